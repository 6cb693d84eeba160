"""asyncrl.cluster: which learner node gets torchrun's node rank 0 (the sbatch script's decision)."""

from __future__ import annotations

import pytest

from asyncrl.cluster import ClusterError, main, node_rank, torchrun_rendezvous


def test_rank_is_the_place_in_the_learner_list_not_the_name_order():
    # c10d would order these by name (a-node first); the addresses point at the list's first
    nodes = ["zeta-07", "alpha-03"]
    assert node_rank("zeta-07", nodes) == 0
    assert node_rank("alpha-03", nodes) == 1


def test_a_fqdn_matches_a_short_slurm_name_and_the_reverse():
    assert node_rank("gpu-b.cluster.local", ["gpu-a", "gpu-b"]) == 1
    assert node_rank("gpu-a", ["gpu-a.cluster.local", "gpu-b.cluster.local"]) == 0


def test_an_exact_name_wins_over_a_short_name_match():
    assert node_rank("gpu-a.two", ["gpu-a.one", "gpu-a.two"]) == 1


def test_unknown_or_ambiguous_node_is_an_error_naming_it():
    with pytest.raises(ClusterError, match="'gpu-z' is not one of the learner nodes gpu-a,gpu-b"):
        node_rank("gpu-z", ["gpu-a", "gpu-b"])
    with pytest.raises(ClusterError, match="matches several"):
        node_rank("gpu-a", ["gpu-a.one", "gpu-a.two"])


def test_static_rendezvous_flags_put_the_master_on_the_first_node():
    assert torchrun_rendezvous("n1", ["n0", "n1", "n2"], 29500) == [
        "--nnodes=3",
        "--node-rank=1",
        "--master-addr=n0",
        "--master-port=29500",
    ]


def test_command_line(capsys):
    assert main(["n1", "n0,n1", "29500"]) == 0
    assert capsys.readouterr().out.split() == [
        "--nnodes=2",
        "--node-rank=1",
        "--master-addr=n0",
        "--master-port=29500",
    ]
    assert main(["n9", "n0,n1", "29500"]) == 2
    assert "not one of" in capsys.readouterr().err

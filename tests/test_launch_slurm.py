"""tools/slurm/asyncrl.sbatch in dry-run mode: the commands it would give SLURM (no cluster here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools/slurm/asyncrl.sbatch"


def _dry_run(nodes: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    bin_dir = str(Path(sys.executable).parent)
    e = dict(os.environ, DRY_RUN="1", NODES=nodes, PATH=f"{bin_dir}:{os.environ['PATH']}", **env)
    e["ASYNCRL"] = str(Path(bin_dir) / "asyncrl")
    return subprocess.run(
        ["bash", str(SCRIPT), str(ROOT / "recipes/multinode.yaml"), *args],
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _argv(line: str) -> list[str]:
    """The argv of a printed (%q-quoted) command line, decoded by bash itself."""
    out = subprocess.run(
        ["bash", "-c", "printf '%s\\0' " + line], capture_output=True, text=True, check=True
    ).stdout
    return out.split("\0")[:-1]


def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_learner_nodes_run_torchrun_and_generator_nodes_run_servers_and_a_worker():
    p = _dry_run("n0 n1 n2 n3 n4", "run.steps=5")
    assert p.returncode == 0, p.stderr
    lines = [_argv(x) for x in p.stdout.splitlines() if x.startswith("srun ")]
    (learner,) = [x for x in lines if "torchrun" in x[-1]]
    gens = [x for x in lines if "torchrun" not in x[-1]]
    assert "--nodelist=n0,n1" in learner
    # each learner node's launcher, as that node runs it: a static rendezvous with rank 0 on n0,
    # where the buffer, version and weight-group addresses point, whatever the names' order
    for node, rank in (("n1", 1), ("n0", 0)):
        torchrun = _torchrun_argv(learner[-1], SLURMD_NODENAME=node)
        assert torchrun[:4] == [
            "--nnodes=2",
            f"--node-rank={rank}",
            "--master-addr=n0",
            "--master-port=29500",
        ]
        assert "--nproc-per-node=8" in torchrun and "c10d" not in " ".join(torchrun)
        for want in (
            "buffer.address=tls+tcp://n0:29600",
            "weights.master_addr=n0",
            "learner.ranks=16",
        ):
            assert want in torchrun
        assert torchrun[-1] == "run.steps=5"  # the user's overrides come last and win
    nodelists = [next(a for a in g if a.startswith("--nodelist=")) for g in gens]
    assert sorted(nodelists) == ["--nodelist=n2", "--nodelist=n3", "--nodelist=n4"]
    inner = gens[0][-1]
    subprocess.run(["bash", "-n", "-c", inner], check=True)
    assert "sglang.launch_server" in inner and "--tp 2" in inner
    # the recipe's pause_mode is in_place: its servers run without the radix cache
    assert "--disable-radix-cache" in inner
    # the workers take the addresses the learner writes once it listens, not a guess; the last
    # job's file is removed before the learner starts
    learner_file = "/nfs/asyncrl/runs/multinode_qwen3_8b_gsm8k/learner.json"
    assert "rollout" in inner and f"--learner-file {learner_file}" in inner
    assert "--buffer" not in inner
    out = p.stdout.splitlines()
    rm = out.index(f"rm -f {learner_file} ")
    assert rm < min(i for i, x in enumerate(out) if x.startswith("srun "))
    # one worker id and one prompt shard per generator node: no prompt generated twice
    ids = sorted(re.search(r"--worker-id (\S+) --shard (\S+)", g[-1]).groups() for g in gens)
    assert ids == [("gen0", "0/3"), ("gen1", "1/3"), ("gen2", "2/3")]


def _launcher(script: str, **env: str) -> subprocess.CompletedProcess:
    """Run a learner node's ``bash -c`` script with ``torchrun`` replaced by a stand-in that prints
    its arguments: the real asyncrl.cluster picks the node rank."""
    with tempfile.TemporaryDirectory() as d:
        fake = Path(d) / "torchrun"
        fake.write_text("#!/bin/bash\nprintf '%s\\0' \"$@\"\n")
        fake.chmod(0o755)
        bin_dir = str(Path(sys.executable).parent)
        e = dict(os.environ, PATH=f"{d}:{bin_dir}:{os.environ['PATH']}", **env)
        return subprocess.run(["bash", "-c", script], env=e, capture_output=True, text=True)


def _torchrun_argv(script: str, **env: str) -> list[str]:
    out = _launcher(script, **env)
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\0")[:-1]


def test_a_node_outside_the_learner_list_does_not_start_torchrun():
    p = _dry_run("n0 n1 n2")
    (learner,) = [_argv(x) for x in p.stdout.splitlines() if "torchrun" in x]
    out = _launcher(learner[-1], SLURMD_NODENAME="n7")
    assert out.returncode != 0 and out.stdout == ""  # the stand-in torchrun never ran
    assert "node 'n7' is not one of the learner nodes n0,n1" in out.stderr


def test_retract_servers_keep_the_radix_cache():
    p = _dry_run("n0 n1 n2", "weights.pause_mode=retract")
    assert p.returncode == 0, p.stderr
    (gen,) = [_argv(x) for x in p.stdout.splitlines() if "sglang.launch_server" in x]
    assert "sglang.launch_server" in gen[-1] and "--disable-radix-cache" not in gen[-1]


def test_too_few_nodes_is_a_clear_error():
    p = _dry_run("n0 n1")
    assert p.returncode == 2 and "need more than LEARNER_NODES=2 nodes" in p.stderr


def test_a_bad_override_fails_before_any_srun():
    p = _dry_run("n0 n1 n2", "buffer.max_staleness=-1")
    assert p.returncode != 0 and "buffer.max_staleness" in p.stderr
    assert "srun" not in p.stdout

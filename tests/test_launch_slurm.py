"""tools/slurm/asyncrl.sbatch in dry-run mode: the commands it would give SLURM (no cluster here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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
    (learner,) = [x for x in lines if "torchrun" in x]
    gens = [x for x in lines if "torchrun" not in x]
    assert "--nodelist=n0,n1" in learner and "torchrun" in learner
    assert "--rdzv-endpoint=n0:29500" in learner and "--nproc-per-node=8" in learner
    for want in ("buffer.address=tls+tcp://n0:29600", "weights.master_addr=n0", "learner.ranks=16"):
        assert want in learner
    assert learner[-1] == "run.steps=5"  # the user's overrides come last and win
    nodelists = [next(a for a in g if a.startswith("--nodelist=")) for g in gens]
    assert sorted(nodelists) == ["--nodelist=n2", "--nodelist=n3", "--nodelist=n4"]
    inner = gens[0][-1]
    subprocess.run(["bash", "-n", "-c", inner], check=True)
    assert "sglang.launch_server" in inner and "--tp 2" in inner
    # the workers take the addresses the learner writes once it listens, not a guess; the last
    # job's file is removed before the learner starts
    learner_file = "/shared/asyncrl/runs/multinode_qwen3_8b_gsm8k/learner.json"
    assert "rollout" in inner and f"--learner-file {learner_file}" in inner
    assert "--buffer" not in inner
    out = p.stdout.splitlines()
    rm = out.index(f"rm -f {learner_file} ")
    assert rm < min(i for i, x in enumerate(out) if x.startswith("srun "))
    # one worker id and one prompt shard per generator node: no prompt generated twice
    ids = sorted(re.search(r"--worker-id (\S+) --shard (\S+)", g[-1]).groups() for g in gens)
    assert ids == [("gen0", "0/3"), ("gen1", "1/3"), ("gen2", "2/3")]


def test_too_few_nodes_is_a_clear_error():
    p = _dry_run("n0 n1")
    assert p.returncode == 2 and "need more than LEARNER_NODES=2 nodes" in p.stderr


def test_a_bad_override_fails_before_any_srun():
    p = _dry_run("n0 n1 n2", "buffer.max_staleness=-1")
    assert p.returncode != 0 and "buffer.max_staleness" in p.stderr
    assert "srun" not in p.stdout

"""The benchmarks in tools/bench/ run, and print the JSON line BENCHMARKS.md reads.

The benchmarks are run by hand (their figures go to BENCHMARKS.md), so nothing else notices when a
refactor breaks one. Those that measure in seconds run here at a tiny size, and their last line is
checked; the rest need an engine, a model or whole RL runs (minutes at any size), so for them
``--help`` exercises everything up to the measurement: imports and options.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"

# name -> the smallest run that still goes through every phase
TINY = {
    "buffer": [
        *("--clients", "1", "--groups", "16", "--put-batch", "2", "--lease", "4"),
        *("--samples", "1", "--prompt", "4", "--tokens", "8", "--batch", "4", "--eta", "0"),
    ],
    "wire_breakdown": ["--messages", "4", "--repeat", "1"],
}
HELP_ONLY = sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in TINY)


def _run(name: str, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def _last_json(r: subprocess.CompletedProcess) -> dict:
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_buffer_bench_moves_every_group_within_the_bound() -> None:
    out = _last_json(_run("buffer", *TINY["buffer"]))
    assert out["bench"] == "buffer" and out["clients"] == 1 and out["put_batch"] == 2
    assert out["rejected_groups"] == 0 and out["staleness_max"] == 0  # --eta 0
    assert out["groups_per_s"] > 0 and out["raw_groups_per_s"] > 0
    assert out["ratio_vs_raw"] == pytest.approx(out["groups_per_s"] / out["raw_groups_per_s"], 0.01)
    assert 0 < out["put_p50_ms"] <= out["put_p99_ms"]


def test_wire_breakdown_bench_reports_every_phase() -> None:
    out = _last_json(_run("wire_breakdown", *TINY["wire_breakdown"]))
    assert out["bench"] == "wire_breakdown"
    for phase in ("raw", "full", "cached-encode", "cached-both", "copy-only", "copy-only-cached"):
        assert out[f"{phase}_us"] > 0
        busy = out[f"{phase}_cores_busy"]
        assert len(busy) <= 2 and all(0.0 <= b <= 1.0 for b in busy)  # none without /proc/stat


@pytest.mark.slow
def test_weights_ipc_bench_times_both_ways() -> None:
    """``weights.py --ipc`` at a tiny size: two engines, gloo and handles side by side, each
    version checked (the bench asserts every report, and the last one's checksums)."""
    out = _last_json(_run("weights", "--ipc", "--hidden", "64", "--layers", "1", "--repeat", "2"))
    assert out["bench"] == "weights_ipc" and out["bytes"] > 0
    assert out["gloo_sync_s"] > 0 and out["ipc_sync_s"] > 0 and out["ipc_speedup"] > 0


def test_tree_cpu_counts_a_grandchild_that_computes_and_not_one_that_sleeps() -> None:
    """``tree_cpu.py`` adds up every descendant's CPU seconds: a grandchild that spins for ~2 s
    (under a shell that only waits) is counted; a tree that only sleeps is not."""
    spin = f"{sys.executable} -c 'import time; t = time.process_time(); exec(\"while time.process_time() - t < 2: pass\")'"
    busy = _last_json(_run("tree_cpu", "--", "bash", "-c", f"{spin} & wait"))
    assert busy["bench"] == "tree_cpu" and busy["rc"] == 0
    assert 1.0 <= busy["cpu_s"] <= busy["wall_s"] + 0.5
    idle = _last_json(_run("tree_cpu", "--", "bash", "-c", "sleep 2 & wait"))
    assert idle["wall_s"] >= 2.0 and idle["cpu_s"] < 0.5 and idle["cores"] < 0.25


@pytest.mark.parametrize("name", HELP_ONLY)
def test_bench_starts(name: str) -> None:
    r = _run(name, "--help")
    assert "usage:" in r.stdout


def test_trl_side_scores_as_asyncrl_exact_match() -> None:
    """vs_trl's TRL side rewards what asyncrl's exact_match does: the bench compares one task."""
    import importlib.util

    from asyncrl import tasks
    from asyncrl.rewards import exact_match

    spec = importlib.util.spec_from_file_location("trl_grpo", BENCH / "trl_grpo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    eos = 1
    trl_reward = mod.exact_match_reward(tasks.score, eos)
    # (completion text, its ids as TRL passes them: up to and including EOS if it stopped, answer)
    cases = [
        ("abcd", [5, 6, 7, 8, eos], "abcd"),  # right, stopped
        (" abcd ", [4, 5, 6, 7, 8, 4, eos], "abcd"),  # right, whitespace around
        ("abcd", [5, 6, 7, 8], "abcd"),  # right text, cut by the token limit
        ("abdc", [5, 6, 8, 7, eos], "abcd"),  # wrong, stopped
        ("", [eos], "abcd"),  # empty
    ]
    ours = [
        exact_match(
            "p", text, [], ids, answer=ans, finish_reason="stop" if ids[-1] == eos else "length"
        )
        for text, ids, ans in cases
    ]
    theirs = trl_reward(
        prompts=["p"] * len(cases),
        completions=[c[0] for c in cases],
        completion_ids=[c[1] for c in cases],
        answer=[c[2] for c in cases],
        trainer_state=None,
    )
    assert theirs == ours == [1.0, 1.0, 0.0, 0.0, 0.0]


def _metrics(run: Path, rows: list[dict]) -> None:
    run.mkdir(parents=True)
    lines = [{"process": "learner", "time": 10.0 + s, **r} for s, r in enumerate(rows)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_staleness_effects_reads_each_versions_reward_and_the_early_arrivals_advantage(tmp_path):
    """Runs written as the learner writes them: on-policy, whose version v draws 0.02 v, and an
    asynchronous run whose policy is as good per version (its batches lag by 1 or 2 versions),
    where the groups of a version that trained at staleness 1 did 0.1 better than those at 2. The
    tool reads each version's reward back through the lag, says the lag alone explains it, and
    finds the early arrivals' advantage."""
    steps = 30

    def reward(v: int) -> float:
        return 0.02 * max(v, 0)

    on = [
        {"step": t, "learner/reward_mean": reward(t - 1), "buffer/staleness_mean": 0.0}
        | {"staleness_hist/0": 4, "staleness/reward_mean/0": reward(t - 1)}
        | {"staleness/tokens/0": 40, "staleness/ess/0": 1.0, "loss/ess": 1.0}
        for t in range(1, steps + 1)
    ]
    late = []
    for t in range(1, steps + 1):
        v = t - 1
        r1, r2 = reward(v - 1) + 0.1, reward(v - 2) - 0.1
        late.append(
            {"step": t, "learner/reward_mean": (r1 + r2) / 2, "buffer/staleness_mean": 1.5}
            | {"staleness_hist/1": 2, "staleness/reward_mean/1": r1, "staleness/tokens/1": 20}
            | {"staleness_hist/2": 2, "staleness/reward_mean/2": r2, "staleness/tokens/2": 20}
            | {"staleness/ess/1": 0.9, "staleness/ess/2": 0.6, "loss/ess": 0.7}
        )
    for i in range(2):
        _metrics(tmp_path / f"p_on_{i}", on)
        _metrics(tmp_path / f"p_late_{i}", late)
    r = _run(
        "staleness_effects",
        *("--runs-dir", str(tmp_path), "--prefix", "p", "--conditions", "on,late", "--ref", "on"),
    )
    assert (tmp_path / "staleness_effects.png").stat().st_size > 0
    out = json.loads((tmp_path / "staleness_effects.json").read_text())
    d = out["conditions"]["late"]
    # version v's groups trained at steps v + 1 and v + 2: their mean is 0.02 v again
    assert d["version_reward"][5:25] == pytest.approx([reward(v) for v in range(5, 25)])
    assert d["selection"] == pytest.approx({"1": 0.1, "2": -0.1})
    assert d["per_k"]["ess"] == {"1": 0.9, "2": 0.6} and d["ess_median"] == 0.7
    assert d["dropped_frac"] == 0.0
    # a constant gain per step: the lag costs nothing, and the model says so
    assert (
        d["delay_model_tail"]
        == pytest.approx(d["ref_tail"])
        == pytest.approx(d["version_reward_tail"])
    )
    assert "late" in r.stdout and "plot:" in r.stdout


@pytest.mark.parametrize(
    ("args", "names"),
    [(["--set", "learner.lr"], "--set: expected KEY=VALUE"), (["--label", "a/b"], "--label")],
)
def test_spread_refuses_a_variant_it_cannot_name(args: list[str], names: str) -> None:
    """A variant's overrides must parse and its label becomes part of run folders' names, so a bad
    one is refused before any run starts."""
    r = subprocess.run(
        [sys.executable, str(BENCH / "spread.py"), "--conditions", "onpolicy", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and names in r.stderr and "Traceback" not in r.stderr


def test_spread_pins_the_algorithm_its_earlier_figures_ran() -> None:
    """demo.yaml's π_prox is the staleness anchor since Session 24; a hard-start condition that
    does not name it still recomputes π_prox, so Sessions 22 and 23's commands reproduce their
    figures, while ``--set`` (last) overrides everything and the demo's own conditions take
    demo.yaml as it is."""
    from tools.bench.spread import recipe_overrides

    assert recipe_overrides("eta4-wait", 3) == [
        "run.seed=3",
        "algorithm.prox_anchor=recompute",
        "buffer.max_staleness=4",
        "buffer.max_batches_ahead=0",
    ]
    anchored = recipe_overrides("wait-anchor", 3)
    assert "algorithm.prox_anchor=staleness" in anchored
    assert "algorithm.prox_anchor=recompute" not in anchored
    variant = recipe_overrides("eta4", 0, ("algorithm.prox_anchor=staleness",))
    assert variant[-1] == "algorithm.prox_anchor=staleness"
    assert recipe_overrides("async-seeds", 2) == ["run.seed=2"]

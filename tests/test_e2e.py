"""End to end: `asyncrl run` with real processes (learner, buffer, rollout worker, built-in engine).

Each test builds the demo's tiny model and a small data set in a temporary folder, runs the recipe
with overrides that keep it to a few steps, and checks what a user gets: the run folder, summary.json,
metrics.jsonl, the W&B offline run read back, plots, and no process left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl import launch, metric_names, metrics
from tests.module_hook import sitecustomize
from tests.numerics import GRAD_RTOL

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


SUMMARY_KEYS = {
    "name",
    "run_dir",
    "outcome",
    "steps",
    "reward_start",
    "reward_end",
    "reward_gain",
    "max_staleness_seen",
    "max_staleness_allowed",
    "wall_seconds",
    "train_seconds",
    "train_steps_timed",
    "trained_tokens",
    "trained_tokens_per_s",
    "algorithm",
    "restarts",
    "buffer_status",
    "plots",
}
"""summary.json's fields, whether `asyncrl run` or `asyncrl learner` alone ended the run."""


def _paths(demo: Path, model: Path | None = None) -> list[str]:
    return [
        f"model.path={model or demo / 'model'}",
        f"data.path={demo / 'data/train.jsonl'}",
        f"data.eval_path={demo / 'data/eval.jsonl'}",
    ]


def _steps(run_dir: Path) -> list[dict]:
    """The learner's per-step records (the learner process also logs weight-sync lines)."""
    return [r for r in metrics.read_metrics(run_dir, process="learner") if "loss" in r]


def _pgroup_alive(pgid: int) -> bool:
    """Is any process of process group ``pgid`` still running (zombies excluded)?"""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def _no_children_left(run_dir: Path) -> None:
    pids = json.loads((run_dir / "logs/pids.json").read_text())
    assert pids, "the launcher recorded no children"
    alive = {name: pid for name, pid in pids.items() if _pgroup_alive(pid)}
    assert not alive, f"process groups still running: {alive}"


def test_sft_run_leaves_a_complete_run_folder(tmp_path, demo_dir):
    steps = 12
    ov = [
        *_paths(demo_dir),
        f"run.output_dir={tmp_path}",
        f"run.steps={steps}",
        "run.eval_prompts=32",
    ]
    s = launch.run(ROOT / "recipes/demo_sft.yaml", ov, progress=False)
    run_dir = tmp_path / "demo_sft"
    assert s["outcome"] == "completed" and s["steps"] == steps
    on_disk = json.loads((run_dir / "summary.json").read_text())
    for key in ("steps", "reward_start", "reward_end", "max_staleness_allowed", "wall_seconds"):
        assert key in on_disk
    assert on_disk["trained_tokens_per_s"] > 0
    assert 0.0 <= on_disk["reward_start"] <= 1.0 and 0.0 <= on_disk["reward_end"] <= 1.0
    learner = _steps(run_dir)
    assert [r["step"] for r in learner] == list(range(1, steps + 1))
    assert all(r["loss"] > 0 for r in learner)
    assert learner[-1]["loss"] < learner[0]["loss"]  # the SFT loss goes down
    # W&B offline run: the same steps and losses as the JSONL
    (wb,) = [w for w in metrics.read_wandb_offline(run_dir) if w["job_type"] == "learner"]
    hist = [h for h in wb["history"] if "loss" in h]
    assert [h["step"] for h in hist] == list(range(1, steps + 1))
    assert hist[-1]["loss"] == pytest.approx(learner[-1]["loss"])
    assert (run_dir / "hf/latest/config.json").is_file()
    assert (run_dir / "plots/learning.png").is_file()
    _no_children_left(run_dir)


def _checkpoints(run_dir: Path) -> list[int]:
    """Complete DCP checkpoints (their .metadata is written last)."""
    return sorted(
        int(p.parent.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*/.metadata")
    )


def _wait_for(cond, timeout_s: float, what: str, logs: Path | None = None) -> None:
    """Poll ``cond`` until true; on a timeout, the tails of the run's logs under ``logs`` (a run
    folder) go into the error, so a standstill in CI can be read without rerunning it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    tails = "".join(
        f"\n--- {p.name} (tail) ---\n{p.read_text(errors='replace')[-4000:]}"
        for p in sorted((logs / "logs").glob("*.log") if logs is not None else [])
    )
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{tails}")


def _ctrl_c_then_resume(tmp_path: Path, recipe: Path, ov: list[str], name: str) -> None:
    run_dir = tmp_path / name
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", str(recipe), *ov, "--no-progress"]
    # its own session, so SIGINT reaches the launcher alone, as Ctrl-C in a terminal does
    p = subprocess.Popen(
        cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for(
            lambda: len(_checkpoints(run_dir)) >= 2 or p.poll() is not None,
            600,
            "two checkpoints",
        )
        assert p.poll() is None, p.communicate()[1][-3000:]
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "stopped (SIGINT)"
    _no_children_left(run_dir)
    saved = _checkpoints(run_dir)[-1]
    # resume: the learner continues from the last complete checkpoint, not from scratch
    n_before = len(_steps(run_dir))
    s = launch.run(recipe, [*ov, "run.resume=true", f"run.steps={saved + 2}"], progress=False)
    assert s["outcome"] == "completed" and s["steps"] == saved + 2
    steps = [r["step"] for r in _steps(run_dir)]
    assert steps[n_before:] == [saved + 1, saved + 2]
    _no_children_left(run_dir)


def test_ctrl_c_stops_the_sft_run_and_it_resumes(tmp_path, demo_dir):
    ov = [
        *_paths(demo_dir),
        f"run.output_dir={tmp_path}",
        "run.steps=100000",
        "run.eval_prompts=16",
        "learner.checkpoint_every=2",
        "learner.checkpoint_async=false",
    ]
    _ctrl_c_then_resume(tmp_path, ROOT / "recipes/demo_sft.yaml", ov, "demo_sft")


# --------------------------------------------------------------------------------------------------
# Reinforcement learning: learner + buffer + rollout worker + built-in engine
# --------------------------------------------------------------------------------------------------

# A reward with signal even for an untrained model: the share of lower-case letters in the completion.
REWARD_MODULE = """
def letters(prompt, completion, prompt_ids, completion_ids, **row):
    return sum(c.islower() for c in completion) / max(len(completion), 1)
"""

# Records every batch the learner trains on, by wrapping asyncrl.learner.source.broadcast_batch when
# the learner imports it (a sitecustomize on PYTHONPATH; the learner's code is not changed). The batch
# is the real one, encoded with the learner's own codec.
RECORDER = sitecustomize(
    "asyncrl.learner.source",
    """
    out = os.environ["ASYNCRL_TEST_RECORD_BATCHES"]
    real = module.broadcast_batch

    def recording(source, **kw):
        batch = real(source, **kw)
        if not isinstance(batch, module.Batch):  # a stop or publish signal, not data
            return batch
        n = len(os.listdir(out))
        with open(os.path.join(out, "batch-%05d.bin" % n), "wb") as f:
            f.write(module.encode_batch(batch))
        return batch

    module.broadcast_batch = recording
    """,
    when='os.environ.get("ASYNCRL_TEST_RECORD_BATCHES")',
)


@pytest.fixture()
def plugin_path(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "plugins"
    d.mkdir()
    (d / "e2e_reward.py").write_text(REWARD_MODULE)
    (d / "sitecustomize.py").write_text(RECORDER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(d), os.environ.get("PYTHONPATH", "")]))
    return d


def _rl_overrides(demo: Path, out: Path, *extra: str) -> list[str]:
    return [
        *_paths(demo),
        f"run.output_dir={out}",
        "run.eval_prompts=16",
        "rollout.group_size=4",
        "rollout.max_concurrent_groups=8",
        "rollout.reward=e2e_reward:letters",
        "buffer.groups_per_batch=2",
        "buffer.dynamic_sampling=false",
        "learner.checkpoint_every=0",
        "generator.max_batch_size=16",
        *extra,
    ]


def test_rl_run_bounds_staleness_and_logs_it(tmp_path, demo_dir, plugin_path):
    eta, steps = 2, 8
    ov = _rl_overrides(
        demo_dir, tmp_path, f"run.steps={steps}", f"buffer.max_staleness={eta}", "run.eval_every=4"
    )
    s = launch.run(ROOT / "recipes/demo.yaml", ov, progress=False)
    run_dir = tmp_path / "demo"
    assert s["outcome"] == "completed", (run_dir / "logs/learner.log").read_text()[-3000:]
    assert s["steps"] == steps and s["max_staleness_allowed"] == eta
    assert set(s) == SUMMARY_KEYS and s == json.loads((run_dir / "summary.json").read_text())
    assert s["max_staleness_seen"] is not None and s["max_staleness_seen"] <= eta
    # the staleness metrics (docs/design.md §8), as W&B shows them (the offline run read back)
    runs = metrics.read_wandb_offline(run_dir)
    (learner,) = [w for w in runs if w["job_type"] == "learner"]
    rows = [h for h in learner["history"] if "buffer/staleness_max" in h]
    assert [h["step"] for h in rows] == list(range(1, steps + 1))
    assert all(0 <= h["buffer/staleness_max"] <= eta for h in rows)
    assert all(h["buffer/staleness_mean"] <= h["buffer/staleness_max"] for h in rows)
    assert all("drift/tokens/0" in h for h in rows)  # trained tokens per staleness bucket
    # the staleness view: every step, in W&B too, and its plot (README "Are old samples teaching?")
    view = (
        metric_names.STALENESS_TOKENS,
        metric_names.STALENESS_ESS,
        metric_names.STALENESS_REWARD,
    )
    assert all(any(k.startswith(p) for k in h) for h in rows for p in view)
    assert all(f"{metric_names.STALENESS_TOKENS}{eta}" in h for h in rows)  # every k, zeros too
    assert (run_dir / "plots/by_staleness.png").is_file()
    assert any(w["job_type"].startswith("worker") for w in runs)  # the rollout worker's run
    assert (run_dir / "plots/staleness.png").is_file() and (run_dir / "plots/reward.png").is_file()
    # held-out evaluation on the generators, at the start, every 4 versions and at the end, each
    # while they held the version evaluated; the summary's rewards are the first and the last
    evals = metrics.read_metrics(run_dir, process="eval")
    assert [e["step"] for e in evals] == [0, 4, 8]
    assert all(e["eval/prompts"] == 16 and e["eval/other_version"] == 0 for e in evals)
    assert s["reward_start"] == evals[0]["eval/success"]
    assert s["reward_end"] == evals[-1]["eval/success"]
    (ev,) = [w for w in runs if w["job_type"] == "eval"]
    assert [h["step"] for h in ev["history"] if "eval/success" in h] == [0, 4, 8]
    # every metric asyncrl reads back (plots, summary, progress) is logged under its name; the
    # drift buckets past staleness 0 only when tokens fall in them
    logged = {k for rec in metrics.read_metrics(run_dir) for k in rec}
    optional = {metric_names.DRIFT_KV_MIXED, metric_names.DRIFT_BY_STALENESS}
    for name in set(metric_names.READ_BY_ASYNCRL) - optional:
        ok = any(k.startswith(name) for k in logged) if name.endswith("/") else name in logged
        assert ok, f"{name} is not logged"
    _no_children_left(run_dir)


def test_one_gpu_recipe_runs_on_a_cpu_host_at_a_tiny_size(tmp_path, demo_dir, plugin_path):
    """recipes/one_gpu.yaml with the demo's model, data and sizes: the learner and its one engine
    (on the CPU here, so weights go over gloo; on a GPU by handle) complete a run, every version
    synced. The memory split it sets is priced by the doctor (tests/test_doctor.py)."""
    steps = 3
    ov = _rl_overrides(
        demo_dir,
        tmp_path,
        f"run.steps={steps}",
        "run.eval_every=0",
        *("model.dtype=float32", "model.max_seq_len=64", "weights.dtype=float32"),
        *("data.prompt_key=prompt", "data.answer_key=answer", "data.chat_template=false"),
        *("rollout.max_new_tokens=8", "learner.lr=3e-4", "learner.micro_batch_tokens=1024"),
        "learner.export_every=0",
    )
    s = launch.run(ROOT / "recipes/one_gpu.yaml", ov, progress=False)
    run_dir = tmp_path / "one_gpu"
    assert s["outcome"] == "completed", (run_dir / "logs/learner.log").read_text()[-3000:]
    assert s["steps"] == steps
    synced = [r for r in metrics.read_metrics(run_dir, process="learner") if "weights/sync_s" in r]
    assert synced and all(r["weights/failed"] == r["weights/dropped"] == 0 for r in synced)
    assert max(r["weights/version"] for r in synced) >= steps - 1
    _no_children_left(run_dir)


@pytest.mark.parametrize("name", ["demo", "demo_ppo"])
def test_eta0_pipeline_matches_a_synchronous_loop_step_for_step(
    tmp_path, demo_dir, plugin_path, monkeypatch, name
):
    """With max_staleness 0 every batch is generated by the current policy, and training on the
    recorded batches in a plain synchronous loop (same init) gives the same losses: GRPO, and PPO
    with a critic (whose value losses match too)."""
    from asyncrl import recipe
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.source import decode_batch
    from asyncrl.learner.trainer import Trainer

    steps = 4
    rec = tmp_path / "batches"
    rec.mkdir()
    monkeypatch.setenv("ASYNCRL_TEST_RECORD_BATCHES", str(rec))
    ov = _rl_overrides(demo_dir, tmp_path, f"run.steps={steps}", "buffer.max_staleness=0")
    s = launch.run(ROOT / f"recipes/{name}.yaml", ov, progress=False)
    assert s["outcome"] == "completed"
    records = _steps(tmp_path / name)
    async_losses = [r["loss"] for r in records]
    critic = name == "demo_ppo"  # PPO with a critic (algorithm.advantage: gae)
    if critic:  # every critic metric asyncrl reads back is logged
        assert all(set(metric_names.READ_WHEN_CRITIC) <= set(r) for r in records)
    batches = [decode_batch(p.read_bytes()) for p in sorted(rec.glob("batch-*.bin"))]
    assert len(batches) == len(async_losses) == steps

    r = recipe.load(ROOT / f"recipes/{name}.yaml", ov)
    assert (r.algorithm.advantage == "gae") == critic
    trainer = Trainer(TrainerConfig.from_recipe(r), run_dir=tmp_path / "sync", checkpointing=False)
    try:
        for v, (batch, loss) in enumerate(zip(batches, async_losses, strict=True)):
            for g in batch.groups:  # on-policy: every token from the weights of version v
                for smp in g.samples:
                    assert set(smp.versions.tolist()) == {v}, (v, smp.versions)
            result = trainer.step(batch)
            assert result.version == v + 1
            # |ℓ_t| = O(1) (|A| ≲ 2, r ≈ 1) and the token weights sum to 1: an absolute bound at
            # that scale (the loss itself can be near 0, so not a relative one)
            assert result.loss == pytest.approx(loss, abs=GRAD_RTOL)
            if critic:
                got = result.metrics[metric_names.VALUE_LOSS]
                assert got == pytest.approx(records[v][metric_names.VALUE_LOSS], abs=GRAD_RTOL)
    finally:
        trainer.close()


def test_remax_run_trains_on_groups_that_carry_their_greedy_baseline(
    tmp_path, demo_dir, plugin_path, monkeypatch
):
    """recipes/demo_remax.yaml, a few steps: every group the learner trained on arrived with the
    reward of its prompt's greedy completion, and the ReMax metrics are logged."""
    from asyncrl.learner.source import decode_batch

    steps = 3
    rec = tmp_path / "batches"
    rec.mkdir()
    monkeypatch.setenv("ASYNCRL_TEST_RECORD_BATCHES", str(rec))
    ov = _rl_overrides(demo_dir, tmp_path, f"run.steps={steps}", "run.eval_every=0")
    s = launch.run(ROOT / "recipes/demo_remax.yaml", ov, progress=False)
    run_dir = tmp_path / "demo_remax"
    assert s["outcome"] == "completed", (run_dir / "logs/learner.log").read_text()[-3000:]
    assert s["steps"] == steps
    batches = [decode_batch(p.read_bytes()) for p in sorted(rec.glob("batch-*.bin"))]
    assert len(batches) == steps
    for batch in batches:
        for g in batch.groups:
            assert isinstance(g.baseline_reward, float), g.metadata
            assert len(g.samples) == 4 and all(not sm.id.endswith("greedy") for sm in g.samples)
    logged = {k for rec in metrics.read_metrics(run_dir) for k in rec}
    assert set(metric_names.READ_WHEN_REMAX) <= logged, set(metric_names.READ_WHEN_REMAX) - logged
    _no_children_left(run_dir)


@pytest.mark.faults  # ~3 min on 2 cores: in `make test-faults`; the sft variant runs by default
def test_ctrl_c_stops_the_rl_run_engines_included_and_it_resumes(tmp_path, demo_dir, plugin_path):
    ov = _rl_overrides(
        demo_dir,
        tmp_path,
        "run.steps=100000",
        "buffer.max_staleness=2",
        "learner.checkpoint_every=2",
        "learner.checkpoint_async=false",
    )
    _ctrl_c_then_resume(tmp_path, ROOT / "recipes/demo.yaml", ov, "demo")


@pytest.mark.faults  # ~2 min on 2 cores: in `make test-faults`
def test_killed_children_are_restarted_and_the_run_completes(tmp_path, demo_dir, plugin_path):
    """kill -9 the rollout worker, then the learner, in one `asyncrl run`: the launcher restarts
    each (the learner from its last checkpoint), the run completes every step, and the summary and
    the launcher's messages say what happened."""
    steps = 24  # enough that the run is still going at the second kill
    ov = _rl_overrides(
        demo_dir,
        tmp_path,
        f"run.steps={steps}",
        "buffer.max_staleness=2",
        "learner.checkpoint_every=2",
        "learner.checkpoint_async=false",
    )
    run_dir = tmp_path / "demo"
    pids_file = run_dir / "logs/pids.json"
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", str(ROOT / "recipes/demo.yaml"), *ov]
    p = subprocess.Popen(
        [*cmd, "--no-progress"],
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def pids() -> dict[str, int]:
        try:
            return json.loads(pids_file.read_text())
        except (OSError, ValueError):  # not written yet, or being rewritten
            return {}

    def trained() -> int:
        return max((r["step"] for r in _steps(run_dir)), default=0)

    def trained_processes() -> set[str]:
        """Which worker processes made the groups trained so far (ids are worker-nonce-n)."""
        audit = run_dir / "buffer/trained.jsonl"
        lines = audit.read_text().splitlines() if audit.exists() else []
        records = [json.loads(x) for x in lines if x.endswith("}")]
        return {g["id"].rsplit("-", 1)[0] for r in records for g in r.get("groups", [])}

    def kill(name: str, when, what: str) -> None:
        _wait_for(lambda: p.poll() is not None or (name in pids() and when()), 600, what, run_dir)
        assert p.poll() is None, p.communicate()[1][-3000:]
        os.kill(pids()[name], signal.SIGKILL)

    try:
        kill("rollout0", lambda: trained() >= 2, "step 2")
        t_kill, first = time.monotonic(), trained_processes()
        # the restarted worker's groups are trained, well within the dead one's lease_seconds
        # (120): whether those leases would have blocked it depends on timing here; the fresh
        # registration that takes them back is checked exactly in tests/buffer/test_service.py
        _wait_for(
            lambda: p.poll() is not None or trained_processes() - first, 90, "new groups", run_dir
        )
        worker_recover_s = time.monotonic() - t_kill
        at = trained()
        kill("learner", lambda: trained() > at and _checkpoints(run_dir), "a checkpoint")
        t_kill, killed_at = time.monotonic(), trained()
        _wait_for(
            lambda: p.poll() is not None or trained() > killed_at, 120, "a step after it", run_dir
        )
        learner_recover_s = time.monotonic() - t_kill
        out, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, err[-3000:]
    assert "rollout0 exited with code -9; restarting it (1 of run.max_restarts=3)" in err
    assert "learner exited with code -9; restarting it (1 of run.max_restarts=3)" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "completed" and summary["steps"] == steps
    assert summary["restarts"] == {"learner": 1, "rollout0": 1}
    done = [r["step"] for r in _steps(run_dir)]
    assert set(done) == set(range(1, steps + 1)) and done[-1] == steps
    after = (run_dir / "logs/learner.log").read_text().split("restart 1 ---", 1)[1]
    resumed = int(after.split("asyncrl learner: resumed at version ", 1)[1].split()[0])
    assert resumed >= 2 and resumed % 2 == 0  # a checkpoint (every 2), not a fresh start
    first_after = len(done) - done[::-1].index(resumed + 1) - 1  # the resumed run's first step
    assert done[first_after:] == list(range(resumed + 1, steps + 1))
    _no_children_left(run_dir)
    sys.path.insert(0, str(ROOT / "tests/faults"))
    from harness import acked_ids, exactly_once, lineage, read_jsonl, report

    # lose nothing across both deaths: every acknowledged group trained once, stored, or named
    survived, _, stored, dropped = lineage(read_jsonl(run_dir / "buffer/trained.jsonl"))
    assert [s["version"] for s in survived] == list(range(1, steps + 1))
    trained_ids = [g["id"] for s in survived for g in s["groups"]]
    audit = exactly_once(acked_ids(run_dir / "audit"), trained_ids, stored, dropped)
    assert audit["lost"] == 0 and audit["duplicated"] == 0, audit
    staleness = [s["trained_at"] - g["min_version"] for s in survived for g in s["groups"]]
    assert max(staleness) <= 2
    report(
        {
            "scenario": "asyncrl run: kill -9 the rollout worker, then the learner",
            "worker_recover_s": round(worker_recover_s, 1),
            "learner_recover_s": round(learner_recover_s, 1),
            "learner_killed_after": killed_at,
            "resumed_at": resumed,
            **audit,
            "staleness_max": max(staleness),
            "steps": steps,
            "seconds": summary["wall_seconds"],
        }
    )


def test_a_dying_child_stops_the_run_and_shows_its_error(tmp_path, demo_dir, plugin_path, capsys):
    """The rollout worker exits at once (its reward function does not exist): the launcher stops
    the learner, prints the worker's last log lines, and reports the run as failed."""
    ov = _rl_overrides(demo_dir, tmp_path, "run.steps=50", "rollout.reward=e2e_reward:nope")
    t0 = time.monotonic()
    s = launch.run(ROOT / "recipes/demo.yaml", ov, progress=False, stop_grace_s=60)
    assert s["outcome"] == "failed" and s["reward_end"] is None
    err = capsys.readouterr().err
    assert "rollout0 exited with code" in err and "nope" in err
    assert time.monotonic() - t0 < 240  # did not wait for the learner's batch timeout
    assert json.loads((tmp_path / "demo/summary.json").read_text())["outcome"] == "failed"
    _no_children_left(tmp_path / "demo")


# --------------------------------------------------------------------------------------------------
# Every token's version is true (issue #17): checked from the engine's side, not from the stamps
# --------------------------------------------------------------------------------------------------


class _Weights:
    """The weights of every version of a run: version 0 is ``model.path``, version k ``hf/v{k}``
    (``learner.export_every: 1``). Models are loaded once each."""

    def __init__(self, base: Path, run_dir: Path):
        self.base, self.run_dir, self._models = base, run_dir, {}

    def path(self, v: int) -> Path:
        return self.base if v == 0 else self.run_dir / "hf" / f"v{v}"

    def model(self, v: int):
        import torch
        from transformers import AutoModelForCausalLM

        if v not in self._models:
            m = AutoModelForCausalLM.from_pretrained(self.path(v), dtype=torch.float32)
            self._models[v] = m.eval()
        return self._models[v]

    def logprobs(self, v: int, prompt: list[int], completion: list[int], temperature: float):
        """log softmax(logits / T) of each completion token under version ``v``'s weights: what an
        engine holding them returns as the behaviour logprob (SGLang 0.5.23, python/sglang/srt/layers/sampler.py), one full forward."""
        import torch

        ids = torch.tensor([list(prompt) + list(completion)])
        with torch.no_grad():
            logits = self.model(v)(ids).logits[0, len(prompt) - 1 : -1].double()
        lp = torch.log_softmax(logits / temperature, -1)
        return lp.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


@pytest.mark.faults  # ~2-3 min on 2 cores: in `make test-faults`
def test_after_a_worker_restart_every_trained_token_carries_its_engines_version(
    tmp_path, demo_dir, plugin_path, monkeypatch
):
    """kill -9 the rollout worker mid-run; `asyncrl run` restarts it and its engine. Every trained
    sample's behaviour logprobs are recomputed with the weights of the version its tokens are
    stamped with (hf/v{k}, exported every step; model.path for 0): a token stamped with a version
    its engine did not hold shows as a gross mismatch, one whose stamp is true as float32 noise.

    Before the fix the restarted worker's engine loaded model.path (version 0) and answered
    ``weight_version "default"`` until the broadcaster reached it, and the client stamped those
    tokens with the learner's version: this test failed, twice out of two runs (24 of 128 trained
    samples stamped v7 were sampled by version 0's weights, |Δ| up to 0.62; the learner's
    ``drift/mismatch_kl`` reached 8.1e-3), within every staleness bound on paper."""
    from asyncrl import recipe
    from asyncrl.learner.source import decode_batch
    from tests.numerics import LOGPROB_ATOL

    steps, eta = 16, 2
    rec = tmp_path / "batches"
    rec.mkdir()
    monkeypatch.setenv("ASYNCRL_TEST_RECORD_BATCHES", str(rec))
    ov = _rl_overrides(
        demo_dir,
        tmp_path,
        f"run.steps={steps}",
        f"buffer.max_staleness={eta}",
        "learner.export_every=1",
    )
    r = recipe.load(ROOT / "recipes/demo.yaml", ov)
    run_dir = tmp_path / "demo"
    pids_file = run_dir / "logs/pids.json"
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", str(ROOT / "recipes/demo.yaml"), *ov]
    p = subprocess.Popen(
        [*cmd, "--no-progress"],
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def pids() -> dict[str, int]:
        try:
            return json.loads(pids_file.read_text())
        except (OSError, ValueError):
            return {}

    def trained() -> int:
        return max((x["step"] for x in _steps(run_dir)), default=0)

    try:
        _wait_for(
            lambda: p.poll() is not None or ("rollout0" in pids() and trained() >= 4), 600, "step 4"
        )
        assert p.poll() is None, p.communicate()[1][-3000:]
        killed_at = trained()
        os.kill(pids()["rollout0"], signal.SIGKILL)
        out, err = p.communicate(timeout=900)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, err[-3000:]
    assert "rollout0 exited with code -9; restarting it" in err

    weights = _Weights(Path(r.resolve(r.model.path)), run_dir)
    temperature = r.rollout.temperature
    batches = [decode_batch(f.read_bytes()) for f in sorted(rec.glob("batch-*.bin"))]
    assert len(batches) == steps
    checked = mixed = 0
    worst = 0.0
    wrong: list[str] = []  # samples whose stamp is not the version of the weights that sampled them
    processes: dict[str, int] = {}
    for batch in batches:
        for g in batch.groups:
            proc = g.id.rsplit("-", 1)[0]
            processes[proc] = processes.get(proc, 0) + len(g.samples)
            for s in g.samples:
                vers = s.versions.tolist()
                k = vers[0]
                # the first span: tokens sampled before any in-flight update, from a KV cache the
                # weights of version k computed alone (later spans' KV mixes two versions)
                n = next((i for i, x in enumerate(vers) if x != k), len(vers))
                mixed += n < len(vers)
                got = s.behavior_logprobs[:n].astype("float64")
                want = weights.logprobs(
                    k, s.prompt_ids.tolist(), s.completion_ids[:n].tolist(), temperature
                ).numpy()
                err_k = float(abs(got - want).max()) if n else 0.0
                checked += 1
                worst = max(worst, err_k)
                if err_k > LOGPROB_ATOL:
                    # which version's weights did sample it? (the nearest one)
                    near = min(
                        range(0, batch.version + 1),
                        key=lambda v: float(
                            abs(
                                got
                                - weights.logprobs(
                                    v,
                                    s.prompt_ids.tolist(),
                                    s.completion_ids[:n].tolist(),
                                    temperature,
                                ).numpy()
                            ).max()
                        ),
                    )
                    wrong.append(
                        f"{s.id} trained at v{batch.version}: stamped v{k}, |Δ| {err_k:.1e}; "
                        f"its logprobs match v{near}'s weights"
                    )
    # the learner's own view: KL(μ ‖ π_prox) on staleness-0 tokens of one-version samples
    kls = [x.get("drift/mismatch_kl") for x in _steps(run_dir)]
    restarted = (run_dir / "logs/rollout0.log").read_text().split("restart 1 ---", 1)[-1]
    m = re.search(r"starting the engines from \S*/(v\d+) \(version \d+\)", restarted)
    sys.path.insert(0, str(ROOT / "tests/faults"))
    from harness import report

    report(
        {
            "scenario": "asyncrl run: kill -9 the rollout worker; versions checked from the weights",
            "killed_at": killed_at,
            "restarted_engines_from": m.group(1) if m else "model.path",
            "samples": checked,
            "spanning_an_update": mixed,
            "samples_per_worker_process": processes,
            "worst_abs_dlogprob": worst,
            "wrong_stamps": len(wrong),
            "mismatch_kl_max": max((kl for kl in kls if kl is not None), default=None),
            "seconds": json.loads((run_dir / "summary.json").read_text())["wall_seconds"],
        }
    )
    assert len(processes) >= 2  # the restarted worker's samples were trained too
    assert not wrong, "\n".join(wrong[:20])
    assert all(kl is None or kl < 1e-4 for kl in kls), kls


def test_rl_run_on_a_reward_model_alone_starts_its_servers_and_evaluates_the_ground_truth(
    tmp_path, demo_dir, plugin_path, monkeypatch, tiny_reward_model
):
    """rollout.reward_model.path: `asyncrl run` starts the /classify server as a supervised child
    before the workers, which score every sample with it (rollout.reward: model, the exact-match
    answer never used); the held-out evaluation scores exact match (rollout.eval_reward); the
    server is stopped with the rest."""
    from asyncrl.learner.source import decode_batch

    steps = 2
    rec = tmp_path / "batches"
    rec.mkdir()
    monkeypatch.setenv("ASYNCRL_TEST_RECORD_BATCHES", str(rec))
    ov = _rl_overrides(
        demo_dir,
        tmp_path,
        f"run.steps={steps}",
        "rollout.reward=model",
        f"rollout.reward_model.path={tiny_reward_model}",
        "rollout.reward_model.input=text",  # another tokenizer than the demo model's
        "rollout.eval_reward=exact_match",
    )
    s = launch.run(ROOT / "recipes/demo.yaml", ov, progress=False)
    run_dir = tmp_path / "demo"
    assert s["outcome"] == "completed", (run_dir / "logs/learner.log").read_text()[-3000:]
    assert "serving" in (run_dir / "logs/reward_model0.log").read_text()
    rm = s["reward_model"]  # not a reward_model run's hf/ export: no accuracy to report
    assert rm["path"] == str(tiny_reward_model) and rm["servers"] == 1
    assert rm["eval_accuracy"] is None and rm["plot"] in s["plots"]
    assert Path(rm["plot"]) == run_dir / "plots/reward_model.png" and Path(rm["plot"]).is_file()
    assert s == json.loads((run_dir / "summary.json").read_text())
    assert "reward_model0" in json.loads((run_dir / "logs/pids.json").read_text())
    rewards = [
        smp.reward
        for p in sorted(rec.glob("batch-*.bin"))
        for g in decode_batch(p.read_bytes()).groups
        for smp in g.samples
    ]
    assert len(rewards) == steps * 2 * 4
    for p in sorted(rec.glob("batch-*.bin")):
        for g in decode_batch(p.read_bytes()).groups:
            assert all("reward_failure" not in smp.metadata for smp in g.samples)
    # the model's scores, not a 0/1 rule: a random head spreads them over a few units
    assert len(set(rewards)) > 2 and any(r not in (0.0, 1.0) for r in rewards)
    evals = metrics.read_metrics(run_dir, process="eval")
    assert [e["step"] for e in evals] == [0, steps]
    for e in evals:  # exact match over 16 prompts: a multiple of 1/16 in [0, 1]
        assert 0 <= e["eval/success"] <= 1 and (e["eval/success"] * 16) % 1 == 0
        assert e["eval/failed"] == 0
    _no_children_left(run_dir)


@pytest.mark.numerics
@pytest.mark.parametrize("ranks", [1, 2])
def test_moe_demo_replays_the_engines_routes_end_to_end(
    tmp_path, tmp_path_factory, plugin_path, monkeypatch, ranks
):
    """recipes/demo_moe.yaml (`make demo-moe`), a few steps at η = 0 on the demo's MoE model: the
    built-in engine returns every sample's experts, they travel to the learner (each trained
    sample carries ``[prompt + completion - 1, 2 MoE layers, top-2]`` expert ids), and the learner,
    which routes with the same weights at staleness 0, agrees with them: a route one position off
    (or another layer's) would agree about as often as a random pair, 1 in 28. summary.json
    reports the agreement and the drift KL.

    On 1 and on 2 learner ranks (FSDP) the engine holds the learner's weights after every sync:
    KL(μ ‖ π) at staleness 0 is float32 rounding, ~1e-13 measured; an engine that kept one stale
    expert (as when the broadcast sent each rank's shard of the experts: docs/moe.md) gave 4e-7
    after one step and 2e-6 after two here, 9e-5 and 3e-4 at the demo's batch size."""
    from asyncrl.learner.source import decode_batch
    from tools.make_demo import make_demo

    demo = make_demo(tmp_path_factory.mktemp("demo_moe"), train=2000, eval=64, arch="qwen3_moe")
    steps = 3
    rec = tmp_path / "batches"
    rec.mkdir()
    monkeypatch.setenv("ASYNCRL_TEST_RECORD_BATCHES", str(rec))
    ov = _rl_overrides(
        demo, tmp_path, f"run.steps={steps}", "buffer.max_staleness=0", f"learner.ranks={ranks}"
    )
    s = launch.run(ROOT / "recipes/demo_moe.yaml", ov, progress=False)
    run_dir = tmp_path / "demo_moe"
    assert s["outcome"] == "completed", (run_dir / "logs/learner.log").read_text()[-3000:]
    batches = [decode_batch(p.read_bytes()) for p in sorted(rec.glob("batch-*.bin"))]
    assert steps <= len(batches) <= steps * ranks  # every rank records the batch it was sent
    for batch in batches:
        for smp in (smp for g in batch.groups for smp in g.samples):
            n = len(smp.prompt_ids) + len(smp.completion_ids) - 1
            assert smp.routed_experts.shape == (n, 2, 2)
            assert int(smp.routed_experts.max()) < 8
            assert (smp.routed_experts[..., 0] != smp.routed_experts[..., 1]).all()
    records = _steps(run_dir)
    agree = [r[metric_names.ROUTING_AGREEMENT] for r in records]
    # float32 on both sides, the same weights: only a near tie (scores equal to rounding) may flip
    assert len(agree) == steps and min(agree) >= 0.99, agree
    mismatch = [r[metric_names.DRIFT_MISMATCH] for r in records]
    assert len(mismatch) == steps and max(mismatch) < 1e-8, mismatch
    assert s["routing_replay"] is True
    assert s["routing_agreement_mean"] == pytest.approx(sum(agree) / steps)
    assert s["drift_kl_mean"] is not None
    assert set(s) == SUMMARY_KEYS | {
        "routing_replay",
        "routing_agreement_mean",
        "routing_agreement_start",
        "routing_agreement_end",
        "drift_kl_mean",
        "mismatch_kl_mean",
    }
    _no_children_left(run_dir)

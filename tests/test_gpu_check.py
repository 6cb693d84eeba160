"""tools/gpu/check.sh, the prepared GPU check: run here with --dry (CPU, tiny sizes, gloo), so that the
one command a GPU session will run has run before, and its records say what each step measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools/gpu/check.sh"
SHIM = ROOT / "tools/gpu/shim"
sys.path.insert(0, str(ROOT))

from tools.gpu import check  # noqa: E402

FIGURES = {
    "env": {
        "torch",
        "device",
        "attention",
        "attention_why",
        "nccl",
        "transformers",
        "torchtitan",
        "pytorch_cuda_alloc_conf",
        "compute_mode",
        "ptrace_scope",
    },
    "learner": {
        "model_s",
        "ac_none",
        "ac_full",
        "best_tokens_per_s",
        "peak_over_plan_range",
        "plan_band",
    },
    "weights": {
        "v1_sync_s",
        "v2_sync_s",
        "v2_checksum_ok",
        "checksum",
        "gb_per_s",
        "engine_device",
        "engine_dtype",
        "backend",
        "generate_tokens",
    },
    "one_gpu": {"eta4", "eta0"},
    "run": {"outcome", "steps", "run_s"},
    "lora": {
        "outcome",
        "steps",
        "run_s",
        "final_export_is_adapter",
        "adapter_bytes",
        "full_model_bytes",
        "weights_bytes_per_sync",
        "teacher_device",
        "teacher_dtype",
        "teacher_logprob_max_abs_diff",
        "teacher_tolerance",
        "teacher_s",
    },
    "engine": {
        "engine_cpu_fp32_tok_s",
        "hf_cpu_fp32_tok_s",
        "engine_cpu_over_hf_cpu",
        "cpu_fp32_prefill_logits_rel_diff",
        "cpu_fp32_rows_equal_to_generate",
        "engine_cpu_fp32_host_ms",
        *(f"engine_cpu_fp32_b{b}_{k}" for b in (2, 4, 8) for k in ("tok_s", "host_ms", "step_ms")),
        "engine_cpu_fp32_b4_over_b2",
    },
    "logprobs": {
        "vocab",
        "chunk_tokens",
        "full_s",
        "chunked_s",
        "full_peak_mib",
        "chunked_peak_mib",
        "logp_max_abs_diff",
        "grad_hidden_rel_diff",
        "grad_head_rel_diff",
        "chunked_by_budget",
    },
    "nccl": {"default_backend", "weight_group_backend", "bounded_wait_ok", "broadcast_intact"},
}
"""What each step must report: the figures docs/gpu.md's results table is filled from."""


def _check(
    results: Path, *args: str, timeout_s: float = 600, **env: str
) -> subprocess.CompletedProcess:
    e = dict(os.environ, ASYNCRL_CHECK_PYTHON=sys.executable) | env
    return subprocess.run(
        ["bash", str(SCRIPT), str(results), *args],
        env=e,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _records(results: Path) -> list[dict]:
    return [json.loads(x) for x in (results / "check.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(1700)
def test_dry_check_runs_every_step_and_records_its_figures(tmp_path):
    # the budget and limits of a loaded 2-core machine: 480 s and the steps' own limits are the
    # GPU host's, whose steps run faster (CI's one_gpu step once ran out of its 180 s here)
    p = _check(
        tmp_path / "results",
        "--dry",
        ASYNCRL_CHECK_WORK=str(tmp_path / "work"),
        ASYNCRL_CHECK_BUDGET_S="1500",
        ASYNCRL_CHECK_LIMIT_SCALE="3",
        timeout_s=1600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    _assert_plan_printed_first(p.stdout, list(check.STEPS))
    recs = _records(tmp_path / "results")
    assert [r["step"] for r in recs] == list(check.STEPS) == list(FIGURES)
    for r in recs:
        assert r["ok"], f"{r['step']}: {r['error'][-2000:]}"
        missing = FIGURES[r["step"]] - set(r["figures"])
        assert not missing, f"{r['step']} lacks {missing}"
        assert (tmp_path / f"results/logs/{r['step']}.log").exists()
    figs = {r["step"]: r["figures"] for r in recs}
    assert figs["env"]["device"] == "cpu" and figs["env"]["attention"] == "sdpa"
    assert "flex" not in figs["learner"]  # flex runs only when named
    # several chunks, and the chunked path computes what the whole logits do
    lp = figs["logprobs"]
    assert lp["tokens"] // lp["chunk_tokens"] >= 4
    assert lp["logp_max_abs_diff"] < 1e-3 and lp["grad_hidden_rel_diff"] < 1e-2
    # the same updates (two document lengths) as one micro-batch and as two, without and with
    # activation checkpointing: each trained, with its first and steady step, and its plan
    le = figs["learner"]
    for ac in ("none", "full"):
        rows = le[f"ac_{ac}"]
        assert rows["attention"] == "DocSegmentSDPA" and "build" in rows["phases"]
        for doc in (48, 96):
            one, two = rows[f"doc{doc}_mb1"], rows[f"doc{doc}_mb2"]
            assert one["tokens"] == two["tokens"] > 0  # the same update, split in two
            assert one["first_step_s"] > 0 and one["step_s"] > 0 and one["tokens_per_s"] > 0
            assert two["plan_gib"] <= one["plan_gib"]
    assert (tmp_path / "results/work/profile_none.txt").read_text().count("\n") > 10
    assert figs["weights"]["v1_checksum_ok"] is True and figs["weights"]["v2_updated"] is True
    # --dry hides the GPU: the engine a run starts (device auto) is on the CPU in float32, gloo
    w = figs["weights"]
    assert (w["engine_device"], w["engine_dtype"], w["backend"]) == ("cpu", "float32", "gloo")
    assert figs["engine"]["cpu_fp32_rows_equal_to_generate"] == 1.0
    assert figs["run"]["outcome"] == "completed" and figs["run"]["steps"] == 3
    # one_gpu.yaml, asynchronous and synchronous: both complete, every version synced
    for eta in ("eta4", "eta0"):
        one = figs["one_gpu"][eta]
        assert one["outcome"] == "completed" and one["sync_failed"] == 0 and one["steps_per_s"] > 0
    # LoRA: each version sends the adapters' bytes, not the model's; the final export is PEFT's
    lo = figs["lora"]
    assert lo["outcome"] == "completed" and lo["steps"] == 3 and lo["final_export_is_adapter"]
    assert lo["weights_bytes_per_sync"] == [lo["adapter_bytes"]]
    assert 0 < lo["adapter_bytes"] < lo["full_model_bytes"]
    # the teacher's logprobs (engine on the CPU in float32 here) are transformers' on those tokens
    assert (lo["teacher_device"], lo["teacher_dtype"]) == ("cpu", "float32")
    assert lo["teacher_logprob_max_abs_diff"] <= lo["teacher_tolerance"] < 1e-3
    assert f"{len(check.STEPS)} of {len(check.STEPS)} records ok" in p.stdout


def _assert_plan_printed_first(stdout: str, steps: list[str]) -> None:
    """check.sh's plan: one line per step, in the order run, before any step's record."""
    lines = stdout.splitlines()
    first_record = next(i for i, x in enumerate(lines) if x.startswith(("[ok  ]", "[FAIL]")))
    planned = [x.split()[2] for x in lines[:first_record] if x.startswith("plan: ") and ". " in x]
    assert planned == steps, lines[: first_record + 1]
    for x in lines[:first_record]:
        if x.startswith("plan: ") and ". " in x:
            assert " expected " in x and " s, limit " in x, x


def test_the_plan_fits_the_window_and_flex_runs_only_by_name():
    """The default steps in the order the window must bring them back, their expected seconds
    within the 480 s budget, each limit at least its expected seconds; flex (and models) only
    when named, env first whatever the order asked."""
    assert check.STEPS == (
        "env",
        "learner",
        "weights",
        "one_gpu",
        "run",
        "lora",
        "engine",
        "logprobs",
        "nccl",
    )
    rows = check.plan([], check.BUDGET_S)
    assert [r["step"] for r in rows] == list(check.STEPS)
    assert sum(r["expected_s"] for r in rows) <= check.BUDGET_S == 480
    assert all(0 < r["expected_s"] <= r["limit_s"] for r in rows)
    assert "flex" not in check.STEPS and "models" not in check.STEPS
    named = check.plan(["lora", "flex", "env"], check.BUDGET_S, scale=3)
    assert [(r["step"], r["by_name"]) for r in named] == [
        ("env", False),
        ("lora", False),
        ("flex", True),
    ]
    assert named[2]["limit_s"] == 3 * check.BY_NAME["flex"].limit
    assert check.plan(["nope"], 480)[1] == {
        "step": "nope",
        "expected_s": 0,
        "limit_s": check.UNKNOWN.limit,
        "by_name": False,
        "known": False,
        "starts_by_s": check.PLAN["env"].expected,
    }


def test_a_step_that_raises_keeps_its_partial_figures(tmp_path):
    """A step's figures survive its exception: what it printed as partial lines, under the
    final line's ``ok: false`` and the error (before: a bare ``{"ok": false}`` hid them). A
    child's partial lines (learner-configs streams into the learner step's log) are not the
    step's."""
    log = tmp_path / "learner.log"
    lines = [
        {"partial": "learner", "phase": "ac_none", "figures": {"ac_none": {"doc1024_mb1": 1}}},
        {"partial": "learner-configs", "phase": "build", "figures": {"params": 5}},
        {"step": "learner", "figures": {"ok": False, "raised": "RuntimeError: boom"}},
    ]
    log.write_text("starting\n" + "".join(json.dumps(x) + "\n" for x in lines))
    rec = check.record(tmp_path, "learner", 1, 3.0, log)
    assert not rec["ok"] and rec["reached"] is None
    assert rec["figures"] == {
        "ac_none": {"doc1024_mb1": 1},
        "ok": False,
        "raised": "RuntimeError: boom",
    }


BOOM = """#!/usr/bin/env bash
# A test fake of the check's python for one step, `boom`, which no real step does on purpose: a
# step that measures one configuration (a phase line) and then raises, run by check.py's own main.
# Every other call is the real interpreter's.
if [ "$2" = boom ]; then
  shift 2
  exec {py} -c '
import sys
sys.path.insert(0, "{root}")
from tools.gpu import check
def boom(work, dry):
    figs = {{"first": {{"tokens_per_s": 123.0}}}}
    check.phase(figs, "first")
    figs["second"] = {{"started": True}}
    raise RuntimeError("the second configuration failed")
check.RUNNERS["boom"] = boom
sys.argv[0] = "check.py"
sys.exit(check.main(["boom", *sys.argv[1:]]))
' "$@"
fi
exec {py} "$@"
"""


def test_check_sh_records_what_a_raising_step_measured(tmp_path):
    """Through check.sh: the raising step's record keeps its first configuration's figures, the
    ones set after its last phase, and the exception; the plan is printed before env."""
    py = tmp_path / "python"
    py.write_text(BOOM.format(py=sys.executable, root=ROOT))
    py.chmod(0o755)
    p = _check(tmp_path / "r", "--dry", "boom", ASYNCRL_CHECK_PYTHON=str(py))
    assert p.returncode == 0, p.stderr
    _assert_plan_printed_first(p.stdout, ["env", "boom"])
    env, boom = _records(tmp_path / "r")
    assert env["ok"] and {"pytorch_cuda_alloc_conf", "ptrace_scope"} <= set(env["figures"])
    assert not boom["ok"] and boom["rc"] == 1 and not boom["timed_out"]
    figs = boom["figures"]
    assert figs["first"] == {"tokens_per_s": 123.0} and figs["second"] == {"started": True}
    assert figs["raised"] == "RuntimeError: the second configuration failed"
    assert "Traceback" in boom["error"]
    assert json.loads((tmp_path / "r/plan.json").read_text())[1]["step"] == "boom"


def test_a_failed_step_is_recorded_with_its_output_and_the_next_one_runs(tmp_path):
    """An unknown step fails (argparse refuses it) and its record carries the output's tail; a step
    that no longer fits the budget is recorded as skipped, not silently dropped."""
    # env under its dry-run bound (60 s x 3: it took 27-45 s on a loaded 2-core machine), and a
    # budget that leaves the unknown step its 20 s whatever env took within that bound
    p = _check(
        tmp_path,
        "--dry",
        "no_such_step",
        "env",
        ASYNCRL_CHECK_BUDGET_S="400",
        ASYNCRL_CHECK_LIMIT_SCALE="3",
    )
    assert p.returncode == 0, p.stderr
    env, bad = _records(tmp_path)  # env first, whatever the order asked
    assert bad["step"] == "no_such_step" and not bad["ok"] and bad["rc"] == 2
    assert "invalid choice" in bad["error"]
    assert env["ok"] and env["figures"]["torch"]

    p = _check(tmp_path / "short", "--dry", "env", ASYNCRL_CHECK_BUDGET_S="5")
    (skipped,) = _records(tmp_path / "short")
    assert skipped["step"] == "env" and not skipped["ok"] and "skipped" in skipped["error"]


HANG = """#!/usr/bin/env bash
# A test fake of the check's python for one step, `hang`, which no real step does on purpose: it
# leaves a grandchild in a session of its own (as `asyncrl run` leaves its children), says which
# phase it reached, and sleeps past its limit. Every other call is the real interpreter's.
if [ "$2" = hang ]; then
  exec {py} -c '
import faulthandler, json, signal, subprocess, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
g = subprocess.Popen(["sleep", "600"], start_new_session=True)
print(json.dumps({{"partial": "hang", "phase": "build", "figures": {{"grandchild": g.pid}}}}), flush=True)
time.sleep(600)
'
fi
exec {py} "$@"
"""


@pytest.mark.slow
def test_a_step_past_its_limit_dumps_its_stacks_keeps_what_it_reached_and_leaves_nothing(tmp_path):
    """check.sh at a step's limit: SIGUSR1 first (the step's Python stacks land in its log), then
    TERM and KILL to every process of the check, whatever its session; the record is timed out
    and holds the figures of the last phase reached."""
    py = tmp_path / "python"
    py.write_text(HANG.format(py=sys.executable))
    py.chmod(0o755)
    # hang's limit is named (hang:25), not what env leaves of a small budget: env runs first, and
    # on a loaded 2-core machine it once took long enough (tens of seconds) that what it left was
    # under the 20 s below which check.sh skips a step, and hang never ran (a soak's one failure)
    p = _check(
        tmp_path / "r",
        "--dry",
        "hang:25",
        ASYNCRL_CHECK_BUDGET_S="600",
        ASYNCRL_CHECK_LIMIT_SCALE="3",  # env's dry-run bound, 180 s (a named limit is not scaled)
        ASYNCRL_CHECK_PYTHON=str(py),
    )
    assert p.returncode == 0, p.stderr
    env, hang = _records(tmp_path / "r")
    assert env["step"] == "env" and env["ok"]  # env runs first even when not asked for
    assert hang["timed_out"] and not hang["ok"] and hang["reached"] == "build"
    assert hang["seconds"] >= 25, hang  # its own limit acted, not the budget
    log = (tmp_path / "r/logs/hang.log").read_text()
    assert "=== hang: limit 25 s" in log
    assert "SIGUSR1" in log and "most recent call first" in log and "line 6 in <module>" in log
    grandchild = hang["figures"]["grandchild"]
    assert (
        not Path(f"/proc/{grandchild}").exists()
        or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split(")")[-1][:3]
    )


def test_the_device_command_packs_the_check_into_one_tarball(tmp_path):
    """tools/gpu/on_device.sh, what a lent-GPU session runs: the records and one tarball of
    everything check.sh wrote under $OUT (the device tool brings back at most 8 files)."""
    import tarfile

    env = dict(os.environ, ASYNCRL_CHECK_PYTHON=sys.executable, OUT=str(tmp_path))
    p = subprocess.run(
        ["bash", str(ROOT / "tools/gpu/on_device.sh"), "--dry", "env"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["check.jsonl", "check.tar.gz"]
    with tarfile.open(tmp_path / "check.tar.gz") as t:
        names = t.getnames()
    assert "check/check.jsonl" in names and "check/logs/env.log" in names
    assert _records(tmp_path)[0]["ok"]


def test_what_a_step_left_running_is_reaped_by_the_checks_tag():
    """A process a step left in a session of its own, carrying the check's tag, is killed between
    steps (check.py reap); one without the tag is not."""
    tag = f"test-{os.getpid()}"
    left = subprocess.Popen(
        ["sleep", "600"], start_new_session=True, env=dict(os.environ, ASYNCRL_CHECK_TAG=tag)
    )
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        assert check.reap(tag) == [f"{left.pid} sleep"]
        assert left.wait(timeout=10) == -9 and other.poll() is None
    finally:
        other.kill()
        left.kill()


def test_a_timed_out_step_is_a_failed_record(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("loading\n" * 5 + "still waiting for the communicator\n")
    rec = check.record(tmp_path, "nccl", 124, 60.0, log)
    assert rec["timed_out"] and not rec["ok"] and rec["figures"] == {}
    assert rec["error"].endswith("still waiting for the communicator\n")
    # a step whose figures say it failed is a failed record even with exit status 0
    log.write_text('{"step": "weights", "figures": {"ok": false, "v2_checksum_ok": false}}\n')
    rec = check.record(tmp_path, "weights", 0, 1.0, log)
    assert not rec["ok"] and rec["figures"]["v2_checksum_ok"] is False
    assert [r["step"] for r in _records(tmp_path)] == ["nccl", "weights"]


def test_the_torch_shim_adds_only_what_torch_lacks():
    """tools/gpu/shim: on this torch (which has DataParallelMeshDims) nothing is patched; a name
    the module lacks is added when the module is first imported, and TorchTitan imports after it."""
    code = (
        "import sitecustomize as s\n"
        "s.MISSING['torch.distributed.fsdp']['_asyncrl_probe'] = s.DataParallelMeshDims\n"
        "import torch.distributed.fsdp as f\n"
        "import asyncrl.learner.trainer\n"
        "assert f._asyncrl_probe(shard='fsdp').shard == 'fsdp'\n"
        "assert f.DataParallelMeshDims is not s.DataParallelMeshDims\n"
        "print(s.PATCHED)\n"
    )
    assert _with_shim(code) == "['torch.distributed.fsdp._asyncrl_probe']"


def _with_shim(code: str) -> str:
    """``code`` in a fresh interpreter with the shim first on its path, as on the GPU host; its
    output."""
    env = dict(os.environ, PYTHONPATH=f"{SHIM}:{ROOT}")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip()


def _shim_module():
    """tools/gpu/shim/sitecustomize.py loaded under another name: its functions without its import
    hook in this process (the hook is installed only by Python's startup import)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_shim", SHIM / "sitecustomize.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def test_the_block_mask_wrapper_stays_out_on_a_torch_with_the_keyword():
    """On this torch (2.13: create_block_mask takes separate_full_blocks) TorchTitan compiles
    torch's own create_block_mask and the shim patches nothing; a process that never imports torch
    does not import it because of the shim."""
    code = (
        "import sys\n"
        "assert 'torch' not in sys.modules, 'the shim imported torch'\n"
        "import sitecustomize as s\n"
        "import asyncrl.learner.trainer\n"
        "import torchtitan.models.common.attention as tt\n"
        "from torch.nn.attention import flex_attention as f\n"
        "assert tt.create_block_mask is f.create_block_mask\n"
        "assert f.create_block_mask.__module__ == 'torch.nn.attention.flex_attention'\n"
        "assert not hasattr(f.create_block_mask, '__wrapped__')\n"
        "print(s.PATCHED)\n"
    )
    assert _with_shim(code) == "[]"


def test_the_block_mask_wrapper_passes_true_through_and_refuses_false():
    """The wrapper against a stand-in for torch 2.11's create_block_mask. A test fake, because
    torch 2.13 (this venv) has the keyword: the stand-in has 2.11's signature (no
    separate_full_blocks) and does what 2.11's does, torch's create_block_mask with full blocks
    kept apart. The wrapper on the lent host's real torch 2.11 runs in tools/gpu/host_env.sh."""
    from torch.nn.attention.flex_attention import create_block_mask

    def torch_2_11_create_block_mask(
        mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False
    ):
        return create_block_mask(
            mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, separate_full_blocks=True
        )

    def causal(b, h, q, kv):
        return q >= kv

    shim = _shim_module()
    assert shim.without_separate_full_blocks(create_block_mask) is None
    wrapped = shim.without_separate_full_blocks(torch_2_11_create_block_mask)
    assert wrapped is not None and wrapped.__wrapped__ is torch_2_11_create_block_mask
    # TorchTitan's call (decoder.py): keywords, separate_full_blocks=True
    m = wrapped(causal, 2, None, 256, 256, device="cpu", BLOCK_SIZE=128, separate_full_blocks=True)
    ref = torch_2_11_create_block_mask(causal, 2, None, 256, 256, device="cpu", BLOCK_SIZE=128)
    assert m.full_kv_num_blocks is not None  # full blocks apart: what True asks for
    assert m.kv_num_blocks.tolist() == ref.kv_num_blocks.tolist() == [[[1, 1]]] * 2
    assert m.full_kv_num_blocks.tolist() == ref.full_kv_num_blocks.tolist() == [[[0, 1]]] * 2
    assert wrapped(causal, 1, 1, 128, 128).full_kv_num_blocks is not None  # keyword left out
    with pytest.raises(NotImplementedError, match=r"separate_full_blocks=False"):
        wrapped(causal, 1, 1, 128, 128, separate_full_blocks=False)


def test_the_forced_attention_reaches_every_learner_the_check_builds(tmp_path, monkeypatch):
    """ASYNCRL_CHECK_ATTENTION (tools/gpu/host_env.sh sets it): the env step names it, the run and
    lora steps' recipes carry it, and learner_configs' Trainer is built with it: flex on this CPU is
    refused by the learner's model build, which shows the value got there. A value that is no
    attention is one line in the step's record."""
    from asyncrl import recipe as recipe_mod

    monkeypatch.setenv("ASYNCRL_CHECK_ATTENTION", "flex")
    env = check.step_env(tmp_path, True)
    assert env["ok"] and env["attention_requested"] == env["attention"] == "flex"
    ov = check.demo_overrides(tmp_path, tmp_path / "runs", steps=3, timeout_s=60)
    for name in ("demo.yaml", "demo_lora.yaml"):
        r = recipe_mod.load(ROOT / "recipes" / name, ov, check_files=False)
        assert r.model.attention == "flex"
    model = check.tiny_model(tmp_path)
    one = [sys.executable, str(ROOT / "tools/gpu/check.py"), "learner-configs", str(tmp_path)]
    out = str(tmp_path / "learner.json")
    p = subprocess.run(
        [*one, str(model), "none", out, "--dry"], capture_output=True, text=True, timeout=300
    )
    assert p.returncode != 0
    assert "model.attention: flex cannot train on CPU" in p.stderr

    p = _check(tmp_path / "bad", "--dry", "env", ASYNCRL_CHECK_ATTENTION="flash")
    (bad,) = _records(tmp_path / "bad")
    assert not bad["ok"] and bad["rc"] == 1
    step_output = [x for x in bad["error"].splitlines() if not x.startswith(("===", "---", "("))]
    assert step_output[0] == (
        "error: ASYNCRL_CHECK_ATTENTION='flash': use one of auto, sdpa, flex, varlen"
    )


REWARD_DISTRIBUTIONS = {
    "exact_match": (),
    "math": ("math-verify", "latex2sympy2_extended", "antlr4-python3-runtime"),  # sympy: torch's
}
"""What each built-in reward imports beyond the GPU host's own packages (torch and its deps)."""


def test_the_bundle_carries_what_the_checks_rewards_import():
    """The host has no math-verify: `one_gpu`'s recipe scores with ``math``, so there every reward
    failed and the step ended with no step trained (`make gpu-host-check`, 2026-12-07). Each
    reward a recipe of the check names is carried, at the version the CPU tier runs."""
    import re
    from importlib.metadata import version

    import yaml

    recipes = sorted(
        set(re.findall(r'"recipes/(\w+\.yaml)"', (ROOT / "tools/gpu/check.py").read_text()))
    )
    assert "one_gpu.yaml" in recipes
    pins = {}
    for line in (ROOT / "tools/gpu/requirements.txt").read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, ver = line.split("==")
            pins[name.strip().lower().replace("_", "-")] = ver.strip()
    for name in recipes:
        reward = yaml.safe_load((ROOT / "recipes" / name).read_text())["rollout"]["reward"]
        assert reward in REWARD_DISTRIBUTIONS, f"{name}: reward {reward!r}: say what it imports"
        for dist in REWARD_DISTRIBUTIONS[reward]:
            key = dist.lower().replace("_", "-")
            assert pins.get(key) == version(dist), f"{name} ({reward}): {dist} not pinned as here"

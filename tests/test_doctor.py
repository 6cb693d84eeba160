"""`asyncrl doctor`: its checks on this machine, its memory verdicts and fixes, the SGLang server
checks against a real HTTP server (the built-in engine), and NCCL's settings and versions."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import trustme

from asyncrl import gpu
from asyncrl import recipe as recipe_mod
from asyncrl.doctor import (
    Check,
    Device,
    Doctor,
    check_device,
    check_generator_memory,
    check_generators,
    check_learner_memory,
    check_logprobs,
    check_model,
    check_nccl,
    check_placement,
    check_ports,
    check_tls,
    judge_logprobs,
)
from asyncrl.memory import GiB, gib
from tests.labels import get_label
from tests.ports import refused_url, unlistened_port
from tests.test_memory_plan import QWEN3_0_6B, QWEN3_8B

ROOT = Path(__file__).resolve().parents[1]
ASYNCRL = [sys.executable, "-m", "asyncrl.cli"]


def _doctor(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [*ASYNCRL, "doctor", *args], capture_output=True, text=True, env=env, timeout=240
    )


def _config_only_model(folder: Path, cfg: dict) -> Path:
    """A model folder with only config.json: all the plan and build_spec read (no weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def demo_overrides(tmp_path_factory) -> list[str]:
    from tools.make_demo import make_demo

    d = make_demo(tmp_path_factory.mktemp("doctor_demo"), train=50, eval=8)
    return [
        f"model.path={d / 'model'}",
        f"data.path={d / 'data/train.jsonl'}",
        f"data.eval_path={d / 'data/eval.jsonl'}",
    ]


def test_the_demo_recipe_passes_on_this_machine(demo_overrides):
    p = _doctor(str(ROOT / "recipes/demo.yaml"), *demo_overrides)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    names = [x[2:].split(":", 1)[0] for x in lines]
    assert names == [
        "recipe",
        "files",
        "device",
        "model",
        "attention",
        "generators",
        "learner memory",
        "placement",
        "rank 0",
        "generator memory",
        "NCCL",
        "ports",
        "TLS",
    ]
    assert all(x.startswith("✓ ") for x in lines), p.stdout
    out = p.stdout
    assert "attention: sdpa: CPU: per-document SDPA" in out  # choose_attention's own words
    assert "weights go over gloo" in out and "checkpointing none" in out
    assert "✓ placement: actor on ranks 0 (TP 1 × DP 1)\n✓ rank 0: actor: states actor " in out
    assert "all 13 checks pass" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_plan_that_does_not_fit_exits_2_naming_it(tmp_path, demo_overrides):
    model = _config_only_model(tmp_path / "qwen3-8b", QWEN3_8B)
    # 8.2B parameters' float32 states alone are 131 GB; million-token sequences add 11.7 TB of
    # float32 activations per micro-batch: no machine holds it
    p = _doctor(
        str(ROOT / "recipes/demo.yaml"),
        *demo_overrides,
        f"model.path={model}",
        "model.max_seq_len=1000000",
        "learner.micro_batch_tokens=1000000",
    )
    assert p.returncode == 2, p.stdout + p.stderr
    line = next(x for x in p.stdout.splitlines() if x.startswith("✗ learner memory"))
    assert line.startswith("✗ learner memory: rank 0 needs ")
    assert "does not fit by" in line and "(largest: activations" in line
    assert "more learner ranks" in line  # no checkpointing or micro-batch fits this host
    # the built-in engine alone (float32 weights twice, the KV of 128 such sequences) neither
    assert "✗ generator memory: each built-in engine: " in p.stdout
    assert p.stderr.strip().endswith("2 of 13 checks fail: learner memory, generator memory")
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize(
    ("name", "config"),
    [("qwen3_0.6b_gsm8k.yaml", QWEN3_0_6B), ("multinode.yaml", QWEN3_8B)],
)
def test_a_shipped_gpu_recipe_names_the_attention_the_learner_will_use(tmp_path, name, config):
    """The GPU recipes leave the attention to auto, so on this CPU machine the doctor names the
    CPU's choice (on a GPU: varlen when its kernels import, else the same SDPA) instead of refusing
    varlen.
    The rest fails here (no data, no servers, no GPU): only the attention line is asked about."""
    model = _config_only_model(tmp_path / "model", config)
    p = _doctor(str(ROOT / "recipes" / name), f"model.path={model}", "--timeout", "1")
    assert "\n✓ attention: sdpa: CPU: per-document SDPA" in p.stdout, p.stdout


def test_an_invalid_recipe_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("buffer: {max_stalenes: 2}\n")
    p = _doctor(str(bad))
    assert p.returncode == 2
    assert "✗ recipe:" in p.stdout and "did you mean 'max_staleness'" in p.stdout
    assert "Traceback" not in p.stderr


# ---- the memory verdict on a GPU, with the device given (no GPU here) -------------------------


def _multinode(tmp_path: Path, *overrides: str) -> Doctor:
    model = _config_only_model(tmp_path / "Qwen3-8B", QWEN3_8B)
    r = recipe_mod.load(
        ROOT / "recipes/multinode.yaml", [f"model.path={model}", *overrides], check_files=False
    )
    d = Doctor(recipe=r)
    check_model(d)
    return d


PPO_8B = [
    "algorithm.loss=ppo",
    "algorithm.advantage=gae",
    "algorithm.kl_coef=0.05",
    "buffer.dynamic_sampling=false",  # the recipe's, a group estimator's rule
]


def _gpu(free_gib: float, host_gib: float = 2048) -> Device:
    free, host = int(free_gib * GiB), int(host_gib * GiB)
    return Device(
        cuda=True, gpus=[("H100", free, free, (9, 0))] * 8, host_available=host, host_total=host
    )


def test_8b_on_16_ranks_fits_an_80_gib_gpu_with_full_checkpointing(tmp_path):
    d = _multinode(tmp_path)  # the recipe as shipped: activation_checkpointing full
    d.device = _gpu(80)
    (c,) = check_learner_memory(d)
    assert c.ok, c.detail
    assert c.detail.startswith("rank 0 needs 73.8 GiB")  # 78,448,718,848 bytes (test_memory_plan)
    # at its 256 MiB logits chunk, + (441 − 110) × 151,936 × 16 at the default 1024 MiB
    assert "checkpointing full" in c.detail


def test_one_gpu_prices_the_engine_beside_the_learner(tmp_path):
    """recipes/one_gpu.yaml: the built-in engine runs on rank 0's GPU (in model.dtype), so its
    weights, staged copy and slot cache count there with the learner's step, not on the host; a GPU
    too small for both names the engine's share among the fixes. An engine on the CPU
    (generator.device cpu) costs the GPU nothing."""
    model = _config_only_model(tmp_path / "Qwen3-0.6B", QWEN3_0_6B)

    def doctor(free_gib: float, *overrides: str) -> Doctor:
        r = recipe_mod.load(
            ROOT / "recipes/one_gpu.yaml", [f"model.path={model}", *overrides], check_files=False
        )
        d = Doctor(recipe=r)
        check_model(d)
        free = int(free_gib * GiB)
        d.device = Device(
            cuda=True,
            gpus=[("H100", free, free, (9, 0))],
            host_available=GiB * 256,
            host_total=GiB * 256,
        )
        return d

    d = doctor(80)
    gen = d.generator_plan()
    assert d.engines_on_gpu() == 1 and gen.weights == d.dims.params * 2  # bfloat16 on the GPU
    assert gen.sequences == 64 and gen.tokens_per_sequence == 2048  # generator.max_batch_size
    (c,) = check_learner_memory(d)
    rank0, _ = d.learner_plans()
    assert c.ok and d.learner_need()[0] == rank0.total + gen.total, c.detail
    assert f"beside it on its GPU 1 built-in engine(s), {gib(gen.total)} GiB" in c.detail
    (g,) = check_generator_memory(d)
    assert g.ok and "on rank 0's GPU, priced with the learner there" in g.detail
    (c,) = check_learner_memory(doctor(rank0.total / GiB + 1))  # the learner alone would fit
    assert not c.ok and "a smaller generator.max_batch_size" in c.detail, c.detail
    (c,) = check_learner_memory(doctor(rank0.total / GiB + 1, "generator.device=cpu"))
    assert c.ok and "built-in engine" not in c.detail, c.detail


def test_async_checkpoint_staging_must_fit_the_host(tmp_path):
    """8 ranks per node each stage 12·P/16 = 6.1 GB of float32 shards on the host for a save."""
    d = _multinode(tmp_path)
    d.device = _gpu(80, host_gib=32)
    (c,) = check_learner_memory(d)
    assert not c.ok and "set learner.checkpoint_async=false" in c.detail
    d = _multinode(tmp_path, "learner.checkpoint_async=false")
    d.device = _gpu(80, host_gib=32)
    (c,) = check_learner_memory(d)
    assert c.ok, c.detail


def test_8b_without_checkpointing_does_not_fit_and_the_fix_is_priced(tmp_path):
    d = _multinode(tmp_path, "learner.activation_checkpointing=none")
    d.device = _gpu(80)
    (c,) = check_learner_memory(d)
    assert not c.ok
    # 401.4 GiB needed, activations 356.5 GiB of it; one 8,192-token sequence alone does not fit 80 GiB
    # next to the rest (room for 6,445 tokens), so only checkpointing is offered
    assert c.detail.startswith("rank 0 needs 401.4 GiB")
    assert "does not fit by" in c.detail and "(largest: activations 356.5 GiB)" in c.detail
    assert "set learner.activation_checkpointing=full (73.8 GiB)" in c.detail
    assert "micro_batch_tokens" not in c.detail
    d.device = _gpu(120)
    (c,) = check_learner_memory(d)
    # (120 GiB − 48,249,076,736 bytes) // 5,840,896 bytes per token = 13,799 tokens
    assert "set learner.micro_batch_tokens=13799" in c.detail


def _placed(tmp_path: Path, *placement: str) -> tuple[Doctor, dict[str, Check]]:
    """PPO with a critic and a KL term, Qwen3-8B on 8 80-GiB GPUs: the doctor and its placement
    checks by name."""
    d = _multinode(tmp_path, "learner.ranks=8", *PPO_8B, *placement)
    d.device = _gpu(80)
    return d, {c.name: c for c in check_placement(d)}


def test_placement_per_rank_on_8_gpus(tmp_path):
    """PPO with a critic and a KL term, Qwen3-8B on 8 GPUs: the actor and its reference on ranks
    0-5, the critic on 6-7 (test_memory_plan has the numbers by hand). The critic's ranks are the
    fullest (95.7 GiB): they do not fit an 80 GiB GPU, and the learner's verdict is theirs."""
    placed = ["placement.actor.ranks=[0,1,2,3,4,5]", "placement.critic.ranks=[6,7]"]
    d, by_name = _placed(tmp_path, *placed)
    assert by_name["placement"].detail == (
        "actor on ranks 0-5 (TP 1 × DP 6); critic on ranks 6-7 (TP 1 × DP 2); "
        "ref on ranks 0-5 (TP 1 × DP 6)"
    )
    assert list(by_name) == ["placement", "rank 0", "ranks 1-5", "ranks 6-7"]
    assert by_name["ranks 1-5"].ok and by_name["ranks 1-5"].detail.startswith(
        "actor, ref: states actor 20.3 + ref 5.09 GiB; peak 61.1 GiB; by phase: values, ref 32.2; "
        "train_actor, train_critic 61.1"
    )
    assert "(with the weight snapshot 30.5)" in by_name["rank 0"].detail
    six = by_name["ranks 6-7"]
    assert not six.ok and six.detail.startswith("critic: states critic 61.0 GiB; peak 95.7 GiB")
    assert six.detail.endswith("does not fit the smallest GPU's 80.0 GiB free")
    (c,) = check_learner_memory(d)
    assert not c.ok
    assert c.detail.startswith("with placement the fullest rank, 6, needs 95.7 GiB at its peak")
    assert "(largest: critic states 61.0 GiB on rank 6)" in c.detail
    d.device = _gpu(96)
    assert all(c.ok for c in check_placement(d) + check_learner_memory(d))


def test_reallocation_lowers_the_peak_it_can(tmp_path):
    """Every role on every rank, critic and ref offloaded between their calls: the ref's 4·P/8
    (3.81 GiB) leaves the update's peak; the critic's stays (its update runs inside the actor's
    train step). On CPU nothing is offloaded, and the check says so."""
    d, by_name = _placed(tmp_path, "placement.critic.offload=true", "placement.ref.offload=true")
    assert by_name["placement"].detail == (
        "actor on ranks 0-7 (TP 1 × DP 8); "
        "critic on ranks 0-7 (TP 1 × DP 8, offloaded between calls); "
        "ref on ranks 0-7 (TP 1 × DP 8, offloaded between calls)"
    )
    assert "peak 66.2 GiB with offload, 70.0 GiB without;" in by_name["ranks 1-7"].detail
    d.device = Device(cuda=False, gpus=[], host_available=2048 * GiB, host_total=2048 * GiB)
    (said, *_) = check_placement(d)
    assert said.detail.endswith(
        "on CPU nothing is offloaded (the device is host memory): a CPU run needs the peaks without offload"
    )


# ---- SGLang servers -------------------------------------------------------------------------


def _demo(model: Path, *overrides: str) -> Doctor:
    """A Doctor for the demo recipe on ``model`` with ``overrides`` (files not checked)."""
    r = recipe_mod.load(
        ROOT / "recipes/demo.yaml", [f"model.path={model}", *overrides], check_files=False
    )
    return Doctor(recipe=r)


def test_a_real_server_is_reached_and_described(tiny_qwen3, rollout_engine):
    """The built-in engine serves SGLang's API (no /server_info: one rank, no radix cache)."""
    d = _demo(tiny_qwen3, "generator.kind=sglang", f"generator.urls=[{rollout_engine.url}]")
    (c,) = check_generators(d)
    assert c.ok, c.detail
    assert c.name == f"SGLang {rollout_engine.url}"
    # the shared engine says "default" until a rollout test labels it (test order must not matter)
    label = get_label(rollout_engine.url)
    assert "asyncrl built-in engine" in c.detail and f"weight version '{label}'" in c.detail


def test_an_unreachable_server_is_named_with_the_fix(tiny_qwen3):
    with refused_url() as url:  # held, not listening, while the doctor calls it
        d = _demo(tiny_qwen3, "generator.kind=sglang", f"generator.urls=[{url}]")
        d.timeout_s = 2
        (c,) = check_generators(d)
    assert not c.ok and "unreachable" in c.detail and "fix generator.urls" in c.detail


class _FakeSGLang(BaseHTTPRequestHandler):
    """SGLang's /model_info and /server_info with a layout no server here can have (TP 4 needs four
    GPUs; real SGLang on CPU runs TP 1): the only part of this test that is not a real server."""

    server_info: dict = {}
    label = "0"

    def do_GET(self):  # noqa: N802
        body = {"/model_info": {"weight_version": self.label, "model_type": "qwen3"}}.get(
            self.path, self.server_info if self.path == "/server_info" else None
        )
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(body or {}).encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_sglang():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeSGLang)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _server_check(tiny_qwen3, url: str, info: dict, label: str = "0", *overrides: str):
    _FakeSGLang.server_info, _FakeSGLang.label = info, label
    d = _demo(tiny_qwen3, "generator.kind=sglang", f"generator.urls=[{url}]", *overrides)
    (c,) = check_generators(d)
    return c, d


def test_server_layout_radix_cache_version_and_label(tiny_qwen3, fake_sglang):
    url = f"http://127.0.0.1:{fake_sglang.server_address[1]}"
    info = {"version": "0.5.23", "tp_size": 4, "dp_size": 1, "disable_radix_cache": False}
    c, _ = _server_check(tiny_qwen3, url, info)  # pause_mode in_place (the default)
    assert not c.ok and "relaunch it with --disable-radix-cache" in c.detail
    c, d = _server_check(tiny_qwen3, url, info, "0", "weights.pause_mode=retract")
    assert c.ok and "sglang 0.5.23, tp 4, radix cache on" in c.detail
    # the generator plan splits weights over the server's 4 GPUs
    check_model(d)
    assert d.generator_plan().weights == d.dims.params * 4 // 4  # float32 over 4 GPUs
    c, _ = _server_check(tiny_qwen3, url, {**info, "disable_radix_cache": True, "dp_size": 2})
    assert not c.ok and "dp_size 2" in c.detail
    c, _ = _server_check(
        tiny_qwen3, url, {**info, "version": "0.5.17", "disable_radix_cache": True}
    )
    assert not c.ok and "use SGLang >= 0.5.19" in c.detail
    c, _ = _server_check(tiny_qwen3, url, {**info, "disable_radix_cache": True}, "latest")
    assert not c.ok and "relaunch it with --weight-version 0" in c.detail


def test_a_tensor_parallel_server_cannot_take_weights_by_handle(tiny_qwen3, fake_sglang):
    """weights.backend ipc sends one payload per bucket, and SGLang reads
    ``serialized_named_tensors[tp_rank]``: a TP-2 server would fail at rank 1 (IndexError), so
    the doctor names it (as the broadcaster refuses it: tests/weights/test_refusal.py)."""
    url = f"http://127.0.0.1:{fake_sglang.server_address[1]}"
    info = {"version": "0.5.23", "tp_size": 2, "dp_size": 1, "disable_radix_cache": True}
    c, _ = _server_check(tiny_qwen3, url, info, "0", "weights.backend=ipc")
    assert not c.ok and c.detail == (
        "weights.backend ipc sends one handle per bucket, which SGLang indexes by TP rank: a "
        "server of tp 2 cannot take it; set weights.backend to nccl"
    )
    c, _ = _server_check(tiny_qwen3, url, {**info, "tp_size": 1}, "0", "weights.backend=ipc")
    assert c.ok, c.detail


# ---- the servers' logprobs against the learner's ------------------------------------------------


def _logprob_check(model: Path, url: str, temperature: float = 0.7) -> Check:
    """The doctor's logprob check of the server at ``url`` for a recipe on ``model`` at
    ``temperature`` (after the checks it follows: the model, the device, the server)."""
    d = _demo(
        model,
        "generator.kind=sglang",
        f"generator.urls=[{url}]",
        f"rollout.temperature={temperature}",
    )
    check_model(d)
    check_device(d)
    (reached,) = check_generators(d)
    assert reached.ok, reached.detail
    (c,) = check_logprobs(d)
    assert c.name == f"logprobs {url}"
    return c


def _mean_gaps(detail: str) -> list[float]:
    return [float(x) for x in re.findall(r"mean \|Δ\| ([0-9.e+-]+)[);]", detail)]


def test_a_server_with_the_learners_logprobs_at_the_temperature_passes(tiny_qwen3, rollout_engine):
    """The built-in engine reports log softmax(z/T), as SGLang does by default: the learner's own
    logprobs of the tokens it samples at T = 0.7 equal them to float32 rounding."""
    c = _logprob_check(tiny_qwen3, rollout_engine.url)
    assert c.ok, c.detail
    assert (
        "32 tokens sampled at T = 0.7: its logprobs are the learner's log softmax(z/T)" in c.detail
    )
    (gap,) = _mean_gaps(c.detail)
    assert gap < 1e-5


@pytest.fixture
def original_logprob_engine(tiny_qwen3, monkeypatch):
    """A built-in engine started with SGLANG_RETURN_ORIGINAL_LOGPROB=1: like SGLang so launched, it
    reports log softmax(z) before the temperature."""
    from asyncrl.engine.api import EngineConfig
    from asyncrl.engine.sampling import ORIGINAL_LOGPROB_ENV
    from asyncrl.engine.server import serve

    monkeypatch.setenv(ORIGINAL_LOGPROB_ENV, "1")
    srv = serve(EngineConfig(model=str(tiny_qwen3), max_batch_size=4))
    monkeypatch.delenv(ORIGINAL_LOGPROB_ENV)
    yield srv
    srv.stop()


def test_untempered_logprobs_are_named_with_the_env_var(tiny_qwen3, original_logprob_engine):
    c = _logprob_check(tiny_qwen3, original_logprob_engine.url)
    assert not c.ok
    assert "its logprobs equal the untempered log softmax(z)" in c.detail
    assert "it runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1" in c.detail
    assert c.detail.endswith("relaunch it without SGLANG_RETURN_ORIGINAL_LOGPROB")
    untempered, tempered = _mean_gaps(c.detail)  # the size of the mismatch, both ways
    assert untempered < 1e-5 and tempered > 0.05
    assert f"off-policy by about {tempered:.2g} nat" in c.detail


def test_a_server_with_other_weights_matches_neither(tiny_qwen3, tiny_qwen3_untied):
    """tiny_qwen3_untied: the same architecture and vocabulary, its own output projection."""
    from asyncrl.engine.api import EngineConfig
    from asyncrl.engine.server import serve

    with serve(EngineConfig(model=str(tiny_qwen3_untied), max_batch_size=4)) as other:
        c = _logprob_check(tiny_qwen3, other.url)
    assert not c.ok
    assert "match neither the learner's log softmax(z/T)" in c.detail
    assert "the server holds other weights or another model than model.path" in c.detail
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in c.detail
    assert min(_mean_gaps(c.detail)) > 0.1


def test_the_env_var_here_is_named_for_built_in_engines(tiny_qwen3):
    """The rollout workers' engines inherit the doctor's environment (it runs where they will)."""
    d = _demo(tiny_qwen3, "rollout.temperature=0.7")
    d.environ = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "True"}  # SGLang's reading: "1" or "true"
    (c,) = check_generators(d)
    assert not c.ok and c.detail.startswith("SGLANG_RETURN_ORIGINAL_LOGPROB=True here")
    assert c.detail.endswith("unset SGLANG_RETURN_ORIGINAL_LOGPROB")
    d.environ = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "0"}
    assert all(c.ok for c in check_generators(d))
    d = _demo(tiny_qwen3, "rollout.temperature=1.0")  # untempered is tempered: nothing to refuse
    d.environ = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
    assert all(c.ok for c in check_generators(d))


def test_a_temperature_too_near_1_to_tell_is_not_refused():
    """Server logprobs nearer the untempered ones, but the two hypotheses closer than the noise."""
    tempered, plain = [-1.0, -2.0], [-1.01, -2.01]
    ok, detail = judge_logprobs([-1.006, -2.006], tempered, plain, temperature=0.99)
    assert ok and "too close to tell which it reports" in detail


# ---- NCCL -------------------------------------------------------------------------------------


def test_trainer_nccl_env_matches_sglang_unless_set_by_hand():
    assert gpu.trainer_nccl_env({}, uses_nccl=True) == {
        "NCCL_CUMEM_ENABLE": "0",
        "NCCL_NVLS_ENABLE": "0",
    }
    assert gpu.trainer_nccl_env({"NCCL_CUMEM_ENABLE": "1"}, uses_nccl=True) == {
        "NCCL_NVLS_ENABLE": "0"
    }
    assert gpu.trainer_nccl_env({}, uses_nccl=False) == {}
    assert gpu.uses_nccl("auto", cuda=True) and not gpu.uses_nccl("auto", cuda=False)
    assert gpu.uses_nccl("nccl", cuda=False) and not gpu.uses_nccl("gloo", cuda=True)
    assert gpu.nccl_env_mismatch({"NCCL_CUMEM_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}) == [
        "NCCL_CUMEM_ENABLE=1"
    ]


def test_the_nonblocking_weight_group_is_bounded_by_the_recipes_timeout():
    """torch bounds a nonblocking communicator's init and launches by
    TORCH_NCCL_NONBLOCKING_TIMEOUT (whole seconds, 30 minutes unset), not by the group's timeout:
    the learner sets it from weights.timeout_s, rounded up, unless set by hand."""
    env = gpu.trainer_nccl_env({}, uses_nccl=True, weights_timeout_s=60.0)
    assert env[gpu.NONBLOCKING_TIMEOUT] == "60"
    assert gpu.nonblocking_timeout_s(env) == 60
    assert gpu.nonblocking_bound_problem(env, 60.0) is None
    env = gpu.trainer_nccl_env({}, uses_nccl=True, weights_timeout_s=2.5)
    assert env[gpu.NONBLOCKING_TIMEOUT] == "3" and gpu.nonblocking_bound_problem(env, 2.5) is None
    by_hand = {gpu.NONBLOCKING_TIMEOUT: "900"}
    assert gpu.NONBLOCKING_TIMEOUT not in gpu.trainer_nccl_env(
        by_hand, uses_nccl=True, weights_timeout_s=60.0
    )
    assert gpu.trainer_nccl_env({}, uses_nccl=False, weights_timeout_s=60.0) == {}
    # where it is not set, torch waits 30 minutes: said, with the bound and the fix
    assert gpu.nonblocking_timeout_s({}) == 1800
    problem = gpu.nonblocking_bound_problem({}, 60.0)
    assert problem is not None and "unset" in problem and "1800s" in problem
    problem = gpu.nonblocking_bound_problem(by_hand, 60.0)
    assert problem is not None and "set to 900" in problem


def test_the_learner_sets_them_only_for_an_nccl_weight_group(monkeypatch):
    from asyncrl.learner.main import match_sglang_nccl

    for k in [*gpu.SGLANG_NCCL_ENV, gpu.NONBLOCKING_TIMEOUT]:
        monkeypatch.setenv(k, "x")  # so that the test's changes are undone
        monkeypatch.delenv(k)
    gloo = recipe_mod.from_dict({"weights": {"backend": "gloo"}})
    assert match_sglang_nccl(gloo) == {} and "NCCL_CUMEM_ENABLE" not in os.environ
    sglang = {"kind": "sglang", "urls": ["http://127.0.0.1:30000"]}
    nccl = recipe_mod.from_dict(
        {"generator": sglang, "weights": {"backend": "nccl", "timeout_s": 45}}
    )
    assert match_sglang_nccl(nccl) == gpu.SGLANG_NCCL_ENV | {gpu.NONBLOCKING_TIMEOUT: "45"}
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert os.environ[gpu.NONBLOCKING_TIMEOUT] == "45"


def test_sglang_versions_map_to_their_nccl():
    assert gpu.expected_nccl("0.5.23") == (2, 30, 7)
    assert gpu.expected_nccl("0.5.99") is None
    assert gpu.TORCH_NCCL["2.13.0"] != gpu.TORCH_NCCL["2.14.1"]  # why one environment


SGLANG = ("generator.kind=sglang", "generator.urls=[http://127.0.0.1:30000]")
"""Overrides for the demo recipe with an SGLang server (NCCL sends to SGLang, not the built-in engine)."""


def test_nccl_backend_on_a_machine_without_gpu_is_named(tiny_qwen3):
    d = _demo(tiny_qwen3, "weights.backend=nccl", *SGLANG)
    d.device = Device(cuda=False, gpus=[], host_available=GiB, host_total=GiB)
    (c,) = check_nccl(d)
    assert not c.ok and "needs a GPU" in c.detail and "weights.backend=gloo" in c.detail


def test_auto_sends_to_built_in_engines_over_gloo_on_a_gpu_host(tiny_qwen3):
    """On a CUDA machine ``auto`` is NCCL for SGLang servers but gloo for a built-in engine on CPU
    (generator.device cpu), which receives into CPU tensors (asyncrl.gpu.weight_backend)."""
    d = _demo(tiny_qwen3, "weights.backend=auto", "generator.kind=builtin", "generator.device=cpu")
    d.device = Device(cuda=True, gpus=[], host_available=GiB, host_total=GiB)
    (c,) = check_nccl(d)
    assert c.ok and "not used: weights go over gloo" in c.detail, c.detail
    assert "built-in engines receive on CPU" in c.detail


def test_built_in_engines_on_cuda_may_take_nccl(tiny_qwen3):
    """With generator.device auto a GPU host runs the built-in engines on CUDA, where they can
    join NCCL: the NCCL line is checked, and says where handles go instead (rank 0's own GPU)."""
    d = _demo(tiny_qwen3, "weights.backend=auto", "generator.kind=builtin")
    d.device = Device(cuda=True, gpus=[], host_available=GiB, host_total=GiB)
    d.environ = {}
    (c,) = check_nccl(d)
    assert c.ok and "not used" not in c.detail, c.detail
    assert "NCCL from another GPU, and take CUDA IPC handles on rank 0's own" in c.detail


def test_a_missing_interpreter_is_one_line():
    with pytest.raises(RuntimeError, match="cannot run"):
        gpu.probe_python("/nonexistent/python")


# ---- ports and TLS ----------------------------------------------------------------------------


def test_ports_in_use_free_and_elsewhere(tiny_qwen3):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        with unlistened_port(reuse=True) as free:  # held, yet free to a bind that reuses
            d = _demo(
                tiny_qwen3,
                f"buffer.address=tcp://127.0.0.1:{free}",
                "weights.master_addr=no-such-host.invalid",
                "weights.master_port=29610",
            )
            (c,) = check_ports(d)
        assert c.ok and f"free: buffer.address 127.0.0.1:{free}" in c.detail
        assert "not this host's" in c.detail and "no-such-host.invalid:29610" in c.detail
        (c,) = check_ports(_demo(tiny_qwen3, f"buffer.pub_address=tcp://127.0.0.1:{busy}"))
        assert not c.ok and f"in use: buffer.pub_address 127.0.0.1:{busy}" in c.detail


def _tls(tmp_path: Path, tiny_qwen3: Path, key: str) -> Check:
    d = _demo(
        tiny_qwen3,
        "buffer.address=tls+tcp://127.0.0.1:0",
        "buffer.pub_address=tls+tcp://127.0.0.1:0",
        f"buffer.tls.cert={tmp_path / 'node.pem'}",
        f"buffer.tls.key={tmp_path / key}",
        f"buffer.tls.ca={tmp_path / 'ca.pem'}",
    )
    (c,) = check_tls(d)
    return c


def test_tls_files_readable_and_the_key_is_the_certificates(tmp_path, tiny_qwen3):
    ca = trustme.CA()
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes())
    cert = ca.issue_cert("127.0.0.1")
    (tmp_path / "node.pem").write_bytes(b"".join(p.bytes() for p in cert.cert_chain_pems))
    (tmp_path / "node.key").write_bytes(cert.private_key_pem.bytes())
    (tmp_path / "other.key").write_bytes(ca.issue_cert("other").private_key_pem.bytes())
    c = _tls(tmp_path, tiny_qwen3, "node.key")
    assert c.ok, c.detail
    c = _tls(tmp_path, tiny_qwen3, "other.key")
    assert not c.ok and "fix buffer.tls" in c.detail
    c = _tls(tmp_path, tiny_qwen3, "gone.key")
    assert not c.ok and "gone.key" in c.detail


def test_lora_on_a_llama_model_fails_the_model_check_in_one_line(tmp_path):
    """The learner's refusal (asyncrl/learner/lora.py:check_supported), said before a run."""
    llama = QWEN3_0_6B | {"model_type": "llama", "rope_theta": 10000.0}
    model = _config_only_model(tmp_path / "llama", llama)
    for lora, ok in (("0", True), ("8", False)):
        r = recipe_mod.load(
            ROOT / "recipes/qwen3_0.6b_gsm8k.yaml",
            [f"model.path={model}", f"learner.lora.rank={lora}"],
            check_files=False,
        )
        (check,) = check_model(Doctor(recipe=r))
        assert check.ok is ok, check.detail
    assert check.detail.startswith("learner.lora: only Qwen3 models") and "\n" not in check.detail


def test_float32_with_grouped_query_attention_on_a_gpu_is_warned(tiny_qwen3):
    """The default model.dtype (float32) on a GPU, with the tiny Qwen3's 4 query / 2 KV heads:
    SDPA's fused kernels refuse it and the math kernel builds L×L scores per document, so the
    attention line warns and names the fix; bf16, or the CPU, say nothing more."""
    from asyncrl.doctor.model_checks import float32_attention_warning

    d = _demo(tiny_qwen3)
    assert d.recipe.model.dtype == "float32"  # the recipe default
    (m,) = check_model(d)
    assert m.ok and d.dims.heads == 4 and d.dims.kv_heads == 2
    warning = float32_attention_warning(d, "sdpa", on_cpu=False)
    assert "math kernel" in warning and warning.endswith("set model.dtype=bfloat16")
    assert float32_attention_warning(d, "sdpa", on_cpu=True) == ""
    assert float32_attention_warning(_bf16(tiny_qwen3), "sdpa", on_cpu=False) == ""


def _bf16(model: Path) -> Doctor:
    d = _demo(model, "model.dtype=bfloat16")
    check_model(d)
    return d


@pytest.mark.parametrize(
    ("env", "backend", "named"),
    [
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "ipc", "PYTORCH_CUDA_ALLOC_CONF"),
        ({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}, "auto", "PYTORCH_ALLOC_CONF"),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "gloo", None),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, "ipc", None),
    ],
    ids=["expandable-ipc", "malloc-async-auto", "gloo", "harmless"],
)
def test_allocator_settings_that_break_cuda_ipc_are_named(tiny_qwen3, env, backend, named):
    """Weights by CUDA IPC handle (ipc, or auto with built-in engines that may share rank 0's
    GPU) under allocator settings whose blocks torch cannot pass by handle: one failed line
    naming the variable and the fix; other backends and harmless settings add no line."""
    d = _demo(tiny_qwen3, f"weights.backend={backend}", "generator.kind=builtin")
    d.device = Device(cuda=True, gpus=[], host_available=GiB, host_total=GiB)
    d.environ = env
    lines = check_nccl(d)
    extra = [c for c in lines if c.name == "weights by handle"]
    if named is None:
        assert extra == [], lines
        return
    (c,) = extra
    assert not c.ok and c.detail.startswith(f"{named}=") and "weights.backend" in c.detail


def test_an_moe_is_priced_by_total_and_active_parameters_and_its_experts_per_rank(tmp_path):
    """Qwen3-30B-A3B (config only) on recipes/multinode.yaml's 16 ranks: the model check names
    the total (what memory scales with) and the active parameters (what a token's compute does),
    and the learner memory line the experts' share of each rank: FSDP shards them over the 16
    ranks with the rest (no expert parallelism), 16 bytes a parameter (float32 params, grads,
    AdamW) × 28,991,029,248 expert parameters / 16 = 27.0 GiB."""
    from tests.test_memory_plan import QWEN3_30B_A3B

    model = _config_only_model(tmp_path / "Qwen3-30B-A3B", QWEN3_30B_A3B)
    r = recipe_mod.load(ROOT / "recipes/multinode.yaml", [f"model.path={model}"], check_files=False)
    d = Doctor(recipe=r)
    (c,) = check_model(d)
    assert c.ok, c.detail
    assert c.detail.startswith("qwen3_moe, 30.5B parameters, 3.35B active (hidden 2048, 48 layers")
    assert "128 experts of width 768, top-8, in 48 of 48 layers: 29B parameters in experts" in (
        c.detail
    )
    d.device = _gpu(80)
    (c,) = check_learner_memory(d)
    assert gib(16 * 28_991_029_248 / 16) == "27.0"
    assert "(experts, 95% of the params: 27.0 GiB a rank of the params, grads and AdamW, " in (
        c.detail
    )
    assert "sharded by FSDP over 16 rank(s), no expert parallelism)" in c.detail
    # the dense 8B's line has no experts
    dense = _multinode(tmp_path)
    dense.device = _gpu(80)
    (c,) = check_learner_memory(dense)
    assert "experts" not in c.detail

"""The real-SGLang tier: one real SGLang 0.5.23 server per tiny model per session, on CPU.

``make test-sglang`` runs it (``pytest -m sglang``). Set-up: ``tools/sglang_cpu/build_env.sh`` builds
SGLang's own venv (cached; 2-4 min from scratch), then a tiny Qwen3 (tied embeddings) and a tiny Llama
(untied) are written by tools/make_tiny_model.py and served by two servers started side by side
(``tools/sglang_cpu/server.py``). If the environment cannot be built or a server does not come up,
every test here FAILS with the cause; the tier is switched off only explicitly, by
``ASYNCRL_SKIP_SGLANG=1``.

Each server handle carries the weights it serves now (``weights``, HF names) and their ``version``:
tests that update weights advance them, tests that compare logprobs use them. Tests that kill a
server (fixture ``doomed``) run after all others.

Fields of SGLang's responses that asyncrl reads, and the tests that check them on the live server:

- ``/generate`` (asyncrl/rollout/generator_pool.py): ``output_ids``,
  ``meta_info.output_token_logprobs`` (``[logprob, id, text]``), ``meta_info.finish_reason`` (``type``; ``matched`` for stop;
  ``message`` for abort), ``meta_info.weight_versions`` (``version``/``start``/``end``),
  ``meta_info.prompt_tokens``, ``meta_info.num_retractions``: test_generate.py (all, for stop,
  length and greedy/sampled), test_abort_resume.py (the abort finish with its ``message``, partial
  tokens/logprobs/spans, HTTP 200; then the resubmitted sample), test_weights.py (spans over two
  versions, ``num_retractions`` > 0 with ``retract``).
- ``/generate`` with ``return_routed_experts`` (routing replay: asyncrl/rollout/sglang_protocol.py
  ``parse_routed_experts``): ``meta_info.routed_experts`` and ``meta_info.prompt_tokens``:
  test_moe_routes.py, on a server of its own serving an untied tiny Qwen3-MoE, started with
  ``--enable-return-routed-experts`` (and tools/sglang_cpu/routes_shim on CPU).
- ``/health`` (generator_http.ahealthy: pool.wait_ready, WeightsClient.health):
  test_generate.py::test_client_wait_ready, test_failure.py (down after a kill).
- ``/model_info`` ``weight_version`` (WeightsClient.weight_version, GeneratorPool.label and its
  polling while a server is behind the version bound): test_weights.py, test_generate.py
  (``"default"`` before a worker labels it).
- ``/update_weight_version`` with ``abort_all_requests: false`` (GeneratorPool.label: a server
  launched without ``--weight-version`` is labelled ``"0"`` before it generates; every server is
  labelled so when it first comes up): test_generate.py::test_a_default_server_is_labelled_at_join
  (``new_version`` in the reply, ``/model_info`` after, a running request not aborted; SGLang
  stamps the label on it as a version change: ``"default"`` spans, refused by the client).
- Control endpoints' ``success``/``message`` and HTTP status (generator_http.acall, WeightsClient):
  ``/init_weights_update_group``, ``/pause_generation``, ``/begin_weight_update`` (200 on 0.5.23,
  so sessions are used), ``/update_weights_from_distributed``, ``/end_weight_update``,
  ``/continue_generation``, ``/destroy_weights_update_group``: test_weights.py (a failure in any
  would show in ``SyncReport.error``), test_failure.py; ``/update_weights_from_disk`` (a rejoining
  generator loads the latest export): test_weights.py::test_update_from_disk.
- ``/server_info`` (the broadcaster's and the doctor's: ``tp_size``, ``disable_radix_cache``): the
  servers run with ``--disable-radix-cache``, as ``weights.pause_mode: in_place`` needs and the
  broadcaster demands (with the cache on, new requests after an in-place update reused prefix KV the
  old weights computed: logprob errors up to ~1 nat for a repeated prompt, measured when the tier's
  servers kept it). test_doctor.py: the doctor's checks of a live server, its logprobs at T = 0.7
  against the learner's, and a server started with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``.
- LoRA (``learner.lora`` with SGLang: asyncrl/weights/adapters.py): ``/load_lora_adapter``
  (``lora_name``, ``lora_path``: a PEFT folder; ``success``/``error_message``),
  ``/unload_lora_adapter``, ``/update_weight_version`` after each load, a ``/generate`` request's
  ``lora_path`` and the spans of one in flight across a load: test_lora.py, on a server of its own
  started with ``--enable-lora`` (and tools/sglang_cpu/lora_shim on CPU).
- ``/flush_cache`` is not called by asyncrl (after a ``retract`` update its last
  ``/update_weights_from_distributed`` asks for the flush), only by the tests.
- ``/weights_checker`` (WeightsClient.checksum reads ``checksum``): SGLang 0.5.23 answers
  ``{success, message, ranks: [{checksums: {sglang_param: hex16}, per_gpu_checksum, ...}],
  per_engine_checksum}``, with no ``checksum`` key and per *fused* SGLang parameter
  (``qkv_proj``, ``gate_up_proj``), so the broadcaster reports "not comparable" (None);
  test_weights.py recomputes SGLang's own checksums from the learner's tensors and compares them all.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from sglang_helpers import Served, label_at_join

from tools.sglang_cpu.server import SGLangServer, SGLangSetupError, build_env

SKIP_ENV = "ASYNCRL_SKIP_SGLANG"
START_TIMEOUT_S = float(
    os.environ.get("ASYNCRL_SGLANG_START_TIMEOUT", "600")
)  # loaded 2 cores: ~3 min
MAX_POSITIONS = 1024  # context length: room for long in-flight requests
ARCHS = {  # one tied, one untied model: both ways of sending lm_head are exercised
    "qwen3": dict(arch="qwen3", tie_embeddings=True),
    "llama": dict(arch="llama", tie_embeddings=False),
}


TIMINGS: dict[str, float] = {}  # set-up times, printed at the end of the session

TIER_TIMEOUT_S = 1500  # per test, set-up included: the first one builds the env and starts servers


def pytest_collection_modifyitems(config, items):
    """Tests that kill a server (fixture ``doomed``) go last: the others share that server. The
    tier's tests get a longer timeout, as the first one carries the whole set-up."""
    here = Path(__file__).parent
    for it in items:
        if here in Path(str(it.path)).parents:
            it.add_marker(pytest.mark.timeout(TIER_TIMEOUT_S))
    items.sort(key=lambda it: "doomed" in getattr(it, "fixturenames", ()))


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.write_line(
            "sglang tier set-up: " + ", ".join(f"{k} {v:.0f}" for k, v in TIMINGS.items())
        )


# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: the real-SGLang tier is switched off")
    t0 = time.monotonic()
    try:
        python = build_env()
    except SGLangSetupError as e:
        pytest.fail(str(e), pytrace=False)
    TIMINGS["SGLang env ready after (s)"] = time.monotonic() - t0
    return python


@pytest.fixture(scope="session")
def _servers(sglang_python, tmp_path_factory):
    """Both servers, started side by side (start-up is mostly imports); stopped at session end."""
    from safetensors.torch import load_file

    from tools.make_tiny_model import make_tiny_model

    handles: dict[str, Served] = {}
    try:
        for name, kw in ARCHS.items():
            d = make_tiny_model(
                tmp_path_factory.mktemp(f"sglang_{name}"), max_positions=MAX_POSITIONS, **kw
            )
            weights = load_file(str(d / "model.safetensors"))
            tied = bool(kw["tie_embeddings"])
            if tied:
                weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
            log = tmp_path_factory.getbasetemp() / f"sglang_{name}.log"
            # in_place pauses (the default) need it: the broadcaster refuses a radix cache
            server = SGLangServer(
                python=sglang_python, model=d, log=log, extra_args=["--disable-radix-cache"]
            )
            server.start()
            handles[name] = Served(
                name=name, server=server, model_dir=d, weights=weights, tied=tied
            )
        yield handles
    finally:
        for h in handles.values():
            h.server.stop()


def _ready(servers: dict[str, Served], name: str) -> Served:
    h = servers[name]
    if h.dead:
        pytest.fail(f"the {name} server was killed by an earlier test", pytrace=False)
    if h.ready:  # healthy once: from then on, only check that it still runs
        if not h.server.alive():
            pytest.fail(f"the {name} server exited (log {h.server.log})", pytrace=False)
        return h
    try:
        TIMINGS[f"{name} server healthy after (s)"] = h.server.wait_healthy(START_TIMEOUT_S)
    except SGLangSetupError as e:
        pytest.fail(str(e), pytrace=False)
    assert label_at_join(h.url) == h.version == 0  # "default" -> "0", as a joining worker does
    h.ready = True
    return h


@pytest.fixture(params=list(ARCHS))
def served(request, _servers) -> Served:
    """Each test runs on both servers: Qwen3 (tied embeddings) and Llama (untied)."""
    return _ready(_servers, request.param)


@pytest.fixture
def qwen3(_servers) -> Served:
    return _ready(_servers, "qwen3")


@pytest.fixture
def llama(_servers) -> Served:
    return _ready(_servers, "llama")


@pytest.fixture
def doomed():
    """Marks a test that kills a server: it runs after all others (see the collection hook).
    Call it with the handle the test kills."""
    killed: list[Served] = []

    def kill(h: Served, sig: int = signal.SIGKILL) -> None:
        h.dead = True
        killed.append(h)
        h.server.signal_group(sig)

    yield kill
    for h in killed:
        h.server.stop()

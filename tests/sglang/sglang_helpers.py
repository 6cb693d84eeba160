"""Helpers of the real-SGLang tier: server handles, the transformers oracle, SGLang's checksum."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch
import trio

from asyncrl.rollout.generator_pool import Completion, GeneratorPool
from asyncrl.rollout.sglang_protocol import SamplingParams
from tools.sglang_cpu.server import SGLangServer, SGLangSetupError

PROMPT = [40, 41, 42, 43, 44, 45, 46, 47]  # token ids of the char tokenizer ("EFGHIJKL"-like)
# |SGLang logprob - transformers logprob|: SGLang's own CPU kernels (attention, RMSNorm, a sampler
# that computes log_softmax(logits / T) itself) add roundings that transformers does not have, so
# the bound is 10 x LOGPROB_ATOL (tests/numerics.py); measured ~3e-7.
TOL = 1e-4


# --------------------------------------------------------------------------------------------------
# Handles
# --------------------------------------------------------------------------------------------------


@dataclass
class Served:
    """A live SGLang server and what it serves now."""

    name: str
    server: SGLangServer
    model_dir: Path
    weights: dict[str, torch.Tensor]  # HF names, as served now (tied lm_head included)
    version: int = 0  # 0: the initial weights (labelled "0" at start, as a joining worker does)
    tied: bool = False
    ready: bool = False  # has answered /health
    dead: bool = False  # killed by a test
    _ref: torch.nn.Module | None = field(default=None, repr=False)
    _ref_version: int = -1

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def label(self) -> str:
        """SGLang's ``weight_version`` for the current weights (asyncrl's labels are the version)."""
        return str(self.version)

    def reference(self) -> torch.nn.Module:
        """A plain transformers model holding :attr:`weights` (the oracle for logprobs)."""
        from transformers import AutoModelForCausalLM

        if self._ref is None:
            self._ref = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
            self._ref.eval()
        if self._ref_version != self.version:
            missing, unexpected = self._ref.load_state_dict(self.weights, strict=False)
            assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
            self._ref_version = self.version
        return self._ref

    def set_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.version, self.weights = version, weights

    async def wait_generating(
        self, min_tokens: int, finished: Callable[[], bool], timeout_s: float = 120.0
    ) -> bool:
        """Wait until one request is running with at least ``min_tokens`` in its KV (prompt plus
        generated), read from SGLang's ``/v1/loads`` (only the tests read it). False if the request
        ``finished()`` first (callers send ``ignore_eos`` so that a random model cannot stop early)."""
        async with httpx.AsyncClient(timeout=10) as http:
            with trio.fail_after(timeout_s):
                while not finished():
                    r = await http.get(self.url + "/v1/loads?include=core")
                    load = r.json()["loads"][0]
                    if load["num_running_reqs"] >= 1 and load["num_used_tokens"] >= min_tokens:
                        return True
                    await trio.sleep(0.01)
        return False


def reference_logprobs(
    model: torch.nn.Module, prompt: list[int], output: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / T) of each output token given everything before it (T=0: unscaled),
    SGLang's definition of the returned behaviour logprob (srt/layers/sampler.py in 0.5.23)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    if temperature > 0:
        logits = logits / temperature
    lp = torch.log_softmax(logits, -1)
    return lp.gather(-1, torch.tensor(output).unsqueeze(-1)).squeeze(-1)


def served_model_dir(served: Served, folder: Path) -> Path:
    """``folder`` made a model folder holding exactly the weights ``served`` holds now (earlier
    tests may have updated them): what the learner must load to compare logprobs with it."""
    import shutil

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for f in served.model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, folder / f.name)
    weights = {
        k: v for k, v in served.weights.items() if not (served.tied and k == "lm_head.weight")
    }
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors")
    return folder


def perturbed(weights: dict[str, torch.Tensor], seed: int, tied: bool) -> dict[str, torch.Tensor]:
    """New weights for a test version: every tensor moved by seeded noise (tied copies kept tied)."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    if tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


# --------------------------------------------------------------------------------------------------
# SGLang's own checksum, recomputed from HF-named tensors (the oracle for /weights_checker)
# --------------------------------------------------------------------------------------------------

_STACKED = {  # SGLang's fused parameters of Llama/Qwen3, in load order (tp 1)
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


VOCAB_PADDING = 64  # SGLang pads embedding and lm_head rows to a multiple of this, with zeros


def sglang_param_tensors(weights: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """HF-named tensors -> SGLang's parameters: q/k/v and gate/up fused by concatenation (tp 1),
    vocabulary rows zero-padded, no lm_head when tied (SGLang shares the embedding)."""
    out: dict[str, torch.Tensor] = {}
    parts = {fused: set(ps) for fused, ps in _STACKED.items()}
    for name, t in weights.items():
        if tied and name == "lm_head.weight":
            continue
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = -(-t.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
            out[name] = torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
            continue
        hit = next(((f, p) for f, ps in parts.items() for p in ps if f".{p}." in name), None)
        if hit is None:
            out[name] = t
            continue
        fused, part = hit
        if part != _STACKED[fused][0]:
            continue
        key = name.replace(f".{part}.", f".{fused}.")
        out[key] = torch.cat(
            [weights[name.replace(f".{part}.", f".{p}.")] for p in _STACKED[fused]]
        )
    return out


def sglang_checksums(weights: dict[str, torch.Tensor], tied: bool) -> tuple[dict[str, str], str]:
    """(per-parameter checksums, per_engine_checksum) as SGLang 0.5.23 computes them on one CPU rank:
    ``sha256(raw bytes)[:8]`` as 16 hex digits per parameter (mm_utils.tensor_hash), then
    ``sha256(name + hex ...)`` over sorted names (per_gpu), then ``sha256(per_gpu)`` (per engine)."""
    per: dict[str, str] = {}
    for name, t in sglang_param_tensors(weights, tied).items():
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        per[name] = hashlib.sha256(raw).digest()[:8].hex()
    h = hashlib.sha256()
    for name in sorted(per):
        h.update(name.encode())
        h.update(per[name].encode())
    per_gpu = h.hexdigest()
    return per, hashlib.sha256(per_gpu.encode()).hexdigest()


def label_at_join(url: str) -> int:
    """What a rollout worker does to a server before it generates on it (GeneratorPool.label):
    a server launched without --weight-version says "default" and is labelled "0". Returns the
    version the pool then holds for it."""

    async def run() -> int | None:
        async with GeneratorPool([url], timeout_s=300) as pool:
            await pool.label()
            return pool.generators[url].version

    v = trio.run(run)
    assert v is not None
    return v


def generate(url: str, params: SamplingParams, prompt: list[int] = PROMPT) -> Completion:
    """One completion through asyncrl's own rollout client (as a worker: labels read first)."""

    async def run() -> Completion:
        async with GeneratorPool([url], timeout_s=300) as pool:
            await pool.label()
            return await pool.generate(prompt, params)

    return trio.run(run)


def healthy(server: SGLangServer, timeout_s: float) -> Iterator[SGLangServer]:
    """A module fixture's body (``yield from healthy(...)``): ``server`` started and healthy, its
    tests failed with SGLang's own words if it never gets there, stopped after them."""
    server.start()
    try:
        server.wait_healthy(timeout_s)
    except SGLangSetupError as e:
        server.stop()
        pytest.fail(str(e), pytrace=False)
    try:
        yield server
    finally:
        server.stop()

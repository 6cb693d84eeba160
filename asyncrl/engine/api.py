"""The built-in engine as one object: the model, its tokenizer, the scheduler that owns the decode
thread, and the weight store. Its endpoints come in two groups over it, the serving ones
(``generate_api``) and the weight ones (``weight_api``), which the server puts together (``server``);
they know this object, not it them. No HTTP here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import torch

from asyncrl import malloc
from asyncrl.engine.batched_model import BatchedLM
from asyncrl.engine.lora_serving import LoraSpec
from asyncrl.engine.replies import BadRequest
from asyncrl.engine.sampling import original_logprob
from asyncrl.engine.scheduler import Scheduler
from asyncrl.engine.weights import WeightStore
from asyncrl.gpu import cuda_uuid, engine_device
from asyncrl.recipe import Dtype


@dataclass
class EngineConfig:
    model: str
    max_batch_size: int = 64
    weight_version: str = "default"
    seed: int = 0
    served_model_name: str | None = None
    # SGLANG_RETURN_ORIGINAL_LOGPROB, read from the environment as SGLang reads it (sampling.py)
    original_logprob: bool = field(default_factory=original_logprob)
    device: str = "cpu"  # auto | cpu | cuda (asyncrl.gpu.engine_device)
    dtype: str = "float32"  # the weights' and KV cache's dtype on CUDA (the recipe's model.dtype)
    # LoRA (the recipe's learner.lora): updates carry adapters, served over the model's weights
    lora_rank: int = 0  # 0: no LoRA, updates carry whole weights
    lora_alpha: float = 16.0
    weights: str | None = None  # served from the start, loaded as /update_weights_from_disk does

    @property
    def lora(self) -> LoraSpec | None:
        return LoraSpec(self.lora_rank, self.lora_alpha) if self.lora_rank else None


def placement(device: str, dtype: str, *, cuda: bool) -> tuple[str, torch.dtype]:
    """Where the engine runs (``"cpu"`` or ``"cuda"``) and in which dtype: on CUDA (``device``
    cuda, or auto with a GPU) in ``dtype``; on CPU in float32 whatever ``dtype`` says, as the engine
    always ran there (its CPU numerics, and the tests that pin them, are float32's). ``cuda``:
    whether torch sees a GPU. ``ValueError`` (one line) for a device or dtype it cannot use."""
    where = engine_device(device, cuda=cuda)
    if dtype not in get_args(Dtype):
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(get_args(Dtype))}")
    return where, torch.float32 if where == "cpu" else getattr(torch, dtype)


@dataclass
class Engine:
    """The loaded model, its scheduler and weight store, and the two groups of endpoints."""

    config: EngineConfig
    tokenizer: Any = None
    hf_model: Any = None
    scheduler: Scheduler = None  # type: ignore[assignment]
    store: WeightStore = None  # type: ignore[assignment]
    _tok_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def load(cls, config: EngineConfig) -> Engine:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(config.model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"--model {config.model}: not a HuggingFace model folder (no config.json)"
            )
        where, dtype = placement(config.device, config.dtype, cuda=torch.cuda.is_available())
        device = torch.device("cuda", torch.cuda.current_device()) if where == "cuda" else "cpu"
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        model.requires_grad_(False)
        lm = BatchedLM(model)
        eos = _eos_ids(model, tok)
        eng = cls(config=config, tokenizer=tok, hf_model=model)
        eng.store = WeightStore(model, eng, receive_buffers=lm.receive_buffers, lora=config.lora)
        eng.scheduler = Scheduler(
            lm,
            eos_ids=eos,
            decode_tail=eng.decode,
            max_batch_size=config.max_batch_size,
            weight_version=config.weight_version,
            seed=config.seed,
            original_logprob=config.original_logprob,
        )
        eng.scheduler.start()
        if config.weights:  # e.g. a restarted worker's engines: the latest export (a PEFT folder)
            try:
                eng.store.load_from_disk(config.weights, version=None, abort_all=False)
            except Exception:
                eng.close()
                raise
        return eng

    def close(self) -> None:
        self.scheduler.stop()

    # ---- helpers ---------------------------------------------------------------------------------

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._tok_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text: str) -> list[int]:
        with self._tok_lock:
            return list(self.tokenizer.encode(text))

    def render_chat(self, messages: list[dict], tools: list[dict] | None, **kwargs: Any) -> str:
        """The prompt text of a chat by the tokenizer's own chat template (its tool format too)."""
        with self._tok_lock:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
            )

    @property
    def device(self) -> torch.device:
        return self.scheduler.lm.device

    @property
    def gpu_uuid(self) -> str | None:
        """The GPU it runs on (None on CPU): what tells a learner on the same GPU (asyncrl.gpu)."""
        return cuda_uuid(self.device.index) if self.device.type == "cuda" else None

    @property
    def context_length(self) -> int:
        return self.scheduler.lm.shape.context

    @property
    def vocab_size(self) -> int:
        return self.scheduler.lm.shape.vocab

    @property
    def served_name(self) -> str:
        return self.config.served_model_name or self.config.model

    @property
    def version(self) -> str:
        return self.scheduler.version

    def call(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run ``fn`` in the decode thread between two steps; 503 when that thread is gone."""
        if not self.scheduler.alive:
            raise BadRequest("engine decode loop is not running", status=503)
        return self.scheduler.call(fn, timeout)

    # ---- what the weight store asks of the decode loop (weights.DecodeLoop) ----------------------

    def swap(self, staged: dict[str, torch.Tensor], version: str | None) -> float:
        lm = self.scheduler.lm
        lm.prepare(staged)  # the fused projections (adopted, or copied in place), not in the swap

        def apply() -> None:
            self.store.apply(staged)
            lm.refresh()

        pause = self.call(lambda: self.scheduler.swap_weights(apply, version))
        malloc.release_freed_memory()  # the previous weights are free now (in this thread, not decode's)
        return pause

    def set_version(self, version: str) -> None:
        self.call(lambda: self.scheduler.set_version(version))

    def abort_all(self) -> None:
        self.call(lambda: self.scheduler.abort())


def _eos_ids(model, tok) -> list[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, list):
            ids.update(x for x in e if isinstance(x, int))
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    return sorted(ids)

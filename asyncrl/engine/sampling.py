"""Sampling parameters with SGLang's names and defaults, and batched sampling with logprobs.

The returned logprob of a token is ``log_softmax(logits / temperature)`` taken before top-k / top-p /
min-p truncation; greedy requests (temperature 0) get the unscaled ``log_softmax(logits)``. That is
SGLang's definition (``srt/layers/sampler.py``), so a learner can treat both engines alike.

SGLang's sampler has a switch, the environment variable ``SGLANG_RETURN_ORIGINAL_LOGPROB``: set, it
reports ``log_softmax(logits)`` before the temperature whatever the temperature (slime's launch
scripts set it). The built-in engine reads the same variable the same way (:func:`original_logprob`),
so that a run, and ``asyncrl doctor``, see what such a server would send: at T != 1 every token then
looks off-policy to a learner that computes log softmax(logits / T).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import torch

from asyncrl.engine.transfer import to_device, to_host

ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


def original_logprob(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is on, as SGLang reads it (``get_bool_env_var``:
    "true" or "1", any case)."""
    return environ.get(ORIGINAL_LOGPROB_ENV, "false").lower() in ("true", "1")


TOP_K_OFF = 1 << 30  # SGLang's default top_k (1073741824): no truncation

# Every key SGLang 0.5.23's schema accepts inside sampling_params, in its order (the 400 text lists them).
SGLANG_KEYS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)

# Keys accepted only at their "off" value: the built-in engine does not implement them, and a request
# that relies on them must fail loudly instead of silently sampling something else.
UNSUPPORTED_UNLESS_OFF = {
    "stop_regex": (None, [], ""),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "custom_params": (None, {}),
    "beam_width": (None, 0, 1),
    "watermark": (None, False),
    "choice": (None, []),
}


class SamplingError(ValueError):
    """A bad ``sampling_params``; ``body`` is the JSON error SGLang would send with HTTP 400."""

    def __init__(self, message: str, *, plain: bool = False):
        super().__init__(message)
        self.body = {"error": message} if plain else {"error": {"message": message}}


@dataclass
class EngineSamplingParams:
    """One request's ``sampling_params`` as the built-in engine reads them: all of SGLang's keys
    it supports, checked by :meth:`parse` (the worker's side sends
    :class:`asyncrl.rollout.sglang_protocol.SamplingParams`)."""

    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_OFF
    min_p: float = 0.0
    min_new_tokens: int = 0
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int = 1
    logit_bias: dict[int, float] = field(default_factory=dict)
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def truncates(self) -> bool:
        return self.top_p < 1.0 or self.top_k < TOP_K_OFF or self.min_p > 0.0

    @classmethod
    def parse(cls, raw: object, *, vocab_size: int) -> EngineSamplingParams:
        """Validate a ``sampling_params`` JSON object; raise :class:`SamplingError` naming the field."""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise SamplingError("sampling_params must be a JSON object")
        unknown = [k for k in raw if k not in SGLANG_KEYS]
        if unknown:
            expected = ", ".join(f"`{k}`" for k in SGLANG_KEYS)
            raise SamplingError(
                f"unknown field `{unknown[0]}`, expected one of {expected}", plain=True
            )
        for k, allowed in UNSUPPORTED_UNLESS_OFF.items():
            if k in raw and raw[k] not in allowed:
                raise SamplingError(f"sampling_params.{k} is not supported by the built-in engine")
        p = cls()
        names = {f.name for f in fields(cls)}
        for k, v in raw.items():
            if k in names and v is not None:
                setattr(p, k, v)
        p._check(raw, vocab_size)
        return p

    def _check(self, raw: dict, vocab_size: int) -> None:
        def need(cond: bool, key: str, what: str) -> None:
            if not cond:
                raise SamplingError(f"sampling_params.{key} must be {what}, got {raw.get(key)!r}")

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: object) -> bool:
            return isinstance(x, int | float) and not isinstance(x, bool)

        need(
            is_int(self.max_new_tokens) and self.max_new_tokens >= 0,
            "max_new_tokens",
            "an int >= 0",
        )
        need(is_num(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]")
        need(
            is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
            "top_k",
            "-1 or an int >= 1",
        )
        if self.top_k == -1:
            self.top_k = TOP_K_OFF
        need(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]")
        need(
            is_int(self.min_new_tokens) and self.min_new_tokens >= 0,
            "min_new_tokens",
            "an int >= 0",
        )
        need(is_int(self.n) and self.n >= 1, "n", "an int >= 1")
        need(
            is_int(self.stream_interval) and self.stream_interval >= 1,
            "stream_interval",
            "an int >= 1",
        )
        for key in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "no_stop_trim",
        ):
            need(isinstance(getattr(self, key), bool), key, "a bool")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        need(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "a non-empty string or a list of them",
        )
        if is_int(self.stop_token_ids):
            self.stop_token_ids = [self.stop_token_ids]
        need(
            isinstance(self.stop_token_ids, list)
            and all(is_int(t) and 0 <= t < vocab_size for t in self.stop_token_ids),
            "stop_token_ids",
            f"a list of token ids in [0, {vocab_size})",
        )
        need(
            self.sampling_seed is None or is_int(self.sampling_seed),
            "sampling_seed",
            "an int or null",
        )
        bias = self.logit_bias
        need(isinstance(bias, dict), "logit_bias", "an object {token_id: bias}")
        try:
            self.logit_bias = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            need(False, "logit_bias", "an object {token_id: bias}")
        need(
            all(0 <= k < vocab_size for k in self.logit_bias),
            "logit_bias",
            f"keyed by token ids in [0, {vocab_size})",
        )
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.min_p = float(self.min_p)


@dataclass
class Sampled:
    """One step's result for every row: token ids, their logprobs, and optional top-k logprobs."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[float, int]] | None]


def sample(
    logits: torch.Tensor,
    params: list[EngineSamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
    *,
    banned: list[list[int] | None] | None = None,
    top_logprobs: list[int] | None = None,
    original: bool = False,
) -> Sampled:
    """Sample one token per row of ``logits [n, vocab]``, vectorised over rows.

    ``generators[i]`` is the row's own generator (requests with ``sampling_seed``), else the engine's
    is used. ``banned[i]`` lists token ids masked out (stop tokens before ``min_new_tokens``).
    ``original``: report the logprobs (and top logprobs) before the temperature
    (``SGLANG_RETURN_ORIGINAL_LOGPROB``); the tokens are drawn at the temperature all the same.
    The host reads the result back once (tokens, logprobs and top logprobs in one transfer,
    ``transfer.to_host``): on CUDA each read is a wait for the device, and it needs all of them
    for its stop checks and the replies.
    """
    n = logits.shape[0]
    dev = logits.device  # the engine's: per-row tensors are made there, and the generators
    logits = logits.float()
    if banned is not None or any(p.logit_bias for p in params):
        logits = logits.clone()
        for i, p in enumerate(params):
            for t, b in p.logit_bias.items():
                logits[i, t] += b
        if banned is not None:
            rows = [i for i, ids in enumerate(banned) if ids for _ in ids]
            cols = [t for ids in banned if ids for t in ids]
            if rows:  # one indexed write for every row, its indices sent in one copy
                idx = to_device(rows + cols, torch.long, dev)
                logits[idx[: len(rows)], idx[len(rows) :]] = float("-inf")
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    scaled = (
        logits
        if all(t == 1.0 for t in temps)
        else logits / to_device(temps, torch.float32, dev)[:, None]
    )
    logp = torch.log_softmax(scaled, dim=-1)
    greedy = [p.greedy for p in params]
    if all(greedy):
        tokens = logits.argmax(dim=-1)
    else:
        probs = logp.exp()
        if any(p.truncates for p in params):
            probs = _truncate(probs, params)
        tokens = torch.multinomial(probs, 1, generator=default_generator)[:, 0]
        for i, g in enumerate(generators):
            if g is not None and not greedy[i]:
                tokens[i] = torch.multinomial(probs[i], 1, generator=g)[0]
        if any(greedy):
            mask = to_device(greedy, torch.bool, dev)
            tokens = torch.where(mask, logits.argmax(dim=-1), tokens)
    reported = torch.log_softmax(logits, dim=-1) if original and scaled is not logits else logp
    chosen = reported.gather(1, tokens[:, None])[:, 0]
    parts = [tokens, chosen]
    if top_logprobs is not None and any(top_logprobs):
        vals, idx = reported.topk(min(max(top_logprobs), reported.shape[1]), dim=-1)
        parts += [vals, idx]
    host = to_host(*parts)
    top: list[list[tuple[float, int]] | None] = [None] * n
    if len(host) > 2:
        vals_l, idx_l = host[2], host[3]
        for i, ki in enumerate(top_logprobs or ()):
            if ki:
                top[i] = list(zip(vals_l[i][:ki], idx_l[i][:ki], strict=True))
    return Sampled(tokens=host[0], logprobs=host[1], top=top)


def _truncate(probs: torch.Tensor, params: list[EngineSamplingParams]) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k, top-p nucleus and min-p floor."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    vocab, dev = probs.shape[1], probs.device
    ks = to_device([min(p.top_k, vocab) for p in params], torch.long, dev)
    ps = to_device([p.top_p for p in params], torch.float32, dev)
    mins = to_device([p.min_p for p in params], torch.float32, dev)
    rank = torch.arange(vocab, device=dev)[None, :]
    keep = rank < ks[:, None]
    cum = sorted_p.cumsum(dim=-1)
    keep &= (cum - sorted_p) < ps[:, None]  # keep a token while the mass before it is < top_p
    keep &= sorted_p >= mins[:, None] * sorted_p[:, :1]
    keep[:, 0] = True
    sorted_p = sorted_p * keep
    out = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    return out / out.sum(dim=-1, keepdim=True)

"""SGLang's ``/generate`` protocol, as asyncrl speaks it: pure, no I/O (docs/design.md §3).

What a request carries (:class:`SamplingParams`, :func:`generate_payload`, :func:`batched_payload`)
and what a response means (:func:`parse_generate_response`): ``output_token_logprobs`` triples give
the token ids and behaviour logprobs, and ``meta_info.weight_versions`` spans give one policy
version per token; with routing replay, ``meta_info.routed_experts`` gives the experts every
position was routed to (:func:`parse_routed_experts`). A token's version is the one its generator
stated, never a guess: a response with a token no numeric span covers (a server that was never
labelled says ``"default"``; SGLang older than 0.5.19 sends no spans) is refused with
:class:`UnlabelledTokens`. A label's format
(:func:`~asyncrl.generator_http.parse_version_label`) is the generator layer's, which the weight
broadcaster's calls share. The built-in engine serves the same protocol, so these functions are
tested on recorded SGLang responses and serve both.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.generator_http import BASE_LABEL, GeneratorError, adapter_name, parse_version_label
from asyncrl.moe import RouteShape, route_problem
from asyncrl.wire import FINISH_REASONS


class GeneratorResponseError(GeneratorError):
    """A ``/generate`` response that does not follow SGLang's schema; the text says which field."""


class UnlabelledTokens(GeneratorResponseError):
    """Tokens whose version the generator did not state as a number: refused, never guessed."""


# --------------------------------------------------------------------------------------------------
# Request
# --------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class SamplingParams:
    """The subset of SGLang ``sampling_params`` a rollout sets. Unknown keys are a 400 in SGLang,
    so only these are ever sent."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # fixed-length generation: benchmarks, and tests that must not stop

    def to_json(self, *, max_new_tokens: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
        }
        if self.stop:
            d["stop"] = list(self.stop)
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if self.ignore_eos:
            d["ignore_eos"] = True
        return d

    @classmethod
    def from_recipe(cls, rollout: Any) -> SamplingParams:
        """From a :class:`asyncrl.recipe.RolloutConfig`."""
        return cls(
            max_new_tokens=rollout.max_new_tokens,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            min_p=rollout.min_p,
            stop=list(rollout.stop),
        )


def generate_payload(
    input_ids: list[int],
    params: SamplingParams,
    *,
    max_new_tokens: int,
    rid: str,
    routed_experts: bool = False,
) -> dict[str, Any]:
    """One non-streaming ``/generate`` request that asks for logprobs; ``rid`` lets it be aborted.
    ``routed_experts``: and for the experts of every position (SGLang's ``return_routed_experts``,
    answered by a server launched with ``--enable-return-routed-experts``; docs/moe.md)."""
    payload: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": params.to_json(max_new_tokens=max_new_tokens),
        "return_logprob": True,
        "stream": False,
        "rid": rid,
    }
    if routed_experts:  # one value for a whole batched body, as SGLang reads it
        payload["return_routed_experts"] = True
    return payload


def with_adapter(payload: dict[str, Any], version: int | None) -> dict[str, Any]:
    """``payload`` served by version ``version``'s LoRA adapter (SGLang's ``lora_path``); version
    0 or unknown: the base model, no adapter."""
    return {**payload, "lora_path": adapter_name(version)} if version else payload


def batched_payload(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """Several requests as one, in SGLang's list form: the per-request fields become lists (the
    rest is the same for all); the response is a list in the same order."""
    per_item = ("input_ids", "sampling_params", "rid")
    return {**payloads[0], **{k: [p[k] for p in payloads] for k in per_item}}


# --------------------------------------------------------------------------------------------------
# Response
# --------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Segment:
    """One ``/generate`` response: the tokens one HTTP request produced."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # stop | length | abort
    matched_stop: int | str | None = None
    abort_message: str = ""
    prompt_tokens: int = 0
    num_retractions: int = 0
    weight_version: int | None = None  # what the generator held when it answered (None: unlabelled)
    # asked with routing replay: the experts of every input position, [positions, moe layers, k]
    routed_experts: np.ndarray | None = None


def version_at_join(label: Any) -> tuple[int, bool]:
    """What a generator holds when a worker joins it: (version, must it be labelled with it first).

    A numeric label is kept (e.g. an SGLang server that outlived a worker's restart holds what the
    broadcaster sent it). ``"default"`` means the weights it was launched with, which must be
    ``model.path``'s (version 0): it is labelled ``"0"`` before anyone generates on it. Any other
    label names weights asyncrl cannot place: refused."""
    v = parse_version_label(label)
    if v is not None:
        return v, False
    if label == BASE_LABEL:
        return 0, True
    raise GeneratorError(
        f"weight_version {label!r} is not a policy version: launch the server with "
        f"--weight-version N, N being the version of its weights (0 for model.path)"
    )


def spans_to_versions(spans: Any, n: int) -> list[int]:
    """``[{"version","start","end"}, ...]`` over output-token indices → one version per token.

    Raises :class:`UnlabelledTokens` when a token has no span with a numeric version (no spans at
    all: SGLang older than 0.5.19) and :class:`GeneratorResponseError` when a span is malformed.
    """
    if n == 0:
        return []
    if spans is None:
        raise UnlabelledTokens(
            "meta_info.weight_versions: missing (SGLang older than 0.5.19 sends no version spans)"
        )
    if not isinstance(spans, list):
        raise GeneratorResponseError("meta_info.weight_versions: expected a list of spans")
    versions: list[int | None] = [None] * n
    for i, s in enumerate(spans):
        if not isinstance(s, dict) or not {"version", "start", "end"} <= s.keys():
            raise GeneratorResponseError(
                f"meta_info.weight_versions[{i}]: expected {{version, start, end}}, got {s!r}"
            )
        start, end = s["start"], s["end"]
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= n):
            raise GeneratorResponseError(
                f"meta_info.weight_versions[{i}]: span [{start}, {end}) is outside [0, {n})"
            )
        v = parse_version_label(s["version"])
        if v is None and start < end:
            raise UnlabelledTokens(
                f"meta_info.weight_versions[{i}]: version {s['version']!r} of tokens "
                f"[{start}, {end}) is not a number (a generator that was never labelled)"
            )
        versions[start:end] = [v] * (end - start)
    if None in versions:
        first = versions.index(None)
        raise UnlabelledTokens(f"meta_info.weight_versions: token {first} of {n} has no span")
    return versions  # type: ignore[return-value]  (no None left)


def parse_finish_reason(fr: Any) -> tuple[str, int | str | None, str]:
    """SGLang's ``finish_reason`` → (stop | length | abort, matched stop, abort message)."""
    if not isinstance(fr, dict) or fr.get("type") not in FINISH_REASONS:
        raise GeneratorResponseError(f"meta_info.finish_reason: unexpected value {fr!r}")
    kind = fr["type"]
    if kind == "abort":
        return kind, None, str(fr.get("message") or "")
    return kind, fr.get("matched"), ""


def _raise_bad_triple(triples: list) -> None:
    """Name the first entry of ``output_token_logprobs`` that is not ``[logprob, token_id, ...]``."""
    for i, t in enumerate(triples):
        if not (isinstance(t, list | tuple) and len(t) >= 2):
            raise GeneratorResponseError(f"meta_info.output_token_logprobs[{i}]: not a triple")
        lp, tok = t[0], t[1]
        if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
            raise GeneratorResponseError(f"meta_info.output_token_logprobs[{i}]: bad token id")
        if not isinstance(lp, int | float) or isinstance(lp, bool) or not math.isfinite(lp):
            raise GeneratorResponseError(
                f"meta_info.output_token_logprobs[{i}]: logprob {lp!r} is not a finite number"
            )
    raise GeneratorResponseError("meta_info.output_token_logprobs: malformed")  # pragma: no cover


def output_token_logprobs(body: Any) -> tuple[list[int], list[float]]:
    """The token ids and behaviour logprobs of one ``/generate`` response, from
    ``meta_info.output_token_logprobs`` (positional triples ``[logprob, token_id, text]``); a
    logprob above 0 (rounding) is read as 0."""
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise GeneratorResponseError("expected an object with meta_info")
    triples = body["meta_info"].get("output_token_logprobs")
    if not isinstance(triples, list):
        raise GeneratorResponseError(
            "meta_info.output_token_logprobs: missing (was return_logprob sent?)"
        )
    try:  # the fast path: a well-formed response (every one, in practice)
        ids = [t[1] for t in triples]
        lps = [float(t[0]) for t in triples]
        ok = all(type(t) is int and t >= 0 for t in ids) and all(map(math.isfinite, lps))
    except (TypeError, IndexError, ValueError):
        ok = False
    if not ok:
        _raise_bad_triple(triples)
    return ids, [lp if lp <= 0.0 else 0.0 for lp in lps]


def parse_routed_experts(meta: dict[str, Any], rows: int, shape: RouteShape) -> np.ndarray:
    """``meta_info.routed_experts`` as SGLang 0.5.23 sends it (docs/moe.md): base64 of int32
    ``[rows, num_hidden_layers, top_k]``, ``rows`` the request's prompt and completion tokens but
    the last; returned as the sample keeps it, its MoE layers' rows in ``shape.dtype``."""
    raw = meta.get("routed_experts")
    if raw is None:
        raise GeneratorResponseError(
            "meta_info.routed_experts: missing (algorithm.routing_replay asks for it: launch "
            "SGLang with --enable-return-routed-experts)"
        )
    if not isinstance(raw, str):
        raise GeneratorResponseError(
            f"meta_info.routed_experts: expected a base64 string, got {type(raw).__name__}"
        )
    try:
        buf = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise GeneratorResponseError("meta_info.routed_experts: not valid base64") from None
    per_row = shape.layers * shape.top_k
    if len(buf) != 4 * rows * per_row:
        raise GeneratorResponseError(
            f"meta_info.routed_experts: {len(buf) / 4:g} int32, but {rows} positions (prompt and "
            f"completion but the last token) of {shape.layers} layers x top-{shape.top_k} make "
            f"{rows * per_row}"
        )
    ids = np.frombuffer(buf, dtype="<i4").reshape(rows, shape.layers, shape.top_k)
    ids = ids[:, list(shape.moe)]
    bad = route_problem(ids, shape)
    if bad is not None:
        raise GeneratorResponseError(f"meta_info.routed_experts: {bad}")
    return ids.astype(shape.dtype)


def parse_generate_response(
    body: Any, *, adapter: int | None = None, routes: RouteShape | None = None
) -> Segment:
    """Parse one non-streaming ``/generate`` response.

    Tokens and logprobs come from ``meta_info.output_token_logprobs``
    (:func:`output_token_logprobs`), checked against ``output_ids``; versions from
    ``meta_info.weight_versions`` (see :func:`spans_to_versions`), or, for a request that named a
    LoRA adapter (:func:`with_adapter`), ``adapter``, the version of that adapter, for every token:
    SGLang serves a request with the adapter it named to its end, while its spans follow the
    server's label, which moves on as soon as the next version's adapter is loaded.
    ``routes``: the model's, when the request asked for its routed experts
    (:func:`parse_routed_experts`; ``meta_info.prompt_tokens`` counts the input).
    """
    if isinstance(body, list):
        if len(body) != 1:
            raise GeneratorResponseError(f"expected one response, got a list of {len(body)}")
        body = body[0]
    ids, lps = output_token_logprobs(body)
    meta = body["meta_info"]
    out_ids = body.get("output_ids")
    if out_ids is not None and list(out_ids) != ids:
        raise GeneratorResponseError(
            f"output_ids ({len(out_ids)} tokens) disagree with meta_info.output_token_logprobs "
            f"({len(ids)} tokens)"
        )
    kind, matched, message = parse_finish_reason(meta.get("finish_reason"))
    prompt_tokens = meta.get("prompt_tokens") or 0
    routed = None
    if routes is not None:
        if not isinstance(prompt_tokens, int) or prompt_tokens < 1:
            raise GeneratorResponseError(
                f"meta_info.prompt_tokens: {prompt_tokens!r}, not a count of input tokens"
            )
        # a request aborted before it was run has no routes: its resumption brings them all
        if "routed_experts" in meta or kind != "abort":
            routed = parse_routed_experts(meta, prompt_tokens + len(ids) - 1, routes)
    return Segment(
        output_ids=ids,
        logprobs=lps,
        versions=[adapter] * len(ids)
        if adapter is not None
        else spans_to_versions(meta.get("weight_versions"), len(ids)),
        finish_reason=kind,
        matched_stop=matched,
        abort_message=message,
        prompt_tokens=int(prompt_tokens),
        num_retractions=int(meta.get("num_retractions") or 0),
        weight_version=parse_version_label(meta.get("weight_version")),
        routed_experts=routed,
    )

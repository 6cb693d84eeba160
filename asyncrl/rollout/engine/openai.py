"""OpenAI-compatible ``/v1/models`` and non-streaming ``/v1/completions``, mapped onto /generate.

Response shapes follow what SGLang 0.5.23 returned (sglang-recorded/inflight_probe.json), including
``metadata.weight_version(s)``; a ``model`` other than the served name is a 404.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from asyncrl.rollout.engine.replies import BadRequest, Reply

if TYPE_CHECKING:
    from asyncrl.rollout.engine.api import Engine


def v1_models(engine: Engine) -> Reply:
    created = int(time.time())
    card = {
        "id": engine.served_name,
        "object": "model",
        "created": created,
        "owned_by": "sglang",
        "root": engine.served_name,
        "parent": None,
        "max_model_len": engine.context_length,
    }
    return Reply(200, {"object": "list", "data": [card]})


def v1_completions(engine: Engine, body: dict) -> Reply:
    """``/v1/completions``, non-streaming: the fields RL clients use, mapped onto /generate."""
    model = body.get("model")
    if model is not None and model != engine.served_name:
        return Reply(
            404,
            {
                "object": "error",
                "message": f"The model `{model}` does not exist.",
                "type": "NotFoundError",
                "param": None,
                "code": 404,
            },
        )
    if body.get("stream"):
        raise BadRequest("stream is not supported on /v1/completions by the built-in engine")
    prompt = body.get("prompt")
    gen: dict[str, Any] = {}
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and isinstance(prompt[0], str)
    ):
        gen["text"] = prompt
    else:
        gen["input_ids"] = prompt
    sp: dict[str, Any] = {"max_new_tokens": body.get("max_tokens", 16)}
    for k in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "n",
    ):
        if body.get(k) is not None:
            sp[k] = body[k]
    if body.get("min_tokens") is not None:
        sp["min_new_tokens"] = body["min_tokens"]
    if body.get("seed") is not None:
        sp["sampling_seed"] = body["seed"]
    gen["sampling_params"] = sp
    n_lp = body.get("logprobs")
    gen["return_logprob"] = n_lp is not None
    if n_lp:
        gen["top_logprobs_num"] = n_lp
    gen["return_text_in_logprobs"] = True
    reply = engine.generation.generate(gen)
    if reply.status != 200:
        return reply
    outs = reply.body if isinstance(reply.body, list) else [reply.body]
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, o in enumerate(outs):
        m = o["meta_info"]
        fin = m["finish_reason"] or {}
        choice: dict[str, Any] = {
            "index": i,
            "text": o["text"],
            "logprobs": None,
            "finish_reason": fin.get("type"),
            "matched_stop": fin.get("matched"),
        }
        if gen["return_logprob"]:
            lps = m["output_token_logprobs"]
            tops = m.get("output_top_logprobs") or [None] * len(lps)
            choice["logprobs"] = {
                "text_offset": [-1] * len(lps),
                "token_logprobs": [x[0] for x in lps],
                "tokens": [x[2] for x in lps],
                "top_logprobs": [
                    {x[2]: x[0]} if t is None else {e[2]: e[0] for e in t}
                    for x, t in zip(lps, tops, strict=True)
                ],
            }
        if body.get("return_token_ids"):
            choice["token_ids"] = o["output_ids"]
        choices.append(choice)
        prompt_tokens += m["prompt_tokens"]
        completion_tokens += m["completion_tokens"]
    last = outs[-1]["meta_info"]
    return Reply(
        200,
        {
            "id": last["id"],
            "object": "text_completion",
            "created": int(time.time()),
            "model": engine.served_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
            },
            "metadata": {
                "weight_version": last["weight_version"],
                "weight_versions": last["weight_versions"],
            },
        },
    )

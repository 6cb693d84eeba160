"""OpenAI-compatible ``/v1/models``, non-streaming ``/v1/completions`` and ``/v1/chat/completions``
(tools, streaming), mapped onto /generate: the same scheduler path, stop rules, logprobs and weight
versions.

Response shapes follow SGLang 0.5.23: what it returned (sglang-recorded/inflight_probe.json) and, for
chat, its OpenAI server (tag v0.5.23: python/sglang/srt/entrypoints/openai/protocol.py and
serving_chat.py), including ``metadata.weight_version(s)`` and its training extensions
(``return_token_ids``, ``return_prompt_token_ids``, ``return_meta_info``); a ``model`` other than the
served name is a 404.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncrl.engine.replies import BadRequest, Reply, is_int
from asyncrl.engine.sampling import EngineSamplingParams, SamplingError
from asyncrl.openai_shapes import finish as _finish
from asyncrl.openai_shapes import tool_call_json as _tool_call_json
from asyncrl.openai_shapes import usage as _usage
from asyncrl.tool_calls import QwenToolCallStream, parse_qwen_tool_calls

if TYPE_CHECKING:
    from asyncrl.engine.api import Engine
    from asyncrl.engine.generate_api import GenerateAPI


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


def v1_completions(api: GenerateAPI, body: dict) -> Reply:
    """``/v1/completions``, non-streaming: the fields RL clients use, mapped onto /generate."""
    engine = api.engine
    _check_model(engine, body)
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
    sp: dict[str, Any] = {"max_new_tokens": body.get("max_tokens", 16), **sampling_params(body)}
    gen["sampling_params"] = sp
    n_lp = body.get("logprobs")
    gen["return_logprob"] = n_lp is not None
    if n_lp:
        gen["top_logprobs_num"] = n_lp
    gen["return_text_in_logprobs"] = True
    reply = api.generate(gen)
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


def _check_model(engine: Engine, body: dict) -> None:
    model = body.get("model")
    if model is not None and model != engine.served_name:
        raise BadRequest(
            f"The model `{model}` does not exist.",
            status=404,
            body=_error(f"The model `{model}` does not exist.", "NotFoundError", 404),
        )


def _error(message: str, type_: str = "BadRequestError", code: int = 400, param=None) -> dict:
    """SGLang's (and OpenAI's) error body."""
    return {"object": "error", "message": message, "type": type_, "param": param, "code": code}


def _bad(message: str, param: str | None = None) -> BadRequest:
    return BadRequest(message, body=_error(message, param=param))


def _rewrap(e: BadRequest) -> BadRequest:
    """A /generate error in the OpenAI error shape, same status."""
    return BadRequest(str(e), status=e.status, body=_error(str(e), code=e.status))


# ---- /v1/chat/completions ------------------------------------------------------------------------

ROLES = ("system", "user", "assistant", "tool", "developer", "function")

# Request keys taken into sampling_params under their own name, where EngineSamplingParams checks
# them (and refuses what the engine cannot do, such as penalties or grammars).
_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "skip_special_tokens",
    "no_stop_trim",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
    "regex",
    "ebnf",
    "stop_regex",
)


def sampling_params(body: dict) -> dict[str, Any]:
    """An OpenAI request's sampling fields as ``/generate``'s ``sampling_params`` (both
    ``/v1/completions`` and ``/v1/chat/completions``): what the engine cannot do is refused there by
    EngineSamplingParams, not dropped here."""
    sp: dict[str, Any] = {k: body[k] for k in _SAMPLING_KEYS if body.get(k) is not None}
    if body.get("min_tokens") is not None:
        sp["min_new_tokens"] = body["min_tokens"]
    if body.get("seed") is not None:
        sp["sampling_seed"] = body["seed"]
    return sp


@dataclass
class ChatRequest:
    """A checked ``/v1/chat/completions`` body: the chat to render and the /generate fields."""

    messages: list[dict]
    tools: list[dict] | None  # None when absent or tool_choice is "none": not shown to the model
    sampling: dict[str, Any]  # sampling_params without max_new_tokens when the client gave none
    max_tokens: int | None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    return_token_ids: bool = False
    return_prompt_token_ids: bool = False
    return_meta_info: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def tool_names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools or []}

    @classmethod
    def parse(cls, body: dict, *, vocab_size: int) -> ChatRequest:
        """Check every field the engine reads; a 400 naming the field otherwise."""

        def flag(key: str) -> bool:
            v = body.get(key, False)
            if not isinstance(v, bool):
                raise _bad(f"`{key}` must be a bool, got {v!r}", key)
            return v

        messages = _messages(body.get("messages"))
        tools = _tools(body.get("tools"))
        choice = body.get("tool_choice")
        if choice is None:
            choice = "auto" if tools else "none"
        if choice == "required" or isinstance(choice, dict):
            if not tools:
                what = "a specific tool" if isinstance(choice, dict) else "required"
                raise _bad(f"Tools cannot be empty if tool choice is set to {what}.", "tool_choice")
            if isinstance(choice, dict):
                name = (choice.get("function") or {}).get("name")
                if name not in {t["function"]["name"] for t in tools}:
                    raise _bad(f"Tool '{name}' not found in tools list.", "tool_choice")
            # SGLang forces these with a grammar; the engine has no constrained decoding
            raise _bad(
                "`tool_choice` 'required' or a named function needs constrained decoding, which "
                "the built-in engine does not have; use 'auto' or 'none'",
                "tool_choice",
            )
        if choice not in ("auto", "none"):
            raise _bad(
                f"`tool_choice` must be 'none', 'auto', 'required' or a function, got {choice!r}",
                "tool_choice",
            )
        fmt = body.get("response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise _bad(
                "`response_format` other than text is not supported by the built-in engine",
                "response_format",
            )
        if body.get("return_hidden_states"):
            raise _bad(
                "`return_hidden_states` is not supported by the built-in engine",
                "return_hidden_states",
            )
        max_tokens = body.get("max_completion_tokens")
        key = "max_completion_tokens"
        if max_tokens is None:
            max_tokens, key = body.get("max_tokens"), "max_tokens"
        if max_tokens is not None and not (is_int(max_tokens) and max_tokens >= 1):
            raise _bad(f"`{key}` must be an int >= 1, got {max_tokens!r}", key)
        sp = sampling_params(body)
        try:
            EngineSamplingParams.parse(
                {**sp, "max_new_tokens": max_tokens or 1}, vocab_size=vocab_size
            )
        except SamplingError as e:
            names = {"min_new_tokens": "min_tokens", "sampling_seed": "seed"}
            bad = next((k for k in sp if f"sampling_params.{k} " in str(e)), None)
            param = names.get(bad, bad) if bad else None
            msg = str(e).replace(f"sampling_params.{bad}", f"`{param}`") if bad else str(e)
            raise _bad(msg, param) from None
        top = body.get("top_logprobs")
        if top is not None and not (is_int(top) and 0 <= top <= 20):
            raise _bad(f"`top_logprobs` must be an int in [0, 20], got {top!r}", "top_logprobs")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise _bad("`stream_options` must be an object", "stream_options")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise _bad("`chat_template_kwargs` must be an object", "chat_template_kwargs")
        req = cls(
            messages=messages,
            tools=tools if choice != "none" else None,
            sampling=sp,
            max_tokens=max_tokens,
            stream=flag("stream"),
            include_usage=bool(opts.get("include_usage")),
            logprobs=flag("logprobs"),
            top_logprobs=top or 0,
            return_token_ids=flag("return_token_ids"),
            return_prompt_token_ids=flag("return_prompt_token_ids"),
            return_meta_info=flag("return_meta_info"),
            template_kwargs=kwargs,
        )
        if req.stream:
            for k in ("return_token_ids", "return_prompt_token_ids", "return_meta_info"):
                if getattr(req, k):  # as SGLang: the ids come with the non-streamed response
                    raise _bad(f"`{k}` is not supported with streaming; set stream=false", k)
        return req


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise _bad("`messages` must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"`messages[{i}]` must be an object with a `role`", "messages")
        if m["role"].lower() not in ROLES:
            raise _bad(
                f"`messages[{i}].role` must be one of {list(ROLES)}, got {m['role']!r}", "messages"
            )
        m = {**m, "role": m["role"].lower()}
        content = m.get("content")
        if isinstance(content, list):  # text parts, joined as SGLang does for string templates
            texts = []
            for part in content:
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise _bad(
                        f"`messages[{i}].content`: only text parts are supported", "messages"
                    )
                texts.append(part["text"])
            m["content"] = " ".join(texts)
        elif content is not None and not isinstance(content, str):
            raise _bad(
                f"`messages[{i}].content` must be a string or a list of text parts", "messages"
            )
        elif content is None and m["role"] == "user":
            raise _bad(f"`messages[{i}].content` is required for a user message", "messages")
        out.append(m)
    return out


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("`tools` must be a list", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (
            isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(fn, dict)
        ):
            raise _bad(f"`tools[{i}]` must be {{'type': 'function', 'function': {{...}}}}", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"`tools[{i}].function.name` must be a non-empty string", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"`tools[{i}].function.parameters` must be a JSON schema object", "tools")
    return tools or None


def _prompt_ids(engine: Engine, req: ChatRequest) -> list[int]:
    try:
        text = engine.render_chat(req.messages, req.tools, **req.template_kwargs)
    except Exception as e:  # the template's own error (jinja, a missing template)
        raise _bad(f"the chat template could not render `messages`: {e}", "messages") from None
    ids = engine.encode(text)
    if not ids:
        raise _bad("the chat template rendered `messages` to an empty prompt", "messages")
    return ids


def _generate_body(engine: Engine, req: ChatRequest, prompt: list[int], *, stream: bool) -> dict:
    room = engine.context_length - len(prompt)
    if room < 1:
        raise _bad(
            f"The input ({len(prompt)} tokens) is longer than the model's context length "
            f"({engine.context_length} tokens).",
            "messages",
        )
    sp = {**req.sampling, "max_new_tokens": req.max_tokens or room}
    return {
        "input_ids": prompt,
        "sampling_params": sp,
        "return_logprob": req.logprobs,
        "top_logprobs_num": req.top_logprobs,
        "return_text_in_logprobs": True,
        "stream": stream,
    }


def v1_chat_completions(api: GenerateAPI, body: dict) -> Reply:
    """``/v1/chat/completions``: the chat rendered by the model's own template, tool calls in
    Qwen's ``<tool_call>`` format parsed into ``tool_calls``; streamed as SSE chunks if asked."""
    engine = api.engine
    _check_model(engine, body)
    req = ChatRequest.parse(body, vocab_size=engine.vocab_size)
    prompt = _prompt_ids(engine, req)
    gen = _generate_body(engine, req, prompt, stream=req.stream)
    model = body.get("model") or engine.served_name
    if req.stream:
        try:
            reqs, _ = api.start(gen)
        except BadRequest as e:
            raise _rewrap(e) from None
        return Reply(stream=_chat_stream(api, req, reqs, model))
    try:
        reply = api.generate(gen)
    except BadRequest as e:
        raise _rewrap(e) from None
    if reply.status != 200:
        msg = (reply.body or {}).get("error", {}).get("message", "generation failed")
        return Reply(reply.status, _error(msg, code=reply.status))
    outs = reply.body if isinstance(reply.body, list) else [reply.body]
    choices = [_choice(engine, req, i, o, prompt) for i, o in enumerate(outs)]
    first = outs[0]["meta_info"]
    return Reply(
        200,
        {
            "id": first["id"],
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": _usage(
                first["prompt_tokens"], sum(o["meta_info"]["completion_tokens"] for o in outs)
            ),
            "metadata": {
                "weight_version": first["weight_version"],
                "weight_versions": first["weight_versions"],
            },
        },
    )


def _logprobs(meta: dict, start: int = 0, end: int | None = None) -> dict:
    """OpenAI's ``{"content": [{token, logprob, bytes, top_logprobs}]}`` for tokens [start, end)."""
    lps = meta["output_token_logprobs"][start:end]
    tops = (meta.get("output_top_logprobs") or [None] * len(meta["output_token_logprobs"]))[
        start:end
    ]

    def entry(lp: float, text: str | None) -> dict:
        text = text or ""
        return {"token": text, "bytes": list(text.encode()), "logprob": lp}

    return {
        "content": [
            {**entry(lp, text), "top_logprobs": [entry(t[0], t[2]) for t in top or []]}
            for (lp, _, text), top in zip(lps, tops, strict=True)
        ]
    }


def _choice(engine: Engine, req: ChatRequest, i: int, out: dict, prompt: list[int]) -> dict:
    meta = out["meta_info"]
    content, calls = out["text"], []
    if req.tools:
        content, calls = parse_qwen_tool_calls(content, req.tool_names)
    reason, matched = _finish(meta["finish_reason"], bool(calls))
    message: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": None}
    if calls:
        message["tool_calls"] = [_tool_call_json(c, k) for k, c in enumerate(calls)]
    choice: dict[str, Any] = {
        "index": i,
        "message": message,
        "logprobs": _logprobs(meta) if req.logprobs else None,
        "finish_reason": reason,
        "matched_stop": matched,
    }
    if req.return_prompt_token_ids or req.return_token_ids:
        choice["prompt_token_ids"] = prompt
    if req.return_token_ids:
        choice["response_token_ids"] = out["output_ids"]
    if req.return_meta_info:
        choice["meta_info"] = meta
    return choice


def _held_stop(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that may be the start of a stop string (not sent yet)."""
    held = 0
    for s in stops:
        for k in range(min(len(text), len(s) - 1), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


def _chat_stream(api: GenerateAPI, req: ChatRequest, reqs: list, model: str) -> Iterator[bytes]:
    """SSE chunks as SGLang sends them: per choice a first ``role`` delta, content and
    ``tool_calls`` deltas, a last chunk with ``finish_reason``; then usage if asked, and [DONE]."""
    stops = req.sampling.get("stop") or []
    stops = [stops] if isinstance(stops, str) else list(stops)
    created = int(time.time())
    rid = reqs[0].rid
    n = len(reqs)
    parsers = [QwenToolCallStream(req.tool_names) if req.tools else None for _ in range(n)]
    text_seen = [""] * n  # text passed to the parser (stop-string prefixes held back)
    tokens_sent = [0] * n  # tokens whose logprobs went out
    calls_sent = [0] * n
    prompt_tokens = completion_tokens = 0

    def chunk(i: int, delta: dict, logprobs=None, reason=None, matched=None) -> bytes:
        body = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": i,
                    "delta": {**delta, "reasoning_content": None},
                    "logprobs": logprobs,
                    "finish_reason": reason,
                    "matched_stop": matched,
                }
            ],
        }
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
    updates = api.updates(reqs)
    try:
        for i, res, final in updates:
            meta = res["meta_info"]
            text = res["text"]
            if not final:
                if text.endswith("\ufffd"):  # a character still incomplete
                    continue
                text = text[: len(text) - _held_stop(text, stops)]
            lp = None
            if req.logprobs and len(meta["output_token_logprobs"]) > tokens_sent[i]:
                lp = _logprobs(meta, tokens_sent[i])
                tokens_sent[i] = len(meta["output_token_logprobs"])
            if parsers[i] is not None:
                content, calls = parsers[i].feed(text, final=final)
            else:
                content, calls = text[len(text_seen[i]) :], []
            text_seen[i] = text
            if content or lp is not None:
                yield chunk(i, {"content": content}, lp)
            for call in calls:
                yield chunk(i, {"tool_calls": [_tool_call_json(call, calls_sent[i])]})
                calls_sent[i] += 1
            if final:
                reason, matched = _finish(meta["finish_reason"], calls_sent[i] > 0)
                code = (meta["finish_reason"] or {}).get("status_code")
                if isinstance(code, int) and code >= 400:
                    err = _error(meta["finish_reason"].get("message", "aborted"), code=code)
                    yield b"data: " + json.dumps({"error": err}).encode() + b"\n\n"
                    break
                yield chunk(i, {}, reason=reason, matched=matched)
                prompt_tokens = meta["prompt_tokens"]
                completion_tokens += meta["completion_tokens"]
        else:
            if req.include_usage:
                usage = {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": _usage(prompt_tokens, completion_tokens),
                }
                yield b"data: " + json.dumps(usage).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        updates.close()

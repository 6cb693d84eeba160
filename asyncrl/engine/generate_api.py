"""The serving endpoints: /generate, health, model info and stats, abort, pause and continue.

JSON in, ``Reply`` out, no HTTP here. Paths, request fields, defaults and response shapes follow
SGLang 0.5.23 (python/sglang/srt/entrypoints/http_server.py, managers/io_struct.py; docs/design.md
§3). Every handler validates its input and answers 4xx with a message naming the field, so a bad
request never reaches the decode loop.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncrl.engine.replies import BadRequest, Reply, is_int
from asyncrl.engine.sampling import EngineSamplingParams, SamplingError
from asyncrl.engine.scheduler import PAUSE_MODES, Request

if TYPE_CHECKING:
    from asyncrl.engine.api import Engine

FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
FLUSH_BUSY = "Cache not flushed: requests are running or queued.\n"


@dataclass
class GenerateAPI:
    """One method per serving endpoint, over the engine's scheduler and tokenizer."""

    engine: Engine

    # ---- /generate -------------------------------------------------------------------------------

    def generate(self, body: Any) -> Reply:
        reqs, batched = self.start(body)
        stream = bool(body.get("stream", False))
        if stream:
            return Reply(stream=self._stream(reqs, batched))
        for r in reqs:
            self._wait(r)
        results = [self._result(r, final=True) for r in reqs]
        if body.get("return_prompt_token_ids"):
            for res, r in zip(results, reqs, strict=True):
                res["prompt_token_ids"] = r.prompt_ids
        for res in results:
            res["meta_info"]["response_sent_to_client_ts"] = time.time()
        for r in reqs:
            code = (r.finish or {}).get("status_code")
            if isinstance(code, int) and code >= 400:
                return Reply(code, {"error": {"message": r.finish["message"]}})
        return Reply(200, results if batched else results[0])

    def _wait(self, r: Request) -> None:
        while not r.done.wait(1.0):
            if not self.engine.scheduler.alive:
                raise BadRequest("engine decode loop stopped", status=500)

    def start(self, body: Any) -> tuple[list[Request], bool]:
        """Check a /generate body and queue its requests: (requests, whether the reply is a list)."""
        reqs, batched = self._parse_generate(body)
        self.engine.scheduler.submit(reqs)
        return reqs, batched

    def updates(self, reqs: list[Request]) -> Iterator[tuple[int, dict, bool]]:
        """(index, result so far, final) of streamed requests as the decode loop reports them; the
        requests still running when the caller stops reading are aborted."""
        pending = {id(r): r for r in reqs}
        index = {id(r): i for i, r in enumerate(reqs)}
        shared = reqs[0].progress
        try:
            while pending:
                try:
                    r, n = shared.get(timeout=1.0)
                except Exception:
                    if not self.engine.scheduler.alive:
                        raise BadRequest("engine decode loop stopped", status=500) from None
                    continue
                if id(r) not in pending:
                    continue
                final = n < 0
                if final:
                    del pending[id(r)]
                yield index[id(r)], self._result(r, final=final, upto=None if final else n), final
        finally:
            if pending:  # the client went away: stop generating for it
                gone = list(pending.values())
                if self.engine.scheduler.alive:
                    self.engine.scheduler.call(lambda: self.engine.scheduler.abort_requests(gone))

    def _stream(self, reqs: list[Request], batched: bool) -> Iterator[bytes]:
        import json

        first = True
        updates = self.updates(reqs)
        try:
            for i, chunk, _ in updates:
                if batched:
                    chunk["index"] = i
                if first:
                    chunk["meta_info"]["response_sent_to_client_ts"] = time.time()
                    first = False
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            updates.close()

    def _parse_generate(self, body: Any) -> tuple[list[Request], bool]:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise BadRequest("exactly one of `text` or `input_ids` must be given")
        if text is not None:
            if isinstance(text, str):
                prompts, batched = [self.engine.encode(text)], False
            elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
                prompts, batched = [self.engine.encode(t) for t in text], True
            else:
                raise BadRequest("`text` must be a string or a non-empty list of strings")
        else:
            if isinstance(ids, list) and ids and all(is_int(t) for t in ids):
                prompts, batched = [list(ids)], False
            elif (
                isinstance(ids, list)
                and ids
                and all(isinstance(s, list) and all(is_int(t) for t in s) for s in ids)
            ):
                prompts, batched = [list(s) for s in ids], True
            else:
                raise BadRequest(
                    "`input_ids` must be a list of token ids or a non-empty list of such lists"
                )
        nb = len(prompts)
        for i, p in enumerate(prompts):
            if not p:
                raise BadRequest(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < self.engine.vocab_size]
            if bad:
                raise BadRequest(
                    f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {self.engine.vocab_size})"
                )

        def per_item(key: str, default: Any) -> list[Any]:
            v = body.get(key, default)
            if batched and isinstance(v, list) and key != "stop":
                if len(v) != nb:
                    raise BadRequest(f"`{key}` has {len(v)} entries for a batch of {nb}")
                return v
            return [v] * nb

        try:
            sps = [
                EngineSamplingParams.parse(sp, vocab_size=self.engine.vocab_size)
                for sp in per_item("sampling_params", None)
            ]
        except SamplingError as e:
            raise BadRequest(str(e), body=e.body) from None
        rids = per_item("rid", None)
        rlp = per_item("return_logprob", False)
        starts = per_item("logprob_start_len", -1)
        tops = per_item("top_logprobs_num", 0)
        rre = per_item("return_routed_experts", False)
        rre_start = per_item("routed_experts_start_len", 0)
        for key, vals, ok in (
            ("rid", rids, lambda v: v is None or isinstance(v, str)),
            ("return_logprob", rlp, lambda v: isinstance(v, bool)),
            ("logprob_start_len", starts, lambda v: is_int(v) and v >= -1),
            ("top_logprobs_num", tops, lambda v: v is None or (is_int(v) and v >= 0)),
            ("return_routed_experts", rre, lambda v: isinstance(v, bool)),
            ("routed_experts_start_len", rre_start, lambda v: is_int(v) and v >= 0),
        ):
            for v in vals:
                if not ok(v):
                    raise BadRequest(f"`{key}` has an invalid value {v!r}")
        if not isinstance(body.get("stream", False), bool):
            raise BadRequest("`stream` must be a bool")
        reqs: list[Request] = []
        shared_q = None
        for i, (p, sp) in enumerate(zip(prompts, sps, strict=True)):
            total = len(p) + sp.max_new_tokens
            if len(p) >= self.engine.context_length:
                raise BadRequest(
                    f"The input ({len(p)} tokens) is longer than the model's context length "
                    f"({self.engine.context_length} tokens)."
                )
            if total > self.engine.context_length:
                raise BadRequest(
                    f"Requested token count exceeds the model's maximum context length of "
                    f"{self.engine.context_length} tokens. You requested a total of {total} tokens: {len(p)} "
                    f"tokens from the input messages and {sp.max_new_tokens} tokens for the completion. "
                    "Please reduce the number of tokens in the input messages or the completion to fit "
                    "within the limit."
                )
            if rre[i] and not self.engine.scheduler.lm.moe_layers:
                raise BadRequest(
                    "`return_routed_experts`: the model has no mixture-of-experts layer"
                )
            if rre[i] and rre_start[i] > len(p):  # SGLang 0.5.23's scheduler refuses it too
                raise BadRequest(
                    f"routed_experts_start_len {rre_start[i]} is higher than the number of input "
                    f"tokens {len(p)}"
                )
            if i < len(starts) and starts[i] >= len(p):
                raise BadRequest(
                    f"logprob_start_len {starts[i]} is not below the prompt length {len(p)}"
                )
            for j in range(sp.n):
                rid = rids[i]
                if rid is not None and sp.n > 1:
                    rid = f"{rid}-{j}"
                r = Request(
                    prompt_ids=p,
                    params=sp,
                    return_logprob=rlp[i],
                    logprob_start_len=starts[i],
                    top_logprobs_num=tops[i] or 0,
                    return_routed_experts=rre[i],
                    routed_experts_start_len=rre_start[i] if rre[i] else 0,
                    stream=bool(body.get("stream", False)),
                    text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
                )
                if rid is not None:
                    r.rid = rid
                if shared_q is None:
                    shared_q = r.progress
                r.progress = shared_q
                reqs.append(r)
        return reqs, batched or len(reqs) > 1

    def _triples(self, lps, ids, with_text: bool) -> list[list]:
        return [
            [lp, t, self.engine.decode([t], False) if with_text else None]
            for lp, t in zip(lps, ids, strict=True)
        ]

    def _tops(self, tops, with_text: bool) -> list:
        return [
            None
            if t is None
            else [[lp, i, self.engine.decode([i], False) if with_text else None] for lp, i in t]
            for t in tops
        ]

    def _result(self, r: Request, *, final: bool, upto: int | None = None) -> dict:
        n = len(r.output_ids) if upto is None else upto
        out_ids = r.output_ids[:n]
        sp = r.params
        text_ids = out_ids
        fin = r.finish if final else None
        if (
            fin
            and fin["type"] == "stop"
            and isinstance(fin["matched"], int)
            and not sp.no_stop_trim
        ):
            text_ids = out_ids[:-1]
        text = self.engine.decode(text_ids, sp.skip_special_tokens)
        if (
            fin
            and fin["type"] == "stop"
            and isinstance(fin["matched"], str)
            and not sp.no_stop_trim
        ):
            at = text.find(fin["matched"])
            if at >= 0:
                text = text[:at]
        spans = r.spans(self.engine.scheduler.version) if final else None
        version = (
            spans[-1]["version"] if spans else (r.final_version or self.engine.scheduler.version)
        )
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": fin,
            "prompt_tokens": len(r.prompt_ids),
            "weight_version": version,
            "num_retractions": r.num_retractions,
        }
        if r.return_logprob:
            with_text = r.text_in_logprobs
            if r.logprob_start_len >= 0 and r.input_logprobs is not None:
                ids = r.prompt_ids[r.logprob_start_len :]
                meta["input_token_logprobs"] = self._triples(r.input_logprobs, ids, with_text)
            else:
                meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = self._triples(r.output_logprobs[:n], out_ids, with_text)
            meta["output_token_logprobs_length"] = n
            if r.top_logprobs_num:
                meta["input_top_logprobs"] = self._tops(r.input_top or [], with_text)
                meta["output_top_logprobs"] = self._tops(r.output_top[:n], with_text)
        meta.update(reasoning_tokens=0, completion_tokens=n, cached_tokens=0)
        if final:
            meta["weight_versions"] = spans
        # SGLang's: base64 of int32 [rows, layers, top_k]; none for a request never run (aborted
        # while waiting), as SGLang collects them only from a request that ran
        if final and r.return_routed_experts and r.routes:
            raw = r.routed_experts().numpy().astype("<i4", copy=False).tobytes()
            meta["routed_experts"] = base64.b64encode(raw).decode("ascii")
        meta.update(cached_tokens_details=None, dp_rank=None)
        if final:
            meta["e2e_latency"] = time.perf_counter() - r.created
        return {"text": text, "output_ids": out_ids, "meta_info": meta}

    # ---- info ------------------------------------------------------------------------------------

    def model_info(self) -> dict:
        cfg = self.engine.hf_model.config
        name = self.engine.served_name
        return {
            "model_path": self.engine.config.model,
            "served_model_name": name,
            "tokenizer_path": self.engine.config.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.engine.scheduler.version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": cfg.model_type,
            "architectures": list(cfg.architectures or [type(self.engine.hf_model).__name__]),
            "engine": "asyncrl",
            "context_length": self.engine.context_length,
            "max_batch_size": self.engine.config.max_batch_size,
            "device": self.engine.device.type,
            **self.stats(),
        }

    def server_info(self) -> dict:
        """SGLang's ``/server_info`` keys that describe this engine to a learner and to
        ``asyncrl doctor``: one rank, no radix cache, and where it runs: ``device`` (as SGLang's
        server arguments name it) and the GPU's UUID, which the broadcaster needs to choose the
        weight group's backend (asyncrl.gpu.needs_gloo)."""
        e = self.engine
        return {
            "engine": "asyncrl",
            "model_path": e.config.model,
            "served_model_name": e.served_name,
            "device": e.device.type,
            "gpu_uuid": e.gpu_uuid,
            "dtype": str(e.scheduler.lm.dtype).removeprefix("torch."),
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "disable_radix_cache": True,
            "max_running_requests": e.config.max_batch_size,
            "context_length": e.context_length,
            # SGLang's server arguments for LoRA: whether weight updates carry adapters
            # (lora_serving.py)
            "enable_lora": bool(e.config.lora_rank),
            "max_lora_rank": e.config.lora_rank or None,
        }

    def stats(self, since: float | None = None) -> dict:
        s = self.engine.scheduler.stats.summary()
        s["running"] = len(self.engine.scheduler.running)
        s["waiting"] = len(self.engine.scheduler.waiting)
        s["paused"] = self.engine.scheduler.paused
        if since is not None:
            s["gaps"] = [list(x) for x in list(self.engine.scheduler.stats.gaps) if x[0] >= since]
        s["now"] = time.time()
        return s

    def health(self) -> Reply:
        return Reply(200 if self.engine.scheduler.alive else 503, None)

    def health_generate(self) -> Reply:
        if not self.engine.scheduler.alive:
            return Reply(503, None)
        if self.engine.scheduler.paused:
            return Reply(200, None)
        r = Request(prompt_ids=[0], params=EngineSamplingParams(max_new_tokens=1, temperature=0.0))
        self.engine.scheduler.submit([r])
        ok = r.done.wait(60.0)
        return Reply(200 if ok else 503, None)

    # ---- control ---------------------------------------------------------------------------------

    def abort_request(self, body: dict) -> Reply:
        rid = body.get("rid")
        if body.get("abort_all", False):
            rid = None
        elif not isinstance(rid, str):
            raise BadRequest("`rid` must be a string (or send abort_all: true)")
        self.engine.call(lambda: self.engine.scheduler.abort(rid))
        return Reply(200, None)

    def flush_cache(self) -> Reply:
        busy = self.engine.call(self.engine.scheduler.n_resident)
        return Reply(400, FLUSH_BUSY) if busy else Reply(200, FLUSH_OK)

    def pause_generation(self, body: dict) -> Reply:
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"`mode` must be one of {list(PAUSE_MODES)}, got {mode!r}")
        self.engine.call(lambda: self.engine.scheduler.pause(mode))
        return Reply(200, {"message": "Generation paused successfully.", "status": "ok"})

    def continue_generation(self, body: dict) -> Reply:
        self.engine.call(self.engine.scheduler.resume)
        return Reply(200, {"message": "Generation continued successfully.", "status": "ok"})

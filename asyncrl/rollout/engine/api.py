"""The engine's endpoints as plain functions: JSON in, ``Reply`` out, no HTTP here.

Paths, request fields, defaults and response shapes follow SGLang 0.5.23
(python/sglang/srt/entrypoints/http_server.py, managers/io_struct.py; docs/design.md §3). Every handler validates its input and answers 4xx with a message naming the field, so a bad
request never reaches the decode loop.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncrl import malloc
from asyncrl.rollout.engine.model import BatchedLM
from asyncrl.rollout.engine.replies import BadRequest, Reply
from asyncrl.rollout.engine.sampling import EngineSamplingParams, SamplingError
from asyncrl.rollout.engine.scheduler import PAUSE_MODES, Request, Scheduler
from asyncrl.rollout.engine.weights import WeightError, WeightStore
from asyncrl.weights import buckets
from asyncrl.weights.buckets import parse_dtype

FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
FLUSH_BUSY = "Cache not flushed: requests are running or queued.\n"
NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Pause with mode 'retract' first, or send flush_cache: false."
)
NO_SESSION = (
    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
)


@dataclass
class EngineConfig:
    model: str
    max_batch_size: int = 64
    weight_version: str = "default"
    seed: int = 0
    served_model_name: str | None = None


@dataclass
class Engine:
    """The loaded model, its scheduler and weight store, and one method per endpoint."""

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
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.requires_grad_(False)
        lm = BatchedLM(model)
        eos = _eos_ids(model, tok)
        eng = cls(config=config, tokenizer=tok, hf_model=model)
        eng.store = WeightStore(model)
        eng.scheduler = Scheduler(
            lm,
            eos_ids=eos,
            decode_tail=eng.decode,
            max_batch_size=config.max_batch_size,
            weight_version=config.weight_version,
            seed=config.seed,
        )
        eng.scheduler.start()
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

    @property
    def context_length(self) -> int:
        return self.scheduler.lm.shape.context

    @property
    def vocab_size(self) -> int:
        return self.scheduler.lm.shape.vocab

    def _call(self, fn, timeout: float = 60.0):
        if not self.scheduler.alive:
            raise BadRequest("engine decode loop is not running", status=503)
        return self.scheduler.call(fn, timeout)

    # ---- /generate -------------------------------------------------------------------------------

    def generate(self, body: Any) -> Reply:
        reqs, batched = self._parse_generate(body)
        stream = bool(body.get("stream", False))
        self.scheduler.submit(reqs)
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
            if not self.scheduler.alive:
                raise BadRequest("engine decode loop stopped", status=500)

    def _stream(self, reqs: list[Request], batched: bool) -> Iterator[bytes]:
        import json

        pending = {id(r): r for r in reqs}
        index = {id(r): i for i, r in enumerate(reqs)}
        shared = reqs[0].progress
        first = True
        try:
            while pending:
                try:
                    r, n = shared.get(timeout=1.0)
                except Exception:
                    if not self.scheduler.alive:
                        raise BadRequest("engine decode loop stopped", status=500) from None
                    continue
                if id(r) not in pending:
                    continue
                final = n < 0
                if final:
                    del pending[id(r)]
                chunk = self._result(r, final=final, upto=None if final else n)
                if batched:
                    chunk["index"] = index[id(r)]
                if first:
                    chunk["meta_info"]["response_sent_to_client_ts"] = time.time()
                    first = False
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            if pending:  # the client went away: stop generating for it
                gone = list(pending.values())
                if self.scheduler.alive:
                    self.scheduler.call(lambda: self.scheduler.abort_requests(gone))

    def _parse_generate(self, body: Any) -> tuple[list[Request], bool]:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise BadRequest("exactly one of `text` or `input_ids` must be given")
        if text is not None:
            if isinstance(text, str):
                prompts, batched = [self.encode(text)], False
            elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
                prompts, batched = [self.encode(t) for t in text], True
            else:
                raise BadRequest("`text` must be a string or a non-empty list of strings")
        else:
            if isinstance(ids, list) and ids and all(_is_int(t) for t in ids):
                prompts, batched = [list(ids)], False
            elif (
                isinstance(ids, list)
                and ids
                and all(isinstance(s, list) and all(_is_int(t) for t in s) for s in ids)
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
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise BadRequest(
                    f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
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
                EngineSamplingParams.parse(sp, vocab_size=self.vocab_size)
                for sp in per_item("sampling_params", None)
            ]
        except SamplingError as e:
            raise BadRequest(str(e), body=e.body) from None
        rids = per_item("rid", None)
        rlp = per_item("return_logprob", False)
        starts = per_item("logprob_start_len", -1)
        tops = per_item("top_logprobs_num", 0)
        for key, vals, ok in (
            ("rid", rids, lambda v: v is None or isinstance(v, str)),
            ("return_logprob", rlp, lambda v: isinstance(v, bool)),
            ("logprob_start_len", starts, lambda v: _is_int(v) and v >= -1),
            ("top_logprobs_num", tops, lambda v: v is None or (_is_int(v) and v >= 0)),
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
            if len(p) >= self.context_length:
                raise BadRequest(
                    f"The input ({len(p)} tokens) is longer than the model's context length "
                    f"({self.context_length} tokens)."
                )
            if total > self.context_length:
                raise BadRequest(
                    f"Requested token count exceeds the model's maximum context length of "
                    f"{self.context_length} tokens. You requested a total of {total} tokens: {len(p)} "
                    f"tokens from the input messages and {sp.max_new_tokens} tokens for the completion. "
                    "Please reduce the number of tokens in the input messages or the completion to fit "
                    "within the limit."
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
            [lp, t, self.decode([t], False) if with_text else None]
            for lp, t in zip(lps, ids, strict=True)
        ]

    def _tops(self, tops, with_text: bool) -> list:
        return [
            None
            if t is None
            else [[lp, i, self.decode([i], False) if with_text else None] for lp, i in t]
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
        text = self.decode(text_ids, sp.skip_special_tokens)
        if (
            fin
            and fin["type"] == "stop"
            and isinstance(fin["matched"], str)
            and not sp.no_stop_trim
        ):
            at = text.find(fin["matched"])
            if at >= 0:
                text = text[:at]
        spans = r.spans(self.scheduler.version) if final else None
        version = spans[-1]["version"] if spans else (r.final_version or self.scheduler.version)
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
        meta.update(cached_tokens_details=None, dp_rank=None)
        if final:
            meta["e2e_latency"] = time.perf_counter() - r.created
        return {"text": text, "output_ids": out_ids, "meta_info": meta}

    @property
    def served_name(self) -> str:
        return self.config.served_model_name or self.config.model

    # ---- info ------------------------------------------------------------------------------------

    def model_info(self) -> dict:
        cfg = self.hf_model.config
        name = self.served_name
        return {
            "model_path": self.config.model,
            "served_model_name": name,
            "tokenizer_path": self.config.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.scheduler.version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": cfg.model_type,
            "architectures": list(cfg.architectures or [type(self.hf_model).__name__]),
            "engine": "asyncrl",
            "context_length": self.context_length,
            "max_batch_size": self.config.max_batch_size,
            **self.stats(),
        }

    def stats(self, since: float | None = None) -> dict:
        s = self.scheduler.stats.summary()
        s["running"] = len(self.scheduler.running)
        s["waiting"] = len(self.scheduler.waiting)
        s["paused"] = self.scheduler.paused
        if since is not None:
            s["gaps"] = [list(x) for x in list(self.scheduler.stats.gaps) if x[0] >= since]
        s["now"] = time.time()
        return s

    def health(self) -> Reply:
        return Reply(200 if self.scheduler.alive else 503, None)

    def health_generate(self) -> Reply:
        if not self.scheduler.alive:
            return Reply(503, None)
        if self.scheduler.paused:
            return Reply(200, None)
        r = Request(prompt_ids=[0], params=EngineSamplingParams(max_new_tokens=1, temperature=0.0))
        self.scheduler.submit([r])
        ok = r.done.wait(60.0)
        return Reply(200 if ok else 503, None)

    # ---- control ---------------------------------------------------------------------------------

    def abort_request(self, body: dict) -> Reply:
        rid = body.get("rid")
        if body.get("abort_all", False):
            rid = None
        elif not isinstance(rid, str):
            raise BadRequest("`rid` must be a string (or send abort_all: true)")
        self._call(lambda: self.scheduler.abort(rid))
        return Reply(200, None)

    def flush_cache(self) -> Reply:
        busy = self._call(self.scheduler.n_resident)
        return Reply(400, FLUSH_BUSY) if busy else Reply(200, FLUSH_OK)

    def pause_generation(self, body: dict) -> Reply:
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"`mode` must be one of {list(PAUSE_MODES)}, got {mode!r}")
        self._call(lambda: self.scheduler.pause(mode))
        return Reply(200, {"message": "Generation paused successfully.", "status": "ok"})

    def continue_generation(self, body: dict) -> Reply:
        self._call(self.scheduler.resume)
        return Reply(200, {"message": "Generation continued successfully.", "status": "ok"})

    # ---- weights ---------------------------------------------------------------------------------

    def init_weights_update_group(self, body: dict) -> Reply:
        try:
            kw = dict(
                master_address=_field(body, "master_address", str),
                master_port=int(_field(body, "master_port", (int, str))),
                rank_offset=_field(body, "rank_offset", int),
                world_size=_field(body, "world_size", int),
                group_name=_field(body, "group_name", str, "weight_update_group"),
                backend=_field(body, "backend", str, "nccl"),
                # asyncrl's extension (SGLang ignores unknown keys): the group's collective timeout,
                # so a peer that dies mid-broadcast frees this engine within the trainer's bound
                timeout_s=float(_field(body, "timeout_s", (int, float), 300.0)),
            )
            if not kw["timeout_s"] > 0:
                raise ValueError(f"timeout_s must be > 0, got {kw['timeout_s']}")
        except (BadRequest, ValueError) as e:
            return _fail(f"Failed to initialize custom process group: {e}.")
        if kw["backend"] == "nccl" and not torch.cuda.is_available():
            # the CPU engine cannot join NCCL; gloo speaks the same rendezvous (the trainer must too)
            print(
                "asyncrl engine: 'nccl' requested without CUDA; joining with gloo", file=sys.stderr
            )
            kw["backend"] = "gloo"
        if not 0 < kw["rank_offset"] < kw["world_size"]:
            return _fail(
                f"Failed to initialize custom process group: rank_offset {kw['rank_offset']} must be in [1, world_size)."
            )
        try:
            self.store.init_group(**kw)
        except Exception as e:
            return _fail(f"Failed to initialize custom process group: {e}.")
        with self.store.lock:
            if self.store.session_open:
                # A new group is a new (or restarted) learner: a session the old one left open (it
                # was killed mid-update) is abandoned, or every begin would fail from now on.
                print(
                    "asyncrl engine: new group; abandoning an open update session", file=sys.stderr
                )
                self.store.session_open = False
                self.store.staged.clear()
                self.store.pending_version = None
        return _ok("Succeeded to initialize custom process group.")

    def destroy_weights_update_group(self, body: dict) -> Reply:
        try:
            self.store.destroy_group(body.get("group_name", "weight_update_group"))
        except WeightError as e:
            return _fail(f"Failed to destroy custom process group: {e}.")
        return _ok("Succeeded to destroy custom process group.")

    def begin_weight_update(self, body: dict) -> Reply:
        with self.store.lock:
            if self.store.session_open:
                return _fail("a weight-update session is already open")
            self.store.session_open = True
            self.store.staged.clear()
            self.store.pending_version = None
        return _ok("Success")

    def end_weight_update(self, body: dict) -> Reply:
        with self.store.lock:
            if not self.store.session_open:
                return _fail("no weight-update session is open (call begin_weight_update first)")
            staged, version = self.store.take_staged()
            self.store.session_open = False
            pause = self._swap(staged, version)
        return Reply(
            200,
            {
                "success": True,
                "message": "Success",
                "pause_s": pause,
                "swap_ts": self.scheduler.stats.last_swap_ts,
                "weight_version": self.scheduler.version,
            },
        )

    def _swap(self, staged: dict, version: str | None) -> float:
        if not staged and version is None:
            return 0.0
        lm = self.scheduler.lm
        lm.prepare(staged)  # the fused projections' copy (in place), here rather than in the swap

        def apply() -> None:
            self.store.apply(staged)
            lm.refresh()

        pause = self._call(lambda: self.scheduler.swap_weights(apply, version))
        malloc.release_freed_memory()  # the previous weights are free now (in this thread, not decode's)
        return pause

    def update_weights_from_distributed(self, body: dict) -> Reply:
        try:
            if "names" in body:
                names, dtypes, shapes = body["names"], body.get("dtypes"), body.get("shapes")
            else:  # the pre-list form: one tensor
                names, dtypes, shapes = [body.get("name")], [body.get("dtype")], [body.get("shape")]
            if not (
                isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            ):
                raise BadRequest("`names`, `dtypes` and `shapes` must be lists")
            if not len(names) == len(dtypes) == len(shapes) or not names:
                raise BadRequest(
                    "`names`, `dtypes` and `shapes` must be non-empty and of equal length"
                )
            if not all(isinstance(n, str) for n in names):
                raise BadRequest("`names` must be strings")
            dts = [parse_dtype(d) if isinstance(d, str) else None for d in dtypes]
            if None in dts:
                raise BadRequest('`dtypes` must be torch dtype names such as "float32"')
            if not all(
                isinstance(s, list) and all(_is_int(x) and x >= 0 for x in s) for s in shapes
            ):
                raise BadRequest("`shapes` must be lists of non-negative ints")
            group = body.get("group_name", "weight_update_group")
            load_format = body.get("load_format")
            if load_format not in (None, "flattened_bucket"):
                raise BadRequest(
                    f'load_format {load_format!r} is not supported (None or "flattened_bucket")'
                )
            version = body.get("weight_version")
            if version is not None and not isinstance(version, str):
                raise BadRequest("`weight_version` must be a string")
        except (BadRequest, ValueError) as e:
            return _fail(str(e))
        with self.store.lock:
            if not self.store.session_open:
                return _fail(NO_SESSION)  # nothing was received: the trainer must not broadcast
            if group not in self.store.groups:
                return _fail(
                    f"no weight-update group named {group!r}; call init_weights_update_group first"
                )
            if body.get("abort_all_requests", False):
                self._call(lambda: self.scheduler.abort())
            try:
                named = self.store.receive_distributed(
                    names=names,
                    dtypes=dts,
                    shapes=shapes,
                    group_name=group,
                    load_format=load_format,
                )
                self.store.stage(named)
            except Exception as e:
                # unlike SGLang (which is left partially updated), nothing was swapped in yet: drop
                # the whole session's staging so the engine keeps serving one consistent version
                self.store.staged.clear()
                self.store.pending_version = None
                self.store.session_open = False
                return _fail(
                    f"Failed to update parameter online: {e}. The staged update was discarded and the "
                    f"weight-update session closed; still serving version {self.scheduler.version}."
                )
            if version is not None:
                self.store.pending_version = version
        msg = "Succeeded to update parameter online."
        if version is not None:
            msg += f" Weight version updated to {version}."
        if body.get("flush_cache", True) and self._call(self.scheduler.n_resident):
            return _fail(NOT_FLUSHED)
        return _ok(msg)

    def update_weights_from_disk(self, body: dict) -> Reply:
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            return _fail("`model_path` (a string) is required", num_paused_requests=0)
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            return _fail("`weight_version` must be a string", num_paused_requests=0)
        if not Path(path).exists():
            return _fail(
                f"Failed to update model weights: {path} does not exist.", num_paused_requests=0
            )
        with self.store.lock:
            saved, self.store.staged = self.store.staged, {}
            try:
                self.store.stage(self.store.load_disk(path))
                staged = self.store.staged
            except Exception as e:
                return _fail(f"Failed to update model weights: {e}.", num_paused_requests=0)
            finally:
                self.store.staged = saved
            if body.get("abort_all_requests", False):
                self._call(lambda: self.scheduler.abort())
            pause = self._swap(staged, version)
        msg = "Succeeded to update model weights."
        if version is not None:
            msg += f" Weight version updated to {version}."
        return Reply(
            200, {"success": True, "message": msg, "num_paused_requests": 0, "pause_s": pause}
        )

    def update_weight_version(self, body: dict) -> Reply:
        new = body.get("new_version")
        if not isinstance(new, str) or not new:
            raise BadRequest("`new_version` (a string) is required")
        if body.get("abort_all_requests", True):
            self._call(lambda: self.scheduler.abort())
        with self.store.lock:
            if self.store.session_open and self.store.staged:
                self.store.pending_version = (
                    new  # labels the staged weights when they are swapped in
                )
            else:
                self._call(lambda: self.scheduler.set_version(new))
        return Reply(
            200,
            {"success": True, "message": f"Weight version updated to {new}", "new_version": new},
        )

    def get_weights_by_name(self, body: dict) -> Reply:
        name = body.get("name")
        size = body.get("truncate_size", 100)
        if not isinstance(name, str):
            raise BadRequest("`name` (a string) is required")
        try:
            size = int(size)
            return Reply(200, self.store.get(name, size))
        except (WeightError, ValueError) as e:
            raise BadRequest(str(e)) from None

    def weights_checker(self, body: dict) -> Reply:
        action = body.get("action", "checksum")
        if action != "checksum":
            return _fail(
                f'action {action!r} is not supported by the built-in engine (only "checksum")'
            )
        skip = body.get("skip_tensor_list") or []
        sample = body.get("sample", 0)
        if not isinstance(sample, int) or isinstance(sample, bool) or sample < 0:
            raise BadRequest("`sample` must be an integer >= 0 (values hashed per tensor; 0: all)")
        # take the tensor references between two steps (one consistent version), hash them here:
        # a swap re-points parameters and never writes into a tensor, so these stay intact
        named = self._call(self.store.named)
        h = buckets.checksum(((n, t) for n, t in named if n not in set(skip)), sample=sample)
        return Reply(
            200,
            {
                "success": True,
                "message": "checksum over HF-named parameters (asyncrl.weights.buckets.checksum)",
                "checksum": h,
                "per_engine_checksum": [h],
                "weight_version": self.scheduler.version,
            },
        )


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


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _field(body: dict, key: str, typ, default: Any = ...) -> Any:
    if key not in body:
        if default is ...:
            raise BadRequest(f"`{key}` is required")
        return default
    v = body[key]
    if not isinstance(v, typ) or isinstance(v, bool):
        raise BadRequest(f"`{key}` has the wrong type ({type(v).__name__})")
    return v


def _ok(message: str) -> Reply:
    return Reply(200, {"success": True, "message": message})


def _fail(message: str, status: int = 400, **extra) -> Reply:
    return Reply(status, {"success": False, "message": message, **extra})

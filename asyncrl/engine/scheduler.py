"""The continuous-batching decode loop: one thread owns the model, the KV cache and every request.

HTTP threads only enqueue requests and commands (``Scheduler.call(fn)`` runs ``fn`` in the decode thread
between two steps and returns its result), then wait on events. So there is no lock around torch
state, a weight swap is exactly "between two decode steps", and pause / abort / retract are simple
list operations on the loop's own state.

Each loop iteration: run pending commands; if not paused, admit waiting requests into free cache rows
(one batched prefill, which also samples their first token); then one decode step for every running
request. Finished requests leave their row at once, so a newcomer joins at the next step.
"""

from __future__ import annotations

import collections
import queue
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, get_args

import torch

from asyncrl.engine.batched_model import BatchedLM
from asyncrl.engine.sampling import EngineSamplingParams, sample
from asyncrl.engine.transfer import to_device, to_host
from asyncrl.recipe import PauseMode

# "abort" is SGLang's third mode; the recipe offers only the two that keep the work.
PAUSE_MODES: tuple[str, ...] = ("abort", *get_args(PauseMode))


@dataclass
class Request:
    """One sequence being generated, and everything its response needs."""

    prompt_ids: list[int]
    params: EngineSamplingParams
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    # SGLang's return_routed_experts: record the experts each position chose in every MoE layer
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    stream: bool = False
    created: float = field(default_factory=time.perf_counter)
    # state, written by the decode thread only
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    input_top: list[list[tuple[float, int]] | None] | None = None
    finish: dict | None = None
    text_end: int | None = None  # characters of the decoded text to keep (stop-string trim)
    version_events: list[tuple[str, int]] = field(default_factory=list)
    final_version: str | None = None
    num_retractions: int = 0
    cache_len: int = 0  # positions of prompt+output held in the KV cache
    generator: torch.Generator | None = None
    done: threading.Event = field(default_factory=threading.Event)
    text_in_logprobs: bool = False
    progress: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # (req, n tokens | -1)
    # the experts each fed position chose, int32 ``[positions, num_hidden_layers, top_k]`` chunks
    routes: list[torch.Tensor] = field(default_factory=list)

    def routed_experts(self) -> torch.Tensor:
        """SGLang's ``routed_experts`` rows: every position fed to the model, the prompt and each
        sampled token but the last (never fed), from ``routed_experts_start_len`` on
        (``[start, prompt + completion - 1)``, as SGLang 0.5.23's ``get_topk``)."""
        n = len(self.prompt_ids) + len(self.output_ids) - 1
        return torch.cat(self.routes)[: max(n, 0)][self.routed_experts_start_len :]

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def spans(self, current: str) -> list[dict]:
        """``weight_versions``: which weights produced output tokens ``[start, end)``."""
        spans: list[dict] = []
        start = 0
        for version, pos in self.version_events:
            if pos > start:
                spans.append({"version": version, "start": start, "end": pos})
                start = pos
        end = len(self.output_ids)
        last = self.final_version or current
        if end > start:
            spans.append({"version": last, "start": start, "end": end})
        # merge neighbours that carry the same label (a version set twice without tokens between)
        merged: list[dict] = []
        for s in spans:
            if merged and merged[-1]["version"] == s["version"] and merged[-1]["end"] == s["start"]:
                merged[-1]["end"] = s["end"]
            else:
                merged.append(s)
        return merged


@dataclass
class StepStats:
    """Decode-step timing, to show that a weight swap does not stall generation."""

    gaps: collections.deque = field(default_factory=lambda: collections.deque(maxlen=8192))
    steps: int = 0
    tokens: int = 0
    last_step_end: float | None = None
    last_step_cpu: float = 0.0
    last_update_pause_s: float = 0.0
    last_swap_ts: float | None = None  # wall clock of the last weight swap
    max_update_pause_s: float = 0.0
    updates: int = 0

    def summary(self) -> dict:
        g = [x for _, x, _ in self.gaps]
        return {
            "decode_steps": self.steps,
            "generated_tokens": self.tokens,
            "step_gap_median_s": statistics.median(g) if g else None,
            "step_gap_max_s": max(g) if g else None,
            "weight_swaps": self.updates,
            "last_update_pause_s": self.last_update_pause_s,
            "last_swap_ts": self.last_swap_ts,
            "max_update_pause_s": self.max_update_pause_s,
        }


class Scheduler:
    """Owns the model and runs the decode loop in its own thread."""

    def __init__(
        self,
        lm: BatchedLM,
        *,
        eos_ids: list[int],
        decode_tail: Callable[[list[int]], str],
        max_batch_size: int = 64,
        max_prefill_tokens: int = 8192,
        weight_version: str = "default",
        seed: int = 0,
        original_logprob: bool = False,
    ):
        self.lm = lm
        self.original_logprob = original_logprob  # SGLANG_RETURN_ORIGINAL_LOGPROB (sampling.py)
        self.eos_ids = set(eos_ids)
        self.decode_tail = decode_tail
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.version = weight_version
        # on the model's device: torch.multinomial draws with a generator of the tensor's device
        self.generator = torch.Generator(lm.device).manual_seed(seed)
        self.cache = lm.new_cache(slots=min(8, max_batch_size))
        self.running: list[Request] = []  # row i of the cache belongs to running[i]
        self.waiting: collections.deque[Request] = collections.deque()
        self.paused: str | None = None
        self.stats = StepStats()
        self._incoming: collections.deque[Request] = collections.deque()
        self._commands: collections.deque[tuple[Callable[[], Any], _Future]] = collections.deque()
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine-decode", daemon=True)
        self.error: BaseException | None = None

    # ---- called from other threads -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, reqs: list[Request]) -> None:
        with self._wake:
            self._incoming.extend(reqs)
            self._wake.notify_all()

    def call(self, fn: Callable[[], Any], timeout: float | None = 60.0) -> Any:
        """Run ``fn`` in the decode thread between two steps; return its result or raise its error."""
        fut = _Future()
        with self._wake:
            self._commands.append((fn, fut))
            self._wake.notify_all()
        return fut.result(timeout)

    # ---- decode-thread-only state changes (use via ``call``) -------------------------------------

    def n_resident(self) -> int:
        """Requests running or queued (what makes SGLang refuse to flush its cache)."""
        waiting = 0 if self.paused == "retract" else len(self.waiting)
        return len(self.running) + waiting

    def set_version(self, new: str) -> None:
        """Stamp every live request with the outgoing version at its current length."""
        if new == self.version:
            return
        for r in self._live():
            r.version_events.append((self.version, len(r.output_ids)))
        self.version = new

    def swap_weights(self, apply: Callable[[], None], new_version: str | None) -> float:
        """Install staged weights (``apply``) and bump the version; return the pause it caused (s)."""
        t0 = time.perf_counter()
        apply()
        if new_version is not None:
            self.set_version(new_version)
        pause = time.perf_counter() - t0
        self.stats.last_swap_ts = time.time()
        self.stats.last_update_pause_s = pause
        self.stats.max_update_pause_s = max(self.stats.max_update_pause_s, pause)
        self.stats.updates += 1
        return pause

    def abort(self, rid: str | None = None, *, message: str = "Aborted") -> int:
        """Abort requests whose rid starts with ``rid`` (all when None); partial output is kept."""
        gone = set()
        for r in self.running:
            if rid is None or r.rid.startswith(rid):
                self._finish(
                    r, {"type": "abort", "message": message, "status_code": None, "err_type": None}
                )
                gone.add(id(r))
        self._drop(gone)
        n = len(gone)
        self._take_incoming()
        still = collections.deque()
        for r in self.waiting:
            if rid is None or r.rid.startswith(rid):
                msg = "Abort in waiting queue" if message == "Aborted" else message
                self._finish(
                    r, {"type": "abort", "message": msg, "status_code": None, "err_type": None}
                )
                n += 1
            else:
                still.append(r)
        self.waiting = still
        return n

    def abort_requests(self, reqs: list[Request]) -> None:
        """Abort these exact requests (a streaming client went away); rids may be shared."""
        ids = {id(r) for r in reqs}
        reason = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        gone = {id(r) for r in self.running if id(r) in ids}
        self._take_incoming()
        for r in reqs:
            if r.finish is None:
                self._finish(r, dict(reason))
        self._drop(gone)
        self.waiting = collections.deque(r for r in self.waiting if id(r) not in ids)

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        if mode == "abort":
            self.abort()
        elif mode == "retract":
            retracted = list(self.running)
            for r in retracted:
                r.num_retractions += 1
                r.cache_len = 0
            self.running = []
            self.waiting.extendleft(reversed(retracted))
        self.paused = mode

    def resume(self) -> None:
        self.paused = None

    # ---- the loop --------------------------------------------------------------------------------

    def _live(self) -> list[Request]:
        self._take_incoming()
        return list(self.running) + list(self.waiting)

    def _take_incoming(self) -> None:
        with self._wake:
            while self._incoming:
                r = self._incoming.popleft()
                if r.params.sampling_seed is not None:
                    r.generator = torch.Generator(self.lm.device).manual_seed(
                        r.params.sampling_seed
                    )
                if r.params.max_new_tokens == 0 and not self._scores_prompt(r):
                    self._finish(r, {"type": "length", "length": 0})
                else:
                    self.waiting.append(r)

    def _run(self) -> None:
        with torch.no_grad():  # once for the thread: the model's methods carry no decorator
            self._loop()

    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stop and not self._commands and not self._has_work():
                        self.stats.last_step_end = None  # idle time is not a gap
                        self._wake.wait()
                    if self._stop:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for fn, fut in commands:
                    try:
                        fut.set(fn(), None)
                    except BaseException as e:  # the caller gets the error, the loop keeps going
                        fut.set(None, e)
                self._take_incoming()
                if self.paused:
                    continue
                self._admit()
                if self.running:
                    self._decode()
        except BaseException as e:  # a bug in the loop: fail every request loudly, not silently
            self.error = e
            for r in list(self.running) + list(self.waiting):
                self._finish(
                    r,
                    {
                        "type": "abort",
                        "message": f"engine error: {e!r}",
                        "status_code": 500,
                        "err_type": "InternalServerError",
                    },
                )
            raise
        finally:
            with self._wake:
                for _, fut in self._commands:
                    fut.set(None, RuntimeError("engine stopped"))
                self._commands.clear()

    def _has_work(self) -> bool:
        if self._incoming:
            return True
        return not self.paused and bool(self.running or self.waiting)

    def _admit(self) -> None:
        batch: list[Request] = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.max_batch_size:
            r = self.waiting[0]
            n = len(r.context)
            if batch and (len(batch) + 1) * max(n, tokens) > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            batch.append(r)
            tokens = max(tokens, n)
        if not batch:
            return
        first = len(self.running)
        want_all = any(
            r.return_logprob and r.logprob_start_len >= 0 and r.input_logprobs is None
            for r in batch
        )
        routes: list[torch.Tensor] | None = (
            [] if any(r.return_routed_experts for r in batch) else None
        )
        logits, full = self.lm.prefill(
            self.cache, first, [r.context for r in batch], all_logits=want_all, routes=routes
        )
        for i, r in enumerate(batch):
            r.cache_len = len(r.context)
            if routes and r.return_routed_experts:  # a retracted request's prefill redoes them all
                r.routes = [routes[0][i, : len(r.context)]]
            if (
                full is not None
                and r.return_logprob
                and r.logprob_start_len >= 0
                and r.input_logprobs is None
            ):
                self._input_logprobs(r, full[i, : len(r.prompt_ids)])
        self.running.extend(batch)
        # a request for no new tokens wanted its prompt's logprobs (a teacher's scoring): done
        scored = [i for i, r in enumerate(batch) if r.params.max_new_tokens == 0]
        for i in scored:
            self._finish(batch[i], {"type": "length", "length": 0})
        if scored:
            self._drop({id(batch[i]) for i in scored})
            keep = [i for i in range(len(batch)) if batch[i].params.max_new_tokens > 0]
            batch, logits = [batch[i] for i in keep], logits[keep]
        if batch:
            self._append(batch, logits, rows=range(first, first + len(batch)))

    @staticmethod
    def _scores_prompt(r: Request) -> bool:
        """Whether the request asks for its prompt's logprobs (SGLang's ``return_logprob`` with a
        ``logprob_start_len``), which a prefill computes even when no token is to be generated."""
        return r.return_logprob and r.logprob_start_len >= 0

    def _input_logprobs(self, r: Request, logits: torch.Tensor) -> None:
        """Logprob of each prompt token given its prefix, from ``logprob_start_len`` on, as SGLang
        answers them: the first None (it computes none for the token at the start), and the
        model's own log_softmax(logits), not scaled by the request's temperature (SGLang scales
        only the sampled tokens'; tests/sglang/test_teacher.py)."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        ids = to_device(r.prompt_ids, torch.long, logp.device)
        picked = logp[:-1].gather(1, ids[1:, None])[:, 0]
        if r.top_logprobs_num:  # read back with the picked ones: one wait for the device
            vals, idx = logp[:-1].topk(min(r.top_logprobs_num, logp.shape[1]), dim=-1)
            got, top_vals, top_ids = to_host(picked, vals, idx)
        else:
            (got,) = to_host(picked)
        lps: list[float | None] = [None, *got]
        start = r.logprob_start_len
        r.input_logprobs = [None] + lps[start + 1 :]
        if r.top_logprobs_num:
            tops = [None] + [
                list(zip(v, i, strict=True)) for v, i in zip(top_vals, top_ids, strict=True)
            ]
            r.input_top = tops[start:]

    def _decode(self) -> None:
        reqs = self.running
        routes: list[torch.Tensor] | None = (
            [] if any(r.return_routed_experts for r in reqs) else None
        )
        logits = self.lm.decode(
            self.cache,
            [r.output_ids[-1] for r in reqs],
            [r.cache_len for r in reqs],
            routes=routes,
        )
        for i, r in enumerate(reqs):
            r.cache_len += 1
            if routes and r.return_routed_experts:
                r.routes.append(routes[0][i])
        self._append(list(reqs), logits, rows=range(len(reqs)))
        now = time.perf_counter()
        cpu = time.thread_time()
        if self.stats.last_step_end is not None:
            # (wall clock, gap, this thread's CPU time in the gap): a long gap with little CPU
            # means the thread was waiting (for a core or the GIL), not working
            self.stats.gaps.append(
                (time.time(), now - self.stats.last_step_end, cpu - self.stats.last_step_cpu)
            )
        self.stats.last_step_end = now
        self.stats.last_step_cpu = cpu
        self.stats.steps += 1

    def _append(self, reqs: list[Request], logits: torch.Tensor, rows: range) -> None:
        """Sample one token for each request, record it, and retire the finished ones."""
        params = [r.params for r in reqs]
        banned = None
        if any(r.params.min_new_tokens > len(r.output_ids) for r in reqs):
            banned = [
                sorted(
                    (set() if r.params.ignore_eos else self.eos_ids) | set(r.params.stop_token_ids)
                )
                if r.params.min_new_tokens > len(r.output_ids)
                else None
                for r in reqs
            ]
        tops = [r.top_logprobs_num if r.return_logprob else 0 for r in reqs]
        out = sample(
            logits,
            params,
            [r.generator for r in reqs],
            self.generator,
            banned=banned,
            top_logprobs=tops,
            original=self.original_logprob,
        )
        finished = []
        check = self._check_finished
        for r, tok, lp, top in zip(reqs, out.tokens, out.logprobs, out.top, strict=True):
            r.output_ids.append(tok)
            r.output_logprobs.append(lp)
            r.output_top.append(top)
            fin = check(r, tok)
            if fin is not None:
                self._finish(r, fin)
                finished.append(r)
            elif r.stream and len(r.output_ids) % r.params.stream_interval == 0:
                r.progress.put((r, len(r.output_ids)))
        self.stats.tokens += len(reqs)
        if finished:
            self._drop({id(r) for r in finished})

    def _check_finished(self, r: Request, tok: int) -> dict | None:
        p = r.params
        n = len(r.output_ids)
        if n >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if n >= p.min_new_tokens:
            if (not p.ignore_eos and tok in self.eos_ids) or tok in p.stop_token_ids:
                return {"type": "stop", "matched": tok}
            if p.stop:
                longest = max(len(s) for s in p.stop)
                tail = self.decode_tail(r.output_ids[-(longest + 8) :])
                for s in p.stop:
                    if s in tail:
                        return {"type": "stop", "matched": s}
        if len(r.prompt_ids) + n >= self.lm.shape.context:
            return {"type": "length", "length": n}
        return None

    def _drop(self, gone: set[int]) -> None:
        """Remove requests (by ``id``) from the running rows; the last row fills each hole."""
        rows = self.running
        i = 0
        while i < len(rows):
            if id(rows[i]) not in gone:
                i += 1
                continue
            last = rows.pop()
            if i < len(rows) and id(last) not in gone:
                self.cache.move(len(rows), i, last.cache_len)
                rows[i] = last
                i += 1

    def _finish(self, r: Request, reason: dict) -> None:
        r.finish = reason
        r.final_version = self.version
        r.cache_len = 0
        r.progress.put((r, -1))
        r.done.set()


class _Future:
    def __init__(self):
        self._ev = threading.Event()
        self._val: Any = None
        self._err: BaseException | None = None

    def set(self, val: Any, err: BaseException | None) -> None:
        self._val, self._err = val, err
        self._ev.set()

    def result(self, timeout: float | None) -> Any:
        if not self._ev.wait(timeout):
            raise TimeoutError("the engine's decode loop did not answer in time")
        if self._err is not None:
            raise self._err
        return self._val

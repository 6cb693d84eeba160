"""The generator client: SGLang's ``/generate`` on trio (docs/design.md §3), its HTTP calls made,
and their failures told apart, by :mod:`asyncrl.generator_http` as the weight calls' are.

One :class:`GeneratorPool` drives any number of SGLang servers or built-in engines (same HTTP API):

- a response whose tokens' versions the generator did not state (:class:`UnlabelledTokens`, see
  :mod:`asyncrl.rollout.sglang_protocol`, which holds all of the protocol's parsing) is refused and
  the request resubmitted to a generator that states its version (counted: ``unlabelled``);
- every generator is labelled with the version it holds before it generates (:meth:`GeneratorPool.
  label`: a server launched from the base model without ``--weight-version`` is labelled ``"0"``),
  and a request goes only to a generator whose version is at least ``min_version`` (the worker sets
  it to the learner's version minus η); while none is, requests wait and ``/model_info`` is polled;
- an ``abort`` finish (a weight update paused the server in ``abort`` mode) is not the end: the
  request is re-sent as prompt + partial output with the remaining token budget, keeping the tokens,
  logprobs and versions already received (AReaL's interruptible generation);
- requests go to the least-loaded generator that is up; an unreachable one is marked down and tried
  again after a back-off, and the request moves to another generator;
- the requests one group's episodes make in the same scheduling tick (all n first turns, typically)
  travel as one batched ``/generate`` (SGLang's list form, :class:`Batcher`): per request, httpx cost
  the worker as much CPU as the engine spent decoding a short completion.
"""

from __future__ import annotations

import itertools
import logging
import math
import uuid
from dataclasses import dataclass, field
from typing import Any

import trio

from asyncrl import backoff
from asyncrl.contract import Completion  # here too: tests and plugins import it from here
from asyncrl.generator_http import (
    GeneratorError,
    acall,
    async_client,
    parse_version_label,
    wait_healthy,
)
from asyncrl.moe import RouteShape, splice_routes
from asyncrl.rollout.sglang_protocol import (
    GeneratorResponseError,
    SamplingParams,
    Segment,
    UnlabelledTokens,
    batched_payload,
    generate_payload,
    parse_generate_response,
    version_at_join,
    with_adapter,
)

log = logging.getLogger(__name__)

_SHARDS = 16  # httpx clients per pool; see GeneratorPool.__init__
_SHARD = 32  # keep-alive connections per client


@dataclass(eq=False)
class _Batch:
    payloads: list[dict[str, Any]] = field(default_factory=list)
    outcomes: list[Any] = field(default_factory=list)  # per payload: (Segment, url) or an error
    done: trio.Event = field(default_factory=trio.Event)


_ALONE = object()  # the batch could not be sent as one: the request goes again on its own


class Batcher:
    """Coalesces one group's ``/generate`` calls made in the same scheduling tick into one batched
    request. One per group: a group is cancelled as a whole, so one cancellation covers its batch."""

    def __init__(self) -> None:
        self.open: _Batch | None = None


# --------------------------------------------------------------------------------------------------
# The pool
# --------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class GeneratorState:
    """Book-keeping for one generator: load, health, and busy time (for its idle fraction)."""

    url: str
    version: int | None = None  # the weights' version it last stated (None: not known yet)
    in_flight: int = 0
    down_until: float = 0.0  # trio clock; 0 = up
    failures: int = 0  # consecutive transport failures
    down_since: float = math.inf  # trio clock of the first of those failures
    last_error: str = ""
    requests: int = 0
    tokens: int = 0
    unlabelled: int = 0  # responses refused: tokens without a numeric version
    busy_s: float = 0.0
    version_read_at: float = -math.inf  # trio clock of the last /model_info read
    _busy_since: float | None = None

    def enter(self, now: float) -> None:
        if self.in_flight == 0:
            self._busy_since = now
        self.in_flight += 1

    def leave(self, now: float) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._busy_since is not None:
            self.busy_s += now - self._busy_since
            self._busy_since = None

    def busy_total(self, now: float) -> float:
        extra = now - self._busy_since if self._busy_since is not None else 0.0
        return self.busy_s + extra


class GeneratorPool:
    """Sends ``/generate`` requests to a set of SGLang-compatible generators.

    ``min_version``: the oldest weights a request may be served by (the worker keeps it at the
    learner's version minus η: older tokens could never be trained). Call :meth:`label` once before
    generating. Use as ``async with GeneratorPool(urls) as pool``.
    """

    def __init__(
        self,
        urls: list[str],
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        retry_s: float = 0.5,
        max_retry_s: float = 15.0,
        max_resumes: int = 1000,
        version_poll_s: float = 0.1,
        lora: bool = False,
        routes: RouteShape | None = None,
    ):
        if not urls:
            raise ValueError("GeneratorPool needs at least one generator URL")
        self.generators = {u.rstrip("/"): GeneratorState(url=u.rstrip("/")) for u in urls}
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self.max_resumes = max_resumes
        self.version_poll_s = version_poll_s
        self.lora = lora  # SGLang serving LoRA adapters by name: requests name one (adapters.py)
        # routing replay: requests ask for the experts of every position (the model's shape)
        self.routes = routes
        self.min_version = 0
        self._behind_logged: tuple | None = None  # the last "waiting for weights" state logged
        self._rr = itertools.count()
        self._t0 = trio.current_time()  # made inside trio.run
        # httpcore's pool rescans every (request, connection) pair on each event, O(R x C): with
        # hundreds of episodes in flight that scan cost more CPU than the engine's decoding. Shards
        # of at most _SHARD concurrent requests keep each scan small.
        self._shards = [
            async_client(timeout_s, connect_s=connect_timeout_s, keepalive=_SHARD)
            for _ in range(_SHARDS)
        ]
        self._shard_rr = itertools.count()
        self._http = self._shards[0]  # control calls (health, abort): few, never concurrent

    async def __aenter__(self) -> GeneratorPool:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            for h in self._shards:
                await h.aclose()

    # -- choosing a generator --------------------------------------------------------------------

    def eligible(self, g: GeneratorState, now: float | None = None) -> bool:
        """Up, and holding weights it has stated and that are within the bound."""
        now = trio.current_time() if now is None else now
        return g.down_until <= now and g.version is not None and g.version >= self.min_version

    def _pick(self, prefer: str | None) -> GeneratorState | None:
        now = trio.current_time()
        up = [g for g in self.generators.values() if self.eligible(g, now)]
        if not up:
            return None
        if prefer is not None:
            g = self.generators.get(prefer)
            if g is not None and self.eligible(g, now):
                return g
        low = min(g.in_flight for g in up)
        ties = [g for g in up if g.in_flight == low]
        return ties[next(self._rr) % len(ties)]

    def _mark_down(self, g: GeneratorState, why: str) -> None:
        if not g.failures:
            g.down_since = trio.current_time()
        g.failures += 1
        g.last_error = why
        wait_s = backoff.delay_s(g.failures - 1, first=self.retry_s, cap=self.max_retry_s)
        g.down_until = trio.current_time() + wait_s
        g.version = None  # it may come back restarted, holding other weights: ask it then
        log.warning("generator %s is down (%s); retrying it in %.1fs", g.url, why, wait_s)

    def _mark_up(self, g: GeneratorState) -> None:
        if g.failures:
            log.info("generator %s is back up", g.url)
        g.failures = 0
        g.down_since = math.inf
        g.down_until = 0.0
        g.last_error = ""

    def down_s(self) -> float:
        """How long every generator has failed (0 while one of them answers)."""
        since = max(g.down_since for g in self.generators.values())
        return max(trio.current_time() - since, 0.0)

    def errors(self) -> str:
        """Each generator's last transport error, for a message."""
        return "; ".join(f"{g.url}: {g.last_error}" for g in self.generators.values())

    def stats(self) -> dict[str, float]:
        """Idle fraction (no request in flight) since the pool was made, load and health; the
        aggregate first (``generator_idle_fraction``), then one entry per generator (``/i``)."""
        now = trio.current_time()
        elapsed = max(now - self._t0, 1e-9)
        gens = list(self.generators.values())
        idle = [1.0 - min(g.busy_total(now) / elapsed, 1.0) for g in gens]
        out: dict[str, float] = {
            "generator_idle_fraction": sum(idle) / len(idle),
            "generators_up": float(sum(g.down_until <= now for g in gens)),
            "generators_within_bound": float(sum(self.eligible(g, now) for g in gens)),
            "generator_min_version": float(self.min_version),
            "responses_unlabelled": float(sum(g.unlabelled for g in gens)),
        }
        for i, g in enumerate(gens):
            out[f"generator_idle_fraction/{i}"] = idle[i]
            out[f"generator_in_flight/{i}"] = float(g.in_flight)
            if g.version is not None:
                out[f"generator_version/{i}"] = float(g.version)
        return out

    # -- versions --------------------------------------------------------------------------------

    async def _model_info_version(self, g: GeneratorState) -> Any:
        """``weight_version`` from the generator's ``/model_info`` (raises on a bad answer)."""
        g.version_read_at = trio.current_time()  # claimed: concurrent waiters do not ask again
        body = await acall(self._http, g.url, "GET", "/model_info", timeout_s=5.0)
        if not isinstance(body, dict) or "weight_version" not in body:
            raise GeneratorResponseError("no weight_version", url=g.url, path="/model_info")
        return body["weight_version"]

    async def label(self) -> None:
        """Before generating (and before the worker registers them with the learner, so that no
        broadcast races the label): read every generator's version; one that says ``"default"``
        was launched from the base model and is labelled ``"0"`` without aborting anything
        (:func:`version_at_join`). Raises :class:`GeneratorError` naming the generator."""
        for g in self.generators.values():
            try:
                label = await self._model_info_version(g)
                v, relabel = version_at_join(label)
                if relabel:
                    body = {"new_version": str(v), "abort_all_requests": False}
                    path = "/update_weight_version"
                    reply = await acall(self._http, g.url, "POST", path, body, timeout_s=10.0)
                    if not (isinstance(reply, dict) and reply.get("new_version") == str(v)):
                        raise GeneratorError(f"{path}: answered {str(reply)[:200]}")
                    log.info("generator %s: weight_version %r labelled %r", g.url, label, str(v))
            except GeneratorError as e:
                raise GeneratorError(f"generator {g.url}: {e}") from None
            g.version = v
            log.info("generator %s holds version %d", g.url, v)

    async def refresh_versions(self) -> None:
        """Read ``/model_info`` of the generators that are up but not within the bound (each at
        most every ``version_poll_s``): the broadcaster updates them behind our back."""
        now = trio.current_time()
        for g in self.generators.values():
            if g.down_until > now or self.eligible(g, now):
                continue
            if now - g.version_read_at < self.version_poll_s:
                continue
            try:
                g.version = parse_version_label(await self._model_info_version(g))
            except GeneratorError as e:
                log.info("generator %s: %s", g.url, e)

    def any_eligible(self) -> bool:
        now = trio.current_time()
        return any(self.eligible(g, now) for g in self.generators.values())

    def behind(self) -> str:
        """Why no generator may serve now, for a log line (empty if one may)."""
        now = trio.current_time()
        if any(self.eligible(g, now) for g in self.generators.values()):
            return ""
        parts = []
        for g in self.generators.values():
            if g.down_until > now:
                parts.append(f"{g.url} down")
            else:
                held = "an unstated version" if g.version is None else f"v{g.version}"
                parts.append(f"{g.url} holds {held}")
        return f"{'; '.join(parts)}; requests need weights of v{self.min_version} or newer"

    def log_behind(self) -> None:
        state = (self.min_version, tuple(g.version for g in self.generators.values()))
        if state != self._behind_logged:
            self._behind_logged = state
            log.info("waiting for the learner's weights: %s", self.behind())

    def log_caught_up(self) -> None:
        """Ends a wait :meth:`log_behind` reported, so the log says when generation goes on."""
        if self._behind_logged is not None and self.any_eligible():
            self._behind_logged = None
            log.info("the learner's weights arrived: generating at v%d or newer", self.min_version)

    def _saw(self, g: GeneratorState, seg: Segment) -> None:
        """A parsed response: the version its generator holds now, its tokens."""
        g.version = seg.weight_version
        g.tokens += len(seg.output_ids)

    def _refused(self, g: GeneratorState, e: UnlabelledTokens) -> None:
        g.unlabelled += 1
        g.version = None  # not used again until /model_info states a version
        log.warning("generator %s: response refused (%s); resubmitting elsewhere", g.url, e)

    # -- requests --------------------------------------------------------------------------------

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until every generator answers ``/health`` (raises :class:`GeneratorError`)."""
        await wait_healthy(self._http, list(self.generators), timeout_s)

    async def _request(
        self, payload: dict[str, Any], prefer: str | None, deadline: float
    ) -> tuple[Any, GeneratorState, int | None]:
        """One ``/generate`` call, moved to another generator while transport errors last (and
        held while no generator is within the version bound): the JSON body, the generator and,
        with ``lora``, the version whose adapter the request named (the generator's latest)."""
        while True:
            g = self._pick(prefer)
            if g is None:
                now = trio.current_time()
                gens = self.generators.values()
                down = [x.down_until for x in gens if x.down_until > now]
                wake = min(down, default=math.inf)
                behind = len(down) < len(gens)  # some are up, but none within the bound
                if behind:
                    self.log_behind()
                    await self.refresh_versions()
                    if self.any_eligible():
                        self.log_caught_up()
                        continue
                    wake = min(wake, trio.current_time() + self.version_poll_s)
                if wake >= deadline:
                    errs = self.errors()
                    raise GeneratorError(
                        f"no generator within the version bound before the timeout "
                        f"({self.behind()})"
                        if behind
                        else f"no generator reachable before the timeout ({errs})"
                    )
                await trio.sleep_until(wake)
                continue
            g.enter(trio.current_time())
            g.requests += 1
            adapter = g.version if self.lora else None
            try:
                http = self._shards[next(self._shard_rr) % _SHARDS]
                sent = with_adapter(payload, adapter)
                body = await acall(http, g.url, "POST", "/generate", sent)
            except GeneratorError as e:
                if not (e.dead or (e.status or 0) >= 500):
                    raise  # refused (4xx) or not JSON: the request or the server is wrong
                self._mark_down(g, e.message)
                prefer = None
                continue
            finally:
                g.leave(trio.current_time())
            self._mark_up(g)
            return body, g, adapter

    async def _post(
        self, payload: dict[str, Any], prefer: str | None, deadline: float
    ) -> tuple[Segment, str]:
        """One request on its own: its parsed segment and the generator that served it."""
        body, g, adapter = await self._request(payload, prefer, deadline)
        try:
            seg = parse_generate_response(body, adapter=adapter, routes=self.routes)
        except UnlabelledTokens as e:
            self._refused(g, e)
            raise
        self._saw(g, seg)
        return seg, g.url

    async def _post_batched(
        self, payload: dict[str, Any], prefer: str | None, deadline: float, batcher: Batcher
    ) -> tuple[Segment, str]:
        """Join the group's open batch; its first member sends it after one scheduling tick."""
        batch = batcher.open
        leader = batch is None
        if batch is None:
            batch = batcher.open = _Batch()
        i = len(batch.payloads)
        batch.payloads.append(payload)
        if leader:
            try:
                await trio.sleep(0)  # the group's other episodes add their requests meanwhile
            finally:
                batcher.open = None
            await self._send_batch(batch, prefer, deadline)
        else:
            await batch.done.wait()
        out = batch.outcomes[i]
        if out is _ALONE:
            return await self._post(payload, prefer, deadline)
        if isinstance(out, BaseException):
            raise out
        return out

    async def _send_batch(self, batch: _Batch, prefer: str | None, deadline: float) -> None:
        """Send a batch as one request and hand each member its outcome (set even if cancelled)."""
        ps = batch.payloads
        try:
            if len(ps) == 1:
                batch.outcomes = [_ALONE]
                return
            try:
                body, g, adapter = await self._request(batched_payload(ps), prefer, deadline)
            except GeneratorError as e:
                # refused: find the bad one, each goes again on its own
                batch.outcomes = [_ALONE if e.refused else e] * len(ps)
                return
            if not isinstance(body, list) or len(body) != len(ps):
                got = f"a list of {len(body)}" if isinstance(body, list) else type(body).__name__
                err = GeneratorResponseError(
                    f"{len(ps)} responses expected, got {got}", url=g.url, path="/generate"
                )
                batch.outcomes = [err] * len(ps)
                return
            outcomes: list[Any] = []
            for b in body:
                try:
                    seg = parse_generate_response(b, adapter=adapter, routes=self.routes)
                    self._saw(g, seg)
                    outcomes.append((seg, g.url))
                except UnlabelledTokens as e:
                    self._refused(g, e)
                    outcomes.append(e)
                except GeneratorError as e:
                    outcomes.append(e)
            batch.outcomes = outcomes
        except BaseException:  # cancelled while sending: stop the members' work, let them redo it
            batch.outcomes = [_ALONE] * len(ps)
            with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                for p in ps[1:]:  # the sender's own request is aborted by its generate()
                    await self.abort(p["rid"])
            raise
        finally:
            batch.done.set()

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        max_new_tokens: int | None = None,
        rid: str | None = None,
        batcher: Batcher | None = None,
    ) -> Completion:
        """Generate one completion of ``input_ids``; resumes across aborts (see module doc).

        ``rid`` prefixes the SGLang request ids (``{rid}.{n}``), so ``abort(rid)`` stops them all.
        With a ``batcher``, requests made in the same tick by other calls with it share one HTTP call.
        Raises :class:`GeneratorError` on a refused request or when no generator answers within
        ``timeout_s``.
        """
        budget = params.max_new_tokens if max_new_tokens is None else max_new_tokens
        rid = rid or uuid.uuid4().hex
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        routes = None  # with routing replay, each resumed request's own for the tokens it made
        resumes = retractions = refused = 0
        finish, matched, url = "length", None, None
        deadline = trio.current_time() + self.timeout_s
        try:
            for n in itertools.count():
                remaining = budget - len(ids)
                if remaining <= 0:
                    finish = "length"
                    break
                payload = generate_payload(
                    list(input_ids) + ids,
                    params,
                    max_new_tokens=remaining,
                    rid=f"{rid}.{n}",
                    routed_experts=self.routes is not None,
                )
                try:
                    if batcher is None:
                        seg, url = await self._post(payload, url, deadline)
                    else:
                        seg, url = await self._post_batched(payload, url, deadline, batcher)
                except UnlabelledTokens:  # its tokens are dropped (counted); sent again elsewhere
                    refused += 1
                    url = None
                    if refused > self.max_resumes:
                        raise
                    continue
                ids += seg.output_ids
                lps += seg.logprobs
                vers += seg.versions
                if seg.routed_experts is not None:
                    routes = splice_routes(routes, seg.routed_experts, len(seg.output_ids))
                retractions += seg.num_retractions
                finish, matched = seg.finish_reason, seg.matched_stop
                if finish != "abort":
                    break
                resumes += 1
                if resumes > self.max_resumes or trio.current_time() >= deadline:
                    log.warning("request %s: giving up after %d aborts", rid, resumes)
                    break
                if not seg.output_ids:  # aborted before any progress: do not spin
                    await trio.sleep(backoff.delay_s(resumes, first=0.01, cap=1.0))
        except trio.Cancelled:
            # stop the server's work too (by rid prefix); a server that does not notice the closed
            # connection (the built-in engine, non-streaming) would otherwise finish it for nothing
            with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                await self.abort(rid, urls=[url] if url else None)
            raise
        if len(ids) > budget:
            raise GeneratorResponseError(
                f"generator returned {len(ids)} tokens for a budget of {budget}"
            )
        return Completion(
            output_ids=ids,
            logprobs=lps,
            versions=vers,
            finish_reason=finish,
            matched_stop=matched,
            num_resumes=resumes,
            num_retractions=retractions,
            generator=url or "",
            routed_experts=routes,
        )

    async def abort(self, rid_prefix: str, *, urls: list[str] | None = None) -> None:
        """Best effort ``/abort_request`` by rid prefix on the given (default: all up) generators."""
        now = trio.current_time()
        targets = urls or [g.url for g in self.generators.values() if g.down_until <= now]
        for u in targets:
            try:
                await acall(
                    self._http, u, "POST", "/abort_request", {"rid": rid_prefix}, timeout_s=2.0
                )
            except GeneratorError:
                pass

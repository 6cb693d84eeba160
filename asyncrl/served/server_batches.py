"""Requests to model servers in batches: samples that finish within :data:`LINGER_S` of each
other travel in one request of up to ``batch_size`` items, bounded by ``timeout_s``; a server that
cannot take it (connection, HTTP error, an answer that does not parse) passes it to the next one,
each server once, the first in turn. A batch that no server answered within the bound fails each
of its items (a failure string, never an exception).

The reward model's ``/classify`` scores (:mod:`asyncrl.served.model_reward`) and the teacher's
``/generate`` logprobs (:mod:`asyncrl.served.teacher`) are its two uses: each says how a batch
becomes a request (:meth:`BatchedServers.request`) and how an answer becomes one result per item
(:meth:`BatchedServers.parse`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx
import trio

from asyncrl.generator_http import GeneratorError, acall, async_client
from asyncrl.recipe import RecipeError

LINGER_S = 0.01
"""How long the first item of a batch waits for others (unless the batch fills first)."""

T = TypeVar("T")


def require_urls(key: str, path: str, urls: Sequence[str], servers: str) -> None:
    """RecipeError naming ``key.urls`` when a served model has a ``path`` but no ``urls``: `asyncrl
    run` starts ``servers`` on the path and passes their urls; a process started alone (`asyncrl
    rollout`, `asyncrl learner`) cannot know them."""
    if path and not urls:
        raise RecipeError(
            f"`asyncrl run` starts {servers} on {key}.path ({path}); started alone, this process "
            f"needs their urls (start `asyncrl engine --model PATH` and set {key}.urls, "
            f"{key}.path='')",
            key=f"{key}.urls",
        )


@dataclass(eq=False)
class _Item:
    payload: Any
    done: trio.Event = field(default_factory=trio.Event)
    result: Any = None
    failure: str = ""


@dataclass(eq=False)
class _Batch:
    items: list[_Item] = field(default_factory=list)
    full: trio.Event = field(default_factory=trio.Event)


class BatchedServers(Generic[T]):
    """Batches items to ``urls`` (module docstring)."""

    def __init__(self, urls: Sequence[str], *, timeout_s: float, batch_size: int) -> None:
        self.urls, self.timeout_s, self.batch_size = list(urls), timeout_s, batch_size
        self.stats = {"calls": 0, "failures": 0, "timeouts": 0, "requests": 0}
        self._turn = itertools.count()  # which server a batch tries first, in turn
        self._http: httpx.AsyncClient | None = None
        self._loop: trio.lowlevel.TrioToken | None = None
        self._open: _Batch | None = None  # the batch new items join

    def request(self, payloads: list[Any]) -> tuple[str, dict]:
        """The (path, JSON body) of one request for ``payloads``."""
        raise NotImplementedError

    def parse(self, answer: Any, payloads: list[Any]) -> list[T]:
        """One result per payload from a server's answer; ValueError naming what is wrong."""
        raise NotImplementedError

    def accept(self, results: list[T]) -> list[T]:
        """What a batch's parsed results become before its items get them (a hook)."""
        return results

    @property
    def http(self) -> httpx.AsyncClient:
        """A client of the running event loop: its connections cannot outlive it, and the held-out
        evaluation runs one loop per evaluation (the worker one for its life)."""
        token = trio.lowlevel.current_trio_token()
        if self._http is None or self._loop is not token:
            self._http = async_client(self.timeout_s)
            self._loop = token
        return self._http

    async def call(self, payload: Any) -> tuple[T | None, str]:
        """(result, failure); never raises but for cancellation.

        The first item of a batch leads it: it waits :data:`LINGER_S` (or until the batch is full)
        and sends it, shielded so that the others' results arrive even if the leader is cancelled."""
        self.stats["calls"] += 1
        item = _Item(payload)
        batch = self._open
        lead = batch is None
        if batch is None:
            batch = self._open = _Batch()
        batch.items.append(item)
        if len(batch.items) >= self.batch_size:  # full: the next item starts another
            batch.full.set()
            self._open = None
        if lead:
            with trio.move_on_after(LINGER_S):
                await batch.full.wait()
            if self._open is batch:
                self._open = None
            with trio.CancelScope(shield=True):
                await self._send(batch.items)
        await item.done.wait()
        if item.failure:
            self.stats["failures"] += 1
        return item.result, item.failure

    async def _send(self, batch: list[_Item]) -> None:
        payloads = [it.payload for it in batch]
        path, body = self.request(payloads)
        self.stats["requests"] += 1
        failure = ""
        results: list[T] = []
        with trio.move_on_after(self.timeout_s) as scope:
            urls = self.urls
            first = next(self._turn) % len(urls)
            for url in urls[first:] + urls[:first]:
                try:
                    answer = await acall(self.http, url, "POST", path, body)
                    results = self.parse(answer, payloads)
                    failure = ""
                    break
                except GeneratorError as e:
                    if e.timed_out:  # the bound is spent: no time for another server
                        scope.cancel()
                    failure = str(e)[:500]
                except ValueError as e:
                    failure = f"{url}{path}: {e}"[:500]
        if scope.cancelled_caught:
            self.stats["timeouts"] += 1
            failure = f"{path} timed out after {self.timeout_s:g}s"
        if failure:
            for it in batch:
                it.failure = failure
        else:
            for it, res in zip(batch, self.accept(results), strict=True):
                it.result = res
        for it in batch:
            it.done.set()

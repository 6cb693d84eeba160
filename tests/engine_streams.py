"""HTTP calls to an engine that run in a thread, for engine tests that act while one is in flight: a
streaming ``/generate`` that decodes, or a weight call that blocks until rank 0 broadcasts; and
the test as rank 0 of an engine's weight group (:func:`weight_group`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


class GenerateStream:
    """Consumes the SSE stream in a thread; ``first`` is set once a token has arrived."""

    def __init__(self, url: str, body: dict):
        self.first = threading.Event()
        self.chunks: list[dict] = []
        self.status: int | None = None
        self._t = threading.Thread(
            target=self._run, args=(url, {**body, "stream": True}), daemon=True
        )
        self._t.start()

    def _run(self, url: str, body: dict) -> None:
        with httpx.Client(timeout=120) as c, c.stream("POST", url + "/generate", json=body) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.chunks.append(json.loads(line[6:]))
                    self.first.set()

    def result(self) -> dict:
        self._t.join(120)
        return self.chunks[-1]


class PostInThread:
    """One POST in a thread (the trainer's "post, then broadcast, then join"): the engine's side of
    a broadcast answers only once the broadcast is received."""

    def __init__(self, client: httpx.Client, path: str, body: dict):
        self.resp: httpx.Response | None = None
        self._t = threading.Thread(target=self._run, args=(client, path, body))
        self._t.start()

    def _run(self, client: httpx.Client, path: str, body: dict) -> None:
        self.resp = client.post(path, json=body, timeout=120)

    def join(self) -> httpx.Response:
        self._t.join(120)
        assert self.resp is not None, "HTTP call did not return"
        return self.resp


@contextmanager
def weight_group(client: httpx.Client, group: str) -> Iterator[object]:
    """This process as rank 0 of a two-rank gloo weight group with the engine behind ``client``
    (rank 1); yields the process group, destroyed on both sides at the end. Rank 0's store listens
    before the engine is told its port (a port found free and bound later could be taken)."""
    from asyncrl.weights import rendezvous

    store = rendezvous.host_store("127.0.0.1", 60)
    body = {
        "master_address": "127.0.0.1",
        "master_port": store.port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": group,
        "backend": "gloo",
    }
    call = PostInThread(client, "/init_weights_update_group", body)
    pg = rendezvous.init_custom_process_group(
        master_address="127.0.0.1",
        master_port=store.port,
        rank=0,
        world_size=2,
        group_name=group,
        timeout_s=60,
    )
    del store
    r = call.join()
    assert r.status_code == 200, r.text
    assert r.json() == {"success": True, "message": "Succeeded to initialize custom process group."}
    try:
        yield pg
    finally:
        r = client.post("/destroy_weights_update_group", json={"group_name": group})
        rendezvous.destroy_process_group(pg)
    assert r.json()["success"]

"""The learner's side of the buffer, without the model: for fault scenarios about the buffer and the
workers (a real :class:`BufferService` in its own process, consuming batches as a learner would).

    python learner_stub.py OUT_DIR CONFIG_JSON [--tls CERT,KEY,CA]

Writes ``OUT_DIR/addresses.json`` once serving, appends one line per batch to ``OUT_DIR/trained.jsonl``
(training version, each group's id and oldest token version, the wait), bumps the version after each
batch, and on SIGTERM writes ``OUT_DIR/final.json`` (the service's stats and the ids still stored).
It is a stand-in only for the model's step and its weights: the service, its sockets and its
bookkeeping are real. Like the weight broadcaster, it labels every registered generator with the new
version before announcing it (``/update_weight_version``, without aborting anything), but sends no
weights: the generators' tokens then carry the versions a learner would give them, which is what the
buffer's staleness bound and the workers' admission act on.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

from asyncrl.buffer.service import BufferService
from asyncrl.recipe import BufferConfig
from asyncrl.transport import TLS


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    cfg = BufferConfig(**json.loads(argv[1]))
    tls = None
    if len(argv) > 3 and argv[2] == "--tls":
        cert, key, ca = argv[3].split(",")
        tls = TLS(cert=cert, key=key, ca=ca)
    out.mkdir(parents=True, exist_ok=True)
    stopping = False

    def on_term(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    http = httpx.Client(timeout=2.0)
    http_lock = threading.Lock()  # the service's callback thread and this one
    generators: dict[str, list[str]] = {}  # worker id -> its generators' urls

    def label(version: int, urls: list[str]) -> None:
        """The broadcaster's label, without the weights (best effort: a generator may be dead)."""
        body = {"new_version": str(version), "abort_all_requests": False}
        for url in urls:
            try:
                with http_lock:
                    http.post(url.rstrip("/") + "/update_weight_version", json=body)
            except httpx.HTTPError as e:
                logging.warning("label %s: %s", url, e)

    def on_register(worker_id: str, gens: list) -> None:
        generators[worker_id] = [g.url for g in gens]
        label(svc.version, generators[worker_id])  # what a learner idle for data does at once

    # The journal folder also holds the service's own audit (groups dropped by name).
    svc = BufferService(cfg, tls=tls, announce_every_s=0.2, journal_dir=out / "buffer")
    svc.on_register(on_register)
    svc.start()
    tmp = out / "addresses.json.tmp"
    tmp.write_text(json.dumps({"address": svc.address, "pub_address": svc.pub_address}))
    tmp.rename(out / "addresses.json")
    waited = 0.0
    with (out / "trained.jsonl").open("a") as log:
        while not stopping:
            t0 = time.monotonic()
            try:
                batch = svc.next_batch(timeout_s=0.5)  # short, so SIGTERM is seen promptly
            except TimeoutError:
                waited += time.monotonic() - t0
                continue
            waited += time.monotonic() - t0
            rec = {
                "version": batch.version,
                "groups": [
                    {
                        "id": g.id,
                        "min_version": min(int(s.versions.min()) for s in g.samples),
                        "prompt": g.metadata.get("prompt"),  # "file:line" of its data row
                        "samples": len(g.samples),
                    }
                    for g in batch.groups
                ],
                "tool_errors": sum(
                    not c.get("ok", True)
                    for g in batch.groups
                    for s in g.samples
                    for c in s.metadata.get("tool_calls", [])
                ),
                "wait_s": waited,
                "t": time.time(),
            }
            log.write(json.dumps(rec) + "\n")
            log.flush()
            waited = 0.0
            label(batch.version + 1, sorted({u for us in list(generators.values()) for u in us}))
            svc.set_version(batch.version + 1)
    state = svc.state_dict()
    final = {"stats": svc.stats(), "stored": [], "version": svc.version}
    from base64 import b64decode

    from asyncrl import wire

    for s in state["stored"]:
        final["stored"].append(wire.decode(b64decode(s["group"]), expect=wire.Group).id)
    svc.stop()
    http.close()
    (out / "final.json").write_text(json.dumps(final))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

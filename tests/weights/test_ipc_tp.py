"""An SGLang server of several TP ranks is refused weights by handle before it is sent any.

``weights.backend: ipc`` sends one payload per bucket in ``serialized_named_tensors``, and SGLang
reads it by TP rank (``serialized_named_tensors[tp_rank]``): rank 1 of a TP-2 server would fail
with an IndexError mid-update. A recipe cannot know a server's TP size (it is in its
``/server_info``), so the broadcaster refuses it at its first group build, with one line naming
the field. The server is a stand-in for SGLang (a few lines of HTTP: no TP-2 server runs on this
CPU machine); the broadcaster, its client and control plane are the real ones."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from asyncrl.recipe import WeightsConfig
from asyncrl.weights.broadcaster import WeightBroadcaster
from asyncrl.wire import GeneratorInfo

TP2 = {"version": "0.5.23", "tp_size": 2, "dp_size": 1, "disable_radix_cache": True}


class _TensorParallelServer(BaseHTTPRequestHandler):
    """SGLang's read-only endpoints for a TP-2 server; every other call is recorded and answered
    as SGLang's success."""

    def _answer(self) -> None:
        self.server.paths.append(self.path)
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        body = {"/model_info": {"weight_version": "0"}, "/server_info": TP2}.get(
            self.path, {"success": True, "message": ""}
        )
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer  # noqa: N815

    def log_message(self, *args):
        pass


@pytest.fixture
def tp2_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _TensorParallelServer)
    httpd.paths = []
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_a_tp2_server_is_refused_handles_before_any_weights(tp2_server, tmp_path, caplog):
    url = f"http://127.0.0.1:{tp2_server.server_address[1]}"
    cfg = WeightsConfig(backend="ipc", timeout_s=3.0, overlap=False)
    b = WeightBroadcaster(cfg, rank=0, export_dir=tmp_path / "hf")
    try:
        b.add_generator(GeneratorInfo(url=url, kind="sglang"))
        with caplog.at_level(logging.WARNING, logger="asyncrl.weights"):
            b.publish(1, {"w": torch.ones(4)})
        assert b.wait(timeout=cfg.timeout_s)
        assert b.generators() == {url: "dropped"}
    finally:
        b.close()
    assert b.reports[0].dropped == [url]
    # asked what it is, never sent a pause, a session or a bucket
    assert set(tp2_server.paths) <= {"/model_info", "/server_info", "/health"}, tp2_server.paths
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said == [
        f"weights: generator {url} refused, no weights sent to it: weights.backend ipc passes one "
        "handle per bucket to a one-rank generator; this one has 2 ranks: set weights.backend to "
        "gloo or nccl"
    ]

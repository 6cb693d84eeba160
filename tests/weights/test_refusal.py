"""The broadcaster refuses a server that cannot take its updates before it sends it anything.

The server here is a stand-in for SGLang (a few lines of HTTP): the built-in engine has no radix
cache and one rank, so it cannot honestly report either, and a server whose ``/server_info`` says
the radix cache is on, or that it has two TP ranks, is the fault these tests provoke. The
broadcaster, its HTTP client and its control plane are the real ones.

Two TP ranks and ``weights.backend: ipc``: ipc sends one payload per bucket in
``serialized_named_tensors`` and SGLang reads it by TP rank (``serialized_named_tensors[tp_rank]``),
so rank 1 would fail with an IndexError mid-update. A recipe cannot know a server's TP size (it is
in its ``/server_info``), so the broadcaster refuses it at its first group build."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from asyncrl.recipe import WeightsConfig
from asyncrl.weights.broadcaster import WeightBroadcaster
from asyncrl.weights.rendezvous import radix_cache_problem
from asyncrl.wire import GeneratorInfo

RADIX_ON = {"version": "0.5.23", "tp_size": 1, "dp_size": 1, "disable_radix_cache": False}
TP2 = {"version": "0.5.23", "tp_size": 2, "dp_size": 1, "disable_radix_cache": True}


class _StandInServer(BaseHTTPRequestHandler):
    """SGLang's read-only endpoints, ``/server_info`` answering the server's ``server_info``;
    every other call (what would carry weights) is recorded and answered as SGLang's success."""

    def _answer(self) -> None:
        self.server.paths.append(self.path)
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        info = self.server.server_info
        body = {"/model_info": {"weight_version": "0"}, "/server_info": info}.get(
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


def _serve(server_info: dict):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _StandInServer)
    httpd.paths, httpd.server_info = [], server_info
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def radix_server():
    yield from _serve(RADIX_ON)


@pytest.fixture
def tp2_server():
    yield from _serve(TP2)


def test_a_radix_cache_server_is_refused_before_any_weights(radix_server, tmp_path, caplog):
    url = f"http://127.0.0.1:{radix_server.server_address[1]}"
    export = tmp_path / "hf" / "v1"  # what a rejoining generator would load first
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    (export / "model.safetensors").write_bytes(b"")
    cfg = WeightsConfig(timeout_s=3.0, overlap=False)  # pause_mode in_place, the default
    b = WeightBroadcaster(cfg, rank=0, export_dir=tmp_path / "hf")
    try:
        b.add_generator(GeneratorInfo(url=url, kind="sglang"))
        with caplog.at_level(logging.WARNING, logger="asyncrl.weights"):
            b.publish(1, {"w": torch.ones(4)})  # overlap off: returns when the version is done
            b.publish(2, {"w": torch.full((4,), 2.0)})  # it answers /health: asked again
        assert b.wait(timeout=cfg.timeout_s)  # nothing left in flight
        assert b.generators() == {url: "dropped"}
    finally:
        b.close()
    first, second = b.reports
    assert first.dropped == [url] and first.error == "no generators", first
    assert second.dropped == [] and second.error == "no generators", second
    # asked what it is, never sent a group, a pause, a bucket or an export
    assert set(radix_server.paths) <= {"/model_info", "/server_info", "/health"}, radix_server.paths
    assert "/server_info" in radix_server.paths
    said = [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name == "asyncrl.weights" and r.levelno >= logging.WARNING
    ]
    assert said == [  # one line, once, though it was asked again before version 2
        (
            logging.ERROR,
            f"weights: generator {url} refused, no weights sent to it: weights.pause_mode "
            "in_place needs the radix cache off: relaunch it with --disable-radix-cache, or set "
            "weights.pause_mode=retract",
        )
    ]
    # what is refused, and what is not
    assert radix_cache_problem(RADIX_ON, "retract") is None
    assert radix_cache_problem({**RADIX_ON, "disable_radix_cache": True}, "in_place") is None
    assert radix_cache_problem({"tp_size": 1}, "in_place") is not None  # absent: SGLang's default


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

"""`asyncrl engine`: serve a HuggingFace causal LM over SGLang's HTTP API, or a sequence-classification
model (a reward model) over SGLang's ``/classify`` (:mod:`asyncrl.engine.classify`).

    asyncrl engine --model HF_DIR [--host 127.0.0.1] [--port P] [--port-file F] [--max-batch-size N]
                   [--weight-version default] [--seed S] [--device auto|cpu|cuda] [--dtype D]
                   [--lora-rank R --lora-alpha A] [--weights DIR]

Stdlib ``ThreadingHTTPServer``: HTTP threads parse JSON and wait on events; all torch work runs in
the scheduler's one decode thread (and weight receives in the weight store's receiver thread).
``--port 0`` binds a free port; the bound port is printed and, with ``--port-file``, written there.
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` in its environment makes it report logprobs before the
temperature, as it makes SGLang (:mod:`asyncrl.engine.sampling`).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, get_args
from urllib.parse import parse_qs, urlparse

from asyncrl.engine import openai
from asyncrl.engine.generate_api import GenerateAPI
from asyncrl.engine.replies import BadRequest, Reply
from asyncrl.engine.weight_api import WeightAPI
from asyncrl.quick_exit import quick_exit
from asyncrl.recipe import Dtype, EngineDevice

if TYPE_CHECKING:
    from asyncrl.engine.api import Engine, EngineConfig
    from asyncrl.engine.classify import Classifier

MAX_BODY = 256 << 20

LOOPBACK_ONLY = frozenset({"/update_weights_from_tensor"})
"""Endpoints answered only to a peer on this host (:func:`_same_host`): their payload is a pickle of
memory handles (asyncrl.weights.ipc), which means nothing elsewhere and is never unpickled from
another host."""


def _routes(engine: Engine | Classifier) -> dict[str, Callable[[dict], Reply]]:
    if hasattr(engine, "routes"):  # a Classifier
        return engine.routes()
    g, w = GenerateAPI(engine), WeightAPI(engine)
    return {
        "/generate": g.generate,
        "/model_info": lambda b: Reply(200, g.model_info()),
        "/get_model_info": lambda b: Reply(200, g.model_info()),
        "/server_info": lambda b: Reply(200, g.server_info()),
        "/get_server_info": lambda b: Reply(200, g.server_info()),
        "/engine_stats": lambda b: Reply(200, g.stats(_float(b.get("since")))),
        "/health": lambda b: g.health(),
        "/health_generate": lambda b: g.health_generate(),
        "/abort_request": g.abort_request,
        "/flush_cache": lambda b: g.flush_cache(),
        "/pause_generation": g.pause_generation,
        "/continue_generation": g.continue_generation,
        "/init_weights_update_group": w.init_weights_update_group,
        "/destroy_weights_update_group": w.destroy_weights_update_group,
        "/begin_weight_update": w.begin_weight_update,
        "/end_weight_update": w.end_weight_update,
        "/update_weights_from_distributed": w.update_weights_from_distributed,
        "/update_weights_from_tensor": w.update_weights_from_tensor,
        "/update_weights_from_disk": w.update_weights_from_disk,
        "/update_weight_version": w.update_weight_version,
        "/get_weights_by_name": w.get_weights_by_name,
        "/weights_checker": w.weights_checker,
        "/v1/models": lambda b: openai.v1_models(engine),
        "/v1/completions": lambda b: openai.v1_completions(g, b),
        "/v1/chat/completions": lambda b: openai.v1_chat_completions(g, b),
    }


def _same_host(peer: str, local: str) -> bool:
    """A peer on this host: a loopback address, or the very address it reached this server at
    (a process connecting to its own host's address is given that address as its source)."""
    mine = _ip(local)
    return _loopback(peer) or (mine is not None and _ip(peer) == mine)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None
    return getattr(ip, "ipv4_mapped", None) or ip


def _loopback(host: str) -> bool:
    ip = _ip(host)  # ::ffff:127.0.0.1 as 127.0.0.1
    return ip is not None and ip.is_loopback


def _float(x) -> float | None:
    try:
        return None if x is None else float(x)
    except (TypeError, ValueError):
        raise BadRequest(f"not a number: {x!r}") from None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # The status line and headers go out in one write and the body in another: with Nagle on, the
    # body waits for the client's delayed ACK of the headers, 40 ms on every keep-alive request.
    disable_nagle_algorithm = True
    server: EngineHTTPServer

    def log_message(self, format, *args):  # quiet: one line per request is too much at 1k req/s
        pass

    def do_GET(self):
        self._handle()

    def do_POST(self):
        self._handle()

    def _handle(self) -> None:
        url = urlparse(self.path)
        route = self.server.routes.get(url.path)
        try:
            body = self._body(url)
            if route is None:
                raise BadRequest(f"no such endpoint: {url.path}", status=404)
            peer = self.client_address[0]
            if url.path in LOOPBACK_ONLY and not _same_host(peer, self.connection.getsockname()[0]):
                raise BadRequest(
                    f"{url.path} takes handles to memory on this host: only from a peer on this "
                    f"host (loopback), not {peer}",
                    status=403,
                )
            reply = route(body)
        except BadRequest as e:
            reply = Reply(e.status, e.body)
        except Exception as e:  # a bug must not kill the server: answer 500 with the reason
            reply = Reply(500, {"error": {"message": f"internal error: {e!r}"}})
        if reply.stream is not None:
            self._send_stream(reply)
        else:
            self._send(reply)

    def _body(self, url) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise BadRequest(f"request body too large ({n} bytes)", status=413)
        raw = self.rfile.read(n) if n else b""
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if not raw.strip():
            return query
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return {**query, **body}

    def _send(self, reply: Reply) -> None:
        if reply.body is None:
            data, ctype = b"", "application/json"
        elif isinstance(reply.body, str):
            data, ctype = reply.body.encode(), "text/plain; charset=utf-8"
        else:
            data, ctype = json.dumps(reply.body).encode(), "application/json"
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _send_stream(self, reply: Reply) -> None:
        self.close_connection = True
        it = reply.stream
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for chunk in it:
                self.wfile.write(chunk)
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        except BadRequest as e:
            err = {
                "error": {
                    "message": str(e),
                    "type": "invalid_request_error",
                    "code": e.status,
                    "retryable": False,
                }
            }
            try:
                self.wfile.write(b"data: " + json.dumps(err).encode() + b"\n\n")
            except OSError:
                pass
        finally:
            it.close()  # aborts what the client no longer reads


class EngineHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], engine: Engine | Classifier):
        self.engine = engine
        self.routes = _routes(engine)
        super().__init__(addr, _Handler)


@dataclass
class EngineServer:
    """An engine served from threads of this process (tests, embedding). ``stop()`` shuts it down."""

    engine: Engine | Classifier
    httpd: EngineHTTPServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.httpd.server_address[0]}:{self.port}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.engine.close()

    def __enter__(self) -> EngineServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(config: EngineConfig, *, host: str = "127.0.0.1", port: int = 0) -> EngineServer:
    """Load the model and serve it on ``host:port`` from background threads; returns at once."""
    from asyncrl.engine.api import Engine
    from asyncrl.engine.classify import Classifier, is_classifier

    engine: Engine | Classifier
    if is_classifier(config.model):
        if config.device == "cuda":  # auto: the CPU, where a classifier runs
            raise ValueError("device cuda: a sequence-classification model is served on CPU only")
        engine = Classifier.load(
            config.model,
            served_model_name=config.served_model_name,
            weight_version=config.weight_version,
            max_batch_size=config.max_batch_size,
        )
    else:
        engine = Engine.load(config)
    httpd = EngineHTTPServer((host, port), engine)
    t = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="engine-http", daemon=True
    )
    t.start()
    return EngineServer(engine=engine, httpd=httpd, thread=t)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="asyncrl engine", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        required=True,
        help="HuggingFace model folder (config.json, safetensors, tokenizer)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 = any free port")
    p.add_argument("--port-file", help="write the bound port here once serving")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--device",
        choices=get_args(EngineDevice),
        default="auto",
        help="auto: cuda when torch sees a GPU, else cpu (a sequence-classification model: cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=get_args(Dtype),
        default="float32",
        help="the weights' and KV cache's dtype on CUDA (on CPU the engine runs float32)",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="serve LoRA adapters of this rank (the recipe's learner.lora.rank): weight updates "
        "carry adapters only, applied over --model's weights; 0: updates carry whole weights",
    )
    p.add_argument("--lora-alpha", type=float, default=16.0, help="the adapters' alpha")
    p.add_argument(
        "--weights",
        default=None,
        help="serve these weights from the start, as /update_weights_from_disk loads them (an HF "
        "folder, or with --lora-rank a PEFT adapter folder); --model's stay the base",
    )
    p.add_argument(
        "--parent-pid",
        type=int,
        default=0,
        help="stop when this process is gone (a rollout worker killed with SIGKILL leaves no engine)",
    )
    a = p.parse_args(argv)
    if not (Path(a.model) / "config.json").is_file():
        print(
            f"asyncrl engine: --model {a.model}: not a HuggingFace model folder (no config.json)",
            file=sys.stderr,
        )
        return 2
    if a.max_batch_size < 1:
        print("asyncrl engine: --max-batch-size must be >= 1", file=sys.stderr)
        return 2
    if a.lora_rank < 0 or (a.lora_rank and not a.lora_alpha > 0):
        print("asyncrl engine: --lora-rank must be >= 0 and --lora-alpha > 0", file=sys.stderr)
        return 2
    import torch

    from asyncrl.engine.api import EngineConfig

    torch.set_num_threads(1)
    # HTTP threads hold the GIL only briefly; a short switch interval lets the decode thread get it
    # back within ~0.5 ms instead of up to 5 ms, which keeps decode steps evenly spaced
    sys.setswitchinterval(float(os.environ.get("ASYNCRL_ENGINE_SWITCH_INTERVAL", "0.0005")))
    cfg = EngineConfig(
        model=a.model,
        max_batch_size=a.max_batch_size,
        weight_version=a.weight_version,
        seed=a.seed,
        served_model_name=a.served_model_name,
        device=a.device,
        dtype=a.dtype,
        lora_rank=a.lora_rank,
        lora_alpha=a.lora_alpha,
        weights=a.weights,
    )
    try:
        srv = serve(cfg, host=a.host, port=a.port)
    except (OSError, ValueError) as e:
        print(f"asyncrl engine: {e}", file=sys.stderr)
        return 2
    if a.port_file:
        tmp = Path(a.port_file + ".tmp")
        tmp.write_text(str(srv.port))
        os.replace(tmp, a.port_file)
    lm = getattr(getattr(srv.engine, "scheduler", None), "lm", None)  # None: a Classifier
    where = f" on {lm.device} in {str(lm.dtype).removeprefix('torch.')}" if lm else ""
    print(f"asyncrl engine: serving {a.model} at {srv.url}{where}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    code = 0
    while not stop.wait(0.1):
        if a.parent_pid and os.getppid() != a.parent_pid:  # reparented: our parent died
            print(f"asyncrl engine: parent {a.parent_pid} is gone; stopping", file=sys.stderr)
            break
        if not hasattr(srv.engine, "scheduler"):  # a Classifier: no decode loop to watch
            continue
        if not srv.engine.scheduler.alive:
            err = srv.engine.scheduler.error
            print(f"asyncrl engine: decode loop died: {err!r}", file=sys.stderr)
            code = 1
            break
    srv.stop()
    for name in list(getattr(srv.engine, "store", None) and srv.engine.store.groups or []):
        srv.engine.store.destroy_group(name)
    quick_exit(code)  # everything is closed: skip the interpreter's slow teardown of torch


if __name__ == "__main__":  # how engine/process.py starts it: as `asyncrl engine` would
    from asyncrl.stacks import dump_stacks_on_usr1

    dump_stacks_on_usr1()
    sys.exit(main(sys.argv[1:]))

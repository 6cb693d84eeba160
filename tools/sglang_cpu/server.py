"""Start and stop a real SGLang 0.5.23 HTTP server on a CPU-only machine (tests/sglang, manual runs).

SGLang runs from its own venv (``build_env.sh`` builds it; torch 2.14.1 there, 2.13 in asyncrl's
.venv) with the import-only ``sgl_kernel`` stand-in from ``stub/`` on PYTHONPATH and the torch-native
attention backend (``--attention-backend torch_native``). The server runs in its own process group, so stopping it
also stops its scheduler and detokenizer processes. Process handling is asyncrl's own
(:class:`asyncrl.launch.children.Child`, :func:`asyncrl.launch.children.stop_children`).

    .venv/bin/python tools/sglang_cpu/server.py MODEL_DIR [--port P]   # serve until Ctrl-C
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.generator_http import healthy, sync_client  # noqa: E402
from asyncrl.launch.children import Child, stop_children  # noqa: E402
from asyncrl.transport import free_port  # noqa: E402

BUILD_ENV = HERE / "build_env.sh"
STUB = HERE / "stub"
LORA_SHIM = HERE / "lora_shim"
ROUTES_SHIM = HERE / "routes_shim"


class SGLangSetupError(RuntimeError):
    """The SGLang environment could not be built, or the server did not come up; one-line cause
    first, then the tail of the relevant log."""


def build_env(timeout_s: float = 1800.0) -> Path:
    """Run ``build_env.sh`` (cached: seconds on a rerun) and return SGLang's python."""
    try:
        p = subprocess.run(
            ["bash", str(BUILD_ENV)], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as e:
        raise SGLangSetupError(f"{BUILD_ENV} did not finish within {timeout_s:.0f}s") from e
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines or not Path(lines[-1]).is_file():
        tail = "\n".join(p.stderr.strip().splitlines()[-15:])
        raise SGLangSetupError(
            f"{BUILD_ENV} failed (exit {p.returncode}): the SGLang CPU environment cannot be "
            f"built on this machine\n{tail}"
        )
    return Path(lines[-1])


def server_env() -> dict[str, str]:
    """The server's environment: CPU engine, offline hub, the stand-in sgl_kernel, one thread."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        SGLANG_USE_CPU_ENGINE="1",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(STUB),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def lora_args(rank: int, targets: list[str]) -> list[str]:
    """Server arguments for runtime LoRA adapters of rank up to ``rank`` on ``targets`` (HF
    names), with SGLang's torch backend (its Triton ones need a GPU)."""
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(rank),
        "--lora-target-modules",
        *targets,
        "--lora-backend",
        "torch_native",
    ]


def lora_env() -> dict[str, str]:
    """What a server started with :func:`lora_args` needs on a CPU-only machine: the shim that
    makes SGLang's pinned host tensors plain ones (lora_shim/sitecustomize.py says why)."""
    return {"PYTHONPATH": f"{LORA_SHIM}{os.pathsep}{STUB}"}


ROUTES_ARGS = ["--enable-return-routed-experts"]
"""Server arguments for an MoE model's routed experts (a request's ``return_routed_experts``)."""


def routes_env() -> dict[str, str]:
    """What a server started with :data:`ROUTES_ARGS` needs on a CPU-only machine: the shim that
    makes SGLang's pinned routes buffer a plain one (routes_shim/sitecustomize.py says why)."""
    return {"PYTHONPATH": f"{ROUTES_SHIM}{os.pathsep}{STUB}"}


@dataclass(kw_only=True)
class SGLangServer:
    """One ``sglang.launch_server`` process (group) serving ``model`` on ``host:port``."""

    python: Path
    model: Path
    log: Path
    port: int = 0  # 0: pick a free one
    host: str = "127.0.0.1"
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # added to server_env()'s
    child: Child | None = None
    started_at: float = 0.0  # time.monotonic() at start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        return [
            str(self.python),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model),
            "--device",
            "cpu",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--attention-backend",
            "torch_native",
            "--disable-overlap-schedule",
            "--dtype",
            "float32",
            "--max-total-tokens",
            "8192",
            "--tp",
            "1",
            # An idle scheduler polls its sockets in a busy loop: ~1 core per server on CPU, taken
            # from the tests and the learner beside it (measured: 0.80 core idle without the flag,
            # 0.01 with it). With it, an idle scheduler blocks in zmq's poll, which returns as soon
            # as a request or a control call arrives, so nothing waits longer.
            "--sleep-on-idle",
            *self.extra_args,
        ]

    def start(self) -> None:
        """Launch without waiting (start several, then :meth:`wait_healthy` on each)."""
        if self.port == 0:
            self.port = free_port(self.host)
        self.child = Child(name=f"sglang:{self.port}", argv=self.argv(), log=self.log)
        self.started_at = time.monotonic()
        self.child.start({**server_env(), **self.env})

    def wait_healthy(self, timeout_s: float = 300.0) -> float:
        """Wait until ``/health`` answers 200; returns the seconds since :meth:`start`.
        Raises :class:`SGLangSetupError` (with the log tail) if it exits or times out."""
        assert self.child is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        with sync_client(5.0) as http:
            while time.monotonic() < deadline:
                if self.child.poll() is not None:
                    raise SGLangSetupError(
                        f"SGLang server for {self.model} exited with code {self.child.poll()} "
                        f"during start-up (log {self.log}):\n{self.child.tail(25)}"
                    )
                if healthy(http, self.url):
                    return time.monotonic() - self.started_at
                time.sleep(0.5)
        raise SGLangSetupError(
            f"SGLang server for {self.model} not healthy after {timeout_s:.0f}s "
            f"(log {self.log}):\n{self.child.tail(25)}"
        )

    def alive(self) -> bool:
        return self.child is not None and self.child.poll() is None

    def signal_group(self, sig: int) -> None:
        """Signal the whole server (its scheduler and detokenizer too)."""
        assert self.child is not None
        self.child.signal_group(sig)

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL what is left after a grace period (a stopped group too)."""
        if self.child is None:
            return
        self.child.signal_group(signal.SIGCONT)  # a SIGSTOPped server must be able to exit
        stop_children([self.child], grace_s=15.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--log", type=Path, default=Path("sglang-server.log"))
    a = p.parse_args(argv)
    try:
        server = SGLangServer(python=build_env(), model=a.model.resolve(), port=a.port, log=a.log)
        server.start()
        took = server.wait_healthy()
    except SGLangSetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"SGLang serving {a.model} at {server.url} (healthy after {took:.0f}s; log {a.log})")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the server on TERM too
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (ignored in background jobs)
    try:
        while server.alive():
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

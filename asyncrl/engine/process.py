"""Start `asyncrl engine` as a child process and wait until it answers /health.

The child binds port 0 unless told otherwise and writes the bound port to a file, so callers never
pick ports. ``stop()`` sends SIGTERM, then SIGKILL after a timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.generator_http import healthy, sync_client


@dataclass
class EngineProcess:
    """A running engine child process: ``url`` is ``http://host:port``."""

    proc: subprocess.Popen
    host: str
    port: int
    log_path: Path
    _tmpdir: tempfile.TemporaryDirectory | None = field(default=None, repr=False)
    started_at: float = field(default_factory=time.monotonic)  # when it was launched

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float) -> None:
        """Return once /health answers 200; on an exit or a timeout, stop it and raise
        ``RuntimeError`` with the log's tail."""
        port_file = Path(self._tmpdir.name) / "port" if self._tmpdir is not None else None
        deadline = time.monotonic() + timeout_s
        http = sync_client(2.0)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"engine exited with code {self.proc.returncode}:\n{self.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"engine not healthy within {timeout_s:.0f}s:\n{self.log_tail()}"
                    )
                if self.port == 0 and port_file is not None and port_file.exists():
                    self.port = int(port_file.read_text())
                if self.port and healthy(http, self.url):
                    return
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        finally:
            http.close()

    def stop(self, timeout_s: float = 10.0) -> int:
        """Terminate the engine; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        return self.proc.returncode

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def spawn_engine_process(
    model_dir: str | os.PathLike,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_batch_size: int = 64,
    weight_version: str = "default",
    seed: int = 0,
    log_path: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    lora_rank: int = 0,
    lora_alpha: float = 16.0,
    weights: str | os.PathLike | None = None,
) -> EngineProcess:
    """Launch ``python -m asyncrl.engine.server`` and return at once: the caller does its
    own start-up work while the engine loads, then calls :meth:`EngineProcess.wait_healthy`.
    stdout and stderr go to ``log_path`` (a temporary file when None). ``device``: auto, cpu or
    cuda (the recipe's ``generator.device``); ``dtype``: its dtype on CUDA (``model.dtype``).
    ``lora_rank`` > 0: it serves LoRA adapters (the recipe's ``learner.lora``) over the model's
    weights; ``weights``: what it serves from the start (a PEFT adapter folder with LoRA)."""
    tmp = tempfile.TemporaryDirectory(prefix="asyncrl-engine-")
    port_file = Path(tmp.name) / "port"
    log = Path(log_path) if log_path is not None else Path(tmp.name) / "engine.log"
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.engine.server",
        "--model",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--port-file",
        str(port_file),
        "--max-batch-size",
        str(max_batch_size),
        "--weight-version",
        weight_version,
        "--seed",
        str(seed),
        "--device",
        device,
        "--dtype",
        dtype,
        "--parent-pid",
        str(os.getpid()),
    ]
    if lora_rank:
        cmd += ["--lora-rank", str(lora_rank), "--lora-alpha", repr(float(lora_alpha))]
    if weights is not None:
        cmd += ["--weights", str(weights)]
    child_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env)
    return EngineProcess(proc=proc, host=host, port=port, log_path=log, _tmpdir=tmp)


def start_engine_process(
    model_dir: str | os.PathLike,
    *,
    timeout_s: float = 120.0,
    **kwargs: Any,
) -> EngineProcess:
    """:func:`spawn_engine_process`, then wait until /health answers 200 (its keyword arguments).

    Raises ``RuntimeError`` (with the log's tail) if the child exits or is not healthy in time.
    """
    ep = spawn_engine_process(model_dir, **kwargs)
    ep.wait_healthy(timeout_s)
    return ep

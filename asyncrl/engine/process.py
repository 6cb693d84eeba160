"""Start `asyncrl engine` as a child process and wait until it answers /health.

The child binds port 0 unless told otherwise and writes the bound port to a file, so callers never
pick ports. ``stop()`` sends SIGTERM, then SIGKILL after a timeout.

With ``fork=True`` (the rollout worker's engines) a child on the CPU is forked from the caller once
the caller has imported what the engine imports (torch, transformers and the model's classes: ~3.5 s
of CPU, most of an engine's start on these cores; the worker needs torch and transformers for its
tokenizer anyway), rather than started as a fresh interpreter that imports them all again: on two
cores shared by three starting processes that is the demo's first step ~2.2 s sooner
(BENCHMARKS.md, session 20). A CUDA engine is always a fresh interpreter: a process that has asked
the driver anything cannot hand CUDA to a forked child. ``ASYNCRL_ENGINE_FORK=0`` turns forking off
(the benchmarks' side-by-side).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.generator_http import healthy, sync_client


class ForkedChild:
    """What :class:`EngineProcess` uses of a ``subprocess.Popen``, for a child forked from this
    process (its pid is this process's to reap)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, its code unknown
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"engine (pid {self.pid})", timeout or 0.0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@dataclass
class EngineProcess:
    """A running engine child process: ``url`` is ``http://host:port``."""

    proc: subprocess.Popen | ForkedChild
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
    fork: bool = False,
) -> EngineProcess:
    """Launch ``python -m asyncrl.engine.server`` and return at once: the caller does its
    own start-up work while the engine loads, then calls :meth:`EngineProcess.wait_healthy`.
    stdout and stderr go to ``log_path`` (a temporary file when None). ``device``: auto, cpu or
    cuda (the recipe's ``generator.device``); ``dtype``: its dtype on CUDA (``model.dtype``).
    ``lora_rank`` > 0: it serves LoRA adapters (the recipe's ``learner.lora``) over the model's
    weights; ``weights``: what it serves from the start (a PEFT adapter folder with LoRA).
    ``fork``: fork it from this process where :func:`can_fork` allows (this process then imports
    the engine's modules first), else start a fresh interpreter."""
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
    proc: subprocess.Popen | ForkedChild | None = None
    if fork and can_fork(device):
        preload(str(model_dir))
        proc = _fork(cmd[3:], log, child_env)  # None: an import started a thread after all
    if proc is None:
        with open(log, "ab") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env)
    return EngineProcess(proc=proc, host=host, port=port, log_path=log, _tmpdir=tmp)


def can_fork(device: str) -> bool:
    """Whether an engine on ``device`` may be forked from this process: on Linux, on the CPU
    (``auto`` where torch has no CUDA: asking it whether a GPU is there would start the driver
    here), from a process of one thread, Python's or native (a fork copies no other thread, and a
    lock one of them held stays held in the child), and not where ASYNCRL_ENGINE_FORK=0 asks for
    fresh interpreters."""
    if sys.platform != "linux" or os.environ.get("ASYNCRL_ENGINE_FORK", "1") == "0":
        return False
    if device not in ("cpu", "auto") or not _one_thread():
        return False
    if device == "auto":
        import torch

        return not torch.backends.cuda.is_built()
    return True


def preload(model_dir: str) -> None:
    """Import here what an engine on ``model_dir`` imports at its start (torch, transformers, the
    model's own classes), so that a child forked afterwards finds them loaded. A failure is left to
    the child, which meets it again and reports it in its log."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        import asyncrl.engine.api  # noqa: F401  torch and the engine's own modules
        import asyncrl.engine.server  # noqa: F401

        AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(model_dir))]
    except Exception:
        pass


def _one_thread() -> bool:
    return len(os.listdir("/proc/self/task")) == 1


def _fork(args: list[str], log: Path, env: dict[str, str]) -> ForkedChild | None:
    """``asyncrl engine ARGS`` in a child forked from this process, its output in ``log``; None,
    forking nothing, if this process has more than one thread."""
    from asyncrl.engine import server

    if not _one_thread():
        return None

    sys.stdout.flush()  # else the child writes the parent's buffered text again
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pid = os.fork()
    if pid:
        os.close(fd)
        return ForkedChild(pid)
    code = 1  # the child: it never returns into the caller's code
    try:
        atexit._clear()  # the caller's exit handlers (its temporary folders' clean-up) are not ours
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.clear()
        os.environ.update(env)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)  # the engine sets its own, not the caller's
        code = server.main(args)  # it ends the process itself once serving ends
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


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

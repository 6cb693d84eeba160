"""The built-in generator: SGLang's HTTP API on HuggingFace transformers models, on the CPU or a GPU.

Start one as a child process (``start_engine_process``; ``spawn_engine_process`` returns before it
is healthy) or in this process (``serve``); both give a ``.url`` that any SGLang client can talk to,
and a ``.stop()``. A process of its own, so a room of its own (docs/design.md §9): below rollout/,
which starts a worker's engines and talks to them over HTTP; its old import path (under rollout/)
fails with one line naming this one.
"""

from __future__ import annotations

from asyncrl.engine.process import (
    EngineProcess,
    spawn_engine_process,
    start_engine_process,
)

__all__ = [
    "EngineProcess",
    "spawn_engine_process",
    "start_engine_process",
    "serve",
    "EngineConfig",
    "EngineServer",
]


def __getattr__(name: str):
    # serve/EngineConfig pull in torch and transformers; import them only when asked for
    if name in ("serve", "EngineServer"):
        from asyncrl.engine import server

        return getattr(server, name)
    if name == "EngineConfig":
        from asyncrl.engine.api import EngineConfig

        return EngineConfig
    raise AttributeError(name)

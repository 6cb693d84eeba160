"""The engine's old import path (asyncrl.rollout.engine, before issue #47 gave the engine a room of
its own) fails with one line naming the new one, for its modules and `python -m` alike."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MESSAGE = "asyncrl.rollout.engine moved to asyncrl.engine: import asyncrl.engine instead"


@pytest.mark.parametrize("name", ["asyncrl.rollout.engine", "asyncrl.rollout.engine.server"])
def test_the_old_path_names_the_new_one(name: str) -> None:
    with pytest.raises(ImportError, match="^" + MESSAGE + "$"):
        importlib.import_module(name)


def test_the_new_path_is_there() -> None:
    from asyncrl.engine import spawn_engine_process, start_engine_process

    assert spawn_engine_process.__module__ == "asyncrl.engine.process"
    assert start_engine_process.__module__ == "asyncrl.engine.process"


def test_python_m_of_the_old_server_path_fails_with_one_line() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "asyncrl.rollout.engine.server", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode != 0
    assert p.stdout == ""
    (line,) = p.stderr.strip().splitlines()
    assert f"'asyncrl.rollout.engine.server' (ImportError: {MESSAGE})" in line

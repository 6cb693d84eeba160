"""The `asyncrl` console script: one subcommand per process kind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from asyncrl.cli import COMMANDS


def _asyncrl() -> list[str]:
    """The installed console script next to this interpreter, else the module."""
    script = Path(sys.executable).parent / "asyncrl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "asyncrl.cli"]


def test_help_lists_every_command():
    p = subprocess.run(
        [*_asyncrl(), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stderr
    for name in ("learner", "rollout", "run", "engine", "check", "graph"):
        assert name in COMMANDS
        assert f"{name}:" in p.stdout
    assert shutil.which("asyncrl", path=str(Path(sys.executable).parent)) is not None


def test_unknown_command_is_a_usage_error(capsys):
    from asyncrl.cli import main

    try:
        main(["trian"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("an unknown command was accepted")
    assert "invalid choice: 'trian'" in capsys.readouterr().err


def test_flags_and_overrides_mix_in_any_order(capsys):
    """`asyncrl check RECIPE --no-files key=value` takes the override after the flag, as
    `asyncrl run RECIPE --overwrite key=value` does (argparse alone refuses a positional list after
    a flag): the resolved recipe shows it."""
    from asyncrl.cli import run_command

    recipe = str(Path(__file__).resolve().parents[1] / "recipes/demo.yaml")
    assert run_command(["check", recipe, "--no-files", "buffer.max_staleness=2"]) == 0
    assert "max_staleness: 2" in capsys.readouterr().out

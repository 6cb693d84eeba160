"""`asyncrl engine` CLI errors (the child-process helper is exercised by tests/engine/test_weights.py)."""

from __future__ import annotations

import subprocess
import sys


def test_cli_rejects_a_missing_model_folder(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "engine",
            "--model",
            str(tmp_path / "nope"),
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "not a HuggingFace model folder" in r.stderr and "Traceback" not in r.stderr

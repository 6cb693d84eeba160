"""Where asyncrl starts a trio event loop: in two places only. The control plane's thread (rank 0's
services, and any blocking code that runs async code, such as a held-out evaluation from the CLI) and
the rollout worker, a trio program. A third ``trio.run`` is a loop nested in a worker thread or a
second way into trio, which is what ``ControlPlane`` is for."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "asyncrl"


def _trio_run_calls(path: Path) -> int:
    tree = ast.parse(path.read_text(), filename=str(path))
    return sum(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "run"
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "trio"
        for n in ast.walk(tree)
    )


def test_trio_run_is_called_by_the_control_plane_and_the_rollout_worker_only():
    sites = {
        str(p.relative_to(PACKAGE)): k
        for p in sorted(PACKAGE.rglob("*.py"))
        if (k := _trio_run_calls(p))
    }
    assert sites == {"control.py": 1, "rollout/main.py": 1}, sites

"""Every benchmark in tools/bench/ starts: its imports resolve and its options parse.

The benchmarks are run by hand (their figures go to BENCHMARKS.md), so nothing else notices when a
refactor breaks one; ``--help`` exercises everything up to the measurement.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = sorted((Path(__file__).resolve().parents[2] / "tools" / "bench").glob("*.py"))


@pytest.mark.parametrize("script", BENCH, ids=[p.stem for p in BENCH])
def test_bench_starts(script: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout

"""tools/ci/failures.py reads real pytest logs: the failing tests' names, first assertions and
tracebacks, which `.ci/run` prints at its end and `tools/ci/soak.py` counts across runs.

The logs are made by running pytest, as `make test` does (`-q`, two xdist workers), on a small
test file written here: two failures (one in a class, parametrized), an error in a fixture's
set-up, a failure two frames deep under a name as long as pytest's rule, and passing tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.ci.failures import closing_line, parse, report
from tools.ci.soak import summarize

ROOT = Path(__file__).resolve().parents[2]
LONG = "test_a_name_so_long_that_pytest_rules_it_with_one_underscore_on_each_side_of_it_x"

SAMPLE = """
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("the fixture broke")

def test_passes():
    assert 1 + 1 == 2

def test_compares():
    got = [1, 2, 3]
    assert got == [1, 2, 4], "the third differs"

class TestGroup:
    @pytest.mark.parametrize("x", [1, 7])
    def test_small(self, x):
        assert x < 5

def test_uses_broken(broken):
    pass

def _deeper(x):
    assert x == 0, "a frame below the test"

def test_a_name_so_long_that_pytest_rules_it_with_one_underscore_on_each_side_of_it_x():
    _deeper(3)
"""


@pytest.fixture(scope="module")
def pytest_log(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("sample")
    (d / "test_sample.py").write_text(SAMPLE)
    (d / "conftest.py").write_text("")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "-o",
         "addopts=", "test_sample.py"],
        cwd=d, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    return out.stdout


def test_names_each_failure_with_its_first_assertion(pytest_log):
    got = {f.nodeid: f for f in parse(pytest_log)}
    assert set(got) == {
        "test_sample.py::test_compares",
        "test_sample.py::TestGroup::test_small[7]",
        "test_sample.py::test_uses_broken",
        f"test_sample.py::{LONG}",
    }
    assert got["test_sample.py::test_compares"].kind == "FAILED"
    assert "the third differs" in got["test_sample.py::test_compares"].message
    assert "7 < 5" in got["test_sample.py::TestGroup::test_small[7]"].message
    err = got["test_sample.py::test_uses_broken"]
    assert err.kind == "ERROR" and "the fixture broke" in err.message
    # each keeps its own traceback, not a neighbour's
    assert "got == [1, 2, 4]" in got["test_sample.py::test_compares"].traceback
    assert "x < 5" in got["test_sample.py::TestGroup::test_small[7]"].traceback
    assert "the fixture broke" in err.traceback
    assert "x < 5" not in got["test_sample.py::test_compares"].traceback
    # a name as long as pytest's rule, and a traceback of two frames (`_ _ _` between them)
    long = got[f"test_sample.py::{LONG}"]
    assert long.message.startswith("AssertionError: a frame below the test")
    assert "_deeper(3)" in long.traceback and "assert x == 0" in long.traceback


def test_closing_line_and_a_clean_log(pytest_log):
    assert "3 failed" in closing_line(pytest_log) and "1 error" in closing_line(pytest_log)
    clean = "....\n==== 4 passed in 0.1s ====\n"
    assert parse(clean) == [] and closing_line(clean) == "4 passed in 0.1s"
    two = clean + "..\n2 passed in 0.2s\n"  # make test: the default tier, then a numerics pass
    assert closing_line(two) == "4 passed in 0.1s | 2 passed in 0.2s"


def test_report_ends_with_the_names(pytest_log, tmp_path):
    log = tmp_path / "default.log"
    log.write_text(pytest_log)
    out = report([log, tmp_path / "missing.log"]).splitlines()
    names = out[out.index("==== failing tests ====") + 1 :]
    assert len(names) == 4 and names[-1].startswith("  ERROR test_sample.py::test_uses_broken")
    assert any("assert got == [1, 2, 4]" in ln for ln in out[: out.index(names[0])])
    ok = tmp_path / "ok.log"
    ok.write_text("==== 4 passed in 0.1s ====\n")
    assert report([ok]) == ""


def test_ci_run_prints_the_report_last(tmp_path):
    """`.ci/run`'s exit trap prints the failure report after the tier times."""
    text = (ROOT / ".ci" / "run").read_text()
    trap = next(ln for ln in text.splitlines() if ln.startswith("trap "))
    assert "tools/ci/failures.py" in trap
    assert trap.index("CI tier times") < trap.index("tools/ci/failures.py")


def test_soak_summary_counts_failures_across_runs(pytest_log):
    found = parse(pytest_log)
    runs = [
        dict(run=1, tier="default", load=0, rc=1, wall=10.0, closing=closing_line(pytest_log)),
        dict(run=2, tier="default", load=0, rc=0, wall=9.0, closing="4 passed"),
    ]
    text = summarize(runs, {f.nodeid: [f] for f in found})
    assert "failing tests over 2 run(s):" in text
    assert "1/2  test_sample.py::test_compares" in text
    assert "no failing test" in summarize(runs[1:], {})

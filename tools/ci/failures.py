"""The failing tests of pytest logs, named with their first assertion and their tracebacks.

A CI log is long, and a reader sees its tail: pytest prints a failing test's traceback in the
middle of its tier's output, and `.ci/run` runs several tiers after it. This reads the logs back
and prints what a reader needs at the end: each failing test's traceback (cut to its last lines),
then one line per failing test with its first `E ` line. `tools/ci/soak.py` uses the same parser
to count which tests fail across runs.

    python tools/ci/failures.py LOG [LOG ...]      # exits 0; prints nothing when nothing failed

Standard library only: `.ci/run` calls it even when the venv could not be built.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

# `FAILED tests/a.py::test_b[x] - AssertionError: ...`, `ERROR tests/a.py::test_c`
_SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$")
# a section header: `====== FAILURES ======`, `==== short test summary info ====`
_HEADER = re.compile(r"^={3,} (.+?) ={3,}$")
# one test's traceback inside FAILURES / ERRORS: `____ test_b[x] ____`, `__ ERROR at setup of t __`,
# `_ test_with_a_name_as_long_as_the_line _`; not a traceback's `_ _ _ _` between two frames
_TEST_RULE = re.compile(r"^_+ ([^_ ].*?) _+$")
# its closing line, bare under -q (`1 failed, 1089 passed in 962.10s (0:16:02)`), else in rules
_CLOSING = re.compile(r"^=*\s*((?:\d+ [a-z]+, )*\d+ [a-z]+ in [\d.]+s.*?|no tests ran.*?)\s*=*$")


@dataclass
class Failure:
    """One failing (or erroring) test of one log."""

    kind: str  # FAILED or ERROR
    nodeid: str  # tests/a.py::test_b[x]
    message: str  # the first `E ` line of its traceback, else the summary line's message
    traceback: str  # its section of FAILURES / ERRORS, '' when none was printed


def _sections(lines: list[str]) -> dict[str, str]:
    """Each test's traceback section, by the title pytest's rule gives it (`test_b[x]`,
    `ERROR at setup of test_c`, `TestK.test_d`)."""
    out: dict[str, str] = {}
    inside = False
    title, body = None, []
    for line in lines:
        head = _HEADER.match(line)
        if head:
            if title is not None:
                out[title] = "\n".join(body)
            title, body = None, []
            inside = head.group(1) in ("FAILURES", "ERRORS")
            continue
        if not inside:
            continue
        rule = _TEST_RULE.match(line)
        if rule:
            if title is not None:
                out[title] = "\n".join(body)
            title, body = rule.group(1), []
        elif title is not None:
            body.append(line)
    if title is not None:
        out[title] = "\n".join(body)
    return out


def _section_for(nodeid: str, sections: dict[str, str]) -> str:
    """pytest titles a section by the test's name after the file (`Class.test[param]`), and an
    error by `ERROR at setup of ...`: match on that tail."""
    tail = nodeid.split("::", 1)[-1].replace("::", ".")
    for title, body in sections.items():
        if title == tail or title.endswith(" of " + tail) or title.endswith("." + tail):
            return body
    return ""


def parse(text: str) -> list[Failure]:
    """The failures a pytest log reports in its short test summaries (pytest prints `FAILED` and
    `ERROR` lines there by default), each with its traceback when the log has one. A log holding
    several pytest runs (make test's default tier, then its numerics passes) gives each run's."""
    lines = text.splitlines()
    sections = _sections(lines)
    failures: list[Failure] = []
    seen: set[tuple[str, str]] = set()
    for line in lines:
        m = _SUMMARY.match(line.rstrip())
        if not m:
            continue
        kind, nodeid, msg = m.group(1), m.group(2), (m.group(3) or "").strip()
        if (kind, nodeid) in seen:
            continue
        seen.add((kind, nodeid))
        tb = _section_for(nodeid, sections)
        first_e = next(
            (ln[1:].strip() for ln in tb.splitlines() if ln.startswith("E ") and ln[1:].strip()),
            "",
        )
        failures.append(Failure(kind, nodeid, first_e or msg, tb))
    return failures


def closing_line(text: str) -> str:
    """pytest's closing lines (`1 failed, 1089 passed in 962.1s`), one per pytest run in the log
    (make test: the default tier, then its numerics passes), joined by ` | `; '' if none."""
    found = []
    for line in text.splitlines():
        m = _CLOSING.match(line.strip())
        if m:
            found.append(m.group(1))
    return " | ".join(found)


def report(logs: list[Path], tb_lines: int = 60) -> str:
    """What `.ci/run` prints last: the tracebacks, then the names, so the names end the log."""
    parts: list[str] = []
    names: list[str] = []
    for log in logs:
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        for f in parse(text):
            tb = f.traceback.splitlines()
            cut = tb[-tb_lines:]
            header = f"---- {f.kind} {f.nodeid} ({log.name})"
            if len(tb) > tb_lines:
                header += f": last {tb_lines} of {len(tb)} traceback lines"
            parts.append("\n".join([header, *cut]) if cut else header + ": no traceback printed")
            names.append(f"  {f.kind} {f.nodeid}: {f.message[:300]}")
    if not names:
        return ""
    return "\n".join(
        ["==== failing tests: tracebacks ====", *parts, "==== failing tests ====", *names]
    )


def main(argv: list[str]) -> int:
    text = report([Path(a) for a in argv])
    if text:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

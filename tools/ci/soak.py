"""Run a test tier again and again from fresh clones, beside busy cores, and count what fails.

A submission lands only if `.ci/run` passes once; a test that fails one run in twenty costs a
day now and then, and a rerun that passes hides it. This repeats the tier CI runs, each time in a
new clone of one commit (so nothing a run leaves behind reaches the next, and the venv is built
as a new machine builds it), optionally beside K processes that each keep one core busy (CI's
machine may be busier than yours), and prints every failing test with how often it failed and
its first assertion.

    python tools/ci/soak.py N [--tier default|numerics|test|faults|sglang|ci] [--load K] [--ref REV]

`default` is the default tier (`make test-default`), `numerics` the numerics tier under another
CPU's kernels (`make test-kernels`), `test` both as `make test` runs them, `faults` and `sglang`
the other tiers, `ci` the whole `.ci/run`. Each run's log is kept under --workdir; one
line per run is appended to --results (TSV: start, commit, tier, busy processes, the 15-min load
average at its end, exit status, wall seconds, pytest's closing line, the failing tests, the CPU),
from which BENCHMARKS.md's soak table is written.
Standard library only; the clones build their own venvs.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

if __package__ in (None, ""):  # run as a script: tools/ is not a package on sys.path then
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.ci.failures import Failure, closing_line, parse

ROOT = Path(__file__).resolve().parents[2]
TIERS = {
    "default": ["make", "test-default"],
    "numerics": ["make", "test-kernels"],
    "test": ["make", "test"],
    "faults": ["make", "test-faults"],
    "sglang": ["make", "test-sglang"],
    "ci": ["bash", ".ci/run"],
}
_BUSY = "while True: pass"


def cpu_facts() -> str:
    """`AMD EPYC, avx512` or `..., avx2`: which kernels torch picks differs by this."""
    model, flags = platform.processor() or "?", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    isa = "avx512" if " avx512f" in flags else "avx2" if " avx2" in flags else "no-avx2"
    return f"{model}, {os.cpu_count()} cores, {isa}"


def start_load(k: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", _BUSY]) for _ in range(k)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def run_once(clone: Path, tier: str, log: Path, timeout_s: float) -> tuple[int, float]:
    """One tier in `clone`, its output in `log`; (exit status, wall seconds). At the timeout the
    whole process group is killed and the status is 124, as `timeout` gives."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "VIRTUAL_ENV")}
    env.update(CI="true", ASYNCRL_FAULTS_REQUIRE_NETNS="1")
    env.pop("PYTHONPATH", None)
    t0 = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            TIERS[tier], cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    return rc, time.monotonic() - t0


def fresh_clone(repo: Path, ref: str, dest: Path) -> str:
    """A new clone of `repo` at `ref` (the commit's id returned)."""
    subprocess.run(["rm", "-rf", str(dest)], check=True)
    subprocess.run(["git", "clone", "-q", str(repo), str(dest)], check=True)
    subprocess.run(["git", "-C", str(dest), "checkout", "-q", ref], check=True)
    out = subprocess.run(
        ["git", "-C", str(dest), "rev-parse", "--short", "HEAD"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return out.stdout.strip()


def summarize(runs: list[dict], failures: dict[str, list[Failure]]) -> str:
    lines = [
        f"{'run':>3}  {'tier':8} {'load':>4} {'exit':>4} {'wall':>7}  pytest's closing line",
    ]
    for r in runs:
        lines.append(
            f"{r['run']:>3}  {r['tier']:8} {r['load']:>4} {r['rc']:>4} {r['wall']:>6.0f}s  "
            f"{r['closing'] or '(no closing line: see its log)'}"
        )
    n = len(runs)
    if failures:
        lines.append(f"failing tests over {n} run(s):")
        for nodeid, fs in sorted(failures.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"  {len(fs)}/{n}  {nodeid}")
            lines.append(f"        {fs[0].message[:300]}")
    else:
        bad = [r for r in runs if r["rc"] != 0]
        lines.append(
            f"no failing test over {n} run(s)"
            + (f"; but {len(bad)} run(s) exited non-zero: see their logs" if bad else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", type=int, help="how many runs")
    ap.add_argument("--tier", choices=sorted(TIERS), default="default")
    ap.add_argument("--load", type=int, default=0, help="busy processes beside each run")
    ap.add_argument("--ref", default="HEAD", help="the commit to clone (default: HEAD)")
    ap.add_argument("--repo", type=Path, default=ROOT, help="the repository to clone")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/asyncrl-soak"))
    ap.add_argument("--results", type=Path, default=None, help="TSV to append (default: workdir)")
    ap.add_argument("--timeout", type=float, default=5400, help="seconds per run (CI's limit)")
    ap.add_argument("--keep", action="store_true", help="keep each run's clone")
    a = ap.parse_args(argv)
    if a.n < 1 or a.load < 0:
        ap.error("N must be at least 1 and --load at least 0")
    a.workdir.mkdir(parents=True, exist_ok=True)
    results = a.results or a.workdir / "soak.tsv"
    ref = subprocess.run(
        ["git", "-C", str(a.repo), "rev-parse", a.ref], check=True, capture_output=True, text=True
    ).stdout.strip()
    machine = cpu_facts()
    print(f"soak: {a.n} x {a.tier} at {ref[:7]}, load {a.load}, on {machine}", flush=True)
    runs: list[dict] = []
    failures: dict[str, list[Failure]] = defaultdict(list)
    for i in range(1, a.n + 1):
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        clone = a.workdir / f"clone-{i}"
        commit = fresh_clone(a.repo, ref, clone)
        log = a.workdir / f"{stamp}-{commit}-{a.tier}-load{a.load}-run{i}.log"
        print(f"[{i}/{a.n}] {a.tier} started {stamp}, log {log}", flush=True)
        load = start_load(a.load)
        try:
            rc, wall = run_once(clone, a.tier, log, a.timeout)
        finally:
            stop(load)
        text = log.read_text(errors="replace")
        found = parse(text)
        load15 = Path("/proc/loadavg").read_text().split()[2]  # what else ran beside it
        for f in found:
            failures[f.nodeid].append(f)
        r = dict(run=i, tier=a.tier, load=a.load, rc=rc, wall=wall, closing=closing_line(text))
        r["loadavg15"] = load15
        runs.append(r)
        print(
            f"[{i}/{a.n}] exit {rc} in {wall:.0f} s (15-min load average {load15}): "
            f"{r['closing'] or 'no closing line'}"
            + "".join(f"\n      {f.kind} {f.nodeid}: {f.message[:200]}" for f in found),
            flush=True,
        )
        with results.open("a") as out:
            names = ";".join(f.nodeid for f in found) or "-"
            out.write(
                "\t".join([stamp, commit, a.tier, str(a.load), load15, str(rc), f"{wall:.0f}",
                           r["closing"] or "-", names, machine]) + "\n"
            )  # fmt: skip
        if not a.keep:
            subprocess.run(["rm", "-rf", str(clone)], check=False)
    print(summarize(runs, failures), flush=True)
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

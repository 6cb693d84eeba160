"""How many cores a command's whole process tree keeps busy: its wall time, its CPU seconds (user +
system, every descendant's, read from /proc once a second) and their ratio.

    python tools/bench/tree_cpu.py [--series FILE] -- make test-sglang

A tier of tests can only run beside another one for free if it leaves a core idle, and its wall time
says nothing about that on a loaded machine; its CPU seconds do not depend on the load. Each process
is counted at the last sample that saw it, so one that lives less than a second may be missed
(interpreter start-ups are longer). Linux only (/proc). Last line: JSON {"bench": "tree_cpu", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a live process, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK  # ppid, utime + stime


def tree_cpu(root: int) -> dict[int, float]:
    """CPU seconds of ``root`` and of every live descendant, by pid."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (s := _stat(int(entry))) is not None:
            stats[int(entry)] = s
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            out[pid] = stats[pid][1]
            todo += children.get(pid, [])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--series", type=Path, help="write 'seconds cpu_seconds' once a second here")
    p.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args()
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("name a command to run, after --")
    t0 = time.monotonic()
    proc = subprocess.Popen(command)
    seen: dict[int, float] = {}
    series = []
    while proc.poll() is None:
        for pid, cpu in tree_cpu(proc.pid).items():
            seen[pid] = max(seen.get(pid, 0.0), cpu)
        series.append((time.monotonic() - t0, sum(seen.values())))
        time.sleep(1.0)
    wall, cpu = time.monotonic() - t0, sum(seen.values())
    if a.series:
        a.series.write_text("".join(f"{t:.0f} {c:.1f}\n" for t, c in series))
    figures = {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "cores": round(cpu / wall, 2)}
    print(
        json.dumps(
            {"bench": "tree_cpu", "command": " ".join(command), "rc": proc.returncode}
            | figures
            | {"load_avg_1m": os.getloadavg()[0]}
        )
    )
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())

"""`asyncrl doctor RECIPE [key=value ...]`: a preflight on the machine a run will use, before step 1.

One line per check, ✓ or ✗ with the fix: the recipe and its files, the devices and their memory,
the model and the attention it will train with, a memory plan per learner rank and per generator
against the device memory (:mod:`asyncrl.memory`), the SGLang servers (reachable, version, TP size,
radix cache against ``weights.pause_mode``, weight-version label, and their logprobs against the
learner's at the recipe's temperature: :func:`check_logprobs`), NCCL on both sides
(:mod:`asyncrl.gpu`), the ports the learner will bind, and the TLS files. On a machine without a GPU
the same checks run where they apply (host memory, gloo).

Exit codes: 0 every check passes; 2 one does not (a plan that does not fit, a server to relaunch, a
port in use...), named on the last line. Never a traceback: a check that cannot run says why.

Each check is a function of the :class:`Doctor` (the recipe and what the checks before it found,
context.py) returning its lines, filed by what it checks: host.py (files, device, ports, TLS),
model_checks.py (model, attention), generators.py (the built-in engines or each SGLang server),
server_logprobs.py (the servers' logprobs against the learner's), memory_checks.py (learner memory,
placement, generator memory and the fixes), nccl.py. :data:`CHECKS` lists them in the order they
run; this file runs them (:func:`run`, :func:`main`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from asyncrl import recipe as recipe_mod
from asyncrl.doctor.context import Check, Device, Doctor
from asyncrl.doctor.generators import check_generators
from asyncrl.doctor.host import check_device, check_files, check_ports, check_tls
from asyncrl.doctor.memory_checks import (
    check_generator_memory,
    check_learner_memory,
    check_placement,
)
from asyncrl.doctor.model_checks import check_attention, check_model
from asyncrl.doctor.nccl import check_nccl
from asyncrl.doctor.server_logprobs import check_logprobs, judge_logprobs

__all__ = [
    "CHECKS",
    "Check",
    "Device",
    "Doctor",
    "check_attention",
    "check_device",
    "check_files",
    "check_generator_memory",
    "check_generators",
    "check_learner_memory",
    "check_logprobs",
    "check_model",
    "check_nccl",
    "check_placement",
    "check_ports",
    "check_tls",
    "judge_logprobs",
    "main",
    "run",
]

CHECKS: tuple[tuple[str, Callable[[Doctor], list[Check]]], ...] = (
    ("files", check_files),
    ("device", check_device),
    ("model", check_model),
    ("attention", check_attention),
    ("generators", check_generators),
    ("logprobs", check_logprobs),
    ("learner memory", check_learner_memory),
    ("placement", check_placement),
    ("generator memory", check_generator_memory),
    ("NCCL", check_nccl),
    ("ports", check_ports),
    ("TLS", check_tls),
)
"""What :func:`run` checks, in order: a check reads what those before it found (the model's
dims, the device, the servers reached). The name is the failed line's when a check cannot run."""


def run(doctor: Doctor, emit: Callable[[Check], None] = lambda c: None) -> list[Check]:
    """Every check of :data:`CHECKS` on ``doctor``, each line given to ``emit`` as it comes."""
    for name, check in CHECKS:
        try:
            results = check(doctor)
        except Exception as e:  # a check that cannot run is a failed check, not a traceback
            results = [Check(name=name, ok=False, detail=f"could not run: {e!r}")]
        for c in results:
            doctor.checks.append(c)
            emit(c)
    return doctor.checks


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="asyncrl doctor", description=__doc__.splitlines()[0])
    p.add_argument("recipe", help="YAML recipe file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. learner.ranks=8")
    p.add_argument(
        "--sglang-python",
        default="",
        help="SGLang's interpreter when it has its own environment: its NCCL is read from it",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per server request")
    a = p.parse_intermixed_args(argv)  # flags and overrides in any order, as `asyncrl run`
    try:
        r = recipe_mod.load(a.recipe, a.overrides, check_files=False)
    except recipe_mod.RecipeError as e:
        print(f"✗ recipe: {e}")
        print("asyncrl doctor: the recipe is invalid: fix it first", file=sys.stderr)
        return 2
    print(f"✓ recipe: {a.recipe} is valid")
    doctor = Doctor(recipe=r, sglang_python=a.sglang_python, timeout_s=a.timeout)
    checks = run(
        doctor, emit=lambda c: print(f"{'✓' if c.ok else '✗'} {c.name}: {c.detail}", flush=True)
    )
    failed = [c.name for c in checks if not c.ok]
    if failed:
        n = len(checks) + 1
        print(
            f"asyncrl doctor: {len(failed)} of {n} checks fail: {', '.join(failed)}",
            file=sys.stderr,
        )
        return 2
    print(f"asyncrl doctor: all {len(checks) + 1} checks pass", file=sys.stderr)
    return 0

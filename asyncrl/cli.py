"""`asyncrl`: one console script, one subcommand per process kind (docs/design.md §1).

Each subcommand lives in its own module and is imported only when run, so `asyncrl check` starts
fast and a part that is not built yet is reported, not crashed on. Every process starts with
asyncrl's malloc settings (:mod:`asyncrl.malloc`): its messages are a megabyte or so, and dumps its
stacks on SIGUSR1 (:mod:`asyncrl.stacks`). Run as the program (no ``argv``: the console script,
``python -m asyncrl.cli``), it ends the process itself once the command returns, without the
interpreter's teardown of torch (:mod:`asyncrl.quick_exit`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from asyncrl import malloc
from asyncrl.quick_exit import quick_exit
from asyncrl.stacks import dump_stacks_on_usr1

COMMANDS: dict[str, tuple[str, str]] = {
    "learner": (
        "asyncrl.learner.main",
        "train: TorchTitan learner, buffer service, weight broadcaster",
    ),
    "rollout": (
        "asyncrl.rollout.main",
        "generate: one rollout worker feeding the learner's buffer",
    ),
    "run": ("asyncrl.launch", "everything on one machine: learner, rollout workers, engines"),
    "engine": ("asyncrl.engine.server", "serve the built-in generator (SGLang's HTTP API)"),
    "check": ("asyncrl.check", "validate a recipe and print it resolved"),
    "graph": ("asyncrl.graph", "print and draw a recipe's dataflow: its model calls, by level"),
    "doctor": (
        "asyncrl.doctor",
        "preflight on the target machine: devices, memory plan, servers, NCCL, ports, TLS",
    ),
}


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the program: its files are closed when the command returns
        quick_exit(run_command(sys.argv[1:]))
    return run_command(argv)


def run_command(argv: list[str]) -> int:
    malloc.keep_freed_memory()
    dump_stacks_on_usr1()
    parser = argparse.ArgumentParser(
        prog="asyncrl",
        description="Asynchronous off-policy RL for LLMs.",
        epilog="Run `asyncrl COMMAND --help` for a command's options.",
    )
    parser.add_argument("command", choices=list(COMMANDS), metavar="COMMAND", help=_table())
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv[:1] if argv and not argv[0].startswith("-") else argv)
    module_name, _ = COMMANDS[ns.command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (e.name == module_name or module_name.startswith(e.name + ".")):
            print(
                f"asyncrl {ns.command}: this part ({module_name}) is not built yet", file=sys.stderr
            )
            return 2
        raise
    return int(module.main(argv[1:]) or 0)


def _table() -> str:
    return "; ".join(f"{name}: {doc}" for name, (_, doc) in COMMANDS.items())


if __name__ == "__main__":
    sys.exit(main())

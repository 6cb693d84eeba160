"""The import graph of asyncrl/, read from every module's imports (at its top, under
``TYPE_CHECKING`` or inside a function):

- no import circles: a module that imports another is never imported back by it, directly or through
  others. A circle means a type or a function lives above its user; such a package cannot be read
  bottom-up, and a lazy import that hides one breaks as soon as someone moves it to the top;
- no imports up the floors (issue #47 item 6): each room (a subpackage, or a module directly in
  asyncrl/) is on a floor of :data:`FLOORS`, and a module imports only its own room and the floors
  below it. Otherwise a lower room depends on a higher one, and a process that needs the low room
  (a rollout worker) drags in the high one (the launcher, the run's end).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "asyncrl"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The asyncrl modules ``name`` imports anywhere in its file (the deepest module each names)."""

    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(known(a.name) for a in node.names if a.name.startswith("asyncrl"))
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            if source.startswith("asyncrl"):
                for a in node.names:
                    sub = f"{source}.{a.name}"
                    found.add(sub if sub in modules else known(source))
    found.discard(None)
    found.discard(name)
    return found  # type: ignore[return-value]


def import_circles(modules: dict[str, Path]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    graph = {m: sorted(_imports(m, p, modules)) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            if i < len(graph[v]):
                work.append((v, i + 1))
                w = graph[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if work:  # v is done: its caller takes its low link
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    circles.append(sorted(group))
    return circles


FLOORS: dict[int, tuple[str, ...]] = {
    0: ("__init__", "wire"),  # the package's version; the messages between processes
    1: ("recipe",),  # the schema every process reads, its loader and its checks
    2: tuple(  # small modules the rooms above share (one another too: the circle test orders them)
        "backoff cluster contract control dataflow generator_http gpu learner_info malloc memory"
        " metric_names metrics moe openai_shapes plots plugins progress quick_exit reach rewards"
        " stacks"
        " tasks tool_calls transport".split()
    ),
    3: ("agents", "buffer", "served", "weights"),  # siblings (each needs only the floors below)
    4: ("engine",),  # the built-in generator's process: receives weights as weights/ sends them
    5: ("rollout",),  # a worker puts to the buffer and starts its engines
    6: ("evaluate", "summary"),  # a run's end: held-out evaluation on rollout's code, summary.json
    7: ("learner",),  # hosts buffer and broadcaster, evaluates through rollout, ends the run
    8: ("launch",),  # `asyncrl run`: starts everything below, ends the run if the learner could not
    9: ("check", "cli", "demo_agent", "doctor", "graph"),  # commands; doctor/ a subpackage
}
"""Each room of asyncrl/ by floor, lowest first (docs/design.md §9). A module imports its own room
and rooms on lower floors; two modules directly in asyncrl/ on one floor may import each other,
two subpackages on one floor (buffer/, weights/) are siblings and never do, and neither do a
subpackage and a module directly in asyncrl/ on one floor. The order is the graph's own. recipe/
has a floor of its own below the small modules because it is a subpackage that some of them
(dataflow.py, memory.py, generator_http.py) import, and it imports nothing of asyncrl's. Floor 2
holds what several rooms share: the contract a plug-in writes against (contract.py), the loader of
user code by import path (plugins.py), the rule rewards (rewards.py: rollout/ runs them, served/'s
reward model adds to them), Qwen's tool-call format and OpenAI-shaped replies (the engine's and the
agents'). agents/ (tools, MCP, the recording client and proxy) and served/ (the reward model's and
the teacher's clients) need nothing above floor 2 and sit below rollout/, whose workflows call the
tools and whose worker scores episodes with the served models; starting those servers is the
launcher's own code (launch/model_servers.py: children, the launch plan, the run's end) and stays
in launch/. engine/ sits on weights/ (it receives weight buckets in weights/' layout, by CUDA IPC
handle or in a group it joins through weights/rendezvous.py), rollout/ on engine/ (a worker spawns
its engines) and buffer/, and learner/ on rollout/ because its rank 0 runs the held-out evaluation
through rollout/held_out_eval.py (design §6); the commands on top import what they check or start.
doctor/ is a subpackage among the commands' modules, so it and they never import each other:
cli.py starts it by name (``importlib``, as every command), and its checks import only floors
below. demo_agent.py on top is the agent demo's old name, a shim over agents/."""


def _room(module: str) -> str:
    """``asyncrl.engine.api`` -> ``engine``; ``asyncrl.summary`` -> ``summary``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _rooms(modules: dict[str, Path]) -> dict[str, bool]:
    """Each room of ``modules`` -> whether it is a subpackage (else a module in asyncrl/)."""
    out: dict[str, bool] = {}
    for m, path in modules.items():
        package = m.count(".") > 1 or (m.count(".") == 1 and path.name == "__init__.py")
        out[_room(m)] = out.get(_room(m), False) or package
    return out


def floor_breaches(modules: dict[str, Path], floors: dict[int, tuple[str, ...]]) -> list[str]:
    """Every import of ``modules`` that goes up a floor of ``floors``, or across to a sibling
    subpackage on the same floor (:data:`FLOORS`), one line each."""
    floor_of = {room: f for f, rooms in floors.items() for room in rooms}
    package = _rooms(modules)
    out = []
    for m, path in sorted(modules.items()):
        for dep in sorted(_imports(m, path, modules)):
            a, b = _room(m), _room(dep)
            if a == b:
                continue
            up = floor_of[b] > floor_of[a]
            sibling = floor_of[b] == floor_of[a] and (package[a] or package[b])
            if up or sibling:
                out.append(
                    f"{m} ({a}, floor {floor_of[a]}) imports {dep} ({b}, floor {floor_of[b]})"
                )
    return out


def test_asyncrl_has_no_import_circles() -> None:
    circles = import_circles(_modules())
    assert not circles, "import circles in asyncrl/:\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )


def test_every_room_is_on_one_floor() -> None:
    placed = [room for rooms in FLOORS.values() for room in rooms]
    assert len(placed) == len(set(placed)), "a room on two floors"
    rooms = set(_rooms(_modules()))
    assert not rooms - set(placed), f"rooms on no floor of FLOORS: {sorted(rooms - set(placed))}"
    assert not set(placed) - rooms, f"FLOORS names no such room: {sorted(set(placed) - rooms)}"


def test_no_module_imports_a_room_above_its_own() -> None:
    breaches = floor_breaches(_modules(), FLOORS)
    assert not breaches, "imports up the floors (FLOORS):\n" + "\n".join(breaches)


def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    """A package ``asyncrl`` under ``tmp_path`` of ``files`` (``"low/a"``: asyncrl/low/a.py, its
    folder a subpackage), as :func:`_modules` names them."""
    modules = {}
    for name in ["", *files]:
        folder = tmp_path / "asyncrl" / Path(name).parent
        folder.mkdir(parents=True, exist_ok=True)
        init = folder / "__init__.py"
        if not init.exists():
            init.write_text("")
            modules[".".join(["asyncrl", *Path(name).parent.parts])] = init
        if name:
            (folder / f"{Path(name).name}.py").write_text(files[name])
            modules[".".join(["asyncrl", *Path(name).parts])] = folder / f"{Path(name).name}.py"
    return modules


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"a": "from asyncrl import b\n", "b": "import asyncrl.c\n", "c": ""}, []),
        (
            {
                "a": "from asyncrl.b import x\n",
                "b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from asyncrl.a import y\n",
                "c": "",
            },
            [["asyncrl.a", "asyncrl.b"]],
        ),
        (
            {
                "a": "def f():\n    from . import b\n",
                "b": "from .c import z\n",
                "c": "from .a import f\n",
            },
            [["asyncrl.a", "asyncrl.b", "asyncrl.c"]],
        ),
    ],
)
def test_the_walk_finds_circles_through_lazy_and_type_only_imports(
    tmp_path: Path, files: dict[str, str], expected: list[list[str]]
) -> None:
    assert import_circles(_package(tmp_path, files)) == expected


_FLOORS = {0: ("__init__", "base", "util"), 1: ("low",), 2: ("high", "side", "mid"), 3: ("top",)}


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (  # down the floors, within a room, and between modules of asyncrl/ on one floor: allowed
            {
                "base": "from asyncrl.util import f\n",
                "util": "",
                "low/a": "from asyncrl import base\n",
                "high/b": "from asyncrl.low.a import x\nfrom . import c\n",
                "high/c": "",
                "top": "import asyncrl.high.b\n",
            },
            [],
        ),
        (  # up, lazily and for types only
            {
                "base": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import asyncrl.top\n",
                "low/a": "def f():\n    from asyncrl.high import b\n",
                "high/b": "",
                "top": "",
            },
            [
                "asyncrl.base (base, floor 0) imports asyncrl.top (top, floor 3)",
                "asyncrl.low.a (low, floor 1) imports asyncrl.high.b (high, floor 2)",
            ],
        ),
        (  # across, to a sibling subpackage on the same floor, or between it and a module
            {
                "high/b": "from ..side.s import y\n",
                "side/s": "",
                "mid": "from asyncrl import side\n",
            },
            [
                "asyncrl.high.b (high, floor 2) imports asyncrl.side.s (side, floor 2)",
                "asyncrl.mid (mid, floor 2) imports asyncrl.side (side, floor 2)",
            ],
        ),
    ],
)
def test_the_floors_catch_an_import_up_or_across(
    tmp_path: Path, files: dict[str, str], expected: list[str]
) -> None:
    assert floor_breaches(_package(tmp_path, files), _FLOORS) == expected

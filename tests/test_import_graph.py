"""No import circles in asyncrl/: a module that imports another (at its top, under ``TYPE_CHECKING``
or inside a function) is never imported back by it, directly or through others. A circle means a type
or a function lives above its user; such a package cannot be read bottom-up, and a lazy import that
hides one breaks as soon as someone moves it to the top."""

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


def test_asyncrl_has_no_import_circles() -> None:
    circles = import_circles(_modules())
    assert not circles, "import circles in asyncrl/:\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )


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
    package = tmp_path / "asyncrl"
    package.mkdir()
    (package / "__init__.py").write_text("")
    modules = {"asyncrl": package / "__init__.py"}
    for name, text in files.items():
        (package / f"{name}.py").write_text(text)
        modules[f"asyncrl.{name}"] = package / f"{name}.py"
    assert import_circles(modules) == expected

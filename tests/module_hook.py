"""A ``sitecustomize.py`` that changes one asyncrl module as a child process imports it: the test
puts it on PYTHONPATH, the package's code stays as it is (no test hooks in production code).

``sitecustomize(module, patch, when=...)``: ``patch`` is the body of ``_patch(module)``, run right
after ``module`` executes; ``when`` an expression deciding at start-up whether to hook at all.
"""

from __future__ import annotations

import textwrap

_TEMPLATE = """
import importlib.abc, importlib.util, os, sys


def _patch(module):
PATCH


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if WHEN:
    sys.meta_path.insert(0, _Hook())
"""


def sitecustomize(module: str, patch: str, *, when: str = "True") -> str:
    body = textwrap.indent(textwrap.dedent(patch).strip("\n"), "    ")
    return _TEMPLATE.replace("PATCH", body).replace("MODULE", repr(module)).replace("WHEN", when)

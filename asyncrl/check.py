"""`asyncrl check RECIPE [key=value ...]`: validate a recipe without training, print it resolved.

`--no-files` skips only the checks that model, data and certificate files exist: for a recipe written
for another machine (the GPU recipes) or one whose model an earlier stage builds (the demo). The
schema, ranges, cross-field rules and addresses are still checked, and the output says what was skipped.
"""

from __future__ import annotations

import argparse
import sys

from asyncrl import recipe as recipe_mod


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="asyncrl check", description=__doc__)
    p.add_argument("recipe", help="YAML recipe file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. learner.lr=1e-6")
    p.add_argument(
        "--no-files",
        action="store_true",
        help="do not check that model, data and TLS files exist (recipes for another machine)",
    )
    a = p.parse_intermixed_args(argv)  # flags and overrides in any order, as `asyncrl run`
    try:
        r = recipe_mod.load(a.recipe, a.overrides, check_files=not a.no_files)
    except recipe_mod.RecipeError as e:
        print(f"asyncrl check: {e}", file=sys.stderr)
        return 2
    print(recipe_mod.dump(r), end="")
    for w in recipe_mod.warnings(r):
        print(f"asyncrl check: warning: {w}", file=sys.stderr)
    skipped = " (file existence not checked: --no-files)" if a.no_files else ""
    print(f"# {a.recipe}: valid{skipped}", file=sys.stderr)
    return 0

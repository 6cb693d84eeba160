"""`asyncrl check RECIPE [key=value ...]`: validate a recipe without training, print it resolved."""

from __future__ import annotations

import argparse
import sys

from asyncrl import recipe as recipe_mod


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="asyncrl check", description=__doc__)
    p.add_argument("recipe", help="YAML recipe file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. learner.lr=1e-6")
    a = p.parse_args(argv)
    try:
        r = recipe_mod.load(a.recipe, a.overrides)
    except recipe_mod.RecipeError as e:
        print(f"asyncrl check: {e}", file=sys.stderr)
        return 2
    print(recipe_mod.dump(r), end="")
    print(f"# {a.recipe}: valid", file=sys.stderr)
    return 0

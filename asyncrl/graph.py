"""`asyncrl graph RECIPE [key=value ...] [--out PATH]`: print and draw the recipe's dataflow.

Prints one line per model call, by level (calls on one level are independent), and writes a PNG
(nodes coloured by role, one arrow per pair of calls labelled with the keys passed). The PNG goes to
``--out`` or next to the run folder, as ``<run dir>.dataflow.png`` (not inside: `asyncrl run`
refuses a run folder that is not empty unless it resumes). Model, data and certificate files are not
checked: the graph does not depend on them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from asyncrl import dataflow, memory
from asyncrl import recipe as recipe_mod

ROLE_COLOURS = {
    "actor": "#4c72b0",
    "critic": "#dd8452",
    "ref": "#8c8c8c",
    "reward": "#55a868",
    "teacher": "#8172b3",
    "driver": "#d9d9d9",
}


def default_out(r: recipe_mod.Recipe) -> Path:
    return r.run_dir.with_name(r.run_dir.name + ".dataflow.png")


def call_places(flow: dataflow.Dataflow, r: recipe_mod.Recipe) -> dict[str, str]:
    """Where each call runs: a learner role's ranks and layout (``placement``), the rollout
    workers (generation, rewards), or every learner rank (the advantages)."""
    layouts = {lay.role: lay for lay in memory.role_layouts(r)}
    out = {}
    for c in flow.calls:
        role = "actor" if c.role == "reward" and c.call == "train_step" else c.role
        if c.call == "generate":
            out[c.name] = "rollout workers' generators"
        elif role in layouts:
            out[c.name] = layouts[role].layout
        elif c.role in ("reward", "driver") and c.name.startswith("reward"):
            out[c.name] = "rollout workers"
        elif c.role == "teacher":
            out[c.name] = "rollout workers (rollout.teacher's servers)"
        else:
            out[c.name] = "every learner rank"
    return out


def describe(flow: dataflow.Dataflow, r: recipe_mod.Recipe) -> str:
    """The dataflow's lines (:meth:`~asyncrl.dataflow.Dataflow.describe`), each call's with where
    it runs."""
    places = call_places(flow, r)
    head, *lines = flow.describe().splitlines()
    calls = [c for level in flow.order() for c in level]
    return "\n".join(
        [head, *(f"{x}  @ {places[c.name]}" for x, c in zip(lines, calls, strict=True))]
    )


def draw(flow: dataflow.Dataflow, out: Path, places: dict[str, str] | None = None) -> Path:
    """Write ``flow`` as a PNG: one column per level, left to right; ``places``: a line under each
    call saying where it runs (:func:`call_places`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Patch
    from matplotlib.path import Path as MplPath

    levels = flow.order()
    pos = {
        c.name: (float(i), (len(calls) - 1) / 2 - j)
        for i, calls in enumerate(levels)
        for j, c in enumerate(calls)
    }
    tallest = max(len(lv) for lv in levels)
    fig, ax = plt.subplots(figsize=(2.8 * len(levels) + 1, 1.3 * tallest + 1.2))

    # One arrow per (producer, consumer), labelled with every key it carries; the keys a call
    # reads from the data are written in its box instead (every call reads the prompts).
    producer = {k: c.name for c in flow.calls for k in c.outputs}
    edges: dict[tuple[str, str], list[str]] = {}
    for c in flow.calls:
        for k in c.inputs:
            if k in producer:
                edges.setdefault((producer[k], c.name), []).append(k)
    skips = 0
    for (a, b), keys in edges.items():
        (x0, y0), (x1, y1) = pos[a], pos[b]
        start, end = (x0 + 0.3, y0), (x1 - 0.3, y1)
        # an arrow that skips a level would run through the boxes between: it arcs over (or under)
        # them instead, alternately, and its label sits at the top of the arc
        bend = 0.0
        if x1 - x0 > 1:
            skips += 1
            side = 1 if skips % 2 else -1
            apex = side * (tallest / 2 + 0.15 * (skips + 1) // 2)  # above (below) every box
            bend = 2 * (apex - (start[1] + end[1]) / 2)
        mid = ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + bend)
        curve = MplPath([start, mid, end], [MplPath.MOVETO, MplPath.CURVE3, MplPath.CURVE3])
        ax.add_patch(
            FancyArrowPatch(path=curve, arrowstyle="-|>", mutation_scale=10, color="#555555", lw=1)
        )
        f = 0.5 if bend else 0.6  # labels of arrows fanning out of one call part nearer the reader
        lx = start[0] * (1 - f) + end[0] * f
        ly = start[1] * (1 - f) + end[1] * f + bend / 2  # a quadratic Bezier's midpoint
        ax.text(
            lx,
            ly,
            ", ".join(keys),
            fontsize=7,
            ha="center",
            va="center",
            color="#333333",
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85},
        )
    for c in flow.calls:
        from_data = [k for k in c.inputs if k not in producer]
        text = f"{c.name}\n{c.label}" + (f"\ndata: {', '.join(from_data)}" if from_data else "")
        if places:
            text += f"\n{places[c.name]}"
        ax.text(
            *pos[c.name],
            text,
            ha="center",
            va="center",
            fontsize=8,
            bbox={"boxstyle": "round,pad=0.4", "fc": ROLE_COLOURS[c.role], "ec": "#333333"},
            color="black" if c.role == "driver" else "white",
        )
    roles = [r for r in dataflow.ROLES if any(c.role == r for c in flow.calls)]
    ax.legend(
        handles=[Patch(fc=ROLE_COLOURS[r], ec="#333333", label=r) for r in roles],
        loc="upper left",
        fontsize=7,
        frameon=False,
    )
    ax.set_xlim(-0.6, len(levels) - 0.4)
    room = 0.15 * (skips + 1) // 2 + 0.2 if skips else 0.0
    ax.set_ylim(-tallest / 2 - 0.3 - room, tallest / 2 + 0.5 + room)
    ax.set_title(flow.name, fontsize=10)
    ax.axis("off")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="asyncrl graph", description=__doc__)
    p.add_argument("recipe", help="YAML recipe file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algorithm.advantage=gae")
    p.add_argument("--out", type=Path, help="PNG path (default: <run dir>.dataflow.png)")
    a = p.parse_intermixed_args(argv)  # flags and overrides in any order, as `asyncrl run`
    try:
        r = recipe_mod.load(a.recipe, a.overrides, check_files=False)
        flow = dataflow.from_recipe(r)
        text = describe(flow, r)
    except (recipe_mod.RecipeError, dataflow.DataflowError) as e:
        print(f"asyncrl graph: {e}", file=sys.stderr)
        return 2
    print(text)
    out = a.out if a.out is not None else default_out(r)
    try:
        draw(flow, out, call_places(flow, r))
    except OSError as e:
        print(f"asyncrl graph: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"# {out}", file=sys.stderr)
    return 0

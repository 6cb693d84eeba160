"""Held-out evaluation of a model folder on a built-in engine of its own.

During an RL run the learner evaluates on the run's generators
(:mod:`asyncrl.learner.eval_schedule`). This is for a model no generator holds: an SFT run's first and last model, an RL run whose
generators were gone at its end (:func:`asyncrl.summary.finish_run`), or by hand::

    python -m asyncrl.evaluate RECIPE [--model DIR] [key=value ...]

The same prompts, chat template, stop rules, workflow and reward as the in-run evaluation
(:class:`asyncrl.rollout.held_out_eval.Evaluation`), greedy, on one engine labelled version 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from asyncrl import recipe as recipe_mod
from asyncrl.recipe import Recipe
from asyncrl.rollout.held_out_eval import EvalReport, Evaluation


def evaluate_model(
    r: Recipe, model_dir: str | Path, *, log_path: str | Path | None = None
) -> EvalReport | None:
    """Greedy held-out score of ``model_dir`` (None when the recipe has no held-out prompts).
    A LoRA adapter export (``learner.lora.export: adapter``) is served over the recipe's
    ``model.path`` by the engine's own adapter path (``--weights``), as a LoRA run's engines are.
    Raises RuntimeError if the engine does not start."""
    from asyncrl.engine import start_engine_process
    from asyncrl.weights.exports import ADAPTER_CONFIG, is_adapter_export

    evaluation = Evaluation.from_recipe(r)
    if evaluation is None:
        return None
    evaluation.lora = False  # its own built-in engine, which serves an adapter merged
    lora: dict = {}
    if is_adapter_export(model_dir):  # a LoRA run's `export: adapter`: served over model.path
        cfg = json.loads((Path(model_dir) / ADAPTER_CONFIG).read_text())
        lora = dict(lora_rank=cfg["r"], lora_alpha=cfg["lora_alpha"], weights=str(model_dir))
        model_dir = r.resolve(r.model.path)
    with start_engine_process(
        str(model_dir),
        host="127.0.0.1",
        max_batch_size=r.generator.max_batch_size,
        weight_version="0",
        seed=r.run.seed,
        log_path=log_path,
        device=r.generator.device,
        dtype=r.model.dtype,
        timeout_s=r.generator.startup_timeout_s,
        **lora,
    ) as engine:
        return evaluation.run([engine.url], version=0, timeout_s=r.rollout.request_timeout_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m asyncrl.evaluate", description=__doc__.splitlines()[0]
    )
    p.add_argument("recipe", help="YAML recipe: data.eval_path, run.eval_prompts, rollout.*")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    p.add_argument("--model", default="", help="model folder (default: the recipe's model.path)")
    a = p.parse_intermixed_args(argv)  # flags and overrides in any order, as `asyncrl run`
    try:
        r = recipe_mod.load(a.recipe, a.overrides)
    except recipe_mod.RecipeError as e:
        print(f"asyncrl evaluate: {e}", file=sys.stderr)
        return 2
    model = a.model or (r.resolve(r.model.path) if r.model.path else "")
    if not model or not Path(model).is_dir():
        print(
            f"asyncrl evaluate: no model folder {model!r} (--model or model.path)", file=sys.stderr
        )
        return 2
    report = evaluate_model(r, model)
    if report is None:
        print(
            "asyncrl evaluate: the recipe has no held-out prompts (data.eval_path)", file=sys.stderr
        )
        return 2
    print(json.dumps({"score": report.score, **report.metrics(), "examples": report.examples}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

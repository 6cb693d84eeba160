"""What a held-out evaluation costs: 500 prompts through a generator against one generation batch.

On one built-in engine holding the demo's SFT model, alternating, ``--repeats`` times each:
- ``eval``: the demo's held-out evaluation (``run.eval_prompts`` prompts, greedy, the recipe's reward:
  asyncrl.rollout.held_out_eval);
- ``batch``: one training batch of the demo, ``groups_per_batch`` x ``group_size`` samples at the
  recipe's temperature (what the rollout side makes per learner step);
- ``batch_same_n``: as many samples at the recipe's temperature as the evaluation has prompts;
- ``transformers``: the evaluation asyncrl ran before (transformers ``generate``, batches of 128).
With ``--runs N``, also the demo's RL stage with ``run.eval_every`` 0 and 10, alternating, N times
each: the learner's training time with and without evaluations in the run (medians). The last line
is JSON:

    {"bench": "eval_cost", "eval_s": ..., "batch_s": ..., "eval_over_batch": ..., ...}

    python tools/bench/eval_cost.py [--repeats 3] [--runs 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from asyncrl import launch  # noqa: E402
from asyncrl import recipe as recipe_mod  # noqa: E402
from asyncrl.engine import start_engine_process  # noqa: E402
from asyncrl.rollout.held_out_eval import Evaluation  # noqa: E402
from asyncrl.rollout.prompts import load_prompt_rows  # noqa: E402
from tools.bench.async_vs_sync import ensure_sft  # noqa: E402

MODEL = ROOT / "runs/demo_sft/hf/latest"


def transformers_eval(model_dir: Path, rows: list[dict], max_new_tokens: int) -> float:
    """Seconds of asyncrl's former evaluation: transformers greedy, batches of 128, left padding."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    t0 = time.monotonic()
    with torch.inference_mode():
        for start in range(0, len(rows), 128):
            enc = tok(
                [r["prompt"] for r in rows[start : start + 128]], return_tensors="pt", padding=True
            )
            model.generate(
                **enc,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
    return time.monotonic() - t0


def rl_train_seconds(eval_every: int, steps: int) -> dict:
    ov = [
        f"run.name=bench_eval_cost_every{eval_every}",
        f"run.steps={steps}",
        f"run.eval_every={eval_every}",
        "learner.checkpoint_every=0",
    ]
    s = launch.run(ROOT / "recipes/demo.yaml", ov, overwrite=True, progress=False)
    if s["outcome"] != "completed":
        raise SystemExit(f"eval_cost: the RL run with eval_every={eval_every}: {s['outcome']}")
    return {
        "train_s": s["train_seconds"],
        "wall_s": s["wall_seconds"],
        "reward_end": s["reward_end"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--runs", type=int, default=0, help="RL runs with and without evaluations")
    p.add_argument("--steps", type=int, default=60)
    a = p.parse_args()
    ensure_sft()
    r = recipe_mod.load(ROOT / "recipes/demo.yaml", [f"model.path={MODEL}"])
    evaluation = Evaluation.from_recipe(r)
    assert evaluation is not None
    ro, b = r.rollout, r.buffer
    train, _, _ = load_prompt_rows(r.resolve(r.data.path), prompt_key=r.data.prompt_key)
    sampled = dataclasses.replace(evaluation.params, temperature=ro.temperature)
    prompts = [dict(train[i]) for i in range(b.groups_per_batch)]
    batch = dataclasses.replace(
        evaluation, rows=[row for row in prompts for _ in range(ro.group_size)], params=sampled
    )
    same_n = dataclasses.replace(
        evaluation,
        rows=[dict(train[i]) for i in range(len(evaluation.rows))],
        params=sampled,
    )
    times: dict[str, list[float]] = {
        "eval": [],
        "batch": [],
        "batch_same_n": [],
        "transformers": [],
    }
    score = None
    with start_engine_process(
        str(MODEL), max_batch_size=r.generator.max_batch_size, weight_version="0", timeout_s=120
    ) as engine:
        for _ in range(a.repeats):
            for name, ev in (("eval", evaluation), ("batch", batch), ("batch_same_n", same_n)):
                report = ev.run([engine.url], version=0, timeout_s=600)
                times[name].append(report.seconds)
                if name == "eval":
                    score = report.score
            times["transformers"].append(
                transformers_eval(MODEL, evaluation.rows, ro.max_new_tokens)
            )
    med = {k: statistics.median(v) for k, v in times.items()}
    n_eval, n_batch = len(evaluation.rows), len(batch.rows)
    print(f"engine at version 0: {MODEL} (max_batch_size {r.generator.max_batch_size})")
    print(
        f"  eval          {n_eval:4d} prompts, greedy     {med['eval']:.2f} s  (score {score:.3f})"
    )
    print(f"  batch         {n_batch:4d} samples, T={ro.temperature:g}     {med['batch']:.2f} s")
    print(
        f"  batch_same_n  {n_eval:4d} samples, T={ro.temperature:g}     {med['batch_same_n']:.2f} s"
    )
    print(f"  transformers  {n_eval:4d} prompts, greedy     {med['transformers']:.2f} s")
    out = {
        "bench": "eval_cost",
        "eval_prompts": n_eval,
        "batch_samples": n_batch,
        "eval_s": round(med["eval"], 3),
        "batch_s": round(med["batch"], 3),
        "batch_same_n_s": round(med["batch_same_n"], 3),
        "transformers_s": round(med["transformers"], 3),
        "eval_over_batch": round(med["eval"] / med["batch"], 2),
        "eval_over_batch_same_n": round(med["eval"] / med["batch_same_n"], 2),
        "transformers_over_eval": round(med["transformers"] / med["eval"], 2),
    }
    if a.runs:
        train: dict[int, list[float]] = {0: [], 10: []}
        for _ in range(a.runs):
            for every in (0, 10):
                res = rl_train_seconds(every, a.steps)
                print(f"  RL {a.steps} steps, eval_every {every:2d}: {res}")
                train[every].append(res["train_s"])
        without, with_ = statistics.median(train[0]), statistics.median(train[10])
        out["train_s_eval_every_0"] = round(without, 2)
        out["train_s_eval_every_10"] = round(with_, 2)
        out["train_slowdown"] = round(with_ / without, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

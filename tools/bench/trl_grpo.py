"""TRL's side of tools/bench/vs_trl.py: GRPO with TRL's synchronous ``GRPOTrainer`` on the demo's task.

Runs in TRL's own virtual environment (tools/bench/trl_env.sh), so it imports nothing of asyncrl's
but its pure scoring function (``asyncrl/tasks.py``, standard library only, loaded by path): the
reward is asyncrl's ``exact_match``, 1 if the completion ended with EOS and its text equals the
answer (surrounding whitespace ignored), else 0.

One optimizer step = one generation round of ``--prompts`` prompts x ``--group`` samples (128
completions for the demo), trained in one batch on that step's own samples (``num_iterations=1``).
Writes to OUT: ``model/`` (the final model and tokenizer), ``log.jsonl`` (each logging step's TRL
metrics with the Unix time it was logged; ``logging_steps=1``) and ``result.json`` (the seconds of
``trainer.train()``, and the Unix times of its start and end).

    PY_TRL tools/bench/trl_grpo.py --model DIR --train train.jsonl --out OUT [--steps 60]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tasks_score():
    """asyncrl.tasks.score without importing asyncrl (its package needs trio, torchtitan, ...)."""
    spec = importlib.util.spec_from_file_location("asyncrl_tasks", ROOT / "asyncrl" / "tasks.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.score


def exact_match_reward(
    score: Callable[[str, str], float], eos_id: int
) -> Callable[..., list[float]]:
    """asyncrl's ``exact_match`` as a TRL reward function: TRL passes each completion's text (decoded
    without special tokens, as asyncrl decodes it) and ids (up to and including the first EOS); a
    completion without EOS was cut by ``max_completion_length`` (asyncrl's finish ``length``) and
    scores 0."""

    def exact_match(completions, completion_ids, answer, **kwargs) -> list[float]:
        return [
            score(text, str(ans)) if ids and ids[-1] == eos_id else 0.0
            for text, ids, ans in zip(completions, completion_ids, answer, strict=True)
        ]

    return exact_match


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model folder to start from")
    p.add_argument("--train", required=True, help="jsonl with prompt and answer")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--prompts", type=int, default=16, help="prompts per optimizer step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--clip-low", type=float, default=0.2)
    p.add_argument("--clip-high", type=float, default=0.28)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(a.model)
    exact_match = exact_match_reward(_tasks_score(), tok.eos_token_id)

    # the SFT target ("completion") is not RL's: only the prompt and the answer stay
    ds = load_dataset("json", data_files=a.train, split="train").select_columns(
        ["prompt", "answer"]
    )

    log_path = out / "log.jsonl"
    log_file = log_path.open("w")

    class LogTimes(TrainerCallback):
        """Each logged step's metrics with the time it was logged: reward against wall clock."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            rec = {"step": state.global_step, "time": time.time(), **(logs or {})}
            log_file.write(json.dumps(rec) + "\n")
            log_file.flush()

    samples = a.prompts * a.group
    cfg = GRPOConfig(
        output_dir=str(out / "trainer"),
        max_steps=a.steps,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=a.grad_clip,
        # one optimizer step = one generation round of `samples` completions, trained in one batch
        per_device_train_batch_size=samples,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=a.group,
        num_iterations=1,
        beta=0.0,
        loss_type="dapo",  # tokens of the whole batch weigh the same: asyncrl's token_mean
        scale_rewards="group",  # GRPO's (r - mean) / std per group: asyncrl's grpo advantage
        epsilon=a.clip_low,
        epsilon_high=a.clip_high,
        temperature=a.temperature,
        top_p=1.0,
        top_k=0,
        max_completion_length=a.max_new_tokens,
        model_init_kwargs={"dtype": torch.float32},
        bf16=False,
        use_cpu=True,
        seed=a.seed,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=a.model,
        reward_funcs=exact_match,
        args=cfg,
        train_dataset=ds,
        processing_class=tok,
        callbacks=[LogTimes()],
    )
    t0 = time.time()
    trainer.train()
    t1 = time.time()
    log_file.close()
    trainer.save_model(str(out / "model"))
    t2 = time.time()
    result = {
        "train_seconds": t1 - t0,
        "train_start": t0,
        "train_end": t1,
        "saved": t2,
        "steps": trainer.state.global_step,
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "generation_batch_size": cfg.generation_batch_size,
        "steps_per_generation": cfg.steps_per_generation,
    }
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Learner throughput: our TorchTitan learner (packed rows, no padding) against a plain transformers +
AdamW loop on padded batches, same tiny model, same mixed-length batches, side by side in one run.

Both train the same sft batches (loss on completion tokens, AdamW, fp32, one thread); steps alternate
between the two so machine load hits both alike. Trained tokens = real (non-padding) tokens per step.
The last line is JSON:

    {"bench": "learner", "tokens_per_s_ratio": ..., "ours_tokens_per_s": ..., "hf_tokens_per_s": ...}

    python tools/bench/learner.py [--steps 12] [--batch 64] [--min-len 16] [--max-len 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def make_batches(n_batches: int, batch: int, lo: int, hi: int, vocab: int, seed: int = 0):
    """Mixed-length sft samples: an 8-token prompt and a completion of uniform length in [lo, hi]."""
    from asyncrl import wire
    from asyncrl.buffer.store import Batch

    rng = np.random.default_rng(seed)
    out = []
    for b in range(n_batches):
        groups = []
        for i in range(batch):
            p = rng.integers(3, vocab, 8).astype(np.int32)
            c = rng.integers(3, vocab, int(rng.integers(lo, hi + 1))).astype(np.int32)
            s = wire.Sample(
                id=f"{b}-{i}",
                group_id=f"{b}-{i}",
                prompt_ids=p,
                completion_ids=c,
                behavior_logprobs=np.zeros(len(c), np.float32),
                versions=np.zeros(len(c), np.int32),
                loss_mask=np.ones(len(c), np.float32),
            )
            groups.append(wire.Group(id=s.id, samples=[s]))
        out.append(Batch(groups=groups, version=0, stats={}))
    return out


class HFLoop:
    """The baseline: transformers model, torch AdamW, right-padded micro-batches of ``micro`` rows."""

    def __init__(self, model_dir: Path, *, lr: float, micro: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, foreach=True)
        self.micro = micro

    def step(self, batch) -> float:
        samples = [g.samples[0] for g in batch.groups]
        n_loss = sum(len(s.completion_ids) for s in samples)
        self.opt.zero_grad()
        total = 0.0
        for i in range(0, len(samples), self.micro):
            chunk = samples[i : i + self.micro]
            seqs = [np.concatenate([s.prompt_ids, s.completion_ids]) for s in chunk]
            width = max(len(x) for x in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            att = torch.zeros(len(seqs), width, dtype=torch.long)
            labels = torch.full((len(seqs), width), -100, dtype=torch.long)
            for r, (s, x) in enumerate(zip(chunk, seqs, strict=True)):
                ids[r, : len(x)] = torch.from_numpy(x.astype(np.int64))
                att[r, : len(x)] = 1
                labels[r, len(s.prompt_ids) : len(x)] = ids[r, len(s.prompt_ids) : len(x)]
            logits = self.model(input_ids=ids, attention_mask=att).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
                reduction="sum",
            ) / max(n_loss, 1)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="timed steps per side (after 2 warm-up)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=4096, help="ours: packed row size")
    p.add_argument("--hf-micro", type=int, default=16, help="baseline: rows per padded micro-batch")
    a = p.parse_args(argv)
    torch.set_num_threads(1)

    from asyncrl import recipe as recipe_mod
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.trainer import Trainer
    from tools.make_tiny_model import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_learner_"))
    model_dir = make_tiny_model(tmp / "model", max_positions=512)
    recipe = recipe_mod.from_dict(
        {
            "model": {"path": str(model_dir), "max_seq_len": 512},
            "algorithm": {"loss": "sft"},
            "learner": {"lr": 1e-4, "micro_batch_tokens": a.micro_batch_tokens},
            "run": {"output_dir": str(tmp / "runs")},
        }
    )
    ours = Trainer(TrainerConfig.from_recipe(recipe), checkpointing=False, run_dir=tmp / "run")
    hf = HFLoop(model_dir, lr=1e-4, micro=a.hf_micro)
    vocab = ours.models.spec.model.vocab_size
    batches = make_batches(a.steps + 2, a.batch, a.min_len, a.max_len, vocab)
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    tokens: list[int] = []
    loss_diff = 0.0
    for i, b in enumerate(batches):
        n = sum(len(g.samples[0].prompt_ids) + len(g.samples[0].completion_ids) for g in b.groups)
        t = time.perf_counter()
        res = ours.step(b)
        t_ours = time.perf_counter() - t
        t = time.perf_counter()
        hf_loss = hf.step(b)
        t_hf = time.perf_counter() - t
        loss_diff = max(loss_diff, abs(res.loss - hf_loss))
        if i >= 2:
            times["ours"].append(t_ours)
            times["hf"].append(t_hf)
            tokens.append(n)
        print(
            f"step {i}: tokens {n}  ours {t_ours:.3f}s (loss {res.loss:.4f})"
            f"  hf {t_hf:.3f}s (loss {hf_loss:.4f})",
            flush=True,
        )
    per_step = statistics.mean(tokens)
    ours_tps = per_step / statistics.median(times["ours"])
    hf_tps = per_step / statistics.median(times["hf"])
    result = {
        "bench": "learner",
        "tokens_per_s_ratio": round(ours_tps / hf_tps, 3),
        "ours_tokens_per_s": round(ours_tps, 1),
        "hf_tokens_per_s": round(hf_tps, 1),
        "tokens_per_step": per_step,
        "batch": a.batch,
        "lengths": [a.min_len + 8, a.max_len + 8],
        "steps": a.steps,
        "max_loss_diff": loss_diff,  # the two loops train the same model the same way
    }
    print(f"ours {ours_tps:.0f} tok/s  hf-padded {hf_tps:.0f} tok/s  ratio {ours_tps / hf_tps:.2f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

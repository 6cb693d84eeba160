"""Held-out success of an exported HF model: greedy decoding, exact match including EOS.

The end of a run (:func:`asyncrl.summary.finish_run`) calls this on the model a run starts from and
on the model it ends with, so summary.json's ``reward_start`` and ``reward_end`` come from the same
prompts, the same decoding and the same scorer, independent of the generators that trained it. Uses
transformers directly: a few hundred prompts of a tiny model decode in seconds on one core.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from asyncrl import tasks


@dataclass(kw_only=True)
class EvalResult:
    success: float
    """Fraction of prompts whose greedy completion equals the answer and ends with EOS."""
    n: int
    examples: list[dict[str, str]]
    """A few (prompt, answer, completion) triples, for the log."""


def load_rows(path: str | Path, *, prompt_key: str, answer_key: str, n: int) -> list[dict]:
    """The first ``n`` (0: all) rows of a jsonl file, checked to have the prompt and answer keys."""
    rows = []
    for i, r in enumerate(tasks.read_jsonl(path)):
        if prompt_key not in r or answer_key not in r:
            raise ValueError(f"{path}: line {i + 1} has no {prompt_key!r} or {answer_key!r}")
        rows.append({"prompt": str(r[prompt_key]), "answer": str(r[answer_key])})
        if n and len(rows) >= n:
            break
    return rows


def evaluate(
    model_dir: str | Path,
    rows: list[dict],
    *,
    max_new_tokens: int = 16,
    batch_size: int = 128,
) -> EvalResult:
    """Greedy held-out success of the HF model in ``model_dir`` on ``rows`` ({prompt, answer})."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars would break the launcher's output
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    right, shown = 0, []
    with torch.inference_mode():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            enc = tok([r["prompt"] for r in chunk], return_tensors="pt", padding=True)
            out = model.generate(
                **enc,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos,
                pad_token_id=tok.pad_token_id,
            )
            for r, ids in zip(chunk, out[:, enc["input_ids"].shape[1] :].tolist(), strict=True):
                ended = eos in ids
                text = tok.decode(ids[: ids.index(eos)] if ended else ids)
                ok = ended and tasks.score(text, r["answer"]) == 1.0
                right += ok
                if len(shown) < 5:
                    shown.append({"prompt": r["prompt"], "answer": r["answer"], "completion": text})
    return EvalResult(success=right / max(len(rows), 1), n=len(rows), examples=shown)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m asyncrl.evaluate", description=__doc__.splitlines()[0]
    )
    p.add_argument("model_dir")
    p.add_argument("eval_jsonl")
    p.add_argument("--n", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=16)
    a = p.parse_args(argv)
    rows = load_rows(a.eval_jsonl, prompt_key="prompt", answer_key="answer", n=a.n)
    res = evaluate(a.model_dir, rows, max_new_tokens=a.max_new_tokens)
    print(json.dumps({"success": res.success, "n": res.n, "examples": res.examples}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Held-out evaluation on real SGLang 0.5.23: the same path as on the built-in engine (greedy, the
recipe's reward, every token of the version evaluated), scored exactly as SGLang decodes."""

from __future__ import annotations

import json

import httpx
import pytest
from sglang_helpers import Served

from asyncrl import recipe as recipe_mod
from asyncrl.rollout.held_out_eval import Evaluation

pytestmark = pytest.mark.sglang

PROMPTS = ["abc", "hello", "xyz", "the cat", "12+3=", "sort: dcba", "qq", "a b c d"]
NEW_TOKENS = 8


def sglang_greedy_text(served: Served, tok, prompt: str) -> str:
    body = {
        "input_ids": tok.encode(prompt, add_special_tokens=True),
        "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW_TOKENS},
    }
    r = httpx.post(served.url + "/generate", json=body, timeout=120)
    r.raise_for_status()
    return tok.decode(r.json()["output_ids"], skip_special_tokens=True)


def test_evaluation_on_sglang_scores_what_sglang_decodes(served: Served, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(served.model_dir)
    texts = [sglang_greedy_text(served, tok, p) for p in PROMPTS]
    answers = [t if i % 2 == 0 else t + "#" for i, t in enumerate(texts)]
    path = tmp_path / "eval.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": p, "answer": a}) + "\n"
            for p, a in zip(PROMPTS, answers, strict=True)
        )
    )
    r = recipe_mod.from_dict(
        {
            "run": {"output_dir": str(tmp_path), "eval_prompts": len(PROMPTS)},
            "model": {"path": str(served.model_dir)},
            "data": {"eval_path": str(path)},
            "rollout": {
                "reward": "tests.rollout_plugins:completion_is_answer",
                "max_new_tokens": NEW_TOKENS,
            },
        }
    )
    report = Evaluation.from_recipe(r).run([served.url], version=served.version, timeout_s=300)
    assert (report.prompts, report.failed, report.other_version) == (len(PROMPTS), 0, 0)
    assert report.score == 0.5
    # a version the server does not hold: refused at once, not waited for
    with pytest.raises(Exception, match="no generator holds version"):
        Evaluation.from_recipe(r).run([served.url], version=served.version + 1, timeout_s=300)

"""Held-out evaluation through real built-in engines: greedy decoding that gives what transformers
gives, the recipe's reward, failures scored 0 and counted, and tokens of another version never
scored."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import yaml

from asyncrl import recipe as recipe_mod
from asyncrl.engine import start_engine_process
from asyncrl.evaluate import evaluate_model, main
from asyncrl.generator_http import GeneratorError
from asyncrl.rollout.held_out_eval import DOWN_S, Evaluation

pytestmark = pytest.mark.slow

PROMPTS = [f"{a}{b}{c}" for a in "abcd" for b in "efg" for c in "hi"]  # 24 distinct prompts
NEW_TOKENS = 8


def hf_greedy_texts(model_dir, prompts: list[str], model=None) -> list[str]:
    """transformers' greedy completions, one prompt at a time (no padding), cut at EOS
    (``model``: another one than ``model_dir``'s, e.g. with a PEFT adapter)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            enc = tok(p, return_tensors="pt")
            ids = model.generate(
                **enc,
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )[0, enc["input_ids"].shape[1] :].tolist()
            if tok.eos_token_id in ids:
                ids = ids[: ids.index(tok.eos_token_id)]
            out.append(tok.decode(ids, skip_special_tokens=True))
    return out


def make_recipe(tmp_path, model_dir, answers: list[str], reward: str, **run):
    path = tmp_path / "eval.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": p, "answer": a}) + "\n"
            for p, a in zip(PROMPTS, answers, strict=False)
        )
    )
    data = {
        "run": {"output_dir": str(tmp_path), "eval_prompts": len(answers), **run},
        "model": {"path": str(model_dir)},
        "data": {"eval_path": str(path)},
        "rollout": {"reward": reward, "max_new_tokens": NEW_TOKENS},
    }
    return recipe_mod.from_dict(data), data


@pytest.fixture(scope="module")
def engine_at_3(tiny_qwen3):
    """An engine that holds version 3 (as one the learner has updated three times)."""
    with start_engine_process(tiny_qwen3, weight_version="3", timeout_s=120) as ep:
        yield ep


def test_greedy_scores_match_transformers_prompt_by_prompt(tiny_qwen3, tmp_path):
    texts = hf_greedy_texts(tiny_qwen3, PROMPTS)
    # every other answer is transformers' own completion: the score is 1/2 only if the engine
    # decodes exactly as transformers does on every one of the 24 prompts
    answers = [t if i % 2 == 0 else t + "#" for i, t in enumerate(texts)]
    r, _ = make_recipe(tmp_path, tiny_qwen3, answers, "tests.rollout_plugins:completion_is_answer")
    report = evaluate_model(r, tiny_qwen3)
    assert report is not None
    assert (report.prompts, report.failed, report.other_version) == (24, 0, 0)
    assert report.score == 0.5
    assert report.version == 0 and report.tokens > 0 and report.examples


def test_a_lora_adapter_export_is_evaluated_over_the_base(tiny_qwen3, tmp_path):
    """A LoRA run's `export: adapter` (a PEFT folder) is served over model.path: the score is
    transformers + PEFT's with that adapter, prompt by prompt."""
    from tests.engine.test_lora_serving import peft_model

    pm, _ = peft_model(tiny_qwen3, seed=5)
    pm.save_pretrained(tmp_path / "adapter")
    texts = hf_greedy_texts(tiny_qwen3, PROMPTS[:6], model=pm)
    assert texts != hf_greedy_texts(tiny_qwen3, PROMPTS[:6])  # the adapter changes them
    answers = [t if i % 2 == 0 else t + "#" for i, t in enumerate(texts)]
    r, _ = make_recipe(tmp_path, tiny_qwen3, answers, "tests.rollout_plugins:completion_is_answer")
    report = evaluate_model(r, tmp_path / "adapter")
    assert report is not None and (report.prompts, report.failed) == (6, 0)
    assert report.score == 0.5


def test_tokens_of_another_version_are_never_scored(engine_at_3, tiny_qwen3, tmp_path):
    answers = hf_greedy_texts(tiny_qwen3, PROMPTS[:6])
    r, _ = make_recipe(tmp_path, tiny_qwen3, answers, "tests.rollout_plugins:completion_is_answer")
    evaluation = Evaluation.from_recipe(r)
    held = evaluation.run([engine_at_3.url], version=3, timeout_s=60)
    assert (held.score, held.other_version) == (1.0, 0)
    # asked for version 2, the engine (at 3, newer) serves, and none of its samples is scored
    other = evaluation.run([engine_at_3.url], version=2, timeout_s=60)
    assert (other.score, other.other_version, other.failed) == (0.0, 6, 0)


def test_a_failing_reward_is_a_counted_zero(engine_at_3, tiny_qwen3, tmp_path):
    r, _ = make_recipe(tmp_path, tiny_qwen3, ["x"] * 5, "tests.rollout_plugins:raising_reward")
    report = Evaluation.from_recipe(r).run([engine_at_3.url], version=3, timeout_s=60)
    assert (report.score, report.failed, report.prompts) == (0.0, 5, 5)


def test_the_command_prints_the_score_and_names_a_missing_model(tiny_qwen3, tmp_path, capsys):
    texts = hf_greedy_texts(tiny_qwen3, PROMPTS[:4])
    _, data = make_recipe(tmp_path, tiny_qwen3, texts, "tests.rollout_plugins:completion_is_answer")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(data))
    assert main([str(recipe)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["score"] == 1.0 and out["eval/prompts"] == 4
    assert main([str(recipe), "--model", str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err


class _DiesOnGenerate(BaseHTTPRequestHandler):
    """A generator that states version 3, then drops every /generate connection unanswered, as
    one killed mid-evaluation does. A fake: a real engine killed at that exact point would make
    the test a race."""

    def do_GET(self):
        body = json.dumps({"weight_version": "3"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.close_connection = True  # no reply at all: "Server disconnected"

    def log_message(self, *args):
        pass


@pytest.fixture
def dying_generator():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _DiesOnGenerate)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_an_evaluation_whose_generators_all_died_stops_soon(dying_generator, tiny_qwen3, tmp_path):
    """The broadcaster sends no version while an evaluation runs: one waiting out
    request_timeout_s for a dead generator held back its replacement's weights (a standstill in
    the faults tier). It stops once every generator has failed for DOWN_S, naming the error."""
    r, _ = make_recipe(tmp_path, tiny_qwen3, ["x"] * 6, "exact_match")
    t0 = time.monotonic()
    with pytest.raises(
        GeneratorError, match=f"every generator down for {DOWN_S:g} s.*disconnected"
    ):
        Evaluation.from_recipe(r).run([dying_generator], version=3, timeout_s=600)
    assert time.monotonic() - t0 < DOWN_S + 20


def test_a_dead_generator_beside_a_live_one_costs_no_prompt(
    dying_generator, engine_at_3, tiny_qwen3, tmp_path
):
    answers = hf_greedy_texts(tiny_qwen3, PROMPTS[:6])
    r, _ = make_recipe(tmp_path, tiny_qwen3, answers, "tests.rollout_plugins:completion_is_answer")
    urls = [dying_generator, engine_at_3.url]
    report = Evaluation.from_recipe(r).run(urls, version=3, timeout_s=120)
    assert (report.score, report.failed, report.other_version) == (1.0, 0, 0)

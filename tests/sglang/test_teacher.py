"""Real SGLang as the distillation teacher (rollout.teacher.urls): its /generate with no new tokens
and input logprobs from the prompt's last token gives, for each completion token, transformers'
log_softmax(logits) of that token. SGLang does not scale input logprobs by the request's
temperature (at T = 0.7 they are still the untempered ones), which the built-in engine follows
(tests/served/test_teacher.py) and docs/distill.md states."""

from __future__ import annotations

import httpx
import pytest
import torch
import trio
from sglang_helpers import PROMPT, TOL, Served, served_model_dir

from asyncrl.recipe import TeacherConfig
from asyncrl.served.teacher import TeacherLogprobs

pytestmark = pytest.mark.sglang

COMPLETIONS = [[50, 51, 52, 53, 54, 55], [60], [41, 40, 43, 42]]


def test_sglangs_teacher_logprobs_equal_transformers(served: Served, tmp_path):
    from transformers import AutoModelForCausalLM

    teacher = TeacherLogprobs(TeacherConfig(urls=[served.url]))
    got = {}

    async def main() -> None:
        async def one(i: int) -> None:
            got[i] = await teacher.logprobs(PROMPT, COMPLETIONS[i])

        async with trio.open_nursery() as n:
            for i in range(len(COMPLETIONS)):
                n.start_soon(one, i)

    trio.run(main)
    assert teacher.stats["requests"] == 1  # the three in one batch
    body = {  # the same request at T = 0.7: the input logprobs are not tempered
        "input_ids": PROMPT + COMPLETIONS[0],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.7},
        "return_logprob": True,
        "logprob_start_len": len(PROMPT) - 1,
    }
    hot = httpx.post(f"{served.url}/generate", json=body, timeout=60).json()["meta_info"]
    assert hot["input_token_logprobs"][0] == [None, PROMPT[-1], None]
    model_dir = served_model_dir(served, tmp_path / "model")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, c in enumerate(COMPLETIONS):
        lp, failure = got[i]
        assert failure == "" and len(lp) == len(c)
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + c])).logits[0, len(PROMPT) - 1 : -1].float()
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None])[:, 0].double()
        err = (torch.from_numpy(lp).double() - want).abs().max().item()
        assert err <= TOL, f"max |SGLang teacher - transformers| {err:.2e}"
        if i == 0:
            at_07 = torch.tensor([t[0] for t in hot["input_token_logprobs"][1:]]).double()
            err = (at_07 - want).abs().max().item()
            assert err <= TOL, f"SGLang's input logprobs at T = 0.7 are tempered: {err:.2e}"

"""The distillation teacher (rollout.teacher): the built-in engine's /generate with no new tokens
answers the logprobs of given tokens in SGLang's shape, equal to transformers' forward on the same
tokens; the teacher client asks for them in batches; a rollout worker (real engine as student and
teacher, real buffer) sends every sample with them, and a teacher that cannot answer fails its
samples, which leave their groups."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
import trio

from asyncrl.recipe import TeacherConfig
from asyncrl.served.teacher import TeacherLogprobs, parse_logprobs
from tests.labels import set_label
from tests.numerics import assert_logits_close

pytestmark = pytest.mark.numerics  # compares float32 results across kernels (tests/numerics.py)

PAIRS = [
    ([5, 6, 7], [8, 9, 10, 11]),
    ([40, 41, 42, 43, 44, 45], [46]),
    ([9], [12, 13, 14, 15, 16, 17, 18]),
    ([20, 21], [22, 23]),
    ([30, 31, 32, 33], [3, 4, 5]),
]


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3)


def hf_logprobs(model, prompt, completion) -> torch.Tensor:
    """transformers' log_softmax(logits) of each completion token given what precedes it."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(list(completion))[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_with_no_new_tokens_answers_the_given_tokens_logprobs(
    rollout_engine, hf_model, temperature
):
    """SGLang's shape (tests/sglang/test_teacher.py checks SGLang's own): no output token, one
    [logprob, id, text] per input token from logprob_start_len on, the first with no logprob;
    per item in a batch of several; the model's own log_softmax(logits), whatever the request's
    temperature (SGLang scales only the sampled tokens' logprobs)."""
    body = {
        "input_ids": [p + c for p, c in PAIRS[:2]],
        "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
        "return_logprob": True,
        "logprob_start_len": [len(p) - 1 for p, _ in PAIRS[:2]],
    }
    answer = httpx.post(f"{rollout_engine.url}/generate", json=body, timeout=60).json()
    for (p, c), item in zip(PAIRS[:2], answer, strict=True):
        m = item["meta_info"]
        assert item["output_ids"] == [] and m["completion_tokens"] == 0
        assert m["finish_reason"]["type"] == "length"
        got = m["input_token_logprobs"]
        # SGLang computes no logprob for the token at logprob_start_len: the first entry is None
        assert got[0] == [None, p[-1], None]
        assert [t[1] for t in got[1:]] == c and all(t[2] is None for t in got)
        assert_logits_close([t[0] for t in got[1:]], hf_logprobs(hf_model, p, c))


def test_teacher_logprobs_equal_transformers_on_the_same_tokens(rollout_engine, hf_model):
    teacher = TeacherLogprobs(TeacherConfig(urls=[rollout_engine.url], batch_size=3))
    got: dict[int, tuple[np.ndarray, str]] = {}

    async def main() -> None:
        async def one(i: int) -> None:
            got[i] = await teacher.logprobs(*PAIRS[i])

        async with trio.open_nursery() as n:
            for i in range(len(PAIRS)):
                n.start_soon(one, i)

    trio.run(main)
    assert teacher.stats["requests"] == 2  # 5 sequences asked at once, in batches of <= 3
    for i, (p, c) in enumerate(PAIRS):
        lp, failure = got[i]
        assert failure == "" and lp.dtype == np.float32 and len(lp) == len(c)
        assert_logits_close(torch.from_numpy(lp), hf_logprobs(hf_model, p, c))


def test_parse_refuses_answers_that_are_not_the_completions_logprobs():
    pairs = [([1, 2], [3, 4])]

    def answer(*triples):
        return [{"meta_info": {"input_token_logprobs": [[None, 2, None], *triples]}}]

    ok = answer([-0.5, 3, None], [-1.0, 4, None])
    np.testing.assert_array_equal(parse_logprobs(ok, pairs)[0], np.float32([-0.5, -1.0]))
    for bad, needle in [
        ([], "0 results for 1 inputs"),
        ([{"meta_info": {}}], "no meta_info.input_token_logprobs"),
        (answer([-0.5, 3, None]), "2 input logprobs for the prompt's last token and 2 completion"),
        (answer([-0.5, 3, None], [-1.0, 4, None], [-1.0, 4, None]), "4 input logprobs"),
        (
            [{"meta_info": {"input_token_logprobs": [[None, 1, None], [-0.5, 3], [-1.0, 4]]}}],
            "entry 0 is not the prompt's last token",
        ),
        (answer([-0.5, 3, None], [-1.0, 5, None]), "entry 2 is not"),
        (answer([-0.5, 3, None], [0.5, 4, None]), "not a log-probability"),
        (answer([-0.5, 3, None], [None, 4, None]), "not a log-probability"),
    ]:
        with pytest.raises(ValueError, match=needle):
            parse_logprobs(bad, pairs)


def test_worker_samples_carry_the_teachers_logprobs_and_leave_its_failures_out(
    rollout_engine, tokenizer, hf_model
):
    """End to end (real engine, real buffer, the groups decoded as the learner gets them): each
    sample's teacher_logprobs are the teacher's logprobs of its completion given its prompt. The
    teacher here is the student's own model, so they are also its behaviour logprobs (T = 1): a
    reverse KL of 0. A teacher that cannot be reached fails every sample (``teacher: ...``): no
    group is sent and the worker stops after max_consecutive_failures."""
    from tests.rollout.test_worker import make_worker, run_to_failure, serve_buffer, take_batch

    async def run(svc, teacher):
        async with make_worker(
            rollout_engine, tokenizer, svc.address, teacher=teacher, max_groups=2
        ) as w:
            await w.run()
        return await take_batch(svc)

    async def run_unreachable(svc, teacher):
        async with make_worker(
            rollout_engine, tokenizer, svc.address, teacher=teacher, max_consecutive_failures=2
        ) as w:
            error = await run_to_failure(w)
        assert "teacher: " in str(error), error
        return w.stats.counters, svc.stats()

    set_label(rollout_engine.url, "default")
    teacher = TeacherLogprobs(TeacherConfig(urls=[rollout_engine.url]))
    with serve_buffer(groups_per_batch=2, max_staleness=0) as svc:
        groups = trio.run(run, svc, teacher)
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 6
    for s in samples:
        assert len(s.teacher_logprobs) == len(s.completion_ids) > 0
        want = hf_logprobs(hf_model, s.prompt_ids.tolist(), s.completion_ids.tolist())
        assert_logits_close(torch.from_numpy(s.teacher_logprobs.copy()), want)
        assert_logits_close(s.teacher_logprobs.copy(), s.behavior_logprobs.copy())
    gone = TeacherLogprobs(TeacherConfig(urls=["http://127.0.0.1:9"], timeout_s=5.0))
    with serve_buffer(groups_per_batch=2, max_staleness=0) as svc:
        c, stats = trio.run(run_unreachable, svc, gone)
    assert stats["stored_total"] == 0
    assert c["groups_dropped_reward_failures"] == 2 and c["reward_failures"] >= 6

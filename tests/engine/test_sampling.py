"""Sampling and logprobs (pure logic): truncation rules, which logprob is returned, seeds."""

from __future__ import annotations

import pytest
import torch

from asyncrl.engine.sampling import (
    TOP_K_OFF,
    EngineSamplingParams,
    SamplingError,
    original_logprob,
    sample,
)


def _p(**kw) -> EngineSamplingParams:
    return EngineSamplingParams.parse(kw, vocab_size=8)


LOGITS = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]])


def _support(params: EngineSamplingParams, draws: int = 400) -> set[int]:
    g = torch.Generator().manual_seed(0)
    out = sample(LOGITS.expand(draws, -1), [params] * draws, [None] * draws, g)
    return set(out.tokens)


def test_truncation_rules_limit_the_support():
    assert _support(_p(top_k=2)) == {0, 1}
    probs = torch.softmax(LOGITS[0], -1)  # 0.636, 0.234, 0.086, ...
    assert probs[0] < 0.7 < probs[0] + probs[1]
    assert _support(_p(top_p=0.7)) == {0, 1}  # smallest prefix whose mass reaches 0.7
    assert _support(_p(top_p=0.5)) == {0}
    assert _support(_p(min_p=0.3)) == {0, 1}  # p >= 0.3 * p_max
    assert len(_support(_p())) > 3


def test_logprob_is_temperature_scaled_before_truncation_and_greedy_is_unscaled():
    g = torch.Generator().manual_seed(0)
    out = sample(LOGITS, [_p(temperature=0.5, top_k=2)], [None], g)
    want = torch.log_softmax(LOGITS[0] / 0.5, -1)[out.tokens[0]]  # over the full vocabulary
    assert out.logprobs[0] == pytest.approx(float(want), abs=1e-6)
    out = sample(LOGITS, [_p(temperature=0.0)], [None], g)
    assert out.tokens == [0]
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(LOGITS[0], -1)[0]), abs=1e-6)


def test_original_logprobs_are_before_the_temperature_as_sglangs_env_var_says():
    """SGLANG_RETURN_ORIGINAL_LOGPROB: the same draw at T = 0.5, its logprob (and the top ones)
    from log_softmax(logits) instead of log_softmax(logits / T)."""
    params = [_p(temperature=0.5)]
    tempered = sample(LOGITS, params, [None], torch.Generator().manual_seed(0), top_logprobs=[2])
    out = sample(
        LOGITS, params, [None], torch.Generator().manual_seed(0), top_logprobs=[2], original=True
    )
    assert out.tokens == tempered.tokens
    plain = torch.log_softmax(LOGITS[0], -1)
    assert out.logprobs[0] == pytest.approx(float(plain[out.tokens[0]]), abs=1e-6)
    assert out.logprobs[0] != pytest.approx(tempered.logprobs[0], abs=1e-2)
    assert [i for _, i in out.top[0]] == [0, 1]
    assert [v for v, _ in out.top[0]] == pytest.approx(plain[:2].tolist(), abs=1e-6)
    assert original_logprob({"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"})
    assert original_logprob({"SGLANG_RETURN_ORIGINAL_LOGPROB": "TRUE"})
    assert not original_logprob({"SGLANG_RETURN_ORIGINAL_LOGPROB": "0"})
    assert not original_logprob({})


def test_rows_are_independent_and_seeds_reproduce():
    params = [_p(temperature=0.0), _p(sampling_seed=3), _p(top_k=1, temperature=2.0)]
    runs = []
    for _ in range(2):
        gens = [None, torch.Generator().manual_seed(3), None]
        runs.append(
            sample(LOGITS.expand(3, -1), params, gens, torch.Generator().manual_seed(1)).tokens
        )
    assert runs[0] == runs[1]
    assert runs[0][0] == 0 and runs[0][2] == 0  # greedy, and top_k=1 is greedy at any temperature


def test_banned_tokens_and_logit_bias():
    g = torch.Generator().manual_seed(0)
    out = sample(LOGITS, [_p(temperature=0.0)], [None], g, banned=[[0, 1]])
    assert out.tokens == [2]
    out = sample(LOGITS, [_p(temperature=0.0, logit_bias={"7": 100.0})], [None], g)
    assert out.tokens == [7]


def test_top_logprobs_are_the_k_best():
    g = torch.Generator().manual_seed(0)
    out = sample(LOGITS, [_p()], [None], g, top_logprobs=[3])
    assert [t for _, t in out.top[0]] == [0, 1, 2]


def test_parse_defaults_and_errors():
    p = _p()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (
        128,
        1.0,
        1.0,
        TOP_K_OFF,
        0.0,
    )
    assert _p(top_k=-1).top_k == TOP_K_OFF and _p(stop="x").stop == ["x"]
    with pytest.raises(SamplingError, match="unknown field `foo`"):
        _p(foo=1)
    with pytest.raises(SamplingError, match="stop_token_ids"):
        _p(stop_token_ids=[99])
    with pytest.raises(SamplingError, match="frequency_penalty"):
        _p(frequency_penalty=0.5)
    assert _p(frequency_penalty=0.0).max_new_tokens == 128  # off value accepted

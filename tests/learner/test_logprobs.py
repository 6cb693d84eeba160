"""Chunked log-probabilities: the same values and gradients as the full-vocabulary computation, with
never more than one chunk of logits computed at a time."""

from __future__ import annotations

import pytest
import torch

from asyncrl.learner.logprobs import chunk_tokens, chunked_backward, chunked_logprobs
from asyncrl.recipe import LearnerConfig
from tests.numerics import assert_grads_close

pytestmark = pytest.mark.numerics  # compares float32 results across kernels (tests/numerics.py)

F64 = torch.float64


def _setup(t: int = 11, d: int = 8, v: int = 50, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(d, v, bias=False, dtype=F64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, d, generator=g, dtype=F64))
    hidden = torch.randn(t, d, generator=g, dtype=F64)
    labels = torch.randint(0, v, (t,), generator=g)
    return head, hidden, labels


def _loss(logp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
    """Not separable over tokens (a GSPO-like sequence term), with an entropy bonus."""
    return -torch.exp(logp[:6].mean()) * 1.5 + logp[6:].square().sum() - 0.1 * ent.sum()


@pytest.mark.parametrize("chunk", [1, 3, 11, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunks_give_the_full_values_and_gradients(chunk, temperature):
    head, hidden, labels = _setup()
    # the full computation, autograd all the way
    h_full = hidden.clone().requires_grad_(True)
    z = head(h_full) / temperature
    logp_full = torch.log_softmax(z, -1).gather(1, labels[:, None])[:, 0]
    ent_full = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    _loss(logp_full, ent_full).backward()
    want_h, want_w = h_full.grad.clone(), head.weight.grad.clone()
    head.weight.grad = None

    lp, ent = chunked_logprobs(hidden, labels, head, temperature=temperature, chunk=chunk)
    torch.testing.assert_close(lp, logp_full.detach().float())
    torch.testing.assert_close(ent, ent_full.detach().float())
    # float32 values from the projection's float64 logits: recompute the loss's gradient in float64
    lp64, ent64 = (x.detach().clone().requires_grad_(True) for x in (logp_full, ent_full))
    g_lp, g_ent = torch.autograd.grad(_loss(lp64, ent64), [lp64, ent64])
    got_h = chunked_backward(
        hidden, labels, head, g_lp, g_ent, temperature=temperature, chunk=chunk
    )
    # the projection's logits go through softmax in float32, as in the learner: compare relative to
    # each gradient's scale (tests/numerics.py)
    assert_grads_close({"h": want_h, "w": want_w}, {"h": got_h.double(), "w": head.weight.grad})


def test_no_more_than_one_chunk_of_logits_at_a_time():
    head, hidden, labels = _setup(t=40, v=200)
    rows: list[int] = []
    head.register_forward_hook(lambda m, i, out: rows.append(out.shape[0]))
    chunk = 7
    lp, _ = chunked_logprobs(hidden, labels, head, temperature=1.0, chunk=chunk)
    chunked_backward(
        hidden,
        labels,
        head,
        torch.ones_like(lp, dtype=F64),
        None,
        temperature=1.0,
        chunk=chunk,
    )
    assert max(rows) == chunk and sum(rows) == 2 * 40  # each pass: every row once, 7 at a time


def test_chunk_size_follows_the_budget_not_the_batch():
    assert chunk_tokens(151_936, 256) == 110  # Qwen3's vocabulary: 256 MiB / (16 B × V)
    assert chunk_tokens(100, 256) == 167_772
    assert chunk_tokens(10**9, 1) == 1


def test_the_default_chunk_is_hundreds_of_tokens_at_a_real_vocabulary():
    """Each chunk reads the whole output projection and adds into its whole gradient (the module's
    docstring): at Qwen3's vocabulary the default budget makes that a few hundred tokens' cost."""
    assert chunk_tokens(151_936, LearnerConfig().logits_chunk_mb) == 441

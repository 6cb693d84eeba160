"""The MoE auxiliary load-balancing loss (issue #55, ``algorithm.moe_aux_loss_coef``): the value is
transformers' Qwen3-MoE ``load_balancing_loss_func`` on the same router logits, padding excluded;
with a coefficient it reaches the router's gradient and balances the routing; at 0 the learner
runs as before; ``asyncrl check`` refuses it on a dense model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.learner import passes
from asyncrl.learner.losses.aggregation import Normaliser
from asyncrl.learner.packing import make_sequence, pack
from asyncrl.learner.routing import (
    load_balancing_loss,
    record_routing,
    recorded_aux_loss,
    routers,
)
from tests.learner.test_model import make_trainer, random_batch, random_sequences

pytestmark = pytest.mark.numerics  # compares float32 results across kernels (tests/numerics.py)

EXPERTS, TOP_K = 8, 2
# Both sides compute the routers' softmax in float32 from logits that agree to float32 rounding of
# different matmul kernels (the learner's hidden states equal transformers' within LOGPROB_ATOL);
# the expert counts are integers and equal when the top-k sets are. The loss is O(top_k), so a
# relative 1e-5 is ~100 float32 ulps of it and far below what one changed routing moves it
# (1/(layers·tokens) ≈ 1e-2 here).
RTOL = 1e-5


def padded_hf(model_dir, seqs: list[np.ndarray], pad: int):
    """transformers' Qwen3-MoE on ``seqs`` right-padded with ``pad`` into one batch: its aux loss
    (with the attention mask) and its router logits per MoE layer, ``[batch·len, E]``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(s)
        mask[i, : len(s)] = 1
    with torch.no_grad():
        out = hf(ids, attention_mask=mask, output_router_logits=True)
    return out.aux_loss, out.router_logits, mask


def ours_on(logits, mask=None) -> torch.Tensor:
    """:func:`load_balancing_loss` on transformers' router logits, choosing as its router does;
    with ``mask``, on the unpadded positions' rows only (what a packed micro-batch holds)."""
    keep = None if mask is None else mask.reshape(-1) > 0
    probs = [torch.softmax(lg.float() if keep is None else lg[keep].float(), -1) for lg in logits]
    return load_balancing_loss(
        probs, [p.topk(TOP_K, -1).indices for p in probs], num_experts=EXPERTS
    )


def test_aux_equals_transformers_padding_excluded(tiny_qwen3_moe, tmp_path):
    tr = make_trainer(tiny_qwen3_moe, tmp_path, algorithm={"moe_aux_loss_coef": 0.01})
    seqs = random_sequences(3, tr.models.spec.model.vocab_size, seed=5)
    assert len({len(s) for s in seqs}) > 1  # right padding in the batch below
    want, logits, mask = padded_hf(tiny_qwen3_moe, seqs, pad=3)
    assert len(logits) == 2  # both layers are MoE
    torch.testing.assert_close(ours_on(logits, mask), want, rtol=RTOL, atol=0)
    # padding does not count: other pad tokens give other padded logits and the same loss ...
    want2, logits2, _ = padded_hf(tiny_qwen3_moe, seqs, pad=7)
    torch.testing.assert_close(want2, want, rtol=RTOL, atol=0)
    torch.testing.assert_close(ours_on(logits2, mask), want, rtol=RTOL, atol=0)
    # ... and counting it would change it
    assert abs(float(ours_on(logits)) - float(want)) > 1e-3
    # the learner's routers, recorded in a training forward of the packed sequences (no padding),
    # which feeds every token but each sequence's last (it predicts nothing)
    fed, _, _ = padded_hf(tiny_qwen3_moe, [s[:-1] for s in seqs], pad=3)
    items = [make_sequence(i, s[:1], s[1:]) for i, s in enumerate(seqs)]
    mb = pack(items).to(tr.models.device)
    rs = record_routing(tr.models.actor)
    passes.hidden(tr.models, mb, tr.models.actor)
    got = recorded_aux_loss(rs)
    assert got is not None and got.requires_grad  # it trains the routers
    torch.testing.assert_close(got.detach(), fed, rtol=RTOL, atol=0)
    assert all(r.record is None for r in rs)  # recording stops: a recompute adds nothing


def router_grads(tr, items) -> list[torch.Tensor]:
    """Each MoE layer's gate gradient after one training micro-batch of ``items`` (the learner's
    own forward and backward, :func:`passes.actor_micro_batch`)."""
    models, actor = tr.models, tr.models.actor
    mb = pack(items).to(models.device)
    norm = Normaliser(
        tokens=float(mb.trained_tokens), seqs=mb.trained_seqs, positions=float(mb.num_tokens)
    )
    totals = passes.StepTotals.on(models.device, models.config.max_staleness, "sft")
    actor.zero_grad(set_to_none=True)
    passes.actor_micro_batch(models, mb, norm, totals, version=0, measure_drift=False)
    out = [r.gate.weight.grad.clone() for r in routers(actor)]
    actor.zero_grad(set_to_none=True)
    return out


def aux_of(tr, items) -> float:
    """The load-balancing loss of the current weights on ``items`` (packed), no gradient."""
    rs = record_routing(tr.models.actor)
    with torch.no_grad():
        passes.hidden(tr.models, pack(items).to(tr.models.device), tr.models.actor)
    return float(recorded_aux_loss(rs))


def test_coef_reaches_the_router_and_balances_the_routing(tiny_qwen3_moe, tmp_path):
    off = make_trainer(
        tiny_qwen3_moe, tmp_path / "off", algorithm={"loss": "sft"}, learner={"lr": 1e-3}
    )
    on = make_trainer(
        tiny_qwen3_moe,
        tmp_path / "on",
        algorithm={"loss": "sft", "moe_aux_loss_coef": 1.0},
        learner={"lr": 1e-3},
    )
    vocab = on.models.spec.model.vocab_size
    items = [make_sequence(i, s[:1], s[1:]) for i, s in enumerate(random_sequences(4, vocab))]
    g_off, g_on = router_grads(off, items), router_grads(on, items)
    for a, b in zip(g_off, g_on, strict=True):
        assert (a - b).abs().max() > 1e-4 * a.abs().max()
    # the coefficient off: the routers never record, and the step logs no aux
    start = aux_of(on, items)
    assert start == aux_of(off, items) and start > TOP_K  # the random routers are unbalanced
    trained = pack_batch(vocab, 1)  # the batch every step trains on
    first = aux_of(on, trained)
    logged = []
    for step in range(6):
        m_off = off.step(random_batch(vocab, seed=1)).metrics
        m_on = on.step(random_batch(vocab, seed=1)).metrics
        assert "loss/moe_aux" not in m_off and all(
            r.record is None for r in routers(off.models.actor)
        )
        logged.append(m_on["loss/moe_aux"])
        if step == 0:  # the same weights, the same forward: the policy loss is apart from the aux
            assert m_on["loss"] == m_off["loss"]
    # the step's logged aux is the loss of its batch (one micro-batch), which the steps lower
    assert logged[0] == pytest.approx(first, rel=RTOL)
    assert logged[-1] < logged[0] and logged[-1] < aux_of(off, trained)
    # more balanced than the same steps without it, on sequences it never trained on
    after_on, after_off = aux_of(on, items), aux_of(off, items)
    assert after_on < after_off and after_on < start


def pack_batch(vocab: int, seed: int) -> list:
    """``random_batch(vocab, seed)``'s samples as the learner lays them out (prompt 2 tokens)."""
    return [make_sequence(i, s[:2], s[2:]) for i, s in enumerate(random_sequences(4, vocab, seed))]


def test_check_refuses_the_aux_loss_on_a_dense_model(tiny_qwen3_moe, tiny_qwen3):
    from asyncrl import recipe
    from asyncrl.recipe import RecipeError

    moe = {"model": {"path": str(tiny_qwen3_moe)}, "algorithm": {"moe_aux_loss_coef": 0.001}}
    assert recipe.from_dict(moe).algorithm.moe_aux_loss_coef == 0.001
    dense = moe | {"model": {"path": str(tiny_qwen3)}}
    with pytest.raises(
        RecipeError,
        match=r"^algorithm\.moe_aux_loss_coef: 0\.001 > 0, but model\.path is not a mixture of "
        r"experts \(model_type qwen3\)",
    ) as e:
        recipe.from_dict(dense)
    assert "\n" not in str(e.value)
    assert recipe.from_dict(dense | {"algorithm": {}}).algorithm.moe_aux_loss_coef == 0.0


def test_under_replay_the_aux_counts_the_replayed_experts(tiny_qwen3_moe, tmp_path):
    """The routings that train are the generator's: the loss balances those, not the ones the
    learner's router would have chosen."""
    tr = make_trainer(
        tiny_qwen3_moe, tmp_path, algorithm={"routing_replay": True, "moe_aux_loss_coef": 0.01}
    )
    seqs = random_sequences(2, tr.models.spec.model.vocab_size, seed=7)
    # every position of every MoE layer to experts 0 and 1, whatever the router prefers
    forced = [np.tile(np.array([0, 1], np.uint8), (len(s) - 1, 2, 1)) for s in seqs]
    items = [
        make_sequence(i, s[:1], s[1:], routed_experts=r)
        for i, (s, r) in enumerate(zip(seqs, forced, strict=True))
    ]
    rs = record_routing(tr.models.actor)
    with torch.no_grad():
        passes.hidden(tr.models, pack(items).to(tr.models.device), tr.models.actor)
    for r in rs:
        assert (r.record[0][1].sort(-1).values == torch.tensor([0, 1])).all()
    probs = [r.record[0][0].reshape(-1, EXPERTS) for r in rs]
    got = float(recorded_aux_loss(rs))
    # f_0 = f_1 = 1 (every routing), so the loss is E·(P_0 + P_1): the mean probabilities there
    want = EXPERTS * float(sum(p[:, :2].sum() for p in probs)) / sum(p.shape[0] for p in probs)
    assert got == pytest.approx(want, rel=RTOL)
    # not the loss of the router's own choice (which counts its top-k, not experts 0 and 1)
    own = aux_of(tr, [make_sequence(i, s[:1], s[1:]) for i, s in enumerate(seqs)])
    assert abs(got - own) > 1e-2

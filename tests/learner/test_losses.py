"""Policy losses: hand-computed values, identities, float64 gradients, split invariance, masking."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl import recipe
from asyncrl.learner.critic import assign_targets, token_targets
from asyncrl.learner.losses.aggregation import Normaliser, count_tokens_and_seqs, token_weights
from asyncrl.learner.losses.kl_penalty import KL_CLAMP, kl_penalty
from asyncrl.learner.losses.policy import LOSSES, needs_prox, policy_loss
from asyncrl.learner.losses.scalar import (
    bradley_terry,
    explained_variance,
    explained_variance_from_sums,
    value_loss,
    variance_sums,
)
from asyncrl.learner.losses.stats import finalize_stats, stat_keys, zero_stats
from asyncrl.learner.packing import make_sequence, pack
from asyncrl.recipe import AlgorithmConfig

F64 = torch.float64
RL_LOSSES = [x for x in LOSSES if x != "sft"]
AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


def t(*xs):
    return torch.tensor(xs, dtype=F64)


def run(loss, *, logp, blp=None, adv=None, mask=None, seq_ids=None, norm=None, **kw):
    """policy_loss with a config from keyword fields and a one-micro-batch normaliser."""
    fields = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    cfg = AlgorithmConfig(loss=loss, **{k: v for k, v in kw.items() if k in fields})
    extra = {k: v for k, v in kw.items() if k not in fields}
    n = logp.shape[0]
    mask = torch.ones(n, dtype=torch.bool) if mask is None else mask
    seq_ids = torch.zeros(n, dtype=torch.long) if seq_ids is None else seq_ids
    if norm is None:
        tok, seqs = count_tokens_and_seqs(mask, seq_ids).tolist()
        norm = Normaliser(tokens=tok, seqs=seqs, seq_len=8)
    return policy_loss(
        cfg=cfg,
        norm=norm,
        logp=logp,
        behavior_logp=blp,
        advantages=adv,
        mask=mask,
        seq_ids=seq_ids,
        **extra,
    )


def grad_of(loss_fn, logp):
    x = logp.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(loss_fn(x), x)
    return g


# ---- hand-built example: ratios r = π/μ = [1.5, 0.5, 1.0, 1.1], A = [1, −1, 2, −1] ----------
BLP = t(-1.0, -2.0, -0.5, -1.5)
R = t(1.5, 0.5, 1.0, 1.1)
LOGP = BLP + torch.log(R)
A = t(1.0, -1.0, 2.0, -1.0)


def test_ppo_golden():
    # clip [0.8, 1.28]: −min(1.5, 1.28), −min(−.5, −.8), −min(2, 2), −min(−1.1, −1.1)
    loss, stats = run("ppo", logp=LOGP, blp=BLP, adv=A)
    assert float(loss) == pytest.approx((-1.28 + 0.8 - 2.0 + 1.1) / 4)
    m = finalize_stats(stats)
    assert m["loss/clip_frac"] == pytest.approx(0.5)
    assert m["loss/is_weight_mean"] == pytest.approx(float(R.mean()))
    # Analytic gradient: unclipped tokens give −r·A/N, clipped tokens 0.
    g = grad_of(lambda x: run("ppo", logp=x, blp=BLP, adv=A)[0], LOGP)
    torch.testing.assert_close(g, t(0.0, 0.0, -2.0 / 4, 1.1 / 4))


def test_decoupled_ppo_golden():
    # π_prox/μ = [2, .5, 10, 1] → w = [2, .5, 5, 1] with C = 5; r = π/π_prox = [1.5, .5, 1, 1.1]/w_raw.
    w_raw = t(2.0, 0.5, 10.0, 1.0)
    prox = BLP + torch.log(w_raw)
    r = R / w_raw  # [.75, 1, .1, 1.1]
    loss, stats = run("decoupled_ppo", logp=LOGP, blp=BLP, adv=A, prox_logp=prox, is_cap=5.0)
    # token0 A=1 r=.75 → −.75·2; token1 r=1 → +1·.5; token2 A=2 r=.1 → −.2·5; token3 A=−1 r=1.1 → 1.1
    expected = (-0.75 * 2 + 0.5 - 0.2 * 5 + 1.1) / 4
    assert float(loss) == pytest.approx(expected)
    assert float(r[2]) == pytest.approx(0.1)
    m = finalize_stats(stats)
    assert m["loss/is_capped_frac"] == pytest.approx(0.25)
    assert m["loss/is_weight_mean"] == pytest.approx(float(w_raw.mean()))
    # Gradient −w·r·A/N (nothing clipped here); w is a constant, however π_prox was computed.
    prox_g = prox.clone().requires_grad_(True)
    g = grad_of(lambda x: run("decoupled_ppo", logp=x, blp=BLP, adv=A, prox_logp=prox_g)[0], LOGP)
    torch.testing.assert_close(g, -t(2.0, 0.5, 5.0, 1.0) * r * A / 4)


def test_tis_golden_and_gradient():
    loss, stats = run("tis", logp=LOGP, blp=BLP, adv=A, is_cap=1.2)
    w = t(1.2, 0.5, 1.0, 1.1)
    assert float(loss) == pytest.approx(float(-(w * A * LOGP).sum() / 4))
    assert finalize_stats(stats)["loss/is_capped_frac"] == pytest.approx(0.25)
    g = grad_of(lambda x: run("tis", logp=x, blp=BLP, adv=A, is_cap=1.2)[0], LOGP)
    torch.testing.assert_close(g, -w * A / 4)


@pytest.mark.parametrize(
    "lower, w, clip_frac",
    [
        # MiniMax-M1's CISPO, the default (issue #43 item 2): bounded above only, so the token
        # whose ratio fell to 0.5 weighs 0.5 (the old default raised it to 1 − clip_low = 0.8)
        (False, (1.28, 0.5, 1.0, 1.1), 0.25),
        (True, (1.28, 0.8, 1.0, 1.1), 0.5),  # algorithm.cispo_clip_low: the lower bound too
    ],
)
def test_cispo_golden_and_gradient(lower, w, clip_frac):
    kw = dict(clip_low=0.2, clip_high=0.28, cispo_clip_low=lower)
    loss, stats = run("cispo", logp=LOGP, blp=BLP, adv=A, **kw)
    w = t(*w)
    assert float(loss) == pytest.approx(float(-(w * A * LOGP).sum() / 4))
    assert finalize_stats(stats)["loss/clip_frac"] == pytest.approx(clip_frac)
    g = grad_of(lambda x: run("cispo", logp=x, blp=BLP, adv=A, **kw)[0], LOGP)
    torch.testing.assert_close(g, -w * A / 4)


def test_gspo_golden_and_gradient():
    # Seq 0 = tokens 0,1: s0 = sqrt(1.5·0.5) = .866 (A=+1); seq 1 = tokens 2,3: s1 = sqrt(1.0·1.1)
    # = 1.0488 (A=−1); both inside [0.8, 1.28], so neither is clipped.
    seq = torch.tensor([0, 0, 1, 1])
    adv = t(1.0, 1.0, -1.0, -1.0)
    kw = dict(seq_ids=seq, clip_low=0.2, clip_high=0.28, aggregation="seq_mean_token_mean")
    loss, _ = run("gspo", logp=LOGP, blp=BLP, adv=adv, **kw)
    s0, s1 = math.sqrt(0.75), math.sqrt(1.1)
    assert float(loss) == pytest.approx((-s0 + s1) / 2)
    # d/dlogp_t (−s_i A_i / 2) = −A_i s_i / (2·|y_i|): the gradient flows through the geometric mean.
    g = grad_of(lambda x: run("gspo", logp=x, blp=BLP, adv=adv, **kw)[0], LOGP)
    torch.testing.assert_close(g, t(-s0 / 4, -s0 / 4, s1 / 4, s1 / 4))
    # Flip A and tighten ε_low to 0.05: seq 0 (A=−1, s0 = .866 < .95) is clipped to .95.
    loss, stats = run("gspo", logp=LOGP, blp=BLP, adv=-adv, **{**kw, "clip_low": 0.05})
    assert float(loss) == pytest.approx((0.95 - s1) / 2)
    assert finalize_stats(stats)["loss/clip_frac"] == pytest.approx(0.5)


def _gspo_as_a_sequence_loss(logp, blp, adv, seq_ids, mask, clip_low, clip_high):
    """GSPO's sequence form, the gradient through s_i's mean: what gspo computed before GSPO-token."""
    m = mask.to(logp.dtype)
    count = torch.zeros(int(seq_ids.max()) + 1, dtype=F64).index_add_(0, seq_ids, m)
    total = torch.zeros(int(seq_ids.max()) + 1, dtype=F64).index_add_(0, seq_ids, (logp - blp) * m)
    s = torch.exp(total / count.clamp(min=1))[seq_ids]
    per_token = -torch.minimum(s * adv, torch.clamp(s, 1 - clip_low, 1 + clip_high) * adv)
    tokens, seqs = count_tokens_and_seqs(mask, seq_ids).tolist()
    c = token_weights(
        mask, seq_ids, aggregation="seq_mean_token_mean", norm=Normaliser(tokens=tokens, seqs=seqs)
    )
    return torch.where(mask, per_token * c, 0).sum()


@pytest.mark.parametrize("seed", range(4))
def test_gspo_token_is_gspo_when_the_advantage_is_the_sequences(seed):
    """One advantage per sequence (the group estimators): GSPO-token's loss is GSPO's exactly and
    its gradient GSPO's (s_i/|y_i| on each token, gathered back by the mean over the tokens)."""
    b = _random_batch(torch.Generator().manual_seed(seed), n_seqs=6, max_len=5)
    kw = dict(clip_low=0.02, clip_high=0.03)  # some sequences clipped, some not
    args = (b["blp"], b["adv"], b["seq_ids"], b["mask"], kw["clip_low"], kw["clip_high"])

    def new(x):
        return run("gspo", **{**b, "logp": x}, **kw)[0]

    def old(x):
        return _gspo_as_a_sequence_loss(x, *args)

    assert float(new(b["logp"])) == float(old(b["logp"]))
    g_new, g_old = grad_of(new, b["logp"]), grad_of(old, b["logp"])
    torch.testing.assert_close(g_new, g_old, rtol=1e-12, atol=1e-15)
    assert (g_old != 0).any() and (g_old[b["mask"]] == 0).any()  # both clipped and unclipped


def test_gspo_token_gradient_follows_each_tokens_advantage():
    """Per-token advantages (gae, vtrace, per-turn discounts): token t of y_i has the ratio
    s_i,t = sg[s_i]·π_t/sg[π_t], so ∂ℓ_t/∂log π_t = −s_i·A_t where unclipped, and the clip acts per
    token by the sign of A_t. Sequence GSPO would give every token of y_i the same −s_i·mean(A)/|y_i|.

    Seq 0: ratios [2, 0.5, 1] → s0 = 1, A = [1, −2, 0.5]; seq 1: ratios [1.44, 1] → s1 = 1.2,
    A = [1, −1]; clip [0.8, 1.1]: seq 1's A > 0 token is clipped (min(1.2, 1.1)), its A < 0 one not.
    seq_mean_token_mean: c = 1/(3·2) on seq 0, 1/(2·2) on seq 1."""
    blp = t(-1.0, -2.0, -0.5, -1.5, -0.7)
    logp = blp + torch.log(t(2.0, 0.5, 1.0, 1.44, 1.0))
    seq, adv = torch.tensor([0, 0, 0, 1, 1]), t(1.0, -2.0, 0.5, 1.0, -1.0)
    kw = dict(seq_ids=seq, clip_low=0.2, clip_high=0.1)
    loss, stats = run("gspo", logp=logp, blp=blp, adv=adv, **kw)
    assert float(loss) == pytest.approx(-(1 - 2 + 0.5) / 6 - (1.1 - 1.2) / 4)
    assert finalize_stats(stats)["loss/clip_frac"] == pytest.approx(1 / 5)
    g = grad_of(lambda x: run("gspo", logp=x, blp=blp, adv=adv, **kw)[0], logp)
    torch.testing.assert_close(g, t(-1 / 6, 2 / 6, -0.5 / 6, 0.0, 1.2 / 4))


def test_sft_is_masked_cross_entropy():
    mask = torch.tensor([True, False, True, True])
    loss, _ = run("sft", logp=LOGP, mask=mask)
    assert float(loss) == pytest.approx(-float(LOGP[mask].mean()))


def test_needs_prox():
    # m2po's mask is cut on π_prox, recomputed over the whole batch before its first update
    assert [x for x in LOSSES if needs_prox(x)] == ["decoupled_ppo", "m2po"]


# ---- aggregations ------------------------------------------------------------------------------


def test_aggregations_golden():
    logp = t(-1.0, -2.0, -3.0, -4.0, -5.0)
    seq = torch.tensor([0, 0, 0, 1, 1])
    mask = torch.tensor([True, True, True, True, False])
    tm, _ = run("sft", logp=logp, seq_ids=seq, mask=mask, aggregation="token_mean")
    assert float(tm) == pytest.approx((1 + 2 + 3 + 4) / 4)
    sm, _ = run("sft", logp=logp, seq_ids=seq, mask=mask, aggregation="seq_mean_token_mean")
    assert float(sm) == pytest.approx((6 / 3 + 4 / 1) / 2)
    norm = Normaliser(tokens=4, seqs=2, seq_len=10)
    dr, _ = run(
        "sft", logp=logp, seq_ids=seq, mask=mask, norm=norm, aggregation="seq_mean_token_sum_norm"
    )
    assert float(dr) == pytest.approx((6 / 10 + 4 / 10) / 2)


def _random_batch(gen, n_seqs, max_len):
    lengths = torch.randint(1, max_len + 1, (n_seqs,), generator=gen)
    seq = torch.repeat_interleave(torch.arange(n_seqs), lengths)
    n = int(lengths.sum())
    blp = -torch.rand(n, generator=gen, dtype=F64) * 3
    logp = blp + (torch.rand(n, generator=gen, dtype=F64) - 0.5) * 0.8
    prox = blp + (torch.rand(n, generator=gen, dtype=F64) - 0.5) * 0.4
    seq_adv = torch.randn(n_seqs, generator=gen, dtype=F64)
    mask = torch.rand(n, generator=gen) > 0.2
    return dict(logp=logp, blp=blp, prox_logp=prox, adv=seq_adv[seq], mask=mask, seq_ids=seq)


@settings(max_examples=25, deadline=None)
@given(
    loss=st.sampled_from(LOSSES),
    aggregation=st.sampled_from(AGGS),
    seed=st.integers(0, 2**31 - 1),
    n_micro=st.integers(1, 4),
    is_level=st.sampled_from(["token", "sequence"]),
)
def test_micro_batch_split_invariance(loss, aggregation, seed, n_micro, is_level):
    """Σ over micro-batches of (contribution / global normaliser) = the full-batch loss, and so
    are the gradients; whole sequences per micro-batch, split points drawn at random."""
    gen = torch.Generator().manual_seed(seed)
    b = _random_batch(gen, n_seqs=6, max_len=5)
    kw = dict(aggregation=aggregation, ratio_mask_high=1.3, kl_coef=0.1, seq_mask_high=1.1)
    if loss in ("tis", "decoupled_ppo"):
        kw["is_level"] = is_level
    ref = b["blp"] + 0.05
    tok, seqs = count_tokens_and_seqs(b["mask"], b["seq_ids"]).tolist()
    norm = Normaliser(tokens=tok, seqs=seqs, seq_len=7)

    def full(x):
        return run(loss, **{**b, "logp": x}, norm=norm, ref_logp=ref, **kw)[0]

    cuts = sorted(torch.randperm(5, generator=gen)[: n_micro - 1].add(1).tolist())
    bounds = [0, *cuts, 6]

    def split(x):
        # Each micro-batch counts its own share; the sum of the shares is the global normaliser.
        parts = []
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            sel = (b["seq_ids"] >= lo) & (b["seq_ids"] < hi)
            part = {k: v[sel] for k, v in b.items()}
            part["seq_ids"] = part["seq_ids"] - lo  # local sequence numbering
            parts.append((sel, part))
        shares = sum(count_tokens_and_seqs(p["mask"], p["seq_ids"]) for _, p in parts)
        assert shares.tolist() == [tok, seqs]
        total = 0
        for sel, p in parts:
            p["logp"] = x[sel]
            total = total + run(loss, **p, norm=norm, ref_logp=ref[sel], **kw)[0]
        return total

    torch.testing.assert_close(split(b["logp"]), full(b["logp"]))
    torch.testing.assert_close(grad_of(split, b["logp"]), grad_of(full, b["logp"]))


def test_token_mean_is_invariant_to_splitting_inside_sequences():
    gen = torch.Generator().manual_seed(0)
    b = _random_batch(gen, n_seqs=3, max_len=6)
    tok, seqs = count_tokens_and_seqs(b["mask"], b["seq_ids"]).tolist()
    norm = Normaliser(tokens=tok, seqs=seqs)
    full, _ = run("ppo", **b, norm=norm)
    half = len(b["logp"]) // 2
    parts = [
        run("ppo", **{k: v[s] for k, v in b.items()}, norm=norm)[0]
        for s in (slice(0, half), slice(half, None))
    ]
    torch.testing.assert_close(parts[0] + parts[1], full)


def test_summed_stats_equal_full_batch_stats():
    gen = torch.Generator().manual_seed(1)
    b = _random_batch(gen, n_seqs=4, max_len=6)
    norm = Normaliser(tokens=1, seqs=1)
    kw = dict(norm=norm, clip_low=0.1, clip_high=0.1, seq_mask_low=0.97)
    _, full = run("decoupled_ppo", **b, **kw)
    sums = None
    for s in (b["seq_ids"] < 2, b["seq_ids"] >= 2):
        _, part = run("decoupled_ppo", **{k: v[s] for k, v in b.items()}, **kw)
        sums = part if sums is None else {k: sums[k] + part[k] for k in sums}
    assert finalize_stats(sums) == pytest.approx(finalize_stats(full))
    assert finalize_stats(full)["loss/clip_frac"] > 0  # the example exercises clipping
    assert 0 < finalize_stats(full)["loss/seq_masked_frac"] < 1  # and the sequence mask


# ---- identities ---------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), aggregation=st.sampled_from(AGGS))
def test_decoupled_ppo_equals_ppo_when_prox_is_behaviour(seed, aggregation):
    b = _random_batch(torch.Generator().manual_seed(seed), n_seqs=4, max_len=5)
    del b["prox_logp"]

    def loss(name, x):
        extra = {"prox_logp": b["blp"]} if name == "decoupled_ppo" else {}
        return run(name, **{**b, "logp": x}, aggregation=aggregation, **extra)[0]

    torch.testing.assert_close(loss("decoupled_ppo", b["logp"]), loss("ppo", b["logp"]))
    torch.testing.assert_close(
        grad_of(lambda x: loss("decoupled_ppo", x), b["logp"]),
        grad_of(lambda x: loss("ppo", x), b["logp"]),
    )


@pytest.mark.parametrize("loss", RL_LOSSES)
def test_on_policy_every_weight_is_one(loss):
    """π = μ = π_prox: IS weights 1, ESS 1, nothing clipped/capped/masked, zero KL; and every loss's
    gradient is the plain policy gradient −A·∇log π / N."""
    b = _random_batch(torch.Generator().manual_seed(3), n_seqs=3, max_len=4)
    b["blp"] = b["prox_logp"] = b["logp"].clone()
    kw = dict(ratio_mask_low=0.9, ratio_mask_high=1.1, seq_mask_low=0.99, seq_mask_high=1.01)
    kw |= dict(is_cap=1.0)
    _, stats = run(loss, **b, **kw)
    m = finalize_stats(stats)
    assert m["loss/is_weight_mean"] == 1.0 and m["loss/ess"] == 1.0
    assert m["loss/clip_frac"] == m["loss/is_capped_frac"] == m["loss/ratio_masked_frac"] == 0.0
    assert m["loss/seq_masked_frac"] == 0.0
    assert m["loss/kl_mu_k1"] == m["loss/kl_mu_k3"] == 0.0
    g = grad_of(lambda x: run(loss, **{**b, "logp": x}, **kw)[0], b["logp"])
    tokens, seqs = count_tokens_and_seqs(b["mask"], b["seq_ids"]).tolist()
    c = token_weights(
        b["mask"],
        b["seq_ids"],
        aggregation=AlgorithmConfig(loss=loss).aggregation_used,  # gspo: per sequence
        norm=Normaliser(tokens=tokens, seqs=seqs, seq_len=8),
    )
    torch.testing.assert_close(g, torch.where(b["mask"], -b["adv"] * c, 0.0))


@pytest.mark.parametrize("loss", LOSSES)
def test_gradcheck_float64(loss):
    b = _random_batch(torch.Generator().manual_seed(4), n_seqs=3, max_len=4)
    ent = torch.rand(len(b["logp"]), dtype=F64, generator=torch.Generator().manual_seed(5))
    ref = b["blp"] - 0.1
    # The KL term's weight sg[min(π/μ, C)] is detached by design: with C below every ratio here
    # it is the constant C, whose derivative finite differences see (kl_coef scaled to match).
    cap = 0.05
    assert float((b["logp"] - b["blp"]).exp().min()) > cap
    kw = dict(
        kl_coef=0.3 / cap,
        is_cap=cap,
        kl_estimator="k2",  # k1 and k3 carry k2's gradient under their own value (see the KL tests)
        entropy_coef=0.01,
        aggregation="seq_mean_token_mean",
        clip_low=0.1,
        clip_high=0.1,
    )

    # tis, cispo and m2po detach their weight w(π/μ) by design, so their gradient is the derivative at a
    # frozen weight: finite differences see that when μ moves with π (ρ fixed; μ is detached inside).
    frozen_w = loss in ("tis", "cispo", "m2po")
    log_rho = (b["logp"] - b["blp"]).detach()

    def f(x, h):
        blp = x - log_rho if frozen_w else b["blp"]
        return run(loss, **{**b, "logp": x, "blp": blp}, ref_logp=ref, entropy=h, **kw)[0]

    x = b["logp"].clone().requires_grad_(True)
    h = ent.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (x, h), eps=1e-6, atol=1e-8)


# ---- options: masking, KL, entropy, garbage in masked positions ----------------------------------


def test_ratio_masking_drops_tokens_but_keeps_denominator():
    # r = [1.5, 0.5, 1.0, 1.1]; keep [0.8, 1.2] → tokens 0 and 1 dropped.
    loss, stats = run("ppo", logp=LOGP, blp=BLP, adv=A, ratio_mask_low=0.8, ratio_mask_high=1.2)
    assert float(loss) == pytest.approx((-2.0 + 1.1) / 4)
    m = finalize_stats(stats)
    assert m["loss/ratio_masked_frac"] == 0.5 and m["loss/clip_frac"] == 0.0
    only_high, _ = run("ppo", logp=LOGP, blp=BLP, adv=A, ratio_mask_high=1.2)
    assert float(only_high) == pytest.approx((0.8 - 2.0 + 1.1) / 4)
    # decoupled_ppo masks on π_prox/μ, not on π/μ.
    loss, _ = run("decoupled_ppo", logp=LOGP, blp=BLP, adv=A, prox_logp=BLP, ratio_mask_high=1.2)
    full, _ = run("decoupled_ppo", logp=LOGP, blp=BLP, adv=A, prox_logp=BLP)
    assert float(loss) == float(full)


def test_ratio_masking_in_gspo_drops_tokens_from_the_geometric_mean():
    # Token 0 (ρ = 1.5) is dropped: s0 = ρ_1 = 0.5 from token 1 alone; |y_0| still counts 2 tokens.
    seq, adv = torch.tensor([0, 0, 1, 1]), t(1.0, 1.0, -1.0, -1.0)
    kw = dict(seq_ids=seq, aggregation="seq_mean_token_mean", ratio_mask_high=1.2)
    loss, _ = run("gspo", logp=LOGP, blp=BLP, adv=adv, **kw)
    assert float(loss) == pytest.approx((-0.5 / 2 + math.sqrt(1.1)) / 2)


# Sequence-level corrections. Seq 0: ratios [2, 0.5] (geometric mean 1, product 1); seq 1: [1.5,
# 1.5] (1.5, 2.25); seq 2: [0.5] (0.5); seq 3: [1.1]. Token-level ρ would be far from 1 in seq 0.
SEQ_BLP = t(-1.0, -2.0, -0.5, -1.5, -0.7, -0.3)
SEQ_R = t(2.0, 0.5, 1.5, 1.5, 0.5, 1.1)
SEQ_LOGP = SEQ_BLP + torch.log(SEQ_R)
SEQ_IDS = torch.tensor([0, 0, 1, 1, 2, 3])
SEQ_A = t(1.0, -1.0, 2.0, 1.0, -1.0, 0.5)


def test_seq_mask_drops_sequences_whose_geometric_mean_ratio_leaves_the_band():
    """[0.8, 1.2] keeps seq 0 (mean 1, though its tokens' ratios are 2 and 0.5) and seq 3, drops
    seq 1 (1.5 > 1.2) and seq 2 (0.5 < 0.8). Dropped sequences stay in the denominators, as
    IcePop's tokens do: tis's gradient on the kept tokens is −ρ_t·A_t/6, 0 on the dropped ones."""
    kw = dict(seq_ids=SEQ_IDS, seq_mask_low=0.8, seq_mask_high=1.2)
    loss, stats = run("tis", logp=SEQ_LOGP, blp=SEQ_BLP, adv=SEQ_A, **kw)
    kept = torch.tensor([True, True, False, False, False, True])
    assert float(loss) == pytest.approx(float(-(SEQ_R * SEQ_A * SEQ_LOGP)[kept].sum() / 6))
    g = grad_of(lambda x: run("tis", logp=x, blp=SEQ_BLP, adv=SEQ_A, **kw)[0], SEQ_LOGP)
    torch.testing.assert_close(g, torch.where(kept, -SEQ_R * SEQ_A / 6, 0.0))
    m = finalize_stats(stats)
    assert m["loss/seq_masked_frac"] == 0.5 and m["loss/ratio_masked_frac"] == 0.0
    only_high, stats = run(
        "tis", logp=SEQ_LOGP, blp=SEQ_BLP, adv=SEQ_A, **{**kw, "seq_mask_low": 0}
    )
    assert finalize_stats(stats)["loss/seq_masked_frac"] == 0.25
    kept[4] = True
    assert float(only_high) == pytest.approx(float(-(SEQ_R * SEQ_A * SEQ_LOGP)[kept].sum() / 6))


@pytest.mark.parametrize("loss", RL_LOSSES)
def test_seq_mask_zeroes_the_dropped_sequences_and_leaves_the_others(loss):
    """Every loss: a kept sequence's gradient is the unmasked loss's. decoupled_ppo's band is on
    π_prox/μ (as IcePop's): with π_prox = μ it drops nothing, whatever π is."""
    b = dict(blp=SEQ_BLP, adv=SEQ_A, seq_ids=SEQ_IDS, prox_logp=SEQ_LOGP)
    b |= dict(clip_low=0.6, clip_high=1.0)  # no clip acts: every unmasked token has a gradient
    band = dict(seq_mask_low=0.8, seq_mask_high=1.2)
    g_all = grad_of(lambda x: run(loss, logp=x, **b)[0], SEQ_LOGP)
    g = grad_of(lambda x: run(loss, logp=x, **b, **band)[0], SEQ_LOGP)
    kept = torch.tensor([True, True, False, False, False, True])
    torch.testing.assert_close(g, torch.where(kept, g_all, 0.0))
    assert (g_all[~kept] != 0).any()
    prox_at_mu = {**b, "prox_logp": SEQ_BLP}
    _, stats = run("decoupled_ppo", logp=SEQ_LOGP, **prox_at_mu, **band)
    assert finalize_stats(stats)["loss/seq_masked_frac"] == 0.0


def test_sequence_level_is_weight_is_the_truncated_product_of_the_ratios():
    """``is_level: sequence`` (verl's rollout_is: sequence): each token of y_i is weighted by
    w_i = sg[min(Π_{t∈y_i} ρ_t, C)]. Seq 0: ratios [2, 0.5, 1.5] → 1.5; seq 1: [3, 2] → 6 → C = 5.
    tis: ∂L/∂log π_t = −w_i·A_t/N; decoupled_ppo: −w_i·r_t·A_t/N with ρ = π_prox/μ, r = π/π_prox."""
    blp = t(-1.0, -2.0, -0.5, -1.5, -0.7)
    rho = t(2.0, 0.5, 1.5, 3.0, 2.0)
    seq, adv = torch.tensor([0, 0, 0, 1, 1]), t(1.0, -1.0, 2.0, 1.0, -1.0)
    w = t(1.5, 1.5, 1.5, 5.0, 5.0)
    kw = dict(seq_ids=seq, is_level="sequence", is_cap=5.0)
    logp = blp + torch.log(rho)
    loss, stats = run("tis", logp=logp, blp=blp, adv=adv, **kw)
    assert float(loss) == pytest.approx(float(-(w * adv * logp).sum() / 5))
    assert finalize_stats(stats)["loss/is_capped_frac"] == pytest.approx(2 / 5)
    g = grad_of(lambda x: run("tis", logp=x, blp=blp, adv=adv, **kw)[0], logp)
    torch.testing.assert_close(g, -w * adv / 5)
    r = t(1.1, 1.0, 0.95, 1.0, 1.05)  # inside the clip [0.8, 1.28]
    prox = logp.clone()
    g = grad_of(
        lambda x: run("decoupled_ppo", logp=x, blp=blp, adv=adv, prox_logp=prox, **kw)[0],
        prox + torch.log(r),
    )
    torch.testing.assert_close(g, -w * r * adv / 5)
    _, stats = run("decoupled_ppo", logp=logp, blp=blp, adv=adv, prox_logp=prox, **kw)
    assert finalize_stats(stats)["loss/is_capped_frac"] == pytest.approx(2 / 5)


def test_masked_positions_may_hold_garbage():
    mask = torch.tensor([True, False, True, False])
    bad = t(0.0, math.nan, 0.0, math.inf)
    for loss in LOSSES:
        clean, _ = run(loss, logp=LOGP, blp=BLP, adv=A, mask=mask, prox_logp=BLP)
        dirty = lambda x, loss=loss: run(  # noqa: E731
            loss,
            logp=x,
            blp=BLP + bad,
            adv=A + bad,
            mask=mask,
            prox_logp=BLP - bad,
            ref_logp=BLP + bad,
            entropy=bad,
        )[0]
        assert float(dirty(LOGP)) == pytest.approx(float(clean))
        g = grad_of(dirty, LOGP)
        assert torch.isfinite(g).all() and (g[~mask] == 0).all(), loss


def test_kl_penalty_values_and_their_gradient():
    ref = BLP.clone()
    zero_adv = torch.zeros(4, dtype=F64)
    delta = LOGP - ref  # log π − log π_ref
    values = {"k1": delta, "k2": delta**2 / 2, "k3": torch.exp(-delta) - 1 + delta}
    for est, kl in values.items():

        def f(x, est=est):
            return run(
                "ppo", logp=x, blp=BLP, adv=zero_adv, ref_logp=ref, kl_coef=0.5, kl_estimator=est
            )

        # each token's term weighs sg[π/μ] = R (μ sampled it; C = 5 does not bind)
        loss, stats = f(LOGP)
        assert float(loss) == pytest.approx(0.5 * float((R * kl).mean()))
        assert finalize_stats(stats)["loss/kl_ref"] == pytest.approx(float(kl.mean()))
        # whatever the value, the gradient is k2's: β·R·δ/N (see the expectation tests below)
        torch.testing.assert_close(grad_of(lambda x, f=f: f(x)[0], LOGP), 0.5 * R * delta / 4)
    with pytest.raises(ValueError, match="ref_logp"):
        run("ppo", logp=LOGP, blp=BLP, adv=A, kl_coef=0.1)


def test_k3_is_clamped_as_verl_does():
    far = t(-30.0)  # log π − log π_ref = −30: e^30 would dominate every other token
    kl = kl_penalty(far, t(0.0), estimator="k3")
    assert float(kl) == KL_CLAMP
    (g,) = torch.autograd.grad(kl_penalty(far.requires_grad_(True), t(0.0), estimator="k3"), far)
    assert float(g) == -30.0  # the clamp never touches k2's gradient


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_the_kl_terms_expected_gradient_is_the_reverse_kls(est):
    """Exact enumeration over a 5-token vocabulary: Σ_y π(y)·∇ KL_term(y), each y a sampled token
    whose probability does not carry gradient (as in training), equals ∇ KL(π ‖ π_ref). Without the
    gradient carrier k1's expected gradient is 0 and k3's is the forward KL's (checked too)."""
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(5, generator=gen, dtype=F64).requires_grad_(True)
    ref_logp = torch.log_softmax(torch.randn(5, generator=gen, dtype=F64), -1)

    def expected_grad(term) -> torch.Tensor:
        probs = torch.softmax(theta, -1).detach()
        g = torch.zeros(5, dtype=F64)
        for y in range(5):
            logp = torch.log_softmax(theta, -1)
            (gy,) = torch.autograd.grad(term(logp[y : y + 1], ref_logp[y : y + 1]), theta)
            g += probs[y] * gy
        return g

    def through_policy_loss(lp, rlp):  # one token, kl_coef 1, advantage 0: the loss is the term
        return run(
            "ppo", logp=lp, blp=lp.detach(), adv=t(0.0), ref_logp=rlp, kl_coef=1.0, kl_estimator=est
        )[0]

    def grad_of_kl(kl) -> torch.Tensor:
        (g,) = torch.autograd.grad(kl(torch.log_softmax(theta, -1)), theta)
        return g

    reverse = grad_of_kl(lambda lp: (lp.exp() * (lp - ref_logp)).sum())  # ∇KL(π ‖ π_ref)
    forward = grad_of_kl(lambda lp: (ref_logp.exp() * (ref_logp - lp)).sum())  # ∇KL(π_ref ‖ π)
    assert float((reverse - forward).abs().max()) > 1e-2  # the two gradients differ here
    assert float((expected_grad(through_policy_loss) - reverse).abs().max()) <= 1e-6
    # what the plain estimators would have given
    raw_k1 = expected_grad(lambda lp, rlp: (lp - rlp).sum())
    raw_k3 = expected_grad(lambda lp, rlp: (torch.exp(rlp - lp) - 1 - (rlp - lp)).sum())
    assert float(raw_k1.abs().max()) <= 1e-12
    assert float((raw_k3 - forward).abs().max()) <= 1e-12


@pytest.mark.parametrize("loss", RL_LOSSES)
def test_the_kl_term_is_importance_weighted_on_a_stale_samplers_tokens(loss):
    """Issue #53 item 4.3, the worked example (docs/off-policy.md, "The KL penalty"): π = [.5, .5],
    π_ref = [.8, .2], tokens from a stale μ = [.2, .8]. The reverse KL's gradient in the logits is
    E_π[δ·∇log π] = [−0.347, +0.347] (δ = log π − log π_ref). Unweighted, the expected gradient over
    μ's tokens was E_μ[δ·∇log π] = [−0.413, +0.413] (the old code); weighted by sg[min(π/μ, C)]
    (C = 5 does not bind here: π/μ ≤ 2.5) it is the reverse KL's, whatever the loss."""
    pi, ref, mu = t(0.5, 0.5), t(0.8, 0.2), t(0.2, 0.8)
    z = torch.log(pi).requires_grad_(True)  # logits whose softmax is π

    def expected(weighted: bool) -> torch.Tensor:
        g = torch.zeros(2, dtype=F64)
        for y in range(2):  # Σ_y μ(y)·∇(term on token y): exact, no sampling
            lp = torch.log_softmax(z, -1)[y : y + 1]
            if weighted:
                term = run(loss, logp=lp, blp=torch.log(mu[y : y + 1]), adv=t(0.0),
                           prox_logp=lp.detach(), ref_logp=torch.log(ref[y : y + 1]),
                           kl_coef=1.0, kl_estimator="k2", is_cap=5.0)[0]  # fmt: skip
            else:
                term = 0.5 * (lp - torch.log(ref[y : y + 1])).square().sum()
            (gy,) = torch.autograd.grad(term, z)
            g += mu[y] * gy
        return g

    reverse = torch.zeros(2, dtype=F64)
    for y in range(2):  # E_π[δ·∇log π], ∇_z log π(y) = e_y − π
        reverse += pi[y] * torch.log(pi[y] / ref[y]) * (torch.eye(2, dtype=F64)[y] - pi)
    np.testing.assert_allclose(reverse.numpy(), [-0.347, 0.347], atol=1e-3)
    np.testing.assert_allclose(expected(False).numpy(), [-0.413, 0.413], atol=1e-3)
    np.testing.assert_allclose(expected(True).numpy(), reverse.numpy(), atol=1e-12)


def test_the_kl_terms_weight_is_capped_and_leaves_sft_alone():
    """π/μ = e² ≈ 7.4 is capped at C = 2; SFT's tokens are the data's (no μ): weight 1."""
    lp, blp, ref = t(-1.0), t(-3.0), t(-2.0)

    def grad(loss, **kw):
        return grad_of(lambda x: run(loss, logp=x, ref_logp=ref, kl_coef=1.0, kl_estimator="k2",
                                     is_cap=2.0, **kw)[0], lp)  # fmt: skip

    assert float(grad("tis", blp=blp, adv=t(0.0))) == pytest.approx(2.0 * 1.0)  # C·δ
    assert float(grad("sft")) == pytest.approx(-1.0 + 1.0)  # −1 from −log π, +δ from the KL


def test_dual_clip_bounds_negative_advantage_tokens():
    # r = π/μ = [10, 10, 0.5], A = [−1, +1, −1]; clip [0.8, 1.28], c = 3
    blp = t(-3.0, -3.0, -1.0)
    logp = blp + torch.log(t(10.0, 10.0, 0.5))
    adv = t(-1.0, 1.0, -1.0)
    plain, _ = run("ppo", logp=logp, blp=blp, adv=adv)
    dual, stats = run("ppo", logp=logp, blp=blp, adv=adv, dual_clip=True, clip_c=3.0)
    # token 0: −min(−10, −1.28) = 10 → capped at c·|A| = 3; token 1: clipped at 1.28; token 2: 0.8
    assert float(plain) == pytest.approx((10.0 - 1.28 + 0.8) / 3)
    assert float(dual) == pytest.approx((3.0 - 1.28 + 0.8) / 3)
    assert finalize_stats(stats)["loss/clip_frac"] == pytest.approx(1.0)
    g = grad_of(lambda x: run("ppo", logp=x, blp=blp, adv=adv, dual_clip=True)[0], logp)
    assert float(g[0]) == 0.0  # the capped token gives no gradient
    # decoupled PPO: the same bound on its trust-region ratio π/π_prox, times its IS weight
    dec, _ = run("decoupled_ppo", logp=logp, blp=blp, prox_logp=blp, adv=adv, dual_clip=True)
    assert float(dec) == pytest.approx(float(dual))


def test_entropy_bonus():
    h = t(0.5, 1.0, 1.5, 2.0).requires_grad_(True)
    base, _ = run("ppo", logp=LOGP, blp=BLP, adv=A)
    loss, stats = run("ppo", logp=LOGP, blp=BLP, adv=A, entropy=h, entropy_coef=0.1)
    assert float(loss.detach()) == pytest.approx(float(base) - 0.1 * 1.25)
    assert finalize_stats(stats)["loss/entropy"] == pytest.approx(1.25)
    (gh,) = torch.autograd.grad(loss, h)
    torch.testing.assert_close(gh, torch.full((4,), -0.1 / 4, dtype=F64))
    with pytest.raises(ValueError, match="entropy"):
        run("ppo", logp=LOGP, blp=BLP, adv=A, entropy_coef=0.1)


def test_missing_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="prox_logp"):
        run("decoupled_ppo", logp=LOGP, blp=BLP, adv=A)
    with pytest.raises(ValueError, match="behavior_logp"):
        run("ppo", logp=LOGP, adv=A)
    with pytest.raises(ValueError, match="shape"):
        run("ppo", logp=LOGP, blp=BLP[:3], adv=A)


# ---- effective sample size -----------------------------------------------------------------------


def _ess(weights, mask=None):
    w = torch.as_tensor(weights, dtype=F64)
    blp = torch.zeros_like(w)
    _, stats = run("tis", logp=torch.log(w), blp=blp, adv=torch.ones_like(w), mask=mask)
    return finalize_stats(stats)["loss/ess"]


def test_ess_edge_cases():
    assert _ess([2.0, 2.0, 2.0]) == pytest.approx(1.0)  # uniform weights, whatever their scale
    assert _ess([1.0, 1e-30, 1e-30, 1e-30]) == pytest.approx(0.25)  # one sample dominates: 1/N
    assert _ess([3.0, 1.0]) == pytest.approx(16 / (2 * 10))
    assert _ess([1.0, 1e6], mask=torch.tensor([True, False])) == pytest.approx(
        1.0
    )  # masked ignored
    empty = finalize_stats(
        run("tis", logp=LOGP, blp=BLP, adv=A, mask=torch.zeros(4, dtype=torch.bool))[1]
    )
    assert empty["loss/ess"] == 1.0 and empty["loss/tokens"] == 0.0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=20))
def test_ess_bounds(ws):
    assert 1 / len(ws) - 1e-9 <= _ess(ws) <= 1 + 1e-9


def test_float32_inputs_and_integer_mask():
    """The learner's dtypes: float32 logprobs and a 0/1 integer loss_mask straight off the wire."""
    mask = torch.tensor([1, 0, 1, 1], dtype=torch.int32)
    want, _ = run("decoupled_ppo", logp=LOGP, blp=BLP, adv=A, prox_logp=BLP, mask=mask.bool())
    got, stats = run(
        "decoupled_ppo",
        logp=LOGP.float(),
        blp=BLP.float(),
        adv=A.float(),
        prox_logp=BLP.float(),
        mask=mask,
    )
    assert got.dtype == torch.float32 and float(got) == pytest.approx(float(want), rel=1e-6)
    assert all(v.dtype == F64 for v in stats.values()) and float(stats["tokens"]) == 3


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("aggregation", AGGS)
def test_empty_micro_batch_and_fixed_stat_keys(loss, aggregation):
    """A rank may get no tokens: the loss is 0 and the stats have the same keys as everyone's, so
    the all-reduce of the summed stats lines up (start the sum from zero_stats())."""
    e = torch.zeros(0, dtype=F64)
    x = e.clone().requires_grad_(True)
    norm = Normaliser(tokens=10, seqs=2, seq_len=4)
    out, stats = run(
        loss,
        logp=x,
        blp=e,
        adv=e,
        prox_logp=e,
        mask=torch.zeros(0, dtype=torch.bool),
        seq_ids=torch.zeros(0, dtype=torch.long),
        norm=norm,
        aggregation=aggregation,
    )
    out.backward()
    keys = stat_keys(loss)
    assert float(out.detach()) == 0.0 and tuple(stats) == keys
    assert {k: float(v) for k, v in stats.items()} == {k: 0.0 for k in keys}
    _, full = run(loss, logp=LOGP, blp=BLP, adv=A, prox_logp=BLP, entropy=torch.ones(4, dtype=F64))
    assert tuple(full) == keys
    summed = {k: zero_stats(loss)[k] + stats[k] + full[k] for k in keys}
    assert finalize_stats(summed) == finalize_stats(full)
    assert finalize_stats(full)["loss/entropy"] == 1.0 and "loss/kl_ref" not in finalize_stats(full)


@pytest.mark.parametrize("aggregation", AGGS)
def test_decoupled_ppo_with_prox_equal_to_pi_is_tis(aggregation):
    """One update per batch: π_prox is π itself (detached), r ≡ 1, so the clip cannot act and
    decoupled PPO's gradient is tis's, sg[min(π/μ, C)]·A·∇log π (the IS cap included)."""
    b = _random_batch(torch.Generator().manual_seed(7), n_seqs=4, max_len=6)
    b["blp"] = b["logp"] - torch.log(t(*([3.0, 0.5] * 20))[: len(b["logp"])])  # some π/μ > C
    kw = dict(aggregation=aggregation, is_cap=2.0, clip_low=0.2, clip_high=0.2)

    def dec(x):
        return run("decoupled_ppo", **{**b, "logp": x, "prox_logp": x.detach()}, **kw)[0]

    def tis(x):
        return run("tis", **{**b, "logp": x}, **kw)[0]

    g_dec, g_tis = grad_of(dec, b["logp"]), grad_of(tis, b["logp"])
    assert float(g_tis.abs().max()) > 0
    assert float((g_dec - g_tis).abs().max()) <= 1e-7 * float(g_tis.abs().max())
    _, stats = run("decoupled_ppo", **{**b, "prox_logp": b["logp"]}, **kw)
    assert finalize_stats(stats)["loss/clip_frac"] == 0.0


# ---- V-trace: one importance weight per token, along the learner's own path ---------------------


def _vtrace_through_the_learner(loss, samples, *, whiten):
    """The learner's path from the critic's values to the loss's gradient: one-token samples
    (π/μ, reward, V) → ``token_targets`` (or ``assign_targets``, which the trainer calls: it
    whitens over the batch) → ``pack`` → ``policy_loss`` with the micro-batch's tensors as
    ``passes.actor_micro_batch`` passes them, π = π_prox (the batch's one update), the recipe's config
    (validated: the recipe accepts the loss with ``advantage: vtrace``). Returns ∂L/∂log π and c_t."""
    r = recipe.from_dict({"algorithm": {"loss": loss, "advantage": "vtrace", "clip_low": 0.6}})
    alg = r.algorithm
    seqs = []
    for i, (ratio, reward, value) in enumerate(samples):
        s = make_sequence(
            i, np.array([1, 2]), np.array([3]), behavior_logprobs=np.array([-1.0]), reward=reward
        )
        s.values = np.array([0.0, value], np.float32)  # completion token 0 sits at row position 1
        s.prox_logp = np.array([0.0, -1.0 + math.log(ratio)], np.float32)
        seqs.append(s)
    if whiten:
        assign_targets(seqs, alg, reduce=False)
    else:
        token_targets(seqs, alg)
    mb = pack(seqs)
    logp = mb.prox_logp.clone().requires_grad_(True)
    tokens, n_seqs = count_tokens_and_seqs(mb.mask, mb.seq_ids).tolist()
    norm = Normaliser(tokens=tokens, seqs=n_seqs, seq_len=float(r.rollout.max_new_tokens))
    out, _ = policy_loss(
        cfg=alg,
        norm=norm,
        logp=logp,
        mask=mb.mask,
        seq_ids=mb.seq_ids,
        behavior_logp=mb.behavior_logp,
        advantages=mb.advantages,
        prox_logp=mb.prox_logp if needs_prox(loss) else None,
    )
    (g,) = torch.autograd.grad(out, logp)
    c = token_weights(mb.mask, mb.seq_ids, aggregation=alg.aggregation_used, norm=norm)
    return g.double(), c


@pytest.mark.parametrize("loss", RL_LOSSES)
def test_vtrace_weights_a_stale_token_by_its_ratio_once(loss):
    """IMPALA's policy gradient is ρ_t·∇log π_t·(r_t + γ·v_{t+1} − V(x_t)) with ONE ρ. A stale
    token with π/μ = 0.5, r = 1, V = 0: ∂L/∂log π = −0.5·c (the loss's own weight is the ρ; the
    advantage is 1), not −0.25 (ρ in the advantage and again in the loss)."""
    g, c = _vtrace_through_the_learner(loss, [(0.5, 1.0, 0.0)], whiten=False)
    torch.testing.assert_close(g, -0.5 * c, rtol=1e-6, atol=0)


@pytest.mark.parametrize("loss", RL_LOSSES)
def test_vtrace_advantages_whitened_as_the_trainer_does_carry_no_ratio(loss):
    """The trainer whitens the critic's advantages over the batch: TD errors [1, 0, −1] (the stale
    token's without its ρ = 0.5) → Â = δ/std(δ); each token's gradient is −(π/μ)·Â·c."""
    g, c = _vtrace_through_the_learner(
        loss, [(0.5, 1.0, 0.0), (1.0, 0.0, 0.0), (1.0, -1.0, 0.0)], whiten=True
    )
    a_hat = t(1.0, 0.0, -1.0) / math.sqrt(2 / 3)
    torch.testing.assert_close(g, -t(0.5, 1.0, 1.0) * a_hat * c, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# The critic's value loss, the reward model's Bradley–Terry loss, explained variance
# --------------------------------------------------------------------------------------------------

# V = [1, 0, 2], V_old = [0.5, 0, 1], R = [2, 1, 0], ε_v = 0.2:
#   t0: (V−R)² = 1;  V_clip = 0.5 + 0.2 = 0.7, (0.7−2)² = 1.69 → max 1.69, clipped;  ½ → 0.845
#   t1: (V−R)² = 1;  V_clip = 0,               (0−1)²   = 1    → 1, not clipped;     ½ → 0.5
#   t2: (V−R)² = 4;  V_clip = 1.2,             (1.2−0)² = 1.44 → 4, not clipped;     ½ → 2
V, V_OLD, RET = t(1.0, 0.0, 2.0), t(0.5, 0.0, 1.0), t(2.0, 1.0, 0.0)


def run_value(values, *, mask=None, seq_ids=None, clip=0.2, aggregation="token_mean", **kw):
    n = values.shape[0]
    mask = torch.ones(n, dtype=torch.bool) if mask is None else mask
    seq_ids = torch.zeros(n, dtype=torch.long) if seq_ids is None else seq_ids
    tok, seqs = count_tokens_and_seqs(mask, seq_ids).tolist()
    old, ret = kw.get("old", V_OLD), kw.get("ret", RET)
    return value_loss(
        values,
        old,
        ret,
        mask=mask,
        seq_ids=seq_ids,
        clip=clip,
        aggregation=aggregation,
        norm=Normaliser(tokens=tok, seqs=seqs),
    )


def test_value_loss_golden_and_clip_fraction():
    loss, stats = run_value(V)
    assert float(loss) == pytest.approx((0.845 + 0.5 + 2.0) / 3)
    assert finalize_stats(stats) == {"loss/value_clip_frac": pytest.approx(1 / 3)}
    # seq_mean_token_mean over sequences [t0, t1], [t2]: ((0.845 + 0.5) / 2 + 2) / 2
    loss, _ = run_value(V, seq_ids=torch.tensor([0, 0, 1]), aggregation="seq_mean_token_mean")
    assert float(loss) == pytest.approx(((0.845 + 0.5) / 2 + 2.0) / 2)
    loss, stats = run_value(V, clip=0.0)  # off: ½·mean (V − R)² = ½·(1 + 1 + 4) / 3
    assert float(loss) == pytest.approx(1.0)
    assert finalize_stats(stats)["loss/value_clip_frac"] == 0.0


def test_value_loss_gradient_is_zero_where_the_clip_acts():
    # t0 clipped (V − V_old = 0.5 > ε_v, the clipped term wins): no gradient. Elsewhere
    # d/dV ½(V − R)² / 3 = (V − R) / 3 = [−1/3, 2/3].
    g = grad_of(lambda v: run_value(v)[0], V)
    torch.testing.assert_close(g, t(0.0, -1 / 3, 2 / 3))


def test_value_loss_ignores_masked_garbage():
    nan = float("nan")
    mask = torch.tensor([True, True, False, True])
    v = t(1.0, 0.0, nan, 2.0)
    loss, stats = run_value(v, mask=mask, old=t(0.5, 0.0, nan, 1.0), ret=t(2.0, 1.0, nan, 0.0))
    assert float(loss) == pytest.approx((0.845 + 0.5 + 2.0) / 3)
    assert float(stats["value_tokens"]) == 3
    g = grad_of(lambda x: run_value(x, mask=mask, old=t(0.5, 0, nan, 1), ret=t(2, 1, nan, 0))[0], v)
    torch.testing.assert_close(g, t(0.0, -1 / 3, 0.0, 2 / 3))


def test_value_loss_micro_batches_add_up():
    g = torch.Generator().manual_seed(0)
    v, old, ret = (torch.randn(10, generator=g, dtype=F64) for _ in range(3))
    seq_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    mask = torch.ones(10, dtype=torch.bool)
    tok, seqs = count_tokens_and_seqs(mask, seq_ids).tolist()
    norm = Normaliser(tokens=tok, seqs=seqs)
    for agg in AGGS[:2]:
        kw = {"clip": 0.3, "aggregation": agg, "norm": norm}
        whole, _ = value_loss(v, old, ret, mask=mask, seq_ids=seq_ids, **kw)
        a, sa = value_loss(v[:5], old[:5], ret[:5], mask=mask[:5], seq_ids=seq_ids[:5], **kw)
        b, sb = value_loss(v[5:], old[5:], ret[5:], mask=mask[5:], seq_ids=seq_ids[5:], **kw)
        torch.testing.assert_close(a + b, whole)
        assert float(sa["value_tokens"] + sb["value_tokens"]) == 10


def test_bradley_terry_golden():
    # s_c − s_r = [2, −1, 0]: L = (log(1 + e⁻²) + log(1 + e) + log 2) / 3; only the first pair
    # is ranked right (a tie is not); the mean margin is 1/3.
    loss, stats = bradley_terry(t(2.0, 0.0, 1.0), t(0.0, 1.0, 1.0))
    want = (math.log(1 + math.exp(-2)) + math.log(1 + math.e) + math.log(2)) / 3
    assert float(loss) == pytest.approx(want)
    out = finalize_stats(stats)
    assert out == {"loss/rm_accuracy": pytest.approx(1 / 3), "loss/rm_margin": pytest.approx(1 / 3)}
    half, _ = bradley_terry(t(2.0), t(0.0), pairs=2)  # a global count: this micro-batch's share
    assert float(half) == pytest.approx(math.log(1 + math.exp(-2)) / 2)


def test_bradley_terry_gradient():
    # dL/ds_c = −σ(s_r − s_c) / N = −dL/ds_r; checked analytically and by finite differences.
    c, r = t(2.0, 0.0, 1.0).requires_grad_(True), t(0.0, 1.0, 1.0).requires_grad_(True)
    bradley_terry(c, r)[0].backward()
    want = -torch.sigmoid(-t(2.0, -1.0, 0.0)) / 3
    torch.testing.assert_close(c.grad, want)
    torch.testing.assert_close(r.grad, -want)
    assert torch.autograd.gradcheck(
        lambda a, b: bradley_terry(a, b)[0],
        (c.detach().requires_grad_(True), r.detach().requires_grad_(True)),
    )


def test_bradley_terry_is_stable_for_large_margins_and_checks_shapes():
    loss, _ = bradley_terry(t(1000.0, -1000.0), t(0.0, 0.0))
    assert float(loss) == pytest.approx(500.0)  # (0 + 1000) / 2, no overflow
    with pytest.raises(ValueError, match="expected \\[pairs\\]"):
        bradley_terry(t(1.0, 2.0), t(1.0))


def test_explained_variance():
    r = t(1.0, 2.0, 3.0, 4.0)
    m = torch.ones(4, dtype=torch.bool)
    assert explained_variance(r, r, m) == 1.0
    assert explained_variance(torch.full((4,), 2.5, dtype=F64), r, m) == 0.0
    # R − V = [−1, 1, −1, 1]: Var 1; Var R = 1.25 → 1 − 1/1.25 = 0.2
    assert explained_variance(t(2.0, 1.0, 4.0, 3.0), r, m) == pytest.approx(0.2)
    nan = float("nan")
    mask = torch.tensor([True, False, True, True, True])
    assert explained_variance(t(2.0, nan, 1.0, 4.0, 3.0), t(1.0, nan, 2.0, 3.0, 4.0), mask) == (
        pytest.approx(0.2)
    )
    assert explained_variance(t(0.0, 1.0), t(3.0, 3.0), torch.ones(2)) == 0.0  # nothing to explain


def test_explained_variance_from_sums_added_over_ranks_equals_the_whole():
    """The learner adds variance_sums over its ranks (an all-reduce) before the ratio."""
    g = torch.Generator().manual_seed(0)
    v, r = torch.randn(50, generator=g, dtype=F64), torch.randn(50, generator=g, dtype=F64)
    r = r + 2 * v  # values that explain part of the returns
    m = torch.ones(50, dtype=torch.bool)
    parts = variance_sums(v[:17], r[:17], m[:17]) + variance_sums(v[17:], r[17:], m[17:])
    whole = explained_variance(v, r, m)
    assert 0.5 < whole < 1
    assert explained_variance_from_sums(parts) == pytest.approx(whole, rel=1e-12)
    assert explained_variance_from_sums(torch.zeros(5, dtype=F64)) == 0.0  # a batch of no tokens


def test_finalize_sums_critic_stats_with_the_policy_stats():
    _, vs = run_value(V)
    _, bs = bradley_terry(t(2.0), t(0.0))
    out = finalize_stats(zero_stats() | vs | bs)
    assert out["loss/tokens"] == 0 and out["loss/value_clip_frac"] == pytest.approx(1 / 3)
    assert out["loss/rm_accuracy"] == 1.0

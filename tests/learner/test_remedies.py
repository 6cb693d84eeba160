"""The off-policy remedies of issue #53, each with a known answer: M2PO's batch-global
second-moment mask (by hand, and over a real 2-rank gloo group equal to one rank's), A-3PO's
staleness anchor for decoupled_ppo, the ESS-scaled learning rate through a real optimizer step,
and their recipe checks. (The adaptive pipeline depth is tests/buffer/test_store.py's.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl import recipe as recipe_mod
from asyncrl.learner.losses.aggregation import Normaliser
from asyncrl.learner.losses.policy import m2po_threshold, policy_loss, staleness_anchor
from asyncrl.learner.losses.stats import finalize_stats
from asyncrl.learner.passes import ess_lr_factor
from asyncrl.recipe import AlgorithmConfig, RecipeError
from tests.learner.test_model import make_trainer
from tests.learner.test_step import params, rl_batch

F64 = torch.float64


def t(*xs):
    return torch.tensor(xs, dtype=F64)


def loss_of(cfg: AlgorithmConfig, logp, blp, adv, **kw):
    n = len(logp)
    mask = torch.ones(n, dtype=torch.bool)
    return policy_loss(
        cfg=cfg,
        norm=Normaliser(tokens=n, seqs=1, seq_len=8),
        logp=logp,
        mask=mask,
        seq_ids=torch.zeros(n, dtype=torch.long),
        behavior_logp=blp,
        advantages=adv,
        **kw,
    )


# ---- M2PO ----------------------------------------------------------------------------------------


def test_m2po_cut_drops_the_largest_until_the_kept_mean_is_at_most_tau():
    # sorted: .5, .3, .02, .01, 0 (mean .166); without .5: .33/4 = .0825 > .04; without .3 too:
    # .03/3 = .01 ≤ .04. So the cut is .3: both go, and the kept mean is .01.
    x = t(0.0, 0.01, 0.5, 0.02, 0.3)
    cut = m2po_threshold(x, 0.04)
    assert cut == pytest.approx(0.3)
    kept = x[x < cut]
    assert kept.tolist() == [0.0, 0.01, 0.02] and float(kept.mean()) <= 0.04
    assert m2po_threshold(t(0.01, 0.03), 0.04) == float("inf")  # mean .02: nothing to drop
    assert m2po_threshold(t(1.0, 2.0), 0.04) == 1.0  # every token over τ: all go
    assert m2po_threshold(torch.zeros(0, dtype=F64), 0.04) == float("inf")


def test_m2po_loss_is_unclipped_weighted_pg_with_masked_tokens_in_the_denominator():
    # μ and π differ by log ratios d = [0, .1, 1.0, -.2]: d² = [0, .01, 1, .04], mean .2625 > .04;
    # dropping the 1.0 leaves mean .0167: the third token is masked.
    blp = t(-1.0, -2.0, -0.5, -1.5)
    d = t(0.0, 0.1, 1.0, -0.2)
    logp, adv = blp + d, t(1.0, -1.0, 2.0, 3.0)
    cut = m2po_threshold(d * d, 0.04)
    cfg = AlgorithmConfig(loss="m2po")
    x = logp.clone().requires_grad_(True)
    loss, stats = loss_of(cfg, x, blp, adv, prox_logp=logp, m2po_cut=cut)
    (g,) = torch.autograd.grad(loss, x)
    rho = torch.exp(d)
    want = -rho * adv / 4  # 1/Σ|o| over every token, masked ones included; no clip (ρ = e^1 kept)
    want[2] = 0.0
    torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-12)
    assert float(loss.detach()) == pytest.approx(float((want * logp).sum()))
    m = finalize_stats(stats)
    assert m["loss/m2po_masked_frac"] == 0.25 and m["loss/clip_frac"] == 0.0


def _m2po_rank(rank: int, parts: list[np.ndarray], out: str) -> None:
    # a FileStore, not a port chosen free and bound later (another process could take it between)
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/store", rank=rank, world_size=len(parts)
    )
    try:
        cut = m2po_threshold(torch.from_numpy(parts[rank]), 0.04, dist.group.WORLD)
        local = m2po_threshold(torch.from_numpy(parts[rank]), 0.04)
        np.save(f"{out}/rank{rank}.npy", np.array([cut, local]))
    finally:
        dist.destroy_process_group()


def test_m2po_mask_over_two_gloo_ranks_is_the_one_rank_mask(tmp_path):
    """The batch's tokens split unevenly over two real gloo ranks: each rank's cut is the one
    rank's over the whole batch, so the masks are equal; a per-rank cut would not be."""
    rng = np.random.default_rng(0)
    d = rng.normal(0, 0.15, 40)
    d[[3, 11]] = [0.9, -0.7]  # two drifted tokens, both on rank 0's share
    d2 = (d * d).astype(np.float64)
    parts = [d2[:13], d2[13:]]
    mp.spawn(_m2po_rank, args=(parts, str(tmp_path)), nprocs=2, join=True)
    (c0, local0), (c1, local1) = (np.load(tmp_path / f"rank{r}.npy") for r in (0, 1))
    one = m2po_threshold(torch.from_numpy(d2), 0.04)
    assert c0 == c1 == one
    mask_two = np.concatenate([parts[0] >= c0, parts[1] >= c1])
    np.testing.assert_array_equal(mask_two, d2 >= one)
    assert mask_two.sum() >= 1 and d2[~mask_two].mean() <= 0.04
    per_rank = np.concatenate([parts[0] >= local0, parts[1] >= local1])
    assert (per_rank != mask_two).any()  # the global cut is not what each rank would cut alone


def test_m2po_step_masks_what_the_batch_cut_says(tiny_qwen3, tmp_path):
    """Through the learner (the recipe's dataflow recomputes π_prox for m2po): the logged masked
    fraction is the cut of the whole batch's (log π_prox − log μ)², computed here by hand."""
    tr = make_trainer(
        tiny_qwen3,
        tmp_path,
        algorithm={"loss": "m2po"},
        learner={"lr": 1e-3},
        buffer={"max_staleness": 4},
    )
    vocab = tr.models.spec.model.vocab_size
    rng = np.random.default_rng(3)

    def far(prompt, c):  # μ off by N(0, .3) nats, a few tokens by 1.5
        x = np.log(1.0 / vocab) + rng.normal(0, 0.3, len(c))
        x[rng.random(len(c)) < 0.1] += 1.5
        return x.astype(np.float32)

    batch = rl_batch(vocab, logp=far)
    seqs = tr.sequences(batch)
    mbs = tr.micro_batches(seqs)
    lp = torch.cat(tr.logprobs(mbs)).float()
    blp = torch.cat([mb.behavior_logp for mb in mbs]).float()
    d = lp - blp
    cut = m2po_threshold(d * d, 0.04)
    want = float(((d * d).double() >= cut).float().mean())
    res = tr.step(batch)
    assert 0 < want < 0.5
    assert res.metrics["loss/m2po_masked_frac"] == pytest.approx(want, abs=1.5 / len(lp))


# ---- A-3PO's staleness anchor -----------------------------------------------------------------


def test_staleness_anchor_by_hand():
    blp, logp = t(-1.0, -1.0, -1.0), t(-0.4, -0.4, -0.4)
    a = staleness_anchor(logp, blp, torch.tensor([0, 1, 3]))
    # s/(s+1) of the way from log μ to log π: 0, 1/2, 3/4 of 0.6
    torch.testing.assert_close(a, t(-1.0, -0.7, -0.55), rtol=0, atol=1e-12)


def test_staleness_anchor_makes_decoupled_ppos_clip_act_at_one_update():
    # one update: π_prox recomputed is π, r ≡ 1, no clip. With the anchor, token 0 (s = 1,
    # π/μ = 2) has r = √2 > 1.28 with A > 0: clipped, no gradient; token 1 (s = 3, π/μ = 2) has
    # r = 2^(1/4) = 1.19: inside; its weight is π̂_prox/μ = 2^(3/4).
    blp = t(-2.0, -2.0)
    logp = blp + np.log(2.0)
    adv, s = t(1.0, 1.0), torch.tensor([1, 3])
    base = AlgorithmConfig(loss="decoupled_ppo")
    x = logp.clone().requires_grad_(True)
    loss, st = loss_of(base, x, blp, adv, prox_logp=logp.clone())
    assert finalize_stats(st)["loss/clip_frac"] == 0.0
    anchored = dataclasses.replace(base, prox_anchor="staleness")
    loss, st = loss_of(anchored, x, blp, adv, prox_logp=logp.clone(), staleness=s)
    (g,) = torch.autograd.grad(loss, x)
    assert finalize_stats(st)["loss/clip_frac"] == 0.5
    w1, r1 = 2 ** (3 / 4), 2 ** (1 / 4)
    torch.testing.assert_close(g, t(0.0, -w1 * r1 / 2), rtol=1e-12, atol=1e-12)


def test_staleness_anchor_is_ignored_with_a_warning_by_other_losses():
    """The demo recipes set the anchor; taking one to another loss (its SFT stage, tis) runs, and
    the warning names the key it ignores."""
    for loss in ("tis", "sft"):
        r = recipe_mod.from_dict({"algorithm": {"loss": loss, "prox_anchor": "staleness"}})
        assert any(w.startswith("algorithm.prox_anchor") for w in recipe_mod.warnings(r)), loss
    r = recipe_mod.from_dict({"algorithm": {"loss": "decoupled_ppo", "prox_anchor": "staleness"}})
    assert not any("prox_anchor" in w for w in recipe_mod.warnings(r))


def test_m2po_needs_a_positive_tau():
    with pytest.raises(RecipeError, match="algorithm.m2po_tau"):
        recipe_mod.from_dict({"algorithm": {"loss": "m2po", "m2po_tau": 0}})


# ---- the ESS-scaled learning rate -------------------------------------------------------------


def noisy(vocab: int, rng: np.random.Generator, sd: float):
    """Behaviour logprobs N(0, sd) nats off the uniform."""
    return lambda p, c: (np.log(1 / vocab) + rng.normal(0, sd, len(c))).astype(np.float32)


def test_ess_lr_factor_by_hand():
    # w = [1, 1, 1, 3]: (Σw)² / (N Σw²) = 36 / 48 = .75
    args = (4.0, 6.0, 12.0)
    assert ess_lr_factor(*args, "linear", 0.0) == pytest.approx(0.75)
    assert ess_lr_factor(*args, "sqrt", 0.0) == pytest.approx(0.75**0.5)
    assert ess_lr_factor(*args, "linear", 0.9) == 0.9
    assert ess_lr_factor(0.0, 0.0, 0.0, "sqrt", 0.0) == 1.0


def test_ess_scaled_lr_scales_adams_first_step_and_leaves_the_schedule(tiny_qwen3, tmp_path):
    """Adam's first step moves each weight by lr·g/|g|: the ESS-scaled run's largest move is the
    plain run's times the factor, the factor is the logged ESS (linear), and the schedule's lr
    (warmup here) is the optimizer's again after the step."""
    sections = {"learner": {"lr": 1e-3, "warmup_steps": 3}, "buffer": {"max_staleness": 4}}
    moves, logged, lrs = [], [], []
    for scale in ("off", "linear"):
        tr = make_trainer(
            tiny_qwen3,
            tmp_path / scale,
            **sections | {"learner": sections["learner"] | {"lr_ess_scale": scale}},
        )
        vocab = tr.models.spec.model.vocab_size
        batch = rl_batch(vocab, logp=noisy(vocab, np.random.default_rng(1), 0.6))
        before = params(tr)
        res = tr.step(batch)
        after = params(tr)
        moves.append(max(float((after[k] - before[k]).abs().max()) for k in after))
        logged.append(res.metrics)
        lrs.append([g["lr"] for opt in tr.models.optimizers for g in opt.param_groups])
    off, lin = logged
    factor = lin["learner/lr_ess_factor"]
    assert factor == pytest.approx(lin["loss/ess"], rel=1e-9) and 0.2 < factor < 0.95
    assert "learner/lr_ess_factor" not in off
    assert lin["lr"] == off["lr"] and lin["learner/lr_effective"] == pytest.approx(
        off["lr"] * factor
    )
    assert moves[1] / moves[0] == pytest.approx(factor, rel=1e-3)
    assert lrs[0] == lrs[1]  # the schedule goes on from its own lr


def test_lr_ess_floor_needs_the_scale():
    with pytest.raises(RecipeError, match="learner.lr_ess_floor"):
        recipe_mod.from_dict({"learner": {"lr_ess_floor": 0.3}})

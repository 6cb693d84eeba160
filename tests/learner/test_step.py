"""One learner step on one rank: every loss trains; the result does not depend on the micro-batch split;
decoupled PPO on on-policy data (π_prox = μ) is exactly PPO (prox recompute through the real model)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from asyncrl import metric_names as names
from asyncrl import wire
from asyncrl.buffer.store import Batch
from asyncrl.learner.calls import distill_advantages, group_advantages
from asyncrl.learner.losses.policy import LOSSES
from tests.learner.test_model import make_trainer
from tests.numerics import (
    F32_EPS,
    LOGPROB_ATOL,
    assert_adam_steps_agree,
    assert_close_rel,
    assert_grads_close,
    weights_and_grads,
)

pytestmark = pytest.mark.numerics  # compares float32 results across kernels (tests/numerics.py)


def rl_batch(vocab: int, *, groups: int = 3, n: int = 4, seed: int = 0, logp=None) -> Batch:
    """Random groups; ``logp(prompt, completion)`` gives behaviour logprobs (default: noisy)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(3, vocab, size=int(rng.integers(3, 9))).astype(np.int32)
        samples = []
        for i in range(n):
            c = rng.integers(3, vocab, size=int(rng.integers(2, 12))).astype(np.int32)
            blp = (
                logp(prompt, c)
                if logp is not None
                else (np.log(1.0 / vocab) + rng.normal(0, 0.1, len(c))).astype(np.float32)
            )
            samples.append(
                wire.Sample(
                    id=f"{g}-{i}",
                    group_id=str(g),
                    prompt_ids=prompt,
                    completion_ids=c,
                    behavior_logprobs=np.asarray(blp, np.float32),
                    versions=np.zeros(len(c), np.int32),
                    loss_mask=np.ones(len(c), np.float32),
                    reward=float(rng.integers(0, 2)) + 0.1 * i,
                )
            )
        out.append(wire.Group(id=str(g), samples=samples))
    return Batch(groups=out, version=0, stats={"staleness_mean": 0.0})


def params(tr) -> dict[str, torch.Tensor]:
    return tr.hf_state_dict()


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


RL = {"learner": {"lr": 1e-3, "grad_clip": 1.0}, "buffer": {"max_staleness": 8}}


def test_every_loss_takes_a_finite_step(tiny_qwen3, tmp_path):
    tr = make_trainer(tiny_qwen3, tmp_path, **RL)
    before = params(tr)
    for i, name in enumerate(LOSSES):
        alg = dataclasses.replace(tr.config.algorithm, loss=name, entropy_coef=0.01 * (i % 2))
        tr.models.config = dataclasses.replace(tr.config, algorithm=alg)  # what the step reads
        batch = rl_batch(tr.models.spec.model.vocab_size, seed=i)
        res = tr.step(batch)
        assert res.version == i + 1 and tr.version == i + 1
        assert np.isfinite(res.loss) and res.loss != 0.0, name
        assert res.metrics["grad_norm"] > 0 and res.metrics["loss/tokens"] > 0
        samples = [s for g in batch.groups for s in g.samples]
        if name != "sft":
            assert f"drift/tokens/{min(i, 1)}" in res.metrics and "drift/kl" in res.metrics
            # the reward curve's point for this step: the trained batch's samples
            reward = np.mean([s.reward for s in samples])
            length = np.mean([len(s.completion_ids) for s in samples])
            assert res.metrics[names.BATCH_REWARD_MEAN] == pytest.approx(reward)
            assert res.metrics[names.BATCH_RESPONSE_LENGTH_MEAN] == pytest.approx(length)
        else:  # an SFT row has no reward
            assert names.BATCH_REWARD_MEAN not in res.metrics
    assert max_diff(params(tr), before) > 1e-4


@pytest.mark.parametrize(
    ("loss", "aggregation"), [("ppo", "token_mean"), ("gspo", "seq_mean_token_mean")]
)
def test_micro_batch_split_does_not_change_the_step(tiny_qwen3, tmp_path, loss, aggregation):
    # The claim is about the gradient: compare it (before the optimizer) relative to its scale.
    # The weights after Adam are checked entry by entry against the bound Adam's g/|g| implies.
    alg = {"loss": loss, "aggregation": aggregation, "clip_low": 0.2, "clip_high": 0.2}
    results = []
    for mbt in (4096, 24):
        tr = make_trainer(
            tiny_qwen3,
            tmp_path,
            algorithm=alg,
            learner={**RL["learner"], "micro_batch_tokens": mbt},
        )
        batch = rl_batch(tr.models.spec.model.vocab_size, groups=4)
        res = tr.step(batch)
        results.append((res, *weights_and_grads(tr.models.actor)))
    (one, w_one, g_one), (many, w_many, g_many) = results
    assert one.metrics["learner/micro_batches"] == 1 and many.metrics["learner/micro_batches"] > 3
    # GRPO advantages sum to 0 over each group: the loss sums terms of size ~1 to ~0.03, and rounds
    # at their scale
    assert_close_rel(one.loss, many.loss, scale=1.0)
    assert_close_rel(one.metrics["grad_norm"], many.metrics["grad_norm"])
    assert_grads_close(g_one, g_many)
    assert_adam_steps_agree(w_one, w_many, g_one, lr=one.metrics["lr"])


def test_the_optimizer_step_is_adamw_with_the_recipes_settings(tiny_qwen3, tmp_path):
    """Step 1 of AdamW from the clipped gradient g, in float64: m̂ = g, v̂ = g², so
    p ← p·(1 − lr·wd) − lr·g/(|g| + eps). Float32 arithmetic rounds it by a few ulps of p and lr."""
    learner = {"lr": 1e-3, "grad_clip": 0.5, "weight_decay": 0.1, "eps": 1e-6}
    tr = make_trainer(tiny_qwen3, tmp_path, learner=learner, buffer={"max_staleness": 8})
    before, _ = weights_and_grads(tr.models.actor)
    res = tr.step(rl_batch(tr.models.spec.model.vocab_size))
    after, grads = weights_and_grads(tr.models.actor)
    lr = res.metrics["lr"]
    assert lr == learner["lr"] and res.metrics["grad_norm"] > learner["grad_clip"]
    clipped = sum(float(g.double().pow(2).sum()) for g in grads.values()) ** 0.5
    assert_close_rel(clipped, learner["grad_clip"])  # the stored gradient is the clipped one
    for k, p in before.items():
        p, g = p.double(), grads[k].double()
        want = p * (1 - lr * learner["weight_decay"]) - lr * g / (g.abs() + learner["eps"])
        err = (after[k].double() - want).abs() - 4 * F32_EPS * (p.abs() + lr)
        assert float(err.max()) <= 0, (k, float(err.max()))


def test_decoupled_ppo_on_policy_equals_ppo(tiny_qwen3, tmp_path):
    from asyncrl.learner.packing import make_sequence, pack

    probe = make_trainer(tiny_qwen3, tmp_path)

    def own_logp(prompt, completion):  # the learner's own logprobs: μ = π_θ = π_prox
        seq = make_sequence(0, prompt, completion)
        (lp,) = probe.logprobs([pack([seq])])
        return lp.numpy()

    vocab = probe.models.spec.model.vocab_size
    out = {}
    for loss in ("ppo", "decoupled_ppo"):
        tr = make_trainer(tiny_qwen3, tmp_path, algorithm={"loss": loss}, **RL)
        res = tr.step(rl_batch(vocab, logp=own_logp))
        out[loss] = (res, *weights_and_grads(tr.models.actor))
    (ppo, w_ppo, g_ppo), (dec, w_dec, g_dec) = out["ppo"], out["decoupled_ppo"]
    # μ is the learner's own float32 logprob of the same forward: π_prox/μ = 1 up to rounding
    assert abs(dec.metrics["loss/is_weight_mean"] - 1.0) <= LOGPROB_ATOL
    assert dec.metrics["drift/mismatch_kl"] <= LOGPROB_ATOL**2  # k3 ≈ (Δ log π)²/2
    assert_close_rel(ppo.loss, dec.loss, scale=1.0)  # GRPO advantages: terms of size ~1 cancel
    assert_grads_close(g_ppo, g_dec)
    assert_adam_steps_agree(w_ppo, w_dec, g_ppo, lr=ppo.metrics["lr"])


def test_batch_over_the_staleness_bound_is_refused_before_any_update(tiny_qwen3, tmp_path):
    from asyncrl.learner.trainer import LearnerError

    tr = make_trainer(tiny_qwen3, tmp_path, buffer={"max_staleness": 1}, learner={"lr": 1e-3})
    before = params(tr)
    batch = rl_batch(tr.models.spec.model.vocab_size)
    tr.version = 2  # the batch's tokens (version 0) are now 2 versions old
    with pytest.raises(LearnerError, match="staleness 2..2"):
        tr.step(batch)
    assert max_diff(params(tr), before) == 0
    tr.version = 1  # staleness 1 is within the bound
    res = tr.step(batch)
    assert res.version == 2 and res.metrics["learner/staleness_max"] == 1.0
    assert max_diff(params(tr), before) > 0


def test_a_token_outside_the_vocabulary_is_refused_in_one_line(tiny_qwen3, tmp_path):
    """A generator serving another model than model.path: a token id past the embedding, which
    on CUDA is a device-side assert that ends the learner, is refused by sample before any
    pass, the model untouched."""
    from asyncrl.learner.models import LearnerError

    tr = make_trainer(tiny_qwen3, tmp_path, **RL)
    vocab = tr.models.spec.model.vocab_size
    before = params(tr)
    for where, bad in (("completion_ids", vocab), ("prompt_ids", -1)):
        batch = rl_batch(vocab)
        s = batch.groups[2].samples[1]
        setattr(s, where, np.append(getattr(s, where), np.int32(bad)))
        s.behavior_logprobs, s.versions, s.loss_mask = (
            np.resize(a, len(s.completion_ids))
            for a in (s.behavior_logprobs, s.versions, s.loss_mask)
        )
        with pytest.raises(
            LearnerError, match=rf"sample '2-1': token id {bad} outside .*\[0, {vocab}\)"
        ):
            tr.step(batch)
    assert max_diff(params(tr), before) == 0 and tr.version == 0


def test_kl_to_the_reference_model(tiny_qwen3, tmp_path):
    tr = make_trainer(
        tiny_qwen3, tmp_path, algorithm={"loss": "ppo", "kl_coef": 0.5, "kl_estimator": "k3"}, **RL
    )
    assert tr.models.ref is not None
    batch = rl_batch(tr.models.spec.model.vocab_size)
    first = tr.step(batch)  # π = π_ref at the first step: the penalty is exactly 0
    assert first.metrics["loss/kl_ref"] == 0.0
    batch.groups = batch.groups[:2]
    for g in batch.groups:
        for s in g.samples:
            s.versions[:] = 1
    second = tr.step(batch)  # π has moved away from the frozen reference
    assert second.metrics["loss/kl_ref"] > 0


def _distance(a: dict, b: dict) -> float:
    return sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a) ** 0.5


def test_decoupled_ppo_has_a_trust_region_only_with_several_updates(tiny_qwen3, tmp_path):
    """One update per batch: π_prox is the policy being trained, r = π/π_prox ≡ 1, nothing clips and
    decoupled PPO's gradient is tis's (equal to float32 rounding here; exactly, in float64, in
    tests/learner/test_losses.py). Four mini-batch updates: π_prox is recomputed before the first, the clip
    acts from the second on, and the step moves away from tis's."""
    vocab = None
    out = {}
    for minibatches in (1, 4):
        for loss in ("decoupled_ppo", "tis"):
            tr = make_trainer(
                tiny_qwen3,
                tmp_path,
                algorithm={"loss": loss},
                learner={"lr": 1e-3, "minibatches": minibatches},
                buffer={"max_staleness": 8},
            )
            vocab = vocab or tr.models.spec.model.vocab_size
            start, _ = weights_and_grads(tr.models.actor)
            res = tr.step(rl_batch(vocab, groups=4))
            assert res.version == 1 and res.metrics["learner/updates"] == minibatches
            out[minibatches, loss] = (res, start, *weights_and_grads(tr.models.actor))
    (dec1, _, w_dec1, g_dec1), (_, start, w_tis1, g_tis1) = (
        out[1, "decoupled_ppo"],
        out[1, "tis"],
    )
    assert dec1.metrics["loss/clip_frac"] == 0.0
    assert_grads_close(g_dec1, g_tis1)
    assert_adam_steps_agree(w_dec1, w_tis1, g_dec1, lr=dec1.metrics["lr"])
    (dec4, _, w_dec4, _), (tis4, _, w_tis4, _) = out[4, "decoupled_ppo"], out[4, "tis"]
    assert dec4.metrics["loss/clip_frac"] > 0 and tis4.metrics["loss/clip_frac"] == 0
    # measured: apart / moved = 0.076 with four updates, 1.4e-5 with one
    assert _distance(w_dec4, w_tis4) > 1e-2 * _distance(w_tis4, start)


def test_the_learners_logprobs_are_the_generators_at_its_temperature(
    tiny_qwen3, tmp_path, rollout_engine
):
    """The built-in engine (like SGLang) reports log_softmax(logits / T) of each sampled token; the
    learner's log π of the same tokens, with rollout.temperature = T, equals it to float32 kernels'
    rounding (at T = 1 a mismatch would not show: check 0.7, and that T = 1 would be far off)."""
    import httpx

    prompts = [[5, 6, 7, 8], [40, 41, 42], [12, 13, 14, 15, 16, 17]]
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 24, "temperature": 0.7, "ignore_eos": True},
        "return_logprob": True,
    }
    replies = httpx.post(rollout_engine.url + "/generate", json=body, timeout=120).json()
    from asyncrl.learner.packing import make_sequence, pack

    items, engine_lps = [], []
    for i, (p, r) in enumerate(zip(prompts, replies, strict=True)):
        triples = r["meta_info"]["output_token_logprobs"]
        items.append(make_sequence(i, np.array(p), np.array([t[1] for t in triples])))
        engine_lps += [t[0] for t in triples]
    for temperature, close in ((0.7, True), (1.0, False)):
        tr = make_trainer(tiny_qwen3, tmp_path, rollout={"temperature": temperature})
        (learner_lps,) = tr.logprobs([pack(items)])
        err = float(
            (learner_lps.double() - torch.tensor(engine_lps, dtype=torch.float64)).abs().max()
        )
        assert (err <= LOGPROB_ATOL) == close, (temperature, err)


def test_staleness_0_tokens_of_a_sample_across_an_update_are_kept_apart(tiny_qwen3, tmp_path):
    """drift/mismatch_kl covers samples generated by one version only: a sample whose first tokens
    came from version 0 and the rest from 1 (an in-flight update) puts its version-1 tokens, trained
    at version 1, into the kv_mixed bucket and its version-0 tokens into staleness 1."""
    tr = make_trainer(tiny_qwen3, tmp_path, buffer={"max_staleness": 2}, learner={"lr": 1e-4})
    batch = rl_batch(tr.models.spec.model.vocab_size, groups=2, n=2)
    for g in batch.groups:
        for s in g.samples:
            s.versions[:] = 1
    mixed = batch.groups[0].samples[0]
    cut = len(mixed.versions) // 2
    mixed.versions[:cut] = 0
    tr.version = 1
    m = tr.step(batch).metrics
    total = sum(len(s.completion_ids) for g in batch.groups for s in g.samples)
    assert m["drift/tokens/kv_mixed"] == len(mixed.versions) - cut
    assert m["drift/tokens/1"] == cut
    assert m["drift/tokens/0"] == total - len(mixed.versions)
    assert {"drift/mismatch_kl", "drift/kv_mixed_kl", "drift/staleness_kl/1"} <= m.keys()


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_activation_checkpointing_recomputes_the_same_gradient(tiny_qwen3, tmp_path, policy):
    """TorchTitan's activation checkpointing per block (learner.activation_checkpointing): the
    backward recomputes each block's activations; the gradient is the one without it."""
    grads = {}
    for ac in ("none", policy):
        tr = make_trainer(
            tiny_qwen3,
            tmp_path,
            learner={"lr": 1e-3, "activation_checkpointing": ac},
            buffer={"max_staleness": 8},
        )
        tr.step(rl_batch(tr.models.spec.model.vocab_size))
        wrapped = "_checkpoint_wrapped_module."  # the wrapper's prefix in parameter names
        assert any(wrapped in n for n, _ in tr.models.actor.named_parameters()) == (ac != "none")
        grads[ac] = {
            k.replace(wrapped, ""): g for k, g in weights_and_grads(tr.models.actor)[1].items()
        }
    assert_grads_close(grads["none"], grads[policy])


def test_collectives_wait_longer_than_rank_0_may_legitimately_wait():
    """Ranks > 0 sit in a collective while rank 0 waits for a batch (and may first finish a
    weight sync): their timeout covers both, whatever the recipe says (300 s did not)."""
    from asyncrl import recipe as recipe_mod
    from asyncrl.learner.distributed import collective_timeout_s

    r = recipe_mod.from_dict({"buffer": {"batch_timeout_s": 3000}, "weights": {"timeout_s": 90}})
    assert collective_timeout_s(r) >= 3000 + 3 * 90
    default = recipe_mod.from_dict({})
    assert collective_timeout_s(default) > default.buffer.batch_timeout_s + 300


def test_remax_advantages_are_each_reward_minus_its_groups_greedy_reward(tiny_qwen3, tmp_path):
    """The learner's per-sample advantage under ``remax`` is r − Group.baseline_reward, read from
    groups as they arrive (decoded from the wire); a group without one (its greedy episode failed)
    is centred on its own mean, and counted."""
    tr = make_trainer(tiny_qwen3, tmp_path, algorithm={"advantage": "remax"}, **RL)
    batch = rl_batch(tr.models.spec.model.vocab_size)
    for g, b in zip(batch.groups, [0.5, None, 1.0], strict=True):
        g.baseline_reward = b
    batch.groups = [wire.decode(wire.encode(g)) for g in batch.groups]
    seqs = tr.sequences(batch)
    assert group_advantages(tr.config, batch, seqs) == {"learner/remax_mean_baselines": 1.0}
    want = []
    for g in batch.groups:
        r = np.array([s.reward for s in g.samples])
        want += list(r - (r.mean() if g.baseline_reward is None else g.baseline_reward))
    np.testing.assert_allclose([s.advantage for s in seqs], want, rtol=1e-6, atol=1e-6)
    res = tr.step(batch)
    assert np.isfinite(res.loss) and res.metrics["learner/remax_mean_baselines"] == 1.0


def episode_maker(vocab: int, seed: int = 0):
    """``episode(i, mask, reward, finish)``: sample ``g/i`` of group ``g``, a random completion
    with ``mask`` as its loss mask (0 runs: a tool's output between the model's turns)."""
    rng = np.random.default_rng(seed)

    def episode(i: int, mask: list[int], reward: float, finish: str) -> wire.Sample:
        n = len(mask)
        return wire.Sample(
            id=f"g/{i}",
            group_id="g",
            prompt_ids=rng.integers(3, vocab, size=4).astype(np.int32),
            completion_ids=rng.integers(3, vocab, size=n).astype(np.int32),
            behavior_logprobs=np.full(n, np.log(1.0 / vocab), np.float32),
            versions=np.zeros(n, np.int32),
            loss_mask=np.array(mask, np.float32),
            reward=reward,
            finish_reason=finish,
        )

    return episode


@pytest.mark.parametrize(
    "aggregation, weights",
    [
        ("seq_mean_token_mean", [0.5, 0.5]),  # each episode one sequence (3/4 : 1/4 before #43)
        ("seq_mean_token_sum_norm", [0.3, 0.1]),  # Dr. GRPO: tokens / (L · episodes), L = 10
        ("token_mean", [0.75, 0.25]),  # tokens: A has 6 of the 8
    ],
)
def test_per_turn_samples_weigh_their_episode_once_under_the_sequence_means(
    tiny_qwen3, tmp_path, aggregation, weights
):
    """Issue #43 item 5: episode A (3 trained turns, 6 tokens, A = +1) against B (1 turn, 2
    tokens, A = −1), split per turn. Under the sequence mean each turn counted as a sequence, so
    A's turns weighed 3/4 of the loss and B's 1/4; each turn now weighs its share of its
    episode's tokens (here 1/3), and the episodes 1/2 each. Dr. GRPO's sum divides by the
    episodes (2), not the turns (4). The weights are read off the real loss's gradient: with
    π = μ, tis's ∂L/∂log π_t = −A_t · c_t."""
    from asyncrl.learner import passes
    from asyncrl.learner.losses.policy import policy_loss
    from asyncrl.rollout.turns import split_turns

    alg = {"advantage": "grpo", "loss": "tis", "aggregation": aggregation}
    rollout = {"turn_samples": True, "max_new_tokens": 10}
    tr = make_trainer(tiny_qwen3, tmp_path, algorithm=alg, rollout=rollout, **RL)
    episode = episode_maker(tr.models.spec.model.vocab_size)
    a = split_turns(episode(0, [1, 1, 0, 1, 1, 0, 1, 1], 1.0, "stop"))
    b = split_turns(episode(1, [0, 1, 1], 0.0, "stop"))
    group = wire.Group(id="g", samples=[*a, *b])
    batch = Batch(groups=[wire.decode(wire.encode(group))], version=0, stats={})
    seqs = tr.sequences(batch)
    for s, adv in zip(seqs, [1.0, 1.0, 1.0, -1.0], strict=True):
        s.advantage = adv
    mbs = passes.micro_batches(tr.models, seqs)
    norm = passes.normaliser(tr.models, mbs, tr.models.meshes["actor"])
    per_episode = {0: 0.0, 1: 0.0}
    for mb in mbs:
        logp = mb.behavior_logp.double().requires_grad_(True)
        loss, _ = policy_loss(
            cfg=tr.config.algorithm,
            norm=norm,
            logp=logp,
            mask=mb.mask,
            seq_ids=mb.seq_ids,
            behavior_logp=mb.behavior_logp.double(),
            advantages=mb.advantages.double(),
            seq_weights=mb.seq_weights,
        )
        (g,) = torch.autograd.grad(loss, logp)
        c = -g / mb.advantages.double()
        for j, i in enumerate(mb.seq_index):
            per_episode[int(i == 3)] += float(c[mb.seq_ids == j].sum())
    assert [per_episode[0], per_episode[1]] == pytest.approx(weights, abs=1e-9)


def test_per_turn_samples_get_their_episodes_advantage_and_a_cut_episodes_turns_all_filtered(
    tiny_qwen3, tmp_path
):
    """``rollout.turn_samples``: the learner finds each turn's episode in its metadata as it came
    over the wire (rollout/turns.py). RLOO then leaves out the other episodes, not the episode's
    own turns: episode A (3 turns, R = 1) against B (1 turn, R = 0) is [1, −1] over episodes, and
    with γ = 1/2 A's turns get [1/4, 1/2, 1] of A's 1. A was cut at max_new_tokens: the overlong
    filter masks all three of its turns, each of which carries A's truncated reward."""
    from asyncrl.rollout.turns import split_turns

    gamma = 0.5
    tr = make_trainer(
        tiny_qwen3,
        tmp_path,
        algorithm={"advantage": "rloo"},
        rollout={"turn_samples": True, "turn_discount": gamma},
        learner=RL["learner"],
        buffer={**RL["buffer"], "overlong_filter": True},
    )
    episode = episode_maker(tr.models.spec.model.vocab_size)
    a = split_turns(episode(0, [1, 1, 0, 1, 0, 0, 1, 1], 1.0, "length"), gamma)
    b = split_turns(episode(1, [1, 1, 1], 0.0, "stop"), gamma)
    group = wire.Group(id="g", samples=[*a, *b])
    batch = Batch(groups=[wire.decode(wire.encode(group))], version=0, stats={})
    seqs = tr.sequences(batch)
    group_advantages(tr.config, batch, seqs)
    assert [s.advantage for s in seqs] == pytest.approx([0.25, 0.5, 1.0, -1.0])
    assert [bool(s.mask.any()) for s in seqs] == [False, False, False, True]


def distill_batch(tr, *, seed: int = 1, teacher=None):
    """:func:`rl_batch` with teacher logprobs (``teacher(seqs)``: per-position log π_T of each
    :class:`Sequence`; default: μ plus noise), through the wire as a worker sends them."""
    batch = rl_batch(tr.models.spec.model.vocab_size)
    rng = np.random.default_rng(seed)
    samples = [s for g in batch.groups for s in g.samples]
    for s in samples:  # a placeholder: the step's layout refuses samples without
        s.teacher_logprobs = s.behavior_logprobs
    per_seq = teacher(tr.sequences(batch)) if teacher is not None else [None] * len(samples)
    for s, lp in zip(samples, per_seq, strict=True):
        if lp is None:
            t = s.behavior_logprobs + rng.normal(0, 0.5, len(s.completion_ids))
        else:
            t = lp[len(s.prompt_ids) - 1 + np.arange(len(s.completion_ids))]
        s.teacher_logprobs = np.minimum(t, 0).astype(np.float32)
    batch.groups = [wire.decode(wire.encode(g)) for g in batch.groups]
    return batch


@pytest.mark.parametrize("coef", [0.0, 0.5])
def test_distill_trains_on_the_teachers_per_token_advantages(tiny_qwen3, tmp_path, coef):
    """``algorithm.advantage: distill``: the teacher logprobs that arrive with the samples (decoded
    from the wire) give each trained token of a packed micro-batch A_t = log π_teacher,t −
    log π_prox,t (+ coef × the sample's GRPO advantage) in the update; the batch's reverse KL is
    the mean of log μ − log π_teacher over those tokens; the step trains on them. A sample without
    teacher logprobs is refused by name."""
    from asyncrl.learner import passes
    from asyncrl.learner.models import LearnerError
    from asyncrl.learner.packing import pack

    teacher = {"teacher": {"urls": ["http://127.0.0.1:9"]}}
    alg = {"advantage": "distill", "distill_coef": coef}
    tr = make_trainer(tiny_qwen3, tmp_path, algorithm=alg, rollout=teacher, **RL)
    batch = distill_batch(tr)
    seqs = tr.sequences(batch)
    info = distill_advantages(tr.config, batch, seqs)
    samples = [s for g in batch.groups for s in g.samples]
    grpo = torch.cat(compute_grpo([g.rewards for g in batch.groups])).tolist()
    mb = pack(seqs)
    prox = torch.randn(mb.sel.numel()) - 3.0  # any π_prox: the advantage follows it
    got = passes.advantages(tr.models, mb, prox).numpy()
    want, kl, n = [], 0.0, 0
    for s, a in zip(samples, grpo, strict=True):
        want.append(s.teacher_logprobs.astype(np.float64) + coef * a)
        kl += float((s.behavior_logprobs.astype(np.float64) - s.teacher_logprobs).sum())
        n += len(s.completion_ids)
    want = np.concatenate(want) - prox.double().numpy()  # samples in order, as packed
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert info[names.DISTILL_REVERSE_KL] == pytest.approx(kl / n, rel=1e-6)
    res = tr.step(batch)
    assert np.isfinite(res.loss) and res.loss != 0.0
    assert res.metrics[names.DISTILL_REVERSE_KL] == pytest.approx(kl / n, rel=1e-6)
    bare = rl_batch(
        tr.models.spec.model.vocab_size, seed=3
    )  # as a worker without a teacher sends them
    with pytest.raises(LearnerError, match="sample '0-0' has 0 teacher logprobs"):
        tr.sequences(bare)


def test_distill_leaves_a_student_that_is_its_teacher_where_it_is_whatever_the_sampler(
    tiny_qwen3, tmp_path
):
    """Issue #43 item 1, through the learner's step: the teacher's logprobs are the student's own
    (π_T = π_prox), the sampler's are not (μ = π_T − noise: a stale μ). The reverse KL(π ‖ π_T)
    is at its minimum, so its gradient is 0: A_t = log π_T − log π_prox = 0 on every token. With
    log μ in the advantage (A_t = log π_T − log μ, the old code) the step's gradient norm was of
    order 1 (it pushes π away from μ; the worked example is
    tests/learner/test_advantages.py::test_distill_with_the_sampler_in_the_advantage_moves_away)."""
    from asyncrl.learner import passes

    teacher = {"teacher": {"urls": ["http://127.0.0.1:9"]}}
    alg = {"advantage": "distill"}
    tr = make_trainer(tiny_qwen3, tmp_path, algorithm=alg, rollout=teacher, **RL)

    def own(seqs):  # the student's log π at the step's weights, packed as the step packs them
        passes.recompute_prox(tr.models, seqs, 0)
        return [s.prox_logp for s in seqs]

    batch = distill_batch(tr, teacher=own)
    rng = np.random.default_rng(2)
    for g in batch.groups:
        for s in g.samples:
            stale = s.teacher_logprobs - np.abs(rng.normal(0, 0.7, len(s.completion_ids)))
            s.behavior_logprobs = stale.astype(np.float32)
    res = tr.step(batch)
    assert abs(res.metrics[names.DISTILL_REVERSE_KL]) > 0.3  # μ is far from π_T ...
    assert res.metrics[names.GRAD_NORM] < 1e-4  # ... and π, already π_T, is not pushed from μ


def test_distills_second_update_on_a_batch_follows_the_current_policy(tiny_qwen3, tmp_path):
    """Issue #53 item 4.2: with several updates per batch the teacher's advantage is
    log π_T − sg[log π_θ], the policy being trained, not log π_T − log π_prox. Worked example
    (docs/off-policy.md, "Which π"): π_T = [.5, .5], π_prox = [.9, .1], and after the first update
    π_θ = [.5, .5] = π_T; A = log π_T − log π_prox = [−0.588, +1.609] still gives the logit step
    [−0.549, +0.549] away from the teacher π_θ already is, where A = log π_T − log π_θ = 0 gives 0.

    Through the learner: ``learner.epochs: 2`` on one batch (B) takes the same two updates as two
    one-update steps on it (D), loss ``tis`` (its weight min(π/μ, C) is the same in both): D's
    second step makes its advantage from its own forward at the weights W1 after the first update,
    so the two runs' gradients agree at both updates exactly when B's second update does too.
    With log π_prox (the old code) B's second update used log π at W0: its gradient norm was 1.51
    where D's is 1.14."""
    teacher = {"teacher": {"urls": ["http://127.0.0.1:9"]}}
    alg = {"advantage": "distill", "loss": "tis"}
    res = {}
    for epochs in (2, 1):
        learner = {**RL["learner"], "epochs": epochs}
        tr = make_trainer(tiny_qwen3, tmp_path, algorithm=alg, rollout=teacher, learner=learner,
                          buffer=RL["buffer"])  # fmt: skip
        batch = distill_batch(tr)
        steps = [tr.step(batch) for _ in range(3 - epochs)]
        norms = [s.metrics[names.GRAD_NORM] for s in steps]
        top = max(s.metrics.get("grad_norm/max", s.metrics[names.GRAD_NORM]) for s in steps)
        res[epochs] = (float(np.mean(norms)), top)  # with the mean: both updates' norms
    (two_mean, two_max), (one_mean, one_max) = res[2], res[1]
    assert_close_rel(two_mean, one_mean)
    assert_close_rel(two_max, one_max)


def compute_grpo(rewards):
    from asyncrl.learner.advantages import compute_advantages

    return compute_advantages(rewards, kind="grpo", eps=1e-6)

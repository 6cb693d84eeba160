"""PPO with a critic in the learner (asyncrl/learner/critic.py): the targets against hand-computed
GAE / V-trace / KL-shaped rewards, the critic's update (it fits the returns; the micro-batch split
does not change its gradient), and a checkpoint → resume that continues actor and critic bitwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl import metric_names as names
from asyncrl.learner.critic import token_targets
from asyncrl.learner.packing import make_sequence
from asyncrl.recipe import AlgorithmConfig
from tests.learner.test_model import make_trainer
from tests.learner.test_step import rl_batch
from tests.numerics import assert_close_rel, assert_grads_close

pytestmark = pytest.mark.numerics  # compares float32 results across kernels (tests/numerics.py)

RL = {"learner": {"lr": 1e-3, "grad_clip": 1.0}, "buffer": {"max_staleness": 8}}
GAE = {"advantage": "gae", "loss": "ppo"}


def _seq(prompt: int, mask: list[float], *, reward: float, values: list[float], mu=None):
    """A sample with ``len(mask)`` completion tokens; per-token inputs given at the trained ones."""
    c = len(mask)
    s = make_sequence(
        0,
        np.arange(3, 3 + prompt),
        np.arange(10, 10 + c),
        loss_mask=np.asarray(mask, np.float32),
        behavior_logprobs=np.zeros(c, np.float32) if mu is None else np.asarray(mu, np.float32),
        reward=reward,
    )
    start = prompt - 1
    s.values = np.zeros(len(s), np.float32)
    s.values[start : start + c] = values
    return s, start


def test_gae_targets_are_the_reward_to_go_minus_the_value_on_trained_tokens():
    """γ = λ = 1 and an outcome reward: A_t = r − V_t and R_t = r at every trained token; a masked
    token (a tool's output) is skipped: neither target nor advantage."""
    s, at = _seq(3, [1, 1, 0, 1], reward=2.0, values=[0.5, -1.0, 7.0, 1.5])
    token_targets([s], AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0))
    adv, ret = s.token_advantages[at : at + 4], s.returns[at : at + 4]
    np.testing.assert_allclose(adv, [1.5, 3.0, 0.0, 0.5], rtol=1e-6)
    np.testing.assert_allclose(ret, [2.0, 2.0, 0.0, 2.0], rtol=1e-6)
    assert not s.token_advantages[:at].any() and not s.returns[:at].any()  # the prompt


def test_gae_targets_discount_over_trained_tokens_only():
    """γ = 0.5, λ = 0: one-step TD. t0 → t1 (next trained token), t1 → t3 (t2 masked), t3 last."""
    s, at = _seq(2, [1, 1, 0, 1], reward=4.0, values=[1.0, 2.0, 9.0, 3.0])
    token_targets([s], AlgorithmConfig(advantage="gae", gamma=0.5, lam=0.0))
    adv = s.token_advantages[at : at + 4]
    # δ0 = 0 + 0.5·2 − 1 = 0, δ1 = 0 + 0.5·3 − 2 = −0.5, δ3 = 4 + 0 − 3 = 1
    np.testing.assert_allclose(adv, [0.0, -0.5, 0.0, 1.0], atol=1e-6)


@pytest.mark.parametrize("advantage", ["gae", "vtrace"])
def test_a_completion_cut_at_max_new_tokens_bootstraps_from_its_last_value(advantage):
    """Issue #53 item 4.4, the worked example (docs/off-policy.md, "Cut completions"): a completion
    cut at ``max_new_tokens`` (no end token) scored R = 0, whose critic values rise, V = [0.5, 1.5]
    (the critic expects it to go on and succeed); γ = λ = 1, μ = π. The old code ended the episode
    at the cut, V = 0 after it: A = [−0.5, −1.5] and targets [0, 0], every token punished as a
    failure and the critic pulled to 0. Bootstrapping from the last value V(x_T) = 1.5:
    A = [1.0, 0.0], targets [1.5, 1.5]. A completion that ended (an end token) is unchanged."""
    alg = AlgorithmConfig(advantage=advantage, gamma=1.0, lam=1.0, vtrace_rho_bar=1.0)
    out = {}
    for cut in (True, False):
        s, at = _seq(2, [1, 1], reward=0.0, values=[0.5, 1.5])
        s.prox_logp = s.behavior_logp.copy()  # π = μ: V-trace is GAE
        s.truncated = cut
        token_targets([s], alg)
        out[cut] = (s.token_advantages[at : at + 2], s.returns[at : at + 2])
    np.testing.assert_allclose(out[True][0], [1.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(out[True][1], [1.5, 1.5], atol=1e-6)
    np.testing.assert_allclose(out[False][0], [-0.5, -1.5], atol=1e-6)
    np.testing.assert_allclose(out[False][1], [0.0, 0.0], atol=1e-6)


def test_the_learner_knows_which_samples_were_cut(tiny_qwen3, tmp_path):
    """A sample's ``finish_reason: length`` (the generator's: cut at ``max_new_tokens``) marks its
    sequence ``truncated``, as a sample the learner cuts at ``model.max_seq_len`` does; a per-turn
    sample only on its trajectory's last turn (the earlier turns were not cut)."""
    tr = make_trainer(tiny_qwen3, tmp_path, algorithm=GAE, **RL)
    batch = rl_batch(tr.models.spec.model.vocab_size, groups=1, n=3)
    a, b, c = batch.groups[0].samples
    a.finish_reason = "length"
    c.finish_reason = "length"
    c.metadata = {"episode": "0/2", "turn": 0, "turns_trained": 2}  # an earlier turn
    assert [s.truncated for s in tr.sequences(batch)] == [True, False, False]


def test_kl_reward_and_vtrace_targets_by_hand():
    mu, pi, ref = [-1.0, -2.0], [-0.5, -2.5], [-1.5, -1.0]
    s, at = _seq(2, [1, 1], reward=1.0, values=[0.25, 0.5], mu=mu)
    s.prox_logp = np.zeros(len(s), np.float32)
    s.prox_logp[at : at + 2] = pi
    s.ref_logp = np.zeros(len(s), np.float32)
    s.ref_logp[at : at + 2] = ref
    beta = 0.1
    alg = AlgorithmConfig(advantage="vtrace", kl_reward_coef=beta, vtrace_rho_bar=1.0)
    token_targets([s], alg)
    r = [
        -beta * (pi[0] - ref[0]),
        1.0 - beta * (pi[1] - ref[1]),
    ]  # r'_t = r_t − β(log π_prox − log π_ref)
    rho = [min(1.0, np.exp(pi[0] - mu[0])), min(1.0, np.exp(pi[1] - mu[1]))]
    v = [0.25, 0.5]
    vs1 = v[1] + rho[1] * (r[1] - v[1])
    vs0 = v[0] + rho[0] * (r[0] + v[1] - v[0]) + rho[0] * (vs1 - v[1])  # c = ρ here (c̄ = ρ̄ = 1)
    np.testing.assert_allclose(s.returns[at : at + 2], [vs0, vs1], rtol=1e-6)
    a = [r[0] + vs1 - v[0], r[1] - v[1]]  # no ρ: the policy loss's weight is the one ρ
    np.testing.assert_allclose(s.token_advantages[at : at + 2], a, rtol=1e-6)


def test_the_kl_shaped_reward_is_the_trained_policys_not_the_samplers():
    """Issue #53 item 4.1, the worked example (docs/off-policy.md, "The KL-shaped reward"): β = 1,
    R = 0, π = π_ref = [.5, .5] (the KL is at its minimum), μ = [.9, .1] (a stale sampler). With
    log μ in the shaped reward (the old code) the rewards were −β·log(μ/π_ref) = [−0.588, +1.609]
    and the expected logit step E_μ[(π/μ)·r'·∇log π] = Σ_y π_y·r'_y·(e_y − π) was
    [−0.549, +0.549]: away from π_ref, which π already is. With log π_prox both are 0."""
    pi, mu, beta = np.array([0.5, 0.5]), np.array([0.9, 0.1]), 1.0
    shaped = []
    for y in range(2):  # one sequence per vocabulary item y, its one trained token y
        s, at = _seq(2, [1], reward=0.0, values=[0.0], mu=[np.log(mu[y])])
        s.prox_logp = np.zeros(len(s), np.float32)
        s.prox_logp[at] = np.log(pi[y])
        s.ref_logp = s.prox_logp.copy()  # π_ref = π
        token_targets([s], AlgorithmConfig(advantage="gae", kl_reward_coef=beta, lam=1.0))
        shaped.append(float(s.returns[at]))  # V = 0, γ = λ = 1: the return is the shaped reward
    shaped = np.array(shaped)
    # the wrong reward, for the record: −β·log(μ/π_ref) = [−0.588, +1.609], step ±0.549
    wrong = -beta * np.log(mu / pi)
    np.testing.assert_allclose(wrong, [-0.588, 1.609], atol=1e-3)
    step = lambda r: sum(pi[y] * r[y] * (np.eye(2)[y] - pi) for y in range(2))  # noqa: E731
    np.testing.assert_allclose(step(wrong), [-0.549, 0.549], atol=1e-3)
    np.testing.assert_allclose(shaped, [0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(step(shaped), [0.0, 0.0], atol=1e-6)


def test_a_kl_reward_recomputes_prox_at_one_update():
    """The KL reward reads log π_prox, so its dataflow has the prox call before the advantages
    even at one update per batch (V-trace's already did)."""
    from asyncrl import dataflow

    flow = dataflow.ppo_with_critic(True)
    adv = next(c for c in flow.calls if c.name == "advantages")
    assert "prox" in {c.name for c in flow.calls} and "prox_logp" in adv.inputs
    assert "prox" not in {c.name for c in dataflow.ppo_with_critic(False).calls}


def test_the_critic_fits_the_returns_and_the_actor_trains(tiny_qwen3, tmp_path):
    tr = make_trainer(tiny_qwen3, tmp_path, algorithm=GAE, critic={"lr": 3e-3}, **RL)
    assert tr.models.critic is not None
    batch = rl_batch(tr.models.spec.model.vocab_size)
    actor0 = {k: v.clone() for k, v in tr.hf_state_dict().items()}
    first = tr.step(batch)
    for k in (names.VALUE_LOSS, names.EXPLAINED_VARIANCE, names.VALUE_CLIP_FRAC):
        assert np.isfinite(first.metrics[k]), k
    assert first.metrics["critic/grad_norm"] > 0 and np.isfinite(first.loss)
    assert max(float((v - actor0[k]).abs().max()) for k, v in tr.hf_state_dict().items()) > 1e-4
    last = first
    for _ in range(6):  # the same batch again: the values move towards its returns
        tr.version = 0
        last = tr.step(batch)
    assert last.metrics[names.VALUE_LOSS] < 0.5 * first.metrics[names.VALUE_LOSS]
    assert last.metrics[names.EXPLAINED_VARIANCE] > first.metrics[names.EXPLAINED_VARIANCE]


def test_micro_batch_split_does_not_change_the_critics_step(tiny_qwen3, tmp_path):
    out = []
    for mbt in (4096, 24):
        learner = {**RL["learner"], "micro_batch_tokens": mbt}
        tr = make_trainer(tiny_qwen3, tmp_path, algorithm=GAE, learner=learner, buffer=RL["buffer"])
        res = tr.step(rl_batch(tr.models.spec.model.vocab_size, groups=4))
        grads = {k: p.grad.detach().clone() for k, p in tr.models.critic.model.named_parameters()}
        out.append((res, grads))
    (one, g_one), (many, g_many) = out
    assert one.metrics["learner/micro_batches"] == 1 and many.metrics["learner/micro_batches"] > 3
    assert_close_rel(one.metrics[names.VALUE_LOSS], many.metrics[names.VALUE_LOSS])
    assert_close_rel(one.metrics["critic/grad_norm"], many.metrics["critic/grad_norm"])
    assert_grads_close(g_one, g_many)


def test_a_value_change_beyond_the_clip_loses_its_gradient(tiny_qwen3, tmp_path):
    """Several updates on one batch with a tiny ε_v: after the first, some values have moved past
    V_old ± ε_v away from their returns, and those tokens are counted as clipped."""
    alg = {**GAE, "value_clip": 1e-4}
    learner = {**RL["learner"], "minibatches": 2, "epochs": 2}
    tr = make_trainer(
        tiny_qwen3,
        tmp_path,
        algorithm=alg,
        learner=learner,
        critic={"lr": 1e-2},
        **{"buffer": RL["buffer"]},
    )
    res = tr.step(rl_batch(tr.models.spec.model.vocab_size))
    assert 0 < res.metrics[names.VALUE_CLIP_FRAC] < 1


@pytest.mark.parametrize("advantage", ["gae", "vtrace"])
def test_checkpoint_and_resume_continue_actor_and_critic_bitwise(tiny_qwen3, tmp_path, advantage):
    from asyncrl import recipe as recipe_mod
    from asyncrl.learner.config import TrainerConfig
    from asyncrl.learner.trainer import Trainer

    spec = {
        "model": {"path": str(tiny_qwen3), "max_seq_len": 256},
        "run": {"output_dir": str(tmp_path), "name": "ckpt", "steps": 3},
        "algorithm": {**GAE, "advantage": advantage, "loss": "decoupled_ppo"},
        "learner": {**RL["learner"], "checkpoint_every": 0, "checkpoint_async": False},
        "buffer": RL["buffer"],
        "critic": {"lr": 3e-3},
    }
    vocab = None

    def run(trainer, steps):
        out = []
        for v in steps:
            res = trainer.step(rl_batch(vocab, seed=v))
            critic = {
                k: p.detach().clone() for k, p in trainer.models.critic.model.state_dict().items()
            }
            out.append((res.loss, res.metrics[names.VALUE_LOSS], critic, trainer.hf_state_dict()))
        return out

    a = Trainer(TrainerConfig.from_recipe(recipe_mod.from_dict(spec)))
    vocab = a.models.spec.model.vocab_size
    run(a, [0])
    assert a.save_checkpoint(force=True)
    straight = run(a, [1, 2])
    a.close()
    spec["run"]["resume"] = True
    b = Trainer(TrainerConfig.from_recipe(recipe_mod.from_dict(spec)))
    assert b.version == 1
    resumed = run(b, [1, 2])
    b.close()
    for (l1, v1, c1, w1), (l2, v2, c2, w2) in zip(straight, resumed, strict=True):
        assert (l1, v1) == (l2, v2)  # bitwise: the same floats
        assert all(torch.equal(c1[k], c2[k]) for k in c1)
        assert all(torch.equal(w1[k], w2[k]) for k in w1)


def test_a_critic_from_a_reward_models_folder_keeps_its_head(
    tiny_qwen3, tiny_reward_model, tmp_path
):
    """critic.path at a reward model's export (InstructGPT starts its value function from the RM):
    the critic's head is the folder's ``score.weight``; from a causal LM it is fresh and small."""
    from safetensors.torch import load_file

    (f,) = tiny_reward_model.glob("*.safetensors")
    head = load_file(str(f))["score.weight"]
    tr = make_trainer(
        tiny_qwen3, tmp_path, algorithm=GAE, critic={"path": str(tiny_reward_model)}, **RL
    )
    assert torch.equal(tr.models.critic.model.lm_head.weight.detach().full_tensor(), head)
    fresh = make_trainer(tiny_qwen3, tmp_path, algorithm=GAE, **RL)
    w = fresh.models.critic.model.lm_head.weight.detach().full_tensor()
    assert w.shape == head.shape and 0 < float(w.abs().max()) < 0.01


def test_the_step_runs_the_recipes_dataflow_in_dependency_order(tiny_qwen3, tmp_path, monkeypatch):
    """V-trace with a KL reward and two updates: the learner runs its calls of the graph
    (asyncrl/dataflow.py) level by level — π_prox, π_ref and the values before the advantages,
    the advantages before the train steps. The runners are wrapped to record, not replaced."""
    from asyncrl.learner import calls

    alg = {"advantage": "vtrace", "loss": "decoupled_ppo", "kl_reward_coef": 0.05}
    learner = {**RL["learner"], "minibatches": 2}
    tr = make_trainer(tiny_qwen3, tmp_path, algorithm=alg, learner=learner, buffer=RL["buffer"])
    ran: list[str] = []
    for call, real in calls.CALL_RUNNERS.items():
        if real is not None:
            wrapped = lambda m, run, real=real, call=call: (ran.append(call), real(m, run))  # noqa: E731
            monkeypatch.setitem(calls.CALL_RUNNERS, call, wrapped)
    res = tr.step(rl_batch(tr.models.spec.model.vocab_size))
    assert np.isfinite(res.loss) and res.metrics["learner/updates"] == 2
    levels = tr.models.flow.order()
    expect = [c.name for level in levels for c in level if calls.CALL_RUNNERS[c.name] is not None]
    assert ran == expect
    assert set(ran[:3]) == {"prox", "ref", "values"}
    assert ran[3:] == ["advantages", "train_actor", "train_critic"]
    assert res.metrics["loss/kl_ref"] != 0.0  # π_ref's logprobs reached the loss's KL statistic


def test_micro_batches_leave_no_unsharded_gradient_to_the_next(tiny_qwen3, tmp_path):
    """Gradient accumulation reduce-scatters at every micro-batch (asyncrl/learner/trainer.py):
    when a training forward starts, neither the actor nor the critic holds an unsharded gradient
    of the micro-batch before (with gradient sync off until the last one, each held its whole
    float32 gradient, 4·P, where the memory plan counts 4·P/N)."""
    from tools.bench.accumulation_memory import held_at_each_forward

    learner = {**RL["learner"], "micro_batch_tokens": 24}
    tr = make_trainer(tiny_qwen3, tmp_path, algorithm=GAE, learner=learner, buffer=RL["buffer"])
    with held_at_each_forward([tr.models.actor, tr.models.critic.model]) as held:
        res = tr.step(rl_batch(tr.models.spec.model.vocab_size, groups=4))
    micro_batches = res.metrics["learner/micro_batches"]
    assert micro_batches > 3 and len(held) == 2 * micro_batches  # the actor's and the critic's
    assert held == [0] * len(held)

"""The dataflow graph: every algorithm's graph validates, broken graphs are refused by name, levels."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl import dataflow as df
from asyncrl import recipe
from asyncrl.dataflow import Dataflow, DataflowError, ModelCall

RECIPES = Path(__file__).resolve().parents[1] / "recipes"

BUILT = {
    "grpo": df.grpo(),
    "grpo_kl_prox_rm": df.grpo(kl_loss=True, prox=True, reward_model=True),
    "ppo": df.ppo_with_critic(False),
    "ppo_kl_reward": df.ppo_with_critic(True),
    "ppo_vtrace_everything": df.ppo_with_critic(True, vtrace=True, kl_loss=True, prox=True),
    "ppo_rule_reward": df.ppo_with_critic(False, reward_model=False),
    "remax": df.remax(),
    "remax_rule_kl": df.remax(reward_model=False, kl_loss=True),
    "distill": df.distill(),
    "distill_outcome_kl_prox": df.distill(outcome=True, kl_loss=True, prox=True),
    "sft": df.sft(),
    "reward_modelling": df.reward_modelling(),
}


@pytest.mark.parametrize("name", list(BUILT))
def test_every_builder_validates_and_trains_last(name):
    flow = BUILT[name].validate()
    levels = flow.order()
    assert sorted(c.name for lv in levels for c in lv) == sorted(c.name for c in flow.calls)
    at = {c.name: i for i, lv in enumerate(levels) for c in lv}
    for c in flow.calls:
        if c.call == "train_step":  # after every other call of its role
            assert all(at[x.name] < at[c.name] for x in flow.calls if x.role == c.role and x != c)
    assert any(c.call == "train_step" for c in flow.calls)


def names(level):
    return {c.name for c in level}


def labels(level):
    return sorted(c.label for c in level)


def test_ppo_levels():
    levels = df.ppo_with_critic(True).order()
    assert [labels(lv) for lv in levels] == [
        ["actor.generate"],
        ["actor.inference", "critic.inference", "ref.inference", "reward.inference"],
        ["driver.compute"],
        ["actor.train_step", "critic.train_step"],
    ]
    adv = levels[2][0]
    # the KL reward is β·(log π_prox − log π_ref): π_prox is recomputed before (issue #53 4.1)
    assert adv.name == "advantages"
    assert {"ref_logp", "prox_logp", "values", "rewards"} <= set(adv.inputs)
    assert set(adv.outputs) == {"advantages", "returns"}
    # Without the KL reward and the KL loss no reference runs.
    assert "ref" not in {c.role for c in df.ppo_with_critic(False).calls}


def test_vtrace_reads_the_learners_policy_and_grpo_levels():
    flow = df.ppo_with_critic(False, vtrace=True)
    adv = next(c for c in flow.calls if c.name == "advantages")
    assert {"prox_logp", "behavior_logp"} <= set(adv.inputs)
    assert [names(lv) for lv in df.grpo().order()] == [
        {"generate"},
        {"reward_fn"},
        {"advantages"},
        {"train_actor"},
    ]
    assert [names(lv) for lv in df.remax().order()][:2] == [
        {"generate", "generate_greedy"},
        {"reward", "reward_greedy"},
    ]


def test_a_train_step_waits_for_its_roles_other_calls():
    # "probe" (an actor forward) reads the rewards, so it is on level 2, after the train step's
    # data (level 1); the train step still comes after it: it would change the probe's weights.
    flow = Dataflow(
        "probe",
        [
            df._generate(),
            ModelCall("score", "driver", "compute", ("responses",), ("rewards",)),
            ModelCall("probe", "actor", "inference", ("rewards",), ("probe_logp",)),
            ModelCall("train", "actor", "train_step", ("responses",)),
        ],
    )
    assert [names(lv) for lv in flow.order()] == [{"generate"}, {"score"}, {"probe"}, {"train"}]


def test_missing_input_is_refused_naming_call_and_key():
    flow = Dataflow(
        "f", [df._generate(), ModelCall("train", "actor", "train_step", ("advantages",))]
    )
    with pytest.raises(DataflowError, match="call 'train' reads key 'advantages', which no call"):
        flow.validate()


def test_cycle_is_refused_naming_the_calls_and_keys():
    flow = Dataflow(
        "f",
        [
            ModelCall("a", "driver", "compute", ("prompts", "z"), ("x",)),
            ModelCall("b", "driver", "compute", ("x",), ("y",)),
            ModelCall("c", "driver", "compute", ("y",), ("z",)),
        ],
    )
    with pytest.raises(DataflowError) as e:
        flow.validate()
    msg = str(e.value)
    assert "cycle" in msg
    for hop in ("'a' reads 'z' from 'c'", "'c' reads 'y' from 'b'", "'b' reads 'x' from 'a'"):
        assert hop in msg
    with pytest.raises(DataflowError, match="cycle: 'a' reads 'x' from 'a'"):
        Dataflow("f", [ModelCall("a", "driver", "compute", ("x",), ("x",))]).validate()


def test_broken_version_order_is_refused():
    # The actor's forward reads a key computed from its own train step's output: it would see the
    # next version inside this step.
    flow = Dataflow(
        "f",
        [
            df._generate(),
            ModelCall("train", "actor", "train_step", ("responses",), ("train_stats",)),
            ModelCall("summary", "driver", "compute", ("train_stats",), ("summary",)),
            ModelCall("probe", "actor", "inference", ("summary",), ("probe_logp",)),
        ],
    )
    with pytest.raises(DataflowError) as e:
        flow.validate()
    msg = str(e.value)
    assert "version order" in msg and "'probe'" in msg and "'summary'" in msg and "'train'" in msg
    # Another role may read it (the critic is not trained by the actor's step).
    ok = Dataflow("f", [*flow.calls[:3], ModelCall("v", "critic", "inference", ("summary",))])
    assert [names(lv) for lv in ok.order()][-1] == {"v"}


def test_version_order_through_another_roles_train_step():
    # probe (actor) reads what the critic's train step wrote; the critic's train step waits for
    # the critic's forward, which reads the actor's train output: probe would follow train_actor.
    flow = Dataflow(
        "f",
        [
            df._generate(),
            ModelCall("train_actor", "actor", "train_step", ("responses",), ("actor_stats",)),
            ModelCall("values", "critic", "inference", ("actor_stats",), ("values",)),
            ModelCall("train_critic", "critic", "train_step", ("responses",), ("critic_stats",)),
            ModelCall("probe", "actor", "inference", ("critic_stats",), ("probe_logp",)),
        ],
    )
    with pytest.raises(DataflowError, match="version order: call 'probe'.*'critic_stats'"):
        flow.validate()


@pytest.mark.parametrize(
    "calls, needle",
    [
        (
            [ModelCall("t", "actor", "train_step", ("prompts",))] * 2,
            "two calls are named 't'",
        ),
        (
            [
                ModelCall("t1", "actor", "train_step", ("prompts",)),
                ModelCall("t2", "actor", "train_step", ("prompts",)),
            ],
            "'t1' and 't2' both train the actor",
        ),
        ([ModelCall("g", "critic", "generate", ("prompts",), ("r",))], "'g': only the actor"),
        ([ModelCall("d", "driver", "inference", ("prompts",), ("r",))], "'d' (driver.inference)"),
        ([ModelCall("m", "actor", "compute", ("prompts",), ("r",))], "'m' (actor.compute)"),
        ([ModelCall("w", "driver", "compute", (), ("prompts",))], "'w' writes key 'prompts'"),
        (
            [
                ModelCall("a", "driver", "compute", ("prompts",), ("x",)),
                ModelCall("b", "driver", "compute", ("prompts",), ("x",)),
            ],
            "key 'x' is produced by both 'a' and 'b'",
        ),
        ([ModelCall("q", "critic", "sleep", ("prompts",))], "'q': role 'critic' / call 'sleep'"),  # type: ignore[arg-type]
    ],
)
def test_malformed_graphs_are_refused(calls, needle):
    with pytest.raises(DataflowError) as e:
        Dataflow("f", calls).validate()
    assert needle in str(e.value)


def _recipe(*overrides: str) -> recipe.Recipe:
    # demo.yaml's dynamic sampling is a group estimator's rule, refused with a critic
    critic = {"algorithm.advantage=gae", "algorithm.advantage=vtrace"} & set(overrides)
    extra = ("buffer.dynamic_sampling=false",) if critic else ()
    return recipe.load(RECIPES / "demo.yaml", (*overrides, *extra), check_files=False)


@pytest.mark.parametrize(
    "overrides, name, roles",
    [
        ((), "grpo (group advantages)", {"actor", "driver"}),
        (("algorithm.loss=sft",), "sft", {"actor"}),
        (("algorithm.advantage=gae",), "ppo with a critic (gae)", {"actor", "critic", "driver"}),
        (
            ("algorithm.advantage=vtrace", "algorithm.kl_reward_coef=0.1"),
            "ppo with a critic (vtrace, kl reward)",
            {"actor", "critic", "driver", "ref"},
        ),
        (("algorithm.advantage=remax",), "remax", {"actor", "driver"}),
        (("algorithm.loss=reward_model",), "reward modelling", {"reward"}),
        (
            (
                "algorithm.advantage=gae",
                "rollout.reward=model",
                "rollout.reward_model.urls=[http://127.0.0.1:9]",
            ),
            "ppo with a critic (gae)",
            {"actor", "critic", "driver", "reward"},  # the reward model's score, no answers read
        ),
        (
            ("algorithm.advantage=rloo", "algorithm.kl_coef=0.1"),
            "rloo (group advantages)",
            {"actor", "driver", "ref"},
        ),
    ],
)
def test_from_recipe(overrides, name, roles):
    flow = df.from_recipe(_recipe(*overrides))
    assert flow.name == name and {c.role for c in flow.calls} == roles
    assert flow.order()


def test_from_recipe_recomputes_prox_only_with_several_updates():
    assert "prox" not in {c.name for c in df.from_recipe(_recipe()).calls}
    flow = df.from_recipe(_recipe("learner.minibatches=2"))
    train = next(c for c in flow.calls if c.name == "train_actor")
    assert "prox_logp" in train.inputs


def test_describe_names_every_call_by_level():
    text = df.ppo_with_critic(True).describe()
    lines = text.splitlines()
    assert "data provides prompts" in lines[0]
    assert "  [0] generate: actor.generate prompts -> responses, behavior_logp" in lines
    assert "  [3] train_critic: critic.train_step prompts, responses, values, returns -> -" in lines


@pytest.mark.parametrize("name", list(BUILT))
def test_the_learner_has_a_runner_for_every_call_or_the_rollout_side_runs_it(name):
    """The learner's step executes a graph level by level through CALL_RUNNERS (the reward model's
    training is RewardModelSteps.step, a graph of that one call)."""
    from asyncrl.learner.calls import CALL_RUNNERS

    calls = {c.name for c in BUILT[name].calls}
    assert calls <= set(CALL_RUNNERS) | {"train_reward"}, calls - set(CALL_RUNNERS)
    for c in BUILT[name].calls:  # None: the rollout workers' calls (generation and rewards)
        if c.name == "train_reward":
            continue
        assert (CALL_RUNNERS.get(c.name) is None) == (
            c.call == "generate" or c.name.startswith("reward") or c.role == "teacher"
        )


def test_distill_reads_the_teachers_logprobs_and_the_rewards_only_when_mixed_in():
    """The teacher is a model call of its own (forward only, in the rollout workers); the
    advantages read its logprobs and the sampler's, and the rewards only with distill_coef > 0."""
    teacher = ("algorithm.advantage=distill", "rollout.teacher.urls=[http://127.0.0.1:9]")
    flow = df.from_recipe(_recipe(*teacher, "buffer.dynamic_sampling=false"))
    assert flow.name == "on-policy distillation"
    assert {c.role for c in flow.calls} == {"actor", "driver", "teacher"}
    call = next(c for c in flow.calls if c.name == "teacher")
    assert call.label == "teacher.inference" and call.outputs == ("teacher_logp",)
    adv = next(c for c in flow.calls if c.name == "advantages")
    assert adv.inputs == ("behavior_logp", "teacher_logp")
    assert [[c.name for c in lv] for lv in flow.order()][1] == ["reward_fn", "teacher"]
    mixed = df.from_recipe(
        _recipe(*teacher, "buffer.dynamic_sampling=false", "algorithm.distill_coef=0.5")
    )
    assert mixed.name == "on-policy distillation + outcome (grpo)"
    assert "rewards" in next(c for c in mixed.calls if c.name == "advantages").inputs

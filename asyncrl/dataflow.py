"""An RL algorithm's step as a graph of model calls (docs/design.md §11): GRPO, PPO with a critic,
ReMax, on-policy distillation, SFT and reward modelling are each a :class:`Dataflow`, checked
before anything runs.

A :class:`ModelCall` is one call of one role's model (the actor that generates and is trained, a
critic, a frozen reference, a reward model, a distillation teacher) or a ``driver`` computation on the data (a rule reward,
advantages), reading and writing named keys of the step's batch. :meth:`Dataflow.validate` refuses
a graph that could not run (a key nobody produces, a cycle) or that would mix weight versions: a
role's ``train_step`` makes its next version, so every other call of that role in the step must come
before it (they all see version i), and the first call at step i+1 sees version i+1.
:meth:`Dataflow.order` gives the levels whose calls are independent and could run at once.

Pure: no I/O, no torch. ``asyncrl graph RECIPE`` (:mod:`asyncrl.graph`) prints and draws it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from asyncrl.recipe import Recipe

Role = Literal["actor", "critic", "ref", "reward", "teacher", "driver"]
CallKind = Literal["generate", "inference", "train_step", "compute"]
ROLES: tuple[str, ...] = get_args(Role)
CALL_KINDS: tuple[str, ...] = get_args(CallKind)


class DataflowError(ValueError):
    """A graph that cannot run as declared; the message names the call and the key."""


@dataclass(frozen=True)
class ModelCall:
    """One call: ``role.call(inputs) -> outputs``, the inputs and outputs being batch keys.

    ``driver`` calls are ``compute`` (no model: a rule reward, advantages); model roles
    ``generate`` (the actor only), run forward-only (``inference``) or take an optimizer step
    (``train_step``, which makes the role's next weight version)."""

    name: str
    role: Role
    call: CallKind
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.role}.{self.call}"


@dataclass
class Dataflow:
    """One step of an algorithm: ``calls`` over a batch whose ``data`` keys the data set provides."""

    name: str
    calls: list[ModelCall]
    data: tuple[str, ...] = ("prompts",)
    _producer: dict[str, ModelCall] = field(default_factory=dict, init=False, repr=False)
    _trains: dict[str, ModelCall] = field(default_factory=dict, init=False, repr=False)

    def validate(self) -> Dataflow:
        """Raise :class:`DataflowError` unless the graph can run; returns ``self`` for chaining.

        Checked: unique call names; role and call kinds that go together; each key produced once
        (and never a data key); every input produced by a call or the data; no cycle; at most one
        ``train_step`` per role, which is that role's last call in the step (no call of the role
        reads a key that depends on its train_step)."""
        names: set[str] = set()
        producer: dict[str, ModelCall] = {}
        trains: dict[str, ModelCall] = {}
        for c in self.calls:
            if c.name in names:
                raise DataflowError(f"{self.name}: two calls are named {c.name!r}")
            names.add(c.name)
            if c.role not in ROLES or c.call not in CALL_KINDS:
                raise DataflowError(
                    f"{self.name}: call {c.name!r}: role {c.role!r} / call {c.call!r}; roles are "
                    f"{', '.join(ROLES)} and calls {', '.join(CALL_KINDS)}"
                )
            if (c.role == "driver") != (c.call == "compute"):
                raise DataflowError(
                    f"{self.name}: call {c.name!r} ({c.label}): the driver computes and only the "
                    "driver does; models generate, run inference or train"
                )
            if c.call == "generate" and c.role != "actor":
                raise DataflowError(f"{self.name}: call {c.name!r}: only the actor generates")
            if c.call == "train_step":
                if c.role in trains:
                    raise DataflowError(
                        f"{self.name}: calls {trains[c.role].name!r} and {c.name!r} both train "
                        f"the {c.role}: one train_step per role and step"
                    )
                trains[c.role] = c
            for k in c.outputs:
                if k in self.data:
                    raise DataflowError(
                        f"{self.name}: call {c.name!r} writes key {k!r}, which the data provides"
                    )
                if k in producer:
                    raise DataflowError(
                        f"{self.name}: key {k!r} is produced by both {producer[k].name!r} and "
                        f"{c.name!r}"
                    )
                producer[k] = c
        for c in self.calls:
            for k in c.inputs:
                if k not in producer and k not in self.data:
                    raise DataflowError(
                        f"{self.name}: call {c.name!r} reads key {k!r}, which no call produces "
                        f"and the data ({', '.join(self.data)}) does not provide"
                    )
        self._producer, self._trains = producer, trains
        self._check_cycles()
        for role, train in trains.items():
            after = self._descendants(train)
            for c in self.calls:
                if c.role != role or c is train:
                    continue
                if c in after:
                    key = next(
                        k for k in c.inputs if k in producer and producer[k] in after | {train}
                    )
                    raise DataflowError(
                        f"{self.name}: version order: call {c.name!r} ({c.label}) reads key {key!r}, "
                        f"produced after {train.name!r} (the {role}'s train_step) in the same step; "
                        f"a role's train_step must be its last call"
                    )
        return self

    def _deps(self, c: ModelCall) -> list[tuple[str, ModelCall]]:
        """(key, producing call) for each input of ``c`` that a call produces."""
        return [(k, self._producer[k]) for k in c.inputs if k in self._producer]

    def _check_cycles(self) -> None:
        state: dict[str, int] = {}  # 1: on the path, 2: done
        path: list[tuple[ModelCall, str]] = []

        def visit(c: ModelCall, via: str) -> None:
            state[c.name] = 1
            path.append((c, via))
            for k, p in self._deps(c):
                if state.get(p.name) == 1:
                    start = next(i for i, (x, _) in enumerate(path) if x is p)
                    # path[i] reads key path[i+1].via from path[i+1]; the last reads k from p.
                    pairs = zip(path[start:], path[start + 1 :], strict=False)
                    hops = [(x.name, via, y.name) for (x, _), (y, via) in pairs]
                    hops.append((c.name, k, p.name))
                    text = "; ".join(f"{a!r} reads {key!r} from {b!r}" for a, key, b in hops)
                    raise DataflowError(f"{self.name}: cycle: {text}")
                if state.get(p.name) is None:
                    visit(p, k)
            path.pop()
            state[c.name] = 2

        for c in self.calls:
            if state.get(c.name) is None:
                visit(c, "")

    def _before(self, c: ModelCall) -> list[ModelCall]:
        """The calls ``c`` must follow: those it reads from and, for a train step, its role's
        other calls (which must see the weights before the step)."""
        before = [p for _, p in self._deps(c)]
        if self._trains.get(c.role) is c:
            before += [x for x in self.calls if x.role == c.role and x is not c]
        return before

    def _descendants(self, root: ModelCall) -> set[ModelCall]:
        """Calls that must follow ``root``, directly or not (also through another role's train
        step, which waits for that role's calls)."""
        out: set[ModelCall] = set()
        frontier = [root]
        while frontier:
            x = frontier.pop()
            for c in self.calls:
                if c not in out and any(p is x for p in self._before(c)):
                    out.add(c)
                    frontier.append(c)
        return out

    def order(self) -> list[list[ModelCall]]:
        """Topological levels: a call's level is one more than the highest level among the calls it
        reads from and, for a ``train_step``, its role's other calls (which must see the old
        weights). Calls in one level are independent. Validates first."""
        self.validate()
        level: dict[str, int] = {}

        def lvl(c: ModelCall) -> int:
            if c.name not in level:
                level[c.name] = 1 + max((lvl(p) for p in self._before(c)), default=-1)
            return level[c.name]

        levels: list[list[ModelCall]] = []
        for c in self.calls:
            n = lvl(c)
            levels.extend([] for _ in range(n + 1 - len(levels)))
            levels[n].append(c)
        return levels

    def describe(self) -> str:
        """One line per call, by level: ``level  name  role.call  inputs -> outputs``."""
        lines = [f"{self.name}: data provides {', '.join(self.data)}"]
        for i, calls in enumerate(self.order()):
            for c in calls:
                ins = ", ".join(c.inputs) or "-"
                outs = ", ".join(c.outputs) or "-"
                lines.append(f"  [{i}] {c.name}: {c.label} {ins} -> {outs}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Builders: one per algorithm
# --------------------------------------------------------------------------------------------------


def _generate() -> ModelCall:
    return ModelCall("generate", "actor", "generate", ("prompts",), ("responses", "behavior_logp"))


def _score(reward_model: bool, responses: str = "responses", out: str = "rewards") -> ModelCall:
    """The sequence reward: a learned reward model's forward, or asyncrl's rule reward (the
    rollout workers' ``rollout.reward``, which needs the answer)."""
    suffix = "" if responses == "responses" else "_" + responses.removesuffix("_responses")
    if reward_model:
        return ModelCall(f"reward{suffix}", "reward", "inference", ("prompts", responses), (out,))
    return ModelCall(
        f"reward_fn{suffix}", "driver", "compute", ("prompts", responses, "answers"), (out,)
    )


def _actor_extras(*, kl_loss: bool, prox: bool) -> tuple[list[ModelCall], tuple[str, ...]]:
    """The reference's log-probs for the loss's KL term; π_prox, recomputed before a batch's first
    of several updates."""
    calls, keys = [], ()
    if kl_loss:
        calls.append(ModelCall("ref", "ref", "inference", ("prompts", "responses"), ("ref_logp",)))
        keys += ("ref_logp",)
    if prox:
        calls.append(
            ModelCall("prox", "actor", "inference", ("prompts", "responses"), ("prox_logp",))
        )
        keys += ("prox_logp",)
    return calls, keys


def _data(reward_model: bool) -> tuple[str, ...]:
    return ("prompts",) if reward_model else ("prompts", "answers")


def grpo(
    *,
    advantage: str = "grpo",
    kl_loss: bool = False,
    prox: bool = False,
    reward_model: bool = False,
) -> Dataflow:
    """Group-relative policy optimisation (and Dr. GRPO, RLOO, REINFORCE++): no critic; each
    sample's advantage comes from the rewards of its prompt's group."""
    extras, keys = _actor_extras(kl_loss=kl_loss, prox=prox)
    calls = [
        _generate(),
        _score(reward_model),
        *extras,
        ModelCall("advantages", "driver", "compute", ("rewards",), ("advantages",)),
        ModelCall(
            "train_actor",
            "actor",
            "train_step",
            ("prompts", "responses", "behavior_logp", "advantages", *keys),
        ),
    ]
    return Dataflow(f"{advantage} (group advantages)", calls, _data(reward_model)).validate()


def ppo_with_critic(
    kl_reward: bool,
    *,
    vtrace: bool = False,
    kl_loss: bool = False,
    prox: bool = False,
    reward_model: bool = True,
) -> Dataflow:
    """PPO with a learned critic (classic RLHF): token-level advantages from the critic's values,
    by GAE or, for stale data, V-trace (which also needs the learner's log π_prox for π/μ). With
    ``kl_reward`` the reference's log-probs and log π_prox shape the per-token rewards
    (β·(log π_prox − log π_ref): docs/off-policy.md, "The KL-shaped reward"); with ``kl_loss`` they
    enter the actor's loss. Actor and critic train side by side on the same advantages stage."""
    adv_in = ["rewards", "values", "behavior_logp"]
    calls = [
        _generate(),
        _score(reward_model),
        ModelCall("values", "critic", "inference", ("prompts", "responses"), ("values",)),
    ]
    needs_ref = kl_reward or kl_loss
    if needs_ref:
        calls.append(ModelCall("ref", "ref", "inference", ("prompts", "responses"), ("ref_logp",)))
    if kl_reward:
        adv_in.append("ref_logp")
    actor_in = ["prompts", "responses", "behavior_logp", "advantages"]
    # V-trace's π and the KL reward's are the learner's policy before the step: π_prox
    if vtrace or kl_reward or prox:
        calls.append(
            ModelCall("prox", "actor", "inference", ("prompts", "responses"), ("prox_logp",))
        )
    if vtrace or kl_reward:
        adv_in.append("prox_logp")
    if prox:
        actor_in.append("prox_logp")
    if kl_loss:
        actor_in.append("ref_logp")
    calls += [
        ModelCall("advantages", "driver", "compute", tuple(adv_in), ("advantages", "returns")),
        ModelCall("train_actor", "actor", "train_step", tuple(actor_in)),
        ModelCall(
            "train_critic", "critic", "train_step", ("prompts", "responses", "values", "returns")
        ),
    ]
    est = "vtrace" if vtrace else "gae"
    name = f"ppo with a critic ({est}{', kl reward' if kl_reward else ''})"
    return Dataflow(name, calls, _data(reward_model)).validate()


def remax(*, kl_loss: bool = False, prox: bool = False, reward_model: bool = True) -> Dataflow:
    """ReMax: the baseline of a sample is the reward of its prompt's greedy completion, generated
    and scored alongside but not trained on. No critic, no group statistics. In asyncrl the rollout
    worker runs ``generate_greedy`` and its ``score`` (one greedy episode per group, whose reward
    travels as ``Group.baseline_reward``) and the learner the ``advantages`` call."""
    extras, keys = _actor_extras(kl_loss=kl_loss, prox=prox)
    calls = [
        _generate(),
        ModelCall("generate_greedy", "actor", "generate", ("prompts",), ("greedy_responses",)),
        _score(reward_model),
        _score(reward_model, "greedy_responses", "greedy_rewards"),
        *extras,
        ModelCall(
            "advantages", "driver", "compute", ("rewards", "greedy_rewards"), ("advantages",)
        ),
        ModelCall(
            "train_actor",
            "actor",
            "train_step",
            ("prompts", "responses", "behavior_logp", "advantages", *keys),
        ),
    ]
    return Dataflow("remax", calls, _data(reward_model)).validate()


def distill(
    *, outcome: bool = False, kl_loss: bool = False, prox: bool = False, reward_model: bool = False
) -> Dataflow:
    """On-policy distillation: the teacher scores the tokens the student sampled (forward only,
    its log-probabilities), and each token's advantage is log π_teacher − sg[log π]; with
    ``outcome`` the sample's group advantage of the rewards is added (``algorithm.distill_coef``).
    In asyncrl the rollout worker runs ``teacher`` (on ``rollout.teacher``'s servers) beside the
    reward, and the logprobs travel with the samples; ``advantages`` makes the outcome part and the
    logged reverse KL of the samplers (log μ − log π_teacher), and ``train_actor`` adds the
    teacher's part in its forward, where log π is (docs/off-policy.md, "Which π")."""
    extras, keys = _actor_extras(kl_loss=kl_loss, prox=prox)
    adv_in = ("behavior_logp", "teacher_logp") + (("rewards",) if outcome else ())
    calls = [
        _generate(),
        _score(reward_model),
        ModelCall("teacher", "teacher", "inference", ("prompts", "responses"), ("teacher_logp",)),
        *extras,
        ModelCall("advantages", "driver", "compute", adv_in, ("advantages",)),
        ModelCall(
            "train_actor",
            "actor",
            "train_step",
            ("prompts", "responses", "behavior_logp", "teacher_logp", "advantages", *keys),
        ),
    ]
    name = "on-policy distillation" + (" + outcome (grpo)" if outcome else "")
    return Dataflow(name, calls, _data(reward_model)).validate()


def sft() -> Dataflow:
    """Supervised fine-tuning: the actor trains on the data's completions; nothing is generated."""
    calls = [ModelCall("train_actor", "actor", "train_step", ("prompts", "completions"))]
    return Dataflow("sft", calls, ("prompts", "completions")).validate()


def reward_modelling() -> Dataflow:
    """A reward model trained on preference pairs (Bradley–Terry): one train_step on the data."""
    calls = [ModelCall("train_reward", "reward", "train_step", ("prompts", "chosen", "rejected"))]
    return Dataflow("reward modelling", calls, ("prompts", "chosen", "rejected")).validate()


def from_recipe(recipe: Recipe) -> Dataflow:
    """The dataflow of a recipe's ``algorithm.loss`` and ``algorithm.advantage``.

    The reward call is the reward model's (``reward.inference``) when ``rollout.reward: model``
    scores with it alone, else the rule reward's (``driver.compute``, which reads the answers; a
    model score added to a rule is part of that call)."""
    alg, lc = recipe.algorithm, recipe.learner
    if alg.loss == "sft":
        return sft()
    if alg.loss == "reward_model":
        return reward_modelling()
    # The learner recomputes π_prox in a forward-only pass when a batch gets several updates, and
    # for m2po, whose mask is cut over the whole batch before its first update.
    prox = lc.minibatches * lc.epochs > 1 or alg.loss == "m2po"
    model_only = recipe.rollout.reward == "model"
    common = {"kl_loss": alg.kl_coef > 0, "prox": prox, "reward_model": model_only}
    if alg.advantage in ("gae", "vtrace"):
        return ppo_with_critic(alg.kl_reward_coef > 0, vtrace=alg.advantage == "vtrace", **common)
    if alg.advantage == "remax":
        return remax(**common)
    if alg.advantage == "distill":
        return distill(outcome=alg.distill_coef > 0, **common)
    return grpo(advantage=alg.advantage, **common)

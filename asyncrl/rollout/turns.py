"""A multi-turn trajectory as one sample per model turn, its reward discounted per turn (pure).

By default a multi-turn episode (``multi_turn``, an agent on the recording client) is one sample:
the whole conversation, with loss_mask 1 on the model's tokens. ``rollout.turn_samples`` trains
each model turn as its own sample instead (AReaL's "individual" export): turn t's prompt is the
conversation before it (the tokens the engine saw for that call: the token-consistency rule of
:mod:`asyncrl.agents.recording` makes them a prefix of the trajectory), its completion the tokens
the model produced in that turn. The trajectory's reward R goes to its last turn, and each earlier
turn gets it discounted by the turns after it: turn t of T gets γ^(T-1-t)·R
(``rollout.turn_discount``; AReaL's ``apply_reward_discount`` with the reward on the last call).

The turns stay one episode for the learner. Each carries its place, ``metadata["episode"]`` (the
trajectory's sample id), ``["turn"]`` t and ``["turns_trained"]`` T (:func:`turn_of` reads them back;
metadata crosses the wire as it is), and the group estimators take their baseline over episodes,
each turn getting γ^(T-1-t) times its episode's advantage
(:func:`asyncrl.learner.advantages.compute_advantages`): an episode's own turns are no part of its
baseline, and a long episode weighs as much as a short one. Each turn also carries the trajectory's
finish reason: its reward is the trajectory's, so a trajectory cut at ``max_new_tokens`` is cut for
every turn, and the overlong filter masks them all (the buffer's ``overlong_samples`` then counts
each turn, the samples it masked).

A model turn is a maximal run of loss_mask-1 tokens: two calls with nothing between them (the
agent asked the model to go on) are one turn.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from asyncrl import wire


class TurnOf(NamedTuple):
    """A per-turn sample's place: turn ``turn`` of the ``turns`` trained turns of ``episode``, the
    trajectory's sample id (``<group>/<episode>``; its turns' ids are ``<episode>.<turn>``)."""

    episode: str
    turn: int
    turns: int


def turn_of(sample: wire.Sample) -> TurnOf | None:
    """Where :func:`split_turns` put ``sample``; None for a whole episode (not split, or left whole
    for want of a trained token)."""
    m = sample.metadata
    if not {"episode", "turn", "turns_trained"} <= m.keys():
        return None
    return TurnOf(str(m["episode"]), int(m["turn"]), int(m["turns_trained"]))


def turn_spans(loss_mask: np.ndarray) -> list[tuple[int, int]]:
    """The [start, end) of each maximal run of trained tokens, in order."""
    m = np.concatenate([[0], (np.asarray(loss_mask) > 0).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(m))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def split_turns(sample: wire.Sample, discount: float = 1.0) -> list[wire.Sample]:
    """``sample`` as one sample per model turn (module docstring). A sample with no trained token
    stays whole: there is no turn to give it to, and the learner skips it as before."""
    spans = turn_spans(sample.loss_mask)
    if not spans:
        return [sample]
    turns = len(spans)
    out = []
    for t, (a, b) in enumerate(spans):
        prompt = np.concatenate([sample.prompt_ids, sample.completion_ids[:a]])
        out.append(
            dataclasses.replace(
                sample,
                id=f"{sample.id}.{t}",
                prompt_ids=prompt.astype(np.int32),
                completion_ids=sample.completion_ids[a:b],
                behavior_logprobs=sample.behavior_logprobs[a:b],
                versions=sample.versions[a:b],
                loss_mask=sample.loss_mask[a:b],
                teacher_logprobs=sample.teacher_logprobs[a:b]
                if sample.teacher_logprobs.size
                else sample.teacher_logprobs,
                # the turn's input positions: its prompt and its tokens but the last
                routed_experts=sample.routed_experts[: len(prompt) + b - a - 1]
                if sample.routed_experts.size
                else sample.routed_experts,
                reward=sample.reward * discount ** (turns - 1 - t),
                finish_reason=sample.finish_reason,  # the trajectory's, as its reward (docstring)
                metadata={
                    **sample.metadata,
                    "episode": sample.id,
                    "turn": t,
                    "turns_trained": turns,
                },
            )
        )
    return out

"""A multi-turn trajectory as one sample per model turn, its reward discounted per turn (pure).

By default a multi-turn episode (``multi_turn``, an agent on the recording client) is one sample:
the whole conversation, with loss_mask 1 on the model's tokens. ``rollout.turn_samples`` trains
each model turn as its own sample instead (AReaL's "individual" export): turn t's prompt is the
conversation before it (the tokens the engine saw for that call: the token-consistency rule of
:mod:`asyncrl.rollout.recording` makes them a prefix of the trajectory), its completion the tokens
the model produced in that turn. The trajectory's reward R goes to its last turn, and each earlier
turn gets it discounted by the turns after it: turn t of T gets γ^(T-1-t)·R
(``rollout.turn_discount``; AReaL's ``apply_reward_discount`` with the reward on the last call).
The learner then normalises the group's advantages over all its turns' samples.

A model turn is a maximal run of loss_mask-1 tokens: two calls with nothing between them (the
agent asked the model to go on) are one turn.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from asyncrl import wire


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
        last = t == turns - 1
        out.append(
            dataclasses.replace(
                sample,
                id=f"{sample.id}.{t}",
                prompt_ids=prompt.astype(np.int32),
                completion_ids=sample.completion_ids[a:b],
                behavior_logprobs=sample.behavior_logprobs[a:b],
                versions=sample.versions[a:b],
                loss_mask=sample.loss_mask[a:b],
                reward=sample.reward * discount ** (turns - 1 - t),
                # only the last turn ended the episode; an earlier one ended where the model stopped
                finish_reason=sample.finish_reason if last else "stop",
                metadata={**sample.metadata, "turn": t, "turns_trained": turns},
            )
        )
    return out

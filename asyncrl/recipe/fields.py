"""What every section of the recipe is built from: the choices' names (``Literal`` types every
other module derives its own from), :func:`setting` (a field with its doc and its range, which the
loader checks) and :class:`RecipeError`, the one error a bad recipe raises. Its own file because
each section file and the loader read it, and it reads nothing of theirs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Literal

# The single list of each choice's names: every other module derives its own from these with
# ``typing.get_args`` (losses, advantages, the engine's pause modes, the memory plan).
Dtype = Literal["float32", "bfloat16", "float16"]
GeneratorKind = Literal["builtin", "sglang"]
EngineDevice = Literal["auto", "cpu", "cuda"]
Loss = Literal["ppo", "decoupled_ppo", "tis", "cispo", "gspo", "m2po", "sft", "reward_model"]
OFFLINE_LOSSES = ("sft", "reward_model")
"""Losses trained from a local data set: no rollouts, no buffer, no weight broadcast."""
RewardNorm = Literal["none", "running", "fixed"]
RewardInput = Literal["ids", "text"]
Advantage = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae", "vtrace", "remax", "distill"]
Aggregation = Literal["auto", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
Checkpointing = Literal["none", "selective", "full"]
PauseMode = Literal["in_place", "retract"]


TOKEN_ADVANTAGES: tuple[Advantage, ...] = ("gae", "vtrace")
"""The advantages computed per token from a critic's values (the others are per sample)."""


class RecipeError(ValueError):
    """A recipe is invalid. ``str(e)`` is one line naming the file, the key and the problem."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None):
        self.file, self.key, self.detail = file, key, message
        where = ": ".join(x for x in (file, key) if x)
        super().__init__(f"{where}: {message}" if where else message)


def _range(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> dict:
    return {"lo": lo, "hi": hi, "lo_open": lo_open}


def setting(default: Any = dataclasses.MISSING, *, factory: Any = None, doc: str = "", **rng: Any):
    """A dataclass field with its ``doc`` and, given ``lo``/``hi``/``lo_open``, its range."""
    meta = {"doc": doc, **({"range": _range(**rng)} if rng else {})}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)

"""A rollout worker's settings, taken from its recipe in one place (:meth:`WorkerConfig.from_recipe`).

Apart from the worker so that the parts it assembles (groups, sender) can name the type without
importing the worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.recipe import Recipe


@dataclass(kw_only=True)
class WorkerConfig:
    worker_id: str
    group_size: int = 8
    max_concurrent_groups: int = 16
    max_staleness: int = 1
    prompt_key: str = "prompt"
    chat_template: bool = False
    max_prompt_tokens: int = 0  # 0: no limit; longer prompts are reported and skipped
    put_batch: int = 8  # groups per Put message
    shutdown_timeout_s: float = 10.0  # bound on giving starts back when stopping
    retry_s: float = 0.2  # first back-off after a failed buffer call (doubles, up to 5 s)
    acquire_idle_s: float = 1.0  # wait before asking again after a grant of 0
    metrics_every_s: float = 10.0
    max_consecutive_failures: int = 20  # groups failing in a row before the worker gives up
    max_groups: int = 0  # stop after this many groups are delivered (0: run until cancelled)
    greedy_baseline: bool = False  # ReMax: each group also plays one greedy episode (its baseline)
    turn_samples: bool = False  # each model turn its own sample (rollout/turns.py)
    turn_discount: float = 1.0  # turn t of T gets γ^(T-1-t)·R
    acked_log: str = ""  # JSONL file for the ids of acknowledged groups (exactly-once audits)
    learner_silence_s: float = 10.0  # no version announcement this long, then one: a restart
    end_release_s: float = 3.0  # after the run's end: bound on giving starts back
    # the learner says it sends none of our generators weights this long on end: stop (a dropped
    # generator that answers again rejoins at the learner's next version or idle publish, which
    # come at least every weights.timeout_s while it waits for data)
    dropped_limit_s: float = 180.0

    @classmethod
    def from_recipe(
        cls, r: Recipe, worker_id: str, *, max_groups: int = 0, acked_log: str = ""
    ) -> WorkerConfig:
        """The worker's settings from its recipe (the rest keep their defaults)."""
        ro = r.rollout
        return cls(
            worker_id=worker_id,
            group_size=ro.group_size,
            max_concurrent_groups=ro.max_concurrent_groups,
            max_staleness=r.buffer.max_staleness,
            prompt_key=r.data.prompt_key,
            chat_template=r.data.chat_template,
            max_prompt_tokens=max(r.model.max_seq_len - ro.max_new_tokens, 1),
            max_groups=max_groups,
            greedy_baseline=r.algorithm.advantage == "remax" and r.algorithm.uses_rollouts,
            turn_samples=ro.turn_samples,
            turn_discount=ro.turn_discount,
            acked_log=acked_log,
            dropped_limit_s=3 * r.weights.timeout_s,
        )

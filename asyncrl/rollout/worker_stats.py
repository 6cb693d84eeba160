"""A rollout worker's counters: what its parts (groups, sender, worker) count as they go, read by its
metrics line and its summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.rollout.leases import LeaseBook


@dataclass
class WorkerStats:
    """Counters since the start (cumulative) and a window since the last metrics line."""

    counters: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            [
                "groups_started",
                "groups_delivered",
                "groups_rejected",
                "groups_cancelled_stale",
                "groups_cancelled_lease",
                "groups_failed",
                "groups_dropped_reward_failures",  # too few rewards computed (group_maker.py)
                "episodes",
                "tokens_generated",
                "greedy_tokens_generated",  # ReMax's baseline episodes (not trained on)
                "reward_failures",
                "remax_baseline_failures",  # groups sent without a greedy baseline
                "prompts_skipped",
                "put_resends",
                "put_messages",
                "acquires",
                "grants_zero",
                "releases",
                "resumes",
                "registrations",
                "tool_calls",  # by multi-turn episodes (metadata["tool_calls"])
                "tool_errors",  # error results the model saw, timeouts included
                "tool_timeouts",
                "tool_call_episodes",  # episodes with >= 1 valid tool call (Episode.made_tool_call)
            ],
            0,
        )
    )
    rewards: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    greedy_rewards: list[float] = field(default_factory=list)  # ReMax's baselines
    weights_wait_s: float = 0.0  # admission held: no generator within the version bound
    peak_episodes_in_flight: int = 0
    leases: LeaseBook = field(default_factory=LeaseBook)  # the worker's starts

    @property
    def max_in_flight_over_granted(self) -> int:
        """Must stay <= 0: the admission invariant."""
        return self.leases.max_over_granted

    @property
    def peak_groups_in_flight(self) -> int:
        return self.leases.peak_in_flight

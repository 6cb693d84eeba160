"""The rewards' old import path: they moved a floor down, to :mod:`asyncrl.rewards` (issue #47),
where rollout/ and the reward model (:mod:`asyncrl.served`) both use them. Code written against
this path fails here with one line naming the new one."""

raise ImportError(
    "asyncrl.rollout.rewards moved to asyncrl.rewards: import asyncrl.rewards instead",
    name=__name__,
)

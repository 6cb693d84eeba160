"""Old path of :mod:`asyncrl.served.teacher` (issue #47): fails with one line naming it."""

raise ImportError(
    "asyncrl.rollout.teacher moved to asyncrl.served.teacher: import asyncrl.served.teacher instead",
    name=__name__,
)

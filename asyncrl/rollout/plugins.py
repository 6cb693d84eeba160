"""Old path of :mod:`asyncrl.plugins` (issue #47): fails with one line naming it."""

raise ImportError(
    "asyncrl.rollout.plugins moved to asyncrl.plugins: import asyncrl.plugins instead",
    name=__name__,
)

"""Old path of :mod:`asyncrl.served.server_batches` (issue #47): fails with one line naming it."""

raise ImportError(
    "asyncrl.rollout.server_batches moved to asyncrl.served.server_batches: import asyncrl.served.server_batches instead",
    name=__name__,
)

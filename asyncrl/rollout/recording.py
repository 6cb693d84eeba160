"""Old path of :mod:`asyncrl.agents.recording` (issue #47): fails with one line naming it."""

raise ImportError(
    "asyncrl.rollout.recording moved to asyncrl.agents.recording: import asyncrl.agents.recording instead",
    name=__name__,
)

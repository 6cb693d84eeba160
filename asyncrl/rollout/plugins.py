"""The plug-in loader's old import path: it moved to :mod:`asyncrl.plugins` (issue #47), a floor
below the rooms that load user code by import path (agents/, rollout/). Code written against this
path fails here with one line naming the new one."""

raise ImportError(
    "asyncrl.rollout.plugins moved to asyncrl.plugins: import asyncrl.plugins instead",
    name=__name__,
)

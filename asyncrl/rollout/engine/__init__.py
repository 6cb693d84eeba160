"""The built-in engine's old import path. The engine is a process of its own and moved to a room
of its own, :mod:`asyncrl.engine` (issue #47); code written against this path fails here with one
line naming the new one (``python -m asyncrl.rollout.engine.server`` too)."""

raise ImportError(
    "asyncrl.rollout.engine moved to asyncrl.engine: import asyncrl.engine instead", name=__name__
)

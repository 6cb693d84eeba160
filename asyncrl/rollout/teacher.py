"""An old import path: the clients of the model servers a run serves beside the policy (the
reward model, the distillation teacher, their batches) moved to a room of their own,
:mod:`asyncrl.served` (issue #47). Code written against this path fails here with one line naming
the new one."""

raise ImportError(
    "asyncrl.rollout.teacher moved to asyncrl.served.teacher: import asyncrl.served.teacher instead",
    name=__name__,
)

"""An old import path: the clients of the model servers a run serves beside the policy (the
reward model, the distillation teacher, their batches) moved to a room of their own,
:mod:`asyncrl.served` (issue #47). Code written against this path fails here with one line naming
the new one."""

raise ImportError(
    "asyncrl.rollout.server_batches moved to asyncrl.served.server_batches: import asyncrl.served.server_batches instead",
    name=__name__,
)

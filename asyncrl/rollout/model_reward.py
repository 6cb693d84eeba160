"""An old import path: the clients of the model servers a run serves beside the policy (the
reward model, the distillation teacher, their batches) moved to a room of their own,
:mod:`asyncrl.served` (issue #47). Code written against this path fails here with one line naming
the new one."""

raise ImportError(
    "asyncrl.rollout.model_reward moved to asyncrl.served.model_reward: import asyncrl.served.model_reward instead",
    name=__name__,
)

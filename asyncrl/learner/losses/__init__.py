"""The learner's losses, pure logic on packed, flat token tensors (docs/off-policy.md):

- :mod:`~asyncrl.learner.losses.policy`: the policy losses and ``policy_loss``, the step's
  policy term;
- :mod:`~asyncrl.learner.losses.kl_penalty`: the KL penalty toward the reference policy, a
  regulariser the policy term adds;
- :mod:`~asyncrl.learner.losses.scalar`: the scalar-head models' losses (a critic's values, a
  reward model's scores);
- :mod:`~asyncrl.learner.losses.aggregation`: how per-token losses add up to a step's loss (the
  token weights);
- :mod:`~asyncrl.learner.losses.stats`: what the losses return as sums, and the metrics made of
  them.
- :mod:`~asyncrl.learner.losses.staleness_stats`: the same per staleness k (the staleness view).
"""

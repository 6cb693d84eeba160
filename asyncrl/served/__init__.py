"""Served models (docs/reward-models.md, docs/distill.md): the clients of the models a run serves
beside the policy, on servers of their own, asked in batches.

- :mod:`asyncrl.served.model_reward`: a learned reward model's ``/classify`` scores, added to the
  rule reward (:mod:`asyncrl.rewards`);
- :mod:`asyncrl.served.teacher`: the distillation teacher's logprobs on ``/generate``;
- :mod:`asyncrl.served.server_batches`: the batches both travel in, server to server.

Starting those servers is the launcher's (:mod:`asyncrl.launch.model_servers`). A room below
rollout/ (tests/test_import_graph.py): a worker scores its episodes with these.
"""

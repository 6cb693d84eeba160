"""Rollout workers (docs/design.md §6): prompts → workflows → generators → rewards → whole groups to the buffer.

- :mod:`asyncrl.rollout.generator_pool`: the generator pool, SGLang ``/generate`` over HTTP
  (version bound, abort resume, load spreading, batching) for SGLang servers and the built-in engine alike;
  :mod:`asyncrl.rollout.sglang_protocol`: the protocol itself, pure (requests, parsed responses,
  per-token versions); the HTTP calls go through :mod:`asyncrl.generator_http`, as the weight
  broadcaster's and the reward model's do.
- :mod:`asyncrl.rollout.workflows`: single-turn and multi-turn (tool-calling) episodes; user
  workflows by import path. The types they are written against: :mod:`asyncrl.contract`; the tools
  they call (Python functions, MCP servers) and agents on the OpenAI API: :mod:`asyncrl.agents`.
- the rewards the worker runs: the rule rewards (:mod:`asyncrl.rewards`: exact match, math-verify,
  user rewards, run with timeouts, a floor down, shared with the reward model) and the served
  models' (:mod:`asyncrl.served`: a reward model's scores, a distillation teacher's logprobs).
- :mod:`asyncrl.rollout.prompts`: the prompts, from local datasets, with a resumable position.
- :mod:`asyncrl.rollout.group_maker`: one prompt → its episodes → their rewards → one group;
  :mod:`asyncrl.rollout.buffer_sender`: finished groups to the buffer, each exactly once.
- :mod:`asyncrl.rollout.held_out_eval`: held-out evaluation through the generators.
- :mod:`asyncrl.rollout.worker`: the trio worker; :mod:`asyncrl.rollout.main`: ``asyncrl rollout``.
- the built-in generator is a room of its own, :mod:`asyncrl.engine` (a process of its own:
  :func:`asyncrl.rollout.main.spawn_engines` starts a worker's engines).
"""

"""The metric keys that asyncrl itself reads back: the plots, summary.json, the progress line and
the benchmarks read these exact names, and the processes emit them under these names
(tests/test_e2e.py::test_rl_run_bounds_staleness_and_logs_it checks that a real run logs every one).
The other keys are for people (README "Reading the dashboard"). A name ending in ``/`` is a family:
one key per bucket, the bucket after the slash.
"""

from __future__ import annotations

# -- the rollout worker, one record per interval (process worker…) -------------------------------
REWARD_MEAN = "rollout/reward_mean"
RESPONSE_LENGTH_MEAN = "rollout/response_length_mean"
GENERATED_TOKENS_PER_S = "rollout/tokens_per_s"
GENERATOR_IDLE = "rollout/generator_idle_fraction"

# -- the held-out evaluation, at step = the version evaluated (process eval) ----------------------
EVAL_SUCCESS = "eval/success"

# -- the learner, one record per version (process learner) ---------------------------------------
LOSS = "loss"
ENTROPY = "loss/entropy"
GRAD_NORM = "grad_norm"
# the trained batch's samples: every step has one (the worker's rollout/* are per 10 s interval, over
# every scored episode, also those of groups the buffer then drops: stale, or with equal rewards)
BATCH_REWARD_MEAN = "learner/reward_mean"
BATCH_RESPONSE_LENGTH_MEAN = "learner/response_length_mean"  # completion tokens, as the worker's
TRAINED_TOKENS = "learner/tokens"
TRAINED_TOKENS_PER_S = "learner/trained_tokens_per_s"
BATCH_WAIT_S = "buffer/wait_s"  # rank 0 waiting for the batch it trained on
STALENESS_MEAN = "buffer/staleness_mean"
STALENESS_MAX = "buffer/staleness_max"
STALENESS_BOUND = "buffer/max_staleness"  # eta
STALENESS_HIST = "staleness_hist/"  # the batch's groups by staleness 0..eta
DROPPED_STALE = "buffer/dropped_stale"  # groups dropped as stale so far (cumulative)
DRIFT_MISMATCH = "drift/mismatch_kl"
DRIFT_KL = "drift/kl"  # KL(μ ‖ π_prox) over every trained token, all staleness (k3)
DRIFT_KV_MIXED = "drift/kv_mixed_kl"
DRIFT_BY_STALENESS = "drift/staleness_kl/"  # 1..eta
# the staleness view, per staleness k = 0..eta (learner/losses/staleness_stats.py; by_staleness.png;
# its KL to the learner is drift's above): are old samples teaching?
STALENESS_TOKENS = "staleness/tokens/"  # trained tokens, summed over the step's updates
STALENESS_ESS = "staleness/ess/"  # of the importance weights pi_prox/mu
STALENESS_MASKED = "staleness/masked_frac/"  # trained tokens a mask dropped from the loss
STALENESS_CLIPPED = "staleness/clipped_frac/"  # ... kept, but a clip or the IS cap cut
STALENESS_ADV_ABS = "staleness/adv_abs_mean/"  # mean |A| over the trained tokens
STALENESS_REWARD = "staleness/reward_mean/"  # mean reward of the batch's groups of staleness k
WEIGHT_SYNC_S = "weights/sync_s"
PAUSE_S = "weights/pause_s/"  # per generator (host:port)

# -- the reward-model learner (algorithm.loss: reward_model), one record per version -------------
RM_LOSS = "rm/loss"  # mean Bradley-Terry loss over the batch's pairs
RM_ACCURACY = "rm/accuracy"  # the batch's pairs ranked right (before the update)
RM_MARGIN = "rm/margin"  # mean r_chosen - r_rejected
RM_EVAL_ACCURACY = (
    "rm/eval_accuracy"  # held-out pairs ranked right; summary.json's rm_eval_accuracy
)

READ_BY_ASYNCRL = (
    REWARD_MEAN,
    RESPONSE_LENGTH_MEAN,
    GENERATED_TOKENS_PER_S,
    GENERATOR_IDLE,
    EVAL_SUCCESS,
    LOSS,
    ENTROPY,
    GRAD_NORM,
    BATCH_REWARD_MEAN,
    BATCH_RESPONSE_LENGTH_MEAN,
    TRAINED_TOKENS,
    TRAINED_TOKENS_PER_S,
    BATCH_WAIT_S,
    STALENESS_MEAN,
    STALENESS_MAX,
    STALENESS_BOUND,
    STALENESS_HIST,
    DRIFT_MISMATCH,
    DRIFT_KV_MIXED,
    DRIFT_BY_STALENESS,
    STALENESS_TOKENS,
    STALENESS_ESS,
    STALENESS_MASKED,
    STALENESS_CLIPPED,
    STALENESS_ADV_ABS,
    STALENESS_REWARD,
    WEIGHT_SYNC_S,
    PAUSE_S,
)
"""Every name above: a real RL run logs each (a family: at least one bucket)."""

# -- ReMax only (algorithm.advantage: remax): the greedy episode each group's baseline comes from --
GREEDY_TOKENS = "rollout/greedy_tokens_generated"  # generated, not trained on (a worker counter)
GREEDY_REWARD_MEAN = "rollout/greedy_reward_mean"  # the baselines' mean over the interval
REMAX_BASELINE_FAILURES = "rollout/remax_baseline_failures"  # groups sent without a baseline
REMAX_MEAN_BASELINES = "learner/remax_mean_baselines"  # the batch's groups without one (mean used)

READ_WHEN_REMAX = (GREEDY_TOKENS, GREEDY_REWARD_MEAN, REMAX_BASELINE_FAILURES, REMAX_MEAN_BASELINES)
"""Every ReMax name above: a real ReMax run logs each as well (tests/test_e2e.py checks)."""

# -- PPO with a critic only (algorithm.advantage: gae / vtrace), one record per version -----------
VALUE_LOSS = "critic/value_loss"  # the clipped value loss, mean over the version's updates
EXPLAINED_VARIANCE = "critic/explained_variance"  # of the returns by the values, before the update
VALUE_CLIP_FRAC = "loss/value_clip_frac"  # trained tokens whose clipped value term was the larger

READ_WHEN_CRITIC = (VALUE_LOSS, EXPLAINED_VARIANCE, VALUE_CLIP_FRAC)
"""Every critic name above: a real run with a critic logs each (tests/test_e2e.py checks)."""

# -- with tools (rollout.tools, or a workflow's own): episodes that made >= 1 valid tool call (one
# the tool answered without an error), as a fraction of the episodes -----------------------------
EVAL_TOOL_CALL_RATE = "eval/tool_call_rate"  # held-out; summary.json's tool_call_rate_start/_end
ROLLOUT_TOOL_CALL_RATE = "rollout/tool_call_rate"  # the worker's episodes over the interval

READ_WHEN_TOOLS = (EVAL_TOOL_CALL_RATE, ROLLOUT_TOOL_CALL_RATE)
"""Every tools name above: a real run with tools logs each (tests/agents/test_demo_agent.py
checks)."""

# -- on-policy distillation only (algorithm.advantage: distill), one record per version ----------
DISTILL_REVERSE_KL = "distill/reverse_kl"  # mean of log μ_t − log π_teacher,t over trained tokens

READ_WHEN_DISTILL = (DISTILL_REVERSE_KL,)
"""Every distillation name above: a real distillation run logs each."""

# -- a mixture-of-experts policy whose samples carry the generator's routes (docs/moe.md) --------
# (token, MoE layer) routings of the step's forwards whose top-k set equals the generator's
ROUTING_AGREEMENT = "learner/routing_agreement"
# the auxiliary load-balancing loss of the actor's training forwards (algorithm.moe_aux_loss_coef
# > 0): E·Σ_e f_e·P_e, unweighted, mean over the step's updates (top_k when balanced)
MOE_AUX = "loss/moe_aux"

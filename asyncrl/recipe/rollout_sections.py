"""The sections the rollout workers read: ``rollout`` (sampling, rewards, tools, turns) with the
models they ask besides the policy (``rollout.reward_model``, ``rollout.teacher``, which `asyncrl
run` may serve), and ``generator`` (the engines or SGLang servers they sample from).
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.recipe.fields import EngineDevice, GeneratorKind, RewardInput, RewardNorm, setting


@dataclass(kw_only=True)
class RewardModelConfig:
    urls: list[str] = setting(
        factory=list, doc="/classify servers (SGLang or `asyncrl engine` on a reward model folder)"
    )
    path: str = setting(
        "",
        doc="a sequence-classification folder (relative to the recipe) that `asyncrl run` serves "
        "on `servers` built-in engines and gives the workers as urls; exclusive with urls",
    )
    servers: int = setting(1, lo=1, doc="built-in /classify servers `asyncrl run` starts on path")
    weight: float = setting(1.0, doc="the sample's reward adds weight x the (normalised) score")
    timeout_s: float = setting(30.0, lo=0, lo_open=True, doc="one /classify request's bound")
    batch_size: int = setting(16, lo=1, doc="completions per /classify request")
    input: RewardInput = setting(
        "ids", doc="ids: prompt + completion token ids (one tokenizer); text: the server tokenizes"
    )
    normalize: RewardNorm = setting(
        "none",
        doc="running: (s - mean) / std of the scores seen so far; fixed: (s - shift) / scale",
    )
    shift: float = setting(0.0)
    scale: float = setting(1.0, lo=0, lo_open=True)

    @property
    def enabled(self) -> bool:
        return bool(self.urls or self.path)


@dataclass(kw_only=True)
class TeacherConfig:
    """The teacher of on-policy distillation (``algorithm.advantage: distill``, docs/distill.md):
    a causal LM whose log-probabilities of the student's sampled tokens the workers ask for, on
    ``/generate`` (SGLang, or `asyncrl engine`) with no new tokens. It must share the student's
    tokenizer: the same token ids are scored."""

    urls: list[str] = setting(
        factory=list, doc="/generate servers of the teacher (SGLang or `asyncrl engine`)"
    )
    path: str = setting(
        "",
        doc="the teacher's HF folder (relative to the recipe) that `asyncrl run` serves on "
        "`servers` built-in engines and gives the workers as urls; exclusive with urls",
    )
    servers: int = setting(1, lo=1, doc="built-in teacher servers `asyncrl run` starts on path")
    timeout_s: float = setting(60.0, lo=0, lo_open=True, doc="one teacher request's bound")
    batch_size: int = setting(16, lo=1, doc="sequences per teacher request")

    @property
    def enabled(self) -> bool:
        return bool(self.urls or self.path)


@dataclass(kw_only=True)
class RolloutConfig:
    workers: int = setting(1, lo=0, doc="rollout worker processes started by `asyncrl run`")
    group_size: int = setting(8, lo=1, doc="samples per prompt (GRPO's n)")
    max_concurrent_groups: int = setting(16, lo=1, doc="groups in flight per worker")
    workflow: str = setting(
        "single_turn", doc="single_turn, multi_turn, or an import path module:fn"
    )
    reward: str = setting(
        "exact_match",
        doc="exact_match, math, an import path module:fn, or model (rollout.reward_model alone)",
    )
    eval_reward: str = setting(
        "",
        doc="the held-out evaluation's reward: empty = the rollouts' (rollout.reward and the reward "
        "model); a rule (exact_match, math, module:fn) scores against the data's answers instead, "
        "e.g. the ground truth of a policy trained on a reward model alone",
    )
    reward_timeout_s: float = setting(10.0, lo=0, lo_open=True)
    reward_weight: float = setting(
        1.0, doc="weight of rollout.reward when a reward model adds to it"
    )
    reward_model: RewardModelConfig = setting(factory=RewardModelConfig)
    teacher: TeacherConfig = setting(
        factory=TeacherConfig, doc="algorithm.advantage: distill's teacher (its logprobs)"
    )
    tools: list[str] = setting(
        factory=list,
        doc="multi_turn's tools: import paths of functions, MCP servers 'mcp:stdio:<command line>' "
        "or 'mcp:http://host:port/mcp' (streamable HTTP)",
    )
    tool_timeout_s: float = setting(
        30.0, lo=0, lo_open=True, doc="per tool call; a call cut is an error"
    )
    max_turns: int = setting(4, lo=1)
    turn_samples: bool = setting(
        False,
        doc="multi-turn episodes: train each model turn as its own sample (its prompt: the "
        "conversation before it) instead of the whole trajectory as one (AReaL's individual export)",
    )
    turn_discount: float = setting(
        1.0,
        lo=0,
        hi=1,
        doc="with turn_samples: turn t of T gets the trajectory's reward R as γ^(T-1-t)·R, and "
        "γ^(T-1-t) times its episode's advantage (the group baseline is over episodes)",
    )
    temperature: float = setting(
        1.0,
        lo=0,
        doc="> 0 for RL losses (0, greedy, is refused: the reported logprobs are not the sampler's)",
    )
    top_p: float = setting(1.0, lo=0, hi=1, lo_open=True)
    top_k: int = setting(-1, lo=-1)
    min_p: float = setting(0.0, lo=0, hi=1)
    max_new_tokens: int = setting(256, lo=1)
    stop: list[str] = setting(factory=list)
    request_timeout_s: float = setting(600.0, lo=0, lo_open=True)

    @property
    def logprob_temperature(self) -> float:
        """The T of the behaviour logprobs generators report, log_softmax(logits / T): SGLang and the
        built-in engine scale by the sampling temperature, and greedy requests (T = 0) are unscaled."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclass(kw_only=True)
class GeneratorConfig:
    kind: GeneratorKind = setting("builtin")
    urls: list[str] = setting(factory=list, doc="SGLang server URLs (kind: sglang)")
    engines_per_worker: int = setting(
        1, lo=0, doc="built-in engines each worker starts (kind: builtin)"
    )
    host: str = setting(
        "",
        doc="where built-in engines listen (the learner calls them); empty: 127.0.0.1 with the "
        "learner on this host, else this host's address on the route to it (docs/multinode.md)",
    )
    base_port: int = setting(0, lo=0, hi=65535, doc="0: pick free ports")
    max_batch_size: int = setting(64, lo=1, doc="built-in engine: running requests per decode step")
    device: EngineDevice = setting(
        "auto",
        doc="built-in engine: auto = cuda when torch sees a GPU, else cpu. On cuda it runs in "
        "model.dtype and receives weights over NCCL; on cpu in float32, over gloo (as always)",
    )
    startup_timeout_s: float = setting(300.0, lo=0, lo_open=True)

"""The recipe: one typed schema for everything a user can set, loaded from YAML with dotted overrides.

Every field a process reads lives here. Validation errors name the file, the dotted key and what was
expected (with a "did you mean" for misspelt keys), and are raised as :class:`RecipeError` so that the
CLI can print one line and exit 2 instead of a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

# The single list of each choice's names: every other module derives its own from these with
# ``typing.get_args`` (losses, advantages, the engine's pause modes, the memory plan).
Dtype = Literal["float32", "bfloat16", "float16"]
GeneratorKind = Literal["builtin", "sglang"]
EngineDevice = Literal["auto", "cpu", "cuda"]
Loss = Literal["ppo", "decoupled_ppo", "tis", "cispo", "gspo", "sft", "reward_model"]
OFFLINE_LOSSES = ("sft", "reward_model")
"""Losses trained from a local data set: no rollouts, no buffer, no weight broadcast."""
RewardNorm = Literal["none", "running", "fixed"]
RewardInput = Literal["ids", "text"]
Advantage = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae", "vtrace", "remax", "distill"]
Aggregation = Literal["auto", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
Checkpointing = Literal["none", "selective", "full"]
PauseMode = Literal["in_place", "retract"]


TOKEN_ADVANTAGES: tuple[Advantage, ...] = ("gae", "vtrace")
"""The advantages computed per token from a critic's values (the others are per sample)."""


class RecipeError(ValueError):
    """A recipe is invalid. ``str(e)`` is one line naming the file, the key and the problem."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None):
        self.file, self.key, self.detail = file, key, message
        where = ": ".join(x for x in (file, key) if x)
        super().__init__(f"{where}: {message}" if where else message)


def _range(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> dict:
    return {"lo": lo, "hi": hi, "lo_open": lo_open}


def _f(default: Any = dataclasses.MISSING, *, factory: Any = None, doc: str = "", **rng: Any):
    meta = {"doc": doc, **({"range": _range(**rng)} if rng else {})}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class RunConfig:
    name: str = _f("run", doc="run folder name under output_dir")
    output_dir: str = _f("runs")
    seed: int = _f(0, lo=0)
    steps: int = _f(100, lo=0, doc="optimizer steps (policy versions) to train")
    resume: bool = _f(False, doc="continue from the run folder's latest checkpoint")
    eval_every: int = _f(
        0, lo=0, doc="evaluate held-out prompts every k versions (0: start/end only)"
    )
    eval_prompts: int = _f(128, lo=0)
    timeout_s: float = _f(3600.0, lo=0, lo_open=True, doc="whole-run wall clock bound")
    max_restarts: int = _f(
        3,
        lo=0,
        doc="`asyncrl run` restarts a child that dies this many times (the learner from its "
        "last checkpoint); 0: the first death ends the run",
    )


@dataclass(kw_only=True)
class ModelConfig:
    path: str = _f("", doc="HuggingFace model folder: config.json, safetensors, tokenizer")
    dtype: Dtype = _f("float32")
    attention: Literal["auto", "sdpa", "flex", "varlen"] = _f("auto")
    max_seq_len: int = _f(4096, lo=1)


@dataclass(kw_only=True)
class DataConfig:
    path: str = _f("", doc="jsonl or parquet file of training prompts")
    eval_path: str = _f("", doc="held-out prompts (same format)")
    prompt_key: str = _f("prompt")
    answer_key: str = _f("answer")
    completion_key: str = _f("completion", doc="target text, for sft")
    chosen_key: str = _f("chosen", doc="reward_model: the preferred completion of a pair")
    rejected_key: str = _f("rejected", doc="reward_model: the other completion of the pair")
    chat_template: bool = _f(False, doc="wrap prompts with the tokenizer's chat template")
    shuffle: bool = _f(True)
    task: str = _f("", doc="built-in synthetic task name, instead of a file")
    num_examples: int = _f(0, lo=0, doc="size of a generated synthetic data set")


@dataclass(kw_only=True)
class RewardModelConfig:
    urls: list[str] = _f(
        factory=list, doc="/classify servers (SGLang or `asyncrl engine` on a reward model folder)"
    )
    path: str = _f(
        "",
        doc="a sequence-classification folder (relative to the recipe) that `asyncrl run` serves "
        "on `servers` built-in engines and gives the workers as urls; exclusive with urls",
    )
    servers: int = _f(1, lo=1, doc="built-in /classify servers `asyncrl run` starts on path")
    weight: float = _f(1.0, doc="the sample's reward adds weight x the (normalised) score")
    timeout_s: float = _f(30.0, lo=0, lo_open=True, doc="one /classify request's bound")
    batch_size: int = _f(16, lo=1, doc="completions per /classify request")
    input: RewardInput = _f(
        "ids", doc="ids: prompt + completion token ids (one tokenizer); text: the server tokenizes"
    )
    normalize: RewardNorm = _f(
        "none",
        doc="running: (s - mean) / std of the scores seen so far; fixed: (s - shift) / scale",
    )
    shift: float = _f(0.0)
    scale: float = _f(1.0, lo=0, lo_open=True)

    @property
    def enabled(self) -> bool:
        return bool(self.urls or self.path)


@dataclass(kw_only=True)
class TeacherConfig:
    """The teacher of on-policy distillation (``algorithm.advantage: distill``, docs/distill.md):
    a causal LM whose log-probabilities of the student's sampled tokens the workers ask for, on
    ``/generate`` (SGLang, or `asyncrl engine`) with no new tokens. It must share the student's
    tokenizer: the same token ids are scored."""

    urls: list[str] = _f(
        factory=list, doc="/generate servers of the teacher (SGLang or `asyncrl engine`)"
    )
    path: str = _f(
        "",
        doc="the teacher's HF folder (relative to the recipe) that `asyncrl run` serves on "
        "`servers` built-in engines and gives the workers as urls; exclusive with urls",
    )
    servers: int = _f(1, lo=1, doc="built-in teacher servers `asyncrl run` starts on path")
    timeout_s: float = _f(60.0, lo=0, lo_open=True, doc="one teacher request's bound")
    batch_size: int = _f(16, lo=1, doc="sequences per teacher request")

    @property
    def enabled(self) -> bool:
        return bool(self.urls or self.path)


@dataclass(kw_only=True)
class RolloutConfig:
    workers: int = _f(1, lo=0, doc="rollout worker processes started by `asyncrl run`")
    group_size: int = _f(8, lo=1, doc="samples per prompt (GRPO's n)")
    max_concurrent_groups: int = _f(16, lo=1, doc="groups in flight per worker")
    workflow: str = _f("single_turn", doc="single_turn, multi_turn, or an import path module:fn")
    reward: str = _f(
        "exact_match",
        doc="exact_match, math, an import path module:fn, or model (rollout.reward_model alone)",
    )
    eval_reward: str = _f(
        "",
        doc="the held-out evaluation's reward: empty = the rollouts' (rollout.reward and the reward "
        "model); a rule (exact_match, math, module:fn) scores against the data's answers instead, "
        "e.g. the ground truth of a policy trained on a reward model alone",
    )
    reward_timeout_s: float = _f(10.0, lo=0, lo_open=True)
    reward_weight: float = _f(1.0, doc="weight of rollout.reward when a reward model adds to it")
    reward_model: RewardModelConfig = _f(factory=RewardModelConfig)
    teacher: TeacherConfig = _f(
        factory=TeacherConfig, doc="algorithm.advantage: distill's teacher (its logprobs)"
    )
    tools: list[str] = _f(
        factory=list,
        doc="multi_turn's tools: import paths of functions, MCP servers 'mcp:stdio:<command line>' "
        "or 'mcp:http://host:port/mcp' (streamable HTTP)",
    )
    tool_timeout_s: float = _f(
        30.0, lo=0, lo_open=True, doc="per tool call; a call cut is an error"
    )
    max_turns: int = _f(4, lo=1)
    turn_samples: bool = _f(
        False,
        doc="multi-turn episodes: train each model turn as its own sample (its prompt: the "
        "conversation before it) instead of the whole trajectory as one (AReaL's individual export)",
    )
    turn_discount: float = _f(
        1.0,
        lo=0,
        hi=1,
        doc="with turn_samples: turn t of T gets the trajectory's reward R as γ^(T-1-t)·R, and "
        "γ^(T-1-t) times its episode's advantage (the group baseline is over episodes)",
    )
    temperature: float = _f(
        1.0,
        lo=0,
        doc="> 0 for RL losses (0, greedy, is refused: the reported logprobs are not the sampler's)",
    )
    top_p: float = _f(1.0, lo=0, hi=1, lo_open=True)
    top_k: int = _f(-1, lo=-1)
    min_p: float = _f(0.0, lo=0, hi=1)
    max_new_tokens: int = _f(256, lo=1)
    stop: list[str] = _f(factory=list)
    request_timeout_s: float = _f(600.0, lo=0, lo_open=True)

    @property
    def logprob_temperature(self) -> float:
        """The T of the behaviour logprobs generators report, log_softmax(logits / T): SGLang and the
        built-in engine scale by the sampling temperature, and greedy requests (T = 0) are unscaled."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclass(kw_only=True)
class GeneratorConfig:
    kind: GeneratorKind = _f("builtin")
    urls: list[str] = _f(factory=list, doc="SGLang server URLs (kind: sglang)")
    engines_per_worker: int = _f(1, lo=0, doc="built-in engines each worker starts (kind: builtin)")
    host: str = _f(
        "",
        doc="where built-in engines listen (the learner calls them); empty: 127.0.0.1 with the "
        "learner on this host, else this host's address on the route to it (docs/multinode.md)",
    )
    base_port: int = _f(0, lo=0, hi=65535, doc="0: pick free ports")
    max_batch_size: int = _f(64, lo=1, doc="built-in engine: running requests per decode step")
    device: EngineDevice = _f(
        "auto",
        doc="built-in engine: auto = cuda when torch sees a GPU, else cpu. On cuda it runs in "
        "model.dtype and receives weights over NCCL; on cpu in float32, over gloo (as always)",
    )
    startup_timeout_s: float = _f(300.0, lo=0, lo_open=True)


@dataclass(kw_only=True)
class TLSConfig:
    cert: str = _f("", doc="this side's certificate (PEM)")
    key: str = _f("", doc="this side's private key (PEM)")
    ca: str = _f("", doc="the CA that signs the peers' certificates (PEM)")


@dataclass(kw_only=True)
class BufferConfig:
    address: str = _f("tcp://127.0.0.1:0", doc="Req/Rep address of the buffer service")
    pub_address: str = _f("tcp://127.0.0.1:0", doc="Pub/Sub address of version announcements")
    groups_per_batch: int = _f(8, lo=1)
    max_staleness: int = _f(
        1, lo=0, doc="eta: no token older than this many versions is trained on"
    )
    max_batches_ahead: int = _f(
        0,
        lo=0,
        doc="pipeline depth: groups stored or running <= this x groups_per_batch; 0 = "
        "max_staleness + 1 (AReaL). A bound of eta, not a target: fewer batches ahead, fresher data",
    )
    lease_seconds: float = _f(120.0, lo=0, lo_open=True)
    dynamic_sampling: bool = _f(
        False,
        doc="DAPO: drop groups whose rewards are all equal (group advantages only: refused with "
        "gae and vtrace, whose A = R - V of such a group is not 0)",
    )
    min_batch_fill: float = _f(
        1.0,
        lo=0,
        hi=1,
        lo_open=True,
        doc="smallest batch fraction taken after partial_batch_after_s",
    )
    partial_batch_after_s: float = _f(
        10.0, lo=0, doc="with min_batch_fill < 1: wait this long for a full batch, then take less"
    )
    overlong_filter: bool = _f(False, doc="drop samples cut by max_new_tokens from the loss")
    batch_timeout_s: float = _f(600.0, lo=0, lo_open=True, doc="learner's longest wait for a batch")
    tls: TLSConfig = _f(factory=TLSConfig)


@dataclass(kw_only=True)
class AlgorithmConfig:
    loss: Loss = _f("decoupled_ppo")
    advantage: Advantage = _f("grpo")
    aggregation: Aggregation = _f(
        "auto",
        doc="auto: seq_mean_token_mean for gspo (its definition), seq_mean_token_sum_norm for "
        "dr_grpo (Dr. GRPO's constant-length sum), token_mean otherwise",
    )
    clip_low: float = _f(0.2, lo=0)
    clip_high: float = _f(0.28, lo=0, doc="clip-higher (DAPO) when > clip_low")
    cispo_clip_low: bool = _f(
        False,
        doc="cispo: clip the weight from below too, at 1 − clip_low (false: MiniMax-M1's CISPO, "
        "whose weight min(π/μ, 1 + clip_high) is bounded above only)",
    )
    dual_clip: bool = _f(
        False, doc="ppo, decoupled_ppo: with A < 0 cap the token loss at clip_c·|A| (verl)"
    )
    clip_c: float = _f(3.0, lo=1, lo_open=True, doc="the dual clip's bound (verl's clip_ratio_c)")
    is_cap: float = _f(5.0, lo=0, lo_open=True, doc="C: cap on importance weights")
    ratio_mask_low: float = _f(0.0, lo=0, doc="mask tokens with ratio below this (0: off)")
    ratio_mask_high: float = _f(0.0, lo=0, doc="mask tokens with ratio above this (0: off)")
    seq_mask_low: float = _f(
        0.0,
        lo=0,
        doc="mask sequences whose geometric-mean ratio exp(mean log ρ) is below this (0: off; < 1)",
    )
    seq_mask_high: float = _f(
        0.0,
        lo=0,
        doc="mask sequences whose geometric-mean ratio exp(mean log ρ) is above this (0: off; > 1)",
    )
    is_level: Literal["token", "sequence"] = _f(
        "token",
        doc="tis, decoupled_ppo: the truncated IS weight per token, min(ρ_t, C), or per sequence, "
        "min(Π_t ρ_t, C) on each of its tokens (verl's sequence-level rollout IS)",
    )
    kl_coef: float = _f(0.0, lo=0, doc="β of the KL(π ‖ π_ref) penalty in the loss")
    kl_estimator: Literal["k1", "k2", "k3"] = _f(
        "k3",
        doc="the KL value added and logged (k3 clamped to 10); its gradient is always KL(π‖π_ref)'s",
    )
    entropy_coef: float = _f(0.0)
    adv_eps: float = _f(1e-6, lo=0, lo_open=True)
    gamma: float = _f(1.0, lo=0, hi=1, doc="gae, vtrace: discount per token")
    lam: float = _f(
        1.0, lo=0, hi=1, doc="gae, vtrace: λ, the trace's length (1: Monte Carlo, 0: one-step TD)"
    )
    vtrace_rho_bar: float = _f(
        1.0, lo=0, lo_open=True, doc="vtrace: ρ̄, truncation of π/μ in the targets' TD errors"
    )
    vtrace_c_bar: float = _f(
        1.0, lo=0, lo_open=True, doc="vtrace: c̄, truncation of π/μ in the trace (≤ ρ̄)"
    )
    value_clip: float = _f(
        0.2, lo=0, doc="ε_v: the critic's value change per step is clipped to ±ε_v (0: off)"
    )
    kl_reward_coef: float = _f(
        0.0,
        lo=0,
        doc="β of the per-token reward r_t − β·(log μ_t − log π_ref,t) (gae, vtrace; classic RLHF)",
    )
    distill_coef: float = _f(
        0.0,
        lo=0,
        doc="distill: weight of the outcome reward in A_t = log π_teacher,t − log π_prox,t + "
        "distill_coef·A_i, A_i the sample's GRPO advantage (0: the teacher alone)",
    )

    @property
    def uses_rollouts(self) -> bool:
        """False for the losses trained from a local data set (:data:`OFFLINE_LOSSES`)."""
        return self.loss not in OFFLINE_LOSSES

    @property
    def aggregation_used(self) -> str:
        """The aggregation the loss runs with (``auto`` resolved)."""
        if self.aggregation != "auto":
            return self.aggregation
        if self.loss == "gspo":
            return "seq_mean_token_mean"
        if self.advantage == "dr_grpo" and self.uses_rollouts:
            return "seq_mean_token_sum_norm"
        return "token_mean"


LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters on the actor's linear layers (docs/lora.md): the base stays frozen, only
    the adapters train, are checkpointed and are sent to the generators. The effective weight of a
    target is W + (alpha / rank) · B A, as PEFT's LoRA (not rsLoRA)."""

    rank: int = _f(0, lo=0, doc="adapter rank r (0: no LoRA, the whole model trains)")
    alpha: float = _f(16.0, lo=0, lo_open=True, doc="the adapter's scale is alpha / rank")
    dropout: float = _f(0.0, lo=0, hi=0.99, doc="dropout on the adapter's input while training")
    targets: list[LoraTarget] = _f(
        factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        doc="the HF linear layers that get an adapter",
    )
    export: Literal["adapter", "merged"] = _f(
        "adapter",
        doc="adapter: a PEFT folder (adapter_config.json, adapter_model.safetensors); merged: an "
        "HF folder with B A folded into the weights",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0


@dataclass(kw_only=True)
class LearnerConfig:
    ranks: int = _f(1, lo=1, doc="torchrun processes started by `asyncrl run`")
    lr: float = _f(1e-6, lo=0)
    weight_decay: float = _f(0.0, lo=0)
    betas: list[float] = _f(factory=lambda: [0.9, 0.999])
    eps: float = _f(1e-8, lo=0, lo_open=True)
    warmup_steps: int = _f(0, lo=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = _f("constant")
    grad_clip: float = _f(1.0, lo=0)
    micro_batch_tokens: int = _f(8192, lo=1, doc="packed tokens per forward/backward")
    minibatches: int = _f(
        1,
        lo=1,
        doc="optimizer updates per batch, each on 1/minibatches of it (AReaL's ppo_n_minibatches); "
        "> 1 recomputes π_prox before the first (decoupled_ppo's trust region needs it)",
    )
    epochs: int = _f(1, lo=1, doc="passes over each batch (each pass: `minibatches` updates)")
    activation_checkpointing: Checkpointing = _f(
        "none",
        doc="recompute each block's activations in the backward (TorchTitan's SelectiveAC / FullAC)",
    )
    compile: bool = _f(False, doc="torch.compile each transformer block (TorchTitan's); GPU only")
    logits_chunk_mb: float = _f(
        1024.0,
        lo=0,
        lo_open=True,
        doc="MiB of float32 logits per chunk: log π is computed a chunk of tokens at a time "
        "(each chunk also reads the output projection and adds into its whole gradient, so not "
        "much smaller: 1024 is 441 tokens at vocabulary 151,936)",
    )
    batch_size: int = _f(64, lo=1, doc="sft: sequences per step")
    checkpoint_every: int = _f(10, lo=0, doc="DCP checkpoint every k versions (0: only at the end)")
    checkpoint_async: bool = _f(True)
    export_every: int = _f(0, lo=0, doc="HF safetensors export every k versions (0: at the end)")
    keep_checkpoints: int = _f(2, lo=0)
    lora: LoraConfig = _f(factory=LoraConfig, doc="low-rank adapters (rank 0: off)")


@dataclass(kw_only=True)
class CriticConfig:
    """The value model of ``algorithm.advantage: gae`` / ``vtrace`` (learner/critic.py): trained
    beside the actor on the same ranks, with the learner's optimizer settings but its own lr."""

    path: str = _f(
        "",
        doc="HF folder: a causal LM (its backbone, a fresh value head) or a one-label "
        "sequence-classification model such as a reward model (backbone and head); empty: model.path",
    )
    lr: float = _f(1e-5, lo=0, doc="the critic's AdamW learning rate (the actor's is learner.lr)")


@dataclass(kw_only=True)
class RolePlacement:
    """Where one model role of the learner runs (docs/placement.md): on which learner ranks, and
    how its ranks are split between tensor parallelism and FSDP's data-parallel sharding."""

    ranks: list[int] = _f(
        factory=list, doc="learner ranks (torchrun RANK) of this role; empty: every rank"
    )
    tensor_parallel: int = _f(
        1, lo=1, doc="tensor-parallel degree inside the role's ranks (the rest shard with FSDP2)"
    )
    offload: bool = _f(
        False,
        doc="between its calls, give the role's parameters, gradients and optimizer state back "
        "(to pinned host memory on GPU; on CPU nothing is freed: a log line says so)",
    )


ROLES = ("actor", "critic", "ref")
"""The learner's model roles a recipe places (the reward model is scored by the workers)."""


@dataclass(kw_only=True)
class PlacementConfig:
    """Each learner role's ranks and parallel layout. Roles on disjoint ranks run their calls at
    once; roles on the same ranks run in the dataflow's order. The default puts every role on
    every rank, FSDP2 over all of them (data-parallel sharding only)."""

    actor: RolePlacement = _f(factory=RolePlacement)
    critic: RolePlacement = _f(factory=RolePlacement, doc="gae / vtrace's value model")
    ref: RolePlacement = _f(
        factory=RolePlacement, doc="the frozen π_ref of a KL term; empty ranks: the actor's ranks"
    )

    def ranks_of(self, role: str, world: int) -> list[int]:
        """The role's ranks in a learner of ``world`` ranks (the ref follows the actor)."""
        ranks = getattr(self, role).ranks
        if not ranks and role == "ref":
            return self.ranks_of("actor", world)
        return list(ranks) if ranks else list(range(world))


@dataclass(kw_only=True)
class WeightsConfig:
    every: int = _f(1, lo=1, doc="publish weights every k versions")
    backend: Literal["auto", "gloo", "nccl", "ipc"] = _f(
        "auto",
        doc="auto: ipc for an engine on rank 0's own GPU, gloo for one on CPU, else nccl; ipc: "
        "each bucket as a handle to rank 0's memory (CUDA IPC; shared memory on CPU), same host",
    )
    bucket_mb: float = _f(512.0, lo=0, lo_open=True, doc="MiB per update call (as slime)")
    load_format: Literal["list", "flattened_bucket"] = _f("list", doc="per tensor (as slime)")
    dtype: Dtype = _f("float32")
    timeout_s: float = _f(60.0, lo=0, lo_open=True, doc="a generator slower than this is dropped")
    overlap: bool = _f(True, doc="broadcast version v while the learner computes v+1")
    verify: Literal["sampled", "full", "off"] = _f(
        "sampled",
        doc="after each version, compare a checksum of the generators' weights with what was sent: "
        "sampled (4096 values per tensor, cheap at any size), full (every byte), off",
    )
    pause_mode: PauseMode = _f(
        "in_place",
        doc="SGLang pause during an update. in_place: requests keep their KV (run SGLang with "
        "--disable-radix-cache, or new requests may reuse prefixes the old weights computed); "
        "retract: KV recomputed on continue and the prefix cache flushed",
    )
    master_addr: str = _f("127.0.0.1")
    master_port: int = _f(0, lo=0, hi=65535, doc="0: pick a free port")
    group_name: str = _f("asyncrl_weights")


@dataclass(kw_only=True)
class LoggingConfig:
    wandb: bool = _f(True)
    wandb_mode: Literal["offline", "online", "disabled"] = _f("offline")
    project: str = _f("asyncrl")
    group: str = _f("", doc="W&B run group (default: the run name)")
    every: int = _f(1, lo=1)
    progress: bool = _f(True)


@dataclass(kw_only=True)
class Recipe:
    run: RunConfig = _f(factory=RunConfig)
    model: ModelConfig = _f(factory=ModelConfig)
    data: DataConfig = _f(factory=DataConfig)
    rollout: RolloutConfig = _f(factory=RolloutConfig)
    generator: GeneratorConfig = _f(factory=GeneratorConfig)
    buffer: BufferConfig = _f(factory=BufferConfig)
    algorithm: AlgorithmConfig = _f(factory=AlgorithmConfig)
    learner: LearnerConfig = _f(factory=LearnerConfig)
    critic: CriticConfig = _f(factory=CriticConfig)
    placement: PlacementConfig = _f(factory=PlacementConfig)
    weights: WeightsConfig = _f(factory=WeightsConfig)
    logging: LoggingConfig = _f(factory=LoggingConfig)
    base_dir: str = field(default=".", metadata={"internal": True})
    """The recipe file's folder: relative paths in the recipe are resolved against it."""

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name

    def resolve(self, path: str) -> Path:
        """A path from the recipe, relative to the recipe file's folder."""
        p = Path(os.path.expanduser(path))
        return p if p.is_absolute() else Path(self.base_dir) / p

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("base_dir")
        return d


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------

_SECTIONS = {f.name for f in dataclasses.fields(Recipe) if not f.metadata.get("internal")}


def _suggest(key: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_type(value: Any, tp: Any, key: str, file: str | None) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise RecipeError(
                f"expected one of {', '.join(map(str, choices))}, got {value!r}"
                + (_suggest(str(value), map(str, choices)) if isinstance(value, str) else ""),
                file=file,
                key=key,
            )
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise RecipeError(f"expected a list, got {type(value).__name__}", file=file, key=key)
        return [_check_type(v, item, f"{key}[{i}]", file) for i, v in enumerate(value)]
    if origin in (types.UnionType, typing.Union):
        for t in typing.get_args(tp):
            try:
                return _check_type(value, t, key, file)
            except RecipeError:
                continue
        raise RecipeError(f"expected {tp}, got {value!r}", file=file, key=key)
    if tp is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"expected true or false, got {value!r}", file=file, key=key)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"expected an integer, got {value!r}", file=file, key=key)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RecipeError(f"expected a number, got {value!r}", file=file, key=key)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise RecipeError(f"expected a string, got {value!r}", file=file, key=key)
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key, file)
    raise RecipeError(f"unsupported type {tp}", file=file, key=key)  # pragma: no cover


def _check_range(value: Any, rng: dict, key: str, file: str | None) -> None:
    lo, hi = rng["lo"], rng["hi"]
    if lo is not None and (value < lo or (rng["lo_open"] and value == lo)):
        rel = ">" if rng["lo_open"] else ">="
        raise RecipeError(f"must be {rel} {lo}, got {value}", file=file, key=key)
    if hi is not None and value > hi:
        raise RecipeError(f"must be <= {hi}, got {value}", file=file, key=key)


def _build(cls: type, data: Any, prefix: str, file: str | None) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            f"expected a mapping of settings, got {type(data).__name__}", file=file, key=prefix
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in fields:
            raise RecipeError("unknown key" + _suggest(str(k), fields), file=file, key=key)
        value = _check_type(v, hints[k], key, file)
        if "range" in fields[k].metadata:
            _check_range(value, fields[k].metadata["range"], key, file)
        kwargs[k] = value
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``learner.lr=1e-6`` -> (["learner", "lr"], 1e-6). Values are read as YAML scalars."""
    if "=" not in text:
        raise RecipeError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise RecipeError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):
        try:  # YAML 1.1 reads 1e-6 as a string; a user writing it means a number
            value = float(value)
        except ValueError:
            pass
    return parts, value


def _apply_override(data: dict, parts: list[str], value: Any) -> None:
    node = data
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise RecipeError(f"cannot set {'.'.join(parts)}: '{p}' is not a section")
        node = child
    node[parts[-1]] = value


def from_dict(
    data: dict,
    *,
    file: str | None = None,
    overrides: typing.Sequence[str] = (),
    check_files: bool = True,
) -> Recipe:
    data = dict(data or {})
    for text in overrides:
        parts, value = parse_override(text)
        if parts[0] not in _SECTIONS:
            raise RecipeError(
                "unknown section" + _suggest(parts[0], _SECTIONS),
                file="override",
                key=".".join(parts),
            )
        _apply_override(data, parts, value)
    recipe = _build(Recipe, data, "", file)
    if file:
        recipe.base_dir = str(Path(file).resolve().parent)
    validate(recipe, file=file, check_files=check_files)
    return recipe


def load(
    path: str | os.PathLike, overrides: typing.Sequence[str] = (), *, check_files: bool = True
) -> Recipe:
    """Read a YAML recipe, apply dotted overrides, validate, and return the typed recipe.

    ``check_files=False`` skips the checks that model, data and TLS files exist (for a recipe written
    for another machine, or whose model a previous stage builds); everything else is still checked.
    """
    file = str(path)
    try:
        text = Path(file).read_text()
    except FileNotFoundError:
        raise RecipeError("recipe file not found", file=file) from None
    except OSError as e:
        raise RecipeError(f"cannot read recipe: {e.strerror}", file=file) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise RecipeError(f"not valid YAML{at}", file=file) from None
    if data is not None and not isinstance(data, dict):
        raise RecipeError("a recipe must be a mapping of sections", file=file)
    return from_dict(data or {}, file=file, overrides=overrides, check_files=check_files)


def learner_roles(r: Recipe) -> tuple[str, ...]:
    """The models the learner builds: the actor; a critic for a token-level advantage; π_ref for a
    KL term (on the loss or on the rewards)."""
    alg = r.algorithm
    critic = alg.uses_rollouts and alg.advantage in TOKEN_ADVANTAGES
    ref = alg.kl_coef > 0 or alg.kl_reward_coef > 0
    return ("actor",) + ("critic",) * critic + ("ref",) * ref


def check_placement(
    placement: PlacementConfig,
    world: int | None = None,
    *,
    file: str | None = None,
    roles: tuple[str, ...] = ROLES,
) -> None:
    """Each role's ranks exist (when ``world`` is known), are distinct, split evenly into its
    tensor-parallel degree, and either equal another role's ranks or do not meet them; the actor's
    include rank 0, which runs the buffer client and the weight broadcaster. ``roles``: the ones
    the run uses (the learner's, :func:`learner_roles`; a role it does not build meets no other)."""
    sets: dict[str, frozenset[int]] = {}
    for role in roles:
        rp: RolePlacement = getattr(placement, role)
        key = f"placement.{role}"
        if any(k < 0 for k in rp.ranks) or len(set(rp.ranks)) != len(rp.ranks):
            raise RecipeError(
                f"expected distinct ranks >= 0, got {rp.ranks}", file=file, key=f"{key}.ranks"
            )
        if role == "actor" and rp.ranks and 0 not in rp.ranks:
            raise RecipeError(
                "rank 0 runs the buffer client and the weight broadcaster, so the actor's ranks "
                f"must include it, got {rp.ranks}",
                file=file,
                key=f"{key}.ranks",
            )
        if world is not None and any(k >= world for k in rp.ranks):
            raise RecipeError(
                f"the learner has {world} rank(s) (0..{world - 1}), got {rp.ranks}",
                file=file,
                key=f"{key}.ranks",
            )
        n = len(rp.ranks) if rp.ranks else world
        if n is not None and n % rp.tensor_parallel:
            raise RecipeError(
                f"{n} rank(s) do not split into tensor-parallel groups of {rp.tensor_parallel}",
                file=file,
                key=f"{key}.tensor_parallel",
            )
        if world is not None:
            sets[role] = frozenset(placement.ranks_of(role, world))
        elif rp.ranks:
            sets[role] = frozenset(rp.ranks)
    for i, a in enumerate(roles):
        for b in roles[i + 1 :]:
            if a in sets and b in sets and sets[a] != sets[b] and sets[a] & sets[b]:
                raise RecipeError(
                    f"shares ranks {sorted(sets[a] & sets[b])} with placement.{a} but not all: "
                    "two roles run on the same ranks or on disjoint ones",
                    file=file,
                    key=f"placement.{b}.ranks",
                )


def check_critic_placement(
    placement: PlacementConfig, world: int | None = None, *, file: str | None = None
) -> None:
    """A critic on the actor's ranks has the actor's tensor-parallel degree: it trains on the
    actor's micro-batches, so each rank's data share must be the actor's. (Only where the run has
    a critic: :func:`learner_roles`.)"""
    actor, critic = placement.actor, placement.critic
    if critic.tensor_parallel == actor.tensor_parallel:
        return
    if world is not None:
        same = set(placement.ranks_of("critic", world)) == set(placement.ranks_of("actor", world))
    else:  # both unset: every rank; one set and not the other: known only with the world
        same = set(critic.ranks) == set(actor.ranks)
    if same:
        raise RecipeError(
            f"{critic.tensor_parallel} differs from placement.actor.tensor_parallel "
            f"{actor.tensor_parallel} on the same ranks: the critic trains on the actor's "
            "micro-batches, so each rank's data share must be the actor's",
            file=file,
            key="placement.critic.tensor_parallel",
        )


def ref_is_lora_base(placement: PlacementConfig, lora: LoraConfig, world: int) -> bool:
    """Whether π_ref is the LoRA actor's frozen base, its adapters off in the ``ref`` call, with no
    model of its own: adapters on, and the reference laid out as the actor (its ranks, its tensor
    parallelism) and not offloaded (docs/lora.md)."""
    a, ref = placement.actor, placement.ref
    return (
        lora.enabled
        and not ref.offload
        and ref.tensor_parallel == a.tensor_parallel
        and placement.ranks_of("ref", world) == placement.ranks_of("actor", world)
    )


def check_lora(r: Recipe, *, file: str | None = None) -> None:
    """What LoRA (``learner.lora``, docs/lora.md) cannot train right: adapter dropout under tensor
    parallelism (each TP rank would draw its own mask of the same replicated input) or in an RL
    loss (its ratios π/μ would measure the mask), a reward model (its score head and backbone
    train), repeated targets."""
    lo = r.learner.lora
    if not lo.enabled:
        return
    if lo.dropout and r.placement.actor.tensor_parallel > 1:
        raise RecipeError(
            f"{lo.dropout} with placement.actor.tensor_parallel "
            f"{r.placement.actor.tensor_parallel}: each tensor-parallel rank would draw its own "
            "dropout mask of the same input; set it 0 or tensor_parallel 1",
            file=file,
            key="learner.lora.dropout",
        )
    if lo.dropout and r.algorithm.uses_rollouts:
        raise RecipeError(
            f"{lo.dropout} with algorithm.loss {r.algorithm.loss}: dropout makes the learner's "
            "π differ from the sampler's μ on fresh data, so the ratios that clip, mask and "
            "weight tokens act on noise; set it 0 (it stays for sft)",
            file=file,
            key="learner.lora.dropout",
        )
    if r.algorithm.loss == "reward_model":
        raise RecipeError(
            "a reward model trains its backbone and score head, not adapters: set rank 0",
            file=file,
            key="learner.lora",
        )
    if not lo.targets or len(set(lo.targets)) != len(lo.targets):
        raise RecipeError(
            f"must name each HF linear layer once, got {lo.targets}",
            file=file,
            key="learner.lora.targets",
        )


def validate(recipe: Recipe, *, file: str | None = None, check_files: bool = True) -> None:
    """Checks across fields and on the file system (unless ``check_files`` is false)."""
    r = recipe
    if check_files and r.model.path and not r.resolve(r.model.path).is_dir():
        raise RecipeError(
            f"model folder {r.model.path!r} does not exist", file=file, key="model.path"
        )
    if check_files and r.model.path and not (r.resolve(r.model.path) / "config.json").is_file():
        raise RecipeError(
            f"model folder {r.model.path!r} has no config.json", file=file, key="model.path"
        )
    for key in ("path", "eval_path"):
        p = getattr(r.data, key)
        if check_files and p and not r.resolve(p).is_file():
            raise RecipeError(f"data file {p!r} does not exist", file=file, key=f"data.{key}")
        if p and Path(p).suffix not in (".jsonl", ".json", ".parquet"):
            raise RecipeError(
                f"data file {p!r} must be .jsonl, .json or .parquet", file=file, key=f"data.{key}"
            )
    alg = r.algorithm
    if alg.clip_low >= 1:
        raise RecipeError("must be < 1", file=file, key="algorithm.clip_low")
    if alg.loss == "gspo" and alg.aggregation not in ("auto", "seq_mean_token_mean"):
        raise RecipeError(
            f"gspo is a sequence-level loss: it averages over sequences (seq_mean_token_mean); "
            f"got {alg.aggregation} (leave it auto)",
            file=file,
            key="algorithm.aggregation",
        )
    if alg.dual_clip and alg.loss not in ("ppo", "decoupled_ppo"):
        raise RecipeError(
            f"the dual clip bounds a clipped ratio: ppo and decoupled_ppo only, not {alg.loss}",
            file=file,
            key="algorithm.dual_clip",
        )
    if alg.cispo_clip_low and alg.loss != "cispo":
        raise RecipeError(
            f"bounds cispo's weight from below: loss cispo only, not {alg.loss}",
            file=file,
            key="algorithm.cispo_clip_low",
        )
    if alg.advantage == "vtrace" and alg.vtrace_c_bar > alg.vtrace_rho_bar:
        raise RecipeError(
            f"V-trace assumes c̄ ≤ ρ̄ (IMPALA), got {alg.vtrace_c_bar} > {alg.vtrace_rho_bar}",
            file=file,
            key="algorithm.vtrace_c_bar",
        )
    if alg.kl_reward_coef > 0 and alg.advantage not in TOKEN_ADVANTAGES:
        raise RecipeError(
            f"a per-token KL reward needs a token-level advantage ({', '.join(TOKEN_ADVANTAGES)}); "
            f"{alg.advantage} sees one reward per sample (use algorithm.kl_coef)",
            file=file,
            key="algorithm.kl_reward_coef",
        )
    if r.buffer.dynamic_sampling and alg.uses_rollouts and alg.advantage in TOKEN_ADVANTAGES:
        raise RecipeError(
            f"drops groups whose rewards are all equal, which carry no signal only under a group "
            f"baseline; under {alg.advantage} their A = R − V(x) ≠ 0 and they are states the critic "
            "must fit (dropping them by outcome biases both): set it false",
            file=file,
            key="buffer.dynamic_sampling",
        )
    if alg.uses_rollouts and r.rollout.temperature == 0:
        raise RecipeError(
            "0 samples greedily, a policy whose probabilities are not the logprobs the generators "
            "report (log_softmax of the logits), so the importance ratios would be wrong and a "
            "group's samples alike: RL losses need > 0 (the held-out evaluation is greedy anyway)",
            file=file,
            key="rollout.temperature",
        )
    check_placement(r.placement, file=file)
    if "critic" in learner_roles(r):
        check_critic_placement(r.placement, file=file)
    if r.rollout.turn_discount != 1 and not r.rollout.turn_samples:
        raise RecipeError(
            "discounts the rewards of per-turn samples: set rollout.turn_samples: true",
            file=file,
            key="rollout.turn_discount",
        )
    if len(r.learner.betas) != 2 or not all(0 <= b < 1 for b in r.learner.betas):
        raise RecipeError("expected two numbers in [0, 1)", file=file, key="learner.betas")
    if r.generator.kind == "sglang" and not r.generator.urls and r.rollout.workers:
        raise RecipeError(
            "kind sglang needs at least one server URL", file=file, key="generator.urls"
        )
    if (
        r.weights.backend == "nccl"
        and r.generator.kind == "builtin"
        and r.generator.device == "cpu"
    ):
        # A built-in engine on CPU receives each version into CPU tensors, which an NCCL group
        # cannot fill: every version would fail. auto picks gloo for it.
        raise RecipeError(
            "nccl cannot send to a built-in engine on CPU (generator.device cpu: it receives "
            "into CPU tensors): set weights.backend=auto or gloo, or generator.device=cuda",
            file=file,
            key="weights.backend",
        )
    if r.algorithm.ratio_mask_high and r.algorithm.ratio_mask_high <= r.algorithm.ratio_mask_low:
        raise RecipeError(
            "must be greater than algorithm.ratio_mask_low",
            file=file,
            key="algorithm.ratio_mask_high",
        )
    # The band must hold 1, every on-policy sequence's ratio (so low < high too).
    if alg.seq_mask_low >= 1:
        raise RecipeError(
            f"must be < 1 (0: off), got {alg.seq_mask_low}: the band would drop on-policy "
            "sequences, whose geometric-mean ratio is 1",
            file=file,
            key="algorithm.seq_mask_low",
        )
    if alg.seq_mask_high and alg.seq_mask_high <= 1:
        raise RecipeError(
            f"must be > 1 (0: off), got {alg.seq_mask_high}: the band would drop on-policy "
            "sequences, whose geometric-mean ratio is 1",
            file=file,
            key="algorithm.seq_mask_high",
        )
    if alg.is_level == "sequence" and alg.loss not in ("tis", "decoupled_ppo"):
        raise RecipeError(
            "a sequence-level weight replaces the truncated IS weight of tis and decoupled_ppo; "
            f"{alg.loss} has none (leave it token)",
            file=file,
            key="algorithm.is_level",
        )
    if alg.loss == "reward_model":
        lc = r.learner
        if lc.minibatches != 1 or lc.epochs != 1:
            raise RecipeError(
                "reward_model makes one update per batch of pairs: leave minibatches and epochs 1",
                file=file,
                key="learner.minibatches" if lc.minibatches != 1 else "learner.epochs",
            )
        if alg.kl_coef:
            raise RecipeError(
                "reward_model has no reference policy: must be 0",
                file=file,
                key="algorithm.kl_coef",
            )
    check_lora(r, file=file)
    rm = r.rollout.reward_model
    if r.rollout.reward == "model" and not rm.enabled:
        raise RecipeError(
            "reward model needs rollout.reward_model.urls or rollout.reward_model.path",
            file=file,
            key="rollout.reward",
        )
    if r.rollout.eval_reward == "model":
        raise RecipeError(
            "the held-out evaluation scores with the rollouts' reward when empty; name a rule here",
            file=file,
            key="rollout.eval_reward",
        )
    _check_model_servers(
        r,
        "rollout.reward_model",
        rm.path,
        rm.urls,
        what="reward model folder",
        kind="an HF sequence-classification folder, e.g. a reward_model run's hf/latest",
        file=file,
        check_files=check_files,
    )
    _validate_teacher(r, file=file, check_files=check_files)
    tls = r.buffer.tls
    given = [bool(tls.cert), bool(tls.key), bool(tls.ca)]
    if any(given) and not all(given):
        raise RecipeError("cert, key and ca must be given together", file=file, key="buffer.tls")
    for k in ("cert", "key", "ca"):
        p = getattr(tls, k)
        if check_files and p and not r.resolve(p).is_file():
            raise RecipeError(f"file {p!r} does not exist", file=file, key=f"buffer.tls.{k}")
    for k in ("address", "pub_address"):
        a = getattr(r.buffer, k)
        if not a.startswith(("tcp://", "ipc://", "tls+tcp://", "inproc://")):
            raise RecipeError(
                f"expected tcp://, ipc:// or tls+tcp:// address, got {a!r}",
                file=file,
                key=f"buffer.{k}",
            )
        if a.startswith("tls+tcp://") and not tls.cert:
            raise RecipeError("a tls+tcp:// address needs buffer.tls", file=file, key=f"buffer.{k}")
        if a.startswith("tcp://") and tls.cert:
            raise RecipeError(
                "buffer.tls is set, so use tls+tcp:// (plain tcp:// would not encrypt)",
                file=file,
                key=f"buffer.{k}",
            )


def _check_model_servers(
    r: Recipe,
    key: str,
    path: str,
    urls: list[str],
    *,
    what: str,
    kind: str,
    file: str | None,
    check_files: bool,
) -> None:
    """A model served for the rollouts (the reward model, the teacher): urls of servers the user
    started, or a folder `asyncrl run` serves; never both, the folder an HF one, the urls http(s)."""
    if path and urls:
        raise RecipeError(
            "give urls (servers you started) or path (`asyncrl run` starts servers on it), "
            "not both",
            file=file,
            key=f"{key}.path",
        )
    if check_files and path and not (r.resolve(path) / "config.json").is_file():
        raise RecipeError(
            f"{what} {path!r} has no config.json ({kind})", file=file, key=f"{key}.path"
        )
    for i, u in enumerate(urls):
        if not u.startswith(("http://", "https://")):
            raise RecipeError(
                f"expected an http(s):// URL, got {u!r}", file=file, key=f"{key}.urls[{i}]"
            )


def _validate_teacher(r: Recipe, *, file: str | None, check_files: bool) -> None:
    """``algorithm.advantage: distill`` and ``rollout.teacher`` go together (a teacher no advantage
    reads would be served and asked for nothing); the teacher's urls or path as the reward
    model's."""
    alg, t = r.algorithm, r.rollout.teacher
    distill = alg.advantage == "distill" and alg.uses_rollouts
    if distill and not t.enabled:
        raise RecipeError(
            "algorithm.advantage distill needs a teacher: set rollout.teacher.path (a causal LM "
            "folder `asyncrl run` serves) or rollout.teacher.urls (/generate servers)",
            file=file,
            key="rollout.teacher",
        )
    if t.enabled and not distill:
        raise RecipeError(
            f"a teacher is read by algorithm.advantage distill only, not {alg.advantage}"
            + (f" with loss {alg.loss}" if not alg.uses_rollouts else "")
            + ": set the advantage to distill, or leave rollout.teacher empty",
            file=file,
            key="rollout.teacher",
        )
    if alg.distill_coef and alg.advantage != "distill":
        raise RecipeError(
            "weighs the outcome reward inside the distill advantage: set algorithm.advantage "
            "distill, or leave it 0",
            file=file,
            key="algorithm.distill_coef",
        )
    if distill and r.rollout.temperature != 1:
        # The teacher's logprobs are untempered (SGLang's input logprobs are log_softmax(z)),
        # the student's log_softmax(z / T): A_t would pull the tempered student to the untempered
        # teacher, and one token's logprob cannot be re-tempered without the whole vocabulary.
        raise RecipeError(
            f"{r.rollout.temperature:g} with algorithm.advantage distill: the teacher's logprobs "
            "are untempered, so at T != 1 the student would learn a teacher whose logits are "
            "scaled by T, not the teacher; set it 1 (docs/distill.md)",
            file=file,
            key="rollout.temperature",
        )
    if distill and r.buffer.dynamic_sampling:
        raise RecipeError(
            "drops groups whose rewards are all equal, but the distill advantage is the teacher's, "
            "per token, whatever the rewards: set it false",
            file=file,
            key="buffer.dynamic_sampling",
        )
    _check_model_servers(
        r,
        "rollout.teacher",
        t.path,
        t.urls,
        what="teacher folder",
        kind="an HF causal LM folder, e.g. a run's hf/latest",
        file=file,
        check_files=check_files,
    )
    if check_files and t.path and r.model.path:
        differs = tokenizer_difference(r.resolve(r.model.path), r.resolve(t.path))
        if differs:
            raise RecipeError(
                f"the teacher's tokenizer is not the student's ({differs}): the teacher scores the "
                "student's token ids, which must mean the same text to both",
                file=file,
                key="rollout.teacher.path",
            )


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt")
"""The files that define an HF tokenizer's token ids (one format or another)."""


def tokenizer_difference(student: Path, teacher: Path) -> str:
    """Why two HF folders' token ids may not mean the same text ("" when they do): a tokenizer
    file one has and the other lacks or holds otherwise (tokenizer.json compared by its vocabulary
    and added tokens, the rest byte for byte); with no such file to compare, their config.json
    ``vocab_size``."""
    compared = False
    for name in TOKENIZER_FILES:
        a, b = student / name, teacher / name
        if not a.is_file() and not b.is_file():
            continue
        if a.is_file() != b.is_file():
            return f"{name} in one folder only"
        compared = True
        if name == "tokenizer.json":
            ja, jb = (json.loads(x.read_text()) for x in (a, b))
            same = all(ja.get(k) == jb.get(k) for k in ("model", "added_tokens"))
        else:
            same = a.read_bytes() == b.read_bytes()
        if not same:
            return f"{name} differs"
    if compared:
        return ""
    sizes = []
    for folder in (student, teacher):
        try:
            sizes.append(json.loads((folder / "config.json").read_text()).get("vocab_size"))
        except (OSError, ValueError):
            sizes.append(None)
    if sizes[0] != sizes[1]:
        return f"vocab_size {sizes[0]} vs {sizes[1]}"
    return ""


def warnings(recipe: Recipe) -> list[str]:
    """Settings that run but are likely not what the user meant: one line each, naming the key.
    `asyncrl check` prints them and the learner logs them at start."""
    out = []
    alg, ro = recipe.algorithm, recipe.rollout
    if alg.loss == "gspo" and max(alg.clip_low, alg.clip_high) > 1e-2:
        out.append(
            f"algorithm.clip_low/clip_high: gspo clips a sequence's mean ratio, which stays close to "
            f"1; a range of {max(alg.clip_low, alg.clip_high):g} rarely clips (the GSPO paper uses "
            "3e-4 / 4e-4)"
        )
    if alg.uses_rollouts and (ro.top_p < 1 or ro.top_k > 0 or ro.min_p > 0):
        out.append(
            "rollout.top_p/top_k/min_p: generators report μ before truncation (log_softmax of "
            "logits / temperature, as SGLang does), so importance ratios do not see the truncation"
        )
    if alg.loss == "decoupled_ppo" and recipe.learner.minibatches * recipe.learner.epochs == 1:
        out.append(
            "algorithm.loss: decoupled_ppo with one update per batch (learner.minibatches × "
            "learner.epochs = 1) is tis: π_prox is the weights being updated, so its clip "
            "(clip_low/clip_high/dual_clip) never acts; set learner.minibatches > 1 for its trust "
            "region, or loss: tis"
        )
    lora = recipe.learner.lora
    if lora.enabled and recipe.generator.kind == "sglang":
        out.append(
            f"learner.lora: SGLang servers load each version's adapter by name from the run "
            f"folder's adapters/ (docs/lora_sync.md): launch them with --enable-lora "
            f"--max-lora-rank {lora.rank} --lora-target-modules {' '.join(lora.targets)}, where "
            "they can read that folder"
        )
    return out


def dump(recipe: Recipe) -> str:
    """The resolved recipe as YAML, as `asyncrl check` prints it."""
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)

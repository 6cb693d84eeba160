"""The memory plan: bytes per learner rank and per generator, from the model's config and the recipe.

Pure arithmetic (no torch, no I/O), so ``asyncrl doctor`` can say before the first step whether a
recipe fits the devices it will run on, and what to change when it does not. Every term is an
estimate of the largest tensors alive at the peak, with the assumptions stated where it is computed;
allocator fragmentation, CUDA/NCCL workspaces and the Python runtime are not in it (the doctor adds
the runtime it measures on CPU).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncrl import dataflow
from asyncrl.recipe import (
    TOKEN_ADVANTAGES,
    Checkpointing,
    GeneratorKind,
    LearnerConfig,
    Recipe,
    ref_is_lora_base,
)
from asyncrl.recipe.moe_config import moe_layers, num_experts

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

MASTER_BYTES = 4
"""The learner's sharded parameters, their gradients and both AdamW moments are float32 whatever
``model.dtype``: the model is built in float32 and FSDP2's mixed precision casts only the gathered
copies used for compute (TorchTitan's ``mixed_precision_param``), reducing in float32."""

REDUCE_BYTES = 4
"""FSDP2 reduce-scatters gradients in TorchTitan's ``mixed_precision_reduce``, float32."""

GiB = 2**30


class PlanError(ValueError):
    """A config.json the plan cannot read (one line, naming the key)."""


@dataclass(frozen=True, kw_only=True)
class ModelDims:
    """What the plan needs from an HF ``config.json`` (Qwen3, Qwen3-MoE and Llama: the learner's
    models)."""

    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    experts: int = 0
    """Experts per MoE layer (0: a dense model; docs/moe.md)."""
    top_k: int = 0
    """Experts each token goes through in an MoE layer."""
    moe_intermediate: int = 0
    """One expert's SwiGLU width."""
    moe_layers: int = 0
    """Layers whose MLP is the experts (Qwen3-MoE's ``mlp_only_layers`` keep a dense one)."""

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelDims:
        def need(key: str) -> int:
            v = cfg.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"config.json: {key!r} must be a positive integer, got {v!r}")
            return v

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        moe = {}
        if num_experts(cfg):
            moe = dict(
                experts=num_experts(cfg),
                top_k=need("num_experts_per_tok"),
                moe_intermediate=need("moe_intermediate_size"),
                moe_layers=sum(moe_layers(cfg)),
            )
        return cls(
            arch=str(cfg.get("model_type", "")),
            hidden=hidden,
            layers=need("num_hidden_layers"),
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate=need("intermediate_size"),
            vocab=need("vocab_size"),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            **moe,
        )

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def dense_layers(self) -> int:
        """Layers with a dense SwiGLU MLP (all of a dense model's)."""
        return self.layers - self.moe_layers

    @property
    def attention_params(self) -> int:
        """One block's q, k, v, o projections, two RMSNorms and Qwen3's per-head q/k norms (no
        biases: the learner refuses models that have them)."""
        h = self.hidden
        attention = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        qk_norm = 2 * self.head_dim if self.arch in ("qwen3", "qwen3_moe") else 0
        return attention + qk_norm + 2 * h

    @property
    def block_params(self) -> int:
        """One dense decoder block: :attr:`attention_params` and SwiGLU's three matrices."""
        return self.attention_params + 3 * self.hidden * self.intermediate

    @property
    def expert_params(self) -> int:
        """One expert: SwiGLU's three matrices at the expert's width."""
        return 3 * self.hidden * self.moe_intermediate

    @property
    def moe_block_params(self) -> int:
        """One MoE decoder block: :attr:`attention_params`, the router (``hidden × experts``) and
        every expert (no shared expert, no load-balancing bias: the learner's Qwen3-MoE); 0 for a
        dense model."""
        if not self.moe_layers:
            return 0
        return (
            self.attention_params + self.hidden * self.experts + self.experts * self.expert_params
        )

    @property
    def experts_params(self) -> int:
        """Every expert of every MoE layer: what expert parallelism would split (0: dense)."""
        return self.moe_layers * self.experts * self.expert_params

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Embedding, blocks, final norm, and the output projection unless tied to the embedding."""
        out = 0 if self.tied else self.embedding_params
        blocks = self.dense_layers * self.block_params + self.moe_layers * self.moe_block_params
        return self.embedding_params + blocks + self.hidden + out

    @property
    def active_params(self) -> int:
        """The parameters one token goes through: :attr:`params` with each MoE layer's experts
        counted ``top_k`` times instead of ``experts`` (the router counted whole); the embedding
        and output projection whole, as the usual "A3B" figures count them. A dense model's
        :attr:`params`."""
        return self.params - self.moe_layers * (self.experts - self.top_k) * self.expert_params

    @property
    def largest_fsdp_unit(self) -> int:
        """Parameters of the largest FSDP2 unit TorchTitan makes: each block (an MoE block with all
        its experts: without expert parallelism they shard with the block); the embedding; the
        final norm with the output projection (one unit with the embedding when tied)."""
        head = self.hidden + (0 if self.tied else self.embedding_params)
        block = max(self.block_params if self.dense_layers else 0, self.moe_block_params)
        if self.tied:
            return max(block, self.embedding_params + head)
        return max(block, self.embedding_params, head)

    def lora_params(self, rank: int, targets: list[str] | tuple[str, ...]) -> int:
        """LoRA adapter parameters (``learner.lora``): ``rank · (in + out)`` per target and layer."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        shape = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        return self.layers * sum(rank * sum(shape[t]) for t in targets)

    def lora_tp_replicated(self, rank: int, targets: list[str] | tuple[str, ...]) -> int:
        """Of :meth:`lora_params`, what tensor parallelism replicates over its ranks (TorchTitan's
        plan, asyncrl/learner/lora.py): A of a column-parallel target (q, k, v, gate, up: its
        B is split as the weight's rows) and B of a row-parallel one (o, down: its A is split as
        the weight's columns); ``rank · hidden`` either way."""
        return self.layers * rank * self.hidden * len(targets)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_dim * dtype_bytes


def saved_per_layer(
    dims: ModelDims, checkpointing: Checkpointing, tp: int = 1, *, moe: bool = False
) -> int:
    """Elements one decoder block keeps for its backward, per token, on one of ``tp``
    tensor-parallel ranks (``moe``: one of the MoE blocks, below).

    - ``none``: the attention norm's input and output (2h), the fused q/k/v projection's output
      (q + 2kv), q and k after their norms and RoPE (q + kv), the attention output (q); the FFN
      norm's input and output (2h), SwiGLU's gate, silu(gate), up and their product (4I):
      ``4h + 3q + 3kv + 4I``.
    - ``selective`` (TorchTitan's per-op SAC): the block's input (h) and the outputs of the ops it
      saves: every other matmul (q/k/v (q + 2kv), the gate (I), the down projection (h)) and the
      attention (q): ``2h + 2q + 2kv + I``.
    - ``full``: the block's input only (h).

    Tensor parallelism splits the heads' and the FFN's tensors (q, kv, I) over its ``tp`` ranks;
    the hidden-sized ones (h) stay whole on each, as sequence parallelism, which would split them,
    is off (``asyncrl.learner.placement.role_parallelism``).

    Attention is the fused kind (flash/varlen/flex on GPU, SDPA's fused CPU kernel): no L × L
    score matrix is kept; its float32 log-sum-exp (a few floats per token) is left out.

    An MoE block (an estimate, not measured): each token goes through ``top_k`` experts, so the
    SwiGLU tensors are ``top_k`` experts' wide, ``I = k·I_e``; TorchTitan's MoE layer also keeps
    the router's scores (E) and the tokens copied into expert order, and with ``none`` the experts'
    outputs before their weighted sum (``k·h`` each): ``+ 2k·h + E`` with ``none``, ``+ k·h + E``
    with ``selective``. Tensor parallelism is refused for MoE models, so ``tp`` is 1 there."""
    h, q, kv, i = dims.hidden, dims.q_dim, dims.kv_dim, dims.intermediate
    routed = 0
    if moe:
        i = dims.top_k * dims.moe_intermediate
        copies = {"none": 2, "selective": 1}.get(checkpointing)
        routed = copies * dims.top_k * h + dims.experts if copies else 0
    if checkpointing == "none":
        whole, split = 4 * h, 3 * q + 3 * kv + 4 * i
    elif checkpointing == "selective":
        whole, split = 2 * h, 2 * q + 2 * kv + i
    elif checkpointing == "full":
        whole, split = h, 0
    else:
        raise ValueError(f"unknown activation checkpointing {checkpointing!r}")
    return whole + routed + math.ceil(split / tp)


def activation_bytes_per_token(
    dims: ModelDims, checkpointing: Checkpointing, compute_bytes: int, tp: int = 1
) -> int:
    """Activation bytes per micro-batch token at the backward's peak on one of ``tp``
    tensor-parallel ranks, in the compute dtype: every layer's saved tensors, plus (with
    checkpointing) one block recomputed in full while its backward runs, plus the final norm's
    input and output (the hidden states log π is taken from, whole on every rank)."""
    kinds = [(dims.dense_layers, False), (dims.moe_layers, True)]
    kinds = [(n, moe) for n, moe in kinds if n]
    saved = sum(n * saved_per_layer(dims, checkpointing, tp, moe=moe) for n, moe in kinds)
    recomputed = 0
    if checkpointing != "none":  # the largest block recomputed
        recomputed = max(saved_per_layer(dims, "none", tp, moe=moe) for _, moe in kinds)
    return (saved + recomputed + 2 * dims.hidden) * compute_bytes


def logits_chunk_bytes(vocab: int, chunk_tokens: int) -> int:
    """One chunk of float32 logits and the three softmax-sized temporaries its backward makes: the
    budget :func:`asyncrl.learner.logprobs.chunk_tokens` sizes chunks by."""
    return chunk_tokens * vocab * 4 * 4


@dataclass(frozen=True, kw_only=True)
class LearnerPlan:
    """Bytes at the peak of one learner rank's step (see :func:`learner_plan` for each term)."""

    params: int
    grads: int
    optimizer: int
    reference: int
    critic: int
    fsdp_gather: int
    activations: int
    logits: int
    weight_snapshot: int
    tokens: int
    """Tokens of the largest micro-batch (see :func:`learner_plan`)."""
    activation_bytes_per_token: int
    checkpoint_staging: int = 0
    """Host bytes an asynchronous checkpoint stages (not in :attr:`total`: not on the GPU)."""

    def items(self) -> list[tuple[str, int]]:
        every = [
            ("params", self.params),
            ("grads", self.grads),
            ("AdamW", self.optimizer),
            ("reference", self.reference),
            ("critic", self.critic),
            ("FSDP gather", self.fsdp_gather),
            ("activations", self.activations),
            ("logits chunk", self.logits),
            ("weight snapshot", self.weight_snapshot),
        ]
        return [(k, v) for k, v in every if v]

    @property
    def total(self) -> int:
        return sum(v for _, v in self.items())

    @property
    def fixed(self) -> int:
        """Everything but the activations (what does not scale with micro-batch tokens)."""
        return self.total - self.activations


def learner_plan(
    dims: ModelDims,
    *,
    ranks: int,
    compute_dtype: str,
    micro_batch_tokens: int,
    max_seq_len: int,
    checkpointing: Checkpointing,
    chunk_tokens: int,
    reference_model: bool = False,
    critic_model: bool = False,
    rank0: bool = True,
    weights_dtype: str = "bfloat16",
    weights_overlap: bool = True,
    samples_per_update: int = 0,
    checkpoint_async: bool = False,
    tensor_parallel: int = 1,
    lora_params: int = 0,
    lora_replicated: int = 0,
) -> LearnerPlan:
    """Bytes on one learner rank at the peak of a step, FSDP2 over ``ranks``.

    With ``tensor_parallel`` t > 1 the ``ranks`` are t-way tensor parallel × ranks/t FSDP: the
    float32 states are still ``P/ranks`` a rank (TP splits each matrix, FSDP the rest; the norms
    TP replicates are left out), and the FSDP gather is divided by t (each rank gathers its column
    or row of every matrix). Of the activations, TP splits the heads' and the FFN's, not the
    hidden-sized ones, which every rank keeps whole with sequence parallelism off
    (:func:`saved_per_layer`): an estimate, not a measurement. The data is split over the ranks/t
    data-parallel groups.

    - params, grads, AdamW (two moments): float32 shards, ``4·P/N`` each, ``8·P/N`` for AdamW
      (:data:`MASTER_BYTES`). The gradients are shards whatever the micro-batch count: the
      learner reduce-scatters at every micro-batch (:mod:`asyncrl.learner.trainer`); with gradient
      sync off between micro-batches FSDP2 would hold each parameter's whole gradient, ``4·P``.
      A frozen reference model (``algorithm.kl_coef > 0``) another ``4·P/N``; a critic
      (``algorithm.advantage`` gae / vtrace) its own params, grads and AdamW, ``16·P/N`` (priced
      at the actor's size: its one-output head is smaller than the actor's vocabulary projection,
      so this is an upper bound).
    - FSDP gather: the largest FSDP unit in the compute dtype, three times: the unit being computed,
      the next one prefetched, and the unsharded gradient before its reduce-scatter; and once in
      float32, the reduce-scatter's input, into which FSDP2 copies that gradient in its reduce dtype
      (TorchTitan's ``mixed_precision_reduce``: float32) and which it keeps until the next unit's
      reduce-scatter (torch's ``foreach_reduce``; one such buffer at a time by default).
    - activations: :func:`activation_bytes_per_token` × the largest micro-batch, ``max(
      micro_batch_tokens, max_seq_len)`` tokens (a longer sequence gets a micro-batch of its own),
      and no more than this rank's share of one update, ``ceil(samples_per_update / ranks)``
      sequences of ``max_seq_len`` (when ``samples_per_update`` is given).
    - logits chunk: :func:`logits_chunk_bytes` of ``chunk_tokens`` (or of the micro-batch, if smaller).
    - weight snapshot (rank 0 only): the weight broadcaster's full copy of the model in the wire
      dtype, twice when it overlaps (version v still sending while v+1 is gathered).
    - checkpoint staging (host memory, not in ``total``): an asynchronous DCP save copies this
      rank's float32 parameter and AdamW shards to the host, ``12·P/N``.

    With LoRA (``lora_params`` A > 0, :meth:`ModelDims.lora_params`) the frozen base keeps its
    float32 shards, ``4·P/N``, and the adapters add theirs; gradients and AdamW exist for the
    adapters alone (``4·A/N``, ``8·A/N``), as do the FSDP gather's gradient buffers (a block's
    adapters), the weight snapshot (the adapters in the wire dtype) and the checkpoint (adapters
    and their AdamW). The activations are priced as without: the backward still runs through every
    block to reach the adapters, and each target's input is saved for its A's gradient. With TP t
    the adapters' parts it replicates (``lora_replicated``, :meth:`ModelDims.lora_tp_replicated`)
    are held t times over, so a rank's adapter shard is ``(A + (t-1)·R)/N``.
    """
    compute = DTYPE_BYTES[compute_dtype]
    p = dims.params
    shard = math.ceil(p / ranks)
    # what trains: the whole model, or its adapters (the base frozen)
    held = lora_params + (tensor_parallel - 1) * lora_replicated  # over the ranks, TP copies too
    adapter_shard = math.ceil(held / ranks)
    trained = adapter_shard if lora_params else shard
    gathered, graded = dims.largest_fsdp_unit, dims.largest_fsdp_unit
    if lora_params:
        per_block = held // dims.layers
        gathered = max(gathered, dims.block_params + per_block)
        graded = per_block
    tokens = max(micro_batch_tokens, max_seq_len)
    if samples_per_update:
        tokens = min(tokens, math.ceil(samples_per_update * tensor_parallel / ranks) * max_seq_len)
    per_token = activation_bytes_per_token(dims, checkpointing, compute, tensor_parallel)
    snapshots = (2 if weights_overlap else 1) if rank0 else 0
    return LearnerPlan(
        params=MASTER_BYTES * (shard + adapter_shard),
        grads=MASTER_BYTES * trained,
        optimizer=2 * MASTER_BYTES * trained,
        reference=MASTER_BYTES * shard if reference_model else 0,
        critic=4 * MASTER_BYTES * shard if critic_model else 0,
        fsdp_gather=math.ceil(
            (2 * compute * gathered + (compute + REDUCE_BYTES) * graded) / tensor_parallel
        ),
        activations=tokens * per_token,
        logits=logits_chunk_bytes(dims.vocab, min(chunk_tokens, tokens)),
        weight_snapshot=snapshots * (lora_params or p) * DTYPE_BYTES[weights_dtype],
        tokens=tokens,
        activation_bytes_per_token=per_token,
        checkpoint_staging=3 * MASTER_BYTES * (trained + (shard if critic_model else 0))
        if checkpoint_async
        else 0,
    )


STATE_BYTES = {"actor": 4 * MASTER_BYTES, "critic": 4 * MASTER_BYTES, "ref": MASTER_BYTES}
"""Float32 bytes per parameter a role keeps between its calls: parameters, gradients and both AdamW
moments for a trained role; the parameters alone for the frozen reference."""


@dataclass(frozen=True, kw_only=True)
class RoleLayout:
    """One learner role's placement: its ranks, split t-way tensor parallel × FSDP over the rest,
    and whether it gives its states back between its calls (``placement.<role>.offload``)."""

    role: str
    ranks: tuple[int, ...]
    tensor_parallel: int = 1
    offload: bool = False

    @property
    def data_parallel(self) -> int:
        return len(self.ranks) // self.tensor_parallel

    @property
    def layout(self) -> str:
        """``ranks 0-5, TP 1 × DP 6`` (and ``, offloaded between calls``)."""
        off = ", offloaded between calls" if self.offload else ""
        return f"ranks {span(self.ranks)}, TP {self.tensor_parallel} × DP {self.data_parallel}{off}"

    def describe(self) -> str:
        """``actor on ranks 0-5 (TP 1 × DP 6)``."""
        return f"{self.role} on {self.layout.replace(', TP', ' (TP', 1)})"


@dataclass(frozen=True, kw_only=True)
class Phase:
    """One level of the learner's dataflow: the roles it calls and those of them it trains (their
    backward holds activations; a forward-only call holds only its gathered unit and logits)."""

    label: str
    roles: frozenset[str]
    trains: frozenset[str] = frozenset()


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """One learner rank with placement: its roles and its peak over the step's phases, with the
    offloaded roles' states counted only in the phases that call them, and without offload."""

    rank: int
    roles: tuple[str, ...]
    states: dict[str, int]
    """Bytes each role here keeps between calls (float32 states, see :data:`STATE_BYTES`)."""
    phases: dict[str, int]
    """Bytes at each phase's peak, with reallocation."""
    weight_snapshot: int
    peak: int
    peak_without_offload: int

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k]) if self.phases else ""


def rank_plans(
    dims: ModelDims,
    layouts: list[RoleLayout],
    phases: list[Phase],
    *,
    world: int,
    publisher: int | None = 0,
    weights_dtype: str = "bfloat16",
    weights_overlap: bool = True,
    lora_params: int = 0,
    lora_replicated: int = 0,
    **kw: Any,
) -> list[RankPlan]:
    """Each learner rank's peak with placement and reallocation.

    A role on k ranks with TP t keeps ``STATE_BYTES[role]·P/k`` a rank (:func:`learner_plan` with
    ``ranks=k``, its FSDP gather, activations and logits chunk as there, the critic priced at the
    actor's size and without a vocabulary chunk). A phase's peak on a rank: the states of every
    role there that is resident (not offloaded) or called by the phase, plus the largest working
    set of the roles it calls there (their calls run one after another): FSDP gather and logits
    chunk, and the activations of a role it trains. ``publisher`` (the actor's first rank, when
    the run publishes weights) also holds the weight snapshot(s) throughout. ``lora_params``: the
    actor's adapters (:func:`learner_plan`): its base keeps ``4·P/k``, its adapters ``16·A/k``, and
    the snapshot is theirs (with TP t, ``lora_replicated`` counted t times: :func:`learner_plan`).
    ``kw``: the other :func:`learner_plan` arguments."""
    plans = {
        lay.role: learner_plan(
            dims,
            ranks=len(lay.ranks),
            tensor_parallel=lay.tensor_parallel,
            rank0=False,
            lora_params=lora_params if lay.role == "actor" else 0,
            lora_replicated=lora_replicated if lay.role == "actor" else 0,
            **kw,
        )
        for lay in layouts
    }
    published = lora_params or dims.params
    snapshot = (2 if weights_overlap else 1) * published * DTYPE_BYTES[weights_dtype]

    def state_bytes(role: str, k: int, t: int) -> int:
        if role == "actor" and lora_params:
            held = lora_params + (t - 1) * lora_replicated
            return math.ceil((MASTER_BYTES * dims.params + 4 * MASTER_BYTES * held) / k)
        return math.ceil(STATE_BYTES[role] * dims.params / k)

    def working(role: str, trains: bool) -> int:
        lp = plans[role]
        logits = lp.logits if role != "critic" else 0
        return lp.fsdp_gather + logits + (lp.activations if trains else 0)

    out = []
    for rank in range(world):
        here = [lay for lay in layouts if rank in lay.ranks]
        states = {
            lay.role: state_bytes(lay.role, len(lay.ranks), lay.tensor_parallel) for lay in here
        }
        snap = snapshot if rank == publisher else 0
        by_phase, without = {}, 0
        for ph in phases:
            called = [lay.role for lay in here if lay.role in ph.roles]
            if not called:
                continue
            work = max(working(r, r in ph.trains) for r in called)
            resident = sum(
                b for r, b in states.items() if r in called or not _layout(here, r).offload
            )
            by_phase[ph.label] = resident + work + snap
            without = max(without, sum(states.values()) + work + snap)
        out.append(
            RankPlan(
                rank=rank,
                roles=tuple(lay.role for lay in here),
                states=states,
                phases=by_phase,
                weight_snapshot=snap,
                peak=max(by_phase.values(), default=sum(states.values()) + snap),
                peak_without_offload=max(without, sum(states.values()) + snap),
            )
        )
    return out


def uses_reference(recipe: Recipe) -> bool:
    """Whether the learner holds a π_ref model of its own: a KL term needs one, unless it is the
    LoRA actor's frozen base (:func:`asyncrl.recipe.ref_is_lora_base`)."""
    a, lc = recipe.algorithm, recipe.learner
    kl = a.kl_coef > 0 or a.kl_reward_coef > 0
    return kl and not ref_is_lora_base(recipe.placement, lc.lora, lc.ranks)


def role_layouts(recipe: Recipe) -> list[RoleLayout]:
    """The learner's model roles in ``recipe`` (the actor; the critic of gae / vtrace; the
    reference of a KL term, unless LoRA's base is it) with their ``placement``, as on GPUs (a reference without ranks of
    its own is laid out as the actor, on its ranks). The actor is never offloaded:
    the learner publishes, checkpoints and exports it between steps."""
    a, world = recipe.algorithm, recipe.learner.ranks
    roles = ["actor"]
    if a.uses_rollouts and a.advantage in TOKEN_ADVANTAGES:
        roles.append("critic")
    if uses_reference(recipe):
        roles.append("ref")
    out = []
    for role in roles:
        rp = getattr(recipe.placement, role)
        follows = role == "ref" and not rp.ranks  # built like the actor, on its ranks
        out.append(
            RoleLayout(
                role=role,
                ranks=tuple(recipe.placement.ranks_of(role, world)),
                tensor_parallel=recipe.placement.actor.tensor_parallel
                if follows
                else rp.tensor_parallel,
                offload=rp.offload and role != "actor",
            )
        )
    return out


def _layout(layouts: list[RoleLayout], role: str) -> RoleLayout:
    return next(lay for lay in layouts if lay.role == role)


def span(ranks: tuple[int, ...] | list[int]) -> str:
    """``0-5`` for consecutive ranks, else ``0,2,4``."""
    r = sorted(ranks)
    if len(r) > 1 and r == list(range(r[0], r[-1] + 1)):
        return f"{r[0]}-{r[-1]}"
    return ",".join(map(str, r))


@dataclass(frozen=True, kw_only=True)
class GeneratorPlan:
    """Bytes one generator needs per device (per GPU of a TP group; the host for the built-in one)."""

    weights: int
    staging: int
    kv_cache: int
    sequences: int
    """Sequences whose KV the plan holds at once."""
    tokens_per_sequence: int

    def items(self) -> list[tuple[str, int]]:
        every = [("weights", self.weights), ("staged weights", self.staging)]
        return [(k, v) for k, v in [*every, ("KV cache", self.kv_cache)] if v]

    @property
    def total(self) -> int:
        return self.weights + self.staging + self.kv_cache


def in_flight_sequences(*, max_concurrent_groups: int, group_size: int, generators: int) -> int:
    """Sequences a rollout worker keeps in flight on each of its generators (it spreads its
    ``max_concurrent_groups`` groups over them)."""
    return math.ceil(max_concurrent_groups * group_size / max(generators, 1))


def generator_plan(
    dims: ModelDims,
    *,
    kind: GeneratorKind,
    dtype_bytes: int,
    sequences: int,
    seq_len: int,
    tp: int = 1,
    max_batch_size: int = 0,
) -> GeneratorPlan:
    """Weights plus the KV cache of the batch, per device.

    - ``sglang``: weights and KV split over ``tp`` GPUs; the KV of every in-flight sequence at
      ``seq_len`` tokens (SGLang sizes its pool to its memory and queues what does not fit, so this
      is the demand to compare with the pool, not an allocation).
    - ``builtin`` (CPU, float32): the running batch is at most ``max_batch_size`` sequences; its slot
      cache grows by doubling, so rows round up to a power of two, each ``seq_len`` long; a weight
      update stages a second copy of the weights before swapping it in.
    """
    if kind == "builtin":
        running = min(sequences, max_batch_size) if max_batch_size else sequences
        rows = 1 << max(running - 1, 0).bit_length()
        weights = dims.params * dtype_bytes
        return GeneratorPlan(
            weights=weights,
            staging=weights,
            kv_cache=rows * seq_len * dims.kv_bytes_per_token(dtype_bytes),
            sequences=rows,
            tokens_per_sequence=seq_len,
        )
    return GeneratorPlan(
        weights=math.ceil(dims.params * dtype_bytes / tp),
        staging=0,
        kv_cache=math.ceil(sequences * seq_len * dims.kv_bytes_per_token(dtype_bytes) / tp),
        sequences=sequences,
        tokens_per_sequence=seq_len,
    )


# ---- a recipe's plan ------------------------------------------------------------------------

ChunkTokens = Callable[[int, float], int]
"""The learner's logits chunk sizing, ``(vocab, learner.logits_chunk_mb) -> tokens``
(:func:`asyncrl.learner.logprobs.chunk_tokens`): the caller passes it in, as this floor does not
import the learner (tests/test_import_graph.py)."""


def samples_per_update(recipe: Recipe) -> int:
    """Sequences one optimizer update trains on: sft's batch, or an RL batch's minibatch."""
    r = recipe
    if not r.algorithm.uses_rollouts:  # a reward model's batch is of pairs: 2 sequences each
        return r.learner.batch_size * (2 if r.algorithm.loss == "reward_model" else 1)
    per_batch = r.buffer.groups_per_batch * r.rollout.group_size
    return math.ceil(per_batch / r.learner.minibatches)


def lora_params(dims: ModelDims, lc: LearnerConfig, *, replicated: bool = False) -> int:
    """The actor's LoRA adapter parameters (0: no ``learner.lora``, the whole model trains);
    ``replicated``: those tensor parallelism replicates (:meth:`ModelDims.lora_tp_replicated`)."""
    if not lc.lora.enabled:
        return 0
    count = dims.lora_tp_replicated if replicated else dims.lora_params
    return count(lc.lora.rank, lc.lora.targets)


def _step_inputs(
    dims: ModelDims, r: Recipe, lc: LearnerConfig, chunk_tokens: ChunkTokens
) -> dict[str, Any]:
    """What both the one-role plan and the per-rank plans read of a recipe's step (``lc``: its
    learner section, perhaps with a fix's changes)."""
    return dict(
        compute_dtype=r.model.dtype,
        micro_batch_tokens=lc.micro_batch_tokens,
        max_seq_len=r.model.max_seq_len,
        checkpointing=lc.activation_checkpointing,
        chunk_tokens=chunk_tokens(dims.vocab, lc.logits_chunk_mb),
        weights_dtype=r.weights.dtype,
        weights_overlap=r.weights.overlap,
        samples_per_update=samples_per_update(r),
        lora_params=lora_params(dims, lc),
        lora_replicated=lora_params(dims, lc, replicated=True),
    )


def learner_plans_for(
    dims: ModelDims, recipe: Recipe, chunk_tokens: ChunkTokens, **changes: Any
) -> tuple[LearnerPlan, LearnerPlan]:
    """(rank 0's plan, another rank's plan) for ``recipe``, with ``changes`` to its learner section
    (to price a fix)."""
    r = recipe
    lc = dataclasses.replace(r.learner, **changes)
    kw = _step_inputs(dims, r, lc, chunk_tokens) | dict(
        ranks=lc.ranks,
        reference_model=uses_reference(r),
        critic_model=r.algorithm.uses_rollouts and r.algorithm.advantage in TOKEN_ADVANTAGES,
        checkpoint_async=lc.checkpoint_async,
    )
    rank0 = learner_plan(dims, rank0=r.algorithm.uses_rollouts, **kw)
    return rank0, learner_plan(dims, rank0=False, **kw)


def phases(recipe: Recipe) -> list[Phase]:
    """The learner's levels of the recipe's dataflow (generation and rewards run in the
    workers); a reward model's ``train_step`` trains the learner's model, placed as the actor."""
    out = []
    for level in dataflow.from_recipe(recipe).order():
        calls = [
            c
            for c in level
            if c.role in ("actor", "critic", "ref")
            and c.call != "generate"
            or c.role == "reward"
            and c.call == "train_step"
        ]
        if not calls:
            continue
        role = {c.name: "actor" if c.role == "reward" else c.role for c in calls}
        out.append(
            Phase(
                label=", ".join(c.name for c in calls),
                roles=frozenset(role.values()),
                trains=frozenset(role[c.name] for c in calls if c.call == "train_step"),
            )
        )
    return out


def rank_plans_for(
    dims: ModelDims, recipe: Recipe, chunk_tokens: ChunkTokens, **changes: Any
) -> list[RankPlan]:
    """Every learner rank's plan with ``recipe``'s placement (``changes`` as for
    :func:`learner_plans_for`)."""
    r = recipe
    lc = dataclasses.replace(r.learner, **changes)
    layouts = role_layouts(r)
    return rank_plans(
        dims,
        layouts,
        phases(r),
        world=lc.ranks,
        publisher=layouts[0].ranks[0] if r.algorithm.uses_rollouts else None,
        **_step_inputs(dims, r, lc, chunk_tokens),
    )


def engines_here(recipe: Recipe) -> int:
    """Built-in engines `asyncrl run` starts on this host."""
    r = recipe
    builtin = r.generator.kind == "builtin" and r.algorithm.uses_rollouts
    return r.rollout.workers * r.generator.engines_per_worker if builtin else 0


def engines_on_gpu(recipe: Recipe, *, cuda: bool) -> int:
    """Built-in engines `asyncrl run` starts on rank 0's GPU (``cuda``: a GPU host): on a GPU host
    each runs on the current CUDA device (the first visible, rank 0's) unless ``generator.device``
    is cpu, and takes its weights by CUDA IPC handle there (``weights.backend: auto``)."""
    return engines_here(recipe) if cuda and recipe.generator.device != "cpu" else 0


def generator_plan_for(
    dims: ModelDims, recipe: Recipe, *, cuda: bool, server_tps: list[int] | tuple[int, ...] = ()
) -> GeneratorPlan | None:
    """One generator's plan for ``recipe`` (None: sft, no generators). ``cuda``: a GPU host (where
    the built-in engines run in ``model.dtype``); ``server_tps``: the reached SGLang servers'
    ``tp_size`` (the smallest splits the least)."""
    r, g = recipe, recipe.generator
    if not r.algorithm.uses_rollouts:
        return None
    builtin = g.kind == "builtin"
    n = g.engines_per_worker if builtin else len(g.urls)
    seqs = in_flight_sequences(
        max_concurrent_groups=r.rollout.max_concurrent_groups,
        group_size=r.rollout.group_size,
        generators=n,
    )
    if builtin:
        return generator_plan(
            dims,
            kind="builtin",
            # on a GPU the built-in engine runs in model.dtype, on the CPU in float32
            dtype_bytes=DTYPE_BYTES[r.model.dtype] if engines_on_gpu(r, cuda=cuda) else 4,
            sequences=seqs,
            seq_len=r.model.max_seq_len,
            max_batch_size=g.max_batch_size,
        )
    return generator_plan(
        dims,
        kind="sglang",
        dtype_bytes=DTYPE_BYTES[r.weights.dtype],
        sequences=seqs,
        seq_len=r.model.max_seq_len,
        tp=max(min(server_tps), 1) if server_tps else 1,
    )


def engines_gpu_bytes(dims: ModelDims | None, recipe: Recipe, *, cuda: bool) -> int:
    """What the built-in engines on rank 0's GPU hold there (weights, staged copy, slots); 0
    without ``dims``."""
    n = engines_on_gpu(recipe, cuda=cuda)
    gen = generator_plan_for(dims, recipe, cuda=cuda) if n and dims is not None else None
    return n * gen.total if gen is not None else 0


def gib(n: float) -> str:
    """Bytes as GiB for a report line: 3 significant figures below 10, one decimal above."""
    g = n / GiB
    return f"{g:.1f}" if g >= 10 else f"{g:.3g}"

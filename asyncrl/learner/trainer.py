"""The learner: TorchTitan's parts (not its Trainer) assembled into an off-policy RL step
(docs/off-policy.md).

Build: ``ParallelDims`` → model spec from the HF folder → meta build → ``parallelize_fn`` (FSDP2) →
``to_empty`` / ``init_weights`` → optimizer and LR-scheduler containers → ``CheckpointManager``, which
loads the HF weights through the state-dict adapter (or resumes the run's latest DCP checkpoint).

Step (all ranks, the same batch): sequences → this rank's share → the learner's calls of the recipe's
dataflow (:mod:`asyncrl.dataflow`), level by level: π_prox and π_ref (forward-only passes), the
critic's values, the advantages, then the train steps: for each epoch, for each mini-batch:
micro-batches → logprobs at the sampling temperature → loss normalised by the mini-batch's GLOBAL
counts → backward → ``clip_grad_norm_`` → optimizer and scheduler step (then the critic's update on
the same micro-batches); then version + 1 (one version per batch, whatever the updates) →
publishers. The graph's generate and reward calls ran in the rollout workers: their outputs are the
batch.

Every collective runs on every rank with the same shapes, whatever the data: the micro-batch count is
agreed (empty rows pad), the reference forward runs on empty rows too, and the statistics reduced
at the end always have the same keys.

Gradient accumulation reduce-scatters at every micro-batch, as TorchTitan's trainer does: the
gradients accumulate sharded, ``4·P/N`` bytes a rank (what :mod:`asyncrl.memory` prices). Turning
gradient sync off for all but the last micro-batch would save the collectives of the others but
keep every parameter's unsharded float32 gradient on every rank between them, ``4·P`` (FSDP2's
``unsharded_accumulated_grad``): +30 GiB a rank for Qwen3-8B. The critic's and the reward model's
updates accumulate the same way.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchtitan.components.optimizer import (
    LRSchedulersContainer,
    OptimizersContainer,
)
from torchtitan.distributed import utils as dist_utils
from torchtitan.protocols.model_spec import ModelSpec

from asyncrl import dataflow, malloc
from asyncrl import metric_names as names
from asyncrl.learner import cpu_shims, export
from asyncrl.learner.advantages import compute_advantages
from asyncrl.learner.attention import attention_masks
from asyncrl.learner.build import Builder
from asyncrl.learner.checkpoint import Checkpoints
from asyncrl.learner.critic import CRITIC_STATES, Critic, assign_targets, critic_zero_stats
from asyncrl.learner.distributed import collective_timeout_s, ensure_distributed
from asyncrl.learner.drift import drift_sums, finalize_drift
from asyncrl.learner.logprobs import (
    chunk_tokens,
    chunked_backward,
    chunked_logprobs,
    local_hidden,
)
from asyncrl.learner.losses import (
    Normaliser,
    count_tokens_and_seqs,
    finalize_stats,
    needs_prox,
    policy_loss,
    zero_stats,
)
from asyncrl.learner.model import build_spec
from asyncrl.learner.offload import Offloader, Reallocation
from asyncrl.learner.packing import (
    MicroBatch,
    Sequence,
    make_sequence,
    pack,
    split_micro_batches,
    split_minibatches,
)
from asyncrl.learner.placement import (
    RoleMesh,
    build_role_meshes,
    exchanges,
)
from asyncrl.learner.reshard import reshard
from asyncrl.learner.source import Batch, BatchSource, broadcast_bytes
from asyncrl.recipe import (
    Recipe,
    RecipeError,
    check_critic_placement,
    check_placement,
    learner_roles,
)
from asyncrl.rollout.turns import turn_of

Publisher = Callable[[int, "Trainer"], None]
"""Called on every rank after each optimizer step with the new version (weights, announcements)."""


log = logging.getLogger("asyncrl.learner")


class LearnerError(RuntimeError):
    """A configuration or state the learner cannot run with (one-line message)."""


def peak_memory() -> dict[str, float]:
    """This process's high-water marks so far: resident memory (Linux reports KiB), and on a GPU
    the most the caching allocator ever handed out."""
    out = {"learner/max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if not cpu_shims.ON_CPU:
        out["learner/device_max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


@dataclass(kw_only=True)
class StepResult:
    """What one optimizer step reports (identical on every rank)."""

    version: int
    loss: float
    metrics: dict[str, float]


class Trainer:
    """The learner on one rank. Construct it on every rank (collective), then call :meth:`step`.

    ``Trainer(recipe, source=None, run_dir=None, checkpointing=True)``: ``source`` matters on rank 0
    only; ``run_dir`` defaults to the recipe's run folder; with ``checkpointing=False`` nothing is
    written (the HF weights are still loaded through the CheckpointManager).
    """

    def __init__(
        self,
        recipe: Recipe,
        *,
        source: BatchSource | None = None,
        run_dir: str | Path | None = None,
        checkpointing: bool = True,
    ) -> None:
        r = self.recipe = recipe
        self.rank, self.world = ensure_distributed(collective_timeout_s(r))
        self.device = torch.device("cpu")
        if not cpu_shims.ON_CPU:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        self.source = source
        self.run_dir = Path(run_dir) if run_dir is not None else r.run_dir
        self.model_dir = r.resolve(r.model.path)
        self.alg = r.algorithm
        self.temperature = 1.0 if self.alg.loss == "sft" else r.rollout.logprob_temperature
        if r.model.dtype == "float16":
            raise LearnerError("model.dtype: float16 training is not supported; use bfloat16")
        self.version = 0
        self.publishers: list[Publisher] = []
        self.source_state: dict | None = None
        self.last_export = ""
        self._batch_info: dict[str, float] = {}

        # Each role's ranks and parallel dims (asyncrl/learner/placement.py), checked first.
        self.dataflow = dataflow.from_recipe(r)
        self.check_dataflow()
        roles = learner_roles(r)
        self.with_critic = "critic" in roles
        try:
            check_placement(r.placement, self.world, roles=roles)
            if self.with_critic:
                check_critic_placement(r.placement, self.world)
        except RecipeError as e:  # one line, as the learner's other configuration errors
            raise LearnerError(str(e)) from None
        self.meshes = build_role_meshes(r.placement, self.world, self.rank, roles)
        self.colocated = all(m.whole_world for m in self.meshes.values())
        actor = self.meshes["actor"]
        # the driver's calls read the actor's shares when every role is on every rank
        self.exchanges = exchanges(
            self.dataflow,
            {k: m.layout for k, m in self.meshes.items()},
            actor.layout if self.colocated else None,
        )
        self.parallel_dims = actor.parallel_dims
        dist_utils.set_spmd_backend(cpu_shims.SPMD_BACKEND)
        # Data parallelism: the ranks of one tensor-parallel group see the same sequences, so the
        # batch is split over the actor's FSDP ranks and its sums are reduced over them alone.
        self.dp_rank, self.dp_size, self.dp_group = 0, 1, None
        if actor.holds:
            dp_mesh = self.parallel_dims.get_mesh("fsdp")
            self.dp_rank, self.dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
            self.dp_group = dp_mesh.get_group()

        self.build = Builder(r, self.meshes, self.device, self.run_dir)
        self.spec = self.model_spec()
        self.max_seq_len = self.spec.model.max_seq_len
        # a rank's logits span its vocabulary slice: 1/tp of it under tensor parallelism (the
        # actor's and π_ref's projections share the chunk, so the smaller degree sizes it)
        tp = min(r.placement.actor.tensor_parallel, r.placement.ref.tensor_parallel)
        vocab = -(-self.spec.model.vocab_size // tp)
        self.chunk_tokens = chunk_tokens(vocab, r.learner.logits_chunk_mb)
        if r.learner.compile and cpu_shims.ON_CPU:
            log.warning(
                "learner.compile on CPU: every new batch layout recompiles the blocks (measured on "
                "the tiny test model: 38-60 s per step against 0.3 s eager); it is meant for GPUs"
            )

        # A rank outside the actor's ranks holds no actor (model, optimizer: None).
        self.model: torch.nn.Module = None  # type: ignore[assignment]
        self.optimizers: OptimizersContainer = None  # type: ignore[assignment]
        self.lr_schedulers: LRSchedulersContainer = None  # type: ignore[assignment]
        if actor.holds:
            self.model = self.build.model(self.spec, "actor")
            self.model.train()
            self.optimizers, self.lr_schedulers = self.build.optimizer(self.model, r.learner.lr)
        self.ref_model: torch.nn.Module | None = None

        self.adapter = self.spec.state_dict_adapter(self.spec.model, str(self.model_dir))
        # PPO with a critic: the value model on its ranks, checkpointed with the actor (its keys)
        critic_mesh = self.meshes.get("critic")
        self.critic = Critic(r, self.build) if critic_mesh and critic_mesh.holds else None
        self.checkpointing = checkpointing
        critic_states: dict[str, Any] | None = None
        if self.critic is not None:
            critic_states = self.critic.states()
        elif self.with_critic:  # on other ranks
            critic_states = dict.fromkeys(CRITIC_STATES)
        self.checkpoints = Checkpoints(
            self.recipe.learner,
            model=self.model,
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            extra_states=critic_states or {},
            adapter=self.adapter,
            run_dir=self.run_dir,
            hf_folder=self.model_dir if self.meshes["actor"].whole_world else None,
            enabled=checkpointing,
        )
        self._load()
        ref_mesh = self.meshes.get("ref")
        self.ref_source = ""  # how π_ref was filled on this rank: "reshard" or "hf"
        if ref_mesh is not None and ref_mesh.holds:
            # π_ref: the initial HF weights, frozen, sharded by its own placement (forward only)
            self.ref_model = self.build.model(self.spec, "ref")
            self._fill_ref(ref_mesh)
            self.ref_model.eval().requires_grad_(False)
        self.realloc = self.reallocation()

    def _fill_ref(self, ref_mesh: RoleMesh) -> None:
        """π_ref's initial weights: at a fresh start on the actor's ranks they are the actor's
        just-loaded ones, resharded into the ref's layout (:func:`reshard`: no second read of the
        HF folder); after a resume the actor holds trained weights, and on other ranks there is no
        actor to copy from: read from the HF folder. Collective over the ref's ranks."""
        assert self.ref_model is not None
        if not self.resumed and ref_mesh.ranks == self.meshes["actor"].ranks:
            moved = reshard(self.model, self.ref_model)
            self.ref_source = "reshard"
            log.info(
                "π_ref: resharded from the actor's initial weights (tensor_parallel %d -> %d, "
                "%.1f MiB gathered)",
                self.recipe.placement.actor.tensor_parallel,
                self.recipe.placement.ref.tensor_parallel,
                moved / 2**20,
            )
            return
        self.build.load_hf(self.ref_model, self.adapter, self.model_dir, group=ref_mesh.group)
        self.ref_source = "hf"
        why = "the actor holds trained weights" if self.resumed else "not on the actor's ranks"
        log.info("π_ref: loaded from %s (%s)", self.model_dir, why)

    def reallocation(self) -> Reallocation:
        """The critic and the reference placed with ``offload: true`` give their device memory back
        between their calls (docs/placement.md). Not the actor: it is published, checkpointed and
        exported between steps. On CPU the device is host memory: nothing to free."""
        offloaders = {}
        roles = {"critic": self.critic, "ref": self.ref_model}
        for role in ("actor", "critic", "ref"):
            if not getattr(self.recipe.placement, role).offload:
                continue
            if cpu_shims.ON_CPU or roles.get(role) is None:
                why = (
                    "on CPU the device is host memory"
                    if cpu_shims.ON_CPU
                    else "the actor is published and checkpointed between steps"
                    if role == "actor"
                    else f"no {role} model on this rank"
                )
                log.info("placement.%s.offload: %s: nothing is freed", role, why)
            elif role == "critic":
                c = self.critic
                offloaders[role] = Offloader(
                    model=c.model, optimizers=list(c.optimizers), device=self.device
                )
            else:
                offloaders[role] = Offloader(model=self.ref_model, device=self.device)
        return Reallocation(offloaders=offloaders)

    def model_spec(self) -> ModelSpec:
        """The TorchTitan spec of ``model.path`` (a subclass trains another head on it)."""
        r = self.recipe
        return build_spec(
            self.model_dir, attention=r.model.attention, max_seq_len=r.model.max_seq_len
        )

    def check_dataflow(self) -> None:
        """Refuse, before any model loads, a graph with a call :meth:`step` cannot run."""
        unknown = [c.label for c in self.dataflow.calls if c.name not in CALL_RUNNERS]
        if unknown:
            raise LearnerError(f"{self.dataflow.name}: no runner in the learner for {unknown}")

    # ------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------

    @property
    def checkpoint_dir(self) -> Path:
        return self.checkpoints.folder

    def latest_checkpoint_step(self) -> int:
        """The highest complete ``step-N`` in the run's checkpoint folder, or -1."""
        return self.checkpoints.latest_step()

    def _load(self) -> None:
        """The latest checkpoint (with ``run.resume``), else the HF weights of ``model.path``."""
        step = self.latest_checkpoint_step()
        if step >= 0 and not self.recipe.run.resume:
            raise LearnerError(
                f"{self.checkpoint_dir} already holds checkpoints (step {step}); "
                "set run.resume=true to continue it or pick another run.name"
            )
        self.resumed = step >= 0  # the actor holds a checkpoint's weights, not model.path's
        state = self.checkpoints.load()
        actor = self.meshes["actor"]
        if step < 0 and not actor.whole_world and actor.holds:
            self.build.load_hf(self.model, self.adapter, self.model_dir, group=actor.group)
        if state is not None:
            self.version = int(state.get("version", step))
            self.source_state = state.get("source")
            if self.source is not None and self.source_state is not None and self.rank == 0:
                self.source.load_state_dict(self.source_state)

    def save_checkpoint(self, *, force: bool = False) -> bool:
        """DCP checkpoint of model, optimizer, scheduler, version and source state (collective).

        Saves when the version is a multiple of ``learner.checkpoint_every`` or when ``force``.
        """
        if not self.checkpoints.due(self.version, force=force):
            return False
        self.free_gradients()
        self.realloc.reload_all()  # the critic's state, offloaded after its calls
        src = self.source.state_dict() if self.source is not None and self.rank == 0 else None
        text = json.dumps({"version": self.version, "source": src})
        text = broadcast_bytes(text.encode() if self.rank == 0 else None).decode()
        return self.checkpoints.save(self.version, text, last=force)

    def free_gradients(self) -> None:
        """Drop the last step's gradients and give their memory back before a checkpoint or an
        export needs room (a model's size in float32: 2.4 GB for Qwen3-0.6B; the next step's
        backward allocates them again). They are not part of either."""
        if self.optimizers is not None:
            self.optimizers.zero_grad()  # set_to_none
        if self.critic is not None:
            self.critic.optimizers.zero_grad()
        malloc.release_freed_memory()

    def wait_for_checkpoint(self) -> None:
        self.checkpoints.wait()

    def close(self) -> None:
        self.checkpoints.close()

    # ------------------------------------------------------------------------------------------
    # Weights out
    # ------------------------------------------------------------------------------------------

    def hf_state_dict(
        self, dtype: torch.dtype | None = None, *, all_ranks: bool = True
    ) -> dict[str, torch.Tensor]:
        """The actor's full tensors under HF names (:func:`export.hf_state_dict`; collective over the
        actor's ranks). With ``all_ranks=False`` only rank 0 keeps them."""
        return export.hf_state_dict(
            self.model, self.adapter, dtype, keep=all_ranks or self.rank == 0
        )

    def export_hf(self, path: str | Path, *, dtype: str | None = None) -> Path:
        """The actor as an HF folder at ``path`` (:func:`export.export_hf`; collective)."""
        self.free_gradients()
        return export.export_hf(
            self.model,
            self.checkpoints.manager,
            path,
            dtype=dtype or self.recipe.model.dtype,
            source=self.model_dir,
            rank=self.rank,
        )

    def maybe_export(self) -> str:
        """HF export every ``learner.export_every`` versions into ``run_dir/hf/v{version}``."""
        k = self.recipe.learner.export_every
        if k and self.version % k == 0:
            self.last_export = str(self.export_hf(self.run_dir / "hf" / f"v{self.version}"))
            return self.last_export
        return ""

    def add_publisher(self, fn: Publisher) -> None:
        self.publishers.append(fn)

    # ------------------------------------------------------------------------------------------
    # The step
    # ------------------------------------------------------------------------------------------

    def sequences(self, batch: Batch) -> list[Sequence]:
        """Every sample of the batch laid out for packing, in group order, with its reward (the
        ``advantages`` call sets the advantages); refuses a token outside the staleness bound."""
        is_sft = self.alg.loss == "sft"
        groups = [g for g in batch.groups if g.samples]
        rewards = [g.rewards for g in groups]
        seqs, i = [], 0
        eta = self.recipe.buffer.max_staleness
        self._batch_info = {"learner/truncated_samples": 0.0}
        staleness: list[np.ndarray] = []
        for gi, g in enumerate(groups):
            for si, s in enumerate(g.samples):
                mask = s.loss_mask
                if self.recipe.buffer.overlong_filter and s.finish_reason == "length":
                    mask = np.zeros_like(mask)
                if not is_sft and (mask > 0).any():
                    k = self.version - np.asarray(s.versions)[mask > 0]
                    if k.max() > eta or k.min() < 0:
                        # Every rank sees the whole batch, so every rank refuses it alike.
                        raise LearnerError(
                            f"sample {s.id!r} has tokens of staleness {int(k.min())}..{int(k.max())}"
                            f" at version {self.version}, outside [0, buffer.max_staleness={eta}]"
                        )
                    staleness.append(k)
                if len(s.prompt_ids) + len(s.completion_ids) - 1 > self.max_seq_len:
                    self._batch_info["learner/truncated_samples"] += 1
                seqs.append(
                    make_sequence(
                        i,
                        s.prompt_ids,
                        s.completion_ids,
                        loss_mask=mask,
                        behavior_logprobs=s.behavior_logprobs,
                        versions=s.versions,
                        reward=float(rewards[gi][si]),
                        max_len=self.max_seq_len,
                    )
                )
                i += 1
        if staleness:
            k = np.concatenate(staleness)
            self._batch_info["learner/staleness_mean"] = float(k.mean())
            self._batch_info["learner/staleness_max"] = float(k.max())
        if seqs and not is_sft:  # the reward curve, one point per step (an SFT row has no reward)
            self._batch_info[names.BATCH_REWARD_MEAN] = float(np.mean(np.concatenate(rewards)))
            lengths = [len(s.completion_ids) for g in groups for s in g.samples]
            self._batch_info[names.BATCH_RESPONSE_LENGTH_MEAN] = float(np.mean(lengths))
        return seqs

    def micro_batches(
        self, mine: list[Sequence], group: dist.ProcessGroup | None = None
    ) -> list[MicroBatch]:
        """This rank's sequences, packed; every rank of the role (``group``, default every rank)
        runs the same number of micro-batches (FSDP's collectives must pair up), padding with empty
        rows that carry no loss."""
        bins = split_micro_batches(mine, self.recipe.learner.micro_batch_tokens)
        n = torch.tensor([len(bins)], dtype=torch.int64)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
        bins += [[] for _ in range(int(n) - len(bins))]
        return [pack(b).to(self.device) for b in bins]

    def _hidden(self, mb: MicroBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """The last hidden states ``[1, L, D]``: the models stop before their output projection,
        which runs a chunk of trained tokens at a time (:mod:`asyncrl.learner.logprobs`). A plain
        tensor, also under tensor parallelism (:func:`local_hidden`)."""
        mb = mb.to(self.device)
        model = self.model if model is None else model
        return local_hidden(model(mb.tokens, mb.positions, attention_masks(model, mb.positions)))

    @torch.no_grad()
    def _token_logprobs(
        self, mb: MicroBatch, model: torch.nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log π and entropy of each trained token of ``mb`` (flat over ``mb.sel``), no gradient."""
        model = self.model if model is None else model
        h = self._hidden(mb, model)
        return chunked_logprobs(
            h[0, mb.sel],
            mb.labels[0, mb.sel],
            model.lm_head,
            temperature=self.temperature,
            chunk=self.chunk_tokens,
        )

    def logprobs(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        """Forward only: log π of each micro-batch's trained tokens with the current weights, at the
        sampling temperature (generators report log_softmax(logits / T): docs/off-policy.md)."""
        return [self._token_logprobs(mb)[0] for mb in mbs]

    def _drift(self, mb: MicroBatch, prox_logp: torch.Tensor) -> torch.Tensor:
        """This micro-batch's drift sums (:func:`drift_sums`) against π_prox."""
        cpu = (t.cpu() for t in (mb.behavior_logp, prox_logp, self.version - mb.versions, mb.mask))
        return drift_sums(
            *cpu, mb.mixed_versions.cpu(), max_staleness=self.recipe.buffer.max_staleness
        )

    def _per_token(
        self,
        mine: list[Sequence],
        compute: Callable[[MicroBatch], dict[str, torch.Tensor]],
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """A forward-only pass over this rank's sequences (collective over the role's ``group``):
        ``compute`` gives, per micro-batch, named values flat over its trained tokens, which are
        stored on each :class:`Sequence` as a per-position array of that name (0 off its trained
        tokens)."""
        by_index = {s.index: s for s in mine}
        for mb in self.micro_batches(mine, group):
            out = {k: v.float().cpu().numpy() for k, v in compute(mb).items()}
            sel = mb.sel.cpu().numpy()
            starts = np.cumsum([0] + [len(by_index[i]) for i in mb.seq_index])
            for j, i in enumerate(mb.seq_index):
                seq = by_index[i]
                at = (sel >= starts[j]) & (sel < starts[j + 1])
                for name, flat in out.items():
                    arr = np.zeros(len(seq), np.float32)
                    arr[sel[at] - starts[j]] = flat[at]
                    setattr(seq, name, arr)

    def _recompute_prox(
        self, mine: list[Sequence], group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        """π_prox before a batch's first update (AReaL's recompute): one forward-only pass over this
        rank's sequences, stored on each :class:`Sequence`; returns the batch's drift sums."""
        drift = torch.zeros(self.recipe.buffer.max_staleness + 2, 3, dtype=torch.float64)

        def prox(mb: MicroBatch) -> dict[str, torch.Tensor]:
            lp = self._token_logprobs(mb)[0]
            drift.add_(self._drift(mb, lp.float().cpu()))
            return {"prox_logp": lp}

        self._per_token(mine, prox, group)
        return drift

    # -- the learner's calls of the dataflow (CALL_RUNNERS) -----------------------------------------

    def _call_prox(self, run: _Step) -> None:
        """``prox``: π_prox, the policy before the step's first update (several updates; V-trace's
        π). Its drift sums count when the updates do not measure the drift themselves."""
        actor = self.meshes["actor"]
        drift = self._recompute_prox(run.share("actor"), actor.group)
        if run.several:
            run.totals.drift += drift

    def _call_ref(self, run: _Step) -> None:
        """``ref``: the frozen reference's logprobs (a KL term in the loss, or a KL reward)."""
        ref = self.ref_model
        self._per_token(
            run.share("ref"),
            lambda mb: {"ref_logp": self._token_logprobs(mb, ref)[0]},
            self.meshes["ref"].group,
        )

    def _call_values(self, run: _Step) -> None:
        """``values``: the critic's V at every trained token."""
        critic = self.critic
        assert critic is not None
        group = self.meshes["critic"].group
        self._per_token(run.share("critic"), lambda mb: {"values": critic.values(mb)}, group)

    def _call_advantages(self, run: _Step) -> None:
        """``advantages``: per token from the critic's values (whitened over the batch), or per
        sample from the group rewards of the whole batch (each rank computes them all alike).
        Roles on every rank: each rank its share, the whitening's sums reduced over them; roles on
        their own ranks: every rank all sequences (their values exchanged), no collective."""
        if self.with_critic:
            seqs = run.mine if self.colocated else run.seqs
            group = self.meshes["actor"].dp_group if self.colocated else None
            run.info |= assign_targets(seqs, self.alg, reduce=self.colocated, group=group)
        else:
            run.info |= self.group_advantages(run.batch, run.seqs)

    def _exchange(self, run: _Step, keys: tuple[str, ...]) -> None:
        """Every rank gets every sequence's ``keys`` (per-token float32 arrays), each computed on
        its producing role's ranks: one float32 sum over the global group (a CPU tensor: gloo), to
        which the first rank of each tensor-parallel group that computed a sequence writes its
        arrays and a presence mark, every other rank zeros. Tensors, not pickled objects: ranks may
        sit on other hosts."""
        role_of = {k: c.role for c in self.dataflow.calls for k in c.outputs}
        ends = np.cumsum([0] + [len(s) for s in run.seqs])
        total, n = int(ends[-1]), len(run.seqs)
        pos = {s.index: j for j, s in enumerate(run.seqs)}
        buf = np.zeros((len(keys), total + n), np.float32)  # each key: its arrays, then presence
        for a, k in enumerate(keys):
            mesh = self.meshes[role_of[k]]
            if not mesh.holds or mesh.tp_rank != 0:
                continue
            for s in run.share(role_of[k]):
                arr = getattr(s, k)
                if arr is not None:
                    j = pos[s.index]
                    buf[a, ends[j] : ends[j + 1]] = arr
                    buf[a, total + j] = 1.0
        summed = torch.from_numpy(buf)
        dist.all_reduce(summed)
        buf = summed.numpy()
        for a, k in enumerate(keys):
            for j, s in enumerate(run.seqs):
                if buf[a, total + j] > 0:
                    setattr(s, k, buf[a, ends[j] : ends[j + 1]].copy())

    def group_advantages(self, batch: Batch, seqs: list[Sequence]) -> dict[str, float]:
        """Each sequence's advantage from its group's rewards (``algorithm.advantage``);
        ``seqs`` are :meth:`sequences` of ``batch``. Per-turn samples (``rollout.turn_samples``)
        are found by the place each carries (``turn_of``): the group's baseline is over episodes.
        Returns the batch's ReMax count."""
        groups = [g for g in batch.groups if g.samples]
        if not groups:
            return {}
        baselines = [g.baseline_reward for g in groups]
        advs = compute_advantages(
            [g.rewards for g in groups],
            kind=self.alg.advantage,
            eps=self.alg.adv_eps,
            baselines=baselines,
            turns=[[turn_of(s) for s in g.samples] for g in groups],
            turn_discount=self.recipe.rollout.turn_discount,
        )
        for seq, a in zip(seqs, torch.cat(advs).tolist(), strict=True):
            seq.advantage = a
        if self.alg.advantage != "remax":
            return {}
        # groups whose greedy episode failed: their baseline is their own mean reward
        return {names.REMAX_MEAN_BASELINES: float(baselines.count(None))}

    def _critic_interleaved(self) -> bool:
        """The critic shares the actor's ranks: its updates follow the actor's (one level's two
        train steps, run in turn on the same ranks)."""
        critic = self.meshes.get("critic")
        return critic is not None and critic.ranks == self.meshes["actor"].ranks

    def _minibatches(self, mine: list[Sequence]) -> list[list[Sequence]]:
        """``learner.epochs`` passes over this rank's share of a role, each in ``learner.minibatches``
        random parts (the same seeds for actor and critic), in update order."""
        lc = self.recipe.learner
        return [
            part
            for epoch in range(lc.epochs)
            for part in split_minibatches(
                mine, lc.minibatches, seed=(self.recipe.run.seed, self.version, epoch)
            )
        ]

    def _call_train_actor(self, run: _Step) -> None:
        """``train_actor``: ``learner.epochs`` passes of ``learner.minibatches`` updates on the
        actor's ranks; with a critic on the same ranks, each update is followed by the critic's on
        the same micro-batches and normaliser (``train_critic``: the two train steps are
        independent calls of one level, interleaved per mini-batch on shared ranks)."""
        interleaved = self.critic is not None and self._critic_interleaved()
        for part in self._minibatches(run.share("actor")):
            mbs, norm = self._update(part, run.totals, drift=not run.several)
            if interleaved:
                assert self.critic is not None
                grad_norm = self.critic.update(mbs, norm, run.totals.stats)
                run.totals.critic_grad_norms.append(grad_norm)

    def _call_train_critic(self, run: _Step) -> None:
        """``train_critic``: on the actor's ranks, done within :meth:`_call_train_actor`'s updates;
        on its own ranks, the same epochs and mini-batch draws over its share, while the actor's
        ranks train the actor."""
        assert self.critic is not None
        if self._critic_interleaved():
            assert "train_actor" in run.done
            return
        mesh = self.meshes["critic"]
        for part in self._minibatches(run.share("critic")):
            mbs = self.micro_batches(part, mesh.group)
            norm = self._normaliser(mbs, mesh)
            grad_norm = self.critic.update(mbs, norm, run.totals.stats)
            run.totals.critic_grad_norms.append(grad_norm)

    def _micro_batch(
        self, mb: MicroBatch, norm: Normaliser, totals: _StepTotals, *, drift: bool
    ) -> None:
        """Forward and backward of one micro-batch's share of an update's loss.

        The loss is computed on log π (and the entropy) as leaves; its gradient then goes back
        through the output projection a chunk at a time and through the decoder
        (:mod:`asyncrl.learner.logprobs`). A rank whose micro-batch trains no token runs the same
        collectives (the projection on one row, with gradient 0), so FSDP's pair up."""
        alg = self.alg
        h = self._hidden(mb)
        # the ``ref`` call's, computed here or on the ref's own ranks (then exchanged)
        ref_logp = mb.ref_logp if "ref" in self.meshes else None
        rows = mb.sel if mb.sel.numel() else torch.zeros(1, dtype=torch.long, device=h.device)
        hidden, labels = h[0, rows], mb.labels[0, rows].clamp(min=0)
        chunking = {"temperature": self.temperature, "chunk": self.chunk_tokens}
        # Both passes run on every rank, in the same order: FSDP's state machine for the group that
        # holds the projection (and its reduce-scatter) must follow the same path everywhere.
        lp, ent = chunked_logprobs(hidden, labels, self.model.lm_head, **chunking)
        if mb.sel.numel() == 0:
            grad_logp, grad_ent = torch.zeros_like(lp), None
        else:
            logp = lp.requires_grad_(True)
            entropy = ent.requires_grad_(True) if alg.entropy_coef != 0 else ent
            prox = mb.prox_logp if mb.prox_logp is not None else logp.detach()
            loss, st = policy_loss(
                cfg=alg,
                norm=norm,
                logp=logp,
                mask=mb.mask,
                seq_ids=mb.seq_ids,
                behavior_logp=mb.behavior_logp,
                advantages=mb.advantages,
                prox_logp=prox if needs_prox(alg.loss) else None,
                ref_logp=ref_logp,
                entropy=entropy,
            )
            wrt = [logp, entropy] if entropy.requires_grad else [logp]
            grads = torch.autograd.grad(loss, wrt, allow_unused=True)
            grad_logp = torch.zeros_like(logp) if grads[0] is None else grads[0]
            grad_ent = None
            if len(grads) > 1:
                grad_ent = torch.zeros_like(entropy) if grads[1] is None else grads[1]
            for k, v in st.items():
                totals.stats[k] += v.cpu()
            if drift and alg.loss != "sft":
                totals.drift += self._drift(mb, prox)
            totals.loss += loss.detach().to(torch.float64).cpu()
        totals.tokens += 0 if mb.is_empty else mb.num_tokens
        grad_hidden = chunked_backward(
            hidden,
            labels,
            self.model.lm_head,
            grad_logp,
            grad_ent,
            **chunking,
        )
        hidden.backward(grad_hidden)

    def _normaliser(self, mbs: list[MicroBatch], mesh: RoleMesh) -> Normaliser:
        """A mini-batch's GLOBAL token and sequence counts: every micro-batch of every
        data-parallel rank of the role (collective over them; a tensor-parallel group's ranks hold
        the same tokens: counted once)."""
        counts = sum((count_tokens_and_seqs(mb.mask, mb.seq_ids) for mb in mbs), torch.zeros(2))
        counts = counts.to(torch.float64)
        dist.all_reduce(counts, group=mesh.dp_group)
        return Normaliser(
            tokens=float(counts[0]),
            seqs=float(counts[1]),
            seq_len=float(self.recipe.rollout.max_new_tokens),
        )

    def _update(
        self, mine: list[Sequence], totals: _StepTotals, *, drift: bool
    ) -> tuple[list[MicroBatch], Normaliser]:
        """One optimizer update on this rank's share of a mini-batch (collective over the actor's
        ranks). The loss is normalised by the mini-batch's GLOBAL counts; π_prox is the recomputed
        one when the sequences carry it, else this forward's own (the step's starting weights, one
        update). Returns the micro-batches and normaliser (a critic on these ranks reuses them)."""
        actor = self.meshes["actor"]
        mbs = self.micro_batches(mine, actor.group)
        norm = self._normaliser(mbs, actor)
        self.optimizers.zero_grad()
        for mb in mbs:
            self._micro_batch(mb, norm, totals, drift=drift)
        clip = self.recipe.learner.grad_clip
        grad_norm = dist_utils.clip_grad_norm_(
            list(self.model.parameters()), clip if clip > 0 else math.inf, foreach=True
        )
        totals.grad_norms.append(float(grad_norm))
        totals.lrs.append(self.lr_schedulers.schedulers[0].get_last_lr()[0])
        totals.micro_batches += len(mbs)
        self.optimizers.step()
        self.lr_schedulers.step()
        return mbs, norm

    def step(self, batch: Batch) -> StepResult:
        """One batch, one new version (collective; every rank passes the same batch).

        ``learner.epochs`` passes, each of ``learner.minibatches`` optimizer updates on a random
        part of the batch. With more than one update, π_prox (and the drift) come from a forward-only
        pass before the first; with one, from that update's own forward, which is the same thing.
        """
        t0 = time.perf_counter()
        lc, eta = self.recipe.learner, self.recipe.buffer.max_staleness
        seqs = self.sequences(batch)
        totals = _StepTotals(drift=torch.zeros(eta + 2, 3, dtype=torch.float64))
        if self.with_critic:
            totals.stats |= critic_zero_stats()
        run = _Step(
            batch=batch,
            seqs=seqs,
            mine=self.meshes["actor"].share(seqs),
            shares={role: m.share(seqs) for role, m in self.meshes.items()},
            totals=totals,
            several=lc.minibatches * lc.epochs > 1,
        )
        # dependency order; one level's calls independent; offloaded roles reloaded around theirs
        for level in self.realloc.levels(self.dataflow.order()):
            for call in level:
                if call.name in self.exchanges:  # another role's outputs: every rank takes part
                    self._exchange(run, self.exchanges[call.name])
                runner = CALL_RUNNERS[call.name]
                # None: ran in the rollout workers, its outputs are the batch. A model role's call
                # runs on its ranks only; roles on disjoint ranks thus run one level's calls at once.
                mesh = self.meshes.get(call.role)
                if runner is not None and (mesh is None or mesh.holds):
                    getattr(self, runner)(run)
                run.done.add(call.name)
        self.version += 1

        # Every rank reduces the same keys and shapes, whatever its share held (zero_stats); a
        # role's per-update numbers (the same on its ranks) come from its first rank alone.
        keys = sorted(totals.stats)
        actor, critic = self.meshes["actor"], self.meshes.get("critic")
        role_numbers = torch.zeros(5, dtype=torch.float64)
        if actor.leader:
            role_numbers[:4] = torch.tensor(
                [
                    float(np.mean(totals.grad_norms)),
                    float(max(totals.grad_norms)),
                    float(totals.lrs[0]),
                    float(totals.micro_batches),
                ],
                dtype=torch.float64,
            )
        if critic is not None and critic.leader:
            role_numbers[4] = float(np.mean(totals.critic_grad_norms))
        local = torch.cat(
            [
                totals.loss.reshape(1),
                torch.tensor([float(totals.tokens)], dtype=torch.float64),
                role_numbers,
                torch.stack([totals.stats[k] for k in keys]),
                totals.drift.reshape(-1),
            ]
        )
        # a tensor-parallel group's ranks hold the same tokens: its first rank counts them
        trained = [m for role, m in self.meshes.items() if role != "ref" and m.holds]
        if any(m.tp_rank != 0 for m in trained):
            local[:2].zero_()
            local[7:].zero_()
        dist.all_reduce(local)
        updates = lc.minibatches * lc.epochs
        loss_total, tokens_total = float(local[0]) / updates, float(local[1])
        grad_norm, grad_norm_max, lr, micro_batches, critic_grad_norm = local[2:7].tolist()
        summed = dict(zip(keys, local[7 : 7 + len(keys)].tolist(), strict=True))
        dt = time.perf_counter() - t0
        metrics = {
            names.LOSS: loss_total,
            names.GRAD_NORM: grad_norm,
            "lr": lr,
            "learner/step_s": dt,
            names.TRAINED_TOKENS: tokens_total,
            names.TRAINED_TOKENS_PER_S: tokens_total / dt if dt > 0 else 0.0,
            "learner/micro_batches": micro_batches,
            "learner/updates": float(updates),
            "learner/sequences": float(len(seqs)),
        }
        if updates > 1:
            metrics["grad_norm/max"] = grad_norm_max
        if self.with_critic:
            metrics[names.VALUE_LOSS] = summed.pop("value_loss") / updates
            metrics["critic/grad_norm"] = critic_grad_norm
        metrics |= peak_memory()
        metrics |= self._batch_info | run.info
        metrics |= finalize_stats(summed)
        if self.alg.loss != "sft":
            metrics |= finalize_drift(local[7 + len(keys) :].reshape(eta + 2, 3))
        for k, v in batch.stats.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                metrics.setdefault(k if "/" in k else f"buffer/{k}", float(v))
        for fn in self.publishers:
            fn(self.version, self)
        return StepResult(version=self.version, loss=loss_total, metrics=metrics)


CALL_RUNNERS: dict[str, str | None] = {
    "generate": None,
    "generate_greedy": None,
    "reward_fn": None,
    "reward_fn_greedy": None,
    "reward": None,
    "reward_greedy": None,
    "prox": "_call_prox",
    "ref": "_call_ref",
    "values": "_call_values",
    "advantages": "_call_advantages",
    "train_actor": "_call_train_actor",
    "train_critic": "_call_train_critic",
}
"""Each dataflow call (:mod:`asyncrl.dataflow`, by name) → the Trainer method that runs it, or None
for the calls of the rollout workers (generation, rewards), whose outputs arrive as the batch."""


@dataclass(kw_only=True)
class _Step:
    """One step's data as its calls run: the batch, its sequences and this rank's shares of them,
    the running totals, what the calls reported, and which calls have run."""

    batch: Batch
    seqs: list[Sequence]
    mine: list[Sequence]  # this rank's share when split over every rank
    shares: dict[str, list[Sequence]]  # each role's share on this rank (none off its ranks)
    totals: _StepTotals
    several: bool  # more than one update per batch
    info: dict[str, float] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)

    def share(self, role: str) -> list[Sequence]:
        return self.shares[role]


@dataclass(kw_only=True)
class _StepTotals:
    """What one step's updates add up on this rank, reduced over ranks at the step's end."""

    drift: torch.Tensor
    loss: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    tokens: int = 0
    stats: dict[str, torch.Tensor] = field(default_factory=zero_stats)
    grad_norms: list[float] = field(default_factory=list)
    critic_grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    micro_batches: int = 0

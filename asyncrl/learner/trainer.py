"""The learner: TorchTitan's parts (not its Trainer) assembled into an off-policy RL learner
(docs/off-policy.md), one per rank.

Build: ``ParallelDims`` → model spec from the HF folder → meta build → ``parallelize_fn`` (FSDP2) →
``to_empty`` / ``init_weights`` → optimizer and LR-scheduler containers (:mod:`.build`) →
``CheckpointManager`` (:mod:`.checkpoint`), which loads the HF weights through the state-dict
adapter (or resumes the run's latest DCP checkpoint). What the step runs on is :class:`Models`
(:mod:`.models`); the step itself is :func:`asyncrl.learner.step.train_step`. Between steps the
Trainer keeps the version, checkpoints it and exports the actor; the caller publishes the weights
(:mod:`asyncrl.learner.main`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.distributed import utils as dist_utils
from torchtitan.protocols.model_spec import ModelSpec

from asyncrl import malloc
from asyncrl.dataflow import Dataflow
from asyncrl.learner import cpu_shims, export, lora, passes
from asyncrl.learner.build import Builder
from asyncrl.learner.calls import CALL_RUNNERS
from asyncrl.learner.checkpoint import Checkpoints
from asyncrl.learner.config import TrainerConfig
from asyncrl.learner.critic import CRITIC_STATES, Critic
from asyncrl.learner.distributed import ensure_distributed
from asyncrl.learner.logprobs import chunk_tokens
from asyncrl.learner.model_spec import build_spec, read_hf_config
from asyncrl.learner.models import LearnerError, Models, reallocation
from asyncrl.learner.packing import MicroBatch, Sequence
from asyncrl.learner.placement import RoleMesh, build_role_meshes, exchanges
from asyncrl.learner.reshard import reshard
from asyncrl.learner.reward_model import RewardModelSteps
from asyncrl.learner.scalar_model import scalar_spec, write_seq_cls_config
from asyncrl.learner.source import Batch, BatchSource, broadcast_bytes
from asyncrl.learner.step import StepResult, sequences, train_step
from asyncrl.moe import RouteShape
from asyncrl.recipe import RecipeError
from asyncrl.recipe.layout import check_critic_placement, check_placement, ref_is_lora_base

log = logging.getLogger("asyncrl.learner")


class Trainer:
    """The learner on one rank. Construct it on every rank (collective), then call :meth:`step`.

    ``Trainer(TrainerConfig.from_recipe(recipe), source=None, run_dir=None, checkpointing=True)``:
    ``source`` matters on rank 0 only; ``run_dir`` defaults to the recipe's run folder; with
    ``checkpointing=False`` nothing is written (the HF weights are still loaded through the
    CheckpointManager).
    """

    def __init__(
        self,
        config: TrainerConfig,
        *,
        source: BatchSource | None = None,
        run_dir: str | Path | None = None,
        checkpointing: bool = True,
    ) -> None:
        c = self.config = config
        self.rank, self.world = ensure_distributed(c.collective_timeout_s)
        device = torch.device("cpu")
        if not cpu_shims.ON_CPU:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        self.source = source
        self.run_dir = Path(run_dir) if run_dir is not None else c.run_dir
        self.model_dir = c.model_dir
        if c.build.dtype == "float16":
            raise LearnerError("model.dtype: float16 training is not supported; use bfloat16")
        self.version = 0
        self.source_state: dict | None = None
        self.last_export = ""
        self.lora = c.learner.lora.enabled  # the actor trains adapters on a frozen base

        # Each role's ranks and parallel dims (asyncrl/learner/placement.py), checked first.
        flow, roles = c.flow, c.roles
        self.check_dataflow(flow)
        try:
            check_placement(c.placement, self.world, roles=roles)
            if "critic" in roles:
                check_critic_placement(c.placement, self.world)
        except RecipeError as e:  # one line, as the learner's other configuration errors
            raise LearnerError(str(e)) from None
        meshes = build_role_meshes(c.placement, self.world, self.rank, roles)
        actor = meshes["actor"]
        colocated = all(m.whole_world for m in meshes.values())
        self.parallel_dims = actor.parallel_dims
        dist_utils.set_spmd_backend(cpu_shims.SPMD_BACKEND)
        # Data parallelism: the ranks of one tensor-parallel group see the same sequences, so the
        # batch is split over the actor's FSDP ranks and its sums are reduced over them alone.
        self.dp_rank, self.dp_size, self.dp_group = 0, 1, None
        if actor.holds:
            dp_mesh = self.parallel_dims.get_mesh("fsdp")
            self.dp_rank, self.dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
            self.dp_group = dp_mesh.get_group()

        self.build = Builder(c.build, meshes, device, self.run_dir)
        spec = self.model_spec()
        # a rank's logits span its vocabulary slice: 1/tp of it under tensor parallelism (the
        # actor's and π_ref's projections share the chunk, so the smaller degree sizes it)
        tp = min(c.placement.actor.tensor_parallel, c.placement.ref.tensor_parallel)
        vocab = -(-spec.model.vocab_size // tp)
        if c.learner.compile and cpu_shims.ON_CPU:
            log.warning(
                "learner.compile on CPU: every new batch layout recompiles the blocks (measured on "
                "the tiny test model: 38-60 s per step against 0.3 s eager); it is meant for GPUs"
            )
        self.models = Models(
            config=c,
            device=device,
            meshes=meshes,
            # the driver's calls read the actor's shares when every role is on every rank
            exchanges=exchanges(
                flow, {k: m.layout for k, m in meshes.items()}, actor.layout if colocated else None
            ),
            spec=spec,
            routes=RouteShape.from_config(read_hf_config(self.model_dir)),
            temperature=c.temperature,
            chunk_tokens=chunk_tokens(vocab, c.learner.logits_chunk_mb),
        )
        m = self.models
        # A rank outside the actor's ranks holds no actor (model, optimizer: None).
        if actor.holds:
            m.actor = self.build.model(spec, "actor")
            m.actor.train()
            m.optimizers, m.lr_schedulers = self.build.optimizer(m.actor, c.learner.lr)

        self.adapter = spec.state_dict_adapter(spec.model, str(self.model_dir))
        # PPO with a critic: the value model on its ranks, checkpointed with the actor (its keys)
        critic_mesh = meshes.get("critic")
        m.critic = Critic(c, self.build) if critic_mesh and critic_mesh.holds else None
        self.checkpointing = checkpointing
        critic_states: dict[str, Any] | None = None
        if m.critic is not None:
            critic_states = m.critic.states()
        elif m.with_critic:  # on other ranks
            critic_states = dict.fromkeys(CRITIC_STATES)
        self.checkpoints = Checkpoints(
            c.learner,
            model=m.actor,
            optimizers=m.optimizers,
            lr_schedulers=m.lr_schedulers,
            extra_states=critic_states or {},
            adapter=self.adapter,
            run_dir=self.run_dir,
            hf_folder=self.model_dir if actor.whole_world and not self.lora else None,
            enabled=checkpointing,
            adapters_only=self.lora,
        )
        self._load()
        # a reward model: the scalar-head model trained on preference pairs by its own executor
        self.reward_model: RewardModelSteps | None = None
        if c.loss == "reward_model":
            self.reward_model = RewardModelSteps(
                m, dp_rank=self.dp_rank, dp_size=self.dp_size, dp_group=self.dp_group
            )
            self.reward_model.start(self.adapter, fresh=self.version == 0)
        ref_mesh = meshes.get("ref")
        self.ref_source = ""  # how π_ref was filled on this rank: "reshard", "hf" or "actor"
        if ref_mesh is not None and ref_mesh.holds:
            m.ref = self._make_ref(spec, ref_mesh)
        self.realloc = reallocation(m)

    def _make_ref(self, spec: ModelSpec, ref_mesh: RoleMesh) -> torch.nn.Module:
        """π_ref, frozen, forward only, sharded by its own placement. At a fresh start on the actor's
        ranks it is resharded from the actor's just-loaded weights (:func:`reshard`: no second HF
        read); after a resume, on other ranks or beside a LoRA actor, read from the HF folder. With
        LoRA and laid out as the actor, it is the actor, whose frozen base it is (``call_ref`` turns
        the adapters off). Collective over the ref's ranks."""
        c = self.config
        if ref_is_lora_base(c.placement, c.learner.lora, self.world):
            self.ref_source = "actor"
            return self.models.actor
        ref = self.build.model(spec, "ref")
        same = not self.lora  # a LoRA actor's parameters are the base's and its adapters'
        if same and not self.resumed and ref_mesh.ranks == self.models.meshes["actor"].ranks:
            moved = reshard(self.models.actor, ref)
            self.ref_source = "reshard"
            log.info(
                "π_ref: resharded from the actor's initial weights (tensor_parallel %d -> %d, "
                "%.1f MiB gathered)",
                c.placement.actor.tensor_parallel,
                c.placement.ref.tensor_parallel,
                moved / 2**20,
            )
        else:
            self.build.load_hf(ref, self.adapter, self.model_dir, group=ref_mesh.group)
            self.ref_source = "hf"
            why = "the actor holds trained weights" if self.resumed else "not on the actor's ranks"
            why = why if same else "the actor has LoRA adapters"
            log.info("π_ref: loaded from %s (%s)", self.model_dir, why)
        return ref.eval().requires_grad_(False)

    def model_spec(self) -> ModelSpec:
        """The TorchTitan spec of ``model.path``: a causal LM, or a reward model's backbone with its
        scalar head."""
        c = self.config
        spec = scalar_spec if c.loss == "reward_model" else build_spec
        return spec(self.model_dir, attention=c.attention, max_seq_len=c.max_seq_len)

    def check_dataflow(self, flow: Dataflow) -> None:
        """Refuse, before any model loads, a graph with a call :meth:`step` cannot run (the
        reward-modelling graph is one call, ``train_reward``: :class:`RewardModelSteps`)."""
        known = {"train_reward"} if self.config.loss == "reward_model" else CALL_RUNNERS
        unknown = [c.label for c in flow.calls if c.name not in known]
        if unknown:
            raise LearnerError(f"{flow.name}: no runner in the learner for {unknown}")

    # ------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------

    def latest_checkpoint_step(self) -> int:
        """The highest complete ``step-N`` in the run's checkpoint folder, or -1."""
        return self.checkpoints.latest_step()

    def _load(self) -> None:
        """The latest checkpoint (with ``run.resume``), else the HF weights of ``model.path`` (with
        LoRA the base always is, the adapters from the checkpoint)."""
        step = self.latest_checkpoint_step()
        if step >= 0 and not self.config.resume:
            raise LearnerError(
                f"{self.checkpoints.folder} already holds checkpoints (step {step}); "
                "set run.resume=true to continue it or pick another run.name"
            )
        self.resumed = step >= 0  # the actor holds a checkpoint's weights, not model.path's
        state = self.checkpoints.load()
        actor = self.models.meshes["actor"]
        if actor.holds and (self.lora or (step < 0 and not actor.whole_world)):
            self.build.load_hf(self.models.actor, self.adapter, self.model_dir, group=actor.group)
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
        if self.models.optimizers is not None:
            self.models.optimizers.zero_grad()  # set_to_none
        if self.models.critic is not None:
            self.models.critic.optimizers.zero_grad()
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
        actor's ranks); with LoRA its adapters alone (:func:`lora.adapter_state_dict`: the
        generators hold the base). With ``all_ranks=False`` only rank 0 keeps them."""
        keep = all_ranks or self.rank == 0
        if self.lora:
            return lora.adapter_state_dict(self.models.actor, dtype, keep=keep)
        return export.hf_state_dict(self.models.actor, self.adapter, dtype, keep=keep)

    def export_hf(self, path: str | Path, *, dtype: str | None = None) -> Path:
        """The actor as an HF folder at ``path`` (:func:`export.export_hf`; collective); a reward
        model as a sequence-classification folder (``score.weight``, one label). With LoRA, as
        ``learner.lora.export`` says: a PEFT adapter folder, or the HF folder with B A merged."""
        self.free_gradients()
        out = export.export_hf(
            self.models.actor,
            self.checkpoints.manager,
            path,
            dtype=dtype or self.config.build.dtype,
            source=self.model_dir,
            rank=self.rank,
            lora=self.config.learner.lora,
            version=self.version,
        )
        if self.reward_model is not None:
            if self.rank == 0:
                write_seq_cls_config(out)
            dist.barrier()
        return out

    def maybe_export(self) -> str:
        """HF export every ``learner.export_every`` versions into ``run_dir/hf/v{version}``."""
        k = self.config.learner.export_every
        if k and self.version % k == 0:
            self.last_export = str(self.export_hf(self.run_dir / "hf" / f"v{self.version}"))
            return self.last_export
        return ""

    # -- the step ---------------------------------------------------------------------------------

    def sequences(self, batch: Batch) -> list[Sequence]:
        """The batch's sequences as the next step lays them out (:func:`step.sequences`)."""
        return sequences(self.models, batch, self.version)[0]

    def micro_batches(
        self, mine: list[Sequence], group: dist.ProcessGroup | None = None
    ) -> list[MicroBatch]:
        """:func:`passes.micro_batches` (collective over ``group``, default every rank)."""
        return passes.micro_batches(self.models, mine, group)

    def logprobs(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        """:func:`passes.logprobs`: the actor's log π of each micro-batch's trained tokens."""
        return passes.logprobs(self.models, mbs)

    def step(self, batch: Batch) -> StepResult:
        """One batch, one new version (:func:`train_step`, or a reward model's step; collective,
        every rank the same batch)."""
        if self.reward_model is not None:
            result = self.reward_model.step(batch, self.version)
        else:
            result = train_step(self.models, self.realloc, batch, self.version)
        self.version = result.version
        return result

"""How a role's model and optimizer come to be: TorchTitan's build order on the role's ranks, an HF
folder's weights loaded into the sharded model, AdamW with its LR schedule. The actor, π_ref and the
critic are all built here (:class:`Builder`), so each is built the same way and no role reaches into
another's owner for it.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.optimizer import (
    LRSchedulersContainer,
    OptimizersContainer,
    ParamGroupConfig,
)
from torchtitan.config.configs import CompileConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.protocols.model_spec import ModelSpec

from asyncrl.learner import cpu_shims, lora
from asyncrl.learner.config import BuildConfig
from asyncrl.learner.placement import RoleMesh

log = logging.getLogger("asyncrl.learner")

AC_CONFIGS = {"none": lambda: None, "selective": SelectiveAC.Config, "full": FullAC.Config}

TRAINER_MODULE = "torchtitan.trainer"


def update_from_config(model_config: Any, parallelism: Any) -> None:
    """TorchTitan's ``Decoder.Config.update_from_config`` (its parallelism checks, the MoE token
    dispatchers' sizes) with a config that holds only ``parallelism``, without importing
    ``torchtitan.trainer``.

    The method imports ``torchtitan.trainer`` for one check, ``isinstance(config, Trainer.Config)``
    (the training branch: RoPE resized to ``training.seq_len``), and that module pulls in
    ``datasets``, pandas, tensorboard and torchdata (1.1 s of every learner's start, BENCHMARKS.md
    sessions 13 and 17), none of which the learner uses. The config here is a ``SimpleNamespace``, an
    instance of no ``Trainer.Config`` whatever that class is, so the check is False either way: while
    the real module is not loaded, ``sys.modules`` holds for the length of the call a stand-in whose
    ``Trainer.Config`` is a new empty class, and it is taken out after (a later import of
    ``torchtitan.trainer`` loads the real one). Once the real module is loaded it is used as it is.
    """
    config = SimpleNamespace(parallelism=parallelism)
    if TRAINER_MODULE in sys.modules:
        model_config.update_from_config(config=config)
        return
    stand_in: Any = ModuleType(TRAINER_MODULE, "asyncrl.learner.build.update_from_config's")
    stand_in.Trainer = type("Trainer", (), {"Config": type("Config", (), {})})
    sys.modules[TRAINER_MODULE] = stand_in
    try:
        model_config.update_from_config(config=config)
    finally:
        if sys.modules.get(TRAINER_MODULE) is stand_in:
            del sys.modules[TRAINER_MODULE]


def adamw_implementation(device: torch.device) -> str:
    """AdamW's kernels for parameters on ``device``. On CUDA ``fused``: a few kernel launches for
    all the parameters, where the for-loop launches several per parameter, and without foreach's
    temporaries, which span the whole model. On CPU the
    for-loop, one parameter at a time: foreach's temporaries would add 2.3 GB of peak for
    Qwen3-0.6B (enough to get it OOM-killed beside its engine), and ``fused`` rounds differently
    (4.6e-6 after 5 steps), where the CPU learner's numbers are kept bitwise
    (tools/bench/learner_bitwise.py)."""
    return "fused" if device.type == "cuda" else "for-loop"


@dataclass
class Builder:
    """Builds on this rank for the roles placed on it (``meshes``: each role's ranks and parallel
    dims, :mod:`asyncrl.learner.placement`)."""

    config: BuildConfig
    meshes: dict[str, RoleMesh]
    device: torch.device
    dump_folder: Path  # TorchTitan's parallelize writes compile/AC debug output under it

    def model(self, spec: ModelSpec, role: str) -> torch.nn.Module:
        """TorchTitan's build order: meta build → parallelize_fn (FSDP2, and tensor parallelism
        when the role's placement asks for it) → to_empty → init_weights. With ``learner.lora`` the
        actor gets its adapters on the meta model (so FSDP2 shards them with their block) and its
        base is frozen (:mod:`.lora`). Collective over the role's ranks."""
        mesh = self.meshes[role]
        assert mesh.holds, (role, mesh.ranks)
        update_from_config(spec.model, mesh.parallelism)
        with torch.device("meta"):
            model = spec.model.build()
        c = self.config
        with_lora = role == "actor" and c.learner.lora.enabled
        if with_lora:
            tp = mesh.parallel_dims.get_optional_mesh("tp")
            n = lora.attach(model, c.learner.lora, spec.name, tp)
            log.info(
                "learner.lora: %.1f M adapter parameters train (rank %d on %s), the base is frozen",
                n / 1e6,
                c.learner.lora.rank,
                ", ".join(c.learner.lora.targets),
            )
        model = spec.parallelize_fn(
            model,
            parallel_dims=mesh.parallel_dims,
            training=TrainingConfig(mixed_precision_param=c.dtype),
            parallelism=mesh.parallelism,
            compile_config=CompileConfig(enable=c.learner.compile, components=["model"]),
            ac_config=AC_CONFIGS[c.learner.activation_checkpointing](),
            dump_folder=str(self.dump_folder),
        )
        cpu_shims.force_sum_reduction(model)
        model._skip_lm_head = True  # the output projection runs in chunks: learner/logprobs.py
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        if with_lora:
            lora.init_adapters(model, c.seed)
        return model

    @staticmethod
    def load_hf(
        model: torch.nn.Module, adapter: Any, folder: Path, *, group: dist.ProcessGroup | None
    ) -> None:
        """An HF folder's weights into a (sharded) model, as CheckpointManager's HF load does.
        Collective over ``group``, the model's role's ranks (None: every rank)."""
        import torch.distributed.checkpoint as dcp
        from torchtitan.components.checkpoint import ModelWrapper

        wrapper = ModelWrapper([model])
        hf_sd = adapter.to_hf(wrapper.state_dict())
        reader = adapter.get_hf_storage_reader(str(folder))
        dcp.load(hf_sd, storage_reader=reader, process_group=group)
        wrapper.load_state_dict(adapter.from_hf(hf_sd))

    def optimizer(
        self, model: torch.nn.Module, lr: float
    ) -> tuple[OptimizersContainer, LRSchedulersContainer]:
        """AdamW with the recipe's ``learner`` settings at ``lr``, and its LR schedule, which counts
        optimizer updates: ``minibatches × epochs`` per version."""
        c = self.config
        optimizers = OptimizersContainer.Config(
            param_groups=[
                ParamGroupConfig(
                    pattern=r".*",
                    optimizer_name="AdamW",
                    optimizer_kwargs={
                        "lr": lr,
                        "betas": tuple(c.learner.betas),
                        "eps": c.learner.eps,
                        "weight_decay": c.learner.weight_decay,
                    },
                )
            ],
            implementation=adamw_implementation(self.device),
        ).build(model_parts=[model])
        per_version = c.updates_per_version
        total = max(c.versions, 1) * per_version
        sched = LRSchedulersContainer.Config(
            warmup_steps=c.learner.warmup_steps * per_version,
            total_steps=total if c.learner.lr_schedule != "constant" else 1 << 40,
            decay_ratio=None if c.learner.lr_schedule != "constant" else 0.0,
            decay_type="cosine" if c.learner.lr_schedule == "cosine" else "linear",
        )
        return optimizers, sched.build(optimizers=optimizers, training_steps=total)

"""What the doctor's checks share: a check's line (:class:`Check`), the device found
(:class:`Device`), and the :class:`Doctor`, one recipe's context that the checks fill in order (the
model's dims, the device, the servers reached) and read, with the memory plan bound to it.

The plan itself is :mod:`asyncrl.memory` (pure arithmetic on a recipe); here it meets what the
checks found: the model's dims, the device, the servers' TP sizes, the learner's logits chunk
sizing (which the plan's floor does not import) and the runtime each process costs the host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl import memory
from asyncrl.memory import GiB, ModelDims
from asyncrl.recipe import Recipe


@dataclass(frozen=True, kw_only=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True, kw_only=True)
class Device:
    """Where learner ranks run: the visible GPUs' free memory, or the host's available RAM."""

    cuda: bool
    gpus: list[tuple[str, int, int, tuple[int, int]]]  # (name, free, total, capability)
    host_available: int
    host_total: int

    @property
    def learner_memory(self) -> int:
        return min(free for _, free, _, _ in self.gpus) if self.cuda else self.host_available


@dataclass(kw_only=True)
class Doctor:
    """One recipe's checks (:data:`asyncrl.doctor.CHECKS`, run by :func:`asyncrl.doctor.run`) and
    what they found. ``sglang_python``: SGLang's own interpreter, when it lives in another
    environment, to read its NCCL."""

    recipe: Recipe
    sglang_python: str = ""
    timeout_s: float = 10.0
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    checks: list[Check] = field(default_factory=list)
    dims: ModelDims | None = None
    device: Device | None = None
    servers: dict[str, dict] = field(default_factory=dict)  # url -> /server_info (or {})

    # Bindings of the recipe's plan (asyncrl.memory) to what the checks found.

    def learner_plans(self, **changes: Any) -> tuple[memory.LearnerPlan, memory.LearnerPlan]:
        from asyncrl.learner.logprobs import chunk_tokens

        assert self.dims is not None
        return memory.learner_plans_for(self.dims, self.recipe, chunk_tokens, **changes)

    def rank_plans(self, **changes: Any) -> list[memory.RankPlan]:
        from asyncrl.learner.logprobs import chunk_tokens

        assert self.dims is not None
        return memory.rank_plans_for(self.dims, self.recipe, chunk_tokens, **changes)

    def generator_plan(self) -> memory.GeneratorPlan | None:
        assert self.dims is not None
        g = self.recipe.generator
        tps = [self.servers[u].get("tp_size", 1) for u in g.urls if self.servers.get(u)]
        return memory.generator_plan_for(self.dims, self.recipe, cuda=self.cuda, server_tps=tps)

    @property
    def cuda(self) -> bool:
        return self.device is not None and self.device.cuda

    def engines_on_gpu(self) -> int:
        return memory.engines_on_gpu(self.recipe, cuda=self.cuda)

    def learner_need(self, **changes: Any) -> tuple[int, int]:
        """(bytes the learner needs where it is compared, bytes there). On a GPU: the fullest
        rank's peak with placement (:meth:`rank_plans`) against the smallest free GPU memory. On CPU every rank, every built-in engine and one
        runtime per process share the host's available RAM."""
        assert self.device is not None
        rank0, _ = self.learner_plans(**changes)
        plans = self.rank_plans(**changes)
        if self.device.cuda:
            engines = memory.engines_gpu_bytes(self.dims, self.recipe, cuda=True)  # rank 0's GPU
            return max(p.peak + (engines if p.rank == 0 else 0) for p in plans), (
                self.device.learner_memory
            )
        ranks = self.recipe.learner.ranks
        need = sum(p.peak_without_offload for p in plans) + ranks * rank0.checkpoint_staging
        return need + self.engines_need(), self.device.host_available

    def engines_need(self) -> int:
        """Host bytes of the built-in engines and of every process's runtime on the host; on a GPU
        machine also the learner ranks' asynchronous checkpoint staging (host memory)."""
        gen = self.generator_plan() if self.dims is not None else None
        engines = memory.engines_here(self.recipe)
        gpu_ranks = min(self.recipe.learner.ranks, len(self.device.gpus)) if self.device else 0
        ranks = self.recipe.learner.ranks if not gpu_ranks else 0
        gen_total = gen.total if gen is not None and engines else 0
        on_host = engines - self.engines_on_gpu()  # the others hold their tensors on the GPU
        staging = self.learner_plans()[0].checkpoint_staging * gpu_ranks if self.dims else 0
        return on_host * gen_total + (ranks + engines) * runtime_bytes() + staging


def runtime_bytes() -> int:
    """One process's runtime before any model: this process's resident memory once it has
    imported torch and TorchTitan (as every learner rank and engine does)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return GiB // 2

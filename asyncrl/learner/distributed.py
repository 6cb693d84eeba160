"""Joining the learner's process group: torchrun's, or a one-process group when run alone, with
collectives that wait as long as rank 0 may legitimately keep the others waiting.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torchtitan.distributed import utils as dist_utils

from asyncrl.learner import cpu_shims

if TYPE_CHECKING:
    from asyncrl.recipe import Recipe


def collective_timeout_s(recipe: Recipe) -> float:
    """How long a rank may wait in a collective: the longest legitimate wait of ranks > 0 for rank 0.

    Between two steps rank 0 waits for a batch (``buffer.batch_timeout_s``) and may first finish the
    previous version's weight sync (preflight, up to three attempts of group build, pause, buckets,
    resume and verify: bounded by ten ``weights.timeout_s``); checkpoint and export I/O get 600 s.
    The process group's default (300 s) was shorter than the default batch wait alone (600 s)."""
    return recipe.buffer.batch_timeout_s + 10 * recipe.weights.timeout_s + 600.0


def ensure_distributed(timeout_s: float = 1800.0) -> tuple[int, int]:
    """Join torchrun's process group, or make a one-process group when run alone (gloo on CPU;
    NCCL for CUDA tensors and gloo for CPU ones on a GPU). Collectives time out after ``timeout_s``
    (:func:`collective_timeout_s`)."""
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            from torchtitan.config.configs import CommConfig

            # On GPU, also a gloo backend for the CPU tensors (counts, stats, batch bytes).
            dist_utils.init_distributed(
                CommConfig(trace_buf_size=0, init_timeout_seconds=int(timeout_s)),
                enable_cpu_backend=not cpu_shims.ON_CPU,
            )
        else:
            torch.autograd.set_multithreading_enabled(False)
            dist.init_process_group(
                "gloo" if cpu_shims.ON_CPU else "cuda:nccl,cpu:gloo",
                rank=0,
                world_size=1,
                store=dist.HashStore(),
                timeout=timedelta(seconds=timeout_s),
            )
    return dist.get_rank(), dist.get_world_size()

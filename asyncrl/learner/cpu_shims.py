"""TorchTitan 0.3.0 on a CPU-only machine: the few shims it needs, each with the reason it exists.

Import this module before any other ``torchtitan`` import (``asyncrl.learner`` does it for you). Every
shim is a no-op on a machine with CUDA, so the same code runs unchanged on GPUs.
Each shim below says which error it avoids.
"""

from __future__ import annotations

import warnings

import torch

ON_CPU = not torch.cuda.is_available()


def patch_device() -> None:
    """Make TorchTitan believe the device is ``cpu`` when there is no GPU.

    ``torchtitan.tools.utils`` computes ``device_type, device_module`` at import time with a helper that
    returns ``None`` on CPU-only builds, and then falls back to ``"cuda"``; other modules copy the names
    at import. Without this, ``init_distributed`` asks for NCCL and ``ParallelDims.build_mesh`` calls
    ``torch.cuda.set_device``. Rebinding the two names before any other TorchTitan import fixes both.
    """
    if not ON_CPU:
        return
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = "cpu"
    tt_utils.device_module = torch.cpu


def force_sum_reduction(model: torch.nn.Module) -> None:
    """Make FSDP reduce gradients with SUM instead of ``PREMUL_SUM(1.0)``.

    TorchTitan disables FSDP's gradient division (the loss is already normalised by the global token
    count), which makes FSDP reduce-scatter with ``PREMUL_SUM`` and a factor of 1.0. Gloo rejects
    ``PREMUL_SUM`` ("Cannot use ReduceOp.PREMUL_SUM with Gloo"); a plain SUM is numerically identical.
    Harmless on NCCL, so it is applied everywhere.
    """
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


SPMD_BACKEND = "partial_dtensor"
"""TorchTitan's default ``spmd_types`` backend keeps parameters as plain annotated tensors, which torch
2.13's ``fully_shard`` refuses ("all parameters must be DTensors"); ``partial_dtensor`` works on CPU
and GPU. A torch-version gap, not a CPU one."""


def quiet_cpu_warnings() -> None:
    """FSDP's init warns on every run that "DTensor random operators may not have complete support on
    cpu device mesh". The learner uses no DTensor random operators (weights come from the HF folder),
    so on CPU the warning is noise in every log. TorchTitan's MoE router asks for a float32 autocast
    around its gate, which CPU autocast does not support and skips with a warning on every forward;
    the gate runs in float32 on CPU anyway."""
    if ON_CPU:
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete")
        warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype")


patch_device()
quiet_cpu_warnings()

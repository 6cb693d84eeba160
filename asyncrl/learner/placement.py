"""A learner role's parallel layout from the recipe's ``placement`` section (docs/design.md §12)."""

from __future__ import annotations

from torchtitan.config.configs import ParallelismConfig

from asyncrl.learner import cpu_shims
from asyncrl.recipe import PlacementConfig


def role_parallelism(placement: PlacementConfig, role: str) -> ParallelismConfig:
    """TorchTitan's parallelism of one role: ``tensor_parallel`` ranks per tensor-parallel group
    (TorchTitan's plan for Qwen3 and Llama: attention and MLP column/row-wise, the embedding and
    the output projection sharded over the vocabulary), FSDP2 over the role's other ranks.

    Sequence parallelism stays off: the final norm's output (the hidden states the chunked output
    projection reads) is then replicated over the tensor-parallel group, the same rows on each."""
    return ParallelismConfig(
        spmd_backend=cpu_shims.SPMD_BACKEND,
        data_parallel_shard_degree=-1,
        tensor_parallel_degree=getattr(placement, role).tensor_parallel,
        enable_sequence_parallel=False,
    )

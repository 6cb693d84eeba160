"""Attention for packed rows: several documents per row, no token attends across a document boundary.

Rows carry per-token ``positions`` that restart at 0 where a document starts (TorchTitan's convention).
TorchTitan's varlen attention (FlashAttention over the packed row) builds its masks from those
positions and is the fastest where its kernels import. :class:`DocSegmentSDPA` runs causal SDPA on
each document's slice of the row: exact block-causal attention, with no L×L mask and no work spent
on the masked-out blocks, on any device, with PyTorch's own fused kernels and nothing to compile. It
is what ``auto`` takes on CPU (flex has no CPU backward; varlen needs flash kernels) and on a GPU
where varlen's kernels do not import: TorchTitan 0.3 compiles flex with ``max_autotune`` and
coordinate-descent tuning (``FlexAttention.inductor_configs``), minutes for each new row length,
and packed rows (:func:`asyncrl.learner.packing.pack`, no padding) change length every step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import FlexAttention, VarlenAttention
from torchtitan.protocols.module import Module


class DocSegments(NamedTuple):
    """Document lengths of each row of a packed batch (they sum to the row length)."""

    lengths: tuple[tuple[int, ...], ...]


def doc_segments(positions: torch.Tensor) -> DocSegments:
    """Document lengths per row, from positions that restart at 0 at each document start. This reads
    the positions back to the host (a wait for the device on a GPU): the learner's packed rows
    bring their lengths from :func:`~asyncrl.learner.packing.pack` instead."""
    rows = []
    pos = positions.detach().cpu()
    for r in range(pos.shape[0]):
        starts = (pos[r] == 0).nonzero(as_tuple=True)[0].tolist()
        if not starts or starts[0] != 0:
            starts = [0, *starts]
        ends = [*starts[1:], pos.shape[1]]
        rows.append(tuple(e - s for s, e in zip(starts, ends, strict=True)))
    return DocSegments(tuple(rows))


class DocSegmentSDPA(Module):
    """Block-causal attention: causal SDPA per document of each packed row (CPU training path)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: DocSegments | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))  # B, N, L, H
        if attention_masks is None:  # one document per row
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
            )
            return out.transpose(1, 2)
        rows = []
        for b, lengths in enumerate(attention_masks.lengths):
            if len(lengths) == 1:
                qs, ks, vs = ((t[b : b + 1],) for t in (q, k, v))
            else:
                qs, ks, vs = (t[b : b + 1].split(list(lengths), dim=2) for t in (q, k, v))
            parts = [
                F.scaled_dot_product_attention(
                    qd, kd, vd, is_causal=True, scale=scale, enable_gqa=enable_gqa
                )
                for qd, kd, vd in zip(qs, ks, vs, strict=True)
            ]
            rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
        out = rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
        return out.transpose(1, 2)


FLASH_MODULES = {"FA3": "flash_attn_interface", "FA4": "flash_attn.cute.interface"}
"""What TorchTitan's varlen attention activates on Hopper (FA3) and Blackwell (FA4): modules that
are not PyTorch's (torchtitan/tools/utils.py get_cuda_flash_attention_impl; torch/nn/attention)."""


def flash_impl(capability: tuple[int, int] | None) -> str | None:
    """The FlashAttention TorchTitan's varlen activates for a CUDA compute capability."""
    if capability is None:
        return None
    return "FA4" if capability >= (10, 0) else "FA3" if capability >= (9, 0) else None


FLEX_COST = (
    "compiles with max_autotune for each new packed-row length (TorchTitan 0.3's "
    "FlexAttention.inductor_configs): minutes before the first step, and again as lengths change"
)


def choose_attention(
    kind: str,
    *,
    on_cpu: bool,
    capability: tuple[int, int] | None,
    importable: Callable[[str], bool],
) -> tuple[str, str]:
    """(attention, why) for ``model.attention``. ``auto``: the per-document SDPA on CPU (neither flex
    nor varlen trains there); on CUDA varlen (packed rows, fastest) when its kernels import, else the
    per-document SDPA, not flex: flex compiles for minutes at each new row length (module
    docstring), so no first step waits on it and no step recompiles. An explicit varlen whose
    kernels do not import is an error naming the module, not a ModuleNotFoundError at model build;
    an explicit flex says what it costs."""
    impl = flash_impl(None if on_cpu else capability)
    module = FLASH_MODULES.get(impl or "")
    if kind == "auto":
        if on_cpu:
            return "sdpa", "CPU: per-document SDPA (flex and varlen do not train on CPU)"
        if module is None or importable(module):
            return "varlen", f"varlen ({impl or 'PyTorch flash kernels'})"
        return "sdpa", (
            f"sdpa: per-document SDPA with PyTorch's fused kernels; varlen on this GPU needs {impl} "
            f"({module}), which does not import, and flex {FLEX_COST}"
        )
    if kind == "flex" and not on_cpu:
        return "flex", f"flex (model.attention): {FLEX_COST}"
    if kind == "varlen" and not on_cpu and module is not None and not importable(module):
        raise ValueError(
            f"model.attention: varlen on this GPU uses {impl}, but {module} does not import; "
            "install it, or use auto, flex or sdpa"
        )
    return kind, f"{kind} (model.attention)"


def module_importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing
        return False


def inner_attention_config(kind: str) -> Module.Config:
    """The inner attention module for a chosen attention (sdpa | flex | varlen, after
    :func:`choose_attention`). ``sdpa`` is the per-document SDPA on any device."""
    if kind == "sdpa":
        return DocSegmentSDPA.Config()
    if kind == "flex":
        return FlexAttention.Config()
    if kind == "varlen":
        return VarlenAttention.Config()
    raise ValueError(f"model.attention: unknown attention {kind!r}")


def attention_masks(
    model: torch.nn.Module, positions: torch.Tensor, doc_lengths: tuple[int, ...] | None = None
):
    """What the model's attention needs for these packed rows (built once per forward). The
    per-document SDPA takes a one-row batch's ``doc_lengths`` (from :func:`pack`, so nothing is read
    back from the device); without them it reads them from ``positions``."""
    inner = model.layers["0"].attention.inner_attention
    if isinstance(inner, DocSegmentSDPA):
        if doc_lengths is not None and positions.shape[0] == 1:
            return DocSegments((tuple(doc_lengths),))
        return doc_segments(positions)
    return model.get_attention_masks(positions)

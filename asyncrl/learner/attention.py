"""Attention for packed rows: several documents per row, no token attends across a document boundary.

Rows carry per-token ``positions`` that restart at 0 where a document starts (TorchTitan's convention).
On GPU, TorchTitan's own varlen or flex attention builds its masks from those positions. On CPU neither
trains (flex has no CPU backward; varlen needs flash kernels), so :class:`DocSegmentSDPA` runs causal SDPA
on each document's slice of the row: exact block-causal attention, with no L×L mask and no work spent on
the masked-out blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import FlexAttention, VarlenAttention
from torchtitan.protocols.module import Module

from asyncrl.learner import cpu_shims


class DocSegments(NamedTuple):
    """Document lengths of each row of a packed batch (they sum to the row length)."""

    lengths: tuple[tuple[int, ...], ...]


def doc_segments(positions: torch.Tensor) -> DocSegments:
    """Document lengths per row, from positions that restart at 0 at each document start."""
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


def inner_attention_config(kind: str) -> Module.Config:
    """The inner attention for ``model.attention`` (auto | sdpa | flex | varlen).

    ``auto`` picks varlen on CUDA (packed rows, no padding, fastest) and the per-document SDPA on CPU.
    ``sdpa`` means the per-document SDPA on any device.
    """
    if kind == "auto":
        kind = "sdpa" if cpu_shims.ON_CPU else "varlen"
    if kind == "sdpa":
        return DocSegmentSDPA.Config()
    if kind == "flex":
        return FlexAttention.Config()
    if kind == "varlen":
        return VarlenAttention.Config()
    raise ValueError(f"model.attention: unknown attention {kind!r}")


def attention_masks(model: torch.nn.Module, positions: torch.Tensor):
    """What the model's attention needs for these packed rows (built once per forward)."""
    inner = model.layers["0"].attention.inner_attention
    if isinstance(inner, DocSegmentSDPA):
        return doc_segments(positions)
    return model.get_attention_masks(positions)

"""Log-probabilities of the trained tokens from the last hidden states, a chunk of tokens at a time.

A real vocabulary makes the logits the largest tensor of a step: 151,936 × 4 bytes per token for
Qwen3, ~90 GB for 32k tokens with the float32 copies log-softmax and entropy make. So the model stops
at its final norm (TorchTitan's ``_skip_lm_head``), and the output projection runs here on one chunk
of trained tokens at a time (``chunk_tokens``): no more than one chunk of logits is ever alive, in the
forward or the backward. A loss that needs every token first (GSPO's sequence ratio, any aggregation)
still works, in two passes:

1. :func:`chunked_logprobs` (no gradient): log π and the entropy of every trained token;
2. the caller computes its loss on those as leaves and takes d loss / d log π (and d loss / d H);
3. :func:`chunked_backward` recomputes each chunk's logits with gradient and back-propagates that
   chunk's share at once, accumulating the output projection's gradient and the hidden states'.

The caller then back-propagates the hidden states' gradient through the decoder. This is the
structure of TorchTitan's ``ChunkedLossWrapper`` (components/loss.py), including how it keeps the
FSDP-sharded output projection gathered across chunks and reduces its gradient once.

What a chunk costs beyond its tokens' share (read in torch 2.13's FSDP2, ``_fsdp_param_group.py``
``post_backward`` and ``_fsdp_param.py``): no collective (the projection's group stays unsharded,
``unshard`` returns at once; with gradient sync off ``post_backward`` returns before the
reduce-scatter; the root's final callback runs per chunk but reduces nothing), but the whole
vocabulary × hidden matrix is touched on every chunk, whatever its size: read by the two
forwards and the backward's ``grad @ W``, and its gradient written by ``grad_logits.T @ h`` and
added into the accumulated one (autograd's ``grad += new``; under mixed precision FSDP's float32
``unsharded_accumulated_grad += grad``): ~18 bytes per element with FSDP's bf16/float32 mixed
precision, 2.8 GB at Qwen3-0.6B's 1024 × 151,936, about 0.8 ms at 3.35 TB/s. That is inherent to
chunking the tokens (each chunk's gradient spans all of the matrix), so the chunks are made large
enough for it to be small per token: ``learner.logits_chunk_mb``'s default, 1024 MiB, is 441 tokens
at Qwen3's vocabulary (BENCHMARKS.md, session 14).

All log-probabilities are of the tempered distribution softmax(logits / T): generators report their
behaviour logprobs that way (docs/off-policy.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def chunk_tokens(vocab_size: int, budget_mb: float) -> int:
    """Tokens per chunk so that one chunk's float32 logits and the softmax-sized temporaries its
    backward needs (about four copies) stay within ``budget_mb`` MiB."""
    return max(1, int(budget_mb * 2**20 // (4 * 4 * vocab_size)))


def local_hidden(h: Tensor) -> Tensor:
    """The hidden states as a plain tensor: a tensor-parallel model's are a DTensor replicated over
    its group (every rank the same rows), whose local tensor is the whole; the gradient given to it
    flows back as the replicated one."""
    if not isinstance(h, DTensor):
        return h
    if not all(p.is_replicate() for p in h.placements):
        raise ValueError(f"hidden states placed {h.placements}: expected replicated ones")
    return h.to_local()


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over a tensor-parallel group whose ranks then compute the same replicated
    loss: the backward is the identity (each rank already holds d loss / d sum)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    """A value replicated over a tensor-parallel group, used by each rank's vocabulary slice: the
    identity forward; backward, each rank's slice gave only its part of the gradient, so the parts
    are summed over the group."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def _vocab_parallel_logprobs(
    logits: DTensor, labels: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    """:func:`_token_logprobs` of logits sharded over the vocabulary (a tensor-parallel output
    projection): each rank works on its own vocabulary slice; the maximum, the sum of exponentials,
    the label's logit and Σ p·z are reduced over the group (Megatron's vocab-parallel cross-entropy),
    so no rank holds a whole row of logits. Differentiable: the gradient of the local logits is the
    local slice of the full one."""
    mesh_dims = [i for i, p in enumerate(logits.placements) if p.is_shard(logits.ndim - 1)]
    if len(mesh_dims) != 1 or any(
        not p.is_replicate() for i, p in enumerate(logits.placements) if i != mesh_dims[0]
    ):
        raise ValueError(f"logits placed {logits.placements}: expected one vocabulary shard")
    group = logits.device_mesh.get_group(mesh_dims[0])
    _, offset = compute_local_shape_and_global_offset(
        logits.shape, logits.device_mesh, logits.placements
    )
    z = logits.to_local().float()
    if temperature != 1.0:
        z = z / temperature
    width = z.shape[-1]
    m = z.detach().amax(-1) if width else z.new_full(z.shape[:-1], -torch.inf)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    lse = m + torch.log(_SumOverGroup.apply(torch.exp(z - m[:, None]).sum(-1), group))
    local = labels - offset[-1]
    inside = (local >= 0) & (local < width)
    picked = z.gather(-1, local.clamp(0, max(width - 1, 0))[:, None])[:, 0] if width else m * 0
    logp = _SumOverGroup.apply(torch.where(inside, picked, 0.0), group) - lse
    pz = (torch.exp(z - _CopyToGroup.apply(lse, group)[:, None]) * z).sum(-1)
    entropy = lse - _SumOverGroup.apply(pz, group)
    return logp, entropy


def _token_logprobs(
    logits: Tensor, labels: Tensor, temperature: float, *, entropy: bool = True
) -> tuple[Tensor, Tensor | None]:
    """(log π of ``labels``, entropy) of softmax(logits / T), per row, in float32; without
    ``entropy`` the second is None (it costs a softmax and a product over the vocabulary)."""
    if isinstance(logits, DTensor):
        if any(p.is_shard() for p in logits.placements):
            logp, ent = _vocab_parallel_logprobs(logits, labels, temperature)
            return logp, ent if entropy else None
        logits = logits.to_local()
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, labels[:, None])[:, 0] - lse
    if not entropy:
        return logp, None
    return logp, lse - (torch.softmax(z, dim=-1) * z).sum(-1)


@torch.no_grad()
def chunked_logprobs(
    hidden: Tensor,
    labels: Tensor,
    lm_head: nn.Module,
    *,
    temperature: float,
    chunk: int,
    entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """log π and entropy (float32, ``[T]``) of each row of ``hidden`` (``[T, D]``, the trained
    tokens' last hidden states) for its label, a chunk of rows at a time; no gradient. Without
    ``entropy`` the second is None: only a loss term, its gradient or a logged metric needs it,
    and it costs a softmax over the vocabulary per token."""
    out_lp, out_ent = [], []
    for h, y in zip(hidden.split(chunk), labels.split(chunk), strict=True):
        lp, ent = _token_logprobs(lm_head(h), y, temperature, entropy=entropy)
        out_lp.append(lp)
        out_ent.append(ent)
    if not out_lp:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty.clone() if entropy else None
    return torch.cat(out_lp), torch.cat(out_ent) if entropy else None


def chunked_backward(
    hidden: Tensor,
    labels: Tensor,
    lm_head: nn.Module,
    grad_logp: Tensor,
    grad_entropy: Tensor | None,
    *,
    temperature: float,
    chunk: int,
) -> Tensor:
    """Back-propagate d loss / d log π (and d loss / d entropy, when the loss has an entropy term)
    through the output projection, a chunk of rows at a time. Accumulates the projection's
    parameter gradients and returns d loss / d ``hidden`` (``[T, D]``).

    With FSDP the projection stays gathered across chunks, and its gradient is reduced once, at
    the last chunk, as every other unit's is at each micro-batch (:mod:`asyncrl.learner.trainer`:
    gradients are reduce-scattered at every micro-batch and accumulate sharded)."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = isinstance(lm_head, FSDPModule)
    leaf = hidden.detach().requires_grad_(True)
    chunks = list(zip(leaf.split(chunk), labels.split(chunk), strict=True))
    grads_lp = grad_logp.split(chunk)
    grads_ent = grad_entropy.split(chunk) if grad_entropy is not None else None
    if fsdp:
        lm_head.set_reshard_after_forward(False)
        lm_head.set_reshard_after_backward(False)
        lm_head.set_requires_gradient_sync(False, recurse=False)
        lm_head.unshard()
    try:
        for i, (h, y) in enumerate(chunks):
            if fsdp and i == len(chunks) - 1:
                lm_head.set_requires_gradient_sync(True, recurse=False)
            lp, ent = _token_logprobs(lm_head(h), y, temperature, entropy=grads_ent is not None)
            if grads_ent is None:
                lp.backward(grads_lp[i])
            else:
                torch.autograd.backward([lp, ent], [grads_lp[i], grads_ent[i]])
    finally:
        if fsdp:  # TorchTitan's settings for the group holding the projection (fsdp.py)
            lm_head.set_reshard_after_forward(False)
            lm_head.set_reshard_after_backward(True)
            lm_head.set_requires_gradient_sync(True, recurse=False)
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)

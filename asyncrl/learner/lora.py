"""Low-rank adapters (LoRA) on the learner's TorchTitan Qwen3: the one place that knows where an HF
target (``q_proj``, ``gate_proj``...) lives in the TorchTitan model, what its adapter tensors are
called on the wire and in a PEFT folder, and how ``W + scaling · B A`` is folded into a weight.

An adapter is a small module (:class:`Adapters`, attribute ``lora``) on the base ``Linear`` with a
forward hook that adds its delta to the Linear's output, so the base's state-dict names, and with
them TorchTitan's state-dict adapter, stay as they are. TorchTitan fuses q, k and v into one
``wqkv`` whose rows interleave per KV group ``[heads_per_kv q heads, 1 k head, 1 v head]``
(``FusedQKVLinear``); q, k and v each get their own A and B there, exactly PEFT's separate
q_proj/k_proj/v_proj adapters, and their deltas are laid into that interleaved layout.

Attached to the meta-built model before ``parallelize_fn``, so FSDP2 shards the adapters with the
rest of their block. Under tensor parallelism each A and B is a DTensor on the TP mesh that follows
its base weight's TorchTitan plan (:func:`_tp_placements`), so each rank's delta is its shard of
the base's output. Initialised as PEFT's default: A kaiming-uniform(a=√5), B zeros (step 0 is the
base model).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from asyncrl.learner.model_spec import ModelConfigError
from asyncrl.recipe import LoraConfig

HF_TARGETS: dict[str, tuple[str, str, str]] = {
    # HF target: (its HF parent module in a decoder layer, the TorchTitan Linear in a block,
    #             the base weight's key in the block's state dict: FusedQKVLinear splits wqkv)
    "q_proj": ("self_attn", "attention.qkv_linear.wqkv", "attention.qkv_linear.wq.weight"),
    "k_proj": ("self_attn", "attention.qkv_linear.wqkv", "attention.qkv_linear.wk.weight"),
    "v_proj": ("self_attn", "attention.qkv_linear.wqkv", "attention.qkv_linear.wv.weight"),
    "o_proj": ("self_attn", "attention.wo", "attention.wo.weight"),
    "gate_proj": ("mlp", "feed_forward.w1", "feed_forward.w1.weight"),
    "up_proj": ("mlp", "feed_forward.w3", "feed_forward.w3.weight"),
    "down_proj": ("mlp", "feed_forward.w2", "feed_forward.w2.weight"),
}
QKV = ("q_proj", "k_proj", "v_proj")

_KEY = re.compile(r"^layers\.(\d+)\..*\.lora\.pairs\.(\w+)\.(A|B)$")


class LoraPair(nn.Module):
    """One target's A (rank, in) and B (out, rank), PEFT's ``lora_A`` / ``lora_B`` weights."""

    def __init__(self, in_features: int, out_features: int, rank: int) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, in_features))
        self.B = nn.Parameter(torch.empty(out_features, rank))


class Adapters(nn.Module):
    """The adapters of one base Linear: one pair, or on the fused ``wqkv`` the pairs of the targets
    among q, k, v (a slice without one adds zeros). ``qkv`` is (n_kv_heads, heads_per_kv,
    head_dim) for ``wqkv``, None for a plain Linear."""

    def __init__(
        self,
        pairs: dict[str, LoraPair],
        *,
        scaling: float,
        dropout: float,
        qkv: tuple[int, int, int] | None,
    ) -> None:
        super().__init__()
        self.pairs = nn.ModuleDict(pairs)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scaling = scaling
        self.qkv = qkv
        self.enabled = True  # off: the base model (:func:`disabled`)

    def delta(self, name: str, x: torch.Tensor) -> torch.Tensor:
        p = self.pairs[name]
        # dropout in the training forward only: the forward-only passes (π_prox, drift) must be
        # the policy's own logprobs, deterministic (the actor stays in train mode between steps)
        if torch.is_grad_enabled():
            x = self.dropout(x)
        h = F.linear(x, p.A)  # PEFT: lora_B(lora_A(dropout(x)))
        if isinstance(h, DTensor) and any(q.is_partial() for q in h.placements):
            # row-parallel target: each rank's A columns saw its slice of x; sum the rank-r
            # product over the TP group before B (replicated), as the base's output is summed
            h = h.redistribute(placements=[Replicate()] * len(h.placements))
        return F.linear(h, p.B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qkv is None:
            (name,) = self.pairs.keys()
            return self.delta(name, x) * self.scaling
        deltas = {name: self.delta(name, x) for name in self.pairs}
        first = next(iter(deltas.values()))
        mesh = first.device_mesh if isinstance(first, DTensor) else None
        # column-parallel wqkv: each rank holds whole KV groups, n_kv / tp of them; its B rows are
        # those groups' q (k, v) rows, so its deltas interleave locally as its base rows do
        local = {k: v.to_local() if mesh else v for k, v in deltas.items()}
        _, hpk, hd = self.qkv
        name, some = next(iter(local.items()))
        n_kv = some.shape[-1] // (hd * (hpk if name == "q_proj" else 1))  # this rank's groups
        lead = some.shape[:-1]
        parts = []
        for name, heads in zip(QKV, (hpk, 1, 1), strict=True):
            if name in local:
                parts.append(local[name].view(*lead, n_kv, heads, hd))
            else:
                parts.append(some.new_zeros(*lead, n_kv, heads, hd))
        out = torch.cat(parts, dim=-2).reshape(*lead, -1) * self.scaling
        if mesh is not None:
            out = DTensor.from_local(out, mesh, first.placements, run_check=False)
        return out


def _add_delta(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    if not module.lora.enabled:
        return None  # the base Linear's output as it is
    return out + module.lora(args[0])


@contextlib.contextmanager
def disabled(model: nn.Module) -> Iterator[None]:
    """The model without its adapters (its frozen base: π_ref of a LoRA run); no-op without any."""
    found = [m for m in model.modules() if isinstance(m, Adapters)]
    for m in found:
        m.enabled = False
    try:
        yield
    finally:
        for m in found:
            m.enabled = True


def check_supported(model_name: str) -> None:
    """Refuse a model adapters cannot be put on (its TorchTitan spec's name): only Qwen3."""
    if model_name != "qwen3":
        raise ModelConfigError(
            f"learner.lora: only Qwen3 models (model_type qwen3) take adapters, not {model_name}: "
            "TorchTitan's Llama permutes the q/k rows from HF's, so the adapters' rows would not "
            "be PEFT's"
        )


def attach(model: nn.Module, cfg: LoraConfig, model_name: str, tp: DeviceMesh | None = None) -> int:
    """Put ``cfg``'s adapters on every block of a meta-built TorchTitan model and freeze the rest;
    returns the adapter parameter count. ``model_name``: the spec's (:func:`check_supported`);
    ``tp``: the role's tensor-parallel mesh, None without tensor parallelism."""
    check_supported(model_name)
    by_linear: dict[str, list[str]] = {}  # q, k and v share wqkv
    for t in cfg.targets:
        by_linear.setdefault(HF_TARGETS[t][1], []).append(t)
    count = 0
    for block in model.layers.values():
        for path, targets in by_linear.items():
            linear = block.get_submodule(path)
            qkv = None
            outs = dict.fromkeys(targets, linear.out_features)
            if path.endswith("wqkv"):
                fused = block.get_submodule(path.rsplit(".", 1)[0])
                hpk, hd = fused.heads_per_kv, fused.head_dim
                n_kv = linear.out_features // ((hpk + 2) * hd)
                if tp is not None and n_kv % tp.size():
                    raise ModelConfigError(
                        f"learner.lora: {n_kv} KV heads do not split over tensor_parallel "
                        f"{tp.size()}: the adapters' q/k/v rows follow wqkv's, whole KV groups"
                    )
                qkv = (n_kv, hpk, hd)
                outs = {t: n_kv * hd * (hpk if t == "q_proj" else 1) for t in targets}
            with torch.device("meta"):
                pairs = {t: LoraPair(linear.in_features, outs[t], cfg.rank) for t in targets}
            if tp is not None:
                a, b = _tp_placements(linear, tp)
                for pair in pairs.values():
                    pair.A = nn.Parameter(distribute_tensor(pair.A, tp, [a]))
                    pair.B = nn.Parameter(distribute_tensor(pair.B, tp, [b]))
            linear.lora = Adapters(pairs, scaling=cfg.scaling, dropout=cfg.dropout, qkv=qkv)
            linear.register_forward_hook(_add_delta)
            count += sum(p.numel() for p in linear.lora.parameters())
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return count


def _tp_placements(linear: nn.Module, tp: DeviceMesh) -> tuple[Placement, Placement]:
    """A's and B's placements on the TP mesh, from TorchTitan's plan for the base weight
    (out, in): A (rank, in) is split as the weight's columns (row-parallel: wo, w2; its partial
    product is summed in :meth:`Adapters.delta`), B (out, rank) as its rows (column-parallel:
    wqkv, w1, w3), each replicated otherwise."""
    from torchtitan.protocols.sharding import resolve_placements

    (w,) = resolve_placements(linear._sharding_config.state_shardings["weight"], tp)
    return (w if w == Shard(1) else Replicate()), (w if w == Shard(0) else Replicate())


def is_adapter(name: str) -> bool:
    """Whether a parameter or state-dict key of the model is an adapter's."""
    return ".lora." in name


def adapter_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(wire name, parameter) of every adapter tensor, in the model's order."""
    from torchtitan.components.checkpointer.utils import canonical_fqn

    for name, p in model.named_parameters():
        if is_adapter(name):
            yield wire_name(canonical_fqn(name)), p


def wire_name(key: str) -> str:
    """``layers.3.attention.qkv_linear.wqkv.lora.pairs.q_proj.A`` →
    ``model.layers.3.self_attn.q_proj.lora_A.weight`` (the wire contract's and, after
    :data:`PEFT_PREFIX`, PEFT's name)."""
    m = _KEY.match(key)
    if m is None:
        raise KeyError(f"not an adapter key: {key}")
    layer, target, which = m.groups()
    return f"model.layers.{layer}.{HF_TARGETS[target][0]}.{target}.lora_{which}.weight"


def _fill(p: torch.Tensor, full: torch.Tensor) -> None:
    """``full`` into ``p``, a plain tensor or this rank's shard of a DTensor."""
    if isinstance(p, DTensor):
        full = distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
        p.to_local().copy_(full.to_local())
    else:
        p.copy_(full)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """PEFT's init: A kaiming-uniform(a=√5), B zeros. Each A from a generator seeded by ``seed`` and
    its index, full-size on every rank, so the adapters do not depend on the rank count."""
    for i, (name, p) in enumerate(adapter_parameters(model)):
        full = torch.zeros(p.shape, dtype=p.dtype)
        if ".lora_A." in name:
            g = torch.Generator().manual_seed(seed * 100_003 + i)
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=g)
        _fill(p, full)


def adapter_state_dict(
    model: nn.Module | None, dtype: torch.dtype | None = None, *, keep: bool = True
) -> dict[str, torch.Tensor]:
    """Every adapter's full tensor under its wire name (B unscaled), cast to ``dtype`` before the
    gather. Collective over the model's ranks; ``keep=False``: gather and drop (not the sender)."""
    out: dict[str, torch.Tensor] = {}
    if model is None:
        return out
    for name, p in adapter_parameters(model):
        v = p.detach()
        if dtype is not None and v.dtype != dtype:
            v = v.to(dtype)
        t = v.full_tensor() if isinstance(v, DTensor) else v
        if keep:
            live = p.to_local() if isinstance(p, DTensor) else p
            aliased = t.untyped_storage().data_ptr() == live.untyped_storage().data_ptr()
            out[name] = t.detach().clone() if aliased else t
    return out


def merge(
    states: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scaling: float
) -> dict[str, torch.Tensor]:
    """The model's state dict (TorchTitan keys, wqkv split into wq/wk/wv) without its adapter keys
    and with ``scaling · B A`` added to each target's weight (PEFT's merge: ``W += (B @ A) ·
    scaling``). ``adapters``: :func:`adapter_state_dict`'s full tensors, the same on every rank.
    New tensors: the model's parameters are not touched."""
    out = {k: v for k, v in states.items() if not is_adapter(k)}
    for name, a in adapters.items():
        if ".lora_A." not in name:
            continue
        b = adapters[name.replace(".lora_A.", ".lora_B.")]
        layer, target = re.match(r"model\.layers\.(\d+)\.\w+\.(\w+)\.lora_A", name).groups()
        key = f"layers.{layer}.{HF_TARGETS[target][2]}"
        w = out[key]
        delta = delta_weight(a, b, scaling, w.dtype)
        if isinstance(w, DTensor):
            delta = distribute_tensor(
                delta.to(w.device), w.device_mesh, w.placements, src_data_rank=None
            )
        out[key] = w + delta
    return out


def delta_weight(
    a: torch.Tensor, b: torch.Tensor, scaling: float, dtype: torch.dtype
) -> torch.Tensor:
    """What an adapter adds to its target's weight, PEFT's ``(B @ A) · scaling`` (in float32)."""
    return ((b.to(torch.float32) @ a.to(torch.float32)) * scaling).to(dtype)

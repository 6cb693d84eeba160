"""LoRA adapters in the built-in engine: a learner that trains adapters sends only them, and the
engine serves base + (alpha / rank) · B A.

The engine is told the adapters' rank and alpha when it starts (``--lora-rank``, ``--lora-alpha``,
as SGLang is told ``--max-lora-rank``), keeps the base weights it loaded from ``--model`` and, at
each version's swap, sets every adapted layer's weight to base + scaling · B A, computed from the
base again every time: the served weight of version v never depends on version v-1's, so no
rounding accumulates across versions. The merge runs off the decode thread before the swap, into
the weights the swap before last let go (else the session's fused receive buffers), so the swap
still only re-points parameters; decoding then costs what it costs without LoRA (docs/lora_sync.md
has the measurements behind merging rather than adding a low-rank product at every decode step).

Names are the wire contract's: ``model.layers.{i}.self_attn.q_proj.lora_A.weight`` (rank, in) and
``...lora_B.weight`` (out, rank), B unscaled; on disk, a PEFT adapter folder (its
``adapter_config.json`` and ``adapter_model.safetensors``, names prefixed ``base_model.model.``).
Errors are ``ValueError`` with one line; the weight store wraps them in its reply.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncrl.weights.exports import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX

PARTS = ("lora_A", "lora_B")


def adapter_target(name: str) -> tuple[str, str] | None:
    """(the weight an adapter tensor adapts, ``"lora_A"`` or ``"lora_B"``); None for any other name."""
    for part in PARTS:
        suffix = f".{part}.weight"
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight", part
    return None


@dataclass(frozen=True)
class LoraSpec:
    """The adapters an engine serves: their rank and alpha (the recipe's ``learner.lora``)."""

    rank: int
    alpha: float

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def read_peft_folder(path: str | Path, spec: LoraSpec) -> list[tuple[str, torch.Tensor]]:
    """A PEFT adapter folder's tensors under the wire names; its rank and alpha must be ``spec``'s
    (another scale would serve other weights than the learner trained)."""
    from safetensors.torch import load_file

    p = Path(path)
    cfg = json.loads((p / ADAPTER_CONFIG).read_text())
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if r != spec.rank or float(alpha or 0) != spec.alpha:
        raise ValueError(
            f"{p / ADAPTER_CONFIG}: r={r} lora_alpha={alpha}, but this engine serves "
            f"--lora-rank {spec.rank} --lora-alpha {spec.alpha:g}"
        )
    if cfg.get("use_rslora") or cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(
            f"{p / ADAPTER_CONFIG}: use_rslora, rank_pattern and alpha_pattern are not supported "
            "(one rank and alpha for every layer)"
        )
    if not (p / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{p}: no {ADAPTER_WEIGHTS}")
    out = []
    for name, t in load_file(str(p / ADAPTER_WEIGHTS)).items():
        out.append((name.removeprefix(PEFT_PREFIX), t))
    return out


class Adapters:
    """The base weights of every layer an adapter may target (the tensors loaded from ``--model``,
    referenced, not copied: a swap re-points parameters, and a merge writes only into weights no
    longer served, never into these) and the adapter served now (its tensors as received, which
    the engine's checksum hashes)."""

    def __init__(self, spec: LoraSpec, params: dict[str, torch.nn.Parameter]):
        if spec.rank < 1 or not spec.alpha > 0:
            raise ValueError(f"LoRA needs rank >= 1 and alpha > 0, got {spec.rank}, {spec.alpha}")
        self.spec = spec
        self.base = {
            n: p.data
            for n, p in params.items()
            if n.startswith("model.layers.") and n.endswith("_proj.weight") and p.dim() == 2
        }
        self.served: dict[str, torch.Tensor] = {}
        # Weights the engine serves now that are not the base (merged, or loaded from disk), and
        # those it served before the last swap: the next merge writes into the latter, whose
        # memory is already the process's (a fresh tensor's first writes fault every page in:
        # 1.3-1.6 s against 0.4 s for Qwen3-0.6B's targets on the CPU).
        self._in_use: dict[str, torch.Tensor] = {}
        self._spare: dict[str, torch.Tensor] = {}

    def checked(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Check adapter tensors against the base layers and the rank; name -> tensor on the
        engine's device (in the dtype it came in: the merge casts)."""
        bad, ready = [], {}
        r = self.spec.rank
        for name, t in named:
            hit = adapter_target(name)
            if hit is None:
                bad.append(
                    f"{name}: not a LoRA adapter tensor, and this engine serves adapters "
                    f"(--lora-rank {r}): send only the adapters (recipe learner.lora)"
                )
                continue
            target, part = hit
            w = self.base.get(target)
            if w is None:
                bad.append(f"{name}: the model has no adaptable layer {target}")
                continue
            want = (r, w.shape[1]) if part == "lora_A" else (w.shape[0], r)
            if tuple(t.shape) != want:
                bad.append(f"{name}: shape {list(t.shape)} != {list(want)} (rank {r})")
                continue
            ready[name] = t.to(w.device).contiguous()
        if bad:
            raise ValueError(
                "; ".join(bad[:5]) + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else "")
            )
        return ready

    def merged(
        self,
        adapter: dict[str, torch.Tensor],
        *,
        replace: bool,
        dest: Callable[[str, torch.Tensor], torch.Tensor | None],
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The weights to install for ``adapter`` (parameter name -> base + scaling · B A, each
        from the base) and the adapter served once they are: ``adapter`` over the one served now,
        or (``replace``) instead of it, every layer it leaves out back to its base weight.
        ``dest(name, base)``: where to write a layer's weight (a fused receive buffer's slice), or
        None for a tensor of its own; the weight served before the last swap comes first."""
        full = dict(adapter) if replace else {**self.served, **adapter}
        touched = {adapter_target(n)[0] for n in adapter}  # type: ignore[index]
        out: dict[str, torch.Tensor] = {}
        if replace:
            out = {
                adapter_target(n)[0]: self.base[adapter_target(n)[0]]  # type: ignore[index]
                for n in self.served
                if adapter_target(n)[0] not in touched  # type: ignore[index]
            }
        for target in sorted(touched):
            prefix = target.removesuffix(".weight")
            a, b = full.get(f"{prefix}.lora_A.weight"), full.get(f"{prefix}.lora_B.weight")
            if a is None or b is None:
                raise ValueError(f"{prefix}: the adapter has lora_A or lora_B but not both")
            w0 = self.base[target]
            o = self._spare.get(target)
            if o is None or o.shape != w0.shape or o.dtype != w0.dtype or o.device != w0.device:
                o = dest(target, w0)
            if o is None:
                o = torch.empty_like(w0)
            torch.addmm(w0, b.to(w0.dtype), a.to(w0.dtype), alpha=self.spec.scaling, out=o)
            out[target] = o
        return out, full

    def installed(self, staged: dict[str, torch.Tensor]) -> None:
        """A swap installed ``staged`` (decode thread): what it replaced of the weights that were
        not the base is free now, and the next merge's destination."""
        for name, t in staged.items():
            base = self.base.get(name)
            if base is None:
                continue
            old = self._in_use.pop(name, None)
            if old is not None:
                self._spare[name] = old
            if t.data_ptr() != base.data_ptr():
                self._in_use[name] = t

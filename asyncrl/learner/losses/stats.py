"""A step's loss statistics: what the losses return as sums, and the logged metrics made of them.

Each micro-batch's loss (:func:`~asyncrl.learner.losses.policy.policy_loss`,
:func:`~asyncrl.learner.losses.scalar.value_loss`,
:func:`~asyncrl.learner.losses.scalar.bradley_terry`) returns additive float64 sums. The step sums
them over micro-batches and ranks (one all-reduce of the same keys on every rank: start from
:func:`zero_stats`), then :func:`finalize_stats` turns them into the logged means. Finalising
happens once a step, after every rank's sums are in, so it belongs to no one loss.
"""

from __future__ import annotations

import torch
from torch import Tensor


def finalize_stats(stats: dict[str, Tensor | float]) -> dict[str, float]:
    """Summed stats → logged metrics (means over trained tokens, ``loss/seq_masked_frac`` over
    trained sequences; ESS = (Σw)² / (N·Σw²)).

    Over no tokens every fraction is 0 and ESS is 1 (nothing to weight). The stats of
    :func:`~asyncrl.learner.losses.scalar.value_loss` and
    :func:`~asyncrl.learner.losses.scalar.bradley_terry` may be summed in too (or alone)."""
    s = {k: float(v) for k, v in stats.items()}
    out = _critic_metrics(s)
    if "tokens" not in s:  # a critic's or a reward model's step: no policy stats
        return out
    n = s["tokens"]
    out["loss/tokens"] = n
    if n <= 0:
        return out | {
            "loss/is_weight_mean": 1.0,
            "loss/ess": 1.0,
            "loss/clip_frac": 0.0,
            "loss/ratio_masked_frac": 0.0,
            "loss/seq_masked_frac": 0.0,
            "loss/is_capped_frac": 0.0,
        }
    out["loss/is_weight_mean"] = s["is_weight"] / n
    out["loss/ess"] = (
        s["is_weight"] ** 2 / (n * s["is_weight_sq"]) if s["is_weight_sq"] > 0 else 0.0
    )
    out["loss/clip_frac"] = s["clipped"] / n
    out["loss/ratio_masked_frac"] = s["ratio_masked"] / n
    out["loss/seq_masked_frac"] = s["seq_masked"] / s["seqs"] if s["seqs"] > 0 else 0.0
    out["loss/is_capped_frac"] = s["is_capped"] / n
    out["loss/kl_mu_k1"] = s["kl_mu_k1"] / n
    out["loss/kl_mu_k3"] = s["kl_mu_k3"] / n
    if "m2po_masked" in s:  # loss m2po: the tokens its second-moment mask dropped
        out["loss/m2po_masked_frac"] = s["m2po_masked"] / n
    for k in ("kl_ref", "entropy"):  # only when computed (the caller passed ref_logp / entropy)
        if s[f"{k}_tokens"] > 0:
            out[f"loss/{k}"] = s[k] / s[f"{k}_tokens"]
    return out


def _critic_metrics(s: dict[str, float]) -> dict[str, float]:
    """The value loss's clip fraction and the reward model's pairwise accuracy and mean margin."""
    out = {}
    if "value_tokens" in s:
        n = s["value_tokens"]
        out["loss/value_clip_frac"] = s["value_clipped"] / n if n > 0 else 0.0
    if "rm_pairs" in s:
        n = s["rm_pairs"]
        out["loss/rm_accuracy"] = s["rm_correct"] / n if n > 0 else 0.0
        out["loss/rm_margin"] = s["rm_margin"] / n if n > 0 else 0.0
    return out


STAT_KEYS = (
    "tokens",
    "ratio_masked",
    "seqs",
    "seq_masked",
    "clipped",
    "is_capped",
    "is_weight",
    "is_weight_sq",
    "kl_mu_k1",
    "kl_mu_k3",
    "kl_ref",
    "kl_ref_tokens",
    "entropy",
    "entropy_tokens",
)


def stat_keys(loss: str = "") -> tuple[str, ...]:
    """The keys :func:`~asyncrl.learner.losses.policy.policy_loss` returns for ``loss``:
    :data:`STAT_KEYS`, and m2po's masked-token count for m2po alone (so that no other loss's
    metrics change)."""
    return STAT_KEYS + (("m2po_masked",) if loss == "m2po" else ())


def zero_stats(loss: str = "", device: torch.device | None = None) -> dict[str, Tensor]:
    """The stats of a micro-batch with no tokens: the starting point of a sum, so that every rank
    all-reduces the same keys (:func:`stat_keys`, which
    :func:`~asyncrl.learner.losses.policy.policy_loss` always returns). On ``device`` (the losses'),
    the sum stays there until the step's end reads it once."""
    return {k: torch.zeros((), dtype=torch.float64, device=device) for k in stat_keys(loss)}

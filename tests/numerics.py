"""How close two floating-point results must be: bounds that follow from the arithmetic, not from
the CPU the test was first run on.

Another CPU (Intel or AMD, AVX2 or AVX-512) runs other BLAS kernels, so the same float32 sum is
added in another order and rounds differently. A test compares what its claim is about:
- values of a known scale (log-probabilities, losses, gradient norms): a bound a few orders of
  magnitude above float32's epsilon times that scale;
- gradients: relative to the tensor's largest entry (an entry near zero is mostly rounding, so a
  per-entry relative bound would be meaningless);
- weights after an Adam step: never one absolute bound. Adam's first update is lr·g/(|g|+ε), about
  lr·sign(g), so rounding noise in a gradient entry near zero moves that weight by up to 2·lr (it did:
  1.2e-5 with lr 1e-3 on an AMD EPYC). :func:`assert_adam_steps_agree` derives each entry's bound from
  its own gradient instead.

Where the bounds were checked: on 2-core AMD EPYC machines (Zen 4, AVX-512) with their native
kernels, and on the same machines with the kernel paths of other x86 CPUs forced: torch's ATen
kernels (``ATEN_CPU_CAPABILITY=avx2``, ``=default``), oneDNN (``ONEDNN_MAX_CPU_ISA``) and MKL
(``MKL_ENABLE_INSTRUCTIONS``). The tests that compare float32 results within a tolerance across
kernels, ranks or layouts carry the ``numerics`` marker (a bitwise comparison of one computation
done two ways, with and without offload or a reshard, does not: other kernels change both sides
alike), and ``make test`` runs them once more under the other CPU's kernels: the AVX2 paths on an
AVX-512 CPU, the generic ones on an AVX2 CPU (Makefile ``test-kernels``). CI once failed on an AVX2-only AMD
EPYC (Zen 3) whose kernels the AVX2 run reproduces (tests/learner/test_placement.py: 1.48e-5, the
same figure to the last digit).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

F32_EPS = torch.finfo(torch.float32).eps  # 1.19e-7

GRAD_RTOL = 1e-5
"""Two float32 gradients of one batch summed in another order (micro-batch split, ranks, kernels):
per tensor, max |Δg| ≤ GRAD_RTOL · max |g|. Reordering a sum of n terms errs by about √n·ε of the
terms' scale (n ≈ 10²–10³ token contributions here: 1–4e-6); the bound is ~100·ε. Measured: ≤ 6.1e-7
on an AMD EPYC (tests/learner/test_step.py's split test)."""

LOGPROB_ATOL = 1e-5
"""Two float32 forward passes of one tiny model (hidden ≤ 256, ≤ 4 layers, logits |x| ≲ 5) that differ
in kernels (packed vs unpacked rows, KV cache vs full forward, batch shape, another BLAS): |Δ| ≤
LOGPROB_ATOL on logits and log-probabilities. One float32 rounding at that scale is ε·5 = 6e-7 and
each layer's reordered sums add a few; the bound is ~16 of them. Measured: ≤ 9.5e-7 (AMD EPYC)."""


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a (possibly FSDP-sharded) one."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def weights_and_grads(model: torch.nn.Module) -> tuple[dict, dict]:
    """Full copies of a model's parameters and of their ``.grad`` (after a step, the clipped
    gradient the optimizer used: the trainer zeroes gradients at the start of a step, not the end)."""
    weights, grads = {}, {}
    for name, p in model.named_parameters():
        weights[name] = full(p)
        if p.grad is not None:
            grads[name] = full(p.grad)
    return weights, grads


def hf_grads(trainer) -> dict[str, torch.Tensor]:
    """A trainer's gradients under HF names, the keys of ``trainer.hf_state_dict()``. The model's
    state-dict hooks split fused weights (wqkv), so for one call the gradients take the weights' place."""
    params = list(trainer.models.actor.parameters())
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        try:
            for p in params:
                p.copy_(p.grad)
            return trainer.hf_state_dict()
        finally:
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)


def assert_logits_close(got, want, *, atol: float = LOGPROB_ATOL) -> None:
    """Float32 logits or log-probabilities of one model from two kernels: |Δ| ≤ atol."""
    got, want = (
        torch.as_tensor(got, dtype=torch.float64),
        torch.as_tensor(want, dtype=torch.float64),
    )
    assert got.shape == want.shape, (got.shape, want.shape)
    err = float((got - want).abs().max()) if got.numel() else 0.0
    assert err <= atol, f"max |Δ| {err:.2e} > {atol:.0e} (scale {float(want.abs().max()):.2e})"


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of max |a − b| / max |a| (0 where both are exactly zero)."""
    assert set(a) == set(b)
    worst = 0.0
    for k in a:
        d, s = float((a[k] - b[k]).abs().max()), float(a[k].abs().max())
        worst = max(worst, d / s if s > 0 else (0.0 if d == 0 else float("inf")))
    return worst


def assert_grads_close(a: dict, b: dict, *, rtol: float = GRAD_RTOL) -> None:
    worst = max_rel_diff(a, b)
    assert worst <= rtol, f"gradients differ by {worst:.2e} of their scale (allowed {rtol:.0e})"


def assert_close_rel(a: float, b: float, *, rtol: float = GRAD_RTOL, scale: float = 0.0) -> None:
    """Two scalars of the same computation (a loss, a gradient norm) up to float32 reordering.
    ``scale``: the size of the terms summed, when they cancel (a loss on whitened advantages sums
    terms of size ~1 to ~0, and rounds at the terms' scale, not the sum's)."""
    bound = rtol * max(abs(a), abs(b), scale)
    assert abs(a - b) <= bound, f"{a!r} vs {b!r} (rtol {rtol:.0e})"


def adam_first_step_bound(grad: torch.Tensor, lr: float, grad_tol: float) -> torch.Tensor:
    """Per entry, how far two first Adam steps from the same weights may land apart when their
    gradients differ by at most ``grad_tol`` (entry-wise) and the reference gradient is ``grad``.

    Adam's first update is u(g) = g/(|g|+ε). For |g| > δ = grad_tol the other gradient has the same
    sign and |u(g) − u(g')| ≤ δ/(|g| − δ); otherwise the signs may differ and |Δu| ≤ 2. Times lr,
    plus a few ulps of float32 rounding of the weight itself (added by the caller).
    """
    g = grad.abs().to(torch.float64)
    du = torch.where(g > grad_tol, grad_tol / (g - grad_tol).clamp(min=1e-300), 2.0).clamp(max=2.0)
    return lr * du


def assert_adam_steps_agree(
    a: dict[str, torch.Tensor],
    b: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    *,
    lr: float,
    rtol: float = GRAD_RTOL,
) -> None:
    """Weights after one Adam step from the same start, ``a`` with gradient ``grads`` and ``b`` with
    a gradient within ``rtol`` of it (:data:`GRAD_RTOL`): each entry within
    :func:`adam_first_step_bound`. Where the gradient is clearly non-zero that bound is tight, so a
    wrong gradient still fails; only entries whose gradient is within rounding of 0 may move apart."""
    assert set(a) == set(b) == set(grads)
    for k in a:
        delta = rtol * float(grads[k].abs().max())
        bound = adam_first_step_bound(grads[k], lr, delta)
        bound = bound + 4 * F32_EPS * (a[k].abs().to(torch.float64) + lr)
        over = (a[k].to(torch.float64) - b[k].to(torch.float64)).abs() - bound
        assert float(over.max()) <= 0, (
            f"{k}: weights differ beyond the Adam bound by {float(over.max()):.2e} "
            f"(gradient there {float(grads[k].flatten()[int(over.argmax())]):.2e})"
        )

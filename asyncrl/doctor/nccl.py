"""The doctor's NCCL check: whether the weights go over NCCL at all (the backend the broadcaster
will choose for this recipe on this device), and if they do, this machine's NCCL settings and
version against the SGLang servers' (:mod:`asyncrl.gpu`): NCCL refuses mismatched versions."""

from __future__ import annotations

from asyncrl import gpu
from asyncrl.doctor.context import Check, Doctor


def check_nccl(d: Doctor) -> list[Check]:
    return _nccl_line(d) + handle_allocator(d)


def handle_allocator(d: Doctor) -> list[Check]:
    """On a GPU host where weights may go by CUDA IPC handle (``weights.backend: ipc``, or
    ``auto`` with built-in engines that may run on rank 0's own GPU): a failed line when the
    learner's allocator settings break those handles (asyncrl.weights.ipc.alloc_conf_problem;
    ``asyncrl learner`` refuses them for ``ipc`` at start), else nothing."""
    from asyncrl.weights.ipc import alloc_conf_problem

    g, backend = d.recipe.generator, d.recipe.weights.backend
    if not (d.device and d.device.cuda):
        return []
    by_handle = backend == "ipc" or (
        backend == "auto" and g.kind == "builtin" and g.device in ("auto", "cuda")
    )
    problem = alloc_conf_problem(d.environ) if by_handle else None
    if problem is None:
        return []
    return [Check(name="weights by handle", ok=False, detail=problem)]


def _nccl_line(d: Doctor) -> list[Check]:
    cuda = bool(d.device and d.device.cuda)
    backend = d.recipe.weights.backend
    here = gpu.this_torch()
    mine = f"torch {here.torch}, NCCL {gpu.format_nccl(here.nccl)}"
    other = sglang_side(d)
    g = d.recipe.generator
    gloo_member = gpu.recipe_needs_gloo(g.kind, g.device, cuda=cuda)
    if not gpu.uses_nccl(backend, cuda=cuda, gloo_member=gloo_member):
        why = f"weights.backend {backend}" + (
            ", built-in engines receive on CPU" if gloo_member and backend == "auto" else ""
        )
        how = "by handle" if backend == "ipc" else "over gloo"
        detail = f"not used: weights go {how} ({why}); here {mine}"
        return [Check(name="NCCL", ok=True, detail=detail + (f"; {other[1]}" if other else ""))]
    if not cuda:
        return [
            Check(
                name="NCCL",
                ok=False,
                detail=f"weights.backend nccl needs a GPU and this machine has none ({mine}): "
                "run it on the GPU machine, or set weights.backend=gloo",
            )
        ]
    bad_env = gpu.nccl_env_mismatch(d.environ)
    if bad_env:
        return [
            Check(
                name="NCCL",
                ok=False,
                detail=f"{', '.join(bad_env)} here, but SGLang servers run with "
                f"{gpu.SGLANG_NCCL_ENV} unless launched with the same: unset it, or set it "
                "for the servers too",
            )
        ]
    if other is None and g.kind == "builtin":
        detail = (
            f"learner {mine}; built-in engines on CUDA (generator.device {g.device}) join "
            "NCCL from another GPU, and take CUDA IPC handles on rank 0's own (NCCL refuses "
            "two ranks on one GPU; weights.backend ipc): the broadcaster chooses at each "
            "group build from what they report"
        )
        return [Check(name="NCCL", ok=True, detail=detail)]
    if other is None:
        return [Check(name="NCCL", ok=True, detail=f"learner {mine}; no SGLang servers")]
    theirs, text = other
    if theirs is None:
        return [Check(name="NCCL", ok=True, detail=f"learner {mine}; {text}")]
    if theirs != here.nccl:
        return [
            Check(
                name="NCCL",
                ok=False,
                detail=f"learner {mine}, but {text}: NCCL refuses mismatched versions; "
                "install the learner on SGLang's torch (pip install 'asyncrl[gpu]', docs/gpu.md)",
            )
        ]
    return [Check(name="NCCL", ok=True, detail=f"learner {mine}; {text}: the same")]


def sglang_side(d: Doctor) -> tuple[gpu.NcclVersion | None, str] | None:
    """(the servers' NCCL if it can be read or inferred, how it was found); None: no SGLang."""
    if d.sglang_python:
        try:
            t = gpu.probe_python(d.sglang_python)
        except RuntimeError as e:
            return None, f"SGLang's environment: {e}"
        return t.nccl, f"SGLang's environment torch {t.torch}, NCCL {gpu.format_nccl(t.nccl)}"
    if d.recipe.generator.kind != "sglang":
        return None
    import importlib.metadata as md

    try:
        v = md.version("sglang")
        here = gpu.this_torch()
        return here.nccl, f"SGLang {v} installed in this environment: the same torch"
    except md.PackageNotFoundError:
        pass
    versions = {str(s.get("version")) for s in d.servers.values() if s.get("version")}
    if len(versions) == 1:
        (v,) = versions
        expected = gpu.expected_nccl(v)
        if expected is not None:
            return expected, (
                f"servers run sglang {v}, which pins torch {gpu.SGLANG_TORCH[v]}: NCCL "
                f"{gpu.format_nccl(expected)} if installed as pinned (not readable over HTTP; "
                "--sglang-python reads it)"
            )
    return None, "the servers' NCCL cannot be read over HTTP: --sglang-python PATH reads it"

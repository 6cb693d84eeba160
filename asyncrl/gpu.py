"""NCCL between the learner and SGLang: the environment both sides must share, and their versions.

The weight-update group joins the learner's rank 0 and every SGLang worker in one NCCL communicator,
so the two sides must agree on what NCCL does:

- **The same NCCL version.** NCCL refuses peers of another version, and each side brings the NCCL of
  its torch wheel. SGLang 0.5.23 pins torch 2.14.1, whose wheel carries NCCL 2.30.7; torch 2.13.0's
  carries 2.29.7. The supported set-up is therefore one environment (``pip install 'asyncrl[gpu]'``:
  the learner on SGLang's torch), or two whose torch versions match (docs/gpu.md).
- **The same NCCL settings.** SGLang's server sets ``NCCL_CUMEM_ENABLE=0`` and ``NCCL_NVLS_ENABLE=0``
  unless they are already set (sglang/srt/entrypoints/engine.py, ``_set_envs_and_config``), and
  SGLang's own test of ``update_weights_from_distributed`` sets both on its trainer process ("very
  important to avoid unexpected behaviors of CUDA and NCCL"). The learner does the same:
  :func:`trainer_nccl_env`.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

SGLANG_NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
"""What an SGLang server runs with unless its environment sets them (and so what the trainer sets)."""

SGLANG_TORCH = {"0.5.23": "2.14.1"}
"""The torch each SGLang release pins (its wheel's ``Requires-Dist: torch==``)."""

TORCH_NCCL = {"2.14.1": (2, 30, 7), "2.13.0": (2, 29, 7)}
"""The NCCL in each torch release's CUDA wheel on PyPI (``Requires-Dist: nvidia-nccl-cu13==``)."""

NcclVersion = tuple[int, int, int]


def trainer_nccl_env(environ: Mapping[str, str], *, uses_nccl: bool) -> dict[str, str]:
    """The variables the learner must set before its first NCCL communicator so that it matches
    SGLang's servers: those of :data:`SGLANG_NCCL_ENV` the user has not set (a value set by hand
    wins, as it does on SGLang's side; set it on both). Nothing when no NCCL group is built."""
    if not uses_nccl:
        return {}
    return {k: v for k, v in SGLANG_NCCL_ENV.items() if k not in environ}


def weight_backend(backend: str, *, cuda: bool, builtin: bool = False) -> str:
    """The backend a weight-update group is built with, from ``weights.backend``: ``auto`` is NCCL
    where CUDA is available, unless a generator is a built-in engine (``builtin``): that engine
    loads its weights on CPU and receives each version into CPU tensors, which NCCL cannot fill,
    so the group is gloo (which moves a learner's CUDA tensors through host memory)."""
    if backend != "auto":
        return backend
    return "nccl" if cuda and not builtin else "gloo"


def uses_nccl(backend: str, *, cuda: bool, builtin: bool = False) -> bool:
    """Whether ``weights.backend`` builds an NCCL weight group on this machine (``builtin``: the
    generators are built-in engines, :func:`weight_backend`)."""
    return weight_backend(backend, cuda=cuda, builtin=builtin) == "nccl"


def nccl_env_mismatch(environ: Mapping[str, str]) -> list[str]:
    """Variables set here to a value an SGLang server would not use unless launched with it too."""
    return [f"{k}={environ[k]}" for k, v in SGLANG_NCCL_ENV.items() if environ.get(k, v) != v]


def expected_nccl(sglang_version: str) -> NcclVersion | None:
    """The NCCL an SGLang release runs with when installed from PyPI as pinned, if known."""
    torch_version = SGLANG_TORCH.get(sglang_version)
    return TORCH_NCCL.get(torch_version) if torch_version else None


def format_nccl(v: NcclVersion | None) -> str:
    return "none" if v is None else ".".join(map(str, v))


@dataclass(frozen=True, kw_only=True)
class TorchInfo:
    """What one Python environment's torch brings: its version and its NCCL (None: no NCCL)."""

    torch: str
    nccl: NcclVersion | None


_PROBE = (
    "import json, torch\n"
    "try:\n    n = list(torch.cuda.nccl.version())\nexcept Exception:\n    n = None\n"
    "print(json.dumps({'torch': torch.__version__, 'nccl': n}))\n"
)


def this_torch() -> TorchInfo:
    """This process's torch and NCCL (``torch.cuda.nccl.version()``: a CPU build has none)."""
    import torch

    try:
        nccl = tuple(torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):
        nccl = None
    return TorchInfo(torch=torch.__version__, nccl=nccl)  # type: ignore[arg-type]


def probe_python(python: str, *, timeout_s: float = 120.0) -> TorchInfo:
    """Another environment's torch and NCCL (e.g. SGLang's, when it has its own venv), by running
    its interpreter. Raises ``RuntimeError`` with a one-line reason."""
    try:
        p = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"{python}: cannot run ({e})") from None
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{python}: torch does not import ({tail})")
    d = json.loads(p.stdout.strip().splitlines()[-1])
    return TorchInfo(torch=d["torch"], nccl=tuple(d["nccl"]) if d["nccl"] else None)

"""NCCL between the learner and its generators (SGLang, built-in engines on CUDA): the environment
both sides must share, their versions, and when a weight group can be NCCL at all.

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

The weight group's own communicator is nonblocking (asyncrl.weights.rendezvous), and torch bounds
every call on such a communicator (its init, which the first broadcast waits for, each launch, an
abort) by ``TORCH_NCCL_NONBLOCKING_TIMEOUT``: 30 minutes unless set, read once per process. The
learner sets it to ``weights.timeout_s`` (:func:`trainer_nccl_env`), so that a generator that joined
and went silent costs a version at most that long, as over gloo.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

SGLANG_NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
"""What an SGLang server runs with unless its environment sets them (and so what the trainer sets)."""

SGLANG_TORCH = {"0.5.23": "2.14.1"}
"""The torch each SGLang release pins (its wheel's ``Requires-Dist: torch==``)."""

TORCH_NCCL = {"2.14.1": (2, 30, 7), "2.13.0": (2, 29, 7)}
"""The NCCL in each torch release's CUDA wheel on PyPI (``Requires-Dist: nvidia-nccl-cu13==``)."""

NONBLOCKING_TIMEOUT = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
"""What bounds each call on a nonblocking NCCL communicator, in whole seconds (torch's
``nccl_nonblocking_timeout()``, NCCLUtils.cpp: parsed with ``stoi``, once per process)."""

NONBLOCKING_TIMEOUT_DEFAULT_S = 30 * 60
"""torch's value for :data:`NONBLOCKING_TIMEOUT` when it is unset or empty."""

NcclVersion = tuple[int, int, int]


def trainer_nccl_env(
    environ: Mapping[str, str], *, uses_nccl: bool, weights_timeout_s: float | None = None
) -> dict[str, str]:
    """The variables the learner must set before its first NCCL communicator: those of
    :data:`SGLANG_NCCL_ENV` so that it matches SGLang's servers, and, given ``weights_timeout_s``,
    :data:`NONBLOCKING_TIMEOUT` rounded up to whole seconds, so that the nonblocking weight group's
    init and launches give up after ``weights.timeout_s`` rather than torch's 30 minutes. A value
    the user has set wins (for SGLang's, as it does on SGLang's side: set it on both). Nothing
    when no NCCL group is built.

    Process-wide: :data:`NONBLOCKING_TIMEOUT` also bounds the learner's own communicators when
    they are nonblocking (``TORCH_NCCL_USE_COMM_NONBLOCKING=1``, or an eager init); TorchTitan's
    default groups are blocking and do not read it."""
    if not uses_nccl:
        return {}
    env = {k: v for k, v in SGLANG_NCCL_ENV.items() if k not in environ}
    if weights_timeout_s is not None and NONBLOCKING_TIMEOUT not in environ:
        env[NONBLOCKING_TIMEOUT] = str(max(1, math.ceil(weights_timeout_s)))
    return env


def nonblocking_timeout_s(environ: Mapping[str, str]) -> int:
    """The bound torch puts on a nonblocking NCCL call in a process with this environment: the
    leading integer of :data:`NONBLOCKING_TIMEOUT` as ``stoi`` reads it, or torch's default."""
    value = environ.get(NONBLOCKING_TIMEOUT, "")
    if not value:
        return NONBLOCKING_TIMEOUT_DEFAULT_S
    m = re.match(r"\s*[+-]?\d+", value)
    if m is None:  # torch's stoi would throw; the weight group's init then fails at once
        return 0
    return int(m.group())


def nonblocking_bound_problem(environ: Mapping[str, str], timeout_s: float) -> str | None:
    """Why the weight group's NCCL calls would outlast ``weights.timeout_s`` here (one line), or
    None: :data:`NONBLOCKING_TIMEOUT` unset (30 minutes) or set higher by hand."""
    bound = nonblocking_timeout_s(environ)
    if bound <= math.ceil(timeout_s):
        return None
    how = (
        "unset"
        if not environ.get(NONBLOCKING_TIMEOUT)
        else f"set to {environ[NONBLOCKING_TIMEOUT]}"
    )
    return (
        f"{NONBLOCKING_TIMEOUT} is {how}: the weight group's NCCL init and launches may block "
        f"{bound}s, not weights.timeout_s ({timeout_s:g}s); set it before the first NCCL "
        "communicator (asyncrl learner does)"
    )


def engine_device(device: str, *, cuda: bool) -> str:
    """Where a built-in engine runs, from ``generator.device`` (``--device``): ``auto`` is CUDA
    when torch sees a GPU, else the CPU. ``cuda`` without a GPU raises ``ValueError`` (one line)."""
    if device == "auto":
        return "cuda" if cuda else "cpu"
    if device == "cuda" and not cuda:
        raise ValueError("device cuda: torch sees no CUDA device here; use cpu or auto")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: expected auto, cpu or cuda")
    return device


def receives_on_cpu(kind: str, device: str | None) -> bool:
    """Whether a generator receives weights into CPU tensors, which an NCCL group cannot fill:
    one whose ``/server_info`` reports ``device: cpu`` (a built-in engine on CPU, SGLang's CPU
    build), or a built-in engine that reports no device (one from before it could run on CUDA).
    SGLang's servers run on CUDA unless they say otherwise (its ``--device`` defaults to cuda)."""
    if device is not None:
        return not device.startswith("cuda")
    return kind == "builtin"


def same_gpu(gpu_uuid: str | None, sender_gpu: str | None) -> bool:
    """Whether a generator that reports ``gpu_uuid`` runs on the learner rank 0's GPU
    ``sender_gpu`` (both known): ``weights.backend: auto`` then passes it CUDA IPC handles
    (asyncrl.weights.ipc), no group at all."""
    return gpu_uuid is not None and gpu_uuid == sender_gpu


def needs_gloo(
    kind: str, device: str | None, gpu_uuid: str | None, *, sender_gpu: str | None
) -> bool:
    """Whether a generator cannot be in an NCCL weight group with the learner's rank 0: it
    receives on CPU (:func:`receives_on_cpu`), or it runs on rank 0's own GPU (its
    ``/server_info`` ``gpu_uuid`` is ``sender_gpu``): NCCL refuses a communicator with two ranks
    on one device ("Duplicate GPU detected"), which is where ``asyncrl run`` puts built-in engines
    on a one-GPU host. Gloo reaches both (through host memory)."""
    if receives_on_cpu(kind, device):
        return True
    return gpu_uuid is not None and gpu_uuid == sender_gpu


def recipe_needs_gloo(kind: str, device: str, *, cuda: bool) -> bool:
    """:func:`needs_gloo` as far as a recipe tells it on the learner's machine, before any
    generator answers: built-in engines with ``generator.device`` cpu, or auto where this machine
    has no GPU. The broadcaster decides each group from what its members report."""
    return kind == "builtin" and (device == "cpu" or not cuda)


def weight_backend(backend: str, *, cuda: bool, gloo_member: bool = False) -> str:
    """The backend a weight-update group is built with, from ``weights.backend``: ``auto`` is NCCL
    where CUDA is available and every generator can join NCCL (SGLang, built-in engines on
    another GPU), gloo as soon as one cannot (``gloo_member``: :func:`needs_gloo`; gloo moves a
    learner's CUDA tensors through host memory)."""
    if backend != "auto":
        return backend
    return "nccl" if cuda and not gloo_member else "gloo"


def uses_nccl(backend: str, *, cuda: bool, gloo_member: bool = False) -> bool:
    """Whether ``weights.backend`` builds an NCCL weight group on this machine (``gloo_member``:
    a generator cannot join NCCL, :func:`weight_backend`)."""
    return weight_backend(backend, cuda=cuda, gloo_member=gloo_member) == "nccl"


def cuda_uuid(device: int | None = None) -> str | None:
    """The UUID of a CUDA device (default: the current one), which names the physical GPU across
    processes whatever their ``CUDA_VISIBLE_DEVICES``; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if device is None else device
    return str(torch.cuda.get_device_properties(index).uuid)


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

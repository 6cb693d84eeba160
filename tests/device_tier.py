"""A pretend accelerator for CPU tests: :class:`PretendDevice` runs asyncrl's real code (the
learner's steps, the built-in engine's decode loop and weight updates) on real CPU tensors and real
gloo collectives, while keeping track of which tensors would live on the GPU and which on the host,
and fails where CUDA would, or where the host would wait for the GPU.

Why this and not PyTorch's own stand-ins (tried with torch 2.13's CPU build, see
``tests/learner/test_device_tier.py``):

- the ``meta`` device has no values, so nothing after the first data-dependent step runs, no gloo
  collective takes its tensors, and it lets a CPU tensor be indexed by meta indices, or written
  at them (``cpu[meta_ids] = ...``): the very crash this tier exists for;
- ``FakeTensorMode`` tensors can report ``cuda`` without CUDA, but have no values either (``.item()``
  raises, so no step completes), cannot go through a gloo collective or FSDP, and also let
  ``cpu_tensor[cuda_ids]`` through;
- a ``__torch_dispatch__`` mode sees the aten ops below FSDP's and DTensor's Python, including the
  backward's, but not the Python-level calls (``x.device``, ``.to(device)``, ``torch.from_numpy``)
  that decide where a tensor goes, nor which file made them.

So this is a ``__torch_function__`` mode over the real computation. Every tensor is on the
accelerator unless it is known to be a host tensor: made by a factory without ``device=`` (CUDA's
rule: the default device is the CPU), by ``torch.from_numpy`` (not overridable: wrapped while the mode
is on), by ``.cpu()`` or ``.to("cpu")``, or computed from host tensors only. Model parameters,
gradients, FSDP's buffers and whatever an op makes from a device tensor are device tensors.
asyncrl's own code (and the tests') sees device tensors as ``cuda:0`` (``x.device``), so
``torch.zeros(n, device=x.device)`` makes a device tensor and ``.to(models.device)`` moves one there;
torch's and TorchTitan's code sees the real device, so their internals run unchanged.

What it catches, at the call that does it:

- a host tensor with at least one dimension in an op with a device tensor, either way round
  (``cpu[cuda_ids] = ...``, ``cuda_t[cpu_ids]``, ``torch.cat([cpu, cuda])``); 0-dim host tensors are
  scalars there, as in CUDA, except as the output of an in-place op;
- ``.numpy()`` of a device tensor (CUDA raises too);
- a draw (``generator=``) on device tensors with a host generator, or the other way round:
  ``torch.Generator`` is wrapped while the mode is on, and one made for the pretend device is
  the device's;
- ``pin_memory=True`` for a tensor made on the device (pinned memory is the host's; it is
  dropped for a host tensor, as this CPU build has no pinned allocator);

and it counts, as :class:`HostRead`, every call that makes the host wait for the device: the reads
of ``tests/engine/test_host_reads.py`` (``.item()``, ``.tolist()``, ``.cpu()``, ``int()``,
``float()``, ``bool()``, ``__index__``, ``.numpy()``) of a device tensor, a copy from device to host,
and the ops whose output size depends on the data (``nonzero``, ``unique``, ``masked_select``,
indexing with a boolean mask, ``repeat_interleave`` without ``output_size``, ``bincount``) or whose
result is a Python value (``equal``, ``allclose``).

A mode is its thread's own: code that runs in other threads (the engine's decode and receiver
threads) is seen only where a test enters the mode there too (``tests/engine/test_device_tier.py``).
What it cannot see: the kernels of the backward (they run on what the forward saved, which was
checked) and the Python hooks that run inside it (FSDP's reduce-scatter: torch's code).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torchtitan
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from tests.engine.test_host_reads import READS

PRETEND = torch.device("cuda", 0)
"""What a device tensor reports to asyncrl's code."""

SYNC_OPS = {
    "nonzero",
    "argwhere",
    "unique",
    "unique_consecutive",
    "masked_select",
    "bincount",
    "equal",
    "allclose",
}
"""Ops whose output's size (or Python result) depends on the values: the host waits for them."""

FACTORIES = {
    "tensor",
    "as_tensor",
    "scalar_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "range",
    "linspace",
    "logspace",
    "eye",
    "rand",
    "randn",
    "randint",
    "randperm",
    "empty_strided",
    "asarray",  # safetensors' load_file: torch.asarray(storage, device="cpu")
    "frombuffer",
}

INTERNAL = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, torchtitan))
WRAPPERS = tuple(
    os.path.join(os.path.dirname(torch.__file__), f)
    for f in ("overrides.py", "_tensor.py", "functional.py", "_jit_internal.py")
)
HERE = os.path.abspath(__file__)
DEVICE_GETTER = torch.Tensor.device
IN_PLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__"}


class DeviceMixError(RuntimeError):
    """A host tensor in device compute: what CUDA refuses ("expected all tensors to be on the same
    device", "indices should be either on cpu or on the same device as the indexed tensor")."""


@dataclass(frozen=True)
class HostRead:
    """One call that makes the host wait for the device, and the asyncrl line that made it."""

    name: str
    where: str


def _caller() -> inspect.FrameInfo | None:
    """The frame that made the torch call being handled, past torch's dispatch wrappers."""
    f = inspect.currentframe()
    while f is not None and (
        f.f_code.co_filename in WRAPPERS
        or os.path.abspath(f.f_code.co_filename) == HERE
        or f.f_code.co_filename.startswith(os.path.dirname(contextlib.__file__) + os.sep)
    ):
        f = f.f_back
    return f


def _is_user(f) -> bool:
    return f is not None and not f.f_code.co_filename.startswith(INTERNAL)


def _where() -> str:
    """The innermost asyncrl (or test) line on the stack: who asked for a read."""
    f = inspect.currentframe()
    while f is not None:
        name = f.f_code.co_filename
        comprehension = f.f_code.co_name.startswith("<") and f.f_code.co_name != "<module>"
        if (
            not name.startswith(INTERNAL)
            and os.path.abspath(name) != HERE
            and "asyncrl" in name
            and not comprehension
        ):
            rel = name.split("asyncrl/", 1)[-1] if "/asyncrl/" in name else name
            return f"{rel}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "?"


def _is_pretend(d: Any) -> bool:
    if isinstance(d, str):
        return d.split(":")[0] == PRETEND.type
    return isinstance(d, torch.device) and d.type == PRETEND.type


def _real(x: Any) -> Any:
    if not _is_pretend(x):
        return x
    return "cpu" if isinstance(x, str) else torch.device("cpu")


class PretendDevice(TorchFunctionMode):
    """The mode (see the module's docstring). ``reads`` lists every host read while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.host: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.reads: list[HostRead] = []
        self._from_numpy = torch.from_numpy
        self._generator = torch.Generator
        self.device_generators: WeakIdKeyDictionary = WeakIdKeyDictionary()

    # -- which side a tensor is on ------------------------------------------------------------

    def on_host(self, t: torch.Tensor) -> bool:
        return t in self.host

    def _mark_host(self, out: Any) -> Any:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.host[t] = True
        return out

    def _read(self, name: str) -> None:
        self.reads.append(HostRead(name, _where()))

    def __enter__(self):
        def from_numpy(a):
            return self._mark_host(self._from_numpy(a))

        mode = self

        class Generator(self._generator):
            """``torch.Generator(device)``: a host generator that, made for the pretend device,
            counts as the device's (CUDA draws on a CUDA tensor only with a CUDA generator)."""

            def __new__(cls, device: Any = "cpu"):
                return super().__new__(cls, _real(device))

            def __init__(self, device: Any = "cpu"):
                if _is_pretend(device):
                    mode.device_generators[self] = True

        torch.from_numpy = from_numpy
        torch.Generator = Generator
        return super().__enter__()

    def __exit__(self, *exc):
        torch.from_numpy = self._from_numpy
        torch.Generator = self._generator
        return super().__exit__(*exc)

    # -- the calls ----------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        user = _is_user(_caller())
        if func is torch.device:
            return func(*args, **kwargs)
        if getattr(func, "__self__", None) is DEVICE_GETTER:
            t = args[0]
            return PRETEND if user and not self.on_host(t) else func(*args)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        host = [t for t in tensors if self.on_host(t)]
        device = [t for t in tensors if not self.on_host(t)]
        real_args, real_kwargs = tree_map(_real, args), tree_map(_real, kwargs)

        if name == "numpy" and device:
            raise TypeError("can't convert a cuda:0 device tensor to numpy (.cpu() it first)")
        if name in READS and device:
            self._read(name)
            if name == "cpu":
                return self._mark_host(func(*real_args, **real_kwargs).clone())
            return func(*real_args, **real_kwargs)
        if name == "to":
            return self._to(func, args, kwargs, real_args, real_kwargs, user, device)
        if name == "copy_":
            dst, src = args[0], args[1]
            if self.on_host(dst) and not self.on_host(src):
                self._read("copy_")  # device → host
            return func(*real_args, **real_kwargs)
        if device and (
            name in SYNC_OPS
            or (name == "where" and len(args) + len(kwargs) == 1)
            or (name == "repeat_interleave" and "output_size" not in kwargs)
            or (name in ("__getitem__", "__setitem__") and _bool_index(args[1]))
        ):
            self._read(name)
        if host and device:
            self._check_mix(name, args, kwargs, host)
        gen = kwargs.get("generator")
        if gen is not None and tensors and (gen in self.device_generators) != bool(device):
            raise DeviceMixError(
                f"{name}: a {'device' if device else 'host'} tensor drawn with a "
                f"{'host' if device else 'device'} generator (at {_where()}): expected a "
                "generator of the tensor's device"
            )
        if name in FACTORIES and real_kwargs.pop("pin_memory", False):
            if not _host_factory(kwargs.get("device"), user):
                raise DeviceMixError(f"{name}: pin_memory=True for a device tensor")
        out = func(*real_args, **real_kwargs)
        if tensors:  # computed from host tensors only: on the host
            return out if device else self._mark_host(out)
        if name in FACTORIES and _host_factory(kwargs.get("device"), user):
            self._mark_host(out)
        return out

    def _to(self, func, args, kwargs, real_args, real_kwargs, user, device):
        """``.to``: asyncrl's ``.to(cuda)`` moves to the device, its ``.to("cpu")`` to the host
        (a read); torch's own ``.to`` keeps the side (it sees the real device)."""
        target = next(
            (a for a in [*args[1:], kwargs.get("device")] if isinstance(a, str | torch.device)),
            None,
        )
        out = func(*real_args, **real_kwargs)
        if not user or target is None:
            return out if device else self._mark_host(out)
        if _is_pretend(target):
            return out.clone() if out is args[0] and not device else out
        if device:
            self._read("to(cpu)")
            return self._mark_host(out.clone() if out is args[0] else out)
        return self._mark_host(out)

    def _check_mix(self, name, args, kwargs, host) -> None:
        target = kwargs.get("out", args[0] if args else None)
        in_place = (name.endswith("_") and not name.startswith("_")) or name in (
            IN_PLACE_DUNDERS | {"__setitem__"}
        )
        if (in_place or "out" in kwargs) and any(target is t for t in host):
            raise DeviceMixError(
                f"{name}: writes device values into a host tensor {tuple(target.shape)} "
                f"(at {_where()})"
            )
        big = [t for t in host if t.dim() > 0]
        if big:
            raise DeviceMixError(
                f"{name}: a host tensor {tuple(big[0].shape)} {big[0].dtype} mixed with device "
                f"tensors (at {_where()}): expected all tensors to be on the same device"
            )


def _host_factory(device: Any, user: bool) -> bool:
    """Whether a factory makes a host tensor. Without a device, yes (CUDA's rule: the default device
    is the CPU). asyncrl's code sees device tensors as ``cuda``, so any other device it names is
    the host. torch's own code sees the real device: a ``torch.device`` it holds (FSDP's, from its
    mesh; a parameter's) is the accelerator here, and it names the host as the string ``"cpu"``
    (AdamW's step counts)."""
    if device is None:
        return True
    if user:
        return not _is_pretend(device)
    return isinstance(device, str) and device == "cpu"


def _bool_index(index: Any) -> bool:
    return any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
        for t in tree_flatten(index)[0]
    )


def optimizer_steps(models) -> list[torch.Tensor]:
    """AdamW's step counts: host tensors on a GPU too (``torch.tensor(0.0)``, no device, unless
    fused or capturable), made when the optimizer was built, before the mode was on."""
    out = []
    for opt in [models.optimizers, getattr(models.critic, "optimizers", None)]:
        for o in opt or []:
            for state in o.state.values():
                step = state.get("step")
                if isinstance(step, torch.Tensor) and not o.defaults.get("fused"):
                    out.append(step)
    return out


@contextlib.contextmanager
def pretend_device(models) -> Iterator[PretendDevice]:
    """The learner's ``models`` on the pretend device while the block runs: their parameters,
    buffers and optimizer states are device tensors (all but AdamW's step counts)."""
    saved = models.device
    models.device = PRETEND
    try:
        with PretendDevice() as mode:
            mode._mark_host(optimizer_steps(models))  # if the optimizer already stepped
            yield mode
    finally:
        models.device = saved

"""Weights by handle: one bucket's flattened buffer passed to a generator on rank 0's own device as a
handle to the memory itself, in SGLang's ``/update_weights_from_tensor`` payload.

On a GPU the handle is a CUDA IPC handle (torch's ``reduce_tensor``): the engine maps rank 0's
buffer and copies it device to device, no host memory on the way (gloo, the only group that reaches
an engine on rank 0's own GPU, goes through the host: 1-1.5 s per version for Qwen3-0.6B, docs/gpu.md).
On the CPU the handle names a shared-memory file (torch's ``file_system`` sharing: the storage moved
into shared memory, a file name and the shared-memory manager's socket), so the same protocol, its
bucket layout, lifetimes, failures and checksums run in the CPU tests; only the CUDA handle itself
needs a GPU.

The payload is SGLang's (0.5.23, ``load_format: flattened_bucket``): base64 of a pickle of
``{"flattened_tensor": uint8 tensor, "metadata": [one record per tensor: name, shape, dtype,
start_idx, end_idx, numel]}``, one string per TP rank. The records are ``types.SimpleNamespace``
(SGLang reads them by attribute and its unpickler allows the type), so rank 0 needs no SGLang. A CUDA
handle names its device by UUID, as SGLang's patched reductions do (``patch_torch.py``), since the
two processes may number their GPUs differently.

A pickle is code: the engine unpickles a payload only from a loopback peer (the server refuses
others) and only with :class:`PayloadUnpickler`, which resolves an allow-list of torch's rebuild
functions and data types and nothing else; every field of the result is then checked
(:func:`load_payload`). Pure logic apart from torch's sharing calls: no HTTP here.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import pickle
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing import reductions

from asyncrl.weights import buckets

FLATTENED = "flattened_bucket"
"""The ``load_format`` of a payload holding one flattened buffer (what rank 0 sends)."""

_DEVICE_ARG = 6
"""Where torch's ``rebuild_cuda_tensor`` arguments hold the device (an index; here a UUID)."""

_CUDA_ARGS = 15
"""How many arguments torch's ``rebuild_cuda_tensor`` takes (``reduce_tensor``'s CUDA branch:
tensor class, size, stride, offset, storage class, dtype, device, handle, storage bytes, storage
offset, requires_grad, ref-counter handle and offset, event handle, event sync), as read from
torch 2.13's reductions.py; tests/weights/test_ipc_cuda_payload.py holds it against the installed
torch's signature, so the GPU host's torch is checked by running that test there."""

_STORAGE_ARG = 4
"""Where those arguments hold the storage class: ``type(tensor._typed_storage())``, which is
``torch.storage.TypedStorage`` (so a CUDA payload names that global, as the unpickler allows)."""


class PayloadError(ValueError):
    """A payload the engine refuses (the message names what is wrong)."""


# --------------------------------------------------------------------------------------------------
# Rank 0: handles
# --------------------------------------------------------------------------------------------------


class _HandlePickler(pickle.Pickler):
    """Pickles tensors as handles to their memory, never their bytes: CUDA tensors by torch's
    ``reduce_tensor`` (an IPC handle; the device as its UUID), CPU ones by a ``file_system``
    shared-memory name whatever the process's sharing strategy (``file_descriptor``, Linux's
    default, passes descriptors over a socket only a child of this process can use)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return _reduce_tensor(obj)
        if isinstance(obj, torch.UntypedStorage):
            return _reduce_cpu_storage(obj)
        return NotImplemented


def _reduce_tensor(t: torch.Tensor) -> tuple:
    if t.is_cuda:
        fn, args = reductions.reduce_tensor(t)
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        return fn, (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1 :])
    if t.device.type != "cpu" or t.requires_grad:
        raise ValueError(
            f"cannot pass a handle to a {t.device.type} tensor (grad {t.requires_grad})"
        )
    meta = (t.storage_offset(), t.size(), t.stride(), False)
    typed = (reductions.rebuild_typed_storage, (t.untyped_storage(), t.dtype))
    return reductions.rebuild_tensor, (torch.Tensor, _Reduced(typed), meta)


class _Reduced:
    """A reduction already made, pickled as it is."""

    def __init__(self, reduced: tuple):
        self.reduced = reduced

    def __reduce__(self) -> tuple:
        return self.reduced


def _reduce_cpu_storage(s: torch.UntypedStorage) -> tuple:
    """torch's ``reduce_storage`` under the ``file_system`` strategy: the storage moves into
    shared memory (once; later calls reuse it), and one reference is taken for the receiver, which
    its rebuild gives back."""
    manager, handle, size = s._share_filename_cpu_()
    s._shared_incref()
    return reductions.rebuild_storage_filename, (torch.UntypedStorage, manager, handle, size)


ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
"""torch's CUDA allocator settings (read once, at the first CUDA allocation; torch also reads
``PYTORCH_ALLOC_CONF`` when this is unset)."""


def alloc_conf_problem(environ: Mapping[str, str]) -> str | None:
    """Why rank 0's CUDA memory cannot be passed by handle under this environment's allocator
    settings, or None. ``expandable_segments:True`` maps memory with the driver's virtual memory
    API, whose blocks torch shares as file descriptors fetched from the learner's process
    (``pidfd_getfd``, which needs ptrace rights over it, and yama's ``ptrace_scope`` refuses
    them between unrelated processes) instead of ``cudaIpcGetMemHandle``; ``backend:
    cudaMallocAsync`` cannot share its blocks at all. Either fails every handle the engine opens."""
    name = ALLOC_CONF_ENV if environ.get(ALLOC_CONF_ENV) else "PYTORCH_ALLOC_CONF"
    conf = environ.get(name) or ""
    pairs = dict(
        (k.strip().lower(), v.strip().lower())
        for k, _, v in (item.partition(":") for item in conf.split(","))
    )
    if pairs.get("expandable_segments") == "true":
        why = "expandable segments are shared through the learner's file descriptors, not CUDA IPC"
    elif pairs.get("backend") == "cudamallocasync":
        why = "torch cannot share cudaMallocAsync's blocks"
    else:
        return None
    return (
        f"{name}={conf} breaks weights by CUDA IPC handle ({why}): unset it for the learner, "
        "or set weights.backend to gloo or nccl"
    )


def share(flat: torch.Tensor) -> None:
    """Put a CPU buffer in shared memory now (a copy, once; none for one made there:
    :func:`asyncrl.weights.buckets.flatten`'s ``shared``), so that building its handles later
    copies nothing. A no-op for CUDA buffers (their handles need no copy)."""
    if not flat.is_cuda:
        flat.untyped_storage()._share_filename_cpu_()


def payload(flat: torch.Tensor, meta: dict) -> str:
    """One bucket as SGLang's ``flattened_bucket`` payload for one rank: a handle to ``flat`` (the
    bucket's buffer, :func:`asyncrl.weights.buckets.flatten`'s layout) and a record per tensor of
    ``meta`` (:meth:`asyncrl.weights.buckets.Bucket.meta`). On CUDA, call it on the stream that
    wrote ``flat`` (the handle's event is recorded there, and the receiver waits on it)."""
    dtypes = [buckets.parse_dtype(d) for d in meta["dtypes"]]
    offsets, total = buckets.flat_layout(dtypes, meta["shapes"])
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"a flattened bucket is a 1-D uint8 tensor of {total} bytes")
    records = []
    for name, dt, shape, start in zip(meta["names"], dtypes, meta["shapes"], offsets, strict=True):
        n = math.prod(shape) * dt.itemsize
        records.append(
            types.SimpleNamespace(
                name=name,
                shape=torch.Size(shape),
                dtype=dt,
                start_idx=start,
                end_idx=start + n,
                numel=n,
            )
        )
    buf = io.BytesIO()
    _HandlePickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(
        {"flattened_tensor": flat, "metadata": records}
    )
    return base64.b64encode(buf.getvalue()).decode("ascii")


# --------------------------------------------------------------------------------------------------
# The engine: payloads
# --------------------------------------------------------------------------------------------------


class _Record:
    """SGLang's ``FlattenedTensorMetadata`` as a payload made by SGLang's own client names it:
    a plain record here (its fields are checked after loading)."""


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """torch's ``rebuild_cuda_tensor`` with the device given by UUID (or index), after checking
    the classes it will call: the payload chooses them, among the allowed globals."""
    if len(args) != _CUDA_ARGS:
        raise PayloadError(f"a CUDA handle has {_CUDA_ARGS} arguments, this one {len(args)}")
    if args[0] is not torch.Tensor or args[_STORAGE_ARG] not in (
        torch.storage.TypedStorage,
        torch.UntypedStorage,
    ):
        raise PayloadError("a CUDA handle rebuilds a torch.Tensor on a torch storage")
    device = args[_DEVICE_ARG]
    if isinstance(device, str):
        index = next(
            (
                i
                for i in range(torch.cuda.device_count())
                if str(torch.cuda.get_device_properties(i).uuid) == device
            ),
            None,
        )
        if index is None:
            raise PayloadError(f"the handle's GPU {device} is not visible to this engine")
        args = (*args[:_DEVICE_ARG], index, *args[_DEVICE_ARG + 1 :])
    return reductions.rebuild_cuda_tensor(*args)


_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}

_ALLOWED: dict[tuple[str, str], Any] = {
    ("builtins", "dict"): dict,
    ("builtins", "list"): list,
    ("builtins", "tuple"): tuple,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("copyreg", "__newobj__"): lambda cls, *a: cls.__new__(cls, *a),
    ("torch", "Size"): torch.Size,
    ("torch", "Tensor"): torch.Tensor,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,  # a CUDA handle's storage class
    ("torch.multiprocessing.reductions", "rebuild_tensor"): reductions.rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): reductions.rebuild_typed_storage,
    (
        "torch.multiprocessing.reductions",
        "rebuild_storage_filename",
    ): reductions.rebuild_storage_filename,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): _Record,
}


class PayloadUnpickler(pickle.Unpickler):
    """Resolves only :data:`_ALLOWED` (containers, torch's tensor and storage rebuilds, dtypes):
    any other global, and so any other code, is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _DTYPES:
            return getattr(torch, name)
        found = _ALLOWED.get((module, name))
        if found is None:
            raise PayloadError(f"payload refers to {module}.{name}, which is not allowed")
        return found


@dataclass
class Loaded:
    """A payload as loaded: the handle's tensor (rank 0's memory, mapped) and where each named
    tensor lies in it."""

    flat: torch.Tensor
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[list[int]]
    starts: list[int]


def load_payload(data: Any, load_format: str | None) -> Loaded:
    """One rank's payload (base64 text, as SGLang's HTTP API carries it) as a :class:`Loaded`,
    every field checked: :class:`PayloadError` naming the first that is wrong. ``load_format``:
    ``flattened_bucket`` (one buffer) or None (SGLang's list of ``(name, tensor)`` pairs, each
    sent as a buffer of its own: loaded as one record per pair)."""
    if not isinstance(data, str):
        raise PayloadError("`serialized_named_tensors` items must be base64 strings")
    try:
        raw = base64.b64decode(data, validate=True)
        obj = PayloadUnpickler(io.BytesIO(raw)).load()
    except PayloadError:
        raise
    except (binascii.Error, pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
        raise PayloadError(f"`serialized_named_tensors`: not a payload ({e})") from None
    except RuntimeError as e:  # torch could not map the handle (gone, or another host's)
        raise PayloadError(f"`serialized_named_tensors`: cannot open the handle ({e})") from None
    if load_format == FLATTENED:
        return _flattened(obj)
    if load_format is None:
        return _listed(obj)
    raise PayloadError(f"load_format {load_format!r} is not supported (None or {FLATTENED!r})")


def _flattened(obj: Any) -> Loaded:
    if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
        raise PayloadError("a flattened_bucket payload is {flattened_tensor, metadata}")
    flat, records = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise PayloadError("`flattened_tensor` must be a 1-D uint8 tensor")
    if not isinstance(records, list) or not records:
        raise PayloadError("`metadata` must be a non-empty list")
    out = Loaded(flat=flat, names=[], dtypes=[], shapes=[], starts=[])
    for i, r in enumerate(records):
        name, shape, dtype = (getattr(r, k, None) for k in ("name", "shape", "dtype"))
        start, end = getattr(r, "start_idx", None), getattr(r, "end_idx", None)
        if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
            raise PayloadError(f"`metadata`[{i}]: name must be a string, dtype a torch dtype")
        if not isinstance(shape, list | tuple) or not all(
            isinstance(s, int) and s >= 0 for s in shape
        ):
            raise PayloadError(f"`metadata`[{i}] ({name}): shape must be non-negative ints")
        if not isinstance(start, int) or not isinstance(end, int):
            raise PayloadError(f"`metadata`[{i}] ({name}): start_idx, end_idx must be ints")
        n = math.prod(shape) * dtype.itemsize
        if start < 0 or start % dtype.itemsize or end - start != n or end > flat.numel():
            raise PayloadError(
                f"`metadata`[{i}] ({name}): bytes [{start}, {end}) do not hold {list(shape)} "
                f"{buckets.dtype_name(dtype)} inside a buffer of {flat.numel()} bytes"
            )
        out.names.append(name)
        out.dtypes.append(dtype)
        out.shapes.append(list(shape))
        out.starts.append(start)
    return out


def _listed(obj: Any) -> Loaded:
    """SGLang's unflattened form: each tensor its own handle, gathered here into one buffer (a
    copy on the engine's side, as each must be copied out anyway)."""
    if not isinstance(obj, list) or not obj:
        raise PayloadError("a payload without load_format is a non-empty list of (name, tensor)")
    named = []
    for i, pair in enumerate(obj):
        if not (
            isinstance(pair, tuple | list)
            and len(pair) == 2
            and isinstance(pair[0], str)
            and isinstance(pair[1], torch.Tensor)
        ):
            raise PayloadError(f"item {i}: expected (name, tensor)")
        named.append((pair[0], pair[1]))
    tensors = [t for _, t in named]
    flat = buckets.flatten(tensors)
    offsets, _ = buckets.flat_layout([t.dtype for t in tensors], [list(t.shape) for t in tensors])
    return Loaded(
        flat=flat,
        names=[n for n, _ in named],
        dtypes=[t.dtype for t in tensors],
        shapes=[list(t.shape) for t in tensors],
        starts=offsets,
    )


def copy_out(loaded: Loaded, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of ``loaded`` copied out of rank 0's memory into one new buffer on
    ``device`` (device to device on a GPU), the copy finished before this returns (the handle may
    be closed, and rank 0's buffer freed, as soon as it has). Views of that buffer, by name."""
    src = loaded.flat
    end = max(
        (
            s + math.prod(sh) * dt.itemsize
            for s, sh, dt in zip(loaded.starts, loaded.shapes, loaded.dtypes, strict=True)
        ),
        default=0,
    )
    dst = torch.empty(end, dtype=torch.uint8, device=device)
    dst.copy_(src[:end], non_blocking=src.is_cuda and dst.is_cuda)
    if dst.is_cuda or src.is_cuda:
        torch.cuda.current_stream(dst.device if dst.is_cuda else src.device).synchronize()
    out = []
    for name, dt, shape, start in zip(
        loaded.names, loaded.dtypes, loaded.shapes, loaded.starts, strict=True
    ):
        n = math.prod(shape) * dt.itemsize
        out.append((name, dst[start : start + n].view(dt).reshape(shape)))
    return out

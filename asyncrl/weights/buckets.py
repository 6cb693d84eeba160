"""Weight buckets in SGLang's layouts, and the checksum both sides compute.

``flattened_bucket``: one uint8 tensor holding the raw bytes of every tensor in ``names`` order, each
starting at a multiple of its dtype's item size (SGLang's ``FlattenedTensorBucket``). ``list``: one
broadcast per tensor. Pure logic: no process groups or HTTP here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, the form SGLang resolves with ``getattr(torch, s)``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


@dataclass
class Bucket:
    """Tensors sent together in one update call."""

    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def meta(self) -> dict:
        """The ``names``/``dtypes``/``shapes`` fields of ``/update_weights_from_distributed``."""
        return {
            "names": list(self.names),
            "dtypes": [dtype_name(t.dtype) for t in self.tensors],
            "shapes": [list(t.shape) for t in self.tensors],
        }


def make_buckets(
    named: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    nbytes: Callable[[torch.Tensor], int] | None = None,
) -> Iterator[Bucket]:
    """Group tensors in order into buckets of at most ``bucket_bytes`` (a larger tensor goes alone).
    ``nbytes``: a tensor's size as it will be sent (after a cast to the wire dtype); its own size
    if None."""
    b, size = Bucket(), 0
    for name, t in named:
        s = t.numel() * t.element_size() if nbytes is None else nbytes(t)
        if b.names and size + s > bucket_bytes:
            yield b
            b, size = Bucket(), 0
        b.names.append(name)
        b.tensors.append(t)
        size += s
    if b.names:
        yield b


def flat_layout(dtypes: list[torch.dtype], shapes: list[list[int]]) -> tuple[list[int], int]:
    """Byte offsets of each tensor in a flattened bucket, and its total size."""
    offsets, pos = [], 0
    for dt, shape in zip(dtypes, shapes, strict=True):
        item = torch.empty((), dtype=dt).element_size()
        pos = (pos + item - 1) // item * item
        offsets.append(pos)
        n = 1
        for s in shape:
            n *= s
        pos += n * item
    return offsets, pos


def flatten(tensors: list[torch.Tensor], *, shared: bool = False) -> torch.Tensor:
    """Pack tensors into one uint8 tensor in SGLang's flattened-bucket layout, on their device (an
    NCCL broadcast cannot send a CPU buffer). ``shared``: a CPU buffer is made in shared memory
    (torch's ``file_system`` sharing), where a handle can name it without a copy
    (asyncrl.weights.ipc); a CUDA buffer needs nothing more."""
    offsets, total = flat_layout([t.dtype for t in tensors], [list(t.shape) for t in tensors])
    device = tensors[0].device if tensors else None
    if shared and (device is None or device.type == "cpu"):
        storage = torch.UntypedStorage._new_using_filename_cpu(total)
        flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    else:
        flat = torch.empty(total, dtype=torch.uint8, device=device)  # only the gaps get zeroed
    pos = 0
    for off, t in zip(offsets, tensors, strict=True):
        flat[pos:off] = 0
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        flat[off : off + raw.numel()] = raw
        pos = off + raw.numel()
    return flat


def unflatten(
    flat: torch.Tensor, dtypes: list[torch.dtype], shapes: list[list[int]]
) -> list[torch.Tensor]:
    """Views of each tensor inside a flattened bucket (the inverse of :func:`flatten`)."""
    offsets, total = flat_layout(dtypes, shapes)
    if flat.numel() != total:
        raise ValueError(f"flattened bucket has {flat.numel()} bytes, the layout needs {total}")
    out = []
    for off, dt, shape in zip(offsets, dtypes, shapes, strict=True):
        item = torch.empty((), dtype=dt).element_size()
        n = 1
        for s in shape:
            n *= s
        out.append(flat[off : off + n * item].view(dt).reshape(shape))
    return out


CHECKSUM_CHUNK_BYTES = 64 * 2**20
"""Bytes of hashed values gathered on their device before one copy to the host (:func:`checksum`)."""


def _hashed_values(t: torch.Tensor, sample: int) -> torch.Tensor:
    """The bytes :func:`checksum` hashes for ``t``, as a flat uint8 tensor on ``t``'s device:
    floating values as float32, ``sample`` > 0 keeping that many evenly spaced values at most."""
    flat = t.detach().reshape(-1)
    if sample and flat.numel() > sample:
        flat = flat[:: -(-flat.numel() // sample)]  # ceil stride: at most `sample` values
    flat = flat.float() if flat.is_floating_point() else flat
    return flat.contiguous().view(torch.uint8)


def checksum(
    named: Iterable[tuple[str, torch.Tensor]],
    *,
    sample: int = 0,
    chunk_bytes: int = CHECKSUM_CHUNK_BYTES,
) -> str:
    """SHA-256 over names, shapes and values in sorted name order: equal on both sides iff the
    weights are equal. Floating values are hashed as float32, so bfloat16 sent into a float32 engine
    (which holds the same values) hashes alike. ``sample`` > 0 hashes only that many evenly spaced
    values of each tensor: still catches a wrong version or tensor, at a cost independent of size
    (a full SHA-256 of an 8B model is ~16 GB read on the host per version).

    Values go to the host a chunk at a time (``chunk_bytes`` of hashed values gathered on their
    device, then one ``.cpu()``), not tensor by tensor: on a GPU each copy waits for the stream, and
    a model has hundreds of tensors. On the host the gathering is one memcpy, and the same code
    runs (it is what the CPU tests cover). The bytes hashed, and so the value, are those of hashing
    each tensor alone."""
    h = hashlib.sha256()
    pending: list[tuple[str, torch.Size, torch.Tensor]] = []  # values not yet on the host
    size = 0

    def update(name: str, shape: torch.Size, values: object) -> None:
        h.update(name.encode())
        h.update(str(list(shape)).encode())
        h.update(values)  # type: ignore[arg-type]  # a uint8 numpy array or memoryview

    def flush() -> None:
        nonlocal size
        if not pending:
            return
        values = [v for _, _, v in pending]
        host = (torch.cat(values) if len(values) > 1 else values[0]).cpu()  # the one copy
        view, pos = memoryview(host.numpy()), 0
        for name, shape, v in pending:
            update(name, shape, view[pos : pos + v.numel()])
            pos += v.numel()
        pending.clear()
        size = 0

    for name, t in sorted(named, key=lambda x: x[0]):
        values = _hashed_values(t, sample)
        if pending and (
            pending[0][2].device != values.device or size + values.numel() > chunk_bytes
        ):
            flush()
        pending.append((name, t.shape, values))
        size += values.numel()
    flush()
    return h.hexdigest()

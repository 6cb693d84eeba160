"""A CUDA handle's payload, as torch shapes it, reaches the built-in engine's rebuild intact.

No CUDA here, so the payload is made by torch's own ``reduce_tensor`` (the code SGLang's client and
``asyncrl.weights.ipc.payload`` call for a CUDA tensor) on a CPU tensor whose storage says it is
on CUDA: the stand-in storage below answers ``device`` and ``_share_cuda_`` (the CUDA driver's
handle, event and ref-counter bytes), everything else is torch's. torch's code thus picks the
globals (``rebuild_cuda_tensor``, ``torch.Tensor``, ``torch.storage.TypedStorage``, the dtype) and
the argument positions, from the installed torch's source (2.13 here; the GPU host's 2.11 was not
read, and this test is how to check it there). The payload is pickled by torch's ``ForkingPickler``, as a
``multiprocessing`` queue (and SGLang's ``MultiprocessingSerializer``) would.

On the engine's side, only torch's ``rebuild_cuda_tensor`` itself is replaced (it opens the CUDA
handle): the test records what it is handed and returns a CPU buffer, so the rest of
:func:`asyncrl.weights.ipc.load_payload` runs as it would on a GPU.
"""

from __future__ import annotations

import base64
import inspect
import types
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from torch.multiprocessing import reductions

from asyncrl.weights import buckets, ipc

HANDLE = b"\x01" * 64  # a cudaIpcMemHandle_t is 64 bytes
EVENT = b"\x02" * 64
REF_COUNTER = b"/torch_ref_counter_0"
PARAMS = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
STORAGE = PARAMS.index("storage_cls")


class _CudaLookingStorage:
    """The one fake: a CPU storage that reports CUDA and hands out CUDA-shaped share data, so
    torch's ``reduce_tensor`` takes its CUDA branch on a machine without CUDA."""

    def __init__(self, real: torch.UntypedStorage):
        self._real = real
        self.device = torch.device("cuda", 0)

    def _share_cuda_(self) -> tuple:
        # (device, handle, storage bytes, storage offset in the allocation, ref-counter handle,
        # ref-counter offset, event handle, event sync required): torch's Storage._share_cuda_
        return (0, HANDLE, self._real.nbytes(), 512, REF_COUNTER, 3, EVENT, True)

    def __getattr__(self, name):
        return getattr(self._real, name)


def _cuda_shaped(flat: torch.Tensor) -> torch.Tensor:
    """``flat``, whose ``_typed_storage()`` is a real ``TypedStorage`` over the stand-in."""
    typed = flat._typed_storage()
    typed._untyped_storage = _CudaLookingStorage(typed._untyped_storage)
    flat._typed_storage = lambda: typed  # instance attribute: only this tensor
    return flat


def _records(meta: dict) -> list[types.SimpleNamespace]:
    """The payload's records, taken from :func:`ipc.payload`'s own for the same bucket."""
    import pickle

    flat = buckets.flatten(
        [
            torch.zeros(s, dtype=buckets.parse_dtype(d))
            for s, d in zip(meta["shapes"], meta["dtypes"], strict=True)
        ]
    )
    ipc.share(flat)
    return pickle.loads(base64.b64decode(ipc.payload(flat, meta)))["metadata"]


@pytest.fixture
def bucket():
    ts = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16)]
    meta = buckets.Bucket(names=["w", "b"], tensors=ts).meta()
    return buckets.flatten(ts), meta, ts


def test_a_cuda_handle_as_torch_pickles_it_is_accepted_and_rebuilt_with_its_arguments(
    bucket, monkeypatch
):
    flat, meta, ts = bucket
    sent = _cuda_shaped(flat.clone())
    fn, args = reductions.reduce_tensor(sent)
    try:
        # torch's CUDA branch, read from its source: what the engine's unpickler must allow
        assert fn is reductions.rebuild_cuda_tensor
        assert len(args) == len(PARAMS) == 15
        assert PARAMS.index("storage_device") == ipc._DEVICE_ARG and args[ipc._DEVICE_ARG] == 0
        assert args[0] is torch.Tensor and args[STORAGE] is torch.storage.TypedStorage
        obj = {"flattened_tensor": sent, "metadata": _records(meta)}
        data = base64.b64encode(bytes(ForkingPickler.dumps(obj))).decode()
    finally:
        reductions.shared_cache.pop(HANDLE, None)  # reduce_tensor filed the made-up handle

    got = []

    def rebuild(*a):  # torch's rebuild opens the CUDA handle: no CUDA here
        got.append(a)
        return flat

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    loaded = ipc.load_payload(data, ipc.FLATTENED)
    assert got == [args]  # every argument, in torch's positions, as torch made it
    assert loaded.names == ["w", "b"] and loaded.shapes == [[2, 3], [4]]
    for (name, t), want in zip(ipc.copy_out(loaded, torch.device("cpu")), ts, strict=True):
        assert torch.equal(t, want), name


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({0: dict}, "rebuilds a torch.Tensor on a torch storage"),
        ({STORAGE: types.SimpleNamespace}, "rebuilds a torch.Tensor on a torch storage"),
        (None, "a CUDA handle has 15 arguments, this one 14"),
    ],
    ids=["tensor-class", "storage-class", "arity"],
)
def test_a_cuda_handle_naming_other_classes_is_refused(bucket, monkeypatch, change, words):
    """The allowed globals include containers; a payload that puts one where torch's rebuild will
    call a storage or tensor class is refused with a line, not an AttributeError in the engine."""
    flat, meta, _ = bucket
    sent = _cuda_shaped(flat.clone())
    fn, args = reductions.reduce_tensor(sent)
    reductions.shared_cache.pop(HANDLE, None)
    args = args[:-1] if change is None else tuple(change.get(i, a) for i, a in enumerate(args))

    class _Handle:
        def __reduce__(self):
            return fn, args

    obj = {"flattened_tensor": _Handle(), "metadata": _records(meta)}
    data = base64.b64encode(bytes(ForkingPickler.dumps(obj))).decode()
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: pytest.fail("rebuilt"))
    with pytest.raises(ipc.PayloadError, match=words):
        ipc.load_payload(data, ipc.FLATTENED)


def test_the_learner_refuses_ipc_under_allocator_settings_that_break_handles(monkeypatch):
    """``weights.backend: ipc`` with expandable segments: one line naming the field, before the
    model is built. ``torch.cuda.is_available`` is made to answer True (no CUDA here): only on a
    GPU does the allocator share rank 0's memory; on the CPU handles are shared-memory files."""
    from asyncrl import recipe as recipe_mod
    from asyncrl.learner.main import refuse_ipc_allocator

    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    ipc_recipe = recipe_mod.from_dict(
        {"model": {"path": "m"}, "weights": {"backend": "ipc"}}, check_files=False
    )
    refuse_ipc_allocator(ipc_recipe, env)  # no GPU: nothing to refuse
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(recipe_mod.RecipeError) as e:
        refuse_ipc_allocator(ipc_recipe, env)
    assert str(e.value).startswith("weights.backend: PYTORCH_CUDA_ALLOC_CONF=expandable_segments")
    refuse_ipc_allocator(ipc_recipe, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"})
    gloo = recipe_mod.from_dict(
        {"model": {"path": "m"}, "weights": {"backend": "gloo"}}, check_files=False
    )
    refuse_ipc_allocator(gloo, env)  # not by handle: the setting is the user's
    assert ipc.alloc_conf_problem({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"})
    assert ipc.alloc_conf_problem({}) is None

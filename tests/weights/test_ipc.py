"""Weights by handle (``weights.backend: ipc``; ``auto`` on rank 0's own GPU): the protocol on the CPU,
where a handle names a shared-memory file instead of CUDA memory. Real engine processes, real HTTP,
real gloo groups for the comparison; a real fault (SIGSTOP) for the failures. Only the CUDA handle
itself needs a GPU (tools/gpu/check.py's weights step)."""

from __future__ import annotations

import base64
import gc
import os
import pickle
import signal
import threading
import weakref

import httpx
import pytest
import torch
from safetensors.torch import load_file

from asyncrl import wire
from asyncrl.engine import start_engine_process
from asyncrl.engine.server import _same_host
from asyncrl.recipe import WeightsConfig
from asyncrl.weights import buckets, ipc
from asyncrl.weights.broadcaster import WeightBroadcaster
from asyncrl.weights.snapshot import drop_tied

# ---- the payload, in this process ----------------------------------------------------------------


def _bucket(seed: int = 0) -> tuple[torch.Tensor, dict, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ts = [
        torch.randn(3, 5, generator=g),
        torch.arange(7, dtype=torch.int64),
        torch.randn(9, generator=g).bfloat16(),
        torch.randn(0, 4),
    ]
    flat = buckets.flatten(ts)
    meta = buckets.Bucket(names=["a", "b", "c", "d"], tensors=ts).meta()
    return flat, meta, ts


def test_a_bucket_made_in_shared_memory_is_shared_without_a_copy():
    _, _, ts = _bucket()
    flat = buckets.flatten(ts, shared=True)
    ptr = flat.data_ptr()
    assert flat.is_shared()
    ipc.share(flat)
    assert flat.data_ptr() == ptr
    assert torch.equal(flat, buckets.flatten(ts))


def test_payload_round_trip_keeps_layout_and_bytes():
    flat, meta, ts = _bucket()
    ipc.share(flat)
    loaded = ipc.load_payload(ipc.payload(flat, meta), ipc.FLATTENED)
    assert loaded.names == meta["names"] and loaded.shapes == meta["shapes"]
    assert loaded.starts == buckets.flat_layout(loaded.dtypes, loaded.shapes)[0]
    out = ipc.copy_out(loaded, torch.device("cpu"))
    for (name, got), want in zip(out, ts, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    # a copy: rank 0's buffer may change or go once the answer is in
    flat.zero_()
    assert torch.equal(out[0][1], ts[0])


def _pickled(obj) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


@pytest.mark.parametrize(
    ("data", "fmt", "words"),
    [
        (_pickled(_Evil()), ipc.FLATTENED, "posix.system, which is not allowed"),
        ("not base64!", ipc.FLATTENED, "not a payload"),
        (_pickled({"flattened_tensor": 1, "metadata": []}), ipc.FLATTENED, "`flattened_tensor`"),
        (_pickled([("a", 3)]), None, "item 0: expected (name, tensor)"),
        (_pickled({}), "direct", "load_format 'direct' is not supported"),
    ],
    ids=["unlisted-global", "base64", "flattened-tensor", "list-item", "load-format"],
)
def test_payload_refusals_name_the_field(data, fmt, words):
    with pytest.raises(ipc.PayloadError) as e:
        ipc.load_payload(data, fmt)
    assert words in str(e.value)


def test_metadata_outside_the_buffer_is_refused():
    flat, meta, _ = _bucket()
    meta["shapes"][0] = [3, 5]
    p = ipc.payload(flat, meta)
    obj = pickle.loads(base64.b64decode(p))  # this process: a trusted round trip of our own
    obj["metadata"][1].end_idx += 8
    with pytest.raises(ipc.PayloadError, match=r"`metadata`\[1\] \(b\): bytes"):
        ipc.load_payload(base64.b64encode(ipc_pickle(obj)).decode(), ipc.FLATTENED)


def ipc_pickle(obj) -> bytes:
    import io

    buf = io.BytesIO()
    ipc._HandlePickler(buf).dump(obj)
    return buf.getvalue()


def test_only_peers_on_this_host_may_send_handles():
    local = "10.0.0.1"  # the address the connection reached the engine at
    assert _same_host("127.0.0.1", local) and _same_host("::1", local)
    assert _same_host("::ffff:127.0.0.1", local) and _same_host("10.0.0.1", local)
    assert not _same_host("10.0.0.2", local) and not _same_host("::ffff:10.0.0.2", local)
    assert not _same_host("not an address", "not an address")


# ---- real engines ----------------------------------------------------------------------------------


def _weights(model_dir) -> dict[str, torch.Tensor]:
    return {
        k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()
    }


def _moved(named: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
        for k, v in named.items()
    }


def _checksum(url: str) -> str:
    r = httpx.post(url + "/weights_checker", json={"action": "checksum"}, timeout=60)
    return r.json()["checksum"]


def _version(url: str) -> str:
    return httpx.get(url + "/model_info", timeout=30).json()["weight_version"]


@pytest.fixture(scope="module")
def engines(tiny_qwen3):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        eps = list(
            pool.map(
                lambda _: start_engine_process(tiny_qwen3, weight_version="0", timeout_s=120),
                range(2),
            )
        )
    yield eps
    for ep in eps:
        ep.stop()


def test_update_by_handle_needs_a_session(engines):
    flat, meta, _ = _bucket()
    ipc.share(flat)
    body = {"serialized_named_tensors": [ipc.payload(flat, meta)], "load_format": ipc.FLATTENED}
    r = httpx.post(engines[0].url + "/update_weights_from_tensor", json=body, timeout=30)
    assert r.status_code == 400 and r.json() == {
        "success": False,
        "message": "update_weights_from_tensor must run between begin_weight_update() and "
        "end_weight_update()",
    }
    r = httpx.post(engines[0].url + "/update_weights_from_tensor", json={}, timeout=30)
    assert r.status_code == 400 and "`serialized_named_tensors`" in r.json()["message"]


@pytest.mark.slow
def test_ipc_and_gloo_give_bitwise_equal_weights(engines, tiny_qwen3):
    """The same versions to one engine by handle and to the other over a gloo group, several buckets
    each, in both layouts: both hold exactly what was sent, byte for byte (a full checksum)."""
    by_handle, by_gloo = engines
    named = _weights(tiny_qwen3)
    kw = dict(timeout_s=30.0, bucket_mb=0.05, overlap=False, verify="full")
    for fmt in ("flattened_bucket", "list"):
        bi = WeightBroadcaster(WeightsConfig(backend="ipc", load_format=fmt, **kw), rank=0)
        bg = WeightBroadcaster(WeightsConfig(backend="gloo", load_format=fmt, **kw), rank=0)
        try:
            bi.add_generator(wire.GeneratorInfo(url=by_handle.url, kind="builtin"))
            bg.add_generator(wire.GeneratorInfo(url=by_gloo.url, kind="builtin"))
            for v in (1, 2):
                named = _moved(named, v)
                bi.publish(v, named)
                bg.publish(v, named)
                ri, rg = bi.reports[-1], bg.reports[-1]
                assert not ri.error and not rg.error, (ri, rg)
                assert ri.updated == [by_handle.url] and rg.updated == [by_gloo.url]
                assert ri.reported == {by_handle.url: str(v)}
                assert ri.checksum_ok == {by_handle.url: True}, ri
                assert rg.checksum_ok == {by_gloo.url: True}, rg
                want = buckets.checksum(drop_tied(named).items())
                assert _checksum(by_handle.url) == _checksum(by_gloo.url) == want
                n = len(bi.sync.pinned)
                assert n == 0 and ri.group_builds == 0 and rg.group_builds == (v == 1)
            assert bi.groups.backend(by_handle.url) == "ipc"
            assert bg.groups.backend(by_gloo.url) == "gloo"
            assert ri.nbytes > 4 * kw["bucket_mb"] * 2**20  # several buckets
        finally:
            bi.close()
            bg.close()


@pytest.mark.slow
def test_a_version_cut_mid_bucket_is_dropped_whole(engines, tiny_qwen3):
    """SIGSTOP the engine after the first of several buckets of version 2 (a real hang): its call
    gets no answer, the version is dropped for it and the engine keeps serving version 1 exactly.
    The buffer it may still be copying stays rank 0's (pinned) after the version's snapshot is
    gone, until the engine opens a new session; version 3 then arrives whole."""
    ep = engines[0]
    named = _weights(tiny_qwen3)
    stopped = threading.Event()

    def on_event(name, f):
        if name == "bucket_sent" and f["version"] == 2 and f["index"] == 0:
            os.kill(ep.pid, signal.SIGSTOP)
            stopped.set()

    cfg = WeightsConfig(
        backend="ipc", timeout_s=3.0, bucket_mb=0.05, overlap=False, load_format="flattened_bucket"
    )
    b = WeightBroadcaster(cfg, rank=0, on_event=on_event)
    try:
        b.add_generator(wire.GeneratorInfo(url=ep.url, kind="builtin"))
        v1 = _moved(named, 1)
        b.publish(1, v1)
        assert b.reports[-1].updated == [ep.url] and not b.reports[-1].error
        try:
            b.publish(2, _moved(v1, 2))
            r = b.reports[-1]
            assert stopped.is_set() and r.dropped == [ep.url] and not r.updated, r
            held = [weakref.ref(t) for t in b.sync.pinned[ep.url]]
            assert len(held) == 1  # the second bucket's buffer, whose answer never came
            gc.collect()
            assert all(h() is not None for h in held)  # its version is done; the buffer is not
        finally:
            os.kill(ep.pid, signal.SIGCONT)
        # the engine finishes its copy into a session that is never ended: still version 1
        assert _version(ep.url) == "1"
        assert _checksum(ep.url) == buckets.checksum(drop_tied(v1).items())
        v3 = _moved(v1, 3)
        b.publish(3, v3)
        r = b.reports[-1]
        assert r.updated == [ep.url] and r.reported == {ep.url: "3"}, r
        assert r.checksum_ok == {ep.url: True}
        assert _checksum(ep.url) == buckets.checksum(drop_tied(v3).items())
        assert ep.url not in b.sync.pinned
        gc.collect()
        assert all(h() is None for h in held)  # released once the engine opened a new session
    finally:
        b.close()

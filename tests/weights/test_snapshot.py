"""Pure logic of the broadcaster: snapshots (buckets as sent), tied weights, finding the latest export."""

from __future__ import annotations

import json

import pytest
import torch

from asyncrl.weights import buckets
from asyncrl.weights.exports import VERSION_FILE, latest_export
from asyncrl.weights.snapshot import drop_tied, make_snapshot


def _named(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(50, 16, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(16, generator=g),
        "model.norm.weight": torch.randn(16, generator=g),
        "lm_head.weight": torch.randn(50, 16, generator=g),
        "counter": torch.arange(3, dtype=torch.int64),  # a non-float tensor keeps its dtype
    }


@pytest.mark.parametrize("load_format", ["flattened_bucket", "list"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_snapshot_holds_cast_copies_in_order(load_format, dtype):
    named = _named()
    snap = make_snapshot(3, named, dtype=dtype, bucket_bytes=2048, load_format=load_format)
    got = dict(snap.named())
    assert list(got) == list(named)  # order kept: the receiver broadcasts in names order
    for n, t in named.items():
        want = t.to(dtype) if t.is_floating_point() else t
        assert got[n].dtype == want.dtype and torch.equal(got[n], want)
    # every bucket fits, unless a single tensor is larger than a bucket
    for b in snap.buckets:
        assert b.nbytes <= 2048 or len(b.names) == 1
    assert len(snap.buckets) > 1
    assert snap.nbytes == sum(b.nbytes for b in snap.buckets)
    # what goes on the wire decodes to the same tensors
    for b, payload in zip(snap.buckets, snap.payloads, strict=True):
        meta = b.meta()
        if load_format == "flattened_bucket":
            assert len(payload) == 1 and payload[0].dtype == torch.uint8
            dts = [buckets.parse_dtype(d) for d in meta["dtypes"]]
            sent = buckets.unflatten(payload[0], dts, meta["shapes"])
        else:
            sent = payload
        for n, t in zip(meta["names"], sent, strict=True):
            assert torch.equal(t, got[n])
    # the snapshot is a copy: the learner may step right after publish() returns
    before = buckets.checksum(snap.named())
    for t in named.values():
        t.add_(1)
    assert buckets.checksum(snap.named()) == before


def test_tied_lm_head_sent_once():
    named = _named()
    named["lm_head.weight"] = named["model.embed_tokens.weight"]  # same storage: tied
    assert "lm_head.weight" not in drop_tied(named)
    named["lm_head.weight"] = named["model.embed_tokens.weight"].clone()  # equal copies (gathered)
    assert "lm_head.weight" not in drop_tied(named)
    named["lm_head.weight"] = named["model.embed_tokens.weight"] + 1  # untied
    assert "lm_head.weight" in drop_tied(named)


def test_latest_export(tmp_path):
    assert latest_export(tmp_path / "missing") is None
    assert latest_export(tmp_path) is None
    for name, version in [("step-3", None), ("step-12", None), ("final", 20), ("step-99", None)]:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text("{}")
        if name != "step-99":  # no weights: not a checkpoint
            (d / "model.safetensors").write_bytes(b"")
        if version is not None:
            (d / VERSION_FILE).write_text(json.dumps({"version": version}))
    path, v = latest_export(tmp_path)
    assert (path.name, v) == ("final", 20)
    # a learner resumed at version 19 owns the exports up to 19 only
    assert latest_export(tmp_path, at_most=19)[0].name == "step-12"
    assert latest_export(tmp_path, at_most=2) is None


def test_membership_follows_registrations():
    """A worker's registration replaces its previous list; removal and re-adding take effect."""
    from asyncrl.recipe import WeightsConfig
    from asyncrl.weights.broadcaster import WeightBroadcaster
    from asyncrl.wire import GeneratorInfo

    with WeightBroadcaster(WeightsConfig(), rank=0) as b:
        b.on_register("w1", [GeneratorInfo(url="http://a:1"), GeneratorInfo(url="http://b:2/")])
        b.on_register("w2", [GeneratorInfo(url="http://c:3", kind="builtin")])
        assert b.generators() == {u: "joining" for u in ("http://a:1", "http://b:2", "http://c:3")}
        b.on_register("w1", [GeneratorInfo(url="http://b:2")])  # a:1 is gone from w1's list
        assert set(b.generators()) == {"http://b:2", "http://c:3"}
        b.remove_generator("http://c:3/")
        assert set(b.generators()) == {"http://b:2"}
        b.add_generator(GeneratorInfo(url="http://c:3"))
        assert set(b.generators()) == {"http://b:2", "http://c:3"}


def test_other_ranks_do_not_send():
    from asyncrl.recipe import WeightsConfig
    from asyncrl.weights.broadcaster import WeightBroadcaster

    with WeightBroadcaster(WeightsConfig(), rank=1) as b:
        b.publish(1, _named())
        assert b.wait(0) and b.reports == []


def test_flatten_aligns_each_tensor_and_zeroes_the_gaps():
    ts = [
        torch.tensor([1, 2, 3], dtype=torch.int8),
        torch.tensor([1.5], dtype=torch.float32),
        torch.tensor([-7], dtype=torch.int64),
    ]
    dts, shapes = [t.dtype for t in ts], [list(t.shape) for t in ts]
    assert buckets.flat_layout(dts, shapes) == ([0, 4, 8], 16)
    flat = buckets.flatten(ts)
    assert flat.numel() == 16 and flat[3].item() == 0  # padding is deterministic
    for a, b in zip(buckets.unflatten(flat, dts, shapes), ts, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_checksum_sees_values_not_the_wire_dtype():
    """bfloat16 on the wire into a float32 engine holds the same values: the checksums agree, full
    and sampled. A changed tensor (another version) changes both; one changed value outside the
    sample changes only the full one (sampled trades that for a cost independent of size)."""
    g = torch.Generator().manual_seed(0)
    sent = {"a": torch.randn(300, 50, generator=g).bfloat16(), "b": torch.randn(7).bfloat16()}
    held = {k: v.float() for k, v in sent.items()}  # the engine's float32 copy of what arrived
    for sample in (0, 16):
        assert buckets.checksum(sent.items(), sample=sample) == buckets.checksum(
            held.items(), sample=sample
        )
    other = {**held, "a": held["a"] * 1.01}
    assert buckets.checksum(other.items(), sample=16) != buckets.checksum(held.items(), sample=16)
    poked = {k: v.clone() for k, v in held.items()}
    poked["a"].view(-1)[1] += 1.0  # index 1: not among the 16 sampled (stride 938)
    assert buckets.checksum(poked.items()) != buckets.checksum(held.items())
    assert buckets.checksum(poked.items(), sample=16) == buckets.checksum(held.items(), sample=16)


def _checksum_tensor_by_tensor(named, *, sample: int = 0) -> str:
    """The checksum as it was computed before it was batched: one host copy per tensor. Kept here
    as the reference the batched one must equal (the other side's engines may run either)."""
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda x: x[0]):
        t = t.detach()
        h.update(name.encode())
        h.update(str(list(t.shape)).encode())
        flat = t.reshape(-1)
        if sample and flat.numel() > sample:
            flat = flat[:: -(-flat.numel() // sample)]
        flat = flat.float() if flat.is_floating_point() else flat
        h.update(flat.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("sample", [0, 7])
@pytest.mark.parametrize("chunk_bytes", [1, 100, buckets.CHECKSUM_CHUNK_BYTES])
def test_batched_checksum_equals_the_tensor_by_tensor_one(sample, chunk_bytes):
    """Random tensors of several dtypes and shapes (scalar, empty, strided), in an order that is not
    the sorted one: the batched checksum hashes the same bytes, whatever the chunking (a chunk per
    tensor, several tensors a chunk, all in one)."""
    g = torch.Generator().manual_seed(11)
    named = {
        "z.bf16": torch.randn(33, 5, generator=g).bfloat16(),
        "a.f32": torch.randn(40, generator=g),
        "m.f16": torch.randn(3, 7, generator=g).half(),
        "b.f64": torch.randn(2, 3, 4, generator=g).double(),
        "k.i64": torch.randint(-9, 9, (17,), generator=g),
        "c.i32": torch.randint(-9, 9, (4, 4), generator=g).int(),
        "q.u8": torch.randint(0, 255, (9,), generator=g).to(torch.uint8),
        "d.bool": torch.rand(13, generator=g) > 0.5,
        "s.scalar": torch.tensor(2.5),
        "e.empty": torch.empty(0, 3),
        "t.strided": torch.randn(8, 6, generator=g).t(),  # not contiguous
    }
    want = _checksum_tensor_by_tensor(named.items(), sample=sample)
    assert buckets.checksum(named.items(), sample=sample, chunk_bytes=chunk_bytes) == want
    poked = dict(named, **{"k.i64": named["k.i64"] + 1})
    assert buckets.checksum(poked.items(), sample=sample, chunk_bytes=chunk_bytes) != want


def test_checksum_copies_to_the_host_once_per_chunk_not_per_tensor():
    """300 tensors (a model's count): one ``.cpu()`` for all of them at the default chunk size, where
    on a GPU each is a copy that waits for the stream; a chunk too small for two tensors falls back
    to one per tensor. Counted with a torch function mode: on CPU ``.cpu()`` copies nothing."""
    from torch.overrides import TorchFunctionMode

    class CountCopies(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.copies = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.cpu:
                self.copies += 1
            return func(*args, **(kwargs or {}))

    named = [(f"layer.{i:03d}", torch.full((64,), float(i))) for i in range(300)]
    with CountCopies() as batched:
        value = buckets.checksum(named, sample=16)
    assert batched.copies == 1
    with CountCopies() as one_by_one:
        assert buckets.checksum(named, sample=16, chunk_bytes=1) == value
    assert one_by_one.copies == 300

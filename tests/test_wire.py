"""The wire codec: every message round-trips; no byte string makes decode raise anything but WireError."""

from __future__ import annotations

import dataclasses
import random

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl import wire

# --------------------------------------------------------------------------------------------------
# Strategies: one per message kind (a new kind without one fails test_every_kind_has_a_strategy)
# --------------------------------------------------------------------------------------------------

text = st.text(max_size=12)
ident = st.text(min_size=1, max_size=8)
version = st.integers(0, 2**62)
count = st.integers(0, wire.MAX_ITEMS)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
json_leaf = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | finite | text
metadata = st.dictionaries(
    text,
    st.recursive(
        json_leaf,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
        max_leaves=6,
    ),
    max_size=3,
)


@st.composite
def samples(draw, group_id: str, sample_id: str) -> wire.Sample:
    n = draw(st.integers(0, 40))
    p = draw(st.integers(0, 40))
    i32 = st.integers(-(2**31), 2**31 - 1)
    return wire.Sample(
        id=sample_id,
        group_id=group_id,
        prompt_ids=np.array(draw(st.lists(i32, min_size=p, max_size=p)), dtype=np.int32),
        completion_ids=np.array(draw(st.lists(i32, min_size=n, max_size=n)), dtype=np.int32),
        behavior_logprobs=np.array(
            draw(st.lists(st.floats(-(2.0**100), 0.0, width=32), min_size=n, max_size=n)),
            dtype=np.float32,
        ),
        versions=np.array(
            draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)), dtype=np.int32
        ),
        loss_mask=np.array(
            draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n)), dtype=np.float32
        ),
        reward=draw(finite),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        metadata=draw(metadata),
    )


@st.composite
def groups(draw) -> wire.Group:
    gid = draw(ident)
    ids = draw(st.lists(ident, min_size=1, max_size=4, unique=True))
    return wire.Group(
        id=gid,
        lease_id=draw(text),
        samples=[draw(samples(gid, i)) for i in ids],
        prompt_index=draw(st.integers(-(2**63), 2**63 - 1)),
        baseline_reward=draw(st.none() | finite),
        metadata=draw(metadata),
    )


STRATEGIES: dict[str, st.SearchStrategy] = {
    "group": groups(),
    "acquire": st.builds(wire.Acquire, worker_id=text, starts=count, request_id=text),
    "grant": st.builds(
        wire.Grant,
        lease_id=text,
        starts=count,
        version=version,
        lease_seconds=finite,
        request_id=text,
    ),
    "put": st.builds(wire.Put, worker_id=text, groups=st.lists(groups(), max_size=3)),
    "ack": st.builds(
        wire.Ack,
        group_ids=st.lists(text, max_size=4),
        rejected=st.dictionaries(text, text, max_size=3),
        version=version,
    ),
    "release": st.builds(wire.Release, worker_id=text, lease_id=text, starts=count),
    "register": st.builds(
        wire.Register,
        worker_id=text,
        generators=st.lists(
            st.builds(wire.GeneratorInfo, url=text, world_size=st.integers(1, 4096), kind=text),
            max_size=3,
        ),
        fresh=st.booleans(),
    ),
    "ok": st.builds(wire.Ok, version=version, message=text),
    "error": st.builds(wire.Error, code=text, message=text),
    "status": st.just(wire.Status()),
    "status_reply": st.builds(wire.StatusReply, version=version, stats=metadata),
    "version": st.builds(
        wire.Version, version=version, checkpoint=text, max_staleness=st.integers(0, 2**31)
    ),
    "end": st.builds(wire.End, version=version, message=text),
}


def assert_same(a, b, where: str = "msg") -> None:
    """Deep equality that compares numpy arrays by dtype and content."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.tobytes() == b.tobytes(), where
        return
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
        return
    if isinstance(a, list | tuple | wire.SampleList):
        assert isinstance(b, list | wire.SampleList) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
        return
    assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def test_every_kind_has_a_strategy():
    assert set(STRATEGIES) == set(wire.MESSAGES)


@pytest.mark.parametrize("kind", sorted(wire.MESSAGES))
def test_round_trip(kind):
    @settings(
        max_examples=40,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(STRATEGIES[kind])
    def check(msg):
        data = wire.encode(msg)
        back = wire.decode(data, expect=wire.MESSAGES[kind])
        assert wire.encode(back) == data  # straight from the columns it arrived in
        assert_same(msg, back)  # (builds the samples)
        assert wire.encode(back) == data  # from the built samples

    check()


# --------------------------------------------------------------------------------------------------
# Fuzzing decode: 10,000 random and mutated inputs
# --------------------------------------------------------------------------------------------------


def _valid_messages(rng: random.Random) -> list[wire.Message]:
    def sample(gid: str, i: int) -> wire.Sample:
        n = rng.randint(0, 6)
        return wire.Sample(
            id=f"s{i}",
            group_id=gid,
            prompt_ids=np.arange(rng.randint(0, 5), dtype=np.int32),
            completion_ids=np.arange(n, dtype=np.int32),
            behavior_logprobs=-np.ones(n, dtype=np.float32),
            versions=np.zeros(n, dtype=np.int32),
            loss_mask=np.ones(n, dtype=np.float32),
            reward=1.0,
            metadata={"task": "sort"},
        )

    group = wire.Group(id="g", lease_id="L", samples=[sample("g", i) for i in range(3)])
    return [
        group,
        wire.Put(worker_id="w", groups=[group, group]),
        wire.Acquire(worker_id="w", starts=4, request_id="r"),
        wire.Grant(lease_id="L", starts=2, version=3, lease_seconds=30.0),
        wire.Ack(group_ids=["g"], rejected={"h": "stale"}, version=2),
        wire.Release(worker_id="w", lease_id="L", starts=1),
        wire.Register(worker_id="w", generators=[wire.GeneratorInfo(url="http://x", world_size=2)]),
        wire.Ok(version=1, message="fine"),
        wire.Error(code="bad_message", message="no"),
        wire.Status(),
        wire.StatusReply(version=5, stats={"a": 1}),
        wire.Version(version=9, checkpoint="/c", max_staleness=1),
        wire.End(version=9, message="done"),
    ]


def _random_value(rng: random.Random):
    return rng.choice(
        [
            None,
            True,
            -1,
            2**64 - 1,
            -(2**63),
            float("nan"),
            float("inf"),
            1.5,
            "",
            "x" * rng.randint(0, 50),
            b"\x00" * rng.randint(0, 9),
            [],
            [1, "a"],
            {},
            {"k": [None]},
            {1: 2},
        ]
    )


def _mutate_tree(obj, rng: random.Random):
    """Change one thing somewhere in a decoded msgpack tree."""
    if isinstance(obj, dict) and obj and rng.random() < 0.7:
        key = rng.choice(list(obj))
        op = rng.random()
        if op < 0.2:
            del obj[key]
        elif op < 0.4:
            obj[key] = _random_value(rng)
        elif op < 0.5 and key == "kind":
            obj[key] = rng.choice([*wire.MESSAGES, "nope", 7])
        elif op < 0.6 and isinstance(obj[key], bytes):  # an array of the wrong length
            raw = obj[key]
            obj[key] = raw[: rng.randint(0, len(raw))] + b"\x01" * rng.randint(0, 9)
        else:
            obj[key] = _mutate_tree(obj[key], rng)
        return obj
    if isinstance(obj, list) and obj and rng.random() < 0.7:
        i = rng.randrange(len(obj))
        if rng.random() < 0.3:
            obj.append(obj[i])  # e.g. a duplicate sample id
        else:
            obj[i] = _mutate_tree(obj[i], rng)
        return obj
    if isinstance(obj, bytes):
        return bytes(rng.getrandbits(8) for _ in range(len(obj) + rng.randint(-4, 4)))
    return _random_value(rng)


_HUGE_HEADERS = [
    b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
    b"\xdb\xff\xff\xff\xff",  # str32 of 4 GiB
    b"\xdd\xff\xff\xff\xff",  # array32 of 4G items
    b"\xdf\xff\xff\xff\xff",  # map32 of 4G entries
    b"\xc9\x7f\xff\xff\xff\x01",  # ext32
    b"\xc5\xff\xff",  # bin16
]


def _huge_declared(base: dict, rng: random.Random) -> bytes:
    """A valid prefix, then a field whose declared size is far beyond the data that follows."""
    head = {k: v for k, v in base.items() if k in ("kind", "v")}
    packed = msgpack.packb(head, use_bin_type=True)
    n = len(head) + 1
    prefix = bytes([0x80 | n]) + packed[1:]  # one more entry than given
    key = rng.choice(["samples", "groups", "prompt_ids", "id", "metadata", "worker_id"])
    return prefix + msgpack.packb(key) + rng.choice(_HUGE_HEADERS) + b"\x00" * rng.randint(0, 16)


def _fuzz_inputs(rng: random.Random, n: int):
    valid = [wire.encode(m) for m in _valid_messages(rng)]
    trees = [msgpack.unpackb(v, raw=False) for v in valid]
    for i in range(n):
        base = rng.randrange(len(valid))
        data = valid[base]
        op = i % 6
        if op == 0:  # random bytes
            yield bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
        elif op == 1:  # truncated
            yield data[: rng.randrange(len(data))]
        elif op == 2:  # flipped bytes
            b = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.getrandbits(8)
            yield bytes(b)
        elif op in (3, 4):  # structural mutation: kinds, types, missing fields, array lengths
            tree = msgpack.unpackb(data, raw=False)
            for _ in range(rng.randint(1, 3)):
                tree = _mutate_tree(tree, rng)
            try:
                yield msgpack.packb(tree, use_bin_type=True)
            except (TypeError, ValueError, OverflowError):
                yield data[:-1]
        else:  # huge declared sizes
            yield _huge_declared(trees[base], rng)


def test_decode_fuzz_raises_only_wire_error():
    rng = random.Random(20261122)
    outcomes = {"error": 0, "ok": 0}
    for data in _fuzz_inputs(rng, 10_000):
        try:
            msg = wire.decode(data)
        except wire.WireError:
            outcomes["error"] += 1
            continue
        # Whatever decodes must be a well-formed message that encodes again.
        assert type(msg) in wire.MESSAGES.values()
        wire.encode(msg)
        outcomes["ok"] += 1
    assert outcomes["error"] > 5_000  # the mutations do break messages...
    assert outcomes["ok"] > 0  # ...and some survive (e.g. a changed metadata value)


@pytest.mark.parametrize("field", ["behavior_logprobs", "versions", "loss_mask"])
def test_per_token_length_mismatch_is_refused_when_encoding(field):
    sample = _valid_messages(random.Random(1))[0].samples[0]
    n = len(sample.completion_ids) + 2
    sample.completion_ids = np.arange(n, dtype=np.int32)
    for f in ("behavior_logprobs", "versions", "loss_mask"):
        if f != field:
            setattr(sample, f, np.zeros(n, dtype=getattr(sample, f).dtype))
    group = wire.Group(id="g", samples=[sample])
    with pytest.raises(wire.WireError) as e:
        wire.encode(wire.Put(worker_id="w", groups=[group]))
    assert f"put.groups[0].samples[0].{field}:" in str(e.value)
    assert "completion_ids" in str(e.value)


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("id", 7, "put.groups[1].id: expected str, got int"),
        ("lease_id", None, "put.groups[1].lease_id: expected str, got NoneType"),
        ("prompt_index", True, "put.groups[1].prompt_index: expected int, got bool"),
        ("metadata", [], "put.groups[1].metadata: expected dict, got list"),
        ("metadata", {b"k": 1}, "put.groups[1].metadata: keys must be strings"),
        ("n", 0, "put.groups[1].n: 0 is outside"),
        ("baseline_reward", "1", "put.groups[1].baseline_reward: expected int or float, got str"),
        ("baseline_reward", float("nan"), "put.groups[1].baseline_reward: must be finite"),
    ],
)
def test_decode_names_the_group_field_at_fault(field, value, needle):
    put = _valid_messages(random.Random(1))[1]
    tree = msgpack.unpackb(wire.encode(put), raw=False)
    tree["groups"][1][field] = value
    with pytest.raises(wire.WireError) as e:
        wire.decode(msgpack.packb(tree, use_bin_type=True))
    assert needle in str(e.value)


def test_decode_checks_tokens_and_names_the_group_and_sample():
    put = _valid_messages(random.Random(1))[1]
    tree = msgpack.unpackb(wire.encode(put), raw=False)
    tree["tokens"] = tree["tokens"][:-4]  # the arrays no longer match the lengths
    with pytest.raises(wire.WireError, match=r"put\.tokens: \d+ bytes, but prompt_len and"):
        wire.decode(msgpack.packb(tree, use_bin_type=True))

    groups = [_valid_messages(random.Random(s))[0] for s in (1, 2)]
    groups[1].id = "h"
    for s in groups[1].samples:
        s.group_id = "h"
    bad = groups[1].samples[1]
    bad.completion_ids = np.arange(2, dtype=np.int32)
    bad.behavior_logprobs = np.array([-1.0, np.nan], dtype=np.float32)
    bad.versions, bad.loss_mask = np.zeros(2, np.int32), np.ones(2, np.float32)
    with pytest.raises(wire.WireError, match=r"put\.groups\[1\]\.samples\[1\]\.behavior_logprobs"):
        wire.decode(wire.encode(wire.Put(worker_id="w", groups=groups)))


def test_decoded_arrays_are_views_of_the_message_and_read_only():
    n = 5000  # a message big enough to be read in place (small ones are simply unpacked)
    s = wire.Sample(
        id="s",
        group_id="g",
        prompt_ids=np.arange(7, dtype=np.int32),
        completion_ids=np.arange(n, dtype=np.int32),
        behavior_logprobs=np.full(n, -1.0, dtype=np.float32),
        versions=np.zeros(n, dtype=np.int32),
        loss_mask=np.ones(n, dtype=np.float32),
    )
    data = wire.encode(wire.Put(worker_id="w", groups=[wire.Group(id="g", samples=[s])]))
    back = wire.decode(data).groups[0].samples[0]
    assert np.shares_memory(back.completion_ids, np.frombuffer(data, np.uint8))
    assert back.completion_ids.flags.aligned and back.loss_mask.flags.aligned  # fast loops
    with pytest.raises(ValueError):
        back.loss_mask[:] = 0


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda d: d.update(kind="nope"), "unknown message kind"),
        (lambda d: d.update(v=99), "schema version"),
        (lambda d: d.pop("worker_id"), "missing field 'worker_id'"),
        (lambda d: d.update(starts=True), "acquire.starts: expected int, got bool"),
        (lambda d: d.update(starts=-1), "acquire.starts: -1 is outside"),
    ],
)
def test_decode_errors_name_the_problem(change, needle):
    d = msgpack.unpackb(wire.encode(wire.Acquire(worker_id="w", starts=1)), raw=False)
    change(d)
    with pytest.raises(wire.WireError, match=needle):
        wire.decode(msgpack.packb(d))


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda d: d.pop("version"), "end: missing field 'version'"),
        (lambda d: d.update(version=-1), r"end.version: -1 is outside"),
        (lambda d: d.update(version="9"), "end.version: expected int, got str"),
        (lambda d: d.update(message=7), "end.message: expected str, got int"),
        (lambda d: d.update(message="x" * (wire.MAX_STR + 1)), "max_str_len"),
    ],
)
def test_end_of_run_is_validated(change, needle):
    """The end-of-run announcement makes every worker leave: only a well-formed one may."""
    msg = wire.End(version=15, message="trained run.steps=15 versions")
    assert wire.decode(wire.encode(msg), expect=wire.End) == msg
    d = msgpack.unpackb(wire.encode(msg), raw=False)
    change(d)
    with pytest.raises(wire.WireError, match=needle):
        wire.decode(msgpack.packb(d))


def test_decode_rejects_bad_sample_values_and_unexpected_kinds():
    good = _valid_messages(random.Random(2))[0]
    s = good.samples[0]
    s.completion_ids = np.arange(2, dtype=np.int32)
    s.versions = np.zeros(2, dtype=np.int32)
    s.loss_mask = np.ones(2, dtype=np.float32)
    for logprobs, needle in ((np.array([0.5, 0.0]), "cannot be positive"), ([np.nan, 0], "finite")):
        s.behavior_logprobs = np.asarray(logprobs, dtype=np.float32)
        with pytest.raises(wire.WireError, match=needle):
            wire.decode(wire.encode(good))
    s.behavior_logprobs = np.array([-1.0, -1.0], dtype=np.float32)
    for mask in ([1.0, 2.0], [1.0, 0.5], [0.0, -1.0]):  # all-ones is the fast path: 2 is not one
        s.loss_mask = np.asarray(mask, dtype=np.float32)
        with pytest.raises(wire.WireError, match="loss_mask: entries must be 0 or 1"):
            wire.decode(wire.encode(good))
    with pytest.raises(wire.WireError, match="unexpected message kind 'status'"):
        wire.decode(wire.encode(wire.Status()), expect=wire.Put)
    with pytest.raises(wire.WireError, match="not a wire message"):
        wire.encode(s)


def test_group_columns_without_building_samples():
    put = _valid_messages(random.Random(4))[1]
    back = wire.decode(wire.encode(put))
    g, want = back.groups[1], put.groups[1]
    for name in wire.TOKEN_ARRAYS:
        got = wire.group_tokens(g, name)  # a view, read before any sample exists
        assert g.samples._items is None
        concat = np.concatenate([getattr(s, name) for s in want.samples])
        assert got.dtype == concat.dtype and got.tolist() == concat.tolist()
        assert wire.group_tokens(want, name).tolist() == concat.tolist()  # built samples
    assert g.rewards == want.rewards and g.samples._items is None


def test_encode_takes_lists_other_dtypes_and_strided_arrays():
    """The fast path joins arrays as they are; anything else is converted, never misread."""
    s = wire.Sample(
        id="s",
        group_id="g",
        prompt_ids=np.arange(10, dtype=np.int32)[::2],  # strided: not joinable as is
        completion_ids=[3, 4, 5],  # a list
        behavior_logprobs=np.array([-1.0, -2.0, -0.5]),  # float64
        versions=np.array([1, 1, 2], dtype=np.int64),
        loss_mask=np.ones(3, dtype=np.float32),
    )
    back = wire.decode(wire.encode(wire.Group(id="g", samples=[s]))).samples[0]
    assert back.prompt_ids.tolist() == [0, 2, 4, 6, 8] and back.prompt_ids.dtype == np.int32
    assert back.completion_ids.tolist() == [3, 4, 5]
    assert back.behavior_logprobs.tolist() == [-1.0, -2.0, -0.5]
    assert back.versions.tolist() == [1, 1, 2] and back.versions.dtype == np.int32


def test_baseline_reward_travels_and_a_group_encoded_before_it_decodes_without_one():
    group = _valid_messages(random.Random(1))[0]
    group.baseline_reward = 0.25
    assert wire.decode(wire.encode(group)).baseline_reward == 0.25
    # journals and checkpoints hold groups encoded before the field existed: no key at all
    tree = msgpack.unpackb(wire.encode(group), raw=False)
    del tree["groups"][0]["baseline_reward"]
    old = wire.decode(msgpack.packb(tree, use_bin_type=True))
    assert old.baseline_reward is None and old.rewards == group.rewards
    group.baseline_reward = None
    assert_same(old, group)


def test_teacher_logprobs_travel_when_the_samples_have_them_and_are_checked():
    """The optional per-token array: absent from the message when no sample has it (the bytes of
    a message from before it, decoded as empty), carried and decoded as a view when every sample
    has one per completion token; a sample with none beside one with some, a length that is not
    its completion's, a group of a message that has them beside one that has not, or a value that
    is no log-probability are refused by name."""
    group = _valid_messages(random.Random(1))[0]
    plain = wire.encode(group)
    assert b"teacher_logprobs" not in plain
    assert wire.decode(plain).samples[0].teacher_logprobs.size == 0
    for i, s in enumerate(group.samples):
        s.teacher_logprobs = -np.arange(1, len(s.completion_ids) + 1, dtype=np.float32) / (i + 2)
    back = wire.decode(wire.encode(group))
    assert wire.encode(back) == wire.encode(group)  # from the columns it arrived in
    assert_same(group, back)
    first = next(s for s in group.samples if len(s.completion_ids) >= 2)
    second = dataclasses.replace(first, id="x", teacher_logprobs=np.zeros(0, np.float32))
    with pytest.raises(wire.WireError, match=r"group.samples\[1\].teacher_logprobs: 0 entries"):
        wire.encode(dataclasses.replace(group, samples=[first, second]))
    short = dataclasses.replace(first, teacher_logprobs=first.teacher_logprobs[:-1])
    with pytest.raises(wire.WireError, match=r"put.groups\[0\].samples\[0\].teacher_logprobs"):
        wire.encode(wire.Put(worker_id="w", groups=[dataclasses.replace(group, samples=[short])]))
    other = wire.decode(plain)
    other.id = "other"
    with pytest.raises(wire.WireError, match="some groups' samples have teacher_logprobs"):
        wire.encode(wire.Put(worker_id="w", groups=[back, other]))
    tree = msgpack.unpackb(wire.encode(group), raw=False)
    bad = np.frombuffer(tree["samples"]["teacher_logprobs"], np.float32).copy()
    bad[0] = 0.5
    tree["samples"]["teacher_logprobs"] = bad.tobytes()
    with pytest.raises(wire.WireError, match=r"samples\[0\].teacher_logprobs: must be a finite"):
        wire.decode(msgpack.packb(tree, use_bin_type=True))
    tree["samples"]["teacher_logprobs"] = bad.tobytes()[:-4]
    with pytest.raises(wire.WireError, match="teacher_logprobs: .* bytes, but completion_len"):
        wire.decode(msgpack.packb(tree, use_bin_type=True))


def _routed_group(rng: np.random.Generator, experts: int = 8) -> wire.Group:
    """A group whose samples carry routes: [tokens - 1, 3 MoE layers, top-2] each."""
    samples = []
    for i, (p, c) in enumerate([(3, 4), (1, 1), (5, 2)]):
        routes = rng.integers(0, experts, size=(p + c - 1, 3, 2))
        samples.append(
            wire.Sample(
                id=f"s{i}",
                group_id="g",
                prompt_ids=np.arange(p, dtype=np.int32),
                completion_ids=np.arange(c, dtype=np.int32),
                behavior_logprobs=-np.ones(c, dtype=np.float32),
                versions=np.zeros(c, dtype=np.int32),
                loss_mask=np.ones(c, dtype=np.float32),
                routed_experts=routes.astype(wire.route_dtype(experts)),
            )
        )
    return wire.Group(id="g", samples=samples)


def test_routed_experts_travel_compact_and_are_checked_against_the_tokens():
    """Routes (routing replay) travel in the narrowest dtype that holds the message's expert ids
    (one byte up to 256 experts), round-trip, re-encode from the columns they arrived in, and are
    refused by name when a sample's positions are not its tokens but the last, when samples
    disagree on [moe_layers, top_k], when one has none beside others, or when the bytes do not
    fit the samples' tokens."""
    rng = np.random.default_rng(0)
    group = _routed_group(rng)
    data = wire.encode(group)
    tree = msgpack.unpackb(data, raw=False)
    assert tree["samples"]["routed_experts_dtype"] == "|u1"
    assert tree["samples"]["routed_experts_shape"] == [3, 2]
    assert len(tree["samples"]["routed_experts"]) == (6 + 1 + 6) * 3 * 2  # one byte an id
    back = wire.decode(data)
    assert wire.encode(back) == data
    assert_same(group, back)
    put = wire.decode(wire.encode(wire.Put(worker_id="w", groups=[back, group])))
    assert_same(put.groups[1], group)
    # more than 256 experts: two bytes; a message without routes has none
    wide = _routed_group(rng, experts=1000)
    assert msgpack.unpackb(wire.encode(wide))["samples"]["routed_experts_dtype"] == "<i2"
    assert_same(wide, wire.decode(wire.encode(wide)))
    assert b"routed_experts" not in wire.encode(_valid_messages(random.Random(1))[0])

    first = group.samples[0]
    for routes, match in (
        (
            first.routed_experts[:-1],
            r"samples\[0\]\.routed_experts: 5 positions, but the sample's 3 ",
        ),
        (
            first.routed_experts[:, :2],
            r"samples\[1\]\.routed_experts: \[moe_layers, top_k\] \[3, 2\]",
        ),
        (
            first.routed_experts[:, :, 0],
            r"samples\[0\]\.routed_experts: expected integer expert ids",
        ),
        (-first.routed_experts.astype(np.int32) - 1, r"routed_experts: expert ids must be in"),
    ):
        bad = dataclasses.replace(first, routed_experts=routes)
        with pytest.raises(wire.WireError, match=match) as e:
            wire.encode(dataclasses.replace(group, samples=[bad, *group.samples[1:]]))
        assert "\n" not in str(e.value)
    none = dataclasses.replace(group.samples[1], routed_experts=np.zeros((0, 0, 0), np.uint8))
    with pytest.raises(wire.WireError, match=r"samples\[1\]\.routed_experts: missing, but other"):
        wire.encode(dataclasses.replace(group, samples=[first, none]))
    unrouted = _valid_messages(random.Random(1))[0]
    assert any(len(s.prompt_ids) + len(s.completion_ids) > 1 for s in unrouted.samples)
    plain = wire.decode(wire.encode(unrouted))  # its samples left unbuilt: columns re-encoded
    plain.id = "other"
    with pytest.raises(wire.WireError, match="some groups' samples have routed_experts"):
        wire.encode(wire.Put(worker_id="w", groups=[back, plain]))
    # the receiving side: bytes that do not fit the tokens, a dtype or shape that is not one
    for key, value, match in (
        ("routed_experts", tree["samples"]["routed_experts"][:-1], r"group\.samples\.routed_exp"),
        ("routed_experts_dtype", "<f4", r"routed_experts_dtype: expected one of"),
        ("routed_experts_shape", [3], r"routed_experts_shape: expected \[moe_layers, top_k\]"),
    ):
        t = msgpack.unpackb(data, raw=False)
        t["samples"][key] = value
        with pytest.raises(wire.WireError, match=match):
            wire.decode(msgpack.packb(t, use_bin_type=True))
    t = msgpack.unpackb(wire.encode(wide), raw=False)
    ids = np.frombuffer(t["samples"]["routed_experts"], "<i2").copy()
    ids[-1] = -3
    t["samples"]["routed_experts"] = ids.tobytes()
    with pytest.raises(wire.WireError, match=r"group\.samples\[2\]\.routed_experts: expert ids"):
        wire.decode(msgpack.packb(t, use_bin_type=True))

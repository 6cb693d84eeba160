"""Every message a process can send another, and the one codec for them (docs/design.md §3).

Messages are msgpack maps ``{"kind": ..., "v": SCHEMA_VERSION, ...fields}``. Nothing is ever pickled.

Groups (a ``group`` message, or the groups of a ``put``) travel as columns for the whole message, so
the codec's Python work is per message, not per sample: ``groups`` holds each group's own fields and
its sample count ``n``; ``samples`` holds the per-sample columns (ids, finish reasons and metadata as
lists; rewards and prompt/completion lengths as raw little-endian ``bin``); and ``tokens``, the map's
last entry, is one ``bin`` with every sample's per-token arrays, array by array: prompt_ids (int32),
completion_ids (int32), behavior_logprobs (float32), versions (int32), loss_mask (float32), each in
sample order. Any msgpack reader can read the message; ours finds ``tokens`` at the end and reads
the arrays straight out of the received bytes (no copy), and builds a group's :class:`Sample`
objects only when someone looks at them. Decoding validates every field and raises only
:class:`WireError`, so a service can answer a bad message with an error reply and keep serving.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, ClassVar

import msgpack
import numpy as np

SCHEMA_VERSION = 2

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Upper bound on one encoded message; transports refuse larger ones before reading them fully."""
MAX_TOKENS = 1 << 20
"""Upper bound on one sample's prompt or completion length."""
MAX_ITEMS = 1 << 16
"""Upper bound on the number of samples in a group, groups in a put, generators in a register..."""
MAX_STR = 1 << 16
"""Upper bound on one string field."""

_I32 = np.dtype("<i4")
_F64 = np.dtype("<f8")
_F32 = np.dtype("<f4")


class WireError(ValueError):
    """A message could not be encoded or decoded; the text says which field and why."""


# --------------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Sample:
    """One completion of one prompt. Per-token arrays all have ``len(completion_ids)`` entries."""

    id: str
    group_id: str
    prompt_ids: np.ndarray  # int32
    completion_ids: np.ndarray  # int32
    behavior_logprobs: np.ndarray  # float32, from the generator
    versions: np.ndarray  # int32, the policy version that produced each token
    loss_mask: np.ndarray  # float32, 0 on tokens the policy did not produce (tool output)
    reward: float = 0.0
    finish_reason: str = "stop"  # stop | length | abort
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def behavior_version(self) -> int:
        """The oldest version among the policy's own tokens (docs/design.md §2)."""
        mask = self.loss_mask > 0
        if not mask.any():
            return int(self.versions.min()) if len(self.versions) else 0
        return int(self.versions[mask].min())

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass(kw_only=True)
class Group:
    """The n samples of one prompt: GRPO's unit, and the unit the buffer stores and hands out."""

    kind: ClassVar[str] = "group"
    id: str
    lease_id: str = ""
    samples: Sequence[Sample]  # a list, or a decoded group's SampleList
    prompt_index: int = -1  # position in the dataset, for the resumable data position
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def behavior_version(self) -> int:
        return min(s.behavior_version for s in self.samples)

    @property
    def rewards(self) -> list[float]:
        if (cols := _unbuilt(self.samples)) is not None:
            return cols._cols.rewards[cols._lo : cols._hi]
        return [s.reward for s in self.samples]


@dataclass(kw_only=True)
class Acquire:
    """A worker asks for the right to start up to ``n`` groups."""

    kind: ClassVar[str] = "acquire"
    worker_id: str
    n: int
    request_id: str = ""


@dataclass(kw_only=True)
class Grant:
    """``k`` groups may be started under ``lease_id`` until ``lease_seconds`` pass (k may be 0)."""

    kind: ClassVar[str] = "grant"
    lease_id: str
    k: int
    version: int
    lease_seconds: float
    request_id: str = ""


@dataclass(kw_only=True)
class Put:
    """Whole groups for the buffer; several per message to amortise per-message overhead."""

    kind: ClassVar[str] = "put"
    worker_id: str
    groups: list[Group]


@dataclass(kw_only=True)
class Ack:
    """Groups now stored (or already stored: duplicates are acknowledged and ignored)."""

    kind: ClassVar[str] = "ack"
    group_ids: list[str]
    rejected: dict[str, str] = field(default_factory=dict)  # group id -> reason
    version: int = 0


@dataclass(kw_only=True)
class Release:
    """A worker gives back ``n`` unused starts of a lease (a cancelled or never-started group)."""

    kind: ClassVar[str] = "release"
    worker_id: str
    lease_id: str
    n: int


@dataclass(kw_only=True)
class GeneratorInfo:
    url: str
    world_size: int = (
        1  # ranks it takes in the weight group when it has no /server_info (else tp_size)
    )
    kind: str = "sglang"  # sglang | builtin


@dataclass(kw_only=True)
class Register:
    """A worker tells the learner which generators it drives, so they receive weights."""

    kind: ClassVar[str] = "register"
    worker_id: str
    generators: list[GeneratorInfo]
    # The worker process has just started and holds no lease: any lease still open under this
    # worker id is a dead process's, and its starts return now instead of after lease_seconds.
    fresh: bool = False


@dataclass(kw_only=True)
class Ok:
    kind: ClassVar[str] = "ok"
    version: int = 0
    message: str = ""


@dataclass(kw_only=True)
class Error:
    """The reply to a message the service could not take; ``code`` is machine-readable."""

    kind: ClassVar[str] = "error"
    code: str
    message: str


@dataclass(kw_only=True)
class Status:
    """Ask the service for its counters (for tools, tests and the launcher's progress bar)."""

    kind: ClassVar[str] = "status"


@dataclass(kw_only=True)
class StatusReply:
    kind: ClassVar[str] = "status_reply"
    version: int
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class Version:
    """Published on every new policy version; ``checkpoint`` is an HF folder to load from disk."""

    kind: ClassVar[str] = "version"
    version: int
    checkpoint: str = ""
    max_staleness: int = 0


@dataclass(kw_only=True)
class End:
    """Published when the learner has trained its last version: the run is over, workers stop.

    A learner that dies sends none, so a worker that hears no version keeps waiting for a restarted
    learner; only this message (or a ``run_ended`` error reply) tells it to leave."""

    kind: ClassVar[str] = "end"
    version: int
    message: str = ""


MESSAGES: dict[str, type] = {
    m.kind: m
    for m in (
        Group,
        Acquire,
        Grant,
        Put,
        Ack,
        Release,
        Register,
        Ok,
        Error,
        Status,
        StatusReply,
        Version,
        End,
    )
}

Message = (
    Group
    | Acquire
    | Grant
    | Put
    | Ack
    | Release
    | Register
    | Ok
    | Error
    | Status
    | StatusReply
    | Version
    | End
)

_ARRAYS = {  # the per-token arrays, in the order they sit in ``tokens``
    "prompt_ids": _I32,
    "completion_ids": _I32,
    "behavior_logprobs": _F32,
    "versions": _I32,
    "loss_mask": _F32,
}
_PER_TOKEN = ("behavior_logprobs", "versions", "loss_mask")
_FINISH = ("stop", "length", "abort")
_GROUPED = ("group", "put")  # the kinds that carry groups
_PAD_KEY, _TOKENS_KEY = msgpack.packb("pad"), msgpack.packb("tokens")
_STREAM_FROM = 16384  # bytes: below this, copying ``tokens`` costs less than reading in place
_LIMITS = dict(
    raw=False,
    strict_map_key=True,
    max_bin_len=MAX_MESSAGE_BYTES,
    max_str_len=MAX_STR,
    max_array_len=MAX_ITEMS,
    max_map_len=MAX_ITEMS,
    max_ext_len=0,
)


class SampleList(Sequence):
    """A decoded group's samples, built on first access.

    Building ten Python objects per sample was most of the decoding time, and the buffer checks and
    stores a group without them (:func:`group_tokens`, ``Group.rewards``); the learner builds them
    when it trains. Until then the group is re-encoded straight from the columns it arrived in."""

    __slots__ = ("_cols", "_lo", "_hi", "_group_id", "_items")

    def __init__(self, cols: _Columns, lo: int, hi: int, group_id: str):
        self._cols, self._lo, self._hi, self._group_id = cols, lo, hi, group_id
        self._items: list[Sample] | None = None

    def _load(self) -> list[Sample]:
        if self._items is None:
            c, gid = self._cols, self._group_id
            a = c.arrays
            p, q = c.prompt_ends, c.completion_ends
            self._items = [
                Sample(
                    id=c.ids[i],
                    group_id=gid,
                    prompt_ids=a["prompt_ids"][p[i] : p[i + 1]],
                    completion_ids=a["completion_ids"][q[i] : q[i + 1]],
                    behavior_logprobs=a["behavior_logprobs"][q[i] : q[i + 1]],
                    versions=a["versions"][q[i] : q[i + 1]],
                    loss_mask=a["loss_mask"][q[i] : q[i + 1]],
                    reward=c.rewards[i],
                    finish_reason=c.finish[i],
                    metadata=c.metadata[i],
                )
                for i in range(self._lo, self._hi)
            ]
        return self._items

    def __len__(self) -> int:
        return self._hi - self._lo

    def __getitem__(self, i):  # type: ignore[override]
        return self._load()[i]

    def __iter__(self) -> Iterator[Sample]:
        return iter(self._load())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"SampleList({len(self)} samples of group {self._group_id!r})"


def _unbuilt(ss: Sequence[Sample]) -> SampleList | None:
    """``ss`` if it is a decoded group's samples that nobody has looked at: still columns."""
    return ss if isinstance(ss, SampleList) and ss._items is None else None


def group_tokens(g: Group, name: str) -> np.ndarray:
    """One per-token array (``versions``, ``loss_mask``...) over all a group's samples, in order:
    a view into the message a decoded group arrived in, else a concatenation."""
    ss = g.samples
    if (cols := _unbuilt(ss)) is not None:
        c = cols._cols
        ends = c.prompt_ends if name == "prompt_ids" else c.completion_ends
        return c.arrays[name][ends[cols._lo] : ends[cols._hi]]
    dt = _ARRAYS[name]
    return np.concatenate(
        [np.asarray(getattr(s, name), dtype=dt).reshape(-1) for s in ss] or [np.empty(0, dt)]
    )


@dataclass
class _Columns:
    """Samples of one or more groups as columns: what ``samples`` and ``tokens`` carry."""

    ids: list[str]
    rewards: list[float]
    finish: list[str]
    metadata: list[Any]
    prompt_lens: list[int]
    completion_lens: list[int]
    arrays: dict[str, Any]  # name -> one array (decoded), or a list of pieces to join (encoding)

    @functools.cached_property
    def prompt_ends(self) -> list[int]:  # n + 1 offsets into prompt_ids
        return [0, *itertools.accumulate(self.prompt_lens)]

    @functools.cached_property
    def completion_ends(self) -> list[int]:  # n + 1 offsets into the per-token arrays
        return [0, *itertools.accumulate(self.completion_lens)]


_DTYPE, _SIZE, _GROUP_ID = attrgetter("dtype"), attrgetter("size"), attrgetter("group_id")
_FIELDS = attrgetter("id", "reward", "finish_reason", "metadata", *_ARRAYS)  # a sample's columns


def _decoded_columns(ss: SampleList) -> _Columns:
    """A decoded group's columns, sliced from the message it arrived in (no sample is built)."""
    c, lo, hi = ss._cols, ss._lo, ss._hi
    p0, p1 = c.prompt_ends[lo], c.prompt_ends[hi]
    q0, q1 = c.completion_ends[lo], c.completion_ends[hi]
    return _Columns(
        ids=c.ids[lo:hi],
        rewards=c.rewards[lo:hi],
        finish=c.finish[lo:hi],
        metadata=c.metadata[lo:hi],
        prompt_lens=c.prompt_lens[lo:hi],
        completion_lens=c.completion_lens[lo:hi],
        arrays={k: [v[p0:p1] if k == "prompt_ids" else v[q0:q1]] for k, v in c.arrays.items()},
    )


def _sample_columns(ss: list[Sample], at: Callable[[int], str]) -> _Columns:
    """Samples (at least one) as columns, gathered in one C-level pass (``map``, then ``zip`` to
    transpose) however many groups they come from; the arrays as the pieces to join. ``at(i)``
    names sample ``i`` in errors."""
    ids, rewards, finish, metadata, *columns = zip(*map(_FIELDS, ss), strict=True)
    arrays: dict[str, list] = {}
    sizes: dict[str, list[int]] = {}
    for (k, dt), column in zip(_ARRAYS.items(), columns, strict=True):
        parts = list(column)
        try:
            ok = set(map(_DTYPE, parts)) <= {dt}
        except AttributeError:  # a list, not an array
            ok = False
        if not ok:
            for i, x in enumerate(parts):
                try:
                    parts[i] = np.asarray(x, dtype=dt).reshape(-1)
                except (TypeError, ValueError, OverflowError) as e:
                    raise WireError(f"{at(i)}.{k}: not convertible to {dt.name}: {e}") from None
        arrays[k] = parts
        sizes[k] = list(map(_SIZE, parts))
    done = sizes["completion_ids"]
    for k in _PER_TOKEN:
        if sizes[k] != done:
            i = next(i for i, (a, b) in enumerate(zip(sizes[k], done, strict=True)) if a != b)
            raise WireError(
                f"{at(i)}.{k}: {sizes[k][i]} entries, but completion_ids has {done[i]} (one per token)"
            )
    return _Columns(
        ids=list(ids),
        rewards=list(rewards),
        finish=list(finish),
        metadata=list(metadata),
        prompt_lens=sizes["prompt_ids"],
        completion_lens=done,
        arrays=arrays,
    )


def _concat(cols: list[_Columns]) -> _Columns:
    """One set of columns from several (a message mixing built and decoded groups); most
    messages have one, which is returned as it is."""
    if len(cols) == 1:
        return cols[0]
    return _Columns(
        ids=[x for c in cols for x in c.ids],
        rewards=[x for c in cols for x in c.rewards],
        finish=[x for c in cols for x in c.finish],
        metadata=[x for c in cols for x in c.metadata],
        prompt_lens=[x for c in cols for x in c.prompt_lens],
        completion_lens=[x for c in cols for x in c.completion_lens],
        arrays={k: [p for c in cols for p in c.arrays[k]] for k in _ARRAYS},
    )


def _plain_default(obj: Any) -> Any:
    """msgpack's hook for what it cannot pack itself: numpy scalars and nested dataclasses."""
    if isinstance(obj, np.generic):
        return obj.item()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    raise TypeError(f"cannot pack {type(obj).__name__}")


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, default=_plain_default)


def _encode_groups(kind: str, fields: dict[str, Any], groups: Sequence[Group]) -> bytes:
    """A message carrying groups: the map's fields, then ``tokens`` last, built in one join."""
    heads: list[dict] = []
    cols: list[_Columns] = []
    run: list[Sample] = []  # built samples of consecutive groups, gathered together
    starts: list[tuple[int, int]] = []  # (index in run, group index) where each group begins

    def at(i: int) -> str:
        j = bisect.bisect_right(starts, (i, len(groups))) - 1
        first, gi = starts[j]
        return (
            f"{kind}.samples[{i}]"
            if kind == "group"
            else f"{kind}.groups[{gi}].samples[{i - first}]"
        )

    def flush() -> None:
        if run:
            cols.append(_sample_columns(run, at))
            run.clear()
            starts.clear()

    for gi, g in enumerate(groups):
        ss = g.samples
        if (unbuilt := _unbuilt(ss)) is not None:
            flush()
            cols.append(_decoded_columns(unbuilt))
        else:
            if set(map(_GROUP_ID, ss)) - {g.id}:
                i = next(i for i, s in enumerate(ss) if s.group_id != g.id)
                where = kind if kind == "group" else f"{kind}.groups[{gi}]"
                raise WireError(
                    f"{where}.samples[{i}].group_id: {ss[i].group_id!r} is not the group's {g.id!r}"
                )
            starts.append((len(run), gi))
            run.extend(ss)
        heads.append(
            {
                "id": g.id,
                "lease_id": g.lease_id,
                "prompt_index": g.prompt_index,
                "metadata": g.metadata,
                "n": len(ss),
            }
        )
    flush()
    c = _concat(cols)
    body = {
        "kind": kind,
        "v": SCHEMA_VERSION,
        **fields,
        "groups": heads,
        "samples": {
            "id": c.ids,
            "reward": np.array(c.rewards, dtype=_F64).tobytes(),
            "finish_reason": c.finish,
            "metadata": c.metadata,
            "prompt_len": np.array(c.prompt_lens, dtype=_I32).tobytes(),
            "completion_len": np.array(c.completion_lens, dtype=_I32).tobytes(),
        },
    }
    pieces = list(itertools.chain.from_iterable(c.arrays[k] for k in _ARRAYS))
    nbytes = 4 * (sum(c.prompt_lens) + 4 * sum(c.completion_lens))  # every dtype is 4 bytes
    head = _pack(body)
    if not 0x80 <= head[0] < 0x8E:  # pragma: no cover - the body has 4 or 5 keys
        raise WireError(f"{kind}: unexpected map header {head[0]:#x}")
    # Two more entries: ``pad`` (a bin8 of 0-15 zero bytes), so that ``tokens`` starts at a multiple
    # of 16 bytes into the message and every array in it is aligned to its 4-byte items (numpy is
    # ~1.5x slower on misaligned ones), then ``tokens``.
    pad = -(len(head) + len(_PAD_KEY) + 2 + len(_TOKENS_KEY) + 5) % 16
    prefix = b"".join(
        (
            bytes([head[0] + 2]),
            head[1:],
            _PAD_KEY + bytes([0xC4, pad]) + bytes(pad),
            _TOKENS_KEY + b"\xc6" + nbytes.to_bytes(4, "big"),
        )
    )
    try:
        return b"".join([prefix, *pieces])
    except (BufferError, ValueError, TypeError):  # a non-contiguous array: copy it first
        return b"".join([prefix, *(np.ascontiguousarray(p) for p in pieces)])


def encode(msg: Message) -> bytes:
    """Pack a message. Raises :class:`WireError` if it does not fit the limits."""
    kind = getattr(type(msg), "kind", None)
    if kind not in MESSAGES:
        raise WireError(f"cannot encode {type(msg).__name__}: not a wire message")
    try:
        if isinstance(msg, Group):
            data = _encode_groups(kind, {}, [msg])
        elif isinstance(msg, Put):
            data = _encode_groups(kind, {"worker_id": msg.worker_id}, msg.groups)
        else:
            data = _pack({"kind": kind, "v": SCHEMA_VERSION, **_plain_default(msg)})
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"cannot encode {kind}: {e}") from None
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"{kind} message is {len(data)} bytes, over the {MAX_MESSAGE_BYTES} limit")
    return data


# --------------------------------------------------------------------------------------------------
# Decoding: validate everything, raise only WireError
# --------------------------------------------------------------------------------------------------


_MISSING = object()


def _req(d: dict, key: str, types: type | tuple, where: str) -> Any:
    v = d.get(key, _MISSING)
    if v is _MISSING:
        raise WireError(f"{where}: missing field '{key}'")
    t = type(v)
    if t is types and not (
        (t is str and len(v) > MAX_STR) or (t is list and len(v) > MAX_ITEMS)
    ):  # the common case, checked first: it runs for every field of every message
        return v
    if isinstance(v, bool) and types in (int, float, (int, float)):
        raise WireError(f"{where}.{key}: expected {_tname(types)}, got bool")
    if not isinstance(v, types):
        raise WireError(f"{where}.{key}: expected {_tname(types)}, got {type(v).__name__}")
    if isinstance(v, str) and len(v) > MAX_STR:
        raise WireError(f"{where}.{key}: string of {len(v)} chars, over the {MAX_STR} limit")
    if isinstance(v, list) and len(v) > MAX_ITEMS:
        raise WireError(f"{where}.{key}: {len(v)} items, over the {MAX_ITEMS} limit")
    return v


def _opt(d: dict, key: str, types: type | tuple, where: str, default: Any) -> Any:
    return _req(d, key, types, where) if key in d else default


def _tname(t: type | tuple) -> str:
    if isinstance(t, tuple):
        return " or ".join(x.__name__ for x in t)
    return t.__name__


def _count(d: dict, key: str, where: str, *, lo: int = 0, hi: int = MAX_ITEMS) -> int:
    v = _req(d, key, int, where)
    if not lo <= v <= hi:
        raise WireError(f"{where}.{key}: {v} is outside [{lo}, {hi}]")
    return v


def _finite(d: dict, key: str, where: str, default: float | None = None) -> float:
    v = (
        _req(d, key, (int, float), where)
        if default is None
        else _opt(d, key, (int, float), where, default)
    )
    v = float(v)
    if not math.isfinite(v):
        raise WireError(f"{where}.{key}: must be finite, got {v}")
    return v


def _metadata(d: dict, where: str) -> dict[str, Any]:
    m = _opt(d, "metadata", dict, where, {})
    for k in m:
        if not isinstance(k, str):
            raise WireError(f"{where}.metadata: keys must be strings")
    return m


def _column(cols: dict, key: str, dt: np.dtype, n: int, where: str) -> np.ndarray:
    raw = _req(cols, key, bytes, where)
    if len(raw) != n * dt.itemsize:
        raise WireError(f"{where}.{key}: {len(raw)} bytes, expected {n} {dt.name} (one per sample)")
    return np.frombuffer(raw, dtype=dt)


def _values_ok(lp: np.ndarray, ver: np.ndarray, mask: np.ndarray) -> bool:
    """Whole-message value checks in five passes when the mask is all ones (no tool tokens), the
    common case; a NaN makes min and max NaN, which fails every comparison."""
    return bool(
        np.isfinite(lp.min())
        and lp.max() <= 1e-3
        and ver.min() >= 0
        and (
            mask.min() == 1 == mask.max()
            or np.count_nonzero(mask == 1) + np.count_nonzero(mask == 0) == len(mask)
        )
    )


def _groups(d: dict, tokens: Any, where: str) -> list[Group]:
    """The groups of a ``group`` or ``put`` message, validated; samples are built lazily."""
    heads = _req(d, "groups", list, where)
    cols = _req(d, "samples", dict, where)
    w = f"{where}.samples"
    ids = _str_list(cols, "id", w)
    n = len(ids)

    def group_at(i: int) -> str:  # group i of the message, for errors
        return where if where == "group" else f"{where}.groups[{i}]"

    sizes = [h.get("n") if type(h) is dict else None for h in heads]
    if not all(type(x) is int and 1 <= x <= MAX_ITEMS for x in sizes):  # name the first bad one
        for i, h in enumerate(heads):
            if not isinstance(h, dict):
                raise WireError(f"{group_at(i)}: expected a map, got {type(h).__name__}")
            _count(h, "n", group_at(i), lo=1)
    if sum(sizes) != n:
        raise WireError(f"{w}.id: {n} samples, but the groups' n add up to {sum(sizes)}")
    starts = [0, *itertools.accumulate(sizes)]

    def at(i: int) -> str:  # sample i of the message, named by its group
        g = bisect.bisect_right(starts, i) - 1
        return f"{group_at(g)}.samples[{i - starts[g]}]"

    rewards = _column(cols, "reward", _F64, n, w).tolist()
    if not all(map(math.isfinite, rewards)):
        i = next(i for i, r in enumerate(rewards) if not math.isfinite(r))
        raise WireError(f"{at(i)}.reward: must be finite")
    finish = _str_list(cols, "finish_reason", w)
    metas = _req(cols, "metadata", list, w)
    for key, col in (("finish_reason", finish), ("metadata", metas)):
        if len(col) != n:
            raise WireError(f"{w}.{key}: {len(col)} entries, but there are {n} samples")
    if not set(finish) <= set(_FINISH):
        i = next(i for i, f in enumerate(finish) if f not in _FINISH)
        raise WireError(f"{at(i)}.finish_reason: expected stop, length or abort, got {finish[i]!r}")
    if set(map(type, metas)) - {dict} or set(map(type, itertools.chain.from_iterable(metas))) - {
        str
    }:
        for i, m in enumerate(metas):  # msgpack already refused keys that are not str or bytes
            if type(m) is not dict or not all(type(k) is str for k in m):
                raise WireError(f"{at(i)}.metadata: expected a map with string keys")
    lens = {}
    for key in ("prompt_len", "completion_len"):
        x = _column(cols, key, _I32, n, w).tolist()
        if n and (min(x) < 0 or max(x) > MAX_TOKENS):
            raise WireError(f"{w}.{key}: lengths must be in [0, {MAX_TOKENS}]")
        lens[key] = x
    prompt_total, total = sum(lens["prompt_len"]), sum(lens["completion_len"])
    if tokens is None:
        tokens = _req(d, "tokens", bytes, where)
    need = 4 * (prompt_total + 4 * total)
    if len(tokens) != need:
        raise WireError(
            f"{where}.tokens: {len(tokens)} bytes, but prompt_len and completion_len call for "
            f"{need} ({prompt_total} prompt and {total} completion tokens)"
        )
    arrays, pos = {}, 0
    for k, dt in _ARRAYS.items():
        count = prompt_total if k == "prompt_ids" else total
        arrays[k] = np.frombuffer(tokens, dtype=dt, count=count, offset=pos)
        pos += count * 4
    lp, ver, mask = arrays["behavior_logprobs"], arrays["versions"], arrays["loss_mask"]
    c = _Columns(
        ids=ids,
        rewards=rewards,
        finish=finish,
        metadata=metas,
        prompt_lens=lens["prompt_len"],
        completion_lens=lens["completion_len"],
        arrays=arrays,
    )
    if total and not _values_ok(lp, ver, mask):  # reductions only; on failure, name the sample
        for bad, k, why in (
            (~np.isfinite(lp), "behavior_logprobs", "must be finite"),
            (lp > 1e-3, "behavior_logprobs", "a log-probability cannot be positive"),
            (ver < 0, "versions", "must be >= 0"),
            ((mask != 0) & (mask != 1), "loss_mask", "entries must be 0 or 1"),
        ):
            if bad.any():
                ends = c.completion_ends[1:]
                i = int(np.searchsorted(ends, int(np.argmax(bad)), side="right"))
                raise WireError(f"{at(i)}.{k}: {why}")
    unique = len(set(ids)) == n  # then no group repeats a sample id: one check for all
    out, lo = [], 0
    for i, (h, size) in enumerate(zip(heads, sizes, strict=True)):
        gid, lease = h.get("id"), h.get("lease_id", "")
        index, meta = h.get("prompt_index", -1), h.get("metadata", _MISSING)
        if meta is _MISSING:
            meta = {}
        if not (  # the common case in one test; otherwise the checks below name the field
            type(gid) is str
            and type(lease) is str
            and type(index) is int
            and type(meta) is dict
            and len(gid) <= MAX_STR
            and len(lease) <= MAX_STR
            and all(type(k) is str for k in meta)
        ):
            gw = group_at(i)
            gid = _req(h, "id", str, gw)
            lease = _opt(h, "lease_id", str, gw, "")
            index = _opt(h, "prompt_index", int, gw, -1)
            meta = _metadata(h, gw)
        if not unique and len(set(ids[lo : lo + size])) != size:
            mine = ids[lo : lo + size]
            dup = next(x for j, x in enumerate(mine) if x in mine[:j])
            raise WireError(f"{group_at(i)}.samples.id: duplicate sample id {dup!r}")
        out.append(
            Group(
                id=gid,
                lease_id=lease,
                samples=SampleList(c, lo, lo + size, gid),
                prompt_index=index,
                metadata=meta,
            )
        )
        lo += size
    return out


def _generator(d: Any, where: str) -> GeneratorInfo:
    if not isinstance(d, dict):
        raise WireError(f"{where}: expected a map, got {type(d).__name__}")
    return GeneratorInfo(
        url=_req(d, "url", str, where),
        world_size=_count(d, "world_size", where, lo=1, hi=4096) if "world_size" in d else 1,
        kind=_opt(d, "kind", str, where, "sglang"),
    )


def _str_list(d: dict, key: str, where: str) -> list[str]:
    v = _req(d, key, list, where)
    if set(map(type, v)) <= {str}:
        return v
    for i, x in enumerate(v):
        if not isinstance(x, str):
            raise WireError(f"{where}.{key}[{i}]: expected str, got {type(x).__name__}")
    return v


def _str_map(d: dict, key: str, where: str) -> dict[str, str]:
    v = _opt(d, key, dict, where, {})
    for k, x in v.items():
        if not isinstance(k, str) or not isinstance(x, str):
            raise WireError(f"{where}.{key}: expected a map of strings to strings")
    return v


def _build(kind: str, d: dict, tokens: memoryview | None) -> Message:
    w = kind
    if kind == "group":
        groups = _groups(d, tokens, w)
        if len(groups) != 1:
            raise WireError(f"group: carries {len(groups)} groups, expected 1")
        return groups[0]
    if kind == "acquire":
        return Acquire(
            worker_id=_req(d, "worker_id", str, w),
            n=_count(d, "n", w),
            request_id=_opt(d, "request_id", str, w, ""),
        )
    if kind == "grant":
        return Grant(
            lease_id=_req(d, "lease_id", str, w),
            k=_count(d, "k", w),
            version=_count(d, "version", w, hi=2**62),
            lease_seconds=_finite(d, "lease_seconds", w),
            request_id=_opt(d, "request_id", str, w, ""),
        )
    if kind == "put":
        return Put(worker_id=_req(d, "worker_id", str, w), groups=_groups(d, tokens, w))
    if kind == "ack":
        return Ack(
            group_ids=_str_list(d, "group_ids", w),
            rejected=_str_map(d, "rejected", w),
            version=_count(d, "version", w, hi=2**62) if "version" in d else 0,
        )
    if kind == "release":
        return Release(
            worker_id=_req(d, "worker_id", str, w),
            lease_id=_req(d, "lease_id", str, w),
            n=_count(d, "n", w),
        )
    if kind == "register":
        gens = _req(d, "generators", list, w)
        return Register(
            worker_id=_req(d, "worker_id", str, w),
            generators=[_generator(g, f"{w}.generators[{i}]") for i, g in enumerate(gens)],
            fresh=_opt(d, "fresh", bool, w, False),
        )
    if kind == "ok":
        return Ok(
            version=_count(d, "version", w, hi=2**62) if "version" in d else 0,
            message=_opt(d, "message", str, w, ""),
        )
    if kind == "error":
        return Error(code=_req(d, "code", str, w), message=_req(d, "message", str, w))
    if kind == "status":
        return Status()
    if kind == "status_reply":
        return StatusReply(
            version=_count(d, "version", w, hi=2**62), stats=_opt(d, "stats", dict, w, {})
        )
    if kind == "version":
        return Version(
            version=_count(d, "version", w, hi=2**62),
            checkpoint=_opt(d, "checkpoint", str, w, ""),
            max_staleness=_count(d, "max_staleness", w, hi=2**31) if "max_staleness" in d else 0,
        )
    if kind == "end":
        return End(
            version=_count(d, "version", w, hi=2**62), message=_opt(d, "message", str, w, "")
        )
    raise WireError(f"unknown message kind {kind!r}")  # pragma: no cover - guarded by MESSAGES


class _Reader:
    """A file over a buffer for msgpack's Unpacker, which then copies only what it reads (the
    header): ``io.BytesIO`` would copy a whole memoryview first."""

    def __init__(self, data: bytes | memoryview):
        self._data, self._pos = data, 0

    def read(self, n: int) -> bytes:
        chunk = self._data[self._pos : self._pos + n]
        self._pos += len(chunk)
        return bytes(chunk)


def _unpack(data: bytes | memoryview) -> tuple[Any, memoryview | None]:
    """The message map, and ``tokens`` as a view into ``data`` when it is the map's last entry (as
    :func:`encode` puts it): the arrays are then read in place, never copied."""
    if len(data) < _STREAM_FROM or not 0x80 <= data[0] <= 0x8F:  # small, or not our layout
        return msgpack.unpackb(data, **_LIMITS), None
    up = msgpack.Unpacker(_Reader(data), read_size=4096, **_LIMITS)  # the header is small
    n = up.read_map_header()
    d: dict = {}
    for i in range(n):
        key = up.unpack()
        if key == "tokens" and i == n - 1:
            pos = up.tell()
            if data[pos] == 0xC6:  # bin32: the arrays run to the end of the message
                size = int.from_bytes(data[pos + 1 : pos + 5], "big")
                if pos + 5 + size != len(data):
                    raise ValueError(f"tokens: {size} bytes declared, {len(data) - pos - 5} follow")
                return d, memoryview(data)[pos + 5 :]
        d[key] = up.unpack()
    if up.tell() != len(data):
        raise ValueError(f"{len(data) - up.tell()} bytes after the message")
    return d, None


def decode(
    data: bytes | bytearray | memoryview,
    *,
    expect: type | tuple[type, ...] | None = None,
    in_place: bool = False,
) -> Message:
    """Unpack and validate one message. Raises only :class:`WireError`.

    Decoded arrays are views into the message, so a buffer that is not ``bytes`` is copied first,
    unless ``in_place``: the caller hands over a buffer nothing will write to again (the transport's
    received nng messages)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message is {len(data)} bytes, over the {MAX_MESSAGE_BYTES} limit")
    if not isinstance(data, bytes) and not in_place:
        data = bytes(data)
    try:
        d, tokens = _unpack(data)
    except Exception as e:  # msgpack raises many types on garbage; all mean "not a message"
        raise WireError(f"not a msgpack message: {type(e).__name__}: {e}") from None
    if not isinstance(d, dict):
        raise WireError(f"expected a msgpack map, got {type(d).__name__}")
    kind = d.get("kind")
    if not isinstance(kind, str) or kind not in MESSAGES:
        raise WireError(f"unknown message kind {kind!r}")
    v = d.get("v")
    if v != SCHEMA_VERSION:
        raise WireError(f"{kind}: schema version {v!r}, this build speaks {SCHEMA_VERSION}")
    if tokens is not None and kind not in _GROUPED:
        raise WireError(f"{kind}: unexpected field 'tokens'")
    try:
        msg = _build(kind, d, tokens)
    except WireError:
        raise
    except Exception as e:  # any surprise in validation is still a bad message, never a crash
        raise WireError(f"{kind}: invalid message: {type(e).__name__}: {e}") from None
    if expect is not None and not isinstance(msg, expect):
        raise WireError(f"unexpected message kind {kind!r} here")
    return msg

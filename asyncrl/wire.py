"""Every message a process can send another, and the one codec for them (DESIGN §3).

Messages are msgpack maps ``{"kind": ..., "v": SCHEMA_VERSION, ...fields}``. Per-token arrays travel as
raw little-endian ``bin`` (int32 ids and versions, float32 logprobs and masks): packing lists of numbers
is ~15x slower. A group travels as columns (one ``bin`` per array for all its samples, plus per-sample
lengths), so the codec's Python work is per group, not per sample. Decoding validates every field and raises only :class:`WireError`, so a service can
answer a bad message with an error reply and keep serving. Nothing is ever pickled.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

SCHEMA_VERSION = 1

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
        """The oldest version among the policy's own tokens (DESIGN §2)."""
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
    samples: list[Sample]
    prompt_index: int = -1  # position in the dataset, for the resumable data position
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def behavior_version(self) -> int:
        return min(s.behavior_version for s in self.samples)

    @property
    def rewards(self) -> list[float]:
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
    world_size: int = 1  # GPUs (tp x pp) of this server: the ranks it takes in the weight group
    kind: str = "sglang"  # sglang | builtin


@dataclass(kw_only=True)
class Register:
    """A worker tells the learner which generators it drives, so they receive weights."""

    kind: ClassVar[str] = "register"
    worker_id: str
    generators: list[GeneratorInfo]


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
)

_ARRAYS = {
    "prompt_ids": _I32,
    "completion_ids": _I32,
    "behavior_logprobs": _F32,
    "versions": _I32,
    "loss_mask": _F32,
}
_PER_TOKEN = ("behavior_logprobs", "versions", "loss_mask")
_FINISH = ("stop", "length", "abort")


# --------------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------------


def _group_plain(g: Group) -> dict[str, Any]:
    """A group's samples as columns: one ``bin`` per per-token array for the whole group.

    This is the hot path of every Put: building and validating a Python object per field per sample
    cost ~16 µs a sample; columns make the codec's cost per group, not per sample (DESIGN §3 budget).
    """
    ss = g.samples
    for i, s in enumerate(ss):
        if s.group_id != g.id:
            raise WireError(
                f"group.samples[{i}].group_id: {s.group_id!r} is not the group's {g.id!r}"
            )
    cols: dict[str, Any] = {
        "id": [s.id for s in ss],
        "reward": np.array([s.reward for s in ss], dtype=_F64).tobytes(),
        "finish_reason": [s.finish_reason for s in ss],
        "metadata": [_to_plain(s.metadata) if s.metadata else {} for s in ss],
        "prompt_len": np.array([len(s.prompt_ids) for s in ss], dtype=_I32).tobytes(),
        "completion_len": np.array([len(s.completion_ids) for s in ss], dtype=_I32).tobytes(),
    }
    for k, dt in _ARRAYS.items():
        parts = [np.asarray(getattr(s, k), dtype=dt).reshape(-1) for s in ss]
        cols[k] = np.concatenate(parts).data if parts else b""  # msgpack packs the buffer: no copy
    return {
        "id": g.id,
        "lease_id": g.lease_id,
        "samples": cols,
        "prompt_index": g.prompt_index,
        "metadata": _to_plain(g.metadata) if g.metadata else {},
    }


def _to_plain(obj: Any) -> Any:
    if obj is None or type(obj) in (str, int, float, bool, bytes):
        return obj
    if isinstance(obj, Group):
        return _group_plain(obj)
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [_to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def encode(msg: Message) -> bytes:
    """Pack a message. Raises :class:`WireError` if it does not fit the limits."""
    kind = getattr(type(msg), "kind", None)
    if kind not in MESSAGES:
        raise WireError(f"cannot encode {type(msg).__name__}: not a wire message")
    body = {"kind": kind, "v": SCHEMA_VERSION, **_to_plain(msg)}
    try:
        data = msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"cannot encode {kind}: {e}") from None
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"{kind} message is {len(data)} bytes, over the {MAX_MESSAGE_BYTES} limit")
    return data


# --------------------------------------------------------------------------------------------------
# Decoding: validate everything, raise only WireError
# --------------------------------------------------------------------------------------------------


def _req(d: dict, key: str, types: type | tuple, where: str) -> Any:
    if key not in d:
        raise WireError(f"{where}: missing field '{key}'")
    v = d[key]
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


def _array(d: dict, key: str, where: str) -> np.ndarray:
    """A group's concatenated column; its size is bounded by the message size limit."""
    raw = _req(d, key, bytes, where)
    dt = _ARRAYS[key]
    if len(raw) % dt.itemsize:
        raise WireError(f"{where}.{key}: {len(raw)} bytes is not a whole number of {dt.name}")
    return np.frombuffer(raw, dtype=dt)


def _column(cols: dict, key: str, dt: np.dtype, n: int, where: str) -> np.ndarray:
    raw = _req(cols, key, bytes, where)
    if len(raw) != n * dt.itemsize:
        raise WireError(f"{where}.{key}: {len(raw)} bytes, expected {n} {dt.name} (one per sample)")
    return np.frombuffer(raw, dtype=dt)


def _values_ok(lp: np.ndarray, ver: np.ndarray, mask: np.ndarray) -> bool:
    """Whole-group value checks without temporaries (a NaN makes min and max NaN, which fails)."""
    lo, hi = lp.min(), lp.max()
    m_lo, m_hi = mask.min(), mask.max()
    return bool(
        np.isfinite(lo)
        and hi <= 1e-3
        and ver.min() >= 0
        and m_lo >= 0
        and m_hi <= 1
        and np.count_nonzero(mask) == np.count_nonzero(mask == 1)
    )


def _first_bad(bad: np.ndarray, ends: np.ndarray) -> int:
    """The index of the sample holding the first flagged token."""
    return int(np.searchsorted(ends, int(np.argmax(bad)), side="right"))


def _group(d: Any, where: str) -> Group:
    if not isinstance(d, dict):
        raise WireError(f"{where}: expected a map, got {type(d).__name__}")
    gid = _req(d, "id", str, where)
    cols = _req(d, "samples", dict, where)
    w = f"{where}.samples"
    ids = _str_list(cols, "id", w)
    n = len(ids)
    if not n:
        raise WireError(f"{w}: a group needs at least one sample")
    if len(set(ids)) != n:
        dup = next(x for i, x in enumerate(ids) if x in ids[:i])
        raise WireError(f"{w}.id: duplicate sample id {dup!r}")
    rewards = _column(cols, "reward", _F64, n, w)
    if not np.isfinite(rewards).all():
        raise WireError(f"{w}[{int(np.argmax(~np.isfinite(rewards)))}].reward: must be finite")
    finish = _str_list(cols, "finish_reason", w)
    metas = _req(cols, "metadata", list, w)
    for key, col in (("finish_reason", finish), ("metadata", metas)):
        if len(col) != n:
            raise WireError(f"{w}.{key}: {len(col)} entries, but the group has {n} samples")
    for i, f in enumerate(finish):
        if f not in _FINISH:
            raise WireError(f"{w}[{i}].finish_reason: expected stop, length or abort, got {f!r}")
    for i, m in enumerate(metas):
        if not isinstance(m, dict) or not all(isinstance(k, str) for k in m):
            raise WireError(f"{w}[{i}].metadata: expected a map with string keys")
    lens = {}
    for key in ("prompt_len", "completion_len"):
        lens[key] = _column(cols, key, _I32, n, w).astype(np.int64)
        if (lens[key] < 0).any() or (lens[key] > MAX_TOKENS).any():
            raise WireError(f"{w}.{key}: lengths must be in [0, {MAX_TOKENS}]")
    arrays = {k: _array(cols, k, w) for k in _ARRAYS}
    for k, total_of in (("prompt_ids", "prompt_len"), ("completion_ids", "completion_len")):
        if len(arrays[k]) != lens[total_of].sum():
            raise WireError(
                f"{w}.{k}: {len(arrays[k])} entries, but {total_of} adds up to {lens[total_of].sum()}"
            )
    t = len(arrays["completion_ids"])
    for k in _PER_TOKEN:
        if len(arrays[k]) != t:
            raise WireError(
                f"{w}.{k}: {len(arrays[k])} entries, but completion_ids has {t} (one per token)"
            )
    ends = np.cumsum(lens["completion_len"])
    lp, ver, mask = arrays["behavior_logprobs"], arrays["versions"], arrays["loss_mask"]
    if t and not _values_ok(lp, ver, mask):  # reductions only; on failure, name the sample
        for bad, k, why in (
            (~np.isfinite(lp), "behavior_logprobs", "must be finite"),
            (lp > 1e-3, "behavior_logprobs", "a log-probability cannot be positive"),
            (ver < 0, "versions", "must be >= 0"),
            ((mask != 0) & (mask != 1), "loss_mask", "entries must be 0 or 1"),
        ):
            if bad.any():
                raise WireError(f"{w}[{_first_bad(bad, ends)}].{k}: {why}")
    bounds = {}
    for key in ("prompt_len", "completion_len"):
        e = np.cumsum(lens[key]).tolist()
        bounds[key] = list(zip([0, *e[:-1]], e, strict=True))
    samples = []
    for i in range(n):
        (p0, p1), (c0, c1) = bounds["prompt_len"][i], bounds["completion_len"][i]
        samples.append(
            Sample(
                id=ids[i],
                group_id=gid,
                prompt_ids=arrays["prompt_ids"][p0:p1],
                completion_ids=arrays["completion_ids"][c0:c1],
                behavior_logprobs=lp[c0:c1],
                versions=ver[c0:c1],
                loss_mask=mask[c0:c1],
                reward=float(rewards[i]),
                finish_reason=finish[i],
                metadata=metas[i],
            )
        )
    return Group(
        id=gid,
        lease_id=_opt(d, "lease_id", str, where, ""),
        samples=samples,
        prompt_index=_opt(d, "prompt_index", int, where, -1),
        metadata=_metadata(d, where),
    )


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


def _build(kind: str, d: dict) -> Message:
    w = kind
    if kind == "group":
        return _group(d, w)
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
        groups = _req(d, "groups", list, w)
        return Put(
            worker_id=_req(d, "worker_id", str, w),
            groups=[_group(g, f"{w}.groups[{i}]") for i, g in enumerate(groups)],
        )
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
    raise WireError(f"unknown message kind {kind!r}")  # pragma: no cover - guarded by MESSAGES


def decode(data: bytes, *, expect: type | tuple[type, ...] | None = None) -> Message:
    """Unpack and validate one message. Raises only :class:`WireError`."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message is {len(data)} bytes, over the {MAX_MESSAGE_BYTES} limit")
    try:
        d = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_bin_len=MAX_MESSAGE_BYTES,
            max_str_len=MAX_STR,
            max_array_len=MAX_ITEMS,
            max_map_len=MAX_ITEMS,
            max_ext_len=0,
        )
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
    try:
        msg = _build(kind, d)
    except WireError:
        raise
    except Exception as e:  # any surprise in validation is still a bad message, never a crash
        raise WireError(f"{kind}: invalid message: {type(e).__name__}: {e}") from None
    if expect is not None and not isinstance(msg, expect):
        raise WireError(f"unexpected message kind {kind!r} here")
    return msg

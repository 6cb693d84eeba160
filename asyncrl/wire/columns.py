"""Groups as columns: how the samples of a ``group`` or ``put`` message travel (pure, no I/O).

The codec's Python work is per message, not per sample: a message's ``groups`` holds each group's
own fields and its sample count ``n``; ``samples`` holds the per-sample columns (ids, finish reasons
and metadata as lists; rewards and prompt/completion lengths as raw little-endian ``bin``); and
``tokens`` is every sample's per-token arrays (:data:`TOKEN_ARRAYS`), array by array, each in sample
order. An optional per-token array (:data:`OPTIONAL_ARRAYS`, e.g. a teacher's logprobs) travels in
``samples`` under its name, all samples' entries joined, when the message's samples have it: all
of them or none (an entry a message has no key for is absent: messages from before it decode).
Routed experts (``Sample.routed_experts``, ``[num_tokens - 1, moe_layers, top_k]`` a sample) travel
the same way, in ``samples``: ``routed_experts`` (every sample's rows joined), its dtype
``routed_experts_dtype`` (the narrowest that holds the message's largest id) and
``routed_experts_shape`` ``[moe_layers, top_k]``, one for the message. A decoded group's arrays
are views into the received message, and its :class:`Sample` objects are built only when someone
looks at them (:class:`SampleList`).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np

from asyncrl.wire import validate
from asyncrl.wire.messages import (
    FINISH_REASONS,
    MAX_ITEMS,
    MAX_TOKENS,
    ROUTE_DTYPES,
    Group,
    Sample,
    TokenArray,
    WireError,
    route_dtype,
)


def _token_arrays() -> dict[str, TokenArray]:
    """The :class:`Sample` fields marked as per-token arrays, in field order."""
    out = {}
    for name, hint in typing.get_type_hints(Sample, include_extras=True).items():
        marks = [x for x in typing.get_args(hint)[1:] if isinstance(x, TokenArray)]
        if typing.get_origin(hint) is typing.Annotated and marks:
            out[name] = marks[0]
    return out


_ALL_MARKED = _token_arrays()
_MARKED = {k: t for k, t in _ALL_MARKED.items() if not t.optional}
TOKEN_ARRAYS: dict[str, np.dtype] = {k: t.dtype for k, t in _MARKED.items()}
"""A sample's per-token arrays and their dtypes, in the order they sit in ``tokens``."""
OPTIONAL_ARRAYS: dict[str, np.dtype] = {k: t.dtype for k, t in _ALL_MARKED.items() if t.optional}
"""A sample's optional per-token arrays (over its completion) and their dtypes."""
_OVER_PROMPT = frozenset(k for k, t in _MARKED.items() if t.over == "prompt")
_PER_TOKEN = tuple(  # the arrays that must have one entry per completion token
    k for k, t in _MARKED.items() if t.over == "completion" and k != "completion_ids"
)
_PROMPT_ITEM_BYTES = sum(t.dtype.itemsize for t in _MARKED.values() if t.over == "prompt")
_COMPLETION_ITEM_BYTES = sum(t.dtype.itemsize for t in _MARKED.values() if t.over == "completion")
_I32 = np.dtype("<i4")
_F64 = np.dtype("<f8")
_GROUP_OWN = validate.Schema(Group, skip=frozenset({"samples"}))  # a group's fields in ``groups``
_HEAD = attrgetter(*_GROUP_OWN.names)


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
                    **{k: v[q[i] : q[i + 1]] for k, v in c.optional.items()},
                    **(
                        {}
                        if c.routes is None
                        else {"routed_experts": c.routes[c.route_ends[i] : c.route_ends[i + 1]]}
                    ),
                )
                for i in range(self._lo, self._hi)
            ]
        return self._items

    @property
    def rewards(self) -> list[float] | None:
        """The rewards column while no sample is built (then a sample may have been changed)."""
        if self._items is not None:
            return None
        return self._cols.rewards[self._lo : self._hi]

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
        ends = c.prompt_ends if name in _OVER_PROMPT else c.completion_ends
        return c.arrays[name][ends[cols._lo] : ends[cols._hi]]
    dt = TOKEN_ARRAYS[name]
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
    optional: dict[str, Any] = dataclasses.field(default_factory=dict)  # those present, as arrays
    # routed experts ``[rows, moe_layers, top_k]``: one array (decoded) or pieces (encoding)
    routes: Any = None

    @functools.cached_property
    def prompt_ends(self) -> list[int]:  # n + 1 offsets into prompt_ids
        return [0, *itertools.accumulate(self.prompt_lens)]

    @functools.cached_property
    def route_ends(self) -> list[int]:  # n + 1 offsets into the routes' rows
        rows = map(route_rows, self.prompt_lens, self.completion_lens)
        return [0, *itertools.accumulate(rows)]

    @functools.cached_property
    def completion_ends(self) -> list[int]:  # n + 1 offsets into the per-token arrays
        return [0, *itertools.accumulate(self.completion_lens)]


_DTYPE, _SIZE, _GROUP_ID = attrgetter("dtype"), attrgetter("size"), attrgetter("group_id")
_FIELDS = attrgetter(
    "id", "reward", "finish_reason", "metadata", *TOKEN_ARRAYS
)  # a sample's columns


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
        arrays={k: [v[p0:p1] if k in _OVER_PROMPT else v[q0:q1]] for k, v in c.arrays.items()},
        optional={k: [v[q0:q1]] for k, v in c.optional.items()},
        routes=None if c.routes is None else [c.routes[c.route_ends[lo] : c.route_ends[hi]]],
    )


def route_rows(prompt_len: int, completion_len: int) -> int:
    """A sample's routed-expert rows: its input positions, every token but the last."""
    return max(prompt_len + completion_len - 1, 0)


def _route_columns(
    ss: list[Sample], prompt_lens: list[int], done: list[int], at: Callable[[int], str]
) -> list[np.ndarray] | None:
    """The samples' routed experts as pieces to join, all in one dtype and ``[moe_layers,
    top_k]`` (None: no sample has them); WireError naming the first sample whose routes are
    missing while another's are there, or whose shape disagrees with its tokens or the others'."""
    parts = [getattr(s, "routed_experts", None) for s in ss]
    have = [p is not None and np.size(p) > 0 for p in parts]
    if not any(have):
        return None
    shape: tuple[int, ...] | None = None
    arrays: list[np.ndarray | None] = []
    for i, (p, pl, cl) in enumerate(zip(parts, prompt_lens, done, strict=True)):
        rows = route_rows(pl, cl)
        if not have[i]:
            if rows:
                raise WireError(
                    f"{at(i)}.routed_experts: missing, but other samples of the message have them "
                    "(all or none)"
                )
            arrays.append(None)
            continue
        a = np.asarray(p)
        if a.ndim != 3 or a.dtype.kind not in "iu":
            raise WireError(
                f"{at(i)}.routed_experts: expected integer expert ids [positions, moe_layers, "
                f"top_k], got {a.dtype.name} of shape {list(a.shape)}"
            )
        if a.shape[0] != rows:
            raise WireError(
                f"{at(i)}.routed_experts: {a.shape[0]} positions, but the sample's {pl} prompt and "
                f"{cl} completion tokens have {rows} (all but the last token)"
            )
        if shape is None:
            shape = a.shape[1:]
        elif a.shape[1:] != shape:
            raise WireError(
                f"{at(i)}.routed_experts: [moe_layers, top_k] {list(a.shape[1:])}, but another "
                f"sample of the message has {list(shape)}"
            )
        if a.min() < 0 or a.max() >= 1 << 31:
            raise WireError(f"{at(i)}.routed_experts: expert ids must be in [0, 2^31)")
        arrays.append(a)
    assert shape is not None
    dt = route_dtype(1 + max(int(a.max()) for a in arrays if a is not None))
    return [np.zeros((0, *shape), dt) if a is None else a.astype(dt, copy=False) for a in arrays]


def _sample_columns(ss: list[Sample], at: Callable[[int], str]) -> _Columns:
    """Samples (at least one) as columns, gathered in one C-level pass (``map``, then ``zip`` to
    transpose) however many groups they come from; the arrays as the pieces to join. ``at(i)``
    names sample ``i`` in errors."""
    ids, rewards, finish, metadata, *columns = zip(*map(_FIELDS, ss), strict=True)
    arrays: dict[str, list] = {}
    sizes: dict[str, list[int]] = {}
    for (k, dt), column in zip(TOKEN_ARRAYS.items(), columns, strict=True):
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
        optional=_optional_columns(ss, done, at),
        routes=_route_columns(ss, sizes["prompt_ids"], done, at),
    )


def _optional_columns(
    ss: list[Sample], done: list[int], at: Callable[[int], str]
) -> dict[str, list[np.ndarray]]:
    """The optional arrays the samples have (all of them: one entry per completion token), as
    pieces to join; WireError naming a sample that has one while another has none, or whose
    length is not its completion's."""
    out = {}
    for k, dt in OPTIONAL_ARRAYS.items():
        parts = []
        for i, s in enumerate(ss):
            try:
                parts.append(np.asarray(getattr(s, k), dtype=dt).reshape(-1))
            except (TypeError, ValueError, OverflowError) as e:
                raise WireError(f"{at(i)}.{k}: not convertible to {dt.name}: {e}") from None
        have = [p.size > 0 for p in parts]
        if not any(have):
            continue
        for i, (p, n) in enumerate(zip(parts, done, strict=True)):
            if p.size != n and (n or have[i]):
                raise WireError(
                    f"{at(i)}.{k}: {p.size} entries, but completion_ids has {n} (one per token, "
                    "on every sample of the message when one has them)"
                )
        out[k] = parts
    return out


def _concat(cols: list[_Columns], kind: str) -> _Columns:
    """One set of columns from several (a message mixing built and decoded groups); most
    messages have one, which is returned as it is."""
    if len(cols) == 1:
        return cols[0]
    for k in OPTIONAL_ARRAYS:
        have = [k in c.optional or not sum(c.completion_lens) for c in cols]
        if any(k in c.optional for c in cols) and not all(have):
            raise WireError(f"{kind}: some groups' samples have {k} and others' do not")
    routes = None
    if any(c.routes is not None for c in cols):
        shapes = {p.shape[1:] for c in cols if c.routes is not None for p in c.routes}
        if len(shapes) > 1:
            raise WireError(f"{kind}: groups' routed_experts have different [moe_layers, top_k]")
        for c in cols:
            if c.routes is None and sum(map(route_rows, c.prompt_lens, c.completion_lens)):
                raise WireError(f"{kind}: some groups' samples have routed_experts and others' not")
        dt = max((p.dtype for c in cols if c.routes is not None for p in c.routes), key=_WIDTH)
        (shape,) = shapes
        routes = [
            p.astype(dt, copy=False)
            for c in cols
            for p in (c.routes if c.routes is not None else [np.zeros((0, *shape), dt)])
        ]
    return _Columns(
        routes=routes,
        ids=[x for c in cols for x in c.ids],
        rewards=[x for c in cols for x in c.rewards],
        finish=[x for c in cols for x in c.finish],
        metadata=[x for c in cols for x in c.metadata],
        prompt_lens=[x for c in cols for x in c.prompt_lens],
        completion_lens=[x for c in cols for x in c.completion_lens],
        arrays={k: [p for c in cols for p in c.arrays[k]] for k in TOKEN_ARRAYS},
        optional={
            k: [p for c in cols for p in c.optional.get(k, [np.zeros(0, OPTIONAL_ARRAYS[k])])]
            for k in OPTIONAL_ARRAYS
            if any(k in c.optional for c in cols)
        },
    )


@dataclass
class Encoded:
    """A message's groups as its ``groups`` and ``samples`` entries and the pieces of ``tokens``."""

    heads: list[dict[str, Any]]
    samples: dict[str, Any]
    tokens: list[Any]  # arrays (or bytes-like pieces) to join, in order
    tokens_bytes: int


def to_columns(kind: str, groups: Sequence[Group]) -> Encoded:
    """The groups of a ``kind`` message as columns; raises :class:`WireError` naming the sample."""
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
        heads.append(dict(zip(_GROUP_OWN.names, _HEAD(g), strict=True), n=len(ss)))
    flush()
    c = _concat(cols, kind)
    return Encoded(
        heads=heads,
        samples={
            "id": c.ids,
            "reward": np.array(c.rewards, dtype=_F64).tobytes(),
            "finish_reason": c.finish,
            "metadata": c.metadata,
            "prompt_len": np.array(c.prompt_lens, dtype=_I32).tobytes(),
            "completion_len": np.array(c.completion_lens, dtype=_I32).tobytes(),
            **{
                k: np.concatenate(parts).astype(OPTIONAL_ARRAYS[k], copy=False).tobytes()
                for k, parts in c.optional.items()
            },
            **({} if c.routes is None else _route_entries(c.routes)),
        },
        tokens=list(itertools.chain.from_iterable(c.arrays[k] for k in TOKEN_ARRAYS)),
        tokens_bytes=_PROMPT_ITEM_BYTES * sum(c.prompt_lens)
        + _COMPLETION_ITEM_BYTES * sum(c.completion_lens),
    )


_WIDTH = ROUTE_DTYPES.index


def _route_entries(pieces: list[np.ndarray]) -> dict[str, Any]:
    """``samples``' routed-expert entries: the rows joined, their dtype and ``[layers, top_k]``."""
    dt = max((p.dtype for p in pieces), key=_WIDTH)
    return {
        "routed_experts": np.concatenate(pieces).astype(dt, copy=False).tobytes(),
        "routed_experts_dtype": dt.str,
        "routed_experts_shape": list(pieces[0].shape[1:]),
    }


def _routes_from(cols: dict, c: _Columns, w: str, at: Callable[[int], str]) -> np.ndarray | None:
    """A message's routed experts ``[rows, moe_layers, top_k]``, checked against its samples'
    token counts; None when it has none."""
    if "routed_experts" not in cols:
        return None
    raw = validate.required(cols, "routed_experts", bytes, w)
    name = validate.required(cols, "routed_experts_dtype", str, w)
    names = {d.str: d for d in ROUTE_DTYPES}
    if name not in names:
        raise WireError(f"{w}.routed_experts_dtype: expected one of {sorted(names)}, got {name!r}")
    dt = names[name]
    shape = validate.required(cols, "routed_experts_shape", list, w)
    if len(shape) != 2 or not all(type(x) is int and 1 <= x <= MAX_ITEMS for x in shape):
        raise WireError(f"{w}.routed_experts_shape: expected [moe_layers, top_k], got {shape!r}")
    rows = c.route_ends[-1]
    if len(raw) != rows * shape[0] * shape[1] * dt.itemsize:
        raise WireError(
            f"{w}.routed_experts: {len(raw)} bytes, but the samples' tokens call for {rows} "
            f"positions of {shape} {dt.name} (each sample's tokens but its last)"
        )
    routes = np.frombuffer(raw, dtype=dt).reshape(rows, *shape)
    if dt.kind == "i" and routes.size and routes.min() < 0:
        first = int(np.argmax((routes < 0).reshape(rows, -1).any(1)))
        i = int(np.searchsorted(c.route_ends[1:], first, side="right"))
        raise WireError(f"{at(i)}.routed_experts: expert ids must be >= 0")
    return routes


def _column(cols: dict, key: str, dt: np.dtype, n: int, where: str) -> np.ndarray:
    raw = validate.required(cols, key, bytes, where)
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


def from_columns(d: dict, tokens: Any, where: str) -> list[Group]:
    """The groups of a ``group`` or ``put`` message map, validated; ``tokens`` is the message's
    ``tokens`` entry when the codec found it in place (else it is read from ``d``). Samples are
    built lazily."""
    heads = validate.required(d, "groups", list, where)
    cols = validate.required(d, "samples", dict, where)
    w = f"{where}.samples"
    ids = validate.str_list(validate.required(cols, "id", list, w), w, "id")
    n = len(ids)

    def group_at(i: int) -> str:  # group i of the message, for errors
        return where if where == "group" else f"{where}.groups[{i}]"

    sizes = [h.get("n") if type(h) is dict else None for h in heads]
    if not all(type(x) is int and 1 <= x <= MAX_ITEMS for x in sizes):  # name the first bad one
        for i, h in enumerate(heads):
            if not isinstance(h, dict):
                raise WireError(f"{group_at(i)}: expected a map, got {type(h).__name__}")
            n_at = validate.required(h, "n", int, group_at(i))
            validate.bounded(n_at, group_at(i), "n", 1, MAX_ITEMS)
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
    finish = validate.str_list(
        validate.required(cols, "finish_reason", list, w), w, "finish_reason"
    )
    metas = validate.required(cols, "metadata", list, w)
    for key, col in (("finish_reason", finish), ("metadata", metas)):
        if len(col) != n:
            raise WireError(f"{w}.{key}: {len(col)} entries, but there are {n} samples")
    if not set(finish) <= set(FINISH_REASONS):
        i = next(i for i, f in enumerate(finish) if f not in FINISH_REASONS)
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
        tokens = validate.required(d, "tokens", bytes, where)
    need = _PROMPT_ITEM_BYTES * prompt_total + _COMPLETION_ITEM_BYTES * total
    if len(tokens) != need:
        raise WireError(
            f"{where}.tokens: {len(tokens)} bytes, but prompt_len and completion_len call for "
            f"{need} ({prompt_total} prompt and {total} completion tokens)"
        )
    arrays, pos = {}, 0
    for k, dt in TOKEN_ARRAYS.items():
        count = prompt_total if k in _OVER_PROMPT else total
        arrays[k] = np.frombuffer(tokens, dtype=dt, count=count, offset=pos)
        pos += count * dt.itemsize
    lp, ver, mask = arrays["behavior_logprobs"], arrays["versions"], arrays["loss_mask"]
    optional = {}
    for k, dt in OPTIONAL_ARRAYS.items():
        if k not in cols:
            continue
        raw = validate.required(cols, k, bytes, w)
        if len(raw) != total * dt.itemsize:
            raise WireError(
                f"{w}.{k}: {len(raw)} bytes, but completion_len calls for {total} {dt.name}"
            )
        optional[k] = np.frombuffer(raw, dtype=dt)
    c = _Columns(
        ids=ids,
        rewards=rewards,
        finish=finish,
        metadata=metas,
        prompt_lens=lens["prompt_len"],
        completion_lens=lens["completion_len"],
        arrays=arrays,
        optional=optional,
    )
    c.routes = _routes_from(cols, c, w, at)
    for k, arr in optional.items():  # log-probabilities, as the behaviour's
        bad = ~np.isfinite(arr) | (arr > 1e-3)
        if bad.any():
            i = int(np.searchsorted(c.completion_ends[1:], int(np.argmax(bad)), side="right"))
            raise WireError(f"{at(i)}.{k}: must be a finite log-probability (<= 0)")
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
        try:  # the group's path is formatted only to name it in an error
            own = _GROUP_OWN.arguments(h, where)
        except WireError:
            own = _GROUP_OWN.arguments(h, group_at(i))
        if not unique and len(set(ids[lo : lo + size])) != size:
            mine = ids[lo : lo + size]
            dup = next(x for j, x in enumerate(mine) if x in mine[:j])
            raise WireError(f"{group_at(i)}.samples.id: duplicate sample id {dup!r}")
        out.append(Group(**own, samples=SampleList(c, lo, lo + size, own["id"])))
        lo += size
    return out

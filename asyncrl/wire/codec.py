"""The one codec for every message: msgpack framing, and dispatch to fields or columns.

Messages are msgpack maps ``{"kind": ..., "v": SCHEMA_VERSION, ...fields}``. Nothing is ever pickled.
A message carrying groups (``group``, ``put``) has them as columns (:mod:`asyncrl.wire.columns`),
and ``tokens``, the map's last entry, is one ``bin`` with every sample's per-token arrays. Any
msgpack reader can read the message; ours finds ``tokens`` at the end and reads the arrays straight
out of the received bytes (no copy). Decoding checks every field (:mod:`asyncrl.wire.validate`) and
raises only :class:`WireError`, so a service can answer a bad message with an error reply and keep
serving.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np

from asyncrl.wire import columns, validate
from asyncrl.wire.messages import (
    MAX_ITEMS,
    MAX_MESSAGE_BYTES,
    MAX_STR,
    MESSAGES,
    SCHEMA_VERSION,
    Group,
    Message,
    Put,
    WireError,
)

_GROUPED = ("group", "put")  # the kinds that carry groups, in columns
_SCHEMAS = {kind: validate.Schema(cls) for kind, cls in MESSAGES.items() if kind not in _GROUPED}
_PUT_OWN = validate.Schema(Put, skip=frozenset({"groups"}))  # a put's fields but its groups
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


# --------------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------------


def _plain_default(obj: Any) -> Any:
    """msgpack's hook for what it cannot pack itself: numpy scalars and nested dataclasses."""
    if isinstance(obj, np.generic):
        return obj.item()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    raise TypeError(f"cannot pack {type(obj).__name__}")


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, default=_plain_default)


def _encode_grouped(kind: str, fields: dict[str, Any], groups: list[Group]) -> bytes:
    """A message carrying groups: the map's fields, then ``tokens`` last, built in one join."""
    enc = columns.to_columns(kind, groups)
    body = {
        "kind": kind,
        "v": SCHEMA_VERSION,
        **fields,
        "groups": enc.heads,
        "samples": enc.samples,
    }
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
            _TOKENS_KEY + b"\xc6" + enc.tokens_bytes.to_bytes(4, "big"),
        )
    )
    try:
        return b"".join([prefix, *enc.tokens])
    except (BufferError, ValueError, TypeError):  # a non-contiguous array: copy it first
        return b"".join([prefix, *(np.ascontiguousarray(p) for p in enc.tokens)])


def encode(msg: Message) -> bytes:
    """Pack a message. Raises :class:`WireError` if it does not fit the limits."""
    kind = getattr(type(msg), "kind", None)
    if kind not in MESSAGES:
        raise WireError(f"cannot encode {type(msg).__name__}: not a wire message")
    try:
        if isinstance(msg, Group):
            data = _encode_grouped(kind, {}, [msg])
        elif isinstance(msg, Put):
            data = _encode_grouped(kind, {"worker_id": msg.worker_id}, msg.groups)
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
# Decoding: check everything, raise only WireError
# --------------------------------------------------------------------------------------------------


def _build(kind: str, d: dict, tokens: memoryview | None) -> Message:
    if kind == "group":
        groups = columns.from_columns(d, tokens, kind)
        if len(groups) != 1:
            raise WireError(f"group: carries {len(groups)} groups, expected 1")
        return groups[0]
    if kind == "put":
        own = _PUT_OWN.arguments(d, kind)
        return Put(**own, groups=columns.from_columns(d, tokens, kind))
    return _SCHEMAS[kind].build(d, kind)


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

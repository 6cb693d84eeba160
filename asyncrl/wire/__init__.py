"""The wire format: every message a process can send another, and the one codec for them
(docs/design.md §3).

- :mod:`asyncrl.wire.messages`: the message dataclasses, which are the schema, and the limits;
- :mod:`asyncrl.wire.validate`: a received map checked against a dataclass's fields and type hints;
- :mod:`asyncrl.wire.columns`: the samples of ``group`` and ``put`` messages as columns, read in
  place and built into :class:`Sample` objects only when someone looks at them;
- :mod:`asyncrl.wire.codec`: :func:`encode` and :func:`decode`, msgpack framing for all of them.

Callers use this package's names (``wire.Put``, ``wire.encode``...).
"""

from asyncrl.wire.codec import decode, encode
from asyncrl.wire.columns import OPTIONAL_ARRAYS, TOKEN_ARRAYS, SampleList, group_tokens
from asyncrl.wire.messages import (
    FINISH_REASONS,
    MAX_ITEMS,
    MAX_MESSAGE_BYTES,
    MAX_STR,
    MAX_TOKENS,
    MESSAGES,
    ROUTE_DTYPES,
    SCHEMA_VERSION,
    Ack,
    Acquire,
    End,
    Error,
    GeneratorInfo,
    Grant,
    Group,
    Message,
    Ok,
    Put,
    Register,
    Release,
    Sample,
    Status,
    StatusReply,
    Version,
    WireError,
    route_dtype,
)

__all__ = [
    "FINISH_REASONS",
    "MAX_ITEMS",
    "MAX_MESSAGE_BYTES",
    "MAX_STR",
    "MAX_TOKENS",
    "MESSAGES",
    "SCHEMA_VERSION",
    "OPTIONAL_ARRAYS",
    "ROUTE_DTYPES",
    "TOKEN_ARRAYS",
    "Ack",
    "Acquire",
    "End",
    "Error",
    "GeneratorInfo",
    "Grant",
    "Group",
    "Message",
    "Ok",
    "Put",
    "Register",
    "Release",
    "Sample",
    "SampleList",
    "Status",
    "StatusReply",
    "Version",
    "WireError",
    "decode",
    "encode",
    "group_tokens",
    "route_dtype",
]

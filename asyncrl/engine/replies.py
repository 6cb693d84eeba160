"""What an endpoint returns, the error that becomes a 4xx, and the field checks that raise it. No
torch here: the HTTP layer and the CLI import this without loading the model stack."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class Reply:
    status: int = 200
    body: Any = None  # dict/list -> JSON, str -> text/plain, None -> empty
    stream: Iterator[bytes] | None = None  # Server-Sent Events


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, body: Any = None):
        super().__init__(message)
        self.status = status
        self.body = body if body is not None else {"error": {"message": message}}


def ok(message: str) -> Reply:
    """SGLang's success shape for control endpoints."""
    return Reply(200, {"success": True, "message": message})


def fail(message: str, status: int = 400, **extra) -> Reply:
    """SGLang's failure shape for control endpoints (``success: false`` and the reason)."""
    return Reply(status, {"success": False, "message": message, **extra})


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def field(body: dict, key: str, typ, default: Any = ...) -> Any:
    """``body[key]`` of type ``typ`` (never a bool), or ``default``; a BadRequest naming the key."""
    if key not in body:
        if default is ...:
            raise BadRequest(f"`{key}` is required")
        return default
    v = body[key]
    if not isinstance(v, typ) or isinstance(v, bool):
        raise BadRequest(f"`{key}` has the wrong type ({type(v).__name__})")
    return v

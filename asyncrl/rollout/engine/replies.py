"""What an endpoint returns, and the error that becomes a 4xx. No torch here: the HTTP layer and the
CLI import this without loading the model stack."""

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

"""Ports that stay what a test needs them to be while it runs.

A port found free, closed, and used a moment later can be taken in between by another xdist
worker's server (the suite runs two at a time): a test expecting "nothing listens there" would
then reach a stranger. A socket bound but never listening holds the port for the test and refuses
every connection to it (Linux answers a SYN there with a reset: ECONNREFUSED)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def unlistened_port(*, reuse: bool = False) -> Iterator[int]:
    """A loopback port held, not listening, for the ``with`` block: a connection to it is refused.

    ``reuse`` sets SO_REUSEADDR, so that a check binding with it too (the doctor's ``port_state``)
    still finds the port free, while a server binding port 0 is not handed it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@contextmanager
def refused_url() -> Iterator[str]:
    """``http://127.0.0.1:PORT`` where nothing listens, for as long as the block runs."""
    with unlistened_port() as port:
        yield f"http://127.0.0.1:{port}"

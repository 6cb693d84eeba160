"""The learner's batch sources speak one protocol, and its wait for a batch answers in one type: the
loop calls every source alike and never compares strings."""

from __future__ import annotations

import threading
import time

import pytest

from asyncrl.buffer.service import BufferService
from asyncrl.learner.dataset_sources import PreferenceSource, SFTSource
from asyncrl.learner.source import Batch, BatchSource, Signal, SourceError, broadcast_batch


class Rows(BatchSource):
    """A local data set as the learner sees one: batches at once, the service's parts left out."""

    def __init__(self, batches: int = 1) -> None:
        self.left, self.version = batches, 0

    def next_batch(self, timeout_s: float) -> Batch:
        if not self.left:
            raise TimeoutError
        self.left -= 1
        return Batch(groups=[], version=self.version, stats={"n": self.left})

    def set_version(self, v: int, checkpoint: str = "") -> None:
        self.version = v

    def state_dict(self) -> dict:
        return {"left": self.left}

    def load_state_dict(self, d: dict) -> None:
        self.left = d["left"]


def test_every_source_is_a_batch_source() -> None:
    """The buffer service sits below the learner and matches by its methods; the data sets
    subclass the protocol."""
    assert issubclass(BufferService, BatchSource)
    assert issubclass(SFTSource, BatchSource) and issubclass(PreferenceSource, BatchSource)
    assert isinstance(Rows(), BatchSource)


def test_a_local_data_set_keeps_the_service_only_defaults() -> None:
    src = Rows()
    src.on_register(lambda worker, gens: None)
    src.watch_generators(dict)
    src.end_run("done")
    src.stop()
    assert src.stats() is None and src.waiting_cause() == ""


def test_broadcast_batch_answers_a_batch_or_a_signal() -> None:
    stop = threading.Event()
    got = broadcast_batch(Rows(), timeout_s=5, stop=stop)
    assert isinstance(got, Batch) and got.stats == {"n": 0}
    assert broadcast_batch(Rows(0), timeout_s=5, wants_publish=lambda: True) is Signal.PUBLISH
    stop.set()
    assert broadcast_batch(Rows(), timeout_s=5, stop=stop) is Signal.STOP


def test_a_timeout_names_no_cause_when_the_source_has_none() -> None:
    with pytest.raises(SourceError, match=r"no batch within 0.01 s \(buffer.batch_timeout_s\)$"):
        broadcast_batch(Rows(0), timeout_s=0.01)


class Undecided(Rows):
    """A service's wait as the learner sees it while a generator's weights are on their way: no
    batch, and a cause that names the dropped generator only once the sync's verdict is in. A
    stand-in, because the point is the order of two events that a real sync decides by timing."""

    def __init__(self, verdict_after_s: float) -> None:
        super().__init__(0)
        self.verdict_at = time.monotonic() + verdict_after_s

    def next_batch(self, timeout_s: float) -> Batch:
        time.sleep(min(timeout_s, 0.02))
        raise TimeoutError

    def decided(self) -> bool:
        return time.monotonic() >= self.verdict_at

    def waiting_cause(self) -> str:
        return "no weights to http://x (preflight: refused)" if self.decided() else "0/2 stored"


def test_a_timeout_waits_for_the_verdict_of_a_sync_in_flight() -> None:
    """The deadline (0.2 s) comes while a sync is in flight; its verdict (0.3 s) is the cause."""
    src = Undecided(verdict_after_s=0.3)
    with pytest.raises(SourceError, match=r"within 0.2 s .*: no weights to http://x \(preflight"):
        broadcast_batch(src, timeout_s=0.2, settling=lambda: not src.decided())
    assert src.decided()


def test_a_generator_waiting_to_join_at_the_deadline_gets_the_weights_first() -> None:
    src = Undecided(verdict_after_s=60)
    got = broadcast_batch(src, timeout_s=0.05, wants_publish=lambda: True, settling=lambda: True)
    assert got is Signal.PUBLISH


def test_the_verdict_is_waited_for_at_most_another_timeout() -> None:
    src = Undecided(verdict_after_s=60)
    t0 = time.monotonic()
    with pytest.raises(SourceError, match=r"within 0.2 s .*: 0/2 stored$"):
        broadcast_batch(src, timeout_s=0.2, settling=lambda: True)
    assert time.monotonic() - t0 >= 0.4

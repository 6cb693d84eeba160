"""Two hosts on one machine for the faults tier: a "learner host" and a "rollout host", each a network
namespace, joined by a point-to-point link whose faults the test controls.

The link is two TUN devices, one moved into each namespace, and a relay thread in the test process
that copies packets between their file descriptors. A userspace relay, not a veth pair with
``tc qdisc ... netem``: the kernel that runs this tier (the CI's Firecracker VM, kernel 6.18) has no
``sch_netem`` and no tc filters or iptables, so delay, random loss, reordering and one-way loss can
only be made here. It is a fault injector (the standards allow a fake only to provoke a fault a real
part cannot); everything above the link -- the kernels' TCP, nng, TLS, gloo, HTTP and every asyncrl
process -- is real. One code path on every machine: the relay is used even where netem exists.

A partition is the relay dropping every packet, as a failed switch does: the endpoints see silence
(TCP retransmits and backs off), not the "network unreachable" that taking an interface down gives.

Set-up and tear-down are :func:`two_hosts`'s: it removes the namespaces and devices it made even when
the test fails (processes started in them are the test's to stop first, in its own ``finally``), and
namespaces left by a test process that was itself killed are removed by the next one. A machine where
namespaces or TUN devices cannot be made skips these tests with one line saying why, unless
``ASYNCRL_FAULTS_REQUIRE_NETNS=1`` (CI sets it), where that is a failure.
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import os
import random
import select
import struct
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

LEARNER_IP, ROLLOUT_IP = "10.77.0.1", "10.77.0.2"
MTU = 32000  # a weight broadcast is few packets, and the Python relay keeps up
PREFIX = "arl"  # namespaces arl-<pid>-<n>-{l,r}; devices arl<pid%1e5><n>{l,r} (<= 15 chars)

_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass
class Direction:
    """The faults of one direction of the link; the test changes them while the relay runs."""

    delay_s: float = 0.0
    jitter_s: float = 0.0  # each packet's delay is delay_s + U(0, jitter_s): this reorders
    loss: float = 0.0  # the chance a packet is dropped
    blocked: bool = False  # every packet dropped (a partition, or half of a half-open link)


@dataclass
class Link:
    """The relay between the two hosts' TUN devices. ``to_rollout``: packets the learner host sends;
    ``to_learner``: the rollout host's. ``counts``: packets by fate, per direction."""

    fds: tuple[int, int]  # learner host's device, rollout host's device
    seed: int = 0
    to_rollout: Direction = field(default_factory=Direction)
    to_learner: Direction = field(default_factory=Direction)
    counts: Counter = field(default_factory=Counter)
    cut_at: float | None = None  # when an armed cut (:meth:`cut_on_packet`) began

    def __post_init__(self) -> None:
        self._cut_min_bytes = 0
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        self._stop = False
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="netlab-relay", daemon=True)
        self._thread.start()

    def set(self, *, to_rollout: Direction | None = None, to_learner: Direction | None = None):
        with self._lock:
            if to_rollout is not None:
                self.to_rollout = to_rollout
            if to_learner is not None:
                self.to_learner = to_learner
        os.write(self._wake_w, b"x")

    def partition(self) -> None:
        self.set(to_rollout=Direction(blocked=True), to_learner=Direction(blocked=True))

    def cut_on_packet(self, min_bytes: int) -> None:
        """Partition both ways from the first packet of ``min_bytes`` or more the learner host sends
        (that packet dropped too): with requests and replies far smaller, that is the first packet of
        a weight broadcast's data, so the cut begins in the middle of one."""
        with self._lock:
            self.cut_at = None
            self._cut_min_bytes = min_bytes

    def heal(self) -> None:
        self.set(to_rollout=Direction(), to_learner=Direction())

    def _run(self) -> None:
        learner_fd, rollout_fd = self.fds
        out = {learner_fd: rollout_fd, rollout_fd: learner_fd}
        name = {learner_fd: "to_rollout", rollout_fd: "to_learner"}
        queue: list[tuple[float, int, int, bytes]] = []  # (release time, seq, fd to write, packet)
        seq = 0
        while not self._stop:
            timeout = max(0.0, queue[0][0] - time.monotonic()) if queue else 1.0
            ready, _, _ = select.select([learner_fd, rollout_fd, self._wake_r], [], [], timeout)
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            for fd in (learner_fd, rollout_fd):
                if fd not in ready:
                    continue
                try:
                    pkt = os.read(fd, 65536)
                except OSError:  # the device went away: tear-down
                    return
                with self._lock:
                    if self._cut_min_bytes and fd == learner_fd and len(pkt) >= self._cut_min_bytes:
                        self._cut_min_bytes = 0
                        self.cut_at = time.monotonic()
                        self.to_rollout = Direction(blocked=True)
                        self.to_learner = Direction(blocked=True)
                    d = getattr(self, name[fd])
                    if d.blocked or (d.loss and self._rng.random() < d.loss):
                        self.counts[name[fd], "dropped"] += 1
                        continue
                    delay = d.delay_s + (self._rng.uniform(0, d.jitter_s) if d.jitter_s else 0)
                self.counts[name[fd], "passed"] += 1
                if delay <= 0 and not queue:
                    self._write(out[fd], pkt)
                else:
                    heapq.heappush(queue, (time.monotonic() + delay, seq, out[fd], pkt))
                    seq += 1
            now = time.monotonic()
            while queue and queue[0][0] <= now:
                _, _, fd, pkt = heapq.heappop(queue)
                self._write(fd, pkt)

    @staticmethod
    def _write(fd: int, pkt: bytes) -> None:
        with contextlib.suppress(OSError):  # a full or vanished device drops it, as a NIC does
            os.write(fd, pkt)

    def close(self) -> None:
        self._stop = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=10)
        for fd in (*self.fds, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class Hosts:
    """The two namespaces and their link; :meth:`run_in` prefixes a command to run on a host."""

    learner_ns: str
    rollout_ns: str
    learner_dev: str
    rollout_dev: str
    link: Link

    def run_in(self, ns: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def pids(self) -> list[int]:
        """Every process still in either namespace (what a test left behind)."""
        out: list[int] = []
        for ns in (self.learner_ns, self.rollout_ns):
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            out += [int(x) for x in r.stdout.split()]
        return out

    def env(self, ns: str) -> dict[str, str]:
        """What a process on that host needs beyond the tier's child env: gloo's endpoint on the
        link's device (gloo would otherwise bind the address the machine's host name resolves to,
        which is not in the namespace), and no HTTP proxy between hosts."""
        dev = self.learner_dev if ns == self.learner_ns else self.rollout_dev
        return {"GLOO_SOCKET_IFNAME": dev, "NO_PROXY": "*", "no_proxy": "*"}


def _sweep_stale() -> None:
    """Remove namespaces a killed test process left (its pid in their names is gone)."""
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) == 4 and parts[0] == PREFIX and parts[1].isdigit():
            if not os.path.exists(f"/proc/{parts[1]}"):
                with contextlib.suppress(OSError):
                    _ip("netns", "del", name)


_counter = 0


def _unavailable(why: str) -> None:
    msg = f"two-host tests need network namespaces and TUN devices (root): {why}"
    if os.environ.get("ASYNCRL_FAULTS_REQUIRE_NETNS") == "1":
        pytest.fail(msg + " (ASYNCRL_FAULTS_REQUIRE_NETNS=1)", pytrace=False)
    pytest.skip(msg)


@contextlib.contextmanager
def two_hosts(seed: int = 0) -> Iterator[Hosts]:
    """Make the two hosts and their link; remove them on exit, whatever happened."""
    global _counter
    _counter += 1
    if os.geteuid() != 0:
        _unavailable("not root")
    tag = f"{os.getpid()}-{_counter}"
    ns = {s: f"{PREFIX}-{tag}-{s}" for s in "lr"}
    dev = {s: f"{PREFIX}{os.getpid() % 100000}{_counter % 100}{s}" for s in "lr"}
    fds: dict[str, int] = {}
    made: list[str] = []
    link: Link | None = None
    try:
        try:
            _sweep_stale()
            for s in "lr":
                _ip("netns", "add", ns[s])
                made.append(ns[s])
                fds[s] = _open_tun(dev[s])
                _ip("link", "set", dev[s], "netns", ns[s])  # the fd stays attached
        except (OSError, subprocess.SubprocessError) as e:
            _unavailable(str(e).splitlines()[0] if str(e) else type(e).__name__)
        addr = {"l": (LEARNER_IP, ROLLOUT_IP), "r": (ROLLOUT_IP, LEARNER_IP)}
        for s in "lr":
            _ip("-n", ns[s], "link", "set", "lo", "up")
            _ip("-n", ns[s], "link", "set", dev[s], "mtu", str(MTU), "up")
            _ip("-n", ns[s], "addr", "add", addr[s][0], "peer", addr[s][1], "dev", dev[s])
        link = Link((fds["l"], fds["r"]), seed=seed)
        yield Hosts(ns["l"], ns["r"], dev["l"], dev["r"], link)
    finally:
        if link is not None:
            link.close()  # closes the devices' fds: the devices go
        else:
            for fd in fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
        for name in made:
            with contextlib.suppress(OSError):
                _ip("netns", "del", name)

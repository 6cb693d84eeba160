"""Where a built-in engine listens (asyncrl.reach.engine_host), on this machine's real sockets, and
`asyncrl rollout`'s one line when generator.host cannot work with a remote learner."""

from __future__ import annotations

import fcntl
import socket
import struct

import pytest

from asyncrl.reach import HostError, dial_host, engine_host, is_loopback

SIOCGIFADDR = 0x8915


def own_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback (Linux: each interface's, by ioctl)."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)[20:24])
            except OSError:  # no IPv4 address
                continue
            if not is_loopback(addr):
                found.append(addr)
    return found


def test_a_learner_on_this_host_keeps_the_engines_on_loopback() -> None:
    for address in (
        "tcp://127.0.0.1:29600",
        "tcp://127.0.0.2:29600",  # routed over loopback, like any 127/8 address
        "tls+tcp://localhost:29600",
        "tcp://0.0.0.0:29600",
        "ipc:///tmp/buffer.ipc",
        "inproc://buffer",
    ):
        assert engine_host("", address) == "127.0.0.1", address
        assert engine_host("127.0.0.1", address) == "127.0.0.1", address  # said, and fine here
        assert dial_host("0.0.0.0", address) == "127.0.0.1", address
    assert engine_host("0.0.0.0", "tcp://127.0.0.1:1") == "0.0.0.0"


def test_a_remote_learner_gets_the_address_on_the_route_to_it() -> None:
    """The learner at one of this machine's non-loopback addresses is, for the route, another
    host: the engines listen on the address the kernel would send from, and loopback set by hand
    is refused in one line naming generator.host."""
    addresses = own_addresses()
    if not addresses:
        pytest.skip("this machine has no IPv4 address but loopback")
    a = addresses[0]
    for learner in (f"tcp://{a}:29600", f"tls+tcp://{a}:29600"):
        assert engine_host("", learner) == a
        assert engine_host(a, learner) == a
        assert engine_host("0.0.0.0", learner) == "0.0.0.0"  # every interface, if asked
        assert dial_host("0.0.0.0", learner) == a  # but the learner dials the routed one
        with pytest.raises(HostError) as e:
            engine_host("127.0.0.1", learner)
        assert str(e.value).startswith("generator.host: 127.0.0.1 is loopback, but the learner")
        assert f"on the route to the learner: {a})" in str(e.value) and "\n" not in str(e.value)


def test_rollout_refuses_loopback_for_a_remote_learner_in_one_line(tmp_path, tiny_qwen3, capsys):
    from asyncrl.rollout import main as rollout_main
    from tests.rollout.test_main import _recipe

    addresses = own_addresses()
    if not addresses:
        pytest.skip("this machine has no IPv4 address but loopback")
    a = addresses[0]
    recipe = _recipe(tmp_path, tiny_qwen3)
    argv = [str(recipe), "generator.host=127.0.0.1", "--buffer", f"tcp://{a}:1"]
    assert rollout_main.main([*argv, "--pub", f"tcp://{a}:2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    said = [line for line in err.splitlines() if line.startswith("asyncrl rollout:")]
    assert len(said) == 1 and said[0].startswith("asyncrl rollout: generator.host: 127.0.0.1")

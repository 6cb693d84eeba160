"""The doctor's checks of this machine: the recipe's files exist, the devices and their memory, the
ports the run will bind are free, and the TLS files are readable and match. None needs the model."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

from asyncrl import recipe as recipe_mod
from asyncrl.doctor.context import Check, Device, Doctor
from asyncrl.memory import gib
from asyncrl.reach import HostError, engine_host


def check_files(d: Doctor) -> list[Check]:
    try:
        recipe_mod.validate(d.recipe, check_files=True)
    except recipe_mod.RecipeError as e:
        return [Check(name="files", ok=False, detail=str(e))]
    return [Check(name="files", ok=True, detail="model, data and TLS files exist")]


def check_device(d: Doctor) -> list[Check]:
    import torch

    total, available = host_memory()
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, tot = torch.cuda.mem_get_info(i)
            name = torch.cuda.get_device_name(i)
            gpus.append((name, free, tot, torch.cuda.get_device_capability(i)))
    d.device = Device(cuda=bool(gpus), gpus=gpus, host_available=available, host_total=total)
    host = f"host RAM {gib(available)} GiB available of {gib(total)} GiB"
    if not gpus:
        return [
            Check(
                name="device",
                ok=True,
                detail=f"no GPU: a CPU run, {os.cpu_count()} cores, {host}",
            )
        ]
    listed = "; ".join(
        f"{i}: {n} (sm {c[0]}{c[1]}), {gib(f)} GiB free of {gib(t)}"
        for i, (n, f, t, c) in enumerate(gpus)
    )
    return [Check(name="device", ok=True, detail=f"{len(gpus)} GPUs: {listed}; {host}")]


def check_ports(d: Doctor) -> list[Check]:
    r = d.recipe
    wanted: list[tuple[str, str, int]] = []
    for key in ("address", "pub_address"):
        a = getattr(r.buffer, key)
        if a.startswith(("tcp://", "tls+tcp://")):
            u = urlsplit(a)
            wanted.append((f"buffer.{key}", u.hostname or "", u.port or 0))
    wanted.append(("weights.master_port", r.weights.master_addr, r.weights.master_port))
    if r.generator.kind == "builtin" and r.generator.base_port:
        n = r.rollout.workers * r.generator.engines_per_worker
        try:
            host = engine_host(r.generator.host, r.buffer.address)
        except HostError:  # the worker refuses it (one line); here only its ports count
            host = r.generator.host
        for i in range(n):
            wanted.append(("generator.base_port", host, r.generator.base_port + i))
    busy, elsewhere, free = [], [], []
    for key, host, port in wanted:
        if port == 0:
            continue
        state = port_state(host, port)
        (busy if state == "busy" else elsewhere if state == "remote" else free).append(
            f"{key} {host}:{port}"
        )
    if busy:
        return [
            Check(
                name="ports",
                ok=False,
                detail=f"in use: {', '.join(busy)}: stop what holds them, or choose other "
                "ports (0: a free one at start)",
            )
        ]
    said = [f"free: {', '.join(free)}" if free else "", "port 0: a free one at start"]
    if elsewhere:
        said.append(f"not this host's (checked where they run): {', '.join(elsewhere)}")
    return [Check(name="ports", ok=True, detail="; ".join(s for s in said if s))]


def check_tls(d: Doctor) -> list[Check]:
    import ssl

    from asyncrl.transport import TLS

    tls = TLS.from_config(d.recipe)
    if tls is None:
        return [Check(name="TLS", ok=True, detail="not used (tcp:// addresses)")]
    try:
        tls.server_config()  # what the buffer service builds (reads and parses the PEM files)
        tls.client_config(d.recipe.buffer.address)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_cert_chain(tls.cert, tls.key)  # the key is the certificate's
        ctx.load_verify_locations(tls.ca)
    except (ValueError, OSError, ssl.SSLError) as e:
        return [Check(name="TLS", ok=False, detail=f"{e}: fix buffer.tls (docs/multinode.md)")]
    except Exception as e:  # pynng's own errors for PEM it cannot parse
        return [Check(name="TLS", ok=False, detail=f"{e!r}: fix buffer.tls (docs/multinode.md)")]
    return [
        Check(
            name="TLS",
            ok=True,
            detail=f"certificate, key (its own) and CA readable: {tls.cert}, {tls.key}, {tls.ca}",
        )
    ]


def host_memory() -> tuple[int, int]:
    """(total, available) host RAM in bytes: /proc/meminfo's MemTotal and MemAvailable."""
    try:
        fields = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, v = line.split(":", 1)
            fields[k] = int(v.split()[0]) * 1024
        return fields["MemTotal"], fields.get("MemAvailable", fields["MemFree"])
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total


def port_state(host: str, port: int) -> str:
    """ "free", "busy" (something listens there) or "remote" (``host`` is not this machine's)."""
    try:
        infos = socket.getaddrinfo(host or "0.0.0.0", port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return "remote"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            return "busy" if e.errno == errno.EADDRINUSE else "remote"
    return "free"

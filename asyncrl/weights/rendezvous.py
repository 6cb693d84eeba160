"""Join a weight-update process group exactly as SGLang's ``init_custom_process_group`` does.

SGLang's servers form a non-default group over a TCPStore hosted by rank 0, with every key under
``PrefixStore(group_name)``. A plain ``init_process_group`` would use other keys and never meet them,
so the learner (rank 0) and the built-in engine (ranks from ``rank_offset``) both join through this
one function. Gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


class LayoutError(ValueError):
    """A generator's parallel layout cannot join a weight-update group (one line, naming why)."""


def server_ranks(info: dict) -> int:
    """How many ranks one server takes in the weight-update group, from its ``/server_info``.

    SGLang 0.5.23 gives each tensor-parallel worker the rank ``rank_offset + tp_rank``
    (model_executor/model_runner_components/weight_updater.py), so a server takes ``tp_size``
    ranks. Its update-from-distributed path asserts ``dp_size == 1``, and with ``pp_size > 1`` the
    stages' tp_ranks would collide: both are refused here, with the fix."""

    def size(key: str) -> int:
        v = info.get(key, 1)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else 1

    if size("dp_size") > 1:
        raise LayoutError(
            f"dp_size {size('dp_size')}: SGLang updates weights from a process group only with "
            "dp_size 1; run one server per data-parallel replica"
        )
    if size("pp_size") > 1:
        raise LayoutError(
            f"pp_size {size('pp_size')}: the weight-update group has no ranks for pipeline stages; "
            "serve with pp_size 1"
        )
    return size("tp_size")


def group_layout(ranks: list[int]) -> tuple[list[int], int]:
    """Each server's ``rank_offset`` and the group's world size: the learner is rank 0, servers follow
    in order, each taking its :func:`server_ranks` (slime's layout)."""
    offsets, nxt = [], 1
    for n in ranks:
        offsets.append(nxt)
        nxt += n
    return offsets, nxt


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_custom_process_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Rendezvous on ``tcp://master_address:master_port`` and return the new group (not the default).

    Blocks until all ``world_size`` ranks have joined or ``timeout_s`` passes (then raises).
    """
    timeout = timedelta(seconds=timeout_s)
    # What c10d.rendezvous("tcp://...") does outside torchrun: rank 0 hosts the store. Called
    # directly because under torchrun rendezvous() would make every rank a client of the agent's
    # store (TORCHELASTIC_USE_AGENT_STORE), so a learner rank 0 would wait for a store nobody hosts.
    store = dist.TCPStore(
        host_name=master_address,
        port=master_port,
        world_size=world_size,
        is_master=rank == 0,
        timeout=timeout,
        multi_tenant=True,
    )
    store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)
    pg_options = {}
    if "backend_options" in c10d._new_process_group_helper.__code__.co_varnames:
        pg_options["backend_options"] = None
    else:  # torch < 2.6 named it pg_options
        pg_options["pg_options"] = None
    pg, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
        **pg_options,
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_process_group(pg: dist.ProcessGroup | None) -> None:
    """Tear a weight group down; safe to call on a group whose peers are gone."""
    if pg is None:
        return
    try:
        dist.destroy_process_group(pg)
    except Exception:  # a dead peer can make teardown raise; the group is unusable either way
        c10d._world.pg_group_ranks.pop(pg, None)

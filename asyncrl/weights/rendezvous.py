"""Join a weight-update process group exactly as SGLang's ``init_custom_process_group`` does.

SGLang's servers form a non-default group over a TCPStore hosted by rank 0, with every key under
``PrefixStore(group_name)``. A plain ``init_process_group`` would use other keys and never meet them,
so the learner (rank 0) and the built-in engine (ranks from ``rank_offset``) both join through this
one function. Gloo on CPU or with a built-in engine on CPU, NCCL on GPU (:func:`default_backend`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from asyncrl.gpu import nonblocking_bound_problem, weight_backend

log = logging.getLogger("asyncrl.weights")


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


def radix_cache_problem(info: dict, pause_mode: str) -> str | None:
    """Why a server cannot take in-place weight updates, from its ``/server_info``; None if it can.

    ``weights.pause_mode: in_place`` keeps running requests' KV across an update, so nothing may be
    flushed, and SGLang's radix cache would then give new requests prefix KV that the old weights
    computed, under the new version's label. ``retract`` flushes it after the update instead.
    SGLang's ``disable_radix_cache`` server argument says which (absent: the cache is on)."""
    if pause_mode != "in_place" or bool(info.get("disable_radix_cache", False)):
        return None
    return (
        "weights.pause_mode in_place needs the radix cache off: relaunch it with "
        "--disable-radix-cache, or set weights.pause_mode=retract"
    )


def group_layout(ranks: list[int]) -> tuple[list[int], int]:
    """Each server's ``rank_offset`` and the group's world size: the learner is rank 0, servers follow
    in order, each taking its :func:`server_ranks` (slime's layout)."""
    offsets, nxt = [], 1
    for n in ranks:
        offsets.append(nxt)
        nxt += n
    return offsets, nxt


def default_backend(*, gloo_member: bool = False, cuda: bool | None = None) -> str:
    """What ``weights.backend: auto`` builds a group with: NCCL on a CUDA machine, gloo on CPU or
    when a member cannot join NCCL (``gloo_member``: a built-in engine on CPU, which receives into
    CPU tensors, or one on the sender's own GPU: :func:`asyncrl.gpu.needs_gloo`). ``cuda``:
    whether CUDA is available (None: ask torch)."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    return weight_backend("auto", cuda=cuda, gloo_member=gloo_member)


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """Rank 0's TCPStore, listening on a port the OS picked (``.port``) before anyone is told it.

    A port found free, closed, and bound again by rank 0 only later could be taken in between (a
    second run or test on the machine); a store bound to port 0 holds its port from the start.
    Multi-tenant: rank 0's :func:`init_custom_process_group` on ``.port`` in this process joins this
    very server instead of binding again, so hold it until those joins have returned (each group's
    store then keeps the server alive)."""
    return dist.TCPStore(
        host_name=host,
        port=0,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        multi_tenant=True,
    )


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
    Rank 0 hosts the store on ``master_port``, or joins the one this process already hosts there
    (:func:`host_store`, which picks the port without a race).
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
    options, env = (None, {}) if backend != "nccl" else _isolated_nccl(timeout)
    key = "backend_options"
    if key not in c10d._new_process_group_helper.__code__.co_varnames:
        key = "pg_options"  # torch < 2.6
    with _environ(env):  # ProcessGroupNCCL reads its error handling once, when it is built
        pg, _ = c10d._new_process_group_helper(
            world_size,
            rank,
            [],
            dist.Backend(backend),
            store,
            group_name=group_name,
            timeout=timeout,
            **{key: options},
        )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


WEIGHT_GROUP_NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
"""How a weight group's NCCL backend handles errors: not at all (0). TorchTitan sets 3 for the
learner's own groups (a timed-out collective ends the process, to dump its flight recorder); for the
weight group that would turn a dead generator into a dead learner. With 0 the broadcaster's bounded
``wait`` sees the failure and aborts this group alone (:func:`abandon_process_group`)."""


def _isolated_nccl(timeout: timedelta) -> tuple[object, dict[str, str]]:
    """Options and environment for a weight group over NCCL: a nonblocking communicator init, so
    the first broadcast does not block in ``ncclCommInitRank`` beyond the group's timeout (NCCL's
    ``blocking = 0`` config), and no process-wide error handling (:data:`WEIGHT_GROUP_NCCL_ENV`).

    A nonblocking communicator's init (which the first broadcast waits for), launches and abort
    are bounded by ``TORCH_NCCL_NONBLOCKING_TIMEOUT``, not by ``timeout``: torch reads it once per
    process, so it cannot be set here for this group alone (the learner sets it at start,
    :func:`asyncrl.gpu.trainer_nccl_env`); a process where it would outlast ``timeout`` says so.
    Verified by reading torch's ProcessGroupNCCL (constructor and watchdog) and NCCLUtils
    (``NCCLComm::getNcclComm``, ``waitReady``, ``nccl_nonblocking_timeout``); no GPU here."""
    problem = nonblocking_bound_problem(os.environ, timeout.total_seconds())
    if problem is not None:
        log.warning("weights: %s", problem)
    opts = dist.ProcessGroupNCCL.Options()  # type: ignore[attr-defined]  # CUDA builds only
    opts.config.blocking = 0
    opts._timeout = timeout
    return opts, dict(WEIGHT_GROUP_NCCL_ENV)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def abandon_process_group(pg: dist.ProcessGroup) -> None:
    """Give up on a weight group whose peers may be gone: an NCCL group's communicators are aborted
    first (a destroy would wait on the stuck collective), then the group is destroyed. Nothing else
    in the process is touched: the learner's own groups keep running."""
    if dist.get_backend(pg) == "nccl":
        try:
            c10d._abort_process_group(pg)
        except Exception:  # already aborted or torn down
            pass
    destroy_process_group(pg)


def destroy_process_group(pg: dist.ProcessGroup | None) -> None:
    """Tear a weight group down; safe to call on a group whose peers are gone."""
    if pg is None:
        return
    try:
        dist.destroy_process_group(pg)
    except Exception:  # a dead peer can make teardown raise; the group is unusable either way
        c10d._world.pg_group_ranks.pop(pg, None)

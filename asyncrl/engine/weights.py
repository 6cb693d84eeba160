"""The engine's weight store: update groups, the update session, and a staging copy of the tensors.

An HTTP thread joins the trainer's group (SGLang's rendezvous, ``asyncrl.weights.rendezvous``),
receives each broadcast into freshly allocated tensors and stages them while decoding goes on. The
members of the model's fused projections are received into row slices of one buffer per group and
session, which the model lays out (``fused.py:ReceiveBuffers``), so that the swap adopts them as
they are instead of copying them once more.
Nothing the decode thread reads is touched until the session ends: :meth:`WeightStore.apply` then
runs in the decode thread between two steps and only re-points each parameter at its new tensor, so
the swap costs microseconds whatever the model size.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from asyncrl.engine.fused import ReceiveBuffers
from asyncrl.engine.lora_serving import (
    Adapters,
    LoraSpec,
    adapter_target,
    read_peft_folder,
)
from asyncrl.weights import buckets, ipc, rendezvous
from asyncrl.weights.exports import is_adapter_export
from asyncrl.weights.threads import BACKGROUND_NICE, lower_priority

NO_SESSION = (
    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
)


class WeightError(ValueError):
    """A weight-update request the engine refuses; the message goes back as ``message``."""


class DecodeLoop(Protocol):
    """What the store asks of the decode loop (the engine implements it)."""

    @property
    def version(self) -> str: ...

    def swap(self, staged: dict[str, torch.Tensor], version: str | None) -> float:
        """Install ``staged`` (and label it ``version``) between two decode steps; the pause (s)."""

    def set_version(self, version: str) -> None: ...

    def abort_all(self) -> None: ...


class Receiver:
    """One background thread, at a lower CPU priority than the decode thread, that joins groups and
    receives broadcasts. On a loaded machine the receive then takes the decode loop's leftovers
    instead of competing with it; gloo's own I/O threads, created here, inherit the priority."""

    def __init__(self, nice: int = BACKGROUND_NICE):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._nice = nice
        self._thread = threading.Thread(target=self._loop, name="engine-weights", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        lower_priority(self._nice)
        while True:
            fn, box, done = self._jobs.get()
            try:
                box.append((fn(), None))
            except BaseException as e:
                box.append((None, e))
            done.set()

    def run(self, fn: Callable[[], Any]) -> Any:
        box: list = []
        done = threading.Event()
        self._jobs.put((fn, box, done))
        done.wait()
        val, err = box[0]
        if err is not None:
            raise err
        return val


class WeightStore:
    """HF-named parameters of the served model, the weight-update groups, and the update session.

    The session is SGLang's begin/update/end protocol as a small state machine, one weight
    operation at a time (``_lock``): closed --begin--> open --update (receive, stage)--> open
    --end (swap the staged tensors in, label them)--> closed. A failed update discards what the
    session staged and closes it, so the engine keeps serving one consistent version; a new group
    (a restarted learner) abandons a session its predecessor left open.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loop: DecodeLoop,
        receive_buffers: Callable[[], ReceiveBuffers] | None = None,
        lora: LoraSpec | None = None,
    ):
        """``receive_buffers``: a session's buffers for the fused members (the engine's model
        gives them, ``BatchedLM.receive_buffers``); None: every tensor is received on its own.
        ``lora``: the engine serves adapters (``lora_serving.py``): updates hold adapter tensors
        only, and the model's weights as loaded stay the base."""
        self.model = model
        self.loop = loop
        self.device = next(model.parameters()).device
        self.params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())
        self.aliases: dict[str, str] = {}
        ptr = {p.data_ptr(): n for n, p in self.params.items()}
        for name, t in model.state_dict().items():  # tied weights: lm_head.weight -> embed_tokens
            if name not in self.params and t.data_ptr() in ptr:
                self.aliases[name] = ptr[t.data_ptr()]
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.backends: dict[str, str] = {}  # group name -> its backend (what a receive lands in)
        self._session_open = False
        self._staged: dict[str, torch.Tensor] = {}
        self._new_buffers = receive_buffers
        self._buffers: ReceiveBuffers | None = None  # the open session's
        self._pending_version: str | None = None  # the label of the staged weights, at their swap
        self._lock = threading.Lock()  # one weight operation at a time (HTTP threads)
        self.receiver = Receiver()
        self.lora = Adapters(lora, self.params) if lora is not None else None
        self._staged_adapter: dict[str, torch.Tensor] = {}  # the session's (LoRA)
        self._next_adapter: dict[str, torch.Tensor] | None = None  # served from the next apply()

    def resolve(self, name: str) -> str | None:
        name = self.aliases.get(name, name)
        return name if name in self.params else None

    # ---- groups ----------------------------------------------------------------------------------

    def init_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float = 300.0,
    ) -> None:
        """Join as rank ``rank_offset`` (one worker per engine); blocks until the trainer joins."""
        if group_name in self.groups:
            raise WeightError(f"group {group_name!r} already exists; destroy it first")

        def join() -> dist.ProcessGroup:
            if backend == "nccl":  # NCCL binds the communicator to this thread's current device
                torch.cuda.set_device(self.device)
            return rendezvous.init_custom_process_group(
                master_address=master_address,
                master_port=master_port,
                rank=rank_offset,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
                timeout_s=timeout_s,
            )

        self.groups[group_name] = self.receiver.run(join)
        self.backends[group_name] = backend
        with self._lock:
            if self._session_open:
                # A new group is a new (or restarted) learner: a session the old one left open (it
                # was killed mid-update) is abandoned, or every begin would fail from now on.
                print(
                    "asyncrl engine: new group; abandoning an open update session", file=sys.stderr
                )
                self._close_session()

    def destroy_group(self, group_name: str) -> None:
        pg = self.groups.pop(group_name, None)
        self.backends.pop(group_name, None)
        if pg is None:
            raise WeightError(f"no weight-update group named {group_name!r}")
        rendezvous.destroy_process_group(pg)

    # ---- the update session ----------------------------------------------------------------------

    def begin(self, *, abandon_open: bool = False) -> None:
        """Open a session; ``abandon_open``: discard one left open (by an update its learner gave
        up on), as a new group does."""
        with self._lock:
            if self._session_open and abandon_open:
                print("asyncrl engine: abandoning an open update session", file=sys.stderr)
                self._close_session()
            if self._session_open:
                raise WeightError("a weight-update session is already open")
            self._close_session()
            self._session_open = True
            self._buffers = self._new_buffers() if self._new_buffers is not None else None

    def update(
        self,
        *,
        names: list[str],
        dtypes: list[torch.dtype],
        shapes: list[list[int]],
        group_name: str,
        load_format: str | None,
        version: str | None,
        abort_all: bool,
    ) -> None:
        """Receive one update call's tensors into the open session (nothing is served yet)."""
        with self._lock:
            if not self._session_open:
                raise WeightError(
                    NO_SESSION
                )  # nothing was received: the trainer must not broadcast
            if group_name not in self.groups:
                raise WeightError(
                    f"no weight-update group named {group_name!r}; "
                    "call init_weights_update_group first"
                )
            if abort_all:
                self.loop.abort_all()
            try:
                self.stage(
                    self.receive_distributed(
                        names=names,
                        dtypes=dtypes,
                        shapes=shapes,
                        group_name=group_name,
                        load_format=load_format,
                    )
                )
            except Exception as e:
                # unlike SGLang (which is left partially updated), nothing was swapped in yet: drop
                # the whole session's staging so the engine keeps serving one consistent version
                self._close_session()
                raise WeightError(
                    f"Failed to update parameter online: {e}. The staged update was discarded and the "
                    f"weight-update session closed; still serving version {self.loop.version}."
                ) from e
            if version is not None:
                self._pending_version = version

    def update_from_tensor(
        self, serialized: str, *, load_format: str | None, version: str | None, abort_all: bool
    ) -> None:
        """Take one bucket by handle into the open session (``/update_weights_from_tensor``):
        rank 0's buffer, mapped from the handle (shared memory, or CUDA IPC on its GPU), copied
        into a new buffer on this engine's device, the copy finished before this returns (rank 0
        may free its buffer once it has the answer). Staged like a received bucket; a failure
        discards the session, as a failed receive does (:meth:`update`)."""
        with self._lock:
            if not self._session_open:
                raise WeightError(NO_SESSION.replace("distributed", "tensor"))
            if abort_all:
                self.loop.abort_all()
            try:
                named = self.receiver.run(lambda: self._copy_in(serialized, load_format))
                self.stage(named)
            except Exception as e:
                self._close_session()
                raise WeightError(
                    f"Failed to update parameter online: {e}. The staged update was discarded and "
                    f"the weight-update session closed; still serving version {self.loop.version}."
                ) from e
            if version is not None:
                self._pending_version = version

    def _copy_in(self, serialized: str, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
        """Open a handle and copy its bucket out (receiver thread). Both on one thread with this
        engine's device current, so on one stream: the handle's event (rank 0's writes to the
        buffer), which opening it makes the current stream wait on, comes before the copy. The
        handle closes when this returns."""
        if self.device.type != "cuda":
            return ipc.copy_out(ipc.load_payload(serialized, load_format), self.device)
        with torch.cuda.device(self.device):
            return ipc.copy_out(ipc.load_payload(serialized, load_format), self.device)

    def end(self) -> float:
        """Swap what the session staged in (between two decode steps); the pause it caused (s)."""
        with self._lock:
            if not self._session_open:
                raise WeightError(
                    "no weight-update session is open (call begin_weight_update first)"
                )
            staged, version = self._staged, self._pending_version
            adapter, bufs = self._staged_adapter, self._buffers
            self._close_session()
            if adapter:
                staged, served = self._merge(adapter, replace=False, bufs=bufs)
                return self._swap(staged, version, adapter=served)
            return self._swap(staged, version)

    def relabel(self, version: str) -> None:
        """Label the staged weights if a session holds some (at their swap), else the served ones."""
        with self._lock:
            if self._session_open and (self._staged or self._staged_adapter):
                self._pending_version = version
            else:
                self.loop.set_version(version)

    def load_from_disk(self, model_path: str, *, version: str | None, abort_all: bool) -> float:
        """Serve an HF folder's weights now, outside any session; the pause it caused (s).

        With LoRA on, a PEFT adapter folder (the learner's ``export: adapter``) is served over the
        base weights, replacing the adapter served now; a whole HF folder (``export: merged``) is
        served as it is, the base kept for the next adapter."""
        with self._lock:
            adapter = None
            try:
                if is_adapter_export(model_path):
                    if self.lora is None:
                        raise ValueError(
                            f"{model_path} is a LoRA adapter folder, but this engine was started "
                            "without --lora-rank (recipe learner.lora)"
                        )
                    named = self.lora.checked(read_peft_folder(model_path, self.lora.spec))
                    staged, adapter = self._merge(named, replace=True, bufs=None)
                else:
                    staged = self._checked(self.load_disk(model_path))
                    adapter = {} if self.lora is not None else None
            except Exception as e:
                raise WeightError(f"Failed to update model weights: {e}.") from e
            if abort_all:
                self.loop.abort_all()
            return self._swap(staged, version, adapter=adapter)

    def _merge(
        self, adapter: dict[str, torch.Tensor], *, replace: bool, bufs: ReceiveBuffers | None
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Base + scaling · B A for every layer ``adapter`` touches (``Adapters.merged``), in the
        receiver thread (below the decode thread's priority), into the fused groups' buffers."""
        assert self.lora is not None
        lora = self.lora

        def dest(name: str, w: torch.Tensor) -> torch.Tensor | None:
            return bufs.get(name, w.dtype, list(w.shape), w.device) if bufs is not None else None

        try:
            return self.receiver.run(lambda: lora.merged(adapter, replace=replace, dest=dest))
        except ValueError as e:
            raise WeightError(
                f"Failed to apply the LoRA adapter: {e}. Still serving version {self.loop.version}."
            ) from e

    def _swap(
        self,
        staged: dict[str, torch.Tensor],
        version: str | None,
        adapter: dict[str, torch.Tensor] | None = None,
    ) -> float:
        """``adapter``: the LoRA adapter served once ``staged`` is (swapped in with it)."""
        if not staged and version is None and adapter is None:
            return 0.0
        self._next_adapter = adapter
        try:
            return self.loop.swap(staged, version)
        finally:
            self._next_adapter = None

    def _close_session(self) -> None:
        self._session_open = False
        self._staged = {}
        self._staged_adapter = {}
        self._buffers = None
        self._pending_version = None

    # ---- receiving -------------------------------------------------------------------------------

    def receive_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[torch.dtype],
        shapes: list[list[int]],
        group_name: str,
        load_format: str | None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Receive one update call's broadcasts from rank 0, in ``names`` order (receiver thread)."""
        pg = self.groups[group_name]
        # NCCL fills CUDA tensors (the engine's device); gloo host ones, moved over at staging
        dev = self.device if self.backends.get(group_name) == "nccl" else torch.device("cpu")
        bufs = self._buffers
        return self.receiver.run(
            lambda: self._receive(pg, names, dtypes, shapes, load_format, dev, bufs)
        )

    def _receive(
        self,
        pg,
        names,
        dtypes,
        shapes,
        load_format,
        device: torch.device,
        bufs: ReceiveBuffers | None,
    ) -> list[tuple[str, torch.Tensor]]:
        if load_format == "flattened_bucket":
            # One broadcast into one buffer: the fused members need no buffers of their own, since
            # a bucket holds them back to back (the learner's order) and the swap adopts them there.
            _, total = buckets.flat_layout(dtypes, shapes)
            flat = torch.empty(total, dtype=torch.uint8, device=device)
            dist.broadcast(flat, src=0, group=pg)
            return list(zip(names, buckets.unflatten(flat, dtypes, shapes), strict=True))
        # Post every receive before waiting on any (as SGLang does): one round trip per call, not
        # one per tensor. A fused group's members land in row slices of one buffer.
        out = [
            (n, self._receive_buffer(bufs, n, dt, s, device))
            for n, dt, s in zip(names, dtypes, shapes, strict=True)
        ]
        works = [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in out]
        for w in works:
            w.wait()
        return out

    def _receive_buffer(
        self, bufs: ReceiveBuffers | None, name: str, dtype: torch.dtype, shape, device
    ) -> torch.Tensor:
        """Where one tensor of a list-format call is received: its fused group's slice if it has
        one (``bufs``), else a tensor of its own."""
        key = self.resolve(name)
        t = bufs.get(key, dtype, shape, device) if bufs is not None and key is not None else None
        return t if t is not None else torch.empty(shape, dtype=dtype, device=device)

    def stage(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Keep checked tensors for the session's swap (with LoRA on: adapter tensors, merged at
        the session's end)."""
        if self.lora is not None:
            self._staged_adapter.update(self.lora.checked(named))
        else:
            self._staged.update(self._checked(named))

    def _checked(self, named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Resolve names, check shapes, convert dtypes and move to the model's device: parameter
        name -> tensor to install."""
        bad = []
        ready = {}
        for name, t in named:
            key = self.resolve(name)
            if key is None and adapter_target(name) is not None:
                bad.append(
                    f"{name}: a LoRA adapter tensor, but this engine was started without "
                    "--lora-rank (recipe learner.lora)"
                )
                continue
            if key is None:
                bad.append(f"{name}: no such parameter")
                continue
            p = self.params[key]
            if tuple(t.shape) != tuple(p.shape):
                bad.append(f"{name}: shape {list(t.shape)} != {list(p.shape)}")
                continue
            ready[key] = t.to(p.device, p.dtype).contiguous()
        if bad:
            raise WeightError(
                "; ".join(bad[:5]) + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else "")
            )
        return ready

    def load_disk(self, model_path: str) -> list[tuple[str, torch.Tensor]]:
        """Read every ``*.safetensors`` file of an HF folder (or one file)."""
        from safetensors.torch import load_file

        path = Path(model_path)
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightError(f"no safetensors files at {model_path}")
        out: list[tuple[str, torch.Tensor]] = []
        for f in files:
            out.extend(load_file(str(f)).items())
        return out

    def apply(self, staged: dict[str, torch.Tensor]) -> None:
        """Re-point parameters at staged tensors. Decode thread only, between two steps."""
        for key, t in staged.items():
            self.params[key].data = t
        if self.lora is not None and self._next_adapter is not None:
            self.lora.served = self._next_adapter
            self.lora.installed(staged)

    # ---- reading ---------------------------------------------------------------------------------

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """What the engine's checksum covers: what the learner sends (with LoRA on, the adapter)."""
        if self.lora is not None:
            return list(self.lora.served.items())
        return [(n, p.data) for n, p in self.params.items()]

    def get(self, name: str, truncate_size: int) -> list:
        if self.lora is not None and name in self.lora.served:
            return self.lora.served[name][:truncate_size].tolist()
        key = self.resolve(name)
        if key is None:
            raise WeightError(f"no parameter named {name!r}")
        return self.params[key].data[:truncate_size].tolist()

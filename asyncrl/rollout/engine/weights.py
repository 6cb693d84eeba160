"""The engine's staged weight receiver: tensors arrive in a side copy while decoding goes on.

An HTTP thread joins the trainer's group (SGLang's rendezvous, ``asyncrl.weights.rendezvous``),
receives each broadcast into freshly allocated tensors and keeps them in ``staged``. Nothing the decode
thread reads is touched until :meth:`WeightStore.apply_staged` runs in the decode thread between two
steps; it only re-points each parameter at its new tensor, so the swap costs microseconds whatever the
model size.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.weights import buckets, rendezvous


class WeightError(ValueError):
    """A weight-update request the engine refuses; the message goes back as ``message``."""


class Receiver:
    """One background thread, at a lower CPU priority than the decode thread, that joins groups and
    receives broadcasts. On a loaded machine the receive then takes the decode loop's leftovers
    instead of competing with it; gloo's own I/O threads, created here, inherit the priority."""

    def __init__(self, nice: int = 10):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._nice = nice
        self._thread = threading.Thread(target=self._loop, name="engine-weights", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:  # Linux: a thread id here sets this thread's niceness only
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        except (OSError, AttributeError):
            pass
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
    """HF-named parameters of the served model, the weight-update groups, and the staging area."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())
        self.aliases: dict[str, str] = {}
        ptr = {p.data_ptr(): n for n, p in self.params.items()}
        for name, t in model.state_dict().items():  # tied weights: lm_head.weight -> embed_tokens
            if name not in self.params and t.data_ptr() in ptr:
                self.aliases[name] = ptr[t.data_ptr()]
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.session_open = False
        self.staged: dict[str, torch.Tensor] = {}
        self.pending_version: str | None = None
        self.lock = threading.Lock()  # one weight operation at a time (HTTP threads)
        self.receiver = Receiver()

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
        self.groups[group_name] = self.receiver.run(
            lambda: rendezvous.init_custom_process_group(
                master_address=master_address,
                master_port=master_port,
                rank=rank_offset,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
                timeout_s=timeout_s,
            )
        )

    def destroy_group(self, group_name: str) -> None:
        pg = self.groups.pop(group_name, None)
        if pg is None:
            raise WeightError(f"no weight-update group named {group_name!r}")
        rendezvous.destroy_process_group(pg)

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
        return self.receiver.run(lambda: self._receive(pg, names, dtypes, shapes, load_format))

    def _receive(self, pg, names, dtypes, shapes, load_format) -> list[tuple[str, torch.Tensor]]:
        if load_format == "flattened_bucket":
            _, total = buckets.flat_layout(dtypes, shapes)
            flat = torch.empty(total, dtype=torch.uint8)
            dist.broadcast(flat, src=0, group=pg)
            return list(zip(names, buckets.unflatten(flat, dtypes, shapes), strict=True))
        # Post every receive before waiting on any (as SGLang does): one round trip per call, not
        # one per tensor.
        out = [
            (n, torch.empty(s, dtype=dt)) for n, dt, s in zip(names, dtypes, shapes, strict=True)
        ]
        works = [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in out]
        for w in works:
            w.wait()
        return out

    def stage(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Check names and shapes, convert dtypes, and keep the tensors for the next swap."""
        bad = []
        ready = {}
        for name, t in named:
            key = self.resolve(name)
            if key is None:
                bad.append(f"{name}: no such parameter")
                continue
            p = self.params[key]
            if tuple(t.shape) != tuple(p.shape):
                bad.append(f"{name}: shape {list(t.shape)} != {list(p.shape)}")
                continue
            ready[key] = t.to(p.dtype).contiguous()
        if bad:
            raise WeightError(
                "; ".join(bad[:5]) + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else "")
            )
        self.staged.update(ready)

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

    def take_staged(self) -> tuple[dict[str, torch.Tensor], str | None]:
        staged, version = self.staged, self.pending_version
        self.staged, self.pending_version = {}, None
        return staged, version

    def apply(self, staged: dict[str, torch.Tensor]) -> None:
        """Re-point parameters at staged tensors. Decode thread only, between two steps."""
        for key, t in staged.items():
            self.params[key].data = t

    # ---- reading ---------------------------------------------------------------------------------

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.data) for n, p in self.params.items()]

    def get(self, name: str, truncate_size: int) -> list:
        key = self.resolve(name)
        if key is None:
            raise WeightError(f"no parameter named {name!r}")
        return self.params[key].data[:truncate_size].tolist()

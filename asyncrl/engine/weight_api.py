"""The weight endpoints: update groups, the begin/update/end session, disk loads, versions, checks.

JSON in, ``Reply`` out, no HTTP here. Each handler checks its request's fields and calls the weight
store, which holds the update session's state (``asyncrl.engine.weights``). Fields and
response shapes follow SGLang 0.5.23 (python/sglang/srt/entrypoints/http_server.py,
managers/io_struct.py); a refused request answers ``success: false`` with the reason.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.engine.replies import BadRequest, Reply, fail, field, is_int, ok
from asyncrl.engine.weights import WeightError
from asyncrl.weights import buckets, ipc
from asyncrl.weights.buckets import parse_dtype

if TYPE_CHECKING:
    from asyncrl.engine.api import Engine

NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Pause with mode 'retract' first, or send flush_cache: false."
)


@dataclass
class WeightAPI:
    """One method per weight endpoint, over the engine's weight store."""

    engine: Engine

    def init_weights_update_group(self, body: dict) -> Reply:
        try:
            kw = dict(
                master_address=field(body, "master_address", str),
                master_port=int(field(body, "master_port", (int, str))),
                rank_offset=field(body, "rank_offset", int),
                world_size=field(body, "world_size", int),
                group_name=field(body, "group_name", str, "weight_update_group"),
                backend=field(body, "backend", str, "nccl"),
                # asyncrl's extension (SGLang ignores unknown keys): the group's collective timeout,
                # so a peer that dies mid-broadcast frees this engine within the trainer's bound
                timeout_s=float(field(body, "timeout_s", (int, float), 300.0)),
            )
            if not kw["timeout_s"] > 0:
                raise ValueError(f"timeout_s must be > 0, got {kw['timeout_s']}")
        except (BadRequest, ValueError) as e:
            return fail(f"Failed to initialize custom process group: {e}.")
        if kw["backend"] == "nccl" and self.engine.store.device.type != "cuda":
            # an engine on CPU cannot join NCCL; gloo speaks the same rendezvous (the trainer must too)
            print(
                "asyncrl engine: 'nccl' requested of an engine on CPU; joining with gloo",
                file=sys.stderr,
            )
            kw["backend"] = "gloo"
        if not 0 < kw["rank_offset"] < kw["world_size"]:
            return fail(
                f"Failed to initialize custom process group: rank_offset {kw['rank_offset']} must be in [1, world_size)."
            )
        try:
            self.engine.store.init_group(**kw)
        except Exception as e:
            return fail(f"Failed to initialize custom process group: {e}.")
        return ok("Succeeded to initialize custom process group.")

    def destroy_weights_update_group(self, body: dict) -> Reply:
        try:
            self.engine.store.destroy_group(body.get("group_name", "weight_update_group"))
        except WeightError as e:
            return fail(f"Failed to destroy custom process group: {e}.")
        return ok("Succeeded to destroy custom process group.")

    def begin_weight_update(self, body: dict) -> Reply:
        try:
            # asyncrl's extension: a learner that gave up on an update (a generator that takes
            # weights by handle has no group whose new build would discard its session)
            self.engine.store.begin(abandon_open=body.get("abandon_open") is True)
        except WeightError as e:
            return fail(str(e))
        return ok("Success")

    def end_weight_update(self, body: dict) -> Reply:
        try:
            pause = self.engine.store.end()
        except WeightError as e:
            return fail(str(e))
        return Reply(
            200,
            {
                "success": True,
                "message": "Success",
                "pause_s": pause,
                "swap_ts": self.engine.scheduler.stats.last_swap_ts,
                "weight_version": self.engine.version,
            },
        )

    def update_weights_from_distributed(self, body: dict) -> Reply:
        try:
            if "names" in body:
                names, dtypes, shapes = body["names"], body.get("dtypes"), body.get("shapes")
            else:  # the pre-list form: one tensor
                names, dtypes, shapes = [body.get("name")], [body.get("dtype")], [body.get("shape")]
            if not (
                isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            ):
                raise BadRequest("`names`, `dtypes` and `shapes` must be lists")
            if not len(names) == len(dtypes) == len(shapes) or not names:
                raise BadRequest(
                    "`names`, `dtypes` and `shapes` must be non-empty and of equal length"
                )
            if not all(isinstance(n, str) for n in names):
                raise BadRequest("`names` must be strings")
            dts = [parse_dtype(d) if isinstance(d, str) else None for d in dtypes]
            if None in dts:
                raise BadRequest('`dtypes` must be torch dtype names such as "float32"')
            if not all(
                isinstance(s, list) and all(is_int(x) and x >= 0 for x in s) for s in shapes
            ):
                raise BadRequest("`shapes` must be lists of non-negative ints")
            group = body.get("group_name", "weight_update_group")
            load_format = body.get("load_format")
            if load_format not in (None, "flattened_bucket"):
                raise BadRequest(
                    f'load_format {load_format!r} is not supported (None or "flattened_bucket")'
                )
            version = body.get("weight_version")
            if version is not None and not isinstance(version, str):
                raise BadRequest("`weight_version` must be a string")
        except (BadRequest, ValueError) as e:
            return fail(str(e))
        try:
            self.engine.store.update(
                names=names,
                dtypes=dts,
                shapes=shapes,
                group_name=group,
                load_format=load_format,
                version=version,
                abort_all=bool(body.get("abort_all_requests", False)),
            )
        except WeightError as e:
            return fail(str(e))
        msg = "Succeeded to update parameter online."
        if version is not None:
            msg += f" Weight version updated to {version}."
        if body.get("flush_cache", True) and self.engine.call(self.engine.scheduler.n_resident):
            return fail(NOT_FLUSHED)
        return ok(msg)

    def update_weights_from_tensor(self, body: dict) -> Reply:
        """SGLang's ``/update_weights_from_tensor``: one bucket by handle (asyncrl.weights.ipc),
        ``serialized_named_tensors`` one payload per TP rank (this engine is rank 0 of one). Only
        from a loopback peer: the server refuses others before this runs (a payload is a pickle)."""
        try:
            payloads = body.get("serialized_named_tensors")
            if not isinstance(payloads, list) or not payloads:
                raise BadRequest(
                    "`serialized_named_tensors` must be a non-empty list (one per rank)"
                )
            load_format = body.get("load_format")
            if load_format not in (None, ipc.FLATTENED):
                raise BadRequest(
                    f"load_format {load_format!r} is not supported (None or {ipc.FLATTENED!r})"
                )
            version = body.get("weight_version")
            if version is not None and not isinstance(version, str):
                raise BadRequest("`weight_version` must be a string")
        except BadRequest as e:
            return fail(str(e))
        try:
            self.engine.store.update_from_tensor(
                payloads[0],
                load_format=load_format,
                version=version,
                abort_all=bool(body.get("abort_all_requests", False)),
            )
        except WeightError as e:
            return fail(str(e))
        if body.get("flush_cache", True) and self.engine.call(self.engine.scheduler.n_resident):
            return fail(NOT_FLUSHED)
        return ok("Success")

    def update_weights_from_disk(self, body: dict) -> Reply:
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            return fail("`model_path` (a string) is required", num_paused_requests=0)
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            return fail("`weight_version` must be a string", num_paused_requests=0)
        if not Path(path).exists():
            return fail(
                f"Failed to update model weights: {path} does not exist.", num_paused_requests=0
            )
        try:
            pause = self.engine.store.load_from_disk(
                path, version=version, abort_all=bool(body.get("abort_all_requests", False))
            )
        except WeightError as e:
            return fail(str(e), num_paused_requests=0)
        msg = "Succeeded to update model weights."
        if version is not None:
            msg += f" Weight version updated to {version}."
        return Reply(
            200, {"success": True, "message": msg, "num_paused_requests": 0, "pause_s": pause}
        )

    def update_weight_version(self, body: dict) -> Reply:
        new = body.get("new_version")
        if not isinstance(new, str) or not new:
            raise BadRequest("`new_version` (a string) is required")
        if body.get("abort_all_requests", True):
            self.engine.abort_all()
        self.engine.store.relabel(new)
        return Reply(
            200,
            {"success": True, "message": f"Weight version updated to {new}", "new_version": new},
        )

    def get_weights_by_name(self, body: dict) -> Reply:
        name = body.get("name")
        size = body.get("truncate_size", 100)
        if not isinstance(name, str):
            raise BadRequest("`name` (a string) is required")
        try:
            size = int(size)
            return Reply(200, self.engine.store.get(name, size))
        except (WeightError, ValueError) as e:
            raise BadRequest(str(e)) from None

    def weights_checker(self, body: dict) -> Reply:
        action = body.get("action", "checksum")
        if action != "checksum":
            return fail(
                f'action {action!r} is not supported by the built-in engine (only "checksum")'
            )
        skip = body.get("skip_tensor_list") or []
        sample = body.get("sample", 0)
        if not isinstance(sample, int) or isinstance(sample, bool) or sample < 0:
            raise BadRequest("`sample` must be an integer >= 0 (values hashed per tensor; 0: all)")
        # take the tensor references between two steps (one consistent version), hash them here:
        # a swap re-points parameters and never writes into a tensor, so these stay intact
        named = self.engine.call(self.engine.store.named)
        h = buckets.checksum(((n, t) for n, t in named if n not in set(skip)), sample=sample)
        return Reply(
            200,
            {
                "success": True,
                "message": "checksum over HF-named parameters (asyncrl.weights.buckets.checksum)",
                "checksum": h,
                "per_engine_checksum": [h],
                "weight_version": self.engine.version,
            },
        )

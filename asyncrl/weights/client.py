"""HTTP control calls the broadcaster makes to one generator (SGLang or the built-in engine).

One method per endpoint of SGLang's weight-update API (SGLang 0.5.23's
http_server.py; docs/design.md §3), each with a timeout.
Every failure becomes a :class:`GeneratorError` whose ``dead`` flag says whether the server could not
be reached at all (connection refused or reset, timeout) or answered with an error, so the
broadcaster can tell "drop it" from "it is alive but refused".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

import httpx

from asyncrl.recipe import PauseMode
from asyncrl.wire import GeneratorInfo


class GeneratorError(RuntimeError):
    """A control call failed. ``dead``: the server did not answer (unreachable, reset or timed out)."""

    def __init__(self, url: str, path: str, message: str, *, dead: bool):
        self.url, self.path, self.dead = url, path, dead
        super().__init__(f"{url}{path}: {message}")


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """One build of the weight-update process group, as ``/init_weights_update_group`` takes it."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float


class WeightsClient:
    """Control client for one generator. Thread-safe: calls may run from several threads at once."""

    def __init__(self, info: GeneratorInfo, *, timeout_s: float, api_key: str | None = None):
        self.info = info
        self.url = info.url.rstrip("/")
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    # ---- plumbing -------------------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        *,
        timeout_s: float | None = None,
        ok_404: bool = False,
    ) -> Any:
        """One request; returns the decoded JSON (``None`` for an empty body, or on 404 if ok_404)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            r = self._http.request(method, path, json=body, timeout=timeout)
        except httpx.TimeoutException as e:
            raise GeneratorError(self.url, path, f"no answer within {timeout:g}s", dead=True) from e
        except httpx.TransportError as e:
            raise GeneratorError(self.url, path, f"unreachable: {e!r}", dead=True) from e
        if r.status_code == 404 and ok_404:
            return None
        data: Any = None
        if r.content:
            try:
                data = r.json()
            except ValueError:
                data = {"message": r.text[:200]}
        if r.status_code >= 400:
            msg = data.get("message") if isinstance(data, dict) else None
            raise GeneratorError(
                self.url, path, f"HTTP {r.status_code}: {msg or r.text[:200]}", dead=False
            )
        if isinstance(data, dict) and data.get("success") is False:
            raise GeneratorError(
                self.url, path, str(data.get("message", "success: false")), dead=False
            )
        return data

    # ---- endpoints ------------------------------------------------------------------------------

    def health(self, *, timeout_s: float | None = None) -> bool:
        try:
            self._call("GET", "/health", timeout_s=timeout_s)
            return True
        except GeneratorError:
            return False

    def model_info(self, *, timeout_s: float | None = None) -> dict:
        data = self._call("GET", "/model_info", timeout_s=timeout_s)
        if not isinstance(data, dict):
            raise GeneratorError(self.url, "/model_info", "expected a JSON object", dead=False)
        return data

    def server_info(self, *, timeout_s: float | None = None) -> dict | None:
        """SGLang's resolved server arguments (``tp_size``, ``dp_size``...); None where the server has
        no such endpoint (the built-in engine). ``/get_server_info`` is the older name."""
        for path in ("/server_info", "/get_server_info"):
            data = self._call("GET", path, timeout_s=timeout_s, ok_404=True)
            if data is not None:
                if not isinstance(data, dict):
                    raise GeneratorError(self.url, path, "expected a JSON object", dead=False)
                return data
        return None

    def weight_version(self, *, timeout_s: float | None = None) -> str | None:
        v = self.model_info(timeout_s=timeout_s).get("weight_version")
        return None if v is None else str(v)

    def pause(self, mode: PauseMode) -> None:
        """Pause generation; ``mode`` is "in_place" or "retract", never "abort" (no lost work)."""
        if mode not in get_args(PauseMode):
            raise ValueError(f"pause mode must be one of {get_args(PauseMode)}, got {mode!r}")
        self._call("POST", "/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/continue_generation", {})

    def begin(self) -> bool:
        """Open an update session. False: the server predates sessions (SGLang <= 0.5.20, 404)."""
        return self._call("POST", "/begin_weight_update", {}, ok_404=True) is not None

    def end(self) -> dict:
        """Close the session. The built-in engine swaps the staged weights in here and reports the
        swap's pause in ``pause_s``."""
        data = self._call("POST", "/end_weight_update", {})
        return data if isinstance(data, dict) else {}

    def init_group(self, spec: GroupSpec, *, rank_offset: int) -> None:
        """Join the group; blocks until every rank has joined. ``timeout_s`` is our extension
        (SGLang ignores unknown keys): the built-in engine uses it as its group's timeout."""
        body = {
            "master_address": spec.master_address,
            "master_port": spec.master_port,
            "rank_offset": rank_offset,
            "world_size": spec.world_size,
            "group_name": spec.group_name,
            "backend": spec.backend,
            "timeout_s": spec.timeout_s,
        }
        self._call("POST", "/init_weights_update_group", body, timeout_s=2 * spec.timeout_s + 5)

    def destroy_group(self, group_name: str, *, timeout_s: float | None = None) -> None:
        body = {"group_name": group_name}
        self._call("POST", "/destroy_weights_update_group", body, timeout_s=timeout_s)

    def update_from_distributed(
        self,
        meta: dict,
        *,
        group_name: str,
        load_format: str,
        weight_version: str | None,
        flush_cache: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        """Receive one bucket; returns after the broadcast has been received and loaded.

        ``flush_cache`` only after a ``retract`` pause (requests hold no KV then): with ``in_place``
        they stay resident and SGLang answers a flush with 400."""
        body: dict[str, Any] = {
            **meta,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
        }
        if load_format == "flattened_bucket":
            body["load_format"] = "flattened_bucket"
        if weight_version is not None:
            body["weight_version"] = weight_version
        self._call("POST", "/update_weights_from_distributed", body, timeout_s=timeout_s)

    def update_from_disk(self, model_path: str, *, weight_version: str) -> None:
        body = {
            "model_path": model_path,
            "weight_version": weight_version,
            "abort_all_requests": False,
            "flush_cache": False,
        }
        self._call("POST", "/update_weights_from_disk", body)

    def checksum(self, *, sample: int = 0) -> str | None:
        """The server's weights checksum (:func:`asyncrl.weights.buckets.checksum`, ``sample`` values
        per tensor; 0: all), or None if it gives none we can compare (SGLang's own
        ``per_engine_checksum`` hashes differently, per fused parameter)."""
        body: dict = {"action": "checksum"}
        if sample and self.info.kind == "builtin":  # SGLang's request schema has no such key
            body["sample"] = sample
        data = self._call("POST", "/weights_checker", body)
        if not isinstance(data, dict):
            return None
        c = data.get("checksum")
        return c if isinstance(c, str) else None

"""The sections of what passes between the learner and the workers: ``buffer`` (the replay
buffer's service, its batches and staleness bound, its TLS) and ``weights`` (how each version
reaches the generators). Read on both sides: by the learner that hosts the buffer and sends the
weights, and by the workers and engines that put to the one and receive the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from asyncrl.recipe.fields import Dtype, PauseMode, setting


@dataclass(kw_only=True)
class TLSConfig:
    cert: str = setting("", doc="this side's certificate (PEM)")
    key: str = setting("", doc="this side's private key (PEM)")
    ca: str = setting("", doc="the CA that signs the peers' certificates (PEM)")


@dataclass(kw_only=True)
class BufferConfig:
    address: str = setting("tcp://127.0.0.1:0", doc="Req/Rep address of the buffer service")
    pub_address: str = setting("tcp://127.0.0.1:0", doc="Pub/Sub address of version announcements")
    groups_per_batch: int = setting(8, lo=1)
    max_staleness: int = setting(
        1, lo=0, doc="eta: no token older than this many versions is trained on"
    )
    max_batches_ahead: int = setting(
        0,
        lo=0,
        doc="most batches ahead: groups stored or running <= this x groups_per_batch; 0 = "
        "max_staleness + 1 (AReaL). The depth moves below it by the learner's waits "
        "(adaptive_depth_wait) or stays at it (adaptive_depth_wait false)",
    )
    adaptive_depth_ess: float = setting(
        0.0,
        lo=0,
        hi=1,
        doc="adaptive pipeline depth (0: off): after a step whose importance-weight ESS is below "
        "this, one batch fewer ahead (down to 1), else one more (up to max_batches_ahead)",
    )
    adaptive_depth_kl: float = setting(
        0.0,
        lo=0,
        doc="adaptive pipeline depth (0: off): after a step whose KL(μ ‖ π_prox) is above this, "
        "one batch fewer ahead (down to 1), else one more (up to max_batches_ahead)",
    )
    adaptive_depth_wait: bool = setting(
        True,
        doc="the pipeline depth by throughput: starts at 1 batch ahead; one deeper after a batch "
        "the learner waited for while the depth (not eta) refused a worker starts, one shallower "
        "when a further whole batch is already stored; up to max_batches_ahead. Depth only where "
        "it buys the learner time (docs/off-policy.md); false: the fixed max_batches_ahead",
    )
    batch_order: Literal["oldest", "newest"] = setting(
        "oldest",
        doc="which stored groups a batch takes: oldest (by behaviour version: each group is trained "
        "once its turn comes) or newest (the freshest: older groups wait, and one that ages past "
        "max_staleness is dropped and its start reused; fresher data for the price of that waste)",
    )
    lease_seconds: float = setting(120.0, lo=0, lo_open=True)
    dynamic_sampling: bool = setting(
        False,
        doc="DAPO: drop groups whose rewards are all equal (group advantages only: refused with "
        "gae and vtrace, whose A = R - V of such a group is not 0)",
    )
    min_batch_fill: float = setting(
        1.0,
        lo=0,
        hi=1,
        lo_open=True,
        doc="smallest batch fraction taken after partial_batch_after_s",
    )
    partial_batch_after_s: float = setting(
        10.0, lo=0, doc="with min_batch_fill < 1: wait this long for a full batch, then take less"
    )
    overlong_filter: bool = setting(False, doc="drop samples cut by max_new_tokens from the loss")
    batch_timeout_s: float = setting(
        600.0, lo=0, lo_open=True, doc="learner's longest wait for a batch"
    )
    tls: TLSConfig = setting(factory=TLSConfig)


@dataclass(kw_only=True)
class WeightsConfig:
    every: int = setting(1, lo=1, doc="publish weights every k versions")
    backend: Literal["auto", "gloo", "nccl", "ipc"] = setting(
        "auto",
        doc="auto: ipc for an engine on rank 0's own GPU, gloo for one on CPU, else nccl; ipc: "
        "each bucket as a handle to rank 0's memory (CUDA IPC; shared memory on CPU), same host",
    )
    bucket_mb: float = setting(512.0, lo=0, lo_open=True, doc="MiB per update call (as slime)")
    load_format: Literal["list", "flattened_bucket"] = setting("list", doc="per tensor (as slime)")
    dtype: Dtype = setting("float32")
    timeout_s: float = setting(
        60.0, lo=0, lo_open=True, doc="a generator slower than this is dropped"
    )
    overlap: bool = setting(True, doc="broadcast version v while the learner computes v+1")
    verify: Literal["sampled", "full", "off"] = setting(
        "sampled",
        doc="after each version, compare a checksum of the generators' weights with what was sent: "
        "sampled (4096 values per tensor, cheap at any size), full (every byte), off",
    )
    pause_mode: PauseMode = setting(
        "in_place",
        doc="SGLang pause during an update. in_place: requests keep their KV (run SGLang with "
        "--disable-radix-cache, or new requests may reuse prefixes the old weights computed); "
        "retract: KV recomputed on continue and the prefix cache flushed",
    )
    master_addr: str = setting("127.0.0.1")
    master_port: int = setting(0, lo=0, hi=65535, doc="0: pick a free port")
    group_name: str = setting("asyncrl_weights")

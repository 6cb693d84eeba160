"""Rank 0 of a weight group, broadcasting what it is told (tests/engine/test_fused.py).

    python tests/engine/rank0_peer.py GROUP_NAME

Hosts the group's store on a port the OS picks and prints it (``port N``): a port found free and
bound only later could be taken in between. Joins as rank 0 of a 2-rank gloo group through the
learner's rendezvous (:func:`asyncrl.weights.rendezvous.init_custom_process_group`), then reads lines ``FORMAT PATH``
from stdin: the (name, tensor) list saved at PATH is broadcast one tensor at a time (``list``) or as
one flattened bucket (``flattened_bucket``), as the learner sends a bucket. At the end of stdin it
leaves the group. Its own process, because one process cannot hold both ends of a group (c10d
refuses a second group of the same name).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from asyncrl.weights import buckets, rendezvous  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    name = sys.argv[1]
    store = rendezvous.host_store("127.0.0.1", 300.0)
    print(f"port {store.port}", flush=True)
    pg = rendezvous.init_custom_process_group(
        master_address="127.0.0.1", master_port=store.port, rank=0, world_size=2, group_name=name
    )
    del store  # the group's own store keeps the server
    for line in sys.stdin:
        fmt, path = line.split()
        tensors = [t for _, t in torch.load(path, weights_only=True)]
        if fmt == "flattened_bucket":
            dist.broadcast(buckets.flatten(tensors), src=0, group=pg)
        else:
            for t in tensors:
                dist.broadcast(t, src=0, group=pg)
    rendezvous.destroy_process_group(pg)


if __name__ == "__main__":
    main()

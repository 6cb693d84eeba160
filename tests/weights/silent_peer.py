"""A peer that joins a weight group and then never takes part in a broadcast (tests/weights/test_bounds.py).

    python tests/weights/silent_peer.py PORT GROUP_NAME TIMEOUT_S

Joins as rank 1 of a 2-rank gloo group through the same rendezvous as a generator
(:func:`asyncrl.weights.rendezvous.init_custom_process_group`), prints ``joined``, then waits until
its stdin is closed: a live generator stuck elsewhere, which rank 0's bounded wait must not take
for a completed broadcast.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from asyncrl.weights import rendezvous  # noqa: E402


def main() -> None:
    port, name, timeout_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    rendezvous.init_custom_process_group(
        master_address="127.0.0.1",
        master_port=port,
        rank=1,
        world_size=2,
        group_name=name,
        backend="gloo",
        timeout_s=timeout_s,
    )
    print("joined", flush=True)
    sys.stdin.read()  # until rank 0 closes it; the process then exits without a collective


if __name__ == "__main__":
    main()

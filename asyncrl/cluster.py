"""Which learner node is torchrun's node rank 0, decided before torchrun starts.

The buffer, the version channel and the weight group's TCPStore are addressed at the first learner
node, so that node must hold learner rank 0. torchrun's c10d rendezvous does not promise it (it
orders nodes by their own names and ignores ``--node-rank``), so the sbatch script uses a static
rendezvous: each node takes its node rank from its place in the job's learner list, and the first
node is the master. ``python -m asyncrl.cluster NODE N0,N1,...`` prints the torchrun flags for NODE.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


class ClusterError(ValueError):
    """This node is not in the learner list (one line, naming both)."""


def _short(name: str) -> str:
    return name.split(".", 1)[0]


def node_rank(node: str, learner_nodes: Sequence[str]) -> int:
    """This node's place in the learner list: its exact name, else its short name (SLURM's node
    names and a host's FQDN may differ only by the domain). Names must identify one node."""
    nodes = list(learner_nodes)
    if node in nodes:
        return nodes.index(node)
    matches = [i for i, n in enumerate(nodes) if _short(n) == _short(node)]
    if len(matches) == 1:
        return matches[0]
    why = "matches several" if matches else "is not one of"
    raise ClusterError(f"node {node!r} {why} the learner nodes {','.join(nodes)}")


def torchrun_rendezvous(node: str, learner_nodes: Sequence[str], port: int) -> list[str]:
    """torchrun's static-rendezvous flags for ``node``: rank 0 on the first learner node, which is
    also the master (the address every other process dials)."""
    nodes = list(learner_nodes)
    return [
        f"--nnodes={len(nodes)}",
        f"--node-rank={node_rank(node, nodes)}",
        f"--master-addr={nodes[0]}",
        f"--master-port={port}",
    ]


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m asyncrl.cluster NODE NODE0,NODE1,... PORT", file=sys.stderr)
        return 2
    node, nodes, port = argv
    try:
        print(" ".join(torchrun_rendezvous(node, [n for n in nodes.split(",") if n], int(port))))
    except (ClusterError, ValueError) as e:
        print(f"asyncrl.cluster: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

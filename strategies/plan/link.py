"""How long a collective takes on a link: latency per step plus bytes over bandwidth, ring or tree.

A ring all-gather or reduce-scatter over n ranks takes n - 1 steps, each rank moving (n - 1) / n of the whole
buffer; a ring all-reduce is a reduce-scatter then an all-gather; a tree all-reduce moves the buffer up and down a
tree of depth log2(n). NCCL picks the faster of ring and tree for all-reduce, as this does. The bandwidth is the
collective's bus bandwidth per rank (what nccl-tests reports as busbw), so the same number serves every kind.
"""

from __future__ import annotations

import math

from .hardware import Link

# an all-to-all moves as an all-gather does; a send is one rank's buffer to one other (a pipeline's activations)
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send")


def collective_seconds(kind: str, nbytes: int, ranks: int, link: Link) -> float:
    """Seconds for one collective over `ranks` ranks of a buffer of `nbytes` (the whole, gathered size)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not a collective the plan knows; choose one of {list(KINDS)}")
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    if kind == "send":
        return nbytes / link.bandwidth + link.latency
    moved = (ranks - 1) / ranks * nbytes / link.bandwidth
    if kind != "all_reduce":
        return moved + (ranks - 1) * link.latency
    ring = 2 * moved + 2 * (ranks - 1) * link.latency
    tree = 2 * nbytes / link.bandwidth + 2 * math.ceil(math.log2(ranks)) * link.latency
    return min(ring, tree)

"""Collective and point-to-point times in the alpha-beta(-gamma) model.

n bytes over p ranks, alpha seconds per message, beta seconds per byte (1 / (bandwidth *
efficiency)), gamma seconds per byte reduced (Thakur, Rabenseifner & Gropp 2005; Chan et al.
2007; the same model Calculon validates with t = latency + S / (bandwidth * efficiency)):
  ring all-reduce          2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma
  ring reduce-scatter      (p-1) alpha + (p-1)/p n beta        (all-gather: the same)
  binomial tree all-reduce 2 log2(p) (alpha + n beta)            (reduce, then broadcast)
  hierarchical all-reduce  intra reduce-scatter(g) + inter all-reduce(n/g) + intra all-gather(g)
  point to point           alpha + n beta
The ring terms' bytes per rank are :func:`thinwire.ring.ring_share`'s, which the ledger
and the methods' traffic formulas count too; all-gather here takes the full gathered size n,
so its time is the reduce-scatter's.
Ranks are placed as Megatron does: tensor-parallel ranks fastest, then data-parallel, then
pipeline, so a data-parallel group has min(d, g/t) members per node (g devices per node) and
each member drives its own share of the node's network links.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from thinwire.planner.specs import ClusterSpec
from thinwire.planner.strategy import StrategySpec
from thinwire.ring import ring_share


@dataclass(frozen=True)
class Link:
    """alpha (s per message) and beta (s per byte) of one link class."""

    alpha: float
    beta: float

    @staticmethod
    def of(bandwidth: float, efficiency: float, latency: float) -> Link:
        return Link(alpha=latency, beta=1.0 / (bandwidth * efficiency))


def intra_link(cluster: ClusterSpec) -> Link:
    """The intra-node link (NVLink / shared memory)."""
    return Link.of(cluster.intra_bandwidth, cluster.intra_efficiency, cluster.intra_latency)


def inter_link(cluster: ClusterSpec, bandwidth: float | None = None) -> Link:
    """The inter-node link; ``bandwidth`` overrides the cluster's (bytes/s per device)."""
    bw = cluster.inter_bandwidth if bandwidth is None else bandwidth
    return Link.of(bw, cluster.inter_efficiency, cluster.inter_latency)


def ring_all_reduce_time(n: float, p: int, link: Link, gamma: float = 0.0) -> float:
    """2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma."""
    if p <= 1:
        return 0.0
    return (2 * (p - 1) * link.alpha + ring_share("all_reduce", p) * n * link.beta
            + ring_share("reduce_scatter", p) * n * gamma)


def ring_reduce_scatter_time(n: float, p: int, link: Link) -> float:
    """(p-1) alpha + (p-1)/p n beta; n is the full (unscattered) size."""
    if p <= 1:
        return 0.0
    return (p - 1) * link.alpha + ring_share("reduce_scatter", p) * n * link.beta


ring_all_gather_time = ring_reduce_scatter_time


def tree_all_reduce_time(n: float, p: int, link: Link) -> float:
    """Binomial-tree reduce then broadcast: 2 log2(p) (alpha + n beta)."""
    if p <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(p)) * (link.alpha + n * link.beta)


def p2p(n: float, link: Link) -> float:
    """alpha + n beta."""
    return link.alpha + n * link.beta


def allreduce(n: float, local: int, nodes: int, intra: Link, inter: Link) -> float:
    """All-reduce over ``local`` ranks per node on ``nodes`` nodes: the best of ring and tree
    inside a flat group, hierarchical when the group spans nodes with several local members."""
    if nodes <= 1:
        return min(ring_all_reduce_time(n, local, intra), tree_all_reduce_time(n, local, intra))
    if local <= 1:
        return min(ring_all_reduce_time(n, nodes, inter), tree_all_reduce_time(n, nodes, inter))
    cross = min(ring_all_reduce_time(n / local, nodes, inter), tree_all_reduce_time(n / local, nodes, inter))
    return ring_reduce_scatter_time(n, local, intra) + cross + ring_all_gather_time(n, local, intra)


def reduce_scatter(n: float, local: int, nodes: int, intra: Link, inter: Link) -> float:
    """Hierarchical reduce-scatter: inside the node first, then across nodes on n/local."""
    return ring_reduce_scatter_time(n, local, intra) + ring_reduce_scatter_time(n / local, nodes, inter)


def all_gather(n: float, local: int, nodes: int, intra: Link, inter: Link) -> float:
    """Hierarchical all-gather, the mirror of :func:`reduce_scatter`."""
    return ring_all_gather_time(n / local, nodes, inter) + ring_all_gather_time(n, local, intra)


def dp_placement(cluster: ClusterSpec, s: StrategySpec) -> tuple[int, int]:
    """(members per node, nodes spanned) of one data-parallel group (TP, then DP, then PP)."""
    per_node = max(1, cluster.devices_per_node // s.tp)
    local = min(s.dp, per_node)
    return local, max(1, math.ceil(s.dp / local))


def pp_crosses_nodes(cluster: ClusterSpec, s: StrategySpec) -> bool:
    """Whether some pipeline boundary crosses a node (stage stride t*d, p stages)."""
    return s.pp > 1 and s.tp * s.dp * s.pp > cluster.devices_per_node


def ring_wire_factor(p: int) -> float:
    """Bytes a ring all-reduce puts on each rank's wire per payload byte: 2(p-1)/p."""
    return ring_share("all_reduce", p)

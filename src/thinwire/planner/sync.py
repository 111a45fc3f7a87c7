"""How replicas synchronise, per step: plain DP, ZeRO, compressed DP, local SGD, IST.

Bytes and seconds per device per optimizer step, for Psi parameters held by each replica,
g bytes per gradient element and n data-parallel workers (compression.md, ist.md):
- dp (ZeRO 0): all-reduce of g*Psi bytes; wire 2(n-1)/n g*Psi per worker (ring).
- ZeRO 1/2: reduce-scatter of gradients + all-gather of w-byte weights (same volume);
  ZeRO 3: per micro-batch, all-gather weights forward and backward + reduce-scatter gradients
  (1.5x DP, Rajbhandari et al. 2020, Sec. 7).
- compressed: payload / ratio plus encode + decode time; compression is used only where it
  pays, (1 - 1/ratio) * S / (bandwidth * efficiency) > encode + decode.
- localsgd / DiLoCo: the DP all-reduce once every H steps (time and bytes / H).
- ist: per round every worker receives its subnet and sends it back, 2 x subnet bytes, once
  per K local steps. Central deployment: rank 0 (also a worker) sends and receives the n-1
  other subnets, 2(n-1) x subnet bytes on its link; sharded: each worker exchanges ~2 x subnet
  bytes, (n-1)/n of it over the wire (its own shard stays local).
"""

from __future__ import annotations

from dataclasses import dataclass

from thinwire.planner.comm import Link, all_gather, allreduce, reduce_scatter, ring_wire_factor
from thinwire.planner.strategy import StrategySpec


@dataclass(frozen=True)
class SyncCost:
    """Per-step synchronisation of one device (the busiest one for central IST)."""

    time: float
    """Seconds per step spent communicating (amortised over H or K)."""
    codec: float
    """Seconds per step encoding + decoding (compressed DP when it pays)."""
    payload_bytes: float
    """Ledger payload per worker per step (what the strategy hands to the collective)."""
    wire_bytes: float
    """Estimated bytes on the busiest worker's wire per step."""
    compressed: bool = False
    """Whether compression was switched on."""

    @property
    def total(self) -> float:
        return self.time + self.codec


@dataclass(frozen=True)
class SyncInputs:
    """What the synchronisation of one replica depends on."""

    params: float
    """Psi, parameters per replica (per device after TP/PP splits)."""
    subnet: float
    """IST subnet parameters per worker (== params otherwise)."""
    grad_bytes: float
    """Bytes per gradient element on the wire."""
    weight_bytes: float
    """Bytes per weight element (ZeRO all-gathers)."""
    local: int
    """Data-parallel members per node."""
    nodes: int
    """Nodes a data-parallel group spans."""
    intra: Link
    inter: Link
    codec_bytes_per_s: float
    """Memory-bound codec throughput (bytes of gradient per second per pass)."""


def _dp_time(x: SyncInputs, s: StrategySpec, payload: float) -> float:
    if s.dp <= 1:
        return 0.0
    if s.zero == 0:
        return allreduce(payload, x.local, x.nodes, x.intra, x.inter)
    weights = payload * x.weight_bytes / x.grad_bytes
    rs = reduce_scatter(payload, x.local, x.nodes, x.intra, x.inter)
    ag = all_gather(weights, x.local, x.nodes, x.intra, x.inter)
    if s.zero == 3:
        return s.micro_batches * (rs + 2 * ag)
    return rs + ag


def _ist(x: SyncInputs, s: StrategySpec) -> SyncCost:
    n, k = s.dp, s.local_steps
    sub = x.subnet * x.grad_bytes
    if n <= 1:
        return SyncCost(0.0, 0.0, 0.0, 0.0)
    link = x.inter if x.nodes > 1 else x.intra
    if s.ist_deployment == "central":
        wire = 2.0 * (n - 1) * sub  # rank 0: n-1 subnets out and n-1 back
        time = 2 * (n - 1) * link.alpha + wire * link.beta
    else:
        wire = 2.0 * sub * (n - 1) / n
        time = 2 * (n - 1) * link.alpha + wire * link.beta
    return SyncCost(time / k, 0.0, 2.0 * sub / k, wire / k)


def sync_cost(x: SyncInputs, s: StrategySpec) -> SyncCost:
    """Seconds and bytes per step for the strategy's method (module docstring)."""
    if s.dp <= 1:
        return SyncCost(0.0, 0.0, 0.0, 0.0)
    payload = x.params * x.grad_bytes
    wire_factor = ring_wire_factor(s.dp)
    if s.method == "ist":
        return _ist(x, s)
    base = _dp_time(x, s, payload)
    if s.zero == 3:
        wire_factor *= 1.5 * s.micro_batches
    if s.method == "localsgd":
        h = s.period
        return SyncCost(base / h, 0.0, payload / h, wire_factor * payload / h)
    if s.method == "compressed" and s.dp > 1 and s.compression_ratio > 1:
        small = payload / s.compression_ratio
        codec = s.codec_passes * payload / x.codec_bytes_per_s
        squeezed = _dp_time(x, s, small)
        if squeezed + codec < base:  # compress only where it pays
            return SyncCost(squeezed, codec, small, wire_factor * small, compressed=True)
    return SyncCost(base, 0.0, payload, wire_factor * payload)

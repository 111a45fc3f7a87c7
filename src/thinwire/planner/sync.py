"""How replicas synchronise, per step: the planner's own data parallelism, or a method of thinwire.

Bytes and seconds per device per optimizer step, for Psi parameters held by each replica,
g bytes per gradient element and n data-parallel workers.

The planner's own data parallelism (``method`` empty; Rajbhandari et al. 2020 for ZeRO):
- ZeRO 0: all-reduce of g*Psi bytes; wire 2(n-1)/n g*Psi per worker (ring);
- ZeRO 1/2: reduce-scatter of gradients + all-gather of w-byte weights (same volume);
- ZeRO 3: per micro-batch, all-gather weights forward and backward + reduce-scatter gradients
  (1.5x DP, Sec. 7).

A method of thinwire's registry (:mod:`thinwire.planner.methods`):
1. its steady-state ledger bytes per step come from its own traffic function over the model's
   layout (thinwire's ledger: fp32 gradients and parameters);
2. rank 0's calls are timed on the cluster's links: an all-reduce of the call's mean payload as
   its all-reduce (ring or tree, hierarchical across nodes), an all-gather likewise,
   a point-to-point exchange (n-1) alpha + wire bytes x beta on the link it crosses;
3. a codec costs ``codec_passes`` passes over the g*Psi gradient bytes of each exchange at
   memory bandwidth, and is used only where it pays: its exchange time plus codec time below
   the same method's without it ((1 - 1/ratio) S / (bandwidth eff) > encode + decode).
"""

from __future__ import annotations

from dataclasses import dataclass

from thinwire.planner.comm import Link, all_gather, allreduce, reduce_scatter, ring_wire_factor
from thinwire.planner.specs import ModelSpec
from thinwire.planner.strategy import StrategySpec


@dataclass(frozen=True)
class SyncCost:
    """Per-step synchronisation of one device (the busiest one for central deployments)."""

    time: float
    """Seconds per step spent communicating (amortised over a method's sync period)."""
    codec: float
    """Seconds per step encoding + decoding (a codec, when it pays)."""
    payload_bytes: float
    """Ledger payload per worker per step, the mean over workers."""
    wire_bytes: float
    """Estimated bytes the busiest worker sends per step."""
    compressed: bool = False
    """Whether a codec was switched on."""

    @property
    def total(self) -> float:
        return self.time + self.codec


NO_SYNC = SyncCost(0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True)
class SyncInputs:
    """What the synchronisation of one replica depends on."""

    params: float
    """Psi, parameters per replica (per device after TP/PP splits)."""
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
    """Seconds of its gradient exchange of ``payload`` bytes (ZeRO as configured)."""
    if s.zero == 0:
        return allreduce(payload, x.local, x.nodes, x.intra, x.inter)
    weights = payload * x.weight_bytes / x.grad_bytes
    rs = reduce_scatter(payload, x.local, x.nodes, x.intra, x.inter)
    ag = all_gather(weights, x.local, x.nodes, x.intra, x.inter)
    if s.zero == 3:
        return s.micro_batches * (rs + 2 * ag)
    return rs + ag


def _planner_dp_sync(x: SyncInputs, s: StrategySpec) -> SyncCost:
    """The planner's own data parallelism (module docstring)."""
    payload = x.params * x.grad_bytes
    wire = ring_wire_factor(s.dp) * payload
    if s.zero == 3:
        wire *= 1.5 * s.micro_batches
    return SyncCost(_dp_time(x, s, payload), 0.0, payload, wire)


def calls_time(calls: tuple[tuple[str, float, float], ...], n: int, x: SyncInputs) -> float:
    """Step 2: seconds of rank 0's (op, calls, wire bytes) on ``n`` workers."""
    total = 0.0
    for op, count, wire in calls:
        if count <= 0 or n <= 1:
            continue
        if op == "all_reduce":
            payload = wire * n / (2 * (n - 1)) / count
            total += count * allreduce(payload, x.local, x.nodes, x.intra, x.inter)
        elif op == "all_gather":
            gathered = wire * n / (n - 1) / count
            total += count * all_gather(gathered, x.local, x.nodes, x.intra, x.inter)
        else:  # an exchange of messages with the other ranks
            link = x.inter if x.nodes > 1 else x.intra
            total += count * (n - 1) * link.alpha + wire * link.beta
    return total


def _method_sync(model: ModelSpec, x: SyncInputs, s: StrategySpec, codec: bool) -> SyncCost:
    """Steps 1-2 (and 3's codec time) for the method of ``s``, its codec on or off."""
    from thinwire.planner.methods import per_step, resolve

    method = resolve(s.method)
    step = per_step(model, s.method, s.dp, s.tp, s.pp, s.optimizer, codec)
    coded = codec and method.codec != "none"
    codec_s = (s.codec_passes * x.params * x.grad_bytes / x.codec_bytes_per_s
               / method.sync_every if coded else 0.0)
    time = calls_time(step.calls, s.dp, x)
    return SyncCost(time, codec_s, step.payload_mean, step.sent_max, compressed=coded)


def sync_cost(model: ModelSpec, x: SyncInputs, s: StrategySpec) -> SyncCost:
    """Seconds and bytes per step for the strategy's synchronisation (module docstring)."""
    if s.dp <= 1:
        return NO_SYNC
    if not s.method:
        return _planner_dp_sync(x, s)
    coded = _method_sync(model, x, s, codec=True)
    if not coded.compressed:
        return coded
    plain = _method_sync(model, x, s, codec=False)
    return coded if coded.total < plain.total else plain  # step 3: a codec only where it pays

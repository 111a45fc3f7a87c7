"""Step time of a plan, with its breakdown: compute, TP, PP, bubble, DP, optimizer.

1F1B pipeline (Narayanan et al. 2021, Sec. 2.2): with per-micro-batch stage times t_i (forward
+ backward of its L/p layers, the last stage also running the logits), m micro-batches and v
interleaved chunks, one step takes
    m * max_i t_i + (p - 1)/v * mean_i t_i,
the second term being the bubble, a fraction (p-1)/(v*m) of the ideal time. Stage boundaries
send b*s*h activations forward and their gradients backward, v times per micro-batch; with
scatter/gather each of the t ranks sends 1/t of it and the receivers all-gather it over NVLink
(Narayanan Sec. 4.1). Data-parallel synchronisation (sync.py) follows the pipeline flush and is
exposed, unless ``overlap_dp`` hides it behind the last micro-batch's backward pass (PyTorch
DDP buckets); the optimizer step is memory bound.
MLPs and counted models run data-parallel only (tp = pp = 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from thinwire.errors import UsageError
from thinwire.planner.comm import (
    dp_layout,
    inter_link,
    intra_link,
    p2p,
    pp_crosses_nodes,
    ring_all_gather,
)
from thinwire.planner.compute import (
    LayerCost,
    layer_cost,
    logits_cost,
    matmul_time,
    optimizer_time,
    vector_time,
)
from thinwire.planner.memory import (
    MemoryBreakdown,
    memory_breakdown,
    param_bytes,
    subnet_params,
    transformer_ist_subnet_params,
    transformer_params_per_device,
)
from thinwire.planner.specs import (
    DTYPE_BYTES,
    ClusterSpec,
    CountedSpec,
    MLPSpec,
    ModelSpec,
    TransformerSpec,
)
from thinwire.planner.strategy import StrategySpec, check_layout
from thinwire.planner.sync import SyncCost, SyncInputs, sync_cost


@dataclass(frozen=True)
class StepBreakdown:
    """Seconds per optimizer step; they add up to the step time."""

    compute: float
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float
    codec: float
    optimizer: float
    offload: float

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.tp_comm
            + self.pp_comm
            + self.bubble
            + self.dp_comm
            + self.codec
            + self.optimizer
            + self.offload
        )

    def as_dict(self) -> dict[str, float]:
        names = (
            "compute",
            "tp_comm",
            "pp_comm",
            "bubble",
            "dp_comm",
            "codec",
            "optimizer",
            "offload",
        )
        return {k: getattr(self, k) for k in names} | {"total": self.total}


@dataclass(frozen=True)
class Traffic:
    """Bytes on the wire per device per step, by link type."""

    tp: float
    pp: float
    dp: float
    dp_payload: float
    """The strategy's ledger payload per worker per step (DP/sync only)."""

    def as_dict(self) -> dict[str, float]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "dp_payload": self.dp_payload}


@dataclass(frozen=True)
class Prediction:
    """Everything the planner predicts for one (model, cluster, strategy)."""

    strategy: StrategySpec
    memory: MemoryBreakdown
    breakdown: StepBreakdown
    traffic: Traffic
    global_batch: int
    model_flops: float
    """Useful FLOPs per step (no recomputation): the numerator of MFU."""
    peak_flops: float
    """Peak FLOP/s of all devices together."""
    compressed: bool = False

    @property
    def step_time(self) -> float:
        return self.breakdown.total

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_time * self.peak_flops)

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.step_time


def _sync(
    cluster: ClusterSpec, s: StrategySpec, psi: float, sub: float, bandwidth: float | None
) -> SyncCost:
    """Synchronisation of ``psi`` parameters per replica (``sub`` per IST worker)."""
    pb = param_bytes(s, cluster)
    local, nodes = dp_layout(cluster, s)
    codec_rate = cluster.memory_bandwidth * cluster.memory_efficiency
    links = (intra_link(cluster), inter_link(cluster, bandwidth))
    x = SyncInputs(psi, sub, pb.grad, pb.weight, local, nodes, *links, codec_rate)
    return sync_cost(x, s)


def _exposed(sync_time: float, micro_batch_compute: float, s: StrategySpec) -> float:
    """DP time left visible: all of it, or what the last backward pass cannot hide."""
    if not s.overlap_dp:
        return sync_time
    backward = micro_batch_compute * (0.75 if s.recompute == "full" else 2.0 / 3.0)
    return max(0.0, sync_time - backward)


def _optimizer(cluster: ClusterSpec, s: StrategySpec, psi: float) -> tuple[float, float]:
    """(optimizer seconds, offload seconds) per step for ``psi`` parameters on a device."""
    pb = param_bytes(s, cluster)
    if s.offload:  # gradients down, weights up over PCIe; the host runs the update
        return 0.0, psi * (pb.grad + pb.weight) / cluster.host_bandwidth
    owned = psi / s.dp if (s.zero >= 1 and s.method != "ist") else psi
    return optimizer_time(owned, pb.grad + 2 * pb.optim + pb.weight, cluster), 0.0


def _transformer(
    model: TransformerSpec, cluster: ClusterSpec, s: StrategySpec, bandwidth: float | None
) -> tuple[StepBreakdown, Traffic, SyncCost]:
    dtype = s.resolved_dtype(cluster)
    e = float(DTYPE_BYTES[dtype])
    b, t, p, v, m = s.micro_batch_size, s.tp, s.pp, s.interleave, s.micro_batches
    ist = s.method == "ist"
    if ist:  # a subnet computes like a t = n split with no collectives inside it
        full = layer_cost(model, cluster, b, s.dp, False, s.recompute, dtype)
        lc = LayerCost(full.matmul, full.vector, 0.0)
        psi = transformer_ist_subnet_params(model, s.dp)
    else:
        lc = layer_cost(model, cluster, b, t, s.sequence_parallel, s.recompute, dtype)
        psi = transformer_params_per_device(model, s)
    lg = logits_cost(model, cluster, b, t, s.sequence_parallel, dtype)
    per_stage = model.layers / p
    act = b * model.seq * model.hidden * e
    boundary = 0.0
    if p > 1:
        crossing = pp_crosses_nodes(cluster, s)
        link = inter_link(cluster, bandwidth) if crossing else intra_link(cluster)
        gather = ring_all_gather(act, t, intra_link(cluster)) if (crossing and t > 1) else 0.0
        boundary = 2 * v * (p2p(act / t, link) + gather)
    mean = (model.layers * lc.total + lg.total) / p + boundary
    sync = _sync(cluster, s, psi, psi, bandwidth)
    opt, off = _optimizer(cluster, s, psi)
    bd = StepBreakdown(
        compute=m * (per_stage * lc.compute + lg.compute),
        tp_comm=m * (per_stage * lc.tp_comm + lg.tp_comm),
        pp_comm=m * boundary,
        bubble=(p - 1) / v * mean,
        dp_comm=_exposed(sync.time, per_stage * lc.compute + lg.compute, s),
        codec=sync.codec,
        optimizer=opt,
        offload=off,
    )
    # wire bytes per layer in units of (t-1)/t * b*s*h: 4 (6) all-reduces of 2 units each, or
    # 5 (6) reduce-scatter + all-gather pairs with SP; full recompute in parentheses
    units = 12 if s.recompute == "full" else (10 if s.sequence_parallel else 8)
    tp_units = units * (t - 1) / t * act * per_stage * m if (t > 1 and not ist) else 0.0
    traffic = Traffic(
        tp=tp_units,
        pp=(2 * v * act / t * m if p > 1 else 0.0),
        dp=sync.wire_bytes,
        dp_payload=sync.payload_bytes,
    )
    return bd, traffic, sync


def _dense(
    model: ModelSpec, cluster: ClusterSpec, s: StrategySpec, bandwidth: float | None
) -> tuple[StepBreakdown, Traffic, SyncCost]:
    dtype = s.resolved_dtype(cluster)
    peak, curve = cluster.peak(dtype), cluster.matmul_efficiency
    b = s.micro_batch_size
    n = s.dp if s.method == "ist" else 1
    if isinstance(model, MLPSpec):
        w = [model.widths[0], *(x / n for x in model.widths[1:-1]), model.widths[-1]]
        mm = sum(3 * matmul_time(2.0 * b * x * y, peak, curve) for x, y in zip(w[:-1], w[1:]))
        vec = vector_time(6.0 * DTYPE_BYTES[dtype] * b * sum(w[1:]), cluster)
        per_mb = mm + vec
    elif isinstance(model, CountedSpec):
        per_mb = 3 * matmul_time(model.flops_per_sample * b / 3, peak, curve)
    else:
        raise UsageError(f"model {model.name}: transformers take the pipeline path")
    per_mb /= cluster.compute_efficiency
    psi = float(model.params)
    sub = subnet_params(model, s.dp) if s.method == "ist" else psi
    sync = _sync(cluster, s, psi, sub, bandwidth)
    opt, off = _optimizer(cluster, s, sub)
    bd = StepBreakdown(
        compute=s.micro_batches * per_mb,
        tp_comm=0.0,
        pp_comm=0.0,
        bubble=0.0,
        dp_comm=_exposed(sync.time, per_mb, s),
        codec=sync.codec,
        optimizer=opt,
        offload=off,
    )
    return bd, Traffic(0.0, 0.0, sync.wire_bytes, sync.payload_bytes), sync


def predict(
    model: ModelSpec, cluster: ClusterSpec, s: StrategySpec, inter_bandwidth: float | None = None
) -> Prediction:
    """Memory, bytes and step time of ``s``; ``inter_bandwidth`` overrides the network's."""
    check_layout(model, cluster, s)
    if isinstance(model, TransformerSpec):
        bd, traffic, sync = _transformer(model, cluster, s, inter_bandwidth)
        useful = model.flops_per_step(s.global_batch())
    else:
        bd, traffic, sync = _dense(model, cluster, s, inter_bandwidth)
        useful = model.flops_per_sample * s.global_batch()
    if s.method == "ist":  # a subnet does a fraction of the full model's work
        useful *= subnet_params(model, s.dp) / model.params
    peak = cluster.peak(s.resolved_dtype(cluster)) * s.devices
    return Prediction(
        s,
        memory_breakdown(model, cluster, s),
        bd,
        traffic,
        s.global_batch(),
        useful,
        peak,
        sync.compressed,
    )

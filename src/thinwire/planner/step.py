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
MLPs and counted models run data-parallel only (tp = pp = 1); a method that cuts an MLP over the
workers computes on a worker's part (:func:`thinwire.planner.methods.worker_widths`).
"""

from __future__ import annotations

from dataclasses import dataclass

from thinwire.errors import UsageError
from thinwire.planner.comm import (
    dp_placement,
    inter_link,
    intra_link,
    p2p,
    pp_crosses_nodes,
    ring_all_gather_time,
)
from thinwire.planner.compute import (
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
    transformer_params_per_device,
)
from thinwire.planner.methods import method_share, work_share, worker_params, worker_widths
from thinwire.planner.specs import (
    DTYPE_BYTES,
    ClusterSpec,
    CountedSpec,
    MLPSpec,
    ModelSpec,
    TransformerSpec,
)
from thinwire.planner.strategy import StrategySpec, check_strategy
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
        """The step time: the sum of the components."""
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
        """Seconds per component and the total."""
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
class LinkBytes:
    """Bytes on the wire per device per step, by link type."""

    tp: float
    pp: float
    dp: float
    dp_payload: float
    """The strategy's ledger payload per worker per step (DP/sync only)."""

    def as_dict(self) -> dict[str, float]:
        return {"tensor_parallel": self.tp, "pipeline_parallel": self.pp, "sync": self.dp,
                "sync_payload": self.dp_payload}


@dataclass(frozen=True)
class Prediction:
    """Everything the planner predicts for one (model, cluster, strategy)."""

    strategy: StrategySpec
    memory: MemoryBreakdown
    breakdown: StepBreakdown
    traffic: LinkBytes
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
    model: ModelSpec, cluster: ClusterSpec, s: StrategySpec, psi: float, bandwidth: float | None
) -> SyncCost:
    """Synchronisation of ``psi`` parameters per replica."""
    pb = param_bytes(s, cluster)
    local, nodes = dp_placement(cluster, s)
    codec_rate = cluster.memory_bandwidth * cluster.memory_efficiency
    links = (intra_link(cluster), inter_link(cluster, bandwidth))
    x = SyncInputs(psi, pb.grad, pb.weight, local, nodes, *links, codec_rate)
    return sync_cost(model, x, s)


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
    owned = psi / s.dp if s.zero >= 1 else psi
    return optimizer_time(owned, pb.grad + 2 * pb.optim + pb.weight, cluster), 0.0


def _boundary(model: TransformerSpec, cluster: ClusterSpec, s: StrategySpec,
              bandwidth: float | None, act: float) -> float:
    """Seconds per micro-batch at the pipeline boundaries (forward + backward, v chunks)."""
    if s.pp == 1:
        return 0.0
    crossing = pp_crosses_nodes(cluster, s)
    link = inter_link(cluster, bandwidth) if crossing else intra_link(cluster)
    gather = ring_all_gather_time(act, s.tp, intra_link(cluster)) if (crossing and s.tp > 1) else 0.0
    return 2 * s.interleave * (p2p(act / s.tp, link) + gather)


def _transformer_bytes(s: StrategySpec, act: float, per_stage: float, sync: SyncCost
                       ) -> LinkBytes:
    """Wire bytes per layer in units of (t-1)/t * b*s*h: 4 (6) all-reduces of 2 units each, or
    5 (6) reduce-scatter + all-gather pairs with SP; full recompute in parentheses."""
    t, m = s.tp, s.micro_batches
    units = 12 if s.recompute == "full" else (10 if s.sequence_parallel else 8)
    tp_bytes = units * (t - 1) / t * act * per_stage * m if t > 1 else 0.0
    pp_bytes = 2 * s.interleave * act / t * m if s.pp > 1 else 0.0
    return LinkBytes(tp_bytes, pp_bytes, sync.wire_bytes, sync.payload_bytes)


def _transformer(
    model: TransformerSpec, cluster: ClusterSpec, s: StrategySpec, bandwidth: float | None
) -> tuple[StepBreakdown, LinkBytes, SyncCost]:
    """1. per-layer and logits costs; 2. the stage boundaries; 3. the 1F1B schedule; 4. DP."""
    dtype = s.resolved_dtype(cluster)
    b, p, m = s.micro_batch_size, s.pp, s.micro_batches
    lc = layer_cost(model, cluster, b, s.tp, s.sequence_parallel, s.recompute, dtype)
    lg = logits_cost(model, cluster, b, s.tp, s.sequence_parallel, dtype)
    per_stage = model.layers / p
    act = b * model.seq * model.hidden * float(DTYPE_BYTES[dtype])
    boundary = _boundary(model, cluster, s, bandwidth, act)
    mean = (model.layers * lc.total + lg.total) / p + boundary
    psi = transformer_params_per_device(model, s)
    sync = _sync(model, cluster, s, psi, bandwidth)
    opt, off = _optimizer(cluster, s, psi)
    bd = StepBreakdown(
        compute=m * (per_stage * lc.compute + lg.compute),
        tp_comm=m * (per_stage * lc.tp_comm + lg.tp_comm),
        pp_comm=m * boundary,
        bubble=(p - 1) / s.interleave * mean,
        dp_comm=_exposed(sync.time, per_stage * lc.compute + lg.compute, s),
        codec=sync.codec,
        optimizer=opt,
        offload=off,
    )
    return bd, _transformer_bytes(s, act, per_stage, sync), sync


def _micro_batch(model: ModelSpec, cluster: ClusterSpec, s: StrategySpec) -> float:
    """Seconds of one micro-batch of an MLP (a worker's part under a cutting method) or a
    counted model: 3 matmuls per layer (forward, two backward) and the element-wise work."""
    dtype = s.resolved_dtype(cluster)
    peak, curve, b = cluster.peak(dtype), cluster.matmul_efficiency, s.micro_batch_size
    if isinstance(model, CountedSpec):  # a worker's part: its share of the parameters
        share = work_share(model, s.method, s.dp) if s.partitioned else 1.0
        return 3 * matmul_time(share * model.flops_per_sample * b / 3, peak, curve)
    if not isinstance(model, MLPSpec):
        raise UsageError(f"model {model.name}: transformers take the pipeline path")
    w = worker_widths(model, s.dp, s.method) if s.partitioned else model.widths
    mm = sum(3 * matmul_time(2.0 * b * x * y, peak, curve) for x, y in zip(w[:-1], w[1:]))
    return mm + vector_time(6.0 * DTYPE_BYTES[dtype] * b * sum(w[1:]), cluster)


def _dense(
    model: ModelSpec, cluster: ClusterSpec, s: StrategySpec, bandwidth: float | None
) -> tuple[StepBreakdown, LinkBytes, SyncCost]:
    """An MLP or a counted model, data-parallel (or cut over the workers)."""
    per_mb = _micro_batch(model, cluster, s) / cluster.compute_efficiency
    psi = float(model.params)
    sync = _sync(model, cluster, s, psi, bandwidth)
    share = method_share(model, s.method, s.dp) if s.partitioned else None
    updated = share.updated if share is not None and share.updated is not None else \
        worker_params(model, s.dp, s.method) if s.partitioned else psi
    opt, off = _optimizer(cluster, s, updated)
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
    return bd, LinkBytes(0.0, 0.0, sync.wire_bytes, sync.payload_bytes), sync


def predict(
    model: ModelSpec, cluster: ClusterSpec, s: StrategySpec, inter_bandwidth: float | None = None
) -> Prediction:
    """Memory, bytes and step time of ``s``; ``inter_bandwidth`` overrides the network's."""
    check_strategy(model, cluster, s)
    if isinstance(model, TransformerSpec):
        bd, traffic, sync = _transformer(model, cluster, s, inter_bandwidth)
        useful = model.flops_per_step(s.global_batch())
    else:
        bd, traffic, sync = _dense(model, cluster, s, inter_bandwidth)
        useful = model.flops_per_sample * s.global_batch()
    if s.partitioned:  # a worker's part does a fraction of the full model's work
        useful *= work_share(model, s.method, s.dp)
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

"""Compute time of one transformer layer (and the logits, and the optimizer) on one device.

Each matmul takes flops / (peak * eff(size)) where eff rises with the operation's size: points
(GFLOP, fraction of peak) interpolated in log size, Calculon's A100 table being 0.6 at 1 GFLOP,
0.9 at 16 and 0.99 at >= 128 (Isaev et al., "Calculon", SC'23). Element-wise kernels (layer
norm, bias+dropout+residual, GeLU, softmax, attention dropout) are memory bound: bytes moved /
(memory bandwidth * efficiency). Each GEMM also pays the time to move its operands, not
overlapped with its math (Calculon's "no_overlap" mode). All kernel times are divided by the
cluster's ``compute_efficiency``, the one constant fit to published runs (validation.py).

Forward matmuls of one layer, per micro-batch of b sequences, split t ways (Megatron):
QKV 6bsh^2/t, scores 2bs^2h/t, scores x V 2bs^2h/t, projection 2bsh^2/t, FFN 2 x 2bshf/t. The
backward pass runs two matmuls (data and weight gradients) of each forward size. Selective
recompute adds the attention core's forward again, full recompute the whole forward
(Korthikanti et al. 2022, Sec. 5). Tensor-parallel communication per layer per micro-batch:
4 all-reduces of b*s*h elements (6 with full recompute); with sequence parallelism each
becomes a reduce-scatter + all-gather pair at equal volume, plus 2 all-gathers re-done in the
backward pass because only the sharded layer-norm output is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from thinwire.planner.comm import (
    intra_link,
    ring_all_gather_time,
    ring_all_reduce_time,
    ring_reduce_scatter_time,
)
from thinwire.planner.specs import DTYPE_BYTES, ClusterSpec, TransformerSpec


def matmul_efficiency(gflop: float, curve: tuple[tuple[float, float], ...]) -> float:
    """Fraction of peak a matmul of ``gflop`` GFLOP reaches: log-linear between the curve's
    points, flat above the last, extrapolated below the first (floor 0.02)."""
    if gflop >= curve[-1][0]:
        return curve[-1][1]
    if len(curve) == 1:
        return curve[0][1] if gflop >= curve[0][0] else max(0.02, curve[0][1] * gflop / curve[0][0])
    lo, hi = curve[0], curve[1]
    for a, b in zip(curve, curve[1:]):
        if gflop < b[0]:
            lo, hi = a, b
            break
    x = math.log(max(gflop, 1e-9))
    x0, x1 = math.log(lo[0]), math.log(hi[0])
    eff = lo[1] + (hi[1] - lo[1]) * (x - x0) / (x1 - x0)
    return min(hi[1], max(0.02, eff))


def matmul_time(flops: float, peak: float, curve: tuple[tuple[float, float], ...]) -> float:
    """flops / (peak * eff(flops))."""
    if flops <= 0:
        return 0.0
    return flops / (peak * matmul_efficiency(flops / 1e9, curve))


def vector_time(nbytes: float, cluster: ClusterSpec) -> float:
    """A memory-bound kernel: bytes / (bandwidth * efficiency)."""
    return nbytes / (cluster.memory_bandwidth * cluster.memory_efficiency)


def gemm_time(
    m: float,
    k: float,
    n: float,
    elem: float,
    peak: float,
    curve: tuple[tuple[float, float], ...],
    cluster: ClusterSpec,
) -> float:
    """Forward GEMM (m x k) @ (k x n): compute time plus the time to move its operands and
    result, not overlapped (Calculon's "no_overlap" processing mode)."""
    return matmul_time(2.0 * m * k * n, peak, curve) + vector_time(
        elem * (m * k + k * n + m * n), cluster
    )


@dataclass(frozen=True)
class LayerCost:
    """Seconds for one layer and one micro-batch on one device, forward + backward."""

    matmul: float
    """Matmul time incl. recomputation."""
    vector: float
    """Element-wise (memory-bound) time incl. recomputation."""
    tp_comm: float
    """Tensor / sequence-parallel collectives on the intra-node link."""

    @property
    def compute(self) -> float:
        return self.matmul + self.vector

    @property
    def total(self) -> float:
        return self.matmul + self.vector + self.tp_comm


@lru_cache(maxsize=4096)
def layer_cost(
    model: TransformerSpec,
    cluster: ClusterSpec,
    b: int,
    t: int,
    sp: bool,
    recompute: str,
    dtype: str,
) -> LayerCost:
    """Forward + backward (+ recompute) cost of one layer for a micro-batch of ``b``."""
    e = float(DTYPE_BYTES[dtype])
    peak, curve = cluster.peak(dtype), cluster.matmul_efficiency
    s, h, a, f = model.seq, model.hidden, model.heads, model.ffn
    n, tok = b * s * h, b * s
    scores = b * a * s * s / t
    # (M, K, N) of each forward GEMM on one device; the attention core as batched GEMMs
    dense = ((tok, h, 3 * h / t), (tok, h / t, h), (tok, h, f / t), (tok, f / t, h))
    dense_t = sum(gemm_time(mm, k, nn, e, peak, curve, cluster) for mm, k, nn in dense)
    core_flops = 2.0 * b * s * s * h / t
    core_bytes_mm = e * (2 * n / t + scores)  # QK^T: reads Q, K, writes scores (x V mirrors it)
    core_t = 2 * (matmul_time(core_flops, peak, curve) + vector_time(core_bytes_mm, cluster))
    rows = n / t if sp else n  # layer norm / dropout regions: replicated unless SP
    norm_bytes = 2 * (2 * e * rows) + 2 * (3 * e + 1) * rows + 2 * e * b * s * f / t
    core_bytes = (4 * e + 1) * scores  # fused softmax (read, write) + dropout (read, write, mask)
    fwd_mm, fwd_vec = dense_t + core_t, vector_time(norm_bytes + core_bytes, cluster)
    matmul, vector = 3 * fwd_mm, 3 * fwd_vec  # backward: twice the forward
    if recompute == "selective":
        matmul += core_t
        vector += vector_time(core_bytes, cluster)
    elif recompute == "full":
        matmul += fwd_mm
        vector += fwd_vec
    ce = cluster.compute_efficiency
    return LayerCost(matmul / ce, vector / ce, tp_layer_comm(n * e, t, sp, recompute, cluster))


def tp_layer_comm(nbytes: float, t: int, sp: bool, recompute: str, cluster: ClusterSpec) -> float:
    """Tensor-parallel collectives of one layer per micro-batch on the intra-node link."""
    if t <= 1:
        return 0.0
    link = intra_link(cluster)
    if sp:
        pairs = 6 if recompute == "full" else 5  # fwd 2 + bwd 2 (+ 2 re-gathers or re-forward)
        return pairs * (ring_reduce_scatter_time(nbytes, t, link) + ring_all_gather_time(nbytes, t, link))
    count = 6 if recompute == "full" else 4
    return count * ring_all_reduce_time(nbytes, t, link)


@lru_cache(maxsize=1024)
def logits_cost(
    model: TransformerSpec, cluster: ClusterSpec, b: int, t: int, sp: bool, dtype: str
) -> LayerCost:
    """Output layer + vocab-parallel cross entropy (fp32) for one micro-batch, on the last stage."""
    e = float(DTYPE_BYTES[dtype])
    peak, curve = cluster.peak(dtype), cluster.matmul_efficiency
    tokens = b * model.seq
    mm = 3 * matmul_time(2.0 * tokens * model.hidden * model.vocab / t, peak, curve)
    vec = vector_time(20.0 * tokens * model.vocab / t, cluster)  # fp32 CE: 3 passes fwd, 2 bwd
    nbytes = tokens * model.hidden * e
    link = intra_link(cluster)
    comm = 0.0
    if t > 1:  # gather the final layer norm output (SP) or all-reduce its gradient
        comm = (
            ring_all_gather_time(nbytes, t, link) + ring_reduce_scatter_time(nbytes, t, link)
            if sp
            else ring_all_reduce_time(nbytes, t, link)
        )
    return LayerCost(mm / cluster.compute_efficiency, vec / cluster.compute_efficiency, comm)


def optimizer_time(params: float, state_bytes: float, cluster: ClusterSpec) -> float:
    """A memory-bound optimizer step touching ``state_bytes`` per parameter (read + write)."""
    return vector_time(params * state_bytes, cluster) / cluster.compute_efficiency

"""The strategy spec: how a model is laid out over the devices and how its replicas talk.

3D parallelism as in Narayanan et al. 2021 (data d, tensor t, pipeline p, d*t*p = N; 1F1B with
m micro-batches of b sequences and v interleaved chunks), memory savers of Korthikanti et al.
2022 (sequence parallelism, selective or full recompute) and Rajbhandari et al. 2020 (ZeRO
stages 0-3, offload), and the data-parallel replacements thinwire studies: compressed DP,
local SGD / DiLoCo (sync every H steps) and IST (Yuan et al. 2022; K local steps per round).

``check_layout`` validates a strategy against a model and a cluster (degrees dividing the
device count, TP inside a node, layers divisible by p*v, ...) with one-line UsageErrors.
"""

from __future__ import annotations

from dataclasses import dataclass

from thinwire.errors import UsageError
from thinwire.planner.specs import (
    DTYPE_BYTES,
    METHODS,
    OPTIMIZERS,
    RECOMPUTE,
    ClusterSpec,
    ModelSpec,
    TransformerSpec,
)


@dataclass(frozen=True)
class StrategySpec:
    """One training plan; every field has a safe default (pure data parallel, no savers)."""

    dp: int = 1
    """d, data-parallel degree (replicas, or IST workers when method == "ist")."""
    tp: int = 1
    """t, tensor-parallel degree (Megatron column/row splits)."""
    pp: int = 1
    """p, pipeline stages."""
    micro_batch_size: int = 1
    """b, sequences (samples) per micro-batch."""
    micro_batches: int = 1
    """m, micro-batches per pipeline per step; global batch B = b * m * d."""
    interleave: int = 1
    """v, model chunks per pipeline stage (interleaved 1F1B); needs m % p == 0 when v > 1."""
    zero: int = 0
    """ZeRO stage: 0 none, 1 optimizer states, 2 + gradients, 3 + weights partitioned over d."""
    recompute: str = "none"
    """Activation recomputation: none, selective (attention core) or full (whole layer)."""
    sequence_parallel: bool = False
    """Korthikanti sequence parallelism: layer norm / dropout activations split over t."""
    offload: bool = False
    """Keep optimizer states and fp32 master weights on the host (ZeRO-Offload)."""
    dtype: str = ""
    """Training dtype (bf16, fp16, fp32, ...); empty: the cluster's default_dtype."""
    accounting: str = "megatron"
    """Bytes per parameter: megatron (fp32 gradients, 18 B with Adam) or zero (16 B, ZeRO paper)."""
    optimizer: str = "adam"
    """adam (K = 12 B mixed / 8 B fp32), momentum (8 / 4) or sgd (4 / 0 bytes of state)."""
    overlap_dp: bool = False
    """Overlap the gradient all-reduce with the last micro-batch's backward (PyTorch DDP)."""
    method: str = "dp"
    """How replicas synchronise: dp, compressed, localsgd or ist."""
    compression_ratio: float = 1.0
    """Compressed DP: payload bytes divided by this ratio (>= 1)."""
    codec_passes: float = 4.0
    """Compressed DP: encode + decode cost, in passes over the gradient at memory bandwidth."""
    period: int = 1
    """Local SGD / DiLoCo: average every H steps."""
    local_steps: int = 1
    """IST: K local steps per round (one repartition and exchange per round)."""
    ist_deployment: str = "sharded"
    """IST: sharded (model spread over workers) or central (rank 0 holds it, also a worker)."""

    def __post_init__(self) -> None:
        for name in (
            "dp",
            "tp",
            "pp",
            "micro_batch_size",
            "micro_batches",
            "interleave",
            "period",
            "local_steps",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"strategy.{name} must be an integer >= 1 (got {value!r})")
        if self.zero not in (0, 1, 2, 3):
            raise UsageError(f"strategy.zero={self.zero} must be 0, 1, 2 or 3")
        if self.recompute not in RECOMPUTE:
            raise UsageError(
                f"strategy.recompute={self.recompute!r}; use one of {', '.join(RECOMPUTE)}"
            )
        if self.method not in METHODS:
            raise UsageError(f"strategy.method={self.method!r}; use one of {', '.join(METHODS)}")
        if self.dtype and self.dtype not in DTYPE_BYTES:
            raise UsageError(f"strategy.dtype={self.dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
        if self.accounting not in ("megatron", "zero"):
            raise UsageError(f"strategy.accounting={self.accounting!r}; use megatron or zero")
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(
                f"strategy.optimizer={self.optimizer!r}; use one of {', '.join(OPTIMIZERS)}"
            )
        if self.compression_ratio < 1:
            raise UsageError(f"strategy.compression_ratio={self.compression_ratio} must be >= 1")
        if self.codec_passes < 0:
            raise UsageError(f"strategy.codec_passes={self.codec_passes} must be >= 0")
        if self.ist_deployment not in ("sharded", "central"):
            raise UsageError(
                f"strategy.ist_deployment={self.ist_deployment!r}; use sharded or central"
            )
        if self.interleave > 1 and self.pp == 1:
            raise UsageError("strategy.interleave > 1 needs pp > 1; set --interleave 1")
        if self.interleave > 1 and self.micro_batches % self.pp:
            raise UsageError(
                f"interleaved 1F1B needs micro_batches ({self.micro_batches}) to be a "
                f"multiple of pp ({self.pp}); change --micro-batches"
            )

    @property
    def devices(self) -> int:
        """d * t * p."""
        return self.dp * self.tp * self.pp

    def global_batch(self) -> int:
        """B = b * m * d."""
        return self.micro_batch_size * self.micro_batches * self.dp

    def resolved_dtype(self, cluster: ClusterSpec) -> str:
        """The strategy's dtype, or the cluster's default."""
        return self.dtype or cluster.default_dtype


def check_layout(model: ModelSpec, cluster: ClusterSpec, s: StrategySpec) -> None:
    """Raise UsageError unless ``s`` can run ``model`` on ``cluster`` (memory is checked apart)."""
    n = cluster.devices
    if s.devices != n:
        raise UsageError(
            f"dp*tp*pp = {s.dp}*{s.tp}*{s.pp} = {s.devices} but the cluster has {n} "
            f"devices ({cluster.nodes} nodes x {cluster.devices_per_node}); fix --dp/--tp/--pp or --nodes"
        )
    if s.tp > cluster.devices_per_node or cluster.devices_per_node % s.tp:
        raise UsageError(
            f"tp={s.tp} must divide the {cluster.devices_per_node} devices of a node "
            "(tensor parallelism stays inside a node); lower --tp"
        )
    cluster.peak(s.resolved_dtype(cluster))  # raises for an unknown dtype
    if not isinstance(model, TransformerSpec):
        if s.tp > 1 or s.pp > 1:
            raise UsageError(
                f"model {model.name} is not a transformer: tensor and pipeline "
                "parallelism are modelled for transformers only; use --tp 1 --pp 1"
            )
        return
    if s.method == "ist" and (s.tp > 1 or s.pp > 1):
        raise UsageError("method ist partitions the model over the dp workers; use --tp 1 --pp 1")
    if model.heads % s.tp:
        raise UsageError(f"tp={s.tp} must divide model.heads={model.heads}; pick a divisor")
    if model.layers % (s.pp * s.interleave):
        raise UsageError(
            f"pp*interleave = {s.pp * s.interleave} must divide model.layers="
            f"{model.layers}; change --pp or --interleave"
        )

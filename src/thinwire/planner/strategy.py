"""The strategy spec: how a model is laid out over the devices and how its replicas talk.

3D parallelism as in Narayanan et al. 2021 (data d, tensor t, pipeline p, d*t*p = N; 1F1B with
m micro-batches of b sequences and v interleaved chunks), memory savers of Korthikanti et al.
2022 (sequence parallelism, selective or full recompute) and Rajbhandari et al. 2020 (ZeRO
stages 0-3, offload), a fused attention kernel (SDPA / FlashAttention: no attention scores
stored), and the methods thinwire trains instead of a gradient all-reduce (``method``: a spec of
the method registry, :mod:`thinwire.planner.methods`).

``check_strategy`` validates a strategy against a model and a cluster (degrees dividing the
device count, TP inside a node, layers divisible by p*v, ...) with one-line UsageErrors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from thinwire.errors import UsageError
from thinwire.planner.specs import (
    ATTENTION,
    DTYPE_BYTES,
    MEGATRON_RECOMPUTE,
    OPTIMIZERS,
    ClusterSpec,
    CountedSpec,
    MLPSpec,
    ModelSpec,
    TransformerSpec,
)

_CHOICES = (("recompute", MEGATRON_RECOMPUTE), ("attention", ATTENTION), ("optimizer", OPTIMIZERS),
            ("accounting", ("megatron", "zero")))


@dataclass(frozen=True)
class StrategySpec:
    """One training plan; every field has a safe default (pure data parallel, no savers)."""

    dp: int = 1
    """d, data-parallel degree (replicas, or the workers a method cuts the model over)."""
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
    attention: str = "fused"
    """fused (SDPA / FlashAttention: the a*s*s attention scores are never stored) or
    materialized (softmax and dropout outputs kept, as Korthikanti et al. count them)."""
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
    method: str = ""
    """How replicas synchronise: empty, a gradient all-reduce every step (ZeRO as ``zero``
    says); or a method spec of thinwire's registry, e.g. ``localsgd:period=20``,
    ``topk:ratio=0.01`` (:mod:`thinwire.planner.methods`)."""
    codec_passes: float = 4.0
    """A method's codec: encode + decode cost, in passes over the gradient at memory bandwidth."""

    def __post_init__(self) -> None:
        """The degrees (every integer field but ``zero``) >= 1; the choices; the method."""
        for f in dataclasses.fields(self):
            if f.type != "int" or f.name == "zero":
                continue
            name, value = f.name, getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"strategy.{name} must be an integer >= 1 (got {value!r})")
        if self.zero not in (0, 1, 2, 3):
            raise UsageError(f"strategy.zero={self.zero} must be 0, 1, 2 or 3")
        for name, allowed in _CHOICES:
            if getattr(self, name) not in allowed:
                raise UsageError(f"strategy.{name}={getattr(self, name)!r}; use one of "
                                 f"{', '.join(allowed)}")
        if self.dtype and self.dtype not in DTYPE_BYTES:
            raise UsageError(f"strategy.dtype={self.dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
        if self.codec_passes < 0:
            raise UsageError(f"strategy.codec_passes={self.codec_passes} must be >= 0")
        self._check_pipeline()
        if self.method:
            self._check_method()

    def _check_pipeline(self) -> None:
        """Interleaving needs a pipeline and m a multiple of p."""
        if self.interleave > 1 and self.pp == 1:
            raise UsageError("strategy.interleave > 1 needs pp > 1; set --interleave 1")
        if self.interleave > 1 and self.micro_batches % self.pp:
            raise UsageError(
                f"interleaved 1F1B needs micro_batches ({self.micro_batches}) to be a "
                f"multiple of pp ({self.pp}); change --micro-batches"
            )

    def _check_method(self) -> None:
        """A method spec that resolves, and no ZeRO with it."""
        from thinwire.planner.methods import resolve

        resolve(self.method)  # raises for an unknown method or option
        if self.zero:
            raise UsageError(f"--method {self.method} synchronises on its own; ZeRO shards the "
                             "planner's own data parallelism: drop --zero or --method")

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

    @property
    def partitioned(self) -> bool:
        """Whether the method cuts the model over the d workers instead of replicating it."""
        if not self.method:
            return False
        from thinwire.planner.methods import partitioned, resolve

        return partitioned(resolve(self.method))


def check_strategy(model: ModelSpec, cluster: ClusterSpec, s: StrategySpec) -> None:
    """Raise UsageError unless ``s`` can run ``model`` on ``cluster`` (memory is checked apart)."""
    n = cluster.devices
    if s.devices != n:
        raise UsageError(
            f"dp*tp*pp = {s.dp}*{s.tp}*{s.pp} = {s.devices} but the cluster has {n} "
            f"devices ({cluster.nodes} nodes x {cluster.devices_per_node}); fix --dp/--tp/--pp, "
            "--nodes or --devices"
        )
    if s.tp > cluster.devices_per_node or cluster.devices_per_node % s.tp:
        raise UsageError(
            f"tp={s.tp} must divide the {cluster.devices_per_node} devices of a node "
            "(tensor parallelism stays inside a node); lower --tp"
        )
    cluster.peak(s.resolved_dtype(cluster))  # raises for an unknown dtype
    check_partition(model, s)
    if not isinstance(model, TransformerSpec):
        if s.tp > 1 or s.pp > 1:
            raise UsageError(
                f"model {model.name} is not a transformer: tensor and pipeline "
                "parallelism are modelled for transformers only; use --tp 1 --pp 1"
            )
        return
    _check_transformer(model, s)


def check_partition(model: ModelSpec, s: StrategySpec) -> None:
    """A method cutting the model into units: a model whose IST plan the planner has (an MLP,
    or a module counted with its adapter), over the dp workers only, every hidden width of an
    MLP >= workers."""
    if not s.partitioned:
        return
    if s.tp > 1 or s.pp > 1:
        raise UsageError(f"--method {s.method} cuts the model over the dp workers; use --tp 1 "
                         "--pp 1")
    from thinwire.planner.methods import resolve
    from thinwire.strategies.entry import Shares

    if isinstance(resolve(s.method).entry, Shares):  # its own cut: its share checks the model
        wide = getattr(model, "wide", None)
        if wide is not None and s.micro_batch_size * s.micro_batches != wide.batch:
            raise UsageError(f"--method {s.method} is priced at {model.name}'s batch of "
                             f"{wide.batch} per worker; use --global-batch {wide.batch * s.dp} "
                             "(or set the model's batch)")
        return
    counted = isinstance(model, CountedSpec) and model.ist is not None
    if not isinstance(model, MLPSpec) and not counted:
        raise UsageError(f"--method {s.method} cuts the model into units; the planner has their "
                         "plan for MLP specs (mlp-W0-...-WL) and for modules counted with their "
                         "adapter (model_spec_from_module(m, adapter=))")
    if isinstance(model, MLPSpec) and min(model.widths[1:-1]) < s.dp:
        raise UsageError(f"--method {s.method} cuts every hidden layer of {model.name} into "
                         f"{s.dp} parts; use widths >= {s.dp} or fewer workers")


def _check_transformer(model: TransformerSpec, s: StrategySpec) -> None:
    """t divides the heads, p*v the layers."""
    if model.heads % s.tp:
        raise UsageError(f"tp={s.tp} must divide model.heads={model.heads}; pick a divisor")
    if model.layers % (s.pp * s.interleave):
        raise UsageError(
            f"pp*interleave = {s.pp * s.interleave} must divide model.layers="
            f"{model.layers}; change --pp or --interleave"
        )

"""Specs as data: the model, the cluster and the strategy the planner reasons about.

Three frozen dataclasses, each field documented and validated in ``__post_init__``; the planner
functions are pure functions of them. Parameter counts follow Narayanan et al. 2021 (SC'21,
arXiv 2104.04473) Eq. 2: P = 12*L*h^2 * (1 + 13/(12h) + (V+s)/(12*L*h)) for a GPT with FFN 4h,
generalised to an FFN width f: per layer 4h^2 + 2hf + f + 9h (QKV/proj weights and biases,
two layer norms, FFN weights and biases).

Invalid values raise :class:`thinwire.errors.UsageError` with one line naming the field and
the fix, so the command line can print it and exit 2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from thinwire.errors import UsageError
from thinwire.strategies.entry import WideShapes

MEGATRON_RECOMPUTE = ("none", "selective", "full")
"""The planner's recomputation modes, Korthikanti et al.'s (2022): ``full`` recomputes every
transformer layer, ``selective`` only the attention core. A thinwire run's ``[memory]
recompute`` (:data:`thinwire.config.RECOMPUTE`) names the same choices by what it recomputes:
:data:`FROM_RUN_RECOMPUTE` maps one onto the other."""
FROM_RUN_RECOMPUTE = {"none": "none", "block": "full", "selective": "selective"}
"""A run's ``memory.recompute`` -> the planner's mode (``block``: each block, i.e. full)."""
ATTENTION = ("fused", "materialized")
MLP_NORMS = ("none", "layer", "batch")
DTYPE_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
OPTIMIZERS = ("adam", "momentum", "sgd")


def _positive(obj: object, *names: str) -> None:
    """A one-line error for the first of ``names`` that is not > 0."""
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise UsageError(
                f"{type(obj).__name__}.{name} must be > 0 (got {value}); set a positive value"
            )


@dataclass(frozen=True)
class TransformerSpec:
    """A GPT-style decoder: the shape Korthikanti et al. 2022 and Narayanan et al. 2021 use."""

    name: str
    """Preset or file name, used in tables."""
    layers: int
    """L, number of transformer layers."""
    hidden: int
    """h, hidden size."""
    heads: int
    """a, attention heads (must divide h)."""
    seq: int
    """s, sequence length in tokens."""
    vocab: int
    """V, vocabulary size (padded)."""
    ffn: int = 0
    """f, FFN inner width; 0 means 4h."""
    global_batch: int = 0
    """Default global batch B in sequences for this model (0: none; the CLI then asks for it)."""
    dropout: bool = True
    """Dropout after attention and the FFN (Megatron's and GPT-2's 0.1): one byte of mask per
    element is stored for backward; false for a model trained without dropout."""

    def __post_init__(self) -> None:
        _positive(self, "layers", "hidden", "heads", "seq", "vocab")
        if self.hidden % self.heads:
            raise UsageError(f"model.heads={self.heads} must divide model.hidden={self.hidden}")
        if self.ffn == 0:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if self.ffn < 0 or self.global_batch < 0:
            raise UsageError("model.ffn and model.global_batch must be >= 0")

    @property
    def layer_params(self) -> int:
        """Parameters of one layer: 4h^2 + 2hf + f + 9h (= 12h^2 + 13h when f = 4h)."""
        h, f = self.hidden, self.ffn
        return 4 * h * h + 2 * h * f + f + 9 * h

    @property
    def embedding_params(self) -> int:
        """Token and position embeddings, V*h + s*h (output layer tied to the input one)."""
        return (self.vocab + self.seq) * self.hidden

    @property
    def params(self) -> int:
        """All parameters, Narayanan et al. Eq. 2 (final layer norm omitted as there)."""
        return self.layers * self.layer_params + self.embedding_params

    def flops_per_step(self, batch: int, recompute: str = "none") -> float:
        """FLOPs of one iteration over ``batch`` sequences (Korthikanti et al. 2022, Sec. 6).

        none: 72*B*s*L*h^2*(1 + s/(6h) + V/(12*L*h)) (the model FLOPs of MFU);
        selective: 72*B*s*L*h^2*(1 + s/(3h) + V/(12*L*h));
        full: 96*B*s*L*h^2*(1 + s/(6h) + V/(16*L*h)) (Narayanan et al. Eq. 3).
        Exact for f = 4h; other FFN widths scale the h^2 term by (4h^2 + 2hf)/(12h^2).
        """
        s, L, h, V = self.seq, self.layers, self.hidden, self.vocab
        k = (4 * h * h + 2 * h * self.ffn) / (12 * h * h)
        base = 72.0 * batch * s * L * h * h
        if recompute == "full":
            return 96.0 * batch * s * L * h * h * (k + s / (6 * h) + V / (16 * L * h))
        if recompute == "selective":
            return base * (k + s / (3 * h) + V / (12 * L * h))
        return base * (k + s / (6 * h) + V / (12 * L * h))


@dataclass(frozen=True)
class MLPSpec:
    """A fully connected network: widths [d, h_1, ..., h_L, C], as in IST (Yuan et al. 2022),
    laid out as thinwire's MLP (:mod:`thinwire.models.mlp`) with normalisation ``norm``."""

    name: str
    """Preset name, for example "mlp-784-2048-2048-10"."""
    widths: tuple[int, ...]
    """Layer widths from input to output; at least one hidden layer."""
    norm: str = "none"
    """none (a bias per neuron), layer (bias + LayerNorm weight and bias per hidden neuron, a
    bias per output) or batch (bias-free, BatchNorm weight and bias per hidden neuron)."""
    global_batch: int = 0
    """Default global batch in samples (0: none)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        if len(self.widths) < 3 or min(self.widths) < 1:
            raise UsageError(
                f"model.widths={list(self.widths)} needs input, >= 1 hidden and output widths, all >= 1"
            )
        if self.norm not in MLP_NORMS:
            raise UsageError(f"model.norm={self.norm!r}; use one of {', '.join(MLP_NORMS)}")

    @property
    def params(self) -> int:
        """sum_i w_i*w_{i+1} plus the per-neuron vectors of ``norm``."""
        w = self.widths
        weights = sum(a * b for a, b in zip(w[:-1], w[1:]))
        hidden, out = sum(w[1:-1]), w[-1]
        vectors = {"none": hidden + out, "layer": 3 * hidden + out, "batch": 2 * hidden}
        return weights + vectors[self.norm]

    @property
    def flops_per_sample(self) -> float:
        """Training FLOPs per sample: 6 * weights (2 forward, 4 backward)."""
        w = self.widths
        return 6.0 * sum(a * b for a, b in zip(w[:-1], w[1:]))


@dataclass(frozen=True)
class CountedSpec:
    """Any model reduced to counts: parameters and training FLOPs per sample (torch modules)."""

    name: str
    """Where the counts came from."""
    params: int
    """Trainable parameters."""
    flops_per_sample: float
    """Training FLOPs per sample (6 x multiply-adds of Linear/Conv layers, forward)."""
    global_batch: int = 0
    """Default global batch in samples (0: none)."""
    ist: Any = None
    """The model's IST plan (:class:`~thinwire.models.adapter.ISTPlan`, from its adapter) when
    counted from a module that has one: the planner prices IST on it (None: IST not priced)."""
    wide: Any = None
    """The shapes of an extreme-classification network (:class:`XMLPShapes`) when the model is
    one: methods that shard its wide layer (``slide``) are priced from them (None: not one)."""

    def __post_init__(self) -> None:
        _positive(self, "params", "flops_per_sample")


@dataclass(frozen=True)
class XMLPShapes(WideShapes):
    """SLIDE's network (Chen et al., MLSys 2020; thinwire's ``xmlp``): ``features`` sparse
    inputs -> ``hidden`` (ReLU) -> ``labels`` outputs, with what its activation traffic needs:
    ``nnz`` non-zeros of an input row, ``label_cols`` label slots of a row and ``batch``, the
    samples a worker reads a step (Amazon-670K: 135909-128-670091, batch 128). The fields are
    :class:`~thinwire.strategies.entry.WideShapes`', checked positive, with the counted model."""

    def __post_init__(self) -> None:
        _positive(self, "features", "hidden", "labels", "nnz", "label_cols", "batch")

    def spec(self, name: str) -> CountedSpec:
        """The counted model: both layers' weights and biases; 6 x the multiply-adds of a
        sample's dense pass (its ``nnz`` input rows and every output)."""
        H = self.hidden
        params = self.features * H + H + self.labels * (H + 1)
        flops = 6.0 * (self.nnz * H + H * self.labels)
        return CountedSpec(name=name, params=params, flops_per_sample=flops,
                           global_batch=self.batch, wide=self)


ModelSpec = TransformerSpec | MLPSpec | CountedSpec


@dataclass(frozen=True)
class ClusterSpec:
    """Nodes of identical devices: an intra-node link (NVLink, shared memory) and a network."""

    name: str
    """Preset or file name."""
    devices_per_node: int
    """g, accelerators (or CPU workers) per node."""
    device_memory: float
    """Bytes of memory per device."""
    peak_flops: tuple[tuple[str, float], ...]
    """Peak FLOP/s per dtype as (dtype, FLOP/s) pairs; a mapping is accepted and converted."""
    memory_bandwidth: float
    """Device memory bandwidth in bytes/s (bounds element-wise ops and the optimizer step)."""
    intra_bandwidth: float
    """Per-device, per-direction intra-node link bandwidth in bytes/s."""
    inter_bandwidth: float
    """Per-device, per-direction inter-node bandwidth in bytes/s (NIC share of one device)."""
    intra_latency: float = 2e-6
    """alpha of the alpha-beta model inside a node, seconds per message (ring step)."""
    inter_latency: float = 5e-6
    """alpha across nodes, seconds per message."""
    nodes: int = 1
    """Number of nodes (the CLI's --nodes overrides)."""
    device_count: int = 0
    """Devices in all, when the last node is only partly used (the CLI's --devices); 0:
    nodes x devices_per_node."""
    matmul_efficiency: tuple[tuple[float, float], ...] = ((1.0, 0.6), (16.0, 0.9), (128.0, 0.99))
    """(GFLOP of one matmul, fraction of peak) points, interpolated in log size (Calculon)."""
    memory_efficiency: float = 0.9
    """Fraction of memory_bandwidth element-wise kernels achieve."""
    intra_efficiency: float = 0.65
    """Fraction of intra_bandwidth collectives achieve."""
    inter_efficiency: float = 0.9
    """Fraction of inter_bandwidth collectives achieve."""
    compute_efficiency: float = 1.0
    """Fraction of the modelled kernel rate reached end to end (launch gaps, framework overhead,
    kernels not modelled): kernel times are divided by it. Fit to published runs for a100-80gb
    (``thinwire plan --validate``); 1.0, i.e. uncalibrated, elsewhere."""
    host_bandwidth: float = 25e9
    """Device-host bytes/s (PCIe), used by offload."""
    default_dtype: str = "bf16"
    """Training dtype when the strategy does not name one."""

    def __post_init__(self) -> None:
        """1. positive sizes and rates; 2. peak FLOP/s per dtype, the default one among them;
        3. the matmul curve; 4. efficiencies in (0, 1], latencies >= 0; 5. the device count."""
        _positive(self, "devices_per_node", "device_memory", "memory_bandwidth",
                  "intra_bandwidth", "inter_bandwidth", "nodes", "host_bandwidth")
        self._normalise_peaks()
        curve = tuple(sorted((float(g), float(e)) for g, e in self.matmul_efficiency))
        if not curve or any(not 0 < e <= 1 or g <= 0 for g, e in curve):
            raise UsageError("cluster.matmul_efficiency needs [gflop > 0, 0 < eff <= 1] pairs")
        object.__setattr__(self, "matmul_efficiency", curve)
        for name in ("memory_efficiency", "intra_efficiency", "inter_efficiency",
                     "compute_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise UsageError(f"cluster.{name} must be in (0, 1]")
        if self.intra_latency < 0 or self.inter_latency < 0:
            raise UsageError("cluster latencies must be >= 0 seconds")
        full = self.nodes * self.devices_per_node
        if self.device_count and not full - self.devices_per_node < self.device_count <= full:
            raise UsageError(
                f"cluster.device_count={self.device_count} does not fit {self.nodes} nodes of "
                f"{self.devices_per_node}; give --devices alone (nodes follow from it)"
            )

    def _normalise_peaks(self) -> None:
        """Step 2: peak_flops as sorted (dtype, FLOP/s) pairs, all > 0, the default included."""
        pairs = self.peak_flops.items() if isinstance(self.peak_flops, Mapping) else self.peak_flops
        object.__setattr__(self, "peak_flops", tuple(sorted((str(k), float(v)) for k, v in pairs)))
        if any(v <= 0 for _, v in self.peak_flops):
            raise UsageError("cluster.peak_flops values must be > 0 FLOP/s")
        if self.default_dtype not in dict(self.peak_flops):
            raise UsageError(
                f"cluster.default_dtype={self.default_dtype!r} has no entry in cluster.peak_flops"
            )

    @property
    def devices(self) -> int:
        """N: ``device_count``, or nodes x devices_per_node."""
        return self.device_count or self.nodes * self.devices_per_node

    def with_devices(self, devices: int) -> ClusterSpec:
        """This cluster cut or grown to ``devices`` devices: whole nodes of the preset, the last
        one partly used (one device: one node holding one)."""
        if devices < 1:
            raise UsageError(f"--devices={devices} must be >= 1")
        g = self.devices_per_node
        nodes = -(-devices // g)
        return dataclasses.replace(self, nodes=nodes, device_count=0 if devices == nodes * g
                                   else devices)

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``; UsageError naming the known dtypes otherwise."""
        table = dict(self.peak_flops)
        if dtype not in table:
            raise UsageError(
                f"cluster {self.name} has no peak_flops for dtype {dtype!r}; "
                f"use one of {sorted(table)}"
            )
        return table[dtype]

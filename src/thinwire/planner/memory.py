"""Memory per device: weights, gradients, optimizer state and activations.

Model states (Rajbhandari et al. 2020, "ZeRO", Sec. 3/5): with w weight bytes, g gradient bytes
and K optimizer bytes per parameter, Psi parameters and N_d data-parallel ranks,
  stage 0: (w + g + K) Psi;  1: (w + g) Psi + K Psi/N_d;  2: w Psi + (g + K) Psi/N_d;
  3: (w + g + K) Psi/N_d.
ZeRO's accounting is w = g = 2, K = 12 (16 B/param: Psi = 7.5B, N_d = 64 gives 120 -> 31.4 ->
16.6 -> 1.9 GB); Megatron keeps fp32 gradients, g = 4 (18 B/param, Korthikanti et al. 2022).

Activations per transformer layer, 16-bit (Korthikanti et al. 2022, arXiv 2205.05198, Table 2),
in units of s*b*h bytes with a = heads and f = FFN width (34 = 18 + 4f/h for f = 4h):
  no parallelism         34 + 5as/h
  tensor parallel t      10 + 24/t + 5as/(ht)
  TP + sequence parallel (34 + 5as/h) / t
  TP + selective         10 + 24/t         (with SP: 34/t)
  full recompute         2 (the layer input; 2/t with SP)
1F1B keeps min(m, p) micro-batches of L/p layers on the first stage (L layers' worth when
m >= p); interleaving with v chunks multiplies that by 1 + (p-1)/(p*v).
"""

from __future__ import annotations

from dataclasses import dataclass

from thinwire.planner.specs import DTYPE_BYTES, ClusterSpec, MLPSpec, ModelSpec, TransformerSpec
from thinwire.planner.strategy import StrategySpec

GIB = 1024.0**3


@dataclass(frozen=True)
class ParamBytes:
    """Bytes per parameter of each model state."""

    weight: float
    """Working weights (2 in mixed precision, 4 in fp32)."""
    grad: float
    """Gradients (4 with Megatron's fp32 accumulation, 2 in ZeRO's accounting)."""
    optim: float
    """Optimizer state incl. fp32 master weights (K = 12 for mixed-precision Adam)."""

    @property
    def total(self) -> float:
        return self.weight + self.grad + self.optim


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device (the most loaded one: the first pipeline stage)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def model_states(self) -> float:
        """Weights + gradients + optimizer (Korthikanti's "parameters and optimizer state")."""
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations

    def fits(self, cluster: ClusterSpec) -> bool:
        return self.total <= cluster.device_memory

    def as_dict(self) -> dict[str, float]:
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "total": self.total,
        }


def param_bytes(strategy: StrategySpec, cluster: ClusterSpec) -> ParamBytes:
    """Bytes per parameter for the strategy's dtype, accounting and optimizer."""
    wb = float(DTYPE_BYTES[strategy.resolved_dtype(cluster)])
    state = {"adam": 2, "momentum": 1, "sgd": 0}[strategy.optimizer]
    if wb >= 4:  # plain fp32: no master copy
        return ParamBytes(wb, 4.0, 4.0 * state)
    grad = 4.0 if strategy.accounting == "megatron" else wb
    return ParamBytes(wb, grad, 4.0 + 4.0 * state)


def zero_model_states(
    psi: float, n_d: int, stage: int, pb: ParamBytes
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per device under ZeRO ``stage`` (module docstring)."""
    w, g, k = pb.weight * psi, pb.grad * psi, pb.optim * psi
    if stage >= 1:
        k /= n_d
    if stage >= 2:
        g /= n_d
    if stage >= 3:
        w /= n_d
    return w, g, k


def layer_activation_units(model: TransformerSpec, t: int, sp: bool, recompute: str) -> float:
    """Activation bytes of one layer divided by s*b*h (Korthikanti Table 2, general f)."""
    h, a, s = model.hidden, model.heads, model.seq
    split = 8.0 + 4.0 * model.ffn / h  # 24 when f = 4h
    attn = 5.0 * a * s / h
    if recompute == "full":
        return 2.0 / t if sp else 2.0
    if sp:
        return (10.0 + split + (0.0 if recompute == "selective" else attn)) / t
    return 10.0 + split / t + (0.0 if recompute == "selective" else attn / t)


def activation_bytes(model: TransformerSpec, s: StrategySpec) -> float:
    """Activation bytes held by the first pipeline stage at its peak (1F1B, interleaving)."""
    per_layer = (
        layer_activation_units(model, s.tp, s.sequence_parallel, s.recompute)
        * model.seq
        * s.micro_batch_size
        * model.hidden
    )
    in_flight = min(s.micro_batches, s.pp)
    total = per_layer * (model.layers / s.pp) * in_flight
    if s.interleave > 1:
        total *= 1.0 + (s.pp - 1) / (s.pp * s.interleave)
    return total


def transformer_params_per_device(
    model: TransformerSpec, s: StrategySpec, embeddings: bool = True
) -> float:
    """Parameters on the first stage's device: L/p layers split t ways (+ its embedding shard)."""
    layers = model.layers / s.pp * model.layer_params / s.tp
    if not embeddings:
        return layers
    return layers + model.vocab * model.hidden / s.tp + model.seq * model.hidden


def mlp_activation_bytes(model: MLPSpec, batch: int, elem: float, n: int = 1) -> float:
    """Stored activations of an MLP: the input, pre- and post-activation of every layer.

    Under IST with n workers a subnet's hidden layers are 1/n as wide.
    """
    hidden = sum(model.widths[1:-1]) / n
    return (model.widths[0] + 2.0 * (hidden + model.widths[-1])) * batch * elem


def ist_subnet_params(model: MLPSpec, n: int) -> float:
    """IST subnet size (Yuan et al. 2022; ist.md): d*h/n + (L-1)*h^2/n^2 + h*C/n + vectors.

    First layer: rows of the worker's neurons (full input width); hidden-to-hidden: the block
    joining its own neurons (1/n^2); output layer: its columns (all C outputs); biases of its
    own hidden neurons plus the shared output bias.
    """
    w = model.widths
    weights = w[0] * w[1] / n + w[-2] * w[-1] / n
    weights += sum(a * b / (n * n) for a, b in zip(w[1:-2], w[2:-1]))
    vectors = (sum(w[1:-1]) / n + w[-1]) if model.bias else 0.0
    return weights + vectors


def transformer_ist_subnet_params(model: TransformerSpec, n: int) -> float:
    """IST for a transformer: heads and FFN neurons dealt over n workers, embeddings shared."""
    h, f = model.hidden, model.ffn
    per_layer = (4 * h * h + 2 * h * f + f) / n + 9 * h
    return model.layers * per_layer + model.embedding_params


def subnet_params(model: ModelSpec, n: int) -> float:
    """Parameters a worker holds under IST with n workers (the full model when n == 1)."""
    if n <= 1 or not isinstance(model, (MLPSpec, TransformerSpec)):
        return float(model.params)
    if isinstance(model, MLPSpec):
        return ist_subnet_params(model, n)
    return transformer_ist_subnet_params(model, n)


def memory_breakdown(model: ModelSpec, cluster: ClusterSpec, s: StrategySpec) -> MemoryBreakdown:
    """Per-device memory of ``s`` (first pipeline stage; IST: one worker's subnet)."""
    pb = param_bytes(s, cluster)
    elem = float(DTYPE_BYTES[s.resolved_dtype(cluster)])
    ist = s.method == "ist"
    n_d = 1 if ist else s.dp  # IST workers hold disjoint subnets: nothing to shard further
    if isinstance(model, TransformerSpec):
        if ist:  # heads and FFN neurons are dealt like a tensor-parallel split of degree n
            psi = transformer_ist_subnet_params(model, s.dp)
            units = layer_activation_units(model, s.dp, False, s.recompute)
            acts = units * model.seq * s.micro_batch_size * model.hidden * model.layers
        else:
            psi = transformer_params_per_device(model, s)
            acts = activation_bytes(model, s)
    else:
        psi = subnet_params(model, s.dp) if ist else float(model.params)
        acts = 0.0
        if isinstance(model, MLPSpec):
            acts = mlp_activation_bytes(model, s.micro_batch_size, elem, s.dp if ist else 1)
    w, g, k = zero_model_states(psi, n_d, s.zero, pb)
    if s.offload:
        k = 0.0
    return MemoryBreakdown(weights=w, gradients=g, optimizer=k, activations=acts)

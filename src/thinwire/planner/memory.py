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
A fused attention kernel (SDPA, FlashAttention) never stores the 5as/h term (the softmax
output, the dropout mask and output; it keeps a few bytes per row), so with it the table's
rows lose that term as under selective recompute. 1F1B keeps min(m, p) micro-batches of L/p
layers on the first stage (L layers' worth when m >= p); interleaving with v chunks multiplies
that by 1 + (p-1)/(p*v). The last stage holds one micro-batch of its L/p layers and the logits:
b*s*V/t in the compute dtype and their fp32 copy for the loss (vocab-parallel cross entropy),
b*s*V*(e + 4)/t bytes. The device reported is the stage holding more.
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
    """Bytes per device (the most loaded one: the first or the last pipeline stage)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    """Activations of the transformer layers (or the MLP's) held at the peak."""
    logits: float = 0.0
    """The logits and their fp32 copy for the loss (on the last stage)."""

    @property
    def model_states(self) -> float:
        """Weights + gradients + optimizer (Korthikanti's "parameters and optimizer state")."""
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.logits

    def fits(self, cluster: ClusterSpec) -> bool:
        return self.total <= cluster.device_memory

    def as_dict(self) -> dict[str, float]:
        """Bytes per component and the total."""
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "logits": self.logits,
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


def layer_activation_units(
    model: TransformerSpec, t: int, sp: bool, recompute: str, attention: str = "fused"
) -> float:
    """Activation bytes of one layer divided by s*b*h (Korthikanti Table 2, general f; the
    attention-score term only with a materialized attention kernel)."""
    h, a, s = model.hidden, model.heads, model.seq
    split = 8.0 + 4.0 * model.ffn / h  # 24 when f = 4h
    stored = recompute == "none" and attention == "materialized"
    attn = 5.0 * a * s / h if stored else 0.0
    if recompute == "full":
        return 2.0 / t if sp else 2.0
    if sp:
        return (10.0 + split + attn) / t
    return 10.0 + split / t + attn / t


def _scores(model: TransformerSpec, t: int, recompute: str, attention: str) -> float:
    """a*s/(h t): the unit of the attention-score terms (0 where the scores are not stored)."""
    if recompute != "none" or attention != "materialized":
        return 0.0
    return model.heads * model.seq / model.hidden / t


def mask_units(model: TransformerSpec, t: int, sp: bool, recompute: str,
               attention: str = "fused") -> float:
    """The dropout masks among :func:`layer_activation_units` (one byte per element): the
    attention output's and the FFN output's, 2 (2/t with SP), and with materialized scores the
    attention dropout's a*s/(h t); 0 under full recomputation."""
    if recompute == "full":
        return 0.0
    return (2.0 / t if sp else 2.0) + _scores(model, t, recompute, attention)


def _per_layer(model: TransformerSpec, s: StrategySpec, elem: float = 2.0) -> float:
    """Activation bytes of one layer and one micro-batch on one device. Table 2's units are
    16-bit tensors plus 1-byte dropout masks: the tensors scale to the dtype's ``elem`` bytes;
    without dropout (``model.dropout`` false) the masks and the attention dropout's output
    (2 a*s/(h t) of the scores' 5) are not stored."""
    t, sp, rc, att = s.tp, s.sequence_parallel, s.recompute, s.attention
    units = layer_activation_units(model, t, sp, rc, att)
    masks = mask_units(model, t, sp, rc, att)
    tensors = units - masks
    if not model.dropout:
        tensors -= 2.0 * _scores(model, t, rc, att)
        masks = 0.0
    return (tensors * elem / 2.0 + masks) * model.seq * s.micro_batch_size * model.hidden


def activation_bytes(model: TransformerSpec, s: StrategySpec, elem: float = 2.0) -> float:
    """Activation bytes held by the first pipeline stage at its peak (1F1B, interleaving)."""
    in_flight = min(s.micro_batches, s.pp)
    total = _per_layer(model, s, elem) * (model.layers / s.pp) * in_flight
    if s.interleave > 1:
        total *= 1.0 + (s.pp - 1) / (s.pp * s.interleave)
    return total


def logits_bytes(model: TransformerSpec, s: StrategySpec, elem: float) -> float:
    """The last stage's logits, b*s*V/t in the compute dtype, and their fp32 copy for the loss,
    and the inputs of the final LayerNorm and of the output layer, 2 b*s*h (/t with SP)."""
    b, q = s.micro_batch_size, model.seq
    head = 2.0 * b * q * model.hidden * elem / (s.tp if s.sequence_parallel else 1)
    return b * q * model.vocab / s.tp * (elem + 4.0) + head


def transformer_params_per_device(
    model: TransformerSpec, s: StrategySpec, embeddings: bool = True
) -> float:
    """Parameters on the first stage's device: L/p layers split t ways (+ its embedding shard)."""
    layers = model.layers / s.pp * model.layer_params / s.tp
    if not embeddings:
        return layers
    return layers + model.vocab * model.hidden / s.tp + model.seq * model.hidden


def mlp_activation_bytes(widths: tuple[float, ...], batch: int, elem: float) -> float:
    """Stored activations of an MLP of ``widths``: the input, pre- and post-activation of every
    layer (a worker's subnet: its hidden widths, :func:`thinwire.planner.methods.worker_widths`)."""
    return (widths[0] + 2.0 * sum(widths[1:])) * batch * elem


def _transformer_memory(model: TransformerSpec, s: StrategySpec, elem: float
                        ) -> tuple[float, float, float]:
    """(parameters, activations, logits) of the more loaded of the first and last stage."""
    psi = transformer_params_per_device(model, s)
    first = activation_bytes(model, s, elem)
    if s.pp == 1:
        return psi, first, logits_bytes(model, s, elem)
    last = _per_layer(model, s, elem) * model.layers / s.pp
    logits = logits_bytes(model, s, elem)
    if last + logits > first:
        return transformer_params_per_device(model, s, embeddings=False), last, logits
    return psi, first, 0.0


def _dense_memory(model: ModelSpec, s: StrategySpec, elem: float) -> tuple[float, float]:
    """(parameters, activations) of one worker of an MLP or a counted model."""
    if not isinstance(model, MLPSpec):
        if s.partitioned:  # its subnet's parameters, or the method's own share (and tables)
            from thinwire.planner.methods import method_share, worker_params

            share = method_share(model, s.method, s.dp)
            if share is not None:
                return share.params, share.other_bytes
            return worker_params(model, s.dp, s.method), 0.0
        return float(model.params), 0.0
    if s.partitioned:
        from thinwire.planner.methods import worker_params, worker_widths

        widths = worker_widths(model, s.dp, s.method)
        psi = worker_params(model, s.dp, s.method)
    else:
        widths, psi = tuple(float(w) for w in model.widths), float(model.params)
    return psi, mlp_activation_bytes(widths, s.micro_batch_size, elem)


def memory_breakdown(model: ModelSpec, cluster: ClusterSpec, s: StrategySpec) -> MemoryBreakdown:
    """Per-device memory of ``s``: 1. bytes per parameter of each state; 2. the parameters and
    activations of the most loaded device (a method cutting the model: one worker's part);
    3. ZeRO's sharding of the states over d (none for a cut model: the parts are disjoint);
    4. offload moves the optimizer state to the host."""
    pb = param_bytes(s, cluster)
    elem = float(DTYPE_BYTES[s.resolved_dtype(cluster)])
    logits = 0.0
    if isinstance(model, TransformerSpec):
        psi, acts, logits = _transformer_memory(model, s, elem)
    else:
        psi, acts = _dense_memory(model, s, elem)
    w, g, k = zero_model_states(psi, 1 if s.partitioned else s.dp, s.zero, pb)
    if s.offload:
        k = 0.0
    return MemoryBreakdown(w, g, k, acts, logits)

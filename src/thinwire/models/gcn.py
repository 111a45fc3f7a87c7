"""A graph convolutional network for node classification.

Kipf & Welling, "Semi-Supervised Classification with Graph Convolutional Networks" (ICLR 2017):
layer l maps node states H_l to H_{l+1} = act(A_hat H_l W_l + b_l) with the normalised adjacency
A_hat = D^-1/2 (A + I) D^-1/2 (built by :mod:`thinwire.data.graph`), ReLU between layers and
the raw class scores after the last. ``norm="layer"`` adds a parameter-free LayerNorm after each
hidden layer (before the activation), as GIST (Wolfe et al., "GIST: Distributed Training for
Large-Scale Graph Convolutional Networks") does so that a worker holding a slice of the hidden
features sees them on the full model's scale.

The model holds its graph: the dense node ``features`` [nodes, F] and the sparse ``adjacency``
(CSR or COO) are non-persistent buffers (never parameters, never in the state dict) taken from the
dataset's ``extra``; ``model.to(device)`` moves them. Forward for node ids [B] (int64):
  1. h = features;
  2. for each ``layers[l]`` (an ``nn.Linear``): dropout on h (training only), then
     h = A_hat (h W_l^T) + b_l (or (A_hat h) W_l^T + b_l when that is cheaper, i.e. when the
     layer widens), then for hidden layers LayerNorm (if asked) and ReLU;
  3. return the rows of ``node_ids``: logits [B, classes].
The bias is added after propagation (so every node gets the same b_l). Hidden layer l has
``layers[l].weight.shape[0]`` features, the columns of ``layers[l + 1]``; no width is stored
elsewhere, so a model holding a subset of hidden features (IST's unit for GCNs) runs unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from thinwire.errors import UsageError
from thinwire.models.adapter import Cut, ISTAdapter, ISTPlan, TensorPlan, UnitGroup
from thinwire.models.registry import ModelEntry
from thinwire.options import check, opt

if TYPE_CHECKING:
    from thinwire.data.datasets import Dataset

SPARSE_LAYOUTS = (torch.sparse_csr, torch.sparse_coo)


class FeatureNorm(nn.Module):
    """Parameter-free LayerNorm over the last dimension at whatever width it meets (the same as
    ``nn.LayerNorm(width, elementwise_affine=False)``, without a stored width)."""

    def __init__(self, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], eps=self.eps)


class GraphConv(nn.Linear):
    """One graph convolution, ``A_hat (h W^T) + b``, or ``(A_hat h) W^T + b`` when the layer
    widens (the cheaper order; the same result in exact arithmetic). An ``nn.Linear`` (its
    ``weight`` and ``bias`` keep their names) called as a module, so module hooks see it: FSDP2
    gathers its parameters and recomputation checkpoints it."""

    def forward(self, h: torch.Tensor, adjacency: torch.Tensor | None = None) -> torch.Tensor:
        if adjacency is None:
            return super().forward(h)
        if self.in_features < self.out_features:
            return F.linear(torch.sparse.mm(adjacency, h), self.weight, self.bias)
        h = torch.sparse.mm(adjacency, F.linear(h, self.weight))
        return h if self.bias is None else h + self.bias


class GCN(nn.Module):
    """The graph convolutional network of the module docstring."""

    features: torch.Tensor
    adjacency: torch.Tensor

    def __init__(self, features: torch.Tensor, adjacency: torch.Tensor, num_classes: int, *,
                 hidden: int = 64, layers: int = 2, norm: str = "none",
                 dropout: float = 0.0) -> None:
        super().__init__()
        if adjacency.layout not in SPARSE_LAYOUTS:
            raise ValueError(f"adjacency must be a sparse CSR or COO tensor, got {adjacency.layout}")
        nodes = features.shape[0]
        if features.dim() != 2 or tuple(adjacency.shape) != (nodes, nodes):
            raise ValueError(f"features must be [nodes, F] and adjacency [nodes, nodes], got "
                             f"{tuple(features.shape)} and {tuple(adjacency.shape)}")
        if adjacency.layout == torch.sparse_coo:
            adjacency = adjacency.coalesce()
        self.register_buffer("features", features, persistent=False)
        self.register_buffer("adjacency", adjacency, persistent=False)
        # The graph comes from the data and is identical on every rank: DistributedDataParallel
        # must not broadcast it (it cannot: it has no sparse support). This is torch's hook for
        # buffers DDP leaves alone (DistributedDataParallel._set_params_and_buffers_to_ignore_...).
        self._ddp_params_and_buffers_to_ignore: tuple[str, ...] = ("features", "adjacency")
        widths = [features.shape[1], *([hidden] * (layers - 1)), num_classes]
        self.layers = nn.ModuleList(GraphConv(widths[i], widths[i + 1])
                                    for i in range(len(widths) - 1))
        self.norm: nn.Module = FeatureNorm() if norm == "layer" else nn.Identity()
        self.act = nn.ReLU()
        self.dropout = dropout
        for lin in self.layers:
            assert isinstance(lin, nn.Linear)
            nn.init.xavier_uniform_(lin.weight)  # Glorot, as Kipf & Welling
            nn.init.zeros_(lin.bias)

    def forward(self, node_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, classes] of nodes ``node_ids`` [B] (steps of the module docstring)."""
        h = self.features
        last = len(self.layers) - 1
        for i, lin in enumerate(self.layers):
            assert isinstance(lin, GraphConv)
            h = F.dropout(h, self.dropout, self.training)
            h = lin(h, self.adjacency)
            if i < last:
                h = self.act(self.norm(h))
        return h[node_ids]


@dataclass(frozen=True)
class Options:
    """``[model]`` options of the GCN."""

    hidden: int = opt(64, "features of each hidden layer")
    layers: int = opt(2, "graph convolution layers (1: no hidden layer)")
    norm: str = opt("none", "after each hidden layer: none, or layer (parameter-free LayerNorm, "
                    "as GIST)", choices=("none", "layer"))
    dropout: float = opt(0.0, "dropout on each layer's input (Kipf & Welling use 0.5)")

    def __post_init__(self) -> None:
        check(self.hidden >= 1, "model.hidden", f"got {self.hidden}; use an integer >= 1")
        check(self.layers >= 1, "model.layers", f"got {self.layers}; use an integer >= 1")
        check(self.norm in ("none", "layer"), "model.norm",
              f"got {self.norm!r}; use one of none, layer")
        check(0.0 <= self.dropout < 1.0, "model.dropout",
              f"got {self.dropout}; use a probability in [0, 1)")


def build_gcn(options: Options, dataset: Dataset, seed: int) -> GCN:
    """The GCN on ``dataset``'s graph (a ``node`` dataset with ``extra["features"]`` and
    ``extra["adjacency"]``) with weights drawn from ``seed`` (identical on every rank)."""
    features = dataset.extra.get("features")
    adjacency = dataset.extra.get("adjacency")
    if (dataset.kind != "node" or not isinstance(features, torch.Tensor)
            or not isinstance(adjacency, torch.Tensor) or adjacency.layout not in SPARSE_LAYOUTS):
        raise UsageError(
            f"model gcn needs a graph (a 'node' dataset with node features and a sparse "
            f"adjacency, such as cora or sbm), but {dataset.name} is a '{dataset.kind}' dataset; "
            f"pick --data.name cora")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GCN(features, adjacency, dataset.num_classes, hidden=options.hidden,
                   layers=options.layers, norm=options.norm, dropout=options.dropout)


class GISTAdapter(ISTAdapter):
    """GIST (Wolfe, Yang, Liao, Chowdhury, Dun, Bayer, Segarra, Kyrillidis, "GIST: Distributed
    Training for Large-Scale Graph Convolutional Networks"): IST over a GCN's hidden features.

    1. Hidden layer i (the outputs of ``layers[i]``, i < L for L + 1 layers) is one disjoint
       group ``hidden.i``, cut as IST cuts a fully connected net's neurons: ``layers[0]``'s
       weight rows and bias by ``hidden.0`` (the node features are whole); ``layers[i]``'s
       weight by ``hidden.i`` (rows, and bias) and ``hidden.i-1`` (columns), so only the block
       joining a worker's own features of both layers travels and trains; ``layers[L]``'s weight
       columns by ``hidden.L-1``, its bias shared and averaged over all ranks;
    2. normalisation is the model's own, parameter-free (``norm = layer``: LayerNorm without
       affine parameters, as GIST): it adapts to whatever width a subnet holds and has nothing
       to cut;
    3. the graph (features, normalised adjacency) is a non-persistent buffer: it never travels
       and stays whole on every worker (each trains its sub-GCN on the full graph);
    4. activation scaling, ``dropout`` by default: layer i > 0 sees the held features of
       ``hidden.i-1`` multiplied by features / held (inverted dropout), so its pre-activations
       (and the logits) keep the full model's scale; the GCN applies its layers functionally,
       so the factor is applied to the output of the hidden activation (``model.act``, called
       once per hidden layer in order), which is the next layer's input. ``dropout`` against
       ``none`` on Cora, 4 workers, is one row of docs/benchmarks/ist-models.md ("IST beyond fully
       connected nets", ``benchmarks/ist_models.py gcn``). A one-layer GCN has no hidden
       features: it is refused.
    """

    scales = ("dropout", "none")

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, GCN):
            raise UsageError(f"GISTAdapter cuts thinwire's GCN, got {type(model).__name__}")
        last = len(model.layers) - 1
        if last < 1:
            raise UsageError("GIST cuts a GCN's hidden features; this GCN has one layer and "
                             "none: use model.layers >= 2")
        groups, tensors, scaled = [], [], []
        for i, lin in enumerate(model.layers):
            assert isinstance(lin, nn.Linear)
            w_cuts, b_cuts = [], []
            if i < last:
                groups.append(UnitGroup(f"hidden.{i}", lin.out_features))
                w_cuts.append(Cut(f"hidden.{i}", 0))
                b_cuts.append(Cut(f"hidden.{i}", 0))
            if i > 0:
                w_cuts.append(Cut(f"hidden.{i - 1}", 1))
                scaled.append((f"layers.{i}", f"hidden.{i - 1}"))
            dtype = str(lin.weight.dtype).replace("torch.", "")
            tensors.append(TensorPlan(f"layers.{i}.weight", tuple(lin.weight.shape),
                                      tuple(w_cuts), dtype=dtype))
            if lin.bias is not None:
                tensors.append(TensorPlan(f"layers.{i}.bias", tuple(lin.bias.shape),
                                          tuple(b_cuts), dtype=dtype))
        super().__init__(ISTPlan(groups=tuple(groups), tensors=tuple(tensors),
                                 scaled_inputs=tuple(scaled)))

    def install_scaling(self, model: nn.Module, factors: Sequence[tuple[str, float]]
                        ) -> list[Any]:
        """Step 4: the k-th call of ``model.act`` in a forward pass makes the input of
        ``layers[k + 1]``; a model pre-hook restarts the count at every forward."""
        assert isinstance(model, GCN)
        by_input = {int(name.split(".")[1]) - 1: f for name, f in factors}
        calls = [0]

        def restart(_m: nn.Module, _args: Any) -> None:
            calls[0] = 0

        def scale(_m: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
            k, calls[0] = calls[0], calls[0] + 1
            f = by_input.get(k)
            return out if f is None else out * f

        return [model.register_forward_pre_hook(restart),
                model.act.register_forward_hook(scale)]


def activation_bytes(options: Options, dataset: Dataset, batch: int, recompute: str) -> int:
    """Bytes the forward pass and the cross-entropy loss keep for backward (fp32), from the
    shapes: N nodes, F input features, hidden width H, L layers, C classes, B labelled nodes a
    step. The whole graph runs every step, so the hidden states are N x H whatever B is.

    Per layer l with input width k and output width w: 1. dropout (p > 0) on a hidden input
    keeps its mask, N k elements (fp32 on the CPU, where dropout is a multiply by a scaled
    mask; CUDA's fused dropout keeps one byte per element, which this formula overstates); the
    node features are data (no gradient), so their dropout keeps no mask; 2. the layer's linear
    keeps its input: the propagated N k when the layer widens (``block`` recompute: the layer's
    input instead, new only after dropout), otherwise the dropout output N k when p > 0 (the
    previous ReLU output, already counted, or the feature buffer, not an activation, when p = 0);
    3. a hidden layer's LayerNorm keeps its input N w and mean and rstd (2 N), its ReLU the
    output N w. Outside: the node ids (int64), the log-softmax output B C, the targets (int64)
    and one scalar. The sparse adjacency is a buffer, never counted."""
    n, f = (int(d) for d in dataset.extra["features"].shape)
    c = dataset.num_classes
    widths = [f, *([options.hidden] * (options.layers - 1)), c]
    total = 0
    for i in range(options.layers):
        k, w = widths[i], widths[i + 1]
        if options.dropout > 0 and i > 0:
            total += n * k
        if k < w:
            total += n * k if (recompute != "block" or options.dropout > 0) else 0
        elif options.dropout > 0:
            total += n * k
        if i < options.layers - 1:
            if options.norm == "layer":
                total += n * w + 2 * n
            total += n * w
    return 4 * (total + batch * c + 1) + 16 * batch


MODEL = ModelEntry(
    name="gcn", summary="graph convolutional network (Kipf & Welling 2017) for node classes",
    build=build_gcn, data_kinds=("node",), default_data="cora", options=Options,
    blocks=(r"layers\.\d+",), ist=GISTAdapter, activations=activation_bytes)

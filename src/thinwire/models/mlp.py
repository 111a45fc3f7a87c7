"""A multilayer perceptron with configurable depth, width and normalisation.

With ``norm="batch"`` the net follows the original IST code (Yuan et al., VLDB 2022): every
linear layer is bias-free and followed by BatchNorm1d that uses batch statistics in training and
in evaluation (``track_running_stats=False``), hidden norms with a learnable per-neuron scale and
shift, the logits' norm without (``affine=False``). Because batch statistics re-normalise each
neuron, a subnet holding 1/n of a layer sees pre-activations on the same scale as the full net:
this is IST's faithful answer to the activation-scale pitfall.

``norm="layer"`` uses LayerNorm with biases in the linear layers; ``norm="none"`` plain linear
layers with biases.

Layout: ``layers[i]`` is the i-th Linear (``len(hidden) + 1`` of them), ``norms[i]`` its norm
(``nn.Identity`` when none). Hidden layer i has ``hidden[i]`` neurons: the rows of
``layers[i].weight`` and the columns of ``layers[i+1].weight``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from thinwire.models.adapter import Cut, ISTPlan, TensorPlan, UnitGroup, linear_stack
from thinwire.models.registry import ModelEntry
from thinwire.options import check, opt

if TYPE_CHECKING:
    from thinwire.data.datasets import Dataset


class MLP(nn.Module):
    def __init__(self, input_dim: int, hidden: Sequence[int], num_classes: int, *,
                 norm: str = "batch", activation: str = "relu") -> None:
        super().__init__()
        self.input_dim = input_dim
        self.hidden = tuple(int(h) for h in hidden)
        self.num_classes = num_classes
        self.norm = norm
        self.activation = activation
        widths = [input_dim, *self.hidden, num_classes]
        bias = norm != "batch"
        self.layers = nn.ModuleList(
            nn.Linear(widths[i], widths[i + 1], bias=bias) for i in range(len(widths) - 1)
        )
        norms: list[nn.Module] = []
        for i, w in enumerate(widths[1:]):
            last = i == len(widths) - 2
            if norm == "batch":
                norms.append(nn.BatchNorm1d(w, affine=not last, momentum=None,
                                            track_running_stats=False))
            elif norm == "layer" and not last:
                norms.append(nn.LayerNorm(w))
            else:
                norms.append(nn.Identity())
        self.norms = nn.ModuleList(norms)
        self.act = nn.ReLU() if activation == "relu" else nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits."""
        h = x.flatten(1)
        last = len(self.layers) - 1
        for i, (lin, nrm) in enumerate(zip(self.layers, self.norms)):
            h = nrm(lin(h))
            if i < last:
                h = self.act(h)
        return h


def build_mlp(input_dim: int, hidden: Sequence[int], num_classes: int, *, norm: str = "batch",
              activation: str = "relu", seed: int = 0) -> MLP:
    """The MLP with weights drawn from ``seed`` (identical on every rank)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MLP(input_dim, hidden, num_classes, norm=norm, activation=activation)


def mlp_plan(input_dim: int, hidden: Sequence[int], num_classes: int, *,
             norm: str = "batch") -> ISTPlan:
    """The IST plan of :class:`MLP` from its widths and norm, without building it.

    Equal to ``linear_stack(build_mlp(input_dim, hidden, num_classes, norm=norm)).plan``
    (:class:`~thinwire.models.adapter.LinearStackAdapter`'s steps): 1. hidden layer i is the
    disjoint group ``hidden.i``; 2. Linear i's weight rows (and bias) are cut by ``hidden.i``
    below the output layer, its columns by ``hidden.i-1`` above the input one; 3. a hidden
    norm's per-neuron weight and bias are cut by its layer's group (the output norm of
    ``norm="batch"`` has none; ``layer`` puts no norm after the output); 4. the output bias is
    shared. Pure data: the planner prices IST from it without torch models."""
    widths = [input_dim, *(int(h) for h in hidden), num_classes]
    last = len(widths) - 2
    tensors: list[TensorPlan] = []
    for i in range(last + 1):
        tensors += _layer_tensors(i, last, widths[i], widths[i + 1], norm)
    return ISTPlan(
        groups=tuple(UnitGroup(f"hidden.{i}", w) for i, w in enumerate(widths[1:-1])),
        tensors=tuple(tensors),
        scaled_inputs=tuple((f"layers.{i}", f"hidden.{i - 1}") for i in range(1, last + 1)),
        batch_normalised=norm == "batch")


def _layer_tensors(i: int, last: int, fan_in: int, fan_out: int, norm: str
                   ) -> list[TensorPlan]:
    """Linear i and its norm in :func:`mlp_plan` (steps 2-4)."""
    rows = (Cut(f"hidden.{i}", 0),) if i < last else ()
    cols = (Cut(f"hidden.{i - 1}", 1),) if i > 0 else ()
    out = [TensorPlan(f"layers.{i}.weight", (fan_out, fan_in), rows + cols)]
    if norm != "batch":
        out.append(TensorPlan(f"layers.{i}.bias", (fan_out,), rows))
    if norm in ("batch", "layer") and i < last:
        out += [TensorPlan(f"norms.{i}.{name}", (fan_out,), rows) for name in ("weight", "bias")]
    return out


@dataclass(frozen=True)
class Options:
    """``[model]`` options of the MLP."""

    hidden: tuple[int, ...] = opt((1024, 1024), "hidden layer widths, e.g. 2048,2048")
    norm: str = opt("batch", "normalisation after each layer: batch (IST's original: batch "
                    "statistics, bias-free layers), layer, or none", choices=("batch", "layer", "none"))
    activation: str = opt("relu", "hidden activation", choices=("relu", "tanh"))

    def __post_init__(self) -> None:
        check(len(self.hidden) >= 1, "model.hidden", "give at least one hidden width")
        check(all(h >= 1 for h in self.hidden), "model.hidden", "every width must be >= 1")


def _build(options: Options, dataset: Dataset, seed: int) -> MLP:
    return build_mlp(dataset.input_dim, options.hidden, dataset.num_classes, norm=options.norm,
                     activation=options.activation, seed=seed)


MODEL = ModelEntry(
    name="mlp", summary="fully connected network (Yuan et al.'s IST architecture)",
    build=_build, data_kinds=("classification",), default_data="fashion-mnist", options=Options,
    ist=linear_stack)

"""Which slice of each MLP parameter belongs to a subnet (Yuan et al., VLDB 2022, Section 3).

For hidden layers 0..L-1 with worker j's neuron groups g_0..g_{L-1}:
  - ``layers.0.weight`` [h_0, d]: rows g_0, every input column;
  - ``layers.i.weight`` [h_i, h_{i-1}], 1 <= i < L: the block rows g_i x columns g_{i-1}
    (1/n^2 of the matrix; the cross blocks between two workers' groups are not trained);
  - ``layers.L.weight`` [C, h_{L-1}]: every output row, columns g_{L-1};
  - per-neuron vectors of hidden layer i (``layers.i.bias``, ``norms.i.weight/bias``): g_i;
  - ``layers.L.bias`` (when present) is shared by every subnet and averaged.

Each parameter has an *owner dimension*, the one indexed by the neurons of one hidden layer
(rows for layers 0..L-1 and their vectors, columns for the output layer): in the sharded
deployment a parameter element lives on the rank that owns that neuron. ``other_dim`` is the
second partitioned dimension of a hidden-to-hidden matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

from thinwire.models.mlp import MLP


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    owner_dim: int | None  # None: shared by every subnet
    owner_layer: int | None
    other_dim: int | None = None
    other_layer: int | None = None

    def subnet_shape(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of this parameter in a subnet whose hidden layers have ``sizes`` neurons."""
        shape = list(self.shape)
        if self.owner_dim is not None and self.owner_layer is not None:
            shape[self.owner_dim] = sizes[self.owner_layer]
        if self.other_dim is not None and self.other_layer is not None:
            shape[self.other_dim] = sizes[self.other_layer]
        return tuple(shape)

    @property
    def row_size(self) -> int:
        """Elements per owner-dimension index in the full tensor (before ``other_dim`` cuts)."""
        if self.owner_dim is None:
            return 0
        n = 1
        for d, s in enumerate(self.shape):
            if d != self.owner_dim:
                n *= s
        return n


def mlp_specs(model: MLP) -> list[ParamSpec]:
    """The ParamSpec of every parameter of ``model``, in ``named_parameters`` order."""
    last = len(model.hidden)
    specs = []
    for name, p in model.named_parameters():
        kind, idx, what = name.split(".")
        i = int(idx)
        shape = tuple(p.shape)
        if kind == "layers" and what == "weight":
            if i == last:
                specs.append(ParamSpec(name, shape, owner_dim=1, owner_layer=i - 1))
            elif i == 0:
                specs.append(ParamSpec(name, shape, owner_dim=0, owner_layer=0))
            else:
                specs.append(ParamSpec(name, shape, 0, i, other_dim=1, other_layer=i - 1))
        elif i == last:  # output bias (norms.L has no parameters)
            specs.append(ParamSpec(name, shape, owner_dim=None, owner_layer=None))
        else:
            specs.append(ParamSpec(name, shape, owner_dim=0, owner_layer=i))
    return specs

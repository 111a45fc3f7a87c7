"""The rule table of the graph-derived adapter is the user's to extend: a module of their own
is one rule (docs/IST.md, "Rules for other modules"; this is its example)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from thinwire.errors import UsageError
from thinwire.models.graph import Use, derive_adapter, module_rule, register_rule


class MyLinear(nn.Module):
    """y = x W^T with W [out, in], written by hand (not an nn.Linear)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


def my_linear(p, node, m, name, out):  # noqa: ANN001, ANN201 - the documented example
    a = p.annotation(node.args[0])
    last = out.dim() - 1
    if last in a:                 # the input's channels index the weight's columns
        p.consume(name, *a[last], f"{name}.weight", 1)
    return {last: (p.new_group(m.weight.shape[0], name, [Use(f"{name}.weight", 0)]), 1)}


def test_a_rule_registered_for_a_users_module_cuts_it() -> None:
    model = nn.Sequential(MyLinear(4, 16), nn.ReLU(), MyLinear(16, 3))
    x = torch.randn(5, 4)
    assert module_rule(model[0]) is None
    with pytest.raises(UsageError, match="register a rule"):  # x @ W.T: a parameter's call
        derive_adapter(model, x)
    register_rule(MyLinear, my_linear)
    plan = derive_adapter(model, x).plan
    cuts = {t.name: [(c.group, c.dim) for c in t.cuts] for t in plan.tensors}
    assert [(g.name, g.size) for g in plan.groups] == [("0", 16)]
    assert cuts == {"0.weight": [("0", 0)], "2.weight": [("0", 1)]}
    assert plan.scaled_inputs == (("2", "0"),)
    with pytest.raises(TypeError, match="nn.Module subclass"):
        register_rule(int, my_linear)


class _ChannelsLast(nn.Module):
    """A convolution whose channels a Linear reads after a permute (ConvNeXt's layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).permute(0, 2, 3, 1)).mean((1, 2))


def test_permute_moves_a_channel_group_to_its_new_dimension() -> None:
    plan = derive_adapter(_ChannelsLast(), torch.randn(2, 3, 6, 6)).plan
    cuts = {t.name: [(c.group, c.dim) for c in t.cuts] for t in plan.tensors}
    assert cuts["conv.weight"] == [("conv", 0)] and cuts["fc.weight"] == [("conv", 1)]

"""Step 5 of :mod:`thinwire.models.graph` (``residual="blocks"``, ResIST): the submodules
whose output is their input plus a branch."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx, nn

from thinwire.models.graph.rules import ELEMENTWISE_FUNCS, is_elementwise

aten = torch.ops.aten
ADDS = {operator.add, operator.iadd, torch.add, aten.add.Tensor}
"""The additions that close a residual block (fx's and an exported graph's)."""
ELEMENTWISE_ATEN = {aten.relu.default, aten.relu_.default, aten.dropout.default,
                    aten.gelu.default, aten.silu.default}
"""An exported graph's activations after a block's addition."""
KEEPS = {aten.to.dtype, aten.to.dtype_layout, aten.alias.default, aten.clone.default,
         aten.contiguous.default}
"""Operators that keep their input's values (an RMSNorm's cast to float32 of its input)."""


def _module_paths(n: fx.Node) -> list[str]:
    stack = n.meta.get("nn_module_stack") or {}
    out = []
    for key, value in stack.items():
        path = value[0] if isinstance(value, tuple) else key
        out.append(str(path))
    return out


def residual_blocks(gm: fx.GraphModule, shapes: Mapping[fx.Node, tuple[int, ...]],
                    names: set[str]) -> list[str]:
    """Submodules (of ``names``, the model's) whose output is their input plus a branch (module
    docstring, step 5): 1. the nodes each module's forward made (an exported graph's
    ``nn_module_stack``); 2. the block's output is an addition (or an activation of one); 3. one
    operand of it reaches, through additions inside the block, exactly one value from outside
    it of the output's shape: the stream (other inputs, a mask or positions, may be read)."""
    modules = dict(gm.named_modules())
    inside: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        paths = _module_paths(n)
        if n.op == "call_module":
            target = str(n.target)
            paths = [p for p in paths if p != target] + [target]
        for p in paths:
            inside.setdefault(p, []).append(n)

    def reaches(v: Any, x: fx.Node, members: set[fx.Node]) -> bool:
        """``v`` is ``x``, through identities and value-keeping conversions (``nn.Identity``,
        ``.to(dtype)``), or an addition inside the block one of whose operands reaches ``x``
        (a pre-norm transformer block: ``h = x + attn(x); out = h + mlp(h)``)."""
        while isinstance(v, fx.Node) and v is not x:
            if (v.op == "call_module" and isinstance(modules.get(str(v.target)), nn.Identity)) \
                    or (v.op == "call_function" and v.target in KEEPS):
                v = v.args[0]
            elif v in members and v.op == "call_function" and v.target in ADDS:
                return any(reaches(a, x, members) for a in v.args[:2])
            else:
                return False
        return v is x

    blocks = []
    for path, nodes in inside.items():
        if not path or path not in names:
            continue
        members = set(nodes)
        # the block's inputs: the stream x, and any other value it reads (a mask, positions)
        external = {x for m in nodes for x in m.all_input_nodes
                    if x not in members and x.op != "get_attr"}
        outs = [m for m in nodes if any(u not in members for u in m.users)]
        if len(outs) != 1 or not external:
            continue
        out = outs[0]
        follower = out  # the block's output is an addition, or an elementwise function of one
        while len(follower.all_input_nodes) == 1 and (
                follower.target in ELEMENTWISE_FUNCS or follower.target in ELEMENTWISE_ATEN or
                (follower.op == "call_module" and is_elementwise(modules[str(follower.target)]))):
            follower = follower.all_input_nodes[0]
        if follower.op != "call_function" or follower.target not in ADDS:
            continue
        streams = [x for x in external if shapes.get(x) == shapes.get(out) is not None
                   and any(reaches(a, x, members) for a in follower.args[:2])]
        if len(streams) == 1:
            blocks.append(path)
    # innermost blocks only (a stage holding blocks is not a block itself)
    return [b for b in blocks if not any(o != b and o.startswith(b + ".") for o in blocks)]

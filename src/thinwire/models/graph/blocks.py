"""Step 5 of :mod:`thinwire.models.graph` (``residual="blocks"``, ResIST): the submodules
whose output is their input plus a branch."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx, nn

from thinwire.models.graph.rules import ELEMENTWISE_FUNCS, is_elementwise


def _module_paths(n: fx.Node) -> list[str]:
    stack = n.meta.get("nn_module_stack") or {}
    out = []
    for key, value in stack.items():
        path = value[0] if isinstance(value, tuple) else key
        out.append(str(path))
    return out


def residual_blocks(gm: fx.GraphModule, shapes: Mapping[fx.Node, tuple[int, ...]]
                     ) -> list[str]:
    """Submodules whose output is their input plus a branch (module docstring, step 5)."""
    modules = dict(gm.named_modules())
    inside: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        paths = _module_paths(n)
        if n.op == "call_module":
            target = str(n.target)
            paths = [p for p in paths if p != target] + [target]
        for p in paths:
            inside.setdefault(p, []).append(n)

    def through_identity(x: Any) -> Any:
        while isinstance(x, fx.Node) and (
                x.op == "call_module" and isinstance(modules.get(str(x.target)), nn.Identity)):
            x = x.args[0]
        return x

    blocks = []
    for path, nodes in inside.items():
        if not path or path not in modules:
            continue
        members = set(nodes)
        external = {x for m in nodes for x in m.all_input_nodes
                    if x not in members and x.op != "get_attr"}
        if len(external) != 1:
            continue
        (x,) = external
        outs = [m for m in nodes if any(u not in members for u in m.users)]
        if len(outs) != 1:
            continue
        out = outs[0]
        adds = [m for m in nodes if m.op == "call_function" and m.target in
                (operator.add, operator.iadd, torch.add)]
        ok = False
        for add in adds:
            ops = [through_identity(a) for a in add.args[:2]]
            if x in ops:
                follower = out
                # the block's output is the add, or an elementwise function of it
                while follower is not add and len(follower.all_input_nodes) == 1 and (
                        follower.target in ELEMENTWISE_FUNCS or
                        (follower.op == "call_module" and is_elementwise(
                            modules[str(follower.target)]))):
                    follower = follower.all_input_nodes[0]
                ok = ok or follower is add
        if ok and shapes.get(x) == shapes.get(out) is not None:
            blocks.append(path)
    # innermost blocks only (a stage holding blocks is not a block itself)
    return [b for b in blocks if not any(o != b and o.startswith(b + ".") for o in blocks)]

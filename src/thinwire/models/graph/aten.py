"""Rules for the aten operators of a graph recorded by ``torch.export`` (the tracer of last
resort, :func:`~thinwire.models.graph.tracing.trace`): a module call is decomposed there, and
its parameters are ``get_attr`` nodes named as in the model, so each layer's rule reads the
tensor names off its operator's arguments (``aten.linear(x, W, b)``: W's rows are the new
group, its columns the input's). The module that owns a weight (its name less the last part)
is the one a subnet configures and scales, as on the fx path.

Beside the rules of :mod:`~thinwire.models.graph.rules`: ``aten.addmm`` (transformers'
``Conv1D``: GPT-2's projections, weight ``[in, out]``), ``aten.split`` along a cut dimension
(a fused projection's q | k | v: the pieces share one group of 3 segments, and GPT-2's
``split_size`` follows the held width), ``aten.cat`` (joins the other dimensions),
``aten.expand`` / ``unsqueeze`` / ``slice`` (rotary embeddings' halves, grouped-query
attention's repeated key/value heads, which :meth:`~thinwire.models.graph.groups.Graph.absorb`
joins to their query heads)."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from thinwire.models.graph import rules
from thinwire.models.graph.context import Context
from thinwire.models.graph.groups import Ann, Use
from thinwire.models.graph.rules import ADDITIVE, register_function_rule

aten = torch.ops.aten


def _param(x: Any) -> str | None:
    return str(x.target) if isinstance(x, fx.Node) and x.op == "get_attr" else None


def _owner(tensor: str) -> str:
    return tensor.rsplit(".", 1)[0] if "." in tensor else tensor


def _arg(n: fx.Node, i: int, name: str, default: Any = None) -> Any:
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def linear(p: Context, n: fx.Node, out: Any) -> Ann:
    """``aten.linear(x, W, b)``: as ``nn.Linear``."""
    w, b = _param(n.args[1]), _param(_arg(n, 2, "bias"))
    if w is None or not isinstance(out, torch.Tensor):
        p.poison_inputs(n)
        return {}
    name = _owner(w)
    a = p.annotation(n.args[0])
    last = out.dim() - 1
    kept = {d: v for d, v in a.items() if d != last}
    if last in a:
        gid, inner = a[last]
        p.consume(name, gid, inner, w, 1)
    uses = [Use(w, 0)] + ([Use(b, 0)] if b is not None else [])
    kept[last] = (p.new_group(int(out.shape[-1]), name, uses), 1)
    return kept


def addmm(p: Context, n: fx.Node, out: Any) -> Ann:
    """``aten.addmm(b, x, W)`` with ``W [in, out]`` (transformers' ``Conv1D``, whose ``nf`` a
    subnet sets to its width)."""
    b, w = _param(n.args[0]), _param(n.args[2])
    a = p.annotation(n.args[1])
    if w is None or b is None or any(d != 1 for d in a):
        p.poison_inputs(n)
        return {}
    name = _owner(w)
    if 1 in a:
        gid, inner = a[1]
        p.consume(name, gid, inner, w, 0)
    gid = p.new_group(int(out.shape[1]), name, [Use(w, 1), Use(b, 0)])
    if hasattr(p.owners.get(name), "nf"):
        p.groups.follow(name, "nf", gid)
    return {1: (gid, 1)}


def layer_norm(p: Context, n: fx.Node, out: Any) -> Ann:
    """``aten.layer_norm(x, shape, W, b)``: as ``nn.LayerNorm``."""
    a = p.annotation(n.args[0])
    shape = list(n.args[1])  # type: ignore[arg-type]
    w, b = _param(_arg(n, 2, "weight")), _param(_arg(n, 3, "bias"))
    rank = out.dim()
    inside = [d for d in a if d >= rank - len(shape)]
    if len(shape) == 1 and inside and w is not None:
        gid, inner = a[rank - 1]
        for t in (w, b):
            if t is not None:
                p.groups.use(gid, Use(t, 0, inner))
        p.groups.layer_norms[_owner(w)] = (gid, inner)
        return dict(a)
    for d in inside:
        p.groups.poison(a[d][0])
    return {d: v for d, v in a.items() if d < rank - len(shape)}


def embedding(p: Context, n: fx.Node, out: Any) -> Ann:
    w = _param(n.args[0])
    if w is None:
        p.poison_inputs(n)
        return {}
    gid = p.new_group(int(out.shape[-1]), _owner(w), [Use(w, 1)])
    p.groups.groups[gid].embedding = True
    return {out.dim() - 1: (gid, 1)}


def same(p: Context, n: fx.Node, out: Any) -> Ann:
    return dict(p.annotation(n.args[0]))


def binary(p: Context, n: fx.Node, out: Any) -> Ann:
    return p.binary(n, n.args[:2], out)


def reshape(p: Context, n: fx.Node, out: Any) -> Ann:
    x = n.args[0]
    return p.reshape(p.annotation(x), p.shape(x), tuple(out.shape))


def transpose(p: Context, n: fx.Node, out: Any) -> Ann:
    x = n.args[0]
    return p.transpose(p.annotation(x), int(n.args[1]), int(n.args[2]),  # type: ignore[arg-type]
                       len(p.shape(x)))


def permute(p: Context, n: fx.Node, out: Any) -> Ann:
    x = n.args[0]
    rank = len(p.shape(x))
    order = [int(d) % rank for d in n.args[1]]  # type: ignore[union-attr, arg-type]
    a = p.annotation(x)
    return {i: a[d] for i, d in enumerate(order) if d in a}


def unsqueeze(p: Context, n: fx.Node, out: Any) -> Ann:
    d0 = int(n.args[1]) % out.dim()  # type: ignore[arg-type]
    return {d + (d >= d0): v for d, v in p.annotation(n.args[0]).items()}


def expand(p: Context, n: fx.Node, out: Any) -> Ann:
    """Broadcast to more or larger size-1 dimensions: a cut dimension keeps its size."""
    x = n.args[0]
    shift = out.dim() - len(p.shape(x))
    return {d + shift: v for d, v in p.annotation(x).items()}


def slice_(p: Context, n: fx.Node, out: Any) -> Ann:
    x = n.args[0]
    a = p.annotation(x)
    rank = len(p.shape(x))
    d = int(_arg(n, 1, "dim", 0)) % rank
    if d in a and out.shape[d] != p.shape(x)[d]:
        raise ValueError("slicing a cut dimension")
    return dict(a)


def reduce(p: Context, n: fx.Node, out: Any) -> Ann:
    x = n.args[0]
    return p.reduce(p.annotation(x), len(p.shape(x)), _arg(n, 1, "dim"),
                    bool(_arg(n, 2, "keepdim", False)))


def split(p: Context, n: fx.Node, out: Any) -> Any:
    """``aten.split(x, size, dim)``: along a cut dimension into equal pieces, every piece holds
    the same units (q | k | v); elsewhere the groups pass on to every piece."""
    x = n.args[0]
    a = p.annotation(x)
    rank = len(p.shape(x))
    d = int(_arg(n, 2, "dim", 0)) % rank
    pieces = list(out)
    if d not in a:
        return [dict(a) for _ in pieces]
    gid, inner = a[d]
    if len({t.shape[d] for t in pieces}) != 1 or inner != 1 or len(x.users) > 1:  # type: ignore[union-attr]
        raise ValueError("a cut dimension split unevenly")
    s = p.groups.split(gid, len(pieces))
    for path in reversed(p.module_path(n)):  # GPT-2's attention splits by its split_size
        module = p.owners.get(path)
        if getattr(module, "split_size", None) == pieces[0].shape[d]:
            p.groups.follow(path, "split_size", s)
            break
    return [{**a, d: (s, 1)} for _ in pieces]


def cat(p: Context, n: fx.Node, out: Any) -> Ann:
    """Concatenation: the other dimensions of every operand are joined; the concatenated one is
    not cut."""
    xs = list(n.args[0])  # type: ignore[arg-type]
    d0 = int(_arg(n, 1, "dim", 0)) % out.dim()
    joined: Ann = {}
    for x in xs:
        for d, (gid, inner) in p.annotation(x).items():
            if d == d0:
                p.groups.poison(gid)
            elif d in joined:
                if joined[d][1] != inner:
                    raise ValueError("concatenation of different widths")
                joined[d] = (p.groups.join(joined[d][0], gid), inner)
            else:
                joined[d] = (gid, inner)
    for d, (gid, _) in list(joined.items()):
        if d != d0 and not all(d in p.annotation(x) for x in xs):
            p.groups.poison(gid)
    return {d: v for d, v in joined.items() if d != d0}


def _module_of(p: Context, n: fx.Node, i: int, name: str, kinds: tuple[type, ...]
               ) -> tuple[str, Any] | None:
    """The module that owns the parameter in argument ``i`` (``name``) of ``n``, when it is one
    of ``kinds``: the module rule is then the operator's rule."""
    w = _param(_arg(n, i, name))
    owner = _owner(w) if w is not None else None
    module = p.owners.get(owner) if owner is not None else None
    return (owner, module) if owner is not None and isinstance(module, kinds) else None


def convolution(p: Context, n: fx.Node, out: Any) -> Ann:
    """``aten.conv{1,2,3}d(x, W, b, ..., groups)``: as the ``nn.Conv*d`` that owns ``W``
    (:func:`~thinwire.models.graph.rules.conv`; grouped and depthwise ones included)."""
    found = _module_of(p, n, 1, "weight", (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d))
    if found is None or not isinstance(out, torch.Tensor):
        p.poison_inputs(n)
        return {}
    return rules.conv(p, n, found[1], found[0], out)


def channel_norm(p: Context, n: fx.Node, out: Any) -> Ann:
    """``aten.batch_norm(x, W, b, ...)``, ``aten.group_norm(x, groups, W, b, ...)`` and
    ``aten.instance_norm``: as the norm module that owns ``W``
    (:func:`~thinwire.models.graph.rules.channel_norm`); without an affine weight, not cut."""
    kinds = (torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm)
    index = 2 if n.target == aten.group_norm.default else 1
    found = _module_of(p, n, index, "weight", kinds)
    if found is None:
        p.poison_inputs(n)
        return {}
    return rules.channel_norm(p, n, found[1], found[0], out)


def nothing(p: Context, n: fx.Node, out: Any) -> Ann:
    return {}


def _register() -> None:
    register_function_rule(aten.linear.default, linear)
    register_function_rule(aten.addmm.default, addmm)
    register_function_rule(aten.layer_norm.default, layer_norm)
    register_function_rule(aten.embedding.default, embedding)
    for op in (aten.dropout.default, aten.gelu.default, aten.silu.default, aten.relu.default,
               aten.tanh.default, aten.sigmoid.default, aten.neg.default, aten.rsqrt.default,
               aten.pow.Tensor_Scalar, aten.contiguous.default, aten.alias.default,
               aten.clone.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
               aten.hardswish.default, aten.hardsigmoid.default, aten.exp.default):
        register_function_rule(op, same)
    for op in (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor,
               aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar):
        register_function_rule(op, binary)
    ADDITIVE.update({aten.add.Tensor, aten.sub.Tensor})
    for op in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        register_function_rule(op, reshape)
    register_function_rule(aten.transpose.int, transpose)
    register_function_rule(aten.permute.default, permute)
    register_function_rule(aten.unsqueeze.default, unsqueeze)
    register_function_rule(aten.expand.default, expand)
    register_function_rule(aten.slice.Tensor, slice_)
    register_function_rule(aten.mean.dim, reduce)
    register_function_rule(aten.sum.dim_IntList, reduce)
    register_function_rule(aten.split.Tensor, split)
    register_function_rule(aten.cat.default, cat)
    register_function_rule(aten.scaled_dot_product_attention.default,
                           lambda p, n, out: p.attend(n))
    register_function_rule(aten._assert_tensor_metadata.default, nothing)
    for op in (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
               aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding):
        register_function_rule(op, convolution)
    for op in (aten.batch_norm.default, aten.group_norm.default, aten.instance_norm.default):
        register_function_rule(op, channel_norm)
    for op in (aten.adaptive_avg_pool1d.default, aten.adaptive_avg_pool2d.default,
               aten.adaptive_avg_pool3d.default, aten.adaptive_max_pool1d.default,
               aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default,
               aten.avg_pool1d.default, aten.avg_pool2d.default, aten.avg_pool3d.default,
               aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default):
        register_function_rule(op, rules.pool_call)
    register_function_rule(aten.flatten.using_ints, rules.flatten_call)


_register()

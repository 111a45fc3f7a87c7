"""The rule table: how each module kind, function and tensor method moves channel groups
(step 2 of :mod:`thinwire.models.graph`).

A *module rule* is called for every call of a module of its kind in the traced graph as
``rule(p, node, module, name, out)``: ``p`` is the running :class:`~thinwire.models.graph.
propagate.Propagation` (``p.annotation(x)``: the groups of an input value per dimension,
``p.shape(x)``, ``p.new_group(width, name, uses)``, ``p.consume(...)``, ``p.poison_inputs(node)``,
``p.groups``: the union-find, whose ``follow`` names a module attribute a subnet sets to its
width), ``name`` the module's qualified name and ``out`` its output on the example; it returns
the output's annotation (``{dim: (group, elements per channel)}``; ``{}``: nothing cut flows
out). A kind is matched along the module class's MRO, by the class itself or by its
``"module.QualName"`` (so a rule for a class of an optional library, such as transformers'
``Conv1D``, needs no import of it). A module whose own class has a rule is one node of the
trace (its forward is not traced into: the rule says what it does); ``leaf=True`` extends that
to the subclasses that inherit the rule.

A user registers a rule for a module of their own with :func:`register_rule`::

    from thinwire.models.graph import Use, register_rule

    @register_rule(MyLinear)          # y = x @ weight.T, weight [out, in]
    def my_linear(p, node, m, name, out):
        a = p.annotation(node.args[0])
        last = out.dim() - 1
        if last in a:                 # the input's channels index the weight's columns
            p.consume(name, *a[last], f"{name}.weight", 1)
        return {last: (p.new_group(m.weight.shape[0], name, [Use(f"{name}.weight", 0)]), 1)}

Function rules (:func:`register_function_rule`, keyed by the callable) and method rules
(:func:`register_method_rule`, keyed by the method's name) take ``(p, node, out)``.

One concept, one file (over 400 lines): the rule table, every built-in rule beside the
registration a user extends it with.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import fx, nn

import thinwire.models.graph.attention as attention
from thinwire.models.graph.context import Context
from thinwire.models.graph.groups import Ann, Use

ModuleRuleFn = Callable[[Context, fx.Node, Any, str, Any], Any]
OpRuleFn = Callable[[Context, fx.Node, Any], Any]


@dataclass(frozen=True)
class ModuleRule:
    """One entry of the table: ``apply(p, node, module, name, out) -> annotation``; ``leaf``:
    the module is one node of the trace."""

    apply: ModuleRuleFn
    leaf: bool = False


_MODULE_RULES: dict[type | str, ModuleRule] = {}
_FUNCTION_RULES: dict[Any, OpRuleFn] = {}
_METHOD_RULES: dict[str, OpRuleFn] = {}


def _key(kind: type | str) -> type | str:
    if isinstance(kind, str):
        return kind
    if not (isinstance(kind, type) and issubclass(kind, nn.Module)) or kind is nn.Module:
        raise TypeError(f"register_rule takes an nn.Module subclass or its 'module.QualName', "
                        f"not {kind!r}")
    return kind


def register_rule(kind: type | str, apply: ModuleRuleFn | None = None, *, leaf: bool = False
                  ) -> Any:
    """Register ``apply`` as the rule of module kind ``kind`` (a class, or its
    ``"module.QualName"``), replacing any earlier rule of that kind; usable as a decorator.
    ``leaf``: keep the module one node of the trace (module docstring)."""
    key = _key(kind)

    def put(fn: ModuleRuleFn) -> ModuleRuleFn:
        _MODULE_RULES[key] = ModuleRule(fn, leaf)
        return fn

    return put if apply is None else put(apply)


def register_function_rule(fn: Any, apply: OpRuleFn) -> None:
    """Register ``apply(p, node, out)`` for calls of the function ``fn`` (``torch.relu``,
    ``operator.add``, ...)."""
    _FUNCTION_RULES[fn] = apply


def register_method_rule(name: str, apply: OpRuleFn) -> None:
    """Register ``apply(p, node, out)`` for calls of the tensor method ``name``."""
    _METHOD_RULES[name] = apply


def module_rule(m: nn.Module) -> ModuleRule | None:
    """The rule of ``m``'s kind: the first class of its MRO with one."""
    for cls in type(m).__mro__:
        rule = _MODULE_RULES.get(cls) or _MODULE_RULES.get(f"{cls.__module__}.{cls.__qualname__}")
        if rule is not None:
            return rule
    return None


def is_leaf(m: nn.Module) -> bool:
    """Whether the tracers keep ``m`` one node: its rule says so (``leaf=True``), or the rule
    was registered for ``m``'s own class (a user's rule for their module; a subclass that
    inherits a rule, such as a library's LayerNorm with its own forward, is traced into)."""
    rule = module_rule(m)
    if rule is None:
        return False
    cls = type(m)
    return rule.leaf or cls in _MODULE_RULES or f"{cls.__module__}.{cls.__qualname__}" in (
        _MODULE_RULES)


def function_rule(fn: Any) -> OpRuleFn | None:
    try:
        return _FUNCTION_RULES.get(fn)
    except TypeError:  # an unhashable target
        return None


def method_rule(name: str) -> OpRuleFn | None:
    return _METHOD_RULES.get(name)


# --- module rules -------------------------------------------------------------------------------
def _input(p: Context, n: fx.Node) -> tuple[Any, Ann]:
    x = n.args[0] if n.args else None
    return x, p.annotation(x)


def elementwise(p: Context, n: fx.Node, m: Any, name: str, out: Any) -> Ann:
    """Activations, dropout, identity: the groups pass on."""
    return dict(_input(p, n)[1])


def pool(p: Context, n: fx.Node, m: Any, name: str, out: Any) -> Ann:
    """Pooling keeps the channel dimension (1) and nothing else."""
    a = _input(p, n)[1]
    return {1: a[1]} if 1 in a else {}


def flatten(p: Context, n: fx.Node, m: nn.Flatten, name: str, out: Any) -> Ann:
    x, a = _input(p, n)
    return p.flatten(a, p.shape(x), m.start_dim, m.end_dim)


def _projection(p: Context, n: fx.Node, name: str, out: Any, size: int, rows: int,
                bias: bool) -> tuple[Ann, int]:
    """A Linear-like projection over the last dimension: the input's group indexes the weight's
    dimension ``1 - rows``, the ``size`` outputs are a new group over its dimension ``rows``
    (and the bias); (the annotation of the output, the new group)."""
    a = _input(p, n)[1]
    last = out.dim() - 1
    kept = {d: v for d, v in a.items() if d != last}
    if last in a:
        gid, inner = a[last]
        p.consume(name, gid, inner, f"{name}.weight", 1 - rows)
    uses = [Use(f"{name}.weight", rows)] + ([Use(f"{name}.bias", 0)] if bias else [])
    new = p.new_group(size, name, uses)
    kept[last] = (new, 1)
    return kept, new


def linear(p: Context, n: fx.Node, m: nn.Linear, name: str, out: Any) -> Ann:
    """Output features are a new group (weight rows, bias); the input's group indexes the
    weight's columns."""
    return _projection(p, n, name, out, m.out_features, 0, m.bias is not None)[0]


def conv1d_transposed(p: Context, n: fx.Node, m: Any, name: str, out: Any) -> Ann:
    """transformers' ``Conv1D`` (GPT-2's projections): a Linear whose weight is stored
    transposed, ``[in, out]``, and whose forward reshapes to ``nf`` outputs (a subnet sets
    ``nf`` to its width)."""
    kept, gid = _projection(p, n, name, out, int(m.weight.shape[1]), 1,
                            getattr(m, "bias", None) is not None)
    p.groups.follow(name, "nf", gid)
    return kept


def conv(p: Context, n: fx.Node, m: nn.Conv1d, name: str, out: Any) -> Ann:
    """Output channels are a new group (filters, bias), the input's channels index the filters'
    input channels. A grouped convolution (``groups`` > 1) is cut by :func:`grouped_conv`."""
    a = _input(p, n)[1]
    for d in a:
        if d != 1:
            p.groups.poison(a[d][0])
    uses = [Use(f"{name}.weight", 0)] + ([Use(f"{name}.bias", 0)] if m.bias is not None else [])
    if m.groups == 1:
        if 1 in a:
            p.consume(name, a[1][0], a[1][1], f"{name}.weight", 1)
        return {1: (p.new_group(m.out_channels, name, uses), 1)}
    return grouped_conv(p, m, name, a)


def grouped_conv(p: Context, m: Any, name: str, a: Ann) -> Ann:
    """A grouped convolution (ResNeXt's cardinality, RegNet's group width; Xie et al., CVPR
    2017, "Aggregated Residual Transformations"; Howard et al., 2017, MobileNets, the depthwise
    case ``groups`` = in channels):

    1. A unit is whole convolution groups: a group's ``in / groups`` input channels and its
       ``out / groups`` filters. The input's channel group is the unit group (its unit spans a
       multiple of ``in / groups`` channels), and the output carries the same group with
       ``out / in`` times the elements per channel: the layers before and after follow it.
    2. The filters' rows (and the bias) of a held group travel; their ``in / groups`` columns
       are the group's own and are never cut.
    3. A subnet sets ``groups``, ``in_channels`` and ``out_channels`` to the groups it holds,
       with the same channels per group. A depthwise convolution (one channel per group) keeps
       its input's channels: ``groups`` follows the held width.

    An input whose channels are not cut (the model's input, a stream kept whole) leaves the
    convolution whole: its output group is not cut either."""
    uses = [Use(f"{name}.weight", 0)] + ([Use(f"{name}.bias", 0)] if m.bias is not None else [])
    if 1 not in a:
        gid = p.new_group(m.out_channels, name, uses)
        p.groups.poison(gid)
        return {1: (gid, 1)}
    gid, inner = a[1]
    per_in = Fraction(m.in_channels // m.groups)   # input elements of one convolution group
    ratio = Fraction(m.out_channels, m.in_channels)
    span = per_in / Fraction(inner)               # channels of the group per convolution group
    root = p.groups.find(gid)
    g = p.groups.groups[root]
    g.base = math.lcm(g.base, span.numerator)     # a unit: whole convolution groups
    widened = Fraction(inner) * ratio
    out_inner = int(widened) if widened.denominator == 1 else widened
    for u in uses:
        p.groups.use(gid, Use(u.tensor, 0, out_inner))
    p.groups.follow(name, "groups", gid, Fraction(1) / span)
    p.groups.follow(name, "in_channels", gid, Fraction(inner))
    p.groups.follow(name, "out_channels", gid, Fraction(out_inner))
    return {1: (gid, out_inner)}


def channel_norm(p: Context, n: fx.Node, m: Any, name: str, out: Any) -> Ann:
    """BatchNorm, InstanceNorm and GroupNorm over dimension 1: their affine parameters and
    running statistics are indexed by its group (GroupNorm: one norm group per unit)."""
    a = _input(p, n)[1]
    for d in a:
        if d != 1:
            p.groups.poison(a[d][0])
    if 1 not in a:
        return {}
    gid, inner = a[1]
    for t in [q for q, _ in m.named_parameters(recurse=False)] + [
            b for b, v in m.named_buffers(recurse=False) if v.dim() == 1]:
        p.groups.use(gid, Use(f"{name}.{t}", 0, inner))
    if isinstance(m, nn.GroupNorm):
        span = Fraction(m.num_channels // m.num_groups) / Fraction(inner)  # channels a group
        root = p.groups.find(gid)
        p.groups.groups[root].base = math.lcm(p.groups.groups[root].base, span.numerator)
        p.groups.group_norms[name] = (gid, inner)
    else:
        p.groups.batch_norms[name] = (gid, inner)
    return {1: (gid, inner)}


def layer_norm(p: Context, n: fx.Node, m: Any, name: str, out: Any) -> Ann:
    """LayerNorm and RMSNorm over the last dimension: their affine parameters are indexed by
    its group and a subnet sets ``normalized_shape`` to its width; over more dimensions, the
    groups inside are not cut."""
    a = _input(p, n)[1]
    k = len(m.normalized_shape)
    rank = out.dim()
    inside = [d for d in a if d >= rank - k]
    if k == 1 and inside and m.elementwise_affine is not None:
        gid, inner = a[rank - 1]
        for t, _ in m.named_parameters(recurse=False):
            p.groups.use(gid, Use(f"{name}.{t}", 0, inner))
        p.groups.layer_norms[name] = (gid, inner)
        return dict(a)
    for d in inside:
        p.groups.poison(a[d][0])
    return {d: v for d, v in a.items() if d < rank - k}


def embedding(p: Context, n: fx.Node, m: nn.Embedding, name: str, out: Any) -> Ann:
    """The embedding dims are a group (the table's columns), marked as an embedding's."""
    gid = p.new_group(m.embedding_dim, name, [Use(f"{name}.weight", 1)])
    p.groups.groups[gid].embedding = True
    return {out.dim() - 1: (gid, 1)}


def multihead_attention(p: Context, n: fx.Node, m: nn.MultiheadAttention, name: str,
                        out: Any) -> Any:
    return attention._attention(p, n, name, m)


def transformer(p: Context, n: fx.Node, m: nn.Module, name: str, out: Any) -> Any:
    return attention._transformer(p, n, name, m)


def fused_qkv_attention(p: Context, n: fx.Node, m: Any, name: str, out: Any) -> Ann:
    """timm's ``Attention`` (ViT, DeiT...): one ``qkv`` Linear whose rows are all heads' q,
    then k, then v (3 segments of ``head_dim`` per head), heads joined into ``proj``. Heads are
    the units; a subnet sets ``num_heads`` and ``attn_dim``. With a gate or a norm over the
    heads' output, nothing inside is cut."""
    a = _input(p, n)[1]
    rank = out.dim()
    last = rank - 1
    plain = (getattr(m, "gate", None) is None and isinstance(getattr(m, "norm", None),
                                                             nn.Identity)
             and isinstance(getattr(m, "q_norm", None), nn.Identity) and len(n.args) == 1
             and n.kwargs.get("attn_mask") is None)
    for d, (gid, _) in a.items():
        if d != last or not plain:
            p.groups.poison(gid)
    if last in a:
        gid, inner = a[last]
        p.consume(f"{name}.qkv", gid, inner, f"{name}.qkv.weight", 1)
    proj = [Use(f"{name}.proj.weight", 0)] + (
        [Use(f"{name}.proj.bias", 0)] if m.proj.bias is not None else [])
    out_gid = p.new_group(m.proj.out_features, f"{name}.proj", proj)
    if not plain:
        p.poison_inputs(n)
        return {last: (out_gid, 1)}
    hd = int(m.head_dim)
    uses = [Use(f"{name}.qkv.weight", 0, hd, 3), Use(f"{name}.proj.weight", 1, hd)]
    if m.qkv.bias is not None:
        uses.append(Use(f"{name}.qkv.bias", 0, hd, 3))
    heads = p.new_group(int(m.num_heads), f"{name}.heads", uses)
    p.groups.scaled.append((f"{name}.proj", heads))
    p.groups.follow(name, "num_heads", heads)
    p.groups.follow(name, "attn_dim", heads, hd)
    return {last: (out_gid, 1)}


ELEMENTWISE_FUNCS: tuple[Any, ...] = (
    F.relu, F.relu6, F.gelu, F.silu, F.elu, F.leaky_relu, F.hardswish, F.mish, F.softplus,
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, torch.relu, torch.sigmoid, torch.tanh,
    F.sigmoid, F.tanh, F.hardtanh, operator.neg, torch.neg, torch.exp, torch.abs)
"""Functions that keep every dimension's groups."""


def is_elementwise(m: nn.Module) -> bool:
    """Whether ``m``'s rule passes its input's groups on unchanged (an activation, dropout)."""
    rule = module_rule(m)
    return rule is not None and rule.apply is elementwise


# --- rules of functions and tensor methods --------------------------------------------------------
def _same(p: Context, n: fx.Node, out: Any) -> Ann:
    return dict(p.annotation(n.args[0]))


def _binary(p: Context, n: fx.Node, out: Any) -> Ann:
    return p.binary(n, n.args[:2], out)


def pool_call(p: Context, n: fx.Node, out: Any) -> Ann:
    """A pooling function (or aten operator): the channel dimension (1) passes on."""
    a = p.annotation(n.args[0])
    return {1: a[1]} if 1 in a else {}


def flatten_call(p: Context, n: fx.Node, out: Any) -> Ann:
    """``torch.flatten(x, start, end)`` (and ``aten.flatten.using_ints``)."""
    x = n.args[0]
    start = n.args[1] if len(n.args) > 1 else n.kwargs.get("start_dim", 0)
    end = n.args[2] if len(n.args) > 2 else n.kwargs.get("end_dim", -1)
    return p.flatten(p.annotation(x), p.shape(x), int(cast(int, start)), int(cast(int, end)))


def _transpose_call(p: Context, n: fx.Node, out: Any) -> Ann:
    x = n.args[0]
    return p.transpose(p.annotation(x), int(cast(int, n.args[1])), int(cast(int, n.args[2])),
                       len(p.shape(x)))


def _nothing(p: Context, n: fx.Node, out: Any) -> Ann:
    return {}


def _reshape_call(p: Context, n: fx.Node, out: Any) -> Ann:
    if not isinstance(out, torch.Tensor):
        p.poison_inputs(n)
        return {}
    x = n.args[0]
    return p.reshape(p.annotation(x), p.shape(x), tuple(out.shape))


def _reduce_call(p: Context, n: fx.Node, out: Any) -> Ann:
    if not isinstance(out, torch.Tensor):
        p.poison_inputs(n)
        return {}
    x = n.args[0]
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    keep = bool(n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False))
    return p.reduce(p.annotation(x), len(p.shape(x)), dims, keep)


def _permute_call(p: Context, n: fx.Node, out: Any) -> Ann:
    x = n.args[0]
    rank = len(p.shape(x))
    dims = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)) else \
        n.args[1:]
    order = [int(cast(int, d)) % rank for d in cast(Any, dims)]
    a = p.annotation(x)
    return {i: a[d] for i, d in enumerate(order) if d in a}


def _register_modules() -> None:
    """The built-in module rules (the table a user extends with :func:`register_rule`)."""
    kind: type
    for kind in (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU,
                 nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Mish, nn.Softplus, nn.Identity,
                 nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout):
        register_rule(kind, elementwise)
    for kind in (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
                 nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.AvgPool1d,
                 nn.AvgPool2d, nn.AvgPool3d, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d):
        register_rule(kind, pool)
    register_rule(nn.Flatten, flatten)
    register_rule(nn.Linear, linear)
    register_rule("transformers.pytorch_utils.Conv1D", conv1d_transposed)
    for kind in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
        register_rule(kind, conv)
    for kind in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm1d,
                 nn.InstanceNorm2d, nn.InstanceNorm3d, nn.GroupNorm):
        register_rule(kind, channel_norm)
    register_rule(nn.LayerNorm, layer_norm)
    register_rule(nn.RMSNorm, layer_norm)
    register_rule(nn.Embedding, embedding)
    register_rule(nn.MultiheadAttention, multihead_attention, leaf=True)
    for kind in (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.TransformerEncoder,
                 nn.TransformerDecoder, nn.Transformer):
        register_rule(kind, transformer, leaf=True)
    register_rule("timm.layers.attention.Attention", fused_qkv_attention, leaf=True)


def _register_calls() -> None:
    """The built-in rules of functions and tensor methods (:func:`register_function_rule`,
    :func:`register_method_rule`)."""
    for fn in ELEMENTWISE_FUNCS:
        register_function_rule(fn, _same)
    for fn in (operator.add, operator.iadd, operator.sub, operator.isub, operator.mul,
               operator.imul, operator.truediv, operator.itruediv, torch.add, torch.sub,
               torch.mul, torch.div):
        register_function_rule(fn, _binary)
    for fn in (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
               F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d,
               F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.max_pool1d, F.max_pool2d,
               F.max_pool3d):
        register_function_rule(fn, pool_call)
    register_function_rule(torch.flatten, flatten_call)
    register_function_rule(operator.getitem, lambda p, n, out: p.getitem(n, out))
    register_function_rule(F.scaled_dot_product_attention, lambda p, n, out: p.attend(n))
    register_function_rule(torch.transpose, _transpose_call)
    register_function_rule(torch.permute, _permute_call)
    register_function_rule(getattr, _nothing)
    for name in ("size", "dim", "numel"):
        register_method_rule(name, _nothing)
    for name in ("relu", "sigmoid", "tanh", "contiguous", "clone", "float", "double", "half",
                 "bfloat16", "to", "type_as", "neg", "exp", "abs", "detach", "relu_",
                 "sigmoid_", "tanh_"):
        register_method_rule(name, _same)
    for name in ("add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_"):
        register_method_rule(name, _binary)
    register_method_rule("permute", _permute_call)
    register_method_rule("flatten", flatten_call)
    register_method_rule("transpose", _transpose_call)
    for name in ("view", "reshape"):
        register_method_rule(name, _reshape_call)
    for name in ("mean", "sum", "amax", "amin"):
        register_method_rule(name, _reduce_call)


_register_modules()
_register_calls()

ADDITIVE = {operator.add, operator.iadd, operator.sub, operator.isub, torch.add, torch.sub,
            "add", "add_", "sub", "sub_"}
"""Targets whose operands are joined as a residual stream."""

"""IST adapters derived from a model's graph: :func:`derive_adapter`.

A hand-written :class:`~thinwire.models.adapter.ISTAdapter` says which units a model has and
which tensor elements each unit indexes. For a model built from stock torch modules the same
plan follows from the model's dataflow, and :func:`derive_adapter` finds it from one example
input (the user's real batch; no shape is ever guessed):

1. **Trace.** ``torch.fx`` records the forward as a graph (symbolic tracing; where the forward
   branches on a shape, such as ``if x.dim() != 4``, fx's meta tracer, whose proxies carry the
   example's shapes). torch.fx and not ``torch.export``: fx keeps a call of a torch module as one node naming the
   module (``nn.MultiheadAttention``, a whole ``nn.TransformerEncoderLayer``), where export
   decomposes them into aten operators and the plan would have to be recovered from those; fx
   traces in milliseconds and needs no compilation stack. A forward whose control flow depends
   on tensor *values* cannot be traced: the error names the innermost module being traced and
   the two fixes (``shared=(name,)``, or an adapter).
2. **Propagate channels.** The graph runs once on a copy of the model with the example input
   (the model itself and its BatchNorm statistics stay untouched). Every value carries, per
   dimension, the *channel group* whose units index it. A layer creates a group for its outputs
   (``Linear`` out features, ``ConvNd`` out channels, ``Embedding`` dims, attention heads,
   FFN neurons) and records the tensors it indexes with it (rows of its weight and its bias);
   a layer fed by a group records its input dimension (the weight's columns / input channels).
   Elementwise operations, pooling, dropout, ``flatten`` (with the elements per channel it
   merges), ``transpose``/``permute`` and reductions over other dimensions pass a group on;
   norms that follow (``BatchNorm*``, ``InstanceNorm*``, ``GroupNorm`` in whole groups,
   ``LayerNorm`` over one dimension) index their parameters and running statistics with it.
3. **Join and poison.** Both sides of an addition or multiplication hold the same channels, so
   their groups are joined into one (a residual stream; with ``residual="whole"``, the default,
   a group joined by an addition is poisoned: the stream stays whole and only the units inside
   its branches are cut; ``residual="channels"`` cuts the stream too). A group that
   reaches the model's output, or an operation the rules do not know (concatenation, a
   ``matmul`` between activations, a functional call of a parameter, a module marked
   ``shared``), is *poisoned*: it is not cut, and every tensor it indexes is shared by all
   subnets and averaged. With ``embeddings="shared"`` (the default, as the GPT's hand adapter)
   the groups of embedding outputs are poisoned too, so a transformer's ``d_model`` stays whole.
4. **Units.** A surviving group of width W whose unit must span ``base`` channels (a GroupNorm
   of G groups over C channels: ``base`` = C / G; attention heads: ``head_dim`` elements) has
   W / base units; a group with fewer than ``min_units`` units is shared. Each recorded use
   becomes a :class:`~thinwire.models.adapter.Cut` (``per_unit`` = base x elements per channel,
   ``segments`` = 3 for a packed q|k|v projection).
5. **Residual blocks** (``residual="blocks"``, ResIST): a submodule whose output is the sum of
   its input and a branch (an identity shortcut) is a unit of the ``dealt`` group named after
   its parent (consecutive blocks of a stage); a subnet skips the blocks it does not hold (their
   forward is the identity for the round), every tensor of a block travels whole with it, and
   everything else is shared.

The adapter's model-side part (:class:`GraphAdapter`): ``configure`` sets a cut LayerNorm's
``normalized_shape`` and a GroupNorm's ``num_groups`` to the units held, replaces the forward of
every ``nn.MultiheadAttention`` whose heads are cut by :func:`attention_forward` for the round
(``MultiheadAttention`` hands ``in_proj_weight`` and ``out_proj.weight`` to a functional call
that derives the head width from ``embed_dim // num_heads``, so it cannot run on cut tensors),
and disables unheld residual blocks. Inverted-dropout scaling (``scale="dropout"``) multiplies
the input of every layer fed by a cut group by (units / held); for a cut attention the factor
acts on the heads' output before ``out_proj``, inside :func:`attention_forward`.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import operator
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.experimental import meta_tracer

from thinwire.errors import UsageError
from thinwire.models.adapter import Cut, ISTAdapter, ISTPlan, TensorPlan, UnitGroup

RESIDUAL_MODES = ("whole", "channels", "blocks")
EMBEDDING_MODES = ("shared", "cut")

_ELEMENTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU,
                        nn.ELU, nn.Hardswish, nn.Hardtanh, nn.Mish, nn.Softplus, nn.Identity,
                        nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)
_POOL_MODULES = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
                 nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
                 nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.MaxPool1d, nn.MaxPool2d,
                 nn.MaxPool3d)
_CHANNEL_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm1d,
                  nn.InstanceNorm2d, nn.InstanceNorm3d)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_TRANSFORMER = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.TransformerEncoder,
                nn.TransformerDecoder, nn.Transformer)
_LEAVES = (nn.MultiheadAttention, *_TRANSFORMER)

_ELEMENTWISE_FUNCS: set[Any] = {
    F.relu, F.relu6, F.gelu, F.silu, F.elu, F.leaky_relu, F.hardswish, F.mish, F.softplus,
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, torch.relu, torch.sigmoid, torch.tanh,
    F.sigmoid, F.tanh, torch.nn.functional.hardtanh, operator.neg, torch.neg, torch.exp,
    torch.abs}
_ELEMENTWISE_METHODS = {"relu", "sigmoid", "tanh", "contiguous", "clone", "float", "double",
                        "half", "bfloat16", "to", "type_as", "neg", "exp", "abs", "detach",
                        "relu_", "sigmoid_", "tanh_"}
_BINARY = {operator.add, operator.iadd, operator.sub, operator.isub, operator.mul,
           operator.imul, operator.truediv, operator.itruediv, torch.add, torch.sub, torch.mul,
           torch.div}
_ADDITIVE = {operator.add, operator.iadd, operator.sub, operator.isub, torch.add, torch.sub,
             "add", "add_", "sub", "sub_"}
_BINARY_METHODS = {"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_"}
_POOL_FUNCS = {F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
               F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d,
               F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.max_pool1d, F.max_pool2d,
               F.max_pool3d}
_REDUCE = {"mean", "sum", "amax", "amin"}
_META = {"size", "dim", "numel"}


# --- union-find of channel groups ---------------------------------------------------------------
@dataclass
class _Group:
    width: int
    origin: str
    base: int = 1
    poisoned: bool = False
    embedding: bool = False
    stream: bool = False     # joined by an addition: a residual stream


@dataclass(frozen=True)
class _Use:
    """Dimension ``dim`` of parameter/buffer ``tensor`` holds ``inner`` elements per channel of
    a group (``segments`` repeated blocks)."""

    tensor: str
    dim: int
    inner: Fraction | int = 1
    segments: int = 1


Ann = dict[int, tuple[int, Any]]
"""Per dimension of a value: (group id, elements per channel along it: an int, or a Fraction
where a unit of several channels spans one element, as a head after a split)."""


@dataclass
class _Graph:
    groups: list[_Group] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    uses: dict[int, list[_Use]] = field(default_factory=dict)
    scaled: list[tuple[str, int]] = field(default_factory=list)
    layer_norms: dict[str, int] = field(default_factory=dict)
    group_norms: dict[str, int] = field(default_factory=dict)
    batch_norms: dict[str, int] = field(default_factory=dict)
    attentions: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (heads, hd)

    def new(self, width: int, origin: str) -> int:
        self.groups.append(_Group(width, origin))
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def find(self, g: int) -> int:
        while self.parent[g] != g:
            self.parent[g] = self.parent[self.parent[g]]
            g = self.parent[g]
        return g

    def join(self, a: int, b: int, stream: bool = False) -> int:
        """One group for ``a`` and ``b``; ``stream``: they are the two sides of an addition
        (a residual stream, kept whole with ``residual="whole"``)."""
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return ra
        ga, gb = self.groups[ra], self.groups[rb]
        if ga.width != gb.width:  # not the same channels after all: neither can be cut
            self.poison(ra)
            self.poison(rb)
            return ra
        keep, gone = (ra, rb) if ra < rb else (rb, ra)
        self.parent[gone] = keep
        g, o = self.groups[keep], self.groups[gone]
        g.base = math.lcm(g.base, o.base)
        g.poisoned = g.poisoned or o.poisoned
        g.embedding = g.embedding or o.embedding
        g.stream = g.stream or o.stream or stream
        self.uses.setdefault(keep, []).extend(self.uses.pop(gone, []))
        return keep

    def poison(self, g: int) -> None:
        self.groups[self.find(g)].poisoned = True

    def use(self, g: int, u: _Use) -> None:
        self.uses.setdefault(self.find(g), []).append(u)


def _poison_ann(graph: _Graph, ann: Any) -> None:
    if isinstance(ann, dict):
        for g, _ in ann.values():
            graph.poison(g)
    elif isinstance(ann, (list, tuple)):
        for a in ann:
            _poison_ann(graph, a)


# --- tracing ------------------------------------------------------------------------------------
class _Leaves:
    """Tracing policy shared by both tracers: torch's attention and transformer modules (and
    the modules marked shared) are kept whole; the module being traced when tracing fails is
    kept for the error message."""

    shared: set[str]
    failed_at: str | None

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname in self.shared or isinstance(m, _LEAVES):
            return True
        return super().is_leaf_module(m, qualname)  # type: ignore[misc]

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)  # type: ignore[misc]
        except Exception:
            if self.failed_at is None:
                self.failed_at = self.path_of_module(m)  # type: ignore[attr-defined]
            raise


class _SymbolicTracer(_Leaves, fx.Tracer):
    def __init__(self, shared: Sequence[str]) -> None:
        super().__init__()
        self.shared, self.failed_at = set(shared), None
        self.proxy_buffer_attributes = True  # a buffer sliced by a shape stays in the graph


class _MetaTracer(_Leaves, meta_tracer.MetaTracer):
    def __init__(self, shared: Sequence[str]) -> None:
        super().__init__()
        self.shared, self.failed_at = set(shared), None


def _example_args(example_input: Any) -> tuple[Any, ...]:
    return tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)


def _trace(model: nn.Module, args: tuple[Any, ...], shared: Sequence[str]) -> fx.GraphModule:
    """Symbolic tracing first (no values needed); where the forward branches on a shape
    (``if x.dim() != 4``), the meta tracer, whose proxies carry the example's shapes."""
    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(args) > len(params):
        raise UsageError(f"IST example_input has {len(args)} values, {type(model).__name__}"
                         f".forward takes {len(params)}; pass one value per forward argument")
    concrete = {p.name: a for p, a in zip(params, args) if not isinstance(a, torch.Tensor)}
    concrete.update({p.name: p.default for p in params[len(args):]})
    symbolic = _SymbolicTracer(shared)
    try:
        graph = symbolic.trace(model, concrete_args=concrete or None)
        return fx.GraphModule(symbolic.root, graph)
    except Exception as e:  # noqa: BLE001 - retried with shapes, then one line
        first = e
    # the meta tracer's values are the example itself, on its own device, so that a device
    # read in the forward (torch.arange(..., device=x.device)) records the real one
    meta_args = {p.name: a for p, a in zip(params, args) if isinstance(a, torch.Tensor)}
    meta = _MetaTracer(shared)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            graph = meta.trace(model, meta_args=meta_args, concrete_args=concrete or None)
        return fx.GraphModule(meta.root, graph)
    except Exception:  # noqa: BLE001 - any tracing failure is the same one-line error
        pass
    where = meta.failed_at or symbolic.failed_at or ""
    mod = dict(model.named_modules()).get(where, model)
    name = f"{where} ({type(mod).__name__})" if where else type(model).__name__
    text = str(first).strip()
    reason = text.splitlines()[0][:120] if text else type(first).__name__
    hatch = f"shared=({where!r},) to keep it whole" if where else "shared=(NAME,) for it"
    raise UsageError(f"IST cannot trace {name} of {type(model).__name__} ({reason}); pass "
                     f"{hatch}, or an adapter (docs/IST.md, 'Writing an adapter')")


# --- propagation --------------------------------------------------------------------------------
def _align(ann: Ann, shape: Sequence[int], out_rank: int) -> Ann:
    """An operand's annotation in the broadcast output's dimensions (right-aligned)."""
    shift = out_rank - len(shape)
    return {d + shift: v for d, v in ann.items() if shape[d] != 1}


class _Propagate(fx.Interpreter):
    """Step 2-3 of the module docstring: runs the graph and annotates every value."""

    def __init__(self, gm: fx.GraphModule, graph: _Graph, embeddings: str,
                 shared: Sequence[str]) -> None:
        super().__init__(gm)
        self.g = graph
        self.embeddings = embeddings
        self.shared = set(shared)
        self.ann: dict[fx.Node, Any] = {}
        self.shapes: dict[fx.Node, tuple[int, ...]] = {}
        self.modules = dict(gm.named_modules())

    # annotations of arguments -------------------------------------------------------------
    def _a(self, x: Any) -> Any:
        return self.ann.get(x, {}) if isinstance(x, fx.Node) else {}

    def _poison_args(self, n: fx.Node) -> None:
        for x in n.all_input_nodes:
            _poison_ann(self.g, self.ann.get(x))

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.shapes[n] = tuple(out.shape)
        try:
            self.ann[n] = self._annotate(n, out)
        except Exception:  # an operation whose shapes the rules do not follow: not cut
            self._poison_args(n)
            self.ann[n] = {}
        return out

    def _annotate(self, n: fx.Node, out: Any) -> Any:
        if n.op == "placeholder":
            return {}
        if n.op == "get_attr":
            return {}
        if n.op == "output":
            _poison_ann(self.g, [self._a(x) for x in n.all_input_nodes])
            return {}
        if n.op == "call_module":
            return self._module(n, self.modules[str(n.target)], out)
        if n.op == "call_function":
            return self._function(n, n.target, out)
        if n.op == "call_method":
            return self._method(n, str(n.target), out)
        self._poison_args(n)
        return {}

    # modules ------------------------------------------------------------------------------
    def _new(self, width: int, name: str, uses: Sequence[_Use]) -> int:
        gid = self.g.new(width, name)
        for u in uses:
            self.g.use(gid, u)
        return gid

    def _consume(self, name: str, gid: int, inner: int, tensor: str, dim: int,
                 scaled: bool = True) -> None:
        self.g.use(gid, _Use(tensor, dim, inner))
        if scaled:
            self.g.scaled.append((name, gid))

    def _module(self, n: fx.Node, m: nn.Module, out: Any) -> Any:
        name = str(n.target)
        x = n.args[0] if n.args else None
        a = self._a(x)
        if name in self.shared:
            self._poison_args(n)
            return {}
        if isinstance(m, _ELEMENTWISE_MODULES):
            return dict(a)
        if isinstance(m, nn.Flatten):
            return self._flatten(a, self.env_shape(x), m.start_dim, m.end_dim)
        if isinstance(m, _POOL_MODULES):
            return self._keep_channels(a)
        if isinstance(m, nn.Linear):
            last = out.dim() - 1
            kept = {d: v for d, v in a.items() if d != last}
            if last in a:
                gid, inner = a[last]
                self._consume(name, gid, inner, f"{name}.weight", 1)
            uses = [_Use(f"{name}.weight", 0)]
            if m.bias is not None:
                uses.append(_Use(f"{name}.bias", 0))
            kept[last] = (self._new(m.out_features, name, uses), 1)
            return kept
        if isinstance(m, _CONVS):
            for d in a:
                if d != 1:
                    self.g.poison(a[d][0])
            uses = [_Use(f"{name}.weight", 0)] + ([_Use(f"{name}.bias", 0)]
                                                  if m.bias is not None else [])
            if m.groups == 1:
                if 1 in a:
                    self._consume(name, a[1][0], a[1][1], f"{name}.weight", 1)
                return {1: (self._new(m.out_channels, name, uses), 1)}
            if m.groups == m.in_channels == m.out_channels and 1 in a:  # depthwise
                gid, inner = a[1]
                for u in uses:
                    self.g.use(gid, u)
                return {1: (gid, inner)}
            if 1 in a:
                self.g.poison(a[1][0])
            gid = self._new(m.out_channels, name, uses)
            self.g.poison(gid)
            return {1: (gid, 1)}
        if isinstance(m, (*_CHANNEL_NORMS, nn.GroupNorm)):
            for d in a:
                if d != 1:
                    self.g.poison(a[d][0])
            if 1 not in a:
                return {}
            gid, inner = a[1]
            for t in [p for p, _ in m.named_parameters(recurse=False)] + [
                    b for b, v in m.named_buffers(recurse=False) if v.dim() == 1]:
                self.g.use(gid, _Use(f"{name}.{t}", 0, inner))
            if isinstance(m, nn.GroupNorm):
                per = m.num_channels // m.num_groups
                root = self.g.find(gid)
                self.g.groups[root].base = math.lcm(self.g.groups[root].base, per)
                self.g.group_norms[name] = gid
            else:
                self.g.batch_norms[name] = gid
            return {1: (gid, inner)}
        if isinstance(m, nn.LayerNorm):
            k = len(m.normalized_shape)
            rank = out.dim()
            inside = [d for d in a if d >= rank - k]
            if k == 1 and inside and m.elementwise_affine is not None:
                gid, inner = a[rank - 1]
                for t, _ in m.named_parameters(recurse=False):
                    self.g.use(gid, _Use(f"{name}.{t}", 0, inner))
                self.g.layer_norms[name] = gid
                return dict(a)
            for d in inside:
                self.g.poison(a[d][0])
            return {d: v for d, v in a.items() if d < rank - k}
        if isinstance(m, nn.Embedding):
            gid = self._new(m.embedding_dim, name, [_Use(f"{name}.weight", 1)])
            self.g.groups[gid].embedding = True
            return {out.dim() - 1: (gid, 1)}
        if isinstance(m, nn.MultiheadAttention):
            return self._attention(n, name, m)
        if isinstance(m, _TRANSFORMER):
            return self._transformer(n, name, m)
        self._poison_args(n)  # a module the rules do not know: what it touches is not cut
        return {}

    def env_shape(self, x: Any) -> tuple[int, ...]:
        v = self.env[x]
        return tuple(v.shape)

    @staticmethod
    def _keep_channels(a: Ann) -> Ann:
        return {1: a[1]} if 1 in a else {}

    def _flatten(self, a: Ann, shape: Sequence[int], start: int, end: int) -> Ann:
        rank = len(shape)
        start, end = start % rank, end % rank
        out: Ann = {}
        for d, (gid, inner) in a.items():
            if d < start:
                out[d] = (gid, inner)
            elif d > end:
                out[d - (end - start)] = (gid, inner)
            elif all(shape[k] == 1 for k in range(start, d)):
                out[start] = (gid, inner * int(np.prod(shape[d + 1:end + 1], dtype=np.int64)))
            else:
                self.g.poison(gid)
        return out

    # attention and transformer layers -------------------------------------------------------
    def _attention_groups(self, name: str, m: nn.MultiheadAttention, a_in: Ann,
                          rank: int) -> int | None:
        """The heads group of ``m`` (None when it is not cut) and the uses of its input."""
        cuttable = (m._qkv_same_embed_dim and m.bias_k is None and not m.add_zero_attn
                    and m.in_proj_weight is not None)
        last = rank - 1
        if last in a_in:
            gid, inner = a_in[last]
            self._consume(name, gid, inner, f"{name}.in_proj_weight", 1)
            if not cuttable:
                self.g.poison(gid)
        if not cuttable:
            return None
        hd = m.head_dim
        uses = [_Use(f"{name}.in_proj_weight", 0, hd, 3), _Use(f"{name}.out_proj.weight", 1, hd)]
        if m.in_proj_bias is not None:
            uses.append(_Use(f"{name}.in_proj_bias", 0, hd, 3))
        heads = self._new(m.num_heads, f"{name}.heads", uses)
        self.g.scaled.append((f"{name}.out_proj", heads))
        self.g.attentions[name] = (heads, hd)
        return heads

    def _attention_out(self, name: str, m: nn.MultiheadAttention, rank: int) -> Ann:
        uses = [_Use(f"{name}.out_proj.weight", 0)]
        if m.out_proj.bias is not None:
            uses.append(_Use(f"{name}.out_proj.bias", 0))
        return {rank - 1: (self._new(m.embed_dim, f"{name}.out_proj", uses), 1)}

    def _attention(self, n: fx.Node, name: str, m: nn.MultiheadAttention) -> Any:
        q, k, v = (n.args + (None, None, None))[:3]
        k = k if k is not None else n.kwargs.get("key")
        v = v if v is not None else n.kwargs.get("value")
        rank = len(self.env_shape(q))
        anns = [self._a(x) for x in (q, k, v)]
        last = rank - 1
        joined: Ann = {}
        for a in anns:
            for d, val in a.items():
                if d != last:
                    self.g.poison(val[0])
                elif last in joined:
                    joined[last] = (self.g.join(joined[last][0], val[0]), val[1])
                else:
                    joined[last] = val
        if last in joined and not all(last in a for a in anns):
            self.g.poison(joined[last][0])
        self._attention_groups(name, m, joined, rank)
        return [self._attention_out(name, m, rank), {}]

    def _layer(self, name: str, m: nn.Module, d_ann: Ann, rank: int,
               memory: Ann | None) -> Ann:
        """One encoder/decoder layer: heads and FFN neurons; d_model in and out the same."""
        last = rank - 1
        attn = [("self_attn", d_ann)]
        if isinstance(m, nn.TransformerDecoderLayer):
            cross = dict(d_ann)
            if memory is not None and last in memory:
                cross = ({last: (self.g.join(d_ann[last][0], memory[last][0]), 1)}
                         if last in d_ann else {})
                if last not in d_ann:
                    self.g.poison(memory[last][0])
            elif last in d_ann:
                self.g.poison(d_ann[last][0])
            attn.append(("multihead_attn", cross))
        stream = dict(d_ann)
        for sub, a in attn:
            mha = getattr(m, sub)
            self._attention_groups(f"{name}.{sub}", mha, a, rank)
            out = self._attention_out(f"{name}.{sub}", mha, rank)
            stream = self._join_stream(stream, out, last)
        lin1: Any = m.linear1  # type: ignore[union-attr]
        lin2: Any = m.linear2  # type: ignore[union-attr]
        if last in stream:
            self._consume(f"{name}.linear1", stream[last][0], 1, f"{name}.linear1.weight", 1)
        ffn = self._new(lin1.out_features, f"{name}.linear1",
                        [_Use(f"{name}.linear1.weight", 0), _Use(f"{name}.linear1.bias", 0)]
                        if lin1.bias is not None else [_Use(f"{name}.linear1.weight", 0)])
        self._consume(f"{name}.linear2", ffn, 1, f"{name}.linear2.weight", 1)
        out2 = {last: (self._new(lin2.out_features, f"{name}.linear2",
                                 [_Use(f"{name}.linear2.weight", 0)] +
                                 ([_Use(f"{name}.linear2.bias", 0)]
                                  if lin2.bias is not None else [])), 1)}
        stream = self._join_stream(stream, out2, last)
        for norm in ("norm1", "norm2", "norm3"):
            ln = getattr(m, norm, None)
            if ln is not None:
                self._norm_on(f"{name}.{norm}", ln, stream, last)
        return stream

    def _join_stream(self, stream: Ann, out: Ann, last: int) -> Ann:
        if last in stream:
            return {last: (self.g.join(stream[last][0], out[last][0], stream=True), 1)}
        self.g.poison(out[last][0])
        return {}

    def _norm_on(self, name: str, ln: nn.LayerNorm, stream: Ann, last: int) -> None:
        if last in stream:
            for t, _ in ln.named_parameters(recurse=False):
                self.g.use(stream[last][0], _Use(f"{name}.{t}", 0))
            self.g.layer_norms[name] = stream[last][0]

    def _stack(self, name: str, m: nn.Module, a: Ann, rank: int, memory: Ann | None) -> Ann:
        stream = dict(a)
        for i, layer in enumerate(m.layers):  # type: ignore[union-attr, arg-type]
            stream = self._layer(f"{name}.layers.{i}", layer, stream, rank, memory)
        norm = getattr(m, "norm", None)
        if isinstance(norm, nn.LayerNorm):
            self._norm_on(f"{name}.norm", norm, stream, rank - 1)
        return stream

    def _transformer(self, n: fx.Node, name: str, m: nn.Module) -> Any:
        args = [x for x in n.args if isinstance(x, fx.Node)]
        shapes = [self.env_shape(x) for x in args[:2]]
        rank = len(shapes[0])
        anns = [self._a(x) for x in args]
        for x in args[2:]:
            _poison_ann(self.g, self.ann.get(x))
        a = anns[0]
        for d in a:
            if d != rank - 1:
                self.g.poison(a[d][0])
        a = {d: v for d, v in a.items() if d == rank - 1}
        if isinstance(m, nn.TransformerEncoderLayer):
            return self._layer(name, m, a, rank, None)
        if isinstance(m, nn.TransformerEncoder):
            return self._stack(name, m, a, rank, None)
        memory = anns[1] if len(anns) > 1 else {}
        if isinstance(m, nn.TransformerDecoderLayer):
            return self._layer(name, m, a, rank, memory)
        if isinstance(m, nn.TransformerDecoder):
            return self._stack(name, m, a, rank, memory)
        assert isinstance(m, nn.Transformer)  # (src, tgt)
        src = self._stack(f"{name}.encoder", m.encoder, a, rank, None)
        tgt = {d: v for d, v in (anns[1] if len(anns) > 1 else {}).items() if d == rank - 1}
        return self._stack(f"{name}.decoder", m.decoder, tgt, rank, src)

    # functions and methods ----------------------------------------------------------------
    def _binary(self, n: fx.Node, operands: Sequence[Any], out: Any) -> Ann:
        if not isinstance(out, torch.Tensor):
            return {}
        rank = out.dim()
        additive = n.target in _ADDITIVE
        joined: Ann = {}
        tensors = []
        for x in operands:
            if isinstance(x, fx.Node) and isinstance(self.env.get(x), torch.Tensor):
                tensors.append(x)
        for x in tensors:
            for d, (gid, inner) in _align(self._a(x), self.env_shape(x), rank).items():
                if d in joined:
                    if joined[d][1] != inner:
                        self.g.poison(gid)
                        self.g.poison(joined[d][0])
                    joined[d] = (self.g.join(joined[d][0], gid, stream=additive), inner)
                else:
                    joined[d] = (gid, inner)
        for x in tensors:  # an operand of full size along a cut dimension but not cut there
            shape = self.env_shape(x)
            aligned = _align(self._a(x), shape, rank)
            for d, (gid, _) in joined.items():
                k = d - (rank - len(shape))
                if k >= 0 and shape[k] != 1 and d not in aligned:
                    if x.op == "get_attr":
                        self.g.use(gid, _Use(str(x.target), k, joined[d][1]))
                    else:
                        self.g.poison(gid)
        return joined

    def _function(self, n: fx.Node, f: Any, out: Any) -> Any:
        if f in _ELEMENTWISE_FUNCS:
            return dict(self._a(n.args[0]))
        if f in _BINARY:
            return self._binary(n, n.args[:2], out)
        if f in _POOL_FUNCS:
            return self._keep_channels(self._a(n.args[0]))
        if f is torch.flatten:
            x = n.args[0]
            start = n.args[1] if len(n.args) > 1 else n.kwargs.get("start_dim", 0)
            end = n.args[2] if len(n.args) > 2 else n.kwargs.get("end_dim", -1)
            return self._flatten(self._a(x), self.env_shape(x), int(cast(int, start)), int(cast(int, end)))
        if f is operator.getitem:
            return self._getitem(n, out)
        if f is F.scaled_dot_product_attention:
            return self._attend(n)
        if f in (torch.transpose,):
            return self._transpose(self._a(n.args[0]), int(cast(int, n.args[1])),
                                   int(cast(int, n.args[2])),
                                   len(self.env_shape(n.args[0])))
        if f in (getattr,):
            return {}
        self._poison_args(n)
        return {}

    def _method(self, n: fx.Node, name: str, out: Any) -> Any:
        if name in _META:
            return {}
        x = n.args[0]
        a = self._a(x)
        if name in _ELEMENTWISE_METHODS:
            return dict(a)
        if name in _BINARY_METHODS:
            return self._binary(n, n.args[:2], out)
        if name == "flatten":
            start = n.args[1] if len(n.args) > 1 else n.kwargs.get("start_dim", 0)
            end = n.args[2] if len(n.args) > 2 else n.kwargs.get("end_dim", -1)
            return self._flatten(a, self.env_shape(x), int(cast(int, start)), int(cast(int, end)))
        if name in ("transpose",):
            return self._transpose(a, int(cast(int, n.args[1])), int(cast(int, n.args[2])),
                                   len(self.env_shape(x)))
        if name in ("view", "reshape") and isinstance(out, torch.Tensor):
            return self._reshape(a, self.env_shape(x), tuple(out.shape))
        if name in _REDUCE and isinstance(out, torch.Tensor):
            dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
            keep = bool(n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False))
            return self._reduce(a, len(self.env_shape(x)), dims, keep)
        self._poison_args(n)
        return {}

    def _transpose(self, a: Ann, d0: int, d1: int, rank: int) -> Ann:
        d0, d1 = d0 % rank, d1 % rank
        swap = {d0: d1, d1: d0}
        return {swap.get(d, d): v for d, v in a.items()}

    def _reduce(self, a: Ann, rank: int, dims: Any, keep: bool) -> Ann:
        if dims is None:
            for gid, _ in a.values():
                self.g.poison(gid)
            return {}
        dims = {int(d) % rank for d in (dims if isinstance(dims, (tuple, list)) else [dims])}
        out: Ann = {}
        for d, v in a.items():
            if d in dims:
                self.g.poison(v[0])
                continue
            out[d if keep else d - sum(1 for k in dims if k < d)] = v
        return out

    def _reshape(self, a: Ann, shape: Sequence[int], new: Sequence[int]) -> Ann:
        """A reshape, as runs of input dimensions and runs of output dimensions of equal
        element count: a cut dimension may open a run it merges (its channels' elements stay
        contiguous: elements per channel x the sizes merged after it) or be split into a run
        whose first dimension it becomes (a unit then spans whole rows of the split: e.g. a
        projection's width split into heads x head_dim, the unit one head)."""
        out: Ann = {}
        i = j = 0
        while i < len(shape) or j < len(new):
            i0, j0 = i, j
            pi = shape[i] if i < len(shape) else 1
            pj = new[j] if j < len(new) else 1
            i, j = i + 1, j + 1
            while pi != pj:
                if pi < pj:
                    pi *= shape[i]
                    i += 1
                else:
                    pj *= new[j]
                    j += 1
            ins = [d for d in range(i0, min(i, len(shape))) if d in a]
            if not ins:
                continue
            if len(ins) > 1:
                raise ValueError("two cut dimensions in one reshaped run")
            d = ins[0]
            gid, inner = a[d]
            if any(shape[k] != 1 for k in range(i0, d)):
                raise ValueError("a cut dimension merged after another")
            outs = [k for k in range(j0, min(j, len(new))) if new[k] != 1]
            if not outs:
                raise ValueError("a cut dimension reshaped away")
            e = outs[0]
            after_in = int(np.prod(shape[d + 1:i], dtype=np.int64))
            after_out = int(np.prod(new[e + 1:j], dtype=np.int64))
            inner = Fraction(inner) * after_in / after_out
            inner = int(inner) if inner.denominator == 1 else inner
            root = self.g.find(gid)
            self.g.groups[root].base = math.lcm(self.g.groups[root].base,
                                                Fraction(inner).denominator)
            out[e] = (gid, inner)
        return out

    def _attend(self, n: fx.Node) -> Ann:
        """``F.scaled_dot_product_attention``: q, k and v hold the same heads along their
        batch dimensions; a cut along the sequence or feature dimensions is not followed."""
        qkv = n.args[:3]
        joined: Ann = {}
        for x in qkv:
            rank = len(self.env_shape(x))
            for d, (gid, inner) in self._a(x).items():
                if d >= rank - 2:
                    raise ValueError("attention over a cut dimension")
                if d in joined:
                    if joined[d][1] != inner:
                        raise ValueError("heads of different widths")
                    joined[d] = (self.g.join(joined[d][0], gid), inner)
                else:
                    joined[d] = (gid, inner)
        for d, (gid, _) in joined.items():
            if not all(d in self._a(x) for x in qkv):
                self.g.poison(gid)
        for x in [*n.args[3:], *n.kwargs.values()]:
            if isinstance(x, fx.Node):
                _poison_ann(self.g, self.ann.get(x))
        return joined

    def _getitem(self, n: fx.Node, out: Any) -> Any:
        x, idx = n.args[0], n.args[1]
        a = self.ann.get(x) if isinstance(x, fx.Node) else None
        if isinstance(a, list):
            return a[idx] if isinstance(idx, int) and idx < len(a) else {}
        if not isinstance(out, torch.Tensor) or not a:
            return dict(a) if isinstance(a, dict) and not a else {}
        items = idx if isinstance(idx, tuple) else (idx,)
        rank = len(self.env_shape(x))
        if any(i is Ellipsis or i is None or isinstance(i, fx.Node) for i in items):
            raise ValueError("indexing not followed")
        result: Ann = {}
        removed = 0
        for d in range(rank):
            i = items[d] if d < len(items) else slice(None)
            if isinstance(i, int):
                if d in a:
                    raise ValueError("indexing a cut dimension")
                removed += 1
                continue
            if d in a:
                if i != slice(None):
                    raise ValueError("slicing a cut dimension")
                result[d - removed] = a[d]
        return result


# --- residual blocks ----------------------------------------------------------------------------
def _module_paths(n: fx.Node) -> list[str]:
    stack = n.meta.get("nn_module_stack") or {}
    out = []
    for key, value in stack.items():
        path = value[0] if isinstance(value, tuple) else key
        out.append(str(path))
    return out


def _residual_blocks(gm: fx.GraphModule, shapes: Mapping[fx.Node, tuple[int, ...]]
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
                        follower.target in _ELEMENTWISE_FUNCS or
                        (follower.op == "call_module" and isinstance(
                            modules.get(str(follower.target)), _ELEMENTWISE_MODULES))):
                    follower = follower.all_input_nodes[0]
                ok = ok or follower is add
        if ok and shapes.get(x) == shapes.get(out) is not None:
            blocks.append(path)
    # innermost blocks only (a stage holding blocks is not a block itself)
    return [b for b in blocks if not any(o != b and o.startswith(b + ".") for o in blocks)]


# --- the adapter --------------------------------------------------------------------------------
@dataclass
class _Attention:
    heads: str
    head_dim: int
    held: int
    in_factor: float = 1.0
    head_factor: float = 1.0


def attention_forward(m: nn.MultiheadAttention, cut: _Attention, query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor,
                      key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                      attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                      is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``nn.MultiheadAttention``'s forward on cut tensors (a subnet's ``cut.held`` heads of
    ``cut.head_dim``): 1. q, k, v from the packed ``in_proj_weight`` (rows: the held heads' q,
    then their k, then their v); 2. per head, softmax(q k^T / sqrt(head_dim) + mask) with
    dropout in training, times v; 3. the heads concatenated, times ``cut.head_factor``
    (inverted dropout) and ``out_proj``. Masks as the module's: a 2-D ``attn_mask`` (or
    ``is_causal``) and a ``key_padding_mask`` [B, S], boolean (True: masked) or additive."""
    if not m.batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    if cut.in_factor != 1.0:
        query, key, value = (t * cut.in_factor for t in (query, key, value))
    b, lq, _ = query.shape
    s = key.shape[1]
    h, hd = cut.held, cut.head_dim
    w = m.in_proj_weight
    bias = m.in_proj_bias
    wq, wk, wv = w.chunk(3)
    bq, bk, bv = bias.chunk(3) if bias is not None else (None, None, None)
    q = F.linear(query, wq, bq).view(b, lq, h, hd).transpose(1, 2)
    k = F.linear(key, wk, bk).view(b, s, h, hd).transpose(1, 2)
    v = F.linear(value, wv, bv).view(b, s, h, hd).transpose(1, 2)
    scores = (q / math.sqrt(hd)) @ k.transpose(-2, -1)
    if attn_mask is None and is_causal:
        attn_mask = torch.ones(lq, s, dtype=torch.bool, device=q.device).triu(1)
    for mask in (attn_mask, None if key_padding_mask is None
                 else key_padding_mask[:, None, None, :]):
        if mask is None:
            continue
        if mask.dim() == 3:
            raise UsageError("IST cuts attention heads; a per-head 3-D attn_mask cannot follow "
                             "the cut: pass a 2-D mask or shared=(the attention's name,)")
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(mask, float("-inf"))
        else:
            scores = scores + mask.to(scores.dtype)
    weights = scores.softmax(-1)
    if m.training and m.dropout > 0:
        weights = F.dropout(weights, m.dropout)
    y = (weights @ v).transpose(1, 2).reshape(b, lq, h * hd)
    if cut.head_factor != 1.0:
        y = y * cut.head_factor
    y = F.linear(y, m.out_proj.weight, m.out_proj.bias)
    if not m.batch_first:
        y = y.transpose(0, 1)
    if not need_weights:
        return y, None
    return y, weights.mean(1) if average_attn_weights else weights


class GraphAdapter(ISTAdapter):
    """The adapter :func:`derive_adapter` builds (module docstring: ``configure`` and the
    scaling). ``blocks``: group -> module names of its residual blocks (``residual="blocks"``)."""

    def __init__(self, plan: ISTPlan, *, layer_norms: Mapping[str, tuple[str, int]],
                 group_norms: Mapping[str, tuple[str, int]],
                 batch_norms: Mapping[str, tuple[str, int]],
                 attentions: Mapping[str, tuple[str, int]],
                 blocks: Mapping[str, Sequence[str]], description: Sequence[str]) -> None:
        if batch_norms or group_norms or blocks:  # a convolutional model: state reset
            self.default_optimizer_state = "reset"
        super().__init__(plan)
        self.layer_norms = dict(layer_norms)    # module -> (group, channels per unit)
        self.group_norms = dict(group_norms)    # module -> (group, norm groups per unit)
        self.batch_norms = dict(batch_norms)    # module -> (group, channels per unit)
        self.attentions = dict(attentions)      # module -> (heads group, head_dim)
        self.blocks = {g: list(b) for g, b in blocks.items()}
        self.description = list(description)
        self.scales = (("batchnorm", "dropout", "none") if plan.batch_normalised else
                       ("none",) if self.blocks else ("dropout", "none"))
        self._cuts: dict[str, _Attention] = {}

    def configure(self, model: nn.Module, held: Mapping[str, np.ndarray] | None) -> None:
        modules = dict(model.named_modules())

        def units(group: str) -> int:
            return self.plan.group(group).size if held is None else len(held[group])

        for name, (group, per) in self.layer_norms.items():
            modules[name].normalized_shape = (units(group) * per,)  # type: ignore[assignment]
        for name, (group, per) in self.group_norms.items():
            modules[name].num_groups = units(group) * per  # type: ignore[assignment]
        for name, (group, per) in self.batch_norms.items():
            modules[name].num_features = units(group) * per  # type: ignore[assignment]
        self._cuts = {}
        for name, (group, hd) in self.attentions.items():
            m = modules[name]
            m.__dict__.pop("forward", None)
            if held is not None and units(group) < self.plan.group(group).size:
                cut = _Attention(group, hd, units(group))
                self._cuts[name] = cut
                m.forward = functools.partial(attention_forward, m, cut)  # type: ignore[method-assign]
        for group, names in self.blocks.items():
            mine = None if held is None else {int(u) for u in held[group]}
            for u, name in enumerate(names):
                block = modules[name]
                block.__dict__.pop("forward", None)
                if mine is not None and u not in mine:
                    block.forward = _identity  # type: ignore[method-assign]

    def install_scaling(self, model: nn.Module, factors: Sequence[tuple[str, float]]
                        ) -> list[Any]:
        """Inverted dropout: a forward pre-hook on each layer fed by a cut group; the heads'
        factor of a cut attention inside :func:`attention_forward`."""
        hooked = []
        handles: list[Any] = []
        modules = dict(model.named_modules())
        for name, factor in factors:
            owner = name.rsplit(".", 1)[0]
            if name.endswith(".out_proj") and owner in self._cuts:
                self._cuts[owner].head_factor = factor
                handles.append(_Reset(self._cuts[owner], "head_factor"))
            elif name in self._cuts:
                self._cuts[name].in_factor = factor
                handles.append(_Reset(self._cuts[name], "in_factor"))
            elif isinstance(modules[name], nn.MultiheadAttention):  # query, key and value
                handles.append(modules[name].register_forward_pre_hook(
                    lambda _m, args, f=factor: (*(a * f for a in args[:3]), *args[3:])))
            else:
                hooked.append((name, factor))
        return handles + super().install_scaling(model, hooked)


@dataclass
class _Reset:
    """A handle that puts an attention's scaling factor back to 1 (``remove``)."""

    cut: _Attention
    attr: str

    def remove(self) -> None:
        setattr(self.cut, self.attr, 1.0)


def _identity(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    del args, kwargs
    return x


def _dtype(x: torch.Tensor) -> str:
    return str(x.dtype).replace("torch.", "")


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
               "_backward_pre_hooks", "_forward_hooks_with_kwargs",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def _copy_without_hooks(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` without its hooks (they may hold anything: IST's own hold a
    process group)."""
    memo: dict[int, Any] = {}
    for m in model.modules():
        for attr in _HOOK_DICTS:
            d = m.__dict__.get(attr)
            if d is not None:
                memo[id(d)] = type(d)()
    return copy.deepcopy(model, memo)


def derive_adapter(model: nn.Module, example_input: Any, *, residual: str = "whole",
                   embeddings: str = "shared", shared: Sequence[str] = (),
                   min_units: int = 2) -> GraphAdapter:
    """The IST adapter of ``model`` from its graph (module docstring), traced with
    ``example_input`` (a tensor, or a tuple of the forward's positional arguments).

    Args:
        residual: ``whole`` (the default: a residual stream, the channel group both sides of an
            addition share, stays whole on every subnet and is averaged; the units inside its
            branches, hidden channels, heads and FFN neurons, are cut), ``channels`` (the stream
            is cut like any other group: every norm over it then normalises over a subnet's
            share only; docs/IST.md, "Getting a good model out of IST") or ``blocks`` (ResIST:
            residual blocks are dealt units, nothing else is cut).
        embeddings: ``shared`` (embedding dimensions, and the residual stream they feed, stay
            whole) or ``cut`` (cut with the layers they feed).
        shared: names of submodules kept whole: not traced into, their tensors shared by every
            subnet, the channels they touch not cut (the escape hatch for a submodule the
            tracer cannot follow).
        min_units: a group with fewer units is shared (IST passes its number of workers).

    Raises :class:`UsageError` (one line) for a model the tracer cannot follow and for a model
    with no unit to cut."""
    if residual not in RESIDUAL_MODES:
        raise UsageError(f"IST residual {residual!r}: use whole, channels or blocks")
    if embeddings not in EMBEDDING_MODES:
        raise UsageError(f"IST embeddings {embeddings!r}: use shared or cut")
    modules = dict(model.named_modules())
    unknown = [s for s in shared if s not in modules or not s]
    if unknown:
        raise UsageError(f"IST shared names {unknown} are not submodules of "
                         f"{type(model).__name__}; use names from model.named_modules()")
    args = _example_args(example_input)
    # traced and run on copies: the trace runs the modules on the example (BatchNorm statistics
    # move), the model itself stays untouched
    work = _copy_without_hooks(model)
    wgm = _trace(work, args, shared)
    graph = _Graph()
    prop = _Propagate(wgm, graph, embeddings, shared)
    was = work.training
    work.train()
    try:
        with torch.no_grad():
            prop.run(*args)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"IST could not run {type(model).__name__} on example_input "
                         f"({str(e).strip().splitlines()[0][:120] if str(e).strip() else e!r}); "
                         "pass the model's own input batch") from None
    finally:
        work.train(was)
    persistent = dict(model.state_dict(keep_vars=True))
    params = dict(model.named_parameters())
    named = [*params.items(), *((n, b) for n, b in model.named_buffers() if n in persistent)]
    if residual == "blocks":
        return _blocks_adapter(model, wgm, prop.shapes, named, params, shared)
    for i in range(len(graph.groups)):
        g = graph.groups[i]
        if (embeddings == "shared" and g.embedding) or (residual == "whole" and g.stream):
            g.poisoned = True
            graph.groups[graph.find(i)].poisoned = True
    adapter = _channels_adapter(model, graph, named, params, min_units)
    _check_subnet(work, adapter, args)
    return adapter


def _check_subnet(work: nn.Module, adapter: GraphAdapter, args: tuple[Any, ...]) -> None:
    """One forward of a subnet holding the first half of every group's units, on the copy: a
    forward that fixes a cut width in code (``x.view(b, n, 4, 16)`` where 4 is a head count)
    fails here, in one line, and not in the first round."""
    plan = adapter.plan
    held = {g.name: np.arange(max(1, g.size // 2)) for g in plan.groups}
    tensors = {**dict(work.named_parameters()), **dict(work.named_buffers())}
    with torch.no_grad():
        for t in plan.tensors:
            x = tensors[t.name].data
            for c in t.cuts:
                size = plan.group(c.group).size
                units = torch.arange(len(held[c.group]), device=x.device)
                idx = (torch.arange(c.segments, device=x.device)[:, None] * size * c.per_unit
                       + (units[:, None] * c.per_unit
                          + torch.arange(c.per_unit, device=x.device)).reshape(1, -1))
                x = x.index_select(c.dim, idx.reshape(-1))
            tensors[t.name].data = x.clone()
        adapter.configure(work, held)
        try:
            work.train()
            work(*args)
        except Exception as e:  # noqa: BLE001 - reported in one line
            text = str(e).strip().splitlines()[0][:160] if str(e).strip() else repr(e)
            raise UsageError(f"IST derived a plan for {type(work).__name__}, but its forward "
                             f"fails on a subnet ({text}): the forward fixes a width the plan "
                             "cuts; derive the width from the weights' shapes, or pass "
                             "shared=(that module,)") from None
        finally:
            adapter.configure(work, None)


def _channels_adapter(model: nn.Module, graph: _Graph, named: Sequence[tuple[str, torch.Tensor]],
                      params: Mapping[str, torch.Tensor], min_units: int) -> GraphAdapter:
    ident = {id(x): n for n, x in reversed(named)}  # tied tensors: their first name
    alias = {n: ident[id(x)] for n, x in named}
    shapes = {n: tuple(x.shape) for n, x in named}
    roots: dict[int, str] = {}
    cuts: dict[str, dict[int, Cut]] = {}
    poisoned_dims: set[tuple[str, int]] = set()
    for root in sorted({graph.find(i) for i in range(len(graph.groups))}):
        g = graph.groups[root]
        uses = [u for u in graph.uses.get(root, []) if u.tensor in alias]
        if not uses or g.poisoned or g.width % g.base or g.width // g.base < min_units:
            continue
        name = g.origin
        roots[root] = name
        for u in uses:
            t = alias[u.tensor]
            per = Fraction(g.base) * u.inner
            c = Cut(name, u.dim, int(per), u.segments)
            size = shapes[t][u.dim]
            if per.denominator != 1 or size != c.segments * (g.width // g.base) * c.per_unit:
                poisoned_dims.add((t, u.dim))
                continue
            prev = cuts.setdefault(t, {}).get(u.dim)
            if prev is not None and prev != c:
                poisoned_dims.add((t, u.dim))
            cuts[t][u.dim] = c
    # a dimension two different cuts claim, or a size that does not fit: its groups are
    # dropped everywhere (a group must index all its tensors to be cut)
    bad = {cuts[t][d].group for t, d in poisoned_dims if d in cuts.get(t, {})}
    if bad:
        for t in list(cuts):
            cuts[t] = {d: c for d, c in cuts[t].items() if c.group not in bad}
        roots = {r: n for r, n in roots.items() if n not in bad}
    groups = []
    for root, name in roots.items():
        g = graph.groups[root]
        groups.append(UnitGroup(name, g.width // g.base))
    used = {c.group for t in cuts.values() for c in t.values()}
    groups = [g for g in groups if g.name in used]
    if not groups:
        raise UsageError(f"IST found no unit to cut in {type(model).__name__}: every layer's "
                         "outputs reach the model's output, a residual stream (kept whole; "
                         "residual='channels' cuts it) or an operation it cannot cut; "
                         "pass an adapter (docs/IST.md, 'Writing an adapter')")
    names = {g.name for g in groups}
    by_root = {r: n for r, n in roots.items() if n in names}
    tensors = []
    for n, x in named:
        if alias[n] != n:
            continue
        tc = tuple(sorted((c for c in cuts.get(n, {}).values() if c.group in names),
                          key=lambda c: c.dim))
        if x.dim() == 0:
            tc = ()
        tensors.append(TensorPlan(n, tuple(x.shape), tc, buffer=n not in params,
                                  dtype=_dtype(x)))
    scaled = []
    seen = set()
    for mod, gid in graph.scaled:
        group = by_root.get(graph.find(gid))
        if group is not None and (mod, group) not in seen:
            seen.add((mod, group))
            scaled.append((mod, group))
    base = {n: graph.groups[r].base for r, n in by_root.items()}
    layer_norms = {m: (by_root[graph.find(g)], base[by_root[graph.find(g)]])
                   for m, g in graph.layer_norms.items() if graph.find(g) in by_root}
    modules = dict(model.named_modules())
    group_norms = {}
    for m, gid in graph.group_norms.items():
        if graph.find(gid) in by_root:
            gn = modules[m]
            owner = by_root[graph.find(gid)]
            group_norms[m] = (owner, base[owner] // (gn.num_channels // gn.num_groups))
    batch_norms = {m: (by_root[graph.find(g)], base[by_root[graph.find(g)]])
                   for m, g in graph.batch_norms.items() if graph.find(g) in by_root}
    attentions = {m: (by_root[graph.find(g)], hd) for m, (g, hd) in graph.attentions.items()
                  if graph.find(g) in by_root}
    batch_after = {by_root[graph.find(g)] for m, g in graph.batch_norms.items()
                   if graph.find(g) in by_root and isinstance(modules[m], nn.BatchNorm1d)
                   and not modules[m].track_running_stats}
    plan = ISTPlan(groups=tuple(groups), tensors=tuple(tensors), scaled_inputs=tuple(scaled),
                   batch_normalised=bool(groups) and all(g.name in batch_after for g in groups))
    description = [f"{g.name}: {g.size} units" for g in groups]
    return GraphAdapter(plan, layer_norms=layer_norms, group_norms=group_norms,
                        batch_norms=batch_norms, attentions=attentions, blocks={},
                        description=description)


def _blocks_adapter(model: nn.Module, gm: fx.GraphModule,
                    shapes: Mapping[fx.Node, tuple[int, ...]],
                    named: Sequence[tuple[str, torch.Tensor]], params: Mapping[str, torch.Tensor],
                    shared: Sequence[str]) -> GraphAdapter:
    blocks = [b for b in _residual_blocks(gm, shapes) if b not in shared]
    by_parent: dict[str, list[str]] = {}
    for b in blocks:
        parent = b.rsplit(".", 1)[0] if "." in b else ""
        by_parent.setdefault(parent or "blocks", []).append(b)
    if not by_parent:
        raise UsageError(f"IST found no residual block in {type(model).__name__} (a submodule "
                         "whose output is its input plus a branch); use residual='channels' "
                         "or pass an adapter")
    owner: dict[str, tuple[str, int]] = {}
    for group, names in by_parent.items():
        for u, b in enumerate(names):
            owner[b] = (group, u)
    tensors = []
    for n, x in named:
        unit = next((owner[b] for b in owner if n.startswith(b + ".")), None)
        tensors.append(TensorPlan(n, tuple(x.shape), unit=unit, buffer=n not in params,
                                  dtype=_dtype(x)))
    groups = tuple(UnitGroup(g, len(b), "dealt") for g, b in by_parent.items())
    plan = ISTPlan(groups=groups, tensors=tuple(tensors))
    return GraphAdapter(plan, layer_norms={}, group_norms={}, batch_norms={}, attentions={},
                        blocks=by_parent,
                        description=[f"{g}: {len(b)} blocks" for g, b in by_parent.items()])

"""Step 2-3 of :mod:`thinwire.models.graph`: the traced graph runs once on the example and
every value is annotated with the channel groups of its dimensions, by the rule of the module,
function or method that made it (:mod:`thinwire.models.graph.rules`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import torch
from torch import fx

import thinwire.models.graph.aten  # noqa: F401 - registers the aten rules
from thinwire.models.graph.groups import Ann, Graph, Use, poison_ann
from thinwire.models.graph.rules import ADDITIVE, function_rule, method_rule, module_rule


class RunFailed(Exception):
    """The example failed to run through node ``op`` of module ``where`` (fields, not args:
    fx's interpreter rewrites an exception's first argument)."""

    def __init__(self, where: str, op: str, text: str) -> None:
        super().__init__(text)
        self.where, self.op, self.text = where, op, text


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:160].strip() if text else type(e).__name__


def _op_name(n: fx.Node) -> str:
    if n.op == "call_module":
        return "the module's forward"
    if n.op == "call_method":
        return f"the tensor method {n.target}"
    name = getattr(n.target, "__name__", None) or str(n.target)
    return f"{name}" if not isinstance(n.target, torch._ops.OpOverload) else str(n.target)


def _align(ann: Ann, shape: Sequence[int], out_rank: int) -> Ann:
    """An operand's annotation in the broadcast output's dimensions (right-aligned)."""
    shift = out_rank - len(shape)
    return {d + shift: v for d, v in ann.items() if shape[d] != 1}


class Propagation(fx.Interpreter):
    """Runs the graph and annotates every value (``ann``: node -> ``{dim: (group, elements
    per channel)}``, or a list of those for a tuple); what a rule calls is documented in
    :mod:`thinwire.models.graph.rules`."""

    def __init__(self, gm: fx.GraphModule, graph: Graph, embeddings: str,
                 shared: Sequence[str], *, exported: bool = False,
                 owners: dict[str, Any] | None = None) -> None:
        super().__init__(gm)
        self.exported = exported  # an aten graph of torch.export (rules: graph/aten.py)
        self.owners = owners if owners is not None else dict(gm.named_modules())
        self.g = graph
        self.embeddings = embeddings
        self.shared = set(shared)
        self.ann: dict[fx.Node, Any] = {}
        self.shapes: dict[fx.Node, tuple[int, ...]] = {}
        self.modules = dict(gm.named_modules())

    @property
    def groups(self) -> Graph:
        """The union-find of channel groups."""
        return self.g

    # annotations of arguments -------------------------------------------------------------
    def annotation(self, x: Any) -> Any:
        """The annotation of an argument (``{}`` for a constant)."""
        return self.ann.get(x, {}) if isinstance(x, fx.Node) else {}

    def poison_inputs(self, n: fx.Node) -> None:
        """Nothing that flows into ``n`` is cut."""
        for x in n.all_input_nodes:
            poison_ann(self.g, self.ann.get(x))

    def run_node(self, n: fx.Node) -> Any:
        try:
            out = super().run_node(n)
        except Exception as e:  # noqa: BLE001 - the example does not run: named in one line
            raise RunFailed(self._where(n), _op_name(n), first_line(e)) from None
        if isinstance(out, torch.Tensor):
            self.shapes[n] = tuple(out.shape)
        try:
            self.ann[n] = self._annotate(n, out)
        except Exception:  # an operation whose shapes the rules do not follow: not cut
            self.poison_inputs(n)
            self.ann[n] = {}
        return out

    def _where(self, n: fx.Node) -> str:
        """The innermost module that made node ``n``, with its class."""
        name = str(n.target) if n.op == "call_module" else (self.module_path(n) or [""])[-1]
        module = self.owners.get(name) if name else None
        return f"{name} ({type(module).__name__})" if module is not None else name

    def module_path(self, n: fx.Node) -> list[str]:
        """The modules (outermost first) whose forward made node ``n`` (an exported graph)."""
        stack = n.meta.get("nn_module_stack") or {}
        return [str(v[0]) if isinstance(v, tuple) else str(k) for k, v in stack.items()]

    def _annotate(self, n: fx.Node, out: Any) -> Any:
        if n.op in ("placeholder", "get_attr"):
            return {}
        if self.exported and self.shared and any(
                m in self.shared for m in self.module_path(n)):
            self.poison_inputs(n)  # inside a module kept whole
            return {}
        if n.op == "output":
            poison_ann(self.g, [self.annotation(x) for x in n.all_input_nodes])
            return {}
        if n.op == "call_module":
            name = str(n.target)
            rule = module_rule(self.modules[name])
            if name in self.shared or rule is None:
                self.poison_inputs(n)  # a module the rules do not know: what it touches
                return {}              # is not cut
            return rule.apply(self, n, self.modules[name], name, out)
        if n.op == "call_function":
            fn = function_rule(n.target)
        elif n.op == "call_method":
            fn = method_rule(str(n.target))
        else:
            fn = None
        if fn is None:
            self.poison_inputs(n)
            return {}
        return fn(self, n, out)

    # what rules call ----------------------------------------------------------------------
    def new_group(self, width: int, name: str, uses: Sequence[Use]) -> int:
        """A new group of ``width`` channels, made by ``name``, indexing ``uses``."""
        gid = self.g.new(width, name)
        for u in uses:
            self.g.use(gid, u)
        return gid

    def consume(self, name: str, gid: int, inner: int, tensor: str, dim: int,
                scaled: bool = True) -> None:
        """Module ``name`` reads group ``gid`` through dimension ``dim`` of ``tensor``
        (``scaled``: its input gets the inverted-dropout factor of that group)."""
        self.g.use(gid, Use(tensor, dim, inner))
        if scaled:
            self.g.scaled.append((name, gid))

    def shape(self, x: Any) -> tuple[int, ...]:
        v = self.env[x]
        return tuple(v.shape)

    def flatten(self, a: Ann, shape: Sequence[int], start: int, end: int) -> Ann:
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


    def binary(self, n: fx.Node, operands: Sequence[Any], out: Any) -> Ann:
        if not isinstance(out, torch.Tensor):
            return {}
        rank = out.dim()
        additive = n.target in ADDITIVE
        joined: Ann = {}
        tensors = []
        for x in operands:
            if isinstance(x, fx.Node) and isinstance(self.env.get(x), torch.Tensor):
                tensors.append(x)
        for x in tensors:
            for d, (gid, inner) in _align(self.annotation(x), self.shape(x), rank).items():
                if d in joined:
                    if joined[d][1] != inner:
                        self.g.poison(gid)
                        self.g.poison(joined[d][0])
                    joined[d] = (self.g.join(joined[d][0], gid, stream=additive), inner)
                else:
                    joined[d] = (gid, inner)
        for x in tensors:  # an operand of full size along a cut dimension but not cut there
            shape = self.shape(x)
            aligned = _align(self.annotation(x), shape, rank)
            for d, (gid, _) in joined.items():
                k = d - (rank - len(shape))
                if k >= 0 and shape[k] != 1 and d not in aligned:
                    if x.op == "get_attr":
                        self.g.use(gid, Use(str(x.target), k, joined[d][1]))
                    else:
                        self.g.poison(gid)
        return joined


    def transpose(self, a: Ann, d0: int, d1: int, rank: int) -> Ann:
        d0, d1 = d0 % rank, d1 % rank
        swap = {d0: d1, d1: d0}
        return {swap.get(d, d): v for d, v in a.items()}

    def reduce(self, a: Ann, rank: int, dims: Any, keep: bool) -> Ann:
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

    def reshape(self, a: Ann, shape: Sequence[int], new: Sequence[int]) -> Ann:
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

    def attend(self, n: fx.Node) -> Ann:
        """``F.scaled_dot_product_attention``: q, k and v hold the same heads along their
        batch dimensions; a cut along the sequence or feature dimensions is not followed."""
        qkv = n.args[:3]
        joined: Ann = {}
        for x in qkv:
            rank = len(self.shape(x))
            for d, (gid, inner) in self.annotation(x).items():
                if d >= rank - 2:
                    raise ValueError("attention over a cut dimension")
                if d in joined:
                    ratio = Fraction(inner) / Fraction(joined[d][1])
                    if ratio == 1:
                        joined[d] = (self.g.join(joined[d][0], gid), joined[d][1])
                    elif ratio.denominator == 1:  # grouped-query: k/v heads repeated
                        joined[d] = (self.g.absorb(joined[d][0], gid, int(ratio)), joined[d][1])
                    else:
                        raise ValueError("heads of different widths")
                else:
                    joined[d] = (gid, inner)
        for d, (gid, _) in joined.items():
            if not all(d in self.annotation(x) for x in qkv):
                self.g.poison(gid)
        for x in [*n.args[3:], *n.kwargs.values()]:
            if isinstance(x, fx.Node):
                poison_ann(self.g, self.ann.get(x))
        return joined

    def getitem(self, n: fx.Node, out: Any) -> Any:
        x, idx = n.args[0], n.args[1]
        a = self.ann.get(x) if isinstance(x, fx.Node) else None
        if isinstance(a, list):
            return a[idx] if isinstance(idx, int) and idx < len(a) else {}
        if not isinstance(out, torch.Tensor) or not a:
            return dict(a) if isinstance(a, dict) and not a else {}
        items = idx if isinstance(idx, tuple) else (idx,)
        rank = len(self.shape(x))
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

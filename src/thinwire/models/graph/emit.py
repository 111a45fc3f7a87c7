"""Step 4-5 of :mod:`thinwire.models.graph`: the groups that survive become an
:class:`~thinwire.models.adapter.ISTPlan` (unit groups, a :class:`~thinwire.models.adapter.Cut`
per recorded use) and a :class:`~thinwire.models.graph.adapter.GraphAdapter`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import torch
from torch import fx, nn

from thinwire.errors import UsageError
from thinwire.models.adapter import Cut, ISTPlan, TensorPlan, UnitGroup
from thinwire.models.graph.adapter import GraphAdapter
from thinwire.models.graph.blocks import residual_blocks
from thinwire.models.graph.errors import nothing_to_cut
from thinwire.models.graph.groups import Graph


def _dtype(x: torch.Tensor) -> str:
    return str(x.dtype).replace("torch.", "")


def _per_channel(graph: Graph) -> list[tuple[int, Fraction]]:
    """(root group, value per channel) of every norm width and width attribute a subnet sets
    from the channels it holds: each must come to whole numbers per unit."""
    out = [(graph.find(g), Fraction(inner)) for norms in (graph.layer_norms, graph.batch_norms)
           for g, inner in norms.values()]
    out += [(graph.find(g), Fraction(per)) for _, _, g, per in graph.follows]
    return out


def channels_adapter(model: nn.Module, graph: Graph, named: Sequence[tuple[str, torch.Tensor]],
                      params: Mapping[str, torch.Tensor], min_units: int) -> GraphAdapter:
    ident = {id(x): n for n, x in reversed(named)}  # tied tensors: their first name
    alias = {n: ident[id(x)] for n, x in named}
    roots, cuts = _group_cuts(graph, alias, {n: tuple(x.shape) for n, x in named}, min_units)
    groups = []
    for root, name in roots.items():
        g = graph.groups[root]
        groups.append(UnitGroup(name, g.width // g.base))
    used = {c.group for t in cuts.values() for c in t.values()}
    groups = [g for g in groups if g.name in used]
    if not groups:
        raise UsageError(nothing_to_cut(model))
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
    norms, batch_after = _norms(model, graph, by_root)
    plan = ISTPlan(groups=tuple(groups), tensors=tuple(tensors), scaled_inputs=tuple(scaled),
                   batch_normalised=bool(groups) and all(g.name in batch_after for g in groups))
    description = [f"{g.name}: {g.size} units" for g in groups]
    return GraphAdapter(plan, blocks={}, description=description, **norms)


def _group_cuts(graph: Graph, alias: Mapping[str, str], shapes: Mapping[str, tuple[int, ...]],
                min_units: int) -> tuple[dict[int, str], dict[str, dict[int, Cut]]]:
    """Each cuttable group's root and name, and every tensor's cut per dimension; a group that
    would cut part of a channel, or that claims a dimension another group claims or whose size
    does not fit, is dropped everywhere (a group must index all its tensors to be cut)."""
    roots: dict[int, str] = {}
    cuts: dict[str, dict[int, Cut]] = {}
    poisoned_dims: set[tuple[str, int]] = set()
    for root in sorted({graph.find(i) for i in range(len(graph.groups))}):
        g = graph.groups[root]
        uses = [u for u in graph.uses.get(root, []) if u.tensor in alias]
        if not uses or g.poisoned or g.width % g.base or g.width // g.base < min_units:
            continue
        if any((Fraction(g.base) * per).denominator != 1 for r, per in _per_channel(graph)
               if r == root):
            continue  # a norm or a width attribute would hold part of a channel
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
    bad = {cuts[t][d].group for t, d in poisoned_dims if d in cuts.get(t, {})}
    if bad:
        for t in list(cuts):
            cuts[t] = {d: c for d, c in cuts[t].items() if c.group not in bad}
        roots = {r: n for r, n in roots.items() if n not in bad}
    return roots, cuts


def _norms(model: nn.Module, graph: Graph, by_root: Mapping[int, str]
           ) -> tuple[dict[str, Any], set[str]]:
    """The adapter's norms, attentions and width attributes of the kept groups (keyword
    arguments of :class:`GraphAdapter`), and the groups a BatchNorm1d on batch statistics
    follows."""
    def per_unit(gid: int, per: Fraction | int) -> tuple[str, int]:
        """(the unit group of ``gid``, ``per`` x its channels per unit)"""
        root = graph.find(gid)
        return by_root[root], int(Fraction(graph.groups[root].base) * per)

    def kept(norms: Mapping[str, tuple[int, Any]]) -> dict[str, tuple[int, Any]]:
        return {m: v for m, v in norms.items() if graph.find(v[0]) in by_root}

    modules = dict(model.named_modules())
    out = {
        "layer_norms": {m: per_unit(g, inner) for m, (g, inner) in kept(graph.layer_norms).items()},
        "group_norms": {m: per_unit(g, Fraction(inner) * modules[m].num_groups
                                    / modules[m].num_channels)
                        for m, (g, inner) in kept(graph.group_norms).items()},
        "batch_norms": {m: per_unit(g, inner) for m, (g, inner) in kept(graph.batch_norms).items()},
        "attentions": {m: (by_root[graph.find(g)], hd) for m, (g, hd) in graph.attentions.items()
                       if graph.find(g) in by_root},
        "widths": {(m, attr): per_unit(g, per)
                   for m, attr, g, per in graph.follows if graph.find(g) in by_root},
    }
    batch_after = {by_root[graph.find(g)] for m, (g, _) in kept(graph.batch_norms).items()
                   if isinstance(modules[m], nn.BatchNorm1d)
                   and not modules[m].track_running_stats}
    return out, batch_after


def blocks_adapter(model: nn.Module, gm: fx.GraphModule,
                    shapes: Mapping[fx.Node, tuple[int, ...]],
                    named: Sequence[tuple[str, torch.Tensor]], params: Mapping[str, torch.Tensor],
                    shared: Sequence[str]) -> GraphAdapter:
    blocks = [b for b in residual_blocks(gm, shapes, set(dict(model.named_modules())))
              if b not in shared]
    by_parent: dict[str, list[str]] = {}
    for b in blocks:
        parent = b.rsplit(".", 1)[0] if "." in b else ""
        by_parent.setdefault(parent or "blocks", []).append(b)
    if not by_parent:
        raise UsageError(f"IST found no residual block in {type(model).__name__} (a submodule "
                         "whose output is its input plus a branch; a norm after the addition, "
                         "as in post-norm transformer layers, makes none); use "
                         "residual='whole' or 'channels', or pass an adapter")
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

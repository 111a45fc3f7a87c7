"""Channel groups: the union-find the propagation builds (steps 2-4 of
:mod:`thinwire.models.graph`): every value's dimension carries the group whose units index it,
a layer records which tensor dimensions a group indexes (:class:`Use`), and a group that
cannot be cut is *poisoned*."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any


@dataclass
class Group:
    width: int
    origin: str
    base: int = 1
    poisoned: bool = False
    embedding: bool = False
    stream: bool = False     # joined by an addition: a residual stream


@dataclass(frozen=True)
class Use:
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
class Graph:
    groups: list[Group] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    uses: dict[int, list[Use]] = field(default_factory=dict)
    scaled: list[tuple[str, int]] = field(default_factory=list)
    # norm module -> (group, elements per channel along the normalised dimension)
    layer_norms: dict[str, tuple[int, Any]] = field(default_factory=dict)
    group_norms: dict[str, tuple[int, Any]] = field(default_factory=dict)
    batch_norms: dict[str, tuple[int, Any]] = field(default_factory=dict)
    attentions: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (heads, hd)
    # (module, attribute, group, value per channel): an attribute a subnet sets to the width
    # it holds (a grouped convolution's ``groups``, an attention's head count); the value per
    # channel may be a Fraction (a convolution group spans several channels)
    follows: list[tuple[str, str, int, Any]] = field(default_factory=list)

    def new(self, width: int, origin: str) -> int:
        self.groups.append(Group(width, origin))
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

    def absorb(self, big: int, small: int, ratio: int) -> int:
        """Join ``small`` into ``big`` where one channel of ``small`` stands for ``ratio``
        channels of ``big`` (grouped-query attention: a key/value head serves ``ratio`` query
        heads, so a unit is one key/value head with its query heads)."""
        rb, rs = self.find(big), self.find(small)
        if rb == rs:
            return rb
        gb, gs = self.groups[rb], self.groups[rs]
        if gb.width != gs.width * ratio:
            self.poison(rb)
            self.poison(rs)
            return rb
        gb.base = math.lcm(gb.base, gs.base * ratio)
        gb.poisoned = gb.poisoned or gs.poisoned
        gb.embedding = gb.embedding or gs.embedding
        gb.stream = gb.stream or gs.stream
        self.uses.setdefault(rb, []).extend(
            replace(u, inner=Fraction(u.inner) / ratio) for u in self.uses.pop(rs, []))
        self.parent[rs] = rb
        return rb

    def split(self, g: int, chunks: int) -> int:
        """A group for each of ``chunks`` equal pieces of ``g`` (q | k | v of a fused
        projection): ``g``'s uses become the new group's, in ``chunks`` segments; ``g`` itself is
        not cut any more."""
        root = self.find(g)
        old = self.groups[root]
        s = self.new(old.width // chunks, old.origin)
        new = self.groups[s]
        new.base, new.poisoned = old.base, old.poisoned
        new.embedding, new.stream = old.embedding, old.stream
        self.uses[s] = [replace(u, segments=u.segments * chunks)
                        for u in self.uses.pop(root, [])]
        self.follows = [(m, a, s, per * chunks) if self.find(x) == root else (m, a, x, per)
                        for m, a, x, per in self.follows]
        old.poisoned = True
        return s

    def poison(self, g: int) -> None:
        self.groups[self.find(g)].poisoned = True

    def use(self, g: int, u: Use) -> None:
        self.uses.setdefault(self.find(g), []).append(u)

    def follow(self, module: str, attr: str, g: int, per: Fraction | int = 1) -> None:
        """``module.attr`` is ``per`` x the channels of ``g`` a subnet holds."""
        self.follows.append((module, attr, g, per))


def poison_ann(graph: Graph, ann: Any) -> None:
    if isinstance(ann, dict):
        for g, _ in ann.values():
            graph.poison(g)
    elif isinstance(ann, (list, tuple)):
        for a in ann:
            poison_ann(graph, a)

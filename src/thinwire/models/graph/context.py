"""What a rule of :mod:`thinwire.models.graph.rules` may call: the running propagation's
interface (:class:`~thinwire.models.graph.propagate.Propagation` implements it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from torch import fx

from thinwire.models.graph.groups import Ann, Graph, Use


class Context(Protocol):
    """The propagation as a rule sees it."""

    ann: dict[fx.Node, Any]
    owners: dict[str, Any]  # the traced model's modules by name
    shared: set[str]  # the submodules the user keeps whole (``derive_adapter``'s ``shared``)

    def module_path(self, n: fx.Node) -> list[str]:
        """The modules (outermost first) whose forward made ``n`` (an exported graph)."""

    @property
    def groups(self) -> Graph:
        """The union-find of channel groups (``poison``, ``join``, ``use``, ``follow``)."""

    def annotation(self, x: Any) -> Any:
        """The groups of an argument per dimension (``{}`` for a constant)."""

    def shape(self, x: Any) -> tuple[int, ...]:
        """The shape of an argument on the example."""

    def poison_inputs(self, n: fx.Node) -> None:
        """Nothing that flows into ``n`` is cut."""

    def new_group(self, width: int, name: str, uses: Sequence[Use]) -> int:
        """A new group of ``width`` channels made by ``name``, indexing ``uses``."""

    def consume(self, name: str, gid: int, inner: int, tensor: str, dim: int,
                scaled: bool = True) -> None:
        """Module ``name`` reads group ``gid`` through dimension ``dim`` of ``tensor``."""

    def flatten(self, a: Ann, shape: Sequence[int], start: int, end: int) -> Ann: ...

    def binary(self, n: fx.Node, operands: Sequence[Any], out: Any) -> Ann: ...

    def transpose(self, a: Ann, d0: int, d1: int, rank: int) -> Ann: ...

    def reduce(self, a: Ann, rank: int, dims: Any, keep: bool) -> Ann: ...

    def reshape(self, a: Ann, shape: Sequence[int], new: Sequence[int]) -> Ann: ...

    def attend(self, n: fx.Node) -> Ann: ...

    def getitem(self, n: fx.Node, out: Any) -> Any: ...

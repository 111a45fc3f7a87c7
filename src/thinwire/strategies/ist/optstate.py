"""The optimizer's per-parameter state across IST's repartitions.

With ``optimizer_state = reset`` (the original code) every round starts with fresh state: the
state of every parameter is dropped at the start and at the end of a round. With ``reindex`` the
per-element state (e.g. Adam's two moments) travels with the subnet's elements:
  1. at the end of the first round the state's names are read off the optimizer (tensors shaped
     like their parameter: :meth:`OptimizerState.harvest`); scalar entries (Adam's ``step``) are
     read again at the end of every round, so the next round goes on from them (every unit is
     trained in every round, so the step count is the same for all of them: Adam's bias
     correction then matches the moments' age);
  2. every round the subnet's state tensors travel beside its parameters, as extra copies of the
     same slices (:meth:`OptimizerState.of_subnet` on the way back);
  3. at the start of a round the received slices become the optimizer's state of the model's
     parameters (:meth:`OptimizerState.install`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def reindexes(optimizer_state: str, default: str) -> bool:
    """Whether ``optimizer_state`` deals the state with its units: ``reindex``, or ``auto``
    with the plan's ``default`` (``ISTPlan.default_optimizer_state``) being ``reindex``. One
    rule for IST's rounds and for its traffic formula."""
    return (default if optimizer_state == "auto" else optimizer_state) == "reindex"


class OptimizerState:
    """The optimizers' per-element state names and scalar entries (module docstring)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], reindex: bool) -> None:
        self.optimizers = list(optimizers)
        self.reindex = reindex
        self.keys: tuple[str, ...] = ()
        self.scalars: dict[str, Any] = {}

    def travelling(self) -> tuple[str, ...]:
        """The state names that travel with the pieces now (none before the first harvest)."""
        return self.keys if self.reindex else ()

    def harvest(self) -> bool:
        """Step 1: the state names (once) and the scalar entries (every round's end); True when
        the names were read now."""
        if not self.reindex:
            return False
        keys: set[str] = set()
        scalars: dict[str, Any] = {}
        for opt in self.optimizers:
            for p, st in opt.state.items():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0:
                        keys.add(k)
                    elif k not in scalars:
                        scalars[k] = v.clone() if isinstance(v, torch.Tensor) else v
        if scalars:
            self.scalars = scalars
        if self.keys:
            return False
        self.keys = tuple(sorted(keys))
        return True

    def of_subnet(self, tensors: Mapping[str, torch.Tensor], names: Sequence[str],
                  buffers: set[str]) -> dict[str, list[torch.Tensor]]:
        """Step 2: name -> [the model's tensor, *its state for ``keys``] for ``names``."""
        states: dict[int, dict[str, Any]] = {}
        for opt in self.optimizers:
            for p, st in opt.state.items():
                states[id(p)] = st
        out: dict[str, list[torch.Tensor]] = {}
        for name in names:
            x = tensors[name].data
            xs = [x]
            if self.reindex and name not in buffers and self.keys:
                st = states.get(id(tensors[name]), {})
                xs += [st[k] if k in st else torch.zeros_like(x) for k in self.keys]
            out[name] = xs
        return out

    def clear(self) -> None:
        """Drop every parameter's state (a round's start and end)."""
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    opt.state.pop(p, None)

    def install(self, tensors: Mapping[str, torch.Tensor],
                sub: Mapping[str, list[torch.Tensor]]) -> None:
        """Step 3: fresh state, then (when it travels) the received state slices."""
        self.clear()
        if not self.travelling():
            return
        names = {id(x): n for n, x in tensors.items()}
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    name = names.get(id(p))
                    if name is None or name not in sub:
                        continue
                    st: dict[str, Any] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                          for k, v in self.scalars.items()}
                    st.update(zip(self.keys, sub[name][1:]))
                    opt.state[p] = st

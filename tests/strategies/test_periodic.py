"""The periodic wrappers share one skeleton (PeriodicSync): the same one-line refusal of a bad
period naming the wrapper, no hook left behind by a refused wrapper, and a context manager
that removes the hook."""

from __future__ import annotations

import pytest
import torch

from thinwire.errors import UsageError
from thinwire.runtime.comm import Comm
from thinwire.strategies.averaging import LocalSGD, PeriodicSync
from thinwire.strategies.diloco import DiLoCo
from thinwire.strategies.sparseloco import SparseLoCo


def _parts() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 2)
    return (model, torch.optim.SGD(model.parameters(), lr=0.1),
            torch.optim.SGD(model.parameters(), lr=0.7))


def _build(kind: str, sync_every: int, **kw: object) -> tuple[PeriodicSync, torch.optim.Optimizer]:
    model, inner, outer = _parts()
    comm = Comm.local()
    if kind == "LocalSGD":
        return LocalSGD(model, inner, sync_every, comm=comm), inner
    if kind == "SparseLoCo":
        return SparseLoCo(model, inner, sync_every, comm=comm), inner
    return DiLoCo(model, inner, outer, sync_every, comm=comm, **kw), inner  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["LocalSGD", "SparseLoCo", "DiLoCo"])
def test_a_bad_period_is_one_line_naming_the_wrapper(kind: str) -> None:
    with pytest.raises(UsageError, match=f"^{kind} sync_every must be >= 1, got 0$"):
        _build(kind, 0)


@pytest.mark.parametrize("kind", ["LocalSGD", "SparseLoCo", "DiLoCo"])
def test_the_block_counts_steps_syncs_on_the_period_and_removes_its_hook(kind: str) -> None:
    wrapper, inner = _build(kind, 2)
    synced: list[int] = []
    sync = wrapper.sync
    wrapper.sync = lambda: (synced.append(wrapper.steps), sync())  # type: ignore[method-assign]
    with wrapper:
        for _ in range(4):
            inner.step()
        assert wrapper.steps == 4 and wrapper.state_dict()["steps"] == 4
    assert not inner._optimizer_step_post_hooks
    if kind != "DiLoCo":  # DiLoCo's hook starts and merges fragments itself (test_streaming)
        assert synced == [2, 4]


def test_a_refused_diloco_leaves_no_hook_on_the_optimizer() -> None:
    model, inner, outer = _parts()
    with pytest.raises(UsageError, match="alpha"):
        DiLoCo(model, inner, outer, 4, comm=Comm.local(), alpha=2.0)
    assert not inner._optimizer_step_post_hooks

"""IST as a context manager: a clean exit leaves every rank the full model (a round in
progress closed first), equal bit for bit to closing the round and gathering the full model by
hand; an error inside the block removes IST's hooks without communication."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from harness import run_workers
from torch import nn

from thinwire.models.adapter import linear_stack
from thinwire.runtime.comm import Comm
from thinwire.runtime.ledger import Ledger
from thinwire.strategies.ist.core import IST


def _setup(comm: Comm) -> tuple[nn.Module, torch.optim.Optimizer, IST]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ist = IST(model, opt, comm=Comm(ledger=Ledger(comm.rank)), local_steps=3,
              adapter=linear_stack(model), scale="none")
    return model, opt, ist


def _steps(comm: Comm, model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    g = torch.Generator().manual_seed(comm.rank)
    for _ in range(n):
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _with_block(comm: Comm) -> dict[str, torch.Tensor]:
    model, opt, ist = _setup(comm)
    with ist:
        _steps(comm, model, opt, 4)  # K = 3: the block is left one step into round 1
    assert ist.finished and not model._forward_pre_hooks
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _by_hand(comm: Comm) -> dict[str, torch.Tensor] | None:
    model, opt, ist = _setup(comm)
    _steps(comm, model, opt, 4)
    ist.end_round()
    full = ist.full_model()
    return None if full is None else {k: v.detach().clone() for k, v in full.state_dict().items()}


def _error_in_block(comm: Comm) -> tuple[int, int, bool, bool]:
    model, opt, ist = _setup(comm)
    ledger = ist.comm.ledger
    try:
        with ist:
            _steps(comm, model, opt, 1)
            before = ledger.by_op()
            raise ValueError("the user's loop failed")
    except ValueError:
        pass
    return (len(model._forward_pre_hooks), len(opt._optimizer_step_post_hooks), ist.finished,
            ledger.by_op() == before)


def test_a_clean_exit_leaves_every_rank_the_full_model() -> None:
    inside = run_workers(_with_block, 2)
    ref = run_workers(_by_hand, 2)[0]
    assert ref is not None
    for rank in inside:
        assert rank.keys() == ref.keys()
        for k in ref:
            assert torch.equal(rank[k], ref[k]), k
    # the test can fail: four steps of training moved the model
    torch.manual_seed(0)
    init = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                         nn.Linear(8, 3)).state_dict()
    assert any(not torch.equal(init[k], ref[k]) for k in ref)


def test_an_error_in_the_block_removes_the_hooks_without_communication() -> None:
    # the ledger holds every byte IST sends: an exit that communicated would add to it
    for hooks, post, finished, quiet in run_workers(_error_in_block, 2):
        assert (hooks, post, finished, quiet) == (0, 0, False, True)

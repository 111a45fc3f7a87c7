"""The original code's behaviour as options (docs/IST.md, "Deviations"): ``drop_last_step``
loses every round's K-th update, ``shards = whole`` gives every rank the whole training set in
the same order. Single process, no forks."""

from __future__ import annotations

import pytest
import torch
from ist_cases import CASES

from thinwire.builders import load_data, make_stream
from thinwire.config import load
from thinwire.errors import UsageError
from thinwire.runtime.comm import Comm
from thinwire.strategies.ist.core import IST
from thinwire.strategies.ist.method import data_shard


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_drop_last_step_loses_the_kth_update(name: str) -> None:
    """n = 1, K = 3, plain SGD: rounds of IST with ``drop_last_step`` equal a plain loop that
    skips the update of every third batch (its forward and backward still happen, as in the
    original script), bit for bit."""
    case, k, steps, lr = CASES[name], 3, 6, 0.05
    model = case.build()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ist = IST(model, opt, comm=Comm.local(), local_steps=k, adapter=case.adapter(model),
              drop_last_step=True)
    plain = case.build()
    p_opt = torch.optim.SGD(plain.parameters(), lr=lr)
    for step in range(steps):
        x, y = case.batch(0, step)
        for m, o, skip in ((model, opt, False), (plain, p_opt, step % k == k - 1)):
            o.zero_grad()
            case.loss(m(x), y).backward()
            if not skip:
                o.step()
    full = ist.full_model()
    assert full is not None
    moved = False
    for key, v in plain.state_dict().items():
        assert torch.equal(full.state_dict()[key], v), key
        moved |= not torch.equal(v, case.build().state_dict()[key])
    assert moved


def test_drop_last_step_needs_two_local_steps() -> None:
    case = CASES["mlp"]
    model = case.build()
    with pytest.raises(UsageError, match="local_steps >= 2"):
        IST(model, torch.optim.SGD(model.parameters(), lr=0.1), comm=Comm.local(),
            local_steps=1, drop_last_step=True)
    with pytest.raises(UsageError, match="method.drop_last_step"):
        load(None, {"method.name": "ist", "method.local_steps": "1",
                    "method.drop_last_step": "true"})


@pytest.mark.parametrize("shards", ["own", "whole"])
def test_whole_data_gives_every_rank_the_same_batches(shards: str) -> None:
    cfg = load(None, {"method.name": "ist", "method.shards": shards, "data.name": "teacher",
                      "runtime.workers": "2"})
    ds = load_data(cfg)
    o = cfg.method.options
    batches = [make_stream(cfg, ds, *data_shard(o, r, 2)).batch(5)[0] for r in range(2)]
    assert torch.equal(batches[0], batches[1]) == (shards == "whole")
    assert data_shard(o, 1, 2) == ((0, 1) if shards == "whole" else (1, 2))

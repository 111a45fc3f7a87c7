"""DeMo: two steps on two ranks against Algorithm 1 of arXiv 2411.19870 written out by hand
(scipy's orthonormal DCT on each block); the traffic formula equals the ledger; checkpoints
resume exactly; bad settings are one line."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness import run_workers
from loco_cases import LR, batch, cfg, flat, model, resumes_exactly, run
from scipy.fft import dctn, idctn

from thinwire.compression.dct import blocks_of
from thinwire.config import load
from thinwire.errors import UsageError
from thinwire.runtime.comm import Comm
from thinwire.strategies import METHODS
from thinwire.strategies.demo import DeMo
from thinwire.strategies.traffic import Layout

BETA, TOPK, CHUNK, STEPS = 0.9, 8, 8, 2
OPTS = {"beta": BETA, "topk": TOPK, "chunk": CHUNK}


def _blocks(shape: tuple[int, ...]) -> list[tuple[slice, slice]]:
    rows, cols, sr, sc = blocks_of(shape, CHUNK)
    return [(slice(i, i + sr), slice(j, j + sc)) for i in range(0, rows, sr)
            for j in range(0, cols, sc)]


def _by_hand(comm: Comm) -> torch.Tensor:
    m = model()
    params = list(m.parameters())
    mom = [np.zeros(p.detach().reshape(p.shape[0], -1).shape if p.dim() > 1
                    else (1, p.numel())) for p in params]
    for step in range(STEPS):
        x, y = batch(comm.rank, step)
        m.zero_grad()
        F.cross_entropy(m(x), y).backward()
        with torch.no_grad():
            for p, mo in zip(params, mom):
                g = p.grad.detach().reshape(mo.shape).double().numpy()
                mo *= BETA  # 2. m <- beta m + lr g
                mo += LR * g
                q = np.zeros_like(mo)
                for rs, cs in _blocks(tuple(p.shape)):  # 3. top-k of each block's DCT
                    c = dctn(mo[rs, cs], norm="ortho")
                    flat_c = c.reshape(-1)
                    top = np.argsort(-np.abs(flat_c), kind="stable")[:TOPK]
                    kept = np.zeros_like(flat_c)
                    kept[top] = flat_c[top]
                    q[rs, cs] = idctn(kept.reshape(c.shape), norm="ortho")
                mo -= q  # 4. m <- m - IDCT(q)
                # 5-6. the mean over ranks of the decoded components (IDCT is linear)
                u = sum(comm.all_gather(torch.from_numpy(q))) / comm.world_size
                p.sub_(LR * torch.sign(u).reshape(p.shape).float())  # 7.
    return flat(m)


def _runs(comm: Comm) -> dict[str, Any]:
    return {"strategy": run(comm, cfg("demo", **OPTS), STEPS), "hand": _by_hand(comm)}


@pytest.fixture(scope="module")
def world2() -> list[dict[str, Any]]:
    return run_workers(_runs, 2, timeout=240)


def test_steps_match_algorithm_1_by_hand(world2: list[dict[str, Any]]) -> None:
    """Guards DeMo's steps 2-7: momentum, blocked DCT, top-k per block, the extracted part taken
    from the momentum, the mean of every rank's coefficients, the sign step. The sign makes the
    comparison exact unless a component of u is within float32 rounding of 0 (none here; one
    wrong block, coefficient or sign moves an entry by 2 lr = 0.2)."""
    for out in world2:
        assert torch.allclose(out["strategy"]["params"], out["hand"], rtol=0, atol=1e-6)
    assert torch.equal(world2[0]["strategy"]["params"], world2[1]["strategy"]["params"])


def test_traffic_formula_equals_the_ledger(world2: list[dict[str, Any]]) -> None:
    """Guards the planner's price of DeMo: one all-gather a step of 6 bytes a kept coefficient
    (blocks of 8 x 8 and 1 x 8 here, 8 kept of each), equal to the formula."""
    layout = Layout.of_model(model())
    config = cfg("demo", **OPTS)
    traffic = METHODS.get("demo").traffic(layout, config.method.options, 2, STEPS, 0, 0)
    # (16,8): 2 blocks; (16,): 2; (16,16): 4; (16,): 2; (4,16): 4x8 blocks, 2; (4,): 1 of 4
    kept = 8 * (2 + 2 + 4 + 2 + 2) + 4
    for rank, out in enumerate(world2):
        assert out["strategy"]["ledger"] == [("all_gather", "grad", 6 * kept)] * STEPS
        assert out["strategy"]["sent"] == traffic.sent[rank]
        assert out["strategy"]["payload"] == traffic.payload[rank]


def test_checkpoint_resumes_exactly() -> None:
    """Guards DeMo's checkpoint state (the decoupled momenta, in the optimizer's state)."""
    assert resumes_exactly(cfg("demo", **OPTS), 3, 3)


def test_bad_settings_are_one_line() -> None:
    """Guards DeMo's checks: it is its own optimizer, so another is refused; bad options too."""
    from thinwire.options import OptionError

    with pytest.raises(UsageError, match="its own optimizer"):
        METHODS.get("demo").check(load(None, {"method.name": "dp", "train.optimizer": "adamw"}))
    with pytest.raises(OptionError, match="method.chunk"):
        cfg("demo", chunk=200)
    with pytest.raises(UsageError, match="DeMo needs"):
        DeMo(model().parameters(), lr=0.1, chunk=0, comm=Comm.local())



def test_demo_is_a_context_manager_that_frees_its_bases_and_still_trains() -> None:
    """Leaving the block frees the cached DCT bases; the next step rebuilds them and takes the
    same update as an optimizer that was never closed (the bases are a pure cache)."""
    nets = [model(), model()]
    opts = [DeMo(n.parameters(), lr=0.1, comm=Comm.local()) for n in nets]
    for step in range(2):
        x, y = batch(0, step)
        for net, opt in zip(nets, opts):
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            if step == 0 and opt is opts[0]:
                with opt:
                    opt.step()
                assert not opt._dct
            else:
                opt.step()
    assert opts[0]._dct and opts[1]._dct
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(a, b)

"""The communication layer records exactly what it sends (multi-process, gloo)."""

import pytest
import torch
from harness import run_workers

from thinwire.runtime.comm import Comm
from thinwire.runtime.ledger import wire_estimate


def _collectives(comm: Comm) -> dict:
    t = torch.full((1000,), float(comm.rank + 1))
    comm.all_reduce(t, tag="x")
    mean = comm.all_reduce(torch.full((3,), float(comm.rank + 1)), op="avg", tag="m")
    g = comm.all_gather(torch.tensor([comm.rank], dtype=torch.int64), tag="y")
    b = torch.arange(10, dtype=torch.float32) if comm.rank == 0 else torch.zeros(10)
    comm.broadcast(b, src=0, tag="z")
    peer = (comm.rank + 1) % comm.world_size
    src = (comm.rank - 1) % comm.world_size
    buf = torch.empty(7, dtype=torch.float64)
    comm.exchange([(peer, torch.full((7,), float(comm.rank), dtype=torch.float64))], [(src, buf)])
    fut = comm.all_reduce_async(torch.ones(4), tag="a")
    fut.wait()
    n = comm.world_size
    gathered = torch.empty(3 * n)  # FSDP2's interface: into one flat tensor, async work handle
    comm.all_gather_into(gathered, torch.full((3,), float(comm.rank)), async_op=True,
                         tag="ag").wait()
    part = torch.empty(2)
    comm.reduce_scatter_into(part, torch.arange(2.0 * n) + comm.rank, tag="rs")
    return {"sum": t[0].item(), "mean": mean.tolist(), "into": gathered.tolist(), "part": part.tolist(), "gather": [int(x) for x in g], "bcast": b.tolist(),
            "p2p": buf[0].item(), "by_op": comm.ledger.by_op(), "totals": comm.ledger.totals()}


@pytest.mark.parametrize("n", [2, 4])
def test_collectives_values_and_bytes(n: int) -> None:
    out = run_workers(_collectives, n)
    for r, o in enumerate(out):
        assert o["sum"] == n * (n + 1) / 2
        assert o["mean"] == [(n + 1) / 2] * 3  # op="avg": the mean, not a sum or a biased mean
        assert o["gather"] == list(range(n))
        assert o["bcast"] == list(range(10))
        assert o["p2p"] == float((r - 1) % n)
        ops = o["by_op"]
        assert ops["all_reduce:x"]["payload"] == 4000
        assert ops["all_reduce:x"]["sent"] == round(2 * (n - 1) / n * 4000)
        assert ops["all_gather:y"]["sent"] == (n - 1) * 8
        assert ops["broadcast:z"]["payload"] == 40
        assert ops["send"]["sent"] == 56 and ops["recv"]["recv"] == 56
        assert ops["all_reduce:a"]["payload"] == 16
        assert o["into"] == [float(q) for q in range(n) for _ in range(3)]
        # rank r keeps elements 2r, 2r+1 of the sum over ranks q of (arange + q)
        assert o["part"] == [n * (2 * r + i) + n * (n - 1) / 2 for i in range(2)]
        assert ops["all_gather:ag"]["payload"] == 12
        assert ops["all_gather:ag"]["sent"] == (n - 1) * 12
        assert ops["reduce_scatter:rs"]["payload"] == 8 * n
        assert ops["reduce_scatter:rs"]["sent"] == round((n - 1) / n * 8 * n)
    # broadcast: the root sends once, the others forward along a chain: n-1 copies in all
    total_bcast = sum(o["by_op"]["broadcast:z"]["sent"] for o in out)
    assert abs(total_bcast - (n - 1) * 40) <= n


def test_wire_estimate_formulas() -> None:
    assert wire_estimate("all_reduce", 1000, 4) == (1500, 1500)
    assert wire_estimate("all_gather", 10, 4) == (30, 30)
    assert wire_estimate("send", 5, 2) == (5, 0)
    assert wire_estimate("reduce_scatter", 1000, 4) == (750, 750)
    assert wire_estimate("all_reduce", 1000, 1) == (0, 0)

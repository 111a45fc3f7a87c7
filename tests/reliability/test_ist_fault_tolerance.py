"""IST without a restart (torchft quorum): a worker SIGKILLed mid-round loses only its round,
the next round deals the units over the live workers, a worker joining later receives its
subnet at the next round boundary. Each worker is one process (tests/reliability/
ist_replica.py) on a lighthouse in this process; every process is bounded and torn down."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from harness import FT_HEARTBEAT_MS, wait_until

pytest.importorskip("torchft")
os.environ.setdefault("RUST_LOG", "error")

from thinwire.runtime.ft import FaultToleranceError, Lighthouse, lighthouse_status  # noqa: E402
from thinwire.strategies.ist.partition import partition_groups, resolve_overlap  # noqa: E402

HERE = Path(__file__).parent
SRC = HERE.parents[1] / "src"
sys.path.insert(0, str(HERE))
import ist_replica  # noqa: E402

pytestmark = pytest.mark.timeout(150)


def _run(tmp: Path, lighthouse: str, args: dict[int, list[str]], rounds: int,
         timeout: float = 100, meanwhile: Callable[[], None] | None = None) -> dict[int, int]:
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1", RUST_LOG="error")
    procs = {i: subprocess.Popen([sys.executable, str(HERE / "ist_replica.py"), str(i),
                                  lighthouse, str(tmp), str(rounds), *a], env=env,
                                 stdout=subprocess.DEVNULL, stderr=open(tmp / f"err{i}", "w"))
             for i, a in args.items()}
    codes: dict[int, int] = {}
    try:
        if meanwhile is not None:
            meanwhile()
        for i, p in procs.items():
            codes[i] = p.wait(timeout=timeout)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes


def kill_first_and_join(tmp: Path, first: list[str], rounds: int) -> dict[int, dict]:
    """Workers 0-2 begin (``first``: their options, a ``--hold`` first), worker 0 dies in round
    1, workers 1 and 2 hold before round 3 until worker 3's quorum request is in, worker 3
    joins there; every other worker ends cleanly. Each survivor's saved output."""
    survivor = [*first, "--hold", "3:go"]
    with Lighthouse(min_workers=2, join_timeout_ms=3000,
                    heartbeat_timeout_ms=FT_HEARTBEAT_MS) as lh:
        codes = _run(tmp, lh.address, {0: [*first, "--die-at", "1"], 1: survivor,
                                       2: survivor, 3: ["--after", "3:1,2", *first[2:]]},
                     rounds, meanwhile=lambda: release_joiner(tmp, lh.address))
    assert codes == {0: -9, 1: 0, 2: 0, 3: 0}, (codes, [(tmp / f"err{i}").read_text()[-800:]
                                                       for i in codes])
    return {i: torch.load(tmp / f"worker{i}.pt") for i in (1, 2, 3)}


def release_joiner(tmp: Path, lighthouse: str) -> None:
    """Once workers 1 and 2 hold before round 3 and the lighthouse holds worker 3's quorum
    request (torchft's fast quorum would otherwise leave a late request out), let them go."""

    def joiner_waiting() -> bool:
        return (all((tmp / f"holding3.{i}").exists() for i in (1, 2))
                and "only have 1 participants" in lighthouse_status(lighthouse))

    wait_until(joiner_waiting, 120, "worker 3 waiting in the lighthouse before round 3")
    (tmp / "readygo").touch()


CUT = (0, 0, 1, None)
"""The dimension of W1, b1, W2 and b2 the hidden units cut (None: b2, shared by every subnet)."""


def _reference(log: list[tuple[int, list[int], list[int]]], lr: float, overlap: int,
               momentum: float = 0.0, *, build: Callable[[], torch.nn.Module] = ist_replica.build,
               batch: Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]] =
               ist_replica.batch,
               loss: Callable[..., torch.Tensor] = torch.nn.functional.mse_loss,
               local_steps: int = ist_replica.K,
               outer: tuple[float, float] = (1.0, 0.0), buffers: bool = False
               ) -> list[torch.Tensor]:
    """IST's rule on the same live sets, one process, written out for the 4-12-3 MLP: round r
    deals the hidden units over the workers that began it (sorted), each worker that closed it
    trains its subnet (rows of W1 and b1, columns of W2, the whole b2; the hidden output scaled
    by 12 / units held) for K steps of SGD from the round-start values; every unit becomes the
    mean of the copies that came back (none: unchanged), b2 its base plus the sum of the
    closers' deltas, in worker order, over their number. With momentum the buffers are dealt
    with their units (``reindex``): fresh in round 0, stored (zero where nobody trained) from
    its end on, and written back by the same rule. ``outer`` (lr, momentum): then every tensor
    takes IST's outer step on the round's change (g = round start - assembled, Nesterov
    momentum b kept per tensor from the first close on, the tensor set to assembled -
    (lr (g + m b) - g)). ``build``, ``batch`` (worker, round, local
    step), ``loss`` and ``local_steps``: another one-hidden-layer network with biases (W1, b1, W2, b2),
    its batches, loss and local steps (the trainer's test: 64-12-10 on digits). ``buffers``:
    the stored momentum buffers instead of the parameters."""
    copies = [[p.detach().clone() for p in build().parameters()]]
    width, fan_in, fan_out = copies[0][0].shape[0], copies[0][0].shape[1], copies[0][2].shape[0]
    bufs: dict[int, torch.Tensor] = {}
    for r, began, closed in log:
        start = list(copies[0])
        order = sorted(began)
        m = len(order)
        held = partition_groups([("0", width, "disjoint")], m, 0, r,
                                min(resolve_overlap(overlap, m), m))["0"]
        count = torch.zeros(width, dtype=torch.int32)
        trained: list[tuple[torch.Tensor, list[list[torch.Tensor]]]] = []
        for i, x in enumerate(order):
            if x not in closed:
                continue
            u = torch.as_tensor(held[i], dtype=torch.long)
            sub = torch.nn.Sequential(torch.nn.Linear(fan_in, len(u)), torch.nn.ReLU(),
                                      torch.nn.Linear(len(u), fan_out))
            params = list(sub.parameters())
            with torch.no_grad():
                for p, base, dim in zip(params, copies[0], CUT):
                    p.copy_(base if dim is None else base.index_select(dim, u))
            f = width / len(u)
            sub[2].register_forward_pre_hook(lambda _m, a, f=f: (a[0] * f, *a[1:]))
            opt = torch.optim.SGD(params, lr=lr, momentum=momentum)
            if len(copies) > 1:
                for p, buf, dim in zip(params, copies[1], CUT):
                    opt.state[p]["momentum_buffer"] = (
                        buf.clone() if dim is None else buf.index_select(dim, u))
            for s in range(local_steps):
                xb, yb = batch(x, r, s)
                opt.zero_grad()
                loss(sub(xb), yb).backward()
                opt.step()
            count[u] += 1
            back = [[p.detach() for p in params]]
            if momentum:
                back.append([opt.state[p]["momentum_buffer"] for p in params])
            trained.append((u, back))
        if momentum and len(copies) == 1:  # the state's names known: stored, zero
            copies.append([torch.zeros_like(x) for x in copies[0]])
        hit, c = count > 0, count.clamp(min=1).float()
        for k, bases in enumerate(copies):
            for j, dim in enumerate(CUT):
                base = bases[j]
                if dim is None:
                    total = None
                    for _, back in trained:
                        d = back[k][j] - base
                        total = d.clone() if total is None else total.add_(d)
                    assert total is not None
                    bases[j] = base.clone().add_(total, alpha=1.0 / len(closed))
                    continue
                acc = torch.zeros_like(base)
                for u, back in trained:
                    acc.index_add_(dim, u, back[k][j])
                shape = [1] * base.dim()
                shape[dim] = -1
                bases[j] = torch.where(hit.view(shape), acc / c.view(shape), base)
        if outer != (1.0, 0.0):
            _outer_step(start, copies[0], bufs, *outer)
    return copies[1] if buffers else copies[0]


def _outer_step(start: list[torch.Tensor], after: list[torch.Tensor],
                bufs: dict[int, torch.Tensor], lr: float, momentum: float) -> None:
    """IST's outer step (``Store.outer_step``) on each tensor, written out."""
    for j, (b0, a) in enumerate(zip(start, after)):
        g = b0 - a
        if j not in bufs:
            bufs[j] = g.clone()
        else:
            bufs[j].mul_(momentum).add_(g)
        u = g + momentum * bufs[j] if momentum else g
        after[j] = a - (lr * u - g)


@pytest.mark.parametrize(("overlap", "momentum", "outer"), [(1, 0.0, (1.0, 0.0)),
                                                           (2, 0.9, (0.7, 0.9))])
def test_keeper_killed_mid_round_and_one_joining(tmp_path: Path, overlap: int,
                                                 momentum: float,
                                                 outer: tuple[float, float]) -> None:
    """3 workers, keepers 0 and 1; worker 0 (the keeper that sends the subnets) SIGKILLs itself
    after the first of round 1's two local steps. Workers 1 and 2 close round 1 without it
    (its units keep their round-start values), worker 2 becomes a keeper from worker 1's copy
    (ledgered as recovery), round 2 deals the units over {1, 2}; worker 3 starts while they
    hold before round 3 (released once the lighthouse holds its quorum request), joins there (its boundary state healed over the ledger) and trains
    rounds 3-4. Every survivor ends with the same full model, bit for bit, equal to the
    one-process reference of IST's rule on the same live sets. With overlap 2 every unit is on
    2 of 3 workers: worker 0's units end round 1 at their live holder's copy, and round 2's
    two workers both hold every unit (the mean of the two). That case runs momentum SGD, its
    buffers dealt with their units: the new keeper receives them with the store, the joiner
    the shared tensor's buffer with its boundary state. It also runs IST's outer optimizer (lr
    0.7, Nesterov momentum 0.9 on each round's change): the new keeper receives the cut
    tensors' outer momentum with the store, the joiner the shared tensor's with its boundary
    state, and the reference applies the same outer step to the same live sets. Both keepers'
    stored models are equal bit for bit before the full model is sent out."""
    rounds = 5
    first = ["--hold", "0:0,1,2", "--overlap", str(overlap), "--momentum", str(momentum),
             "--outer", f"{outer[0]}:{outer[1]}"]
    out = kill_first_and_join(tmp_path, first, rounds)
    log = out[1]["log"]
    assert out[2]["log"] == log
    assert [(r, b, c) for r, b, c in log] == [
        (0, [0, 1, 2], [0, 1, 2]), (1, [0, 1, 2], [1, 2]), (2, [1, 2], [1, 2]),
        (3, [1, 2, 3], [1, 2, 3]), (4, [1, 2, 3], [1, 2, 3])], log
    assert out[3]["log"] == log[3:] and out[3]["joined"] == 3
    assert out[1]["keepers"] == out[2]["keepers"] == out[3]["keepers"] == [1, 2]
    # worker 2 became a keeper from worker 1's copy, worker 3 healed from a peer: both ledgered
    assert out[1]["bytes"].get("recovery", 0) > 0 and out[3]["bytes"].get("recovery", 0) > 0
    for i in (2, 3):
        for a, b in zip(out[1]["params"], out[i]["params"]):
            assert torch.equal(a, b), i
    assert out[3]["stored"] is None
    for a, b in zip(out[1]["stored"].values(), out[2]["stored"].values()):
        assert torch.equal(a, b)
    ref = _reference(log, 0.05, overlap, momentum, outer=outer)
    for a, b in zip(out[1]["params"], ref):
        assert torch.equal(a, b), (a - b).abs().max()
    # the loss mattered: with worker 0 closing round 1 the model differs
    whole = _reference([(0, [0, 1, 2], [0, 1, 2]), (1, [0, 1, 2], [0, 1, 2]), *log[2:]], 0.05,
                       overlap, momentum, outer=outer)
    assert max((a - b).abs().max().item() for a, b in zip(ref, whole)) > 1e-3


def test_lr_zero_through_a_loss_leaves_the_model_unchanged(tmp_path: Path) -> None:
    """lr = 0, overlapping subnets (each unit on 2 of 3 workers): worker 2 (not a keeper) dies
    mid-round 1; the survivors finish rounds 1-2 and their model is the initial one, bit for
    bit (the live holders' mean of unchanged copies is the copy, the shared tensor's deltas
    are zero)."""
    first = ["--hold", "0:0,1,2", "--lr", "0", "--overlap", "2"]
    with Lighthouse(min_workers=2, join_timeout_ms=3000,
                    heartbeat_timeout_ms=FT_HEARTBEAT_MS) as lh:
        codes = _run(tmp_path, lh.address, {0: first, 1: first,
                                            2: [*first, "--die-at", "1"]}, 3)
    assert codes == {0: 0, 1: 0, 2: -9}, (codes, [(tmp_path / f"err{i}").read_text()[-800:]
                                                 for i in codes])
    out = {i: torch.load(tmp_path / f"worker{i}.pt") for i in (0, 1)}
    assert out[0]["log"][1] == (1, [0, 1, 2], [0, 1])
    for a, b in zip(out[0]["params"], ist_replica.build().parameters()):
        assert torch.equal(a, b.detach())
    for a, b in zip(out[0]["params"], out[1]["params"]):
        assert torch.equal(a, b)


def test_the_only_keeper_lost_ends_with_one_line(tmp_path: Path) -> None:
    """keepers 1: worker 0 stores the model alone and dies mid-round 1; the survivors' close
    finds no live copy of the model and each ends with one line naming it, no traceback."""
    first = ["--hold", "0:0,1,2", "--keepers", "1"]
    with Lighthouse(min_workers=2, join_timeout_ms=3000,
                    heartbeat_timeout_ms=FT_HEARTBEAT_MS) as lh:
        codes = _run(tmp_path, lh.address, {0: [*first, "--die-at", "1"], 1: first, 2: first}, 3)
    assert codes == {0: -9, 1: 3, 2: 3}, codes
    for i in (1, 2):
        err = (tmp_path / f"err{i}").read_text()
        lines = [ln for ln in err.splitlines() if ln.startswith("fault tolerance:")]
        assert len(lines) == 1 and "every worker storing the model" in lines[0], err[-800:]
        assert "Traceback" not in err


def test_too_few_units_for_the_workers_is_refused_in_one_line() -> None:
    """A hidden layer of 12 units cannot be cut into 16 subnets: one line."""
    from thinwire.errors import UsageError
    from thinwire.models.graph_adapter import derive_adapter
    from thinwire.strategies.ist.fault import FaultTolerantIST

    model = ist_replica.build()
    adapter = derive_adapter(model, torch.zeros(2, 4), min_units=2)
    with Lighthouse(min_workers=1) as lh, pytest.raises(UsageError, match="16 subnets") as info:
        FaultTolerantIST(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         replica_id="worker0", lighthouse=lh.address, workers=16,
                         adapter=adapter)
    assert "\n" not in str(info.value)


def test_a_replica_id_without_a_number_is_refused_in_one_line() -> None:
    from thinwire.strategies.ist.fault import replica_number

    assert replica_number("worker12") == 12
    with pytest.raises(FaultToleranceError, match="ends in no number") as info:
        replica_number("worker")
    assert "\n" not in str(info.value)

"""Sharded IST without a restart (torchft quorum): every block of units on two workers, a
worker SIGKILLed mid-round loses only its round and its blocks are copied to the survivors, a
worker joining later becomes a holder at the next round boundary, and losing both holders of
a block ends the job in one line. Each worker is one process (tests/reliability/
ist_replica.py) on a lighthouse in this process; every process is bounded and torn down."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from harness import FT_HEARTBEAT_MS

pytest.importorskip("torchft")
os.environ.setdefault("RUST_LOG", "error")

from thinwire.runtime.ft import FaultToleranceError, Lighthouse  # noqa: E402
from thinwire.strategies.ist.fault_sharded import assign, initial_holders  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import ist_replica  # noqa: E402
from test_ist_fault_tolerance import _reference, _run, kill_first_and_join  # noqa: E402

pytestmark = pytest.mark.timeout(150)


def test_holders_move_only_what_lost_a_copy() -> None:
    """The holders' rule (fault_sharded.assign) on the runs below and a loss of 4 workers:
    a block keeps its live holders, a block that lost one gets the least loaded survivor, a
    joiner takes blocks from the most loaded until loads differ by at most one; a block with
    no live holder is named."""
    first = initial_holders(3, [0, 1, 2], 2)
    assert first == [[0, 1], [1, 2], [2, 0]]
    after = assign(first, [{1}, {1, 2}, {2}], [1, 2], 2)
    assert after == [[1, 2], [1, 2], [2, 1]]
    joined = assign(after, [{1, 2}] * 3, [1, 2, 3], 2)
    assert joined == [[1, 2], [3, 2], [3, 1]]
    four = initial_holders(4, [0, 1, 2, 3], 2)
    lost_two = assign(four, [{1}, {1, 2}, {2, 3}, {3}], [1, 2, 3], 2)
    moved = sum(len(set(b) - set(a)) for a, b in zip(four, lost_two))
    assert moved == 2 and sorted(sum(lost_two, [])) == [1, 1, 1, 2, 2, 2, 3, 3], lost_two
    with pytest.raises(ValueError) as info:
        assign(four, [set(), {2}, {2, 3}, {3}], [2, 3], 2)
    assert info.value.args == (0,)


def test_sharded_owner_killed_mid_round_and_one_joining(tmp_path: Path) -> None:
    """3 workers, 3 blocks each on 2 of them ([0, 1], [1, 2], [2, 0]), overlapping subnets
    (each unit on 2 of 3 workers) and momentum SGD, its buffers dealt with their units;
    worker 0 (primary of block 0) SIGKILLs itself after the first of round 1's two local
    steps. Workers 1 and 2 close round 1 without it (its units keep their live holder's
    copy), block 0 is copied from worker 1 to worker 2 and block 2 from worker 2 to worker 1
    (ledgered as recovery), round 2 is dealt over {1, 2}; worker 3 joins before round 3
    (healed, then holder of blocks 1 and 2, copied to it). Every survivor ends with the same
    full model, equal bit for bit to the one-process reference of IST's rule on the same
    live sets (the same reference as the central store's: the store's layout changes no
    value); worker 1, the lowest live, holds the one-worker state finish assembled: the final
    model and the reference's momentum buffers, bit for bit."""
    rounds = 5
    first = ["--hold", "0:0,1,2", "--overlap", "2", "--momentum", "0.9",
             "--deployment", "sharded"]
    out = kill_first_and_join(tmp_path, first, rounds)
    log = out[1]["log"]
    assert out[2]["log"] == log and out[3]["log"] == log[3:] and out[3]["joined"] == 3
    assert [(r, b, c) for r, b, c in log] == [
        (0, [0, 1, 2], [0, 1, 2]), (1, [0, 1, 2], [1, 2]), (2, [1, 2], [1, 2]),
        (3, [1, 2, 3], [1, 2, 3]), (4, [1, 2, 3], [1, 2, 3])], log
    for i in (1, 2, 3):
        assert out[i]["holders"] == [[1, 2], [3, 2], [3, 1]], (i, out[i]["holders"])
        assert out[i]["stored"] is None  # no worker stores the whole model between rounds
        assert out[i]["bytes"].get("recovery", 0) > 0, (i, out[i]["bytes"])
    for i in (2, 3):
        for a, b in zip(out[1]["params"], out[i]["params"]):
            assert torch.equal(a, b), i
    ref = _reference(log, 0.05, 2, 0.9)
    for a, b in zip(out[1]["params"], ref):
        assert torch.equal(a, b), (a - b).abs().max()
    # worker 1, the lowest live, holds the whole store finish assembled, momentum included
    assert out[2]["written"] is None and out[3]["written"] is None
    written = out[1]["written"]
    names = [n for n, _ in ist_replica.build().named_parameters()]
    moms = _reference(log, 0.05, 2, 0.9, buffers=True)
    for n, p, m in zip(names, out[1]["params"], moms):
        assert torch.equal(written["store"][n], p), n
        assert torch.equal(written["state_store"][f"{n}|momentum_buffer"], m), n
    whole = _reference([(0, [0, 1, 2], [0, 1, 2]), (1, [0, 1, 2], [0, 1, 2]), *log[2:]], 0.05,
                       2, 0.9)
    assert max((a - b).abs().max().item() for a, b in zip(ref, whole)) > 1e-3


def test_both_holders_of_a_block_lost_end_in_one_line(tmp_path: Path) -> None:
    """4 workers, block 0 on workers 0 and 1; both SIGKILL themselves mid-round 1. Workers 2
    and 3 close the round, find no live copy of block 0 and each ends with one line naming
    it (and its workers), no traceback."""
    first = ["--hold", "0:0,1,2,3", "--workers", "4", "--deployment", "sharded"]
    with Lighthouse(min_workers=2, join_timeout_ms=3000,
                    heartbeat_timeout_ms=FT_HEARTBEAT_MS) as lh:
        codes = _run(tmp_path, lh.address, {0: [*first, "--die-at", "1"],
                                            1: [*first, "--die-at", "1"], 2: first, 3: first},
                     3)
    assert codes == {0: -9, 1: -9, 2: 3, 3: 3}, codes
    for i in (2, 3):
        err = (tmp_path / f"err{i}").read_text()
        lines = [ln for ln in err.splitlines() if ln.startswith("fault tolerance:")]
        assert len(lines) == 1 and "block 0" in lines[0] and "workers [0, 1]" in lines[0], \
            err[-800:]
        assert "Traceback" not in err


def test_sharded_outer_optimizer_is_refused_in_one_line() -> None:
    from thinwire.strategies.ist.fault import FaultTolerantIST

    model = ist_replica.build()
    with pytest.raises(FaultToleranceError, match="outer_lr") as info:
        FaultTolerantIST(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         replica_id="worker0", lighthouse="http://127.0.0.1:1", workers=3,
                         deployment="sharded", example_input=torch.zeros(2, 4), outer_lr=0.5)
    assert "\n" not in str(info.value)

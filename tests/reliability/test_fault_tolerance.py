"""Fault tolerance without a restart (torchft quorum): a worker SIGKILLed mid-run, a worker
joining later, too few workers left. Each replica group is one process (tests/reliability/
ft_replica.py) on a lighthouse in this process; every process is bounded and torn down."""

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

from thinwire.runtime.ft import Lighthouse, lighthouse_status  # noqa: E402

HERE = Path(__file__).parent
SRC = HERE.parents[1] / "src"
sys.path.insert(0, str(HERE))
import ft_replica  # noqa: E402

pytestmark = pytest.mark.timeout(150)


def _run(tmp: Path, lighthouse: str, args: dict[int, list[str]], steps: int,
         timeout: float = 100, meanwhile: Callable[[], None] | None = None) -> dict[int, int]:
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1", RUST_LOG="error")
    procs = {i: subprocess.Popen([sys.executable, str(HERE / "ft_replica.py"), str(i),
                                  lighthouse, str(tmp), str(steps), *a], env=env,
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


def release_joiner(tmp: Path, lighthouse: str) -> None:
    """Once replicas 0 and 1 hold before step 10 and the lighthouse holds replica 3's quorum
    request alone, let them go (their requests then complete the quorum with it)."""

    def joiner_waiting() -> bool:
        return (all((tmp / f"holding10.{i}").exists() for i in (0, 1))
                and "only have 1 participants" in lighthouse_status(lighthouse))

    wait_until(joiner_waiting, 90, "replica 3 waiting in the lighthouse before step 10")
    (tmp / "readygo").touch()


def _reference(live: dict[int, list[int]], steps: int) -> list[torch.Tensor]:
    """Momentum SGD where step t's gradient is the mean over the replicas live at t (the
    algorithm's rule applied to the same live sets, one process)."""
    model, opt = ft_replica.build()
    for t in range(steps):
        grads = []
        for r in live[t]:
            model.zero_grad()
            x, y = ft_replica.batch(r, t)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for j, p in enumerate(model.parameters()):
            p.grad = sum(g[j] for g in grads) / len(grads)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("codec", ["none", "topk:ratio=0.5"])
def test_worker_killed_and_one_joining(tmp_path: Path, codec: str) -> None:
    """3 replicas; replica 2 SIGKILLs itself inside step 5 (after the quorum formed, so the
    survivors lose that step and redo it); replica 3 starts late and joins at step 10 (the
    survivors hold there until its quorum request is in the lighthouse: torchft's fast quorum
    would otherwise form without a request that comes late). Survivors finish without a restart; every
    committed step's mean is over its live quorum; the joiner recovered a live peer's model and
    momentum and ends equal to its peers bit for bit. With top-k and its error feedback the
    same holds but the reference (codec "none" only): the joiner's residual starts at zero,
    its peers' are their own, yet the models agree, since every member decodes the same
    gathered payloads."""
    steps = 16
    first = ["--hold", "0:0,1,2", "--codec", codec]
    survivor = [*first, "--hold", "10:go"]
    with Lighthouse(min_workers=2, join_timeout_ms=3000,
                    heartbeat_timeout_ms=FT_HEARTBEAT_MS) as lh:
        codes = _run(tmp_path, lh.address, {
            0: survivor, 1: survivor, 2: [*first, "--die-at", "5"],
            3: ["--after", "10:0,1", "--codec", codec]}, steps,
            meanwhile=lambda: release_joiner(tmp_path, lh.address))
    assert codes == {0: 0, 1: 0, 2: -9, 3: 0}, (codes, [(tmp_path / f"err{i}").read_text()[-600:]
                                                       for i in codes])
    out = {i: torch.load(tmp_path / f"replica{i}.pt") for i in (0, 1, 3)}
    live = out[0]["live"]
    assert out[1]["live"] == live
    assert sorted(live) == list(range(steps))
    assert all(live[t] == [0, 1, 2] for t in range(5)), live
    assert all(live[t] == [0, 1] for t in range(5, 10)), live
    assert all(live[t] == [0, 1, 3] for t in range(10, steps)), live
    assert out[0]["dropped"] == out[1]["dropped"] == 1
    assert out[3]["joined"] == 10 and out[3]["bytes"].get("recovery", 0) > 0
    # exactly one survivor sent the joiner its state, and its ledger says so
    assert sum(out[i]["bytes"].get("recovery", 0) for i in (0, 1)) == out[3]["bytes"]["recovery"]
    for i in (1, 3):
        for a, b in zip(out[0]["params"], out[i]["params"]):
            assert torch.equal(a, b), i
    if codec != "none":
        # per-rank state: the joiner's starts at zero though its peers' is not
        assert out[3]["residual_at_join"] == 0 and out[0]["residual"] > 0
        return
    ref = _reference(live, steps)
    # gloo sums 2-3 fp32 addends in its own order: at most an ulp a step apart, far under
    # 1e-5 after 16 steps; losing the worker changes the result by > 1e-2 (checked below)
    for a, b in zip(out[0]["params"], ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    never_lost = _reference({t: [0, 1, 2] for t in range(steps)}, steps)
    assert max((a - b).abs().max().item() for a, b in zip(ref, never_lost)) > 1e-2


def test_too_few_workers_left_ends_with_one_line(tmp_path: Path) -> None:
    """2 replicas, min_workers 2: one dies, the survivor's next quorum cannot form; it exits
    with one line naming min_workers, no traceback, within its quorum timeout."""
    first = ["--hold", "0:0,1", "--quorum-timeout", "4"]
    with Lighthouse(min_workers=2, join_timeout_ms=2000) as lh:
        codes = _run(tmp_path, lh.address, {0: first, 1: [*first, "--die-at", "3"]}, 10,
                     timeout=60)
    assert codes == {0: 3, 1: -9}, codes
    err = (tmp_path / "err0").read_text()
    lines = [ln for ln in err.splitlines() if ln.startswith("fault tolerance:")]
    assert len(lines) == 1 and "min_workers=2" in lines[0], err[-800:]
    assert "Traceback" not in err


def test_lighthouse_lost_ends_with_one_line(tmp_path: Path) -> None:
    """The lighthouse stops while 2 replicas hold at step 4: each replica's next quorum fails
    and it exits with one line, no traceback, no hang (the quorum timeout bounds it)."""
    args = ["--hold", "0:0,1", "--hold", "4:go", "--quorum-timeout", "4"]
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1", RUST_LOG="error")
    lh = Lighthouse(min_workers=2, join_timeout_ms=2000)
    procs = [subprocess.Popen([sys.executable, str(HERE / "ft_replica.py"), str(i), lh.address,
                               str(tmp_path), "10", *args], env=env, stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / f"err{i}", "w")) for i in (0, 1)]
    try:
        def holding() -> bool:  # both replicas wait at step 4 (a replica that died fails)
            assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
            return all((tmp_path / f"holding4.{i}").exists() for i in (0, 1))

        wait_until(holding, 60, "both replicas holding at step 4")
        lh.shutdown()
        (tmp_path / "readygo").touch()
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        lh.shutdown()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [3, 3], codes
    for i in (0, 1):
        err = (tmp_path / f"err{i}").read_text()
        lines = [ln for ln in err.splitlines() if ln.startswith("fault tolerance:")]
        assert len(lines) == 1 and "lighthouse" in lines[0], err[-800:]
        assert "Traceback" not in err


def test_a_scattered_exchange_is_refused_in_one_line() -> None:
    from thinwire.runtime.ft import FaultToleranceError
    from thinwire.strategies.fault import FaultTolerantDP

    model = torch.nn.Linear(2, 2)
    with pytest.raises(FaultToleranceError, match="drop exchange=scatter") as info:
        FaultTolerantDP(model, torch.optim.SGD(model.parameters(), lr=0.1), replica_id="a",
                        lighthouse="http://127.0.0.1:1", codec="fp4:exchange=scatter")
    assert "\n" not in str(info.value)

"""Property test over signal timing: a short run (one process, checkpoints every 4 steps) gets
SIGINT once or twice at random moments (the second soon after the first, while the first is
being handled); afterwards its run directory is complete (the final checkpoint and a whole
final write), or resumable (a resume finishes it to the uninterrupted run's result), or holds
no checkpoint yet, which a resume reports in one line; never a state that is none of these.
Each attempt runs in a forked child, so the signals never reach the test process."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from harness import poll_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inproc import train_here

from thinwire import checkpoint

RUN = {"data.name": "digits", "model.hidden": "16", "train.batch_size": 16, "train.steps": 16,
       "train.eval_every": 4, "run.checkpoint_every": 4, "run.progress": False}


def _train(run: Path, **over: Any) -> None:
    train_here(run, RUN, **over)


def _interrupted(run: Path, delays: list[float]) -> None:
    """The run in a forked child, SIGINT after each of ``delays`` (seconds, cumulative)."""
    armed = [True]

    def on_sigint(signum: int, frame: Any) -> None:
        if armed[0]:
            raise KeyboardInterrupt

    # SIGINT held back across the fork: a signal sent at once lands in the child only after
    # its own handler is in place, inside the try (not at the fork, under pytest's handler)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    pid = os.fork()
    if pid == 0:  # the child: whatever happens, it ends here, never back in pytest's loop
        try:
            try:
                signal.signal(signal.SIGINT, on_sigint)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
                _train(run)
            except BaseException:  # noqa: BLE001 - the interrupt under test
                pass
            finally:  # a second signal landing here raises out to the outer finally
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                armed[0] = False
        finally:
            os._exit(0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    for d in delays:
        time.sleep(d)  # the moment of the signal is what the property varies: the sleep is the test
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            break
    # a hard bound: a child that hangs is killed and fails
    if not poll_until(lambda: os.waitpid(pid, os.WNOHANG) != (0, 0), 60, poll=0.01):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError("the interrupted run did not end within 60 s")


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    _train(tmp_path_factory.mktemp("warm") / "run")  # imports and data loaded: not timed
    run = tmp_path_factory.mktemp("whole") / "run"
    t0 = time.perf_counter()
    _train(run)
    return {"final": json.loads((run / "summary.json").read_text())["final"],
            "seconds": time.perf_counter() - t0}


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(first=st.floats(0.0, 1.0), second=st.one_of(st.none(), st.floats(0.0, 0.05)))
def test_an_interrupted_run_is_complete_or_resumable(
        whole: dict[str, Any], tmp_path_factory: pytest.TempPathFactory, first: float,
        second: float | None) -> None:
    run = tmp_path_factory.mktemp("cut") / "run"
    at = first * 1.1 * whole["seconds"]  # over the whole run, and a little after it
    _interrupted(run, [at] if second is None else [at, second])
    steps = RUN["train.steps"]
    step = checkpoint.latest_step(run)
    if step == steps and not checkpoint.final_state_problem(run, steps):
        state = "complete"
    elif step is None:
        with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint"):
            checkpoint.require_resumable(run, 1, steps=steps)
        return
    else:
        assert checkpoint.require_resumable(run, 1, steps=steps) == step
        _train(run, **{"run.resume": True})
        state = "resumed"
    assert not checkpoint.final_state_problem(run, steps), state
    assert json.loads((run / "summary.json").read_text())["final"] == whole["final"], state
    with pytest.raises(checkpoint.CheckpointError, match="is complete"):
        checkpoint.require_resumable(run, 1, steps=steps)

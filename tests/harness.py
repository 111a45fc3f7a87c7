"""Multi-process test harness: the library's spawn harness with test defaults.

``run_workers(fn, world_size, *args)`` runs ``fn(comm, *args)`` on ``world_size`` forked gloo
ranks (a file store's rendezvous, one torch thread each, hard timeout) through
:func:`thinwire.runtime.spawn.run_group`; a failing or hanging rank fails the test, named.

The helpers every test file shares live here too, written once: ``wait_until`` /
``poll_until`` (wait on a condition with a timeout, never a fixed sleep), ``one_line`` (a
refusal's message is one non-empty line), ``stderr_lines`` (a command's non-blank output
lines), ``pipeline_config`` (the pipeline tests' run configuration) and ``FT_HEARTBEAT_MS``
(the fault-tolerance jobs' heartbeat timeout).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from thinwire.data.text import BUNDLED_DIR
from thinwire.runtime.spawn import RankFailed, rendezvous_dir, run_group

__all__ = ["DATA", "FT_HEARTBEAT_MS", "one_line", "pipeline_config", "poll_until",
           "rendezvous_dir", "run_workers", "stderr_lines", "wait_until"]


DATA: Path = BUNDLED_DIR
"""The data that ships with the package: ``DATA / "tinyshakespeare"`` holds ``input.txt``,
``DATA / "cora"`` holds ``cora.npz`` (tests name it as ``--data.dir`` so that no
``$THINWIRE_DATA_DIR`` or user cache of the machine changes what they read)."""


FT_HEARTBEAT_MS = 1000
"""The lighthouse's heartbeat timeout in the tests' fault-tolerant jobs (the launcher's default
is 2 s, the planner's figure): a SIGKILLed worker leaves the quorum this long after its last
heartbeat, a wait every such test takes in full. A live worker heartbeats every 100 ms from
torchft's own thread, so it would have to miss ten in a row to be counted lost."""


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90) -> list[Any]:
    try:
        return run_group(fn, world_size, *args, timeout=timeout, threads=1)
    except RankFailed as exc:
        raise AssertionError(str(exc)) from None


def poll_until(condition: Callable[[], Any], timeout: float, poll: float = 0.05) -> Any:
    """Poll ``condition()`` until it returns a true value or ``timeout`` seconds pass; the last
    value either way (the caller asserts on it): a test waits on the event it needs, never a
    fixed time."""
    import time

    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > end:
            return value
        time.sleep(poll)


def wait_until(condition: Callable[[], Any], timeout: float, what: str,
               poll: float = 0.05) -> Any:
    """Poll ``condition()`` until it returns a true value (returned) or ``timeout`` seconds pass
    (an AssertionError naming ``what``): a test waits on the event it needs, never a fixed
    time. A condition that raises (a process it waits on died) fails the wait at once."""
    value = poll_until(condition, timeout, poll)
    if not value:
        raise AssertionError(f"{what}: not within {timeout:g} s")
    return value


def one_line(exc: BaseException | pytest.ExceptionInfo[BaseException]) -> str:
    """The message of a refusal (the exception, or what ``pytest.raises`` caught), asserted to
    be one non-empty line: bad input is one line naming what is wrong, never a traceback."""
    text = str(exc.value if isinstance(exc, pytest.ExceptionInfo) else exc)
    assert text and "\n" not in text, text
    return text


def stderr_lines(text: str) -> list[str]:
    """The non-blank lines of a command's output (a refusal is exactly one of them)."""
    return [ln for ln in text.splitlines() if ln.strip()]


def flat_state(state: object, prefix: str = "") -> dict[str, object]:
    """Every leaf of a (nested) state dict, keyed by its path (resume tests compare them)."""
    if isinstance(state, dict):
        out: dict[str, object] = {}
        for k, v in state.items():
            out.update(flat_state(v, f"{prefix}{k}/"))
        return out
    if isinstance(state, (list, tuple)):
        out = {}
        for i, v in enumerate(state):
            out.update(flat_state(v, f"{prefix}{i}/"))
        return out
    return {prefix: state}


def assert_same_state(a: dict[str, object], b: dict[str, object], rank: int
                      ) -> tuple[int, int]:
    """Two flat states (:func:`flat_state`) equal leaf by leaf, tensors bit for bit; returns
    (tensors, non-empty tensors) compared, so a test checks there was something to compare (a
    rank of central IST holds empty stores between rounds)."""
    import torch

    assert a.keys() == b.keys(), rank
    tensors = filled = 0
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b[k]), (rank, k)  # type: ignore[arg-type]
            tensors += 1
            filled += v.numel() > 0
        else:
            assert v == b[k], (rank, k)
    return tensors, filled


def pipeline_config(*, pp: int, workers: int, micro_batches: int, batch_size: int,
                    model: str = "gpt", schedule: str = "1f1b", **over: Any) -> Any:
    """The ``pipeline`` method's configuration every pipeline test starts from: ``model`` (the
    GPT on tiny-shakespeare, or another on digits) in ``pp`` stages of ``workers`` ranks,
    ``micro_batches`` micro-batches of a ``batch_size`` step, lr 0.1; ``over`` (dotted keys)
    on top."""
    from thinwire.config import load

    data = "tinyshakespeare" if model == "gpt" else "digits"
    return load(None, {"model.name": model, "data.name": data, "method.name": "pipeline",
                       "method.schedule": schedule, "method.micro_batches": micro_batches,
                       "parallel.pp": pp, "runtime.workers": workers,
                       "train.batch_size": batch_size, "train.lr": 0.1, **over})

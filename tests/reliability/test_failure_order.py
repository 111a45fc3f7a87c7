"""Which failure the launcher reports, from the failures torch's agent collects (unit level;
``test_job_processes.py`` checks real jobs)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from thinwire.launch import first_failure


def failure(code: int, kind: str = "", message: str = "", when: float = 0.0) -> Any:
    data: dict[str, Any] = {}
    if kind:
        data = {"message": message, "timestamp": int(when),
                "thinwire": {"kind": kind, "time": when}}
    return SimpleNamespace(exitcode=code, error_file_data=data, timestamp=int(when) or 100)


def test_a_killed_worker_beats_the_peers_it_broke() -> None:
    f = first_failure({0: failure(1, "peer", "communication failed: reset by peer", 1.0),
                       1: failure(-9)})
    assert f.rank == 1 and f.kind == "signal" and "SIGKILL" in str(f)


def test_the_earliest_recorded_error_wins() -> None:
    f = first_failure({0: failure(2, "usage", "checkpoint x is corrupt", 5.25),
                       1: failure(2, "usage", "checkpoint y is corrupt", 5.20),
                       2: failure(-15)})
    assert f.rank == 1 and str(f) == "worker rank 1 failed: checkpoint y is corrupt"


def test_a_real_error_beats_communication_errors_and_agent_kills() -> None:
    f = first_failure({0: failure(1, "peer", "communication failed", 3.0),
                       1: failure(1, "error", "ValueError: bad shape", 3.5),
                       2: failure(-15)})
    assert f.rank == 1 and f.kind == "error"


def test_a_stopped_worker_is_named() -> None:
    f = first_failure({0: failure(1, "peer", "communication failed: timed out", 9.0),
                       1: failure(-9)}, stopped={1})
    assert f.rank == 1 and f.kind == "stopped" and "SIGSTOP" in str(f)


def test_only_agent_kills_names_the_lowest_rank_and_its_signal() -> None:
    f = first_failure({1: failure(-15), 0: failure(-15)})
    assert f.rank == 0 and "SIGTERM" in str(f)
    assert "\n" not in str(f)

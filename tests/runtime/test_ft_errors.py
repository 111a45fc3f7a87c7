"""A recovery that does not load is named as such (thinwire.runtime.ft): the received state of
a live peer failing in a part's ``load_state_dict`` is one line naming the part and the cause,
not the "no quorum" line of a lighthouse that cannot be reached."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from thinwire.runtime.ft import FaultToleranceError, RecoveryFailed, Replica, _named_load


def test_a_part_that_does_not_load_names_itself_and_its_cause() -> None:
    model = torch.nn.Linear(3, 2)
    load = _named_load("model", model.load_state_dict)
    load(torch.nn.Linear(3, 2).state_dict())  # a matching state loads
    with pytest.raises(RecoveryFailed) as e:
        load(torch.nn.Linear(4, 2).state_dict())
    msg = str(e.value)
    assert "\n" not in msg and "(model: " in msg and "size mismatch for weight" in msg, msg
    assert "did not load" in msg and "no quorum" not in msg


class _Manager:
    """torchft's Manager as Replica calls it, its quorum and vote failing as given."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def current_step(self) -> int:
        return 0

    def start_quorum(self, **_: Any) -> None:
        raise self.error

    def should_commit(self) -> bool:
        raise self.error


@pytest.mark.parametrize("error,needle", [
    (RecoveryFailed("fault tolerance: the state received from a live peer did not load (x)"),
     "did not load"),
    (RuntimeError("transport error: connection refused\nmore"), "no quorum of at least"),
])
def test_begin_and_commit_tell_a_failed_recovery_from_a_missing_quorum(error: Exception,
                                                                        needle: str) -> None:
    replica = Replica.__new__(Replica)
    replica.manager, replica.min_workers, replica._quorum_timeout = _Manager(error), 2, 5.0
    for call in (replica.begin, replica.commit):
        with pytest.raises(FaultToleranceError) as e:
            call()
        assert "\n" not in str(e.value) and needle in str(e.value), str(e.value)

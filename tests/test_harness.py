"""The shared test helpers of tests/harness.py hold what the tests rely on: a wait that never
sees its condition fails, naming it; a refusal of two lines or none is not one line; the
pipeline tests' configuration is the pipeline method's, with the overrides on top."""

from __future__ import annotations

import pytest
from harness import one_line, pipeline_config, poll_until, stderr_lines, wait_until

from thinwire.errors import UsageError


def test_a_wait_returns_the_condition_s_value_and_fails_naming_what_never_came() -> None:
    calls = iter([0, "", "ready"])
    assert wait_until(lambda: next(calls), 60, "the third call", poll=0) == "ready"
    with pytest.raises(AssertionError, match="the event: not within 0 s"):
        wait_until(lambda: False, 0, "the event")
    assert poll_until(lambda: [], 0) == []  # the last value, for the caller to assert on


def test_a_refusal_is_one_non_empty_line() -> None:
    assert one_line(UsageError("train.lr: must be > 0")) == "train.lr: must be > 0"
    with pytest.raises(UsageError) as caught:
        raise UsageError("one line")
    assert one_line(caught) == "one line"
    for bad in ("two\nlines", ""):
        with pytest.raises(AssertionError):
            one_line(UsageError(bad))
    assert stderr_lines("\nthinwire train: interrupted\n  \n") == ["thinwire train: interrupted"]


def test_the_pipeline_config_takes_its_overrides_last() -> None:
    cfg = pipeline_config(pp=2, workers=4, micro_batches=4, batch_size=8,
                          **{"train.clip_norm": 0.5, "runtime.workers": 2})
    assert (cfg.method.name, cfg.model.name, cfg.data.name) == ("pipeline", "gpt", "tinyshakespeare")
    assert (cfg.parallel.pp, cfg.runtime.workers, cfg.train.batch_size) == (2, 2, 8)
    assert (cfg.train.lr, cfg.train.clip_norm) == (0.1, 0.5)
    assert pipeline_config(pp=2, workers=2, micro_batches=2, batch_size=4,
                           model="mlp").data.name == "digits"

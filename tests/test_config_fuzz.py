"""Property-based fuzzing of the command line over the config space: every input either reaches
the launch of workers or ends with one line on stderr and exit code 2, never a traceback, and a
rejected input leaves nothing behind."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from harness import stderr_lines
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thinwire.cli import main
from thinwire.config import iter_options

OPTIONS = [dotted for dotted, _f, _t, _o in iter_options()]
NASTY = ["", "-1", "0", "1", "2", "3.5", "1e20", "1e308", "inf", "-inf", "nan", "2**70",
         "9999999999999999999999", "true", "false", "yes", "x", "..", "../victim", "/abs",
         "a,b", "16,16", "0,0", "mlp", "gpt", "dp", "ist", "topk:ratio=2", "powersgd:rank=0",
         "\x00", "é", "[", "sharded", "batch", "cuda", "nccl"]


class Launched(Exception):
    """Raised instead of starting workers: the input was accepted."""


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    import thinwire.launch

    def launch(*args: object, **kwargs: object) -> None:
        raise Launched

    monkeypatch.setattr(thinwire.launch, "launch", launch)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from(OPTIONS),
                          st.one_of(st.sampled_from(NASTY), st.text(max_size=12))),
                min_size=1, max_size=4))
def test_any_config_input_launches_or_fails_in_one_line(
        no_launch: None, capsys: pytest.CaptureFixture[str], pairs: list[tuple[str, str]]) -> None:
    out = Path(tempfile.mkdtemp(prefix="tw-fuzz-"))
    try:
        argv = ["train", "--data.name", "digits", "--model.hidden", "8", "--workers", "2",
                "--train.batch_size", "8", "--no-progress"]
        for key, value in pairs:
            if key in ("run.out", "data.dir"):
                continue  # the file system is fuzzed by the reliability tests
            argv += [f"--{key}", value]
        argv += ["--run.out", str(out / "runs")]
        try:
            code = main(argv)
        except Launched:
            return  # accepted: preflight passed, the run directory was claimed
        except SystemExit as exc:  # argparse's own one-line errors
            code = int(exc.code or 0)
        err = capsys.readouterr().err
        lines = stderr_lines(err)
        assert code == 2, (argv, err)
        assert len(lines) == 1, (argv, err)
        assert "Traceback" not in err
        assert not (out / "runs").exists() or not any((out / "runs").iterdir()), argv
    finally:
        shutil.rmtree(out, ignore_errors=True)

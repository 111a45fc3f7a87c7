"""The run-directory rules as a property: generated sequences of ``train``, ``--resume``,
``--overwrite``, ``compare`` and ``report`` over an output folder that also holds a user's
files, a user's folder laid out like a run, a user's file named like thinwire's lock, symbolic
links (to a folder outside, and inside a finished run) and finished runs.

Invariants after every command: (a) no byte of a file thinwire did not create changes, no such
file disappears and every link still points where it did; (b) no finished run's summary changes,
except by a successful ``--overwrite`` of that (thinwire) run; (c) every command either succeeds
or is refused with exit code 2 and one line on stderr.

The commands go through the command line (:func:`thinwire.cli.main`) in this process; only the
launcher's process boundary is replaced by the worker entry's own body run here on one worker
(:mod:`inproc`: :func:`thinwire.launch.launch` spawns the same ``thinwire.worker`` code under
torch's elastic agent, at seconds per run), so each example costs about a second.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inproc import tiny_config, train_inproc

from thinwire import rundir, worker
from thinwire.cli import main

pytestmark = pytest.mark.timeout(600)

NAMES = ("dp", "done", "linked", "results", "to-outside", "mine", "notes.txt", "report")
"""Run names the commands use: new, finished runs, a user's folder, a link, a name whose lock
file the user owns, a user's file, and the folder compare and report write into."""

TINY = ["--data", "digits", "--model.hidden", "8", "--model.norm", "none",
        "--train.batch_size", "8", "--steps", "4", "--train.eval_every", "0", "--workers", "1",
        "--runtime.threads", "1", "--no-progress"]

commands = st.one_of(
    st.tuples(st.just("train"), st.sampled_from(NAMES)),
    st.tuples(st.just("resume"), st.sampled_from(NAMES)),
    st.tuples(st.just("overwrite"), st.sampled_from(NAMES)),
    st.tuples(st.just("compare"), st.booleans()),
    st.tuples(st.just("report"), st.sampled_from(NAMES)),
)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("template")
    return train_inproc(tiny_config(out))


def build_tree(root: Path, finished: Path, user_report: bool) -> Path:
    """The output folder ``root/out`` and a folder ``root/outside`` beside it."""
    out, outside = root / "out", root / "outside"
    (outside / "victim").mkdir(parents=True)
    (outside / "victim" / "precious.txt").write_text("outside, keep")
    (outside / "log.txt").write_text("a user's log\n")
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    results = out / "results"  # a user's folder with thinwire's layout
    (results / "checkpoints").mkdir(parents=True)
    (results / "config.toml").write_text("[run]\n")
    (results / "thesis.txt").write_text("years of work")
    os.symlink(outside / "victim", out / "to-outside")
    (out / ".mine.thinwire-lock").write_text("my data, not a lock")
    (out / ".dp.lock").write_text("an old lock of mine")
    shutil.copytree(finished, out / "done")
    shutil.copytree(finished, out / "linked")
    (out / "linked" / "metrics.jsonl").unlink()
    os.symlink(outside / "log.txt", out / "linked" / "metrics.jsonl")
    if user_report:
        (out / "report").mkdir()
        (out / "report" / "compare.md").write_text("my comparison")
    return out


def snapshot(root: Path) -> tuple[dict[str, bytes], dict[str, str]]:
    """Regular files with their bytes and links with their targets (links not followed)."""
    files, links = {}, {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink():
                links[str(p)] = os.readlink(p)
            elif p.is_file():
                files[str(p)] = p.read_bytes()
    return files, links


def thinwire_made(path: str, out: Path) -> bool:
    """Inside a directory thinwire marked (a run or a report folder) or one of its hidden
    entries (lock, staging) that it created itself."""
    p = Path(path)
    for parent in [p, *p.parents]:
        if parent == out:
            return False
        if any(os.path.isfile(parent / m) and not os.path.islink(parent)
               for m in (rundir.MARKER, ".thinwire-report")):
            return True
    return False


def one_command(cmd: tuple[Any, ...], out: Path, capsys: pytest.CaptureFixture[str]
                ) -> tuple[int, str]:
    kind = cmd[0]
    if kind in ("train", "resume", "overwrite"):
        flags = {"train": [], "resume": ["--resume"], "overwrite": ["--overwrite"]}[kind]
        argv = ["train", "--out", str(out), "--run.name", cmd[1], *TINY, *flags]
    elif kind == "compare":
        argv = ["compare", "--out", str(out), "--methods", "dp", "--thin-links", "modelled",
                *TINY, *(["--overwrite"] if cmd[1] else [])]
    else:
        argv = ["report", str(out / cmd[1])]
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    return rc, err


def launch_here(run_dir: Path, workers: int, **_: Any) -> None:
    assert workers == 1
    assert worker._run(Path(run_dir) / "config.toml") == 0


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(commands, min_size=1, max_size=4), st.booleans())
def test_run_directory_rules(finished_run: Path, capsys: pytest.CaptureFixture[str],
                             sequence: list[tuple[Any, ...]], user_report: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="tw-prop-") as tmp, \
            pytest.MonkeyPatch.context() as mp:
        mp.setattr("thinwire.launch.launch", launch_here)
        mp.delenv("THINWIRE_LAUNCHER_PID", raising=False)
        root = Path(tmp)
        out = build_tree(root, finished_run, user_report)
        files, links = snapshot(root)
        users = {p: b for p, b in files.items() if not thinwire_made(p, out)}
        summaries = {n: (out / n / "summary.json").read_bytes() for n in ("done", "linked")}
        for cmd in sequence:
            rc, err = one_command(cmd, out, capsys)
            assert rc in (0, 2), (cmd, rc, err)
            if rc == 2:
                assert len(err.splitlines()) == 1 and "Traceback" not in err, (cmd, err)
            now_files, now_links = snapshot(root)
            for p, data in users.items():  # (a)
                assert now_files.get(p) == data, (cmd, p, err)
            for p, target in links.items():
                assert now_links.get(p) == target, (cmd, p)
            replaced = ({cmd[1]} if cmd[0] == "overwrite" else {"dp"} if cmd[0] == "compare"
                        and cmd[1] else set())
            for name, data in list(summaries.items()):  # (b)
                now = (out / name / "summary.json").read_bytes()
                if rc == 0 and name in replaced:
                    summaries[name] = now
                else:
                    assert now == data, (cmd, name, err)
            for name in NAMES:  # runs finished by this command join (b)
                s = out / name / "summary.json"
                if name not in summaries and rundir.is_run_dir(out / name) and s.is_file():
                    summaries[name] = s.read_bytes()
        assert not [p for p in out.iterdir() if p.name.endswith((".staging", ".replaced"))]

"""The command line end to end: training, reporting, help, and every bad-input path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from harness import stderr_lines, wait_until

from thinwire.cli import main
from thinwire.config import iter_options, load

QUICK = ["--data.name", "digits", "--model.hidden", "32,32", "--train.batch_size", "16",
         "--train.steps", "40", "--train.eval_every", "20", "--no-progress"]


def thinwire(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "thinwire", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_train_and_report_end_to_end(tmp_path: Path) -> None:
    r = thinwire("train", "--workers", "2", "--method", "localsgd", "--out", str(tmp_path), *QUICK)
    assert r.returncode == 0, r.stderr
    run = tmp_path / "localsgd"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["final"]["accuracy"] > 0.5
    # the written config reloads to the run's own settings (what --resume relies on)
    saved = load(run / "config.toml")
    assert saved.method.name == "localsgd" and saved.runtime.workers == 2
    assert saved.train.steps == summary["steps"]
    assert (run / "ledger.rank1.json").exists()
    assert main(["report", str(run), "--plots", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "accuracy.png").stat().st_size > 1000


def test_help_lists_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for dotted, _f, _t, _owners in iter_options():
        assert f"--{dotted}" in text


@pytest.mark.parametrize("args,needle", [
    (["--train.lr", "fast"], "train.lr: expected a number"),
    (["--train.nonsense", "1"], "unrecognized arguments: --train.nonsense"),
    (["--train.lr", "-1"], "train.lr: must be in [0, 1e6]"),
    (["--method", "ist", "--workers", "32", "--model.hidden", "16,16"], "into 32 subnets"),
    (["--method", "warp"], "unknown method 'warp'"),
    (["--data.name", "imagenet"], "imagenet"),
    (["--data.name", "fashion-mnist", "--data.dir", "/nonexistent/dir"], "data.dir"),
    (["--train.batch_size", "5000"], "smaller than batch_size"),
    (["--config", "/nonexistent.toml"], "not found"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str, tmp_path: Path) -> None:
    r = thinwire("train", "--out", str(tmp_path), "--data.name", "digits", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = stderr_lines(r.stderr)
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_bad_toml_file_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlr = 'x'\n")
    r = thinwire("train", "--config", str(bad))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "train.lr" in r.stderr
    bad.write_text("[train\n")
    r = thinwire("train", "--config", str(bad))
    assert r.returncode == 2 and "not valid TOML" in r.stderr


def _children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"thinwire.worker" in cmd:
                out.append(int(p.name))
    return out


def test_a_dead_worker_ends_the_job_with_an_error(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "thinwire", "train", "--workers", "2", "--out", str(tmp_path),
         "--data.name", "digits", "--train.steps", "100000", "--train.batch_size", "8",
         "--model.hidden", "16", "--train.eval_every", "0", "--runtime.timeout_s", "20",
         "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def started() -> list[int]:
            found = [c for agent in [proc.pid, *_agents(proc.pid)] for c in _children(agent)]
            return found if len(found) == 2 else []

        workers = wait_until(started, 60, "two workers started")

        def training() -> bool:  # a train record: both ranks are past the first step
            return any(f.stat().st_size > 0 for f in tmp_path.rglob("metrics.jsonl"))

        wait_until(training, 60, "the first metrics record written")
        os.kill(max(workers), signal.SIGKILL)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "worker rank" in err.strip().splitlines()[-1]


def _agents(pid: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
            and _ppid(p) == pid]


def _ppid(p: Path) -> int:
    try:
        return int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def test_unknown_key_in_toml_names_it(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlearning_rate = 0.1\n")
    r = thinwire("train", "--config", str(bad))
    assert r.returncode == 2 and "unknown option train.learning_rate" in r.stderr


def test_compare_end_to_end_prints_one_row_per_method(tmp_path: Path) -> None:
    """Guards compare's option splitting and run names end to end: two methods with their own
    options give two run directories and two rows, each labelled with its options (the
    thin-link figures modelled: the testbed's reruns are tests/testbed's)."""
    r = thinwire("compare", "--methods", "dp,ist:local_steps=5,train.lr=0.1", "--workers", "2",
                 "--out", str(tmp_path), "--thin-links", "modelled", *QUICK, timeout=300)
    assert r.returncode == 0, r.stderr
    table = (tmp_path / "report" / "compare.md").read_text()
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert [row.split(" | ")[0] for row in rows] == [
        "| dp [hidden=32,32]", "| ist(K=5,central,auto,overlap=auto) [lr=0.1, hidden=32,32]"]
    assert (tmp_path / "ist_local_steps5_train.lr0.1" / "summary.json").is_file()
    assert (tmp_path / "report" / "accuracy.png").is_file()


def test_bench_modelled_end_to_end(tmp_path: Path) -> None:
    r = thinwire("bench", "--modelled", "--link", "100mbit,1gbit", "--methods", "dp,localsgd",
                 "--workers", "2", "--out", str(tmp_path), *QUICK, timeout=300)
    assert r.returncode == 0, r.stderr
    table = (tmp_path / "bench.md").read_text()
    assert "modelled" in table
    rows = [ln for ln in table.splitlines() if ln.startswith("| 100mbit") or ln.startswith("| 1gbit")]
    assert len(rows) == 4
    # the modelled wall time of dp grows on the slower link; local SGD's bytes are 1/10 of dp's
    data = json.loads((tmp_path / "bench.json").read_text())["results"]
    wall = {(d["link_label"], d["method"].split(" ")[0]): d["wall_s"] for d in data}
    assert wall[("100mbit", "dp")] > wall[("1gbit", "dp")]


def test_worker_entry_usage_errors(tmp_path: Path) -> None:
    for argv in ([], ["a", "b"], [str(tmp_path / "missing.toml")]):
        r = subprocess.run([sys.executable, "-m", "thinwire.worker", *argv], capture_output=True,
                           text=True, timeout=60)
        lines = stderr_lines(r.stderr)
        assert r.returncode == 2 and len(lines) == 1, (argv, r.stderr)

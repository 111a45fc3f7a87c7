"""``thinwire report`` on missing or damaged inputs: one line naming the file, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import stderr_lines
from report_cases import write_report_run

from thinwire.cli import main
from thinwire.report.tables import compare_table, load_run


def test_the_hand_made_run_is_valid(tmp_path: Path) -> None:
    run = load_run(write_report_run(tmp_path / "dp"))
    assert "| dp |" in compare_table([run])


@pytest.mark.parametrize("file,content,needle", [
    ("summary.json", None, "not a finished run directory"),
    ("metrics.jsonl", None, "not a finished run directory"),
    ("summary.json", b"", "not valid JSON"),
    ("summary.json", b"{\"final\": ", "not valid JSON"),
    ("summary.json", b"\xff\xfe\x00garbage", "not UTF-8"),
    ("summary.json", b"[]", "top level is list"),
    ("summary.json", b"{}", "not a thinwire summary"),
    ("summary.json", json.dumps({"wall_s": "x"}).encode(), "wall_s is not a number"),
    ("summary.json", b"NaN", "top level is float"),
    ("summary.json", b"[" * 100000, "not valid JSON"),
    ("metrics.jsonl", b"{\"kind\": \"eval\"}\n", "lacks a numeric step"),
    ("metrics.jsonl", b"not json\n", "line 1 is not valid JSON"),
    ("metrics.jsonl", b"[1, 2]\n", "not a metrics record"),
    ("metrics.jsonl", b"\x00\x01\x02", "not valid JSON"),
])
def test_damaged_inputs_are_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            file: str, content: bytes | None, needle: str) -> None:
    run = write_report_run(tmp_path / "dp")
    if content is None:
        (run / file).unlink()
    else:
        (run / file).write_bytes(content)
    before = sorted(tmp_path.rglob("*"))
    assert main(["report", str(run), "--plots", str(tmp_path / "plots")]) == 2
    out, err = capsys.readouterr()
    lines = stderr_lines(err)
    assert len(lines) == 1 and needle in lines[0], err
    assert lines[0].startswith("thinwire report: error: ") and "Traceback" not in out + err
    assert sorted(tmp_path.rglob("*")) == before  # no plots folder, nothing written


def test_a_summary_with_a_broken_config_still_reports(tmp_path: Path) -> None:
    """The tables read the recorded label and numbers, never the config: a damaged config
    section (an older or hand-edited run) does not stop a report."""
    run = write_report_run(tmp_path / "dp")
    s = json.loads((run / "summary.json").read_text())
    for bad in ({"train": {"lr": "fast"}}, {"nonsense": {}}, {"train": {"lr": None}}):
        s["config"] = bad
        (run / "summary.json").write_text(json.dumps(s))
        assert load_run(run).label == s["label"]

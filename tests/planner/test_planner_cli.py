"""``thinwire plan`` end to end through the top-level command, and docs/PLANNER.md's blocks
re-printed by the commands they name."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from thinwire.cli import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "PLANNER.md"


def test_search_prints_a_ranked_table(capsys):
    rc = main(
        ["plan", "--model", "gpt3-175b", "--cluster", "a100-80gb", "--nodes", "8", "--search"]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "feasible plans on 64 devices" in out and "#1 vs #2" in out
    ranks = [line.split()[0] for line in out.splitlines() if re.match(r"^\d+\s+\d+\s+\d+", line)]
    assert ranks[:3] == ["1", "2", "3"]


def test_single_plan_text_and_json(capsys):
    args = [
        "plan",
        "--model",
        "megatron-175b",
        "--cluster",
        "a100-80gb",
        "--nodes",
        "8",
        "--tp",
        "8",
        "--pp",
        "8",
        "--interleave",
        "3",
        "--sp",
        "--recompute",
        "selective",
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "Memory: fits" in text and "bubble" in text
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True and data["strategy"]["interleave"] == 3
    assert data["memory_bytes"]["activations"] / 2**30 == pytest.approx(12.35, abs=0.01)
    assert data["step_seconds"]["total"] == pytest.approx(13.75, rel=0.1)  # Korthikanti T5


def test_validate_crossover_and_scaling(capsys, tmp_path):
    assert main(["plan", "--validate"]) == 0
    out = capsys.readouterr().out
    assert "Korthikanti" in out and "Narayanan" in out and "leave-one-out" in out
    assert (
        main(
            [
                "plan",
                "--model",
                "mlp-784-2048-2048-10",
                "--cluster",
                "cpu-1gbe",
                "--nodes",
                "8",
                "--crossover",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert 0 < data["crossover_bytes_per_s"]["compressed"] < 1e12
    assert (
        main(
            [
                "plan",
                "--model",
                "mlp-784-2048-2048-10",
                "--cluster",
                "cpu-1gbe",
                "--nodes",
                "8",
                "--scaling",
                "--max-workers",
                "16",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert "DP knee" in capsys.readouterr().out
    png = tmp_path / "scaling.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--model", "gpt-7", "--cluster", "a100-80gb"], "unknown --model"),
        (["--model", "gpt3-175b", "--cluster", "a100-40"], "unknown --cluster"),
        (["--model", "gpt3-175b", "--cluster", "a100-80gb", "--nodes", "8", "--tp", "3"], "tp*pp"),
        (
            [
                "--model",
                "gpt3-175b",
                "--cluster",
                "a100-80gb",
                "--nodes",
                "8",
                "--tp",
                "16",
                "--dp",
                "4",
            ],
            "inside a node",
        ),
        (["--model", "gpt3-175b", "--cluster", "a100-80gb", "--dp", "3"], "dp*tp*pp"),
        (["--model", "mlp-784-2048-2048-10", "--cluster", "cpu-1gbe", "--scaling"], "--out"),
        (["--model", "gpt3-175b", "--cluster", "a100-80gb", "--bandwidth", "fast"], "--bandwidth"),
        (["--cluster", "a100-80gb"], "--model"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, argv, needle):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_doc_blocks_are_printed_by_their_commands(capsys):
    text = DOC.read_text(encoding="utf-8")
    blocks = re.findall(
        r"<!-- printed by: (thinwire plan[^>]*?) -->\n```text\n(.*?)```", text, re.S
    )
    assert len(blocks) >= 3
    for command, shown in blocks:
        assert main(shlex.split(command)[1:]) == 0
        assert capsys.readouterr().out == shown, f"docs/PLANNER.md is stale for: {command}"

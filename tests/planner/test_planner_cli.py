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


def test_validate_prints_held_out_errors_within_sane_bounds(capsys):
    assert main(["plan", "--validate"]) == 0
    out = capsys.readouterr().out
    assert "Korthikanti" in out and "Narayanan" in out and "leave-one-out" in out
    rows = re.findall(r"^(Korthikanti 2022 T5|Narayanan 2021 T1)\s+\S+ \S+ \S+\s+(\d\.\d+)\s+"
                      r"(\d+\.\d+)% \(max \d+\.\d+%\)\s+(\d+\.\d+)% \(max (\d+\.\d+)%\)",
                      out, re.M)
    assert [r[0] for r in rows] == ["Korthikanti 2022 T5", "Narayanan 2021 T1"]
    for _, fit, in_sample, held, held_max in rows:
        assert 0.7 < float(fit) < 0.95
        assert float(in_sample) < float(held) < 10.0 and float(held_max) < 15.0
    assert main(["plan", "--validate", "--json"]) == 0
    sm = json.loads(capsys.readouterr().out)["summary"]
    assert sm["heldout_korthikanti_mean"] == pytest.approx(float(rows[0][3]) / 100, abs=5e-5)
    assert sm["heldout_narayanan_mean"] == pytest.approx(float(rows[1][3]) / 100, abs=5e-5)
    assert sm["fit_narayanan"] == pytest.approx(float(rows[0][1]), abs=5e-4)


def test_crossover_is_where_the_step_times_meet(capsys):
    from thinwire.planner.insight import method_variants, step_at
    from thinwire.planner.presets import load_cluster, load_model

    argv = ["plan", "--model", "mlp-784-2048-2048-10", "--cluster", "cpu-1gbe", "--nodes", "8",
            "--crossover", "--method", "topk:ratio=0.01", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    cross = data["crossover_bytes_per_s"]
    assert cross["ist"] is None and cross["localsgd"] is None  # they win on every link
    w = cross["topk:ratio=0.01"]
    model, cluster = load_model("mlp-784-2048-2048-10"), load_cluster("cpu-1gbe", nodes=8)
    v = method_variants(model, data_strategy(model, cluster), ["topk:ratio=0.01"])
    base, topk = v["data parallel"], v["topk:ratio=0.01"]
    assert step_at(model, cluster, topk, w) == pytest.approx(step_at(model, cluster, base, w),
                                                             rel=1e-6)
    assert step_at(model, cluster, topk, w / 2) < step_at(model, cluster, base, w / 2)
    assert step_at(model, cluster, topk, w * 2) > step_at(model, cluster, base, w * 2)


def data_strategy(model, cluster):
    from thinwire.planner.strategy import StrategySpec

    return StrategySpec(dp=8, micro_batch_size=1, micro_batches=512 // 8)


def test_scaling_writes_a_png_and_names_the_knee(capsys, tmp_path):
    argv = ["plan", "--model", "mlp-784-2048-2048-10", "--cluster", "cpu-1gbe", "--nodes", "8",
            "--scaling", "--max-workers", "16", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Data-parallel knee: parallel efficiency falls below 50% at 2 workers" in out
    png = tmp_path / "scaling.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_device_and_devices_that_are_not_whole_nodes(capsys):
    assert main(["plan", "--model", "gpt2-small", "--cluster", "h100", "--devices", "1",
                 "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["strategy"]["dp"] == 1 and one["step_seconds"]["dp_comm"] == 0.0
    assert main(["plan", "--model", "gpt2-small", "--cluster", "h100", "--devices", "1"]) == 0
    assert "on h100: 1 device on 1 node of 8" in capsys.readouterr().out
    argv = ["plan", "--model", "gpt2-small", "--cluster", "a100-80gb", "--devices", "12",
            "--micro-batch-size", "4", "--global-batch", "48", "--json"]
    assert main(argv) == 0
    twelve = json.loads(capsys.readouterr().out)
    assert twelve["nodes"] == 2 and twelve["strategy"]["dp"] == 12
    assert twelve["strategy"]["micro_batches"] == 1


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
        (["--model", "gpt2-small", "--cluster", "h100", "--workers", "4"], "--devices"),
        (["--model", "gpt2-small", "--cluster", "h100", "--steps", "10"], "--calibrate"),
        (["--model", "gpt2-small", "--cluster", "h100", "--nodes", "2", "--devices", "3"],
         "not both"),
        (["--model", "gpt2-small", "--cluster", "h100", "--devices", "0"], "--devices"),
        (["--model", "gpt2-small", "--cluster", "h100", "--method", "ring"], "unknown method"),
        (["--model", "gpt2-small", "--cluster", "h100", "--method", "ist"], "MLP specs"),
        (["--model", "mlp-784-64-10", "--cluster", "cpu-1gbe", "--nodes", "8", "--method",
          "localsgd", "--zero", "1"], "--zero"),
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


def test_a_tables_plan_prices_its_runs_optimizer(capsys):
    """``--crossover --convergence mlp-fashion-mnist`` alone prices the table's recorded inputs,
    its runs' plain SGD included (IST's default deals the optimizer state: none travels with
    SGD); an explicit ``--optimizer adam`` prices Adam's two moments with every piece."""
    table = ["--crossover", "--convergence", "mlp-fashion-mnist", "--json"]
    given = ["--model", "mlp-784-1024-1024-10", "--cluster", "cpu-1gbe", "--devices", "4",
             "--micro-batch-size", "128"]
    outs = []
    for argv in (table, [*given, "--optimizer", "sgd", *table], [*given, *table],
                 [*given, "--optimizer", "adam", *table]):
        assert main(["plan", *argv]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    assert outs[2] == outs[3] != outs[1]
    sgd, adam = (json.loads(o)["to_target"][0]["rows"][0]["seconds"] for o in (outs[1], outs[3]))
    assert adam["ist"] > 2 * sgd["ist"]  # at 100 Mb/s IST's bytes are its time: 3x the pieces
    assert adam["localsgd"] < 1.1 * sgd["localsgd"]  # a replica's bytes carry no state

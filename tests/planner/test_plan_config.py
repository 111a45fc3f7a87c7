"""``thinwire plan --config CONFIG.toml`` prices a train config as written: every rank's bytes
from the method's own formula (the same numbers ``thinwire.measure.predict`` gives, which the
ledger tests hold equal to real runs), and with ``--cluster`` the planner's plan of the run's
layout; a missing file or a mode that does not apply is a one-line error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from thinwire import config as config_mod
from thinwire.builders import build_model, load_data
from thinwire.cli import main
from thinwire.commands.plan import config_strategy
from thinwire.measure.predict import run_layout, run_traffic
from thinwire.planner.presets import model_spec_from_module

MLP = {"model.name": "mlp", "data.name": "digits", "model.hidden": "16,16", "runtime.workers": 2,
       "train.steps": 20, "train.eval_every": 20}


def _write(tmp_path: Path, overrides: dict[str, object]) -> tuple[Path, config_mod.Config]:
    cfg = config_mod.load(None, overrides)
    path = tmp_path / "config.toml"
    path.write_text(config_mod.dumps(cfg))
    return path, config_mod.load(path)


@pytest.mark.parametrize("method", [{"method.name": "dp"},
                                    {"method.name": "localsgd", "method.period": 10},
                                    {"method.name": "dp", "method.compressor": "topk:ratio=0.1"}])
def test_the_bytes_are_the_method_formula_of_the_config(tmp_path: Path, capsys, method) -> None:
    path, cfg = _write(tmp_path, {**MLP, **method})
    assert main(["plan", "--config", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = run_traffic(cfg, run_layout(cfg))
    assert out["bytes"]["sent_per_worker_max"] == max(want.sent) > 0
    assert out["workers"] == 2 and out["steps"] == 20
    assert {k: (v["calls"], v["wire_bytes"]) for k, v in out["rank0_calls"].items()} == \
        want.rank0_calls


def test_with_a_cluster_the_plan_is_the_run_layout(tmp_path: Path, capsys) -> None:
    path, cfg = _write(tmp_path, {**MLP, "method.name": "localsgd", "method.period": 20,
                                  "memory.recompute": "block", "train.batch_size": 32})
    assert main(["plan", "--config", str(path), "--cluster", "cpu-1gbe", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    text = json.dumps(plan)
    assert "localsgd:period=20" in text
    model = model_spec_from_module(build_model(cfg, load_data(cfg)), "mlp")
    s = config_strategy(cfg, model)
    assert (s.dp, s.tp, s.pp, s.micro_batch_size, s.recompute) == (2, 1, 1, 32, "full")
    assert main(["plan", "--config", str(path), "--cluster", "cpu-1gbe"]) == 0
    out = capsys.readouterr().out
    assert "on 2 workers" in out and "2 devices" in out and "Step time" in out


def test_bad_config_input_is_one_line(tmp_path: Path, capsys) -> None:
    assert main(["plan", "--config", str(tmp_path / "none.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such file" in err
    path, _ = _write(tmp_path, MLP)
    assert main(["plan", "--config", str(path), "--search"]) == 2
    assert "drop --search" in capsys.readouterr().err
    path.write_text("[train]\nsteps = -1\n")
    assert main(["plan", "--config", str(path)]) == 2
    assert "train.steps" in capsys.readouterr().err

"""The "bridge" experiment (torch IST against Theorem 2 of Shulgin & Richtarik, ICML 2024).

The full experiment launches 12 jobs of worker processes and is explicit-only; here a cheap
version (one IST job, 2 workers, 20 steps) checks the plumbing end to end: the launch, the
checkpoint watcher, the reassembly of the full model from IST's store (it must reproduce the
test NLL the run logged), the objective, the table and the figure. The floor itself needs the
full sizes (see docs/THEORY.md), so no assertion about it is made here.
"""

import argparse
import json
from pathlib import Path

import pytest
import torch

from thinwire.commands import theory as theory_cli
from thinwire.theory import exp_bridge
from thinwire.theory.experiments import default_registry

TINY = exp_bridge.BridgeSpec(
    name="bridge-tiny",
    lrs=(0.4,),
    horizon=8.0,
    points=2,
    methods=("ist",),
    shards=("skew",),
    ref_iters=200,
)


def test_bridge_is_registered_and_explicit_only(capsys):
    registry = default_registry()
    for name in ("bridge", "bridge-batchnorm"):
        assert name in registry.names() and registry.get(name).explicit_only
        assert name not in registry.default_names()
        assert name not in theory_cli.selected(registry, [], True)
    assert theory_cli.selected(registry, ["bridge"], False) == ["bridge"]
    assert "heterogeneous" in registry.default_names()
    theory_cli.print_listing(registry)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("bridge "))
    assert "explicit only" in line


def test_spec_steps_are_multiples_of_the_period_and_keep_lr_times_steps():
    spec = exp_bridge.DEFAULT
    for lr in spec.lrs:
        assert spec.every(lr) % spec.local_steps == 0
        assert spec.steps(lr) == spec.every(lr) * spec.points
        assert spec.steps(lr) * lr == pytest.approx(spec.horizon, rel=0.15)
    cfg = exp_bridge.run_config_for(spec, "ist", "skew", 0.1, 3, Path("x"))
    assert (cfg.method.name, cfg.method.options.scale, cfg.model.options.norm) == ("ist", "dropout", "none")
    assert (cfg.data.shard, cfg.data.skew, cfg.train.seed) == ("skew", 1.0, 3)
    assert cfg.train.weight_decay == spec.weight_decay and cfg.method.options.deployment == "central"


def test_fit_floor_recovers_a_floor_and_a_slope():
    lrs = [0.4, 0.2, 0.1]
    assert exp_bridge.fit_floor(lrs, [0.1 + 0.3 * x for x in lrs]) == pytest.approx((0.1, 0.3))
    a, b = exp_bridge.fit_floor(lrs, [0.5 * x for x in lrs])  # proportional to lr: no floor
    assert a == pytest.approx(0.0, abs=1e-12) and b == pytest.approx(0.5)


def test_checkpoint_reassembly_matches_the_full_model(tmp_path):
    """An IST store written by hand comes back as the same full model (and local SGD's too)."""
    from thinwire import config
    from thinwire.models import build_mlp

    cfg = config.load(None, {"model.hidden": "6", "model.norm": "none", "train.seed": 1})
    model = build_mlp(5, (6,), 3, norm="none", seed=7)
    store = {n: p.detach().clone() for n, p in model.named_parameters()}
    ist = {"round": 3, "store": store, "state_keys": [], "state_store": {}, "scalar_state": {}}
    x = torch.randn(4, 5)
    for i, state in enumerate(({"ist": ist}, {"model": model.state_dict()})):
        path = tmp_path / f"rank0-{i}.pt"
        torch.save({"strategy": state}, path)
        back = exp_bridge.model_from_checkpoint(path, cfg, 5, 3)
        assert torch.equal(back(x), model(x))
    torch.save({"strategy": {"ist": {"store": {"layers.0.weight": store["layers.0.weight"]}}}},
               tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="no value"):
        exp_bridge.model_from_checkpoint(tmp_path / "bad.pt", cfg, 5, 3)


def test_tiny_bridge_end_to_end(tmp_path):
    result = exp_bridge.run_bridge(tmp_path, 0, TINY)
    result.write(tmp_path)
    nums = result.numbers
    key = "ist/skew/0.4"
    # the full model rebuilt from rank 0's checkpoint reproduces what the run logged
    assert nums[f"{key}/test_nll_reloaded"] == pytest.approx(nums[f"{key}/test_nll"], rel=1e-5)
    assert nums[f"{key}/points"] == TINY.points
    assert nums[f"{key}/plateau"] == pytest.approx(
        nums[f"{key}/final_ce"] + nums[f"{key}/final_penalty"]
    )  # the second half of 2 checkpoints is the last one
    # 20 noisy steps cannot beat the converged full-batch reference of the same objective, nor
    # can 20 full-batch gradient steps
    assert nums["f_ref"] < nums[f"{key}/plateau"] < 5.0
    assert nums["f_ref"] < nums["f_gd"] and nums["gd_residue"] == nums["f_gd"] - nums["f_ref"]
    assert nums[f"{key}/gap"] == pytest.approx(nums[f"{key}/plateau"] - nums["f_ref"])
    md = (tmp_path / "bridge-tiny.md").read_text()
    assert "| skew=1 | IST | 0.4 | 20 |" in md
    assert json.loads((tmp_path / "bridge-tiny.json").read_text())["figures"] == ["bridge-tiny.png"]
    assert (tmp_path / "bridge-tiny.png").stat().st_size > 10_000
    assert not list(tmp_path.glob("**/checkpoints"))  # worker runs live in a temporary folder


def test_cli_runs_a_named_explicit_only_experiment(tmp_path, monkeypatch):
    """`thinwire theory bridge` dispatches to the experiment (stubbed here: it takes minutes)."""
    calls = []

    def fake(out_dir, seed):
        calls.append(seed)
        return exp_bridge.ExperimentResult("bridge", "Bridge", "| a |\n|---|\n| 1 |", (), {})

    registry = default_registry()
    registry._experiments["bridge"] = exp_bridge.Experiment("bridge", "x", fake, explicit_only=True)
    args = argparse.Namespace(names=["bridge"], list=False, all=False, out=str(tmp_path), seed="4")
    assert theory_cli.run(args, registry) == 0 and calls == [4]
    assert (tmp_path / "bridge.md").exists()

"""One worker's failure, priced (``thinwire.planner.failure``, ``thinwire plan --failures``):
torchft's quorum against a restart from the last checkpoint, each number equal to its hand
computation from the method's ``Recovery`` (data of its registry entry), the crossover where
the two costs meet, and the command's one-line errors. That the recovery bytes are what a real
joiner receives is held by ``tests/reliability/test_ft_trainer.py``
(``test_diloco_loses_a_worker_and_one_joins``: the ledger's ``recovery`` tensors)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from thinwire import config as config_mod
from thinwire.cli import main
from thinwire.planner import StrategySpec, load_cluster, predict
from thinwire.planner.failure import HEARTBEAT_S, failure_cost, recovery_bytes
from thinwire.planner.specs import CountedSpec
from thinwire.strategies import METHODS
from thinwire.strategies.entry import Recovery

MODEL = CountedSpec(name="counted", params=1_000_000, flops_per_sample=6e6)


def test_every_method_on_the_quorum_says_what_a_joiner_receives() -> None:
    for name, entry in METHODS.entries():
        assert (entry.recovery is not None) == entry.fault_tolerant, name


def test_recovery_bytes_are_the_copies_buffers_and_optimizer_state() -> None:
    # 3 copies of 1000 parameters in 4 tensors, 40 buffer bytes, Adam: 2 states + 4 steps
    rec = Recovery(copies=3)
    assert recovery_bytes(rec, 1000, 4, "adam", 40) == 3 * 4000 + 40 + 2 * 4000 + 4 * 4
    assert recovery_bytes(rec, 1000, 4, "momentum", 40) == 3 * 4000 + 40 + 4000
    assert recovery_bytes(Recovery(optimizer=False, buffers=False), 1000, 4, "adam", 40) == 4000


def test_diloco_failure_equals_the_hand_computation() -> None:
    """diloco (H = 10, outer Nesterov): a joiner receives the model, the inner Adam state,
    theta_g and the outer momentum; the quorum loses the heartbeat, the round (10 steps) and
    the transfer; a restart loses its start-up, the load and half the checkpoint interval."""
    cluster = load_cluster("cpu-1gbe", nodes=4)
    pred = predict(MODEL, cluster, StrategySpec(dp=4, method="diloco"))
    t, bw, p = pred.step_time, cluster.inter_bandwidth, MODEL.params
    cost = failure_cost(MODEL, cluster, pred.strategy, t, checkpoint_every=40, startup_s=1.5)
    size = 4 * p * (1 + 2 + 1 + 1) + 4  # model, Adam's 2 states, theta_g, momentum; 1 step
    assert cost.recovery_bytes == size
    assert cost.parts == ("model", "optimizer", "theta_g", "outer momentum")
    assert cost.quorum_s == pytest.approx(2.0 + 10 * t + size / bw, rel=1e-12)
    assert cost.restart_s == pytest.approx(1.5 + size / bw + 20 * t, rel=1e-12)
    # the crossover: R(C*) = Q
    star = cost.crossover_interval
    assert star == pytest.approx(2 * (2.0 + 10 * t - 1.5) / t, rel=1e-12)
    at = failure_cost(MODEL, cluster, pred.strategy, t, checkpoint_every=1, startup_s=1.5)
    assert at.restart_s + (star - 1) / 2 * t == pytest.approx(cost.quorum_s, rel=1e-9)


def test_the_failure_rate_crossover_counts_the_restart_checkpoint_writes() -> None:
    """At an interval below C*, a restart loses W / (C t) of the time to writes and
    lambda R(C) to failures, the quorum lambda Q: they meet at lambda*; at C >= C* the quorum
    wins at any rate (None)."""
    cluster = load_cluster("cpu-1gbe", nodes=4)
    pred = predict(MODEL, cluster, StrategySpec(dp=4, method="localsgd:period=50"))
    t = pred.step_time
    cost = failure_cost(MODEL, cluster, pred.strategy, t, checkpoint_every=10)
    lam = cost.crossover_rate
    assert lam is not None and cost.restart_s < cost.quorum_s
    per_hour_restart = 3600 * cost.transfer_s / (10 * t) + lam * cost.restart_s
    assert per_hour_restart == pytest.approx(lam * cost.quorum_s, rel=1e-9)
    far = failure_cost(MODEL, cluster, pred.strategy, t,
                       checkpoint_every=int(cost.crossover_interval) + 1)
    assert far.crossover_rate is None and far.restart_s > far.quorum_s


def test_ist_loses_no_step_and_sends_a_keepers_store() -> None:
    cluster = load_cluster("cpu-1gbe", nodes=4)
    from thinwire.planner import load_model

    mlp = load_model("mlp-784-512-512-10")
    pred = predict(mlp, cluster, StrategySpec(dp=4, method="ist", optimizer="momentum"))
    cost = failure_cost(mlp, cluster, pred.strategy, pred.step_time, checkpoint_every=100)
    assert cost.lost_steps == 0 and cost.parts == ("keeper's store",)
    assert cost.recovery_bytes == 4 * mlp.params * 2  # the store and its dealt momentum


def test_the_launcher_heartbeat_is_the_planner_default() -> None:
    from thinwire.launch import launch_replicas

    assert inspect.signature(launch_replicas).parameters["heartbeat_ms"].default == \
        1000 * HEARTBEAT_S


def test_plan_prints_the_failure_block(capsys) -> None:
    base = ["plan", "--model", "mlp-784-512-512-10", "--cluster", "cpu-1gbe", "--nodes", "4",
            "--method", "localsgd"]
    assert main([*base, "--failures", "--checkpoint-every", "30", "--startup-s", "4"]) == 0
    out = capsys.readouterr().out
    assert "one worker's failure, localsgd(H=10)" in out and "checkpoint every 30 steps" in out
    assert main([*base, "--failures", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["failure"]
    assert got["checkpoint_every"] == 100 and got["lost_steps"] == 10


@pytest.mark.parametrize("extra,needle", [
    (["--startup-s", "3"], "belong to --failures"),
    (["--failures", "--checkpoint-every", "0"], "--checkpoint-every 0"),
    (["--failures", "--crossover"], "drop --crossover"),
])
def test_bad_failure_input_is_one_line(capsys, extra: list[str], needle: str) -> None:
    base = ["plan", "--model", "mlp-784-512-512-10", "--cluster", "cpu-1gbe", "--nodes", "4"]
    assert main([*base, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err, err


def test_a_method_off_the_quorum_is_refused_in_one_line() -> None:
    from thinwire.errors import UsageError

    cluster = load_cluster("cpu-1gbe", nodes=4)
    with pytest.raises(UsageError, match="method hybrid cannot run over a torchft quorum"):
        failure_cost(MODEL, cluster, StrategySpec(dp=4, method="hybrid"), 1.0,
                     checkpoint_every=10)


def test_a_config_with_fault_tolerance_prices_a_failure(tmp_path: Path, capsys) -> None:
    """--config with --cluster: a run that sets runtime.fault_tolerance (or max_restarts)
    gets the failure block, at its own checkpoint interval."""
    cfg = config_mod.load(None, {"model.name": "mlp", "data.name": "digits",
                                 "model.hidden": "16,16", "runtime.workers": 2,
                                 "method.name": "diloco", "train.steps": 20,
                                 "run.checkpoint_every": 10, "method.period": 5,
                                 "runtime.fault_tolerance": "torchft"})
    path = tmp_path / "config.toml"
    path.write_text(config_mod.dumps(cfg))
    assert main(["plan", "--config", str(path), "--cluster", "cpu-1gbe", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["failure"]
    assert got["checkpoint_every"] == 10 and got["lost_steps"] == 5

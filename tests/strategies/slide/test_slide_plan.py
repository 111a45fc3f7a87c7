"""The planner prices method slide from its registry entry: ``thinwire plan --method slide``'s
bytes per step equal a 2-rank run's ledger (both lower-layer modes), its memory one rank's
measured parameters, Adam state and hash tables, and its compute the active fraction's.

Exact equalities: the planner's bytes come from the traffic formula the run's ledger is held to,
its parameter and state bytes from the shard's shapes; a wrong term (a missing all-reduce, the
whole wide layer instead of the shard, the dense work at any active fraction) breaks them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401  # before the ranks fork
from harness import run_workers

from thinwire.builders import build_model, build_strategy, load_data, make_stream
from thinwire.cli import main
from thinwire.config import dumps, load
from thinwire.data.task import task_for
from thinwire.errors import UsageError
from thinwire.planner.presets import load_cluster, load_model
from thinwire.planner.specs import XMLPShapes
from thinwire.planner.step import predict
from thinwire.planner.strategy import StrategySpec
from thinwire.runtime.comm import Comm

SMALL = {"method.name": "slide", "data.labels": 200, "data.features": 300, "data.proto": 8,
         "data.train": 512, "data.test": 64, "model.hidden": 16, "method.K": 4,
         "method.L": 8, "method.active": 0.1, "method.rebuild_first": 50,
         "train.batch_size": 16, "train.lr": 0.01}
STEPS = 3


def _run(comm: Comm, lower: str) -> dict[str, Any]:
    cfg = load(None, {**SMALL, "method.lower": lower, "runtime.workers": comm.world_size})
    ds = load_data(cfg)
    strat = build_strategy(cfg, comm, torch.device("cpu"), task_for(ds), build_model(cfg, ds))
    stream = make_stream(cfg, ds, comm.rank, comm.world_size)
    strat.train_step(stream.batch(0), 0)  # the first step: the state exists from here on
    mark = comm.ledger.mark()
    for s in range(1, STEPS + 1):
        strat.train_step(stream.batch(s), s)
    entries = comm.ledger.entries[mark:]
    mem = strat.memory()
    part = strat.parts[0]
    return {"sent": sum(e.sent for e in entries) / STEPS,
            "payload": sum(e.payload for e in entries) / STEPS,
            "params": mem.params, "optimizer": mem.optimizer,
            "tables": 8 * (part.tables.sorted.numel() + part.tables.offsets.numel()),
            "nnz": int(ds.x_train.shape[2]), "label_cols": int(ds.y_train.shape[1])}


def _predict(lower: str, got: dict[str, Any], workers: int = 2, active: float = 0.1) -> Any:
    shapes = XMLPShapes(features=300, hidden=16, labels=200, nnz=got["nnz"],
                        label_cols=got["label_cols"], batch=16)
    cluster = load_cluster("cpu-1gbe").with_devices(workers)
    spec = f"slide:K=4,L=8,active={active},lower={lower}"
    s = StrategySpec(dp=workers, micro_batch_size=16, micro_batches=1, dtype="fp32",
                     optimizer="adam", method=spec)
    return predict(shapes.spec("xmlp-small"), cluster, s)


@pytest.mark.parametrize("lower", ["average", "replicate"])
def test_planner_equals_a_two_rank_run(lower: str, tmp_path: Path, capsys: Any) -> None:
    ranks = run_workers(_run, 2, lower, timeout=120)
    p = _predict(lower, ranks[0])
    assert p.traffic.dp == max(r["sent"] for r in ranks)
    assert p.traffic.dp_payload == sum(r["payload"] for r in ranks) / 2
    assert p.memory.weights == ranks[0]["params"]
    assert p.memory.optimizer == ranks[0]["optimizer"]
    assert p.memory.activations == ranks[0]["tables"]  # the hash tables, beside the states
    # thinwire plan --config of the same run as written: its bytes, and with --cluster the
    # plan of its shapes, equal the ranks' ledgers (a run priced as dp would differ: the wide
    # layer's gradient, 200 x 17 floats, would be all-reduced)
    cfg = load(None, {**SMALL, "method.lower": lower, "runtime.workers": 2, "train.steps": 5})
    path = tmp_path / "config.toml"
    path.write_text(dumps(cfg))
    assert main(["plan", "--config", str(path), "--cluster", "cpu-1gbe", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes"]["sent_per_worker_max"] == 5 * max(r["sent"] for r in ranks)
    assert "slide" in json.dumps(out["plan"])
    assert out["plan"]["traffic_bytes"]["sync"] == max(r["sent"] for r in ranks)
    assert out["plan"]["memory_bytes"]["weights"] == ranks[0]["params"]


def test_planner_work_follows_the_active_fraction() -> None:
    """The step's compute grows with the active fraction (dense-mp: every neuron)."""
    got = {"nnz": 8, "label_cols": 4}
    small, big = _predict("average", got, 2, 0.01), _predict("average", got, 2, 0.5)
    assert small.breakdown.compute < big.breakdown.compute
    assert small.traffic.dp == big.traffic.dp  # what crosses the wire is b x H, not the width


def test_preset_and_errors() -> None:
    model = load_model("xmlp-amazon-670k")
    assert model.params == 135909 * 128 + 128 + 670091 * 129
    cluster = load_cluster("cpu-1gbe").with_devices(4)
    s = StrategySpec(dp=4, micro_batch_size=1, micro_batches=128, method="slide")
    p = predict(model, cluster, s)
    assert p.memory.weights < 4 * model.params / 2  # a quarter of the wide layer per rank
    from thinwire.planner.insight import method_variants

    assert "slide" in method_variants(model, s, ("slide",))  # a column of --crossover
    with pytest.raises(UsageError, match="--global-batch 512"):
        predict(model, cluster, dataclasses.replace(s, micro_batches=32))
    with pytest.raises(UsageError, match="extreme-classification model"):
        predict(load_model("mlp-10-20-30"), cluster, s)

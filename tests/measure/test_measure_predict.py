"""The run predictor's bytes equal real runs' ledgers, to the byte, for every method.

Each case trains a small MLP on digits through the trainer on 2 forked gloo ranks (the spawn
harness) and compares every rank's ledger with :func:`run_traffic` (the method's own traffic
function over the layout of the run's model), ``summary.json``'s bytes with
:func:`summary_bytes`, and rank 0's calls per collective with the calls the time model
charges. The cases are chosen to catch a wrong layout: 64-512-512-10 (1.2 MB of gradients, so
DDP splits it into a 1 MiB-capped first bucket and a second one from step 1 on), Top-k's
per-bucket k, PowerSGD's per-matrix factors, widths not divisible by 2 for IST (uneven groups
that rotate with the round), and IST moving SGD momentum with its subnets (``reindex``). The
cases are every method's ``ledger`` entry in tests/method_cases.py (the model-parallel methods
name there the tests that hold their ledgers).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import run_workers
from method_cases import params, resolve

from thinwire.config import load
from thinwire.data import load_dataset
from thinwire.measure.calibrate import preimport
from thinwire.measure.predict import optimizer_states, predict_run, run_layout, run_traffic
from thinwire.runtime.comm import Comm
from thinwire.strategies.data_parallel import buckets
from thinwire.trainer import Trainer

BASE = {"data.name": "digits", "train.batch_size": "8", "train.steps": "10",
        "train.eval_every": "0", "run.progress": "false", "runtime.workers": "2"}

RUNS = {f"{m}:{v}": {**case, "method.name": m} for m, v, case in
        (p.values for p in params("ledger"))}
"""Every method's ``ledger`` cases of tests/method_cases.py, by ``method:variant``."""


@pytest.fixture(scope="module", autouse=True)
def _imports_done_once() -> None:
    """Import here, once, what every forked rank would otherwise import on its own (torch's
    compiler stack for the first optimizer; sklearn for digits): seconds per rank and run."""
    preimport()
    load_dataset("digits")


def _train(comm: Comm, cfg, run_dir: str) -> dict:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    summary = Trainer(cfg, comm, torch.device("cpu"), Path(run_dir)).run()
    return {"summary": summary, "totals": comm.ledger.totals(), "by_op": comm.ledger.by_op()}


@pytest.mark.parametrize("method,variant,case", params("ledger"))
def test_predicted_bytes_equal_a_real_run(method: str, variant: str, case: dict,
                                          tmp_path: Path) -> None:
    cfg = load(None, {**BASE, **resolve(case), "method.name": method, "run.out": str(tmp_path)})
    out = run_workers(_train, 2, cfg, str(tmp_path / "run"))
    layout = run_layout(cfg)
    want = run_traffic(cfg, layout)
    assert [o["totals"]["sent_bytes"] for o in out] == list(want.sent)
    assert [o["totals"]["recv_bytes"] for o in out] == list(want.recv)
    assert [o["totals"]["payload_bytes"] for o in out] == list(want.payload)
    pred, b = predict_run(cfg, layout), out[0]["summary"]["bytes"]
    for key in ("sent_per_worker_mean", "sent_per_worker_max", "payload_per_worker_mean"):
        assert pred[key] == b[key], key
    collectives = {"all_reduce", "all_gather"}
    counted: dict[str, int] = {}
    for key, v in out[0]["by_op"].items():
        op = key.partition(":")[0]
        op = op if op in collectives else "p2p"  # the ledger's sends and receives
        counted[op] = counted.get(op, 0) + v["calls"]
    charged = {op: calls for op, (calls, _) in want.rank0_calls.items() if calls}
    if case.get("method.deployment") == "sharded":  # rank 0 both sends and receives in
        # every exchange
        charged["p2p"] *= 2
    assert counted == charged


def test_the_layout_is_the_models_in_gradient_ready_order() -> None:
    cfg = load(None, {**BASE, **RUNS["dp:plain"], "run.out": "unused"})
    layout = run_layout(cfg)
    assert [p.name for p in layout.ready_order][:3] == ["layers.2.weight", "norms.1.weight",
                                                        "norms.1.bias"]
    sizes = [sum(p.numel for p in b) for b in buckets(layout.ready_order)]
    assert sizes == [5120 + 512 + 512 + 262_144, 32_768 + 512 + 512]  # 1 MiB first, then 25 MiB
    assert layout.ist is not None and [g.size for g in layout.ist.groups] == [512, 512]


@pytest.mark.parametrize("over,states", [({}, 0), ({"train.momentum": "0.9"}, 1),
                                         ({"train.optimizer": "adamw"}, 2)])
def test_optimizer_states_count_the_per_element_state(over: dict, states: int) -> None:
    cfg = load(None, {**BASE, **RUNS["dp:plain"], **over, "run.out": "unused"})
    assert optimizer_states(cfg) == states

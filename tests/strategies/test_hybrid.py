"""Hybrid data + model parallelism of the DLRM on the synthetic click log, with and without DCT.

Exactness (no DCT): the tables split over ranks and the all-to-all exchange compute the same
function as one process on the global batch, so after 2 SGD steps parameters agree to float32
rounding (atol 1e-6 on weights of order 0.1; a table update lost, doubled or not divided by n
moves them by ~lr x gradient ~1e-3). Quality: both runs beat the majority-class baseline, whose
AUC is 0.5 and log loss the entropy of the click rate.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401  # before the ranks fork: each would import it at its first optimizer
from harness import run_workers

from thinwire.builders import build_model, build_strategy, load_data, make_stream
from thinwire.config import load
from thinwire.data.task import auc, task_for
from thinwire.errors import UsageError
from thinwire.measure.predict import run_traffic
from thinwire.runtime.comm import Comm
from thinwire.strategies import METHODS
from thinwire.strategies.hybrid import traffic_of

BASE = {"model.name": "dlrm", "method.name": "hybrid", "data.tables": 4, "data.rows": 50,
        "data.train": 4096, "data.test": 2048, "model.dim": 8, "model.bottom": "16",
        "model.top": "16", "train.batch_size": 64}


CLIP = 0.05


def _runs(comm: Comm) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # exactness: 2 SGD steps on a fixed global batch, without and with clipping
    b, n = 64, comm.world_size
    for clip in (0.0, CLIP):
        cfg = load(None, {**BASE, "runtime.workers": n, "train.lr": 0.5, "train.steps": 2,
                          "train.clip_norm": clip})
        ds = load_data(cfg)
        strat = build_strategy(cfg, comm, torch.device("cpu"), task_for(ds),
                               build_model(cfg, ds))
        mark = comm.ledger.mark()
        for s in range(2):
            rows = slice(s * n * b + comm.rank * b, s * n * b + (comm.rank + 1) * b)
            strat.train_step((ds.x_train[rows], ds.y_train[rows]), s)
        out[f"sent{clip}"] = comm.ledger.totals(since=mark)["sent_bytes"]
        dense = sum(p.numel() for p in strat.dense)
        out[f"want{clip}"] = traffic_of(b, 4, 8, dense, n, 2, clip=clip > 0).sent[comm.rank]
        # the prediction of the run: the registry's formula over its run layout
        layout = METHODS.get("hybrid").run_layout(cfg, build_model(cfg, ds), (ds.x_train[:b],
                                                                              ds.y_train[:b]))
        out[f"predicted{clip}"] = run_traffic(cfg, layout).sent[comm.rank]
        m = strat.eval_model()
        out[f"exact{clip}"] = None if m is None else {k: v.detach().clone() for k, v in
                                                      m.named_parameters()}
    # quality with and without DCT
    for dct in (False, True):
        cfg = load(None, {**BASE, "runtime.workers": n, "train.optimizer": "adamw",
                          "train.lr": 0.01, "train.steps": 60, "method.dct": dct,
                          "method.every": 20, "method.dp_keep": 0.05,
                          "method.mp_keep": 0.2})
        strat = build_strategy(cfg, comm, torch.device("cpu"), task_for(ds),
                               build_model(cfg, ds))
        stream = make_stream(cfg, ds, comm.rank, n)
        mark = comm.ledger.mark()
        for s in range(60):
            strat.train_step(stream.batch(s), s)
        by_tag: dict[str, int] = {}
        for e in comm.ledger.entries[mark:]:
            by_tag[e.tag] = by_tag.get(e.tag, 0) + e.sent
        m = strat.eval_model()
        out[f"dct={dct}"] = (by_tag, None if m is None else
                             task_for(ds).evaluate(m, ds.x_test, ds.y_test))
    return out


def _reference(clip: float) -> dict[str, torch.Tensor]:
    """One process, the global batches; with ``clip`` torch's ``clip_grad_norm_`` on the whole
    model (asserted to clip)."""
    cfg = load(None, {**BASE, "method.name": "dp", "runtime.workers": 1, "train.lr": 0.5})
    ds = load_data(cfg)
    model = build_model(cfg, ds)
    task = task_for(ds)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for s in range(2):
        rows = slice(s * 128, (s + 1) * 128)
        opt.zero_grad()
        task.loss(model(ds.x_train[rows]), ds.y_train[rows]).backward()
        if clip:
            assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)) > 2 * clip
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def test_hybrid_dlrm_exact_and_beats_majority_with_and_without_dct() -> None:
    """Exact without and with clipping (the owned tables' squares summed over the ranks, the
    replicated MLPs once), the ledger equal to the formula and to the run's prediction."""
    out = run_workers(_runs, 2, timeout=120)
    for clip in (0.0, CLIP):
        ref = _reference(clip)
        for k, v in ref.items():
            torch.testing.assert_close(out[0][f"exact{clip}"][k], v, atol=1e-6, rtol=1e-5,
                                       msg=lambda m, k=k, c=clip: f"clip={c} {k}: {m}")
        for r in range(2):
            assert out[r][f"sent{clip}"] == out[r][f"want{clip}"] == out[r][f"predicted{clip}"], \
                (clip, r)
    assert out[0][f"sent{CLIP}"] > out[0]["sent0.0"]  # the norm's all-reduce
    ds = load_data(load(None, {**BASE, "runtime.workers": 2}))
    rate = float(ds.y_test.float().mean())
    majority_nll = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    oracle = auc(ds.extra["p_test"], ds.y_test.float())
    plain_bytes, plain = out[0]["dct=False"]
    dct_bytes, dct = out[0]["dct=True"]
    for result in (plain, dct):
        assert result["auc"] > 0.6, result  # majority class: 0.5
        assert result["nll"] < majority_nll - 0.01, (result, majority_nll)
        assert result["auc"] < oracle + 0.02
    assert dct_bytes["grad"] * 5 < plain_bytes["grad"]
    assert dct_bytes["mp"] < plain_bytes["mp"]
    assert dct["auc"] == pytest.approx(plain["auc"], abs=0.05)


def test_hybrid_traffic_refuses_dct_with_one_line() -> None:
    cfg = load(None, {**BASE, "runtime.workers": 2, "method.dct": True})
    ds = load_data(cfg)
    layout = METHODS.get("hybrid").run_layout(cfg, build_model(cfg, ds), (ds.x_train[:64],
                                                                          ds.y_train[:64]))
    with pytest.raises(UsageError, match="depend on the data") as exc:
        run_traffic(cfg, layout)
    assert "\n" not in str(exc.value)

"""dp x pp x tp: a GPT in 2 pipeline stages, each stage's blocks tensor-parallel over 2 ranks,
2 data-parallel replicas (8 gloo ranks). With the identity codecs, GPipe and 1F1B train to the
parameters of one process running the same micro-batches through the whole model, every rank
reports its replica's loss, and every rank's ledger equals the method's traffic formula (what
the planner reads) to the byte.

Tolerance: boundary tensors cross bit for bit, but a row-parallel layer's output is the sum of
tp partial products (each a float32 dot product over half the inputs, then one add) where the
reference computes one dot product, and the replicas' gradients are summed before the division
by dp: float32 reassociation, ~1e-7 relative per operation on values of order 1e-2. Over 2
SGD steps (lr 0.1) on a 4-block model the parameters differ by a few 1e-9 (measured 4e-9);
atol 1e-7 and rtol 1e-5 leave a wide margin, while a missing or doubled group sum, a wrong
slice or a dropped micro-batch moves parameters by lr x gradient, ~1e-3 (a missing backward
sum changes the second step's loss in the fifth digit), and fails."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401  # before the ranks fork: each would import it at its first optimizer
import torch.nn.functional as F
from harness import pipeline_config, run_workers

from thinwire.config import load
from thinwire.errors import UsageError
from thinwire.measure.predict import run_traffic
from thinwire.models.gpt import GPT
from thinwire.runtime.mesh import Mesh
from thinwire.strategies import METHODS
from thinwire.strategies.base import Context
from thinwire.strategies.pipeline.method import PipelineStrategy

DP, PP, TP = 2, 2, 2
M, B, L, V, STEPS = 2, 4, 16, 13, 2


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def make() -> GPT:
    torch.manual_seed(0)
    return GPT(V, L, n_layer=4, n_head=4, d_model=32)


def batch(d: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + d)
    return torch.randint(0, V, (B, L), generator=g), torch.randint(0, V, (B, L), generator=g)


def config(schedule: str, **extra: Any) -> Any:
    return pipeline_config(schedule=schedule, pp=PP, workers=DP * PP * TP, micro_batches=M,
                           batch_size=B, **{"parallel.tp": TP, "train.steps": STEPS,
                                            "train.eval_every": STEPS, **extra})


def _train(comm: Any, runs: list[tuple[str, float]]) -> list[dict[str, Any]]:
    mesh = Mesh(comm, dp=DP, pp=PP, tp=TP)
    out = []
    for schedule, clip in runs:
        ctx = Context(cfg=config(schedule, **{"train.clip_norm": clip}), comm=comm,
                      device=torch.device("cpu"), loss=lm_loss, mesh=mesh)
        strat = PipelineStrategy(ctx, make())
        d, dps = strat.data_shard()
        assert (d, dps) == (mesh.coords.dp, DP)
        mark = comm.ledger.mark()
        losses = [strat.train_step(batch(d, t), t) for t in range(STEPS)]
        totals = comm.ledger.totals(since=mark)
        tags = {e.tag for e in comm.ledger.entries[mark:]}
        full = strat.eval_model()
        out.append({"losses": losses, "sent": totals["sent_bytes"],
                    "payload": totals["payload_bytes"], "tags": tags,
                    "params": None if full is None else
                    {k: v.detach().clone() for k, v in full.named_parameters()}})
    return out


def _reference(clip: float) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """One process, the whole model: per step every replica's micro-batches, gradients of
    loss / (M dp) accumulated, with ``clip`` torch's ``clip_grad_norm_`` (asserted to clip),
    one SGD step. Losses per step and replica."""
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for t in range(STEPS):
        opt.zero_grad()
        per = []
        for d in range(DP):
            x, y = batch(d, t)
            total = 0.0
            for xm, ym in zip(x.chunk(M), y.chunk(M)):
                part = lm_loss(model(xm), ym) / M
                (part / DP).backward()
                total += float(part.detach())
            per.append(total)
        if clip:
            assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)) > 2 * clip
        opt.step()
        losses.append(per)
    return losses, {k: v.detach() for k, v in model.named_parameters()}


CLIP = 0.05


def test_dp_pp_tp_2x2x2_matches_one_process_and_the_traffic_formula() -> None:
    """GPipe with clipping (the whole model's norm: slices summed over tp, replicated
    parameters once, stages summed over pp) and 1F1B without."""
    runs = [("gpipe", CLIP), ("1f1b", 0.0)]
    results = run_workers(_train, DP * PP * TP, runs, timeout=120)
    for i, (schedule, clip) in enumerate(runs):
        losses, want = _reference(clip)
        cfg = config(schedule, **{"train.clip_norm": clip})
        # the prediction of the run (measure.predict): the registry's traffic formula over the
        # method's run layout of a fresh model and one batch
        layout = METHODS.get("pipeline").run_layout(cfg, make(), batch(0, 0))
        predicted = run_traffic(cfg, layout)
        for rank, per_run in enumerate(results):
            r = per_run[i]
            d = rank // (PP * TP)
            assert r["losses"] == pytest.approx([row[d] for row in losses], rel=1e-5), \
                (schedule, rank)
            assert (r["sent"], r["payload"]) == (predicted.sent[rank], predicted.payload[rank]), \
                (schedule, rank, r["sent"], predicted.sent[rank])
            assert {"tp", "grad", "act", "actgrad"} <= r["tags"], (schedule, rank, r["tags"])
        full = results[2][i]["params"]  # replica 0's last stage, tensor rank 0, evaluates
        assert full is not None and all(per_run[i]["params"] is None
                                        for k, per_run in enumerate(results) if k != 2)
        assert set(full) == set(want)
        for k, v in want.items():
            torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, k=k, s=schedule: f"{s} {k}: {m}")
        moved = max(float((v - make().state_dict()[k]).abs().max()) for k, v in want.items())
        # the steps changed the model (clipped: by at most lr x clip a step), far beyond the
        # tolerance: the comparison is not vacuous
        assert moved > (1e-4 if clip else 1e-3)


def test_dp_pp_tp_refuses_what_it_cannot_split() -> None:
    """One-line errors: a tensor codec without tensor parallelism, the tensor method with
    stages, a tp that does not divide the heads, dropout, a model without a tensor-parallel
    plan."""
    entry = METHODS.get("pipeline")
    assert entry.check_model is not None
    with pytest.raises(UsageError, match="method.tp_codec"):
        config("1f1b", **{"method.tp_codec": "int8", "parallel.tp": 1, "runtime.workers": 4})
    with pytest.raises(UsageError, match="--method pipeline --parallel.pp S --parallel.tp T"):
        load(None, {"model.name": "gpt", "data.name": "tinyshakespeare", "method.name": "tensor",
                    "parallel.pp": 2, "parallel.tp": 2, "runtime.workers": 4})
    with pytest.raises(UsageError, match="does not divide the 4 units"):
        entry.check_model(config("1f1b", **{"parallel.tp": 3, "runtime.workers": 12}), make())
    with pytest.raises(UsageError, match="dropout"):
        entry.check_model(config("1f1b", **{"model.dropout": 0.1}), make())
    with pytest.raises(UsageError, match="offers no tensor-parallel plan"):
        entry.check_model(load(None, {"model.name": "mlp", "data.name": "digits",
                                      "method.name": "pipeline", "parallel.pp": 2,
                                      "parallel.tp": 2, "runtime.workers": 4}), make())

"""Pipeline exactness: with the identity codec, GPipe and 1F1B over S = 2 and 4 stages and
dp = 1 and 2 replicas give the loss and the gradients of one process running the same
micro-batches through the whole model and averaging the replicas' gradients; every rank's
ledger equals the method's traffic formula to the byte.

Tolerance: boundary tensors arrive bit for bit and each stage's backward is the whole model's
autograd graph, with micro-batch gradients accumulated in the same order (m = 0 .. M-1); what
may differ is the order of float additions inside kernels (an embedding's scattered gradient
rows, the all-reduce's sum of the replicas before the division by dp instead of after), a few
float32 roundings of values of order 1e-2: rtol 1e-5 and atol 1e-7 are hundreds of roundings
wide and far below any real error (a dropped micro-batch changes gradients by ~25 %)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from harness import pipeline_config, run_workers

from thinwire.models.gpt import GPT
from thinwire.models.mlp import build_mlp
from thinwire.runtime.mesh import Mesh
from thinwire.strategies import METHODS
from thinwire.strategies.base import Context
from thinwire.strategies.pipeline.method import PipelineStrategy
from thinwire.strategies.pipeline.plan import pipeline_layout

M, B, L, V = 4, 8, 6, 11


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if out.dim() == 3:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.cross_entropy(out, y)


def make(model_name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if model_name == "gpt":
        return GPT(V, L, n_layer=2, n_head=2, d_model=8)
    return build_mlp(5, (6, 6, 6), 3, norm="layer", seed=0)


def batch(model_name: str, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + d)
    if model_name == "gpt":
        return (torch.randint(0, V, (B, L), generator=g), torch.randint(0, V, (B, L), generator=g))
    return torch.randn(B, 5, generator=g), torch.randint(0, 3, (B,), generator=g)


def config(model_name: str, schedule: str, S: int, dp: int, clip: float = 0.0):
    return pipeline_config(model=model_name, schedule=schedule, pp=S, workers=S * dp,
                           micro_batches=M, batch_size=B, **{"train.clip_norm": clip})


def _stage_grads(comm, S: int, dp: int, runs) -> list:
    mesh = Mesh(comm, dp=dp, pp=S)
    out = []
    for model_name, schedule in runs:
        cfg = config(model_name, schedule, S, dp)
        model = make(model_name)
        ctx = Context(cfg=cfg, comm=comm, device=torch.device("cpu"), loss=lm_loss, mesh=mesh)
        strat = PipelineStrategy(ctx, model)
        shard, shards = strat.data_shard()
        assert (shard, shards) == (mesh.coords.dp, dp)
        mark = comm.ledger.mark()
        loss = strat.train_step(batch(model_name, shard), 0)
        sent = comm.ledger.totals(since=mark)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append((loss, grads, sent["sent_bytes"], sent["payload_bytes"]))
    return out


def _reference(model_name: str, dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: every replica's micro-batches through the whole model; the replicas'
    gradients averaged."""
    model = make(model_name)
    losses, total = [], {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for d in range(dp):
        model.zero_grad()
        x, y = batch(model_name, d)
        loss = 0.0
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            part = lm_loss(model(xm), ym) / M
            part.backward()
            loss += float(part.detach())
        losses.append(loss)
        for n, p in model.named_parameters():
            total[n] += p.grad / dp
    return losses, total


def _check(S: int, dp: int, runs) -> None:
    results = run_workers(_stage_grads, S * dp, S, dp, runs)
    for i, (model_name, schedule) in enumerate(runs):
        losses, want = _reference(model_name, dp)
        cfg = config(model_name, schedule, S, dp)
        model = make(model_name)
        layout = pipeline_layout(cfg, model, batch(model_name, 0))
        traffic = METHODS.get("pipeline").traffic(layout, cfg.method.options, S * dp, 1, 0, 0)
        for rank, per_run in enumerate(results):
            loss, grads, sent, payload = per_run[i]
            d = rank // S
            # every rank reports its replica's loss (the last stage's, broadcast)
            assert abs(loss - losses[d]) < 1e-6, (model_name, schedule, rank, loss, losses[d])
            assert sent == traffic.sent[rank] and payload == traffic.payload[rank], \
                (model_name, schedule, rank, sent, traffic.sent[rank])
            for n, g in grads.items():
                torch.testing.assert_close(g, want[n], rtol=1e-5, atol=1e-7, msg=n)
        # every parameter is some stage's
        covered = set().union(*(per_run[i][1] for per_run in results))
        assert covered == set(want), set(want) - covered


def test_two_stages_one_replica() -> None:
    _check(2, 1, [("gpt", "gpipe"), ("gpt", "1f1b"), ("mlp", "1f1b")])


def test_two_stages_two_replicas() -> None:
    _check(2, 2, [("gpt", "gpipe"), ("gpt", "1f1b")])


def test_four_stages_one_replica() -> None:
    _check(4, 1, [("gpt", "gpipe"), ("gpt", "1f1b")])


def test_four_stages_two_replicas() -> None:
    _check(4, 2, [("gpt", "gpipe"), ("gpt", "1f1b"), ("mlp", "gpipe")])

"""The planner's pipeline model held to runs: the bytes it predicts from a transformer's
dimensions alone (stages, micro-batches, micro-batch size, sequence length, d_model, codecs) are
every rank's ledger bytes, to the byte, for S = 2 and 4 stages; and its step time is M slots of
the slowest stage plus a bubble of S - 1 mean slots."""

from __future__ import annotations

import pytest
import torch
from harness import run_workers
from test_pipeline_exact import B, L, M, batch, lm_loss, make

from thinwire.errors import UsageError
from thinwire.planner.pipeline import (
    PipelineShape,
    boundary_bytes,
    options_of,
    step_time,
    traffic,
)
from thinwire.runtime.mesh import Mesh
from thinwire.strategies.base import Context
from thinwire.strategies.pipeline.method import PipelineParallel

CODECS = [("int8", "int4"), ("topk:ratio=0.25", "lowrank:rank=2")]
STEPS = 2
D_MODEL = 8  # make("gpt")'s width; its blocks keep it, so every boundary carries [b, L, 8]


def _cfg(S: int, fwd: str, bwd: str):
    from thinwire.config import load

    return load(None, {"model.name": "gpt", "data.name": "tinyshakespeare",
                       "method.name": "pipeline", "method.schedule": "1f1b",
                       "method.micro_batches": M, "method.codec_fwd": fwd,
                       "method.codec_bwd": bwd, "parallel.pp": S, "runtime.workers": S,
                       "train.batch_size": B, "train.lr": 0.1})


def _ledgers(comm, S: int) -> list[tuple[int, int]]:
    mesh = Mesh(comm, dp=1, pp=S)
    out = []
    for fwd, bwd in CODECS:
        cfg = _cfg(S, fwd, bwd)
        ctx = Context(cfg=cfg, comm=comm, device=torch.device("cpu"), loss=lm_loss, mesh=mesh)
        strat = PipelineParallel(ctx, make("gpt"))
        mark = comm.ledger.mark()
        for step in range(STEPS):
            strat.train_step(batch("gpt", 0), step)
        got = comm.ledger.totals(since=mark)
        out.append((got["sent_bytes"], got["payload_bytes"]))
    return out


@pytest.mark.parametrize("S", [2, 4])
def test_planner_predicts_every_ranks_ledger_bytes(S: int) -> None:
    results = run_workers(_ledgers, S, S)
    shape = PipelineShape(stages=S, micro_batches=M, micro_batch=B // M, seq=L, d_model=D_MODEL)
    for i, (fwd, bwd) in enumerate(CODECS):
        want = traffic(shape, options_of(fwd, bwd, micro_batches=M), steps=STEPS)
        for rank in range(S):
            sent, payload = results[rank][i]
            # the loss broadcast is control traffic, outside the ledger's sent/payload totals
            assert (sent, payload) == (want.sent[rank], want.payload[rank]), (S, fwd, bwd, rank)
    # the codecs shrink what the planner predicts: int8/int4 send under a third of fp32
    plain = traffic(shape, options_of(micro_batches=M)).sent
    packed = traffic(shape, options_of("int8", "int4", micro_batches=M)).sent
    assert all(3 * p < q for p, q in zip(packed, plain))


def test_step_time_is_m_slowest_slots_and_a_bubble_of_s_minus_one_mean_slots() -> None:
    shape = PipelineShape(stages=4, micro_batches=8, micro_batch=2, seq=16, d_model=32)
    o = options_of("int8", "none", micro_batches=8)
    sent = boundary_bytes(shape, o)
    fp32 = 2 * 16 * 32 * 4
    assert sent[0] == pytest.approx(2 * 16 * 32 + 4 * 2)  # one int8 message and its scales
    assert sent[3] == fp32  # the last stage sends one plain gradient
    t = step_time(shape, o, [1.0, 1.0, 1.5, 1.0], bandwidth=1000.0, latency=0.01,
                  codec_seconds=[0.1, 0.2, 0.2, 0.1])
    # stage 2 is the slowest: 1.5 s compute, 0.2 s codec, two messages at 10 ms
    assert t.compute == 1.5 and t.codec == 0.2
    assert t.transfer == pytest.approx(sent[2] / 1000.0 + 0.02)
    slots = [c + e + x for c, e, x in
             zip([1.0, 1.0, 1.5, 1.0], [0.1, 0.2, 0.2, 0.1],
                 [sent[0] / 1e3 + 0.01, sent[1] / 1e3 + 0.02, sent[2] / 1e3 + 0.02,
                  sent[3] / 1e3 + 0.01])]
    assert t.total == pytest.approx(8 * max(slots) + 3 * sum(slots) / 4)
    equal = step_time(shape, o, [1.0] * 4, bandwidth=1e12)
    assert equal.bubble / equal.schedule == pytest.approx(3 / 11)  # (S-1)/(M+S-1)
    shared = step_time(shape, o, [1.0, 1.0, 1.5, 1.0], bandwidth=1e12, cores=1)
    assert shared.total == pytest.approx(8 * 4.5)  # one core: the stages' work in turn
    with pytest.raises(UsageError, match="stage_seconds"):
        step_time(shape, o, [1.0], bandwidth=1.0)

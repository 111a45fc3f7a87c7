"""The planner's pipeline model held to runs: the bytes it predicts from a transformer's
dimensions alone (stages, micro-batches, micro-batch size, sequence length, d_model, codecs) are
every rank's ledger bytes, to the byte, for S = 2 and 4 stages; its step time is M slots of
the slowest stage plus a bubble of S - 1 mean slots; its simulation of the schedule agrees with
that closed form where the closed form is exact, keeps a shared core busy, and puts the codec's
own bytes on the links; a stage's passes are timed where the simulation reads them."""

from __future__ import annotations

import pytest
import torch
from harness import pipeline_config, run_workers
from test_pipeline_exact import B, L, M, batch, lm_loss, make

from thinwire.errors import UsageError
from thinwire.planner.pipeline import (
    PipelineShape,
    boundary_bytes,
    options_of,
    simulate,
    step_time,
    traffic,
)
from thinwire.runtime.mesh import Mesh
from thinwire.strategies.base import Context
from thinwire.strategies.pipeline.method import PipelineStrategy
from thinwire.strategies.pipeline.schedule import Boundaries

CODECS = [("int8", "int4"), ("topk:ratio=0.25", "lowrank:rank=2")]
STEPS = 2
D_MODEL = 8  # make("gpt")'s width; its blocks keep it, so every boundary carries [b, L, 8]


def _cfg(S: int, fwd: str, bwd: str):
    return pipeline_config(pp=S, workers=S, micro_batches=M, batch_size=B,
                           **{"method.codec_fwd": fwd, "method.codec_bwd": bwd})


def _ledgers(comm, S: int) -> list[tuple[int, int]]:
    mesh = Mesh(comm, dp=1, pp=S)
    out = []
    for fwd, bwd in CODECS:
        cfg = _cfg(S, fwd, bwd)
        ctx = Context(cfg=cfg, comm=comm, device=torch.device("cpu"), loss=lm_loss, mesh=mesh)
        strat = PipelineStrategy(ctx, make("gpt"))
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


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("S", "M"), [(2, 4), (4, 4), (4, 8), (3, 5)])
def test_simulation_is_the_closed_form_for_equal_stages_on_their_own_cores(schedule, S, M):
    shape = PipelineShape(stages=S, micro_batches=M, micro_batch=2, seq=4, d_model=8)
    o = options_of(micro_batches=M, schedule=schedule)
    sim = simulate(shape, o, [1.0] * S, [2.0] * S, bandwidth=1e18, optimizer_seconds=0.5)
    closed = step_time(shape, o, [3.0] * S, bandwidth=1e18, optimizer_seconds=0.5)
    # (M + S - 1)(F + B) + the optimizer: fill, M slots of the slowest stage, drain
    assert sim.total == pytest.approx((M + S - 1) * 3.0 + 0.5)
    assert sim.total == pytest.approx(closed.total)
    assert sim.busy == pytest.approx((M * 3.0 + 0.5,) * S)
    # unequal forward and backward at the same F + B: the same total (every pass waits its turn)
    skew = simulate(shape, o, [2.5] * S, [0.5] * S, bandwidth=1e18)
    assert skew.total == pytest.approx((M + S - 1) * 3.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulation_keeps_one_shared_core_busy_and_stretches_over_fewer_cores(schedule):
    S, M = 4, 4
    shape = PipelineShape(stages=S, micro_batches=M, micro_batch=2, seq=4, d_model=8)
    o = options_of(micro_batches=M, schedule=schedule)
    f, b, opt = [0.5, 1.0, 0.75, 0.25], [1.0, 2.0, 1.5, 0.5], [0.1, 0.2, 0.1, 0.1]
    one = simulate(shape, o, f, b, bandwidth=1e18, optimizer_seconds=opt, cores=1)
    work = M * (sum(f) + sum(b)) + sum(opt)
    # with no wire time some stage always has a pass in hand: the core never idles
    assert one.total == pytest.approx(work)
    assert one.work == pytest.approx(work)
    two = simulate(shape, o, f, b, bandwidth=1e18, optimizer_seconds=opt, cores=2)
    own = simulate(shape, o, f, b, bandwidth=1e18, optimizer_seconds=opt)
    assert work / 2 <= two.total + 1e-9  # two cores do the work at best twice as fast
    assert own.total < two.total < one.total  # sharing costs time; the dependencies stay
    assert simulate(shape, o, f, b, bandwidth=1e18, optimizer_seconds=opt,
                    cores=S).total == pytest.approx(own.total)


def test_simulation_puts_each_codecs_bytes_on_the_links_and_waits_for_them():
    shape = PipelineShape(stages=2, micro_batches=1, micro_batch=2, seq=4, d_model=8)
    bw, lat = 1000.0, 0.25
    for fwd, bwd in [("none", "none"), ("int8", "none"), ("int4", "int8")]:
        o = options_of(fwd, bwd, micro_batches=1)
        x = traffic(shape, o).sent  # stage 0 sends the activation, stage 1 its gradient
        sim = simulate(shape, o, [0.0, 0.0], [0.0, 0.0], bandwidth=bw, latency=lat)
        # one micro-batch, no compute: the activation's transfer, the gradient's, a latency each
        assert sim.total == pytest.approx(x[0] / bw + x[1] / bw + 2 * lat), (fwd, bwd)
        # behind a token bucket, a message's first `burst` bytes pass at once
        half = min(x) / 2
        bucket = simulate(shape, o, [0.0, 0.0], [0.0, 0.0], bandwidth=bw, latency=lat,
                          burst=half)
        assert bucket.total == pytest.approx((x[0] - half + x[1] - half) / bw + 2 * lat)
        full = simulate(shape, o, [0.0, 0.0], [0.0, 0.0], bandwidth=bw, latency=lat,
                        burst=max(x))
        assert full.total == pytest.approx(2 * lat)
    # GPipe over 3 stages, 2 micro-batches, no compute, a message one unit of time: the
    # activations reach stage 1 at 1 and 2 and stage 2 at 2 and 3; stage 2's gradients leave at
    # 3 and, its upload one message at a time, reach stage 1 at 4 and 5; stage 1 sends them on
    # at once: stage 0 has the last at 6
    shape3 = PipelineShape(stages=3, micro_batches=2, micro_batch=2, seq=4, d_model=8)
    o = options_of(micro_batches=2, schedule="gpipe")
    msg = 2 * 4 * 8 * 4 / bw
    sim = simulate(shape3, o, [0.0] * 3, [0.0] * 3, bandwidth=bw)
    assert sim.total == pytest.approx(6 * msg)


def test_simulation_starts_a_rendezvous_transfer_only_when_the_receiver_waits():
    # GPipe, 2 stages, 2 micro-batches; a message takes 1 s; stage 1's forward takes 1 s, all
    # else nothing. Eager: micro-batch 1's activation crosses while stage 1 computes
    # micro-batch 0 (arrives at 2), the gradients leave at 3 and 3: the last lands at 5.
    # Rendezvous (gloo, NCCL): it crosses only once stage 1 asks for it, at 2: one second later.
    shape = PipelineShape(stages=2, micro_batches=2, micro_batch=2, seq=4, d_model=8)
    o = options_of(micro_batches=2, schedule="gpipe")
    bw = 2 * 4 * 8 * 4  # bytes of one plain message: 1 s each
    eager = simulate(shape, o, [0.0, 1.0], [0.0, 0.0], bandwidth=bw, rendezvous=False)
    meet = simulate(shape, o, [0.0, 1.0], [0.0, 0.0], bandwidth=bw)
    assert eager.total == pytest.approx(5.0)
    assert meet.total == pytest.approx(6.0)


def test_simulation_holds_a_transfer_while_its_receivers_upload_sends():
    # GPipe, 3 stages, 2 micro-batches, no compute, 1 s a message. Without queued ACKs the last
    # gradient lands at 6 (the test above). With them, a message into stage r waits for r's
    # upload: micro-batch 1's activation waits for stage 1's send of micro-batch 0 (2 s, not
    # 1), micro-batch 0's gradient for stage 1's send of activation 1, and so on down the
    # schedule: each of stage 1's sends defers one of its receives, 2 s in all.
    shape = PipelineShape(stages=3, micro_batches=2, micro_batch=2, seq=4, d_model=8)
    o = options_of(micro_batches=2, schedule="gpipe")
    bw = 2 * 4 * 8 * 4
    free = simulate(shape, o, [0.0] * 3, [0.0] * 3, bandwidth=bw)
    held = simulate(shape, o, [0.0] * 3, [0.0] * 3, bandwidth=bw, acks_queue=True)
    assert free.total == pytest.approx(6.0)
    assert held.total == pytest.approx(8.0)
    ends = {(s, k, m): e for s, k, m, _, e in held.passes}
    assert ends[(1, "F", 1)] == pytest.approx(3.0)  # its activation crossed in [2, 3]


def test_simulation_charges_each_codec_to_the_pass_that_runs_it():
    # 2 stages, 1 micro-batch, no compute, free link; boundary 0 encodes the activation in 1 s,
    # decodes it in 2, encodes the gradient in 3, decodes it in 4: stage 0's forward (encode),
    # stage 1's forward (decode) and backward (encode), stage 0's backward (decode), in turn
    shape = PipelineShape(stages=2, micro_batches=1, micro_batch=2, seq=4, d_model=8)
    o = options_of("int8", "int8", micro_batches=1)
    sim = simulate(shape, o, [0.0, 0.0], [0.0, 0.0], bandwidth=1e18,
                   codec_seconds=[(1.0, 2.0, 3.0, 4.0)])
    assert sim.total == pytest.approx(10.0)
    assert sim.busy == pytest.approx((5.0, 5.0))
    ends = {(s, k): e for s, k, _, _, e in sim.passes}
    assert ends[(0, "F")] == pytest.approx(1.0) and ends[(1, "B")] == pytest.approx(6.0)


def test_simulation_rejects_what_does_not_fit_the_shape():
    shape = PipelineShape(stages=2, micro_batches=2, micro_batch=2, seq=4, d_model=8)
    o = options_of(micro_batches=2)
    with pytest.raises(UsageError, match="backward"):
        simulate(shape, o, [1.0, 1.0], [1.0], bandwidth=1.0)
    with pytest.raises(UsageError, match="codec_seconds"):
        simulate(shape, o, [1.0, 1.0], [1.0, 1.0], bandwidth=1.0, codec_seconds=[(0, 0)])
    with pytest.raises(UsageError, match="cores"):
        simulate(shape, o, [1.0, 1.0], [1.0, 1.0], bandwidth=1.0, cores=0)
    with pytest.raises(UsageError, match="burst"):
        simulate(shape, o, [1.0, 1.0], [1.0, 1.0], bandwidth=1.0, burst=-1)
    with pytest.raises(UsageError, match="micro_batches"):
        simulate(shape, options_of(micro_batches=3), [1.0, 1.0], [1.0, 1.0], bandwidth=1.0)


def test_a_stage_times_its_passes_in_schedule_order_on_a_silent_communicator():
    from thinwire.measure.local import Silent
    from thinwire.models import MODELS
    from thinwire.strategies.pipeline.schedule import Pipeline, order

    model = make("gpt")
    chain = MODELS.get("gpt").chain(model)
    x, y = batch("gpt", 0)
    for s in range(2):
        pipe = Pipeline(chain, Silent(s, 2), micro_batches=M, loss=lm_loss, example=x[:B // M],
                        schedule="1f1b", boundaries=Boundaries(fwd="int8", bwd="int4"))
        loss = pipe.run(x, y, 0)
        assert (loss is not None) == (s == 1)
        kinds = [(k, m) for k, m, _ in pipe.passes]
        assert kinds == order("1f1b", s, 2, M) + [("W", -1)]
        assert all(sec >= 0 for _, _, sec in pipe.passes)
        # the stage really trained: every parameter of it has a gradient
        assert all(p.grad is not None for p in pipe.parameters())

"""Boundary codecs' contracts (round-trip bound or exactness, payload bytes, error-feedback and
history bookkeeping), and compressed pipelines whose ledger equals the traffic formula."""

from __future__ import annotations

import math

import pytest
import torch
from harness import pipeline_config, run_workers
from test_pipeline_exact import B, M, batch, lm_loss, make

from thinwire.compression.base import Site, from_bytes, to_bytes
from thinwire.options import OptionError
from thinwire.runtime.mesh import Mesh
from thinwire.strategies import METHODS
from thinwire.strategies.base import Context
from thinwire.strategies.pipeline.codecs import bottleneck, build_boundary, sample_ids
from thinwire.strategies.pipeline.method import PipelineStrategy
from thinwire.strategies.pipeline.plan import pipeline_layout

SHAPE = (4, 6, 10)


def x_of(seed: int = 0, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def wire(codec, x: torch.Tensor, key: Site, receiver=None) -> tuple[torch.Tensor, int]:
    """x through the codec as the pipeline sends it: bytes on the wire and back."""
    buf = to_bytes(codec.encode_tensor(x, key))
    spec = (receiver or codec).tensor_spec(tuple(x.shape))
    assert buf.numel() == sum(p.nbytes for p in spec) == codec.tensor_bytes(tuple(x.shape))
    back = (receiver or codec).decode_tensor(from_bytes(buf, spec), tuple(x.shape), key)
    return back, buf.numel()


def test_identity_and_casts_round_trip_exactly_or_within_the_cast() -> None:
    x, key = x_of(), Site(0, 0)
    y, n = wire(build_boundary("none"), x, key)
    assert torch.equal(y, x) and n == 4 * x.numel()
    y, n = wire(build_boundary("bf16"), x, key)
    assert n == 2 * x.numel() and torch.allclose(y, x, rtol=2**-8, atol=0)


@pytest.mark.parametrize("spec,levels,chunk", [("int8", 127, 512), ("int4", 7, 128),
                                                ("int4:chunk=7", 7, 7)])
def test_quantisers_error_within_half_a_step_of_each_chunk(spec, levels, chunk) -> None:
    x = x_of(1, (3, 7, 11))  # 231 elements: odd, partial chunks
    y, n = wire(build_boundary(spec), x, Site(0, 0))
    d = x.numel()
    level_bytes = d if levels == 127 else (d + 1) // 2
    assert n == level_bytes + 4 * math.ceil(d / chunk)
    flat, err = x.reshape(-1), (y - x).reshape(-1).abs()
    half = 0.5 + 2**-16 if levels == 127 else 0.5  # int8 rounds x (1 / step): int8.py
    for start in range(0, d, chunk):
        step = flat[start:start + chunk].abs().max() / levels
        assert err[start:start + chunk].max() <= step * half * (1 + 1e-5) + 1e-7
    assert err.max() > 0  # it really quantises


def test_topk_keeps_the_largest_and_error_feedback_keeps_the_rest() -> None:
    x, key = x_of(2), Site(0, 3)
    k = math.ceil(0.1 * x.numel())
    y, n = wire(build_boundary("topk:ratio=0.1"), x, key)
    assert n == 8 * k
    kept = y.reshape(-1) != 0
    assert int(kept.sum()) == k
    assert x.reshape(-1).abs()[~kept].max() <= x.reshape(-1).abs()[kept].min()
    ef = build_boundary("topk:ratio=0.1,ef=true")
    y1, _ = wire(ef, x, key)
    residual = ef.residuals[3].clone()  # the codec reuses its memory
    torch.testing.assert_close(residual, (x - y1).reshape(-1), rtol=0, atol=0)
    x2 = x_of(3)
    y2, _ = wire(ef, x2, Site(1, 3))  # the next step's slot 3 carries the residual
    plain, _ = wire(build_boundary("topk:ratio=0.1"), x2 + residual.view(SHAPE), Site(1, 3))
    assert torch.equal(y2, plain)


@pytest.mark.parametrize("ef", [False, True])
def test_randk_sender_and_receiver_agree_on_the_indices(ef) -> None:
    x, key = x_of(4), Site(5, 1)
    spec = f"randk:ratio=0.25,ef={str(ef).lower()}"
    sender, receiver = build_boundary(spec, seed=7), build_boundary(spec, seed=7)
    y, n = wire(sender, x, key, receiver)
    k = math.ceil(0.25 * x.numel())
    assert n == 4 * k and int((y != 0).sum()) == k
    own = sender.decode_tensor(sender.encode_tensor(x, key), SHAPE, key) if not ef else None
    if own is not None:
        assert torch.equal(own, y)
    if ef:  # unscaled: the kept values are x's, the rest is the residual
        kept = y.reshape(-1) != 0
        assert torch.equal(y.reshape(-1)[kept], x.reshape(-1)[kept])
        torch.testing.assert_close(sender.residuals[1], (x - y).reshape(-1))


def test_lowrank_is_exact_at_low_rank_and_propagates_its_error_to_the_next_micro_batch() -> None:
    g = torch.Generator().manual_seed(0)
    low = (torch.randn(24, 2, generator=g) @ torch.randn(2, 10, generator=g)).view(4, 6, 10)
    codec = build_boundary("lowrank:rank=2,lep=false")
    y, n = wire(codec, low, Site(0, 0))
    assert n == 4 * 2 * (24 + 10)
    torch.testing.assert_close(y, low, rtol=1e-4, atol=1e-5)
    # lazy error propagation: micro-batch 1 sends M_1 + (M_0 - approx_0), within the step only
    lep, plain = build_boundary("lowrank:rank=2"), build_boundary("lowrank:rank=2,lep=false")
    x0, x1 = x_of(5), x_of(6)
    y0, _ = wire(lep, x0, Site(3, 0))
    err = x0 - y0
    torch.testing.assert_close(lep.error, err.reshape(24, 10), rtol=1e-5, atol=1e-6)
    assert err.norm() < x0.norm()  # a projection never grows the matrix
    y1, _ = wire(lep, x1, Site(3, 1))
    want, _ = wire(plain, x1 + err, Site(3, 1))
    torch.testing.assert_close(y1, want, rtol=1e-5, atol=1e-5)
    y2, _ = wire(lep, x1, Site(4, 1))  # a new step starts without error
    want2, _ = wire(plain, x1, Site(4, 1))
    torch.testing.assert_close(y2, want2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bits", [4, 8])
def test_aqsgd_histories_agree_and_deltas_shrink(bits) -> None:
    sender, receiver = build_boundary(f"aqsgd:bits={bits}"), build_boundary(f"aqsgd:bits={bits}")
    tokens = torch.randint(0, 9, (4, 5), generator=torch.Generator().manual_seed(1))
    ids = sample_ids(tokens)
    x = x_of(7)
    key = Site(0, 0, ids)
    y, n = wire(sender, x, key, receiver)
    d = x.numel()
    assert n == (d if bits == 8 else (d + 1) // 2) + 4 * math.ceil(d / 128)
    first = (y - x).abs().max()
    assert 0 < first <= x.abs().max() / (7 if bits == 4 else 127)
    for i in ids.tolist():
        assert torch.equal(sender.history[i], receiver.history[i])
    # the same samples again, slightly moved: the error is the delta's, much smaller
    x2 = x + 0.01 * x_of(8)
    y2, _ = wire(sender, x2, Site(1, 0, ids), receiver)
    assert (y2 - x2).abs().max() < first / 10
    with pytest.raises(ValueError, match="ids"):
        sender.encode_tensor(x, Site(0, 0))


def test_sample_ids_are_the_samples_contents() -> None:
    a = torch.randint(0, 50, (6, 8), generator=torch.Generator().manual_seed(2))
    ids = sample_ids(a)
    assert ids.dtype == torch.int64 and len(set(ids.tolist())) == 6
    assert torch.equal(sample_ids(a[[3, 0]]), ids[[3, 0]])
    f = torch.randn(3, 4)
    assert torch.equal(sample_ids(f), sample_ids(f.clone())) and len(set(sample_ids(f).tolist())) == 3


def test_bottlenecks_subspace_is_exact_on_its_subspace_and_ae_is_drawn_from_the_seed() -> None:
    enc, dec = bottleneck("subspace:dim=3", 10, seed=1, boundary=0)
    h = x_of(9)
    z = enc(h)
    assert z.shape == (4, 6, 3)
    u = enc.basis
    torch.testing.assert_close(u.T @ u, torch.eye(3), rtol=0, atol=1e-6)
    torch.testing.assert_close(dec(z), h @ u @ u.T)
    inside = dec(z)
    torch.testing.assert_close(dec(enc(inside)), inside, rtol=1e-5, atol=1e-6)
    e1, d1 = bottleneck("ae:dim=4", 10, seed=1, boundary=2)
    e2, _ = bottleneck("ae:dim=4", 10, seed=1, boundary=2)
    assert torch.equal(e1.weight, e2.weight) and d1(e1(h)).shape == h.shape
    assert sum(p.numel() for p in e1.parameters()) == 44


def test_bad_specs_are_one_line_errors() -> None:
    with pytest.raises(OptionError, match="unknown codec"):
        build_boundary("zip")
    with pytest.raises(OptionError, match="lowrank.rank"):
        build_boundary("lowrank:rank=0")
    with pytest.raises(OptionError, match="bottleneck"):
        build_boundary("ae:dim=4")


# --- compressed pipelines: ledger = formula ------------------------------------------------------
RUNS = [
    {"method.codec_fwd": "int8", "method.codec_bwd": "int4"},
    {"method.codec_fwd": "topk:ratio=0.25", "method.codec_bwd": "randk:ratio=0.25,ef=true"},
    {"method.codec_fwd": "aqsgd:bits=4", "method.codec_bwd": "lowrank:rank=2"},
    {"method.codec_fwd": "ae:dim=4", "method.codec_bwd": "int8"},
    {"method.codec_fwd": "subspace:dim=4", "method.train_lr0": True},
    {"method.codec_bwd": "lowrank:rank=2", "method.epilogue_only": True},
    {"method.codec_fwd": "int4", "method.uncompressed_first": 1,
     "method.overrides": "2@fp16|bf16"},
]


def _cfg(over: dict):
    values = {"train.lr": 0.0 if over.get("method.train_lr0") else 0.1}
    values.update({k: v for k, v in over.items() if k != "method.train_lr0"})
    return pipeline_config(pp=4, workers=4, micro_batches=M, batch_size=B, **values)


def _compressed(comm) -> list:
    mesh = Mesh(comm, dp=1, pp=4)
    out = []
    for over in RUNS:
        cfg = _cfg(over)
        model = make("gpt")
        ctx = Context(cfg=cfg, comm=comm, device=torch.device("cpu"), loss=lm_loss, mesh=mesh)
        strat = PipelineStrategy(ctx, model)
        mark = comm.ledger.mark()
        losses = [strat.train_step(batch("gpt", 0), s) for s in range(2)]
        sent = comm.ledger.totals(since=mark)
        evaluated = strat.eval_model()
        eval_loss = None
        if evaluated is not None:
            with torch.no_grad():
                x, y = batch("gpt", 0)
                eval_loss = float(lm_loss(evaluated(x), y))
        out.append((losses, sent["sent_bytes"], sent["payload_bytes"], eval_loss))
    return out


def test_compressed_pipelines_send_exactly_the_formulas_bytes() -> None:
    results = run_workers(_compressed, 4)
    for i, over in enumerate(RUNS):
        cfg = _cfg(over)
        layout = pipeline_layout(cfg, make("gpt"), batch("gpt", 0))
        want = METHODS.get("pipeline").traffic(layout, cfg.method.options, 4, 2, 0, 0)
        for rank, per_run in enumerate(results):
            losses, sent, payload, _ = per_run[i]
            assert sent == want.sent[rank] and payload == want.payload[rank], (over, rank)
            assert all(math.isfinite(v) for v in losses)
        if over.get("method.train_lr0"):
            # lr 0: the evaluated model (links and the subspace's modules, gathered on the last
            # stage) gives the pipeline's loss on the same batch
            losses, _, _, eval_loss = results[3][i]
            assert eval_loss == pytest.approx(losses[0], rel=1e-5)
    # int8 activations: stage 0 sends a quarter of the identity's 4 bytes an element (plus
    # one fp32 scale a chunk)
    numel = (B // M) * 6 * 8
    assert results[0][0][1] == 2 * M * (numel + 4 * math.ceil(numel / 512))

"""Constants no test pinned before: each test here fails under its planted bug in
``tools/mutants.py`` (ids in brackets; docs/TESTING.md) and holds the behaviour, not the line:
SLIDE's loss [slide-padded-count], Streaming DiLoCo's merge [diloco-alpha-swap] and its
per-fragment residuals [diloco-shared-residual], the scattered exchange's second encoding
[scatter-ef-twice], the fp4 grid's zero threshold [fp4-zero], the graph adapter's poison
through a union [graph-poison-lost], the device rule on every tensor of a call
[device-first-only] and the crossover bandwidth's bisection [crossover-bisect]."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from harness import run_workers
from torch import nn

from thinwire.runtime.comm import Comm, CommDeviceError


# --- SLIDE: the loss over the softmax is normalised by the sample's own labels ------------------
def test_slide_loss_divides_by_the_true_label_count_not_the_slots() -> None:
    """Rows with 1, 2 and 3 labels in 3 slots (padded with -1): the sharded loss and its
    gradient equal multilabel_nll on the dense logits, row by row. Dividing by the 3 slots
    instead would shrink the 1-label row's label term to a third."""
    from thinwire.builders import build_model, load_data
    from thinwire.config import load
    from thinwire.data.task import multilabel_nll, task_for
    from thinwire.strategies.base import Context
    from thinwire.strategies.slide.method import SlideStrategy

    cfg = load(None, {"method.name": "slide", "method.full": "true", "data.labels": 12,
                      "data.features": 20, "data.train": 64, "data.test": 16,
                      "model.hidden": 6, "runtime.workers": 2})
    ds = load_data(cfg)
    strat = SlideStrategy(Context(cfg, Comm.local(), torch.device("cpu"), task_for(ds).loss),
                  build_model(cfg, ds), shards=2)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 6, generator=g)
    y = torch.tensor([[4, -1, -1], [1, 9, -1], [0, 5, 11]])
    h_all = h.clone().requires_grad_(True)
    loss = strat.sharded_loss(h_all, y)
    ref_h = h.clone().requires_grad_(True)
    logits = torch.cat([p.dense(ref_h) for p in strat.parts], dim=1)
    want = torch.stack([multilabel_nll(logits[i:i + 1], y[i:i + 1]) for i in range(3)])
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    (want.sum() / 3).backward()
    assert h_all.grad is not None and ref_h.grad is not None
    torch.testing.assert_close(h_all.grad, ref_h.grad, rtol=1e-5, atol=1e-6)


# --- Streaming DiLoCo: the merge's weights, and one residual per fragment -------------------------
def _linear_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def _inner_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_streaming_diloco_merges_alpha_of_the_local_copy() -> None:
    """alpha = 0.3, one worker, outer SGD lr 0.5 without momentum: after a round the outer step
    gives theta_g' = theta_g - 0.5 (theta_g - theta_local) and the merge
    alpha theta_local + (1 - alpha) theta_g'. (At alpha = 0.5, where every other test sits,
    swapping the two weights changes nothing.)"""
    from thinwire.strategies.diloco import DiLoCo

    model, local = _linear_model(), _linear_model()
    start = [p.detach().clone() for p in model.parameters()]
    _inner_steps(local, torch.optim.SGD(local.parameters(), lr=0.1), 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.5)
    with DiLoCo(model, inner, outer, sync_every=4, comm=Comm.local(), alpha=0.3):
        _inner_steps(model, inner, 4)
    for p, g0, q in zip(model.parameters(), start, local.parameters()):
        outer_result = g0 - 0.5 * (g0 - q.detach())
        torch.testing.assert_close(p.detach(), 0.3 * q.detach() + 0.7 * outer_result)


class _TwoBlocks(nn.Module):
    """Two equal fragments; the forward uses ``a`` only, so ``b`` never changes locally."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def test_each_fragment_keeps_its_own_codec_residual() -> None:
    """Top-k with error feedback on two fragments of the same size: fragment b's
    pseudo-gradient is exactly 0 every round, so with its own residual nothing is ever sent for
    it and b never moves; a residual shared between fragments (or keyed by anything but the
    fragment) would carry a's leftovers into b's payload and move it."""
    from thinwire.compression import build
    from thinwire.strategies.diloco import DiLoCo

    model = _TwoBlocks()
    b0 = model.b.weight.detach().clone()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    g = torch.Generator().manual_seed(2)
    with DiLoCo(model, inner, outer, sync_every=4, comm=Comm.local(),
                fragments=[model.a, model.b], codec=build("topk:ratio=0.25")):
        for _ in range(16):
            inner.zero_grad()
            model(torch.randn(8, 4, generator=g)).square().mean().backward()
            inner.step()
    assert not torch.equal(model.a.weight.detach(), _TwoBlocks().a.weight.detach())
    assert torch.equal(model.b.weight.detach(), b0)


# --- the scattered exchange: the second encoding carries no error feedback ------------------------
def _scatter(comm: Comm) -> dict[str, Any]:
    from thinwire.compression import build
    from thinwire.compression.fp4 import FP4
    from thinwire.compression.scatter import shard_numel

    n, me, d, chunk = comm.world_size, comm.rank, 40, 8
    xs = [torch.randn(d, generator=torch.Generator().manual_seed(10 + r)) for r in range(n)]
    codec = build("fp4:chunk=8,exchange=scatter", rank=me)
    fut, _ = codec.average_async(comm, xs[me].clone(), 0, key=3)
    got = fut.wait().clone()
    codec.close()
    plain, s = FP4(chunk), shard_numel(d, n, chunk)

    def q(v: torch.Tensor) -> torch.Tensor:
        return plain.decode(plain.encode(v, 0), v.numel(), 0)

    padded = [torch.cat([x, x.new_zeros(n * s - d)]) for x in xs]
    # the documented rule: the mean of the first encodings, re-encoded once without feedback
    mean = torch.cat([q(sum(q(p[j * s:(j + 1) * s]) for p in padded) / n) for j in range(n)])
    residuals = codec.inner.residuals
    return {"got": got, "want": mean[:d],
            "residuals": {k: v.clone() for k, v in residuals.items()},
            "first": {3 * n + j: padded[me][j * s:(j + 1) * s] - q(padded[me][j * s:(j + 1) * s])
                      for j in range(n)}}


def test_the_scattered_exchange_re_encodes_the_mean_without_error_feedback() -> None:
    """Two ranks, fp4 with error feedback, exchange=scatter (compression/scatter.py, steps 2
    and 4): each rank's residual of shard j is what the *first* encoding of its own shard j
    dropped, and the result is the mean of the first encodings, re-quantised once. Feedback on
    the second encoding would overwrite the residual of the rank's own shard with the rounding
    of the shared mean."""
    for out in run_workers(_scatter, 2, timeout=60):
        torch.testing.assert_close(out["got"], out["want"], rtol=0, atol=1e-6)
        assert sorted(out["residuals"]) == sorted(out["first"])
        for k, e in out["first"].items():
            torch.testing.assert_close(out["residuals"][k], e, rtol=0, atol=1e-7)


# --- fp4: the zero threshold and the smallest step of the grid ------------------------------------
@pytest.mark.parametrize("path", ["0", "auto"], ids=["torch", "default"])
def test_fp4_rounds_to_zero_below_half_the_smallest_step(path: str) -> None:
    """Against a scale of 1: the grid's smallest magnitude is 2^-6, and 2^-7 (half of it, the
    midpoint to 0) is the threshold: values between 2^-8 and 2^-7 decode to 0, from 2^-7 up to
    1.5 2^-6 to 2^-6; the midpoint 0.75 splits 0.5 from 1. On the pure torch path (every
    device's) and the default one (the compiled kernel where it builds)."""
    from thinwire import kernels
    from thinwire.compression.fp4 import FP4

    values = [1.0, 1.2 * 2**-8, 1.9 * 2**-8, 0.99 * 2**-7, 1.01 * 2**-7, 2**-6, 1.45 * 2**-6,
              1.55 * 2**-6, 0.74, 0.76, -1.5 * 2**-8, -1.1 * 2**-7]
    want = [1.0, 0.0, 0.0, 0.0, 2**-6, 2**-6, 2**-6, 2**-5, 0.5, 1.0, 0.0, -(2**-6)]
    codec = FP4(chunk=len(values))
    x = torch.tensor(values)
    with kernels.forced(path):
        got = codec.decode(codec.encode(x, 0), x.numel(), 0)
    assert got.tolist() == want


# --- the graph adapter: a union keeps the must-share mark -----------------------------------------
class _Stream(nn.Module):
    """A residual stream (inp, f1) whose f1 branch also feeds a cumulative sum over channels
    (an operation no cut can follow) before it joins the stream; an FFN (up, down) beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.f1, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        a = self.f1(h)
        mixed = torch.cumsum(a, dim=1)  # poisons a's channels, before the union below
        h = h + a  # joins the stream's channels with a's: the union must stay poisoned
        h = h + self.down(torch.relu(self.up(h)))
        return self.out(h) + mixed.sum(1, keepdim=True)


def test_a_residual_stream_with_one_uncuttable_consumer_is_never_cut() -> None:
    from thinwire.models.graph_adapter import derive_adapter

    # residual="channels": a stream is cut unless something poisons it (with "whole", the
    # default, every stream stays whole and the mark would not be tested)
    plan = derive_adapter(_Stream(), torch.randn(4, 8), min_units=2, residual="channels").plan
    assert [(g.name, g.size) for g in plan.groups] == [("up", 32)]
    shared = {t.name for t in plan.tensors if t.shared}
    assert {"inp.weight", "inp.bias", "f1.weight", "f1.bias", "out.weight"} <= shared


# --- the device rule: every tensor of a call, not the first --------------------------------------
@pytest.mark.parametrize("call", ["all_to_all", "all_gather_into", "reduce_scatter_into"])
def test_the_device_rule_checks_every_tensor_of_a_call(call: str) -> None:
    comm = Comm.local().expect("cpu")
    good, bad = torch.zeros(4), torch.zeros(4, device="meta")
    with pytest.raises(CommDeviceError, match="meta"):
        if call == "all_to_all":
            comm.all_to_all([good], [bad], tag="t")
        elif call == "all_gather_into":
            comm.all_gather_into(good, bad, tag="t")
        else:
            comm.reduce_scatter_into(good, bad, tag="t")


# --- the crossover bandwidth: found by bisection, where the times meet -------------------------
def test_the_crossover_bandwidth_is_where_the_penalised_times_meet() -> None:
    """Local SGD at 1.5 times dp's steps on an MLP: below W* it is faster, above it slower,
    and at W* the two step times (the penalty applied) agree to 1e-6; a bisection that
    stopped at the grid (61 points over 7 decades: steps of 31%) or went the wrong way would
    miss by up to a grid step."""
    import dataclasses

    from thinwire.planner import crossover_bandwidth
    from thinwire.planner.insight import step_at
    from thinwire.planner.presets import load_cluster, load_model
    from thinwire.planner.strategy import StrategySpec

    model = load_model("mlp-784-2048-2048-10")
    cluster = load_cluster("cpu-1gbe").with_devices(4)
    dp = StrategySpec(dp=4, micro_batch_size=128)
    other = dataclasses.replace(dp, method="localsgd")
    w = crossover_bandwidth(model, cluster, dp, other, penalty=1.5)
    assert 1e5 < w < 1e12 and math.isfinite(w)

    def gain(bw: float) -> float:
        return 1.5 * step_at(model, cluster, other, bw) - step_at(model, cluster, dp, bw)

    assert gain(w / 1.01) < 0 < gain(w * 1.01)
    assert abs(gain(w)) <= 1e-6 * step_at(model, cluster, dp, w)


# --- rebuild_buckets: the warm-up leaves no trace ---------------------------------------------
def test_rebuild_buckets_warm_up_leaves_buffers_draws_and_codec_as_they_were() -> None:
    """The warm-up forward and backward run with the hook silent, inside a forked RNG, and
    put the module's buffers back (a BatchNorm's running statistics move in any training
    forward) and drop the gradients: afterwards the model, the random stream and the hook's
    flag are as before, so the resumed run's next step is the uninterrupted one's."""
    from types import SimpleNamespace

    from thinwire.compression import rebuild_buckets

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 2))
    ddp, state = SimpleNamespace(module=module), SimpleNamespace(silent=False)
    buffers = [b.clone() for b in module.buffers()]
    rng = torch.get_rng_state()
    seen: list[bool] = []

    def forward_backward() -> None:
        seen.append(state.silent)
        module(torch.randn(8, 4) * 3 + 1).sum().backward()

    rebuild_buckets(ddp, state, forward_backward)
    assert seen == [True] and state.silent is False
    assert all(torch.equal(a, b) for a, b in zip(module.buffers(), buffers))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in module.parameters())

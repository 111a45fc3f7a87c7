"""Behaviours no test held before (a regression would have passed the suite); each test here is
shown to fail when its behaviour is broken, by the planted bugs of ``tools/mutants.py``
(``aqsgd-frozen``, ``dct-every``, ``resist-no-scale``, ``dp-codec-rescale``; docs/TESTING.md).
"""

from __future__ import annotations

from typing import Any

import torch
from harness import run_workers

from thinwire.builders import build_model, build_strategy, load_data, make_stream, rescalable
from thinwire.compression.base import Site
from thinwire.config import load
from thinwire.runtime.comm import Comm
from thinwire.strategies.pipeline.codecs import build_boundary


# --- AQ-SGD: the per-sample history follows every visit, on both sides ----------------------------
def test_aqsgd_history_follows_each_visit_on_both_sides() -> None:
    """Wang et al. (2022): m_i <- m_i + Q^-1(Q(a - m_i)) at every visit of sample i, on the
    sender and the receiver alike. Three visits of the same samples whose activations move by
    1.0 each time: after each visit both histories are within the quantisation error of the
    newest activation (int8: at most |delta|_max / 254 per element, delta ~ 1 here, so 0.01),
    and the two sides hold the same bytes. A history frozen at the first visit would sit a
    whole 1.0 (then 2.0) away."""
    sender, receiver = build_boundary("aqsgd:bits=8"), build_boundary("aqsgd:bits=8")
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 3, 8, generator=g)
    ids = torch.tensor([7, 3, 11, 5])
    for visit in range(3):
        a = base + visit * 1.0 + 0.1 * torch.randn(4, 3, 8, generator=g)
        key = Site(visit, 0, samples=ids)
        got = receiver.decode_tensor(sender.encode_tensor(a, key), tuple(a.shape), key)
        assert (got - a).abs().max() < 0.02, visit
        for i, sample in enumerate(ids.tolist()):
            assert torch.equal(sender.history[sample], receiver.history[sample])
            assert (sender.history[sample] - a[i]).abs().max() < 0.02, (visit, sample)


# --- hybrid DCT: thresholds re-estimated only every method.every steps --------------------------
DLRM = {"model.name": "dlrm", "method.name": "hybrid", "data.tables": 4, "data.rows": 50,
        "data.train": 1024, "data.test": 256, "model.dim": 8, "model.bottom": "16",
        "model.top": "16", "train.batch_size": 32, "train.lr": 0.05, "method.dct": True,
        "method.every": 3, "method.dp_keep": 0.1, "method.mp_keep": 0.2}


def _dct_thresholds(comm: Comm) -> list[tuple[float, float]]:
    cfg = load(None, {**DLRM, "runtime.workers": comm.world_size, "train.steps": 6})
    ds = load_data(cfg)
    from thinwire.data.task import task_for

    strat: Any = build_strategy(cfg, comm, torch.device("cpu"), task_for(ds), build_model(cfg, ds))
    stream = make_stream(cfg, ds, comm.rank, comm.world_size)
    out = []
    for s in range(6):
        strat.train_step(stream.batch(s), s)
        out.append((float(strat.t_g), float(strat.ex.t_a)))
    return out


def test_dct_thresholds_are_re_estimated_only_every_period() -> None:
    """Gupta et al. (KDD 2021): the DP threshold t_g and the MP threshold t_a are estimated at
    steps 0 and 3 (every = 3) and held in between; the gradients change every step, so an
    estimate at every step would change them at steps 1, 2, 4 and 5."""
    for per_step in run_workers(_dct_thresholds, 2, timeout=120):
        t_g = [t for t, _ in per_step]
        t_a = [t for _, t in per_step]
        for t in (t_g, t_a):
            assert t[0] == t[1] == t[2] and t[3] == t[4] == t[5], t
            assert t[0] > 0 and t[3] > 0 and t[3] != t[0], t


# --- ResIST: partitioned blocks scaled by 1 / min(S, n) at test time ----------------------------
def test_resist_scales_partitioned_blocks_at_evaluation() -> None:
    """Dun et al. (UAI 2022): in the assembled model each partitioned block's residual branch
    is multiplied by 1 / min(S, n) (S blocks in its stage, n subnets); downsampling blocks
    (shared) keep 1. Checked on the attributes and on the forward pass: block output =
    relu(x + p branch(x))."""
    from thinwire.models.resnet import BasicBlock, ResISTAdapter, ResNet

    torch.manual_seed(0)
    model = ResNet((1, 8, 8), 10, widths=(4, 8), blocks=(3, 2)).eval()
    adapter = ResISTAdapter(model)
    for n, want in ((2, {0: 0.5, 1: 1.0}), (4, {0: 1 / 3, 1: 1.0})):
        adapter.configure_eval(model, n)
        for s, stage in enumerate(model.stages):
            for block in stage:
                assert isinstance(block, BasicBlock)
                expect = 1.0 if block.downsample else want[s]
                assert abs(block.branch_scale - expect) < 1e-12, (n, s, block.branch_scale)
    block = model.stages[0][0]
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        branch = block.bn2(block.conv2(torch.relu(block.bn1(block.conv1(x)))))
        torch.testing.assert_close(block(x), torch.relu(x + branch / 3))


# --- compressed dp: refused for resume at another worker count -----------------------------------
def test_compressed_dp_is_not_rescalable() -> None:
    """A codec's error-feedback residuals are private to each rank, so a checkpoint of compressed
    dp resumes only at its own worker count; plain dp (the same state everywhere) rescales."""
    base = {"data.name": "digits", "model.hidden": "16", "train.steps": "4",
            "runtime.workers": "2"}
    assert rescalable(load(None, base))
    for codec in ("topk:ratio=0.1", "powersgd:rank=2", "int8"):
        assert not rescalable(load(None, {**base, "method.compressor": codec})), codec

"""SLIDE's hash tables in the compiled kernels (thinwire.kernels) against the pure-torch lsh.py.

The kernels take every random number from the same torch generator, in the same order, so the
two paths must agree exactly: the same hash codes, the same tables (sorted ids and bucket
offsets), the same active sets and masks, and the generator left in the same state, on 1, 2 and
4 threads. Cases: SimHash and DWTA, both samplings, buckets large enough and too small (the
shortfall fill); DWTA on inputs with all-zero rows and bins (densification) and integer values
(ties in a bin's argmax: the first wins); a build whose buckets hold equal keys (the stable
order). The pure path is also the one every other test in tests/slide runs with
THINWIRE_KERNELS=0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from thinwire import kernels
from thinwire.strategies.slide.layer import SLIDELayer
from thinwire.strategies.slide.lsh import SimHash, Tables, generator

HAVE = kernels.available()
needs_kernels = pytest.mark.skipif(not HAVE, reason="no C++ compiler: compiled kernels unbuilt")
SRC = str(Path(kernels.__file__).resolve().parents[2])  # the src/ this thinwire is from

CASES = {  # buckets hold the budget / they do not (the fill runs)
    "enough": {"K": 4, "L": 10, "budget": 40, "bucket": 16, "range_bits": 6},
    "short": {"K": 9, "L": 8, "budget": 300, "bucket": 4, "range_bits": 10},
}


def inputs(family: str, B: int = 64, H: int = 32, C: int = 2000
           ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if family == "dwta":  # integer values: ties in the bins; zero rows and bins: densification
        h = torch.randint(0, 3, (B, H), generator=g).float() * (torch.rand(B, H, generator=g)
                                                                 < 0.3)
        h[3] = 0
    else:
        h = torch.randn(B, H, generator=g)
    labels = torch.randint(0, C, (B, 3), generator=g)
    labels[::3, 2] = -1
    return h, labels


def run(path: str, threads: int, family: str, sampling: str, case: str
        ) -> dict[str, torch.Tensor]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with kernels.forced(path):
            layer = SLIDELayer(32, 2000, family_name=family, seed=3, sampling=sampling,
                               **CASES[case])
            h, labels = inputs(family)
            codes = layer.tables.h.codes(h)
            ids, mask = layer.active(h, labels)
            g = generator(h.device, layer.seed, 0xAC7, layer.offset, layer.schedule.updates)
            layer.tables.active(h, layer.local_labels(labels), 200, sampling, g)
            after = torch.rand(4, generator=g)  # the generator's state after the draws
    finally:
        torch.set_num_threads(before)
    return {"codes": codes, "sorted": layer.tables.sorted, "offsets": layer.tables.offsets,
            "ids": ids, "mask": mask, "after": after}


@needs_kernels
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("sampling", ["topk", "vanilla"])
@pytest.mark.parametrize("family", ["simhash", "dwta"])
def test_compiled_tables_equal_the_pure_ones(family: str, sampling: str, case: str) -> None:
    ref = run("0", 1, family, sampling, case)
    assert ref["ids"].shape == (64, CASES[case]["budget"] + 3)
    filled = ref["mask"].float().mean()
    if case == "short" and sampling == "vanilla":
        assert bool(ref["mask"].all())  # every row filled from the random block
    if case == "short" and sampling == "topk":
        assert filled < 1  # some rows short: their empty slots must match too
    for threads in (1, 2, 4):
        got = run("1", threads, family, sampling, case)
        for name, want in ref.items():
            assert torch.equal(got[name], want), f"{name} differs on {threads} threads"


@needs_kernels
def test_dwta_codes_of_zero_rows_and_tied_bins_equal_the_pure_ones() -> None:
    layer = SLIDELayer(16, 100, family_name="dwta", K=3, L=20, bin_size=4, range_bits=8)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 2, (50, 16), generator=g).float()  # many ties and empty bins
    x[0] = 0  # every bin empty: every function ends at bin_size
    x[1] = 0
    x[1, 4] = 1.0  # one coordinate: everything borrows from the few functions that see it
    with kernels.forced("0"):
        ref = layer.tables.h.codes(x)
    with kernels.forced("1"):
        got = layer.tables.h.codes(x)
    assert torch.equal(got, ref)
    assert len(set(ref[0].tolist())) == 1  # the all-empty row: one code for every table


@needs_kernels
def test_build_orders_equal_keys_by_id_on_both_paths() -> None:
    C, L = 200_000, 2  # 4 buckets of about 50,000 neurons: float32 keys repeat inside them
    hashes = SimHash(8, 2, L, seed=7, device=torch.device("cpu"))
    w = torch.randn(C, 8, generator=torch.Generator().manual_seed(0))
    built = {}
    for path in ("0", "1"):
        t = Tables(hashes, C, 32, seed=11, device=torch.device("cpu"))
        with kernels.forced(path):
            t.build(w)
        built[path] = (t.sorted, t.offsets)
    key = torch.rand(L, C, generator=generator(torch.device("cpu"), 11, 0x7AB, 0))
    codes = hashes.codes(w).t()
    pair = codes * 2**24 + (key * 2**24).long()  # (code, key) as one integer
    assert int(pair[0].unique().numel()) < C  # equal keys inside a bucket: the order is tested
    assert torch.equal(built["1"][0], built["0"][0])
    assert torch.equal(built["1"][1], built["0"][1])


def test_without_a_compiler_the_layer_runs_on_the_pure_path(tmp_path: Path) -> None:
    code = ("import torch; from thinwire.strategies.slide.layer import SLIDELayer; "
            "l = SLIDELayer(8, 300, budget=10); print(tuple(l.active(torch.randn(4, 8))[0].shape))")
    env = {**os.environ, "PYTHONPATH": SRC, "CXX": str(tmp_path / "no-such-compiler"),
           "PATH": str(tmp_path), "THINWIRE_KERNELS_CACHE": str(tmp_path / "cache"),
           "THINWIRE_KERNELS": "auto"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "(4, 10)", done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "using the pure-torch path" in lines[0], done.stderr


@needs_kernels
def test_topk_orders_equal_scores_by_id_on_both_paths() -> None:
    """100 labels a sample score L bucket + 1 + a tie draw in [0, 0.5): at 1601 float32 keeps
    4096 values in that range, so about one pair a row rounds to the same score, and the order
    of the active set (stable: by id) is tested."""
    layer = SLIDELayer(16, 5000, K=6, L=50, bucket=32, budget=20, seed=2, sampling="topk")
    g = torch.Generator().manual_seed(4)
    h = torch.randn(32, 16, generator=g)
    labels = torch.stack([torch.randperm(5000, generator=g)[:100] for _ in range(32)])
    with kernels.forced("0"):
        ref = layer.active(h, labels)
    with kernels.forced("1"):
        got = layer.active(h, labels)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u), u = 2^-24: two float32 sums of the same n terms in
    different orders differ by at most 2 gamma_n times the sum of the terms' magnitudes."""
    u = 2.0**-24
    return n * u / (1 - n * u)


@needs_kernels
def test_fused_layer_on_a_wide_sparse_batch_matches_the_gathered_layer() -> None:
    """Far more rows than slots (the touched rows sorted by two radix passes, not a count per
    row) and a weight gradient of 72,000 rows x 128 (36.9 MB: written by streaming stores): the
    same touched rows as the gathered pure-torch layer, values within the float32 sums' bound,
    the same bits on 1, 2 and 4 threads."""
    B, A, H, C = 128, 600, 128, 170_000
    layer = SLIDELayer(H, C, K=2, L=2, budget=A)
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(C, generator=g)[:B * A].view(B, A)
    ids[120:, :] = ids[:8, :].flip(1)  # 8 x 600 slots on rows already touched
    ids[5, :10] = ids[5, 0]  # one row ten times in a sample
    mask = torch.ones(B, A, dtype=torch.bool)
    mask[7, 3:] = False
    h = torch.randn(B, H, generator=g)
    w = torch.randn(B, A, generator=g)  # a fixed upstream gradient: sum(out * w)
    got = {}
    for path, threads in (("0", 1), ("1", 1), ("1", 2), ("1", 4)):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            layer.zero_grad(set_to_none=True)
            x = h.clone().requires_grad_(True)
            with kernels.forced(path):
                out = layer(x, ids, mask)
                (out.masked_fill(~mask, 0.0) * w).sum().backward()
        finally:
            torch.set_num_threads(before)
        gw = layer.weight.grad.coalesce()
        got[(path, threads)] = (out.detach(), x.grad, gw.indices()[0], gw.values())
    ref, fused = got[("0", 1)], got[("1", 1)]
    for t in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(got[("1", t)], fused)), t
    assert torch.equal(fused[2], ref[2]) and fused[2].numel() == 72_000
    wt = layer.weight.detach()
    on = mask
    bound_out = 2 * gamma(H + 1) * ((wt[ids].abs() @ h.abs().unsqueeze(-1)).squeeze(-1) + 1)
    assert torch.all((fused[0][on] - ref[0][on]).abs() <= bound_out[on])
    gm = (w * mask).abs()
    bound_gh = 2 * gamma(A) * torch.einsum("ba,bah->bh", gm, wt[ids].abs())
    assert torch.all((fused[1] - ref[1]).abs() <= bound_gh + 1e-30)
    terms = torch.zeros(C, H).index_add_(0, ids.reshape(-1), gm.reshape(-1, 1)
                                         * h.abs().repeat_interleave(A, 0))
    assert torch.all((fused[3] - ref[3]).abs() <= 2 * gamma(10) * terms[ref[2]] + 1e-30)


@needs_kernels
def test_fused_loss_matches_the_torch_loss_within_float32_rounding() -> None:
    """Both paths against the same loss and gradient in float64: within 4 gamma_(A + 8) of each
    term's size (the max-shifted exponent, an A-term sum, its log, the targets' sum), the torch
    path as well (so the bound is the float32 rounding, not a loose tolerance), and the same
    bits on 1, 2 and 4 threads."""
    from thinwire.strategies.slide.layer import active_softmax_loss, label_targets

    g = torch.Generator().manual_seed(0)
    B, A, C = 64, 300, 5000
    ids = torch.randint(0, C, (B, A), generator=g)
    labels = torch.randint(0, C, (B, 3), generator=g) + 100
    labels[::2, 2] = -1
    ids[:, :3] = labels.clamp(min=0) - 100  # offset 100: global id = local + 100
    mask = torch.ones(B, A, dtype=torch.bool)
    mask[1, 10:] = False
    mask[2, 0] = False  # a label's slot off: not a target
    z = (torch.randn(B, A, generator=g) * 5).masked_fill(~mask, float("-inf"))
    got = {}
    for path, threads in (("0", 1), ("1", 1), ("1", 2), ("1", 4)):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            x = z.clone().requires_grad_(True)
            with kernels.forced(path):
                loss = active_softmax_loss(x, ids, mask, labels, offset=100)
                (2.5 * loss).backward()
        finally:
            torch.set_num_threads(before)
        got[(path, threads)] = (loss.detach(), x.grad)
    for t in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(got[("1", t)], got[("1", 1)]))
    # the float64 reference of the same function
    x64 = z.double().requires_grad_(True)
    t = label_targets(ids, mask, labels, 100).double()
    cnt = (labels >= 0).sum(1).clamp(min=1).double()
    logp = torch.log_softmax(x64, 1).masked_fill(~mask, 0.0)
    exact = -((logp * t).sum(1) / cnt).mean()
    (2.5 * exact).backward()
    assert x64.grad is not None and float(t.sum()) > B  # targets found (a wrong offset: none)
    zs = z.double().masked_fill(~mask, 0.0)
    size = (zs - zs.max(1, keepdim=True).values).abs().masked_fill(~mask, 0.0) \
        + logp.detach().abs() + 1
    bound_loss = 4 * gamma(A + 8) * float(((size * t).sum(1) / cnt).mean()) + 1e-7
    p = torch.softmax(x64.detach(), 1)
    bound_g = 4 * gamma(A + 8) * 2.5 / B / cnt.unsqueeze(1) * (
        t.sum(1, keepdim=True) * p * (size + 1) + t) + 1e-12
    for path in ("0", "1"):
        loss, grad = got[(path, 1)]
        assert abs(float(loss) - float(exact.detach())) <= bound_loss, path
        assert torch.all((grad.double() - x64.grad).abs() <= bound_g), path


@pytest.mark.parametrize("path", [pytest.param("0", id="torch"),
                                  pytest.param("1", id="compiled", marks=needs_kernels)])
def test_a_row_with_no_active_slot_adds_nothing_to_the_loss_or_its_gradient(path: str) -> None:
    """A sample none of whose slots is on (its shard drew nothing for it) contributes 0 to the
    loss and gets a zero gradient on every slot, as the torch path gives (the compiled loss once
    scaled its empty softmax by 1 / 0, and its gradient was NaN); the other rows are unchanged
    by it. Rows of 20 slots: the eight-lane loops and the tail."""
    from thinwire.strategies.slide.layer import active_softmax_loss

    g = torch.Generator().manual_seed(3)
    B, A, C = 4, 20, 500
    ids = torch.stack([torch.randperm(C, generator=g)[:A] for _ in range(B)])
    labels = ids[:, 5:6].clone()
    mask = torch.ones(B, A, dtype=torch.bool)
    mask[0] = False
    z = torch.randn(B, A, generator=g)
    x = z.clone().requires_grad_(True)
    with kernels.forced(path):
        loss = active_softmax_loss(x, ids, mask, labels)
        loss.backward()
    assert x.grad is not None
    assert torch.equal(x.grad[0], torch.zeros(A))
    rest = z[1:].clone().requires_grad_(True)
    with kernels.forced(path):
        loss_rest = active_softmax_loss(rest, ids[1:], mask[1:], labels[1:])
        loss_rest.backward()
    assert rest.grad is not None
    assert torch.allclose(loss * B, loss_rest * (B - 1), rtol=1e-6, atol=0)
    assert torch.allclose(x.grad[1:] * B, rest.grad * (B - 1), rtol=1e-5, atol=1e-9)

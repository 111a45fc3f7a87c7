"""The SLIDE layer and its hash tables (:mod:`thinwire.strategies.slide`).

- SimHash's collision rate: two vectors at angle theta share a K-bit code with probability
  (1 - theta / pi)^K (Charikar); measured over 4000 random pairs x 50 tables, the rate's
  standard error is below 0.006 at every angle tested, so 0.03 is a five-sigma bound and a wrong
  bit count (K +- 1 changes the rate by a factor 1 - theta / pi, >= 0.06 here) fails it.
- Retrieval recall against exact top inner products on random weights: the active set (5% of
  4096 neurons) must hold the 10 largest inner products of a query far more often than a random
  5% set does (recall 0.05, standard error 0.004 over 3000 top neurons). Measured: SimHash
  0.64, DWTA 0.33 (fixed seeds); thresholds 0.4 and 0.2, eight and four times chance.
- The sparse layer equals the dense layer restricted to the active set, forward and backward
  (float64, so equality to 1e-12 is a fair demand); the weight's gradient is sparse and touches
  only active rows.
- The active set: fixed size, distinct ids, labels always in it; the rebuild schedule (50,
  then intervals growing 1.5x); a rebuild files neurons under their current weights' codes.
"""

from __future__ import annotations

import math

import torch

from thinwire.strategies.slide.layer import SLIDELayer, active_softmax_loss
from thinwire.strategies.slide.lsh import Schedule, SimHash, Tables


def test_simhash_collision_rate_is_charikars() -> None:
    H, K, L, pairs = 32, 4, 50, 4000
    hashes = SimHash(H, K, L, seed=3, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for theta in (0.3, 0.8, 1.4):
        u = torch.randn(pairs, H, generator=g)
        w = torch.randn(pairs, H, generator=g)
        u = u / u.norm(dim=1, keepdim=True)
        w = w - (w * u).sum(1, keepdim=True) * u
        w = w / w.norm(dim=1, keepdim=True)
        v = math.cos(theta) * u + math.sin(theta) * w
        rate = float((hashes.codes(u) == hashes.codes(v)).float().mean())
        assert abs(rate - (1 - theta / math.pi) ** K) < 0.03, (theta, rate)


def _recall(family: str, K: int) -> float:
    C, H = 4096, 32
    layer = SLIDELayer(H, C, family_name=family, K=K, L=50, budget=205, bucket=64, seed=1,
                       range_bits=9)
    q = torch.randn(300, H, generator=torch.Generator().manual_seed(2))
    if family == "dwta":
        q = torch.relu(q)  # DWTA's inputs: sparse, non-negative activations
    top = (q @ layer.weight.detach().t()).topk(10).indices
    ids, mask = layer.active(q)
    assert ids.shape == (300, 205)
    return float(((ids.unsqueeze(1) == top.unsqueeze(-1)) & mask.unsqueeze(1)).any(-1)
                 .float().mean())


def test_retrieval_recall_beats_chance() -> None:
    assert _recall("simhash", 7) > 0.4
    assert _recall("dwta", 3) > 0.2


def test_active_set_fixed_size_distinct_with_labels() -> None:
    layer = SLIDELayer(16, 500, K=5, L=10, budget=20, offset=1000, seed=4)
    h = torch.randn(64, 16)
    labels = torch.randint(1000, 1500, (64, 3))
    labels[::3, 2] = -1
    labels[1, 0] = 7  # another shard's label: not here
    ids, mask = layer.active(h, labels)
    assert ids.shape == (64, 23) and bool(mask.all())
    for i in range(64):
        row = ids[i].tolist()
        assert len(set(row)) == len(row)
        for lab in labels[i].tolist():
            if 1000 <= lab < 1500:
                assert lab - 1000 in row
    assert 7 - 1000 not in ids[1].tolist()


def test_sparse_layer_equals_dense_restricted_forward_and_backward() -> None:
    torch.manual_seed(0)
    C, H, B = 300, 12, 8
    w0, b0 = torch.randn(C, H, dtype=torch.float64), torch.randn(C, dtype=torch.float64)
    layer = SLIDELayer(H, C, K=4, L=6, budget=30, weight=w0, bias=b0, seed=5)
    h = torch.randn(B, H, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, C, (B, 2))
    ids, mask = layer.active(h, labels)
    mask[0, -1] = False  # an empty slot is -inf and gets no gradient
    out = layer(h, ids, mask)
    loss = active_softmax_loss(out, ids, mask, labels)
    loss.backward()
    g_sparse, gb_sparse, gh_sparse = (layer.weight.grad.to_dense(),
                                      layer.bias.grad.to_dense().squeeze(-1), h.grad.clone())
    assert layer.weight.grad.is_sparse
    # the dense layer, its logits restricted to the active set
    w, b = w0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
    h2 = h.detach().clone().requires_grad_(True)
    full = h2 @ w.t() + b
    restricted = full.gather(1, ids).masked_fill(~mask, float("-inf"))
    assert torch.equal(torch.isinf(out), torch.isinf(restricted))
    torch.testing.assert_close(out[mask], restricted[mask], atol=1e-12, rtol=0)
    active_softmax_loss(restricted, ids, mask, labels).backward()
    torch.testing.assert_close(g_sparse, w.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(gb_sparse, b.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(gh_sparse, h2.grad, atol=1e-12, rtol=0)
    touched = set(ids[mask].tolist())
    rows = set(torch.nonzero(w.grad.abs().sum(1)).squeeze(1).tolist())
    assert rows <= touched and len(rows) > 30
    torch.testing.assert_close(layer.dense(h.detach()), h.detach() @ w0.t() + b0, atol=1e-12,
                               rtol=0)


def test_rebuild_schedule_and_tables_from_current_weights() -> None:
    s = Schedule(50, 1.5)
    due = [t for t in range(1, 400) if s.tick()]
    assert due == [50, 125, 237, 406][:3] and s.next_at == 406
    layer = SLIDELayer(16, 400, K=5, L=8, budget=10, seed=6, rebuild_first=3)
    before = layer.tables.sorted.clone()
    with torch.no_grad():
        layer.weight.mul_(-1)  # every code flips
    assert [layer.updated() for _ in range(3)] == [False, False, True]
    fresh = Tables(layer.tables.h, 400, 32, layer.tables.seed, torch.device("cpu"))
    fresh.builds = layer.tables.builds - 1
    fresh.build(layer.weight.detach())
    assert torch.equal(fresh.sorted, layer.tables.sorted)
    assert torch.equal(fresh.offsets, layer.tables.offsets)
    assert not torch.equal(before, layer.tables.sorted)

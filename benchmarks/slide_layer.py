"""The SLIDE layer's forward + backward against the dense layer's, per active fraction.

For an output width C, hidden width H and batch B: the dense layer computes all C logits and
their full gradient (F.linear forward and backward, a dense [C, H] weight gradient); the SLIDE
layer (:class:`thinwire.SLIDELayer`) retrieves the active set (table query and selection), then
computes the logits of A = s C neurons per sample and their sparse gradient. Printed per row:
the median seconds of each over ``--repeats`` timed steps (after two warm-up steps), the ratio
sparse / (dense x s) (the issue's target: at most 2) and the retrieval's share of the sparse
time. One torch thread (``--threads``), CPU.

    python benchmarks/slide_layer.py --widths 10000,100000 --fractions 0.005,0.01,0.05
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from thinwire.strategies.slide.layer import SLIDELayer, active_softmax_loss


def _median(fn, repeats: int) -> float:  # noqa: ANN001
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def row(C: int, H: int, B: int, s: float, K: int, L: int, repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    h = torch.relu(torch.randn(B, H, generator=g))
    labels = torch.randint(0, C, (B, 1), generator=g)
    layer = SLIDELayer(H, C, K=K, L=L, budget=max(1, round(s * C)), seed=1)
    w = layer.weight.detach().clone().requires_grad_(True)
    b = layer.bias.detach().squeeze(-1).clone().requires_grad_(True)

    def dense() -> None:
        w.grad = b.grad = None
        F.cross_entropy(F.linear(h, w, b), labels[:, 0]).backward()

    hq = h.clone()

    def query() -> None:
        layer.active(hq, labels)

    def sparse() -> None:
        layer.zero_grad(set_to_none=True)
        ids, mask = layer.active(hq, labels)
        active_softmax_loss(layer(hq, ids, mask), ids, mask, labels).backward()

    td, tq, ts = (_median(f, repeats) for f in (dense, query, sparse))
    return {"C": C, "s": s, "dense_s": td, "sparse_s": ts, "ratio": ts / (td * s),
            "query_share": tq / ts}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="10000,100000")
    ap.add_argument("--fractions", default="0.005,0.01,0.05")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--K", type=int, default=9)
    ap.add_argument("--L", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    try:
        widths = [int(v) for v in a.widths.split(",")]
        fractions = [float(v) for v in a.fractions.split(",")]
    except ValueError:
        print("slide_layer: --widths and --fractions take comma-separated numbers",
              file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    print(f"# SLIDE layer vs dense: H {a.hidden}, batch {a.batch}, K {a.K}, L {a.L}, "
          f"{a.threads} thread(s), median of {a.repeats}")
    print("| width | active | dense fwd+bwd s | SLIDE fwd+bwd s | SLIDE / (dense x active) "
          "| retrieval share |")
    print("|---|---|---|---|---|---|")
    for C in widths:
        for s in fractions:
            r = row(C, a.hidden, a.batch, s, a.K, a.L, a.repeats)
            print(f"| {C} | {s:g} | {r['dense_s']:.4f} | {r['sparse_s']:.4f} | "
                  f"{r['ratio']:.1f} | {r['query_share']:.0%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The SLIDE layer's forward + backward against the dense layer's, per active fraction.

For an output width C, hidden width H and batch B: the dense layer computes all C logits and
their full gradient (F.linear forward and backward, a dense [C, H] weight gradient); the SLIDE
layer (:class:`thinwire.SLIDELayer`) retrieves the active set (table query and selection), then
computes the logits of A = s C neurons per sample and their sparse gradient. Printed per row
(one per width, active fraction and ``--sampling`` mode, ``topk`` or ``vanilla``): the least
seconds of each over ``--repeats`` timed steps (after two warm-up steps; on a shared machine
the least-disturbed step is the closest to the code's own cost), the ratio
sparse / (dense x s) (the issue's target: at most 2), the retrieval's share of the sparse
time, and the floor of the sparse compute itself: the same forward and backward with the
active ids given (retrieval free), its ratio to dense x s, and the [B, A, H] gather of the
active weight rows alone (the memory traffic every gather-based sparse step pays, forward, and
once more for the scattered gradient backward). One torch thread (``--threads``), CPU.

    python benchmarks/slide_layer.py --widths 10000,100000 --fractions 0.005,0.01,0.05 \
        --sampling topk,vanilla
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from thinwire.strategies.slide.layer import SLIDELayer, active_softmax_loss
from thinwire.strategies.slide.lsh import SAMPLINGS


def _best(fn, repeats: int) -> float:  # noqa: ANN001
    """The least seconds of ``repeats`` timed calls after two warm-up calls (on a shared machine
    the least-disturbed call is the closest to the code's own cost)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def rows(C: int, H: int, B: int, s: float, K: int, L: int, repeats: int,
         samplings: list[str]) -> list[dict[str, float | str]]:
    """One dense measurement, then per sampling mode the SLIDE layer's (module docstring)."""
    g = torch.Generator().manual_seed(0)
    h = torch.relu(torch.randn(B, H, generator=g))
    labels = torch.randint(0, C, (B, 1), generator=g)
    layers = {sm: SLIDELayer(H, C, K=K, L=L, budget=max(1, round(s * C)), seed=1, sampling=sm)
              for sm in samplings}
    first = next(iter(layers.values()))
    w = first.weight.detach().clone().requires_grad_(True)
    b = first.bias.detach().squeeze(-1).clone().requires_grad_(True)

    def dense() -> None:
        w.grad = b.grad = None
        F.cross_entropy(F.linear(h, w, b), labels[:, 0]).backward()

    td = _best(dense, repeats)
    out: list[dict[str, float | str]] = []
    for sm, layer in layers.items():
        hq = h.clone()

        def query() -> None:
            layer.active(hq, labels)

        def sparse() -> None:
            layer.zero_grad(set_to_none=True)
            ids, mask = layer.active(hq, labels)
            active_softmax_loss(layer(hq, ids, mask), ids, mask, labels).backward()

        given = layer.active(hq, labels)

        def compute() -> None:
            layer.zero_grad(set_to_none=True)
            ids, mask = given
            active_softmax_loss(layer(hq, ids, mask), ids, mask, labels).backward()

        wd = layer.weight.detach()

        def gather() -> None:
            F.embedding(given[0], wd)

        tq, ts, tc, tg = (_best(f, repeats) for f in (query, sparse, compute, gather))
        out.append({"C": C, "s": s, "sampling": sm, "dense_s": td, "sparse_s": ts,
                    "ratio": ts / (td * s), "query_share": tq / ts, "compute_s": tc,
                    "compute_ratio": tc / (td * s), "gather_s": tg})
    return out


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
    ap.add_argument("--sampling", default="topk,vanilla",
                    help="comma-separated: topk, vanilla (SLIDELayer's sampling modes)")
    a = ap.parse_args(argv)
    try:
        widths = [int(v) for v in a.widths.split(",")]
        fractions = [float(v) for v in a.fractions.split(",")]
    except ValueError:
        print("slide_layer: --widths and --fractions take comma-separated numbers",
              file=sys.stderr)
        return 2
    samplings = a.sampling.split(",")
    bad = [v for v in samplings if v not in SAMPLINGS]
    if bad:
        print(f"slide_layer: --sampling {bad[0]!r}: use {', '.join(SAMPLINGS)}", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    print(f"# SLIDE layer vs dense: H {a.hidden}, batch {a.batch}, K {a.K}, L {a.L}, "
          f"{a.threads} thread(s), least of {a.repeats}")
    print("| width | active | sampling | dense fwd+bwd s | SLIDE fwd+bwd s "
          "| SLIDE / (dense x active) | retrieval share | ids given: fwd+bwd s "
          "| ids given / (dense x active) | gather [B, A, H] alone s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for C in widths:
        for s in fractions:
            for r in rows(C, a.hidden, a.batch, s, a.K, a.L, a.repeats, samplings):
                print(f"| {C} | {s:g} | {r['sampling']} | {r['dense_s']:.4f} | {r['sparse_s']:.4f} | "
                      f"{r['ratio']:.1f} | {r['query_share']:.0%} | {r['compute_s']:.4f} | "
                      f"{r['compute_ratio']:.1f} | {r['gather_s']:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The SLIDE layer's forward + backward against the dense layer's, per active fraction.

For an output width C, hidden width H and batch B: the dense layer computes all C logits and
their full gradient (F.linear forward and backward, a dense [C, H] weight gradient); the SLIDE
layer (:class:`thinwire.SLIDELayer`) retrieves the active set (table query and selection), then
computes the logits of A = s C neurons per sample and their sparse gradient. Printed per row
(one per width, active fraction and ``--sampling`` mode, ``topk`` or ``vanilla``): the least
seconds of each over ``--repeats`` rounds that time every variant once (after a warm-up
round; on a shared machine the least-disturbed step is the closest to the code's own cost), the ratio
sparse / (dense x s) (the goal: at most 4), the retrieval's share of the sparse
time, and the floor of the sparse compute itself: the same forward and backward with the
active ids given (retrieval free), its ratio to dense x s, and the [B, A, H] gather of the
active weight rows alone (the memory traffic every gather-based sparse step pays, forward, and
once more for the scattered gradient backward). The gather's floor beside it: the bytes it must
move (the B A active rows of H floats read and the [B, A, H] result written, 2 x 4 B A H) over
this machine's measured copy bandwidth (a 256 MiB torch copy on the same threads, bytes read
plus written over the least seconds of ``--repeats``, printed once above the table), and that
floor over dense x s: where it exceeds 4, no gather-based step can meet the goal, however
fast its retrieval. With the compiled kernels (thinwire.kernels) built, the full step runs
the compiled path (the hash codes, tables and active sets in native arrays, the fused layer with
no gather, the fused loss) and the table adds, with the ids given, the fused layer's time and
ratio beside the gathered pure-torch layer's, the full step's ratio on the pure-torch path, and
the fused layer's floor: the active rows read forward and their gradients written backward
(2 x 4 B A H bytes: the layer's input here needs no gradient, so the backward reads no weight
rows) over the copy bandwidth, the same with each touched row counted once (the fused layer
reads a row shared by several samples once: 2 x 4 U H bytes for U distinct touched rows), and
that traffic measured: ``index_select`` of the U touched rows, ascending, into a kept [U, H]
buffer (the same scattered reads of the weight and as many rows written in sequence; rows at
random places are read well below the copy's bandwidth), with the fused layer's time over it.
One torch thread (``--threads``), CPU.
Before every timed call ``--flush-mib`` MiB are written (untimed), so that every variant starts
from caches that hold none of the layer (:func:`cache_flush` says why), and every layer's
gradients are dropped (untimed): a variant's step would otherwise free the gradient the previous
variant left on the shared layer (the gathered path's [B A, H] values: 8 ms at 0.2 % of
1,000,000 outputs, counted in the fused step that followed it), so each variant pays for
allocating its own gradients and none for freeing another's.

``--by-kernel`` adds a second table: the full compiled step (retrieval included) split by
kernel, each part's least milliseconds over ``--repeats`` steps (the same untimed flush and
gradient drop before each): the retrieval's kernels together, the touched rows' sort, the
forward, the loss (forward and backward), the backward, and the Python and torch around them.

    python benchmarks/slide_layer.py --widths 10000,100000 --fractions 0.005,0.01,0.05 \
        --sampling topk,vanilla
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from thinwire import kernels
from thinwire.strategies.slide.layer import SLIDELayer, active_softmax_loss
from thinwire.strategies.slide.lsh import SAMPLINGS


def _least(fns: dict[str, Callable[[], None]], repeats: int,
           flush: Callable[[], None] | None = None) -> dict[str, float]:
    """The least seconds of each function over ``repeats`` rounds (after one warm-up round), a
    round timing every function once, so that a burst of other work on a shared machine falls
    on all of them alike; the least-disturbed call is the closest to the code's own cost.
    ``flush`` (untimed) runs before every timed call, so each starts from the same caches."""
    for f in fns.values():
        f()
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            if flush is not None:
                flush()
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def copy_bandwidth(repeats: int, mib: int = 256) -> float:
    """Bytes a second of a large torch copy (read plus written) on the current threads: the
    least seconds of ``repeats`` copies of ``mib`` MiB into a preallocated tensor."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    t = _least({"copy": copy}, repeats)["copy"]
    return 2 * src.numel() * 4 / t


def cache_flush(mib: int) -> Callable[[], None] | None:
    """A function that writes ``mib`` MiB (0: None): run before every timed call, it evicts
    what the previous variant left in the caches. Without it a variant that reads the same active
    rows as the one before it (the ids-given steps after the gather) finds them cached, and one
    that follows the dense layer finds them evicted, so the full step looked slower than its
    retrieval plus the ids-given step (``--flush-mib 0`` shows it); this host's last-level cache
    is reported as 300 MiB, and writing 256 MiB evicts the layer's rows where 64 MiB did not."""
    if mib <= 0:
        return None
    buf = torch.empty(mib * 2**20 // 4)

    def flush() -> None:
        buf.fill_(1.0)
    return flush


def rows(C: int, H: int, B: int, s: float, K: int, L: int, repeats: int,
         samplings: list[str], bandwidth: float, flush: Callable[[], None] | None = None,
         kernel_parts: bool = False) -> list[dict[str, Any]]:
    """The dense layer and, per sampling mode, the SLIDE layer (module docstring)."""
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

    fns: dict[str, Callable[[], None]] = {"dense": dense}
    moved: dict[str, float] = {}
    distinct: dict[str, float] = {}  # the fused layer's bytes over the touched rows
    for sm, layer in layers.items():
        variants, active_ids, rows_touched = _variants(sm, layer, h, labels)
        fns.update(variants)
        moved[sm] = 2.0 * 4 * active_ids * H  # rows read + [B, A, H] written, float32
        distinct[sm] = 2.0 * 4 * rows_touched * H

    def before() -> None:  # untimed (module docstring): no step frees another's gradients
        w.grad = b.grad = None
        for layer in layers.values():
            layer.zero_grad(set_to_none=True)
        if flush is not None:
            flush()
    t = _least(fns, repeats, before)
    td = t["dense"]
    parts = {sm: by_kernel(fns[f"{sm}.sparse"], repeats, before) if kernel_parts and PATH == "1"
             else {} for sm in layers}
    return [{"parts": parts[sm], "C": C, "s": s, "sampling": sm, "dense_s": td,
             "sparse_s": t[f"{sm}.sparse"],
             "ratio": t[f"{sm}.sparse"] / (td * s),
             "query_share": t[f"{sm}.query"] / t[f"{sm}.sparse"],
             "compute_s": t[f"{sm}.compute"], "compute_ratio": t[f"{sm}.compute"] / (td * s),
             "gather_s": t[f"{sm}.gather"], "gather_mb": moved[sm] / 1e6,
             "floor_s": moved[sm] / bandwidth,
             "floor_ratio": moved[sm] / bandwidth / (td * s),
             "fused_s": t.get(f"{sm}.fused", float("nan")),
             "fused_ratio": t.get(f"{sm}.fused", float("nan")) / (td * s),
             "sparse_torch_ratio": t.get(f"{sm}.sparse_torch", float("nan")) / (td * s),
             # fused floor: the active rows read forward and their gradients written backward
             # (2 x 4 B A H bytes, as moved counts; h needs no gradient: no rows read back)
             "fused_floor_ratio": moved[sm] / bandwidth / (td * s),
             "distinct_floor_ratio": distinct[sm] / bandwidth / (td * s),
             "touched_s": t.get(f"{sm}.touched", float("nan")),
             "touched_ratio": t.get(f"{sm}.touched", float("nan")) / (td * s),
             "fused_over_touched": t.get(f"{sm}.fused", float("nan"))
             / t.get(f"{sm}.touched", float("nan"))} for sm in layers]


KERNEL_PARTS = {"retrieval": ("lsh_",), "sort": ("slide_touched_rows",),
                "forward": ("slide_forward_rows",), "loss": ("slide_softmax_loss",),
                "backward": ("slide_backward_rows",)}
"""``--by-kernel``'s columns: the kernels (by name prefix) each part of the step sums."""


def by_kernel(step: Callable[[], None], repeats: int, before: Callable[[], None]
              ) -> dict[str, float]:
    """Seconds of each part of ``step`` (:data:`KERNEL_PARTS`, ``rest`` and ``total``), each
    the least over ``repeats`` calls with ``before`` (untimed) ahead of each: the compiled
    kernels' entry points are wrapped with timers for the calls and restored after."""
    lib = kernels.lib()
    assert lib is not None
    spent: dict[str, float] = {}

    def timer(part: str, fn: Callable[..., object]) -> Callable[..., object]:
        def timed(*args: object) -> object:
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[part] = spent.get(part, 0.0) + time.perf_counter() - t0
        return timed

    part_of = {name: part for name in kernels.SIGNATURES for part, pre in KERNEL_PARTS.items()
               if name.startswith(pre) and hasattr(lib, name)}
    originals = {name: getattr(lib, name) for name in part_of}
    best = {k: float("inf") for k in (*KERNEL_PARTS, "rest", "total")}
    try:
        for name, fn in originals.items():
            setattr(lib, name, timer(part_of[name], fn))
        step()  # warm
        for _ in range(repeats):
            before()
            spent.clear()
            t0 = time.perf_counter()
            step()
            total = time.perf_counter() - t0
            spent["rest"] = total - sum(spent.values())
            spent["total"] = total
            for k in best:
                best[k] = min(best[k], spent.get(k, 0.0))
    finally:
        for name, fn in originals.items():
            setattr(lib, name, fn)
    return best


def _variants(sm: str, layer: SLIDELayer, h: torch.Tensor, labels: torch.Tensor
              ) -> tuple[dict[str, Callable[[], None]], int, int]:
    """The timed variants of one layer: retrieval alone, the full sparse step, the step with
    the active ids given, and the gather of the active weight rows alone; the number of
    active ids given (B x A, padding included: the gather moves them all) and of the rows the
    fused layer touches (every slot's, masked ones included)."""
    given = layer.active(h, labels)

    def query() -> None:
        layer.active(h, labels)

    def gather() -> None:
        F.embedding(given[0], layer.weight.detach())

    def step(path: str, ids: tuple[torch.Tensor, torch.Tensor] | None) -> Callable[[], None]:
        def run() -> None:
            with kernels.forced(path):
                _step(layer, h, labels, ids)
        return run

    fns = {f"{sm}.query": query, f"{sm}.sparse": step(PATH, None),
           f"{sm}.compute": step("0", given), f"{sm}.gather": gather}
    # the rows the fused layer reads and writes the gradient of: every slot's (masked ones too)
    touched = torch.unique(given[0])
    if PATH == "1":
        fns[f"{sm}.fused"] = step("1", given)
        fns[f"{sm}.sparse_torch"] = step("0", None)
        kept = kernels.empty_huge(touched.numel(), layer.weight.shape[1])  # as the gradient's

        def touched_rows() -> None:
            torch.index_select(layer.weight.detach(), 0, touched, out=kept)
        fns[f"{sm}.touched"] = touched_rows
    return fns, given[0].numel(), touched.numel()


PATH = "1" if kernels.available() else "0"
"""The full step's path: the compiled kernels where they build (thinwire.kernels)."""


def _step(layer: SLIDELayer, h: torch.Tensor, labels: torch.Tensor,
          given: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """One sparse forward and backward; the active set retrieved unless ``given``."""
    layer.zero_grad(set_to_none=True)
    ids, mask = given if given is not None else layer.active(h, labels)
    active_softmax_loss(layer(h, ids, mask), ids, mask, labels).backward()


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
    ap.add_argument("--flush-mib", type=int, default=256,
                    help="MiB written before every timed call (evicts the caches; 0: off)")
    ap.add_argument("--sampling", default="topk,vanilla",
                    help="comma-separated: topk, vanilla (SLIDELayer's sampling modes)")
    ap.add_argument("--by-kernel", action="store_true",
                    help="a second table: the compiled step's time split by kernel")
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
    bandwidth = copy_bandwidth(a.repeats)
    flush = cache_flush(a.flush_mib)
    print(f"# SLIDE layer vs dense: H {a.hidden}, batch {a.batch}, K {a.K}, L {a.L}, "
          f"{a.threads} thread(s), least of {a.repeats}, {a.flush_mib} MiB written before "
          "every timed call")
    print(f"# copy bandwidth: {bandwidth / 1e9:.2f} GB/s (256 MiB torch copy, read + written, "
          f"{a.threads} thread(s))")
    print(f"# SLIDE fwd+bwd: the {'compiled' if PATH == '1' else 'pure-torch'} path; ids "
          "given: torch = the gathered pure-torch layer, fused = the compiled kernels")
    print("| width | active | sampling | dense fwd+bwd s | SLIDE fwd+bwd s "
          "| SLIDE / (dense x active) | torch SLIDE / (dense x active) | retrieval share "
          "| ids given, torch: fwd+bwd s | torch / (dense x active) | ids given, fused: fwd+bwd s "
          "| fused / (dense x active) | gather [B, A, H] alone s | gather moves MB "
          "| gather floor / (dense x active) | fused floor / (dense x active) "
          "| fused floor, rows once / (dense x active) | touched rows gathered s "
          "| touched rows gathered / (dense x active) | fused / touched rows gathered |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
          "---:|---:|---:|")
    split: list[dict[str, Any]] = []
    for C in widths:
        for s in fractions:
            for r in rows(C, a.hidden, a.batch, s, a.K, a.L, a.repeats, samplings, bandwidth,
                          flush, a.by_kernel):
                split.append(r)
                print(f"| {C} | {s:g} | {r['sampling']} | {r['dense_s']:.4f} | "
                      f"{r['sparse_s']:.4f} | {r['ratio']:.1f} | "
                      f"{r['sparse_torch_ratio']:.1f} | {r['query_share']:.0%} | "
                      f"{r['compute_s']:.4f} | {r['compute_ratio']:.1f} | "
                      f"{r['fused_s']:.4f} | {r['fused_ratio']:.1f} | {r['gather_s']:.4f} | "
                      f"{r['gather_mb']:.1f} | {r['floor_ratio']:.2f} | "
                      f"{r['fused_floor_ratio']:.2f} | {r['distinct_floor_ratio']:.2f} | "
                      f"{r['touched_s']:.4f} | {r['touched_ratio']:.2f} | "
                      f"{r['fused_over_touched']:.2f} |", flush=True)
    if a.by_kernel and PATH == "1":
        cols = [*KERNEL_PARTS, "rest", "total"]
        print("\n# the compiled step (retrieval included) by kernel, least ms of each part over "
              f"{a.repeats} steps; rest: the Python and torch around the kernels")
        print("| width | active | sampling | " + " | ".join(f"{c} ms" for c in cols) + " |")
        print("|---|---|---|" + "---:|" * len(cols))
        for r in split:
            parts = r["parts"]
            print(f"| {r['C']} | {r['s']:g} | {r['sampling']} | "
                  + " | ".join(f"{1e3 * parts[c]:.2f}" for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time to the dense model's precision@1 (less a margin) from finished runs' metrics.

The issue's target for Distributed SLIDE: at width >= 100,000, 4 workers and 100 Mbit/s, SLIDE
reaches the dense model's precision@1 (within 1 point) at least 5x sooner than dense model
parallelism. Given run directories (each a ``thinwire train``/``bench`` method directory holding
``metrics.jsonl``; a directory above them is searched), the reference (``--reference``, a path
fragment naming dense-mp's run) sets the target: its final precision@1 less ``--margin`` (0.01,
one point). Printed per run: its final and best precision@1, the first evaluation at or above
the target (step, rank 0's training seconds to it, the ledger's bytes sent per worker), and the
reference's seconds to the target over this run's (the speed-up; the target asks for >= 5).

    python benchmarks/slide_time_to_target.py runs/tb_slide_ttt_densemp runs/tb_slide_ttt_repl \\
        --reference dense-mp
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

METRIC = "precision@1"


def evals(run: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    return [r for r in rows if r.get("kind") == "eval" and METRIC in r]


def first_at(rows: list[dict[str, float]], target: float) -> dict[str, float] | None:
    return next((r for r in rows if r[METRIC] >= target), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="run directories, or directories above them")
    ap.add_argument("--reference", default="dense-mp",
                    help="a path fragment naming the reference run (default dense-mp)")
    ap.add_argument("--margin", type=float, default=0.01)
    a = ap.parse_args(argv)
    runs = sorted({m.parent for d in a.dirs for m in Path(d).rglob("metrics.jsonl")})
    runs = [r for r in runs if evals(r)]
    refs = [r for r in runs if a.reference in str(r)]
    if len(refs) != 1:
        print(f"slide_time_to_target: --reference {a.reference!r} names {len(refs)} of the runs "
              f"with evaluations ({', '.join(str(r) for r in runs) or 'none'}); name one",
              file=sys.stderr)
        return 2
    ref_rows = evals(refs[0])
    target = ref_rows[-1][METRIC] - a.margin
    ref_hit = first_at(ref_rows, target)
    assert ref_hit is not None  # its own last evaluation is above its final value less a margin
    print(f"# target: {refs[0]}'s final {METRIC} {ref_rows[-1][METRIC]:.4f} - {a.margin:g} "
          f"= {target:.4f}")
    print(f"| run | final {METRIC} | best | steps | step at target | train s to target "
          "| sent/worker to target | reference s / this |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        rows = evals(r)
        hit = first_at(rows, target)
        best = max(x[METRIC] for x in rows)
        tail = (f"{hit['step']} | {hit['wall_s']:.1f} | {hit['sent_bytes'] / 1e6:.2f} MB | "
                f"{ref_hit['wall_s'] / hit['wall_s']:.2f}x" if hit else "not reached | - | - | -")
        print(f"| {r} | {rows[-1][METRIC]:.4f} | {best:.4f} | {rows[-1]['step']} | {tail} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

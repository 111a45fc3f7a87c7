"""DCT on hybrid DP+MP training of a DLRM: AUC, log loss, DP and MP bytes against no compression.

Gupta et al., "Training Recommender Systems at Scale: Communication-Efficient Model and Data
Parallelism" (KDD 2021) report at least 100x less DP traffic and 20x less MP traffic without loss
of quality. This script trains ``model dlrm`` with ``method hybrid`` on 4 gloo ranks (tables
split by table, MLPs replicated) on the synthetic ``clicks`` log (generated from the seed: no
real click log installs offline here, so every number is on synthetic data), without DCT and
with DCT at the given (dp_keep, mp_keep) settings, all from the same weights and batches, and
prints test AUC and log loss (8192 impressions), the best AUC the generator allows (its true
click probabilities), the majority-class baseline, and the bytes each rank sent per step on
the DP side (``grad`` entries: all-reduce, or DCT's counts and entries) and on the MP side
(``mp``: ids, embedding vectors, their gradients, DCT's counts), with the reduction factors.

    PYTHONPATH=src python benchmarks/dct.py [--steps 200] [--settings 0.01/0.05,0.002/0.02]
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from thinwire.builders import build_model, build_strategy, load_data, make_stream
from thinwire.config import load
from thinwire.data.task import auc, task_for
from thinwire.runtime.comm import Comm
from thinwire.runtime.spawn import run_group


def train(comm: Comm, over: dict[str, Any], steps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    cfg = load(None, {**over, "runtime.workers": comm.world_size})
    ds = load_data(cfg)
    strat = build_strategy(cfg, comm, torch.device("cpu"), task_for(ds), build_model(cfg, ds))
    stream = make_stream(cfg, ds, comm.rank, comm.world_size)
    for s in range(steps):
        strat.train_step(stream.batch(s), s)
    by_tag = {"grad": 0, "mp": 0}
    for e in comm.ledger.entries:
        if e.tag in by_tag:
            by_tag[e.tag] += e.sent
    rows = comm.gather_floats([by_tag["grad"] / steps, by_tag["mp"] / steps])
    model = strat.eval_model()
    out = {"dp": sum(r[0] for r in rows) / len(rows), "mp": sum(r[1] for r in rows) / len(rows)}
    if model is not None:
        out.update(task_for(ds).evaluate(model, ds.x_test, ds.y_test))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--settings", default="0.01/0.05,0.002/0.02",
                    help="DCT runs as dp_keep/mp_keep, comma-separated")
    args = ap.parse_args()
    over = {"model.name": "dlrm", "method.name": "hybrid", "train.optimizer": "adamw",
            "train.lr": 3e-3, "train.batch_size": 128, "train.steps": args.steps,
            "train.eval_every": args.steps}
    ds = load_data(load(None, {**over, "runtime.workers": args.workers}))
    rate = float(ds.y_test.float().mean())
    majority = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    best = auc(ds.extra["p_test"], ds.y_test.float())
    runs: list[tuple[str, dict[str, Any]]] = [("none", {})]
    for setting in args.settings.split(","):
        dp_keep, mp_keep = setting.split("/")
        runs.append((f"DCT dp_keep={dp_keep} mp_keep={mp_keep} T={args.every}",
                     {"method.dct": True, "method.dp_keep": dp_keep, "method.mp_keep": mp_keep,
                      "method.every": args.every}))
    results = []
    for label, extra in runs:
        r = run_group(train, args.workers, {**over, **extra}, args.steps, timeout=3600)[0]
        results.append((label, r))
        print(f"# {label}: {r}", flush=True)
    base = results[0][1]
    print(f"\nDLRM (dim 16, bottom 8-64-16, top 64-1, 8 tables x 1000 rows) on the synthetic "
          f"click log, {args.workers} ranks x batch 128, AdamW 3e-3, {args.steps} steps; "
          f"test: 8192 impressions, click rate {rate:.3f}\n")
    print(f"Best reachable AUC (true probabilities): {best:.4f}; majority class: AUC 0.5, "
          f"log loss {majority:.4f}\n")
    print("| compression | test AUC | log loss | DP bytes/rank/step | DP reduction | "
          "MP bytes/rank/step | MP reduction |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, r in results:
        print(f"| {label} | {r['auc']:.4f} | {r['nll']:.4f} | {r['dp'] / 1e3:,.2f} kB | "
              f"{base['dp'] / r['dp']:.1f}x | {r['mp'] / 1e3:,.2f} kB | "
              f"{base['mp'] / r['mp']:.1f}x |")


if __name__ == "__main__":
    main()

"""IST against data parallelism and local SGD on Fashion-MNIST (MLP 784-h-h-10).

    python benchmarks/ist_vs_dp.py                       # the full grid (~30 min on 2 cores)
    python benchmarks/ist_vs_dp.py --hidden 1024 --workers 4 --shards iid --steps 200   # quick

For every hidden width h, worker count n and sharding (iid, or label-skewed with skew 0.9) it
runs dp, localsgd (H = 10) and ist (K = 10, central deployment, batch-statistics scaling) with
the same data, model, batch (128 per worker), learning rate and number of steps, and prints one
markdown table: test accuracy and NLL, bytes sent per worker (mean and max, from the ledger),
parameters trained per worker, wall time (rank 0's summed step time). Then, at n = 4, the
targets set for IST are checked against DP: accuracy within 1 point, at most 1/10 of the
bytes, at most 1/3 of the parameters per worker.

Grid defaults keep the run near 30 minutes on 2 cores: h = 1024 at n in {2, 4, 8} on iid shards,
label-skewed shards at n = 4, and h = 2048 at n = 4 on iid shards (``--full`` runs the whole
product). ``--reuse`` takes finished runs of identical configs from ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

from thinwire.config import load, to_dict
from thinwire.report.tables import fmt_bytes, fmt_count
from thinwire.run import run_config

METHODS = {"dp": {"method.name": "dp"},
           "localsgd": {"method.name": "localsgd", "method.period": "10"},
           "ist": {"method.name": "ist", "method.local_steps": "10"}}


def one(h: int, n: int, shard: str, method: str, args: argparse.Namespace) -> dict[str, Any]:
    over = {"data.name": "fashion-mnist", "model.hidden": f"{h},{h}", "runtime.workers": str(n),
            "train.steps": str(args.steps), "train.eval_every": str(args.steps),
            "train.batch_size": "128", "train.lr": str(args.lr), "data.shard": shard,
            "run.out": str(Path(args.out) / f"h{h}_n{n}_{shard}"), "run.name": method,
            "run.progress": "false", "model.norm": args.norm, **METHODS[method]}
    if method == "ist" and args.norm != "batch":
        over["method.scale"] = "dropout"  # batch statistics need BatchNorm layers
    if shard == "skew":
        over["data.skew"] = str(args.skew)
    cfg = load(None, over)
    done = cfg.run_dir / "summary.json"
    if args.reuse and done.exists():  # a finished run of exactly this config
        summary = json.loads(done.read_text())
        if summary["config"] == json.loads(json.dumps(to_dict(cfg))):
            return summary  # type: ignore[no-any-return]
    return run_config(cfg)


def row(h: int, n: int, shard: str, method: str, s: dict[str, Any]) -> str:
    f, b, m = s["final"], s["bytes"], s["memory"]
    return (f"| {h} | {n} | {shard} | {method} | {f['accuracy']:.4f} | {f['nll']:.4f} | "
            f"{fmt_bytes(b['sent_per_worker_mean'])} | {fmt_bytes(b['sent_per_worker_max'])} | "
            f"{fmt_count(m['params_held_max'])} ({m['params_held_max'] / m['params_full']:.1%}) | "
            f"{s['wall_s']:.1f} |")


def check(results: dict[tuple[int, int, str, str], dict[str, Any]]) -> list[str]:
    lines = []
    for (h, n, shard, method), s in sorted(results.items()):
        if method != "ist" or n != 4 or (h, n, shard, "dp") not in results:
            continue
        dp = results[(h, n, shard, "dp")]
        gap = 100 * (dp["final"]["accuracy"] - s["final"]["accuracy"])
        ratio = s["bytes"]["sent_per_worker_mean"] / dp["bytes"]["sent_per_worker_mean"]
        ratio_max = s["bytes"]["sent_per_worker_max"] / dp["bytes"]["sent_per_worker_max"]
        params = s["memory"]["params_held_max"] / s["memory"]["params_full"]
        lines.append(
            f"| {h} | {shard} | {gap:+.2f} pt {'(met)' if gap <= 1 else '(missed)'} | "
            f"{ratio:.4f} mean, {ratio_max:.4f} max {'(met)' if ratio_max <= 0.1 else '(missed)'} | "
            f"{params:.3f} {'(met)' if params <= 1 / 3 else '(missed)'} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", default="1024,2048")
    p.add_argument("--workers", default="2,4,8")
    p.add_argument("--shards", default="iid,skew")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--skew", type=float, default=0.9)
    p.add_argument("--norm", default="batch", choices=("batch", "layer", "none"),
                   help="batch: IST's original BatchNorm with batch statistics; otherwise IST "
                        "uses inverted-dropout scaling")
    p.add_argument("--full", action="store_true", help="every (h, n) pair, not h>1024 at n=4 only")
    p.add_argument("--out", default="runs/bench_ist")
    p.add_argument("--reuse", action="store_true",
                   help="reuse finished runs of identical configs found under --out")
    args = p.parse_args()
    hs = [int(x) for x in args.hidden.split(",")]
    ns = [int(x) for x in args.workers.split(",")]
    shards = args.shards.split(",")
    t0 = time.time()
    results: dict[tuple[int, int, str, str], dict[str, Any]] = {}
    for h, n, shard in itertools.product(hs, ns, shards):
        if not args.full and n != 4 and (h > min(hs) or shard != "iid"):
            continue  # the default grid: everything at n = 4, iid only elsewhere
        if not args.full and h > min(hs) and shard != "iid":
            continue
        for method in METHODS:
            print(f"-- h={h} n={n} {shard} {method}", file=sys.stderr, flush=True)
            results[(h, n, shard, method)] = one(h, n, shard, method, args)
    print(f"# IST vs DP and local SGD: Fashion-MNIST, MLP 784-h-h-10 (norm {args.norm}), batch "
          f"128/worker, {args.steps} steps, lr {args.lr}, skew {args.skew}, "
          f"{time.time() - t0:.0f} s in all\n")
    print("| h | n | shards | method | test acc | test NLL | sent/worker mean | sent/worker max "
          "| params trained/worker | wall s |")
    print("|---:|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for key, s in results.items():
        print(row(*key, s))
    print("\nTargets at n = 4 (IST against DP):\n")
    print("| h | shards | accuracy gap (DP - IST) <= 1 pt | bytes/worker IST/DP <= 0.1 "
          "| params trained/worker <= 1/3 |")
    print("|---:|---|---|---|---|")
    print("\n".join(check(results)))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(
        {"|".join(map(str, k)): v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()

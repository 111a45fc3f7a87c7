"""Low-communication methods on the thin-wire testbed: wall time and bytes per worker to an easy
target and to data parallelism's converged one, for DP, local SGD, DiLoCo, Streaming DiLoCo
(fp32 and 4-bit), SparseLoCo, DeMo and IST (both deployments).

Fashion-MNIST, MLP 784-h-h-10 (batch norm), 4 workers in network namespaces joined by
tc-shaped links (``thinwire.testbed``), the same batch and inner learning rate for every method
but DeMo (a sign step: ``train.lr`` 0.002), every method the same number of steps, evaluated
every ``--eval-every`` steps. Wall times and wire bytes are measured; without namespaces (not
root) the script falls back to the modelled mode and says so. DP's converged target is the best
accuracy DP reached on the link. Run as root from the repository root (one testbed run at a
time)::

    flock /tmp/thinwire-testbed.lock .venv/bin/python benchmarks/loco_thin_wire.py \\
        --links 100mbit,1gbit --steps 100 --out runs/loco_thin_wire

Writes OUT/bench.md (the tables and the exact command) and OUT/bench.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from thinwire import config as config_mod
from thinwire.run import method_overrides, preflight, run_name
from thinwire.testbed import bench
from thinwire.testbed.netns import unavailable_reason
from thinwire.testbed.rates import parse_links
from thinwire.testbed.report import BenchResult, bench_table

METHODS = ("dp", "localsgd:period=10", "diloco:period=10",
           "diloco:period=10,fragments=2,delay=2",
           "diloco:period=10,fragments=2,delay=2,compressor=fp4",
           "sparseloco:period=10", "demo:train.lr=0.002",
           "ist:local_steps=10", "ist:local_steps=10,deployment=sharded")


def winners(results: list[BenchResult], target: float) -> list[str]:
    """Per link: the method first to ``target`` and the one with the fewest bytes to it."""
    lines = []
    for link in dict.fromkeys(r.link for r in results):
        hits = [(r.method, r.to_target(target)) for r in results if r.link == link]
        reached = [(m, h) for m, h in hits if h is not None]
        if not reached:
            lines.append(f"- {link.label}, to {target:.3f}: no method reached it")
            continue
        fast = min(reached, key=lambda mh: mh[1][1])
        thin = min(reached, key=lambda mh: mh[1][2])
        lines.append(f"- {link.label}, to {target:.3f}: fastest {fast[0]} ({fast[1][1]:.1f} s), "
                     f"fewest bytes {thin[0]} ({thin[1][2] / 1e6:.3f} MB/worker); reached by "
                     f"{len(reached)} of {len(hits)}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/loco_thin_wire")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--links", default="100mbit,1gbit")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--easy", type=float, default=0.75, help="the easy target accuracy")
    p.add_argument("--methods", default=";".join(METHODS),
                   help="method specs separated by ';'")
    p.add_argument("--timeout", type=float, default=1500.0, help="whole benchmark, seconds")
    args = p.parse_args()
    if args.steps % args.eval_every or args.eval_every % 10:
        p.error("--steps must be a multiple of --eval-every, itself a multiple of 10 (H)")
    out = Path(args.out)
    links = parse_links(args.links)
    reason = unavailable_reason()
    kind = "modelled" if reason else "measured"
    if reason:
        print(f"no network namespaces ({reason}): modelled mode, wall times are modelled")
    groups = ["modelled"] if reason else [lk.label for lk in links]
    base = {"data.name": "fashion-mnist", "model.hidden": f"{args.hidden},{args.hidden}",
            "model.norm": "batch", "runtime.workers": 4, "runtime.threads": 1,
            "train.log_every": 10, "run.progress": False, "train.steps": args.steps,
            "train.eval_every": args.eval_every}
    specs = [s for s in args.methods.split(";") if s]
    cfgs = {g: [config_mod.load(None, {**base, **method_overrides(spec),
                                      "run.name": run_name(spec), "run.out": str(out / g)})
                for spec in specs] for g in groups}
    preflight(cfgs[groups[0]][0])
    t0 = time.monotonic()
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    results, error = bench.run_all(cfgs, links, t0 + args.timeout, modelled=bool(reason))
    if error and not results:
        raise SystemExit(f"loco_thin_wire: {error}")
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    total = time.monotonic() - t0
    lines = [f"Command: `{' '.join(shlex.quote(a) for a in ['python', *sys.argv])}` (as root)",
             f"Mode: {kind}. MLP 784-{args.hidden}-{args.hidden}-10 on Fashion-MNIST, 4 workers, "
             f"{args.steps} steps each, evaluated every {args.eval_every}; whole benchmark "
             f"{total / 60:.1f} min; load average before {' '.join(load_before)}, after "
             f"{' '.join(load_after)}." + (f" Stopped early ({error})." if error else "")]
    targets = [("easy", args.easy)]
    for link in dict.fromkeys(r.link for r in results):
        dp = next((r for r in results if r.link == link and r.is_dp), None)
        if dp is not None and dp.curve:
            best = max(a for _, a, _ in dp.curve)
            if all(t != best for _, t in targets):  # the same data give the same curve
                targets.append((f"DP's converged on {link.label}", best))
    for name, target in targets:
        lines += ["", f"Target {target:.4f} ({name}):", "", bench_table(results, target), ""]
        lines += winners(results, target)
    text = "\n".join(lines)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(text + "\n")
    rows = [{"link": r.link.label, "method": r.method, "kind": r.kind, "wall_s": r.wall_s,
             "curve": r.curve, "sent_per_worker": r.run.summary["bytes"]["per_rank_sent"],
             "to_target": {str(t): r.to_target(t) for _, t in targets}} for r in results]
    (out / "bench.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Low-communication methods on the thin-wire testbed: wall time and bytes per worker to an easy
target and to data parallelism's converged one, for DP, local SGD, DiLoCo, Streaming DiLoCo
(fp32 and 4-bit), SparseLoCo, DeMo and IST (both deployments).

``--model mlp`` (the default): Fashion-MNIST, MLP 784-h-h-10 (batch norm), 4 workers in network
namespaces joined by
tc-shaped links (``thinwire.testbed``), the same batch and inner learning rate for every method
but DeMo (a sign step: ``train.lr`` 0.002), every method the same number of steps, evaluated
every ``--eval-every`` steps. Wall times and wire bytes are measured; without namespaces (not
root) the script falls back to the modelled mode and says so. DP's converged target is the best
accuracy DP reached on the link. Run as root from the repository root (one testbed run at a
time)::

    flock /tmp/thinwire-testbed.lock .venv/bin/python benchmarks/loco_thin_wire.py \\
        --links 100mbit,1gbit --steps 100 --out runs/loco_thin_wire

``--model gpt``: the GPT on tiny-shakespeare (2 blocks, 4 heads, d_model ``--d-model``,
context 64, AdamW 3e-3, batch 32 a worker, validation on the first 512 windows; the target is a
perplexity, lower is better), H = ``--period`` for the periodic methods, Streaming DiLoCo with
2 fragments, tau = 4 and alpha 0.5, its 4-bit run through the scattered exchange
(``fp4:exchange=scatter``); one more run, local SGD with H = the run's length (one average at
the end), is the local compute alone against which the overlapped step is held::

    flock /tmp/thinwire-testbed.lock .venv/bin/python benchmarks/loco_thin_wire.py \\
        --model gpt --links 100mbit --steps 600 --eval-every 60 --out runs/loco_gpt_100mbit

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

GPT_METHODS = ("dp", "localsgd:period={H}", "diloco:period={H}",
               "diloco:period={H},fragments=2,delay=4,alpha=0.5",
               "diloco:period={H},fragments=2,delay=4,alpha=0.5,compressor=fp4:exchange=scatter",
               "sparseloco:period={H}", "demo:train.optimizer=sgd",
               "ist:local_steps=10", "ist:local_steps=10,deployment=sharded",
               "localsgd:period={S},train.eval_every={S}")

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
            lines.append(f"- {link.label}, to {target:.4g}: no method reached it")
            continue
        fast = min(reached, key=lambda mh: mh[1][1])
        thin = min(reached, key=lambda mh: mh[1][2])
        lines.append(f"- {link.label}, to {target:.4g}: fastest {fast[0]} ({fast[1][1]:.1f} s), "
                     f"fewest bytes {thin[0]} ({thin[1][2] / 1e6:.3f} MB/worker); reached by "
                     f"{len(reached)} of {len(hits)}")
    return lines


def _is_alone(r: BenchResult, steps: int) -> bool:
    """Local SGD averaging once, at the end: the local compute alone."""
    method = r.run.summary.get("config", {}).get("method", {})
    return (method.get("name") == "localsgd"
            and int(method.get("period", 0)) == int(r.run.summary.get("steps", steps)))


def step_times(results: list[BenchResult], steps: int) -> list[str]:
    """Per link: each method's ms per training step and its ratio to local compute alone."""
    lines = []
    for link in dict.fromkeys(r.link for r in results):
        mine = [r for r in results if r.link == link]
        for i, r in enumerate(mine):
            # the local-compute run nearest in the run order (the machine's load drifts)
            alones = [(abs(j - i), j) for j, a in enumerate(mine) if _is_alone(a, steps)]
            alone = mine[min(alones)[1]] if alones else None
            ms = 1000 * r.wall_s / r.run.summary.get("steps", steps)
            ratio = "no local compute run"
            if alone is not None:
                alone_ms = 1000 * alone.wall_s / alone.run.summary.get("steps", steps)
                ratio = f"{ms / alone_ms:.3f}x the nearest local compute run"
            lines.append(f"- {link.label} {r.method}: {ms:.1f} ms a step ({ratio})")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/loco_thin_wire")
    p.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    p.add_argument("--hidden", type=int, default=512, help="MLP width")
    p.add_argument("--d-model", type=int, default=64, help="GPT width")
    p.add_argument("--period", type=int, default=20, help="GPT: H of the periodic methods")
    p.add_argument("--links", default="100mbit,1gbit")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--easy", type=float, default=None,
                   help="the easy target (MLP accuracy, default 0.75; GPT perplexity, default 10)")
    p.add_argument("--target", type=float, default=None,
                   help="one more target (DP's converged value from a run without DP)")
    p.add_argument("--methods", default="", help="method specs separated by ';' (default: "
                   "every method of the model's list)")
    p.add_argument("--timeout", type=float, default=1500.0, help="whole benchmark, seconds")
    args = p.parse_args()
    gpt = args.model == "gpt"
    sync = args.period if gpt else 10
    if args.steps % args.eval_every or args.eval_every % sync or args.eval_every % 10:
        p.error(f"--steps must be a multiple of --eval-every, itself a multiple of 10 (IST's K) "
                f"and of H = {sync}")
    if args.easy is None:
        args.easy = 10.0 if gpt else 0.75
    if not args.methods:
        args.methods = ";".join(m.format(H=args.period, S=args.steps)
                                for m in (GPT_METHODS if gpt else METHODS))
    out = Path(args.out)
    links = parse_links(args.links)
    reason = unavailable_reason()
    kind = "modelled" if reason else "measured"
    if reason:
        print(f"no network namespaces ({reason}): modelled mode, wall times are modelled")
    groups = ["modelled"] if reason else [lk.label for lk in links]
    base: dict[str, object] = {
        "data.name": "fashion-mnist", "model.hidden": f"{args.hidden},{args.hidden}",
        "model.norm": "batch", "runtime.workers": 4, "runtime.threads": 1,
        "train.log_every": 10, "run.progress": False, "train.steps": args.steps,
        "train.eval_every": args.eval_every}
    if gpt:
        from thinwire.data.text import BUNDLED_DIR

        base = {"model.name": "gpt", "data.name": "tinyshakespeare",
                "data.dir": str(BUNDLED_DIR / "tinyshakespeare"), "data.seq_len": 64,
                "data.limit_test": 512, "model.n_layer": 2, "model.d_model": args.d_model,
                "model.n_head": 4, "train.optimizer": "adamw", "train.lr": 0.003,
                "train.batch_size": 32, "runtime.workers": 4, "runtime.threads": 1,
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
    workload = (f"GPT (2 blocks, 4 heads, d_model {args.d_model}, context 64) on "
                f"tiny-shakespeare, H = {args.period}" if gpt else
                f"MLP 784-{args.hidden}-{args.hidden}-10 on Fashion-MNIST")
    lines = [f"Command: `{' '.join(shlex.quote(a) for a in ['python', *sys.argv])}` (as root)",
             f"Mode: {kind}. {workload}, 4 workers, "
             f"{args.steps} steps each, evaluated every {args.eval_every}; whole benchmark "
             f"{total / 60:.1f} min; load average before {' '.join(load_before)}, after "
             f"{' '.join(load_after)}." + (f" Stopped early ({error})." if error else "")]
    targets = [("easy", args.easy)]
    if args.target is not None:
        targets.append(("given", args.target))
    for link in dict.fromkeys(r.link for r in results):
        dp = next((r for r in results if r.link == link and r.is_dp), None)
        if dp is not None and dp.curve:
            values = [a for _, a, _ in dp.curve]
            best = max(values) if dp.run.higher_is_better else min(values)
            if all(t != best for _, t in targets):  # the same data give the same curve
                targets.append((f"DP's converged on {link.label}", best))
    for name, target in targets:
        lines += ["", f"Target {target:.4f} ({name}):", "", bench_table(results, target), ""]
        lines += winners(results, target)
    lines += ["", "Step time (training wall s / steps, rank 0) against local compute alone "
              f"(localsgd with H = {args.steps}: one average at the end):", ""]
    lines += step_times(results, args.steps)
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

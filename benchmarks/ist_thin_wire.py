"""IST beyond MLPs on the thin-wire testbed: time to target of DP, local SGD and IST at 100 Mbit/s
for the GPT (heads and FFN neurons), the ResNet (ResIST's dealt residual blocks) and the GCN
(GIST's hidden features), 4 workers.

Each model family runs ``thinwire.testbed.bench`` (as ``thinwire bench`` does): one network
namespace per worker, tc-shaped links, the same data, model, batch and optimizer for every
method; each method runs its own number of steps (enough to pass the targets; IST needs more,
its steps are cheaper), evaluated every ``eval`` steps (a multiple of every method's steps per
round). Wall times (rank 0's training time, evaluation excluded) and wire bytes are *measured*;
without namespaces (not root) the script falls back to the *modelled* mode and says so. Run as
root from the repository root::

    timeout 2400 \\
        .venv/bin/python benchmarks/ist_thin_wire.py --out runs/ist_thin_wire gpt resnet gcn

Targets: the best value every method reached (the bench's common target) and a few easier ones;
validation loss (mean NLL per token, = ln perplexity) for the GPT, test accuracy otherwise.
Writes OUT/FAMILY/bench.md (tables, ratios, the exact command), OUT/FAMILY/bench.json and
OUT/FAMILY/metric_vs_wall.png. Published claims to set these against (ist.md): ResIST
(Dun et al., UAI 2022) 3.6-3.8x faster than local SGD to within 1% accuracy on CIFAR; GIST
(Wolfe et al., 2021) trains widths one device cannot hold.

Steps of :func:`main`: 1. build the configs of every (family, method); 2. run each family's
methods on fresh testbeds; 3. derive targets, times to target and the byte/memory table;
4. print and write them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ist_models import DATA  # the shared data folder, found as the model benchmark finds it

import thinwire.testbed.bench as bench
from thinwire import config as config_mod
from thinwire.errors import UsageError
from thinwire.report.tables import fmt_bytes
from thinwire.run import method_overrides, preflight, run_name
from thinwire.testbed.netns import unavailable_reason
from thinwire.testbed.rates import parse_links
from thinwire.testbed.report import BenchResult, bench_table, common_target, plot_bench


@dataclass(frozen=True)
class Family:
    """One model on one dataset: shared overrides, and per method spec (steps, eval every)."""

    title: str
    base: dict[str, Any]
    methods: dict[str, tuple[int, int]]
    easier: tuple[float, ...]  # offsets from the common target towards easier targets
    notes: list[str] = field(default_factory=list)


FAMILIES: dict[str, Family] = {
    # 2 blocks, d_model 192: 0.9M parameters (3.6 MB), so DP's ring all-reduce puts ~5.4 MB per
    # step on each worker's 100 Mbit/s link (~0.5 s), comparable with a step's compute here.
    "gpt": Family(
        "GPT on tinyshakespeare (2 blocks, 4 heads, d_model 192, context 64, AdamW 3e-3, "
        "batch 32, validation limited to the first 512 windows)",
        {"model.name": "gpt", "data.name": "tinyshakespeare",
         "data.dir": str(DATA / "tinyshakespeare"), "data.seq_len": 64, "data.limit_test": 512,
         "model.n_layer": 2, "model.d_model": 192, "model.n_head": 4,
         "train.optimizer": "adamw", "train.lr": 0.003, "train.batch_size": 32},
        {"dp": (120, 20), "localsgd": (120, 20), "ist": (300, 20),
         "ist:deployment=sharded": (300, 20)},
        (0.05, 0.10, 0.20)),
    # widths 32/64/128 (the paper's CIFAR widths doubled), 5 blocks a stage: 1.9M parameters;
    # digits' 8x8 images keep a step's compute small, so the wire shows.
    "resnet": Family(
        "ResNet (ResIST) on digits (widths 32/64/128, 5 blocks a stage, SGD 0.05, batch 128)",
        {"model.name": "resnet", "data.name": "digits", "model.widths": "32,64,128",
         "model.blocks": "5,5,5", "train.batch_size": 128},
        {"dp": (60, 10), "localsgd": (100, 10), "ist": (400, 50),
         "ist:deployment=sharded": (400, 50)},
        (0.01, 0.02, 0.05)),
    # hidden 512, 3 layers: 1.0M parameters (the 1433-wide input layer and 512x512 hidden one).
    "gcn": Family(
        "GCN (GIST) on Cora (3 layers, hidden 512, parameter-free LayerNorm, AdamW 1e-2, "
        "batch 32 labelled nodes)",
        {"model.name": "gcn", "data.name": "cora", "data.dir": str(DATA / "cora"),
         "model.hidden": 512, "model.layers": 3, "model.norm": "layer",
         "train.optimizer": "adamw", "train.lr": 0.01, "train.batch_size": 32},
        {"dp": (60, 10), "localsgd": (60, 10), "ist": (120, 10),
         "ist:deployment=sharded": (120, 10)},
        (0.01, 0.02, 0.05)),
    "sbm": Family(
        "GCN (GIST) on the stochastic block model (100k nodes; 3 layers, hidden 64, AdamW 1e-2, "
        "batch 32)",
        {"model.name": "gcn", "data.name": "sbm", "model.hidden": 64, "model.layers": 3,
         "model.norm": "layer", "train.optimizer": "adamw", "train.lr": 0.01,
         "train.batch_size": 32},
        {"dp": (40, 10), "localsgd": (40, 10), "ist": (60, 10)},
        (0.01, 0.02, 0.05)),
}


def short(res: BenchResult) -> str:
    """The method's label without the model's bracketed options (the same in every row)."""
    return res.method.split(" [")[0].split(":", 1)[-1]


def is_loss(res: BenchResult) -> bool:
    """Targets in validation loss (ln perplexity) rather than the run's own metric."""
    return res.run.metric == "perplexity"


def as_metric(res: BenchResult, target: float) -> float:
    """A target in the family's units (loss for the GPT) in the run's metric's units."""
    return math.exp(target) if is_loss(res) else target


def hit(res: BenchResult, target: float) -> tuple[int, float, float] | None:
    """(step, measured wall s, ledger bytes sent per worker) at the first evaluation at the
    target (``target`` in the family's units)."""
    return res.to_target(as_metric(res, target))


def targets(results: list[BenchResult], easier: tuple[float, ...]) -> list[float]:
    """The best value every method reached, then easier ones (loss up, accuracy down)."""
    best = common_target(results)
    if is_loss(results[0]):
        t = round(math.log(best), 3) + 0.0005  # rounded up: every method still reaches it
        return [t] + [t + e for e in easier]
    t = math.floor(best * 1000) / 1000
    return [t] + [t - e for e in easier]


def ratio_lines(results: list[BenchResult], target: float) -> list[str]:
    """Per IST variant: its time to ``target`` and each other method's, with the ratio."""
    times = {short(r): hit(r, target) for r in results}
    lines = []
    unit = "val loss" if is_loss(results[0]) else "accuracy"
    for ist in (short(r) for r in results if "ist(" in r.method):
        mine = times[ist]
        if mine is None:
            lines.append(f"- to {unit} {target:.3f}: {ist} not reached")
            continue
        parts = [f"{ist} {mine[1]:.1f} s (step {mine[0]})"]
        for other in (short(r) for r in results if "ist(" not in r.method):
            o = times[other]
            parts.append(f"{other} {o[1]:.1f} s ({o[1] / mine[1]:.2f}x)" if o is not None
                         else f"{other} not reached")
        lines.append(f"- to {unit} {target:.3f}: " + "; ".join(parts))
    return lines


def summary_table(results: list[BenchResult], target: float) -> str:
    """Final metric, time to target, bytes per worker (ledger mean/max, measured mean/max) and
    the most loaded worker's parameters and optimizer state."""
    loss = is_loss(results[0])
    final_head = "final val loss (ppl)" if loss else "final test acc"
    lines = [f"| method | {final_head} | train wall s | s to {target:.3f} | steps | "
             "sent/worker mean (ledger) | sent/worker max (ledger) | wire tx/worker mean "
             "(measured) | wire tx/worker max (measured) | params held/worker | "
             "params + optimizer state, max worker |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        f = r.run.summary["final"]
        final = (f"{f['nll']:.3f} ({f['perplexity']:.2f})" if loss
                 else f"{f[r.run.metric]:.4f}")
        h = hit(r, target)
        to = f"{h[1]:.1f} | {h[0]}" if h else "not reached | -"
        b = r.run.summary["bytes"]
        tx = r.wire.measured_tx if r.wire is not None else []
        wire = (f"{fmt_bytes(sum(tx) / len(tx))} | {fmt_bytes(max(tx))}" if tx else "- | -")
        m = r.run.summary["memory"]
        held = int(m["params_held_max"])
        share = held / int(m["params_full"]) if m.get("params_full") else float("nan")
        state = fmt_bytes(m["params_bytes_max"] + m["optimizer_bytes_max"])
        lines.append(f"| {short(r)} | {final} | {r.wall_s:.1f} | {to} | "
                     f"{fmt_bytes(b['sent_per_worker_mean'])} | "
                     f"{fmt_bytes(b['sent_per_worker_max'])} | {wire} | "
                     f"{held / 1e3:.1f}k ({share:.0%}) | {state} |")
    return "\n".join(lines)


def run_family(name: str, fam: Family, out: Path, link: str, deadline: float,
               quick: bool) -> str:
    """Steps 1-4 for one family; returns the text written to OUT/NAME/bench.md."""
    links = parse_links(link)
    reason = unavailable_reason()
    kind = "modelled" if reason else "measured"
    if reason:
        print(f"no network namespaces ({reason}): modelled mode, wall times are modelled")
    groups = ["modelled"] if reason else [lk.label for lk in links]
    base = {**fam.base, "runtime.workers": 4, "runtime.threads": 1, "train.log_every": 10,
            "run.progress": False, "run.overwrite": True}  # a re-run replaces its directories
    plan = {spec: ((every, every) if quick else (steps, every))
            for spec, (steps, every) in fam.methods.items()}
    cfgs = {g: [config_mod.load(None, {**base, **method_overrides(spec), "train.steps": steps,
                                      "train.eval_every": every, "run.name": run_name(spec),
                                      "run.out": str(out / name / g)})
                for spec, (steps, every) in plan.items()] for g in groups}
    preflight(cfgs[groups[0]][0])
    t0 = time.monotonic()
    results, error = bench.run_all(cfgs, links, deadline, modelled=bool(reason))
    if error and not results:
        raise SystemExit(f"ist_thin_wire: {name}: {error}")
    total = time.monotonic() - t0
    params = int(results[0].run.summary["memory"]["params_full"])
    tgts = targets(results, fam.easier)
    load = os.getloadavg()
    lines = [f"### {fam.title}", "",
             f"Command: `{' '.join(shlex.quote(a) for a in ['python', *sys.argv])}` (as root)",
             f"Mode: {kind}, link {link}, 4 workers, {params / 1e6:.2f}M parameters "
             f"({fmt_bytes(4 * params)} float32); (steps, eval every): "
             + ", ".join(f"{s} {n}" for s, n in plan.items())
             + f"; this family {total / 60:.1f} min; load average after it "
             f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}."
             + (f" Stopped early ({error}); the tables hold the runs that finished." if error
                else ""), "",
             summary_table(results, tgts[0]), "",
             "Time to target, IST against the others (x: the other's time / IST's; measured, "
             "one run each on the same testbed):"]
    for t in tgts:
        lines += ratio_lines(results, t)
    lines += ["", "The bench's own table (target in the run's metric"
              + (", perplexity = exp(val loss)" if is_loss(results[0]) else "") + "):", "",
              bench_table(results, as_metric(results[0], tgts[0]))]
    text = "\n".join(lines)
    fam_out = out / name
    fam_out.mkdir(parents=True, exist_ok=True)
    (fam_out / "bench.md").write_text(text + "\n")
    rows = [{"method": r.method, "kind": r.kind, "wall_s": r.wall_s, "curve": r.curve,
             "summary_bytes": r.run.summary["bytes"], "memory": r.run.summary["memory"],
             "final": r.run.summary["final"],
             "wire_tx": r.wire.measured_tx if r.wire else None,
             "to_target": {f"{t:.4f}": hit(r, t) for t in tgts}} for r in results]
    (fam_out / "bench.json").write_text(json.dumps({"targets": tgts, "results": rows}, indent=1))
    plot_bench(results, as_metric(results[0], tgts[0]), fam_out / "metric_vs_wall.png")
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("families", nargs="*", default=["gpt", "resnet", "gcn"],
                   help=f"any of {', '.join(FAMILIES)} (default: gpt resnet gcn)")
    p.add_argument("--out", default="runs/ist_thin_wire")
    p.add_argument("--link", default="100mbit", help="one link rate, e.g. 100mbit")
    p.add_argument("--timeout", type=float, default=2400.0, help="all families, seconds")
    p.add_argument("--quick", action="store_true",
                   help="each method one evaluation interval only (a check that all runs work)")
    args = p.parse_args()
    for fam in args.families:
        if fam not in FAMILIES:
            p.error(f"unknown family {fam!r}; use any of {', '.join(FAMILIES)}")
    if "," in args.link:
        p.error(f"--link {args.link}: give one link rate, e.g. 100mbit")
    deadline = time.monotonic() + args.timeout
    for fam in args.families:
        try:
            text = run_family(fam, FAMILIES[fam], Path(args.out), args.link, deadline, args.quick)
        except UsageError as exc:  # one line, no traceback
            raise SystemExit(f"ist_thin_wire: {fam}: {exc}") from None
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

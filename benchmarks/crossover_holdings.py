"""The crossover by target held to the thin-wire testbed: predicted against measured winners.

    .venv/bin/python benchmarks/crossover_holdings.py runs/xover_mlp runs/xover_gcn runs/xover_gpt

Each argument is the output folder of one ``thinwire bench --link 100mbit,1gbit`` invocation
(the commands are in docs/PLANNER.md, "Held to the testbed"): the same methods, model and data
on each link, measured on the testbed. Per folder:

1. convergence: steps to each target per method, fit from all its runs
   (:func:`thinwire.planner.convergence.from_runs`, the default targets or ``--target``);
2. the model as the planner counts it: the run's own module built from its ``config.toml`` and
   counted with its IST adapter (``model_spec_from_module(model, adapter=)``), so every method is
   priced from its registry entry's traffic formula on the model's real layout;
3. the testbed as a planner cluster: 4 single-worker nodes; each link's rate as the inter-node
   bandwidth with TCP's payload per frame (1448/1538) as its efficiency; a CPU worker's peak
   (``--gflops``, the planner's matmul curve and memory rate of ``cpu-1gbe``) scaled by one
   ``compute_efficiency`` per folder fit so that the planner's compute of a full-model step
   equals the measured one: rank 0's ``compute_s`` / steps of the runs of the replicated
   method (one that trains the whole model) whose compute is the largest share of its wall
   time (local SGD here: 9 of its 10 steps send nothing, whereas data parallelism's compute
   is read as step time less all-reduce time, which overlaps the backward pass), mean over
   links: the only number taken from the runs besides the steps;
4. predicted time to target = planner step time x fitted steps (:mod:`thinwire.planner.crossover`);
   measured = the first evaluation at the target on the testbed, rank 0's training time
   (evaluation excluded); the winner of each, per link and target.

Prints one markdown table per folder. Nothing is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

from thinwire import config as config_mod
from thinwire.planner.convergence import curve_of, fit, run_dirs
from thinwire.planner.crossover import priced, times_at, winner
from thinwire.planner.insight import step_at
from thinwire.planner.presets import load_cluster, model_spec_from_module
from thinwire.planner.step import predict
from thinwire.planner.strategy import StrategySpec
from thinwire.report.tables import load_run, time_to_target
from thinwire.testbed.modelled import FRAME_EFFICIENCY


def counted(run_dir: Path):
    """Step 2: the run's model, built from its config, counted with its IST adapter."""
    from thinwire.builders import build_model, load_data
    from thinwire.models import MODELS

    cfg = config_mod.load(run_dir / "config.toml")
    model = build_model(cfg, load_data(cfg))
    entry = MODELS.get(cfg.model.name)
    adapter = entry.ist(model) if entry.ist is not None else None
    return model_spec_from_module(model, cfg.model.name, adapter=adapter), cfg


def testbed_cluster(rate_bps: float, workers: int, gflops: float, efficiency: float = 1.0):
    """Step 3: the testbed's workers and one link rate as a planner cluster."""
    cpu = load_cluster("cpu-1gbe")
    return dataclasses.replace(
        cpu, name=f"testbed {rate_bps / 1e6:g} Mbit/s", nodes=workers, device_count=0,
        peak_flops=(("fp32", gflops * 1e9), ("bf16", gflops * 1e9)),
        inter_bandwidth=rate_bps / 8, inter_efficiency=FRAME_EFFICIENCY, inter_latency=0.0,
        compute_efficiency=efficiency)


def fit_efficiency(model, cluster, base: StrategySpec, measured_compute: float) -> float:
    """Step 3: compute_efficiency so that the planner's data-parallel compute (+ optimizer)
    equals the measured compute per step (kernel times are divided by it)."""
    bd = predict(model, cluster, base).breakdown
    return min(1.0, (bd.compute + bd.optimizer) / measured_compute)


def compute_per_step(runs) -> tuple[str, float]:
    """Step 3: (spec, mean compute seconds a step) of the replicated method whose runs spend
    the largest share of their wall time computing."""
    from thinwire.planner.methods import partitioned, resolve

    by_spec: dict[str, list] = {}
    for r in runs:
        spec = curve_of(r.path).spec
        if not partitioned(resolve(spec)):
            by_spec.setdefault(spec, []).append(r)
    share = {k: sum(float(r.summary["compute_s"]) / float(r.summary["wall_s"]) for r in rs)
             / len(rs) for k, rs in by_spec.items()}
    best = max(share, key=lambda k: share[k])
    rs = by_spec[best]
    return best, sum(float(r.summary["compute_s"]) / int(r.summary["steps"]) for r in rs) / len(rs)


def holdings(folder: Path, targets: list[float], gflops: float) -> str:
    dirs = run_dirs([folder])
    conv = fit([curve_of(d) for d in dirs], targets)
    runs = {d: load_run(d) for d in dirs}
    notes: list[str] = []
    links = sorted({d.parent.name for d in dirs}, key=lambda s: float(s.rstrip("mbitg"))
                   * (1000 if s.endswith("gbit") else 1))
    model, cfg = counted(dirs[0])
    workers = cfg.runtime.workers
    base = StrategySpec(dp=workers, micro_batch_size=cfg.train.batch_size, dtype="fp32",
                        optimizer="adam" if cfg.train.optimizer.startswith("adam") else "sgd")
    spec, measured_compute = compute_per_step(list(runs.values()))
    eff = fit_efficiency(model, testbed_cluster(1e9, workers, gflops), base, measured_compute)
    lines = [f"**{conv.family} on {conv.dataset}** ({workers} workers, batch "
             f"{cfg.train.batch_size} per worker; compute_efficiency {eff:.3f} from {spec}'s "
             f"measured {1e3 * measured_compute:.1f} ms of compute a step)", ""]
    agree = total = 0
    for link in links:
        rate = float(link.rstrip("mbitg")) * (1e9 if link.endswith("gbit") else 1e6)
        cluster = testbed_cluster(rate, workers, gflops, eff)
        p = priced(model, cluster, base, conv)
        if total == 0:
            lines += ["| link | target | " + " | ".join(
                f"{p.labels[k]} steps, s predicted / measured" for k in p.variants)
                + " | predicted winner | measured winner | agree |",
                "|---|---:|" + "---:|" * len(p.variants) + "---|---|---|"]
        here = {curve_of(d).spec: runs[d] for d in dirs if d.parent.name == link}
        for t in conv.targets:
            pred = times_at(model, cluster, p, conv, t, cluster.inter_bandwidth)
            meas: dict[str, float | None] = {}
            for k, run in here.items():
                hit = time_to_target(run, t)
                meas[k] = None if hit is None else float(hit["wall_s"])
            pw, mw = winner(pred), winner(meas)
            total += 1
            agree += pw == mw
            cells = [f"{_fmt(conv.steps(k, t), '.0f')}: {_fmt(pred.get(k), '.1f')} / "
                     f"{_fmt(meas.get(k), '.1f')}" if conv.steps(k, t) is not None
                     else "does not reach" for k in p.variants]
            lines.append(f"| {link} | {t:g} | " + " | ".join(cells) + " | "
                         f"{p.labels[pw] if pw else 'none'} | "
                         f"{p.labels.get(mw, mw) if mw else 'none'} | "
                         f"{'yes' if pw == mw else 'NO'} |")
        step = {p.labels[k]: step_at(model, cluster, s, cluster.inter_bandwidth)
                for k, s in p.variants.items()}
        notes.append(f"planner step at {link}: " + ", ".join(
            f"{k} {v * 1e3:.1f} ms" for k, v in step.items()))
    lines += ["", f"predicted winner = measured winner in {agree} of {total} (link, target) "
              "pairs; " + "; ".join(notes)]
    return "\n".join(lines)


def _fmt(x: float | None, spec: str) -> str:
    return "does not reach" if x is None else format(x, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", help="thinwire bench output folders")
    ap.add_argument("--target", action="append", default=[],
                    help="FOLDER=T1,T2 targets for one folder (default: the fit's own)")
    ap.add_argument("--gflops", type=float, default=50.0,
                    help="a worker's peak GFLOP/s before the per-folder efficiency (default 50)")
    args = ap.parse_args()
    chosen = {}
    for item in args.target:
        name, _, values = item.partition("=")
        chosen[Path(name)] = [float(v) for v in values.split(",") if v]
    out = []
    for folder in map(Path, args.folders):
        out.append(holdings(folder, chosen.get(folder, []), args.gflops))
    print(f"Command: python {' '.join(sys.argv)}\n")
    print("\n\n".join(out))
    return 0 if all(math.isfinite(args.gflops) for _ in [0]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

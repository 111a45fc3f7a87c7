"""The pipeline's boundary codecs on the thin-wire testbed, and the planner's pipeline step time
held to the measured one.

    python benchmarks/pipeline_thin_wire.py --link 100mbit \\
        --data-dir ../shared/data/tinyshakespeare --out runs/pipe_tb --timeout 700

A character-level GPT (4 blocks, d_model 64, 4 heads, context 64) on tiny-shakespeare, 4 workers
in network namespaces joined by tc-shaped links (:mod:`thinwire.testbed`): the pipeline runs 4
stages x 1 replica, 1F1B, 4 micro-batches of 8 windows (batch 32); data parallelism runs 4
replicas of 8 windows (the same 32 a step). AdamW lr 3e-3, the same seed and steps for every run,
perplexity on the first 1024 validation windows every ``--eval-every`` steps.

For every run it prints the validation curve, ledger bytes, the kernel's wire bytes, the median
measured step time (rank 0's ``step_s``, steps after the third; with ``--repeats R`` the median of
R runs' medians, their range beside it) and the planner's prediction,
from inputs measured here just before the run, one thread a process (as each worker has):

1. each stage's forward and backward pass of one micro-batch and its optimizer step, the real
   :class:`~thinwire.strategies.pipeline.schedule.Pipeline` of the run's codecs on a
   communicator that moves nothing (its pass timings), the median of ``--reps`` steps; the
   codecs' encoding and decoding, and any bottleneck's layers, are inside those passes;
2. each stage's CPU seconds a step when the S stages run the method together over loopback
   (30 steps): the passes are scaled up to it, what they cost beside the isolated ones
   (gloo's copies and threads, a wake-up for every message, caches shared with the others);
3. :func:`thinwire.planner.pipeline.simulate` with those passes, the link's rate times the
   TCP payload per frame (:data:`thinwire.testbed.modelled.FRAME_EFFICIENCY`) as each stage's
   upload and download, behind tc's token bucket (:func:`thinwire.testbed.netns.burst_bytes`),
   no latency, and ``os.cpu_count()`` cores shared by the stages; a transfer starts when its
   receiver waits for it (gloo's rendezvous) and the receiver's upload is idle (its TCP
   acknowledgements queue behind its outgoing data in tbf's FIFO). Over loopback: no bucket,
   no queued acknowledgements. Beside
   it, the same simulation with the isolated passes and the closed form
   (:func:`~thinwire.planner.pipeline.step_time`, its ``cores`` floor) with them.

Writes OUT/pipeline_thin_wire.md and OUT/pipeline_thin_wire.json. Needs root (namespaces);
bounded by ``--timeout`` seconds for all runs of one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from thinwire.config import Config, load
from thinwire.report.tables import fmt_bytes

RUNS: dict[str, dict[str, str]] = {
    "dp": {"method.name": "dp", "parallel.pp": "1"},  # batch 32 / workers a replica
    "none": {},
    "int8": {"method.codec_fwd": "int8", "method.codec_bwd": "int8"},
    "int4": {"method.codec_fwd": "int4", "method.codec_bwd": "int4"},
    "topk": {"method.codec_fwd": "topk:ratio=0.1"},
    "topk_ef": {"method.codec_fwd": "topk:ratio=0.1,ef=true"},
    "topk_b0": {"method.overrides": "0@topk:ratio=0.1|none"},
    "topk_b2": {"method.overrides": "2@topk:ratio=0.1|none"},
    "ae16": {"method.codec_fwd": "ae:dim=16"},
    "lowrank": {"method.codec_bwd": "lowrank:rank=8"},
}
LABELS = {
    "dp": "dp (S replicas x 32/S)", "none": "pipeline, uncompressed", "int8": "fwd + bwd int8",
    "int4": "fwd + bwd int4", "topk": "fwd top-10%", "topk_ef": "fwd top-10% + EF",
    "topk_b0": "fwd top-10% at boundary 0 only", "topk_b2": "fwd top-10% at boundary 2 only",
    "ae16": "fwd autoencoder k=16", "lowrank": "bwd low rank 8 (LEP)",
}


def config(name: str, args: argparse.Namespace, out: Path) -> Config:
    values = {"model.name": "gpt", "model.n_layer": "4", "model.d_model": "64",
              "model.n_head": "4", "data.name": "tinyshakespeare", "data.limit_test": "1024",
              "runtime.workers": str(args.stages), "runtime.threads": "1", "train.steps": str(args.steps),
              "train.eval_every": str(args.eval_every), "train.log_every": "1",
              "train.batch_size": "32", "train.lr": "0.003", "train.optimizer": "adamw",
              "run.out": str(out), "run.progress": "false", "run.name": name,
              "method.name": "pipeline", "parallel.pp": str(args.stages),
              "method.schedule": "1f1b", "method.micro_batches": str(args.micro_batches)}
    if args.data_dir:
        values["data.dir"] = args.data_dir
    if RUNS[name].get("method.name", "pipeline") != "pipeline":
        values = {k: v for k, v in values.items() if not k.startswith("method.")}
        values["train.batch_size"] = str(32 // args.stages)
    values.update(RUNS[name])
    return load(None, values)


# --- calibration (steps 1 and 2) -------------------------------------------------------------------
def calibrate(cfg: Config, reps: int) -> dict[str, Any]:
    """Step 1: each stage's real passes and optimizer step, on a communicator that moves
    nothing (:class:`thinwire.measure.local.Silent`), one thread, the median of ``reps`` steps."""
    from thinwire.builders import build_model, load_data
    from thinwire.data.task import task_for
    from thinwire.measure.local import Silent
    from thinwire.models import MODELS
    from thinwire.strategies.base import make_optimizer
    from thinwire.strategies.pipeline.schedule import Pipeline

    torch.set_num_threads(1)
    ds = load_data(cfg)
    model = build_model(cfg, ds)
    make_chain = MODELS.get(cfg.model.name).chain
    assert make_chain is not None
    chain = make_chain(model)
    o = cfg.method.options
    S, M = cfg.parallel.pp, o.micro_batches
    x, y = ds.x_train[:cfg.train.batch_size], ds.y_train[:cfg.train.batch_size]
    fwd, bwd, opt_s, sizes = [], [], [], []
    pipe = None
    for s in range(S):
        pipe = Pipeline(chain, Silent(s, S), micro_batches=M, loss=task_for(ds).loss,
                        example=x.chunk(M)[0], schedule=o.schedule, boundaries=o.boundaries(),
                        seed=cfg.train.seed)
        opt = make_optimizer(pipe.parameters(), cfg.train)
        sizes.append(sum(p.numel() for p in pipe.parameters()))
        f, g, t = [], [], []
        for step in range(reps + 2):
            opt.zero_grad(set_to_none=True)
            pipe.run(x, y, step)
            t0 = time.perf_counter()
            opt.step()
            if step >= 2:  # two warm-up steps
                t.append(time.perf_counter() - t0)
                f.append(statistics.mean(sec for k, _, sec in pipe.passes if k == "F"))
                g.append(statistics.mean(sec for k, _, sec in pipe.passes if k == "B"))
        fwd.append(statistics.median(f))
        bwd.append(statistics.median(g))
        opt_s.append(statistics.median(t))
    assert pipe is not None
    return {"forward_s": fwd, "backward_s": bwd, "optimizer_s": opt_s, "stage_params": sizes,
            "boundary": (x.shape[0] // M, *pipe.widths[0]), "loopback_cpu": loopback_cpu(cfg)}


def _loopback_worker(comm: Any, cfg: Config, steps: int) -> float:
    """This stage's CPU seconds (all its threads, user and system) a step of the real method."""
    from thinwire.builders import build_mesh, build_model, build_strategy, load_data
    from thinwire.data.task import task_for

    ds = load_data(cfg)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, ds)
    cpu_dev = torch.device("cpu")
    strategy = build_strategy(cfg, comm, cpu_dev, task_for(ds), model,
                              build_mesh(cfg, comm, cpu_dev))
    x, y = ds.x_train[:cfg.train.batch_size], ds.y_train[:cfg.train.batch_size]
    cpu = []
    for step in range(steps + 3):
        c0 = time.process_time()
        strategy.train_step((x, y), step)
        if step >= 3:  # three warm-up steps
            cpu.append(time.process_time() - c0)
    strategy.close()
    return statistics.median(cpu)


def loopback_cpu(cfg: Config, steps: int = 30) -> list[float]:
    """Step 2: each stage's CPU seconds a step when the S stages really run together, over
    loopback on this machine: what the stage's passes cost beside the isolated ones (receiving
    and sending through gloo, waking on every message, caches shared with the other stages)."""
    from thinwire.runtime.spawn import run_group

    return list(run_group(_loopback_worker, cfg.parallel.pp, cfg, steps, timeout=300, threads=1))


def predict(cfg: Config, cal: dict[str, Any], link_bps: float, shaped: bool = True
            ) -> dict[str, float]:
    """The planner's step time of the run (module docstring, step 3): the simulation with the
    stages' passes at their loopback CPU (the prediction), the same with the isolated passes,
    and the closed form with the isolated passes."""
    from thinwire.planner.pipeline import PipelineShape, simulate, step_time
    from thinwire.testbed.modelled import FRAME_EFFICIENCY
    from thinwire.testbed.netns import burst_bytes

    o = cfg.method.options
    M = o.micro_batches
    mb, seq, width = cal["boundary"]
    shape = PipelineShape(cfg.parallel.pp, M, mb, seq, width)
    cores = os.cpu_count() or 1
    goodput = link_bps / 8 * FRAME_EFFICIENCY  # TCP payload bytes a second
    f, b, opt = cal["forward_s"], cal["backward_s"], cal["optimizer_s"]
    scale = [max(1.0, (c - t) / (M * (fs + bs)))
             for c, t, fs, bs in zip(cal["loopback_cpu"], opt, f, b)]
    # tc's token bucket, in payload bytes (none over loopback)
    burst = burst_bytes(link_bps / 8) * FRAME_EFFICIENCY if shaped else 0.0
    # gloo's sends wait for their receive; tbf's FIFO queues a stage's ACKs behind its data
    link: dict[str, Any] = {"bandwidth": goodput, "burst": burst, "rendezvous": True,
                            "acks_queue": shaped}
    sim = simulate(shape, o, [x * k for x, k in zip(f, scale)], [x * k for x, k in zip(b, scale)],
                   optimizer_seconds=opt, cores=cores, **link)
    alone = simulate(shape, o, f, b, optimizer_seconds=opt, cores=cores, **link)
    closed = step_time(shape, o, [x + y for x, y in zip(f, b)], bandwidth=goodput,
                       optimizer_seconds=max(opt), cores=cores)
    return {"total": sim.total, "isolated": alone.total, "closed": closed.total,
            "work": sim.work, "work_isolated": alone.work}


# --- the runs ------------------------------------------------------------------------------------
def measured_step(run: Any) -> float:
    """Median of rank 0's step seconds after the third step."""
    steps = [float(r["step_s"]) for r in run.trains if int(r["step"]) > 3]
    return statistics.median(steps) if steps else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link", default="100mbit", help="link rates, e.g. 100mbit,1gbit")
    p.add_argument("--runs", default=",".join(RUNS), help=f"subset of {', '.join(RUNS)}")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--reps", type=int, default=20, help="repetitions of each calibration timing")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each configuration; the measured step is their median")
    p.add_argument("--data-dir", default="")
    p.add_argument("--out", default="runs/pipeline_thin_wire")
    p.add_argument("--timeout", type=float, default=700.0, help="seconds for all runs")
    p.add_argument("--modelled", action="store_true", help="no namespaces: loopback, modelled")
    p.add_argument("--loopback-bps", type=float, default=1e10,
                   help="--modelled: the loopback's bit rate the prediction assumes")
    p.add_argument("--check", action="store_true",
                   help="build the configs, calibrate and predict, run nothing")
    args = p.parse_args(argv)

    import thinwire.testbed.bench as bench
    from thinwire.testbed.netns import unavailable_reason
    from thinwire.testbed.rates import parse_links

    if args.repeats < 1:
        print(f"--repeats: got {args.repeats}; use 1 or more", file=sys.stderr)
        return 2
    names = [n for n in args.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        print(f"--runs: unknown {', '.join(unknown)}; use {', '.join(RUNS)}", file=sys.stderr)
        return 2
    links = parse_links(args.link, "0")
    reason = None if args.modelled else unavailable_reason()
    modelled = args.modelled or reason is not None
    if reason:
        print(f"no network namespaces ({reason}); modelled mode", flush=True)
    out = Path(args.out)
    load_start = os.getloadavg()
    groups = ["modelled"] if modelled else [lk.label for lk in links]
    cfgs = {g: [config(n, args, out / g) for n in names] for g in groups}
    first_pipe = next((c for c in cfgs[groups[0]] if c.method.name == "pipeline"), None)
    cal = calibrate(first_pipe, args.reps) if first_pipe is not None else None
    if cal is not None:
        print(f"calibration (1 thread): stage F, B s/micro-batch "
              f"{[round(v, 4) for v in cal['forward_s']]}, "
              f"{[round(v, 4) for v in cal['backward_s']]}, optimizer "
              f"{[round(v, 4) for v in cal['optimizer_s']]} s, CPU a step over loopback "
              f"{[round(v, 4) for v in cal['loopback_cpu']]} s, "
              f"boundary {cal['boundary']}", flush=True)
    if args.check:
        for c in cfgs[groups[0]]:
            if cal is not None and c.method.name == "pipeline":
                for lk in links:
                    t = predict(c, cal, lk.rate_bps or 1e12)
                    print(f"{c.run_name} {lk.label}: predicted {t['total']:.3f} s/step "
                          f"(isolated passes {t['isolated']:.3f}, closed form {t['closed']:.3f}; "
                          f"CPU work {t['work']:.3f} s, isolated {t['work_isolated']:.3f} s)")
        return 0
    if modelled:  # one loopback run each: no link to model
        links = links[:1]
    # each pipeline run predicted from a calibration just before it (the machine's load drifts)
    deadline = time.monotonic() + args.timeout
    results, stopped, preds, cals = [], "", {}, {}
    steps_of: dict[tuple[str, str], list[float]] = {}  # the repeats' measured steps
    for g in groups:
        here = links if modelled else [lk for lk in links if lk.label == g]
        for c in cfgs[g]:
            if stopped:
                break
            bps = args.loopback_bps if modelled else here[0].rate_bps
            if c.method.name == "pipeline" and bps:
                cals[(g, c.run_name)] = calibrate(c, args.reps)
                preds[(g, c.run_name)] = predict(c, cals[(g, c.run_name)], bps,
                                                 shaped=not modelled)
                print(f"{c.run_name}: predicted {preds[(g, c.run_name)]['total']:.3f} s/step",
                      flush=True)
            done, stopped = bench.run_all({g: [c]}, here, deadline, modelled=modelled)
            for k in range(1, args.repeats):  # the same run again, in its own directory
                if stopped or not done:
                    break
                again = config(c.run_name, args, out / g / f"repeat{k}")
                more, stopped = bench.run_all({g: [again]}, here, deadline, modelled=modelled)
                steps_of[(g, c.run_name)] = [*steps_of.get((g, c.run_name), []),
                                             *(measured_step(r.run) for r in more)]
            results += [(g, r) for r in done]
    load_end = os.getloadavg()
    rows = []
    for g, res in results:
        name = res.run.path.name
        pred = preds.get((g, name))
        b = res.run.summary["bytes"]
        runs = [measured_step(res.run), *steps_of.get((g, name), [])]
        rows.append({
            "link": "loopback" if modelled else res.link.label, "run": name, "label": LABELS[name],
            "curve": [(int(e["step"]), float(e["perplexity"])) for e in res.run.evals],
            "final_ppl": float(res.run.summary["final"]["perplexity"]),
            "final_nll": float(res.run.summary["final"]["nll"]),
            "sent_mean": b["sent_per_worker_mean"], "sent_max": b["sent_per_worker_max"],
            "wire_tx": res.wire.measured_total if res.wire is not None else None,
            "train_wall_s": res.wall_s, "step_s": statistics.median(runs), "step_runs": runs,
            "predicted": pred})
    text = table(rows, args, load_start, load_end)
    if stopped:
        text += f"\nstopped early: {stopped}\n"
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline_thin_wire.md").write_text(text)
    (out / "pipeline_thin_wire.json").write_text(json.dumps(
        {"argv": sys.argv, "load_start": load_start, "load_end": load_end,
         "calibration": {f"{g}/{n}": v for (g, n), v in cals.items()},
         "rows": rows}, indent=1))
    return 1 if stopped else 0


def table(rows: list[dict[str, Any]], args: argparse.Namespace, l0: tuple[float, ...],
          l1: tuple[float, ...]) -> str:
    steps = sorted({s for r in rows for s, _ in r["curve"]})
    head = ["link", "run", *[f"ppl@{s}" for s in steps], "sent/worker mean", "max",
            "wire tx (all)", "step s measured", "step s simulated", "sim/meas",
            "closed form s", "closed/meas", "CPU work s (all stages)", "step vs pipeline"]
    lines = [f"load average at start {l0[0]:.2f} {l0[1]:.2f} {l0[2]:.2f}, at end "
             f"{l1[0]:.2f} {l1[1]:.2f} {l1[2]:.2f}; {os.cpu_count()} cores; "
             f"{args.steps} steps, M={args.micro_batches}, S={args.stages}"
             + (f"; {args.repeats} runs of each, the median step" if args.repeats > 1 else ""),
             "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = {r["link"]: r["step_s"] for r in rows if r["run"] == "none"}
    for r in rows:
        curve = dict(r["curve"])
        p = r["predicted"]
        pred = [f"{p['total']:.3f}", f"{p['total'] / r['step_s']:.2f}", f"{p['closed']:.3f}",
                f"{p['closed'] / r['step_s']:.2f}", f"{p['work']:.3f}"] if p else ["-"] * 5
        rel = (f"{r['step_s'] / base[r['link']]:.2f}x" if r["link"] in base else "-")
        lines.append("| " + " | ".join([
            r["link"], r["label"], *[f"{curve[s]:.2f}" if s in curve else "-" for s in steps],
            fmt_bytes(r["sent_mean"]), fmt_bytes(r["sent_max"]),
            fmt_bytes(r["wire_tx"]) if r["wire_tx"] is not None else "-",
            f"{r['step_s']:.3f}" + (f" ({min(r['step_runs']):.3f}-{max(r['step_runs']):.3f})"
                                    if len(r["step_runs"]) > 1 else ""), *pred, rel]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

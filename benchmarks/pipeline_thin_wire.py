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
measured step time (rank 0's ``step_s``, steps after the third) and the planner's prediction
(:func:`thinwire.planner.pipeline.step_time`) from inputs measured here, in this process, with
one thread (as each worker has):

1. the forward and backward seconds of each stage's links for one micro-batch (the last stage
   with the loss), the median of ``--reps`` repetitions;
2. each codec's encoding and decoding seconds of one boundary message, the same way;
3. the optimizer step of the largest stage;
4. the link's rate as the bandwidth, no latency; the workers share ``os.cpu_count()`` cores
   (the planner's ``cores`` floor).

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


# --- calibration (steps 1-3) ---------------------------------------------------------------------
def _median_seconds(fn: Any, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate(cfg: Config, reps: int) -> dict[str, Any]:
    """Steps 1 and 3: per-stage forward + backward seconds of one micro-batch, optimizer step."""
    from thinwire.models import MODELS
    from thinwire.run import build_model, load_data
    from thinwire.strategies.pipeline.schedule import cut

    torch.set_num_threads(1)
    ds = load_data(cfg)
    model = build_model(cfg, ds)
    make_chain = MODELS.get(cfg.model.name).chain
    assert make_chain is not None
    chain = make_chain(model)
    o = cfg.method.options
    mb = cfg.train.batch_size // o.micro_batches
    x, y = ds.x_train[:mb], ds.y_train[:mb]
    cuts = cut(len(chain), cfg.parallel.pp)
    stage_s, h = [], x
    boundary: tuple[int, ...] | None = None
    sizes = []
    for s, (a, b) in enumerate(cuts):
        stage = torch.nn.Sequential(*chain[a:b])
        sizes.append(sum(p.numel() for p in stage.parameters()))
        inp = h.detach()

        def fb(stage: torch.nn.Module = stage, inp: torch.Tensor = inp, last: bool = s == len(cuts) - 1
               ) -> None:
            i = inp.clone().requires_grad_(inp.is_floating_point())
            out = stage(i)
            if last:
                torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                                  y.reshape(-1)).backward()
            else:
                out.backward(torch.ones_like(out) * 1e-3)
            stage.zero_grad(set_to_none=True)

        stage_s.append(_median_seconds(fb, reps))
        with torch.no_grad():
            h = stage(inp)
        if s == 0:
            boundary = (mb, *h.shape[1:])
    big = torch.nn.Sequential(*chain[cuts[sizes.index(max(sizes))][0]:
                                     cuts[sizes.index(max(sizes))][1]])
    opt = torch.optim.AdamW(big.parameters(), lr=1e-3)
    for p in big.parameters():
        p.grad = torch.zeros_like(p)
    opt_s = _median_seconds(opt.step, reps)
    return {"stage_s": stage_s, "optimizer_s": opt_s, "stage_params": sizes,
            "boundary": boundary,
            "seq": int(x.shape[1])}


def codec_seconds(cfg: Config, shape: tuple[int, ...], reps: int) -> list[float]:
    """Step 2: per stage, encoding and decoding seconds of its messages for one micro-batch."""
    from thinwire.compression.base import from_bytes, to_bytes
    from thinwire.strategies.pipeline.codecs import Key, build_boundary, is_bottleneck

    o = cfg.method.options
    S = cfg.parallel.pp
    bounds = o.boundaries()
    x = torch.randn(shape)
    ids = torch.arange(shape[0], dtype=torch.int64)

    def cost(spec: str) -> tuple[float, float]:
        if spec == "none" or is_bottleneck(spec):
            return 0.0, 0.0
        codec = build_boundary(spec)
        key = Key(0, 0, ids)
        enc = _median_seconds(lambda: to_bytes(codec.encode(x, key)), reps)
        payload = from_bytes(to_bytes(codec.encode(x, key)), codec.spec(shape))
        other = build_boundary(spec)
        dec = _median_seconds(lambda: other.decode(payload, shape, key), reps)
        return enc, dec

    per_b = []
    for b in range(S - 1):
        f, g = bounds.specs(b)
        per_b.append((cost(f), cost(g)))
    out = []
    for s in range(S):
        t = 0.0
        if s < S - 1:  # encode the activation, decode its gradient
            t += per_b[s][0][0] + per_b[s][1][1]
        if s > 0:  # decode the activation, encode its gradient
            t += per_b[s - 1][0][1] + per_b[s - 1][1][0]
        out.append(t)
    return out


def predict(cfg: Config, cal: dict[str, Any], link_bps: float, reps: int) -> dict[str, float]:
    """The planner's step time of the run (module docstring, step 4)."""
    from thinwire.planner.pipeline import PipelineShape, step_time

    o = cfg.method.options
    mb, seq, width = cal["boundary"]
    shape = PipelineShape(cfg.parallel.pp, o.micro_batches, mb, seq, width)
    codec = codec_seconds(cfg, tuple(cal["boundary"]), reps)
    t = step_time(shape, o, cal["stage_s"], bandwidth=link_bps / 8, codec_seconds=codec,
                  optimizer_seconds=cal["optimizer_s"], cores=os.cpu_count() or 1)
    return t.as_dict()


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
    p.add_argument("--data-dir", default="")
    p.add_argument("--out", default="runs/pipeline_thin_wire")
    p.add_argument("--timeout", type=float, default=700.0, help="seconds for all runs")
    p.add_argument("--modelled", action="store_true", help="no namespaces: loopback, modelled")
    p.add_argument("--loopback-bps", type=float, default=1e10,
                   help="--modelled: the loopback's bit rate the prediction assumes")
    p.add_argument("--check", action="store_true",
                   help="build the configs, calibrate and predict, run nothing")
    args = p.parse_args(argv)

    from thinwire.testbed import bench
    from thinwire.testbed.netns import unavailable_reason
    from thinwire.testbed.rates import parse_links

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
        print(f"calibration (1 thread): stage F+B s/micro-batch "
              f"{[round(v, 4) for v in cal['stage_s']]}, optimizer {cal['optimizer_s']:.4f} s, "
              f"boundary {cal['boundary']}", flush=True)
    if args.check:
        for c in cfgs[groups[0]]:
            if cal is not None and c.method.name == "pipeline":
                for lk in links:
                    t = predict(c, cal, lk.rate_bps or 1e12, args.reps)
                    print(f"{c.run_name} {lk.label}: predicted {t['total']:.3f} s/step "
                          f"(slot {t['slot']:.4f}, bubble {t['bubble']:.3f}, floor {t['floor']:.3f})")
        return 0
    if modelled:  # one loopback run each: no link to model
        links = links[:1]
    # each pipeline run predicted from a calibration just before it (the machine's load drifts)
    deadline = time.monotonic() + args.timeout
    results, stopped, preds, cals = [], "", {}, {}
    for g in groups:
        here = links if modelled else [lk for lk in links if lk.label == g]
        for c in cfgs[g]:
            if stopped:
                break
            bps = args.loopback_bps if modelled else here[0].rate_bps
            if c.method.name == "pipeline" and bps:
                cals[(g, c.run_name)] = calibrate(c, args.reps)
                preds[(g, c.run_name)] = predict(c, cals[(g, c.run_name)], bps, args.reps)
                print(f"{c.run_name}: predicted {preds[(g, c.run_name)]['total']:.3f} s/step",
                      flush=True)
            done, stopped = bench.run_all({g: [c]}, here, deadline, modelled=modelled)
            results += [(g, r) for r in done]
    load_end = os.getloadavg()
    rows = []
    for g, res in results:
        name = res.run.path.name
        pred = preds.get((g, name))
        b = res.run.summary["bytes"]
        rows.append({
            "link": "loopback" if modelled else res.link.label, "run": name, "label": LABELS[name],
            "curve": [(int(e["step"]), float(e["perplexity"])) for e in res.run.evals],
            "final_ppl": float(res.run.summary["final"]["perplexity"]),
            "final_nll": float(res.run.summary["final"]["nll"]),
            "sent_mean": b["sent_per_worker_mean"], "sent_max": b["sent_per_worker_max"],
            "wire_tx": res.wire.measured_total if res.wire is not None else None,
            "train_wall_s": res.wall_s, "step_s": measured_step(res.run), "predicted": pred})
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
            "wire tx (all)", "step s measured", "step s predicted", "pred/meas",
            "slot: compute+codec+transfer s", "step vs pipeline"]
    lines = [f"load average at start {l0[0]:.2f} {l0[1]:.2f} {l0[2]:.2f}, at end "
             f"{l1[0]:.2f} {l1[1]:.2f} {l1[2]:.2f}; {os.cpu_count()} cores; "
             f"{args.steps} steps, M={args.micro_batches}, S={args.stages}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = {r["link"]: r["step_s"] for r in rows if r["run"] == "none"}
    for r in rows:
        curve = dict(r["curve"])
        p = r["predicted"]
        ratio = f"{p['total'] / r['step_s']:.2f}" if p else "-"
        slot = (f"{p['compute']:.3f}+{p['codec']:.3f}+{p['transfer']:.3f}"
                + (" (cores floor)" if p["floor"] > p["schedule"] else "")) if p else "-"
        rel = (f"{r['step_s'] / base[r['link']]:.2f}x" if r["link"] in base else "-")
        lines.append("| " + " | ".join([
            r["link"], r["label"], *[f"{curve[s]:.2f}" if s in curve else "-" for s in steps],
            fmt_bytes(r["sent_mean"]), fmt_bytes(r["sent_max"]),
            fmt_bytes(r["wire_tx"]) if r["wire_tx"] is not None else "-",
            f"{r['step_s']:.3f}", f"{p['total']:.3f}" if p else "-", ratio, slot, rel]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

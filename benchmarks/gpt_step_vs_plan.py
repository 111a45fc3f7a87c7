"""One GPT size: the measured step time and peak memory of a training step against
``thinwire plan``'s prediction for the same model, batch, dtype and device.

    python benchmarks/gpt_step_vs_plan.py --device cuda [--cluster h200] [--layers 4]
        [--d-model 256] [--heads 4] [--seq 256] [--batch 32] [--steps 20] [--warmup 5]

Steps: 1. the model as the planner reads it (a transformer TOML: layers, hidden, heads, seq,
vocab of tiny-shakespeare) is priced by ``thinwire plan --json`` on one device of ``--cluster``
in fp32 with Adam (what thinwire's GPT trains in); 2. thinwire's GPT of those dimensions is
trained on ``--device`` through the dp strategy on one rank (``Comm.local`` on that device:
the device rule holds); after ``--warmup`` steps the allocator's peak is reset and ``--steps``
steps are timed, synchronised around each; 3. a table: step seconds (median), the allocator's
peak against the plan's total, the model states (parameters + gradients + optimizer, measured
from the tensors) and the saved activations (measured by the strategy's memory report) against
the plan's, each with measured / planned.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def plan(args: argparse.Namespace, vocab: int) -> dict:
    """Step 1: ``thinwire plan --json`` for the model on one device of the cluster."""
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "gpt.toml"
        model.write_text(f'kind = "transformer"\nname = "gpt-check"\nlayers = {args.layers}\n'
                         f"hidden = {args.d_model}\nheads = {args.heads}\nseq = {args.seq}\n"
                         f"vocab = {vocab}\nglobal_batch = {args.batch}\n")
        out = subprocess.run(
            [sys.executable, "-m", "thinwire", "plan", "--model", str(model), "--cluster",
             args.cluster, "--devices", "1", "--micro-batch-size", str(args.batch),
             "--global-batch", str(args.batch), "--dtype", "fp32", "--optimizer", "adam",
             "--json"], capture_output=True, text=True, check=True).stdout
    return json.loads(out)  # type: ignore[no-any-return]


def measure(args: argparse.Namespace) -> dict:
    """Step 2: the GPT's training steps on the device."""
    from thinwire.builders import build_model, build_strategy, load_data, make_stream
    from thinwire.config import load
    from thinwire.data.task import task_for
    from thinwire.runtime.comm import Comm

    device = torch.device(args.device)
    cfg = load(None, {"model.name": "gpt", "data.name": "tinyshakespeare",
                      "data.seq_len": args.seq, "model.n_layer": args.layers,
                      "model.d_model": args.d_model, "model.n_head": args.heads,
                      "train.batch_size": args.batch, "train.optimizer": "adamw",
                      "train.steps": args.warmup + args.steps, "runtime.device": args.device,
                      **({"data.dir": args.data_dir} if args.data_dir else {})})
    ds = load_data(cfg)
    strategy = build_strategy(cfg, Comm.local(device=device), device, task_for(ds),
                              build_model(cfg, ds))
    stream = make_stream(cfg, ds, 0, 1)
    cuda = device.type == "cuda"
    times = []
    for step in range(args.warmup + args.steps):
        x, y = (t.to(device) for t in stream.batch(step))
        if step == args.warmup and cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        strategy.train_step((x, y), step)
        if cuda:
            torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    mem = strategy.memory()
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    strategy.close()
    return {"step_s": statistics.median(times), "peak": peak,
            "states": mem.params + mem.grads + mem.optimizer, "activations": mem.activations,
            "vocab": ds.num_classes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cluster", default="h200", help="the planner's cluster preset")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--data-dir", default="", help="folder holding tinyshakespeare/ "
                    "(default: the standard places)")
    args = ap.parse_args()
    got = measure(args)
    want = plan(args, int(got["vocab"]))
    mem, secs = want["memory_bytes"], want["step_seconds"]
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(f"# GPT {args.layers} x {args.d_model} ({args.heads} heads), seq {args.seq}, batch "
          f"{args.batch}, fp32 AdamW on {name}; plan: {args.cluster}, 1 device; "
          f"median of {args.steps} steps after {args.warmup}\n")
    print("| quantity | planned | measured | measured / planned |")
    print("|---|---:|---:|---:|")
    rows = [("step s", secs["total"], got["step_s"]),
            ("peak MiB (allocator)", mem["total"] / 2**20, got["peak"] / 2**20),
            ("model states MiB", (mem["weights"] + mem["gradients"] + mem["optimizer"]) / 2**20,
             got["states"] / 2**20),
            ("activations MiB (+ logits)", (mem["activations"] + mem["logits"]) / 2**20,
             got["activations"] / 2**20)]
    for label, p, m in rows:
        ratio = f"{m / p:.2f}" if p and m else "-"
        print(f"| {label} | {p:.4g} | {m:.4g} | {ratio} |")


if __name__ == "__main__":
    main()

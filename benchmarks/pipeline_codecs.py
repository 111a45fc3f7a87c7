"""Every boundary codec of the pipeline method on one GPT, against the uncompressed pipeline and
data parallelism of the same model and global batch.

    python benchmarks/pipeline_codecs.py                  # the table of docs/benchmarks/pipeline.md
    python benchmarks/pipeline_codecs.py --steps 40       # a quick look

A character-level GPT (4 blocks, d_model 64, 4 heads, context 64) on tiny-shakespeare, 4
workers: the pipeline runs 4 stages x 1 replica, 1F1B with 4 micro-batches of 8 windows (batch
32); data parallelism runs 4 replicas of batch 8 (the same 32 windows a step). AdamW, lr 3e-3,
the same seed and steps for every run. Each row: the perplexity and NLL on the first 4096
validation windows at the end,
bytes sent per worker (mean and max, from the ledger: point-to-point bytes exact, DP's ring
all-reduce estimated), the activation payload of one boundary message forward and backward, and
wall time (a loaded 2-core machine: not comparable between rows). ``--reuse`` takes finished runs
of identical configs from ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from thinwire.config import load, to_dict
from thinwire.report.tables import fmt_bytes
from thinwire.run import run_config

RUNS: list[tuple[str, dict[str, str]]] = [
    ("dp (4 replicas)", {"method.name": "dp"}),
    ("pipeline, uncompressed", {}),
    ("fwd int8", {"method.codec_fwd": "int8"}),
    ("fwd int4", {"method.codec_fwd": "int4"}),
    ("fwd int4, first boundary plain", {"method.codec_fwd": "int4",
                                        "method.uncompressed_first": "1"}),
    ("fwd + bwd int8", {"method.codec_fwd": "int8", "method.codec_bwd": "int8"}),
    ("fwd + bwd int4", {"method.codec_fwd": "int4", "method.codec_bwd": "int4"}),
    ("fwd top-10%", {"method.codec_fwd": "topk:ratio=0.1"}),
    ("fwd top-10% + EF", {"method.codec_fwd": "topk:ratio=0.1,ef=true"}),
    ("fwd rand-10% (scaled)", {"method.codec_fwd": "randk:ratio=0.1"}),
    ("fwd rand-10% + EF", {"method.codec_fwd": "randk:ratio=0.1,ef=true"}),
    ("bwd top-10%", {"method.codec_bwd": "topk:ratio=0.1"}),
    ("bwd low rank 8 (LEP)", {"method.codec_bwd": "lowrank:rank=8"}),
    ("bwd low rank 8, no LEP", {"method.codec_bwd": "lowrank:rank=8,lep=false"}),
    ("bwd low rank 8, cool-down only", {"method.codec_bwd": "lowrank:rank=8",
                                        "method.epilogue_only": "true"}),
    ("fwd AQ-SGD 4-bit", {"method.codec_fwd": "aqsgd:bits=4"}),
    ("fwd autoencoder k=16", {"method.codec_fwd": "ae:dim=16"}),
    ("fwd subspace k=16", {"method.codec_fwd": "subspace:dim=16"}),
    ("Optimus-CC-like: fwd int8, bwd low rank 8", {"method.codec_fwd": "int8",
                                                   "method.codec_bwd": "lowrank:rank=8"}),
    # AQ-SGD pays off once samples come back: 256 training windows, 7.5 epochs in 60 steps
    ("256 windows: uncompressed", {"data.limit_train": "256"}),
    ("256 windows: fwd int4", {"method.codec_fwd": "int4", "data.limit_train": "256"}),
    ("256 windows: fwd AQ-SGD 4-bit", {"method.codec_fwd": "aqsgd:bits=4",
                                       "data.limit_train": "256"}),
]


def config(name: str, over: dict[str, str], args: argparse.Namespace) -> Any:
    dp = over.get("method.name") == "dp"
    values = {"model.name": "gpt", "model.n_layer": "4", "model.d_model": "64",
              "model.n_head": "4", "data.name": "tinyshakespeare", "data.limit_test": "4096",
              "runtime.workers": "4",
              "train.steps": str(args.steps), "train.eval_every": str(args.steps),
              "train.batch_size": "8" if dp else "32", "train.lr": "0.003",
              "train.optimizer": "adamw", "run.out": args.out, "run.progress": "false",
              "run.name": "".join(c if c.isalnum() else "_" for c in name).strip("_"),
              "method.name": "pipeline", "parallel.pp": "1" if dp else "4"}
    if args.data_dir:
        values["data.dir"] = args.data_dir
    if not dp:
        values.update({"method.schedule": "1f1b", "method.micro_batches": "4"})
    values.update(over)
    return load(None, values)


def message_bytes(cfg: Any) -> tuple[int, int]:
    """Payload of one forward and one backward message over boundary 1 (micro-batch 8 x 64 x 64
    activations; the first boundary is plain when ``uncompressed_first`` says so)."""
    from thinwire.strategies.pipeline.codecs import (
        bottleneck_options,
        build_boundary,
        is_bottleneck,
    )

    o = cfg.method.options
    fwd, bwd = o.boundaries().specs(1)
    shape: tuple[int, ...] = (8, 64, 64)
    if is_bottleneck(fwd):
        shape = (8, 64, bottleneck_options(fwd)[1].dim)
        fwd = "none"
    return (build_boundary(fwd, forward=True).tensor_bytes(shape),
            build_boundary(bwd).tensor_bytes(shape))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default="runs/pipeline_codecs")
    p.add_argument("--data-dir", default="")
    p.add_argument("--only", default="", help="comma-separated row numbers to run (0-based)")
    p.add_argument("--reuse", action="store_true")
    args = p.parse_args()
    chosen = [RUNS[int(i)] for i in args.only.split(",")] if args.only else RUNS
    print(f"GPT 4x64 (4 heads, context 64), tiny-shakespeare, 4 workers, {args.steps} steps, "
          "global batch 32, AdamW lr 3e-3\n")
    print("| run | val ppl | val NLL | sent/worker mean | sent/worker max | fwd msg | bwd msg | "
          "wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, over in chosen:
        cfg = config(name, over, args)
        done = cfg.run_dir / "summary.json"
        summary = None
        if args.reuse and done.exists():
            old = json.loads(done.read_text())
            if old["config"] == json.loads(json.dumps(to_dict(cfg))):
                summary = old
        if summary is None:
            summary = run_config(cfg)
        f, b = summary["final"], summary["bytes"]
        msgs = ("-", "-") if cfg.method.name == "dp" else tuple(
            fmt_bytes(x) for x in message_bytes(cfg))
        print(f"| {name} | {f['perplexity']:.3f} | {f['nll']:.4f} | "
              f"{fmt_bytes(b['sent_per_worker_mean'])} | {fmt_bytes(b['sent_per_worker_max'])} | "
              f"{msgs[0]} | {msgs[1]} | {summary['wall_s']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

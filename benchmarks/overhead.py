"""thinwire's data-parallel step time against a plain DDP script, same model, data and run.

    python benchmarks/overhead.py [--workers 4] [--steps 200] [--hidden 1024,1024] [--repeats 3]

The plain baseline is the textbook loop: DistributedDataParallel with its built-in C++
all-reduce hook, SGD, the same MLP, the same per-rank batches (thinwire's data and model
builders, so the work is identical). thinwire runs ``thinwire train --method dp`` end to end
(launcher, trainer, ledger hook, metrics). Both report the summed step time on rank 0 with
evaluation excluded; runs alternate (plain, thinwire, plain, ...) to share the machine's noise,
and the ratio of medians is printed: throughput(thinwire) / throughput(plain DDP).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _plain_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    from thinwire.builders import build_model, load_data, make_stream
    from thinwire.config import load

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # a client of the parent's store (bound before the workers start): no rank binds a port
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    cfg = load(None, _overrides(args))
    ds = load_data(cfg)
    stream = make_stream(cfg, ds, rank, world)
    model = build_model(cfg, ds)  # the model thinwire's trainer builds, from the same seed
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.train.lr)
    loss_fn = nn.CrossEntropyLoss()
    total = 0.0
    for step in range(cfg.train.steps):
        x, y = stream.batch(step)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(x), y).backward()
        opt.step()
        total += time.perf_counter() - t0
    if rank == 0:
        Path(out).write_text(json.dumps({"wall_s": total}))
    del ddp, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _overrides(args: argparse.Namespace) -> dict[str, str]:
    return {"data.name": args.data, "model.hidden": args.hidden, "model.norm": "none",
            "train.steps": str(args.steps), "train.batch_size": str(args.batch),
            "train.eval_every": "0", "runtime.workers": str(args.workers)}


def plain(args: argparse.Namespace) -> float:
    from thinwire.launch import loopback_store

    out = tempfile.mktemp(suffix=".json")
    store, port = loopback_store()  # listening on a port of the kernel's choice until the end
    try:
        mp.start_processes(_plain_worker, args=(args.workers, port, args, out),
                           nprocs=args.workers, start_method="spawn")
    finally:
        del store
    return float(json.loads(Path(out).read_text())["wall_s"])


def thinwire(args: argparse.Namespace, out_dir: str, name: str) -> float:
    cmd = [sys.executable, "-m", "thinwire", "train", "--method", "dp", "--no-progress",
           "--run.out", out_dir, "--run.name", name]
    for k, v in _overrides(args).items():
        cmd += [f"--{k}", v]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return float(json.loads((Path(out_dir) / name / "summary.json").read_text())["wall_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--hidden", default="1024,1024")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--data", default="fashion-mnist")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    base, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            base.append(plain(args))
            ours.append(thinwire(args, tmp, f"dp{i}"))  # a fresh run directory each repeat
    b, o = statistics.median(base), statistics.median(ours)
    print(f"# DP overhead: {args.workers} workers, MLP {args.hidden}, batch {args.batch}, "
          f"{args.steps} steps, {args.data}, {args.repeats} alternating repeats")
    print("| runner | median train time s | steps/s | all repeats s |")
    print("|---|---:|---:|---:|")
    print(f"| plain DDP | {b:.2f} | {args.steps / b:.1f} | {', '.join(f'{x:.2f}' for x in base)} |")
    print(f"| thinwire dp | {o:.2f} | {args.steps / o:.1f} | {', '.join(f'{x:.2f}' for x in ours)} |")
    print(f"\nthroughput ratio thinwire / plain DDP: {b / o:.3f} (target >= 0.97)")


if __name__ == "__main__":
    main()

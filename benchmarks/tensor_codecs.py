"""Compressed tensor-parallel traffic against compressed pipeline-boundary traffic: quality and bytes.

Bian et al. ("Does compressing activations help model parallel training?", MLSys 2024) found
that tensor parallelism tolerates activation compression worse than pipeline parallelism. This
script trains the same GPT on tiny-shakespeare with the same codec in two places:

- TP: ``method tensor`` at tp = 2 on 2 gloo ranks, ``method.codec`` on every tensor-parallel
  collective (2 per region and direction: 8 per block and step); bytes are the ledger's ``tp``
  entries per rank;
- PP boundary: one process, the codec applied to the activation leaving block ``L/2 - 1`` and
  to its gradient coming back (keys 0 and 1, error feedback as the codec's registry default):
  numerically what a 2-stage pipeline with that codec on its stage boundary computes (the
  pipeline itself, #12, is not in this tree); bytes are the codec's payload per direction.

Both start from the same weights and see the same batches (single-process runs use the global
batch). Reported: validation perplexity after ``--steps`` steps (limit_test windows), its
change against the uncompressed run of the same place, and bytes per rank per step.

    PYTHONPATH=src python benchmarks/tensor_codecs.py [--steps 300] [--codecs none,fp16,...]
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch
from torch import nn

from thinwire.builders import build_mesh, build_model, build_strategy, load_data
from thinwire.compression import build
from thinwire.config import load
from thinwire.data.task import task_for
from thinwire.run import split_methods
from thinwire.runtime.comm import Comm
from thinwire.runtime.spawn import run_group


def base(args: argparse.Namespace) -> dict[str, Any]:
    return {"model.name": "gpt", "data.name": "tinyshakespeare", "data.dir": args.data_dir,
            "data.seq_len": args.seq, "data.limit_test": 256, "model.n_layer": 2,
            "model.d_model": 64, "model.n_head": 4, "train.optimizer": "adamw",
            "train.lr": 3e-3, "train.batch_size": args.batch, "train.steps": args.steps,
            "train.eval_every": args.steps, "method.name": "tensor", "parallel.tp": 2}


def batch(ds: Any, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, len(ds.x_train), (rows,), generator=g)
    return ds.x_train[idx], ds.y_train[idx]


def tp_run(comm: Comm, over: dict[str, Any], steps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    cfg = load(None, {**over, "runtime.workers": comm.world_size})
    ds = load_data(cfg)
    strat = build_strategy(cfg, comm, torch.device("cpu"), task_for(ds), build_model(cfg, ds),
                           build_mesh(cfg, comm, torch.device("cpu")))
    t0 = time.perf_counter()
    for s in range(steps):
        strat.train_step(batch(ds, s, cfg.train.batch_size), s)
    wall = time.perf_counter() - t0
    sent = sum(e.sent for e in comm.ledger.entries if e.tag == "tp")
    model = strat.eval_model()
    ppl = task_for(ds).evaluate(model, ds.x_test, ds.y_test)["perplexity"] if model else 0.0
    return {"ppl": ppl, "sent_per_step": sent / steps, "s_per_step": wall / steps}


class _Boundary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, codec: Any, step: int) -> torch.Tensor:
        ctx.codec, ctx.step = codec, step
        flat = x.detach().reshape(-1).clone()
        return codec.decode(codec.encode(flat, step, key=0), flat.numel(), step,
                            key=0).view_as(x).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        flat = g.detach().reshape(-1).clone()
        c = ctx.codec
        out = c.decode(c.encode(flat, ctx.step, key=1), flat.numel(), ctx.step, key=1)
        return out.view_as(g).to(g.dtype), None, None


def pp_run(over: dict[str, Any], codec_spec: str, steps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    cfg = load(None, {**over, "method.name": "dp", "parallel.tp": 1, "runtime.workers": 1})
    ds = load_data(cfg)
    task = task_for(ds)
    model = build_model(cfg, ds)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr,
                            weight_decay=cfg.train.weight_decay)
    codec = build(codec_spec) if codec_spec != "none" else None
    blocks = model.get_submodule("blocks")
    assert isinstance(blocks, nn.ModuleList)
    state = {"step": 0}
    if codec is not None:
        blocks[len(blocks) // 2 - 1].register_forward_hook(
            lambda _m, _a, out: _Boundary.apply(out, codec, state["step"]) if model.training
            else out)
    t0 = time.perf_counter()
    numel = 0
    for s in range(steps):
        state["step"] = s
        x, y = batch(ds, s, cfg.train.batch_size)
        emb = model.get_submodule("tok_emb")
        assert isinstance(emb, nn.Embedding)
        numel = x.numel() * emb.embedding_dim
        opt.zero_grad()
        task.loss(model(x), y).backward()
        opt.step()
    wall = time.perf_counter() - t0
    per_dir = codec.payload_bytes(numel) if codec is not None else 4 * numel
    return {"ppl": task.evaluate(model, ds.x_test, ds.y_test)["perplexity"],
            "sent_per_step": float(per_dir), "s_per_step": wall / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--codecs", default="none,fp16,int8,qsgd,topk:ratio=0.1")
    ap.add_argument("--data-dir", default="",
                    help="directory holding input.txt (default: the package's copy)")
    args = ap.parse_args()
    over = base(args)
    codecs = split_methods(args.codecs)
    rows = []
    for spec in codecs:
        tp = run_group(tp_run, 2, {**over, "method.codec": spec}, args.steps, timeout=3600)[0]
        pp = pp_run(over, spec, args.steps)
        rows.append((spec, tp, pp))
        print(f"# {spec}: tp {tp} pp {pp}", flush=True)
    tp0, pp0 = rows[0][1]["ppl"], rows[0][2]["ppl"]
    print(f"\nGPT 2x64 (4 heads), tiny-shakespeare, seq {args.seq}, batch {args.batch}, "
          f"AdamW 3e-3, {args.steps} steps; validation perplexity on 256 windows\n")
    print("| codec | TP=2 val ppl | TP Δppl | TP bytes/rank/step | PP-boundary val ppl | "
          "PP Δppl | PP bytes/boundary/direction/step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for spec, tp, pp in rows:
        print(f"| {spec} | {tp['ppl']:.3f} | {tp['ppl'] - tp0:+.3f} | "
              f"{tp['sent_per_step'] / 1e3:,.1f} kB | {pp['ppl']:.3f} | "
              f"{pp['ppl'] - pp0:+.3f} | {pp['sent_per_step'] / 1e3:,.1f} kB |")
    assert all(math.isfinite(r[1]["ppl"]) for r in rows)


if __name__ == "__main__":
    main()

"""thinwire's DiLoCo / local SGD beside torchft's on the same model, data and workers (gloo on
loopback), in one run: the parameters after N outer steps, the step time and the bytes of both.

Each of ``--workers`` processes is one torchft replica group of one rank: its own TCPStore and
``torchft.manager.Manager`` (synchronous quorum) joined through the ``torchft_lighthouse``
binary the torchft wheel ships, bound to 127.0.0.1. Every process then runs, from the same
initial model and on the same batches (worker i reads shard i of the config's dataset):

1. torchft: ``torchft.local_sgd.DiLoCo(manager, fragments, inner, outer, sync_every,
   fragment_sync_delay=delay, fragment_update_alpha=alpha)`` (``--method diloco``) or
   ``torchft.local_sgd.LocalSGD(manager, model, inner, sync_every)`` (``--method localsgd``);
2. thinwire: ``thinwire.DiLoCo(model, inner, outer, sync_every, fragments=..., delay=...,
   alpha=...)`` or ``thinwire.LocalSGD`` on a gloo process group over loopback.

The fragments are the same modules for both (the model's layers strided, layer l in fragment
l mod P, as :func:`thinwire.strategies.diloco.strided_fragments` cuts them); the outer optimizer
is SGD with Nesterov momentum (one per fragment for torchft, which steps every parameter its
outer optimizer holds; one over the model for thinwire, which steps the synchronised fragment
only: the same update). Bytes: thinwire's ledger (ring estimate) and, for both, the bytes the
process wrote (``wchar`` of ``/proc/self/io``: gloo's socket writes, measured; control traffic
included: torchft's quorum and commit RPCs, thinwire's none during training).

    python benchmarks/torchft_side_by_side.py --workers 4 --outer-steps 5 --period 20 \\
        --fragments 2 --delay 2 --set model.name=mlp --set data.name=fashion-mnist

prints one table and, with ``--json FILE``, writes every figure.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def start_lighthouse(binary: str, args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    """The lighthouse binary bound to 127.0.0.1 on a port of the kernel's choice (``:0``, so no
    port is picked, released and bound again later), and its address, read from the line it
    logs once it listens; its further log lines are drained (and dropped) by a thread."""
    import re
    import threading

    env = dict(os.environ, RUST_LOG="info")  # the "listening on" line is logged at info
    proc = subprocess.Popen(
        [binary, "--min_replicas", str(args.workers), "--bind", "127.0.0.1:0",
         "--join_timeout_ms", "200", "--quorum_tick_ms", "10"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    for line in proc.stderr:
        found = re.search(r"listening on: http://[^:\s]+:(\d+)", line)
        if found:
            threading.Thread(target=lambda: [None for _ in proc.stderr or ()],
                             daemon=True).start()
            return proc, f"http://127.0.0.1:{found.group(1)}"
    proc.wait()
    raise SystemExit(f"torchft_side_by_side: torchft_lighthouse exited ({proc.returncode}) "
                     "before listening; run it by hand to see why")


def written() -> int:
    """Bytes this process has written (sockets included), from /proc/self/io."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


def _setup(args: argparse.Namespace, rank: int) -> tuple[Any, Any, Any]:
    from thinwire.builders import load_data, make_stream
    from thinwire.config import load

    overrides = dict(s.split("=", 1) for s in args.set)
    cfg = load(None, {"train.batch_size": args.batch_size, **overrides})
    ds = load_data(cfg)
    return cfg, ds, lambda: make_stream(cfg, ds, rank, args.workers)


def _model(cfg: Any, ds: Any) -> Any:
    import torch

    from thinwire.builders import build_model

    torch.manual_seed(0)
    return build_model(cfg, ds)


def _fragments(model: Any, p: int) -> list[Any]:
    """The model's parameters strided over its layers into p fragments, as modules."""
    from torch import nn

    from thinwire.strategies.diloco import strided_fragments

    named = list(model.named_parameters())
    frags = strided_fragments([n for n, _ in named], p)
    out = []
    for idx in frags:
        holder = nn.Module()
        for j, i in enumerate(idx):
            holder.register_parameter(f"p{j}", named[i][1])
        out.append(holder)
    return out


def _train(args: argparse.Namespace, model: Any, inner: Any, loss_fn: Any, stream: Any,
           steps: int) -> float:
    model.train()
    t0 = time.perf_counter()
    for s in range(steps):
        x, y = stream.batch(s)
        inner.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        inner.step()
    return (time.perf_counter() - t0) / steps


def _flat(model: Any) -> Any:
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _outer(params: Any, args: argparse.Namespace) -> Any:
    import torch

    return torch.optim.SGD(params, lr=args.outer_lr, momentum=args.outer_momentum,
                           nesterov=args.outer_momentum > 0)


def _manager(args: argparse.Namespace, rank: int, lighthouse: str,
             holder: dict[str, Any]) -> tuple[Any, Any]:
    """This rank's torchft Manager (one replica group of one rank) and its TCPStore, each bound
    to a port of the kernel's choice (0); the model it checkpoints for recovery is
    ``holder["model"]``, the repeat's model."""
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    model = holder
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=120)),
        load_state_dict=lambda sd: model["model"].load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model["model"].state_dict()},
        min_replica_size=args.workers,
        use_async_quorum=False, replica_id=f"replica{rank}", store_addr="127.0.0.1",
        store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
        port=0, hostname="127.0.0.1", init_sync=False,
        timeout=timedelta(seconds=120), quorum_timeout=timedelta(seconds=120),
        connect_timeout=timedelta(seconds=60))
    return manager, store


def _torchft(args: argparse.Namespace, rank: int, manager: Any, holder: dict[str, Any]
             ) -> dict[str, Any]:
    import torch
    from torchft.local_sgd import DiLoCo as FTDiLoCo
    from torchft.local_sgd import LocalSGD as FTLocalSGD

    from thinwire.data.task import task_for

    cfg, ds, stream = _setup(args, rank)
    model = _model(cfg, ds)
    holder["model"] = model
    inner = torch.optim.SGD(model.parameters(), lr=args.lr)
    steps = args.outer_steps * args.period
    commits0 = manager.current_step()
    w0 = written()
    # a repeat's wrapper registers its fragments' recovery state again under the same keys:
    # drop the previous repeat's (torchft refuses duplicate keys; "default" is the model's)
    for key in [k for k in manager._load_state_dict_fns if k != "default"]:
        manager._load_state_dict_fns.pop(key)
        manager._user_state_dicts.pop(key, None)
    if args.method == "diloco":
        frags = _fragments(model, args.fragments)
        outers = [_outer(f.parameters(), args) for f in frags]
        wrapper = FTDiLoCo(manager, frags, inner, outers if len(frags) > 1 else outers[0],
                           args.period, fragment_sync_delay=args.delay,
                           fragment_update_alpha=args.alpha)
    else:
        wrapper = FTLocalSGD(manager, model, inner, args.period)
    with wrapper:
        step_s = _train(args, model, inner, task_for(ds).loss, stream(), steps)
    return {"params": _flat(model), "step_s": step_s, "wchar": written() - w0,
            "commits": manager.current_step() - commits0}


def _thinwire(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    import torch

    import thinwire
    from thinwire.data.task import task_for

    cfg, ds, stream = _setup(args, rank)
    comm = thinwire.Comm()
    model = _model(cfg, ds)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr)
    steps = args.outer_steps * args.period
    w0 = written()
    if args.method == "diloco":
        frags = _fragments(model, args.fragments)
        wrapper = thinwire.DiLoCo(model, inner, _outer(model.parameters(), args), args.period,
                                  comm=comm, fragments=frags, delay=args.delay,
                                  alpha=args.alpha)
    else:
        wrapper = thinwire.LocalSGD(model, inner, args.period, comm=comm)
    with wrapper:
        step_s = _train(args, model, inner, task_for(ds).loss, stream(), steps)
    out = {"params": _flat(model), "step_s": step_s, "wchar": written() - w0,
           "ledger_sent": int(comm.ledger.totals()["sent_bytes"])}
    comm.barrier()
    return out


def _worker(rank: int, args: argparse.Namespace, lighthouse: str, port: int,
            queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        holder: dict[str, Any] = {}
        manager, store = _manager(args, rank, lighthouse, holder)
        # thinwire's group: a client of the parent's store, which listens already
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=client, rank=rank, world_size=args.workers,
                                timeout=timedelta(seconds=120))
        # repeats interleaved, the order alternating (torchft first in even repeats), so a
        # change of the machine's load falls on both alike
        reps: list[dict[str, Any]] = []
        for rep in range(args.repeats):
            if rep % 2 == 0:
                ft = _torchft(args, rank, manager, holder)
                tw = _thinwire(args, rank)
            else:
                tw = _thinwire(args, rank)
                ft = _torchft(args, rank, manager, holder)
            reps.append({"torchft": ft, "thinwire": tw})
        manager.shutdown(wait=False)
        dist.destroy_process_group()
        del store
        # plain pickle: torch's queue reductions share memory that dies with this process
        queue.put((rank, pickle.dumps(reps)))
    except BaseException as exc:  # the parent reports it in one line and exits non-zero
        import traceback

        queue.put((rank, f"{type(exc).__name__}: {exc} {traceback.format_exc()[-1500:]}"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent /
                                                        "torchft_lighthouse")
    if not Path(binary).exists():
        raise SystemExit("torchft_side_by_side: torchft_lighthouse not found; install the dev "
                         "extra (pip install -c constraints.txt -e '.[dev]')")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's manager logs every quorum at info
    from thinwire.launch import loopback_store

    lighthouse, address = start_lighthouse(binary, args)
    store, port = loopback_store()  # thinwire's rendezvous, bound before any worker starts
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args, address, port, queue))
             for r in range(args.workers)]
    try:
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        deadline = time.monotonic() + args.timeout
        while len(results) < args.workers:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SystemExit(f"torchft_side_by_side: no answer from ranks "
                                 f"{sorted(set(range(args.workers)) - set(results))} within "
                                 f"{args.timeout:g} s")
            try:
                rank, value = queue.get(timeout=min(left, 5))
            except Exception:  # noqa: BLE001 - queue.Empty: poll again
                continue
            if isinstance(value, str):
                raise SystemExit(f"torchft_side_by_side: rank {rank}: {value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        lighthouse.kill()
        lighthouse.wait()
        del store
    return summarise(args, [results[r] for r in range(args.workers)])


def summarise(args: argparse.Namespace, per_rank: list[list[dict[str, Any]]]
              ) -> dict[str, Any]:
    """Parameters compared in every repeat (each starts from the same model and batches); per
    rank the step times of every repeat, the bytes of the first."""
    diffs = [float((rep["torchft"]["params"] - rep["thinwire"]["params"]).abs().max())
             for reps in per_rank for rep in reps]
    scale = max(float(reps[0]["thinwire"]["params"].abs().max()) for reps in per_rank)
    out: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()}, "max_abs_diff": max(diffs),
                           "max_abs_param": scale, "per_rank": []}
    for reps in per_rank:
        r = reps[0]
        out["per_rank"].append({
            "torchft_step_s": [rep["torchft"]["step_s"] for rep in reps],
            "thinwire_step_s": [rep["thinwire"]["step_s"] for rep in reps],
            "torchft_wchar": r["torchft"]["wchar"], "thinwire_wchar": r["thinwire"]["wchar"],
            "thinwire_ledger_sent": r["thinwire"]["ledger_sent"],
            "torchft_commits": r["torchft"]["commits"]})
    return out


def _median(values: list[float]) -> float:
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def table(res: dict[str, Any]) -> str:
    rows = res["per_rank"]

    def mean(key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    a = res["args"]
    def step_ms(key: str) -> list[float]:
        """Per repeat: the step time averaged over ranks, ms."""
        return [1e3 * sum(r[key][i] for r in rows) / len(rows)
                for i in range(len(rows[0][key]))]

    ft, tw = step_ms("torchft_step_s"), step_ms("thinwire_step_s")
    ratios = [b / a for a, b in zip(ft, tw)]
    lines = [f"{a['method']} H={a['period']} P={a['fragments']} tau={a['delay']} "
             f"alpha={a['alpha']} workers={a['workers']} outer steps={a['outer_steps']} "
             f"repeats={a['repeats']} ({' '.join(a['set'])})",
             "| | step ms (median of repeats) | step ms per repeat | bytes written/worker "
             "| ledger sent/worker |",
             "|---|---:|---:|---:|---:|",
             f"| torchft | {_median(ft):.2f} | {' '.join(f'{v:.2f}' for v in ft)} "
             f"| {mean('torchft_wchar'):.0f} | - |",
             f"| thinwire | {_median(tw):.2f} | {' '.join(f'{v:.2f}' for v in tw)} "
             f"| {mean('thinwire_wchar'):.0f} | {mean('thinwire_ledger_sent'):.0f} |",
             f"thinwire / torchft step time per repeat: {' '.join(f'{v:.3f}' for v in ratios)} "
             f"(median {_median(ratios):.3f})",
             f"parameters: max |torchft - thinwire| = {res['max_abs_diff']:.3g} "
             f"(max |theta| {res['max_abs_param']:.3g}); torchft commits "
             f"{rows[0]['torchft_commits']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", choices=("diloco", "localsgd"), default="diloco")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--outer-steps", type=int, default=3)
    ap.add_argument("--period", type=int, default=10, help="inner steps between syncs (H)")
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--delay", type=int, default=0)
    ap.add_argument("--alpha", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=0.05, help="inner SGD learning rate")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config overrides for model and data, e.g. model.name=mlp")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of both, interleaved with the order alternating")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.workers < 2 or args.outer_steps < 1 or args.period < 1 or args.repeats < 1:
        ap.error("--workers must be >= 2, --outer-steps, --period and --repeats >= 1")
    if any("=" not in s for s in args.set):
        ap.error("--set takes KEY=VALUE")
    res = run(args)
    print(table(res))
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

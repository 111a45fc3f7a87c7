"""What costs IST its model quality, and what wins it back: one table per model, every method at
equal samples processed.

    python benchmarks/ist_quality.py --out runs/ist_quality                 # the ablation table
    python benchmarks/ist_quality.py --out runs/ist_quality --table target  # the target table

Models, all written here as a user writes them from stock torch modules (none imported from the
tests), trained on scikit-learn's digits (1,797 8x8 images; 1,400 to train, 397 held out):
``mlp`` (Linear + ReLU, 64-256-256-10), ``rescnn`` (Conv2d + BatchNorm2d stem, two residual
blocks whose skip is an add in ``forward``, a Linear head), ``encoder`` (each image a sequence of
its 8 rows, a Linear input projection, a learned position table, ``nn.TransformerEncoder`` of 2
post-norm layers, d 64, 4 heads, FFN 128, mean pooling, a Linear head), and thinwire's own
``resnet`` and ``gpt`` (the registry's models at small widths: ResNet on the digits as images,
GPT a character model of tiny-shakespeare, its metric the validation perplexity).

Every method runs in one group of ``n`` gloo processes (``torch.multiprocessing``; one thread
each), which runs every job of the table in turn:
  1. each job builds the model from seed 0 and Adam (the ``opt`` column: or SGD + momentum 0.9)
     with the job's learning rate; each worker draws batches of ``batch`` from its own shard
     (rank r holds training rows r, r + n, ...; its own generator);
  2. ``plain``: rank 0 alone trains one model on the union of the n workers' batches (the
     batches the workers draw, so DP computes the same thing up to BatchNorm's per-worker
     statistics); ``dp``: gradients averaged with one all-reduce a step through a
     :class:`~thinwire.runtime.comm.Comm`; ``localsgd``: :class:`thinwire.LocalSGD`;
     ``diloco``: :class:`thinwire.DiLoCo` (Nesterov outer SGD, lr 0.7, momentum 0.9; with
     ``fragments`` its Streaming form); ``ist``: :class:`thinwire.IST` with the job's options;
  3. every method takes ``steps`` optimizer steps per worker, so all of them process the same
     samples; rank 0 evaluates the final model (IST's assembled one; BatchNorm statistics
     recomputed on 20 training batches for every method alike): test accuracy and NLL (or
     perplexity), and the bytes each worker sent (the ledger, evaluation traffic excluded).
The table prints each job's metric, its distance to ``plain`` and its bytes as a fraction of DP's.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


# --- the users' models --------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.fc2(F.relu(self.fc1(x)))))


class ResCNN(nn.Module):
    """A user's residual CNN: the skips are additions written in ``forward``."""

    def __init__(self, c: int = 32) -> None:
        super().__init__()
        self.stem, self.bn0 = nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c3, self.b3 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c4, self.b4 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn0(self.stem(x)))
        h = F.relu(h + self.b2(self.c2(F.relu(self.b1(self.c1(h))))))
        h = F.relu(h + self.b4(self.c4(F.relu(self.b3(self.c3(h))))))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


class Encoder(nn.Module):
    """A user's ``nn.TransformerEncoder`` classifier: each image a sequence of its 8 rows."""

    def __init__(self, d: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.pos = nn.Parameter(torch.randn(8, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.inp(x) + self.pos).mean(1))


# --- data ---------------------------------------------------------------------------------------
class Digits:
    """scikit-learn's digits, standardised; rank ``r`` of ``n`` draws from rows r, r + n, ..."""

    lm = False

    def __init__(self, shape: tuple[int, ...]) -> None:
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.as_tensor(d.data, dtype=torch.float32) / 16.0
        y = torch.as_tensor(d.target, dtype=torch.long)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        x, y = x[perm], y[perm]
        mean, std = x[:1400].mean(0), x[:1400].std(0) + 0.1
        x = ((x - mean) / std).reshape(-1, *shape)
        self.x, self.y, self.x_te, self.y_te = x[:1400], y[:1400], x[1400:], y[1400:]

    def batch(self, rank: int, n: int, gen: torch.Generator, b: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(rank, len(self.x), n)
        i = rows[torch.randint(0, len(rows), (b,), generator=gen)]
        return self.x[i], self.y[i]

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        out = model(self.x_te)
        return {"acc": float((out.argmax(1) == self.y_te).float().mean()),
                "nll": float(F.cross_entropy(out, self.y_te))}


class FashionMNIST(Digits):
    """Fashion-MNIST (the system's copy, ``make data``): 60,000 28x28 images to train, the first
    2,000 test images held out; far from converged in a few hundred steps, unlike digits."""

    def __init__(self) -> None:  # noqa: D107 - the data differ, the interface is Digits'
        from thinwire.data.datasets import _load_fashion_mnist

        x_tr, y_tr, x_te, y_te = _load_fashion_mnist(None, False)
        self.x = torch.as_tensor(x_tr, dtype=torch.float32).reshape(-1, 1, 28, 28) / 255.0
        self.y = torch.as_tensor(y_tr, dtype=torch.long)
        self.x_te = torch.as_tensor(x_te[:2000], dtype=torch.float32).reshape(-1, 1, 28, 28) / 255.0
        self.y_te = torch.as_tensor(y_te[:2000], dtype=torch.long)


class Shakespeare:
    """tiny-shakespeare characters (the copy inside the package); random windows per rank."""

    lm = True

    def __init__(self, context: int = 64) -> None:
        from thinwire.data.text import encode, find_tinyshakespeare, read_text

        path = find_tinyshakespeare()
        assert path is not None, "tiny-shakespeare ships inside the package"
        chars, ids = encode(read_text(path))
        cut = int(0.9 * len(ids))
        self.train_ids, self.val_ids = torch.as_tensor(ids[:cut]), torch.as_tensor(ids[cut:])
        self.vocab, self.context = len(chars), context
        g = torch.Generator().manual_seed(7)
        starts = torch.randint(0, len(self.val_ids) - context - 1, (64,), generator=g)
        self.val = torch.stack([self.val_ids[s:s + context + 1] for s in starts])

    def batch(self, rank: int, n: int, gen: torch.Generator, b: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        span = (len(self.train_ids) - self.context - 1) // n
        s = rank * span + torch.randint(0, span, (b,), generator=gen)
        w = torch.stack([self.train_ids[k:k + self.context + 1] for k in s])
        return w[:, :-1], w[:, 1:]

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        nll = float(self.loss(model(self.val[:, :-1]), self.val[:, 1:]))
        return {"ppl": math.exp(nll), "nll": nll}


def build(name: str, seed: int = 0) -> tuple[nn.Module, Any]:
    """The model (initialised from ``seed``) and its data."""
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP(), Digits((64,))
    if name == "rescnn":
        return ResCNN(), Digits((1, 8, 8))
    if name == "encoder":
        return Encoder(), Digits((8, 8))
    if name == "rescnn-fmnist":
        return ResCNN(16), FashionMNIST()
    if name == "resnet":
        from thinwire.models.resnet import ResNet

        return ResNet((1, 8, 8), 10, widths=(16, 32), blocks=(2, 2)), Digits((1, 8, 8))
    if name == "gpt":
        from thinwire.models.gpt import GPT

        data = Shakespeare()
        torch.manual_seed(seed)
        return GPT(data.vocab, data.context, n_layer=2, n_head=4, d_model=64), data
    raise SystemExit(f"unknown model {name!r}")


# --- jobs ---------------------------------------------------------------------------------------
@dataclass
class Job:
    """One row: a model, a method and its options."""

    model: str
    method: str                      # plain, dp, localsgd, diloco, ist
    label: str = ""
    steps: int = 200
    batch: int = 32
    lr: float = 3e-3
    opt: str = "adam"                # adam, sgd (momentum 0.9)
    period: int = 10                 # localsgd / diloco H
    fragments: int = 1               # diloco
    ist: dict[str, Any] = field(default_factory=dict)   # thinwire.IST keyword arguments
    seed: int = 0                    # the model's initialisation and every worker's batches
    recal: bool = True               # BatchNorm statistics recomputed before evaluation

    def name(self) -> str:
        return self.label or self.method


def _optimizer(job: Job, model: nn.Module) -> torch.optim.Optimizer:
    if job.opt == "sgd":
        return torch.optim.SGD(model.parameters(), lr=job.lr, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=job.lr)


@torch.no_grad()
def _recalibrate(model: nn.Module, data: Any) -> nn.Module:
    """BatchNorm statistics recomputed on 20 training batches of 64 (on a copy)."""
    from thinwire.models.norms import recalibrate_batchnorm

    if data.lm:
        return model
    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    recalibrate_batchnorm(model, [data.x[torch.randint(0, len(data.x), (64,), generator=gen)]
                                  for _ in range(20)], running=True)
    return model.eval()


def _sent(comm: Any) -> int:
    return sum(v["sent"] for k, v in comm.ledger.by_op().items() if not k.endswith(":control"))


def run_job(job: Job, rank: int, n: int) -> dict[str, Any] | None:
    """Steps 1-3 for one job on this rank; rank 0 returns the row."""
    import thinwire
    from thinwire.runtime.comm import Comm
    from thinwire.strategies.grads import all_reduce_grads

    comm = Comm()
    model, data = build(job.model, job.seed)
    gens = [torch.Generator().manual_seed(1000 + 100 * job.seed + r) for r in range(n)]
    t0 = time.perf_counter()
    if job.method == "plain":
        if rank == 0:
            opt = _optimizer(job, model)
            for _ in range(job.steps):
                parts = [data.batch(r, n, gens[r], job.batch) for r in range(n)]
                x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
                opt.zero_grad()
                data.loss(model(x), y).backward()
                opt.step()
        dist.barrier()
        full: nn.Module | None = model if rank == 0 else None
        sent = [0] * n
    else:
        opt = _optimizer(job, model)
        wrapper: Any = None
        x0, _ = data.batch(rank, n, torch.Generator().manual_seed(5), job.batch)
        if job.method == "ist":
            wrapper = thinwire.IST(model, opt, comm=comm, example_input=x0, **job.ist)
        elif job.method == "localsgd":
            wrapper = thinwire.LocalSGD(model, opt, job.period, comm=comm)
        elif job.method == "diloco":
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            wrapper = thinwire.DiLoCo(model, opt, outer, job.period, comm=comm,
                                      fragments=job.fragments)
        for _ in range(job.steps):
            x, y = data.batch(rank, n, gens[rank], job.batch)
            opt.zero_grad()
            data.loss(model(x), y).backward()
            if job.method == "dp":  # one all-reduce of every gradient, through the ledger
                all_reduce_grads(comm, list(model.parameters()))
            opt.step()
        if job.method == "ist":
            assert wrapper.at_boundary, "steps must be a multiple of IST's local steps"
            full = wrapper.full_model()
        else:
            full = model if rank == 0 else None
        if wrapper is not None and hasattr(wrapper, "close"):
            wrapper.close()
        out = [torch.zeros(1) for _ in range(n)]
        dist.all_gather(out, torch.tensor([float(_sent(comm))]))
        sent = [int(t.item()) for t in out]
    train_s = time.perf_counter() - t0
    if rank != 0:
        return None
    assert full is not None
    metrics = data.evaluate(_recalibrate(full, data) if job.recal else full.eval())
    return {"model": job.model, "label": job.name(), "method": job.method, "n": n,
            "seed": job.seed,
            "sent_mean": sum(sent) / n, "sent_max": max(sent), "train_s": train_s, **metrics}


def _worker(rank: int, n: int, port: int, jobs: list[dict[str, Any]], out: str) -> None:
    # every rank a client of the parent's store (TORCHELASTIC_USE_AGENT_STORE): none binds a port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    rows = []
    try:
        for spec in jobs:
            row = run_job(Job(**spec), rank, n)
            if row is not None:
                rows.append(row)
                print(_line(row, None, None), flush=True)
                Path(out).write_text(json.dumps(rows))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def run_group(jobs: list[Job], n: int, out: Path) -> list[dict[str, Any]]:
    """Every job with ``n`` workers (one process group), rank 0's rows. The rendezvous store
    listens here, bound to a port of the kernel's choice before any worker starts (no port is
    picked, released and bound again later)."""
    from thinwire.launch import loopback_store

    out.parent.mkdir(parents=True, exist_ok=True)
    store, port = loopback_store()
    try:
        mp.spawn(_worker, args=(n, port, [j.__dict__ for j in jobs], str(out)), nprocs=n)
    finally:
        del store
    return json.loads(out.read_text())


# --- tables -------------------------------------------------------------------------------------
def _metric(row: dict[str, Any]) -> tuple[str, float]:
    return ("ppl", row["ppl"]) if "ppl" in row else ("acc", row["acc"])


def _line(row: dict[str, Any], plain: dict[str, Any] | None, dp: dict[str, Any] | None) -> str:
    key, value = _metric(row)
    gap = ""
    if plain is not None:
        ref = _metric(plain)[1]
        gap = (f"{100 * (value - ref):+.1f} pt" if key == "acc"
               else f"{100 * (value / ref - 1):+.1f}%")
    share = ""
    if dp is not None and dp["sent_mean"] and row["method"] != "plain":
        share = f"1/{dp['sent_mean'] / row['sent_mean']:.0f}" if row["sent_mean"] else "0"
    return (f"| {row['model']} | {row['label']} | {row['n']} | {value:.4f} | {gap} | "
            f"{row['nll']:.3f} | {row['sent_mean'] / 1e6:.2f} MB | {share} | "
            f"{row['train_s']:.1f} |")


HEADER = ("| model | method | workers | acc / ppl | vs plain | test NLL | sent/worker | "
          "of DP's bytes | s |\n|---|---|---:|---:|---:|---:|---:|---:|---:|")


def mean_over_seeds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, label, workers): the mean of its seeds' rows (``seeds`` counted)."""
    out: dict[tuple[str, str, int], dict[str, Any]] = {}
    count: dict[tuple[str, str, int], int] = {}
    for r in rows:
        key = (r["model"], r["label"], r["n"])
        if key not in out:
            out[key] = dict(r)
            count[key] = 1
            continue
        count[key] += 1
        for k, v in r.items():
            if isinstance(v, float) or (isinstance(v, int) and k not in ("n", "seed")):
                out[key][k] += v
    for key, r in out.items():
        for k, v in list(r.items()):
            if isinstance(v, float) or (isinstance(v, int) and k not in ("n", "seed")):
                r[k] = v / count[key]
        r["seeds"] = count[key]
    return list(out.values())


def table(rows: list[dict[str, Any]]) -> str:
    lines = [HEADER]
    rows = mean_over_seeds(rows)
    for r in rows:
        same = [x for x in rows if x["model"] == r["model"]]
        plain = next((x for x in same if x["method"] == "plain" and x["n"] == r["n"]), None)
        dp = next((x for x in same if x["method"] == "dp" and x["n"] == r["n"]), None)
        lines.append(_line(r, plain, dp))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ist_quality_jobs import TABLES  # the tables' rows, beside this file

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/ist_quality")
    p.add_argument("--table", default="ablation", choices=sorted(TABLES))
    p.add_argument("--models", default="", help="comma-separated subset of the table's models")
    p.add_argument("--only", default="", help="labels to run, separated by ';' (with plain and "
                   "dp)")
    a = p.parse_args(argv)
    groups = TABLES[a.table]()
    models = {m for m in a.models.split(",") if m}
    only = {m.strip() for m in a.only.split(";") if m.strip()}
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for n, jobs in groups:
        jobs = [j for j in jobs if (not models or j.model in models)
                and (not only or j.name() in only or j.method in ("plain", "dp"))]
        if jobs:
            rows += run_group(jobs, n, Path(a.out) / f"{a.table}-n{n}.json")
    text = (f"{a.table} table, {time.time() - t0:.0f} s, load average {load} before, "
            f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])} after\n\n"
            + table(rows) + "\n")
    Path(a.out, f"{a.table}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())

"""IST on models users write from stock torch modules, in their own loop: a residual CNN
(Conv2d + BatchNorm + identity skips + GroupNorm, a Linear head) on Fashion-MNIST and an
``nn.TransformerEncoder`` character LM on tiny-shakespeare, IST (adapter derived from the
model's graph, no adapter written) against data parallelism and local SGD, 4 workers; and the
models people download, with the libraries' own classes and fresh weights: GPT-2 from Hugging
Face ``transformers`` (``--tasks gpt2``: 2 layers of 64, 4 heads, on the same characters) and
torchvision's MobileNetV3-small (``--tasks mobilenet``: Fashion-MNIST, the gray image repeated
on 3 channels).

    python benchmarks/ist_user_models.py --out runs/ist_zoo --tasks gpt2,mobilenet

    python benchmarks/ist_user_models.py --out runs/ist_user --link loopback
    flock /tmp/thinwire-testbed.lock timeout 1800 \\
        python benchmarks/ist_user_models.py --out runs/ist_user_tb --link 100mbit   # root

Every (task, method) is one run of ``--workers`` processes (gloo; on loopback, or one network
namespace per worker with tc-shaped links from :mod:`thinwire.testbed`), each process this file
in ``--worker`` mode:
  1. builds the model from seed 0 and an Adam optimizer;
  2. wraps them with the method: ``thinwire.IST(model, opt, local_steps=K,
     example_input=batch)`` / gradients averaged with one all-reduce per step through a
     :class:`~thinwire.runtime.comm.Comm` / ``thinwire.LocalSGD(model, opt, sync_every=H)``;
  3. trains ``--steps`` steps on its own shard (the CNN: disjoint slices of the training set;
     the LM: random windows from its own stream); every ``--eval`` steps (a multiple of K and
     H) rank 0 evaluates the full model (IST's assembled model, ``control`` traffic kept out
     of the method's bytes): test accuracy on 2000 test images (BatchNorm statistics
     recalibrated on 10 training batches first, for every method) / mean NLL on 32 fixed
     validation windows;
  4. writes its ledger's bytes and rank 0's curve (step, training wall time without
     evaluation, bytes sent by rank 0, metric) to RUN/rank0.json.
The driver prints and writes OUT/results.md: final metric, bytes sent per worker (mean; rank
0's for IST's central deployment, which stores the model), training wall time, and the curve.
Wall times are of one run on a shared machine (the load average is recorded beside them):
compare ratios within one table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

TASKS = ("cnn", "lm", "gpt2", "mobilenet")
IMAGES = ("cnn", "mobilenet")  # Fashion-MNIST; the others: tiny-shakespeare
METHODS = ("dp", "localsgd", "ist", "ist-none", "ist-old")
# ist-none: IST with scale="none"; ist-old: the old defaults (the residual stream cut, disjoint
# subnets, optimizer state reset); localsgdH (e.g. localsgd20): local SGD with period H


def _method(name: str) -> tuple[str, int | None]:
    """(method, local SGD period or None): ``localsgd20`` -> ("localsgd", 20)."""
    if name.startswith("localsgd") and name[len("localsgd"):].isdigit():
        return "localsgd", int(name[len("localsgd"):])
    return name, None


# --- the users' models ------------------------------------------------------------------------
class ResidualCNN(nn.Module):
    """A user's residual CNN for 28x28 images."""

    def __init__(self, c: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
                                  nn.ReLU())
        self.block1 = Residual(c)
        self.down = nn.Sequential(nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, bias=False),
                                  nn.GroupNorm(8, 2 * c), nn.ReLU())
        self.block2 = Residual(2 * c)
        self.head = nn.Linear(2 * c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block2(self.down(self.block1(self.stem(x))))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


class Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class EncoderLM(nn.Module):
    """A user's causal character LM on nn.TransformerEncoder."""

    def __init__(self, vocab: int, d: int = 64, heads: int = 4, layers: int = 2,
                 context: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n = idx.shape[1]
        h = self.emb(idx) + self.pos(torch.arange(n, device=idx.device))
        h = self.encoder(h, mask=self.get_buffer("mask")[:n, :n], is_causal=True)
        return self.head(self.norm(h))


class GrayMobileNet(nn.Module):
    """torchvision's MobileNetV3-small on a 1-channel image (repeated on 3 channels)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        from thinwire.models.torchvision_ops import define_missing_torchvision_ops

        define_missing_torchvision_ops()
        from torchvision.models import mobilenet_v3_small

        self.net = mobilenet_v3_small(num_classes=classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.expand(-1, 3, -1, -1))


def gpt2(vocab: int, context: int = 64) -> nn.Module:
    """``transformers``' GPT2LMHeadModel at 2 layers of 64 (no cache: a training forward)."""
    from thinwire.models.torchvision_ops import define_missing_torchvision_ops

    define_missing_torchvision_ops()  # transformers' model classes probe torchvision
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=context, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


# --- data ---------------------------------------------------------------------------------------
def _data_dir() -> Path:
    if os.environ.get("THINWIRE_DATA"):
        return Path(os.environ["THINWIRE_DATA"])
    for base in Path(__file__).resolve().parents[1].parents:
        if (base / "shared" / "data").is_dir():
            return base / "shared" / "data"
    return Path("shared/data")


class Task:
    """Data, model, loss and metric of one task for one rank."""

    def __init__(self, name: str, rank: int, workers: int, batch: int) -> None:
        self.name, self.rank, self.workers, self.batch = name, rank, workers, batch
        self.gen = torch.Generator().manual_seed(1000 + rank)
        if name in IMAGES:
            from thinwire.data.datasets import _load_fashion_mnist

            x_tr, y_tr, x_te, y_te = _load_fashion_mnist(None, False)
            x = torch.as_tensor(x_tr, dtype=torch.float32).reshape(-1, 1, 28, 28) / 255.0
            self.x, self.y = x[rank::workers], torch.as_tensor(y_tr, dtype=torch.long)[rank::workers]
            self.x_te = torch.as_tensor(x_te[:2000], dtype=torch.float32).reshape(
                -1, 1, 28, 28) / 255.0
            self.y_te = torch.as_tensor(y_te[:2000], dtype=torch.long)
        else:
            text = (_data_dir() / "tinyshakespeare" / "input.txt").read_text()
            chars = sorted(set(text))
            ids = torch.as_tensor([chars.index(c) for c in text], dtype=torch.long)
            self.vocab, self.context = len(chars), 64
            cut = int(0.9 * len(ids))
            self.train_ids, self.val_ids = ids[:cut], ids[cut:]
            g = torch.Generator().manual_seed(7)
            starts = torch.randint(0, len(self.val_ids) - self.context - 1, (32,), generator=g)
            self.val = torch.stack([self.val_ids[s:s + self.context + 1] for s in starts])

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        if self.name == "mobilenet":
            return GrayMobileNet()
        if self.name == "gpt2":
            return gpt2(self.vocab, self.context)
        return ResidualCNN() if self.name == "cnn" else EncoderLM(self.vocab)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.name in IMAGES:
            i = torch.randint(0, len(self.x), (self.batch,), generator=self.gen)
            return self.x[i], self.y[i]
        s = torch.randint(0, len(self.train_ids) - self.context - 1, (self.batch,),
                          generator=self.gen)
        w = torch.stack([self.train_ids[k:k + self.context + 1] for k in s])
        return w[:, :-1], w[:, 1:]

    @staticmethod
    def loss(out: Any, y: torch.Tensor) -> torch.Tensor:
        out = _logits(out)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def metric(self, model: nn.Module) -> float:
        if self.name in IMAGES:
            # BatchNorm statistics recalibrated on 10 training batches (on a copy), for every
            # method alike: IST's subnets ran with a share of the channels and scaled inputs,
            # so the running statistics they kept are not the full model's
            from thinwire.models.norms import recalibrate_batchnorm

            model = copy.deepcopy(model)
            gen = torch.Generator().manual_seed(3)
            recalibrate_batchnorm(model, [self.x[torch.randint(0, len(self.x), (64,),
                                                               generator=gen)]
                                          for _ in range(10)], running=True)
            model.eval()
            return float((_logits(model(self.x_te)).argmax(1) == self.y_te).float().mean())
        model.eval()
        nll = float(self.loss(model(self.val[:, :-1]), self.val[:, 1:]))
        model.train()
        return nll


# --- a worker -----------------------------------------------------------------------------------
def worker(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    import thinwire
    from thinwire.runtime.comm import Comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = Comm()
    task = Task(a.task, rank, n, a.batch)
    model = task.model()
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    x0, _ = task.next_batch()
    ist = local = None
    method, period = _method(a.method)
    if method.startswith("ist"):
        old = ({"residual": "channels", "overlap": 1, "optimizer_state": "reset"}
               if method == "ist-old" else {})
        ist = thinwire.IST(model, opt, comm=comm, local_steps=a.local_steps, example_input=x0,
                           scale="none" if method == "ist-none" else None, **old)
    elif method == "localsgd":
        local = thinwire.LocalSGD(model, opt, period or a.period, comm=comm)
    curve: list[dict[str, Any]] = []
    train_s = 0.0
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        x, y = task.next_batch()
        opt.zero_grad()
        task.loss(model(x), y).backward()
        if a.method == "dp":
            grads = []
            for p in model.parameters():
                assert p.grad is not None  # every parameter is used by the loss
                grads.append(p.grad)
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, op="avg", tag="grad")
            at = 0
            for g in grads:
                g.copy_(flat[at:at + g.numel()].view_as(g))
                at += g.numel()
        opt.step()
        train_s += time.perf_counter() - t0
        if step % a.eval == 0 or step == a.steps:
            full = ist.full_model() if ist is not None else (model if rank == 0 else None)
            if rank == 0 and full is not None:
                totals = comm.ledger.by_op()
                sent = sum(v["sent"] for k, v in totals.items() if not k.endswith(":control"))
                curve.append({"step": step, "train_s": round(train_s, 3), "sent": sent,
                              "metric": task.metric(full)})
    totals = comm.ledger.by_op()
    sent = sum(v["sent"] for k, v in totals.items() if not k.endswith(":control"))
    buf = torch.tensor([float(sent)])
    gathered = [torch.zeros(1) for _ in range(n)]
    dist.all_gather(gathered, buf)
    sent_all = [int(t.item()) for t in gathered]
    if local is not None:
        local.close()
    if rank == 0:
        Path(a.run_dir, "rank0.json").write_text(json.dumps(
            {"curve": curve, "sent": sent_all, "train_s": train_s,
             "groups": [g.name for g in ist.plan.groups] if ist is not None else []}))
    dist.barrier()
    dist.destroy_process_group()


# --- the driver ---------------------------------------------------------------------------------
def _time_to(curve: list[dict[str, Any]], goal: float | None, task: str) -> str:
    """Training seconds (rank 0) to the first evaluation at ``goal`` (DP's final metric:
    accuracy at or above it, NLL at or below it), or "not reached"."""
    if goal is None:
        return ""
    for c in curve:
        if (c["metric"] >= goal) if task in IMAGES else (c["metric"] <= goal):
            return f"{c['train_s']:.1f} (step {c['step']})"
    return "not reached"



def _run(a: argparse.Namespace, task: str, method: str, run_dir: Path) -> dict[str, Any]:
    from thinwire.testbed.netns import Testbed
    from thinwire.testbed.rates import parse_links
    from thinwire.testbed.run import run_processes, worker_env

    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--task", task,
            "--method", method, "--run-dir", str(run_dir), "--steps", str(a.steps),
            "--eval", str(a.eval), "--batch", str(a.batch[task]), "--lr", str(a.lr[task]),
            "--local-steps", str(a.local_steps), "--period", str(a.period)]
    deadline = time.monotonic() + a.timeout
    if a.link == "loopback":
        # the store listens here on a port of the kernel's choice and every rank is its client
        # (TORCHELASTIC_USE_AGENT_STORE): no port is picked, released and bound again later
        from thinwire.launch import loopback_store

        store, port = loopback_store()
        try:
            specs = [(argv, {**worker_env(r, a.workers, "127.0.0.1", port, "lo", 1),
                             "TORCHELASTIC_USE_AGENT_STORE": "True"})
                     for r in range(a.workers)]
            wall = run_processes(specs, run_dir, deadline)
        finally:
            del store
    else:
        link = parse_links(a.link)[0]
        with Testbed(a.workers, link) as tb:
            specs = [(tb.exec_argv(r, argv), worker_env(r, a.workers, tb.addr(0), 29531,
                                                         tb.ifname(r), 1))
                     for r in range(a.workers)]
            wall = run_processes(specs, run_dir, deadline)
    out = json.loads((run_dir / "rank0.json").read_text())
    out["wall_s"] = wall
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--task", choices=TASKS)
    p.add_argument("--method")
    p.add_argument("--out", default="runs/ist_user")
    p.add_argument("--link", default="loopback", help="loopback, or a rate for the testbed")
    p.add_argument("--tasks", default="cnn,lm")
    p.add_argument("--methods", default="dp,localsgd,ist")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval", type=int, default=100)
    p.add_argument("--batch", default="")
    p.add_argument("--lr", default="")
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--period", type=int, default=10)
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args(argv)
    if a.worker:
        a.batch, a.lr = int(a.batch), float(a.lr)
        worker(a)
        return 0
    tasks = [t for t in a.tasks.split(",") if t]
    methods = [m for m in a.methods.split(",") if m]
    periods = [_method(m)[1] or a.period for m in methods if _method(m)[0] == "localsgd"]
    if (any(t not in TASKS for t in tasks) or any(_method(m)[0] not in METHODS + ("localsgd",)
                                                  for m in methods)
            or a.eval % a.local_steps or any(a.eval % p for p in periods)):
        print(f"error: --tasks from {','.join(TASKS)}, --methods from {','.join(METHODS)}; "
              "--eval a multiple of --local-steps and --period", file=sys.stderr)
        return 2
    a.batch = {"cnn": 32, "lm": 16, "gpt2": 16, "mobilenet": 32}
    a.lr = {"cnn": 0.003, "lm": 0.003, "gpt2": 0.003, "mobilenet": 0.003}
    load = Path("/proc/loadavg").read_text().split()[:3]
    lines = [f"# IST on user models, {a.workers} workers, link {a.link}",
             f"load average before: {' '.join(load)}; {a.steps} steps, eval every {a.eval}, "
             f"IST K = {a.local_steps}, local SGD H = {a.period}", ""]
    for task in tasks:
        metric = "test accuracy" if task in IMAGES else "val NLL"
        lines += [f"## {task}", "", f"| method | {metric} | sent per worker (mean) | "
                  "rank 0 sent | train s (rank 0) | wall s | s to DP's final | curve (step: "
                  "metric @ MB) |", "|---|---|---|---|---|---|---|---|"]
        runs = {m: _run(a, task, m, Path(a.out) / task / m) for m in methods}
        goal = runs["dp"]["curve"][-1]["metric"] if "dp" in runs else None
        for method, r in runs.items():
            last = r["curve"][-1]
            curve = "; ".join(f"{c['step']}: {c['metric']:.3f} @ {c['sent'] / 1e6:.1f}"
                              for c in r["curve"])
            lines.append(f"| {method} | {last['metric']:.4f} | "
                         f"{np.mean(r['sent']) / 1e6:.2f} MB | {r['sent'][0] / 1e6:.2f} MB | "
                         f"{r['train_s']:.1f} | {r['wall_s']:.1f} | "
                         f"{_time_to(r['curve'], goal, task)} | {curve} |")
            print(lines[-1], flush=True)
        lines.append("")
    lines.append(f"load average after: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""IST beyond fully connected nets: the GPT (heads and FFN neurons), the ResNet (ResIST's dealt
residual blocks) and the GCN (GIST's hidden features, on Cora and on a 100k-node stochastic
block model) against data parallelism and local SGD, at 4 workers.

    python benchmarks/ist_models.py --out runs/ist_models            # every family
    python benchmarks/ist_models.py --out runs/ist_models gpt resnet # some of them
    python benchmarks/ist_models.py widths      # GIST's widths, counted (no training)

Each family is one ``thinwire compare`` (same data, model, batch, optimizer and steps for every
method), printed as its table (final metric, NLL, bytes sent per worker mean and max, parameters
trained per worker, wall time), followed by a memory table from the runs' summary.json:
parameters, gradients and optimizer state of the most loaded worker. Every family compares
dp, localsgd (H = 10), ist at the model's default K and activation scaling, and one row of IST
with the alternative scaling (``scale=none``). ``THINWIRE_DATA`` names the folder holding
``tinyshakespeare/`` and ``cora/`` (default: the copies that ship with the package). Sizes are small enough for a
loaded 2-core machine (each family a few minutes); wall times are of one run on a shared machine:
compare them within a table only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from thinwire.report.tables import fmt_bytes


def _data_root() -> Path:
    """``$THINWIRE_DATA``, else the data that ships with the package."""
    if os.environ.get("THINWIRE_DATA"):
        return Path(os.environ["THINWIRE_DATA"])
    from thinwire.data.text import BUNDLED_DIR

    return BUNDLED_DIR


DATA = _data_root()

FAMILIES: dict[str, list[str]] = {
    "gpt": ["--model", "gpt", "--data", "tinyshakespeare", "--data.dir",
            str(DATA / "tinyshakespeare"), "--data.seq_len", "64", "--model.n_layer", "2",
            "--model.d_model", "64", "--model.n_head", "4", "--train.optimizer", "adamw",
            "--train.lr", "0.003", "--train.batch_size", "32", "--train.steps", "400",
            "--train.eval_every", "100",
            "--methods", "dp,localsgd,ist,ist:scale=none"],
    "resnet": ["--model", "resnet", "--data", "digits", "--model.widths", "8,16,32",
               "--model.blocks", "5,5,5", "--train.steps", "200", "--train.eval_every", "50",
               "--methods", "dp,localsgd,ist,ist:scale=none"],
    "gcn": ["--model", "gcn", "--data", "cora", "--data.dir", str(DATA / "cora"),
            "--model.hidden", "256", "--model.layers", "3", "--model.norm", "layer",
            "--train.optimizer", "adamw", "--train.lr", "0.01", "--train.batch_size", "32",
            "--train.steps", "200",
            "--train.eval_every", "20", "--methods", "dp,localsgd,ist,ist:scale=none"],
    "sbm": ["--model", "gcn", "--data", "sbm", "--model.hidden", "64", "--model.layers", "3",
            "--model.norm", "layer", "--train.optimizer", "adamw", "--train.lr", "0.01",
            "--train.batch_size", "32", "--train.steps", "40", "--train.eval_every", "20",
            "--methods", "dp,localsgd,ist"],
}


def widths_table(widths: tuple[int, ...] = (4096, 16384, 32768), nodes: int = 100_000,
                 features: int = 128, classes: int = 10) -> str:
    """GIST's claim in numbers: a 3-layer GCN on the SBM's shape (nodes x features, classes)
    at growing hidden width, counted on the meta device (no memory) and cut by its adapter; a
    worker's subnet from the planner (:func:`~thinwire.planner.methods.worker_params`). Model
    state: parameters + gradients + Adam's two moments (16 bytes per parameter, float32);
    activations: one float per node and feature of each of the two hidden layers, twice (the
    pre-norm and post-norm copies autograd keeps), a worker holding 1/n of the features."""
    import warnings

    import torch

    from thinwire.models.gcn import GCN, GISTAdapter
    from thinwire.planner.methods import worker_params
    from thinwire.planner.presets import model_spec_from_module

    lines = ["| hidden width | parameters | model state, 1 device | activations, 1 device "
             "| model state / worker, n = 4 | activations / worker, n = 4 "
             "| model state / worker, n = 8 |", "|---:|---:|---:|---:|---:|---:|---:|"]
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    for h in widths:
        with torch.device("meta"):
            adjacency = torch.sparse_coo_tensor(torch.zeros(2, 1, dtype=torch.long),
                                                torch.zeros(1), (nodes, nodes))
            model = GCN(torch.empty(nodes, features), adjacency, classes, hidden=h, layers=3,
                        norm="layer")
        spec = model_spec_from_module(model, f"gcn-{h}", adapter=GISTAdapter(model))
        act = 2 * 2 * nodes * h * 4
        lines.append(f"| {h} | {spec.params / 1e6:.1f}M | {fmt_bytes(16 * spec.params)} | "
                     f"{fmt_bytes(act)} | {fmt_bytes(16 * worker_params(spec, 4))} | "
                     f"{fmt_bytes(act / 4)} | {fmt_bytes(16 * worker_params(spec, 8))} |")
    return "\n".join(lines)


def memory_table(out: Path) -> str:
    lines = ["| run | params | grads | optimizer state | params + optimizer state |",
             "|---|---:|---:|---:|---:|"]
    for path in sorted(out.glob("*/summary.json")):
        s = json.loads(path.read_text())
        m = s["memory"]
        both = m["params_bytes_max"] + m["optimizer_bytes_max"]
        lines.append(f"| {s['label']} | {fmt_bytes(m['params_bytes_max'])} | "
                     f"{fmt_bytes(m['grads_bytes_max'])} | {fmt_bytes(m['optimizer_bytes_max'])} "
                     f"| {fmt_bytes(both)} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("families", nargs="*", default=[*FAMILIES, "widths"],
                   help=f"any of {', '.join(FAMILIES)}, widths (default: all)")
    p.add_argument("--out", default="runs/ist_models")
    p.add_argument("--workers", type=int, default=4)
    args = p.parse_args()
    if "widths" in args.families:
        print("## widths (GIST: widths one device cannot hold)\n")
        print(widths_table() + "\n", flush=True)
        args.families = [f for f in args.families if f != "widths"]
    for fam in args.families:
        if fam not in FAMILIES:
            p.error(f"unknown family {fam!r}; use any of {', '.join(FAMILIES)}")
    for fam in args.families:
        out = Path(args.out) / fam
        cmd = [sys.executable, "-m", "thinwire", "compare", *FAMILIES[fam], "--workers",
               str(args.workers), "--out", str(out), "--overwrite", "--no-progress"]
        print(f"## {fam}\n\n    thinwire compare {' '.join(cmd[4:])}\n", flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            print(r.stderr[-3000:], file=sys.stderr)
            raise SystemExit(r.returncode)
        table = [line for line in r.stdout.splitlines() if line.startswith(("|", "Bytes"))]
        print("\n".join(table) + "\n\nMemory of the most loaded worker (bytes, float32):\n")
        print(memory_table(out) + "\n", flush=True)


if __name__ == "__main__":
    main()

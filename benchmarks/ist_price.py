"""Price IST for a user's own model from its graph-derived plan, without training it.

    python benchmarks/ist_price.py --model FILE.py:ClassName --input 8x1x28x28 \
        [--tokens VOCAB] [--workers 4] [--steps 1000] [--local-steps 10] [--period 10]

1. builds ``ClassName()`` from FILE.py (its constructor's defaults);
2. derives the IST plan from one input of the given shape (``--tokens V``: integer ids below
   V, for a model that embeds tokens; else standard normal floats), with
   :func:`thinwire.models.graph_adapter.derive_adapter`;
3. prints the unit groups, and the bytes every rank sends over ``--steps`` steps for IST (the
   ``ist`` method's exact traffic formula on that plan, the one its ledger equals), data
   parallelism (a ring all-reduce of every parameter each step) and local SGD (one every
   ``--period`` steps), in float32.
Bad input is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

from thinwire.errors import UsageError
from thinwire.models.graph_adapter import derive_adapter
from thinwire.strategies.ist.method import Options, ist_traffic
from thinwire.strategies.traffic import ring_all_reduce


def _load(spec: str) -> type:
    path, _, name = spec.rpartition(":")
    if not path or not name or not Path(path).is_file():
        raise UsageError(f"--model {spec!r}: use FILE.py:ClassName with an existing file")
    sys.path.insert(0, str(Path(path).resolve().parent))
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise UsageError(f"--model {spec!r}: {path} defines no class {name}")
    return cls


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--input {text!r}: use sizes joined by x, e.g. 8x1x28x28") from None
    if not shape or min(shape) < 1:
        raise UsageError(f"--input {text!r}: every size must be >= 1")
    return shape


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--tokens", type=int, default=0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--period", type=int, default=10)
    a = p.parse_args(argv)
    try:
        if a.workers < 2 or a.steps < 1 or a.local_steps < 1 or a.period < 1:
            raise UsageError("--workers must be >= 2, --steps, --local-steps, --period >= 1")
        model = _load(a.model)()
        shape = _shape(a.input)
        torch.manual_seed(0)
        x = (torch.randint(0, a.tokens, shape) if a.tokens > 0 else torch.randn(shape))
        adapter = derive_adapter(model, x, min_units=a.workers)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plan = adapter.plan
    params = sum(t.numel for t in plan.tensors if not t.buffer)
    cut = sum(t.numel for t in plan.tensors if not t.buffer and not t.shared)
    print(f"{type(model).__name__}: {params} parameters, {cut} in cut tensors; groups: "
          + ", ".join(f"{g.name} ({g.size})" for g in plan.groups))
    ist = ist_traffic(plan, Options(local_steps=a.local_steps), a.workers, a.steps, seed=0)
    dp = ring_all_reduce(4 * params, a.workers) * a.steps
    local = ring_all_reduce(4 * params, a.workers) * (a.steps // a.period)
    print(f"bytes sent per rank over {a.steps} steps at n = {a.workers} "
          f"(IST K = {a.local_steps}, local SGD H = {a.period}):")
    print(f"  ist (central): rank 0 {ist.sent[0] / 1e6:.2f} MB, mean {ist.sent_mean / 1e6:.2f} MB")
    print(f"  dp:            {dp / 1e6:.2f} MB")
    print(f"  localsgd:      {local / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

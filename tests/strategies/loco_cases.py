"""Shared pieces of the low-communication method tests: a small MLP, per-rank batches, runs of a
method through the real strategy with its ledger."""

from __future__ import annotations

import io
from typing import Any

import torch

from thinwire.builders import build_strategy
from thinwire.config import load
from thinwire.data.task import TASKS
from thinwire.models import build_mlp
from thinwire.runtime.comm import Comm

IN, OUT, LR = 8, 4, 0.1


def cfg(name: str, **method: Any):
    return load(None, {"method.name": name, "model.hidden": "16,16", "model.norm": "none",
                       "train.lr": LR, "train.eval_every": 12,
                       **{f"method.{k}": v for k, v in method.items()}})


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, IN, generator=g), torch.randint(0, OUT, (16,), generator=g)


def model() -> torch.nn.Module:
    return build_mlp(IN, (16, 16), OUT, norm="none", seed=0)


def strategy(comm: Comm, config: Any):
    m = model()
    return build_strategy(config, comm, torch.device("cpu"), TASKS["classification"], m), m


def flat(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def run(comm: Comm, config: Any, steps: int) -> dict[str, Any]:
    s, m = strategy(comm, config)
    mark = comm.ledger.mark()
    for step in range(steps):
        s.train_step(batch(comm.rank, step), step)
    s.close()
    entries = comm.ledger.entries[mark:]
    return {"params": flat(m), "sent": sum(e.sent for e in entries),
            "payload": sum(e.payload for e in entries),
            "ledger": [(e.op, e.tag, e.payload) for e in entries]}


def resumes_exactly(config: Any, first: int, then: int) -> bool:
    """A run checkpointed after ``first`` steps (through torch.save / weights_only load) and
    resumed in a fresh strategy continues bit for bit for ``then`` more steps (one process)."""
    comm = Comm.local()
    a, model_a = strategy(comm, config)
    for step in range(first):
        a.train_step(batch(0, step), step)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b, model_b = strategy(comm, config)
    b.load_state_dict(torch.load(buf, weights_only=True))
    for step in range(first, first + then):
        a.train_step(batch(0, step), step)
        b.train_step(batch(0, step), step)
    return torch.equal(flat(model_a), flat(model_b)) and not torch.equal(
        flat(model_a), flat(model())) and torch.equal(
        torch.cat([v.reshape(-1) for v in _tensors(a.state_dict())]),
        torch.cat([v.reshape(-1) for v in _tensors(b.state_dict())]))


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state.float()]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in _tensors(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []

"""SparseLoCo (``sparseloco``): DiLoCo's rounds with a chunked top-k, 2-bit pseudo-gradient and a
local error-feedback accumulator in place of the outer momentum.

Sarfi, Therien, Lidin and Belilovsky, "Communication Efficient LLM Pre-training with SparseLoCo"
(arXiv 2508.15706), Algorithm 1. Every worker r holds the global parameters theta (identical on
all ranks), its replica theta_r and its accumulator e_r (zero at first). Each outer round:
  1. H = ``period`` inner optimizer steps (the paper's: AdamW) from theta;
  2. pseudo-gradient delta_r = theta - theta_r;
  3. e_r <- beta e_r + delta_r (the decayed accumulator plays the outer momentum's part);
  4. delta_hat_r = Q(TopK(e_r)): the flat e_r is cut into chunks of ``chunk`` elements and the
     ``topk`` entries of largest magnitude of each chunk are kept (the paper: 1-3 % density),
     their values quantised to 2 bits (the registry's codec ``topk2bit``,
     :class:`~thinwire.compression.chunked.ChunkTopK2Bit`);
  5. e_r <- e_r - delta_hat_r (what the wire did not carry stays for later rounds);
  6. delta = mean_r delta_hat_r: every rank's payload all-gathered through the ledger (tag
     ``average``), decoded and summed in rank order in fp32, divided by R;
  7. theta <- theta - ``outer_lr`` delta; theta_r <- theta.

The 2-bit quantiser (ours; the paper's is a 2-bit quantiser of the kept values, its exact form
not fixed there) is :mod:`thinwire.compression.chunked`'s. Per round a rank hands
K (2 + 1/4) + 8 C bytes to one all-gather (K kept values, C chunks): at 64 of 4096, 1/227 of
the dense fp32 pseudo-gradient.

:class:`SparseLoCo` runs this around a user's model and inner optimizer::

    with thinwire.SparseLoCo(model, inner_optimizer, sync_every=50, topk=64, chunk=4096):
        ...  # the usual loop with inner_optimizer.step()
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from thinwire.compression.base import from_bytes, to_bytes
from thinwire.compression.registry import build
from thinwire.options import check, opt
from thinwire.runtime.comm import Comm
from thinwire.strategies.averaging import PeriodicSync
from thinwire.strategies.base import (
    Context,
    MemoryReport,
    WrappedStrategy,
    flat_params,
    load_flat,
)
from thinwire.strategies.entry import MethodEntry, Recovery
from thinwire.strategies.traffic import Layout, Traffic


class SparseLoCo(PeriodicSync):
    """SparseLoCo's outer loop around ``model`` (module docstring): after every
    ``sync_every``-th step of ``inner_optimizer``, steps 2-7. ``replica``: over a torchft
    quorum (:mod:`thinwire.strategies.averaging`, steps a-c: step 7 applied only if the quorum
    commits); a joiner copies theta, its accumulator e_r (per rank) starts at zero."""

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                 sync_every: int, *, comm: Comm | None = None, outer_lr: float = 1.0,
                 beta: float = 0.95, chunk: int = 4096, topk: int = 64,
                 tag: str = "average", replica: Any = None) -> None:
        super().__init__(model, sync_every, comm=comm, tag=tag, replica=replica)
        self.outer_lr, self.beta = outer_lr, beta
        # the accumulator is its error feedback (steps 3, 5): none of the codec's own
        self.codec = build("topk2bit", chunk=chunk, topk=topk, ef=False)
        self.global_flat = flat_params(model).clone()
        self.error = torch.zeros_like(self.global_flat)
        self._hook_on(inner_optimizer)

    def sync(self) -> None:
        """Steps 2-7."""
        with torch.no_grad():
            d = self.global_flat.numel()
            # 2. pseudo-gradient; 3. into the accumulator
            delta = self.global_flat - flat_params(self.model)
            self.error.mul_(self.beta).add_(delta)
            # 4. top-k of each chunk, 2 bits a value (deterministic: step and key 0);
            # 5. what is sent leaves the accumulator
            payload = self.codec.encode(self.error, 0)
            self.error.sub_(self.codec.decode(payload, d, 0))
            # 6. every rank's payload, decoded and summed in rank order, over R
            wire = to_bytes(payload)
            rows = self.comm.all_gather(wire, tag=self.tag)
            spec = self.codec.spec(d)
            mean = torch.zeros_like(self.global_flat)
            for row in rows:
                self.codec.decode_add(from_bytes(row, spec), mean, 0)
            mean.div_(len(rows))
            if not self.commit():  # over a quorum: refused, the round-start state is back
                return
            # 7. the outer step; the replica restarts from theta
            self.global_flat.sub_(mean, alpha=self.outer_lr)
            load_flat(self.model, self.global_flat)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "global": self.global_flat.clone(),
                "error": self.error.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.global_flat.copy_(state["global"])
        self.error.copy_(state["error"])

    def shared_state(self) -> dict[str, Any]:
        """:meth:`state_dict` less the accumulator, which is this rank's own."""
        out = self.state_dict()
        del out["error"]
        return out

    def load_shared_state(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.global_flat.copy_(state["global"])
        self.error.zero_()


@dataclass(frozen=True)
class Options:
    period: int = opt(10, "inner steps between outer steps (H)")
    outer_lr: float = opt(1.0, "outer learning rate (alpha)")
    beta: float = opt(0.95, "decay of the error-feedback accumulator")
    chunk: int = opt(4096, "elements per top-k chunk (<= 32768)")
    topk: int = opt(64, "entries kept per chunk")

    def __post_init__(self) -> None:
        check(self.period >= 1, "method.period", "must be >= 1")
        check(self.outer_lr > 0, "method.outer_lr", "must be > 0")
        check(0 <= self.beta < 1, "method.beta", "must be in [0, 1)")
        check(1 <= self.chunk <= 32768, "method.chunk", "must be in [1, 32768]")
        check(1 <= self.topk <= self.chunk, "method.topk",
              f"must be in [1, method.chunk = {self.chunk}]")


class SparseLoCoStrategy(WrappedStrategy):
    name = "sparseloco"
    state_key = "sparseloco"

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        super().__init__(ctx, model)
        o: Options = ctx.options
        self.wrapper = SparseLoCo(self.model, self.opt, o.period, comm=self.comm,
                                  outer_lr=o.outer_lr, beta=o.beta, chunk=o.chunk, topk=o.topk,
                                  replica=ctx.replica)

    def memory(self) -> MemoryReport:
        """Inner state as local SGD's; theta and the accumulator count as optimizer state."""
        inner = super().memory()
        flat = self.wrapper.global_flat
        extra = 2 * flat.numel() * flat.element_size()
        return dataclasses.replace(inner, optimizer=inner.optimizer + extra)


def traffic(layout: Layout, options: Options, workers: int, steps: int, seed: int,
            optimizer_states: int = 0) -> Traffic:
    """One all-gather of ``topk2bit``'s payload of the whole model per round."""
    del seed, optimizer_states
    payload = build("topk2bit", chunk=options.chunk, topk=options.topk,
                    ef=False).payload_bytes(layout.numel)
    return Traffic.uniform(workers, "all_gather", [payload] * (steps // options.period))


METHOD = MethodEntry(
    name="sparseloco",
    summary="SparseLoCo: H inner steps, chunked top-k 2-bit pseudo-gradient, local error "
            "feedback for outer momentum",
    strategy="thinwire.strategies.sparseloco:SparseLoCoStrategy", options=Options,
    label=lambda o: f"sparseloco(H={o.period},k={o.topk}/{o.chunk})",
    sync_every=lambda o: o.period, traffic=traffic, memory=("recompute",), fault_tolerant=True,
    recovery=lambda o: Recovery(copies=2, lost_steps=o.period,
                                parts=("model", "optimizer", "theta")))

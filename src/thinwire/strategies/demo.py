"""DeMo (``demo``): decoupled momentum; each step the workers exchange only the top-k of a chunked
DCT of their momenta and step with the sign of the mean.

Peng, Quesnelle and Kingma, "DeMo: Decoupled Momentum Optimization" (arXiv 2411.19870),
Algorithm 1. Every worker keeps its own momentum m (zero at first, never averaged); at each step,
for every parameter with gradient g:
  1. decoupled weight decay: theta <- (1 - lr wd) theta;
  2. m <- beta m + lr g;
  3. q = TopK(DCT(m)): the parameter is viewed as a matrix (rows = its first dimension, a
     vector as one row) and cut into blocks of s_r x s_c, each the largest divisor of its
     dimension <= ``chunk`` (the reference code's rule); an orthonormal 2-D DCT-II of each
     block; the ``topk`` coefficients of largest magnitude of each block are kept (the
     registry's codec ``dcttopk``, :class:`~thinwire.compression.dct.DCTTopK`);
  4. m <- m - IDCT(q): what was extracted leaves the momentum (the rest is error feedback);
  5. every rank's q (int16 offsets within the block, fp32 values) of every parameter goes in
     one all-gather through the ledger (tag ``grad``);
  6. u = IDCT(mean_r q_r), the coefficients summed in rank order and divided by R;
  7. theta <- theta - lr sign(u) (signSGD on the shared fast components).
Replicas stay identical (every rank applies the same u); only the momenta differ.

Over a torchft quorum (``replica``; torchft's ``OptimizerWrapper`` shape, docs/
FAULT_TOLERANCE.md) every step is an outer step: ``zero_grad`` forms the step's quorum (a
joiner copies a live peer's parameters and step count; its momentum, this rank's own, starts
at zero), the all-gather of step 5 runs over the live members (R = the live count), and steps
1 and 7 are applied only if the quorum commits; refused, the momenta are put back as they
were before the step.

Per step a rank hands sum over parameters of (blocks x min(topk, block size)) x 6 bytes to the
all-gather: at the paper's chunk 64 and topk 32, about 6 / (4 x 128) of the dense fp32 gradient
for matrices whose sides are multiples of 64.

:class:`DeMo` is the optimizer for a user's own loop (the reference code's shape)::

    opt = thinwire.DeMo(model.parameters(), lr=1e-3, topk=32, chunk=64)
    ...  # loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from thinwire.compression.base import Part, Site, from_bytes, to_bytes
from thinwire.compression.dct import DCTTopK, kept
from thinwire.errors import UsageError
from thinwire.options import check, opt
from thinwire.runtime.comm import Comm
from thinwire.strategies.base import Context, ReplicatedStrategy
from thinwire.strategies.entry import MethodEntry, Recovery
from thinwire.strategies.traffic import Layout, Traffic

_SITE = Site(0)
"""Where DeMo encodes: the DCT codec draws no randomness and keeps no state, so one site."""


class DeMo(torch.optim.Optimizer):
    """DeMo (module docstring) over ``params``: ``step()`` runs steps 1-7 with one all-gather
    through ``comm`` (default ``Comm()``)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, *, beta: float = 0.999,
                 topk: int = 32, chunk: int = 64, weight_decay: float = 0.0,
                 comm: Comm | None = None, tag: str = "grad", replica: Any = None) -> None:
        if lr <= 0 or not 0 <= beta < 1 or topk < 1 or not 1 <= chunk <= 181:
            raise UsageError(f"DeMo needs lr > 0, beta in [0, 1), topk >= 1 and chunk in "
                             f"[1, 181] (int16 offsets), got lr={lr}, beta={beta}, "
                             f"topk={topk}, chunk={chunk}")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.beta, self.topk, self.chunk = beta, topk, chunk
        self.replica = replica
        self.comm = (replica.comm if replica is not None
                     else comm if comm is not None else Comm())
        self.tag = tag
        # the registry's dcttopk without error feedback: step 4 is DeMo's own
        self.codec = DCTTopK(chunk, topk)
        self._dct = self.codec.bases  # the cached DCT bases
        self.clock = 0
        self.history: list[tuple[int, list[int], bool]] = []
        self._open = False
        self._members: list[int] = []
        if replica is not None:
            replica.attach("demo", self._ft_state, self._ft_load)

    # --- over a torchft quorum ----------------------------------------------------------------
    def begin_round(self) -> None:
        """The step's quorum (a joiner recovers here); nothing if open or without a replica."""
        if self.replica is None or self._open:
            return
        self.replica.begin()
        self._members = self.replica.members()
        self._open = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.begin_round()
        super().zero_grad(set_to_none=set_to_none)

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _ft_state(self) -> dict[str, Any]:
        return {"params": [p.detach() for p in self._params()], "clock": self.clock}

    def _ft_load(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for p, saved in zip(self._params(), state["params"]):
                p.copy_(saved)
        self.state.clear()  # this rank's momenta start at zero
        self.clock = int(state["clock"])

    def _commit(self, momenta: dict[Any, torch.Tensor]) -> bool:
        """The quorum's vote; refused: the momenta as they were before the step."""
        self.clock += 1
        if self.replica is None:
            return True
        self.begin_round()  # a step() without zero_grad() first
        kept = bool(self.replica.commit())
        self._open = False
        self.history.append((self.clock, list(self._members), kept))
        if not kept:
            for p, m in momenta.items():
                self.state[p]["momentum"].copy_(m)
        return kept

    def close(self) -> None:
        """Free the cached DCT bases (rebuilt on the next step if training goes on); as for
        every public wrapper, ``with DeMo(...) as opt:`` calls it on leaving the block."""
        self._dct.clear()

    def __enter__(self) -> DeMo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: ANN401 - the Optimizer signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items: list[tuple[torch.Tensor, float, float, int]] = []
        idx_parts, val_parts = [], []
        before: dict[Any, torch.Tensor] = {}
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p, dtype=torch.float32)
                m = state["momentum"]
                if self.replica is not None:
                    before[p] = m.clone()
                # 2. m <- beta m + lr g
                m.mul_(self.beta).add_(p.grad.float(), alpha=lr)
                # 3. top-k of each block's DCT
                site = _SITE
                payload = self.codec.encode_tensor(m, site)
                # 4. the extracted part leaves the momentum
                m.sub_(self.codec.decode_tensor(payload, m.shape, site))
                idx_parts.append(payload[0])
                val_parts.append(payload[1])
                items.append((p, lr, wd, payload[0].numel()))
        if not items:
            self._commit(before)
            return loss
        # 5. one all-gather of every parameter's coefficients
        wire = to_bytes((torch.cat(idx_parts), torch.cat(val_parts)))
        total = sum(n for *_, n in items)
        spec = (Part(total, torch.int16), Part(total, torch.float32))
        rows = self.comm.all_gather(wire, tag=self.tag)
        if not self._commit(before):
            return loss
        decoded = [from_bytes(r, spec) for r in rows]
        at = 0
        for p, lr, wd, n in items:
            # 1. decoupled weight decay (applied with the step: only a kept step moves p)
            if wd:
                p.mul_(1 - lr * wd)
            # 6. the coefficients summed in rank order, over R; u = IDCT
            acc = self.codec.coefficients(p.shape, p.device)
            for idx, val in decoded:
                self.codec.add_coefficients((idx[at:at + n], val[at:at + n]), acc)
            acc.div_(len(decoded))
            u = self.codec.inverse(acc, p.shape)
            # 7. signSGD on u
            p.add_(torch.sign(u).to(p.dtype), alpha=-lr)
            at += n
        return loss


@dataclass(frozen=True)
class Options:
    beta: float = opt(0.999, "momentum decay (the reference code's compression_decay)")
    topk: int = opt(32, "DCT coefficients kept per block")
    chunk: int = opt(64, "largest block side (a divisor of each dimension <= this)")

    def __post_init__(self) -> None:
        check(0 <= self.beta < 1, "method.beta", "must be in [0, 1)")
        check(self.topk >= 1, "method.topk", "must be >= 1")
        check(1 <= self.chunk <= 181, "method.chunk", "must be in [1, 181] (int16 offsets)")


class DeMoStrategy(ReplicatedStrategy):
    name = "demo"

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        super().__init__(ctx, model)
        o: Options = ctx.options
        t = self.cfg.train
        self.opt = DeMo(self.model.parameters(), lr=t.lr, beta=o.beta, topk=o.topk,
                        chunk=o.chunk, weight_decay=t.weight_decay, comm=self.comm,
                        replica=ctx.replica)
        if ctx.replica is not None:  # a joiner also takes the model's buffers
            ctx.replica.attach("model", self.model.state_dict, self.model.load_state_dict)

    @property
    def quorum(self) -> DeMo:
        """What opens each step's quorum and records it (``thinwire.ft_trainer``)."""
        return self.opt


def traffic(layout: Layout, options: Options, workers: int, steps: int, seed: int,
            optimizer_states: int = 0) -> Traffic:
    """One all-gather a step of 6 bytes (int16 offset, fp32 value) per kept coefficient."""
    del seed, optimizer_states
    payload = 6 * sum(kept(p.shape, options.chunk, options.topk) for p in layout.params)
    return Traffic.uniform(workers, "all_gather", [payload] * steps)


def _check(cfg: Any) -> None:
    if cfg.train.optimizer != "sgd" or cfg.train.momentum:
        raise UsageError("method demo is its own optimizer (decoupled momentum, sign step): "
                         "leave train.optimizer at sgd and train.momentum at 0")


METHOD = MethodEntry(
    name="demo",
    summary="DeMo: local momenta, all-gather of the top-k of their chunked DCT, sign step",
    strategy="thinwire.strategies.demo:DeMoStrategy", options=Options,
    label=lambda o: f"demo(k={o.topk}/{o.chunk}x{o.chunk})", traffic=traffic,
    check=_check, memory=("recompute",), fault_tolerant=True,
    # the parameters twice (the optimizer's and the model's state), the momenta start at zero
    recovery=lambda o: Recovery(copies=2, optimizer=False, lost_steps=1,
                                parts=("model", "parameters")))

"""Pipeline model parallelism: a model's chain cut into stages, micro-batches, GPipe and 1F1B.

GPipe: Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
Parallelism" (NeurIPS 2019). 1F1B: Narayanan et al., "PipeDream" (SOSP 2019) and "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC 2021), the
non-interleaved one-forward-one-backward schedule.

:class:`Pipeline` is what a user calls from their own loop: built on every rank of a pipeline
group with the model's chain (``ModelEntry.chain``: modules whose composition is the model), it
keeps this rank's stage and, for each mini-batch, accumulates the stage's parameter gradients of
the batch's mean loss; the caller averages them over data-parallel replicas and steps its
optimizer. One :meth:`Pipeline.run` on stage s of S with M micro-batches:

  1. cut the batch into M equal micro-batches (and, for AQ-SGD, their sample ids);
  2. run the schedule's sequence of forward F(m) and backward B(m) passes:
     GPipe: F(0) .. F(M-1), then B(0) .. B(M-1);
     1F1B: w = min(S - s - 1, M) warm-up forwards, then M - w pairs F(w + i), B(i), then the
     w cool-down backwards;
  3. F(m): stage 0 reads micro-batch m, the others receive the previous stage's payload and
     decode it (a leaf needing its gradient); the last stage adds loss(out, y_m) / M, the others
     encode their output with the boundary's forward codec and post its send;
  4. B(m): the last stage back-propagates its loss, the others receive and decode the gradient
     of their output and back-propagate it; every stage but the first encodes the gradient of
     its input with the backward codec and posts its send;
  5. wait for every posted send; return the batch's loss (last stage) or None.

Every boundary message goes through :class:`~thinwire.runtime.comm.Comm` (a posted ``isend``
and a blocking ``recv``), so the ledger holds exactly the encoded payloads. Sends never block,
and each stage receives in the order its neighbour sends, so neither schedule can deadlock.

Why our own schedule and not ``torch.distributed.pipelining``: its stages exchange tensors with
their own ``batch_isend_irecv`` calls on the process group, outside thinwire's ledger, and send
the activation itself (its shape and dtype fixed at stage creation); a codec whose payload is a
tuple of typed tensors (int4 levels and scales, low-rank factors) and state on both sides
(AQ-SGD) would have to be smuggled through it. The schedules themselves are short.

Exactness: with the identity codec, every boundary tensor arrives bit for bit, each stage's
backward is the same autograd graph as in the whole model, and gradients of micro-batches are
accumulated in the same order (m = 0 .. M-1) in both schedules, so the gradients equal those of
one process running the same micro-batches through the whole model (up to the order of float
additions inside fused kernels).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from thinwire.compression.base import Compressor, Site, from_bytes, to_bytes
from thinwire.runtime.comm import Comm
from thinwire.strategies.pipeline.codecs import (
    bottleneck,
    build_boundary,
    is_bottleneck,
    sample_ids,
)

SCHEDULES = ("gpipe", "1f1b")


def cut(links: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of ``links`` chain links for ``stages`` stages, as even as
    possible (the first ``links % stages`` stages one link more)."""
    if stages < 1 or links < stages:
        raise ValueError(f"cannot cut a chain of {links} links into {stages} stages")
    base, extra = divmod(links, stages)
    out, start = [], 0
    for s in range(stages):
        end = start + base + (1 if s < extra else 0)
        out.append((start, end))
        start = end
    return out


def order(schedule: str, stage: int, stages: int, micro: int) -> list[tuple[str, int]]:
    """The schedule's passes on ``stage``: ("F", m) and ("B", m) in order (module docstring,
    step 2)."""
    if schedule == "gpipe":
        return [("F", m) for m in range(micro)] + [("B", m) for m in range(micro)]
    if schedule != "1f1b":
        raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    w = warmup(stage, stages, micro)
    out = [("F", m) for m in range(w)]
    for i in range(micro - w):
        out += [("F", w + i), ("B", i)]
    return out + [("B", m) for m in range(micro - w, micro)]


def warmup(stage: int, stages: int, micro: int) -> int:
    """1F1B's warm-up forwards on ``stage``: min(S - s - 1, M)."""
    return min(stages - stage - 1, micro)


@dataclass(frozen=True)
class Boundaries:
    """What crosses each boundary b (between stage b and b + 1):

    - ``fwd``, ``bwd``: codec specs of the activation and of its gradient (``fwd`` may be a
      bottleneck, ``ae:dim=k`` or ``subspace:dim=k``);
    - ``uncompressed_first``: boundaries 0 .. n-1 are sent as they are (Bian et al.: compressing
      the early layers' activations hurts most);
    - ``epilogue_only``: the backward codec only for gradients a stage sends in its 1F1B
      cool-down (after its last forward), the rest as they are (Optimus-CC's epilogue-only
      compression: those are the messages on the critical path);
    - ``overrides``: per-boundary (fwd, bwd) specs replacing the defaults."""

    fwd: str = "none"
    bwd: str = "none"
    uncompressed_first: int = 0
    epilogue_only: bool = False
    overrides: tuple[tuple[int, str, str], ...] = ()

    def specs(self, b: int) -> tuple[str, str]:
        for i, f, g in self.overrides:
            if i == b:
                return f, g
        if b < self.uncompressed_first:
            return "none", "none"
        return self.fwd, self.bwd

    def compressed_backward(self, b: int, m: int, stages: int, micro: int) -> bool:
        """Whether the gradient of micro-batch m crossing boundary b is sent with the codec."""
        if not self.epilogue_only:
            return True
        return m >= micro - warmup(b + 1, stages, micro)


class Pipeline:
    """This rank's stage of a model's chain, trained with a pipeline schedule (module docstring).

    ``chain``: the whole model as modules whose composition is its forward (every rank passes
    the same, built from the same seed); ``comm``: the pipeline group (rank = stage, world size =
    stages); ``example``: one input micro-batch (only its shape and dtype are used, to find the
    boundary shapes); ``loss(out, y)``: the task's mean loss. In one's own loop, on each rank
    of a dp x pp :class:`~thinwire.runtime.mesh.Mesh`::

        pipe = thinwire.Pipeline(MODELS.get("gpt").chain(model), mesh.pp, micro_batches=4,
                                 loss=loss, example=x[:8], schedule="1f1b",
                                 boundaries=thinwire.Boundaries(fwd="int8", bwd="lowrank:rank=8"))
        opt = torch.optim.AdamW(pipe.parameters())
        for x, y in batches:
            opt.zero_grad()
            loss = pipe.run(x, y, step)          # the batch's loss on the last stage
            # average the stage's gradients over mesh.dp (one all-reduce), then
            opt.step()
    """

    def __init__(self, chain: Sequence[nn.Module], comm: Comm, *, micro_batches: int,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 example: torch.Tensor, schedule: str = "1f1b",
                 boundaries: Boundaries = Boundaries(), seed: int = 0) -> None:
        self.comm, self.loss_fn, self.schedule = comm, loss, schedule
        self.n_stages, self.stage_rank, self.n_micro = comm.world_size, comm.rank, micro_batches
        self.chain = list(chain)
        self.cuts = cut(len(self.chain), self.n_stages)
        a, b = self.cuts[self.stage_rank]
        self.stage = nn.Sequential(*self.chain[a:b])
        self.boundaries = boundaries
        self.widths = self._probe(example)
        # bottlenecks of every boundary (the evaluated model holds them all); codecs of this
        # rank's two boundaries
        self.bottlenecks: dict[int, tuple[nn.Module, nn.Module]] = {}
        for bd in range(self.n_stages - 1):
            f, _ = boundaries.specs(bd)
            if is_bottleneck(f):
                self.bottlenecks[bd] = bottleneck(f, self.widths[bd][-1], seed, bd)
        self.encoder = self.bottlenecks.get(self.stage_rank, (None, None))[0]
        self.decoder = self.bottlenecks.get(self.stage_rank - 1, (None, None))[1]
        for mod in (self.encoder, self.decoder):
            if mod is not None:
                mod.to(next(iter(self.stage.parameters()), torch.empty(0)).device)
        self.codecs: dict[tuple[int, str], Compressor] = {}
        self.plain: dict[tuple[int, str], Compressor] = {}
        for bd in (self.stage_rank - 1, self.stage_rank):
            if 0 <= bd < self.n_stages - 1:
                f, g = boundaries.specs(bd)
                self.codecs[(bd, "F")] = build_boundary("none" if is_bottleneck(f) else f,
                                                        forward=True, seed=seed, rank=self.stage_rank)
                self.codecs[(bd, "B")] = build_boundary(g, seed=seed, rank=self.stage_rank)
                self.plain[(bd, "B")] = build_boundary("none")
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self.passes: list[tuple[str, int, float]] = []
        """The last :meth:`run`'s passes in order: (kind, micro-batch, seconds), from the pass's
        start (its receive included) to its end (its send posted); step 5's wait is
        ("W", -1, seconds). On :class:`thinwire.measure.local.Silent` they are the passes' own
        work (the planner's simulation reads them)."""

    # --- shapes ------------------------------------------------------------------------------
    def _probe(self, example: torch.Tensor) -> list[tuple[int, ...]]:
        """Per-sample shapes of the tensors leaving each stage but the last (run on the meta
        device: no memory, no compute)."""
        h = example[:1].to("meta")
        out: list[tuple[int, ...]] = []
        with torch.no_grad():
            for s, (a, b) in enumerate(self.cuts[:-1]):
                for link in self.chain[a:b]:
                    h = copy.deepcopy(link).to("meta")(h)
                out.append(tuple(h.shape[1:]))
                del s
        return out

    def wire_shape(self, b: int, rows: int) -> tuple[int, ...]:
        """The shape of the tensor crossing boundary b for a micro-batch of ``rows`` samples."""
        shape = (rows, *self.widths[b])
        if b in self.bottlenecks:
            f, _ = self.boundaries.specs(b)
            from thinwire.strategies.pipeline.codecs import bottleneck_options

            shape = (*shape[:-1], min(bottleneck_options(f)[1].dim, shape[-1]))
        return shape

    # --- parameters ----------------------------------------------------------------------------
    def modules(self) -> list[nn.Module]:
        """This stage's trained modules: its links, then its bottleneck halves."""
        return [self.stage] + [m for m in (self.decoder, self.encoder) if m is not None]

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules() for p in m.parameters()]

    # --- the wire ------------------------------------------------------------------------------
    def _codec(self, b: int, d: str, m: int) -> Compressor:
        if d == "B" and not self.boundaries.compressed_backward(b, m, self.n_stages, self.n_micro):
            return self.plain[(b, d)]
        return self.codecs[(b, d)]

    def _send(self, b: int, d: str, x: torch.Tensor, site: Site) -> None:
        buf = to_bytes(self._codec(b, d, site.key).encode_tensor(x.detach(), site))
        peer = b + 1 if d == "F" else b
        self._pending.append((self.comm.isend(buf, peer, tag="act" if d == "F" else "actgrad"),
                              buf))

    def _recv(self, b: int, d: str, shape: tuple[int, ...], site: Site,
              device: torch.device) -> torch.Tensor:
        codec = self._codec(b, d, site.key)
        spec = codec.tensor_spec(shape)
        buf = torch.empty(sum(p.nbytes for p in spec), dtype=torch.uint8, device=device)
        peer = b if d == "F" else b + 1
        self.comm.recv(buf, peer, tag="act" if d == "F" else "actgrad")
        return codec.decode_tensor(from_bytes(buf, spec), shape, site).float()

    # --- one mini-batch ----------------------------------------------------------------------
    def run(self, x: torch.Tensor, y: torch.Tensor, step: int) -> float | None:
        """Forward and backward of every micro-batch of (x, y) on this stage (steps 1-5 of the
        module docstring); parameter gradients are accumulated (zero them before)."""
        S, s, M = self.n_stages, self.stage_rank, self.n_micro
        if x.shape[0] % M:
            raise ValueError(f"a batch of {x.shape[0]} does not split into {M} micro-batches")
        xs, ys = x.chunk(M), y.chunk(M)  # 1.
        needs_ids = any(c.needs_samples for c in self.codecs.values())
        ids = [sample_ids(xm) for xm in xs] if needs_ids else [None] * M
        device = x.device
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        total = 0.0
        self.passes = []
        clock = time.perf_counter()
        for kind, m in order(self.schedule, s, S, M):  # 2.
            site = Site(step, m, ids[m])
            rows = xs[m].shape[0]
            if kind == "F":  # 3.
                if s == 0:
                    h = xs[m]
                else:
                    inp = self._recv(s - 1, "F", self.wire_shape(s - 1, rows), site, device)
                    inp.requires_grad_(True)
                    inputs[m] = inp
                    h = self.decoder(inp) if self.decoder is not None else inp
                out = self.stage(h)
                if s == S - 1:
                    loss = self.loss_fn(out, ys[m]) / M
                    total += float(loss.detach())
                    outputs[m] = loss
                else:
                    z = self.encoder(out) if self.encoder is not None else out
                    self._send(s, "F", z, site)
                    outputs[m] = z
            else:  # 4.
                z = outputs.pop(m)
                if s == S - 1:
                    z.backward()
                else:
                    g = self._recv(s, "B", tuple(z.shape), site, device)
                    z.backward(g)
                if s > 0:
                    inp = inputs.pop(m)
                    grad = inp.grad if inp.grad is not None else torch.zeros_like(inp)
                    self._send(s - 1, "B", grad, site)
            now = time.perf_counter()
            self.passes.append((kind, m, now - clock))
            clock = now
        for work, _buf in self._pending:  # 5.
            work.wait()
        self._pending.clear()
        self.passes.append(("W", -1, time.perf_counter() - clock))
        return total if s == S - 1 else None

    # --- state -------------------------------------------------------------------------------
    def codec_state(self) -> dict[str, Any]:
        return {f"{b}.{d}": c.state_dict() for (b, d), c in self.codecs.items()}

    def load_codec_state(self, state: dict[str, Any]) -> None:
        for (b, d), c in self.codecs.items():
            c.load_state_dict(state.get(f"{b}.{d}", {}))

"""DiLoCo (``diloco``): local inner steps, outer Nesterov momentum on the averaged pseudo-gradient;
Streaming DiLoCo's fragments, overlap and low-bit outer gradients as options.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023),
Algorithm 1. Every worker holds the global parameters theta_g (identical on all ranks) and its
replica theta_i, starting equal. Each outer round:
  1. H = ``sync_every`` inner optimizer steps on the worker's own batches (the paper's inner
     optimizer is AdamW: ``--train.optimizer adamw``; its state stays local across rounds);
  2. pseudo-gradient delta_i = theta_g - theta_i;
  3. delta = mean_i delta_i: one all-reduce through the ledger, tagged ``average`` (the bytes
     of local SGD's model average), or a codec's exchange (with error feedback where it has it);
  4. the model is reset to theta_g, delta is set as its gradient, and the outer optimizer steps
     (the paper: SGD, lr 0.7, Nesterov momentum 0.9); theta_g <- the model.

Local SGD is the special case outer lr 1, momentum 0: theta_g - (theta_g - mean_i theta_i) =
mean_i theta_i, equal up to one rounding per element (tested).

Streaming DiLoCo (Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
Distributed Free Lunch", arXiv 2501.18512, Algorithm 2) changes steps 2-4:
  a. the parameters are cut into P ``fragments`` strided over the layers: the model's layers
     (a parameter's layer: its name up to the first numeric part, ``blocks.3`` or ``net.2``,
     else its module, :func:`layers_of`) in order, layer l in fragment l mod P, so every
     fragment spans the depth (the paper's strided pattern);
  b. fragment p is synchronised every H steps, the fragments staggered by H / P steps (rounded
     down where P does not divide H): its steps 2-4 run at the steps s with s mod H =
     floor((p + 1) H / P) mod H (P = 1: every H-th step, as above), so the peak bytes drop by P
     while the total does not;
  c. overlap (``delay`` tau < floor(H / P), the shortest stagger): fragment p's
     pseudo-gradient is taken tau steps before its merge step and its exchange runs in the
     background (an asynchronous ``Comm`` call, recorded in the ledger) while the worker takes
     tau more inner steps;
  d. at the merge step the outer optimizer steps theta_g of the fragment with the averaged
     pseudo-gradient, and the worker's fragment becomes alpha theta_local + (1 - alpha) theta_g
     (``alpha``; 0, the default, takes the outer result as DiLoCo does; the paper studies 0.5
     with overlap);
  e. the pseudo-gradient may go on the wire in 4 or 8 bits (the paper: 4-bit E3M0 floats):
     any codec of :mod:`thinwire.compression` (``compressor``, e.g. ``fp4`` or ``int8``),
     whose exchange decodes every rank's payload and accumulates in fp32; with
     ``fp4:exchange=scatter`` a quantised reduce-scatter summed in fp32 and an all-gather of
     the re-quantised mean (:mod:`thinwire.compression.scatter`, INTELLECT-1's int8
     all-reduce), a ring all-reduce's bytes of the payload instead of n - 1 payloads.
With one fragment, no delay, alpha 0 and no codec, this is the DiLoCo above bit for bit
(tested).

:class:`DiLoCo` runs this around a user's model, inner and outer optimizers (torchft's shape)::

    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    with thinwire.DiLoCo(model, inner_optimizer, outer, sync_every=500):
        ...  # the usual loop with inner_optimizer.step()
    # Streaming: 4 strided fragments, 5 steps of overlap, 4-bit outer gradients
    thinwire.DiLoCo(model, inner, outer, sync_every=100, fragments=4, delay=5,
                    codec=thinwire.build_codec("fp4"))

One concept, one file (over 400 lines): DiLoCo's outer loop (plain, Streaming, over a torchft
quorum) with its method entry, options and traffic formula.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from thinwire.compression.registry import check_codec, codec_names
from thinwire.errors import UsageError
from thinwire.options import check, opt
from thinwire.runtime.comm import Comm
from thinwire.strategies.averaging import PeriodicSync
from thinwire.strategies.base import (
    Context,
    MemoryReport,
    WrappedStrategy,
    optimizer_bytes,
)
from thinwire.strategies.entry import Compressed, MethodEntry, Recovery, Rescalable
from thinwire.strategies.traffic import Layout, Traffic


def layer_of(name: str) -> str:
    """A parameter's layer for the fragments: its name up to the first numeric part
    (``blocks.3.attn.w`` -> ``blocks.3``), else its module (``head.weight`` -> ``head``)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1])


def layers_of(names: Sequence[str]) -> list[int]:
    """The layer index (0, 1, ... in order of first appearance) of each parameter name."""
    index: dict[str, int] = {}
    return [index.setdefault(layer_of(n), len(index)) for n in names]


def strided_fragments(names: Sequence[str], fragments: int) -> list[list[int]]:
    """Step a: the parameter indices of each fragment, layer l in fragment l mod P."""
    layers = layers_of(names)
    if fragments > max(layers, default=-1) + 1:
        raise UsageError(f"DiLoCo fragments={fragments} exceeds the model's "
                         f"{max(layers, default=-1) + 1} layers; use at most that many")
    return [[i for i, layer in enumerate(layers) if layer % fragments == p]
            for p in range(fragments)]


def merge_step(p: int, fragments: int, sync_every: int) -> int:
    """Step b: fragment p merges at the steps s with s mod H equal to this."""
    return ((p + 1) * sync_every // fragments) % sync_every


class DiLoCo(PeriodicSync):
    """DiLoCo's outer loop around ``model`` (module docstring): after every ``sync_every``-th
    step of ``inner_optimizer``, steps 2-4. ``codec``: a compressor (``thinwire.compression``)
    for the pseudo-gradient, or None for a plain all-reduce.

    Streaming DiLoCo (steps a-e): ``fragments`` is a number of fragments strided over the
    layers (:func:`strided_fragments`) or the fragments themselves (modules or lists of
    parameters, torchft's ``model_fragments``; together they must hold every parameter once);
    ``delay`` the overlap tau in inner steps (< sync_every / fragments), ``alpha`` the merge
    weight of the local parameters.

    ``replica`` (a :class:`~thinwire.runtime.ft.Replica`): over a torchft quorum
    (:mod:`thinwire.strategies.averaging`, steps a-c), each fragment's outer step is one
    torchft step: its round opens after the previous fragment's merge, its exchange (started
    ``delay`` steps early or not) is averaged over the live members, and the merge is applied
    only if the quorum commits. A joiner copies theta_g, the outer optimizer, the rounds, the
    codec's shared state and a peer's model and inner optimizer; the codec's residuals (per
    rank) start at zero."""

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: torch.optim.Optimizer, sync_every: int, *,
                 comm: Comm | None = None, codec: Any = None, tag: str = "average",
                 fragments: int | Sequence[Any] = 1, delay: int = 0, alpha: float = 0.0,
                 replica: Any = None) -> None:
        super().__init__(model, sync_every, comm=comm, tag=tag, replica=replica)
        self.inner = inner_optimizer
        self.outer = outer_optimizer
        self.codec = codec
        self.params = [p for p in model.parameters()]
        self.global_params = [p.detach().clone() for p in self.params]
        self.fragments = self._fragments(model, fragments)
        n = len(self.fragments)
        if n > sync_every:
            raise UsageError(f"DiLoCo fragments={n} exceeds sync_every={sync_every}: each "
                             f"fragment needs a step of its own; use at most {sync_every}")
        if not 0 <= delay < sync_every // n:
            raise UsageError(f"DiLoCo delay={delay} must be in [0, sync_every / fragments = "
                             f"{sync_every // n}); lower it or sync less often")
        if not 0.0 <= alpha <= 1.0:
            raise UsageError(f"DiLoCo alpha={alpha} must be in [0, 1]")
        self.delay = delay
        self.alpha = alpha
        self.rounds = [0] * n
        self._pending: tuple[int, Any] | None = None  # (fragment, future or tensor)
        self._hook_on(inner_optimizer)

    def _fragments(self, model: nn.Module, fragments: int | Sequence[Any]) -> list[list[int]]:
        if isinstance(fragments, int):
            if fragments < 1:
                raise UsageError(f"DiLoCo fragments must be >= 1, got {fragments}")
            if fragments == 1:
                return [list(range(len(self.params)))]
            return strided_fragments([n for n, _ in model.named_parameters()], fragments)
        index = {id(p): i for i, p in enumerate(self.params)}
        out = []
        for frag in fragments:
            ps = list(frag.parameters()) if isinstance(frag, nn.Module) else list(frag)
            out.append(sorted(index[id(p)] for p in ps))
        flat = sorted(i for f in out for i in f)
        if flat != list(range(len(self.params))) or any(not f for f in out):
            raise UsageError("DiLoCo fragments must hold every parameter of the model exactly "
                             "once, none of them empty")
        return out

    def on_step(self) -> None:
        """Step b: each fragment starts its exchange delay steps before its merge step and
        merges at it (both on this phase of the period)."""
        phase = self.steps % self.sync_every
        for p in range(len(self.fragments)):
            merge = merge_step(p, len(self.fragments), self.sync_every)
            if phase == (merge - self.delay) % self.sync_every:
                self._start(p)
            if phase == merge:
                self._finish(p)

    def sync(self) -> None:
        """Steps 2-4 of every fragment in turn, now (blocking; over a quorum each fragment's
        outer step is a round of its own)."""
        for p in range(len(self.fragments)):
            self.begin_round()
            self._start(p)
            self._finish(p)

    def on_quorum(self) -> None:
        """The codec's private randomness follows the live rank."""
        codec = self.codec
        while codec is not None:
            codec.rank = self.comm.rank
            codec = getattr(codec, "inner", None)

    def shared_state(self) -> dict[str, Any]:
        """:meth:`state_dict` less the codec's per-rank residuals."""
        from thinwire.strategies.fault import shared_codec_state

        out = self.state_dict()
        if "codec" in out:
            out["codec"] = shared_codec_state(out["codec"])
        return out

    def load_shared_state(self, state: dict[str, Any]) -> None:
        if self.codec is not None:
            self.codec.reset()
        self.load_state_dict(state)

    def _start(self, p: int) -> None:
        """Steps 2-3 of fragment p: its pseudo-gradient, and its mean's exchange started."""
        idx = self.fragments[p]
        with torch.no_grad():
            # 2. pseudo-gradient
            delta = torch.cat([(self.global_params[i] - self.params[i]).reshape(-1)
                               for i in idx])
            # 3. its mean over workers (in the background with a delay)
            key = (self.rounds[p] + 1) * len(self.fragments) + p  # P = 1: the round
            if self.codec is not None:
                from thinwire.compression import average_async

                # the round as the codec's step, the fragment as its key (its residual)
                fut, _ = average_async(self.comm, self.codec, delta, key, key=p, tag=self.tag,
                                       shapes=[tuple(self.params[i].shape) for i in idx])
                self._pending = (p, fut)
            elif self.delay == 0:
                self._pending = (p, self.comm.all_reduce(delta, op="avg", tag=self.tag))
            else:
                world = self.comm.world_size
                self._pending = (p, self.comm.all_reduce_async(delta, tag=self.tag).then(
                    lambda f: f.value().div_(world)))

    def _wait(self) -> torch.Tensor:
        assert self._pending is not None
        value = self._pending[1]
        return value if isinstance(value, torch.Tensor) else value.wait()

    def _finish(self, p: int) -> None:
        """Step 4 (d) of fragment p: the outer step on theta_g, then the merge."""
        assert self._pending is not None and self._pending[0] == p
        delta = self._wait()
        self._pending = None
        if not self.commit():  # over a quorum: refused, the round-start state is back
            return
        self.rounds[p] += 1
        idx = self.fragments[p]
        mine = set(idx)
        others = [i for i in range(len(self.params)) if i not in mine]
        kept = {i: self.params[i].grad for i in others}
        local: list[torch.Tensor] = []
        with torch.no_grad():
            for i in others:  # the outer step moves this fragment alone
                self.params[i].grad = None
            at = 0
            for i in idx:
                g, q = self.global_params[i], self.params[i]
                if self.alpha > 0:
                    local.append(q.detach().clone())
                q.copy_(g)
                q.grad = delta[at:at + q.numel()].view_as(q).clone()
                at += q.numel()
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for j, i in enumerate(idx):
                self.global_params[i].copy_(self.params[i])
                if self.alpha > 0:  # d. merge: alpha theta_local + (1 - alpha) theta_g
                    self.params[i].mul_(1 - self.alpha).add_(local[j], alpha=self.alpha)
            for i in others:
                self.params[i].grad = kept[i]

    def state_dict(self) -> dict[str, Any]:
        """theta_g, the outer optimizer, the codec's state, the rounds, and a pending
        exchange's mean (waited for), so a resumed run merges the same values."""
        out: dict[str, Any] = {"steps": self.steps, "global": [g.clone() for g in self.global_params],
                               "outer": self.outer.state_dict()}
        if self._pending is not None:  # first: an exchange on its thread updates residuals
            p = self._pending[0]
            self._pending = (p, self._wait())
            out["pending"] = {"fragment": p, "delta": self._pending[1].clone()}
        if self.codec is not None:
            out["codec"] = self.codec.state_dict()
        if len(self.fragments) > 1 or self.delay:
            out["rounds"] = list(self.rounds)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        with torch.no_grad():
            for g, saved in zip(self.global_params, state["global"]):
                g.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        if self.codec is not None and "codec" in state:
            self.codec.load_state_dict(state["codec"])
        if "rounds" in state:
            self.rounds = [int(r) for r in state["rounds"]]
        pending = state.get("pending")
        self._pending = None if pending is None else (int(pending["fragment"]),
                                                      pending["delta"].clone())

    def close(self) -> None:
        """Remove the hook; an exchange still in flight is waited for (and not applied)."""
        if self._pending is not None:
            self._wait()
            self._pending = None
        if self.codec is not None:
            self.codec.close()
        super().close()


@dataclass(frozen=True)
class Options:
    period: int = opt(10, "inner steps between outer steps (H)")
    outer_lr: float = opt(0.7, "outer Nesterov learning rate")
    outer_momentum: float = opt(0.9, "outer Nesterov momentum (0: plain SGD)")
    compressor: str = opt("none", "codec spec for the pseudo-gradient: one of "
                          f"{codec_names('delta')} with its options (none: plain all-reduce; "
                          "fp4 or int8: Streaming DiLoCo's low-bit outer gradients)")
    fragments: int = opt(1, "Streaming DiLoCo: fragments strided over the layers, synced in turn")
    delay: int = opt(0, "Streaming DiLoCo: inner steps (tau) a fragment's exchange overlaps")
    alpha: float = opt(0.0, "Streaming DiLoCo: weight of the local parameters in the merge")

    def __post_init__(self) -> None:
        check(self.period >= 1, "method.period", "must be >= 1")
        check(self.fragments >= 1, "method.fragments", "must be >= 1")
        check(self.fragments <= self.period, "method.fragments",
              f"must be at most method.period={self.period} (a step for each fragment)")
        check(0 <= self.delay < self.period // self.fragments, "method.delay",
              f"must be in [0, period / fragments = {self.period // self.fragments})")
        check(0 <= self.alpha <= 1, "method.alpha", "must be in [0, 1]")
        check(self.outer_lr > 0, "method.outer_lr", "must be > 0")
        check(0 <= self.outer_momentum < 1, "method.outer_momentum", "must be in [0, 1)")
        if self.compressor != "none":
            check_codec(self.compressor, "method.compressor", slot="delta")


class DiLoCoStrategy(WrappedStrategy):
    name = "diloco"
    state_key = "diloco"

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        super().__init__(ctx, model)
        o: Options = ctx.options
        self.outer_opt = torch.optim.SGD(self.model.parameters(), lr=o.outer_lr,
                                         momentum=o.outer_momentum,
                                         nesterov=o.outer_momentum > 0)
        codec = None
        if o.compressor != "none":
            from thinwire.compression import build

            # over a quorum the live rank is set at each quorum (DiLoCo.on_quorum)
            codec = build(o.compressor, seed=self.cfg.train.seed,
                          rank=0 if ctx.replica is not None else self.comm.rank, slot="delta")
        self.wrapper = DiLoCo(self.model, self.opt, self.outer_opt, o.period, comm=self.comm,
                              codec=codec, fragments=o.fragments, delay=o.delay, alpha=o.alpha,
                              replica=ctx.replica)

    def memory(self) -> MemoryReport:
        """Inner state as local SGD's; theta_g and the outer momentum count as optimizer state."""
        inner = super().memory()
        extra = sum(g.numel() * g.element_size() for g in self.wrapper.global_params)
        return dataclasses.replace(
            inner, optimizer=inner.optimizer + extra + optimizer_bytes(self.outer_opt))


def traffic(layout: Layout, options: Options, workers: int, steps: int, seed: int,
            optimizer_states: int = 0) -> Traffic:
    """Every fragment's exchange once per ``period`` steps, counted from the step that issues
    it (``delay`` steps before its merge step; one issued and not yet merged is waited for,
    and recorded, when the run closes)."""
    del seed, optimizer_states
    names = [p.name for p in layout.params]
    frags = ([list(range(len(names)))] if options.fragments == 1
             else strided_fragments(names, options.fragments))
    codec = None
    if options.compressor != "none":
        from thinwire.compression import build

        codec = build(options.compressor, slot="delta")
    total = Traffic.none(workers)
    for p, idx in enumerate(frags):
        start = (merge_step(p, len(frags), options.period) or options.period) - options.delay
        rounds = (steps - start) // options.period + 1 if steps >= start else 0
        numel = sum(layout.params[i].numel for i in idx)
        if codec is None:
            calls = [("all_reduce", 4 * numel)]
        else:
            calls = codec.collectives(numel, [layout.params[i].shape for i in idx],
                                      world=workers)
        for op, payload in calls:
            total = total + Traffic.uniform(workers, op, [payload] * rounds)
    return total


def _label(o: Options) -> str:
    extra = ""
    if o.compressor != "none":
        from thinwire.compression import build

        extra = f"+{build(o.compressor, slot='delta').describe()}"
    stream = ""
    if o.fragments > 1 or o.delay or o.alpha:
        stream = f",P={o.fragments},tau={o.delay}" + (f",alpha={o.alpha:g}" if o.alpha else "")
    return f"diloco(H={o.period}{stream}){extra}"


def _recovery(o: Options) -> Recovery:
    """A joiner's copy: the model, the inner optimizer, theta_g, the outer momentum and a
    pending fragment's mean (Streaming's delay); a refused outer step loses its round (the
    steps to the next fragment's outer step)."""
    copies = 2 + (o.outer_momentum > 0) + (1 / o.fragments if o.delay else 0)
    parts = ("model", "optimizer", "theta_g") + (("outer momentum",) if o.outer_momentum else ())
    return Recovery(copies=copies, lost_steps=o.period / o.fragments,
                    parts=parts + (("pending mean",) if o.delay else ()))


class DiLoCoEntry(MethodEntry, Rescalable, Compressed):
    """diloco's registry entry: its outer delta's codec is ``compressor``."""

    def rescalable(self, options: Options) -> bool:
        # a codec's residuals are per rank, as in dp; fragments and the merge leave ranks apart
        return options.compressor == "none" and options.fragments == 1 and options.alpha == 0

    def codec(self, options: Options) -> str:
        return options.compressor

    def uncompressed(self, options: Options) -> Options:
        return dataclasses.replace(options, compressor="none")


METHOD = DiLoCoEntry(
    name="diloco", summary="DiLoCo: H inner steps, outer Nesterov step on the mean pseudo-gradient",
    strategy="thinwire.strategies.diloco:DiLoCoStrategy", options=Options, label=_label,
    sync_every=lambda o: o.period, traffic=traffic, memory=("recompute",), fault_tolerant=True,
    recovery=_recovery)

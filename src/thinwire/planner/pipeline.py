"""The ``pipeline`` method in the planner: boundary bytes from its own traffic formula, step time
of its schedule.

The method's traffic formula (:func:`thinwire.strategies.pipeline.traffic.traffic`) reads a
:class:`~thinwire.strategies.pipeline.plan.PipelinePlan` that a run probes from its model;
here the plan comes from a transformer's dimensions instead, so the planner prices a pipeline run
before it exists, with the very formula the tests hold equal to the ledger:

1. :func:`pipeline_plan`: S stages, dp replicas, M micro-batches of b sequences of length T, d_model
   h: every boundary carries one [b, T, h] activation forward and its gradient backward per
   micro-batch (a transformer's blocks keep their width);
2. :func:`traffic`: the method's formula on that plan, so each message costs the boundary codec's
   own ``tensor_bytes`` of the [b, T, h] shape (:mod:`thinwire.strategies.pipeline.codecs`):
   no byte count is derived twice;
3. :func:`step_time`: the schedule's step time. GPipe (Huang et al., NeurIPS 2019) and 1F1B
   (Narayanan et al., SC 2021, Sec. 2.2) both run M micro-batches through the slowest stage and
   fill and drain the pipeline once: with tau_s stage s's time a micro-batch,
       step = M max_s tau_s + (S - 1) mean_s tau_s + sync + optimizer,
   the second term the bubble, (S - 1) / (M + S - 1) of the schedule when the stages are equal
   (the planner's transformer path, :mod:`thinwire.planner.step`, uses the same form). tau_s is
   the stage's forward and backward compute c_s, its codec's encoding and decoding e_s, and the
   transfer of what it sends for one micro-batch over its link, bytes_s / bandwidth plus one
   latency a message (its forward and backward messages leave through its one link, so they
   add up; nothing is assumed to overlap with compute). sync is the data-parallel all-reduce of
   a stage's gradients (ring, 2 (dp-1)/dp of 4 P_s bytes at the bandwidth), optimizer the
   optimizer step. When the S stages share fewer cores than S (the thin-wire testbed runs every
   worker on one machine), the schedule takes at least the stages' total compute and codec
   time over the cores: ``cores`` bounds it from below.
4. :func:`simulate`: the same schedule played out event by event, for what the closed form
   leaves out: stages whose forward and backward differ (a stage's backward only starts when its
   gradient arrives, so fill and drain are not S - 1 equal slots), links that carry messages
   one after another (the sender's upload and the receiver's download) and let a burst through
   after idling, a receiver that must be waiting before a message leaves, and S stages
   sharing fewer than S cores. Each stage runs its schedule's passes in order (the order the runtime
   uses, :func:`thinwire.strategies.pipeline.schedule.order`); a pass starts when the message it
   reads has arrived; the stages with a pass in hand share ``cores`` equally (processor
   sharing, what a fair OS scheduler gives busy processes); a finished pass sends its message
   over the stage's upload and the receiver's download (each a link of ``bandwidth`` that
   carries one message at a time, as a full-duplex port does, optionally behind a token bucket
   of ``burst`` bytes, as shaped links are), which deliver it ``latency`` after its last byte;
   with ``rendezvous`` (gloo and NCCL) the transfer starts only when the receiver has reached
   the pass that waits for the message, so a receiver busy with another pass delays it; with
   ``acks_queue`` it waits for the receiver's upload to fall idle too (over a FIFO-shaped link
   the receiver's acknowledgements queue behind its outgoing data); each
   stage waits for its sends, steps its optimizer (on the shared cores
   too), and the step ends when the last stage's loss reaches every stage. With a core a stage,
   equal stages, no message cost and an infinitely fast link it gives (M + S - 1)(F + B), the
   closed form's value.

One concept, one file (over 400 lines): the planner's model of the pipeline method.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from thinwire.errors import UsageError

if TYPE_CHECKING:
    from thinwire.strategies.entry import MethodEntry, Staged
    from thinwire.strategies.traffic import Traffic


def _method() -> Staged:
    """The pipeline method's stage ``plan``, ``message_bytes`` and pass ``order``: the
    registered method that is :class:`~thinwire.strategies.entry.Staged`."""
    from thinwire.planner.methods import staged

    return staged()


def _entry() -> MethodEntry:
    """The same method's registry entry (its options and traffic formula)."""
    from thinwire.planner.methods import method_that_is
    from thinwire.strategies.entry import Staged

    return method_that_is(Staged, "a pipeline's stage plan")


@dataclass(frozen=True)
class PipelineShape:
    """The dimensions a pipeline's traffic depends on (step 1)."""

    stages: int
    micro_batches: int
    micro_batch: int
    """b: sequences a micro-batch."""
    seq: int
    """T: positions a sequence."""
    d_model: int
    dp: int = 1
    stage_params: tuple[int, ...] = ()
    """Parameters of each stage (only the data-parallel all-reduce reads them; zeros if empty)."""
    clip: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):  # every count: stages, micro-batches, sizes, replicas
            v = getattr(self, f.name)
            if isinstance(v, int) and not isinstance(v, bool) and v < 1:
                raise UsageError(f"pipeline {f.name}: got {v}; use 1 or more")
        if self.stage_params and len(self.stage_params) != self.stages:
            raise UsageError(f"pipeline stage_params: {len(self.stage_params)} sizes for "
                             f"{self.stages} stages; give one a stage")

    @property
    def batch(self) -> int:
        """A replica's batch: M micro-batches of b sequences."""
        return self.micro_batches * self.micro_batch


def pipeline_plan(shape: PipelineShape) -> Any:
    """Step 1: the method's stage plan (its entry's ``plan``) for a transformer of these
    dimensions."""
    S = shape.stages
    return _method().plan(S, shape.dp, shape.batch, ((shape.seq, shape.d_model),) * (S - 1),
                          shape.stage_params or (0,) * S, shape.clip)


def options_of(codec_fwd: str = "none", codec_bwd: str = "none", **more: Any) -> Any:
    """The pipeline method's options (defaults, the two codecs, any other option by name); a bad
    spec is a one-line error."""
    return _entry().options(codec_fwd=codec_fwd, codec_bwd=codec_bwd, **more)


def traffic(shape: PipelineShape, options: Any, steps: int = 1) -> Traffic:
    """Step 2: the ledger's totals per rank after ``steps`` steps (rank r is stage r % S of
    replica r // S), from the method's own formula. ``options.micro_batches`` must be M."""
    from thinwire.strategies.traffic import Layout

    method_traffic = _entry().traffic
    assert method_traffic is not None

    if options.micro_batches != shape.micro_batches:
        raise UsageError(f"pipeline micro_batches: the options say {options.micro_batches}, the "
                         f"shape {shape.micro_batches}; give the same M to both")
    layout = replace(Layout.from_shapes([]), pipeline=pipeline_plan(shape))
    return method_traffic(layout, options, shape.stages * shape.dp, steps, 0, 0)


def boundary_bytes(shape: PipelineShape, options: Any) -> tuple[float, ...]:
    """Bytes stage s sends over the boundaries per micro-batch (forward and backward messages,
    the mean over the step's micro-batches), from :func:`traffic` without data parallelism."""
    alone = replace(shape, dp=1, clip=False, stage_params=())
    t = traffic(alone, options)
    return tuple(b / shape.micro_batches for b in t.sent)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step (step 3): the slowest stage's per-micro-batch time tau split into its
    compute, codec and transfer parts, the mean stage's tau, and what follows the schedule."""

    stages: int
    micro_batches: int
    compute: float
    codec: float
    transfer: float
    mean_slot: float
    sync: float = 0.0
    optimizer: float = 0.0
    floor: float = 0.0
    """The shared cores' bound: the stages' total compute and codec seconds / cores (0: none)."""

    @property
    def slot(self) -> float:
        """max_s tau_s."""
        return self.compute + self.codec + self.transfer

    @property
    def bubble(self) -> float:
        """(S - 1) mean_s tau_s: the fill and drain."""
        return (self.stages - 1) * self.mean_slot

    @property
    def schedule(self) -> float:
        """M max_s tau_s + the bubble."""
        return self.micro_batches * self.slot + self.bubble

    @property
    def total(self) -> float:
        return max(self.schedule, self.floor) + self.sync + self.optimizer

    def as_dict(self) -> dict[str, float]:
        return {"slot": self.slot, "compute": self.compute, "codec": self.codec,
                "transfer": self.transfer, "mean_slot": self.mean_slot, "bubble": self.bubble,
                "schedule": self.schedule, "floor": self.floor, "sync": self.sync,
                "optimizer": self.optimizer, "total": self.total}


def _sync_seconds(shape: PipelineShape, bandwidth: float, latency: float) -> float:
    """The data-parallel ring all-reduce of the largest stage's fp32 gradients (0: one replica,
    or no stage sizes given)."""
    if shape.dp < 2 or not shape.stage_params:
        return 0.0
    grad = 4 * max(shape.stage_params)
    return 2 * (shape.dp - 1) / shape.dp * grad / bandwidth + 2 * (shape.dp - 1) * latency


def step_time(shape: PipelineShape, options: Any, stage_seconds: Sequence[float], *,
              bandwidth: float, latency: float = 0.0,
              codec_seconds: Sequence[float] | None = None, optimizer_seconds: float = 0.0,
              cores: int | None = None) -> StepTime:
    """Step 3 (module docstring). ``stage_seconds[s]``: stage s's forward and backward compute
    of one micro-batch; ``codec_seconds[s]``: its encoding and decoding of one micro-batch's
    messages (both boundaries); ``bandwidth``: bytes a second of a stage's link; ``latency``:
    seconds a message; ``cores``: the cores the stages share (None: a device a stage)."""
    S, M = shape.stages, shape.micro_batches
    if len(stage_seconds) != S:
        raise UsageError(f"pipeline stage_seconds: {len(stage_seconds)} times for {S} stages")
    if bandwidth <= 0:
        raise UsageError(f"pipeline bandwidth: got {bandwidth}; use bytes a second > 0")
    codec = list(codec_seconds) if codec_seconds is not None else [0.0] * S
    if len(codec) != S:
        raise UsageError(f"pipeline codec_seconds: {len(codec)} times for {S} stages")
    sent = boundary_bytes(shape, options)
    messages = [(s < S - 1) + (s > 0) for s in range(S)]
    parts = [(stage_seconds[s], codec[s], sent[s] / bandwidth + messages[s] * latency)
             for s in range(S)]
    c, e, x = max(parts, key=sum)
    mean = sum(sum(p) for p in parts) / S
    sync = _sync_seconds(shape, bandwidth, latency)
    floor = M * (sum(stage_seconds) + sum(codec)) / cores if cores else 0.0
    return StepTime(S, M, c, e, x, mean, sync, optimizer_seconds, floor)


@dataclass(frozen=True)
class Simulated:
    """Step 4's result: the step's seconds and where the stages' time went."""

    total: float
    """Seconds of one step, from the first pass to the loss's arrival on every stage."""
    busy: tuple[float, ...]
    """CPU seconds each stage spends a step (passes, codecs, messages, optimizer)."""
    sync: float = 0.0
    passes: tuple[tuple[int, str, int, float, float], ...] = ()
    """(stage, kind, micro-batch, start, end) of every pass ("O": the optimizer step), in the
    order they ended: where the step's time went."""

    @property
    def work(self) -> float:
        return sum(self.busy)


class _Link:
    """One direction of a stage's port: messages one at a time, at ``rate`` bytes a second once
    a token bucket of ``burst`` bytes (full at the start, refilled at the rate) is spent."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.at, self.free = burst, 0.0, 0.0

    def take(self, nbytes: float, now: float) -> float:
        """The time the last of ``nbytes`` posted at ``now`` has passed this link."""
        start = max(now, self.free)
        level = min(self.burst, self.tokens + (start - self.at) * self.rate)
        if level >= nbytes:
            self.tokens, end = level - nbytes, start
        else:
            self.tokens, end = 0.0, start + (nbytes - level) / self.rate
        self.at = self.free = end
        return end


@dataclass(frozen=True)
class _Inputs:
    """The validated inputs of :func:`simulate`: per stage its passes, their CPU seconds and
    the bytes of each message it sends."""

    stages: int
    micro_batches: int
    passes: list[list[tuple[str, int]]]
    """Stage s's passes in the runtime's order, then its optimizer step ``("O", -1)``."""
    forward: Sequence[float]
    backward: Sequence[float]
    codec: list[tuple[float, ...]]
    opt: list[float]
    fwd: list[list[int]]
    bwd: list[list[int]]
    bounds: Any

    def cpu(self, s: int, kind: str, m: int) -> float:
        """Stage s's seconds (one core) of pass ``kind`` on micro-batch m: its compute plus the
        codec work of the messages it reads and writes."""
        S, M, codec = self.stages, self.micro_batches, self.codec
        if kind == "O":
            return self.opt[s]
        if kind == "F":
            t = self.forward[s]
            if s > 0:  # decode the activation
                t += codec[s - 1][1]
            if s < S - 1:  # encode its own
                t += codec[s][0]
            return t
        t = self.backward[s]
        if s < S - 1 and self.bounds.compressed_backward(s, m, S, M):  # decode the output's gradient
            t += codec[s][3]
        if s > 0 and self.bounds.compressed_backward(s - 1, m, S, M):  # encode the input's
            t += codec[s - 1][2]
        return t


def _inputs(shape: PipelineShape, options: Any, forward: Sequence[float],
            backward: Sequence[float], bandwidth: float, codec_seconds: Any,
            optimizer_seconds: Any, cores: int | None, burst: float) -> _Inputs:
    """:func:`simulate`'s arguments checked (one-line errors) and turned into :class:`_Inputs`."""
    order = _method().order
    message_bytes = _method().message_bytes

    S, M = shape.stages, shape.micro_batches
    for name, v in (("forward", forward), ("backward", backward)):
        if len(v) != S:
            raise UsageError(f"pipeline {name}: {len(v)} times for {S} stages")
    if bandwidth <= 0:
        raise UsageError(f"pipeline bandwidth: got {bandwidth}; use bytes a second > 0")
    if cores is not None and cores < 1:
        raise UsageError(f"pipeline cores: got {cores}; use 1 or more, or None")
    if burst < 0:
        raise UsageError(f"pipeline burst: got {burst}; use bytes >= 0")
    codec: list[tuple[float, ...]] = ([tuple(c) for c in codec_seconds]
                                      if codec_seconds is not None else [(0.0,) * 4] * (S - 1))
    if len(codec) != S - 1 or any(len(c) != 4 for c in codec):
        raise UsageError(f"pipeline codec_seconds: give {S - 1} (encode, decode, encode, "
                         "decode) tuples, one a boundary")
    opt = ([float(optimizer_seconds)] * S if isinstance(optimizer_seconds, (int, float))
           else list(optimizer_seconds))
    if len(opt) != S:
        raise UsageError(f"pipeline optimizer_seconds: {len(opt)} times for {S} stages")
    if options.micro_batches != M:
        raise UsageError(f"pipeline micro_batches: the options say {options.micro_batches}, the "
                         f"shape {M}; give the same M to both")
    fwd, bwd, _ = message_bytes(pipeline_plan(replace(shape, dp=1)), options)
    passes = [order(options.schedule, s, S, M) + [("O", -1)] for s in range(S)]
    return _Inputs(S, M, passes, forward, backward, codec, opt, fwd, bwd, options.boundaries())


class _Simulation:
    """The event loop of :func:`simulate`: the stages' positions in their passes, the links,
    the messages posted, asked for and in flight, and the clock."""

    def __init__(self, inp: _Inputs, *, bandwidth: float, latency: float, cores: int | None,
                 burst: float, rendezvous: bool, acks_queue: bool) -> None:
        S = inp.stages
        self.inp, self.latency, self.cores = inp, latency, cores
        self.rendezvous, self.acks_queue = rendezvous, acks_queue
        self.pos, self.left = [0] * S, [-1.0] * S  # left < 0: no pass in hand
        self.busy = [0.0] * S
        self.arrive: dict[tuple[str, int, int], float] = {}
        self.up = [_Link(bandwidth, burst) for _ in range(S)]
        self.down = [_Link(bandwidth, burst) for _ in range(S)]
        self.sent_by = [0.0] * S
        self.offered: dict[tuple[str, int, int], int] = {}  # posted sends not yet on the wire
        self.asked: dict[tuple[str, int, int], float] = {}  # receives a stage waits in
        self.unsent = [0] * S
        self.began = [0.0] * S
        self.timeline: list[tuple[int, str, int, float, float]] = []
        self.done: list[float | None] = [None] * S
        self.now = 0.0

    def needs(self, s: int) -> float | None:
        """When stage s's next pass can start (None: its message is not on the way yet); with
        ``rendezvous``, a receive asked for is a transfer started if its send is posted."""
        kind, m = self.inp.passes[s][self.pos[s]]
        key = None
        if kind == "F" and s > 0:
            key, frm = ("F", s - 1, m), s - 1
        elif kind == "B" and s < self.inp.stages - 1:
            key, frm = ("B", s, m), s + 1
        if key is not None:
            if key not in self.asked:
                self.asked[key] = self.now
                if key in self.offered:
                    self.transfer(frm, s, key)
            return self.arrive.get(key)
        if kind == "O":
            return self.sent_by[s] if self.unsent[s] == 0 else None
        return self.now

    def transfer(self, s: int, to: int, key: tuple[str, int, int]) -> None:
        """A posted message from s to ``to`` goes on the wire: the sender's upload and the
        receiver's download (after its upload falls idle, with ``acks_queue``)."""
        nbytes = self.offered.pop(key)
        start = max(self.now, self.up[to].free) if self.acks_queue else self.now
        end = max(self.up[s].take(nbytes, start), self.down[to].take(nbytes, start))
        self.arrive[key] = end + self.latency
        self.sent_by[s] = max(self.sent_by[s], end)
        self.unsent[s] -= 1

    def post(self, s: int, to: int, key: tuple[str, int, int], nbytes: int) -> None:
        """A finished pass's send: on the wire now, or (``rendezvous``) once it is asked for."""
        self.offered[key] = nbytes
        self.unsent[s] += 1
        if key in self.asked or not self.rendezvous:
            self.transfer(s, to, key)

    def _start_passes(self) -> list[float]:
        """Every idle stage whose next pass can start takes it; returns the times the others
        can (the next events)."""
        wakes = []
        for s in range(self.inp.stages):
            if self.done[s] is None and self.left[s] < 0:
                t = self.needs(s)
                if t is not None and t <= self.now:
                    self.left[s] = self.inp.cpu(*((s,) + self.inp.passes[s][self.pos[s]]))
                    self.began[s] = self.now
                elif t is not None:
                    wakes.append(t)
        return wakes

    def _finish(self, s: int) -> None:
        """Stage s ends its pass in hand: logged, its message posted, its step done after the
        optimizer."""
        kind, m = self.inp.passes[s][self.pos[s]]
        self.timeline.append((s, kind, m, self.began[s], self.now))
        self.left[s] = -1.0
        self.pos[s] += 1
        if kind == "F" and s < self.inp.stages - 1:
            self.post(s, s + 1, ("F", s, m), self.inp.fwd[s][m])
        elif kind == "B" and s > 0:
            self.post(s, s - 1, ("B", s - 1, m), self.inp.bwd[s - 1][m])
        elif kind == "O":
            self.done[s] = self.now

    def run(self) -> list[float]:
        """Until every stage has stepped: start what can start, advance the clock to the next
        pass end or arrival (the running passes share the cores equally), finish what ended.
        Returns each stage's end."""
        S, cores = self.inp.stages, self.cores
        while any(d is None for d in self.done):
            wakes = self._start_passes()
            running = [s for s in range(S) if self.left[s] >= 0]
            if not running:
                if not wakes:  # cannot happen for a valid schedule; a guard against a silent hang
                    raise RuntimeError("pipeline simulation: every stage waits for a message")
                self.now = min(wakes)
                continue
            rate = min(1.0, cores / len(running)) if cores else 1.0
            dt = min(self.left[s] for s in running) / rate
            if wakes and min(wakes) - self.now < dt:
                dt = min(wakes) - self.now
            self.now += dt
            for s in running:
                self.left[s] -= dt * rate
                self.busy[s] += dt * rate
            for s in running:
                if self.left[s] > 1e-12:
                    continue
                self._finish(s)
        return [d for d in self.done if d is not None]


def simulate(shape: PipelineShape, options: Any, forward: Sequence[float],
             backward: Sequence[float], *, bandwidth: float, latency: float = 0.0,
             codec_seconds: Sequence[Sequence[float]] | None = None,
             optimizer_seconds: float | Sequence[float] = 0.0,
             cores: int | None = None, burst: float = 0.0,
             rendezvous: bool = True, acks_queue: bool = False) -> Simulated:
    """Step 4 (module docstring). ``forward[s]``, ``backward[s]``: stage s's compute seconds of
    one micro-batch (one core); ``codec_seconds[b]``: boundary b's (activation encode,
    activation decode, gradient encode, gradient decode) seconds of one message (the CPU its
    sending and receiving cost, gloo's copies included, belongs in the passes' seconds);
    ``optimizer_seconds``: the optimizer step (one value, or one a stage);
    ``bandwidth``: bytes a second of each stage's link; ``latency``: seconds a message;
    ``cores``: the cores the stages share (None: one each); ``burst``: bytes a link sends at
    once after idling (a token bucket's depth, as ``tc``'s tbf and clouds' burst credits
    shape; 0: a plain rate); ``rendezvous``: a message leaves only once its receiver waits for
    it (gloo's and NCCL's point-to-point: the receiver's posted buffer is the go-ahead), else as
    soon as it is sent; ``acks_queue``: a transfer into a stage waits until that stage's upload
    is idle (TCP's acknowledgements queue behind its outgoing data on a FIFO-shaped link, so
    the incoming, ACK-clocked transfer stalls: the thin-wire testbed's tbf links, home
    uplinks), else the two directions are independent."""
    inp = _inputs(shape, options, forward, backward, bandwidth, codec_seconds,
                  optimizer_seconds, cores, burst)
    sim = _Simulation(inp, bandwidth=bandwidth, latency=latency, cores=cores, burst=burst,
                      rendezvous=rendezvous, acks_queue=acks_queue)
    finished = sim.run()
    sync = _sync_seconds(shape, bandwidth, latency)
    total = max(max(finished), finished[-1] + latency) + sync  # the loss's broadcast
    return Simulated(total, tuple(sim.busy), sync, tuple(sim.timeline))


__all__ = ["PipelineShape", "Simulated", "StepTime", "boundary_bytes", "options_of", "pipeline_plan",
           "simulate", "step_time", "traffic"]

"""The ``pipeline`` method in the planner: boundary bytes from its own traffic formula, step time
of its schedule.

The method's traffic formula (:func:`thinwire.strategies.pipeline.method.traffic`) reads a
:class:`~thinwire.strategies.pipeline.method.PipelinePlan` that a run probes from its model;
here the plan comes from a transformer's dimensions instead, so the planner prices a pipeline run
before it exists, with the very formula the tests hold equal to the ledger:

1. :func:`plan_of`: S stages, dp replicas, M micro-batches of b sequences of length T, d_model
   h: every boundary carries one [b, T, h] activation forward and its gradient backward per
   micro-batch (a transformer's blocks keep their width);
2. :func:`traffic`: the method's formula on that plan, so each message costs the boundary codec's
   own ``payload_bytes`` of the [b, T, h] shape (:mod:`thinwire.strategies.pipeline.codecs`):
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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from thinwire.errors import UsageError

if TYPE_CHECKING:
    from thinwire.strategies.pipeline.method import PipelinePlan
    from thinwire.strategies.traffic import Traffic


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


def plan_of(shape: PipelineShape) -> PipelinePlan:
    """Step 1: the method's stage plan for a transformer of these dimensions."""
    from thinwire.strategies.pipeline.method import PipelinePlan

    S = shape.stages
    return PipelinePlan(S, shape.dp, shape.batch, ((shape.seq, shape.d_model),) * (S - 1),
                        shape.stage_params or (0,) * S, shape.clip)


def options_of(codec_fwd: str = "none", codec_bwd: str = "none", **more: Any) -> Any:
    """The pipeline method's options (defaults, the two codecs, any other option by name); a bad
    spec is a one-line error."""
    from thinwire.strategies.pipeline.method import Options

    return Options(codec_fwd=codec_fwd, codec_bwd=codec_bwd, **more)


def traffic(shape: PipelineShape, options: Any, steps: int = 1) -> Traffic:
    """Step 2: the ledger's totals per rank after ``steps`` steps (rank r is stage r % S of
    replica r // S), from the method's own formula. ``options.micro_batches`` must be M."""
    from thinwire.strategies.pipeline.method import traffic as method_traffic
    from thinwire.strategies.traffic import Layout

    if options.micro_batches != shape.micro_batches:
        raise UsageError(f"pipeline micro_batches: the options say {options.micro_batches}, the "
                         f"shape {shape.micro_batches}; give the same M to both")
    layout = replace(Layout.from_shapes([]), pipeline=plan_of(shape))
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
    sync = 0.0
    if shape.dp > 1 and shape.stage_params:
        grad = 4 * max(shape.stage_params)
        sync = 2 * (shape.dp - 1) / shape.dp * grad / bandwidth + 2 * (shape.dp - 1) * latency
    floor = M * (sum(stage_seconds) + sum(codec)) / cores if cores else 0.0
    return StepTime(S, M, c, e, x, mean, sync, optimizer_seconds, floor)


__all__ = ["PipelineShape", "StepTime", "boundary_bytes", "options_of", "plan_of", "step_time",
           "traffic"]

"""The cost of one worker's failure: torchft's quorum against a restart from a checkpoint.

A fault-tolerant run (``runtime.fault_tolerance torchft``, docs/FAULT_TOLERANCE.md) keeps
going when a worker dies; a restart-based one (``runtime.max_restarts``) starts every worker
again from the last checkpoint. The planner prices one failure of each from the method's
:class:`~thinwire.strategies.entry.Recovery` (data of its registry entry: what a joiner
copies, what a failure discards) and the planned step time t, every byte over the link the
plan's workers share (the cluster's inter-node bandwidth per device, B_link):

1. the recovery bytes (:func:`recovery_bytes`): what a joining worker receives from a live
   peer, the ledger's ``recovery`` tag less torchft's metadata: ``copies`` fp32 tensors the
   size of the worker's parameters P (the model; DiLoCo's theta_g and outer momentum, ...),
   the model's buffers, and the (inner) optimizer's state: k x 4 P bytes (k = 2 for Adam, 1
   for momentum SGD, 0 for SGD) plus Adam's per-tensor step (4 bytes each);
2. with the quorum: Q = the heartbeat timeout (after which the lighthouse counts the worker
   lost, the quorum forms without it) + ``lost_steps`` x t (the refused step or round every
   survivor runs again or loses) + recovery bytes / B_link (a replacement joins; its peers
   wait for it in the synchronous quorum);
3. with a restart: R(C) = the workers' start-up (``startup_s``: process, imports, data,
   model; measured on the target, 0 unless given) + the checkpoint's load (a one-worker
   checkpoint holds the same state: the same bytes over the link from shared storage) + the
   steps since the last checkpoint, on average C / 2 of an interval of C steps, x t;
4. the crossover: the transfer is in both, so a restart costs less per failure only while
   C < C* = 2 (heartbeat + lost_steps t - start-up) / t; and since only the restart needs
   the checkpoints, whose writes (the same bytes over the link every C steps) cost W / (C t)
   of the time, a restart at an interval below C* wins only above the failure rate
   lambda* = 3600 W / (C t (Q - R(C))) per hour (below it, the writes cost more than the
   failures save); at C >= C* the quorum wins at any rate.

Not priced: the quorum's per-round overhead (its RPC to the lighthouse and the commit vote,
a few messages a round), a codec's shared state a joiner copies (PowerSGD's warm-start
factors; residuals start at zero and are not copied) and the fault-tolerant run's own
checkpoints (kept for the job's end, not for a worker's failure). No torch at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from thinwire.errors import UsageError
from thinwire.planner.methods import OPTIMIZER_STATES, bucketed, ist_plan, layout_of, resolve
from thinwire.planner.render import nbytes, rate, seconds
from thinwire.planner.specs import ClusterSpec, ModelSpec

HEARTBEAT_S = 2.0
"""The lighthouse's heartbeat timeout thinwire's launcher starts it with
(:func:`thinwire.launch.launch_replicas`' ``heartbeat_ms``; a test holds them equal)."""

__all__ = ["HEARTBEAT_S", "FailureCost", "failure_cost", "failure_report", "recovery_bytes"]


def recovery_bytes(recovery: Any, params: int, tensors: int, optimizer: str,
                   buffer_bytes: float = 0.0) -> float:
    """Step 1: the bytes of a method's :class:`~thinwire.strategies.entry.Recovery` for a
    worker holding ``params`` fp32 parameters in ``tensors`` tensors, trained by
    ``optimizer`` (``adam``, ``momentum``, ``sgd``), with ``buffer_bytes`` of buffers."""
    out = recovery.copies * 4.0 * params
    if recovery.buffers:
        out += buffer_bytes
    if recovery.optimizer:
        out += OPTIMIZER_STATES[optimizer] * 4.0 * params
        out += 4.0 * tensors if optimizer == "adam" else 0.0
    return out


@dataclass(frozen=True)
class FailureCost:
    """One failure's cost both ways (module docstring, steps 1-4); seconds, bytes, steps."""

    method: str
    parts: tuple[str, ...]
    recovery_bytes: float
    bandwidth: float
    step_time: float
    heartbeat_s: float
    lost_steps: float
    checkpoint_every: int
    startup_s: float

    @property
    def transfer_s(self) -> float:
        """The recovery bytes over the link (the joiner's copy; the restart's load, write)."""
        return self.recovery_bytes / self.bandwidth

    @property
    def quorum_s(self) -> float:
        """Step 2: Q."""
        return self.heartbeat_s + self.lost_steps * self.step_time + self.transfer_s

    @property
    def restart_s(self) -> float:
        """Step 3: R(C)."""
        return self.startup_s + self.transfer_s + self.checkpoint_every / 2 * self.step_time

    @property
    def crossover_interval(self) -> float:
        """Step 4: C*, the checkpoint interval (steps) below which a restart costs less per
        failure (0: never)."""
        return max(0.0, 2 * (self.heartbeat_s + self.lost_steps * self.step_time
                             - self.startup_s) / self.step_time)

    @property
    def crossover_rate(self) -> float | None:
        """Step 4: lambda*, failures per hour above which the restart (at C) loses less time
        than the quorum, its checkpoint writes included; None where the quorum wins at any
        rate (C >= C*)."""
        gap = self.quorum_s - self.restart_s
        if gap <= 0:
            return None
        return 3600.0 * self.transfer_s / (self.checkpoint_every * self.step_time * gap)

    def as_dict(self) -> dict[str, Any]:
        fields = dict(self.__dict__)
        for name in ("transfer_s", "quorum_s", "restart_s", "crossover_interval",
                     "crossover_rate"):
            fields[name] = getattr(self, name)
        return fields


def failure_cost(model: ModelSpec, cluster: ClusterSpec, strategy: Any, step_time: float, *,
                 checkpoint_every: int, startup_s: float = 0.0,
                 heartbeat_s: float = HEARTBEAT_S) -> FailureCost:
    """Steps 1-4 for ``strategy``'s method (the planner's own data parallelism: DDP's) on
    one device's share of ``model`` at the planned ``step_time``; a method that cannot run on
    the quorum, or a checkpoint interval below 1, is a one-line error."""
    from thinwire.strategies import METHODS
    from thinwire.strategies.entry import MethodEntry

    if strategy.method:
        method = resolve(strategy.method)
    else:  # the planner's own data parallelism: the method with DDP's buckets, as it runs
        dp = bucketed()
        assert isinstance(dp, MethodEntry)
        method = resolve(dp.name)
    entry = method.entry
    if not entry.fault_tolerant or entry.recovery is None:
        able = [n for n, e in METHODS.entries() if e.fault_tolerant]
        raise UsageError(f"--failures: method {entry.name} cannot run over a torchft quorum "
                         f"(a failure restarts every worker); methods that can: "
                         f"{', '.join(able)}")
    if checkpoint_every < 1:
        raise UsageError(f"--checkpoint-every {checkpoint_every}: give the restart's checkpoint "
                         "interval in steps, >= 1")
    if startup_s < 0 or heartbeat_s < 0:
        raise UsageError("--startup-s and --heartbeat-s are seconds, >= 0")
    rec = entry.recovery(method.options)
    layout = layout_of(model, strategy.tp, strategy.pp)
    plan = ist_plan(model)
    buffers = sum(4.0 * t.numel for t in plan.tensors if t.buffer) if plan is not None else 0.0
    size = recovery_bytes(rec, layout.numel, len(layout.params), strategy.optimizer, buffers)
    return FailureCost(method.label, rec.parts, size, cluster.inter_bandwidth, step_time,
                       heartbeat_s, rec.lost_steps, checkpoint_every, startup_s)


def failure_report(cost: FailureCost) -> str:
    """The text block ``thinwire plan --failures`` prints."""
    t, n = cost.step_time, nbytes
    rate_ = cost.crossover_rate
    half = cost.checkpoint_every / 2
    lines = [
        f"one worker's failure, {cost.method} (step {seconds(t)}, link {rate(cost.bandwidth)}):",
        f"  recovery a joiner receives: {n(cost.recovery_bytes)} ({', '.join(cost.parts)}), "
        f"{seconds(cost.transfer_s)} over the link",
        f"  torchft quorum: {seconds(cost.quorum_s)} = heartbeat {seconds(cost.heartbeat_s)} + "
        f"{cost.lost_steps:g} steps lost ({seconds(cost.lost_steps * t)}) + recovery "
        f"{seconds(cost.transfer_s)}",
        f"  restart, checkpoint every {cost.checkpoint_every} steps: {seconds(cost.restart_s)} = "
        f"start-up {seconds(cost.startup_s)} (--startup-s) + checkpoint load {seconds(cost.transfer_s)} + "
        f"{half:g} steps redone ({seconds(half * t)})",
        "  crossover: " + (
            "a restart never costs less per failure (its start-up alone exceeds the quorum's "
            "heartbeat and lost steps)" if cost.crossover_interval == 0 else
            "a restart costs less per failure only with checkpoints every "
            f"< {cost.crossover_interval:.3g} steps; " + (
                "at this interval the quorum loses less time at any failure rate"
                if rate_ is None else f"at this interval, its checkpoint writes counted, above "
                f"{rate_:.3g} failures an hour"))]
    return "\n".join(lines) + "\n"

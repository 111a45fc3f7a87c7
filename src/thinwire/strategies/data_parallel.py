"""Data parallelism (``dp``): DistributedDataParallel with its traffic through the ledger.

Every step: 1. forward and backward on the worker's batch; 2. DDP buckets the gradients and
calls our communication hook, which averages each bucket with one all-reduce through
:class:`~thinwire.runtime.comm.Comm` (or, with ``method.compressor``, encodes it, exchanges the
encoding with the collective that fits the codec and decodes:
:func:`thinwire.compression.ddp_hook`); 3. the optimizer steps on the averaged gradient, so every
replica stays identical.

Memory options (``[memory]``, :mod:`thinwire.strategies.memory`): ``zero = 1`` keeps DDP and
steps through :class:`~thinwire.strategies.memory.ShardedOptimizer` (composes with every codec:
the codec averages the gradient, the owners step); ``zero = 2 | 3`` replaces DDP with FSDP2
(no codec: FSDP2 reduces gradients with its own reduce-scatter); ``recompute`` composes with
both. DDP runs with ``gradient_as_bucket_view`` so gradients live in its buckets once.

Parity: with the same global batch, n workers x batch b match one worker x batch n b up to
floating-point summation order (when the model has no batch-statistics layers).

Traffic (:func:`traffic`): DDP hands the hook one bucket of every gradient at step 0 and, from
step 1 on, the buckets it rebuilt in gradient-ready order, each closed as soon as it holds at
least its cap (1 MiB for the first, 25 MiB after: torch's defaults); each bucket is one exchange
of the codec (one all-reduce of 4 d_b bytes without one).

What does not go through DDP's own process-group calls (so that the ledger holds every byte):
DDP is built with ``init_sync=False`` (every rank builds the same model from the same seed, or
loads its own checkpoint: the broadcast of all parameters from rank 0 would be traffic outside
the ledger) and without its per-forward broadcast of buffers (batch norm's running statistics
stay each rank's own; in training mode they feed nothing the forward computes, and rank 0's,
the ones it evaluates and saves, are the same either way). What is left outside the ledger is
DDP's broadcast of the rebuilt bucket assignment, once a process (a few bytes a parameter).

Over a torchft quorum (``--runtime.fault_tolerance torchft``, ``Context.replica``): no DDP; the
step is :class:`~thinwire.strategies.fault.FaultTolerantDP`'s (1. the step's quorum, a joiner
recovering there; 2. the gradients flattened into one tensor and averaged over the live
workers through the codec's all-reduce or all-gather; 3. the vote; 4. kept, the optimizer
steps; dropped, the trainer runs the same step again on the next quorum). Every codec whose
exchange is an all-reduce or an all-gather; ``exchange=scatter`` and ``[memory] zero`` are
refused in one line (:func:`_check`). The checkpoint is the model and optimizer (one worker's:
the codec's residuals are per rank, docs/FAULT_TOLERANCE.md).

Resume: a new process starts DDP from its first-iteration bucket again. So that the step after a
resume sees the buckets of the uninterrupted run (a codec with a scale per bucket or draws over
its positions, such as int8, fp4, QSGD or rand-k, would otherwise encode a differently laid out
bucket, and the ledger would count one more first-iteration step), the first step after
:meth:`DataParallelStrategy.load_state_dict` runs one forward and backward first with the hook silent
(no exchange), the random state and the buffers put back after it, which lets DDP record the
gradient-ready order and rebuild (:meth:`DataParallelStrategy._rebuild_buckets`).

One concept, one file (over 400 lines): the dp method (its strategy over DDP, ZeRO or a torchft
quorum, its bucket traffic formula and registry entry), as every method lives in one module.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from thinwire.compression.registry import check_codec, codec_names
from thinwire.options import OptionError, check, opt
from thinwire.runtime.comm import Comm
from thinwire.strategies.base import (
    Batch,
    Context,
    MemoryReport,
    ReplicatedStrategy,
    lr_at,
    make_optimizer,
    set_lr,
)
from thinwire.strategies.entry import Bucketed, Compressed, MethodEntry, Recovery, Rescalable
from thinwire.strategies.memory import (
    ShardedOptimizer,
    deal,
    full_state,
    gathered_bytes,
    local_state,
    shard_model,
)
from thinwire.strategies.traffic import Layout, ParamInfo, Traffic, wire

BUCKET_FIRST = 1 << 20
"""DDP's first bucket cap in bytes (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``)."""
BUCKET_CAP = 25 << 20
"""DDP's bucket cap in bytes (``bucket_cap_mb=25``)."""


@dataclass(frozen=True)
class Options:
    compressor: str = opt("none", f"gradient codec spec: one of {codec_names()} with its "
                          "options, e.g. topk:ratio=0.01, powersgd:rank=2 (none: plain "
                          "all-reduce)")

    def __post_init__(self) -> None:
        if self.compressor != "none":
            check_codec(self.compressor, "method.compressor")


def quiet_ddp(model: nn.Module, device: torch.device) -> DDP:
    """``model`` in DDP as ``dp`` builds it: gradients as bucket views, and no process-group
    traffic but the hook's (module docstring): no broadcast of the model at construction, none
    of the buffers at each forward."""
    quiet: dict[str, Any] = ({"forward_sync_buffers": False}
             if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
             else {"broadcast_buffers": False})
    return DDP(model, device_ids=None if device.type == "cpu" else [device],
               gradient_as_bucket_view=True, init_sync=False, **quiet)


@dataclass
class PlainState:
    """The plain hook's state: while ``silent`` it exchanges nothing
    (:func:`~thinwire.compression.hooks.rebuild_buckets`)."""

    silent: bool = False


def allreduce_hook(comm: Comm) -> Any:
    """The plain DDP hook: average a bucket with one all-reduce through the ledger (none while
    its state, a :class:`PlainState`, is silent)."""
    from thinwire.compression.hooks import unchanged

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
        if state is not None and state.silent:
            return unchanged(bucket)
        buf = bucket.buffer()
        buf.div_(comm.world_size)
        return comm.all_reduce_async(buf, tag="grad")

    return hook


class DataParallelStrategy(ReplicatedStrategy):
    name = "dp"

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        zero = ctx.cfg.memory.zero if ctx.comm.distributed else 0
        self.shadow = copy.deepcopy(model) if zero >= 2 else None  # unsharded, for evaluation
        super().__init__(ctx, model)
        self.ddp: nn.Module
        self.hook_state: Any = None
        self.sharded = zero >= 2
        self._rebuild_pending = False
        self.plain_state = PlainState()  # the plain hook's (no codec)
        self.ft: Any = None
        if ctx.replica is not None:  # over a torchft quorum: FaultTolerantDP's step
            from thinwire.strategies.fault import FaultTolerantDP

            self.ddp = self.model
            self.ft = FaultTolerantDP(self.model, self.opt, replica=ctx.replica,
                                      codec=ctx.options.compressor, seed=self.cfg.train.seed,
                                      clip_norm=self.cfg.train.clip_norm)
            return
        if self.sharded:
            from thinwire.models import MODELS

            shard_model(self.model, self.comm, ctx.device, zero,
                        MODELS.get(self.cfg.model.name).blocks, ctx.cfg.memory.offload == "params")
            self.ddp = self.model
            self.opt = make_optimizer(self.model.parameters(), self.cfg.train)
            self.meter.gathered_of = lambda: gathered_bytes(self.model)
            return
        if zero == 1:
            self.opt = ShardedOptimizer(self.model.parameters(), self.comm,
                                        lambda ps: make_optimizer(ps, self.cfg.train))
        if self.comm.distributed:
            self.ddp = quiet_ddp(self.model, ctx.device)
            codec = ctx.options.compressor
            if codec == "none":
                self.ddp.register_comm_hook(self.plain_state, allreduce_hook(self.comm))
            else:
                from thinwire.compression import ddp_hook

                state, hook = ddp_hook(codec, comm=self.comm, seed=self.cfg.train.seed)
                self.ddp.register_comm_hook(state, hook)
                self.hook_state = state
        else:
            self.ddp = self.model

    @property
    def quorum(self) -> Any:
        """Over a torchft quorum, what opens each step's quorum and records it
        (``thinwire.ft_trainer``): the :class:`~thinwire.strategies.fault.FaultTolerantDP`."""
        return self.ft

    def train_step(self, batch: Batch, step: int) -> float:
        if self.ft is not None:
            return self._quorum_step(batch, step)
        if self._rebuild_pending:
            self._rebuild_pending = False
            self._rebuild_buckets(batch)
        return self.standard_step(self.ddp, self.opt, batch, step)

    def _quorum_step(self, batch: Batch, step: int) -> float:
        """One step over the quorum (module docstring): the schedule's learning rate, forward,
        backward, then the live average, the vote and (kept) the optimizer step."""
        x, y = batch
        set_lr(self.opt, lr_at(self.cfg.train, step))
        self.model.train()
        self.ft.zero_grad()
        with self.meter.measure():
            loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.ft.step()
        return float(loss.detach())

    def _rebuild_buckets(self, batch: Batch) -> None:
        """Let DDP rebuild its buckets in a resumed process before the first real step:
        :func:`~thinwire.compression.hooks.rebuild_buckets` with one silent forward and backward
        on ``batch`` (module docstring)."""
        from thinwire.compression.hooks import rebuild_buckets

        x, y = batch

        def forward_backward() -> None:
            self.ddp.train()
            self.loss_fn(self.ddp(x), y).backward()

        state = self.plain_state if self.hook_state is None else self.hook_state
        rebuild_buckets(self.ddp, state, forward_backward)

    def eval_model(self) -> nn.Module | None:
        if not self.sharded:
            return super().eval_model()
        state = full_state(self.model, self.comm)  # every rank takes part
        if self.comm.rank != 0 or self.shadow is None:
            return None
        self.shadow.load_state_dict(state)
        return self.shadow.to(self.ctx.device)

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer (local shards under ZeRO-2/3), and with a codec its state
        (error-feedback residuals, PowerSGD's warm-start factors) per parameter, with the step
        count of shared random draws (:meth:`~thinwire.compression.hooks.HookState.export`).
        The resumed run is the uninterrupted one bit for bit, with every codec: its first step
        rebuilds DDP's buckets before it exchanges (:meth:`_rebuild_buckets`)."""
        if not self.sharded:
            out = super().state_dict()
            if self.hook_state is not None:
                out["codec"] = self.hook_state.export(list(self.model.parameters()))
            return out
        return {"model": local_state(self.model.state_dict()),
                "opt": local_state(self.opt.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.sharded:
            super().load_state_dict(state)
            if self.hook_state is not None and "codec" in state:
                self.hook_state.restore(list(self.model.parameters()), state["codec"])
            self._rebuild_pending = self.ddp is not self.model
            return None
        from torch.distributed.tensor import DTensor  # sharded only: a second's import otherwise

        with torch.no_grad():
            for name, t in self.model.state_dict().items():
                local = t.to_local() if isinstance(t, DTensor) else t
                local.copy_(state["model"][name])
        params = list(self.model.parameters())
        opt_state = state["opt"]
        for i, s in opt_state.get("state", {}).items():
            p = params[int(i)]
            for k, v in list(s.items()):
                if isinstance(v, torch.Tensor) and v.dim() > 0 and isinstance(p, DTensor):
                    s[k] = DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape,
                                              stride=p.stride())
        self.opt.load_state_dict(opt_state)
        return None

    def memory(self) -> MemoryReport:
        report = super().memory()
        if not self.sharded:
            return report
        return dataclasses.replace(report, gathered=self.meter.gathered)

    def close(self) -> None:
        # DDP can abort a gloo rank at interpreter exit; drop it before the group goes (the
        # model and optimizer stay readable: they hold no process-group state); the codec's
        # exchange (a background thread for exchange=scatter) ends first.
        if self.hook_state is not None:
            self.hook_state.compressor.close()
        if self.ft is not None:
            self.ft.codec.close()  # the replica is the worker's: it closes it
        self.ddp = self.model
        gc.collect()


def buckets(params: tuple[ParamInfo, ...], first: int = BUCKET_FIRST,
            cap: int = BUCKET_CAP) -> list[list[ParamInfo]]:
    """DDP's rebuilt buckets over parameters in gradient-ready order (module docstring)."""
    out: list[list[ParamInfo]] = []
    current: list[ParamInfo] = []
    size, limit = 0, first
    for p in params:
        current.append(p)
        size += p.numel * p.itemsize
        if size >= limit:
            out.append(current)
            current, size, limit = [], 0, cap
    if current:
        out.append(current)
    return out


def bucket_traffic(layout: Layout, codec: str, workers: int, steps: int) -> Traffic:
    """Ledger bytes of ``steps`` DDP steps through ``codec``: step 0 one bucket of everything,
    later steps the rebuilt buckets (shared with other methods that average through DDP)."""
    n = workers
    if n <= 1 or steps < 1:
        return Traffic.none(n)

    def collectives(bucket: list[ParamInfo]) -> list[tuple[str, int]]:
        numel = sum(p.numel for p in bucket)
        if codec == "none":
            return [("all_reduce", 4 * numel)]
        from thinwire.compression import build

        return build(codec).collectives(numel, [p.shape for p in bucket], world=n)

    first = [collectives(list(layout.params))]
    later = [collectives(b) for b in buckets(layout.ready_order)]
    calls: dict[str, tuple[int, int]] = {}
    pay = sent = 0
    for step_calls, times in ((first, 1), (later, steps - 1)):
        for bucket_calls in step_calls:
            for op, payload in bucket_calls:
                w = wire(op, payload, n)
                pay += payload * times
                sent += w * times
                c, b = calls.get(op, (0, 0))
                calls[op] = (c + times, b + w * times)
    return Traffic((sent,) * n, (sent,) * n, (pay,) * n, calls)


def traffic(layout: Layout, options: Options, workers: int, steps: int, seed: int,
            optimizer_states: int = 0) -> Traffic:
    del seed, optimizer_states
    return bucket_traffic(layout, options.compressor, workers, steps)


def _check(cfg: Any) -> None:
    """``[memory]`` with this method's options: FSDP2 (ZeRO-2/3) takes no gradient codec; over
    a torchft quorum, neither ``[memory] zero`` nor a codec exchanged by an all-to-all."""
    codec = cfg.method.options.compressor
    check(cfg.memory.zero < 2 or codec == "none", "memory.zero",
          f"FSDP2 reduces gradients with its own reduce-scatter, a codec ({codec}) needs "
          "DDP's hook; use --memory.zero 1 with a compressor, or drop the compressor")
    if cfg.runtime.fault_tolerance == "none":
        return
    check(cfg.memory.zero == 0, "memory.zero",
          "dp over a torchft quorum keeps the whole optimizer on every worker (a lost owner "
          "would lose its shard); drop --memory.zero or --runtime.fault_tolerance")
    if codec != "none":
        from thinwire.compression import build

        check(type(build(codec)).__name__ != "ScatteredExchange", "method.compressor",
              f"{codec} exchanges with an all-to-all, which dp over a torchft quorum does not "
              "carry yet; drop exchange=scatter")


def _label(o: Options) -> str:
    if o.compressor == "none":
        return "dp"
    from thinwire.compression import build

    return f"dp+{build(o.compressor).describe()}"


def _alias(name: str, values: Mapping[str, str]) -> dict[str, str] | None:
    """A codec's name is shorthand for dp with that codec: ``topk:ratio=0.01``."""
    from thinwire.compression import CODECS

    if name == "none" or name not in CODECS:
        return None
    spec = name + (":" + ",".join(f"{k}={v}" for k, v in values.items()) if values else "")
    return {"name": "dp", "compressor": spec}


def _check_model(cfg: Any, model: nn.Module) -> None:
    """A codec that cannot compress this model's gradients is refused (one line)."""
    spec = cfg.method.options.compressor
    if spec == "none":
        return
    from thinwire.compression import build

    why = build(spec).cannot_compress([tuple(p.shape) for p in model.parameters()
                                       if p.requires_grad])
    if why:
        raise OptionError(f"method.compressor: {why}")


class DataParallelEntry(MethodEntry, Rescalable, Compressed, Bucketed):
    """dp's registry entry: rescalable without a codec (a codec's residuals are per rank), its
    codec is ``compressor``, and it declares DDP's bucket traffic and ZeRO-1's owners, which
    the planner prices other methods' DDP averaging and ``[memory]`` runs with."""

    def rescalable(self, options: Options) -> bool:
        return options.compressor == "none"

    def codec(self, options: Options) -> str:
        return options.compressor

    def uncompressed(self, options: Options) -> Options:
        return dataclasses.replace(options, compressor="none")

    def buckets(self, layout: Layout, codec: str, workers: int, steps: int) -> Traffic:
        return bucket_traffic(layout, codec, workers, steps)

    def owners(self, sizes: Sequence[int], n: int) -> list[int]:
        return deal(sizes, n)


METHOD = DataParallelEntry(
    name="dp", summary="data parallelism (DDP), optionally with a gradient codec",
    strategy="thinwire.strategies.data_parallel:DataParallelStrategy", options=Options,
    label=_label, check=_check, traffic=traffic, alias=_alias, memory=("zero", "recompute"),
    check_model=_check_model, fault_tolerant=True, recovery=lambda o: Recovery(lost_steps=1))

__all__ = ["METHOD", "DataParallelStrategy", "DataParallelEntry", "Options", "allreduce_hook",
           "bucket_traffic", "buckets"]

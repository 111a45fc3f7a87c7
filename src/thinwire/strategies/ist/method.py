"""Independent Subnetwork Training (``ist``) as a method of the trainer.

Yuan et al., VLDB 2022; ResIST (Dun et al., UAI 2022) and GIST (Wolfe et al.) for other model
families. The algorithm lives in :class:`~thinwire.strategies.ist.core.IST` (usable in a user's
own loop); this module gives it to the trainer: its options, label, checks, its traffic formula
and the Strategy, which wraps the run's model and optimizer with :class:`IST` and takes the
standard step. The model's units come from its registry entry's adapter (``ModelEntry.ist``).

Local steps: ``method.local_steps = 0`` (the default) takes the model's own K, its adapter's
``default_local_steps`` (10; 50 for the ResNet, as ResIST), read from the registry entry's
adapter class without building the model. :func:`local_steps` resolves K, the one place that
does: the config's checks and synchronisation period (through the entry's ``for_model``: steps,
evaluations and checkpoints are aligned to the model's K), the Strategy (from the run's
adapter), the traffic formula and the planner (from the plan's ``default_local_steps``).

Hybrid schedule: with ``method.switch_at = S`` the run switches to local SGD (period
``method.period``) on the full model at step S: IST's early speed without its accuracy ceiling
(ResIST's converse, which warmed up with local SGD). With ``method.switch_patience = P`` instead
the switch needs no hand-picked step (:class:`PlateauRule`): 1. after every evaluation the rank
that evaluated the full model appends the metric to its history; 2. once the history holds more
than P values, it compares the best of the last P with the best before them; 3. if they gain no
more than ``method.switch_tol`` (IST's curve has flattened), 4. it broadcasts the decision
(one control-tagged number through the Comm, every evaluation, so every rank takes the same
branch) and 5. every rank switches at the next step, a synchronisation point (evaluations
fall on multiples of lcm(K, H)). Measured (docs/benchmarks/ist.md, "IST's time to DP's converged
accuracy"): the earlier the switch, the better the hybrid ends, and none reaches DP's converged
accuracy as soon as local SGD alone; the default tolerance (0.5 points) switches early.

Defaults: the recommended configuration, the same as ``thinwire.IST``'s and read from the same
place (:mod:`~thinwire.strategies.ist.defaults`): ``overlap = 0`` (auto, each unit on
max(1, workers // 2) workers) and ``optimizer_state = auto`` (the model family's), the measured
best of ``benchmarks/ist_quality.py``. The published algorithm is ``method.overlap = 1`` and
``method.optimizer_state = reset`` (``--method ist:overlap=1,optimizer_state=reset``).

The original code's behaviour, for exact comparisons with it (docs/IST.md, "Deviations"):
``method.drop_last_step`` (its round sends the subnet back after K - 1 updates; the K-th is
lost) and ``method.shards = whole`` (every worker samples the whole training set, in the same
seeded order). Both default to thinwire's choice: all K steps count, a disjoint shard per rank.

Traffic per round r (:func:`traffic`, exact): owner o sends worker w the piece of w's subnet it
stores (:func:`~thinwire.strategies.ist.pieces.piece_matrix`) and gets it back after K steps;
the shared tensors' updates are averaged with one all-reduce. With ``optimizer_state =
reindex`` every parameter element carries its per-element optimizer state along, except on the
way down in round 0, when no state exists yet. The switch of the hybrid schedule sends every
rank's stored slices to every other rank once, then local SGD's averages follow.

Over a torchft quorum (``--runtime.fault_tolerance torchft``, ``Context.replica``): the
Strategy wraps the model with :class:`~thinwire.strategies.ist.fault.FaultTolerantIST` instead
(its steps 1-6: a worker lost mid-round loses only its round, the next round is dealt over the
workers alive then, a joining worker receives its subnet at the next round boundary; central:
the whole model on :data:`KEEPERS` workers, sharded: every block of units on :data:`KEEPERS`
workers, :mod:`~thinwire.strategies.ist.fault_sharded`). Central: every keeper evaluates its
stored model; at the last step every live worker receives the full model (``finish``) and
evaluates and exports it; the first live keeper writes the checkpoint (a one-worker central IST
state). Sharded: no worker holds the whole model between rounds, so the run evaluates and
checkpoints only at its end (``train.eval_every`` and ``run.checkpoint_every`` other than
``train.steps`` or 0 are refused in one line); ``finish`` assembles the model on every live
worker and the lowest writes the same one-worker checkpoint. Refused in one line, as
``FaultTolerantIST`` refuses them: the hybrid schedule (its switch needs a message outside a
round), the outer optimizer with the sharded store (its blocks do not carry the momentum yet);
and ``shards = whole`` (each worker reads its own shard over the quorum).

One concept, one file (over 400 lines): the ist method (its options, checks, label, strategy
and traffic formula), as every method lives in one module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from thinwire.errors import UsageError
from thinwire.models.adapter import ISTAdapter, ISTPlan
from thinwire.options import check, opt
from thinwire.strategies.base import (
    Batch,
    Context,
    MemoryReport,
    Strategy,
    make_optimizer,
    memory_of,
)
from thinwire.strategies.entry import MethodEntry, ModelDefaults, Recovery, Subnets
from thinwire.strategies.ist import defaults
from thinwire.strategies.ist import pieces as pc
from thinwire.strategies.ist.optstate import reindexes
from thinwire.strategies.ist.partition import partition_groups, resolve_overlap
from thinwire.strategies.traffic import Layout, Traffic, ring_all_reduce


@dataclass(frozen=True)
class Options:
    local_steps: int = opt(0, "local optimizer steps per round (K); 0: the model's default "
                           "(10; resnet 50, as ResIST)")
    deployment: str = opt("central", "where the full model is stored: central (rank 0, which "
                          "also trains a subnet) or sharded (1/n on every rank)",
                          choices=("central", "sharded"))
    scale: str = opt("auto", "activation scaling: auto (the model's default), batchnorm (batch "
                     "statistics), dropout (inverted dropout), eval (the full model's "
                     "partitioned blocks scaled at evaluation, ResIST) or none",
                     choices=("auto", "batchnorm", "dropout", "eval", "none"))
    optimizer_state: str = opt(defaults.OPTIMIZER_STATE, "optimizer state at repartition: "
                               "auto (the model's: reset for the resnet, reindex otherwise; "
                               "the recommended default, as thinwire.IST's), reset (fresh each "
                               "round, as published) or reindex (it travels with the subnet)",
                               choices=("auto", "reset", "reindex"))
    overlap: int = opt(defaults.OVERLAP, "workers holding each unit of a cut group: 0, auto "
                       "(the recommended default, as thinwire.IST's): max(1, workers // 2), "
                       "every subnet about half the model's cut units (docs/IST.md, 'Getting "
                       "a good model out of IST'); 1: disjoint subnets, as published; up to "
                       "the number of workers (everyone holds everything)")
    outer_lr: float = opt(1.0, "outer SGD on each round's change of the stored model (DiLoCo's "
                          "outer step); 1 with outer_momentum 0: none")
    outer_momentum: float = opt(0.0, "Nesterov momentum of the outer step (0: none)")
    switch_at: int = opt(0, "hybrid schedule: switch to local SGD at this step (0: never)")
    switch_patience: int = opt(0, "hybrid schedule, automatic: switch to local SGD once the "
                               "evaluation metric's best over the last P evaluations is no more "
                               "than method.switch_tol better than its best before them (0: "
                               "off; needs train.eval_every)")
    switch_tol: float = opt(0.005, "with method.switch_patience: the gain (metric units, e.g. "
                            "accuracy 0.005 = 0.5 points) below which IST's curve counts as flat")
    period: int = opt(10, "after the switch: local SGD's steps between averages (H)")
    drop_last_step: bool = opt(False, "as the original code: the K-th step of each round is "
                               "taken but its update is lost (the subnet travels back after "
                               "K - 1 updates); for exact comparisons with it")
    shards: str = opt("own", "training data per rank: own (a disjoint shard each) or whole "
                      "(every rank samples the whole training set in the same seeded order, as "
                      "the original code)", choices=("own", "whole"))

    def __post_init__(self) -> None:
        check(self.local_steps >= 0, "method.local_steps", "must be >= 1, or 0 for the model's "
              "default")
        check(self.overlap >= 0, "method.overlap", "must be >= 1, or 0 for auto")
        check(self.outer_lr > 0, "method.outer_lr", "must be > 0 (1: no outer step)")
        check(0 <= self.outer_momentum < 1, "method.outer_momentum", "must be in [0, 1)")
        check(self.switch_at >= 0, "method.switch_at", "must be >= 0")
        check(self.period >= 1, "method.period", "must be >= 1")
        check(self.switch_patience >= 0, "method.switch_patience", "must be >= 0 (0: off)")
        check(self.switch_tol >= 0, "method.switch_tol", "must be >= 0")
        check(not (self.switch_at and self.switch_patience), "method.switch_patience",
              "cannot be combined with method.switch_at (both choose the switch "
              "step); set one of them to 0")
        if self.local_steps:
            _check_k(self, self.local_steps)

    @property
    def hybrid(self) -> bool:
        """Whether the run may switch to local SGD (at a set step or automatically)."""
        return bool(self.switch_at or self.switch_patience)


class PlateauRule:
    """The automatic switch's test (module docstring, steps 1-3): the metric has flattened when
    the best of its last ``patience`` values is no more than ``tol`` better than the best
    before them. Kept on the rank that evaluates; its history is part of the checkpoint."""

    def __init__(self, patience: int, tol: float) -> None:
        self.patience, self.tol = patience, tol
        self.history: list[float] = []

    def flat(self, value: float, higher_is_better: bool) -> bool:
        """Append ``value`` (step 1); whether the curve is flat now (steps 2-3)."""
        self.history.append(value)
        if len(self.history) <= self.patience:
            return False
        sign = 1.0 if higher_is_better else -1.0
        before = max(sign * v for v in self.history[:-self.patience])
        recent = max(sign * v for v in self.history[-self.patience:])
        return recent - before <= self.tol


def _check_k(o: Options, k: int) -> None:
    check(o.switch_at % k == 0, "method.switch_at",
          f"must be a multiple of the local steps per round ({k})")
    check(not o.drop_last_step or k >= 2, "method.drop_last_step",
          f"discards the K-th update of each round; it needs method.local_steps >= 2, got {k}")


def local_steps(o: Options, model: ISTPlan | ISTAdapter | Callable[..., Any] | None) -> int:
    """K, resolved here and nowhere else (module docstring, "Local steps"): 1. a set
    ``local_steps`` is K; 2. else the model's ``default_local_steps``, read from ``model``: its
    IST plan, its adapter, or its registry entry's ``ist`` (an adapter class; a plain
    function, such as the MLP's ``linear_stack``, or None: the generic
    :attr:`ISTAdapter.default_local_steps`, 10)."""
    if o.local_steps:
        return o.local_steps
    if isinstance(model, (ISTPlan, ISTAdapter)) or (
            isinstance(model, type) and issubclass(model, ISTAdapter)):
        return int(model.default_local_steps)
    return ISTAdapter.default_local_steps


def _sync_period(o: Options, k: int) -> int:
    """Steps between synchronisations at K = ``k``: lcm(K, H) when the run may switch to local
    SGD, else K."""
    return int(np.lcm(k, o.period)) if o.hybrid else k


def _sync_every(o: Options) -> int:
    if not o.local_steps:
        return 1  # K is the model's: ``sync_every_for`` (via ``for_model``) knows it
    return _sync_period(o, o.local_steps)


def local_steps_of(cfg: Any) -> int:
    """K of an ``ist`` run config (:func:`local_steps` of its model's registry entry)."""
    from thinwire.models import MODELS

    return local_steps(cfg.method.options, MODELS.get(cfg.model.name).ist)


KEEPERS = 2
"""Over a torchft quorum: the live workers storing the whole model (central) or each block of
units (sharded; FaultTolerantIST's ``keepers``): one may be lost in a round and nothing is
lost."""


def _check_quorum(cfg: Any) -> None:
    """Over a torchft quorum, what FaultTolerantIST refuses (one line each), and the
    evaluations and checkpoints at round boundaries."""
    o: Options = cfg.method.options
    if o.deployment == "sharded":
        for name, every in (("train.eval_every", cfg.train.eval_every),
                            ("run.checkpoint_every", cfg.run.checkpoint_every)):
            check(every in (0, cfg.train.steps), name,
                  f"{every}: over a torchft quorum sharded ist holds the whole model on no "
                  "worker between rounds, so it evaluates and checkpoints only at the end; "
                  f"use 0 or train.steps ({cfg.train.steps}), or --method.deployment central")
        check((o.outer_lr, o.outer_momentum) == (1.0, 0.0), "method.outer_lr",
              "over a torchft quorum the sharded store's blocks do not carry the outer "
              "optimizer's momentum yet; leave method.outer_lr at 1 and method.outer_momentum "
              "at 0, or use --method.deployment central")
    check(not (o.switch_at or o.switch_patience), "method.switch_at",
          "over a torchft quorum the hybrid schedule's switch is not carried yet; leave "
          "method.switch_at and method.switch_patience at 0")
    check(o.shards == "own", "method.shards",
          "over a torchft quorum each worker reads its own shard (a lost worker's is not read "
          "while it is gone); leave method.shards at own")
    k = o.local_steps or local_steps_of(cfg)
    for name, every in (("train.steps", cfg.train.steps),
                        ("train.eval_every", cfg.train.eval_every),
                        ("run.checkpoint_every", cfg.run.checkpoint_every)):
        check(every % k == 0, name,
              f"{every} is not a multiple of K = {k}: over a torchft quorum ist evaluates and "
              f"checkpoints at round boundaries; use a multiple of {k}")


def _check(cfg: Any) -> None:
    """The overlap against the workers; with an automatic K: the config's step alignment
    against the model's K; over a torchft quorum, :func:`_check_quorum`."""
    o: Options = cfg.method.options
    if cfg.runtime.fault_tolerance != "none":
        _check_quorum(cfg)
    check(o.overlap <= cfg.runtime.workers, "method.overlap",
          f"{o.overlap} is more workers than the run has ({cfg.runtime.workers}); use 1 to "
          f"{cfg.runtime.workers}, or 0 for auto")
    if o.switch_patience and not cfg.train.eval_every:
        raise UsageError("method.switch_patience switches on the evaluation curve; set "
                         "train.eval_every (e.g. a few times per 10% of train.steps)")
    if o.local_steps:
        return
    k = local_steps_of(cfg)
    _check_k(o, k)
    sync = _sync_period(o, k)
    for name, every in (("train.steps", cfg.train.steps),
                        ("train.eval_every", cfg.train.eval_every),
                        ("run.checkpoint_every", cfg.run.checkpoint_every)):
        check(every % sync == 0, name,
              f"{every} is not a multiple of {sync}, the steps between synchronisations of ist "
              f"on {cfg.model.name} (K = {k}, its default; set method.local_steps to change "
              f"it); use a multiple of {sync}")


def _label(o: Options) -> str:
    """What runs: K, the deployment and every option that departs from the published algorithm
    (:data:`~thinwire.strategies.ist.defaults.PUBLISHED`), so the default reads
    ``ist(K=auto,central,auto,overlap=auto)`` and ``ist:overlap=1,optimizer_state=reset``
    reads ``ist(K=auto,central)``."""
    hybrid = f"->localsgd@{o.switch_at}" if o.switch_at else ""
    if o.switch_patience:
        hybrid = f"->localsgd@plateau(P={o.switch_patience},tol={o.switch_tol:g})"
    if hybrid and o.period != 10:
        hybrid += f"(H={o.period})"
    scale = f",{o.scale}-scale" if o.scale != "auto" else ""
    published = defaults.PUBLISHED
    state = f",{o.optimizer_state}" if o.optimizer_state != published["optimizer_state"] else ""
    drop = ",drop-last" if o.drop_last_step else ""
    whole = ",whole-data" if o.shards == "whole" else ""
    overlap = f",overlap={o.overlap or 'auto'}" if o.overlap != published["overlap"] else ""
    outer = (f",outer={o.outer_lr:g}/{o.outer_momentum:g}"
             if (o.outer_lr, o.outer_momentum) != (1.0, 0.0) else "")
    k = o.local_steps or "auto"
    return f"ist(K={k},{o.deployment}{scale}{state}{overlap}{outer}{drop}{whole}){hybrid}"


def data_shard(o: Options, rank: int, world: int) -> tuple[int, int]:
    """(shard, shards) a rank reads: its own of ``world`` disjoint shards, or, with ``shards =
    whole``, shard 0 of 1 on every rank; the batch stream is seeded by the shard, so every rank
    then draws the same mini-batches, the original code's identically seeded shuffles."""
    return (0, 1) if o.shards == "whole" else (rank, world)


def adapter_for(cfg: Any, model: nn.Module) -> ISTAdapter:
    """The IST adapter of the run's model (its registry entry's), or a one-line error."""
    from thinwire.models import MODELS

    entry = MODELS.get(cfg.model.name)
    if entry.ist is None:
        raise UsageError(f"model {cfg.model.name} has no IST units; use another method or model")
    return entry.ist(model)


def _check_model(cfg: Any, model: nn.Module) -> None:
    adapter = adapter_for(cfg, model)
    n = cfg.runtime.workers
    for g in adapter.plan.groups:
        if g.kind == "disjoint" and g.size < n:
            raise UsageError(f"IST cuts {g.name} of {cfg.model.name} ({g.size} units) into {n} "
                             f"subnets; use >= {n} units there or fewer workers")
    scale = cfg.method.options.scale
    if scale != "auto" and scale not in adapter.scales:
        raise UsageError(f"method.scale {scale} does not fit {cfg.model.name} with these "
                         f"options; use one of {', '.join(adapter.scales)} (batchnorm needs a "
                         "batch-statistics norm after every cut layer)")


class ISTStrategy(Strategy):
    name = "ist"

    def __init__(self, ctx: Context, model: nn.Module) -> None:
        from thinwire.strategies.averaging import LocalSGD
        from thinwire.strategies.ist.core import IST

        super().__init__(ctx, model)
        o: Options = ctx.options
        self.o = o
        self.model = model.to(ctx.device)
        self.opt = make_optimizer(self.model.parameters(), self.cfg.train)
        adapter = adapter_for(self.cfg, model)
        self.k = local_steps(o, adapter)
        self.ft: Any = None
        self.ist: IST
        self._final_state: dict[str, Any] | None = None
        self._local_cls = LocalSGD
        self.local: Any = None
        if ctx.replica is not None:  # over a torchft quorum (module docstring)
            from thinwire.strategies.ist.fault import FaultTolerantIST

            self.ist = self.ft = FaultTolerantIST(
                self.model, self.opt, replica=ctx.replica, workers=self.cfg.runtime.workers,
                keepers=KEEPERS, local_steps=self.k, seed=self.cfg.train.seed,
                deployment=o.deployment,
                scale=None if o.scale == "auto" else o.scale,
                optimizer_state=o.optimizer_state, adapter=adapter,
                drop_last_step=o.drop_last_step, overlap=o.overlap, outer_lr=o.outer_lr,
                outer_momentum=o.outer_momentum)
            self.switch_step = 0
            self.rule = None
            return
        self.ist = IST(self.model, self.opt, comm=self.comm, local_steps=self.k,
                       seed=self.cfg.train.seed, deployment=o.deployment,
                       scale=None if o.scale == "auto" else o.scale,
                       optimizer_state=o.optimizer_state, adapter=adapter,
                       drop_last_step=o.drop_last_step, overlap=o.overlap,
                       outer_lr=o.outer_lr, outer_momentum=o.outer_momentum)
        self.switch_step = o.switch_at  # 0: not (yet) chosen
        self.rule = PlateauRule(o.switch_patience, o.switch_tol) if o.switch_patience else None

    def data_shard(self) -> tuple[int, int]:
        return data_shard(self.o, self.comm.rank, self.comm.world_size)

    # --- over a torchft quorum (thinwire.ft_trainer) -----------------------------------------
    @property
    def quorum(self) -> Any:
        """What opens each round's quorum and records it: the FaultTolerantIST."""
        return self.ft

    def live_model(self, final: bool) -> nn.Module | None:
        """The model this worker evaluates over the quorum: a keeper's stored model (None on
        other workers, and on every worker of the sharded store: no message outside a round);
        at the end, the full model on every live worker (``finish``: the first live keeper's
        store, or every block, over the last quorum), then the checkpoint writer's one-worker
        state (a keeper's store; sharded, the store ``finish`` assembled on it)."""
        if not final:
            return self.ist.full_model()
        model = self.ist.finish()
        if self.ft.writes_checkpoint:
            self._final_state = self.ist.state_dict()
        return model

    def _switch(self, *, resuming: bool = False) -> None:
        """Hybrid schedule: every rank gets the full model, then local SGD continues, averaging
        after global steps that are multiples of its period (resuming: the model comes from
        the checkpoint, nothing travels)."""
        if resuming:
            self.ist.abandon()
        else:
            self.ist.finish()
        self.local = self._local_cls(self.model, self.opt, self.o.period, comm=self.comm)
        self.local.steps = self.switch_step

    def observe(self, step: int, value: float | None, higher_is_better: bool) -> None:
        """The automatic switch (module docstring): rank 0, which evaluates IST's full model,
        decides; the decision reaches every rank by one broadcast."""
        if self.rule is None or self.local is not None or self.switch_step:
            return
        flat = value is not None and self.rule.flat(value, higher_is_better)
        device = next(self.model.parameters()).device  # nccl broadcasts device tensors only
        decision = torch.tensor([1.0 if flat else 0.0], device=device)
        if self.comm.world_size > 1:
            self.comm.broadcast(decision, 0, tag="control")
        if decision.item():
            self.switch_step = step

    def train_step(self, batch: Batch, step: int) -> float:
        if self.switch_step and step >= self.switch_step and self.local is None:
            self._switch()
        return self.standard_step(self.model, self.opt, batch, step)

    def eval_model(self) -> nn.Module | None:
        if self.local is not None:
            return self.model if self.comm.rank == 0 else None
        return self.ist.full_model(to=0, tag="control")

    def state_dict(self) -> dict[str, Any]:
        if self.ft is not None and self.ist.finished:  # the store as it was before finish
            return {"ist": self._final_state or {}, "switch_step": 0}
        if self.local is not None:
            return {"local": self.local.state_dict(), "model": self.model.state_dict(),
                    "opt": self.opt.state_dict(), "switch_step": self.switch_step}
        state: dict[str, Any] = {"ist": self.ist.state_dict(), "switch_step": self.switch_step}
        if self.rule is not None:
            state["plateau"] = torch.tensor(self.rule.history, dtype=torch.float64)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.switch_step = int(state.get("switch_step", self.o.switch_at))
        if self.rule is not None and "plateau" in state:
            self.rule.history = [float(v) for v in state["plateau"].tolist()]
        if "local" in state:
            self._switch(resuming=True)
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["opt"])
            self.local.load_state_dict(state["local"])
            return
        self.ist.load_state_dict(state["ist"])

    def memory(self) -> MemoryReport:
        if self.local is not None:
            return memory_of(self.model.parameters(), self.opt)
        sub = self.ist.subnet_numel(0)
        stored = self.ist.stored_numel()
        t = self.cfg.train
        buffers = 2 if t.optimizer == "adamw" else (1 if t.momentum > 0 else 0)
        state_stored = sum(x.numel() for d in self.ist.state_store.values() for x in d.values())
        if self.ist.reindex and not state_stored:
            state_stored = buffers * stored
        return MemoryReport(params=4 * (sub + stored), grads=4 * sub,
                            optimizer=4 * buffers * sub + 4 * state_stored, param_count=sub,
                            stored_count=stored)

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
        if self.ft is not None:
            self.ft.close()  # its hooks; the replica is the worker's, which closes it


def ist_traffic(plan: ISTPlan, o: Options, workers: int, steps: int, seed: int,
                optimizer_states: int = 0) -> Traffic:
    """The ledger bytes of a run (module docstring). With ``switch_patience`` the switch step
    is found during the run: the prediction is IST's throughout (a lower bound; the
    decision's broadcasts are control traffic)."""
    n = workers
    if n <= 1:
        return Traffic.none(n)
    own = pc.Ownership(plan, n, o.deployment)
    groups = [(g.name, g.size, g.kind) for g in plan.groups]
    k = local_steps(o, plan)
    copies = (optimizer_states if reindexes(o.optimizer_state, plan.default_optimizer_state)
              else 0)
    last = o.switch_at if o.switch_at else steps
    sent = np.zeros(n, dtype=np.int64)
    recv = np.zeros(n, dtype=np.int64)
    rank0_p2p = [0, 0]
    shared_calls = [0, 0]
    shared = pc.shared_bytes(plan, state_copies=copies)
    overlap = resolve_overlap(o.overlap, n)
    for r in range(min(last, steps) // k):
        held = partition_groups(groups, n, seed, r, overlap)
        down = pc.piece_matrix(plan, own, held, state_copies=copies if r > 0 else 0)
        up = pc.piece_matrix(plan, own, held, state_copies=copies)
        out_d, in_d = down.sum(axis=1), down.sum(axis=0)
        out_u, in_u = up.sum(axis=0), up.sum(axis=1)  # workers send up, owners receive
        sent += out_d + out_u
        recv += in_d + in_u
        rank0_p2p[0] += 2
        rank0_p2p[1] += int(max(out_d[0], in_d[0]) + max(out_u[0], in_u[0]))
        if shared:
            w = ring_all_reduce(shared, n)
            sent += w
            recv += w
            shared_calls[0] += 1
            shared_calls[1] += w
    payload = sent + recv - (shared_calls[1] * 2) + shared * shared_calls[0]
    calls: dict[str, tuple[int, int]] = {"p2p": (rank0_p2p[0], rank0_p2p[1])}
    if shared_calls[0]:
        calls["all_reduce"] = (shared_calls[0], shared_calls[1])
    total = Traffic(tuple(int(x) for x in sent), tuple(int(x) for x in recv),
                    tuple(int(x) for x in payload), calls)
    if o.switch_at and steps > o.switch_at:
        stored = [4 * pc.stored_numel(plan, own, r) - 4 * _shared_numel(plan) for r in range(n)]
        s_sent = tuple((n - 1) * stored[r] for r in range(n))
        s_recv = tuple(sum(stored) - stored[r] for r in range(n))
        total = total + Traffic(s_sent, s_recv, tuple(a + b for a, b in zip(s_sent, s_recv)),
                                {"p2p": (1, max(s_sent[0], s_recv[0]))})
        numel = sum(t.numel for t in plan.tensors if not t.buffer)
        rounds = (steps - o.switch_at) // o.period
        total = total + Traffic.uniform(n, "all_reduce", [4 * numel] * rounds)
    return total


def _shared_numel(plan: ISTPlan) -> int:
    return sum(t.numel for t in plan.tensors if t.shared)


def traffic(layout: Layout, options: Options, workers: int, steps: int, seed: int,
            optimizer_states: int = 0) -> Traffic:
    if layout.ist is None:
        raise UsageError("IST traffic needs the model's IST plan (an adapter)")
    return ist_traffic(layout.ist, options, workers, steps, seed, optimizer_states)


def held_by(o: Options, workers: int) -> int:
    """Workers holding each unit of a cut group under ``o`` (``overlap``, 0 resolved)."""
    return resolve_overlap(o.overlap, workers)


def worker_numel(plan: ISTPlan, workers: int, overlap: int = 1) -> float:
    """Elements a worker's subnet trains when ``plan``'s units are dealt over ``workers``
    (round 0's partition, each unit held by ``overlap`` workers, resolved: 1 is the published
    disjoint form; the mean over workers; buffers excluded). Pure: the planner's compute and
    memory of a subnet read it."""
    held = partition_groups([(g.name, g.size, g.kind) for g in plan.groups], workers, 0, 0,
                            overlap)
    total = sum(pc.subnet_numel(t, held, w) for t in plan.tensors if not t.buffer
                for w in range(workers))
    return total / workers


class ISTEntry(MethodEntry, ModelDefaults, Subnets):
    """ist's registry entry: K defaults to the model's (:func:`local_steps`), and a worker
    trains a subnet of the model's IST plan (:func:`worker_numel`, :func:`held_by`)."""

    def for_model(self, options: Options, ist: Any) -> Options:
        return dataclasses.replace(options, local_steps=local_steps(options, ist))

    def worker_numel(self, plan: ISTPlan, workers: int, overlap: int = 1) -> float:
        return worker_numel(plan, workers, overlap)

    def overlap(self, options: Options, workers: int) -> int:
        return held_by(options, workers)


METHOD = ISTEntry(
    name="ist", summary="Independent Subnetwork Training: subnets dealt afresh each round (each "
                        "unit on half the workers by default), K local steps a round",
    strategy="thinwire.strategies.ist.method:ISTStrategy", options=Options, label=_label,
    sync_every=_sync_every, check=_check, check_model=_check_model, traffic=traffic,
    fault_tolerant=True,
    # a lost keeper's replacement receives the whole store (the dealt optimizer state and the
    # outer momentum with it); the survivors lose no step: the lost worker's units keep their
    # round-start values. Sharded: the lost worker's blocks move, about 2/n of the store
    # (measured: half the central recovery at 4 workers); priced as the whole store, an upper
    # bound (the entry's recovery does not see the worker count)
    recovery=lambda o: Recovery(copies=1 + ((o.outer_lr, o.outer_momentum) != (1.0, 0.0)),
                                optimizer=o.optimizer_state != "reset", lost_steps=0,
                                parts=("keeper's store",)),
    regime="early accuracy on few bytes at wide layers over thin links: to 0.83 on Fashion-MNIST "
           "(MLP 784-2048-2048-10, 4 workers, 100 Mbit/s) sharded IST in its published form "
           "(ist:overlap=1,optimizer_state=reset) is 15.7x faster than DP and 2.6x faster "
           "than local SGD (python benchmarks/thin_wire.py, as root; "
           "docs/benchmarks/testbed.md, 'Thin-wire testbed'); at equal samples the defaults of "
           "thinwire.IST come within 2.5 points of DP's accuracy on converged tasks "
           "(python benchmarks/ist_quality.py)")

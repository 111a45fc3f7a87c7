"""Independent Subnetwork Training around a user's own model, optimizer and training loop.

Yuan, Wolfe, Dun, Tang, Kyrillidis, Jermaine, "Distributed Learning of Deep Neural Networks using
Independent Subnet Training", VLDB 2022 (arXiv 1910.02120); ResIST (Dun et al., UAI 2022) for
depth units; analysed by Shulgin & Richtarik, ICML 2024. The user keeps their loop, loss,
optimizer, schedule, clipping and autocast; :class:`IST` decides only which subnet each worker
trains, what travels and when::

    ist = thinwire.IST(model, optimizer, local_steps=10)     # after init_process_group
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()                 # every K-th step ends a round: subnets travel back
        if ist.at_boundary and want_eval:
            full = ist.full_model()      # the full model on rank 0 (None elsewhere)

The model's units come from its adapter: given (``adapter=``), or derived from the model's graph
(:func:`~thinwire.models.graph_adapter.derive_adapter`) with ``example_input=`` or, with neither,
from the real input of the first training forward. The defaults (the residual stream kept whole,
overlap auto, optimizer state auto) are the measured best of ``benchmarks/ist_quality.py``
(docs/IST.md, "Getting a good model out of IST"), held in :mod:`.defaults`, which the trainer's
``ist`` method reads too; ``overlap=1, optimizer_state="reset", residual="channels"`` is the
published algorithm as the original code runs it.

The model object is the subnet: IST swaps the *data* of the model's own parameters for the
subnet's slices, so the optimizer (which holds the same parameter objects), schedulers and
clipping work unchanged, and a worker only ever holds its subnet plus the slices it stores.
Round r covers the K optimizer steps after its first forward pass:
  1. the first training forward of a round draws the round's partition from (seed, r) with no
     message (:func:`~thinwire.strategies.ist.partition.partition_groups`): disjoint groups, or
     with ``overlap`` r > 1 each worker holding r of them, so every unit is trained by r
     workers (auto, the default: r = max(1, n // 2));
  2. the ranks storing the model send each worker the pieces of its subnet
     (:mod:`~thinwire.strategies.ist.pieces`: central, rank 0 stores everything; sharded, each
     rank ~1/n of every group's units); the subnet's tensors replace the model's parameter data;
     the optimizer state starts fresh (``reset``, the original code) or is re-indexed from the
     owners' full-size state (``reindex``);
  3. the user's loop takes K optimizer steps; with ``scale="dropout"`` the inputs of modules fed
     by cut units are multiplied by (units / units held) (inverted dropout, placed by the
     adapter's ``install_scaling``); ``batchnorm`` relies on batch-statistics norms after every
     cut layer (the original code's choice); ``eval`` leaves training alone and scales the
     assembled model at evaluation (the adapter's ``configure_eval``, ResIST's choice);
  4. after the K-th step (an optimizer post-step hook) the workers send the trained pieces back;
     owners write the disjoint blocks in place (elements held by several workers, as ResIST's
     shared blocks or overlapping subnets' units, end at the mean of their holders' copies);
     tensors every subnet shares are averaged with one all-reduce of their updates; cut blocks nobody trained (cross blocks between two workers' neurons)
     stay bitwise unchanged; with ``outer_lr``/``outer_momentum`` the stored model then takes
     an outer SGD step with Nesterov momentum on the round's change, as DiLoCo's outer step
     (:meth:`~thinwire.strategies.ist.store.Store.outer_step`; lr 1 and momentum 0, the
     default, is the plain write-back, bit for bit). Between rounds the model holds no data. With
     ``drop_last_step=True`` (the original code's behaviour, for exact comparisons with it) the
     pieces are taken just before the K-th step, whose update is then lost.
Evaluation happens only at round boundaries (:meth:`IST.full_model`); a forward in eval mode or
``full_model`` mid-round is a one-line error, as is an optimizer step with no forward in a round.

Pieces travel in one dtype per model (the plan's ``wire_dtype``, the widest floating-point dtype
of its tensors): integer buffers such as a BatchNorm's ``num_batches_tracked`` are cast to it on
the way and back, and every index tensor follows the model's device.

This module is the round's lifecycle (the hooks and steps 1-4); the concepts it drives live
beside it: :mod:`.layout` (where a cut tensor's elements lie), :mod:`.store` (what a rank stores
and the owner's side of an exchange), :mod:`.subnet` (the worker's side), :mod:`.optstate` (the
optimizer state across repartitions) and :mod:`.assembly` (the full model).

One concept, one file (over 400 lines): the public IST object and its round's lifecycle.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from thinwire.errors import UsageError
from thinwire.models.adapter import ISTAdapter, ISTPlan
from thinwire.runtime.comm import Comm
from thinwire.strategies.ist import defaults
from thinwire.strategies.ist import pieces as pc
from thinwire.strategies.ist import subnet as sn
from thinwire.strategies.ist.assembly import gather_full
from thinwire.strategies.ist.elements import View
from thinwire.strategies.ist.optstate import OptimizerState, reindexes
from thinwire.strategies.ist.partition import partition_groups, resolve_overlap
from thinwire.strategies.ist.store import Dealt, Overlap, Store

DEPLOYMENTS = ("central", "sharded")

OPTIMIZER_STATES = ("auto", "reset", "reindex")


def _check_options(local_steps: int, drop_last_step: bool, deployment: str,
                   optimizer_state: str, outer_lr: float, outer_momentum: float) -> None:
    """One line for each option of :class:`IST` out of its range."""
    if local_steps < 1:
        raise UsageError(f"IST local_steps must be >= 1, got {local_steps}")
    if drop_last_step and local_steps < 2:
        raise UsageError("IST drop_last_step discards the K-th update of each round; it "
                         f"needs local_steps >= 2, got {local_steps}")
    if deployment not in DEPLOYMENTS:
        raise UsageError(f"IST deployment {deployment!r}: use central or sharded")
    if optimizer_state not in OPTIMIZER_STATES:
        raise UsageError(f"IST optimizer_state {optimizer_state!r}: use auto, reset or reindex")
    if not (outer_lr > 0 and 0 <= outer_momentum < 1):
        raise UsageError(f"IST outer_lr {outer_lr} / outer_momentum {outer_momentum}: "
                         "use outer_lr > 0 and 0 <= outer_momentum < 1 (1 and 0: no "
                         "outer optimizer)")


class IST:
    """Independent Subnetwork Training of ``model`` (module docstring).

    Args:
        model: the full model, built identically on every rank (same seed).
        optimizers: the optimizer (or list) over ``model.parameters()``; IST resets or re-indexes
            their per-parameter state at each repartition.
        comm: the communication layer (default ``Comm()``: the default process group).
        local_steps: K, optimizer steps per round.
        seed: seed of the partitions (identical on every rank).
        deployment: ``central`` (rank 0 stores the model) or ``sharded``.
        scale: activation scaling, one of the adapter's ``scales`` (default: its first).
        optimizer_state: ``reset`` (fresh state each round), ``reindex`` (the state is dealt
            with its units: it travels with them and Adam's step count goes on) or ``auto``,
            the default: the adapter's ``default_optimizer_state`` (``reset`` for convolutional
            models, ``reindex`` otherwise; docs/IST.md, "Getting a good model out of IST").
        adapter: the model's :class:`~thinwire.models.adapter.ISTAdapter`; default: derived
            from the model's graph (:func:`~thinwire.models.graph_adapter.derive_adapter`)
            with ``example_input``, or, without one, at the first training forward from the
            real input (the model is whole until then).
        drop_last_step: the original code's round: the K-th step's update is discarded (the
            pieces go back as they were after K - 1 steps); needs K >= 2.
        example_input: a batch of the model's input to derive the adapter from: a tensor, a
            tuple of the forward's positional arguments, or a dict of its keyword arguments
            (``{"input_ids": x, "attention_mask": m}`` for a loop that calls
            ``model(input_ids=x, attention_mask=m)``); never needed with ``adapter``.
        example_kwargs: keyword arguments beside a positional ``example_input``
            (``model(x, attention_mask=m)``).
        overlap: how many workers hold each unit of a cut group (1, IST: disjoint subnets; r:
            each worker holds r of the round's n groups, a subnet of r/n of every cut layer, and
            an element trained by several workers ends at the mean of their copies; n: every
            worker trains the whole model, local SGD); 0, the default: max(1, n // 2)
            (:func:`~thinwire.strategies.ist.partition.resolve_overlap`).
        outer_lr, outer_momentum: the outer optimizer on each round's change of the stored
            model (Nesterov SGD, DiLoCo's outer step; the store keeps its momentum): 1 and 0
            write the trained subnets back as they are.
        residual, embeddings, shared: how the derived adapter cuts residual connections
            (``channels`` or ResIST's ``blocks``) and embeddings (``shared`` or ``cut``), and
            the submodules it keeps whole (:func:`~thinwire.models.graph_adapter.derive_adapter`).
    """

    def __init__(self, model: nn.Module, optimizers: torch.optim.Optimizer |
                 Sequence[torch.optim.Optimizer], *, comm: Comm | None = None,
                 local_steps: int = 10, seed: int = 0, deployment: str = "central",
                 scale: str | None = None, optimizer_state: str = defaults.OPTIMIZER_STATE,
                 adapter: ISTAdapter | None = None, tag: str = "subnet",
                 drop_last_step: bool = False, example_input: Any = None,
                 example_kwargs: Mapping[str, Any] | None = None,
                 residual: str = defaults.RESIDUAL, embeddings: str = "shared",
                 shared: Sequence[str] = (), overlap: int = defaults.OVERLAP,
                 outer_lr: float = 1.0,
                 outer_momentum: float = 0.0) -> None:
        _check_options(local_steps, drop_last_step, deployment, optimizer_state, outer_lr,
                       outer_momentum)
        self.model = model
        self.optimizers = ([optimizers] if isinstance(optimizers, torch.optim.Optimizer)
                           else list(optimizers))
        self.comm = comm if comm is not None else Comm()
        self.n, self.rank = self.comm.world_size, self.comm.rank
        if not 0 <= overlap <= self.n:
            raise UsageError(f"IST overlap {overlap}: use 1 (disjoint subnets) to the number "
                             f"of workers ({self.n}: every worker holds everything), or 0 "
                             "(auto: half the workers)")
        self.K = local_steps
        self.seed = seed
        self.deployment = deployment
        self._state_arg = optimizer_state  # auto: resolved with the adapter's plan
        self.drop_last_step = drop_last_step
        self.outer = (float(outer_lr), float(outer_momentum))
        self.overlap = resolve_overlap(int(overlap), self.n)
        self.tag = tag
        self._scale_arg = scale
        self._derive: dict[str, Any] = {"residual": residual, "embeddings": embeddings, "shared": tuple(shared)}
        self.round = 0
        self.in_round = 0
        self.active = False
        self.finished = False
        self.held: dict[str, tuple[np.ndarray, ...]] = {}
        self.opt_state = OptimizerState(self.optimizers, optimizer_state == "reindex")
        self._scale_handles: list[Any] = []
        self._hooks: list[Any] = []
        self._kept: dict[str, list[torch.Tensor]] | None = None
        self.adapter: ISTAdapter | None = None
        if isinstance(example_input, (list, tuple, Mapping)) and not example_input \
                and not example_kwargs:
            raise UsageError(f"IST example_input={example_input!r} is empty: pass a batch of "
                             "the model's input (a tensor, a tuple of the forward's "
                             "arguments or a dict of its keyword arguments)")
        if adapter is None and (example_input is not None or example_kwargs):
            adapter = self._derived(example_input, example_kwargs)
        if adapter is not None:
            self._setup(adapter)
        self._attach()

    @property
    def reindex(self) -> bool:
        """Whether the optimizer state is dealt with its units (``optimizer_state`` resolved:
        ``auto`` takes the adapter's default once the plan is known)."""
        return self.opt_state.reindex

    def _adapter(self) -> ISTAdapter:
        """The adapter, set up by now (given, or derived at the first forward)."""
        assert self.adapter is not None, "IST: the adapter is set up at the first forward"
        return self.adapter

    def _derived(self, example_input: Any, example_kwargs: Mapping[str, Any] | None = None
                 ) -> ISTAdapter:
        from thinwire.models.graph_adapter import derive_adapter

        return derive_adapter(self.model, example_input, min_units=max(2, self.n),
                              example_kwargs=example_kwargs, **self._derive)

    def _setup(self, adapter: ISTAdapter) -> None:
        """The plan known: check it against the model, slice this rank's store out of the
        model, and release the model's tensors."""
        model = self.model
        self.adapter = adapter
        self.plan: ISTPlan = adapter.plan
        self.scale = self._scale_arg if self._scale_arg is not None else adapter.scales[0]
        if self.scale not in adapter.scales:
            raise UsageError(f"IST scale {self.scale!r} is not available for "
                             f"{type(model).__name__}; use one of "
                             f"{', '.join(adapter.scales)}")
        self.opt_state.reindex = reindexes(self._state_arg, self.plan.default_optimizer_state)
        self.wire = getattr(torch, self.plan.wire_dtype)
        self.own = pc.Ownership(self.plan, self.n, self.deployment)
        self._check_model()
        self.device = next(model.parameters()).device
        self.view = View(self.plan, self.own, self.rank, self.device, self.wire)
        self._tensors = self._model_tensors(model)
        self._store = Store(self.view, self._tensors)
        self._release()

    def _ready(self, what: str) -> None:
        if self.adapter is None:
            raise UsageError(f"IST {what} before the model's plan is known: pass "
                             "example_input= (or an adapter) to IST, or run a training forward "
                             "first")

    # --- set-up --------------------------------------------------------------------------------
    def _check_model(self) -> None:
        names = {t.name for t in self.plan.tensors if not t.buffer}
        params = {n for n, _ in self.model.named_parameters()}
        if names != params:
            missing = sorted(params - names)[:3] or sorted(names - params)[:3]
            raise UsageError(f"IST adapter does not match {type(self.model).__name__}: "
                             f"parameters {missing} differ; pass the adapter of this model")
        for g in self.plan.groups:
            if g.kind == "disjoint" and g.size < self.n:
                raise UsageError(f"IST cuts {g.name} ({g.size} units) into {self.n} subnets; "
                                 f"use >= {self.n} units there or fewer workers")
        for t in self.plan.tensors:
            actual = dict(self.model.named_parameters()).get(t.name)
            if actual is not None and tuple(actual.shape) != t.shape:
                raise UsageError(f"IST adapter says {t.name} is {t.shape}, the model holds "
                                 f"{tuple(actual.shape)}; rebuild the adapter for this model")

    @staticmethod
    def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = dict(model.named_parameters())
        out.update(dict(model.named_buffers()))
        return out

    @property
    def store(self) -> dict[str, torch.Tensor]:
        """This rank's stored slices (:class:`~thinwire.strategies.ist.store.Store`)."""
        return self._store.slices

    @property
    def state_store(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer-state slices stored beside :attr:`store` (``reindex``)."""
        return self._store.state

    @property
    def state_keys(self) -> tuple[str, ...]:
        return self.opt_state.keys

    def _attach(self) -> None:
        self._hooks = [self.model.register_forward_pre_hook(self._pre_forward,
                                                            with_kwargs=True)]
        self._hooks += [o.register_step_post_hook(self._post_step) for o in self.optimizers]
        if self.drop_last_step:
            self._hooks.append(self.optimizers[0].register_step_pre_hook(self._pre_step))

    def _detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _release(self) -> None:
        """Between rounds the model's tensors hold no data (and no gradients)."""
        for t in self.plan.tensors:
            x = self._tensors[t.name]
            x.data = x.data.new_empty(0)
            if isinstance(x, nn.Parameter):
                x.grad = None

    # --- hooks ---------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.adapter is None and module.training:  # the first forward's own arguments
            self._setup(self._derived(tuple(args), kwargs))
        if self.adapter is None:  # evaluated before training: the model is still whole
            return
        if not module.training:
            where = (f"mid-round (step {self.in_round} of {self.K} of round {self.round})"
                     if self.active else "between rounds")
            raise UsageError(f"IST: the model was evaluated {where}; it holds one worker's "
                             "subnet or nothing. Evaluate ist.full_model() at a round boundary")
        if not self.active:
            self.begin_round()

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """``drop_last_step``: before the K-th step, keep the subnet as it is (with its optimizer
        state when that travels); the round ends with these pieces."""
        del optimizer, args, kwargs
        if self.active and self.in_round == self.K - 1:
            self._harvest_state_keys()
            self._kept = {name: [x.detach().clone() for x in xs]
                          for name, xs in self._subnet().items()}

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        del args, kwargs
        if not self.active:
            raise UsageError("IST: optimizer.step() was called with no forward pass in this "
                             "round; run the forward and backward before each step")
        if optimizer is not self.optimizers[-1]:
            return
        self.in_round += 1
        if self.in_round == self.K:
            self.end_round()

    @property
    def at_boundary(self) -> bool:
        """True between rounds, where the full model is defined (evaluate, checkpoint)."""
        return not self.active

    # --- step 1-2: partition and scatter -------------------------------------------------------
    def _partition(self, round_: int) -> dict[str, tuple[np.ndarray, ...]]:
        return partition_groups([(g.name, g.size, g.kind) for g in self.plan.groups], self.n,
                                self.seed, round_, self.overlap)

    def _may_begin(self) -> bool:
        """Whether a round is to begin now: False while one is open; a finished IST or one
        without its plan is a one-line error."""
        if self.finished:
            raise UsageError("IST has finished (the model is whole again); build a new IST")
        if self.active:
            return False
        self._ready("began a round")
        return True

    def begin_round(self) -> None:
        """Steps 1-2: draw the round's partition, move the subnets, load them into the model."""
        if not self._may_begin():
            return
        self.held = self._partition(self.round)
        v, held, keys = self.view, self.held, self.opt_state.travelling()
        sends = [(w, self._store.extract(held, w, keys)) for w in range(self.n)
                 if w != self.rank and v.piece_size(held, self.rank, w, keys)]
        recvs = [(o, torch.empty(size, device=self.device, dtype=self.wire))
                 for o in range(self.n)
                 if o != self.rank and (size := v.piece_size(held, o, self.rank, keys))]
        self.comm.exchange(sends, recvs, tag=self.tag)
        sub = sn.allocate(v, held, self._store, self._tensors, keys)
        if v.piece_size(held, self.rank, self.rank, keys):
            sn.load(v, held, sub, self.rank, self._store.extract(held, self.rank, keys), keys)
        for o, buf in recvs:
            sn.load(v, held, sub, o, buf, keys)
        with torch.no_grad():
            for name, xs in sub.items():
                self._tensors[name].data = xs[0]
        self.opt_state.install(self._tensors, sub)
        self._adapter().configure(self.model, {g: units[self.rank] for g, units in self.held.items()})
        self._install_scaling()
        self.active = True
        self.in_round = 0

    def _install_scaling(self) -> None:
        if self.scale != "dropout":
            return
        factors = []
        for mod_name, group in self.plan.scaled_inputs:
            factor = self.plan.group(group).size / len(self.held[group][self.rank])
            if factor != 1.0:
                factors.append((mod_name, factor))
        if factors:
            self._scale_handles = self._adapter().install_scaling(self.model, factors)

    # --- step 4: gather, write back, average ---------------------------------------------------
    def _harvest_state_keys(self) -> None:
        """After the first round: the optimizer's per-element state names (e.g. Adam's moments)."""
        if self.opt_state.harvest():
            self._store.start_state(self.opt_state.keys)

    def _subnet(self) -> sn.Subnet:
        """This rank's trained subnet tensors, with their optimizer state when it travels."""
        names = [t.name for t in self.plan.tensors if pc.holds(t, self.held, self.rank)]
        buffers = {t.name for t in self.plan.tensors if t.buffer}
        return self.opt_state.of_subnet(self._tensors, names, buffers)

    def _trained_subnet(self) -> sn.Subnet:
        """The round's trained subnet (kept from the last step or read now), closing the round's
        hold on it; ending a round outside one is a one-line error."""
        if not self.active:
            raise UsageError("IST.end_round() outside a round")
        self._harvest_state_keys()
        sub = self._kept if self._kept is not None else self._subnet()
        self._kept = None
        return sub

    def end_round(self) -> None:
        """Step 4: pieces back to their owners, shared tensors averaged, the model released."""
        sub = self._trained_subnet()
        v, held, keys = self.view, self.held, self.opt_state.travelling()
        sends = [(o, sn.take(v, held, sub, o, keys)) for o in range(self.n)
                 if o != self.rank and v.piece_size(held, o, self.rank, keys)]
        recvs = [(w, torch.empty(size, device=self.device, dtype=self.wire))
                 for w in range(self.n)
                 if w != self.rank and (size := v.piece_size(held, self.rank, w, keys))]
        self.comm.exchange(sends, recvs, tag=self.tag)
        dealt: Dealt = {}
        overlap: Overlap | None = {} if self.overlap > 1 else None
        outer = self.outer != (1.0, 0.0)
        with torch.no_grad():
            before = ({k: x.clone() for k, x in self._store.parameter_slices().items()}
                      if outer else {})
            if v.piece_size(held, self.rank, self.rank, keys):
                self._store.write_back(held, self.rank, sn.take(v, held, sub, self.rank, keys),
                                       keys, dealt, overlap)
            for w, buf in sorted(recvs, key=lambda r: r[0]):
                self._store.write_back(held, w, buf, keys, dealt, overlap)
            self._store.average_dealt(dealt, keys)
            if overlap is not None:
                self._store.average_overlap(overlap, keys)
            self._store.average_shared(sub, keys, self.comm, self.n)
            if outer:
                self._store.outer_step(before, *self.outer)
        self._end_common()

    def _end_common(self) -> None:
        for h in self._scale_handles:
            h.remove()
        self._scale_handles = []
        self.opt_state.clear()
        self._release()
        self._adapter().configure(self.model, None)
        self.active = False
        self.round += 1
        self.in_round = 0

    # --- the full model ------------------------------------------------------------------------
    def _gather_full(self, to: Sequence[int], tag: str) -> dict[str, torch.Tensor] | None:
        """Every tensor whole on the ranks in ``to`` (:mod:`.assembly`)."""
        self._ready("was asked for the full model")
        if self.active:
            raise UsageError(f"IST: the full model was asked for mid-round (step {self.in_round}"
                             f" of {self.K} of round {self.round}); ask at a round boundary, "
                             "after the K-th optimizer step")
        return gather_full(self._store, self.comm, self._tensors, to, tag)

    def full_model(self, to: int = 0, *, tag: str = "control") -> nn.Module | None:
        """The full model on rank ``to`` (None elsewhere); every rank must call it, at a round
        boundary. A copy: training goes on in the user's model. ``tag`` labels the traffic in
        the ledger (``control``, evaluation, is kept out of the method's totals)."""
        full = self._gather_full([to], tag)
        return None if full is None else self._model_from(full)

    def _model_from(self, full: dict[str, torch.Tensor]) -> nn.Module:
        """A copy of the user's model holding ``full`` (the full tensors by name), configured
        as evaluated."""
        self._detach()
        try:
            clone = copy.deepcopy(self.model)
        finally:
            self._attach()
        tensors = self._model_tensors(clone)
        with torch.no_grad():
            for name, x in full.items():
                tensors[name].data = x
        self._configure_full(clone)
        return clone

    def _configure_full(self, model: nn.Module) -> None:
        """The full model as evaluated: every unit in place, then the adapter's evaluation-time
        adjustment unless ``scale`` is ``none``."""
        self._adapter().configure(model, None)
        if self.scale != "none":
            self._adapter().configure_eval(model, self.n)

    def finish(self, *, tag: str = "switch") -> nn.Module:
        """End IST: the user's model becomes the full model again on every rank (hooks removed,
        optimizer state cleared), configured as :meth:`full_model` evaluates it (so training
        goes on from the model the evaluations saw). The hybrid schedule's switch to local
        SGD."""
        full = self._gather_full(list(range(self.n)), tag)
        assert full is not None
        return self._install_full(full)

    def _install_full(self, full: dict[str, torch.Tensor]) -> nn.Module:
        """End IST with ``full`` (name -> whole tensor) as the model: hooks removed, every cut
        tensor set to its whole value, the model back to its full-size modules."""
        self._detach()
        with torch.no_grad():
            for name, x in full.items():
                self._tensors[name].data = x
        self._configure_full(self.model)
        self.finished = True
        return self.model

    def abandon(self) -> None:
        """End IST without communication: hooks removed, the model's tensors full-size but
        uninitialised (the caller loads a state into them, e.g. resuming past a switch)."""
        self._detach()
        with torch.no_grad():
            for t in self.plan.tensors:
                x = self._tensors[t.name]
                x.data = x.data.new_empty(t.shape)
        self._configure_full(self.model)
        self.finished = True

    def close(self) -> None:
        """Remove IST's hooks and scaling from the user's model, without communication (safe
        after an error on any rank); idempotent. The model keeps what its tensors hold (a
        subnet mid-round, nothing between rounds): call :meth:`finish` first for the full
        model, as leaving a ``with`` block without an error does."""
        for h in self._scale_handles:
            h.remove()
        self._scale_handles = []
        self._detach()

    def __enter__(self) -> IST:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        """1. Without an error: a round in progress is closed (:meth:`end_round`), then
        :meth:`finish` makes the user's model the full model on every rank (every rank must
        leave the block together, as every rank takes the same steps); 2. with an error: no
        communication (another rank may be gone); 3. either way :meth:`close`."""
        if exc_type is None and not self.finished:
            if self.active:
                self.end_round()
            self.finish()
        self.close()

    # --- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's stored slices, optimizer-state slices and the round (at a boundary)."""
        self._ready("was asked for its state")
        if self.active:
            raise UsageError("IST.state_dict() mid-round; checkpoint at a round boundary")
        return {"round": self.round, "store": dict(self.store),
                "state_keys": list(self.state_keys),
                "state_store": {f"{n}|{k}": v for n, d in self.state_store.items()
                                for k, v in d.items()},
                "scalar_state": {k: v for k, v in self.opt_state.scalars.items()
                                 if isinstance(v, (torch.Tensor, int, float))},
                "outer": dict(self._store.outer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ready("was given a state")
        self.round = int(state["round"])
        with torch.no_grad():
            for name, x in state["store"].items():
                self.store[name].copy_(x)
        self.opt_state.keys = tuple(state.get("state_keys", ()))
        self.opt_state.scalars = dict(state.get("scalar_state", {}))
        self._store.outer = {k: v.to(self.device).clone()
                             for k, v in state.get("outer", {}).items()}
        self._store.state = {}
        for key, v in state.get("state_store", {}).items():
            name, _, k = key.partition("|")
            self.state_store.setdefault(name, {})[k] = v.to(self.device).clone()

    # --- what a worker holds -------------------------------------------------------------------
    def subnet_numel(self, round_: int | None = None, *, params_only: bool = True) -> int:
        """Elements of this rank's subnet in ``round_`` (default: the current one)."""
        self._ready("was asked for a subnet's size")
        held = self._partition(self.round if round_ is None else round_)
        return sum(pc.subnet_numel(t, held, self.rank) for t in self.plan.tensors
                   if not (params_only and t.buffer))

    def stored_numel(self) -> int:
        """Elements of the model this rank stores between rounds."""
        return self._store.numel()

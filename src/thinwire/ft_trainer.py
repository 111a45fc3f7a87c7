"""The training loop over a torchft quorum (``--runtime.fault_tolerance torchft``).

A run that keeps training when a worker dies, for the methods whose entry says
``fault_tolerant`` (dp with its all-reduce and all-gather codecs, localsgd, diloco with its
Streaming options and codecs, sparseloco, demo): the outer loop of torchft's
``LocalSGD``/``DiLoCo`` (Douillard et al., "DiLoCo", 2023; torchft's ``Manager``), on thinwire's
wrappers (:mod:`thinwire.strategies.averaging`, steps a-c; DeMo's optimizer and dp's
:class:`~thinwire.strategies.fault.FaultTolerantDP`, every step an outer step). The strategy's ``quorum`` is the object that opens each
round's quorum and records it. Each
worker process is one replica group (:class:`~thinwire.runtime.ft.Replica`, index ``I`` of
``runtime.workers``, started by :func:`thinwire.launch.launch_replicas` or by hand on another
machine). What differs from :class:`~thinwire.trainer.Trainer`:

1. the strategy's wrapper gets the replica; every exchange goes through its
   :class:`~thinwire.runtime.ft.ManagedComm` (the live quorum, every byte in the ledger,
   recovery under the ``recovery`` tag);
2. data: worker ``I`` reads shard ``I`` of ``runtime.workers`` at every step, whoever else is
   alive (the batch is a pure function of seed, shard and step): a lost worker's shard is not
   read while it is gone, a worker that joins (or rejoins under its index) reads its own shard
   from the step it joins at; a refused round's batches are not read again (dp runs a refused
   step again: its clock counts committed steps);
3. before each step the round's quorum is opened (``begin_round``): a joining worker receives
   a live peer's state there, its step count included, and the loop goes on from that step;
4. no collective outside a round, so a lost worker cannot stall one: every live worker
   evaluates its own model (all hold the same one after an outer step) and logs into
   ``RUN_DIR/workerI/`` (metrics, ``summary.json``, ``model.pt``); the checkpoint is written
   by the quorum's rank 0 of the last outer step alone, as a one-worker checkpoint (the
   shared model, outer state and that worker's inner optimizer); a step the quorum's clock did
   not count (dp's refused step, run again) is neither logged, evaluated nor checkpointed;
5. each worker's summary adds ``fault_tolerance``: every outer step's (step, live workers,
   kept), the steps at which it joined and recovered; the launcher writes the run's
   ``summary.json`` from the lowest surviving worker's, naming the workers lost and the step;
6. ``run.resume``: every worker (one that joins later too) loads the one-worker checkpoint at
   start and its quorum's clock goes on from that step (``resume_at``), for a method whose
   checkpoint is the same on every worker (its entry is ``Rescalable`` under the run's
   options: local SGD, DiLoCo and dp without a codec); the others are refused in one line by
   the config, their checkpoint holding one worker's own state (residuals, fragments,
   subnets).

A method joins by setting ``fault_tolerant=True`` in its registry entry and giving its
strategy a ``quorum`` (built from ``Context.replica``): an object with ``begin_round()``
(form the round's quorum, a joiner recovering there; nothing if one is open), ``clock`` (the
job's step count, a joiner's taken from its peer), ``resume_at(step)`` (a resumed run's clock,
for a method that resumes) and ``history`` (each outer step's
``(clock, live workers, kept)``, and where a round may close with fewer workers than began it,
a fourth item: those that began it). :class:`~thinwire.strategies.averaging.PeriodicSync`,
:class:`~thinwire.strategies.demo.DeMo`, :class:`~thinwire.strategies.fault.FaultTolerantDP`
and :class:`~thinwire.strategies.ist.fault.FaultTolerantIST` are the four so far. Two optional
parts, for a method whose workers do not all hold the model (IST): the quorum's
``writes_checkpoint`` (default: the quorum's rank 0 writes it) and the strategy's
``live_model(final)`` (the model this worker evaluates, None for none; default its ``model``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from thinwire import checkpoint
from thinwire.builders import build_strategy
from thinwire.config import Config, label
from thinwire.data.task import eval_rows
from thinwire.runtime.ft import Replica
from thinwire.trainer import Trainer

__all__ = ["FaultTolerantTrainer", "worker_dir"]


def worker_dir(run_dir: Path, index: int) -> Path:
    """Where worker ``index`` of a fault-tolerant run writes its own files."""
    return run_dir / f"worker{index}"


class FaultTolerantTrainer(Trainer):
    """:class:`~thinwire.trainer.Trainer` over a torchft quorum (module docstring, 1-5)."""

    def __init__(self, cfg: Config, replica: Replica, device: torch.device,
                 run_dir: Path) -> None:
        self.replica = replica
        self.index = replica.index
        self.joined_at = -1
        worker_dir(run_dir, self.index).mkdir(exist_ok=True)
        super().__init__(cfg, replica.comm, device, run_dir)

    # --- 1., 2.: the strategy on the replica, the worker's own shard ---------------------------
    def _build_strategy(self, model: torch.nn.Module) -> Any:
        return build_strategy(self.cfg, self.comm, self.device, self.task, model,
                              replica=self.replica)

    def _data_shard(self) -> tuple[int, int]:
        return self.index, self.cfg.runtime.workers

    def _logs(self) -> bool:
        return True

    def _log_dir(self) -> Path:
        return worker_dir(self.run_dir, self.index)

    def _progress(self) -> Any:
        if self.index != 0 or not self.cfg.run.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=self.cfg.train.steps, desc=self.cfg.run_name, leave=False,
                    dynamic_ncols=True, mininterval=1.0)

    # --- 3.: the round's quorum before the step ------------------------------------------------
    def _next_step(self, step: int) -> int:
        if step >= self.cfg.train.steps:
            return step
        wrapper = self.strategy.quorum
        wrapper.begin_round()
        if self.joined_at < 0:
            self.joined_at = wrapper.clock
        return int(wrapper.clock)

    def _ready(self) -> None:
        """No barrier: a worker may be gone, or join later."""

    # --- 6.: resuming (run.resume) -------------------------------------------------------------
    def _load_checkpoint(self, step: int) -> dict[str, Any]:
        """Every worker loads the one-worker checkpoint (the config allows resuming only a
        method whose checkpoint is the same on every worker: Rescalable)."""
        return checkpoint.load_rank(self.run_dir, step, 0, 1, rescalable=True)

    def _resume(self) -> None:
        super()._resume()
        if self.start:
            self.strategy.quorum.resume_at(self.start)

    # --- 4.: evaluation, checkpoints and files of this worker alone ----------------------------
    def _counted(self, done: int) -> bool:
        """Whether the step ending at ``done`` counted (dp's refused step is run again)."""
        return int(self.strategy.quorum.clock) == done

    def _evaluate(self, step: int, wall: float, *, final: bool = False,
                  record: bool = True) -> dict[str, float]:
        own = getattr(self.strategy, "live_model", None)
        model = self.strategy.model if own is None else own(final)
        if model is None:  # this worker holds no whole model at this step
            return {}
        result = self.task.evaluate(model, self.ds.x_test, self.ds.y_test, device=self.device,
                                    batch_size=eval_rows(self.ds.num_classes))
        if final:
            self.final_model = model
        if self.writer is not None and record:
            sent = self._counters()
            self.writer.write({"kind": "eval", "step": step, "metric": self.task.metric,
                               **result, "wall_s": wall, "sent_bytes": sent["sent_bytes"],
                               "sent_bytes_max": sent["sent_bytes"],
                               "payload_bytes": sent["payload_bytes"]})
        return dict(result)

    def _save(self, step: int, wall: float) -> None:
        writes = getattr(self.strategy.quorum, "writes_checkpoint", None)
        if (self.comm.rank != 0) if writes is None else not writes:
            return  # the last outer step's quorum rank 0 (the round is closed), or its keeper
        state = {"strategy": self.strategy.state_dict(),
                 "trainer": {"wall_s": wall, **self._counters(), "label": label(self.cfg)}}
        checkpoint.save_rank(self.run_dir, step, 0, state)
        checkpoint.mark_complete(self.run_dir, step, 1)

    def _gather(self, values: list[float]) -> list[list[float]]:
        return [list(values)]

    def _rank_name(self) -> int:
        return self.index

    # --- 5.: the record of the quorum --------------------------------------------------------
    def _complete(self, summary: dict[str, Any]) -> dict[str, Any]:
        wrapper = self.strategy.quorum
        summary["fault_tolerance"] = {
            "worker": self.index, "joined_at": self.joined_at,
            "recoveries": self.replica.recoveries,
            "outer_steps": [{"step": h[0], "live": h[1], "kept": h[2],
                             **({"began": h[3]} if len(h) > 3 else {})}
                            for h in wrapper.history]}
        return summary


def compose_summary(run_dir: Path, exits: list[Any]) -> dict[str, Any]:
    """The run's ``summary.json``, ``model.pt`` and ``metrics.jsonl`` from the lowest surviving
    worker's (every survivor holds the same model after the last outer step), with
    ``fault_tolerance.lost``:
    each lost worker, how it ended, and ``step``: the clock of the last outer step it was in
    the quorum of (a worker lost in a round: that round's outer step, refused; lost between
    rounds: the last it took part in). ``exits``: the launcher's
    :class:`~thinwire.launch.Exit` of every worker."""
    import json

    from thinwire.rundir import write_bytes, write_text

    survivors = [e.worker for e in exits if e.code == 0]
    first = worker_dir(run_dir, min(survivors))
    summary: dict[str, Any] = json.loads((first / "summary.json").read_text())
    ft = summary["fault_tolerance"]
    lost = []
    for e in exits:
        if e.code == 0:
            continue
        seen = [o["step"] for o in ft["outer_steps"] if e.worker in o.get("began", o["live"])]
        lost.append({"worker": e.worker, "step": seen[-1] if seen else 0,
                     "ended": e.describe()})
    ft["survivors"] = survivors
    ft["lost"] = lost
    summary["workers"] = len(exits)
    write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    for name in ("model.pt", "metrics.jsonl"):  # what thinwire report reads beside the summary
        if (first / name).exists():
            write_bytes(run_dir / name, (first / name).read_bytes())
    return summary

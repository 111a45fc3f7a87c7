"""The training loop, the same for every method, model and task.

For each step: 1. take this worker's batch of the step (a pure function of seed, shard, step);
2. ``strategy.train_step``; a non-finite loss stops the run with a one-line error (the last
complete checkpoint is kept); 3. every ``log_every`` steps the loss rank writes a metrics record
to the run's loggers (``run.loggers``: metrics.jsonl, TensorBoard: :mod:`thinwire.loggers`)
(compute time = step time - time inside communication calls, from the ledger); 4. at
evaluation points every rank calls ``strategy.eval_model`` and the rank holding the full model
evaluates it with the task's metric; every rank then hands the value (None where it did not
evaluate) to ``strategy.observe``; 5. at checkpoint points every rank saves its state atomically. At
the end the ledgers and memory reports of all ranks are gathered (tagged control) into ``summary.json`` (the memory measured from the tensors, the saved activations, the
process's peak resident set and, on CUDA, the allocator's peak: :func:`process_peaks`), and the final model is exported to ``model.pt`` (batch-statistics
norms recalibrated so it predicts single samples: :mod:`thinwire.models.norms`).
"""

from __future__ import annotations

import io
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from thinwire import checkpoint
from thinwire.builders import (
    build_mesh,
    build_model,
    build_strategy,
    load_data,
    make_stream,
    rescalable,
)
from thinwire.config import Config, label, to_dict
from thinwire.data.task import eval_rows, task_for
from thinwire.errors import UsageError
from thinwire.loggers import Loggers, parse_loggers
from thinwire.models.norms import recalibrate_batchnorm, uses_batch_statistics
from thinwire.rundir import write_bytes, write_text
from thinwire.runtime.comm import Comm
from thinwire.strategies.base import lr_at
from thinwire.summary import ByteTotals, MemoryTotals, RankTotals, RunSummary

RECALIBRATION_BATCHES = 20


def process_peaks(device: torch.device) -> tuple[int, int]:
    """(peak resident set of this process in bytes, from ``resource.getrusage`` (Linux: KiB),
    the CUDA allocator's peak on ``device``: 0 elsewhere)."""
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cuda = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return int(rss), int(cuda)


class NonFiniteLoss(UsageError):
    """The training loss became inf or nan."""


class Trainer:
    def __init__(self, cfg: Config, comm: Comm, device: torch.device, run_dir: Path) -> None:
        self.cfg, self.comm, self.device, self.run_dir = cfg, comm, device, run_dir
        comm.expect(device)  # the device rule: every tensor of every call on the run's device
        self.ds = load_data(cfg)
        self.task = task_for(self.ds)
        model = build_model(cfg, self.ds)
        self.strategy = self._build_strategy(model)
        self.shard, self.shards = self._data_shard()
        self.stream = make_stream(cfg, self.ds, self.shard, self.shards)
        self.start = 0
        self.carry = {"wall_s": 0.0, "sent_bytes": 0.0, "payload_bytes": 0.0, "recv_bytes": 0.0}
        if cfg.run.resume:
            self._resume()
        logs = self._logs()
        self.writer = (Loggers(parse_loggers(cfg.run.loggers), self._log_dir(),
                               resume_step=self.start if cfg.run.resume else None)
                       if logs else None)
        self.final_model: Any = None

    # --- what a fault-tolerant trainer (thinwire.ft_trainer) replaces -------------------------
    def _build_strategy(self, model: torch.nn.Module) -> Any:
        return build_strategy(self.cfg, self.comm, self.device, self.task, model,
                              build_mesh(self.cfg, self.comm, self.device))

    def _data_shard(self) -> tuple[int, int]:
        return self.strategy.data_shard()  # type: ignore[no-any-return]

    def _logs(self) -> bool:
        return self.comm.rank == self.strategy.loss_rank  # type: ignore[no-any-return]

    def _log_dir(self) -> Path:
        return self.run_dir

    def _next_step(self, step: int) -> int:
        """The step the loop runs next (a fault-tolerant trainer's joiner jumps to its peers')."""
        return step

    def _counted(self, done: int) -> bool:
        """Whether the step ending at ``done`` counted: always here (a fault-tolerant trainer's
        refused step is run again, and neither logged, evaluated nor checkpointed)."""
        del done
        return True

    # --- resume ------------------------------------------------------------------------------
    def _resume(self) -> None:
        step = checkpoint.latest_step(self.run_dir)
        if step is None:  # a restart before the first checkpoint: from the start
            return
        state = self._load_checkpoint(step)
        saved = state.get("trainer", {}).get("label")
        if saved is not None and saved != label(self.cfg):
            raise UsageError(f"--resume: the checkpoint in {self.run_dir} was written by "
                             f"{saved}, this run is {label(self.cfg)}; resume with the same "
                             "method and options, or start a new run")
        self.strategy.load_state_dict(state["strategy"])
        self.carry = {k: float(v) for k, v in state["trainer"].items() if k in self.carry}
        self.start = step

    def _load_checkpoint(self, step: int) -> dict[str, Any]:
        """This rank's state of the checkpoint of ``step``."""
        return checkpoint.load_rank(self.run_dir, step, self.comm.rank, self.comm.world_size,
                                    rescalable=rescalable(self.cfg))

    def _counters(self) -> dict[str, float]:
        t = self.comm.ledger.totals()
        return {k: self.carry[k] + float(t[k]) for k in ("sent_bytes", "payload_bytes", "recv_bytes")}

    # --- the loop ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg, comm = self.cfg, self.comm
        steps = cfg.train.steps
        eval_every = cfg.train.eval_every or steps
        bar = self._progress()
        self._ready()  # every rank ready: the clocks start together
        wall = self.carry["wall_s"]
        acc_compute = acc_comm = 0.0
        last_eval: dict[str, float] = {}
        step = self.start
        while (step := self._next_step(step)) < steps:
            comm.ledger.step = step
            x, y = self.stream.batch(step)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            mark = comm.ledger.mark()
            t0 = time.perf_counter()
            loss = self.strategy.train_step((x, y), step)
            dt = time.perf_counter() - t0
            if not math.isfinite(loss):
                raise NonFiniteLoss(self._nonfinite(loss, step))
            comm_s = float(comm.ledger.totals(since=mark)["comm_seconds"])
            wall += dt
            acc_compute += max(dt - comm_s, 0.0)
            acc_comm += comm_s
            done = step + 1
            if not self._counted(done):  # a refused step, run again (thinwire.ft_trainer)
                continue
            if self.writer and (done % cfg.train.log_every == 0 or done == steps):
                self.writer.write({"kind": "train", "step": done, "loss": loss,
                                   "lr": lr_at(cfg.train, step), "step_s": dt,
                                   "compute_s": acc_compute, "comm_s": acc_comm, "wall_s": wall,
                                   **self._counters()})
            if done % eval_every == 0 or done == steps:
                last_eval = self._evaluate(done, wall, final=done == steps) or last_eval
                if bar is not None:
                    bar.set_postfix({self.task.metric[:4]: f"{last_eval.get(self.task.metric, 0):.3f}"})
            if self._checkpoint_due(done):
                self._save(done, wall)
            if bar is not None:
                bar.update(1)
            step = done
        if self.start == steps:  # resumed after the final checkpoint: the final write failed
            last_eval = self._evaluate(steps, wall, final=True, record=False)
        if bar is not None:
            bar.close()
        summary = self._summary(wall, acc_compute, acc_comm, last_eval)
        if self.writer:
            self.writer.close()
        self.strategy.close()
        return summary

    def _ready(self) -> None:
        self.comm.barrier()

    def _gather(self, values: list[float]) -> list[list[float]]:
        return self.comm.gather_floats(values)

    def _rank_name(self) -> int:
        return self.comm.rank

    def _complete(self, summary: dict[str, Any]) -> dict[str, Any]:
        return summary

    def _nonfinite(self, loss: float, step: int) -> str:
        kept = checkpoint.latest_step(self.run_dir)
        where = (f"the last complete checkpoint (step {kept}) is kept" if kept is not None
                 else "no checkpoint was written")
        return (f"train: the loss became {loss} at step {step} on rank {self.comm.rank}; lower "
                f"--train.lr (now {self.cfg.train.lr:g}) or set --train.clip_norm; {where}")

    def _progress(self) -> Any:
        if self.comm.rank != 0 or not self.cfg.run.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=self.cfg.train.steps, initial=self.start, desc=self.cfg.run_name,
                    leave=False, dynamic_ncols=True, mininterval=1.0)

    def _checkpoint_due(self, done: int) -> bool:
        every = self.cfg.run.checkpoint_every
        return (every > 0 and done % every == 0) or done == self.cfg.train.steps

    def _evaluate(self, step: int, wall: float, *, final: bool = False,
                  record: bool = True) -> dict[str, float]:
        model = self.strategy.eval_model()  # every rank: a sharded strategy assembles here
        counters = self._counters()
        per_rank = self.comm.gather_floats([counters["sent_bytes"], counters["payload_bytes"]])
        if model is None:
            self.strategy.observe(step, None, self.task.higher_is_better)
            return {}
        result = self.task.evaluate(model, self.ds.x_test, self.ds.y_test, device=self.device,
                                    batch_size=eval_rows(self.ds.num_classes))
        self.strategy.observe(step, float(result[self.task.metric]),
                              self.task.higher_is_better)
        if final:
            self.final_model = model
        if self.writer is None or not record:  # record=False: its record is already written
            return result
        sent = [r[0] for r in per_rank]
        self.writer.write({"kind": "eval", "step": step, "metric": self.task.metric, **result,
                           "wall_s": wall, "sent_bytes": sum(sent) / len(sent),
                           "sent_bytes_max": max(sent),
                           "payload_bytes": sum(r[1] for r in per_rank) / len(per_rank)})
        return result

    def _save(self, step: int, wall: float) -> None:
        state = {"strategy": self.strategy.state_dict(),
                 "trainer": {"wall_s": wall, **self._counters(), "label": label(self.cfg)}}
        checkpoint.save_rank(self.run_dir, step, self.comm.rank, state)
        self.comm.barrier()
        if self.comm.rank == 0:
            checkpoint.mark_complete(self.run_dir, step, self.comm.world_size)
        self.comm.barrier()

    def _export(self) -> None:
        """The final model to ``model.pt`` (rank holding it), batch statistics recalibrated."""
        model = self.final_model
        if model is None:
            return
        if uses_batch_statistics(model):
            batches = (self.stream.batch(s)[0] for s in range(RECALIBRATION_BATCHES))
            recalibrate_batchnorm(model, batches)
        buf = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buf)
        write_bytes(self._log_dir() / "model.pt", buf.getvalue())

    def _summary(self, wall: float, compute: float, comm_s: float,
                 last_eval: dict[str, float]) -> dict[str, Any]:
        c = self._counters()
        mem = self.strategy.memory()
        rss, device_peak = process_peaks(self.device)
        mine = RankTotals(
            sent=c["sent_bytes"], payload=c["payload_bytes"], recv=c["recv_bytes"],
            params=mem.params, grads=mem.grads, optimizer=mem.optimizer,
            param_count=mem.param_count, stored_count=mem.stored_count,
            activations=mem.activations, gathered=mem.gathered, host=mem.host, peak=mem.peak,
            rss_peak=rss, device_peak=device_peak, holds_model=float(self.final_model is not None))
        ranks = [RankTotals.of(row) for row in self._gather(mine.floats())]
        self._export()
        cfg = self.cfg
        estimated = bool(self.comm.ledger.totals()["sent_estimated"])
        summary = RunSummary(
            method=cfg.method.name, model=cfg.model.name, data=cfg.data.name, label=label(cfg),
            run=cfg.run_name, metric=self.task.metric,
            higher_is_better=self.task.higher_is_better, workers=len(ranks),
            steps=cfg.train.steps, final=last_eval, wall_s=wall, compute_s=compute,
            comm_s=comm_s, bytes=ByteTotals.of(ranks, estimated),
            memory=MemoryTotals.of(ranks, self.strategy.full_param_count(),
                                   {"zero": cfg.memory.zero, "recompute": cfg.memory.recompute,
                                    "offload": cfg.memory.offload}),
            config=to_dict(cfg), final_files=RunSummary.files_of(ranks)).to_json()
        ledger = self.comm.ledger
        write_text(self.run_dir / f"ledger.rank{self._rank_name()}.json", json.dumps(
            {"by_op": ledger.by_op(), "totals": ledger.totals(),
             "totals_with_control": ledger.totals(include_control=True),
             "devices": sorted({e.device for e in ledger.entries if e.device})}, indent=1))
        # every rank's model and ledger are written (a rank whose write failed never gets
        # here): a run is complete once its summary exists, so it is written last
        self._ready()
        summary = self._complete(summary)
        if self.writer is not None:
            write_text(self._log_dir() / "summary.json", json.dumps(summary, indent=2))
        return summary

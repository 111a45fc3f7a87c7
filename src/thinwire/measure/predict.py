"""Predict a thinwire run: its ledger's bytes exactly, its step time from calibrated constants.

For a run config (any registered method, any model):

1. the layout of the run's model (:func:`run_layout`): built from the config as the workers
   build it, its gradient-ready order probed with one forward and backward pass on the run's
   first batch (DDP fills its buckets in that order), its IST plan from the model's adapter;
   for a method that declares a ``run_layout`` (pipeline stages, tensor-parallel slices) that
   function's layout of the model and the first batch instead;
2. the bytes (:func:`run_traffic`): the method's own traffic function,
   ``METHODS.get(name).traffic(layout, options, workers, steps, seed, optimizer_states)``; no
   byte is re-derived here, so the prediction equals every rank's ledger (tests hold it so);
   ``optimizer_states`` is the number of per-element state tensors of the run's optimizer,
   found by stepping it once (:func:`optimizer_states`);
3. the time per step on rank 0 (whose clock ``summary.json`` reports), with the constants of a
   :class:`~thinwire.measure.calibrate.Calibration` and the run's
   :class:`~thinwire.measure.local.RunShape` (:func:`predict_run`):
   - communication: rank 0's calls (``Traffic.rank0_calls``), each op's ``calls x hops x
     alpha + wire bytes / bandwidth`` (all-reduce 2(n-1) hops, all-gather n-1, an exchange
     n-1), plus ``call_overhead_s`` per collective call (DDP's reducer, measured per bucket);
   - compute: (t0 + F / R) x straggler, F = 6 b sum_i w_i w_{i+1} over the widths rank 0
     trains; the straggler factor is the wait for the slowest worker at each synchronisation;
   - codec: the run's codec over the 4-byte gradient of the layout, once per synchronisation,
     at its measured bytes per second, x straggler;
   - local synchronisation work (repartitioning, parameter averaging, an outer step) per
     period, over its S steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from thinwire.config import Config
    from thinwire.data import Dataset
    from thinwire.measure.calibrate import Calibration
    from thinwire.measure.local import RunShape
    from thinwire.strategies.traffic import Layout, Traffic

HOPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1}
"""Sequential message steps of one collective over n ranks (ring all-reduce, ring all-gather);
any other op (an exchange of messages) takes n - 1."""


def run_layout(cfg: Config, dataset: Dataset | None = None) -> Layout:
    """Step 1: the layout of the run's model (module docstring)."""
    from thinwire.builders import build_model, load_data, make_stream
    from thinwire.models import MODELS
    from thinwire.strategies import METHODS
    from thinwire.strategies.entry import HasRunLayout
    from thinwire.strategies.traffic import Layout

    ds = dataset if dataset is not None else load_data(cfg)
    model = build_model(cfg, ds)
    batch = make_stream(cfg, ds, 0, cfg.dp_degree).batch(0)
    entry = METHODS.get(cfg.method.name)
    if isinstance(entry, HasRunLayout):
        return entry.run_layout(cfg, model, batch)
    example = batch[0]
    adapter = MODELS.get(cfg.model.name).ist
    plan = adapter(model).plan if adapter is not None else None
    return Layout.of_model(model, example, ist=plan)


def optimizer_states(cfg: Config) -> int:
    """Per-element state tensors the run's optimizer keeps (one step on a probe parameter)."""
    import torch

    from thinwire.strategies.base import make_optimizer

    p = torch.nn.Parameter(torch.zeros(3))
    opt = make_optimizer([p], cfg.train)
    p.grad = torch.ones(3)
    opt.step()
    return sum(1 for v in opt.state[p].values() if torch.is_tensor(v) and v.numel() == 3)


def run_traffic(cfg: Config, layout: Layout) -> Traffic:
    """Step 2: the run's ledger totals from its method's own traffic function."""
    from thinwire.strategies import METHODS

    entry = METHODS.get(cfg.method.name)
    return entry.traffic(layout, cfg.method.options, cfg.runtime.workers, cfg.train.steps,
                         cfg.train.seed, optimizer_states(cfg))


def summary_bytes(t: Traffic) -> dict[str, float]:
    """The ledger totals as ``summary.json``'s ``bytes`` reports them."""
    return {"sent_per_worker_mean": sum(t.sent) / len(t.sent),
            "sent_per_worker_max": float(max(t.sent)),
            "payload_per_worker_mean": sum(t.payload) / len(t.payload)}


def comm_seconds(t: Traffic, n: int, cal: Calibration) -> float:
    """Step 3: rank 0's calls of the whole run, timed on the calibrated links."""
    total = 0.0
    for op, (calls, wire) in t.rank0_calls.items():
        fit = cal.links.get(op)
        if fit is None or not calls:
            continue
        hops = HOPS.get(op, lambda m: m - 1)(n)
        total += calls * hops * fit.alpha_s + wire / fit.bytes_per_s
        if op in HOPS:
            total += calls * cal.call_overhead_s
    return total


def _weights(widths: tuple[float, ...]) -> float:
    return sum(a * b for a, b in zip(widths[:-1], widths[1:]))


def step_seconds(cfg: Config, layout: Layout, t: Traffic, cal: Calibration, shape: RunShape
                 ) -> dict[str, float]:
    """Step 3: seconds per step, by component (module docstring)."""
    n, steps = cfg.runtime.workers, cfg.train.steps
    straggler = cal.stragglers.get(cal.key(shape.key, shape.sync_every), 1.0)
    flops = 6.0 * _weights(shape.trained) * cfg.train.batch_size
    compute = (cal.step_overhead_s + flops / cal.compute_flops_per_s) * straggler
    codec = 0.0
    if shape.codec != "none" and n > 1:
        codec = 4.0 * layout.numel / cal.codecs[shape.codec] / shape.sync_every * straggler
    sync = cal.sync_overhead_s.get(shape.name, 0.0) / shape.sync_every
    comm = comm_seconds(t, n, cal) / steps
    return {"compute_time_s": compute, "comm_time_s": comm, "codec_time_s": codec,
            "sync_time_s": sync, "straggler": straggler,
            "step_time_s": compute + comm + codec + sync}


def predict_run(cfg: Config, layout: Layout, cal: Calibration | None = None,
                shape: RunShape | None = None) -> dict[str, Any]:
    """Steps 2-3 for one run: ``summary.json``'s bytes exactly and, with a calibration and the
    run's shape, its seconds per step."""
    t = run_traffic(cfg, layout)
    out: dict[str, Any] = {"run": cfg.run_name, **summary_bytes(t),
                           "per_rank_sent": list(t.sent), "rank0_calls": dict(t.rank0_calls)}
    if cal is not None and shape is not None:
        out.update(step_seconds(cfg, layout, t, cal, shape))
    return out

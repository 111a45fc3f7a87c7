"""The library's run layer, launcher side: pre-flight, run directory, launch, one config run.

What ``thinwire train`` / ``compare``, the planner's calibration, the testbed and the theory
lab's bridge experiment call to turn a :class:`~thinwire.config.Config` into a trained run; the
command modules only parse arguments. The builders a worker calls (data, model, stream,
strategy, mesh) live in :mod:`thinwire.builders` (the workers never import this module, which
launches them), and are imported from there. Steps of :func:`run_config`:
  1. :func:`preflight`: load the data once, build the model once, and check what would fail on
     the workers (shards hold a batch, the model fits the data and the method) as one-line
     errors before any worker starts;
  2. prepare the run directory (:mod:`thinwire.rundir`: plain names only, nothing outside it
     touched) and write the resolved ``config.toml``;
  3. launch the workers (:func:`thinwire.launch.launch`); each runs the trainer;
  4. read back ``summary.json``.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from thinwire import config as config_mod
from thinwire.builders import (
    build_model,
    load_data,
    make_stream,
    rescalable,
)
from thinwire.config import Config
from thinwire.data import Dataset
from thinwire.errors import RunFailed, UsageError
from thinwire.options import parse_spec, split_top
from thinwire.strategies import METHODS

__all__ = [
    "method_configs", "method_overrides", "preflight", "run_config", "run_directory", "run_name",
    "split_methods",
]


def check_runtime(cfg: Config) -> None:
    """The device and backend the workers would pick exist here (the workers' own check,
    :mod:`thinwire.runtime.dist`, made before they start; CUDA is not initialised)."""
    import torch

    rt, cuda = cfg.runtime, torch.cuda.is_available()
    if rt.device == "cuda" and not cuda:
        raise UsageError("runtime.device: cuda requested but no CUDA device is visible; use "
                         "--runtime.device cpu")
    on_cuda = rt.device == "cuda" or (rt.device == "auto" and cuda)
    if rt.backend == "nccl" and not on_cuda:
        raise UsageError("runtime.backend: nccl needs CUDA devices"
                         + (" (none is visible here)" if not cuda else "")
                         + "; use --runtime.backend gloo on CPU")


def preflight(cfg: Config) -> Dataset:
    """Step 1: what would fail on the workers, as one-line errors now; returns the data."""
    check_runtime(cfg)
    if cfg.data.dir and not Path(cfg.data.dir).is_dir():
        raise UsageError(f"data.dir: {cfg.data.dir} is not a directory; pass the folder holding "
                         "the dataset files, or leave it empty for the standard places")
    ds = load_data(cfg)
    try:
        model = build_model(cfg, ds)
    except (RuntimeError, MemoryError, OverflowError) as exc:
        first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise UsageError(f"model {cfg.model.name}: cannot be built with these options ({first}); "
                         "choose smaller --model.* sizes") from None
    entry = METHODS.get(cfg.method.name)
    if entry.check_model is not None:
        entry.check_model(cfg, model)
    shards = cfg.dp_degree
    for shard in range(shards):
        try:
            make_stream(cfg, ds, shard, shards)
        except ValueError as exc:
            raise UsageError(f"data: worker {shard}: {exc}") from None
    return ds


# --- the run directory and the launch -----------------------------------------------------------
@contextlib.contextmanager
def run_directory(cfg: Config) -> Iterator[Any]:
    """Step 2 (:mod:`thinwire.rundir`): the run directory claimed for the job (locked; a
    replacement staged beside the old run and swapped in only if the body succeeds), with the
    resolved ``config.toml`` written into it. Yields the :class:`~thinwire.rundir.RunDir`."""
    from thinwire import checkpoint, rundir

    with rundir.open_run(cfg.run.out, cfg.run_name, resume=cfg.run.resume,
                         overwrite=cfg.run.overwrite) as rd:
        if cfg.run.resume:
            rundir.check_no_links(rd.path)
            checkpoint.require_resumable(rd.path, cfg.runtime.workers, rescalable=rescalable(cfg),
                                         steps=cfg.train.steps)
        rundir.write_text(rd.path / "config.toml", config_mod.dumps(cfg))
        try:
            yield rd
            rd.commit()
        finally:  # however the job ended: a worker killed mid-write leaves its temporary file
            with rundir.deferred_signals():
                checkpoint.remove_temporaries(rd.path)


def run_config(cfg: Config) -> dict[str, Any]:
    """Train one config on its local workers (steps 1-4); returns the run's summary. A bad input
    found by a worker is a :class:`UsageError`, a failed worker a :class:`RunFailed`."""
    from thinwire.launch import WorkerFailed, launch
    from thinwire.worker import RESUME_CHECKED_ENV

    preflight(cfg)
    with run_directory(cfg) as rd:
        if cfg.runtime.fault_tolerance == "torchft":
            return run_replicas(rd.path, cfg, env={RESUME_CHECKED_ENV: "1"})
        try:
            launch(rd.path, cfg.runtime.workers, max_restarts=cfg.runtime.max_restarts,
                   env={RESUME_CHECKED_ENV: "1"})
        except WorkerFailed as exc:
            if exc.kind == "usage":
                raise UsageError(f"{cfg.run_name}: {exc.cause or exc}") from None
            raise RunFailed(f"{cfg.run_name}: {exc}") from None
    return json.loads((rd.final / "summary.json").read_text())  # type: ignore[no-any-return]


def run_replicas(run_dir: Path, cfg: Config, *, env: dict[str, str] | None = None,
                 module: str = "thinwire.worker") -> dict[str, Any]:
    """Step 3 with ``runtime.fault_tolerance torchft``: the workers as replica groups of a
    torchft quorum (:func:`thinwire.launch.launch_replicas`); the job goes on while at least
    ``runtime.min_workers`` live, and the summary names the workers lost
    (:func:`thinwire.ft_trainer.compose_summary`). ``module``: the worker entry (tests wrap
    it to inject faults)."""
    from thinwire.ft_trainer import compose_summary
    from thinwire.launch import WorkerFailed, launch_replicas

    try:
        exits = launch_replicas(run_dir, cfg.runtime.workers,
                                min_workers=cfg.runtime.min_workers, env=env, module=module)
    except WorkerFailed as exc:
        if exc.kind == "usage":
            raise UsageError(f"{cfg.run_name}: {exc.cause or exc}") from None
        raise RunFailed(f"{cfg.run_name}: {exc}") from None
    return compose_summary(run_dir, exits)


# --- several methods: the spec syntax of compare and bench ---------------------------------------
def method_overrides(spec: str) -> dict[str, Any]:
    """Config overrides for one method spec of ``--methods``.

    ``"ist:local_steps=20,train.lr=0.1"`` -> ist with K = 20 and lr 0.1: the name is a method
    (or a shorthand a method declares, such as a codec's name for compressed dp), the
    ``KEY=VALUE`` items are the method's options, dotted keys any other option of the run."""
    name, values = parse_spec(spec, "method")
    own = {k: v for k, v in values.items() if "." not in k}
    other = {k: v for k, v in values.items() if "." in k}
    out: dict[str, Any] = dict(other)
    if name in METHODS:
        out["method.name"] = name
        out.update({f"method.{k}": v for k, v in own.items()})
        return out
    for _, entry in METHODS.entries():
        if entry.alias is not None and (resolved := entry.alias(name, own)) is not None:
            out.update({f"method.{k}": v for k, v in resolved.items()})
            return out
    raise UsageError(f"unknown method {name!r} in {spec!r}; use one of "
                     f"{', '.join(METHODS.names())} or a codec name (e.g. topk)")


def split_methods(text: str) -> list[str]:
    """Split ``--methods`` on the commas that start a new method (a method's own options are
    comma-separated too: ``dp,ist:local_steps=20,train.lr=0.1,topk``). A part is an option of
    the method before it when it is ``key=value`` with no colon before its ``=`` (the value may
    be a codec spec: ``pipeline:codec_fwd=int4,codec_bwd=lowrank:rank=8``); commas inside
    parentheses never split (``pipeline:codec_fwd=(topk:ratio=0.1,ef=true),dp``)."""
    out: list[str] = []
    for part in (p.strip() for p in split_top(text, "--methods")):
        if not part:
            continue
        if "=" in part and ":" not in part.split("=", 1)[0] and out:
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def run_name(spec: str) -> str:
    """A plain directory name for a method spec (``ist:local_steps=20`` -> ``ist_local_steps20``)."""
    name = re.sub(r"[^A-Za-z0-9._+-]+", "_", spec.replace("=", "")).strip("._-")
    return name[:100].rstrip("._-") or "run"


def method_configs(specs: list[str], base_path: str | None, base: dict[str, Any]
                   ) -> list[Config]:
    """One validated config per method spec (all validated before anything trains)."""
    if not specs:
        raise UsageError("--methods: give at least one method, e.g. dp,localsgd,ist")
    cfgs = [config_mod.load(base_path, {**base, **method_overrides(s), "run.name": run_name(s)})
            for s in specs]
    names = [c.run_name for c in cfgs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UsageError(f"--methods: {dup[0]} appears twice; give each method once")
    return cfgs

"""``thinwire plan``: predict memory, bytes and step time; search plans; validate; insight.

  thinwire plan --model gpt3-175b --cluster a100-80gb --nodes 8 --tp 8 --pp 8 --sp --recompute selective
  thinwire plan --model gpt2-small --cluster h100 --devices 1
  thinwire plan --model gpt3-175b --cluster a100-80gb --nodes 8 --search
  thinwire plan --validate
  thinwire plan --model mlp-784-2048-2048-10 --cluster cpu-1gbe --nodes 8 --method ist
  thinwire plan --model mlp-784-2048-2048-10 --cluster cpu-1gbe --nodes 8 --crossover
  thinwire plan --model mynet.py:ResNet --input 32x3x32x32 --cluster cpu-1gbe --nodes 4 --method ist
  thinwire plan --model mlp-784-2048-2048-10 --cluster cpu-1gbe --nodes 64 --scaling --out runs/plan
  thinwire plan --calibrate --model mlp-784-512-512-10 --workers 4 --steps 100 --out runs/calibrate
Bad input raises UsageError (the top-level command prints it and exits 2).

One concept, one file (over 400 lines): the ``plan`` command's arguments and what each mode prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from thinwire.errors import UsageError
from thinwire.planner.failure import failure_report
from thinwire.planner.modes import convergence_mode, crossover_mode, scaling_mode
from thinwire.planner.presets import list_presets, load_cluster, load_model
from thinwire.planner.report import plan_report, prediction_json, search_report
from thinwire.planner.search import search
from thinwire.planner.specs import (
    ATTENTION,
    DTYPE_BYTES,
    FROM_RUN_RECOMPUTE,
    MEGATRON_RECOMPUTE,
    ClusterSpec,
    MLPSpec,
    ModelSpec,
    XMLPShapes,
)
from thinwire.planner.step import predict
from thinwire.planner.strategy import StrategySpec
from thinwire.planner.usermodel import is_module_ref
from thinwire.planner.validation import render_validation, step_time_records

_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
CALIBRATE_MODEL = "mlp-784-512-512-10"


def parse_bandwidth(text: str) -> float:
    """'10gbit', '100Mb/s', '25GB/s', '1.25e9' (bytes/s) -> bytes per second, the planner's
    unit of bandwidth (a link *rate*, :func:`thinwire.testbed.rates.parse_rate`, is in bits/s as
    tc takes it).

    bits: 'bit', 'b/s', 'bps' (lower-case b); bytes: 'B', 'B/s', 'Bps' or no unit.
    """
    m = re.fullmatch(
        r"\s*([0-9.]+(?:[eE][+-]?\d+)?)\s*([kKmMgGtT]?)(bits?|b/s|bps|B/s|Bps|B)?\s*", text
    )
    if not m:
        raise UsageError(
            f"--bandwidth {text!r} not understood; write e.g. 1gbit, 100Mb/s or 25GB/s"
        )
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    unit = m.group(3) or "B"
    return value / 8 if unit.startswith("b") else value


def _where(parser: argparse.ArgumentParser) -> None:
    """The model and the cluster."""
    g = parser.add_argument_group("what and where")
    g.add_argument("--config", metavar="CONFIG.toml",
                   help="price a thinwire train config as written (e.g. RUN_DIR/config.toml): "
                   "every rank's bytes from its method's formula; with --cluster also the "
                   "planner's step time and memory of its layout on that cluster")
    g.add_argument("--model", help="preset name, mlp-W0-W1-...-WL, FILE.toml, or "
                   "FILE.py:ClassName (a model of your own, built with its constructor's "
                   "defaults; give --input)")
    g.add_argument("--input", metavar="SHAPE",
                   help="--model FILE.py:ClassName: the example input's shape, batch first, e.g. "
                   "8x1x28x28; the IST plan is derived from the traced forward on it, and its "
                   "batch is the micro-batch unless --micro-batch-size says otherwise")
    g.add_argument("--input-tokens", type=int, metavar="V",
                   help="with --input: the example is token ids below V (a model that embeds "
                   "tokens) instead of standard normal floats")
    g.add_argument("--ist-residual", choices=("whole", "channels", "blocks"), default="whole",
                   help="--model FILE.py:ClassName: a residual stream stays whole and only the "
                   "units inside its branches are cut (whole), the stream is cut too "
                   "(channels), or residual blocks are dealt units (blocks, ResIST)")
    g.add_argument("--ist-shared", metavar="NAME,...", default="",
                   help="--model FILE.py:ClassName: submodules kept whole (not traced into, "
                   "shared by every subnet), as IST's shared=: the escape hatch for a submodule "
                   "the tracer cannot follow")
    g.add_argument(
        "--cluster", help="preset name (a100-80gb, h100, h200, cpu-1gbe, ...) or FILE.toml"
    )
    g.add_argument("--nodes", type=int, help="number of nodes (default: the preset's)")
    g.add_argument("--devices", type=int,
                   help="number of devices in all, e.g. 1 or 12 (nodes follow; the last one "
                   "may be partly used); instead of --nodes")
    g.add_argument("--bandwidth", help="override the inter-node bandwidth per device, e.g. 1gbit")


def _strategy_flags(parser: argparse.ArgumentParser) -> None:
    """The layout, the memory savers and the method."""
    s = parser.add_argument_group("strategy")
    for flag, help_ in (
        ("--dp", "data-parallel degree (default: devices / (tp*pp))"),
        ("--tp", "tensor-parallel degree"),
        ("--pp", "pipeline stages"),
        ("--micro-batch-size", "b, samples per micro-batch"),
        ("--micro-batches", "m per pipeline per step (default: from the global batch)"),
        ("--global-batch", "B in samples (default: the model preset's)"),
        ("--interleave", "v, interleaved chunks per stage"),
        ("--zero", "ZeRO stage 0-3"),
    ):
        s.add_argument(flag, type=int, help=help_)
    s.add_argument("--recompute", choices=MEGATRON_RECOMPUTE, default="none")
    s.add_argument("--sp", action="store_true", help="sequence parallelism")
    s.add_argument("--attention", choices=ATTENTION, default="fused",
                   help="fused (SDPA / flash: no attention scores stored) or materialized")
    s.add_argument("--offload", action="store_true", help="optimizer state on the host")
    s.add_argument("--overlap-dp", action="store_true", help="overlap the all-reduce with backward")
    s.add_argument("--dtype", choices=sorted(DTYPE_BYTES), help="default: the cluster's")
    s.add_argument("--accounting", choices=("megatron", "zero"), default="megatron")
    s.add_argument("--optimizer", choices=("adam", "momentum", "sgd"),
                   help="what the optimizer keeps per parameter: memory, and the state a "
                   "method moves with its units (default: adam; with --convergence NAME and "
                   "no --model and --cluster: the table's runs')")
    s.add_argument("--method", default="",
                   help="a method of thinwire train instead of the gradient all-reduce, with "
                   "its options as there: e.g. localsgd:period=20, ist, ist:deployment=sharded, "
                   "topk:ratio=0.01 (defaults: the method's own)")
    s.add_argument("--codec-passes", type=float, default=4.0,
                   help="a codec's encode + decode cost in passes over the gradient")


def _mode_flags(parser: argparse.ArgumentParser) -> None:
    """What to print instead of one plan."""
    a = parser.add_argument_group("modes")
    a.add_argument("--search", action="store_true", help="rank all feasible plans by step time")
    a.add_argument("--top", type=int, default=10, help="plans to show with --search")
    a.add_argument("--validate", "--report", dest="validate", action="store_true",
                   help="print the validation tables against published runs")
    a.add_argument("--crossover", action="store_true",
                   help="when thinwire's methods beat data parallelism, per link speed")
    a.add_argument("--penalty", default="", help="extra-steps factors, e.g. ist=2,localsgd=1.5")
    a.add_argument("--convergence", nargs="+", metavar="SRC",
                   help="steps to target per method: run directories (or folders of them) to "
                   "fit, a table written by --out FILE.json, or a shipped table's name; alone, "
                   "prints the fit; with --crossover, time to target per link")
    a.add_argument("--target", help="--convergence: target values of the runs' metric, e.g. "
                   "0.8,0.83 (default: the table's)")
    a.add_argument("--scaling", action="store_true",
                   help="step time and throughput vs workers (PNG)")
    a.add_argument("--max-workers", type=int, default=256)
    a.add_argument("--weak", action="store_true", help="scaling with a fixed per-worker batch")
    a.add_argument("--out", help="directory for --scaling's scaling.png, --calibrate's tables")
    a.add_argument("--calibrate", action="store_true",
                   help="measure this machine, run every method here and print predicted "
                   "against measured (--model mlp-..., --workers, --steps, --micro-batch-size "
                   "per worker)")
    a.add_argument("--workers", type=int, help="--calibrate: local worker processes (4)")
    a.add_argument("--steps", type=int, help="--calibrate: steps per run, a multiple of 10 (100)")
    a.add_argument("--list", action="store_true", help="list the presets")
    _failure_flags(parser)
    a.add_argument("--json", action="store_true", help="machine-readable output")


def _failure_flags(parser: argparse.ArgumentParser) -> None:
    """What one worker's failure costs: the torchft quorum against a restart."""
    f = parser.add_argument_group("failures (thinwire.planner.failure)")
    f.add_argument("--failures", action="store_true",
                   help="price one worker's failure: torchft's quorum (--runtime.fault_tolerance "
                   "torchft) against a restart from the last checkpoint (--runtime.max_restarts), "
                   "and the crossover; --config prices it when the run sets either")
    f.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS",
                   help="the restart's checkpoint interval (default 100; --config: the run's)")
    f.add_argument("--startup-s", type=float, default=0.0, metavar="S",
                   help="a worker's start-up before its first step, as measured on the target "
                   "(default 0: the restart's cost is then a lower bound)")
    f.add_argument("--heartbeat-s", type=float, default=None, metavar="S",
                   help="the lighthouse's heartbeat timeout (default: the launcher's, 2 s)")


def _failures(args: argparse.Namespace, model: ModelSpec, cluster: ClusterSpec, pred: Any,
              checkpoint_every: int = 100) -> Any:
    """``--failures``: one failure's cost at the plan's step time
    (:func:`thinwire.planner.failure.failure_cost`)."""
    from thinwire.planner.failure import HEARTBEAT_S, failure_cost

    return failure_cost(model, cluster, pred.strategy, pred.step_time,
                        checkpoint_every=(checkpoint_every if args.checkpoint_every is None
                                          else args.checkpoint_every),
                        startup_s=args.startup_s,
                        heartbeat_s=HEARTBEAT_S if args.heartbeat_s is None else args.heartbeat_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``thinwire plan``."""
    _where(parser)
    _strategy_flags(parser)
    _mode_flags(parser)


def _micro_batches(args: argparse.Namespace, model: ModelSpec, b: int, dp: int) -> int:
    """m from --micro-batches, or the global batch over b * dp."""
    if args.micro_batches is not None:
        return int(args.micro_batches)
    batch = args.global_batch or model.global_batch
    if batch and batch % (b * dp):
        raise UsageError(
            f"global batch {batch} is not a multiple of b*dp = {b * dp}; "
            "set --global-batch or --micro-batches"
        )
    return max(1, batch // (b * dp)) if batch else 1


def _strategy(args: argparse.Namespace, model: ModelSpec, cluster: ClusterSpec) -> StrategySpec:
    """The StrategySpec the flags describe (degrees defaulting to the whole cluster)."""
    tp, pp = args.tp or 1, args.pp or 1
    n = cluster.devices
    if args.dp is None and n % (tp * pp):
        raise UsageError(
            f"tp*pp = {tp * pp} does not divide the {n} devices; change --tp/--pp, --nodes or "
            "--devices"
        )
    dp = args.dp or n // (tp * pp)
    b = args.micro_batch_size or 1
    return StrategySpec(
        dp=dp, tp=tp, pp=pp, micro_batch_size=b, micro_batches=_micro_batches(args, model, b, dp),
        interleave=args.interleave or 1, zero=args.zero or 0, recompute=args.recompute,
        sequence_parallel=args.sp, attention=args.attention, offload=args.offload,
        dtype=args.dtype or "", accounting=args.accounting, optimizer=args.optimizer or "adam",
        overlap_dp=args.overlap_dp, method=args.method, codec_passes=args.codec_passes,
    )


def _cluster(args: argparse.Namespace) -> ClusterSpec:
    """--cluster with --nodes or --devices and --bandwidth applied."""
    if args.nodes is not None and args.devices is not None:
        raise UsageError("give --nodes or --devices, not both (--devices sets the nodes)")
    cluster = load_cluster(args.cluster, args.nodes)
    if args.devices is not None:
        cluster = cluster.with_devices(args.devices)
    if args.bandwidth:
        cluster = dataclasses.replace(cluster, inter_bandwidth=parse_bandwidth(args.bandwidth))
    return cluster


def _print(out: str | dict[str, Any] | list[Any]) -> None:
    if isinstance(out, str):
        print(out, end="")
    else:
        print(json.dumps(out, indent=2, default=str))


def _validate(args: argparse.Namespace) -> str | dict[str, Any]:
    """--validate: the validation tables, or their records as JSON."""
    if not args.json:
        return render_validation()
    records, summary = step_time_records(load_cluster("a100-80gb"))
    return {"summary": summary, "runs": [dataclasses.asdict(r) for r in records]}


def calibrate_mode(args: argparse.Namespace) -> str | dict[str, Any]:
    """``--calibrate``: the suite of :mod:`thinwire.measure.suite`; predicted against measured
    (bytes exactly, step time) as markdown, written to ``--out``."""
    from thinwire.measure.suite import calibration_report, run_suite

    model = load_model(args.model or CALIBRATE_MODEL)
    if not isinstance(model, MLPSpec):
        raise UsageError("--calibrate trains an MLP: give --model mlp-784-H-...-10")
    n, steps, batch = args.workers or 4, args.steps or 100, args.micro_batch_size or 128
    out = Path(args.out or "runs/calibrate")
    data = run_suite(model.widths, n, steps, batch, str(out / "runs"),
                     log=lambda m: print(f"thinwire plan --calibrate: {m}", file=sys.stderr))
    data["command"] = (f"thinwire plan --calibrate --model {model.name} --workers {n} "
                       f"--steps {steps} --micro-batch-size {batch} --out {shlex.quote(str(out))}")
    text = calibration_report(data)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.md").write_text(text)
    (out / "calibration.json").write_text(json.dumps(data, indent=2, default=str))
    return data if args.json else text + f"\nwrote {out / 'calibration.md'}\n"


def _check_calibrate_only(args: argparse.Namespace) -> None:
    """--workers and --steps belong to --calibrate; elsewhere they are a one-line error."""
    if args.calibrate:
        return
    if args.workers is not None:
        raise UsageError("--workers is --calibrate's number of local processes; for a plan give "
                         "--devices (or --nodes) and --dp")
    if args.steps is not None:
        raise UsageError("--steps is --calibrate's steps per run; a plan predicts one step")


def _search(args: argparse.Namespace, model: ModelSpec, cluster: ClusterSpec
            ) -> str | list[Any]:
    """--search: every feasible layout for the global batch, fastest first."""
    free = dict(dp=None, tp=None, pp=None, micro_batches=1, interleave=None)
    base = _strategy(argparse.Namespace(**{**vars(args), **free}), model, cluster)
    preds = search(model, cluster, base, args.global_batch or model.global_batch)
    if args.json:
        return [prediction_json(model, cluster, p) for p in preds[: args.top]]
    return search_report(preds, args.top, cluster)


def _shape(args: argparse.Namespace) -> tuple[int, ...]:
    from thinwire.planner.usermodel import parse_shape

    return parse_shape(args.input)


def _model(args: argparse.Namespace, cluster: ClusterSpec) -> ModelSpec:
    """--model: a preset, a TOML file, or a user's FILE.py:ClassName counted with the IST plan
    derived on the --input example (groups below the data-parallel degree shared, as IST does
    on that many workers; the default global batch: the example's batch per worker)."""
    if not is_module_ref(args.model):
        if args.input or args.input_tokens is not None:
            raise UsageError("--input and --input-tokens describe the example input of --model "
                             "FILE.py:ClassName; drop them for a preset or TOML model")
        return load_model(args.model)
    from thinwire.planner.usermodel import example_input, load_module, model_spec_from_example

    if not args.input:
        raise UsageError(f"--model {args.model} needs --input SHAPE, the example input's shape "
                         "batch first, e.g. --input 8x1x28x28")
    if args.input_tokens is not None and args.input_tokens < 1:
        raise UsageError(f"--input-tokens={args.input_tokens}: give the vocabulary size, >= 1")
    shape = _shape(args)
    module = load_module(args.model)
    workers = args.dp or max(1, cluster.devices // ((args.tp or 1) * (args.pp or 1)))
    return model_spec_from_example(module, example_input(shape, args.input_tokens or 0),
                                   min_units=workers, residual=args.ist_residual,
                                   shared=tuple(filter(None, args.ist_shared.split(","))),
                                   global_batch=shape[0] * workers)


def _plan(args: argparse.Namespace) -> str | dict[str, Any] | list[Any]:
    """A plan's prediction, a search, a crossover or a scaling curve."""
    if args.crossover and args.convergence and not args.model and not args.cluster:
        args = _table_inputs(args)
    if not args.model or not args.cluster:
        raise UsageError("give --model NAME|FILE.toml|FILE.py:ClassName and --cluster "
                         "NAME|FILE.toml (see --list)")
    cluster = _cluster(args)
    model = _model(args, cluster)
    if is_module_ref(args.model) and args.micro_batch_size is None:
        args = argparse.Namespace(**{**vars(args), "micro_batch_size": _shape(args)[0]})
    if args.search:
        return _search(args, model, cluster)
    base = _strategy(args, model, cluster)
    if args.crossover:
        return crossover_mode(model, cluster, base, method=args.method, penalty=args.penalty,
                              as_json=args.json, convergence=args.convergence or (),
                              target=args.target or "", command_line=_fit_command(args))
    if args.scaling:
        return scaling_mode(model, cluster, base, out=args.out, max_workers=args.max_workers,
                            global_batch=args.global_batch, weak=args.weak, method=args.method,
                            as_json=args.json)
    pred = predict(model, cluster, base)
    cost = _failures(args, model, cluster, pred) if args.failures else None
    if args.json:
        return {**prediction_json(model, cluster, pred),
                **({"failure": cost.as_dict()} if cost is not None else {})}
    return plan_report(model, cluster, pred) + (
        "\n" + failure_report(cost) if cost is not None else "")


def _method_spec(cfg: Any, wide: bool = False) -> str:
    """The run's method as the planner's ``--method`` spec: its name and the options that
    differ from their defaults (values with commas in parentheses); "" where the planner's own
    strategy describes the run: a method that is not ``planned`` (its pipeline and tensor
    degrees are the strategy's) unless the model spec carries the wide-layer shapes the method
    prices itself from (``wide``), and ZeRO (the planner shards its own data parallelism
    itself)."""
    from thinwire.strategies import METHODS

    entry = METHODS.get(cfg.method.name)
    if (not entry.planned and not wide) or cfg.memory.zero:
        return ""
    o = cfg.method.options
    defaults = type(o)()
    items = []
    for f in dataclasses.fields(o):
        v = getattr(o, f.name)
        if v == getattr(defaults, f.name):
            continue
        text = str(v).lower() if isinstance(v, bool) else str(v)
        items.append(f"{f.name}=({text})" if "," in text else f"{f.name}={text}")
    return cfg.method.name + (":" + ",".join(items) if items else "")


def config_strategy(cfg: Any, model: ModelSpec) -> StrategySpec:
    """The planner's :class:`StrategySpec` of a thinwire run: its degrees (dp = workers /
    (pp tp)), per-worker batch as micro-batches (the pipeline's ``micro_batches`` where it has
    them), ``[memory]`` (``recompute`` by :data:`FROM_RUN_RECOMPUTE`), fp32, the run's
    optimizer, and its method (:func:`_method_spec`)."""
    m = int(getattr(cfg.method.options, "micro_batches", 1) or 1) if cfg.parallel.pp > 1 else 1
    optimizer = {"adamw": "adam", "adam": "adam"}.get(cfg.train.optimizer) or (
        "momentum" if cfg.train.momentum else "sgd")
    return StrategySpec(
        dp=cfg.dp_degree, tp=cfg.parallel.tp, pp=cfg.parallel.pp,
        micro_batch_size=max(1, cfg.train.batch_size // m), micro_batches=m,
        zero=cfg.memory.zero, recompute=FROM_RUN_RECOMPUTE[cfg.memory.recompute],
        offload=cfg.memory.offload != "none", dtype="fp32", optimizer=optimizer,
        method=_method_spec(cfg, wide=getattr(model, "wide", None) is not None))


def config_mode(args: argparse.Namespace) -> str | dict[str, Any]:
    """``--config``: the run's bytes per rank (its method's own formula, equal to the ledger:
    :mod:`thinwire.measure.predict`), and with ``--cluster`` the planner's prediction of its
    layout there (devices = the run's workers unless --nodes/--devices say otherwise)."""
    from thinwire import config as config_mod
    from thinwire.builders import build_model, load_data
    from thinwire.measure.predict import run_layout, run_traffic, summary_bytes
    from thinwire.planner.presets import model_spec_from_module
    from thinwire.report.tables import fmt_bytes

    for flag in ("model", "search", "crossover", "scaling"):
        if getattr(args, flag):
            raise UsageError(f"--config prices the run as written; drop --{flag}")
    path = Path(args.config)
    if not path.is_file():
        raise UsageError(f"--config {path}: no such file; give a train config such as "
                         "RUN_DIR/config.toml")
    cfg = config_mod.load(path)
    dataset = load_data(cfg)
    layout = run_layout(cfg, dataset)
    traffic = run_traffic(cfg, layout)
    label = config_mod.label(cfg)
    steps, n = cfg.train.steps, cfg.runtime.workers
    out: dict[str, Any] = {"config": str(path), "method": label, "workers": n, "steps": steps,
                           "bytes": summary_bytes(traffic),
                           "rank0_calls": {k: {"calls": c, "wire_bytes": b}
                                           for k, (c, b) in traffic.rank0_calls.items()}}
    lines = [f"{label} on {n} workers, {steps} steps ({path})",
             f"sent per worker: mean {fmt_bytes(traffic.sent_mean)}, max "
             f"{fmt_bytes(max(traffic.sent))}; {fmt_bytes(traffic.sent_mean / max(steps, 1))} "
             "a step (the method's formula: what every rank's ledger will hold)"]
    lines += [f"  rank 0 {op}: {c} calls, {fmt_bytes(b)} on the wire"
              for op, (c, b) in sorted(traffic.rank0_calls.items())]
    text = "\n".join(lines) + "\n"
    if args.cluster:
        if layout.wide is not None:  # a method that shards a wide layer prices its shapes
            model: Any = XMLPShapes(**dataclasses.asdict(layout.wide)).spec(cfg.model.name)
        else:
            model = model_spec_from_module(build_model(cfg, dataset), cfg.model.name)
        if args.nodes is None and args.devices is None:
            args = argparse.Namespace(**{**vars(args), "devices": n})
        cluster = _cluster(args)
        pred = predict(model, cluster, config_strategy(cfg, model))
        rt = cfg.runtime
        cost = (_failures(args, model, cluster, pred,
                          cfg.run.checkpoint_every or cfg.train.steps)
                if args.failures or rt.fault_tolerance != "none" or rt.max_restarts else None)
        if args.json:
            out["plan"] = prediction_json(model, cluster, pred)
            if cost is not None:
                out["failure"] = cost.as_dict()
        text += "\n" + plan_report(model, cluster, pred)
        text += "\n" + failure_report(cost) if cost is not None else ""
    return out if args.json else text


def _table_inputs(args: argparse.Namespace) -> argparse.Namespace:
    """``--crossover --convergence TABLE`` without ``--model`` and ``--cluster``: the model,
    cluster, devices, micro-batch and optimizer of the table's runs (its ``plan``), where the
    table records them."""
    from thinwire.planner.convergence import load

    plan = load(list(args.convergence)).plan
    if not plan:
        raise UsageError(f"--convergence {' '.join(args.convergence)}: the table records no "
                         "model and cluster of its runs; give --model NAME and --cluster NAME "
                         "(see --list)")
    given = {k: v for k, v in plan.items() if getattr(args, k, None) is None}
    return argparse.Namespace(**{**vars(args), **given})


def _fit_command(args: argparse.Namespace) -> str:
    """A convergence fit's provenance: the command that re-runs it."""
    if not args.convergence:
        return ""
    return shlex.join(["thinwire", "plan", "--convergence", *args.convergence]
                      + (["--target", args.target] if args.target else []))


def _check_failures_flags(args: argparse.Namespace) -> None:
    """--failures prices one plan (or --config with --cluster); elsewhere a one-line error."""
    given = args.checkpoint_every is not None or args.startup_s or args.heartbeat_s is not None
    if given and not args.failures and not args.config:
        raise UsageError("--checkpoint-every, --startup-s and --heartbeat-s belong to --failures; "
                         "add --failures")
    other = [f for f in ("search", "crossover", "scaling", "validate", "calibrate")
             if getattr(args, f)]
    if args.failures and (other or (args.config and not args.cluster)):
        why = f"--{other[0]}" if other else "--config without --cluster"
        raise UsageError(f"--failures prices one plan's step time; drop {why} (--config needs "
                         "--cluster for a step time)")


def run(args: argparse.Namespace) -> int:
    """Dispatch ``thinwire plan``; returns the exit code."""
    _check_calibrate_only(args)
    _check_failures_flags(args)
    if args.config:
        _print(config_mode(args))
    elif args.validate:
        _print(_validate(args))
    elif args.convergence and not args.crossover:
        _print(convergence_mode(args.convergence, target=args.target or "", out=args.out,
                                as_json=args.json, command_line=_fit_command(args)))
    elif args.calibrate:
        _print(calibrate_mode(args))
    elif args.list:
        print("models:   " + ", ".join(list_presets("model")) + ", mlp-W0-W1-...-WL")
        print("clusters: " + ", ".join(list_presets("cluster")))
        from thinwire.planner.convergence import shipped

        print("convergence tables (--convergence NAME): " + ", ".join(shipped()))
    else:
        _print(_plan(args))
    return 0

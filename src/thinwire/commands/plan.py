"""``thinwire plan``: predict memory, bytes and step time; search plans; validate; insight.

  thinwire plan --model gpt3-175b --cluster a100-80gb --nodes 8 --tp 8 --pp 8 --sp --recompute selective
  thinwire plan --model gpt3-175b --cluster a100-80gb --nodes 8 --search
  thinwire plan --validate
  thinwire plan --model mlp-784-2048-2048-10 --cluster cpu-1gbe --nodes 8 --crossover
  thinwire plan --model mlp-784-2048-2048-10 --cluster cpu-1gbe --nodes 64 --scaling --out runs/plan
  thinwire plan --calibrate --model mlp-784-512-512-10 --workers 4 --steps 100 --out runs/calibrate
Bad input raises UsageError (the top-level command prints it and exits 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

from thinwire.errors import UsageError
from thinwire.planner.modes import calibrate_mode, crossover_mode, scaling_mode
from thinwire.planner.presets import list_presets, load_cluster, load_model
from thinwire.planner.report import plan_report, prediction_json, search_report
from thinwire.planner.search import search
from thinwire.planner.specs import DTYPE_BYTES, METHODS, RECOMPUTE, ClusterSpec, ModelSpec
from thinwire.planner.step import predict
from thinwire.planner.strategy import StrategySpec
from thinwire.planner.validation import render_validation, step_time_records

_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float:
    """'10gbit', '100Mb/s', '25GB/s', '1.25e9' (bytes/s) -> bytes per second.

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``thinwire plan``."""
    g = parser.add_argument_group("what and where")
    g.add_argument("--model", help="preset name, mlp-W0-W1-...-WL, or FILE.toml")
    g.add_argument(
        "--cluster", help="preset name (a100-80gb, h100, h200, cpu-1gbe, ...) or FILE.toml"
    )
    g.add_argument("--nodes", type=int, help="number of nodes (default: the preset's)")
    g.add_argument("--bandwidth", help="override the inter-node bandwidth per device, e.g. 1gbit")
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
        ("--period", "local SGD: average every H steps"),
        ("--local-steps", "IST: K local steps per round"),
    ):
        s.add_argument(flag, type=int, help=help_)
    s.add_argument("--recompute", choices=RECOMPUTE, default="none")
    s.add_argument("--sp", action="store_true", help="sequence parallelism")
    s.add_argument("--offload", action="store_true", help="optimizer state on the host")
    s.add_argument("--overlap-dp", action="store_true", help="overlap the all-reduce with backward")
    s.add_argument("--dtype", choices=sorted(DTYPE_BYTES), help="default: the cluster's")
    s.add_argument("--accounting", choices=("megatron", "zero"), default="megatron")
    s.add_argument("--optimizer", choices=("adam", "momentum", "sgd"), default="adam")
    s.add_argument("--method", choices=METHODS, default="dp")
    s.add_argument("--compression-ratio", type=float, default=1.0)
    s.add_argument("--codec-passes", type=float, default=4.0, help="compressed DP codec cost")
    s.add_argument("--ist-deployment", choices=("sharded", "central"), default="sharded")
    a = parser.add_argument_group("modes")
    a.add_argument("--search", action="store_true", help="rank all feasible plans by step time")
    a.add_argument("--top", type=int, default=10, help="plans to show with --search")
    a.add_argument(
        "--validate",
        "--report",
        dest="validate",
        action="store_true",
        help="print the validation tables against published runs",
    )
    a.add_argument(
        "--crossover", action="store_true", help="when IST / compressed / local SGD beat DP"
    )
    a.add_argument("--penalty", default="", help="extra-steps factors, e.g. ist=2,localsgd=1.5")
    a.add_argument(
        "--scaling", action="store_true", help="step time and throughput vs workers (PNG)"
    )
    a.add_argument("--max-workers", type=int, default=256)
    a.add_argument("--weak", action="store_true", help="scaling with a fixed per-worker batch")
    a.add_argument("--out", help="directory for --scaling's scaling.png, --calibrate's tables")
    a.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine, run dp / localsgd / ist / dp+topk here and print predicted "
        "against measured (--model mlp-..., --workers, --steps, --micro-batch-size per worker)",
    )
    a.add_argument("--workers", type=int, help="--calibrate: local worker processes (4)")
    a.add_argument("--steps", type=int, help="--calibrate: steps per run, a multiple of 10 (100)")
    a.add_argument("--list", action="store_true", help="list the presets")
    a.add_argument("--json", action="store_true", help="machine-readable output")


def _strategy(args: argparse.Namespace, model: ModelSpec, cluster: ClusterSpec) -> StrategySpec:
    tp, pp = args.tp or 1, args.pp or 1
    n = cluster.devices
    if args.dp is None and n % (tp * pp):
        raise UsageError(
            f"tp*pp = {tp * pp} does not divide the {n} devices; change --tp/--pp or --nodes"
        )
    dp = args.dp or n // (tp * pp)
    b = args.micro_batch_size or 1
    batch = args.global_batch or model.global_batch
    m = args.micro_batches
    if m is None:
        if batch and batch % (b * dp):
            raise UsageError(
                f"global batch {batch} is not a multiple of b*dp = {b * dp}; "
                "set --global-batch or --micro-batches"
            )
        m = max(1, batch // (b * dp)) if batch else 1
    return StrategySpec(
        dp=dp,
        tp=tp,
        pp=pp,
        micro_batch_size=b,
        micro_batches=m,
        interleave=args.interleave or 1,
        zero=args.zero or 0,
        recompute=args.recompute,
        sequence_parallel=args.sp,
        offload=args.offload,
        dtype=args.dtype or "",
        accounting=args.accounting,
        optimizer=args.optimizer,
        overlap_dp=args.overlap_dp,
        method=args.method,
        compression_ratio=args.compression_ratio,
        codec_passes=args.codec_passes,
        period=args.period or 1,
        local_steps=args.local_steps or 1,
        ist_deployment=args.ist_deployment,
    )


def run(args: argparse.Namespace) -> int:
    """Dispatch ``thinwire plan``; returns the exit code."""
    if args.validate:
        if args.json:
            records, summary = step_time_records(load_cluster("a100-80gb"))
            runs = [dataclasses.asdict(r) for r in records]
            print(json.dumps({"summary": summary, "runs": runs}, indent=2))
        else:
            print(render_validation(), end="")
        return 0
    if args.calibrate:
        out = calibrate_mode(args)
        print(json.dumps(out, indent=2, default=str) if isinstance(out, dict) else out, end="")
        return 0
    if args.list:
        print("models:   " + ", ".join(list_presets("model")) + ", mlp-W0-W1-...-WL")
        print("clusters: " + ", ".join(list_presets("cluster")))
        return 0
    if not args.model or not args.cluster:
        raise UsageError("give --model NAME|FILE.toml and --cluster NAME|FILE.toml (see --list)")
    model = load_model(args.model)
    cluster = load_cluster(args.cluster, args.nodes)
    if args.bandwidth:
        cluster = dataclasses.replace(cluster, inter_bandwidth=parse_rate(args.bandwidth))
    if args.search:
        base = _strategy(
            argparse.Namespace(
                **{
                    **vars(args),
                    "dp": None,
                    "tp": None,
                    "pp": None,
                    "micro_batches": 1,
                    "interleave": None,
                }
            ),
            model,
            cluster,
        )
        preds = search(model, cluster, base, args.global_batch or model.global_batch)
        if args.json:
            print(
                json.dumps(
                    [prediction_json(model, cluster, p) for p in preds[: args.top]], indent=2
                )
            )
        else:
            print(search_report(preds, args.top, cluster), end="")
        return 0
    base = _strategy(args, model, cluster)
    if args.crossover or args.scaling:
        out = (
            crossover_mode(args, model, cluster, base)
            if args.crossover
            else scaling_mode(args, model, cluster, base)
        )
        print(
            json.dumps(out, indent=2) if isinstance(out, dict) else out,
            end="" if isinstance(out, str) else "\n",
        )
        return 0
    pred = predict(model, cluster, base)
    if args.json:
        print(json.dumps(prediction_json(model, cluster, pred), indent=2))
    else:
        print(plan_report(model, cluster, pred), end="")
    return 0

"""Readable and JSON forms of the planner's answers (one plan, a search, a crossover)."""

from __future__ import annotations

import math
from typing import Any

from thinwire.planner.render import gib, nbytes, rate, seconds, table
from thinwire.planner.search import why
from thinwire.planner.specs import ClusterSpec, ModelSpec
from thinwire.planner.step import Prediction
from thinwire.planner.strategy import StrategySpec


def method_label(s: StrategySpec) -> str:
    """The method's own short name (``localsgd(H=10)``); empty for the planner's own data parallelism."""
    if not s.method:
        return ""
    from thinwire.planner.methods import resolve

    return resolve(s.method).label


def strategy_text(s: StrategySpec) -> str:
    """Compact one-line form of a strategy."""
    text = (
        f"dp={s.dp} tp={s.tp} pp={s.pp} b={s.micro_batch_size} m={s.micro_batches} "
        f"v={s.interleave} zero={s.zero} recompute={s.recompute} attention={s.attention}"
        f"{' sp' if s.sequence_parallel else ''}{' offload' if s.offload else ''}"
    )
    label = method_label(s)
    return f"{text}{' method=' + label if label else ''}"


def _devices(cluster: ClusterSpec) -> str:
    if cluster.device_count:
        many = "s" if cluster.devices > 1 else ""
        nodes = f"{cluster.nodes} node{'s' if cluster.nodes > 1 else ''}"
        return f"{cluster.devices} device{many} on {nodes} of {cluster.devices_per_node}"
    return f"{cluster.nodes} nodes x {cluster.devices_per_node} = {cluster.devices} devices"


def _bytes_table(p: Prediction) -> str:
    """Bytes per step and device on each kind of link."""
    return table(
        ["link", "bytes/step/device"],
        [
            ["tensor parallel (intra-node)", nbytes(p.traffic.tp)],
            ["pipeline p2p", nbytes(p.traffic.pp)],
            ["data parallel / sync (wire, busiest worker)", nbytes(p.traffic.dp)],
            ["data parallel / sync (payload, mean)", nbytes(p.traffic.dp_payload)],
        ],
        "Bytes",
    )


def plan_report(model: ModelSpec, cluster: ClusterSpec, p: Prediction) -> str:
    """Memory, bytes and step-time breakdown of one plan."""
    mem = p.memory
    fits = "fits" if mem.fits(cluster) else "DOES NOT FIT; try --search, --zero, --recompute, --tp/--pp"
    head = (
        f"model {model.name} ({model.params / 1e9:.3g}B params) on {cluster.name}: "
        f"{_devices(cluster)}\nplan: {strategy_text(p.strategy)}; global batch {p.global_batch}"
    )
    mem_rows = [[k, gib(v)] for k, v in mem.as_dict().items()]
    mem_rows.append(["device capacity", gib(cluster.device_memory)])
    memory = table(["memory per device", "GiB"], mem_rows, f"Memory: {fits}")
    steps = table(
        ["component", "time", "share"],
        [[k, seconds(v), f"{100 * v / p.step_time:.1f}%"]
         for k, v in p.breakdown.as_dict().items()],
        "Step time",
    )
    tail = f"throughput {p.samples_per_s:.4g} samples/s, MFU {100 * p.mfu:.1f}%" + (
        ", compression on" if p.compressed else ""
    )
    return "\n\n".join([head, memory, _bytes_table(p), steps, tail]) + "\n"


_SEARCH_HEAD = ("#", "d", "t", "p", "b", "m", "v", "recomp", "sp", "zero", "GiB", "step s",
                "compute", "tp", "pp", "bubble", "sync", "optim", "MFU%")


def _search_row(i: int, p: Prediction) -> list[object]:
    """One ranked plan: its strategy, memory, step time and breakdown columns."""
    s, bd = p.strategy, p.breakdown
    return [
        i, s.dp, s.tp, s.pp, s.micro_batch_size, s.micro_batches, s.interleave, s.recompute,
        "y" if s.sequence_parallel else "-", s.zero, gib(p.memory.total), f"{p.step_time:.4g}",
        f"{bd.compute:.3g}", f"{bd.tp_comm:.3g}", f"{bd.pp_comm:.3g}", f"{bd.bubble:.3g}",
        f"{bd.dp_comm + bd.codec:.3g}", f"{bd.optimizer + bd.offload:.3g}",
        f"{100 * p.mfu:.1f}",
    ]


def search_report(preds: list[Prediction], top: int, cluster: ClusterSpec) -> str:
    """Ranked feasible plans with their breakdown columns, and why the leaders lead."""
    if not preds:
        return "no feasible plan: nothing fits in device memory; add nodes or lower the batch\n"
    text = table(
        _SEARCH_HEAD,
        [_search_row(i, p) for i, p in enumerate(preds[:top], 1)],
        f"{len(preds)} feasible plans on {cluster.devices} devices, fastest first "
        "(seconds per step; columns after 'step s' are its breakdown)",
    )
    lines = [
        f"#{i} vs #{i + 1}: {why(preds[i - 1], preds[i])} (#{i} minus #{i + 1})"
        for i in range(1, min(top, len(preds) - 1, 3) + 1)
    ]
    return text + "\n\n" + "\n".join(lines) + "\n"


def _beats(w: float) -> str:
    if math.isinf(w):
        return "on all links modelled (800 kb/s to 8 Tb/s)"
    return "on no link modelled (800 kb/s to 8 Tb/s)" if w == 0 else f"below {rate(w)}"


def crossover_report(
    rows: list[list[Any]],
    methods: list[str],
    cross: dict[str, float],
    penalties: dict[str, float],
    cluster: ClusterSpec,
    variants: dict[str, StrategySpec],
) -> str:
    """Step times per link speed and where each method stops beating data parallelism."""
    labels = [method_label(variants[m]) for m in methods]
    text = table(
        ["link", "data parallel s"] + [f"{label} s (x)" for label in labels],
        rows,
        f"Step time per link speed on {cluster.name} ({cluster.nodes} nodes); "
        "(x) = break-even penalty: how many times more steps the method may take and still win;\n"
        "penalty = extra steps to reach the same loss (--penalty; 1 = per-step comparison)",
    )
    lines = [
        f"per step x {penalties.get(m, 1.0):g} (--penalty), {label} is faster than data "
        f"parallel {_beats(cross[m])}"
        for m, label in zip(methods, labels)
    ]
    lines.append("(a per-step comparison, not time to a target: --convergence RUNS|FILE|NAME "
                 "gives each method's measured steps to a target and the winner per link)")
    return text + "\n\n" + "\n".join(lines) + "\n"


def prediction_json(model: ModelSpec, cluster: ClusterSpec, p: Prediction) -> dict[str, Any]:
    """Machine-readable form of one plan."""
    return {
        "model": model.name,
        "cluster": cluster.name,
        "nodes": cluster.nodes,
        "strategy": {k: getattr(p.strategy, k) for k in p.strategy.__dataclass_fields__},
        "global_batch": p.global_batch,
        "memory_bytes": p.memory.as_dict(),
        "fits": p.memory.fits(cluster),
        "traffic_bytes": p.traffic.as_dict(),
        "step_seconds": p.breakdown.as_dict(),
        "samples_per_s": p.samples_per_s,
        "mfu": p.mfu,
        "compressed": p.compressed,
    }

"""Fault tolerance measured on the thin-wire testbed: time lost per failure, quality, bytes.

    PYTHONPATH=src python benchmarks/ft_thin_wire.py --model mlp \\
        --methods diloco,localsgd,ist --recovery quorum,restart --scenarios none,one,rejoin \\
        --out runs/ft_thin_wire

Every run is ``--workers`` (4) workers in their own network namespaces joined at ``--link``
(100 Mbit/s) by :mod:`thinwire.testbed` (torn down after each run; ``--timeout`` bounds the
whole bench). Faults come from outside (:mod:`thinwire.testbed.faults`): the bench SIGKILLs a
worker once the job's logged step reaches the fault's step, and for ``rejoin`` starts it again
later. Scenarios (``--kill-at A,B``, ``--join-at J``):

- ``none``: uninterrupted; ``one``: worker 3 killed at step A; ``two``: worker 3 at A and
  worker 2 at B; ``rejoin``: worker 3 killed at A and started again at J.

Recoveries:

- ``quorum``: ``--runtime.fault_tolerance torchft --runtime.min_workers 2``, no restart: the
  survivors go on, a rejoining worker recovers the live state from a peer (``recovery`` bytes);
- ``restart``: ``--runtime.max_restarts F`` (F = the scenario's failures) with
  ``--run.checkpoint_every --checkpoint-every``: every worker restarts from the newest
  checkpoint (read from this machine's disk: no recovery bytes cross the link); ``rejoin``
  is not run (a restart brings every worker back: it is ``one``);
- ``torchft``: torchft's own ``DiLoCo`` wrapper (:mod:`ft_thin_wire_torchft`, diloco only).

Per run one line goes to ``OUT/results.jsonl`` (a failed run's with its one-line error; a run
already there is not run again: delete the line to rerun it); at the end, and with ``--table`` alone, the table of every line:
job time (first worker start to last exit, measured), training time (the lowest surviving
worker's, evaluation excluded), job time minus the uninterrupted run's of the same method and
recovery, over the failures (start-up noise and, on a shared machine, the cores a lost worker
frees are in it), the time lost at each fault measured directly (:func:`stalls`), final metric and its change against
that run, bytes: wire (kernel counters of every veth, everything included) and ledger (wire
bytes sent of the workers whose ledger was written: a killed worker writes none), with the
ledger's ``recovery`` bytes apart.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

MODELS: dict[str, dict[str, Any]] = {
    "mlp": {"data.name": "fashion-mnist", "model.name": "mlp", "model.hidden": "1024,1024",
            "train.batch_size": 32, "train.lr": 0.05},
    "gpt": {"data.name": "tinyshakespeare", "model.name": "gpt", "model.n_layer": 2,
            "model.d_model": 128, "train.batch_size": 16, "train.lr": 0.003,
            "train.optimizer": "adamw"},
}
METHODS: dict[str, dict[str, Any]] = {
    "diloco": {"method.name": "diloco", "method.period": 20, "method.fragments": 2,
               "method.delay": 1, "method.compressor": "fp4:exchange=scatter"},
    "localsgd": {"method.name": "localsgd", "method.period": 20},
    "ist": {"method.name": "ist", "method.deployment": "central", "method.local_steps": 20},
}
SCENARIOS = ("none", "one", "two", "rejoin")
RECOVERIES = ("quorum", "restart", "torchft")


def faults_of(scenario: str, a: argparse.Namespace) -> str:
    k1, k2 = a.kill_at
    w = a.workers - 1
    return {"none": "", "one": f"kill:{w}@{k1}", "two": f"kill:{w}@{k1},kill:{w - 1}@{k2}",
            "rejoin": f"kill:{w}@{k1},join:{w}@{a.join_at}"}[scenario]


def config_of(model: str, method: str, recovery: str, scenario: str, a: argparse.Namespace,
              failures: int) -> Any:
    from thinwire import config as config_mod

    over: dict[str, Any] = {**MODELS[model], **METHODS[method], "train.steps": a.steps,
                            "train.eval_every": a.steps, "train.log_every": 1,
                            "runtime.workers": a.workers, "runtime.threads": 1,
                            "runtime.timeout_s": a.worker_timeout, "run.progress": False,
                            "run.out": str(a.out / model),
                            "run.name": f"{method}-{recovery}-{scenario}"}
    if recovery == "quorum":
        over.update({"runtime.fault_tolerance": "torchft", "runtime.min_workers": 2})
    else:
        over.update({"run.checkpoint_every": a.checkpoint_every, "runtime.max_restarts": failures})
    for item in a.set:
        k, v = item.split("=", 1)
        over[k] = v
    return config_mod.load(None, over)


def ledger_bytes(run_dir: Path) -> tuple[int, int, int]:
    """(wire bytes sent, recovery bytes sent, ledger files) over the ledgers written."""
    sent = recovery = files = 0
    for p in sorted(run_dir.glob("ledger.rank*.json")):
        data = json.loads(p.read_text())
        files += 1
        sent += int(data.get("totals_with_control", data["totals"])["sent_bytes"])
        recovery += sum(int(v["sent"]) for k, v in data["by_op"].items()
                        if k.endswith(":recovery"))
    return sent, recovery, files


def run_one(model: str, method: str, recovery: str, scenario: str,
            a: argparse.Namespace, deadline: float) -> dict[str, Any]:
    from thinwire.run import run_directory
    from thinwire.testbed.faults import parse_faults, run_quorum_in_testbed, run_restart_in_testbed
    from thinwire.testbed.rates import parse_links

    link = parse_links(a.link)[0]
    faults = parse_faults(faults_of(scenario, a), a.workers)
    failures = sum(f.action == "kill" for f in faults)
    cfg = config_of(model, method, recovery, scenario, a, failures)
    shutil.rmtree(Path(cfg.run.out) / cfg.run_name, ignore_errors=True)  # a failed try's
    with run_directory(cfg) as rd:
        if recovery == "quorum":
            wire = run_quorum_in_testbed(rd.path, link, 1, deadline, faults, workers=a.workers,
                                         min_workers=2)
        else:
            wire = run_restart_in_testbed(rd.path, link, 1, deadline, faults, workers=a.workers,
                                          max_restarts=failures)
    summary = json.loads((rd.final / "summary.json").read_text())
    sent, rec, files = ledger_bytes(rd.final)
    return {"model": model, "method": method, "recovery": recovery, "scenario": scenario,
            "label": summary.get("label"), "failures": failures, "job_s": wire.elapsed_s,
            "train_s": float(summary["wall_s"]), "metric": summary["metric"],
            "final": float(summary["final"][summary["metric"]]), "wire_tx": sum(wire.tx_bytes),
            "ledger_sent": sent, "ledger_files": files, "recovery_sent": rec,
            "attempts": wire.attempts, "fired": wire.fired, "exits": wire.exits,
            "params": summary.get("params"), "steps": a.steps, "link": link.label,
            "uptime": os.getloadavg(), "run_dir": str(rd.final)}


def stalls(row: dict[str, Any]) -> str:
    """The time lost at each fault, seconds. Restart: from the kill until the restarted job
    is back at the step it was killed at (restart, checkpoint load, steps redone). Quorum and
    torchft: the longest gaps of worker 0's training clock, one per fault (a failure's
    heartbeat timeout and refused round, a join's recovery), less its median step."""
    faults = len(row["fired"])
    if row["recovery"] == "restart":
        back = [f"{f['back_s'] - f['at_s']:.1f}" for f in row["fired"] if "back_s" in f]
        return ", ".join(back) or "-"
    path = Path(row["run_dir"]) / "worker0" / "metrics.jsonl"
    if not faults or not path.exists():
        return "-"
    walls = [float(r["wall_s"]) for r in map(json.loads, path.read_text().splitlines())
             if r.get("kind", "train") == "train"]
    gaps = sorted(b - a for a, b in zip(walls, walls[1:]))
    if not gaps:
        return "-"
    median = gaps[len(gaps) // 2]
    return ", ".join(f"{g - median:.1f}" for g in gaps[::-1][:faults])


def fmt_mb(b: float) -> str:
    return f"{b / 1e6:.1f} MB"


def table(rows: list[dict[str, Any]]) -> str:
    base = {(r["model"], r["method"], r["recovery"]): r for r in rows
            if r["scenario"] == "none" and "error" not in r}
    out = ["| model | method | recovery | scenario | job s | train s | job s vs uninterrupted / failure "
           "| lost at each fault, s | final | vs uninterrupted | wire tx (kernel) | ledger sent (files) "
           "| recovery (ledger) | faults fired at step | load |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    order = [list(MODELS), list(METHODS), list(RECOVERIES), list(SCENARIOS)]
    rows = sorted(rows, key=lambda r: [o.index(r[k]) for o, k in
                                       zip(order, ("model", "method", "recovery", "scenario"))])
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['method']} | {r['recovery']} | {r['scenario']} "
                       f"| failed: {r['error'][:160]} |")
            continue
        b = base.get((r["model"], r["method"], r["recovery"]))
        lost = "-"
        if b is not None and r["failures"]:
            lost = f"{(r['job_s'] - b['job_s']) / r['failures']:.1f}"
        delta = f"{r['final'] - b['final']:+.4f}" if b is not None and b is not r else "-"
        fired = ", ".join(f"{f['action']} {f['worker']}@{f['at_step']}" for f in r["fired"]) or "-"
        if r.get("attempts", 1) > 1:
            fired += f" ({r['attempts']} attempts)"
        out.append(f"| {r['model']} | {r['method']} | {r['recovery']} | {r['scenario']} "
                   f"| {r['job_s']:.1f} | {r['train_s']:.1f} | {lost} | {stalls(r)} | {r['final']:.4f} "
                   f"| {delta} | {fmt_mb(r['wire_tx'])} | {fmt_mb(r['ledger_sent'])} "
                   f"({r['ledger_files']}) | {fmt_mb(r['recovery_sent'])} | {fired} "
                   f"| {r['uptime'][0]:.1f} |")
    return "\n".join(out)


def load_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def plan(a: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    out = []
    for model in a.model:
        for method in a.methods:
            for recovery in a.recovery:
                if recovery == "torchft" and method != "diloco":
                    continue
                for scenario in a.scenarios:
                    if recovery == "restart" and scenario == "rejoin":
                        continue
                    out.append((model, method, recovery, scenario))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=lambda s: s.split(","), default=["mlp"])
    ap.add_argument("--methods", type=lambda s: s.split(","), default=["diloco", "localsgd", "ist"])
    ap.add_argument("--recovery", type=lambda s: s.split(","), default=["quorum", "restart"])
    ap.add_argument("--scenarios", type=lambda s: s.split(","), default=["none", "one", "rejoin"])
    ap.add_argument("--link", default="100mbit")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--kill-at", type=lambda s: [int(x) for x in s.split(",")], default=[150, 350])
    ap.add_argument("--join-at", type=int, default=200)
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--worker-timeout", type=float, default=30.0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--timeout", type=float, default=3600.0, help="the whole bench, seconds")
    ap.add_argument("--out", type=Path, default=Path("runs/ft_thin_wire"))
    ap.add_argument("--table", action="store_true", help="print the table of OUT and exit")
    a = ap.parse_args(argv)
    bad = [x for x in a.model if x not in MODELS] + [x for x in a.methods if x not in METHODS] \
        + [x for x in a.recovery if x not in RECOVERIES] + [x for x in a.scenarios
                                                            if x not in SCENARIOS]
    if bad:
        ap.error(f"unknown {', '.join(bad)}")
    results = a.out / "results.jsonl"
    if not a.table:
        bench(a, results)
    print(table(load_rows(results)))
    return 0


def bench(a: argparse.Namespace, results: Path) -> None:
    from thinwire.testbed.bench import interrupts_raise
    from thinwire.testbed.netns import cleanup_stale
    from thinwire.testbed.run import BenchFailed

    os.environ.setdefault("RUST_LOG", "error")
    a.out.mkdir(parents=True, exist_ok=True)
    done = {(r["model"], r["method"], r["recovery"], r["scenario"]) for r in load_rows(results)}
    deadline = time.monotonic() + a.timeout
    cleanup_stale()
    with interrupts_raise():
        for key in plan(a):
            if key in done:
                continue
            print(f"== {' '.join(key)} ({os.getloadavg()[0]:.1f} load)", flush=True)
            try:
                if key[2] == "torchft":
                    from ft_thin_wire_torchft import run_torchft

                    row = run_torchft(key, a, deadline)
                else:
                    row = run_one(*key, a, deadline)
            except BenchFailed as exc:
                print(f"   failed: {exc}", flush=True)
                if time.monotonic() > deadline:
                    break
                row = {**dict(zip(("model", "method", "recovery", "scenario"), key)),
                       "error": str(exc), "uptime": os.getloadavg()}
            with open(results, "a") as f:
                f.write(json.dumps(row) + "\n")
            if "error" in row:
                continue
            print(f"   job {row['job_s']:.1f} s, final {row['final']:.4f}, wire "
                  f"{fmt_mb(row['wire_tx'])}, recovery {fmt_mb(row['recovery_sent'])}",
                  flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    raise SystemExit(main())

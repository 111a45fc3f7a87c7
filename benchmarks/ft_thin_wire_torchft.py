"""torchft's own ``DiLoCo`` on the thin-wire testbed, under the faults of ft_thin_wire.py.

Each worker is one torchft replica group in its own namespace (the run's lighthouse on the
bridge, :func:`thinwire.testbed.faults.run_quorum_in_testbed`), running
``torchft.local_sgd.DiLoCo`` as benchmarks/torchft_side_by_side.py does (its model, fragments,
outer optimizer and data come from there: worker i reads shard i of the run's config):

1. a ``torchft.manager.Manager`` (synchronous quorum, ``min_replica_size`` 2) whose store,
   RPC server and gloo group are on the worker's veth address; recovery over torchft's
   ``PGTransport`` (the gloo group; its default HTTP transport advertises the machine's host
   name, which a namespace cannot reach), as thinwire's replicas do;
2. the loop runs until the quorum committed ``steps / (H / P)`` fragment syncs; the batch of
   each step is a function of the committed syncs and the local step (a joiner, healed from a
   peer by torchft at its first quorum, takes the job's position from there);
3. every step is logged to ``RUN/workerI/metrics.jsonl`` (the bench's kill trigger reads it),
   the final model evaluated on the test set into ``RUN/workerI/summary.json``.

torchft's DiLoCo has no fp4 codec nor scattered exchange: it sends fp32 pseudo-gradients (the
same Streaming schedule: fragments, delay), so its bytes are not comparable with thinwire's fp4
row, only its recovery. Bytes: the kernel's counters only (torchft keeps no ledger).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def run_torchft(key: tuple[str, str, str, str], a: Any, deadline: float) -> dict[str, Any]:
    """One row of ft_thin_wire.py's table for torchft's DiLoCo (``key``: model, method,
    recovery, scenario)."""
    from ft_thin_wire import config_of, faults_of

    from thinwire import config as config_mod
    from thinwire.testbed.faults import parse_faults, run_quorum_in_testbed
    from thinwire.testbed.rates import parse_links

    model, method, _, scenario = key
    link = parse_links(a.link)[0]
    faults = parse_faults(faults_of(scenario, a), a.workers)
    cfg = config_of(model, method, "quorum", scenario, a, 0)
    run_dir = a.out / model / f"{method}-torchft-{scenario}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(config_mod.dumps(cfg))
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                          os.environ.get("PYTHONPATH", "")])}
    wire = run_quorum_in_testbed(run_dir, link, 1, deadline, faults, workers=a.workers,
                                 min_workers=2, env=env, module="ft_thin_wire_torchft",
                                 summarise=False)
    survivors = sorted(r for r, c in wire.exits.items() if c == 0)
    summary = json.loads((run_dir / f"worker{survivors[0]}" / "summary.json").read_text())
    return {"model": model, "method": method, "recovery": "torchft", "scenario": scenario,
            "label": "torchft DiLoCo (fp32, same H, P, tau)",
            "failures": sum(f.action == "kill" for f in faults), "job_s": wire.elapsed_s,
            "train_s": summary["wall_s"], "metric": summary["metric"],
            "final": summary["final"][summary["metric"]], "wire_tx": sum(wire.tx_bytes),
            "ledger_sent": 0, "ledger_files": 0, "recovery_sent": 0, "attempts": 1,
            "fired": wire.fired, "exits": wire.exits, "steps": a.steps, "link": link.label,
            "uptime": os.getloadavg(), "run_dir": str(run_dir), "commits": summary["commits"]}


def _manager(cfg: Any, index: int, holder: dict[str, Any]) -> tuple[Any, Any]:
    import torch
    from torch.distributed import TCPStore
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from thinwire.runtime.ft import _manager_server_on
    from thinwire.worker import FT_HOST_ENV, FT_LIGHTHOUSE_ENV

    host, t = os.environ[FT_HOST_ENV], timedelta(seconds=cfg.runtime.timeout_s)
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)

    def load(sd: dict[str, Any]) -> None:
        holder["model"].load_state_dict(sd["model"])
        holder["inner"].load_state_dict(sd["inner"])

    def save() -> dict[str, Any]:
        return {"model": holder["model"].state_dict(), "inner": holder["inner"].state_dict()}

    torch.set_num_threads(1)
    pg = ProcessGroupGloo(timeout=t)
    with _manager_server_on(host):  # its RPC server on the veth address, as thinwire's
        manager = Manager(
            pg=pg, checkpoint_transport=PGTransport(pg, timeout=t, device=torch.device("cpu")), load_state_dict=load, state_dict=save,
            min_replica_size=cfg.runtime.min_workers, use_async_quorum=False,
            replica_id=f"replica{index}", store_addr=host, store_port=store.port, rank=0,
            world_size=1, lighthouse_addr=os.environ[FT_LIGHTHOUSE_ENV], port=0, hostname=host,
            init_sync=False, timeout=t, quorum_timeout=t, connect_timeout=t)
    return manager, store


def replica(config_path: Path) -> int:
    """Steps 1-3 of the module docstring for worker ``THINWIRE_FT_WORKER``."""
    import torch
    from torchft.local_sgd import DiLoCo as FTDiLoCo
    from torchft_side_by_side import _fragments

    from thinwire import config as config_mod
    from thinwire.builders import build_model, load_data, make_stream
    from thinwire.data.task import eval_rows, task_for
    from thinwire.worker import FT_WORKER_ENV

    cfg = config_mod.load(config_path)
    run_dir, index = config_path.parent, int(os.environ[FT_WORKER_ENV])
    m = cfg.method.options
    ds = load_data(cfg)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, ds)
    inner = torch.optim.SGD(model.parameters(), lr=cfg.train.lr)
    holder = {"model": model, "inner": inner}
    manager, _store = _manager(cfg, index, holder)
    frags = _fragments(model, m.fragments)
    outers = [torch.optim.SGD(f.parameters(), lr=m.outer_lr, momentum=m.outer_momentum,
                              nesterov=m.outer_momentum > 0) for f in frags]
    per_sync = m.period // m.fragments
    syncs = cfg.train.steps // per_sync
    stream, loss_fn = make_stream(cfg, ds, index, cfg.runtime.workers), task_for(ds).loss
    out = run_dir / f"worker{index}"
    t0 = time.perf_counter()
    wrapper = FTDiLoCo(manager, frags, inner, outers if len(frags) > 1 else outers[0],
                       m.period, fragment_sync_delay=m.delay)
    with wrapper, open(out / "metrics.jsonl", "a") as log:
        while manager.current_step() < syncs:
            s = manager.current_step() * per_sync + wrapper._local_step
            x, y = stream.batch(s)
            inner.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            inner.step()
            log.write(json.dumps({"step": s + 1, "wall_s": time.perf_counter() - t0}) + "\n")
            log.flush()
    wall = time.perf_counter() - t0
    task = task_for(ds)
    result = task.evaluate(model, ds.x_test, ds.y_test, device=torch.device("cpu"),
                           batch_size=eval_rows(ds.num_classes))
    (out / "summary.json").write_text(json.dumps({
        "metric": task.metric, "final": dict(result), "wall_s": wall,
        "commits": manager.current_step()}))
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    from thinwire.worker import die_with_parent

    die_with_parent()
    sys.path.insert(0, str(Path(__file__).parent))
    raise SystemExit(replica(Path(sys.argv[1])))

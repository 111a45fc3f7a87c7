"""``--runtime.fault_tolerance torchft`` through the trainer: a worker SIGKILLed mid-run, a
worker joining later, too few workers left. Each job is :func:`thinwire.run.run_replicas`
(the launcher's lighthouse on 127.0.0.1, one process per worker) with faults planted by
tests/reliability/ft_worker.py; every process is waited for with a bound and none outlives
its job. The final models are checked against a one-process reference applying the method's
rule to the live sets the survivors recorded."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import FT_HEARTBEAT_MS

pytest.importorskip("torchft")
os.environ.setdefault("RUST_LOG", "error")

from method_cases import MLP  # noqa: E402

from thinwire import checkpoint, rundir  # noqa: E402
from thinwire import config as config_mod  # noqa: E402
from thinwire import launch as launch_mod  # noqa: E402
from thinwire.builders import build_model, load_data, make_stream  # noqa: E402
from thinwire.data.task import task_for  # noqa: E402
from thinwire.errors import RunFailed  # noqa: E402
from thinwire.launch import worker_pids  # noqa: E402
from thinwire.run import run_replicas  # noqa: E402
from thinwire.strategies.base import flat_params, load_flat  # noqa: E402

HERE = Path(__file__).parent
STEPS, H = 20, 5
pytestmark = pytest.mark.timeout(120)


def make_run(root: Path, method: dict[str, str], workers: int, min_workers: int,
             **extra: str) -> tuple[Path, Any]:
    over = {**MLP, **method, "train.batch_size": "16", "train.steps": str(STEPS),
            "train.eval_every": str(STEPS), "train.log_every": "5", "run.progress": "false",
            "runtime.workers": str(workers), "runtime.fault_tolerance": "torchft",
            "runtime.min_workers": str(min_workers), "runtime.timeout_s": "8",
            "run.out": str(root), "run.name": "ft", **extra}
    cfg = config_mod.load(None, over)
    run = root / "ft"
    run.mkdir(parents=True)
    rundir.write_text(run / "config.toml", config_mod.dumps(cfg))
    return run, cfg


def run_job(run: Path, cfg: Any, **faults: str) -> dict[str, Any]:
    """The job through :func:`thinwire.run.run_replicas`, its lighthouse started with the
    tests' heartbeat timeout (``harness.FT_HEARTBEAT_MS``)."""
    env = {f"THINWIRE_TEST_FT_{k.upper()}": v for k, v in faults.items()}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    launcher = launch_mod.launch_replicas
    launch_mod.launch_replicas = functools.partial(launcher, heartbeat_ms=FT_HEARTBEAT_MS)
    try:
        return run_replicas(run, cfg, env=env, module="ft_worker")
    finally:  # no orphan, however the job ended
        launch_mod.launch_replicas = launcher
        assert worker_pids(os.getpid(), "ft_worker") == []


def final_params(run: Path, worker: int, cfg: Any) -> list[torch.Tensor]:
    """The parameters of a worker's exported model (its batch-norm statistics are its own:
    recalibrated on its shard)."""
    state = torch.load(run / f"worker{worker}" / "model.pt")
    return [state[n] for n, _ in build_model(cfg, load_data(cfg)).named_parameters()]


def reference(cfg: Any, rounds: list[dict[str, Any]], outer: bool,
              forget_outer_at: int = -1) -> list[torch.Tensor]:
    """The method's rule on the recorded live sets, one process: every kept outer step at
    step s, each live worker w trains steps s-H .. s-1 on its own shard from the shared model
    (plain SGD, no optimizer state), then the models (localsgd) or the pseudo-gradients with
    an outer Nesterov step (diloco: lr 0.7, momentum 0.9) are averaged over the live set; a
    refused outer step changes nothing. ``forget_outer_at``: the outer momentum starts afresh
    after that step (what a resume that lost the outer state would do)."""
    ds = load_data(cfg)
    loss = task_for(ds).loss
    model = build_model(cfg, ds)
    streams = {w: make_stream(cfg, ds, w, cfg.runtime.workers) for w in range(cfg.runtime.workers)}
    theta = flat_params(model).clone()
    outer_opt = None
    if outer:
        g = torch.nn.Parameter(theta.clone())
        outer_opt = torch.optim.SGD([g], lr=0.7, momentum=0.9, nesterov=True)
    for r in rounds:
        if not r["kept"]:
            continue
        ends = []
        for w in r["live"]:
            load_flat(model, theta)
            opt = torch.optim.SGD(model.parameters(), lr=cfg.train.lr)
            for s in range(r["step"] - H, r["step"]):
                x, y = streams[w].batch(s)
                opt.zero_grad()
                loss(model(x), y).backward()
                opt.step()
            ends.append(flat_params(model).clone())
        total = ends[0].clone()
        for e in ends[1:]:
            total += e
        if outer_opt is None:
            theta = total / len(ends)
        else:
            delta = torch.zeros_like(theta)
            for e in ends:
                delta += theta - e
            g = outer_opt.param_groups[0]["params"][0]
            with torch.no_grad():
                g.copy_(theta)
            g.grad = delta / len(ends)
            outer_opt.step()
            theta = g.detach().clone()
            if r["step"] == forget_outer_at:
                outer_opt.state.clear()
    load_flat(model, theta)
    return [p.detach().clone() for p in model.parameters()]


def predicted_recovery(cfg: Any) -> tuple[float, int]:
    """The planner's recovery bytes of the run's method on its model (its buffers counted),
    and the number of tensors the joiner receives (the method's ``copies`` of the parameter
    tensors, and the buffers)."""
    from thinwire.planner.failure import recovery_bytes
    from thinwire.strategies import METHODS

    model = build_model(cfg, load_data(cfg))
    params = [p for p in model.parameters()]
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    entry = METHODS.get(cfg.method.name)
    assert entry.recovery is not None
    rec = entry.recovery(cfg.method.options)
    return (recovery_bytes(rec, sum(p.numel() for p in params), len(params), "sgd", buffers),
            round(rec.copies * len(params)) + len(list(model.buffers())))


def test_localsgd_survives_a_worker_killed_mid_run(tmp_path: Path) -> None:
    """3 workers, min_workers 2; worker 2 SIGKILLs itself inside step 7 (its round's quorum
    formed): the outer step at 10 is refused by every survivor (the round's steps are lost),
    the next quorum is the two survivors, and they finish with no restart. The summary names
    worker 2, lost at the outer step of 10; the survivors end equal bit for bit, and equal to
    the reference on the recorded live sets within 1e-6 (gloo sums the 3 models of the first
    outer step in its own order, an ulp apart at most; later sums have 2 addends, exact in any
    order), while losing the worker moves the result by more than 1e-3 (checked)."""
    run, cfg = make_run(tmp_path, {"method.name": "localsgd", "method.period": str(H)}, 3, 2)
    summary = run_job(run, cfg, start="0,1,2", kill="2:7")
    ft = summary["fault_tolerance"]
    assert ft["survivors"] == [0, 1]
    assert ft["lost"] == [{"worker": 2, "step": 10, "ended": "killed by SIGKILL"}], ft
    rounds = ft["outer_steps"]
    assert [(r["step"], r["live"], r["kept"]) for r in rounds] == [
        (5, [0, 1, 2], True), (10, [0, 1, 2], False), (15, [0, 1], True), (20, [0, 1], True)]
    a, b = final_params(run, 0, cfg), final_params(run, 1, cfg)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    ref = reference(cfg, rounds, outer=False)
    for x, y in zip(a, ref):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
    never_lost = reference(cfg, [{**r, "live": [0, 1, 2], "kept": True} for r in rounds],
                           outer=False)
    assert max((x - y).abs().max().item() for x, y in zip(ref, never_lost)) > 1e-3


def test_diloco_loses_a_worker_and_one_joins(tmp_path: Path) -> None:
    """3 workers, min_workers 1: worker 1 is held back, worker 2 SIGKILLs itself inside step 7;
    worker 0 goes on alone, and worker 1 starts once worker 0 reached step 10 and joins the
    round starting at 15 (worker 0 waits there until it is heartbeating). The joiner recovers
    worker 0's state (model, outer momentum, step) over the quorum, in the ledger's
    ``recovery`` kind (every tensor the planner prices, plus torchft's metadata), and ends
    equal to it bit for bit; both equal the reference on the
    recorded live sets bit for bit (every sum has 1 or 2 addends: exact in any order)."""
    run, cfg = make_run(tmp_path, {"method.name": "diloco", "method.period": str(H)}, 3, 1)
    summary = run_job(run, cfg, start="0,2", kill="2:7", join="1:10:15")
    ft = summary["fault_tolerance"]
    assert ft["survivors"] == [0, 1] and [x["worker"] for x in ft["lost"]] == [2], ft
    rounds = ft["outer_steps"]
    assert [(r["step"], r["live"], r["kept"]) for r in rounds] == [
        (5, [0, 2], True), (10, [0, 2], False), (15, [0], True), (20, [0, 1], True)]
    joiner = json.loads((run / "worker1" / "summary.json").read_text())["fault_tolerance"]
    assert joiner["joined_at"] == 15 and joiner["recoveries"] == 1
    got = json.loads((run / "ledger.rank1.json").read_text())["by_op"]["recv:recovery"]
    sent = json.loads((run / "ledger.rank0.json").read_text())["by_op"]["send:recovery"]
    assert got["recv"] == sent["sent"] > 0, (got, sent)
    # the planner's recovery bytes (thinwire.planner.failure, from diloco's Recovery): every
    # tensor the joiner received, exactly; beyond them torchft sends an 8-byte length and the
    # pickled metadata (each tensor's path, dtype, shape; the manager's step: 4.7 kB here)
    predicted, tensors = predicted_recovery(cfg)
    assert got["calls"] == 2 + tensors, (got, tensors)
    assert 0 < got["recv"] - predicted - 8 < 8192, (got, predicted)
    a, b = final_params(run, 0, cfg), final_params(run, 1, cfg)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    ref = reference(cfg, rounds, outer=True)
    assert all(torch.equal(x, y) for x, y in zip(a, ref)), \
        max((x - y).abs().max().item() for x, y in zip(a, ref))


@pytest.mark.timeout(240)  # two jobs
def test_a_stopped_run_resumes_with_the_option_on(tmp_path: Path) -> None:
    """DiLoCo, 2 workers: a job of 10 steps (its last checkpoint written by the quorum's rank
    0 alone: the shared model, theta_g, the outer momentum, its inner optimizer), then the same
    run resumed to 20 steps with ``--runtime.fault_tolerance torchft`` still on: every worker
    loads that checkpoint and the quorum's clock goes on from step 10 (the outer steps at 15
    and 20 only); both workers end equal to each other and to the uninterrupted run's rule on
    the same live sets, bit for bit (every sum has 2 addends; the workers and the reference
    compute on one thread each, so their matrix products sum in the same order), while a
    resume that lost the outer momentum would move the result by more than 1e-3 (checked)."""
    over = {"method.name": "diloco", "method.period": str(H)}
    run, cfg = make_run(tmp_path, over, 2, 2, **{"train.steps": "10", "train.eval_every": "10",
                                                "run.checkpoint_every": "10",
                                                "runtime.threads": "1"})
    run_job(run, cfg)
    assert checkpoint.complete_steps(run) == [10]
    for marker in run.glob("worker*/ready"):
        marker.unlink()
    cfg = config_mod.load(run / "config.toml", {"train.steps": str(STEPS),
                                                "train.eval_every": str(STEPS),
                                                "run.resume": "true"})
    rundir.write_text(run / "config.toml", config_mod.dumps(cfg))
    ft = run_job(run, cfg)["fault_tolerance"]
    assert ft["survivors"] == [0, 1] and ft["lost"] == [], ft
    assert [(r["step"], r["live"], r["kept"]) for r in ft["outer_steps"]] == [
        (15, [0, 1], True), (20, [0, 1], True)]
    a, b = final_params(run, 0, cfg), final_params(run, 1, cfg)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    rounds = [{"step": s, "live": [0, 1], "kept": True} for s in (5, 10, 15, 20)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' (runtime.threads 1)
    try:
        ref = reference(cfg, rounds, outer=True)
        forgot = reference(cfg, rounds, outer=True, forget_outer_at=10)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(x, y) for x, y in zip(a, ref)), \
        max((x - y).abs().max().item() for x, y in zip(a, ref))
    assert max((x - y).abs().max().item() for x, y in zip(ref, forgot)) > 1e-3


def test_streaming_diloco_with_fp4_scatter_survives_a_worker_killed(tmp_path: Path) -> None:
    """Streaming DiLoCo (2 fragments, overlap 2, alpha 0.5, 4-bit outer gradients exchanged by
    a quantised reduce-scatter and all-gather: all-to-alls over the quorum), 3 workers, worker
    2 killed inside step 7: fragment 1's outer step at 10 (its exchange started at 8) is
    refused, the survivors go on; their shared state (theta_g, the outer momentum, the rounds)
    is equal bit for bit at the end, since each decodes the same payloads (the local models
    differ by design: alpha keeps half of each worker's own)."""
    run, cfg = make_run(tmp_path, {"method.name": "diloco", "method.period": "10",
                                   "method.fragments": "2", "method.delay": "2",
                                   "method.alpha": "0.5",
                                   "method.compressor": "fp4:exchange=scatter"}, 3, 2)
    summary = run_job(run, cfg, start="0,1,2", kill="2:7")
    ft = summary["fault_tolerance"]
    assert ft["survivors"] == [0, 1] and ft["lost"][0]["worker"] == 2, ft
    assert [(r["step"], r["live"], r["kept"]) for r in ft["outer_steps"]] == [
        (5, [0, 1, 2], True), (10, [0, 1, 2], False), (15, [0, 1], True), (20, [0, 1], True)]
    a, b = (torch.load(run / f"worker{i}" / "wrapper.pt") for i in (0, 1))
    assert a["rounds"] == b["rounds"] == [2, 1]  # fragment 1's refused step is not counted
    assert all(torch.equal(x, y) for x, y in zip(a["global"], b["global"]))
    for k, v in a["outer"]["state"].items():
        assert torch.equal(v["momentum_buffer"], b["outer"]["state"][k]["momentum_buffer"])
    led = json.loads((run / "ledger.rank0.json").read_text())["by_op"]
    assert led["all_to_all:average"]["calls"] > 0


def test_demo_survives_a_worker_killed_mid_step(tmp_path: Path) -> None:
    """DeMo (every step an outer step), 3 workers, 10 steps, worker 2 killed inside step 4:
    that step is applied by no survivor (their momenta put back), the survivors go on as two,
    and their models are equal bit for bit (each applies the sign of the same decoded mean)."""
    run, cfg = make_run(tmp_path, {"method.name": "demo", "method.topk": "4",
                                   "method.chunk": "8"}, 3, 2,
                        **{"train.steps": "10", "train.eval_every": "10"})
    summary = run_job(run, cfg, start="0,1,2", kill="2:4")
    ft = summary["fault_tolerance"]
    assert ft["lost"] == [{"worker": 2, "step": 5, "ended": "killed by SIGKILL"}], ft
    steps = [(r["step"], r["live"], r["kept"]) for r in ft["outer_steps"]]
    assert steps == ([(s, [0, 1, 2], True) for s in range(1, 5)] + [(5, [0, 1, 2], False)]
                     + [(s, [0, 1], True) for s in range(6, 11)]), steps
    a, b = final_params(run, 0, cfg), final_params(run, 1, cfg)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_too_few_workers_left_ends_in_one_line_with_the_checkpoint_intact(
        tmp_path: Path) -> None:
    """SparseLoCo, 2 workers, min_workers 2, a checkpoint every 5 steps: worker 1 is killed
    inside step 7;
    worker 0 refuses the outer step of 10 (its round's steps are lost: the checkpoint of step 10
    holds the model of step 5), its next quorum cannot form within runtime.timeout_s (4 s here:
    waited in full), and the job ends with one line naming min_workers; both checkpoints are
    complete and load; no worker is left."""
    run, cfg = make_run(tmp_path, {"method.name": "sparseloco", "method.period": str(H),
                                   "method.chunk": "64", "method.topk": "8"}, 2, 2,
                        **{"run.checkpoint_every": str(H), "runtime.timeout_s": "4"})
    with pytest.raises(RunFailed) as info:
        run_job(run, cfg, start="0,1", kill="1:7")
    msg = str(info.value)
    assert "\n" not in msg and "fault tolerance:" in msg and "min_workers=2" in msg, msg
    assert checkpoint.complete_steps(run) == [5, 10]
    five, ten = (checkpoint.load_rank(run, s, 0, 1) for s in (5, 10))
    s5, s10 = five["strategy"], ten["strategy"]
    assert s5["sparseloco"]["steps"] == s10["sparseloco"]["steps"] == 5
    assert torch.equal(s5["sparseloco"]["error"], s10["sparseloco"]["error"])
    for k, v in s5["model"].items():
        assert torch.equal(v, s10["model"][k]), k


@pytest.mark.parametrize("over,needle", [
    ({"method.name": "hybrid"}, "method hybrid cannot run over a torchft quorum yet"),
    ({"method.name": "pipeline", "runtime.workers": "2"}, "method pipeline cannot run"),
    ({"method.name": "tensor"}, "methods that can: dp, localsgd"),
    ({"method.name": "localsgd", "runtime.max_restarts": "1"}, "runtime.max_restarts"),
    ({"method.name": "localsgd", "runtime.min_workers": "5"}, "runtime.min_workers"),
    ({"method.name": "diloco", "method.compressor": "int8", "run.resume": "true"},
     "without --runtime.fault_tolerance"),
])
def test_what_cannot_run_on_the_quorum_is_refused_in_one_line(over: dict[str, str],
                                                              needle: str) -> None:
    from thinwire.errors import UsageError

    with pytest.raises(UsageError) as info:
        config_mod.load(None, {**MLP, "runtime.workers": "3",
                               "runtime.fault_tolerance": "torchft", **over})
    msg = str(info.value)
    assert "\n" not in msg and needle in msg, msg

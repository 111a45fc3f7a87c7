"""Elastic restarts: a worker SIGKILLed at a random step (seeded) is restarted with its group by
torch's agent, the group resumes from the newest complete checkpoint, and the final weights
equal an uninterrupted run's bit for bit. Six kills in all (two for each of dp, localsgd and ist), each
followed by a restart; 2 workers, a 32-32 MLP on digits, 40 steps, a checkpoint every 5. The
methods and their kills: every method's ``restart`` entry in tests/method_cases.py."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from method_cases import MLP, params, resolve

from thinwire import checkpoint, rundir
from thinwire import config as config_mod
from thinwire.launch import WorkerFailed, launch

HERE = Path(__file__).parent
STEPS, EVERY, WORKERS = 40, 5, 2
def make_run(root: Path, name: str, method: str, case: dict[str, Any]) -> Path:
    over = {**resolve(case), "train.batch_size": "16",
            "train.steps": str(STEPS), "train.eval_every": "20", "train.log_every": "5",
            "run.checkpoint_every": str(EVERY), "run.progress": "false",
            "runtime.workers": str(WORKERS), "runtime.timeout_s": "60", "method.name": method,
            "run.out": str(root), "run.name": name}
    cfg = config_mod.load(None, over)
    run = root / name
    run.mkdir(parents=True)
    rundir.write_text(run / "config.toml", config_mod.dumps(cfg))
    return run


def kill_plan(method: str, kills: int) -> list[tuple[int, int, int]]:
    """(attempt, rank, step): a random rank at a random step reached by that attempt."""
    rng = random.Random(f"thinwire-elastic-{method}")
    plan, resumed_from = [], 0
    for attempt in range(kills):
        step = rng.randrange(resumed_from, STEPS)
        plan.append((attempt, rng.randrange(WORKERS), step))
        resumed_from = (step // EVERY) * EVERY  # the newest checkpoint sealed before the kill
    return plan


def run_job(run: Path, plan: list[tuple[int, int, int]]) -> None:
    env = {"THINWIRE_TEST_KILLS": ",".join(f"{a}:{r}:{s}" for a, r, s in plan),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    launch(run, WORKERS, env=env, max_restarts=len(plan), module="faulty_worker")


def final_state(run: Path) -> list[dict[str, Any]]:
    assert checkpoint.latest_step(run) == STEPS
    return [checkpoint.load_rank(run, STEPS, r, WORKERS) for r in range(WORKERS)]


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("method,variant,case", params("restart"))
def test_killed_workers_restart_and_match_an_uninterrupted_run(tmp_path: Path, method: str,
                                                              variant: str, case: Any) -> None:
    over, kills = case
    plan = kill_plan(method, kills)
    ref = make_run(tmp_path, "ref", method, over)
    run_job(ref, [])
    hit = make_run(tmp_path, "hit", method, over)
    run_job(hit, plan)
    killed = sorted(p.name for p in hit.glob("killed.*"))
    assert killed == sorted(f"killed.attempt{a}.rank{r}.step{s}" for a, r, s in plan), killed
    a, b = final_state(ref), final_state(hit)
    for r in range(WORKERS):
        assert_bitwise_equal(a[r]["strategy"], b[r]["strategy"], f"rank{r}")
    # the metrics were rewound on every restart: the same steps, once each
    def steps(run: Path) -> list[tuple[str, int]]:
        import json

        return [(r["kind"], r["step"]) for r in map(json.loads,
                                                    (run / "metrics.jsonl").read_text().splitlines())]

    assert steps(hit) == steps(ref)


@pytest.mark.timeout(300)
def test_without_restarts_a_kill_ends_the_job(tmp_path: Path) -> None:
    run = make_run(tmp_path, "hit", "dp", {**MLP, "model.norm": "none"})
    with pytest.raises(WorkerFailed) as e:
        launch(run, WORKERS, env={"THINWIRE_TEST_KILLS": "0:1:7",
                                  "PYTHONPATH": str(HERE)}, module="faulty_worker")
    assert e.value.rank == 1 and e.value.kind == "signal" and "SIGKILL" in str(e.value)
    assert checkpoint.latest_step(run) == 5

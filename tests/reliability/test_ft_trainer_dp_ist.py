"""``thinwire train --method dp|ist --runtime.fault_tolerance torchft``: the trainer's fault
tolerance for data parallelism (every step a quorum's step, FaultTolerantDP) and for IST
(rounds on a quorum, FaultTolerantIST). Each job is :func:`thinwire.run.run_replicas` with the
faults planted by tests/reliability/ft_worker.py (SIGKILL of one worker inside a chosen step,
a worker joining later); every wait is on a file or a process, bounded, and no worker outlives
its job. The final models are checked against a one-process reference applying the method's
rule to the live sets the survivors recorded."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchft")
os.environ.setdefault("RUST_LOG", "error")

from test_ft_trainer import final_params, make_run, run_job  # noqa: E402

from thinwire import checkpoint  # noqa: E402
from thinwire import config as config_mod  # noqa: E402
from thinwire.builders import build_model, load_data, make_stream  # noqa: E402
from thinwire.compression import build_codec  # noqa: E402
from thinwire.data.task import task_for  # noqa: E402
from thinwire.strategies.base import lr_at, make_optimizer, set_lr  # noqa: E402
from thinwire.strategies.grads import flatten, grads_of, unflatten_into  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def dp_reference(cfg: Any, steps: list[dict[str, Any]], codec: str = "none"
                 ) -> list[torch.Tensor]:
    """Data parallelism's rule on the recorded live sets, one process: each kept step s (the
    s-th committed step, batch index s - 1) averages the gradients of the live workers, each
    on its own shard, at the shared model, and the run's optimizer (momentum SGD here) steps
    on the mean; a refused step changes nothing (its batches are read again at the next
    quorum's step of the same index). With a ``codec`` (one not linear: all-gathered), each
    live worker's flat gradient is encoded by its own codec (its error feedback its own; a
    lost worker's with it), and the mean is every payload decoded in worker order, summed and
    divided by their number, as the codec's exchange does."""
    ds = load_data(cfg)
    loss = task_for(ds).loss
    model = build_model(cfg, ds)
    opt = make_optimizer(model.parameters(), cfg.train)
    streams = {w: make_stream(cfg, ds, w, cfg.runtime.workers) for w in range(cfg.runtime.workers)}
    params = list(model.parameters())
    codecs = {w: build_codec(codec, seed=cfg.train.seed) for w in streams}
    for s in steps:
        if not s["kept"]:
            continue
        if codec != "none":
            mean = _coded_mean(model, params, loss, streams, codecs, s)
            unflatten_into(mean, [p.grad for p in params])  # type: ignore[misc]
            set_lr(opt, lr_at(cfg.train, s["step"] - 1))
            opt.step()
            continue
        grads = []
        for w in s["live"]:
            model.zero_grad(set_to_none=True)
            x, y = streams[w].batch(s["step"] - 1)
            loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in params])  # type: ignore[union-attr]
        for j, p in enumerate(params):
            total = grads[0][j].clone()
            for g in grads[1:]:
                total += g[j]
            p.grad = total / len(grads)
        set_lr(opt, lr_at(cfg.train, s["step"] - 1))
        opt.step()
    return [p.detach().clone() for p in params]


def _coded_mean(model: Any, params: list[torch.Tensor], loss: Any, streams: dict[int, Any],
                codecs: dict[int, Any], s: dict[str, Any]) -> torch.Tensor:
    """The live workers' gradients through their codecs: encoded, decoded in worker order,
    summed and divided (``Compressor.average_async`` of a codec that is not linear)."""
    payloads = []
    for w in s["live"]:
        model.zero_grad(set_to_none=True)
        x, y = streams[w].batch(s["step"] - 1)
        loss(model(x), y).backward()
        flat = flatten(grads_of(params))
        payloads.append(codecs[w].encode(flat, s["step"] - 1, key=0))
    numel = sum(p.numel() for p in params)
    first = codecs[s["live"][0]]
    mean = first.decode(payloads[0], numel, s["step"] - 1, key=0)
    for payload in payloads[1:]:
        first.decode_add(payload, mean, s["step"] - 1, key=0)
    return mean.div_(len(payloads))


def _dp_steps(summary: dict[str, Any]) -> list[tuple[int, list[int], bool]]:
    return [(r["step"], r["live"], r["kept"]) for r in summary["fault_tolerance"]["outer_steps"]]


def test_dp_survives_a_worker_killed_mid_step(tmp_path: Path) -> None:
    """dp (no codec, momentum SGD), 3 workers, min_workers 2; worker 2 SIGKILLs itself inside
    step 7 (its quorum formed): that step is refused by both survivors and run again by the
    two of them, and they finish the 20 steps with no restart. The summary names worker 2,
    lost at step 8 (the refused one); the survivors end equal bit for bit, and equal to the
    reference on the recorded live sets within 1e-5 (gloo sums the 3 workers' gradients of the
    first 7 steps in its own order, an ulp apart, which momentum carries on; later sums have 2
    addends, exact in any order), while not losing the worker moves it by more than 1e-3. The
    refused step is logged and evaluated once, after it counted; the last checkpoint holds the
    final model."""
    run, cfg = make_run(tmp_path, {"method.name": "dp"}, 3, 2,
                        **{"train.momentum": "0.9", "run.checkpoint_every": "4",
                           "train.eval_every": "4", "train.log_every": "4"})
    summary = run_job(run, cfg, start="0,1,2", kill="2:7")
    ft = summary["fault_tolerance"]
    assert ft["survivors"] == [0, 1]
    assert ft["lost"] == [{"worker": 2, "step": 8, "ended": "killed by SIGKILL"}], ft
    steps = _dp_steps(summary)
    assert steps == ([(s, [0, 1, 2], True) for s in range(1, 8)] + [(8, [0, 1, 2], False)]
                     + [(s, [0, 1], True) for s in range(8, 21)]), steps
    a, b = final_params(run, 0, cfg), final_params(run, 1, cfg)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    recorded = ft["outer_steps"]
    ref = dp_reference(cfg, recorded)
    for x, y in zip(a, ref):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
    never_lost = dp_reference(cfg, [{"step": s, "live": [0, 1, 2], "kept": True}
                                    for s in range(1, 21)])
    assert max((x - y).abs().max().item() for x, y in zip(ref, never_lost)) > 1e-3
    # the refused step (8, run again) is logged and evaluated once, after it counted; the last
    # checkpoint holds the final model
    records = [json.loads(line) for line in
               (run / "worker0" / "metrics.jsonl").read_text().splitlines()]
    for kind in ("train", "eval"):
        logged = [r["step"] for r in records if r["kind"] == kind]
        assert logged == [4, 8, 12, 16, 20], (kind, logged)
    assert checkpoint.complete_steps(run) == [16, 20]
    last = checkpoint.load_rank(run, 20, 0, 1)["strategy"]["model"]
    names = [n for n, _ in build_model(cfg, load_data(cfg)).named_parameters()]
    assert all(torch.equal(last[n], x) for n, x in zip(names, a))


def test_dp_with_error_feedback_survives_a_worker_killed(tmp_path: Path) -> None:
    """dp with top-k and its error feedback (all-gathered payloads), 3 workers, worker 1
    killed inside step 4: the step is refused, each survivor puts its residual back as it was
    before the step, and the two go on; they end equal bit for bit (each decodes the same
    gathered payloads in the same order), and their residuals differ (each its own)."""
    run, cfg = make_run(tmp_path, {"method.name": "dp", "method.compressor": "topk:ratio=0.25"},
                        3, 2, **{"train.steps": "10", "train.eval_every": "10"})
    summary = run_job(run, cfg, start="0,1,2", kill="1:4")
    ft = summary["fault_tolerance"]
    assert ft["survivors"] == [0, 2] and ft["lost"][0]["worker"] == 1, ft
    assert _dp_steps(summary) == ([(s, [0, 1, 2], True) for s in range(1, 5)]
                                  + [(5, [0, 1, 2], False)]
                                  + [(s, [0, 2], True) for s in range(5, 11)])
    a, b = final_params(run, 0, cfg), final_params(run, 2, cfg)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    ra, rb = (torch.load(run / f"worker{i}" / "wrapper.pt")["codec"] for i in (0, 2))
    assert ra.keys() == rb.keys() and any(not torch.equal(ra[k], rb[k]) for k in ra)
    led = json.loads((run / "ledger.rank0.json").read_text())["by_op"]
    assert led["all_gather:grad"]["calls"] > 0


def test_dp_with_int8_survives_a_worker_killed(tmp_path: Path) -> None:
    """dp with the int8 codec (a fp32 scale per 512 elements, all-gathered) and its error
    feedback, 3 workers, worker 2 killed inside step 4: the step is refused (each survivor's
    residual put back), the two go on and end equal bit for bit, and equal bit for bit to the
    reference that encodes each live worker's gradient with its own codec and decodes the
    payloads in worker order (the exchange moves exact bytes and each survivor sums the same
    decoded payloads in the same order: no reduction order to tolerate; the workers and the
    reference compute on one thread each, so their matrix products sum alike), while not
    losing the worker moves the result by more than 1e-3."""
    run, cfg = make_run(tmp_path, {"method.name": "dp", "method.compressor": "int8"}, 3, 2,
                        **{"train.steps": "10", "train.eval_every": "10",
                           "train.momentum": "0.9", "runtime.threads": "1"})
    summary = run_job(run, cfg, start="0,1,2", kill="2:4")
    ft = summary["fault_tolerance"]
    assert ft["survivors"] == [0, 1] and ft["lost"][0]["worker"] == 2, ft
    assert _dp_steps(summary) == ([(s, [0, 1, 2], True) for s in range(1, 5)]
                                  + [(5, [0, 1, 2], False)]
                                  + [(s, [0, 1], True) for s in range(5, 11)])
    a, b = final_params(run, 0, cfg), final_params(run, 1, cfg)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' (runtime.threads 1)
    try:
        ref = dp_reference(cfg, ft["outer_steps"], codec="int8")
        never_lost = dp_reference(cfg, [{"step": s, "live": [0, 1, 2], "kept": True}
                                        for s in range(1, 11)], codec="int8")
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(x, y) for x, y in zip(a, ref)), \
        max((x - y).abs().max().item() for x, y in zip(a, ref))
    assert max((x - y).abs().max().item() for x, y in zip(ref, never_lost)) > 1e-3


@pytest.mark.parametrize("over,needle", [
    ({"method.compressor": "fp4:exchange=scatter"}, "drop exchange=scatter"),
    ({"memory.zero": "1"}, "memory.zero"),
])
def test_what_dp_cannot_carry_on_the_quorum_is_refused_in_one_line(
        over: dict[str, str], needle: str) -> None:
    from method_cases import MLP

    from thinwire.errors import UsageError

    with pytest.raises(UsageError) as info:
        config_mod.load(None, {**MLP, "method.name": "dp", "runtime.workers": "3",
                               "runtime.fault_tolerance": "torchft", **over})
    msg = str(info.value)
    assert "\n" not in msg and needle in msg, msg


@pytest.mark.parametrize("deployment", ["central", "sharded"])
def test_ist_loses_a_keeper_mid_round_and_one_joins(tmp_path: Path, deployment: str) -> None:
    """ist (K = 4, a 64-12-10 MLP without norms, plain SGD), 4 workers configured,
    min_workers 2: workers 0-2 begin; worker 1 (a keeper, with worker 0) SIGKILLs itself inside
    step 5, the second step of round 1. Workers 0 and 2 close round 1 without it (its units
    keep their round-start values), worker 2 becomes a keeper from worker 0's copy, round 2 is
    dealt over {0, 2}; worker 3 starts once worker 0 began step 8 and joins the round starting
    at 12 (workers 0 and 2 hold there until its quorum request is in), recovering the round's boundary
    state over the ledger's ``recovery`` kind. No worker restarts; the summary names worker 1,
    lost in the round that closed at step 8; workers 0, 2 and the joiner end with the same
    full model, equal bit for bit to the one-process reference of IST's rule on the recorded
    live sets (tests/reliability/test_ist_fault_tolerance.py's, on this network and these
    batches); losing worker 1 changes it by more than 1e-3. Sharded (every block of units on
    two workers, fault_sharded): the same, worker 1's blocks copied to survivors (``recovery``)
    and the joiner made a holder of some; the one checkpoint, written at the end by the lowest
    live worker (worker 0, which ``finish`` gave the whole store), holds the final model, as
    the central keeper's does."""
    from test_ist_fault_tolerance import _reference

    run, cfg = make_run(tmp_path, {"method.name": "ist", "method.local_steps": "4",
                                   "method.deployment": deployment,
                                   "model.hidden": "12", "model.norm": "none"}, 4, 2)
    summary = run_job(run, cfg, start="0,1,2", kill="1:5", join="3:8:12")
    ft = summary["fault_tolerance"]
    assert ft["survivors"] == [0, 2, 3], ft
    assert ft["lost"] == [{"worker": 1, "step": 8, "ended": "killed by SIGKILL"}], ft
    rounds = [(r["step"] // 4 - 1, r["began"], r["live"]) for r in ft["outer_steps"]]
    assert rounds == [(0, [0, 1, 2], [0, 1, 2]), (1, [0, 1, 2], [0, 2]), (2, [0, 2], [0, 2]),
                      (3, [0, 2, 3], [0, 2, 3]), (4, [0, 2, 3], [0, 2, 3])], rounds
    joiner = json.loads((run / "worker3" / "summary.json").read_text())["fault_tolerance"]
    assert joiner["joined_at"] == 12 and joiner["recoveries"] == 1
    got = json.loads((run / "ledger.rank3.json").read_text())["by_op"]["recv:recovery"]
    assert got["recv"] > 0, got
    final = {i: final_params(run, i, cfg) for i in (0, 2, 3)}
    for i in (2, 3):
        assert all(torch.equal(x, y) for x, y in zip(final[0], final[i])), i
    ds = load_data(cfg)
    streams = {w: make_stream(cfg, ds, w, 4) for w in range(4)}

    def ref(log: list[tuple[int, list[int], list[int]]]) -> list[torch.Tensor]:
        return _reference(log, cfg.train.lr, 0, build=lambda: build_model(cfg, ds),
                          batch=lambda w, r, s: streams[w].batch(4 * r + s),
                          loss=task_for(ds).loss, local_steps=4)

    expected = ref(rounds)
    for x, y in zip(final[0], expected):
        assert torch.equal(x, y), (x - y).abs().max()
    whole = ref([(0, [0, 1, 2], [0, 1, 2]), (1, [0, 1, 2], [0, 1, 2]), *rounds[2:]])
    assert max((x - y).abs().max().item() for x, y in zip(expected, whole)) > 1e-3
    assert checkpoint.complete_steps(run) == [20]  # written by worker 0, the first keeper
    store = checkpoint.load_rank(run, 20, 0, 1)["strategy"]["ist"]["store"]
    names = [n for n, _ in build_model(cfg, ds).named_parameters()]
    assert all(torch.equal(store[n], x) for n, x in zip(names, final[0]))


@pytest.mark.parametrize("over,needle", [
    ({"method.deployment": "sharded", "train.eval_every": "20"}, "train.eval_every"),
    ({"method.deployment": "sharded", "train.eval_every": "0", "run.checkpoint_every": "20"},
     "run.checkpoint_every"),
    ({"method.deployment": "sharded", "train.eval_every": "0", "method.outer_lr": "0.7"},
     "method.outer_lr"),
    ({"method.switch_at": "40"}, "method.switch_at"),
    ({"method.shards": "whole"}, "method.shards"),
    ({"method.local_steps": "4", "train.eval_every": "10"}, "train.eval_every"),
])
def test_what_ist_cannot_carry_on_the_quorum_is_refused_in_one_line(
        over: dict[str, str], needle: str) -> None:
    from method_cases import MLP

    from thinwire.errors import UsageError

    with pytest.raises(UsageError) as info:
        config_mod.load(None, {**MLP, "method.name": "ist", "runtime.workers": "3",
                               "train.steps": "40", "runtime.fault_tolerance": "torchft",
                               **over})
    msg = str(info.value)
    assert "\n" not in msg and needle in msg, msg


def test_ists_outer_optimizer_is_taken_on_the_quorum() -> None:
    """IST's outer optimizer runs over the quorum (its momentum travels with a keeper's store
    and a joiner's boundary state: test_ist_fault_tolerance.py holds it to the reference)."""
    from method_cases import MLP

    cfg = config_mod.load(None, {**MLP, "method.name": "ist", "runtime.workers": "3",
                                 "train.steps": "40", "runtime.fault_tolerance": "torchft",
                                 "method.outer_lr": "0.7", "method.outer_momentum": "0.9"})
    assert (cfg.method.options.outer_lr, cfg.method.options.outer_momentum) == (0.7, 0.9)

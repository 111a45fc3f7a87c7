"""The device rule, checked on CPU for every registered method (docs/ARCHITECTURE.md,
invariants: every tensor handed to ``Comm`` lives on the run's device).

A CUDA run's process group is nccl's, and nccl refuses a CPU tensor; on CPU with gloo nothing
tells the two apart. So each rank here runs with torch's default device set to ``meta``
(``with torch.device("meta")``) around every step, evaluation and the summary's gathers
(checkpoints are written outside it: see ``STRAYS``): a tensor made without naming a device,
which a CUDA run would leave on the CPU, lands on meta instead, and ``Comm``, which knows the
run's device (cpu: the trainer declares it), refuses it before the call with
:class:`~thinwire.runtime.comm.CommDeviceError`. Tensors placed from the model's or the input's
device are on the run's device in both runs. Each method's ``device`` case
(tests/method_cases.py) runs on 2 or 4 forked gloo ranks for 2 steps (an evaluation and a
checkpoint at step 2), then resumes from that checkpoint to step 4 (loading, a second
evaluation and checkpoint under the rule too), and every ledger entry must record the run's
device. What this cannot see: a tensor placed on the CPU by name (``device="cpu"``,
``.cpu()``, ``torch.from_numpy``) and then handed to ``Comm``; the gpu-marked tests of
tests/test_gpu.py run the same cases on CUDA where a device exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401  # before the ranks fork: each would import it at its first optimizer
from harness import run_workers
from method_cases import params, resolve, workers

from thinwire.config import load
from thinwire.runtime.comm import Comm, CommDeviceError
from thinwire.trainer import Trainer


@pytest.fixture(scope="module", autouse=True)
def _imports_done_once() -> None:
    """Import here, once, what every forked rank would otherwise import on its own (the first
    optimizer's compiler stack, sklearn for digits): seconds per rank and run."""
    from thinwire.data import load_dataset

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    load_dataset("digits")


STEPS = {"train.steps": 4, "train.eval_every": 2, "run.checkpoint_every": 2,
         "train.batch_size": 8, "run.progress": False}


STRAYS = [("strategy", "train_step"), ("strategy", "eval_model"), ("strategy", "observe"),
          ("trainer", "_evaluate"), ("trainer", "_summary")]
"""The calls run with the meta default: every step, evaluation (the metric gathers included)
and the summary's gathers. Checkpoints are written outside it: a state tensor a CUDA run keeps
on the CPU is right there, and here it would be saved on meta."""


def _on_meta(fn: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.device("meta"):  # what a CUDA run would leave on the CPU lands on meta here
            return fn(*args, **kwargs)
    return call


def _plant(comm: Comm, observe: Any) -> Any:
    """``observe`` with a stray control tensor before it, made as the known offenders were."""
    def call(*args: Any, **kwargs: Any) -> Any:
        comm.all_reduce(torch.tensor([1.0], dtype=torch.float64), tag="control")
        return observe(*args, **kwargs)
    return call


def _train(comm: Comm, over: dict[str, Any], run_dir: str, plant: bool = False
           ) -> list[tuple[str, str, str]]:
    cfg = load(None, {**over, "runtime.workers": comm.world_size})
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    tr = Trainer(cfg, comm, torch.device("cpu"), Path(run_dir))
    if plant:
        tr.strategy.observe = _plant(comm, tr.strategy.observe)
    for owner, name in STRAYS:
        target = tr.strategy if owner == "strategy" else tr
        setattr(target, name, _on_meta(getattr(target, name)))
    tr.run()
    return [(e.op, e.tag, e.device) for e in comm.ledger.entries]


@pytest.mark.parametrize("method,variant,case", params("device"))
def test_every_call_of_every_method_is_on_the_run_device(method: str, variant: str,
                                                         case: dict[str, Any],
                                                         tmp_path: Path) -> None:
    over = {**resolve(case), "method.name": method, **STEPS, "run.out": str(tmp_path)}
    n = workers(over)
    run = str(tmp_path / "run")
    out = run_workers(_train, n, {**over, "train.steps": 2}, run, timeout=180)
    out += run_workers(_train, n, {**over, "run.resume": True}, run, timeout=180)
    for rank, entries in enumerate(out):
        assert entries, rank
        ops = {op for op, _, _ in entries}
        assert ops & {"all_reduce", "all_gather", "send", "broadcast", "all_to_all"}, ops
        wrong = [e for e in entries if e[0] != "barrier" and e[2] != "cpu"]
        assert not wrong, (rank, wrong)


def _planted(comm: Comm, device: str) -> str:
    comm.expect(device)
    stray = torch.tensor([1.0])  # a control tensor made without a device: on the CPU
    try:
        comm.all_reduce(stray, tag="control")
    except CommDeviceError as exc:
        return str(exc)
    return "accepted"


def test_a_cpu_control_tensor_under_a_cuda_run_is_refused() -> None:
    """The check itself: a run declared on cuda refuses a CPU tensor before any collective (and
    so before nccl would), naming the call, the tag and both devices; the world size does not
    matter (a one-GPU run finds it too). Declared cpu, the same call goes through."""
    out = run_workers(_planted, 2, "cuda:0")
    for msg in out:
        assert "Comm.all_reduce (tag 'control'): a tensor on cpu" in msg
        assert "run's device is cuda:0" in msg
    assert run_workers(_planted, 2, "cpu") == ["accepted", "accepted"]
    local = Comm.local(device="cuda")
    with pytest.raises(CommDeviceError, match="gather_floats|all_gather"):
        local.all_gather(torch.zeros(2), tag="control")


def _stray_under_meta(comm: Comm) -> str:
    comm.expect("cpu")
    with torch.device("meta"):
        try:
            comm.broadcast(torch.tensor([0.5], dtype=torch.float64), src=0, tag="control")
        except CommDeviceError as exc:
            return str(exc)
    return "accepted"


def test_the_meta_default_turns_a_stray_tensor_into_a_refusal() -> None:
    """The simulation's premise: under the meta default a tensor made without a device (the
    pipeline's loss broadcast before it named its device) is refused on a CPU run."""
    for msg in run_workers(_stray_under_meta, 2):
        assert "Comm.broadcast (tag 'control'): a tensor on meta" in msg


def test_a_stray_control_tensor_planted_in_a_method_fails_its_run(tmp_path: Path) -> None:
    """The harness can fail: the same run as localsgd's case, with one control all-reduce of a
    tensor made without a device planted in the method's ``observe``, stops at its first
    evaluation with the rule's error."""
    from method_cases import CASES

    over = {**CASES["localsgd"]["device"]["plain"], "method.name": "localsgd", **STEPS,
            "train.steps": 2, "run.out": str(tmp_path)}
    with pytest.raises(AssertionError, match=r"CommDeviceError: Comm.all_reduce \(tag "
                                             r"'control'\): a tensor on meta"):
        run_workers(_train, 2, over, str(tmp_path / "run"), True, timeout=180)

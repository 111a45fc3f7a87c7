"""Adding a method is one module that implements the capabilities it has, and one registry
line (docs/ARCHITECTURE.md, "Adding a method"): this test module is such a module, the worked
example of the document. Its method, ``every-other``, is data parallelism by periodic model
averaging at its smallest: each replica steps on its own batch, and every other step (a period
of 2 by default) the replicas average their parameters with one all-reduce. Registered for the
test, it runs through the trainer on 2 gloo ranks, and every rank's ledger equals its traffic
formula."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_workers

from thinwire.config import load
from thinwire.data import load_dataset
from thinwire.measure.predict import run_layout, run_traffic
from thinwire.options import OptionError, check, opt
from thinwire.runtime.comm import Comm
from thinwire.strategies import METHODS
from thinwire.strategies.base import Batch, ReplicatedStrategy, flat_params, load_flat
from thinwire.strategies.entry import HasRunLayout, MethodEntry, Rescalable
from thinwire.strategies.traffic import Layout, Traffic
from thinwire.trainer import Trainer

NAME = "every-other"


@dataclass(frozen=True)
class Options:
    """The ``[method]`` options beyond ``name``."""

    period: int = opt(2, "steps between parameter averages")

    def __post_init__(self) -> None:
        check(self.period >= 1, "method.period", "must be >= 1")


class EveryOther(ReplicatedStrategy):
    """The Strategy: 1. the standard step on this rank's batch; 2. on every period's last step,
    the parameters averaged over the ranks (one all-reduce, tag ``average``)."""

    name = NAME

    def train_step(self, batch: Batch, step: int) -> float:
        loss = self.standard_step(self.model, self.opt, batch, step)  # step 1
        if (step + 1) % self.ctx.options.period == 0:  # step 2
            flat = flat_params(self.model)
            self.comm.all_reduce(flat, op="avg", tag="average")
            load_flat(self.model, flat)
        return loss


def traffic(layout: Layout, options: Options, workers: int, steps: int, seed: int,
            optimizer_states: int = 0) -> Traffic:
    """The ledger's bytes: one all-reduce of every parameter (4 bytes each) a period."""
    del seed, optimizer_states
    return Traffic.uniform(workers, "all_reduce", [4 * layout.numel] * (steps // options.period))


class EveryOtherEntry(MethodEntry, Rescalable):
    """The entry, with the one capability the method has beyond every entry's fields: at a
    checkpoint every replica holds the same model, so it resumes at another worker count."""

    def rescalable(self, options: Options) -> bool:
        return True


METHOD = EveryOtherEntry(
    name=NAME, summary="average the replicas' parameters every other step",
    strategy=f"{__name__}:EveryOther", options=Options, traffic=traffic,
    label=lambda o: f"{NAME}(H={o.period})", sync_every=lambda o: o.period)


@pytest.fixture
def registered() -> Any:
    """The registry line, for this test only (the method-case table holds the library's
    methods): ``METHODS.register(name, "module:METHOD")``."""
    METHODS.register(NAME, f"{__name__}:METHOD")
    try:
        yield METHODS.get(NAME)
    finally:
        METHODS.unregister(NAME)
    assert NAME not in METHODS


def _train(comm: Comm, cfg: Any, run_dir: str) -> dict:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, comm, torch.device("cpu"), Path(run_dir))
    summary = trainer.run()
    strategy = trainer.strategy
    assert isinstance(strategy, EveryOther)
    return {"summary": summary, "totals": comm.ledger.totals(),
            "params": flat_params(strategy.model)}


def test_a_method_defined_here_trains_and_its_formula_is_its_ledger(registered: MethodEntry,
                                                                    tmp_path: Path) -> None:
    assert registered is METHOD and isinstance(registered, Rescalable)
    assert registered.planned and not isinstance(registered, HasRunLayout)
    load_dataset("digits")  # once here, not in each forked rank
    cfg = load(None, {"method.name": NAME, "data.name": "digits", "model.hidden": "16,16",
                      "train.batch_size": "8", "train.steps": "6", "train.eval_every": "6",
                      "run.progress": "false", "runtime.workers": "2",
                      "run.out": str(tmp_path)})
    assert cfg.sync_every == 2 and METHOD.rescales(cfg.method.options)
    out = run_workers(_train, 2, cfg, str(tmp_path / "run"))
    want = run_traffic(cfg, run_layout(cfg))
    assert want.rank0_calls == {"all_reduce": (3, want.sent[0])} and want.sent[0] > 0
    assert [o["totals"]["sent_bytes"] for o in out] == list(want.sent)
    assert [o["totals"]["recv_bytes"] for o in out] == list(want.recv)
    assert [o["totals"]["payload_bytes"] for o in out] == list(want.payload)
    assert torch.equal(out[0]["params"], out[1]["params"])  # averaged at the last step
    assert out[0]["summary"]["final"]["accuracy"] > 0.2  # it learns: chance is 0.1


def test_a_misspelt_capability_is_refused_where_the_entry_is_defined() -> None:
    with pytest.raises(TypeError, match=r"does not define Rescalable\.rescalable"):
        class Misspelt(MethodEntry, Rescalable):
            def rescaleable(self, options: Options) -> bool:
                return True


def test_a_taken_name_is_refused_in_one_line() -> None:
    with pytest.raises(OptionError, match=r"^method 'dp' is already registered"):
        METHODS.register("dp", f"{__name__}:METHOD")

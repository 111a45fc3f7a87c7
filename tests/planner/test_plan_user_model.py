"""``thinwire plan --model FILE.py:ClassName --input SHAPE`` and its Python entry
(:func:`thinwire.planner.usermodel.model_spec_from_example`): a user's own model, written here
into tmp_path, is priced from the IST plan derived from its graph, without training it.

- the spec carries exactly the plan ``derive_adapter`` derives on the same example, the module's
  parameters, and 6 x its multiply-adds per sample (convolutions and the head, counted by hand);
- the planner's IST bytes per step are the steady-state difference of the ``ist`` method's
  traffic formula on that plan (the formula every rank's ledger equals: a 2-rank IST run on the
  derived plan is checked against it here too), and data parallelism's are a ring all-reduce of
  every parameter;
- ``--input-tokens V`` gives a model that embeds tokens ids below V;
- ``--ist-shared`` keeps a submodule the tracer cannot follow whole;
- bad input (missing file, no such class, a constructor that needs arguments, a bad shape, a
  model the tracer cannot follow, --input without a user model) is one line and exit 2.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from thinwire.cli import main
from thinwire.models.graph_adapter import derive_adapter
from thinwire.planner.methods import OPTIMIZER_STATES
from thinwire.planner.usermodel import example_input, load_module, model_spec_from_example
from thinwire.strategies.ist.method import Options, ist_traffic
from thinwire.strategies.traffic import ring_all_reduce

NET = textwrap.dedent('''
    from __future__ import annotations

    import dataclasses

    import torch
    from torch import nn


    @dataclasses.dataclass
    class Sizes:  # a dataclass needs its module in sys.modules while the file runs
        width: int = 8


    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(c)
            self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(c)

        def forward(self, x):
            return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


    class Net(nn.Module):
        def __init__(self, width=Sizes().width, classes=10):
            super().__init__()
            self.stem = nn.Conv2d(1, width, 3, padding=1)
            self.block = Block(width)
            self.head = nn.Linear(width, classes)

        def forward(self, x):
            x = self.block(torch.relu(self.stem(x)))
            return self.head(x.mean((2, 3)))


    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:
                return self.fc(x)
            return x


    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.branchy = Branchy()
            self.fc1 = nn.Linear(4, 8)
            self.fc2 = nn.Linear(8, 3)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(self.branchy(x))))


    class TokenMLP(nn.Module):
        def __init__(self, vocab=20):
            super().__init__()
            self.embed = nn.Embedding(vocab, 8)
            self.fc1 = nn.Linear(8, 16)
            self.fc2 = nn.Linear(16, vocab)

        def forward(self, ids):
            return self.fc2(torch.relu(self.fc1(self.embed(ids))))


    class NeedsWidth(nn.Module):
        def __init__(self, width):
            super().__init__()
''')

WIDTH, CLASSES, SIDE, BATCH = 8, 10, 6, 4
# multiply-adds per sample: the stem (1 -> 8, 3x3), two 8 -> 8 3x3 convolutions, the head
MACS = SIDE * SIDE * 9 * (1 * WIDTH + 2 * WIDTH * WIDTH) + WIDTH * CLASSES
PARAMS = (9 * WIDTH + WIDTH) + 2 * 9 * WIDTH * WIDTH + 2 * 2 * WIDTH + WIDTH * CLASSES + CLASSES


@pytest.fixture
def net_file(tmp_path: Path) -> Path:
    path = tmp_path / "usernet.py"
    path.write_text(NET)
    return path


def _plan_json(capsys, *args: str) -> dict:
    assert main(["plan", "--cluster", "cpu-1gbe", "--devices", "2", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def _steady(plan, k: int, n: int) -> float:
    """The busiest rank's bytes sent per step in the steady state (round 2 minus round 1),
    with the optimizer ``thinwire plan`` assumes (Adam: its two moments travel with their
    units where the plan's optimizer state is dealt, as IST's default ``auto`` does)."""
    states = OPTIMIZER_STATES["adam"]
    one, two = (ist_traffic(plan, Options(local_steps=k), n, s, 0, states) for s in (k, 2 * k))
    return max((b - a) / k for a, b in zip(one.sent, two.sent))


def test_the_spec_is_the_derived_plan_with_the_modules_counts(net_file: Path) -> None:
    model = load_module(f"{net_file}:Net")
    x = example_input((BATCH, 1, SIDE, SIDE))
    spec = model_spec_from_example(model, x, min_units=2)
    assert spec.name == "Net" and spec.params == PARAMS
    assert spec.flops_per_sample == 6.0 * MACS
    assert spec.ist == derive_adapter(model, x, min_units=2).plan
    assert {g.size for g in spec.ist.groups} == {WIDTH}  # stem + block channels: one group


def test_ist_and_dp_bytes_are_the_methods_formulas_on_the_derived_plan(net_file: Path,
                                                                        capsys) -> None:
    common = ["--model", f"{net_file}:Net", "--input", f"{BATCH}x1x{SIDE}x{SIDE}"]
    ist = _plan_json(capsys, *common, "--method", "ist:local_steps=3")
    dp = _plan_json(capsys, *common)
    plan = derive_adapter(load_module(f"{net_file}:Net"),
                          example_input((BATCH, 1, SIDE, SIDE)), min_units=2).plan
    busiest = _steady(plan, 3, 2)
    assert ist["traffic_bytes"]["sync"] == pytest.approx(busiest) and busiest > 0
    assert dp["traffic_bytes"]["sync"] == pytest.approx(ring_all_reduce(4 * PARAMS, 2))
    assert busiest < dp["traffic_bytes"]["sync"]
    assert ist["strategy"]["micro_batch_size"] == BATCH  # the example's batch, per worker
    assert ist["global_batch"] == 2 * BATCH and ist["strategy"]["micro_batches"] == 1
    assert ist["step_seconds"]["compute"] > 0


def _ist_ledger(comm, path: str) -> dict:
    from thinwire.strategies.ist.core import IST

    model = load_module(f"{path}:Net")
    x = example_input((BATCH, 1, SIDE, SIDE), seed=comm.rank)
    y = torch.arange(BATCH) % CLASSES
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ist = IST(model, opt, comm=comm, local_steps=2, example_input=x)
    for _ in range(4):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    ist.full_model()
    return {"sent": sum(v["sent"] for v in comm.ledger.by_op().values())}


def test_a_two_rank_run_sends_what_the_formula_on_the_derived_plan_says(net_file: Path) -> None:
    from harness import run_workers

    plan = derive_adapter(load_module(f"{net_file}:Net"),
                          example_input((BATCH, 1, SIDE, SIDE)), min_units=2).plan
    want = ist_traffic(plan, Options(local_steps=2), 2, 4, seed=0)
    out = run_workers(_ist_ledger, 2, str(net_file))
    assert [o["sent"] for o in out] == list(want.sent)


@pytest.mark.parametrize("args,what", [
    (["--model", "{d}/none.py:Net", "--input", "4x1x6x6"], "no such file"),
    (["--model", "{d}/usernet.py:Nope", "--input", "4x1x6x6"], "no nn.Module class Nope"),
    (["--model", "{d}/usernet.py:NeedsWidth", "--input", "4x1x6x6"], "give every argument"),
    (["--model", "{d}/usernet.py:Net", "--input", "4xax6"], "sizes joined by x"),
    (["--model", "{d}/usernet.py:Net", "--input", "4x0x6x6"], ">= 1"),
    (["--model", "{d}/usernet.py:Net", "--input", "100000x1x100000x100000"], "smaller batch"),
    (["--model", "{d}/usernet.py:Net", "--input", "4x3x6x6"], "could not run Net"),
    (["--model", "{d}/usernet.py:Net"], "needs --input"),
    (["--model", "{d}/usernet.py:Branchy", "--input", "2x4"], "Branchy"),
    (["--model", "{d}/usernet.py:Wrapped", "--input", "2x4"], "shared=('branchy',)"),
    (["--model", "mlp-784-10-10", "--input", "4x784"], "drop them"),
])
def test_bad_input_is_one_line_and_exit_2(net_file: Path, capsys, args, what) -> None:
    argv = [a.format(d=net_file.parent) for a in args]
    assert main(["plan", "--cluster", "cpu-1gbe", "--devices", "2", *argv]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.strip().splitlines()) == 1 and what in cap.err, cap.err


def test_ist_shared_is_the_escape_hatch_for_an_untraceable_submodule(net_file: Path,
                                                                     capsys) -> None:
    """Wrapped's branchy submodule branches on its data; kept whole, the rest is cut and
    priced (its fc1 neurons are the one group)."""
    out = _plan_json(capsys, "--model", f"{net_file}:Wrapped", "--input", "2x4", "--method",
                     "ist", "--ist-shared", "branchy")
    assert out["traffic_bytes"]["sync"] > 0
    spec = model_spec_from_example(load_module(f"{net_file}:Wrapped"), example_input((2, 4)),
                                   shared=("branchy",))
    assert [g.size for g in spec.ist.groups] == [8]
    assert all(t.shared for t in spec.ist.tensors if t.name.startswith("branchy."))


def test_input_tokens_makes_token_ids_for_a_model_that_embeds_them(net_file: Path,
                                                                   capsys) -> None:
    """Ids below V (floats would fail the embedding); the hidden neurons are the group, the
    embedding shared (derive_adapter's default); bytes are the formula's on that plan."""
    out = _plan_json(capsys, "--model", f"{net_file}:TokenMLP", "--input", "4x5",
                     "--input-tokens", "20", "--method", "ist:local_steps=2")
    ids = example_input((4, 5), tokens=20)
    assert ids.dtype == torch.int64 and int(ids.max()) < 20
    plan = derive_adapter(load_module(f"{net_file}:TokenMLP"), ids, min_units=2).plan
    assert [g.size for g in plan.groups] == [16]
    assert out["traffic_bytes"]["sync"] == pytest.approx(_steady(plan, 2, 2))
    assert main(["plan", "--cluster", "cpu-1gbe", "--devices", "2", "--model",
                 f"{net_file}:TokenMLP", "--input", "4x5"]) == 2  # float ids: one line
    assert len(capsys.readouterr().err.strip().splitlines()) == 1

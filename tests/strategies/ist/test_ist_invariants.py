"""The invariants of ist.md for every adapter (MLP, GPT, ResNet, GCN, and a user's fused-qkv
attention with its own adapter), at n = 2 and 4, central and sharded.

One forked group per (n, deployment) runs, for every model in turn, two rounds of :class:`IST` around plain torch
objects (K = 2, plain SGD):
  round 0 with learning rate 0 on every rank: the assembled model equals the initial one bit
  for bit (every floating-point tensor; integer step counters are the ResNet tests' business);
  round 1 with learning rate 0 on one *frozen* rank: every element that only the frozen rank
  held, and every cross block nobody held (cut tensors whose cuts name different workers), is
  bitwise unchanged, and every other worker's own block moved; a dealt block the frozen rank
  held alone is bitwise unchanged;
and each rank's ledger equals the traffic formula the planner uses (``ist_traffic`` on the
adapter's plan) to the byte. Partitions are checked without processes (disjoint and covering;
dealt: covering, every worker >= 1), and n = 1 against plain training in one process.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import pytest
import torch
from harness import run_workers
from ist_cases import CASES, GRAPH_CASES, block_owner, state

from thinwire.runtime.comm import Comm
from thinwire.runtime.ledger import Ledger
from thinwire.strategies.ist.core import IST
from thinwire.strategies.ist.method import Options, ist_traffic
from thinwire.strategies.ist.partition import partition_groups

K = 2
LR = 0.05
ADAPTED = ["mlp", "gpt", "resnet", "gcn", "fused", *GRAPH_CASES]


def _steps(comm: Comm, case, model, opt, first: int) -> None:  # noqa: ANN001
    for step in range(first, first + K):
        x, y = case.batch(comm.rank, step)
        opt.zero_grad()
        case.loss(model(x), y).backward()
        opt.step()


def _two_rounds(comm: Comm, name: str, deployment: str, frozen: int) -> dict:
    case = CASES[name]
    model = case.build()
    init = state(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ist = IST(model, opt, comm=comm, local_steps=K, deployment=deployment,
              adapter=case.adapter(model), overlap=1)  # disjoint subnets, as published
    _steps(comm, case, model, opt, 0)
    mid = ist.full_model()
    for g in opt.param_groups:
        g["lr"] = 0.0 if comm.rank == frozen else LR
    _steps(comm, case, model, opt, K)
    final = ist.full_model()
    digest = hashlib.sha256(b"".join(u.tobytes() for units in ist.held.values()
                                     for u in units)).hexdigest()
    return {"init": init, "mid": None if mid is None else state(mid),
            "final": None if final is None else state(final), "by_op": comm.ledger.by_op(),
            "digest": digest}


def _every_adapter(comm: Comm, deployment: str, frozen: int) -> dict:
    """Every adapter's two rounds in one process group (one fork per (n, deployment)), each on
    a communicator of its own, so each has its own ledger."""
    return {name: _two_rounds(Comm(ledger=Ledger(comm.rank)), name, deployment, frozen)
            for name in ADAPTED}


@functools.cache
def _group(n: int, deployment: str) -> list[dict]:
    """Every rank's results of one (n, deployment) group, run once per session."""
    return run_workers(_every_adapter, n, deployment, n - 1)


@pytest.mark.parametrize("deployment", ["central", "sharded"])
@pytest.mark.parametrize("n", [2, 4])
def test_round_invariants_and_bytes(n: int, deployment: str) -> None:
    per_rank = _group(n, deployment)
    for name in ADAPTED:
        _check_rounds(name, n, deployment, n - 1, [o[name] for o in per_rank])


@pytest.mark.parametrize("n", [2, 4])
def test_central_and_sharded_deployments_agree(n: int) -> None:
    """Where the pieces are stored does not change the model: after the two rounds the central
    and sharded deployments assemble the same model. Guards the averaging of shared tensors
    (embeddings, norms, biases: store + mean of the workers' updates) in either deployment.
    Tolerance: the two sum the same updates in another order (rank 0's sequential sum, the
    all-reduce), a float32 reassociation of a few ulps; a sum for a mean moves a shared tensor
    by a whole update (about 1e-3 here)."""
    central, sharded = _group(n, "central")[0], _group(n, "sharded")[0]
    for name in ADAPTED:
        a, b = central[name]["final"], sharded[name]["final"]
        for k, v in a.items():
            if v.is_floating_point():
                assert torch.allclose(v, b[k], rtol=1e-5, atol=1e-6), f"{name}: {k}"
            else:
                assert torch.equal(v, b[k]), f"{name}: {k}"


def _check_rounds(name: str, n: int, deployment: str, frozen: int, out: list[dict]) -> None:
    case = CASES[name]
    plan = case.adapter(case.build()).plan
    groups = [(g.name, g.size, g.kind) for g in plan.groups]
    res = out[0]
    assert all(o["digest"] == res["digest"] for o in out), f"{name}: ranks disagree"

    # a round with learning rate 0 reproduces the model bitwise
    for k, v in res["init"].items():
        if v.is_floating_point():
            assert torch.equal(v, res["mid"][k]), f"{name}: {k} moved in a round with lr 0"

    # round 1: what only the frozen rank held, and cross blocks, are bitwise unchanged
    held = partition_groups(groups, n, 0, 1)
    for t in plan.tensors:
        before, after = res["mid"][t.name], res["final"][t.name]
        if not before.is_floating_point() or t.shared:
            continue
        changed = before != after
        if t.unit is not None:
            g, u = t.unit
            holders = {w for w in range(n) if u in held[g][w]}
            if holders == {frozen}:
                assert not changed.any(), f"{t.name}: held by the frozen rank alone, it moved"
            continue
        owner = block_owner(t, plan, held)
        assert not changed[owner == -1].any(), f"{name} {t.name}: a cross block moved"
        assert not changed[owner == frozen].any(), f"{t.name}: the frozen rank's block moved"
        if not t.buffer:
            for w in range(n - 1):
                assert changed[owner == w].any(), f"{t.name}: worker {w}'s block did not train"

    # every rank's ledger is the planner's formula, byte for byte
    want = ist_traffic(plan, Options(local_steps=K, deployment=deployment, overlap=1), n, 2 * K,
                       seed=0)
    for r, o in enumerate(out):
        ops = o["by_op"]
        got = tuple(sum(v[f] for v in ops.values()) for f in ("sent", "recv", "payload"))
        assert got == (want.sent[r], want.recv[r], want.payload[r]), (name, r, ops)
        assert "send:subnet" in ops or "recv:subnet" in ops


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("name", ADAPTED)
def test_partitions_disjoint_and_covering(name: str, n: int) -> None:
    case = CASES[name]
    plan = case.adapter(case.build()).plan
    groups = [(g.name, g.size, g.kind) for g in plan.groups]
    for r in range(6):
        held = partition_groups(groups, n, 3, r)
        for g in plan.groups:
            units = held[g.name]
            assert len(units) == n
            flat = np.concatenate(units)
            assert all(len(u) >= 1 for u in units), g.name
            assert sorted(set(flat.tolist())) == list(range(g.size)), g.name
            if g.kind == "disjoint" or g.size >= n:
                assert len(flat) == g.size, f"{g.name}: a unit went to two workers"
            else:  # dealt, fewer units than workers: one each, some shared
                assert all(len(u) == 1 for u in units)


@pytest.mark.parametrize("state", ["reset", "reindex"])
@pytest.mark.parametrize("name", ADAPTED)
def test_one_worker_equals_plain_training(name: str, state: str) -> None:
    """n = 1: every unit on the one worker; IST is the plain loop bit for bit: with ``reset``
    momentum restarts every K steps in both (the plain loop builds a fresh optimizer each
    round); with ``reindex`` the state dealt with its units is the plain loop's one optimizer's,
    exactly."""
    case = CASES[name]
    k, steps = 3, 9
    model = case.build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ist = IST(model, opt, comm=Comm.local(), local_steps=k, adapter=case.adapter(model),
              optimizer_state=state)
    plain = case.build()
    a_losses, b_losses = [], []
    for step in range(steps):
        x, y = case.batch(0, step)
        opt.zero_grad()
        loss = case.loss(model(x), y)
        loss.backward()
        opt.step()
        a_losses.append(loss.item())
        if step % k == 0 and (state == "reset" or step == 0):
            p_opt = torch.optim.SGD(plain.parameters(), lr=LR, momentum=0.9)
        p_opt.zero_grad()
        loss = case.loss(plain(x), y)
        loss.backward()
        p_opt.step()
        b_losses.append(loss.item())
    assert a_losses == b_losses
    full = ist.full_model()
    assert full is not None
    for key, v in plain.state_dict().items():
        assert torch.equal(full.state_dict()[key], v), key


def _scaled_outputs(comm: Comm) -> dict:
    out = {}
    for scale in ("dropout", "none"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        IST(model, opt, comm=Comm(ledger=Ledger(comm.rank)), local_steps=K, scale=scale)
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            out[scale] = model(x)  # the subnet's forward (the round begins here)
        out["bias"] = model[2].bias.detach().clone()
    return out


def test_dropout_scaling_multiplies_the_cut_layers_input_by_n() -> None:
    """Inverted dropout (``scale = "dropout"``) at n = 2: a subnet holding half of the hidden
    units feeds the next layer 2x its activations, so (output - bias) is exactly twice the
    unscaled subnet's (ReLU is positively homogeneous; x2 is exact in float). Guards the
    scaling factor units / held."""
    for o in run_workers(_scaled_outputs, 2):
        d, n, b = o["dropout"] - o["bias"], o["none"] - o["bias"], o["bias"]
        assert torch.allclose(d, 2 * n, rtol=1e-6, atol=1e-6), (d, n, b)
        assert not torch.allclose(d, n)


def _one_trained_worker(comm: Comm, deployment: str) -> dict:
    case = CASES["mlp"]
    model = case.build()
    init = state(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR if comm.rank == 0 else 0.0)
    local: dict[str, torch.Tensor] = {}
    # registered before IST's own hook, so it sees the trained subnet before the exchange
    opt.register_step_post_hook(lambda *_: local.update(
        {k: v.detach().clone() for k, v in model.named_parameters()}))
    ist = IST(model, opt, comm=Comm(ledger=Ledger(comm.rank)), local_steps=K,
              deployment=deployment, adapter=case.adapter(model))
    _steps(comm, case, model, opt, 0)
    full = ist.full_model()
    return {"init": init, "local": local, "full": None if full is None else state(full)}


@pytest.mark.parametrize("deployment", ["central", "sharded"])
def test_shared_tensors_move_by_the_mean_update(deployment: str) -> None:
    """A tensor every subnet shares (the output layer's bias) ends a round at store + the mean
    of the workers' updates: with rank 1 frozen (lr 0), exactly half of rank 0's update. Guards
    the / n of the shared-tensor average. Tolerance: one float32 rounding of the halving and the
    sum (ulps of values about 0.1); a sum for a mean is off by a whole update."""
    out = run_workers(_one_trained_worker, 2, deployment)
    plan = CASES["mlp"].adapter(CASES["mlp"].build()).plan
    shared = [t.name for t in plan.tensors if t.shared and not t.buffer]
    assert shared
    full = out[0]["full"]
    for name in shared:
        init, trained = out[0]["init"][name], out[0]["local"][name]
        assert not torch.equal(trained, init), name
        want = init + (trained - init) / 2
        assert torch.allclose(full[name], want, rtol=1e-6, atol=1e-7), name

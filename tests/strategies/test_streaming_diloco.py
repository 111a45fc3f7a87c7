"""Streaming DiLoCo in ``diloco``: one fragment without overlap or codec is the 2023 algorithm bit
for bit; fragments, overlap and the merge against Algorithm 2 of arXiv 2501.18512 written out by
hand; the traffic formula equals the ledger; a checkpoint taken with an exchange in flight
resumes exactly."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import run_workers
from loco_cases import LR
from loco_cases import batch as _batch
from loco_cases import cfg as _method_cfg
from loco_cases import flat as _flat
from loco_cases import model as _model
from loco_cases import run as _run
from loco_cases import strategy as _strategy

from thinwire.errors import UsageError
from thinwire.runtime.comm import Comm
from thinwire.strategies import METHODS
from thinwire.strategies.diloco import DiLoCo, strided_fragments
from thinwire.strategies.traffic import Layout

H = 4


def _cfg(**method: Any):
    return _method_cfg("diloco", **{"period": H, **method})


def _inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _diloco_2023(comm: Comm, steps: int) -> torch.Tensor:
    """DiLoCo as thinwire ran it before Streaming DiLoCo: one flat all-reduce of the whole
    pseudo-gradient every H steps, the outer Nesterov step from theta_g."""
    model = _model()
    params = list(model.parameters())
    inner = torch.optim.SGD(params, lr=LR, momentum=0.0)
    outer = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    glob = [p.detach().clone() for p in params]
    for step in range(steps):
        _inner_step(model, inner, comm.rank, step)
        if (step + 1) % H == 0:
            with torch.no_grad():
                delta = torch.cat([(g - p).reshape(-1) for g, p in zip(glob, params)])
                comm.all_reduce(delta, op="avg")
                at = 0
                for g, p in zip(glob, params):
                    p.copy_(g)
                    p.grad = delta[at:at + p.numel()].view_as(p).clone()
                    at += p.numel()
            outer.step()
            outer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for g, p in zip(glob, params):
                    g.copy_(p)
    return _flat(model)


def _streaming_by_hand(comm: Comm, steps: int, fragments: int, tau: int, alpha: float
                       ) -> torch.Tensor:
    """Algorithm 2 of arXiv 2501.18512 written out directly: fragment p (layers l = p mod P)
    sends theta_g,p - theta_p at t_p - tau (t_p = (p + 1) H / P mod H), and at t_p takes
    theta_g,p <- OuterOpt(theta_g,p, mean delta), theta_p <- alpha theta_p + (1 - alpha)
    theta_g,p; the outer optimizer Nesterov SGD (lr 0.7, momentum 0.9) per fragment, by hand."""
    model = _model()
    params = list(model.parameters())
    layer = [i // 2 for i in range(len(params))]  # weight and bias of each Linear
    frag = [[i for i in range(len(params)) if layer[i] % fragments == p] for p in range(fragments)]
    inner = torch.optim.SGD(params, lr=LR, momentum=0.0)
    glob = [p.detach().clone() for p in params]
    mom = [torch.zeros_like(p) for p in params]
    sent: dict[int, list[torch.Tensor]] = {}
    for t in range(1, steps + 1):
        _inner_step(model, inner, comm.rank, t - 1)
        for p in range(fragments):
            tp = (p + 1) * H // fragments % H
            with torch.no_grad():
                if t % H == (tp - tau) % H:
                    sent[p] = []
                    for i in frag[p]:
                        d = glob[i] - params[i]
                        comm.all_reduce(d, op="avg")
                        sent[p].append(d)
                if t % H == tp:
                    for i, d in zip(frag[p], sent.pop(p)):
                        mom[i].mul_(0.9).add_(d)
                        glob[i].sub_(0.7 * (d + 0.9 * mom[i]))
                        params[i].mul_(alpha).add_((1 - alpha) * glob[i])
    return _flat(model)


def _runs(comm: Comm) -> dict[str, Any]:
    steps = 3 * H
    return {
        "default": _run(comm, _cfg(), steps),
        "explicit": _run(comm, _cfg(fragments=1, delay=0, alpha=0.0), steps),
        "old": _diloco_2023(comm, steps),
        "stream": _run(comm, _cfg(fragments=2, delay=1, alpha=0.5), steps),
        "stream_hand": _streaming_by_hand(comm, steps, 2, 1, 0.5),
        "fp4": _run(comm, _cfg(fragments=2, delay=1, compressor="fp4:chunk=64"), steps + 1),
        "int8": _run(comm, _cfg(period=6, fragments=3, delay=1, compressor="int8"), steps - 1),
    }


@pytest.fixture(scope="module")
def world2() -> list[dict[str, Any]]:
    return run_workers(_runs, 2, timeout=240)


def test_one_fragment_is_diloco_bit_for_bit(world2: list[dict[str, Any]]) -> None:
    """Guards the reduction to DiLoCo: one fragment, no delay, alpha 0, no codec equals the
    2023 outer loop exactly, on both ranks."""
    for out in world2:
        assert torch.equal(out["default"]["params"], out["old"])
        assert torch.equal(out["explicit"]["params"], out["old"])


def test_fragments_overlap_and_merge_against_algorithm_2(world2: list[dict[str, Any]]) -> None:
    """Guards strided fragments, the tau-step overlap and the alpha merge against the paper's
    algorithm written out by hand. Tolerance: per-tensor against one flat all-reduce and torch's
    Nesterov SGD against the hand formula differ by a rounding per operation (|theta| < 2:
    ~1e-7), far below the 1e-3 the streaming run differs from plain DiLoCo."""
    for out in world2:
        assert torch.allclose(out["stream"]["params"], out["stream_hand"], rtol=0, atol=2e-6)
        assert float((out["stream"]["params"] - out["old"]).abs().max()) > 1e-3


def test_traffic_formula_equals_the_ledger(world2: list[dict[str, Any]]) -> None:
    """Guards the planner's view of Streaming DiLoCo: bytes sent and handed to collectives on
    every rank equal the method's traffic formula (fragments, an exchange issued and not yet
    merged, 4- and 8-bit codecs), and ranks agree on the parameters where they must."""
    layout = Layout.of_model(_model())
    entry = METHODS.get("diloco")
    cases = {"stream": (_cfg(fragments=2, delay=1, alpha=0.5), 3 * H),
             "fp4": (_cfg(fragments=2, delay=1, compressor="fp4:chunk=64"), 3 * H + 1),
             "int8": (_cfg(period=6, fragments=3, delay=1, compressor="int8"), 3 * H - 1),
             "default": (_cfg(), 3 * H)}
    for name, (cfg, steps) in cases.items():
        traffic = entry.traffic(layout, cfg.method.options, 2, steps, 0, 0)
        for rank, out in enumerate(world2):
            assert out[name]["sent"] == traffic.sent[rank], name
            assert out[name]["payload"] == traffic.payload[rank], name
    d = layout.numel
    assert world2[0]["default"]["ledger"] == [("all_reduce", "average", 4 * d)] * 3
    # fp4: 4 bits an element plus a scale per 64, per fragment, all-gathered
    fp4 = [op for op, _, _ in world2[0]["fp4"]["ledger"]]
    assert set(fp4) == {"all_gather"} and len(fp4) == 7  # 3 rounds x 2 fragments, 1 in flight
    assert torch.equal(world2[0]["default"]["params"], world2[1]["default"]["params"])


def test_checkpoint_with_an_exchange_in_flight_resumes_exactly() -> None:
    """Guards Streaming DiLoCo's checkpoint state: taken between a fragment's send and its merge
    (the mean waited for and saved), with fp4's error-feedback residuals, a resumed run
    continues bit for bit."""
    comm = Comm.local()
    cfg = _cfg(fragments=2, delay=1, alpha=0.5, compressor="fp4")
    a, model_a = _strategy(comm, cfg)
    for step in range(5):  # step 5 sends fragment 0, merged at step 6
        a.train_step(_batch(0, step), step)
    assert a.wrapper._pending is not None
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert state["diloco"]["pending"]["fragment"] == 0
    b, model_b = _strategy(comm, cfg)
    b.load_state_dict(state)
    for step in range(5, 11):
        a.train_step(_batch(0, step), step)
        b.train_step(_batch(0, step), step)
    assert torch.equal(_flat(model_a), _flat(model_b))


def test_fragments_are_strided_over_layers_and_bad_settings_are_one_line() -> None:
    """Guards step a's pattern and the checks: layer l in fragment l mod P; too many fragments
    for the layers or for the period, a delay of a whole stagger are refused in one line; a
    period P does not divide staggers the merges by floor((p + 1) H / P)."""
    names = [f"blocks.{i}.{w}" for i in range(5) for w in ("a.weight", "b.bias")]
    names = ["emb.weight", *names, "head.weight"]
    frags = strided_fragments(names, 3)
    # layers: emb, blocks.0..4, head = 7 layers -> 0,3,6 / 1,4 / 2,5
    assert frags[0] == [0, 5, 6, 11] and frags[1] == [1, 2, 7, 8] and frags[2] == [3, 4, 9, 10]
    with pytest.raises(UsageError, match="exceeds"):
        strided_fragments(names, 8)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match="exceeds sync_every"):
        DiLoCo(model, opt, opt, 1, comm=Comm.local(), fragments=2)
    with pytest.raises(UsageError, match="delay"):
        DiLoCo(model, opt, opt, 4, comm=Comm.local(), fragments=2, delay=2)
    with pytest.raises(UsageError, match="exactly once"):
        DiLoCo(model, opt, opt, 4, comm=Comm.local(), fragments=[model.layers[0]])
    from thinwire.options import OptionError
    from thinwire.strategies.diloco import merge_step

    assert [merge_step(p, 4, 10) for p in range(4)] == [2, 5, 7, 0]
    with pytest.raises(OptionError, match="method.fragments"):
        _cfg(period=2, fragments=3)

    with pytest.raises(OptionError, match="method.delay"):
        _cfg(fragments=2, delay=2)

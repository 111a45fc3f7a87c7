"""One codec interface for every slot: each codec of the registry is built and round-trips its
exact bytes in every slot it names, and is refused in one line (the option, the slot, the
codecs the slot takes) in every other; SparseLoCo's and DeMo's codecs are registry entries."""

from __future__ import annotations

import pytest
import torch

from thinwire.compression import CODECS, SLOTS, Site, build, check_codec, slot_codecs
from thinwire.compression.base import from_bytes, to_bytes
from thinwire.options import OptionError

SHAPE = (4, 6, 10)
OPTIONS = {"topk": "topk:ratio=0.1", "randk": "randk:ratio=0.1", "lowrank": "lowrank:rank=2",
           "topk2bit": "topk2bit:chunk=32,topk=4", "dcttopk": "dcttopk:chunk=8,topk=4"}
CASES = [(slot, name) for slot in SLOTS for name in CODECS.names()]


def _site(step: int = 0) -> Site:
    return Site(step, 1, torch.tensor([11, 12, 13, 14]))


@pytest.mark.parametrize("slot, name", CASES)
def test_every_codec_goes_in_its_slots_and_is_refused_in_one_line_elsewhere(slot: str,
                                                                          name: str) -> None:
    spec = OPTIONS.get(name, name)
    where = f"method.option_of_{slot}"
    if slot not in CODECS.get(name).slots:
        with pytest.raises(OptionError) as err:
            check_codec(spec, where, slot=slot)
        text = str(err.value)
        assert "\n" not in text and text.startswith(f"{where}: codec {name} does not go on")
        assert SLOTS[slot].carries in text
        assert text.endswith(f"{where} takes {', '.join(slot_codecs(slot))}")
        assert name not in slot_codecs(slot)
        return
    check_codec(spec, where, slot=slot)
    sender, receiver = build(spec, seed=3, slot=slot), build(spec, seed=3, slot=slot)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    for step in range(2):  # state (residuals, errors, histories) carried to the next step
        wire = to_bytes(sender.encode_tensor(x + step, _site(step)))
        assert wire.numel() == sender.tensor_bytes(SHAPE)
        if name != "none":
            assert wire.numel() < 4 * x.numel(), (name, slot)
        y = receiver.decode_tensor(from_bytes(wire, receiver.tensor_spec(SHAPE)), SHAPE,
                                   _site(step))
        assert y.shape == SHAPE and bool(torch.isfinite(y).all())


def test_error_feedback_starts_as_its_slot_says() -> None:
    assert build("int4").describe() == "int4(chunk=128,ef)"
    assert build("int4", slot="act").describe() == "int4(chunk=128)"
    assert build("int4:ef=true", slot="actgrad").describe() == "int4(chunk=128,ef)"
    assert build("topk2bit", slot="tp").describe() == "topk2bit(chunk=4096,topk=64,ef)"


@pytest.mark.parametrize("slot", [s for s in SLOTS if not SLOTS[s].averaged])
def test_the_scattered_exchange_is_refused_where_nothing_is_averaged(slot: str) -> None:
    with pytest.raises(OptionError) as err:
        check_codec("int8:exchange=scatter", "method.x", slot=slot)
    assert "\n" not in str(err.value) and "--method.compressor" in str(err.value)
    for averaged in (s for s in SLOTS if SLOTS[s].averaged):
        check_codec("int8:exchange=scatter", "method.x", slot=averaged)


def test_shaped_codecs_keep_their_state_in_state_dict() -> None:
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2))
    for spec, slot in (("lowrank:rank=2", "actgrad"), ("aqsgd:bits=8", "act")):
        a = build(spec, seed=1, slot=slot)
        a.encode_tensor(x, _site())
        b = build(spec, seed=1, slot=slot)
        b.load_state_dict(a.state_dict())
        assert a.state_dict() and all(torch.equal(a.state_dict()[k], b.state_dict()[k])
                                      for k in a.state_dict())
        assert torch.equal(to_bytes(a.encode_tensor(x + 1, _site())),
                           to_bytes(b.encode_tensor(x + 1, _site())))


def test_dcttopk_keeping_every_coefficient_is_exact_and_keeps_the_largest() -> None:
    x = torch.randn(16, 12, generator=torch.Generator().manual_seed(3))
    full = build("dcttopk:chunk=4,topk=16", ef=False)  # 4 x 4 blocks, all 16 kept
    torch.testing.assert_close(full.decode_tensor(full.encode_tensor(x, Site(0)), x.shape,
                                                  Site(0)), x, rtol=1e-5, atol=1e-5)
    few = build("dcttopk:chunk=4,topk=3", ef=False)
    idx, val = few.encode_tensor(x, Site(0))
    assert idx.dtype == torch.int16 and val.numel() == 12 * 3 == few.tensor_spec(x.shape)[1].numel
    coef = few.coefficients(x.shape, x.device)
    few.add_coefficients((idx, val), coef)
    assert torch.equal(few.inverse(coef, x.shape), few.decode_tensor((idx, val), x.shape, Site(0)))


def test_sparseloco_and_demo_encode_with_registered_codecs() -> None:
    from thinwire.runtime.comm import Comm
    from thinwire.strategies.demo import DeMo
    from thinwire.strategies.sparseloco import SparseLoCo

    net = torch.nn.Linear(8, 4)
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    with SparseLoCo(net, inner, 2, comm=Comm.local(), chunk=16, topk=2) as loco:
        assert loco.codec.describe() == build("topk2bit:chunk=16,topk=2,ef=false").describe()
    with DeMo(net.parameters(), lr=0.1, topk=3, chunk=4, comm=Comm.local()) as demo:
        assert demo.codec.describe() == build("dcttopk:chunk=4,topk=3,ef=false").describe()

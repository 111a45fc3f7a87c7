"""IST's local steps K are resolved in one place (``strategies/ist/method.py``'s
``local_steps``): the config's period, the entry's ``for_model``, the traffic formula and the
planner agree on the model's K, and a set K wins everywhere."""

from __future__ import annotations

import pytest

from thinwire.config import load
from thinwire.errors import UsageError
from thinwire.models.adapter import ISTAdapter, ISTPlan
from thinwire.models.resnet import ResISTAdapter
from thinwire.strategies import METHODS
from thinwire.strategies.entry import ModelDefaults
from thinwire.strategies.ist.method import Options, local_steps, local_steps_of

RESNET = {"method.name": "ist", "model.name": "resnet", "data.name": "digits",
          "model.widths": "4,8", "model.blocks": "1,1", "runtime.workers": "2"}


def test_every_form_of_the_model_gives_its_k() -> None:
    auto, seven = Options(), Options(local_steps=7)
    plan = ISTPlan(groups=(), tensors=(), default_local_steps=50)
    for model, k in ((None, 10), (print, 10), (ISTAdapter, 10), (ResISTAdapter, 50),
                     (plan, 50)):
        assert local_steps(auto, model) == k, model
        assert local_steps(seven, model) == 7, model
    entry = METHODS.get("ist")
    assert isinstance(entry, ModelDefaults)
    assert entry.for_model(auto, ResISTAdapter) == Options(local_steps=50)
    assert entry.for_model(seven, ResISTAdapter) == seven


def test_the_config_aligns_to_the_models_k() -> None:
    cfg = load(None, {**RESNET, "train.steps": "100", "train.eval_every": "50"})
    assert local_steps_of(cfg) == 50 and cfg.sync_every == 50
    hybrid = load(None, {**RESNET, "train.steps": "300", "train.eval_every": "150",
                         "method.switch_at": "150", "method.period": "30"})
    assert hybrid.sync_every == 150  # lcm(K = 50, H = 30)
    with pytest.raises(UsageError, match=r"train.steps: 120 is not a multiple of 50"):
        load(None, {**RESNET, "train.steps": "120", "train.eval_every": "0"})
    set_k = load(None, {**RESNET, "train.steps": "120", "train.eval_every": "60",
                        "method.local_steps": "12"})
    assert local_steps_of(set_k) == 12 and set_k.sync_every == 12

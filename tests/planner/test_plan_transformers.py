"""``thinwire plan --model CONFIG`` for a Hugging Face ``transformers`` config (a
``config.json`` or its folder): the model is built from the config with fresh weights (nothing
downloaded), its IST plan derived from the example input (traced by torch.export), and IST's
bytes are the ``ist`` method's traffic formula on that plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from thinwire.cli import main
from thinwire.planner.methods import OPTIMIZER_STATES
from thinwire.planner.usermodel import example_input, load_module, model_spec_from_example
from thinwire.strategies.ist.method import Options, ist_traffic

transformers.logging.set_verbosity_error()


@pytest.fixture
def gpt2_config(tmp_path: Path) -> Path:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    return tmp_path


def _steady(plan, k: int, n: int, states: int, **options) -> float:  # noqa: ANN001, ANN003
    o = Options(local_steps=k, **options)
    one, two = (ist_traffic(plan, o, n, s, 0, states) for s in (k, 2 * k))
    return max((b - a) / k for a, b in zip(one.sent, two.sent))


def test_a_transformers_config_is_priced_from_its_derived_plan(gpt2_config: Path,
                                                               capsys) -> None:
    module = load_module(str(gpt2_config / "config.json"))
    assert isinstance(module, transformers.GPT2LMHeadModel)
    spec = model_spec_from_example(module, example_input((4, 16), tokens=64), min_units=2)
    assert [g.size for g in spec.ist.groups] == [4, 128, 4, 128]  # heads, FFN neurons
    assert main(["plan", "--cluster", "cpu-1gbe", "--devices", "2", "--json", "--model",
                 str(gpt2_config), "--input", "4x16", "--input-tokens", "64", "--method",
                 "ist:local_steps=2"]) == 0
    out = json.loads(capsys.readouterr().out)
    # the default deals Adam's two moments with their units (the plan's optimizer_state auto)
    adam = OPTIMIZER_STATES["adam"]
    assert out["traffic_bytes"]["sync"] == pytest.approx(_steady(spec.ist, 2, 2, adam))
    assert main(["plan", "--cluster", "cpu-1gbe", "--devices", "2", "--json", "--model",
                 str(gpt2_config), "--input", "4x16", "--input-tokens", "64", "--method",
                 "ist:local_steps=2,overlap=1,optimizer_state=reset"]) == 0
    published = json.loads(capsys.readouterr().out)["traffic_bytes"]["sync"]
    assert published == pytest.approx(_steady(spec.ist, 2, 2, adam, overlap=1,
                                              optimizer_state="reset"))
    assert out["traffic_bytes"]["sync"] == pytest.approx((1 + adam) * published)


def test_a_config_transformers_cannot_build_is_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    assert main(["plan", "--cluster", "cpu-1gbe", "--devices", "2", "--model", str(tmp_path),
                 "--input", "4x16", "--input-tokens", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "transformers could not build it" in err, err

"""``thinwire train --help`` lists every choice from the registries: each codec under every
codec option, each model and dataset under ``--model`` / ``--data`` (nothing typed by hand, so a
new registry entry appears in the help)."""

from __future__ import annotations

import re

import pytest

from thinwire.cli import main
from thinwire.compression import CODECS, slot_codecs
from thinwire.data import DATASETS
from thinwire.models import MODELS
from thinwire.strategies.pipeline.codecs import BOTTLENECKS


@pytest.fixture
def help_text(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def _option_help(text: str, flag: str) -> str:
    """The help of option ``flag``: its line and the indented lines after it, joined."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(f"  {flag} "))
    out = [lines[i]]
    for line in lines[i + 1:]:
        if not line.startswith("    ") or line.lstrip().startswith("-"):
            break
        out.append(line)
    return re.sub(r"\s+", " ", " ".join(out))


@pytest.mark.parametrize("flag, slot, extra", [
    ("--method.compressor", "grad", ()), ("--method.codec", "tp", ()),
    ("--method.tp_codec", "tp", ()), ("--method.codec_fwd", "act", BOTTLENECKS),
    ("--method.codec_bwd", "actgrad", ()),
])
def test_every_codec_option_lists_every_codec_of_its_slot(help_text: str, flag: str, slot: str,
                                                          extra: tuple) -> None:
    found = _option_help(help_text, flag)
    takes = (*slot_codecs(slot), *extra)
    for name in takes:
        assert re.search(rf"\b{re.escape(name)}\b", found), (flag, name, found)
    refused = [n for n in CODECS.names() if n not in takes]
    if slot != "actgrad":  # lowrank goes on activation gradients only: not offered elsewhere
        assert "lowrank" in refused
    for name in refused:  # refused there: not offered
        assert not re.search(rf"\b{name}\b", found), (flag, name, found)


def test_model_and_data_options_list_every_entry(help_text: str) -> None:
    for flag, registry in (("--model NAME", MODELS), ("--data NAME", DATASETS)):
        found = _option_help(help_text, flag)
        for name in registry.names():
            assert name in found, (flag, name)

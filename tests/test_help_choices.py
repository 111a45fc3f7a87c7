"""``thinwire train --help`` lists every choice from the registries: each codec under every
codec option, each model and dataset under ``--model`` / ``--data`` (nothing typed by hand, so a
new registry entry appears in the help)."""

from __future__ import annotations

import re

import pytest

from thinwire.cli import main
from thinwire.compression import CODECS
from thinwire.data import DATASETS
from thinwire.models import MODELS
from thinwire.strategies.pipeline.codecs import BACKWARD_ONLY, BOTTLENECKS, OWN


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


@pytest.mark.parametrize("flag, extra", [
    ("--method.compressor", ()), ("--method.codec", ()), ("--method.tp_codec", ()),
    ("--method.codec_fwd", (*(n for n in OWN if n not in BACKWARD_ONLY), *BOTTLENECKS)),
    ("--method.codec_bwd", tuple(OWN)),
])
def test_every_codec_option_lists_every_codec(help_text: str, flag: str, extra: tuple) -> None:
    found = _option_help(help_text, flag)
    for name in (*CODECS.names(), *extra):
        assert re.search(rf"\b{re.escape(name)}\b", found), (flag, name, found)
    if flag == "--method.codec_fwd":  # refused there: not offered
        assert not any(re.search(rf"\b{n}\b", found) for n in BACKWARD_ONLY), found


def test_model_and_data_options_list_every_entry(help_text: str) -> None:
    for flag, registry in (("--model NAME", MODELS), ("--data NAME", DATASETS)):
        found = _option_help(help_text, flag)
        for name in registry.names():
            assert name in found, (flag, name)

"""`thinwire theory` end to end, and the experiment registry."""

import json
import textwrap

import pytest

from thinwire.cli import main
from thinwire.errors import UsageError
from thinwire.theory.experiments import default_registry

BUILTIN = ["interpolation", "heterogeneous", "homogeneous-vs-heterogeneous", "counterexample-2x2"]


def test_all_writes_figures_tables_and_numbers(tmp_path, capsys):
    assert main(["theory", "--all", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in BUILTIN:
        assert (tmp_path / f"{name}.md").read_text().startswith("## ")
        numbers = json.loads((tmp_path / f"{name}.json").read_text())
        assert numbers["figures"] and all(
            (tmp_path / f).stat().st_size > 10_000 for f in numbers["figures"]
        )
    assert len(list(tmp_path.glob("*.png"))) >= 4
    assert "| method | gamma |" in out and (tmp_path / "index.md").exists()
    het = json.loads((tmp_path / "heterogeneous.json").read_text())["numbers"]
    floor = het["IST scaled/floor"]
    assert 0.8 * floor <= het["IST scaled/plateau/0.02"] <= 1.25 * floor


def test_unknown_name_exits_2(tmp_path, capsys):
    assert main(["theory", "no-such-experiment", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no-such-experiment" in err and "interpolation" in err


@pytest.mark.parametrize("seed", ["-1", "abc", "1.5"])
def test_bad_seed_exits_2(tmp_path, seed, capsys):
    assert main(["theory", "counterexample-2x2", "--seed", seed, "--out", str(tmp_path)]) == 2
    assert "--seed" in capsys.readouterr().err


def test_nothing_selected_exits_2(tmp_path):
    assert main(["theory", "--out", str(tmp_path)]) == 2


def test_list_names_every_experiment(capsys):
    assert main(["theory", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in BUILTIN)


def test_one_experiment_by_name(tmp_path):
    assert main(["theory", "counterexample-2x2", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "counterexample-2x2.png").exists()
    assert not (tmp_path / "interpolation.png").exists()


def test_another_module_can_register_an_experiment(tmp_path, monkeypatch):
    (tmp_path / "extra_theory_exp.py").write_text(
        textwrap.dedent("""
        from thinwire.theory.registry import Experiment, ExperimentResult

        def _run(out_dir, seed):
            return ExperimentResult("extra", "Extra", "| a |\\n|---|\\n| 1 |", (), {"seed": seed})

        def register(registry):
            registry.register(Experiment("extra", "an experiment from elsewhere", _run))
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = default_registry(extensions=["extra_theory_exp"])
    assert registry.names() == BUILTIN + ["extra"]
    result = registry.get("extra").run(tmp_path, 3)
    assert result.numbers["seed"] == 3
    with pytest.raises(UsageError):
        registry.get("missing")
    with pytest.raises(ValueError):
        registry.register(registry.get("extra"))

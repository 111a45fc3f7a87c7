"""Experiment parameters of the theory lab and the options of `thinwire theory`.

Property-based (hypothesis): whatever is typed, the command either runs or answers with one
line on stderr and exit code 2, never a traceback; the parameter classes accept exactly what
their bounds allow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from thinwire.cli import main
from thinwire.errors import UsageError
from thinwire.theory import (
    exp_counterexample,
    exp_heterogeneous,
    exp_homogeneity,
    exp_interpolation,
    params,
)
from thinwire.theory.experiments import default_registry
from thinwire.theory.registry import Experiment, ExperimentResult

PARAMS = {
    "interpolation": exp_interpolation.Params,
    "heterogeneous": exp_heterogeneous.Params,
    "homogeneous-vs-heterogeneous": exp_homogeneity.Params,
    "counterexample-2x2": exp_counterexample.Params,
}
NAMES = list(PARAMS) + ["bridge", "bridge-batchnorm"]
FLAGS = sorted(
    {params.flag(n) for cls in PARAMS.values() for n in params.names(cls)} | {"--seed", "--seeds"}
)
# what a shell can pass: printable text without line breaks
TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), min_size=0, max_size=12
)
NUMBER = st.one_of(
    st.integers(-5, 50).map(str),
    st.floats(allow_nan=True, allow_infinity=True, width=32).map(repr),
    st.sampled_from(["1e400", "-0", "0.5", "1_0", " 3 ", "nan", "inf", "", "1,", ",", "10,20"]),
)
VALUE = st.one_of(NUMBER, TEXT, st.lists(NUMBER, min_size=1, max_size=4).map(",".join))


@contextlib.contextmanager
def captured() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        yield out, err


def fake_call(self: Experiment, out_dir: Path, parameters: object = None) -> ExperimentResult:
    """Stands in for a run: the property tests are about parsing, not about the experiments."""
    return ExperimentResult(self.name, self.name, "| a |\n|---|\n| 1 |", (), {})


def exit_code(argv: list[str]) -> tuple[int, str, str]:
    """main(argv) with stdout and stderr captured; argparse's SystemExit becomes its code."""
    with captured() as (out, err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


# --- the parameter classes ---------------------------------------------------------------------
def test_defaults_are_the_documented_runs():
    assert exp_interpolation.Params() == exp_interpolation.Params(
        n=10, q=(1, 2), gamma=0.5, iterations=300, level=1e-20, mc_rounds=6000, seeds=(0,)
    )
    het = exp_heterogeneous.Params()
    assert (het.n, het.q, het.heterogeneity, het.gammas) == (10, 1, 1.0, (1.0, 0.5, 0.1, 0.02))
    assert (het.iterations, het.tail, het.seeds) == (4000, 500, (0,))
    homo = exp_homogeneity.Params()
    assert homo.heterogeneity == (0.0, 0.25, 0.5, 0.75, 1.0)
    assert (homo.gamma, homo.iterations, homo.tail) == (0.5, 3000, 1000)
    two = exp_counterexample.Params()
    assert (two.a, two.b, two.gamma, two.iterations, two.grid) == (1.0, 4.0, 0.05, 25, 200)


def test_every_parameter_has_help_and_a_listing_line():
    for cls in PARAMS.values():
        for f in dataclasses.fields(cls):
            assert f.metadata["help"], f.name
        lines = params.describe(cls)
        assert len(lines) == len(params.names(cls))
        assert all(line.startswith("--") and "(default: " in line for line in lines[:-1])


def test_options_become_typed_parameters():
    p = params.from_options(
        exp_heterogeneous.Params,
        {
            "n": "4",
            "d": "8",
            "gammas": "1, 0.5,0.1",
            "seeds": "0,3",
            "iterations": "200",
            "tail": "50",
        },
    )
    assert (p.n, p.q, p.gammas, p.seeds, p.iterations) == (4, 2, (1.0, 0.5, 0.1), (0, 3), 200)
    i = params.from_options(exp_interpolation.Params, {"n": "5", "d": "5,10,15"})
    assert i.q == (1, 2, 3)
    c = params.from_options(exp_counterexample.Params, {"a": "2", "b": "10", "seed": "4"})
    assert (c.a, c.b, c.seed) == (2.0, 10.0, 4)


@pytest.mark.parametrize(
    "cls,given,words",
    [
        (exp_heterogeneous.Params, {"n": "10", "d": "15"}, ["--d 15", "d = q n", "--d 20"]),
        (exp_heterogeneous.Params, {"q": "2", "d": "30"}, ["--d 30", "--q 2", "d = q n"]),
        (exp_heterogeneous.Params, {"n": "30", "q": "2"}, ["d = q n", "60", "--q or --n"]),
        (exp_heterogeneous.Params, {"tail": "9000"}, ["--tail", "--iterations"]),
        (exp_heterogeneous.Params, {"gammas": "0.5,0.5"}, ["--gammas", "once"]),
        (exp_heterogeneous.Params, {"gammas": "3"}, ["--gammas", "<= 1"]),
        (exp_heterogeneous.Params, {"q": "1,2"}, ["--q", "one value"]),
        (exp_homogeneity.Params, {"heterogeneity": "0,1.5"}, ["--heterogeneity", "<= 1"]),
        (exp_interpolation.Params, {"n": "1"}, ["--n", ">= 2"]),
        (exp_interpolation.Params, {"level": "inf"}, ["--level", "finite"]),
        (exp_counterexample.Params, {"b": "1.5"}, ["--a", "--b", "sqrt(ab)"]),
        (exp_counterexample.Params, {"gamma": "0.3"}, ["--gamma", "diverges"]),
        (exp_counterexample.Params, {"n": "3"}, ["takes no --n", "--a"]),
    ],
)
def test_bad_options_name_the_option_and_the_fix(cls, given, words):
    with pytest.raises(UsageError) as info:
        params.from_options(cls, given)
    message = str(info.value)
    assert "\n" not in message and message.startswith(cls.experiment)
    for word in words:
        assert word in message


def test_python_construction_is_validated_too():
    with pytest.raises(UsageError, match="--n"):
        exp_heterogeneous.Params(n=0)
    with pytest.raises(UsageError, match="--gammas"):
        exp_heterogeneous.Params(gammas=())
    with pytest.raises(UsageError, match="--iterations"):
        exp_heterogeneous.Params(iterations=True)  # a bool is not an integer


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted(PARAMS)),
    options=st.dictionaries(
        st.sampled_from(
            [
                "n",
                "q",
                "d",
                "gamma",
                "gammas",
                "tail",
                "iterations",
                "seeds",
                "seed",
                "a",
                "b",
                "grid",
                "heterogeneity",
                "ridge",
                "level",
                "mc_rounds",
                "nonsense",
            ]
        ),
        VALUE,
        max_size=4,
    ),
)
def test_any_option_text_gives_parameters_or_one_line_usage_error(name, options):
    cls = PARAMS[name]
    try:
        p = params.from_options(cls, options)
    except UsageError as exc:
        assert "\n" not in str(exc) and str(exc).strip()
        return
    assert isinstance(p, cls)
    assert set(options) <= set(params.names(cls))


# --- the command line --------------------------------------------------------------------------
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    names=st.lists(st.sampled_from(NAMES + ["no-such", "--all", "--list"]), max_size=3),
    options=st.lists(st.tuples(st.sampled_from(FLAGS), VALUE), max_size=3),
)
def test_the_command_never_shows_a_traceback(tmp_path, names, options):
    argv = ["theory", *names]
    for flag, value in options:
        argv += [flag, value]
    argv += ["--out", str(tmp_path / "out")]
    with mock.patch.object(Experiment, "__call__", fake_call):
        code, _, err = exit_code(argv)
    assert code in (0, 2), (argv, code, err)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "error:" in lines[0], (argv, err)
        assert "Traceback" not in err


def not_a_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return "," not in text
    return False


@pytest.fixture(scope="module")
def never_written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("theory") / "never"


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(PARAMS)),
    flag=st.sampled_from(["--n", "--q", "--d", "--iterations", "--seeds", "--gammas", "--tail"]),
    value=st.one_of(TEXT.filter(not_a_number), st.integers(-(10**6), 0).map(str)),
)
def test_bad_input_is_one_line_and_exit_2(never_written, name, flag, value):
    """Non-numbers, zero and negatives are wrong for each of these options (a seed may be 0,
    so only negatives are wrong for --seeds): nothing runs."""
    if flag == "--seeds":
        assume(not value.lstrip("+-").isdigit() or int(value) < 0)
    code, out, err = exit_code(["theory", name, flag, value, "--out", str(never_written)])
    assert code == 2 and not never_written.exists()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("thinwire theory: error:"), err
    assert out == ""


def test_options_not_taken_are_errors_not_ignored(tmp_path):
    code, _, err = exit_code(["theory", "counterexample-2x2", "--n", "5", "--out", str(tmp_path)])
    assert code == 2 and "counterexample-2x2 takes no --n" in err
    code, _, err = exit_code(["theory", "--all", "--gammas", "0.5", "--out", str(tmp_path)])
    assert code == 2 and "--gammas is not taken by" in err and "heterogeneous --gammas" in err
    code, _, err = exit_code(["theory", "bridge", "--iterations", "5", "--out", str(tmp_path)])
    assert code == 2 and "bridge takes no --iterations" in err
    code, _, err = exit_code(["theory", "heterogeneous", "--seed", "1", "--seeds", "2"])
    assert code == 2 and "--seed or --seeds" in err
    assert not list(tmp_path.iterdir())  # validated before anything ran


def test_seed_reaches_every_experiment():
    registry = default_registry()
    for name in PARAMS:
        p = registry.get(name).parameters({}, 7)
        assert getattr(p, "seeds", None) == (7,) or getattr(p, "seed", None) == 7
    assert registry.get("bridge").parameters({}, 7) == 7
    assert registry.get("bridge").parameters({}, None) == 0


def test_list_shows_every_option_with_its_default(capsys):
    assert main(["theory", "--list"]) == 0
    out = capsys.readouterr().out
    for name, cls in PARAMS.items():
        assert name in out
        for f in dataclasses.fields(cls):
            assert params.flag(f.name) in out
    assert "(default: 1,0.5,0.1,0.02)" in out and "--d V" in out

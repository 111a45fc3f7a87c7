"""Convergence as data and the crossover by target, on hand-built runs with known crossings."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conv_runs import ramp, write_run
from hypothesis import given, settings
from hypothesis import strategies as st

from thinwire.cli import main
from thinwire.errors import UsageError
from thinwire.planner import convergence as cv
from thinwire.planner.crossover import priced, times_at, winner, winner_ranges
from thinwire.planner.insight import BASELINE, step_at
from thinwire.planner.presets import load_cluster, load_model
from thinwire.planner.strategy import StrategySpec

DP, LOCAL, IST = {"name": "dp"}, {"name": "localsgd", "period": 10}, {"name": "ist"}


@pytest.fixture()
def runs(tmp_path):
    """dp reaches 0.80 at step 50 and 0.85 at 90; local SGD at 60 and 120; IST 0.80 at 140,
    never 0.85. Two dp runs (40 and 60 to 0.80) pool to 50."""
    write_run(tmp_path / "a" / "dp", DP, ramp({0.80: 40, 0.85: 90}, 150))
    write_run(tmp_path / "b" / "dp", DP, ramp({0.80: 60, 0.85: 90}, 150))
    write_run(tmp_path / "a" / "localsgd", LOCAL, ramp({0.80: 60, 0.85: 120}, 150))
    write_run(tmp_path / "a" / "ist", IST, ramp({0.80: 140}, 150))
    return tmp_path


def test_fit_gives_known_steps_factors_and_does_not_reach(runs):
    conv = cv.from_runs([runs], targets=[0.80, 0.85])
    assert conv.baseline == "dp" and conv.methods[0].spec == "dp"
    assert conv.steps("dp", 0.80) == 50 and conv.method("dp").runs == 2
    assert conv.steps("localsgd", 0.80) == 60 and conv.factor("localsgd", 0.80) == pytest.approx(1.2)
    assert conv.factor("ist", 0.80) == pytest.approx(2.8)
    assert conv.steps("ist", 0.85) is None and conv.factor("ist", 0.85) is None
    assert conv.factor("localsgd", 0.85) == pytest.approx(120 / 90)
    # a run that reached beside one that did not: the mean of those that did
    write_run(runs / "c" / "ist", IST, ramp({0.80: 100, 0.85: 150}, 150))
    again = cv.from_runs([runs], targets=[0.80, 0.85])
    assert again.steps("ist", 0.80) == 120 and again.steps("ist", 0.85) == 150


def test_spec_of_keeps_only_non_default_options():
    assert cv.spec_of({"name": "dp"}) == "dp"
    assert cv.spec_of({"name": "localsgd", "period": 10}) == "localsgd"  # its default
    assert cv.spec_of({"name": "localsgd", "period": 20}) == "localsgd:period=20"
    from thinwire.planner.methods import resolve

    assert resolve(cv.spec_of({"name": "localsgd", "period": 20})).sync_every == 20
    with pytest.raises(UsageError, match="not registered"):
        cv.spec_of({"name": "nosuchmethod"})


def test_json_round_trip_and_shipped_tables(runs, tmp_path):
    conv = cv.from_runs([runs], targets=[0.80, 0.85], provenance="thinwire bench ...")
    back = cv.from_json(json.loads(json.dumps(conv.to_json())))
    assert back == conv
    with pytest.raises(UsageError, match="not a convergence table"):
        cv.from_json({"methods": 3})
    for name in cv.shipped():
        table = cv.load([name])
        assert table.provenance.startswith(("thinwire ", "python ")), name
        assert table.baseline and table.targets


def test_runs_of_different_tasks_are_refused(tmp_path):
    write_run(tmp_path / "x", DP, ramp({0.8: 10}, 20))
    write_run(tmp_path / "y", DP, ramp({0.8: 10}, 20), data="digits")
    with pytest.raises(UsageError, match="different tasks"):
        cv.from_runs([tmp_path])


def test_default_targets_are_reached_by_the_runs_that_set_them(runs):
    conv = cv.from_runs([runs])
    common = min(m.best for m in conv.methods)
    assert all(conv.steps("dp", t) is not None for t in conv.targets)
    assert any(t <= common for t in conv.targets)
    assert all(conv.steps("ist", t) is not None for t in conv.targets if t <= common)


def _setting():
    model = load_model("mlp-784-2048-2048-10")
    cluster = load_cluster("cpu-1gbe").with_devices(4)
    base = StrategySpec(dp=4, micro_batch_size=128)
    return model, cluster, base


def _table(steps: dict[str, float | None], target: float = 0.8) -> cv.Convergence:
    methods = tuple(cv.MethodSteps(k, k, {target: s}, 1, 0.9, 200) for k, s in steps.items())
    return cv.Convergence("mlp-2048-2048", "fashion-mnist", "accuracy", True, (target,), methods,
                          "dp", 4, 128)


def test_time_is_step_time_times_steps_and_the_method_that_never_reaches_never_wins():
    model, cluster, base = _setting()
    ist = "ist:overlap=1,optimizer_state=reset"  # the published form: disjoint, state reset
    conv = _table({"dp": 50, "localsgd": 60, ist: None})
    p = priced(model, cluster, base, conv)
    assert p.labels["dp"] == BASELINE
    for w in (12.5e6, 1.25e9, 50e9):
        t = times_at(model, cluster, p, conv, 0.8, w)
        assert t["dp"] == pytest.approx(50 * step_at(model, cluster, p.variants["dp"], w))
        assert t["localsgd"] == pytest.approx(60 * step_at(model, cluster, p.variants["localsgd"],
                                                           w))
        assert t[ist] is None and winner(t) != ist
    # per step IST is the fastest of the three on every link: only its steps keep it out
    assert all(step_at(model, cluster, p.variants[ist], w)
               < step_at(model, cluster, p.variants["localsgd"], w) for w in (12.5e6, 50e9))
    assert winner({"a": None, "b": None}) is None


def test_winner_ranges_switch_where_the_times_cross():
    model, cluster, base = _setting()
    conv = _table({"dp": 50, "localsgd": 100, "ist": None})
    p = priced(model, cluster, base, conv)
    ranges = winner_ranges(model, cluster, p, conv, 0.8)
    assert [k for *_, k in ranges] == ["localsgd", "dp"]
    edge = ranges[0][1]
    t = times_at(model, cluster, p, conv, 0.8, edge)
    assert t["localsgd"] == pytest.approx(t["dp"], rel=1e-6)
    below = times_at(model, cluster, p, conv, 0.8, edge / 2)
    assert below["localsgd"] < below["dp"]
    # with 3x the steps for local SGD, DP wins from a thinner link on
    three = _table({"dp": 50, "localsgd": 150})
    slower = winner_ranges(model, cluster, priced(model, cluster, base, three), three, 0.8)
    assert slower[0][1] < edge


def test_cli_fit_table_and_crossover_by_target(runs, tmp_path, capsys):
    out = tmp_path / "conv.json"
    assert main(["plan", "--convergence", str(runs), "--target", "0.8,0.85", "--out",
                 str(out)]) == 0
    text = capsys.readouterr().out
    assert "does not reach" in text and "2.8x dp" in text and f"wrote {out}" in text
    saved = json.loads(out.read_text())
    assert saved["fit_command"].startswith("thinwire plan --convergence")
    args = ["plan", "--model", "mlp-784-2048-2048-10", "--cluster", "cpu-1gbe", "--devices",
            "4", "--crossover", "--convergence", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "Time to accuracy 0.85" in text and "fastest to accuracy 0.85:" in text
    assert "every link" not in text and "Per step (not time to a target)" in text
    line85 = next(ln for ln in text.splitlines() if ln.startswith("100 Mb/s")
                  and "does not reach" in ln)
    assert "ist" not in line85.split()[-1]
    assert main([*args, "--target", "0.8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (block,) = data["to_target"]
    assert block["target"] == 0.8 and block["steps"]["ist"] == 140
    for row in block["rows"]:
        reached = {k: v for k, v in row["seconds"].items() if v is not None}
        assert row["winner"] == min(reached, key=reached.get)


@pytest.mark.parametrize("extra, message", [
    (["--target", "0.9"], "has steps for"),
    (["--target", "abc"], "--target 'abc'"),
])
def test_cli_bad_targets_are_one_line(runs, tmp_path, capsys, extra, message):
    out = tmp_path / "conv.json"
    cv_table = cv.from_runs([runs], targets=[0.8])
    out.write_text(json.dumps(cv_table.to_json()))
    assert main(["plan", "--model", "mlp-784-2048-2048-10", "--cluster", "cpu-1gbe",
                 "--crossover", "--convergence", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_target_without_convergence_and_missing_sources_are_refused(tmp_path, capsys):
    for argv in (["plan", "--model", "mlp-784-2048-2048-10", "--cluster", "cpu-1gbe",
                  "--crossover", "--target", "0.8"],
                 ["plan", "--convergence", str(tmp_path / "nothing")]):
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--target needs --convergence" in err and "no such run directory" in err


def test_per_step_prose_says_per_step(capsys):
    assert main(["plan", "--model", "mlp-784-2048-2048-10", "--cluster", "cpu-1gbe", "--devices",
                 "4", "--crossover"]) == 0
    text = capsys.readouterr().out
    assert "every link" not in text and "per step" in text and "--convergence" in text


def test_unpriced_methods_are_named_not_dropped_silently():
    model = load_model("gpt2-small")
    cluster = load_cluster("cpu-1gbe").with_devices(4)
    conv = dataclasses.replace(_table({"dp": 50, "ist": 80}))
    p = priced(model, cluster, StrategySpec(dp=4, micro_batch_size=1), conv)
    assert "ist" in p.unpriced and "dp" in p.variants


_json = st.recursive(st.none() | st.booleans() | st.floats(allow_nan=True) | st.integers()
                     | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
_keys = st.sampled_from(["family", "dataset", "metric", "higher_is_better", "targets", "methods",
                         "spec", "label", "steps", "runs", "best", "steps_run"])


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(_keys, _json, max_size=8))
def test_a_damaged_table_is_a_usage_error_never_a_traceback(d):
    try:
        cv.from_json(d)
    except UsageError as exc:
        assert "not a convergence table" in str(exc)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=20))
def test_target_text_parses_or_is_one_line(text):

    from thinwire.planner.modes import _targets

    try:
        values = _targets(text)
    except UsageError as exc:
        assert "--target" in str(exc)
    else:
        assert all(isinstance(v, float) for v in values)

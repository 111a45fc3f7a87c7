"""Property-based fuzzing (hypothesis) of the checkpoint format and the report inputs.

Each generated case must load cleanly or fail with one line (a UsageError: exit code 2 on the
command line), never another exception or a traceback, and must leave the directory exactly as
it was. 150 cases per property, a few seconds in all; hypothesis shrinks any failure to a
minimal input and prints it."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from ckpt_cases import write_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from report_cases import records, summary, write_report_run

from thinwire import checkpoint
from thinwire.errors import UsageError
from thinwire.report.tables import compare_table, load_run

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>")
            for p in sorted(root.rglob("*"))}


def expect_one_line_or_ok(fn: Any) -> Any:
    try:
        return fn()
    except UsageError as exc:
        msg = str(exc)
        assert msg and "\n" not in msg and "Traceback" not in msg, msg
        return None


# --- checkpoint files ---------------------------------------------------------------------------
def _reference_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        run = write_run(Path(d), steps=(10,))
        return (checkpoint.step_dir(run, 10) / "rank1.pt").read_bytes()


REF = _reference_bytes()

byte_edits = st.one_of(
    st.integers(0, len(REF)).map(lambda n: ("truncate", n)),
    st.binary(max_size=4096).map(lambda b: ("replace", b)),
    st.lists(st.tuples(st.integers(0, len(REF) - 1), st.integers(0, 255)), min_size=1,
             max_size=16).map(lambda flips: ("flip", flips)),
    st.tuples(st.integers(0, len(REF)), st.binary(min_size=1, max_size=64)).map(
        lambda t: ("insert", t)),
)

leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(),
                 st.text(max_size=8),
                 st.lists(st.floats(allow_nan=False, width=32), max_size=6).map(torch.tensor))
values = st.recursive(leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12)
wrong_states = st.one_of(
    values,
    st.fixed_dictionaries({"strategy": values, "trainer": values}),
    st.fixed_dictionaries({"strategy": st.dictionaries(st.text(max_size=4), values, max_size=3),
                           "trainer": st.dictionaries(st.sampled_from(
                               ["wall_s", "sent_bytes", "payload_bytes", "recv_bytes", "x"]),
                               values, max_size=5)}),
)


def _apply(data: bytes, edit: tuple[str, Any]) -> bytes:
    kind, arg = edit
    if kind == "truncate":
        return data[:arg]
    if kind == "replace":
        return bytes(arg)
    if kind == "flip":
        b = bytearray(data)
        for i, v in arg:
            b[i] = v
        return bytes(b)
    pos, blob = arg
    return data[:pos] + blob + data[pos:]


def _check_checkpoint(run: Path) -> None:
    before = snapshot(run)
    step = expect_one_line_or_ok(lambda: checkpoint.require_resumable(run, 2))
    if step is not None:  # it loaded: then it must be a usable thinwire state
        for r in range(2):
            s = checkpoint.load_rank(run, step, r, 2)
            assert isinstance(s["strategy"], dict) and isinstance(s["trainer"], dict)
    assert snapshot(run) == before


@FUZZ
@given(edit=byte_edits)
def test_fuzz_rank_file_bytes(edit: tuple[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as d:
        run = write_run(Path(d), steps=(5, 10))
        (checkpoint.step_dir(run, 10) / "rank1.pt").write_bytes(_apply(REF, edit))
        _check_checkpoint(run)


@FUZZ
@given(content=st.one_of(st.binary(max_size=40), st.text(max_size=20).map(str.encode),
                         st.integers(-5, 10**9).map(lambda n: f"{n}\n".encode())))
def test_fuzz_complete_file(content: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        run = write_run(Path(d), steps=(10,))
        (checkpoint.step_dir(run, 10) / "COMPLETE").write_bytes(content)
        _check_checkpoint(run)


@FUZZ
@given(obj=wrong_states)
def test_fuzz_types_inside_a_valid_torch_file(obj: Any) -> None:
    with tempfile.TemporaryDirectory() as d:
        run = write_run(Path(d), steps=(10,))
        torch.save(obj, checkpoint.step_dir(run, 10) / "rank0.pt")
        _check_checkpoint(run)


# --- report inputs ------------------------------------------------------------------------------
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10)


def _mutate_summary(draw: Any) -> bytes:
    s: Any = summary()
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from([("wall_s",), ("final",), ("final", "accuracy"),
                                     ("memory",), ("memory", "params_full"),
                                     ("memory", "params_held_max"), ("bytes",),
                                     ("bytes", "sent_per_worker_max"), ("label",),
                                     ("config",), ("config", "train")]))
        target = s
        for key in path[:-1]:
            target = target.setdefault(key, {}) if isinstance(target, dict) else {}
        if isinstance(target, dict):
            if draw(st.booleans()):
                target.pop(path[-1], None)
            else:
                target[path[-1]] = draw(json_values)
    return json.dumps(s).encode()


@st.composite
def summary_bytes(draw: Any) -> bytes:
    good = json.dumps(summary()).encode()
    return draw(st.one_of(
        st.builds(lambda n: good[:n], st.integers(0, len(good))),
        st.binary(max_size=200),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.just(None).map(lambda _: _mutate_summary(draw)),
    ))


@st.composite
def metrics_bytes(draw: Any) -> bytes:
    good = "".join(json.dumps(r) + "\n" for r in records()).encode()
    line = st.one_of(json_values.map(json.dumps),
                     st.fixed_dictionaries({"kind": st.sampled_from(["train", "eval", "x"])},
                                           optional={"step": json_values,
                                                     "accuracy": json_values,
                                                     "loss": json_values}).map(json.dumps),
                     st.text(max_size=20))
    return draw(st.one_of(
        st.builds(lambda n: good[:n], st.integers(0, len(good))),
        st.binary(max_size=200),
        st.lists(line, max_size=5).map(lambda ls: "\n".join(ls).encode()),
    ))


@FUZZ
@given(s=summary_bytes(), m=metrics_bytes())
def test_fuzz_report_inputs(s: bytes, m: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        run = write_report_run(Path(d) / "dp")
        (run / "summary.json").write_bytes(s)
        (run / "metrics.jsonl").write_bytes(m)
        before = snapshot(Path(d))
        loaded = expect_one_line_or_ok(lambda: load_run(run))
        if loaded is not None:  # it loaded: the table must render
            assert "|" in compare_table([loaded])
        assert snapshot(Path(d)) == before


def test_fuzzing_runs_enough_cases() -> None:
    assert FUZZ.max_examples >= 100

"""Extreme-classification data: the XC Repository's format (files written here), the synthetic
generator's determinism and best precision, Shakespeare's words, and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thinwire.cli import main
from thinwire.data import DATASETS
from thinwire.data.registry import DataSource
from thinwire.data.shakespeare_words import find_plays
from thinwire.data.task import TASKS, multilabel_nll, precision_at
from thinwire.data.xc import RepoOptions, SynthOptions, parse_xc
from thinwire.errors import UsageError

ROWS = st.lists(st.tuples(st.lists(st.integers(0, 19), min_size=1, max_size=4, unique=True),
                          st.dictionaries(st.integers(0, 49),
                                          st.floats(0.0625, 10, allow_nan=False, width=32),
                                          max_size=6)), min_size=1, max_size=8)


def _write(path: Path, rows: list[tuple[list[int], dict[int, float]]]) -> None:
    lines = [f"{len(rows)} 50 20"]
    lines += [",".join(map(str, lab)) + " " + " ".join(f"{f}:{v!r}" for f, v in feats.items())
              for lab, feats in rows]
    path.write_text("\n".join(lines) + "\n")


@settings(max_examples=30, deadline=None)
@given(ROWS)
def test_xc_format_round_trip(tmp_path_factory: pytest.TempPathFactory,
                              rows: list[tuple[list[int], dict[int, float]]]) -> None:
    path = tmp_path_factory.mktemp("xc") / "train.txt"
    _write(path, rows)
    feats, labels, nf, nc = parse_xc(path)
    assert (nf, nc) == (50, 20) and len(feats) == len(rows)
    for (ids, vals), lab, (want_lab, want) in zip(feats, labels, rows):
        assert lab.tolist() == want_lab
        assert dict(zip(ids.tolist(), vals.tolist())) == pytest.approx(want)


def test_xc_repo_loader_and_errors(tmp_path: Path) -> None:
    rows = [([1, 3], {0: 1.0, 7: 0.5}), ([19], {49: 2.0}), ([2], {})]
    _write(tmp_path / "train.txt", rows)
    _write(tmp_path / "test.txt", rows[:2])
    entry = DATASETS.get("xc-repo")
    ds = entry.load(DataSource(dir=str(tmp_path)), RepoOptions(), 0)
    assert ds.kind == "extreme" and ds.num_classes == 20 and ds.x_train.shape == (3, 2, 2)
    assert ds.y_train[0].tolist() == [1, 3] and ds.y_train[1].tolist() == [19, -1]
    assert ds.x_train[0, 0].tolist() == [0, 7] and ds.x_train[0, 1].tolist() == [1.0, 0.5]
    bad = {"header": "3 50\n1 0:1\n", "line": "1 50 20\n1 0-1\n", "range": "1 50 20\n25 0:1\n",
           "short": "5 50 20\n1 0:1\n"}
    for what, text in bad.items():
        (tmp_path / "test.txt").write_text(text)
        with pytest.raises(UsageError) as exc:
            entry.load(DataSource(dir=str(tmp_path)), RepoOptions(), 0)
        assert "\n" not in str(exc.value) and "test.txt" in str(exc.value), what
    with pytest.raises(UsageError, match="not found"):
        entry.load(DataSource(dir=str(tmp_path)), RepoOptions(preset="amazon-670k"), 0)
    with pytest.raises(UsageError, match="--data.dir"):
        entry.load(DataSource(), RepoOptions(), 0)


def test_synthetic_is_deterministic_with_known_best_precision() -> None:
    entry = DATASETS.get("xc-synth")
    o = SynthOptions(labels=300, features=600, train=512, test=256)
    a, b = entry.load(DataSource(), o, 3), entry.load(DataSource(), o, 3)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, entry.load(DataSource(), o, 4).x_train)
    assert a.x_train.shape == (512, 2, 8) and a.num_classes == 300
    assert 0.5 < a.extra["best_p1"] <= 1 and a.extra["best_p5"] <= 0.6 + 1e-9
    # the primary label's prototype drives the features: noise-free data is easier
    easy = entry.load(DataSource(), SynthOptions(labels=300, features=600, train=512, test=256,
                                                 noise=0.05), 3)
    assert easy.extra["best_p1"] >= a.extra["best_p1"]


def test_best_precision_does_not_depend_on_its_memory_bound(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """The best precision is computed a few rows at a time where a chunk of 256 rows would hold
    too many cells (xc.BAYES_CELLS); the rows it takes at once change nothing."""
    import thinwire.data.xc as xc

    o = SynthOptions(labels=300, features=600, train=64, test=256)
    world = xc.make_synth(o, 3)
    whole = xc.bayes_precision(o, world)
    monkeypatch.setattr(xc, "BAYES_CELLS", 7 * 301)  # 7 rows a chunk
    assert xc.bayes_precision(o, world) == pytest.approx(whole, abs=1e-12)


def test_evaluation_batches_bound_their_logits() -> None:
    from thinwire.data.task import EVAL_LOGITS, eval_rows

    assert eval_rows(10) == eval_rows(60_000) == 1000  # narrow layers: unchanged
    assert eval_rows(1_000_000) == 67 and eval_rows(1_000_000) * 1_000_000 <= EVAL_LOGITS
    assert eval_rows(10**9) == 1


def test_extreme_task_loss_and_precision() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0, -2.0, -3.0], [0.0, 0.0, 5.0, 4.0, 1.0, 2.0]])
    labels = torch.tensor([[0, -1], [3, 5]])
    assert precision_at(logits, labels, 1).tolist() == [1.0, 0.0]
    assert precision_at(logits, labels, 5).tolist() == pytest.approx([0.2, 0.4])
    logp = torch.log_softmax(logits, 1)
    want = (-logp[0, 0] - (logp[1, 3] + logp[1, 5]) / 2) / 2
    assert float(multilabel_nll(logits, labels)) == pytest.approx(float(want))
    assert float(TASKS["extreme"].loss(logits, labels)) == pytest.approx(float(want))


def test_shakespeare_words(tmp_path: Path) -> None:
    assert len(find_plays()) == 42  # the installed package (make data installs it)
    (tmp_path / "a_gut.txt").write_text("To be, or not to be: that is the question.\n" * 10)
    (tmp_path / "b_gut.txt").write_text("O Romeo, Romeo! wherefore art thou Romeo?\n" * 10)
    entry = DATASETS.get("shakespeare-words")
    ds = entry.load(DataSource(dir=str(tmp_path)), entry.options(context=2), 0)
    vocab = ds.extra["vocab"]
    assert vocab == sorted(set(vocab)) and "romeo" in vocab and ds.num_classes == len(vocab)
    i = vocab.index
    assert ds.x_train[0, 0].tolist() == [i("to"), i("be")] and ds.y_train[0, 0] == i("or")
    assert ds.x_train.shape[1:] == (2, 2) and ds.y_train.shape[1] == 1
    assert len(ds.x_test) > 0
    with pytest.raises(UsageError, match="no \\*_gut.txt"):
        entry.load(DataSource(dir=str(tmp_path / "none")), entry.options(), 0)


@pytest.mark.parametrize(("args", "needle"), [
    (["--method.K", "0"], "method.K"),
    (["--train.momentum", "0.9", "--train.optimizer", "sgd"], "train.momentum"),
    (["--model.name", "mlp"], "xmlp"),
    (["--method.family", "minhash"], "method.family"),
    (["--data.name", "xc-repo"], "--data.dir"),
])
def test_bad_options_one_line(args: list[str], needle: str, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", "--method", "slide", "--workers", "2", "--out", str(tmp_path),
                 "--no-progress", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and needle in err, (code, err)

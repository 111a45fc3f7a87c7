"""The setup command: quiet when the data is there, one helpful line when it is not."""

from __future__ import annotations

from pathlib import Path

import pytest

from thinwire.data import setup


def test_found_prints_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(setup, "find_fashion_mnist", lambda data_dir=None: tmp_path)
    assert setup.main([]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and str(tmp_path) in out


def test_missing_without_apt_prints_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(setup, "find_fashion_mnist", lambda data_dir=None: None)
    monkeypatch.setattr(setup, "_can_apt", lambda: False)
    assert setup.main([]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert "not found" in out and "apt-get install dataset-fashion-mnist" in out


def test_missing_apt_fails_reports_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(setup, "find_fashion_mnist", lambda data_dir=None: None)
    monkeypatch.setattr(setup, "_can_apt", lambda: True)
    monkeypatch.setattr(setup, "_apt_install", lambda: "E: Unable to locate package")
    assert setup.main([]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "Unable to locate package" in out

"""Every registered method has a case of every kind in tests/method_cases.py, or says why not.

The registry-driven tests (resume, ledger, models, restart, device, CUDA) parametrise over
``METHODS.names()`` through that table, so a method added to the registry without cases would
otherwise run none of them silently."""

from __future__ import annotations

from method_cases import CASES, KINDS, Exempt, method_names, missing


def test_every_method_has_a_case_or_an_exemption_of_every_kind() -> None:
    assert not missing(), (
        "no test case for " + ", ".join(missing()) + ": add the method's entry to CASES in "
        "tests/method_cases.py (a case, or Exempt('why') for a kind it cannot have)")


def test_the_table_names_only_registered_methods_and_known_kinds() -> None:
    stale = sorted(set(CASES) - set(method_names()))
    assert not stale, f"tests/method_cases.py has cases for unregistered methods {stale}"
    for name, kinds in CASES.items():
        assert set(kinds) <= set(KINDS), (name, sorted(set(kinds) - set(KINDS)))


def test_every_exemption_says_why_and_every_method_is_checked_for_devices() -> None:
    for name, kinds in CASES.items():
        for kind, entry in kinds.items():
            if isinstance(entry, Exempt):
                assert len(entry.why.split()) >= 6, (name, kind, entry.why)
            elif kind == "gloo_cuda":
                assert entry is True, (name, entry)
            else:
                assert isinstance(entry, dict) and entry, (name, kind)
        # the device rule has no exemption: every method runs under it on CPU
        assert not isinstance(kinds.get("device"), Exempt), name

"""The one-line messages of :mod:`thinwire.models.graph`: each names the module or the model,
what the rules could not follow, and the fixes (mark it shared, register a rule, pass an
adapter)."""

from __future__ import annotations

from torch import nn

FIXES = "register a rule for it (docs/IST.md, 'Rules for other modules'), or pass an adapter " \
        "(docs/IST.md, 'Writing an adapter')"


def cannot_trace(model: nn.Module, where: str, module: nn.Module | None, reasons: str) -> str:
    """A forward neither tracer follows: ``where`` is the innermost module being traced."""
    name = f"{where} ({type(module).__name__}) of " if where else ""
    hatch = (f"pass shared=({where!r},) to keep it whole" if where else
             "keep the offending submodule whole with shared=(NAME,)")
    return f"IST cannot trace {name}{type(model).__name__} ({reasons}); {hatch}, {FIXES}"


def nothing_to_cut(model: nn.Module) -> str:
    return (f"IST found no unit to cut in {type(model).__name__}: every layer's outputs reach "
            "the model's output, a residual stream (kept whole; residual='channels' cuts it) "
            f"or an operation it cannot cut; {FIXES}")


def subnet_fails(model: nn.Module, where: str, module: nn.Module | None, text: str) -> str:
    """A subnet's forward fails: ``where`` is the innermost module running when it did."""
    if where:
        return (f"IST derived a plan for {type(model).__name__}, but on a subnet the forward "
                f"of {where} ({type(module).__name__}) fails ({text}): it fixes a width the "
                "plan cuts; derive the width from the weights' shapes, pass "
                f"shared=({where!r},) to keep it whole, or {FIXES}")
    return (f"IST derived a plan for {type(model).__name__}, but its forward fails on a subnet "
            f"({text}): the forward fixes a width the plan cuts; derive the width from the "
            f"weights' shapes, keep that module whole with shared=(NAME,), or {FIXES}")


def cannot_run(model: nn.Module, where: str, op: str, text: str) -> str:
    """The example does not run through the traced graph: ``op`` failed in module ``where``."""
    what = (where if op == "the module's forward" else f"{op} in {where}") if where else op
    return (f"IST could not run {type(model).__name__} on the example input: {what} "
            f"failed ({text}); pass the model's own input batch, as the training loop calls "
            "the model (a tensor, a tuple of its positional arguments or a dict of its keyword "
            "arguments)")

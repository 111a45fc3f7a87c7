"""The one-line messages of :mod:`thinwire.models.graph`: each names the module or the model,
what the rules could not follow, and the fixes (mark it shared, register a rule, pass an
adapter)."""

from __future__ import annotations

from torch import nn

FIXES = "register a rule for it (docs/IST.md, 'Rules for other modules'), or pass an adapter " \
        "(docs/IST.md, 'Writing an adapter')"


def cannot_trace(model: nn.Module, where: str, module: nn.Module | None, reasons: str) -> str:
    """A forward neither tracer follows: ``where`` is the innermost module being traced."""
    name = f"{where} ({type(module).__name__})" if where else type(model).__name__
    hatch = (f"pass shared=({where!r},) to keep it whole" if where else
             "keep the offending submodule whole with shared=(NAME,)")
    return f"IST cannot trace {name} of {type(model).__name__} ({reasons}); {hatch}, {FIXES}"


def nothing_to_cut(model: nn.Module) -> str:
    return (f"IST found no unit to cut in {type(model).__name__}: every layer's outputs reach "
            "the model's output, a residual stream (kept whole; residual='channels' cuts it) "
            f"or an operation it cannot cut; {FIXES}")


def subnet_fails(model: nn.Module, text: str) -> str:
    return (f"IST derived a plan for {type(model).__name__}, but its forward fails on a subnet "
            f"({text}): the forward fixes a width the plan cuts; derive the width from the "
            "weights' shapes, or pass shared=(that module,)")

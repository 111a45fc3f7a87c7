"""PyPI's torchvision (and timm, built on it, and transformers' model classes, which probe it)
beside a CPU build of torch.

PyPI's torchvision wheels carry compiled operators (``torchvision/_C.so``: nms, roi_align, ...)
built against PyPI's CUDA build of torch; beside torch's CPU build they do not load, and
``import torchvision`` then fails at its first fake-kernel registration ("operator
torchvision::nms does not exist"), which also breaks ``transformers``' model classes (they
probe torchvision). Model classes (``torchvision.models``, timm's, transformers') are
pure Python and call none of those operators, so :func:`define_missing_torchvision_ops`
declares the two schemas that ``torchvision/_meta_registrations.py`` registers unconditionally
(nms, qnms), with no kernel, when the compiled library does not load: the import then
succeeds, the models are the libraries' own, and calling one of the detection operators still
fails (no kernel), as it would without the library. Where ``_C.so`` loads (a matching build),
nothing is declared."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_LIBRARY: list[torch.library.Library] = []


def define_missing_torchvision_ops() -> bool:
    """Declare torchvision's nms schemas when its compiled operators cannot load; True when it
    did. Call before the first import of torchvision, timm or transformers' models."""
    if _LIBRARY:
        return True
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    lib = next(Path(spec.submodule_search_locations[0]).glob("_C*.so"), None)
    if lib is not None:
        try:
            torch.ops.load_library(str(lib))
            return False
        except (OSError, RuntimeError):
            pass
    frag = torch.library.Library("torchvision", "FRAGMENT")
    try:
        for schema in _SCHEMAS:
            frag.define(schema)
    except RuntimeError:  # already declared (by a library loaded some other way)
        return False
    _LIBRARY.append(frag)
    return True

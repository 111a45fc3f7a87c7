"""Models: a registry of model entries, each in its own module with its options and builder.

``MODELS.get("mlp").build(options, dataset, seed)`` gives the full model, identical on every
rank for the same seed. Strategies treat models as data: what a method needs to know about a
model's structure comes from the model's adapters (:mod:`thinwire.models.adapter`).
"""

from typing import Any

from thinwire.models.registry import ModelEntry
from thinwire.options import Registry

MODELS: Registry[ModelEntry] = Registry("model", {
    "mlp": "thinwire.models.mlp:MODEL",
    "gpt": "thinwire.models.gpt:MODEL",
    "resnet": "thinwire.models.resnet:MODEL",
    "gcn": "thinwire.models.gcn:MODEL",
    "dlrm": "thinwire.models.dlrm:MODEL",
    "xmlp": "thinwire.models.xmlp:MODEL",
})
"""Every model by name."""

__all__ = ["MLP", "MODELS", "ModelEntry", "build_mlp"]


def __getattr__(name: str) -> Any:
    if name in ("MLP", "build_mlp"):
        from thinwire.models import mlp

        return getattr(mlp, name)
    raise AttributeError(f"module 'thinwire.models' has no attribute {name!r}")

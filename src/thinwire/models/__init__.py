"""Reference models."""

from thinwire.models.mlp import MLP, build_mlp

__all__ = ["MLP", "build_mlp"]

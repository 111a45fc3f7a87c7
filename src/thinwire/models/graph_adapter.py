"""The graph-derived IST adapter, kept importable under its first name: the code is the
package :mod:`thinwire.models.graph` (tracing, propagation, the rule table, plan emission)."""

from thinwire.models.graph import (
    EMBEDDING_MODES,
    RESIDUAL_MODES,
    GraphAdapter,
    attention_forward,
    derive_adapter,
    register_rule,
)

__all__ = ["EMBEDDING_MODES", "RESIDUAL_MODES", "GraphAdapter", "attention_forward",
           "derive_adapter", "register_rule"]

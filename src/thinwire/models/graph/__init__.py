"""IST adapters derived from a model's graph: :func:`derive_adapter`, cut by a rule table.

A hand-written :class:`~thinwire.models.adapter.ISTAdapter` says which units a model has and
which tensor elements each unit indexes. For a model built from stock torch modules the same
plan follows from the model's dataflow, and :func:`derive_adapter` finds it from one example
input (the user's real batch; no shape is ever guessed):

1. **Trace.** The forward is called as the training loop calls it: the example's positional
   and keyword arguments (``model(input_ids=x, attention_mask=m)``). ``torch.fx`` records it
   as a graph (symbolic tracing; where the forward
   branches on a shape, such as ``if x.dim() != 4``, fx's meta tracer, whose proxies carry the
   example's shapes). torch.fx first: it keeps a call of a module as one node naming the module
   (``nn.MultiheadAttention``, a whole ``nn.TransformerEncoderLayer``, timm's ``Attention``),
   traces in milliseconds and needs no compilation stack. Where neither fx tracer follows the
   forward (Hugging Face ``transformers`` models), ``torch.export.export(strict=False)``: the
   forward decomposed into aten operators with the parameters as named ``get_attr`` nodes,
   which the rules of :mod:`~thinwire.models.graph.aten` follow. A forward whose control flow
   depends on tensor *values* cannot be traced: the error names the innermost module being
   traced, both tracers' reasons and the fixes (``shared=(name,)``, a rule, or an adapter).
2. **Propagate channels.** The graph runs once on a copy of the model with the example input
   (the model itself and its BatchNorm statistics stay untouched). Every value carries, per
   dimension, the *channel group* whose units index it. A layer creates a group for its outputs
   (``Linear`` out features, ``ConvNd`` out channels, ``Embedding`` dims, attention heads,
   FFN neurons) and records the tensors it indexes with it (rows of its weight and its bias);
   a layer fed by a group records its input dimension (the weight's columns / input channels).
   Elementwise operations, pooling, dropout, ``flatten`` (with the elements per channel it
   merges), ``transpose``/``permute`` and reductions over other dimensions pass a group on;
   norms that follow (``BatchNorm*``, ``InstanceNorm*``, ``GroupNorm`` in whole groups,
   ``LayerNorm`` and ``RMSNorm`` over one dimension) index their parameters and running
   statistics with it; a grouped convolution (ResNeXt's paths) carries its input's group with
   a unit of whole paths, its ``groups`` following the paths a subnet holds (a depthwise one:
   the width held). What each module kind, function and method does is one entry of
   the rule table (:mod:`~thinwire.models.graph.rules`), which a user extends for a module of
   their own with :func:`register_rule`.
3. **Join and poison.** Both sides of an addition or multiplication hold the same channels, so
   their groups are joined into one (a residual stream; with ``residual="whole"``, the default,
   a group joined by an addition is poisoned: the stream stays whole and only the units inside
   its branches are cut; ``residual="channels"`` cuts the stream too). A group that
   reaches the model's output, or an operation the rules do not know (concatenation, a
   ``matmul`` between activations, a functional call of a parameter, a module marked
   ``shared``), is *poisoned*: it is not cut, and every tensor it indexes is shared by all
   subnets and averaged. With ``embeddings="shared"`` (the default, as the GPT's hand adapter)
   the groups of embedding outputs are poisoned too, so a transformer's ``d_model`` stays whole.
4. **Units.** A surviving group of width W whose unit must span ``base`` channels (a GroupNorm
   of G groups over C channels: ``base`` = C / G; attention heads: ``head_dim`` elements) has
   W / base units; a group with fewer than ``min_units`` units is shared. Each recorded use
   becomes a :class:`~thinwire.models.adapter.Cut` (``per_unit`` = base x elements per channel,
   ``segments`` = 3 for a packed q|k|v projection).
5. **Residual blocks** (``residual="blocks"``, ResIST): a submodule whose output is the sum of
   its input and a branch (an identity shortcut; a pre-norm transformer block's two additions;
   the block may read other values, a mask or positions) is a unit of the ``dealt`` group named after
   its parent (consecutive blocks of a stage); a subnet skips the blocks it does not hold (their
   forward is the identity for the round), every tensor of a block travels whole with it, and
   everything else is shared.

The adapter's model-side part (:class:`GraphAdapter`): ``configure`` sets a cut LayerNorm's
``normalized_shape`` and a GroupNorm's ``num_groups`` to the units held, replaces the forward of
every ``nn.MultiheadAttention`` whose heads are cut by :func:`attention_forward` for the round

Files: ``tracing.py`` (step 1), ``groups.py`` (the union-find), ``rules.py`` (the table) and
``attention.py`` (torch's attention and transformer rules), ``propagate.py`` (steps 2-3),
``blocks.py`` (step 5), ``emit.py`` (the plan), ``adapter.py`` (:class:`GraphAdapter`),
``derive.py`` (:func:`derive_adapter`), ``errors.py`` (the one-line messages).
"""

from thinwire.models.graph.adapter import GraphAdapter, attention_forward
from thinwire.models.graph.derive import EMBEDDING_MODES, RESIDUAL_MODES, derive_adapter
from thinwire.models.graph.groups import Ann, Use
from thinwire.models.graph.rules import (
    ModuleRule,
    module_rule,
    register_function_rule,
    register_method_rule,
    register_rule,
)

__all__ = ["EMBEDDING_MODES", "RESIDUAL_MODES", "Ann", "GraphAdapter", "ModuleRule", "Use",
           "attention_forward", "derive_adapter", "module_rule", "register_function_rule",
           "register_method_rule", "register_rule"]

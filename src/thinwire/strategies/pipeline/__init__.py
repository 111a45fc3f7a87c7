"""Pipeline model parallelism with compressed boundaries (the ``pipeline`` method).

- :mod:`.schedule`: :class:`Pipeline` (a model's chain cut into stages; GPipe and 1F1B over the
  ledgered communicator), :class:`Boundaries` (what each boundary sends);
- :mod:`.codecs`: a boundary's codecs (the registry's of the ``act`` and ``actgrad`` slots:
  int4, low rank with lazy error propagation, AQ-SGD and every flat codec), sample ids and
  bottlenecks (learned autoencoder, fixed subspace);
- :mod:`.method`: the method's options, checks, traffic formula and Strategy.
"""

from thinwire.strategies.pipeline.schedule import Boundaries, Pipeline, cut, order

__all__ = ["Boundaries", "Pipeline", "cut", "order"]

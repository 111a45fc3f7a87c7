"""Independent Subnetwork Training: :class:`~thinwire.strategies.ist.core.IST` (the algorithm,
usable in a user's own loop; ``thinwire.IST``), the partitions (:mod:`.partition`), the pieces
that travel (:mod:`.pieces`), and the trainer's method (:mod:`.method`). The package imports
nothing itself, so the numpy-only modules stay light and no submodule depends on it."""

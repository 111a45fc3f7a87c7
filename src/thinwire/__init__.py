"""thinwire: training neural networks across workers joined by thin links.

Independent Subnetwork Training (IST), data parallelism, compressed data parallelism, local SGD
and DiLoCo on one harness and one per-rank byte ledger; a planner that predicts memory, bytes and
step time; a theory lab for IST on quadratics.
"""

__version__ = "0.1.0"

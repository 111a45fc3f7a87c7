"""The ring algorithms' bytes per rank, in one place: the ledger's estimates
(:func:`thinwire.runtime.ledger.wire_estimate`), the methods' traffic formulas
(:mod:`thinwire.strategies.traffic`) and the planner's alpha-beta times
(:mod:`thinwire.planner.comm`) all take their bandwidth term from :func:`ring_share`.

Over n ranks, each rank sends (and receives), per byte of ``payload``:
  all-reduce      2 (n-1)/n   (a reduce-scatter, then an all-gather; payload = the tensor)
  reduce-scatter  (n-1)/n     (payload = the full, unscattered tensor)
  all-gather      (n-1)       (payload = one rank's part)
and nothing at n = 1 (Patarasuk & Yuan 2009; Thakur, Rabenseifner & Gropp 2005).
"""

from __future__ import annotations

RING_OPS = ("all_reduce", "reduce_scatter", "all_gather")


def ring_share(op: str, n: int) -> float:
    """Bytes one rank sends in a ring ``op`` over ``n`` ranks, per byte of payload."""
    if op not in RING_OPS:
        raise ValueError(f"unknown ring collective {op!r}; one of {', '.join(RING_OPS)}")
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "reduce_scatter":
        return (n - 1) / n
    return float(n - 1)


def ring_bytes(op: str, payload: int, n: int) -> int:
    """Whole bytes one rank sends in a ring ``op`` of ``payload`` bytes over ``n`` ranks."""
    return round(ring_share(op, n) * payload)

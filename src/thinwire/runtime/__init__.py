"""Process group set-up, the communication layer and its per-rank byte ledger."""

from thinwire.runtime.comm import Comm
from thinwire.runtime.ledger import Ledger, LedgerEntry, wire_estimate

__all__ = ["Comm", "Ledger", "LedgerEntry", "wire_estimate"]

"""Process group set-up, the communication layer and its per-rank byte ledger."""

from thinwire.runtime.comm import Comm, Ledger, LedgerEntry, wire_estimate

__all__ = ["Comm", "Ledger", "LedgerEntry", "wire_estimate"]

"""The thin-wire testbed (``thinwire bench``): IST's promise is wall-clock speed on thin links.

On one machine over loopback the wire is never thin, so the testbed makes it thin for real: one
network namespace per worker, veth pairs to a bridge in its own namespace, addresses in
198.18.0.0/15 only, and ``tc`` limiting the rate (and, with netem, the delay) of both directions
of every worker's link.

Three kinds of figure, always labelled:
- **measured**: wall times of runs on the shaped links, and wire bytes from the kernel's
  interface counters (headers and all traffic included) -- :mod:`.netns`, :mod:`.run`;
- **estimated**: the ledger's wire bytes for collectives (ring algorithms) beside its exact
  payload and point-to-point bytes -- compared with the measured bytes in :mod:`.measure`;
- **modelled**: where namespaces cannot be built, wall time = compute time measured over loopback
  + latency and ledger bytes / bandwidth per communication call -- :mod:`.modelled`.

Modules: :mod:`.rates` (``100mbit``, ``5ms``), :mod:`.netns` (namespaces, shaping, teardown),
:mod:`.run` (workers under a deadline), :mod:`.measure`, :mod:`.modelled`, :mod:`.report`
(table and plot), :mod:`.bench` (the loop over links and methods), :mod:`.thin_links` (time to
a target on thin links for ``thinwire compare``'s loopback runs), :mod:`.faults` (fault-tolerant
jobs: torchft's lighthouse on the bridge (:mod:`.lighthouse`), one replica group per namespace,
workers SIGKILLed and rejoined from outside at chosen steps, and restart-based recovery under
the same kills); the command line is :mod:`thinwire.commands.bench`.
"""

from thinwire.testbed.rates import Link, parse_delay, parse_links, parse_rate

__all__ = ["Link", "parse_delay", "parse_links", "parse_rate"]

"""Link specifications from the command line: ``--link 100mbit``, ``--delay 5ms``.

Rates use tc's decimal units in *bits* per second: ``bit``, ``kbit``, ``mbit``, ``gbit``
(1 mbit = 10^6 bit/s), case-insensitive, optionally followed by ``/s`` (``100Mbit/s``);
``unlimited`` means no rate limit. Byte units (tc's ``bps`` means *bytes* per second) are refused
to avoid an 8x mistake. Delays take ``us``, ``ms`` or ``s`` (``0`` alone is allowed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from thinwire.errors import UsageError

RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
MIN_RATE_BPS = 64e3
MAX_RATE_BPS = 100e9
MAX_DELAY_S = 10.0
UNLIMITED = ("unlimited", "none", "inf")

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"


@dataclass(frozen=True)
class Link:
    """One worker's link to the switch: rate in bit/s (None: unlimited), one-way delay in s.

    The rate and the delay apply to each direction of the link (upload and download) separately,
    so a message from worker a to worker b crosses two links: a's upload and b's download.
    """

    rate_bps: float | None
    delay_s: float = 0.0

    @property
    def label(self) -> str:
        rate = format_rate(self.rate_bps)
        return rate if self.delay_s == 0 else f"{rate}+{self.delay_s * 1e3:g}ms"

    @property
    def bytes_per_s(self) -> float | None:
        return None if self.rate_bps is None else self.rate_bps / 8


def parse_rate(text: str) -> float | None:
    """A link rate in bits/s, as tc takes it: ``"100mbit"`` -> 1e8; ``"unlimited"`` -> None;
    anything else -> UsageError (a planner *bandwidth* is in bytes/s:
    ``thinwire.commands.plan.parse_bandwidth``)."""
    t = text.strip().lower().removesuffix("/s")
    if t in UNLIMITED:
        return None
    m = re.fullmatch(_NUMBER + r"\s*([a-z]+)", t)
    if not m or m.group(2) not in RATE_UNITS:
        raise UsageError(f"link rate {text!r}: use a number with bit, kbit, mbit or gbit "
                         "(e.g. 100mbit, 1gbit) or 'unlimited'")
    bps = float(m.group(1)) * RATE_UNITS[m.group(2)]
    if not MIN_RATE_BPS <= bps <= MAX_RATE_BPS:
        raise UsageError(f"link rate {text!r}: use a rate between 64kbit and 100gbit, "
                         "or 'unlimited'")
    return bps


def parse_delay(text: str) -> float:
    """``"5ms"`` -> 0.005 s; ``"0"`` -> 0.0; anything else -> UsageError."""
    t = text.strip().lower()
    if re.fullmatch(r"0+(?:\.0*)?", t):
        return 0.0
    m = re.fullmatch(_NUMBER + r"\s*([a-z]+)", t)
    if not m or m.group(2) not in DELAY_UNITS:
        raise UsageError(f"delay {text!r}: use a number with us, ms or s (e.g. 5ms) or 0")
    s = float(m.group(1)) * DELAY_UNITS[m.group(2)]
    if s > MAX_DELAY_S:
        raise UsageError(f"delay {text!r}: use at most {MAX_DELAY_S:g}s")
    return s


def parse_links(rates: str, delay: str = "0") -> list[Link]:
    """``"100mbit,1gbit,unlimited"`` -> one Link per rate, all with the same delay."""
    items = [r for r in rates.split(",") if r.strip()]
    if not items:
        raise UsageError("--link: give at least one rate, e.g. 100mbit or unlimited")
    d = parse_delay(delay)
    links = [Link(parse_rate(r), d) for r in items]
    if len({lk.label for lk in links}) != len(links):
        raise UsageError(f"--link {rates!r}: each rate at most once")
    return links


def format_rate(bps: float | None) -> str:
    if bps is None:
        return "unlimited"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"

"""The codec registry: one entry per codec, each declaring its options, built from plain arguments.

``build("topk")``, ``build("topk:ratio=0.01")``, ``build("powersgd:rank=2,ef=false")`` and
``build("topk", ratio=0.01)`` give a ready :class:`~thinwire.compression.base.Compressor`:

  1. the spec's name picks the entry (an unknown name is a one-line
     :class:`~thinwire.options.OptionError` listing the known ones);
  2. the spec's ``key=value`` pairs and the keyword arguments (which win) become the entry's
     options dataclass, validated (an unknown option or a bad value is a one-line error naming
     the option and the allowed ones);
  3. the entry's factory makes the codec from the options, the shared seed and this rank;
  4. when the options switch error feedback on (``ef``, on by default for every biased codec)
     and the codec wants the generic wrapper (:attr:`Compressor.wants_error_feedback`: PowerSGD
     keeps its own residual), it is wrapped in :class:`~thinwire.compression.feedback.ErrorFeedback`;
  5. when the options ask for ``exchange=scatter`` (fp4, int8), the codec (with its error
     feedback) is averaged by :class:`~thinwire.compression.scatter.ScatteredExchange`: a
     quantised reduce-scatter summed in fp32, then an all-gather of the re-quantised mean.

Entries live in their codecs' modules (``casts``, ``sparse``, ``quantize``, ``sign``,
``powersgd``); a new codec is one module plus one line here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from thinwire.compression.base import Compressor
from thinwire.compression.feedback import ErrorFeedback
from thinwire.options import (
    NoOptions,
    OptionError,
    Registry,
    build_options,
    check,
    opt,
    parse_spec,
)

EXCHANGES = ("gather", "scatter")


def exchange_option() -> Any:
    """The ``exchange`` option of a codec whose payloads cannot be summed (step 5 below)."""
    return opt("gather", "gather: all-gather every rank's payload; scatter: quantised "
               "reduce-scatter summed in fp32, the re-quantised mean all-gathered")


def check_exchange(options: Any, codec: str) -> None:
    """One line naming ``<codec>.exchange`` when it is neither of :data:`EXCHANGES`."""
    check(options.exchange in EXCHANGES, f"{codec}.exchange",
          f"got {options.exchange!r}; use gather or scatter")


@dataclass(frozen=True)
class CodecEntry:
    """A codec by name: a one-line summary, its options dataclass and its factory
    ``factory(options, seed, rank) -> Compressor`` (before the generic error feedback)."""

    name: str
    summary: str
    factory: Callable[[Any, int, int], Compressor]
    options: type = NoOptions


CODECS: Registry[CodecEntry] = Registry("codec", {
    "none": "thinwire.compression.casts:NONE",
    "fp16": "thinwire.compression.casts:FP16",
    "bf16": "thinwire.compression.casts:BF16",
    "topk": "thinwire.compression.sparse:TOPK",
    "randk": "thinwire.compression.sparse:RANDK",
    "qsgd": "thinwire.compression.quantize:QSGD_ENTRY",
    "int8": "thinwire.compression.quantize:INT8",
    "fp4": "thinwire.compression.fp4:FP4_ENTRY",
    "sign": "thinwire.compression.sign:SIGN",
    "powersgd": "thinwire.compression.powersgd:POWERSGD",
})
"""Every codec by name."""


def codec_names() -> str:
    """The registered codecs for an option's help: ``"none, fp16, ..."`` (read from
    :data:`CODECS`, so a new codec appears in every such help)."""
    return ", ".join(CODECS.names())


def codec_options(spec: str, **options: Any) -> tuple[CodecEntry, Any]:
    """Steps 1-2: the entry of ``spec`` and its validated options instance."""
    name, values = parse_spec(spec, "codec")
    entry = CODECS.get(name)
    merged: dict[str, Any] = {**values, **options}
    return entry, build_options(entry.options, merged, name, owner=f"codec {name}")


def build(spec: str, *, seed: int = 0, rank: int = 0, **options: Any) -> Compressor:
    """The codec of ``spec`` (``"name"`` or ``"name:key=value,..."``) with ``options``.

    ``seed`` drives shared randomness (identical on all ranks); ``rank`` is this worker's rank,
    which separates each worker's private randomness. PowerSGD's own ``rank`` option therefore
    goes in the spec here, or through :func:`build_codec`'s mapping
    (:func:`~thinwire.compression.hooks.ddp_hook` and ``register`` take the worker's rank from
    their communicator, so there it may be a keyword). Example::

        >>> from thinwire.compression import build
        >>> build("topk:ratio=0.01").describe()
        'topk(ratio=0.01,ef)'
        >>> build("powersgd:rank=4", ef=False, rank=1).describe()   # worker 1
        'powersgd(rank=4,warm_start)'
    """
    return build_codec(spec, options, seed=seed, rank=rank)


def check_codec(spec: str, where: str, *, averaged: bool = True) -> None:
    """A codec spec that :func:`build` accepts, or a one-line :class:`OptionError` naming
    ``where`` (the option that holds it, e.g. ``method.compressor``).

    ``averaged=False``: ``where`` sends the codec's payloads point to point or gathers them
    (a pipeline boundary, tensor-parallel collectives) instead of averaging a tensor over
    data-parallel replicas, so ``exchange=scatter`` (step 5) is refused there."""
    try:
        build(spec)
    except OptionError as exc:
        raise OptionError(f"{where}: {exc}") from None
    if not averaged:
        refuse_scatter(spec, where)


def refuse_scatter(spec: str, where: str) -> None:
    """One line naming ``where`` and where ``exchange=scatter`` applies, when ``spec`` asks
    for it (see :func:`check_codec`)."""
    _name, values = parse_spec(spec, "codec")
    if values.get("exchange", "gather").strip() == "scatter":
        raise OptionError(f"{where}: exchange=scatter is the scattered averaging of a codec "
                          "over data-parallel replicas and applies only to --method.compressor; "
                          f"{where} sends its payloads as they are; drop exchange=scatter")


def build_codec(spec: str, options: Mapping[str, Any] | None = None, *, seed: int = 0,
                rank: int = 0) -> Compressor:
    """:func:`build` with the options as a mapping (whose keys may be any option's name)."""
    entry, opts = codec_options(spec, **(options or {}))
    # 3. the codec itself
    comp = entry.factory(opts, seed, rank)
    # 4. the generic error feedback, where the codec wants it
    if getattr(opts, "ef", False) and comp.wants_error_feedback:
        comp = ErrorFeedback(comp)
    # 5. the scattered exchange, where asked for
    if getattr(opts, "exchange", "gather") == "scatter":
        from thinwire.compression.scatter import ScatteredExchange

        comp = ScatteredExchange(comp)
    return comp

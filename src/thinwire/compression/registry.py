"""The codec registry: one entry per codec, each declaring its options and the slots it goes in,
built from plain arguments.

``build("topk")``, ``build("topk:ratio=0.01")``, ``build("powersgd:rank=2,ef=false")`` and
``build("topk", ratio=0.01)`` give a ready :class:`~thinwire.compression.base.Compressor`, the
one codec interface of every *slot* (:data:`SLOTS`: data-parallel gradients, outer deltas,
tensor-parallel sums, a pipeline boundary's activations and activation gradients):

  1. the spec's name picks the entry (an unknown name is a one-line
     :class:`~thinwire.options.OptionError` listing the known ones), and the entry must go in
     the slot it is built for (``slot``; elsewhere a one-line error naming the slot, why, and
     the codecs the slot takes);
  2. the spec's ``key=value`` pairs and the keyword arguments (which win) become the entry's
     options dataclass, validated (an unknown option or a bad value is a one-line error naming
     the option and the allowed ones); error feedback's ``ef`` defaults to the slot's (on for
     every slot but a pipeline boundary's);
  3. the entry's factory makes the codec from the options, the shared seed and this rank;
  4. when the options switch error feedback on (``ef``, on by default for every biased codec)
     and the codec wants the generic wrapper (:attr:`Compressor.wants_error_feedback`: PowerSGD
     keeps its own residual), it is wrapped in :class:`~thinwire.compression.feedback.ErrorFeedback`;
  5. when the options ask for ``exchange=scatter`` (fp4, fp8, int8), the codec (with its error
     feedback) is averaged by :class:`~thinwire.compression.scatter.ScatteredExchange`: a
     quantised reduce-scatter summed in fp32, then an all-gather of the re-quantised mean.

Entries live in their codecs' modules (``casts``, ``sparse``, ``quantize``, ``int8``, ``fp8``,
``fp4``, ``int4``, ``sign``, ``powersgd``, ``chunked``, ``dct``, ``lowrank``, ``aqsgd``); a new
codec is one module plus one line here, and goes in every slot unless its entry names its
``slots``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
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
class Slot:
    """A place a codec encodes tensors: what it carries, the options that name its codec, and
    whether it averages over data-parallel replicas (where ``exchange=scatter`` applies) and
    starts error feedback on."""

    name: str
    carries: str
    options: str
    averaged: bool
    ef: bool


SLOTS: Mapping[str, Slot] = MappingProxyType({s.name: s for s in (
    Slot("grad", "gradients averaged over data-parallel replicas", "--method.compressor",
         averaged=True, ef=True),
    Slot("delta", "outer deltas averaged over replicas", "diloco's --method.compressor",
         averaged=True, ef=True),
    Slot("tp", "tensor-parallel sums", "--method.codec, --method.tp_codec", averaged=False,
         ef=True),
    Slot("act", "activations at a pipeline boundary", "--method.codec_fwd", averaged=False,
         ef=False),
    Slot("actgrad", "activation gradients at a pipeline boundary", "--method.codec_bwd",
         averaged=False, ef=False),
)})
"""Every codec slot by name."""

EVERY_SLOT = frozenset(SLOTS)


@dataclass(frozen=True)
class CodecEntry:
    """A codec by name: a one-line summary, its options dataclass, its factory
    ``factory(options, seed, rank) -> Compressor`` (before the generic error feedback), the
    slots it goes in (every one unless named) and why it goes in no other."""

    name: str
    summary: str
    factory: Callable[[Any, int, int], Compressor]
    options: type = NoOptions
    slots: frozenset[str] = EVERY_SLOT
    why: str = ""


CODECS: Registry[CodecEntry] = Registry("codec", {
    "none": "thinwire.compression.casts:NONE",
    "fp16": "thinwire.compression.casts:FP16",
    "bf16": "thinwire.compression.casts:BF16",
    "topk": "thinwire.compression.sparse:TOPK",
    "randk": "thinwire.compression.sparse:RANDK",
    "qsgd": "thinwire.compression.quantize:QSGD_ENTRY",
    "int8": "thinwire.compression.int8:INT8",
    "fp8": "thinwire.compression.fp8:FP8_ENTRY",
    "int4": "thinwire.compression.int4:INT4",
    "fp4": "thinwire.compression.fp4:FP4_ENTRY",
    "sign": "thinwire.compression.sign:SIGN",
    "powersgd": "thinwire.compression.powersgd:POWERSGD",
    "topk2bit": "thinwire.compression.chunked:TOPK2BIT",
    "dcttopk": "thinwire.compression.dct:DCTTOPK",
    "lowrank": "thinwire.compression.lowrank:LOWRANK",
    "aqsgd": "thinwire.compression.aqsgd:AQSGD_ENTRY",
})
"""Every codec by name."""


def slot_of(slot: str) -> Slot:
    """The slot named ``slot`` (a name outside :data:`SLOTS` is a programming error)."""
    if slot not in SLOTS:
        raise ValueError(f"unknown codec slot {slot!r}; slots: {', '.join(SLOTS)}")
    return SLOTS[slot]


def slot_codecs(slot: str) -> tuple[str, ...]:
    """The codecs that go in ``slot``, in registry order."""
    slot_of(slot)
    return tuple(name for name, entry in CODECS.entries() if slot in entry.slots)


def codec_names(slot: str = "grad") -> str:
    """The codecs of ``slot`` for an option's help: ``"none, fp16, ..."`` (read from
    :data:`CODECS`, so a new codec appears in the help of every slot it goes in)."""
    return ", ".join(slot_codecs(slot))


def refuse_slot(entry: CodecEntry, slot: str, where: str = "", also: tuple[str, ...] = ()
                ) -> None:
    """Step 1's one line, when ``entry`` does not go in ``slot``: ``where`` (the option), the
    slot, why, and the codecs the slot takes (``also``: the caller's own, e.g. bottlenecks)."""
    if slot in entry.slots:
        return
    s = slot_of(slot)
    takes = ", ".join((*slot_codecs(slot), *also))
    head = f"{where}: " if where else ""
    raise OptionError(f"{head}codec {entry.name} does not go on {s.carries}: {entry.why}; "
                      f"{where or s.options} takes {takes}")


def codec_options(spec: str, *, slot: str = "grad", **options: Any) -> tuple[CodecEntry, Any]:
    """Steps 1-2: the entry of ``spec`` (refused outside its slots) and its validated options
    instance (``ef`` defaulting to the slot's)."""
    name, values = parse_spec(spec, "codec")
    entry = CODECS.get(name)
    refuse_slot(entry, slot)
    merged: dict[str, Any] = {**values, **options}
    if not slot_of(slot).ef and "ef" not in merged and _has_option(entry, "ef"):
        merged["ef"] = "false"
    return entry, build_options(entry.options, merged, name, owner=f"codec {name}")


def _has_option(entry: CodecEntry, option: str) -> bool:
    return entry.options is not NoOptions and option in {f.name for f in fields(entry.options)}


def build(spec: str, *, seed: int = 0, rank: int = 0, slot: str = "grad",
          **options: Any) -> Compressor:
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
    return build_codec(spec, options, seed=seed, rank=rank, slot=slot)


def check_codec(spec: str, where: str, *, slot: str = "grad", also: tuple[str, ...] = ()
                ) -> None:
    """A codec spec that :func:`build` accepts in ``slot``, or a one-line :class:`OptionError`
    naming ``where`` (the option that holds it, e.g. ``method.compressor``); ``also``: names
    the caller takes in that option besides the registry's (listed in the refusal).

    A slot that sends the codec's payloads point to point or gathers them (a pipeline
    boundary, tensor-parallel collectives) instead of averaging a tensor over data-parallel
    replicas refuses ``exchange=scatter`` (step 5)."""
    name, _values = parse_spec(spec, "codec")
    if name in CODECS:
        refuse_slot(CODECS.get(name), slot, where, also)
    try:
        build(spec, slot=slot)
    except OptionError as exc:
        raise OptionError(f"{where}: {exc}") from None
    if not slot_of(slot).averaged:
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
                rank: int = 0, slot: str = "grad") -> Compressor:
    """:func:`build` with the options as a mapping (whose keys may be any option's name)."""
    entry, opts = codec_options(spec, slot=slot, **(options or {}))
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

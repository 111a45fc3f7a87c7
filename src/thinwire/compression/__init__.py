"""Communication compression: codecs, error feedback, the codec registry and DDP hooks.

One interface (:class:`Compressor`: spec, encode, decode, with their tensor forms at a
:class:`Site`) for every codec slot: data-parallel gradients, outer deltas, tensor-parallel
sums, a pipeline boundary's activations and activation gradients (:data:`SLOTS`).
One file per family: :mod:`.casts` (none, fp16, bf16), :mod:`.sparse` (topk, randk),
:mod:`.quantize` (qsgd), :mod:`.int8` (int8), :mod:`.fp8` (fp8), :mod:`.fp4` (fp4),
:mod:`.int4` (int4), :mod:`.sign` (sign), :mod:`.powersgd` (powersgd), :mod:`.chunked`
(SparseLoCo's topk2bit), :mod:`.dct` (DeMo's dcttopk), :mod:`.lowrank` (Optimus-CC's lowrank,
activation gradients only), :mod:`.aqsgd` (AQ-SGD, pipeline boundaries only); :mod:`.feedback`
wraps biased codecs with error feedback; :mod:`.registry` builds any of them from plain
arguments for a slot, refusing a codec outside its slots in one line; :mod:`.hooks` turns any of
them into a DDP hook that exchanges through :class:`~thinwire.runtime.comm.Comm`. Codecs know no
training method.

    >>> from thinwire.compression import build
    >>> c = build("topk:ratio=0.01")                 # or build("topk", ratio=0.01)
    >>> c.describe(), c.collectives(1_000_000)
    ('topk(ratio=0.01,ef)', [('all_gather', 80000)])

In a training loop of your own: ``register(ddp_model, "powersgd", rank=2)``.
Collectives: all-reduce for the linear codecs (none, fp16, bf16, randk; powersgd's P and Q),
all-gather of the encoded bytes for the rest (topk, qsgd, int8, fp8, sign).
"""

from __future__ import annotations

from thinwire.compression.aqsgd import AQSGD
from thinwire.compression.base import Collective, Compressor, Part, Payload, Shaped, Site
from thinwire.compression.casts import Cast, Identity
from thinwire.compression.chunked import ChunkTopK2Bit
from thinwire.compression.dct import DCTTopK
from thinwire.compression.feedback import ErrorFeedback
from thinwire.compression.fp8 import FP8
from thinwire.compression.hooks import (
    HookState,
    average_async,
    compressed_hook,
    ddp_hook,
    rebuild_buckets,
    register,
)
from thinwire.compression.int4 import Int4
from thinwire.compression.int8 import Int8
from thinwire.compression.lowrank import LowRank
from thinwire.compression.powersgd import PowerSGD
from thinwire.compression.quantize import QSGD
from thinwire.compression.registry import (
    CODECS,
    SLOTS,
    CodecEntry,
    Slot,
    build,
    build_codec,
    check_codec,
    codec_names,
    codec_options,
    slot_codecs,
)
from thinwire.compression.sign import ScaledSign
from thinwire.compression.sparse import RandK, TopK

__all__ = [
    "AQSGD", "CODECS", "QSGD", "SLOTS", "Cast", "ChunkTopK2Bit", "CodecEntry", "Collective",
    "Compressor", "DCTTopK", "ErrorFeedback", "FP8", "HookState", "Identity", "Int4", "Int8",
    "LowRank", "Part", "Payload", "PowerSGD", "RandK", "ScaledSign", "Shaped", "Site", "Slot", "TopK",
    "average_async", "build", "build_codec", "check_codec", "codec_names", "codec_options",
    "compressed_hook", "ddp_hook", "rebuild_buckets", "register", "slot_codecs",
]

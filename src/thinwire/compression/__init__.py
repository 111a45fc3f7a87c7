"""Communication compression: codecs, error feedback, the codec registry and DDP hooks.

One file per family: :mod:`.casts` (none, fp16, bf16), :mod:`.sparse` (topk, randk),
:mod:`.quantize` (qsgd, int8), :mod:`.sign` (sign), :mod:`.powersgd` (powersgd); :mod:`.feedback`
wraps biased codecs with error feedback; :mod:`.registry` builds any of them from plain
arguments; :mod:`.hooks` turns any of them into a DDP hook that exchanges through
:class:`~thinwire.runtime.comm.Comm`. Codecs know no training method.

    >>> from thinwire.compression import build
    >>> c = build("topk:ratio=0.01")                 # or build("topk", ratio=0.01)
    >>> c.describe(), c.collectives(1_000_000)
    ('topk(ratio=0.01,ef)', [('all_gather', 80000)])

In a training loop of your own: ``register(ddp_model, "powersgd", rank=2)``.
Collectives: all-reduce for the linear codecs (none, fp16, bf16, randk; powersgd's P and Q),
all-gather of the encoded bytes for the rest (topk, qsgd, int8, sign).
"""

from __future__ import annotations

from thinwire.compression.base import Collective, Compressor, Part, Payload
from thinwire.compression.casts import Cast, Identity
from thinwire.compression.feedback import ErrorFeedback
from thinwire.compression.hooks import (
    HookState,
    average_async,
    compressed_hook,
    ddp_hook,
    rebuild_buckets,
    register,
)
from thinwire.compression.powersgd import PowerSGD
from thinwire.compression.quantize import QSGD, Int8
from thinwire.compression.registry import (
    CODECS,
    CodecEntry,
    build,
    build_codec,
    check_codec,
    codec_names,
    codec_options,
)
from thinwire.compression.sign import ScaledSign
from thinwire.compression.sparse import RandK, TopK

__all__ = [
    "CODECS", "QSGD", "Cast", "CodecEntry", "Collective", "Compressor", "ErrorFeedback",
    "HookState", "Identity", "Int8", "Part", "Payload", "PowerSGD", "RandK", "ScaledSign",
    "TopK", "average_async", "build", "build_codec", "check_codec", "codec_names", "codec_options", "compressed_hook", "ddp_hook",
    "rebuild_buckets", "register",
]

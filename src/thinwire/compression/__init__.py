"""Communication compression: compressors, error feedback and DDP communication hooks.

One file per family: :mod:`.casts` (none, fp16, bf16), :mod:`.sparse` (topk, randk),
:mod:`.quantize` (qsgd, int8), :mod:`.sign` (sign), :mod:`.powersgd` (powersgd);
:mod:`.feedback` wraps biased compressors with error feedback; :mod:`.hooks` turns any of them
into a DDP hook that exchanges through :class:`~thinwire.runtime.comm.Comm`.

Collectives: all-reduce for the linear ones (none, fp16, bf16, randk; powersgd's P and Q),
all-gather of the encoded bytes for the rest (topk, qsgd, int8, sign).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from thinwire.compression.base import Compressor, Part, Payload
from thinwire.compression.casts import Cast, Identity
from thinwire.compression.feedback import ErrorFeedback
from thinwire.compression.hooks import HookState, average_async, compressed_hook
from thinwire.compression.powersgd import PowerSGD
from thinwire.compression.quantize import QSGD, Int8
from thinwire.compression.sign import ScaledSign
from thinwire.compression.sparse import RandK, TopK
from thinwire.config import MethodConfig
from thinwire.runtime.comm import Comm

# name -> factory(method config, seed, rank), before error feedback
REGISTRY: dict[str, Callable[[MethodConfig, int, int], Compressor]] = {
    "none": lambda c, s, r: Identity(seed=s, rank=r),
    "fp16": lambda c, s, r: Cast(torch.float16, seed=s, rank=r),
    "bf16": lambda c, s, r: Cast(torch.bfloat16, seed=s, rank=r),
    "topk": lambda c, s, r: TopK(c.ratio, seed=s, rank=r),
    # scaled (unbiased) without EF; unscaled (contractive) with EF, as Stich et al.
    "randk": lambda c, s, r: RandK(c.ratio, scale=not c.error_feedback, seed=s, rank=r),
    "qsgd": lambda c, s, r: QSGD(c.levels, seed=s, rank=r),
    "int8": lambda c, s, r: Int8(seed=s, rank=r),
    "sign": lambda c, s, r: ScaledSign(seed=s, rank=r),
    "powersgd": lambda c, s, r: PowerSGD(c.rank, error_feedback=c.error_feedback, seed=s, rank=r),
}


def build_compressor(method_cfg: MethodConfig, *, seed: int = 0, rank: int = 0) -> Compressor:
    """The configured compressor; biased ones wrapped in error feedback when it is on.

    ``seed`` drives shared randomness (identical on all ranks); ``rank`` separates each rank's
    private randomness. The identity and unbiased QSGD are never wrapped; PowerSGD keeps its
    own residual.
    """
    name = method_cfg.compressor
    if name not in REGISTRY:
        raise ValueError(f"unknown compressor {name!r}; known: {', '.join(REGISTRY)}")
    comp = REGISTRY[name](method_cfg, seed, rank)
    if method_cfg.error_feedback and not comp.unbiased and not isinstance(comp, PowerSGD):
        return ErrorFeedback(comp)
    return comp


def ddp_hook(method_cfg: MethodConfig, comm: Comm, *, seed: int = 0) -> tuple[HookState, Any]:
    """``(state, hook)`` for ``DDP.register_comm_hook``: the configured compressor, per bucket."""
    return HookState(comm, build_compressor(method_cfg, seed=seed, rank=comm.rank)), compressed_hook


__all__ = [
    "QSGD", "REGISTRY", "Cast", "Compressor", "ErrorFeedback", "HookState", "Identity", "Int8",
    "Part", "Payload", "PowerSGD", "RandK", "ScaledSign", "TopK", "average_async",
    "build_compressor", "compressed_hook", "ddp_hook",
]

"""``aqsgd``: AQ-SGD's quantised activation deltas against a per-sample history.

Wang et al., "Fine-tuning Language Models over Slow Networks using Activation Compression with
Guarantees" (NeurIPS 2022): quantise the *change* of each sample's activation since the last
time that sample crossed this boundary. Sender and receiver keep the same history m_i per
sample id i (zero before its first visit):
  1. delta = a - m_i (the tensor's rows against their histories);
  2. send Q(delta): ``bits`` = 4 (:mod:`.int4`'s format) or 8 (int8, fp32 absmax per chunk);
  3. both sides: m_i <- m_i + Q^-1(Q(delta)); the receiver uses m_i as the activation.
As training converges the deltas shrink and so does the quantisation error, which is what makes
the method's guarantee. The ids come with the :class:`~thinwire.compression.base.Site` (one per
row: :attr:`~thinwire.compression.base.Compressor.needs_samples`); the history costs one
activation per sample on both sides. Its slots are a pipeline boundary's (the registry's
``slots``): only there does a tensor arrive with its samples' ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from thinwire.compression.base import Part, Payload, Shaped, Site, chunk_rows
from thinwire.compression.int4 import dequantize4, quantize4
from thinwire.compression.registry import CodecEntry
from thinwire.options import check, opt


class AQSGD(Shaped):
    """AQ-SGD's deltas against a per-sample history (module docstring, steps 1-3)."""

    name = "aqsgd"
    needs_samples = True

    def __init__(self, bits: int = 4, chunk: int = 128, *, seed: int = 0, rank: int = 0) -> None:
        super().__init__(seed=seed, rank=rank)
        self.bits, self.chunk = bits, chunk
        self.history: dict[int, torch.Tensor] = {}

    def params(self) -> dict[str, Any]:
        return {"bits": self.bits}

    @property
    def wants_error_feedback(self) -> bool:
        return False  # the history carries what the wire did not, step 3

    def tensor_spec(self, shape: Sequence[int]) -> tuple[Part, ...]:
        d = math.prod(shape)
        levels = Part((d + 1) // 2, torch.uint8) if self.bits == 4 else Part(d, torch.int8)
        return (levels, Part(math.ceil(d / self.chunk), torch.float32))

    def _quantize(self, flat: torch.Tensor) -> Payload:
        if self.bits == 4:
            return quantize4(flat, self.chunk)
        rows = chunk_rows(flat, self.chunk)
        scale = rows.abs().amax(dim=1) / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(rows / safe[:, None]).to(torch.int8).reshape(-1)[:flat.numel()]
        return (q, scale)

    def _dequantize(self, payload: Payload, numel: int) -> torch.Tensor:
        if self.bits == 4:
            return dequantize4(payload[0], payload[1], numel, self.chunk)
        q, scale = payload
        return (chunk_rows(q.float(), self.chunk) * scale[:, None]).reshape(-1)[:numel]

    def _past(self, ids: torch.Tensor | None, like: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        if ids is None or ids.numel() != like.shape[0]:
            raise ValueError("aqsgd needs the ids of the micro-batch's samples (one per row)")
        keys = [int(i) for i in ids.tolist()]
        zero = torch.zeros(like.shape[1:], dtype=torch.float32, device=like.device)
        return keys, torch.stack([self.history.get(k, zero) for k in keys])

    def _remember(self, keys: list[int], values: torch.Tensor) -> None:
        for k, v in zip(keys, values):
            self.history[k] = v.clone()

    def encode_tensor(self, x: torch.Tensor, site: Site) -> Payload:
        a = x.detach().float()
        keys, past = self._past(site.samples, a)
        payload = self._quantize((a - past).reshape(-1))  # 1-2
        self._remember(keys, past + self._dequantize(payload, a.numel()).view_as(a))  # 3
        return payload

    def decode_tensor(self, payload: Payload, shape: Sequence[int], site: Site) -> torch.Tensor:
        like = torch.empty(tuple(shape), device=payload[0].device)
        keys, past = self._past(site.samples, like)
        now = past + self._dequantize(payload, math.prod(shape)).view(*shape)
        self._remember(keys, now)
        return now

    def reset(self, key: int | None = None) -> None:
        del key
        self.history.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        if not self.history:
            return {}
        keys = sorted(self.history)
        return {"ids": torch.tensor(keys, dtype=torch.int64),
                "values": torch.stack([self.history[k] for k in keys])}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if "ids" in state:
            self.history = {int(k): v.clone() for k, v in zip(state["ids"].tolist(),
                                                               state["values"])}


@dataclass(frozen=True)
class AQSGDOptions:
    """Options of ``aqsgd``."""

    bits: int = opt(4, "bits a delta element: 4 or 8", choices=(4, 8))
    chunk: int = opt(128, "elements per fp32 absmax scale")

    def __post_init__(self) -> None:
        check(self.chunk >= 1, "aqsgd.chunk", f"got {self.chunk}; use 1 or more")


AQSGD_ENTRY = CodecEntry(
    name="aqsgd", summary="AQ-SGD: quantised activation deltas against a per-sample history on "
    "both sides", options=AQSGDOptions,
    factory=lambda o, seed, rank: AQSGD(o.bits, o.chunk, seed=seed, rank=rank),
    slots=frozenset({"act", "actgrad"}),
    why="it keeps a history per sample, and only a pipeline boundary hands a codec its "
        "samples' ids: it goes on activations or activation gradients (codec_fwd, codec_bwd)")

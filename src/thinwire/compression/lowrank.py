"""``lowrank``: rank-r factors of an activation gradient with Optimus-CC's lazy error propagation.

Song et al., "Optimus-CC: Efficient Large NLP Model Training with 3D Parallelism Aware
Communication Compression" (ASPLOS 2023), compress the activation gradients a pipeline stage
sends back with the PowerSGD step of Vogels et al. (NeurIPS 2019) on one rank's matrix. The
tensor is read as a matrix M [rows, width] (the last dimension is the width), so the codec is
:class:`~thinwire.compression.base.Shaped`:
  1. lazy error propagation (``lep``): M <- M + e, where e is what the previous micro-batch of
     this step at this boundary did not carry (zero for the first micro-batch of a step: the
     error is propagated to the next micro-batch, whose weight gradients it joins in the step's
     sum, never to another step);
  2. Q0 [width, r] standard normal from the shared seed (step, micro-batch);
  3. P = orthonormal basis (QR) of M Q0; Q = M^T P;
  4. send P [rows, r] and Q [width, r] (fp32), r = min(rank, rows, width);
  5. decode P Q^T = P P^T M, M's projection onto span(P): exact when rank(M) <= r;
     e <- M - P Q^T.
Payload 4 r (rows + width) bytes. Its slot is the activation gradients only (the registry's
``slots``): on an activation, step 1 would land one micro-batch's error on other samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from thinwire.compression.base import Part, Payload, Shaped, Site, generator
from thinwire.compression.registry import CodecEntry
from thinwire.options import OptionError, check, opt


class LowRank(Shaped):
    """Rank-r factors with lazy error propagation (module docstring, steps 1-5)."""

    name = "lowrank"

    def __init__(self, rank: int = 8, lep: bool = True, *, seed: int = 0,
                 worker: int = 0) -> None:
        super().__init__(seed=seed, rank=worker)
        self.r, self.lep = rank, lep
        self.error: torch.Tensor | None = None
        self._error_step = -1

    def params(self) -> dict[str, Any]:
        return {"rank": self.r, "lep": self.lep}

    @property
    def wants_error_feedback(self) -> bool:
        return False  # its own error, step 1

    def _dims(self, shape: Sequence[int]) -> tuple[int, int, int]:
        width = shape[-1]
        rows = math.prod(shape[:-1])
        return rows, width, min(self.r, rows, width)

    def tensor_spec(self, shape: Sequence[int]) -> tuple[Part, ...]:
        rows, width, r = self._dims(shape)
        return (Part(rows * r, torch.float32), Part(width * r, torch.float32))

    def check_compresses(self, shape: Sequence[int]) -> None:
        """A one-line OptionError when the factors of a ``shape`` tensor are no smaller than
        the tensor itself (r (rows + width) >= rows width): such a rank cannot compress."""
        rows, width, r = self._dims(shape)
        if r * (rows + width) >= rows * width:
            most = (rows * width - 1) // (rows + width)
            fix = f"use rank <= {most}" if most >= 1 else "use another codec"
            raise OptionError(f"codec lowrank:rank={self.r}: its factors of a [{rows}, "
                              f"{width}] boundary hold {r * (rows + width)} values, no fewer "
                              f"than the tensor's {rows * width}, so it cannot compress; {fix}")

    def encode_tensor(self, x: torch.Tensor, site: Site) -> Payload:
        self.check_compresses(tuple(x.shape))
        rows, width, r = self._dims(tuple(x.shape))
        m = x.detach().reshape(rows, width).float()
        # 1. the previous micro-batch's error, within this step
        if self.lep and self.error is not None and self._error_step == site.step \
                and self.error.shape == m.shape:
            m = m + self.error
        # 2. shared Q0; 3. P, Q
        q0 = torch.randn(width, r, generator=generator(self.seed, site.step, site.key),
                         device="cpu").to(m.device)
        p = torch.linalg.qr(m @ q0).Q.contiguous()
        q = (m.T @ p).contiguous()
        if self.lep:  # 5. what the factors do not carry
            self.error, self._error_step = m - p @ q.T, site.step
        return (p, q)

    def decode_tensor(self, payload: Payload, shape: Sequence[int], site: Site) -> torch.Tensor:
        rows, width, r = self._dims(shape)
        p, q = payload[0].reshape(rows, r), payload[1].reshape(width, r)
        return (p @ q.T).view(*shape)

    def reset(self, key: int | None = None) -> None:
        del key
        self.error, self._error_step = None, -1

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.error is None:
            return {}
        return {"error": self.error, "step": torch.tensor(self._error_step)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if "error" in state:
            self.error, self._error_step = state["error"].clone(), int(state["step"])


@dataclass(frozen=True)
class LowRankOptions:
    """Options of ``lowrank``."""

    rank: int = opt(8, "rank r of the factors")
    lep: bool = opt(True, "lazy error propagation: add a micro-batch's error to the next one's")

    def __post_init__(self) -> None:
        check(self.rank >= 1, "lowrank.rank", f"got {self.rank}; use 1 or more")


LOWRANK = CodecEntry(
    name="lowrank", summary="Optimus-CC: rank-r factors of [rows, width] activation gradients, "
    "lazy error propagation to the next micro-batch", options=LowRankOptions,
    factory=lambda o, seed, rank: LowRank(o.rank, o.lep, seed=seed, worker=rank),
    slots=frozenset({"actgrad"}),
    why="Optimus-CC's lazy error propagation adds a micro-batch's error to the next "
        "micro-batch's, whose weight gradients it joins, and it reads a [rows, width] matrix: "
        "it goes on activation gradients only (codec_bwd)")

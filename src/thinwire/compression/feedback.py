"""Error feedback (EF, "memory"): send what was dropped before, later.

Stich, Cordonnier and Jaggi, "Sparsified SGD with Memory" (NeurIPS 2018); Karimireddy et al.,
"Error Feedback Fixes SignSGD" (ICML 2019). Per key (DDP bucket), each rank keeps a residual e
(zero at first) and, for a gradient g:
  1. corrected = g + e;
  2. payload = C(corrected) (what goes on the wire);
  3. e <- corrected - decode(payload) (what the wire did not carry).
Nothing is lost, only delayed: with a contractive C (||C(x) - x||^2 <= (1 - delta) ||x||^2) SGD
with EF converges at SGD's rate. The registry wraps a codec when its ``ef`` option is on and the
codec wants it (:attr:`Compressor.wants_error_feedback`: the biased ones, top-k, unscaled
rand-k, sign, int8, fp16, bf16); QSGD is unbiased with variance factor omega that may exceed 1,
where EF's contraction argument fails, so it runs without. PowerSGD keeps its own residual
against the *aggregated* approximation, as Vogels et al. do (:mod:`thinwire.compression.powersgd`).

Why EF and not EF21 (Richtarik, Sokolov and Fatkhullin, NeurIPS 2021; each rank keeps g_i and
sends C(grad_i - g_i)): EF21's guarantees are sharper with full gradients, but with stochastic
gradients plain EF21 keeps a variance floor unless batches grow (the gap EF21-SGDM later
closed), and it makes the update direction a running state rather than this step's gradient,
which changes what DDP's optimizer sees. Classic EF is what EF-signSGD and PowerSGD were shown
with, keeps the hook stateless apart from e, and is exact for the identity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from thinwire.compression.base import Compressor, Part, Payload, Shapes, empty


class ErrorFeedback(Compressor):
    """Wrap a codec with a residual per key; the wire format and decode are the inner codec's."""

    unbiased = False

    def __init__(self, inner: Compressor) -> None:
        super().__init__(seed=inner.seed, rank=inner.rank)
        self.inner = inner
        self.name = inner.name
        self.linear = inner.linear
        self.residuals: dict[int, torch.Tensor] = {}

    @property
    def wants_error_feedback(self) -> bool:
        return False  # it is the error feedback

    def params(self) -> dict[str, Any]:
        return {**self.inner.params(), "ef": True}

    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        return self.inner.spec(numel, dtype)

    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        flat = x.reshape(-1)
        # 1. add back what earlier steps did not send
        e = self.residuals.get(key)
        if e is not None and (e.shape != flat.shape or e.device != flat.device):
            e = None  # a bucket of another layout: start afresh
        corrected = flat if e is None else torch.add(
            flat, e, out=empty(flat.numel(), flat.dtype, flat.device))
        # 2. compress
        payload = self.inner.encode(corrected, step, key=key)
        # 3. keep what this payload does not carry, in the old residual's memory where there is
        #    one (corrected is then a new tensor, so no payload aliases that memory)
        buf = e if e is not None and e.dtype == corrected.dtype else None
        decoded = self.inner.decode(payload, flat.numel(), step, key=key, out=buf)
        if buf is None:
            self.residuals[key] = corrected - decoded.to(corrected.dtype)
        else:
            self.residuals[key] = torch.sub(corrected, decoded, out=buf)
        return payload

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.decode(payload, numel, step, key=key, out=out)

    def decode_add(self, payload: Payload, out: torch.Tensor, step: int, *, key: int = 0) -> None:
        self.inner.decode_add(payload, out, step, key=key)

    def reset(self, key: int | None = None) -> None:
        if key is None:
            self.residuals.clear()
        else:
            self.residuals.pop(key, None)
        self.inner.reset(key)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"residual.{k}": v for k, v in self.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {int(k.split(".", 1)[1]): v.clone() for k, v in state.items()
                          if k.startswith("residual.")}

    def split_state(self, key: int, shapes: Shapes) -> list[dict[str, torch.Tensor]]:
        sizes = [math.prod(s) for s in shapes]
        e = self.residuals.get(key)
        if e is None or e.numel() != sum(sizes):
            return [{} for _ in shapes]
        return [{"residual": piece.clone()} for piece in e.split(sizes)]

    def join_state(self, key: int, shapes: Shapes,
                   pieces: Sequence[Mapping[str, torch.Tensor]]) -> None:
        found = [p.get("residual") for p in pieces]
        like = next((t for t in found if t is not None), None)
        if like is None:
            self.residuals.pop(key, None)
            return
        self.residuals[key] = torch.cat([
            t.reshape(-1) if t is not None else like.new_zeros(math.prod(s))
            for t, s in zip(found, shapes)])

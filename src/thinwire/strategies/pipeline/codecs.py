"""Codecs of a pipeline boundary: what goes on the wire for an activation or its gradient.

A boundary codec turns the tensor one stage hands the next (forward: the activation; backward:
the gradient of the loss with respect to it) into a payload of typed tensors and back, as the
gradient codecs of :mod:`thinwire.compression` do for flat gradients; unlike them it sees the
tensor's shape and a :class:`Key` (step, micro-batch, the micro-batch's sample ids), and some
keep state on one side (error feedback, Optimus-CC's lazy error) or on both (AQ-SGD's history).
The pipeline sends ``to_bytes(payload)``: the ledger's bytes are exactly the payload's
(:meth:`BoundaryCodec.payload_bytes`, known from the shape without running).

Codecs by spec (``name:key=value,...``):

- every codec of :data:`thinwire.compression.CODECS` (``none``, ``fp16``, ``bf16``, ``int8``,
  ``topk``, ``randk``, ``qsgd``, ``sign``) on the flattened tensor, through :class:`Flat`;
  error feedback is *off* at a boundary unless the spec asks ``ef=true`` (each micro-batch holds
  other samples from one step to the next: the residual of micro-batch slot m is added to the
  next step's slot m, which Bian et al. (MLSys 2024) found does not rescue Top-k);
- ``int4``: :class:`Int4`, 4-bit blockwise absmax quantisation, two levels a byte;
- ``lowrank:rank=r``: :class:`LowRank`, PowerSGD-style rank-r factors of the [tokens, width]
  matrix with Optimus-CC's lazy error propagation (for activation gradients);
- ``aqsgd:bits=b``: :class:`AQSGD`, AQ-SGD's quantised activation deltas against a per-sample
  history (for activations);
- ``ae:dim=k`` and ``subspace:dim=k`` are not wire codecs but *bottlenecks*
  (:func:`bottleneck`): modules appended to the sending stage and prepended to the receiving one,
  so the wire carries k coordinates a position (forward and backward).
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from thinwire.compression.base import Compressor, Part, Payload, generator, mix_seed
from thinwire.options import NoOptions, OptionError, build_options, check, opt, parse_spec


@dataclass(frozen=True)
class Key:
    """What a boundary codec may know of a tensor besides its values: the training step, the
    micro-batch's index in the step, and the ids of its samples (one int64 per row, AQ-SGD)."""

    step: int
    micro: int
    samples: torch.Tensor | None = None


class BoundaryCodec(ABC):
    """Encode a boundary tensor of a known shape to a payload and back (module docstring)."""

    name: str = ""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def params(self) -> dict[str, Any]:
        return {}

    def describe(self) -> str:
        items = [k if v is True else f"{k}={v}" for k, v in self.params().items() if v is not False]
        return f"{self.name}({','.join(items)})" if items else self.name

    @abstractmethod
    def spec(self, shape: tuple[int, ...]) -> tuple[Part, ...]:
        """The payload's parts for a float32 tensor of ``shape``."""

    def payload_bytes(self, shape: tuple[int, ...]) -> int:
        return sum(p.nbytes for p in self.spec(shape))

    @abstractmethod
    def encode(self, x: torch.Tensor, key: Key) -> Payload: ...

    @abstractmethod
    def decode(self, payload: Payload, shape: tuple[int, ...], key: Key) -> torch.Tensor: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class Flat(BoundaryCodec):
    """A gradient codec of :mod:`thinwire.compression` on the flattened tensor; its per-key
    state (error feedback's residual) and shared randomness (Rand-k's indices) are keyed by the
    micro-batch's slot, so sender and receiver agree without sending indices."""

    def __init__(self, codec: Compressor) -> None:
        super().__init__(codec.seed)
        self.codec = codec
        self.name = codec.name

    def describe(self) -> str:
        return self.codec.describe()

    def spec(self, shape: tuple[int, ...]) -> tuple[Part, ...]:
        return self.codec.spec(math.prod(shape), torch.float32)

    def encode(self, x: torch.Tensor, key: Key) -> Payload:
        return self.codec.encode(x.detach().reshape(-1).float(), key.step, key=key.micro)

    def decode(self, payload: Payload, shape: tuple[int, ...], key: Key) -> torch.Tensor:
        return self.codec.decode(payload, math.prod(shape), key.step, key=key.micro).view(shape)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.codec.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.codec.load_state_dict(state)


# --- 4-bit quantisation ----------------------------------------------------------------------------
def quantize4(flat: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-3 of :class:`Int4`: (packed uint8 levels, fp32 scale per chunk)."""
    d = flat.numel()
    pad = (-d) % chunk
    x = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
    rows = x.view(-1, chunk)
    scale = rows.abs().amax(dim=1) / 7
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (torch.round(rows / safe[:, None]).clamp_(-7, 7) + 8).to(torch.uint8).reshape(-1)[:d]
    if d % 2:
        q = torch.cat([q, q.new_full((1,), 8)])
    pairs = q.view(-1, 2)
    return (pairs[:, 0] << 4) | pairs[:, 1], scale


def dequantize4(packed: torch.Tensor, scale: torch.Tensor, numel: int, chunk: int
                ) -> torch.Tensor:
    """Step 4 of :class:`Int4`: (level - 8) x scale of its chunk, ``numel`` floats."""
    levels = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:numel]
    values = levels.float() - 8
    pad = (-numel) % chunk
    if pad:
        values = torch.cat([values, values.new_zeros(pad)])
    return (values.view(-1, chunk) * scale[:, None]).reshape(-1)[:numel]


class Int4(BoundaryCodec):
    """4-bit quantisation with an fp32 absmax scale per chunk:
      1. cut x into chunks of ``chunk`` elements; 2. scale = max |x_i| / 7 per chunk;
      3. level = round(x_i / scale) in [-7, 7], stored as level + 8 in a nibble, two a byte
         (high nibble first); 4. decode (level - 8) scale.
    |x_i - x_hat_i| <= scale / 2 (round to nearest); payload ceil(d / 2) + 4 ceil(d / chunk)
    bytes."""

    name = "int4"

    def __init__(self, chunk: int = 128, seed: int = 0) -> None:
        super().__init__(seed)
        self.chunk = chunk

    def params(self) -> dict[str, Any]:
        return {"chunk": self.chunk}

    def spec(self, shape: tuple[int, ...]) -> tuple[Part, ...]:
        d = math.prod(shape)
        return (Part((d + 1) // 2, torch.uint8), Part(math.ceil(d / self.chunk), torch.float32))

    def encode(self, x: torch.Tensor, key: Key) -> Payload:
        return quantize4(x.detach().reshape(-1).float(), self.chunk)

    def decode(self, payload: Payload, shape: tuple[int, ...], key: Key) -> torch.Tensor:
        packed, scale = payload
        return dequantize4(packed, scale, math.prod(shape), self.chunk).view(shape)


# --- low rank with lazy error propagation ----------------------------------------------------------
class LowRank(BoundaryCodec):
    """Rank-r factors of the boundary tensor seen as a matrix M [rows, width] (the last dimension
    is the width): Optimus-CC's compression of activation gradients (Song et al., ASPLOS 2023),
    the PowerSGD step of Vogels et al. (NeurIPS 2019) on one rank's matrix:
      1. lazy error propagation (``lep``): M <- M + e, where e is what the previous micro-batch
         of this step at this boundary did not carry (zero for the first micro-batch of a step:
         the error is propagated to the next micro-batch, whose weight gradients it joins in the
         step's sum, never to another step);
      2. Q0 [width, r] standard normal from the shared seed (step, micro-batch);
      3. P = orthonormal basis (QR) of M Q0; Q = M^T P;
      4. send P [rows, r] and Q [width, r] (fp32), r = min(rank, rows, width);
      5. decode P Q^T = P P^T M, M's projection onto span(P): exact when rank(M) <= r;
         e <- M - P Q^T.
    Payload 4 r (rows + width) bytes."""

    name = "lowrank"

    def __init__(self, rank: int = 8, lep: bool = True, seed: int = 0) -> None:
        super().__init__(seed)
        self.rank, self.lep = rank, lep
        self.error: torch.Tensor | None = None
        self._error_step = -1

    def params(self) -> dict[str, Any]:
        return {"rank": self.rank, "lep": self.lep}

    def _dims(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        width = shape[-1]
        rows = math.prod(shape[:-1])
        return rows, width, min(self.rank, rows, width)

    def spec(self, shape: tuple[int, ...]) -> tuple[Part, ...]:
        rows, width, r = self._dims(shape)
        return (Part(rows * r, torch.float32), Part(width * r, torch.float32))

    def check_compresses(self, shape: tuple[int, ...]) -> None:
        """A one-line OptionError when the factors of a ``shape`` boundary are no smaller than
        the tensor itself (r (rows + width) >= rows width): such a rank cannot compress."""
        rows, width, r = self._dims(shape)
        if r * (rows + width) >= rows * width:
            most = (rows * width - 1) // (rows + width)
            fix = f"use rank <= {most}" if most >= 1 else "use another codec"
            raise OptionError(f"codec lowrank:rank={self.rank}: its factors of a [{rows}, "
                              f"{width}] boundary hold {r * (rows + width)} values, no fewer "
                              f"than the tensor's {rows * width}, so it cannot compress; {fix}")

    def encode(self, x: torch.Tensor, key: Key) -> Payload:
        self.check_compresses(tuple(x.shape))
        rows, width, r = self._dims(tuple(x.shape))
        m = x.detach().reshape(rows, width).float()
        # 1. the previous micro-batch's error, within this step
        if self.lep and self.error is not None and self._error_step == key.step \
                and self.error.shape == m.shape:
            m = m + self.error
        # 2. shared Q0; 3. P, Q
        q0 = torch.randn(width, r, generator=generator(self.seed, key.step, key.micro),
                         device="cpu").to(m.device)
        p = torch.linalg.qr(m @ q0).Q.contiguous()
        q = (m.T @ p).contiguous()
        if self.lep:  # 5. what the factors do not carry
            self.error, self._error_step = m - p @ q.T, key.step
        return (p, q)

    def decode(self, payload: Payload, shape: tuple[int, ...], key: Key) -> torch.Tensor:
        rows, width, r = self._dims(shape)
        p, q = payload[0].reshape(rows, r), payload[1].reshape(width, r)
        return (p @ q.T).view(shape)

    def state_dict(self) -> dict[str, Any]:
        return {} if self.error is None else {"error": self.error, "step": self._error_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "error" in state:
            self.error, self._error_step = state["error"].clone(), int(state["step"])


# --- AQ-SGD ----------------------------------------------------------------------------------------
class AQSGD(BoundaryCodec):
    """AQ-SGD (Wang et al., "Fine-tuning Language Models over Slow Networks using Activation
    Compression with Guarantees", NeurIPS 2022): quantise the *change* of each sample's
    activation since the last time that sample crossed this boundary.

    Sender and receiver keep the same history m_i per sample id i (zero before its first visit):
      1. delta = a - m_i (the micro-batch's rows against their histories);
      2. send Q(delta): ``bits`` = 4 (:class:`Int4`) or 8 (int8, fp32 absmax per chunk);
      3. both sides: m_i <- m_i + Q^-1(Q(delta)); the receiver uses m_i as the activation.
    As training converges the deltas shrink and so does the quantisation error, which is what
    makes the method's guarantee. The ids come with the :class:`Key` (one per row); the history
    costs one activation per sample on both sides of the boundary."""

    name = "aqsgd"

    def __init__(self, bits: int = 4, chunk: int = 128, seed: int = 0) -> None:
        super().__init__(seed)
        self.bits, self.chunk = bits, chunk
        self.history: dict[int, torch.Tensor] = {}

    def params(self) -> dict[str, Any]:
        return {"bits": self.bits}

    def spec(self, shape: tuple[int, ...]) -> tuple[Part, ...]:
        d = math.prod(shape)
        levels = Part((d + 1) // 2, torch.uint8) if self.bits == 4 else Part(d, torch.int8)
        return (levels, Part(math.ceil(d / self.chunk), torch.float32))

    def _quantize(self, flat: torch.Tensor) -> Payload:
        if self.bits == 4:
            return quantize4(flat, self.chunk)
        pad = (-flat.numel()) % self.chunk
        rows = (torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).view(-1, self.chunk)
        scale = rows.abs().amax(dim=1) / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(rows / safe[:, None]).to(torch.int8).reshape(-1)[:flat.numel()]
        return (q, scale)

    def _dequantize(self, payload: Payload, numel: int) -> torch.Tensor:
        if self.bits == 4:
            return dequantize4(payload[0], payload[1], numel, self.chunk)
        q, scale = payload
        pad = (-numel) % self.chunk
        v = q.float()
        v = torch.cat([v, v.new_zeros(pad)]) if pad else v
        return (v.view(-1, self.chunk) * scale[:, None]).reshape(-1)[:numel]

    def _past(self, ids: torch.Tensor | None, like: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        if ids is None or ids.numel() != like.shape[0]:
            raise ValueError("aqsgd needs the ids of the micro-batch's samples (one per row)")
        keys = [int(i) for i in ids.tolist()]
        zero = torch.zeros(like.shape[1:], dtype=torch.float32, device=like.device)
        return keys, torch.stack([self.history.get(k, zero) for k in keys])

    def _remember(self, keys: list[int], values: torch.Tensor) -> None:
        for k, v in zip(keys, values):
            self.history[k] = v.clone()

    def encode(self, x: torch.Tensor, key: Key) -> Payload:
        a = x.detach().float()
        keys, past = self._past(key.samples, a)
        payload = self._quantize((a - past).reshape(-1))  # 1-2
        self._remember(keys, past + self._dequantize(payload, a.numel()).view_as(a))  # 3
        return payload

    def decode(self, payload: Payload, shape: tuple[int, ...], key: Key) -> torch.Tensor:
        like = torch.empty(shape, device=payload[0].device)
        keys, past = self._past(key.samples, like)
        now = past + self._dequantize(payload, math.prod(shape)).view(shape)
        self._remember(keys, now)
        return now

    def state_dict(self) -> dict[str, Any]:
        if not self.history:
            return {}
        keys = sorted(self.history)
        return {"ids": torch.tensor(keys, dtype=torch.int64),
                "values": torch.stack([self.history[k] for k in keys])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "ids" in state:
            self.history = {int(k): v.clone() for k, v in zip(state["ids"].tolist(),
                                                               state["values"])}


def sample_ids(x: torch.Tensor) -> torch.Tensor:
    """One int64 id per row of ``x`` from its content: two polynomial hashes modulo the prime
    p = 2^31 - 1 with fixed weights, combined to a 62-bit id (a collision among n samples has
    probability about n^2 / 2^62). A sample is what it contains, so the batch format needs no
    id column and ranks agree without messages; identical rows share one AQ-SGD history, which
    is right (the same input gives the same activation)."""
    p = 2**31 - 1
    rows = x.reshape(x.shape[0], -1)
    if rows.is_floating_point():
        rows = rows.float().view(torch.int32)
    v = rows.to(torch.int64) % p
    n = v.shape[1]
    g = generator(0x1D5, n)
    w = torch.randint(1, p, (2, n), generator=g, dtype=torch.int64).to(x.device)
    h1 = ((v * w[0]) % p).sum(dim=1) % p
    h2 = ((v * w[1]) % p).sum(dim=1) % p
    return h1 * p + h2


# --- bottlenecks: a learned autoencoder, a fixed subspace ------------------------------------------
class Project(nn.Module):
    """z = h U for a fixed orthonormal U [width, k] (a buffer, not trained)."""

    def __init__(self, basis: torch.Tensor) -> None:
        super().__init__()
        self.basis: torch.Tensor
        self.register_buffer("basis", basis)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.basis


class Lift(nn.Module):
    """h = z U^T: the point of the subspace with coordinates z."""

    def __init__(self, basis: torch.Tensor) -> None:
        super().__init__()
        self.basis: torch.Tensor
        self.register_buffer("basis", basis)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z @ self.basis.T


def bottleneck(spec: str, width: int, seed: int, boundary: int) -> tuple[nn.Module, nn.Module]:
    """(encoder on the sending stage, decoder on the receiving one) of a bottleneck spec:

    - ``ae:dim=k``: Bian et al. (MLSys 2024)'s learned autoencoder, Linear(width, k) then
      Linear(k, width), trained jointly with the model (each half by its stage's optimizer);
    - ``subspace:dim=k``: in the spirit of Protocol Models (Pluralis, 2025), the stage output is
      constrained to a fixed k-dimensional subspace shared by both sides: the sender sends the
      k coordinates z = h U (U orthonormal, from the seed), the receiver continues from z U^T,
      the projection of h. Nothing of the constrained output is lost on the wire.
    Both are drawn from (seed, boundary), so every rank builds the same modules."""
    name, o = bottleneck_options(spec)
    if o.dim >= width:
        raise OptionError(f"codec {spec}: dim {o.dim} is not below the width {width} of "
                          f"boundary {boundary}, so it cannot compress; use dim < {width}")
    k = o.dim
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(mix_seed(seed, boundary, 0xB07) % 2**63)
        if name == "ae":
            return nn.Linear(width, k), nn.Linear(k, width)
        basis = torch.linalg.qr(torch.randn(width, k)).Q.contiguous()
    return Project(basis), Lift(basis.clone())


# --- options and the registry --------------------------------------------------------------------
@dataclass(frozen=True)
class Int4Options:
    chunk: int = opt(128, "elements per fp32 absmax scale")

    def __post_init__(self) -> None:
        check(self.chunk >= 1, "int4.chunk", f"got {self.chunk}; use 1 or more")


@dataclass(frozen=True)
class LowRankOptions:
    rank: int = opt(8, "rank r of the factors")
    lep: bool = opt(True, "lazy error propagation: add a micro-batch's error to the next one's")

    def __post_init__(self) -> None:
        check(self.rank >= 1, "lowrank.rank", f"got {self.rank}; use 1 or more")


@dataclass(frozen=True)
class AQSGDOptions:
    bits: int = opt(4, "bits a delta element: 4 or 8", choices=(4, 8))
    chunk: int = opt(128, "elements per fp32 absmax scale")

    def __post_init__(self) -> None:
        check(self.chunk >= 1, "aqsgd.chunk", f"got {self.chunk}; use 1 or more")


@dataclass(frozen=True)
class BottleneckOptions:
    dim: int = opt(16, "coordinates a position on the wire (k)")

    def __post_init__(self) -> None:
        check(self.dim >= 1, "dim", f"got {self.dim}; use 1 or more")


OWN: dict[str, tuple[type, Any]] = {
    "int4": (Int4Options, lambda o, seed: Int4(o.chunk, seed)),
    "lowrank": (LowRankOptions, lambda o, seed: LowRank(o.rank, o.lep, seed)),
    "aqsgd": (AQSGDOptions, lambda o, seed: AQSGD(o.bits, o.chunk, seed)),
}
"""The pipeline's own wire codecs (the others come from :data:`thinwire.compression.CODECS`)."""

BACKWARD_ONLY = {"lowrank": "Optimus-CC: its lazy error propagation adds a micro-batch's error "
                             "to the next micro-batch's, whose weight gradients it joins; on an "
                             "activation it would land on other samples"}
"""The pipeline's codecs for activation gradients only (codec_fwd refuses them): why."""

BOTTLENECKS = ("ae", "subspace")
"""Specs that are bottleneck modules, not wire codecs (:func:`bottleneck`)."""


def boundary_names(*, forward: bool) -> str:
    """The boundary codecs for an option's help: every codec of
    :data:`thinwire.compression.CODECS`, the pipeline's own (:data:`OWN`; forward, not those of
    :data:`BACKWARD_ONLY`) and, forward, the bottlenecks (read from the tables, so a new codec
    appears in the help)."""
    from thinwire.compression.registry import CODECS

    own = [n for n in OWN if not (forward and n in BACKWARD_ONLY)]
    return ", ".join([*CODECS.names(), *own, *(BOTTLENECKS if forward else ())])


def bottleneck_options(spec: str) -> tuple[str, BottleneckOptions]:
    name, values = parse_spec(spec, "codec")
    if name not in BOTTLENECKS:
        raise OptionError(f"codec {spec!r} is not a bottleneck; use one of {', '.join(BOTTLENECKS)}")
    return name, build_options(BottleneckOptions, values, name, owner=f"codec {name}")


def is_bottleneck(spec: str) -> bool:
    return parse_spec(spec, "codec")[0] in BOTTLENECKS


def build_boundary(spec: str, *, seed: int = 0, rank: int = 0) -> BoundaryCodec:
    """The wire codec of ``spec`` (module docstring); an unknown name or option is a one-line
    :class:`~thinwire.options.OptionError`."""
    from thinwire.compression import CODECS, build_codec

    name, values = parse_spec(spec, "codec")
    if name in OWN:
        cls, make = OWN[name]
        return make(build_options(cls, values, name, owner=f"codec {name}"), seed)  # type: ignore[no-any-return]
    if name in BOTTLENECKS:
        raise OptionError(f"codec {spec!r} is a bottleneck of the forward activation; give it "
                          "as codec_fwd, not as a wire codec of gradients")
    if name not in CODECS:
        known = sorted({*CODECS.names(), *OWN, *BOTTLENECKS})
        raise OptionError(f"unknown codec {name!r}; use one of {', '.join(known)}")
    entry = CODECS.get(name)
    if entry.options is not NoOptions and "ef" in {f.name for f in dataclasses.fields(entry.options)}:
        values = {"ef": "false", **values}
    return Flat(build_codec(name, values, seed=seed, rank=rank))


def check_spec(spec: str, where: str, *, forward: bool) -> None:
    """A spec :func:`build_boundary` (or, forward, :func:`bottleneck`) accepts, or a one-line
    error naming ``where``."""
    from thinwire.compression.registry import refuse_scatter

    try:
        if forward and is_bottleneck(spec):
            bottleneck_options(spec)
        else:
            build_boundary(spec)
    except OptionError as exc:
        raise OptionError(f"{where}: {exc}") from None
    name = parse_spec(spec, "codec")[0]
    if forward and name in BACKWARD_ONLY:
        raise OptionError(f"{where}: {name} is a codec of activation gradients "
                          f"({BACKWARD_ONLY[name]}); give it as codec_bwd, and for activations "
                          "use e.g. int8, int4, aqsgd or a bottleneck (ae, subspace)")
    refuse_scatter(spec, where)

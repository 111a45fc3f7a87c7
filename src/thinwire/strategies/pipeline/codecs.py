"""Codecs of a pipeline boundary: what goes on the wire for an activation or its gradient.

A boundary's codec is a codec of :mod:`thinwire.compression` (the one interface and registry of
every codec slot), built for the slot ``act`` (forward: the activation a stage hands the next)
or ``actgrad`` (backward: the gradient of the loss with respect to it). The pipeline encodes the
tensor in its shape at a :class:`~thinwire.compression.base.Site` (step, micro-batch, the
micro-batch's sample ids) with ``encode_tensor`` and sends ``to_bytes(payload)``: the ledger's
bytes are exactly the payload's (``tensor_bytes``, known from the shape without running).
Error feedback is *off* at a boundary unless the spec asks ``ef=true`` (each micro-batch holds
other samples from one step to the next: the residual of micro-batch slot m is added to the next
step's slot m, which Bian et al. (MLSys 2024) found does not rescue Top-k). Besides the flat
codecs (``int8``, ``int4``, ``topk``, ...), the registry's codecs of this slot read the shape:
``lowrank:rank=r`` (Optimus-CC, activation gradients only) and ``aqsgd:bits=b`` (AQ-SGD's
per-sample history, whose ids :func:`sample_ids` gives).

``ae:dim=k`` and ``subspace:dim=k`` are not wire codecs but *bottlenecks* (:func:`bottleneck`):
modules appended to the sending stage and prepended to the receiving one, so the wire carries k
coordinates a position (forward and backward); they go only in the forward slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from thinwire.compression.base import Compressor, generator, mix_seed
from thinwire.options import OptionError, build_options, check, opt, parse_spec


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


# --- options ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BottleneckOptions:
    dim: int = opt(16, "coordinates a position on the wire (k)")

    def __post_init__(self) -> None:
        check(self.dim >= 1, "dim", f"got {self.dim}; use 1 or more")


BOTTLENECKS = ("ae", "subspace")
"""Specs that are bottleneck modules, not wire codecs (:func:`bottleneck`)."""


def slot(*, forward: bool) -> str:
    """The registry's slot of a boundary's forward or backward codec."""
    return "act" if forward else "actgrad"


def boundary_names(*, forward: bool) -> str:
    """The boundary codecs for an option's help: the registry's codecs of the slot and,
    forward, the bottlenecks (read from the tables, so a new codec appears in the help)."""
    from thinwire.compression.registry import slot_codecs

    return ", ".join([*slot_codecs(slot(forward=forward)), *(BOTTLENECKS if forward else ())])


def bottleneck_options(spec: str) -> tuple[str, BottleneckOptions]:
    name, values = parse_spec(spec, "codec")
    if name not in BOTTLENECKS:
        raise OptionError(f"codec {spec!r} is not a bottleneck; use one of {', '.join(BOTTLENECKS)}")
    return name, build_options(BottleneckOptions, values, name, owner=f"codec {name}")


def is_bottleneck(spec: str) -> bool:
    return parse_spec(spec, "codec")[0] in BOTTLENECKS


def build_boundary(spec: str, *, forward: bool = False, seed: int = 0,
                   rank: int = 0) -> Compressor:
    """The wire codec of ``spec`` in the forward or backward slot (module docstring): the
    registry's; a bottleneck or an unknown name or option is a one-line
    :class:`~thinwire.options.OptionError`."""
    from thinwire.compression.registry import build

    if is_bottleneck(spec):
        raise OptionError(f"codec {spec!r} is a bottleneck of the forward activation; give it "
                          "as codec_fwd, not as a wire codec of gradients")
    return build(spec, seed=seed, rank=rank, slot=slot(forward=forward))


def check_spec(spec: str, where: str, *, forward: bool) -> None:
    """A spec :func:`build_boundary` (or, forward, :func:`bottleneck`) accepts, or a one-line
    error naming ``where``, the slot and the codecs it takes."""
    from thinwire.compression.registry import check_codec

    if forward and is_bottleneck(spec):
        try:
            bottleneck_options(spec)
        except OptionError as exc:
            raise OptionError(f"{where}: {exc}") from None
        return
    if is_bottleneck(spec):
        raise OptionError(f"{where}: codec {spec!r} is a bottleneck of the forward activation; "
                          "give it as codec_fwd, not as a wire codec of gradients")
    check_codec(spec, where, slot=slot(forward=forward),
                also=BOTTLENECKS if forward else ())

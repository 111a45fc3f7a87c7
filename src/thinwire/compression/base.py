"""The Compressor interface, wire-format helpers and shared randomness.

A compressor (a *codec*) maps a flat tensor x of d elements to a *payload*: a tuple of tensors in
their real wire dtypes (values, int32 indices, int8 levels, uint8 packed bits, fp32 scales), and
back:

    payload = C.encode(x, step, key=bucket)            # on the sender
    x_hat   = C.decode(payload, d, step, key=bucket)   # on every receiver

``C.spec(d, dtype)`` lists the payload's parts (count and dtype of each) without running it, so
``payload_bytes`` and ``nominal_ratio`` (input bytes / payload bytes) are known in advance.

Every codec slot (data-parallel gradients, outer deltas, tensor-parallel sums, a pipeline
boundary's activations and activation gradients) takes this one interface. A slot that hands
the codec a tensor of known shape at a :class:`Site` (step, key, sample ids) calls the tensor
forms, which flatten for the flat codecs and keep the shape for the codecs that read it
(:attr:`Compressor.shaped`: low rank's [rows, width] matrix, AQ-SGD's per-sample rows):

    payload = C.encode_tensor(x, site)                 # x of any shape
    x_hat   = C.decode_tensor(payload, x.shape, site)  # C.tensor_bytes(x.shape) bytes between

State lives in the codec where it needs it (error feedback's residual per key, PowerSGD's warm
start, low rank's lazy error, AQ-SGD's history per sample) and travels with ``state_dict``.

The whole exchange belongs to the codec: :meth:`Compressor.average_async` averages a tensor over
all ranks through :class:`~thinwire.runtime.comm.Comm`, and :meth:`Compressor.collectives` lists
the collectives one such exchange issues, with their payload bytes, without running anything (so
a planner or a method's traffic formula gets the ledger's bytes exactly). The defaults:

- ``linear`` codecs, whose payloads may be *summed* by an all-reduce and decoded once
  (``decode(sum_i p_i) = sum_i decode(p_i)``): 1. divide x by the world size n; 2. encode;
  3. one all-reduce of the single payload tensor; 4. decode the sum once: the average;
- the others: 1. encode; 2. view the payload's tensors as bytes and all-gather exactly those
  bytes; 3. decode every rank's payload and sum them in rank order (so every rank computes the
  same sum); 4. divide by n;
- with the codec option ``exchange=scatter`` (fp4, int8): the scattered exchange of
  :mod:`.scatter`, a quantised reduce-scatter summed in fp32 and an all-gather of the
  re-quantised mean (2 (n - 1) / n payloads a rank instead of n - 1).

PowerSGD overrides both (two all-reduces, per tensor of a bucket). Whether a codec wants the
generic error feedback wrapper is the codec's property :attr:`Compressor.wants_error_feedback`.

Devices: every tensor, buffer and generator follows the input's device. Randomness is never
sent. Randomness every rank must agree on comes from (seed, step, key) alone: PowerSGD's first
Q from :meth:`Compressor.shared_generator`, a CPU ``torch.Generator`` drawn on the CPU (O(m r)
numbers) and moved to the input's device; Rand-k's indices from a counter-based integer hash of
each index and shared keys (:func:`~thinwire.compression.quantize.counter_hash`), computed
with exact integer arithmetic wherever it is needed (the compiled kernels, or torch on the
input's device). Either way ranks agree whatever device each of them computes on, and results
are identical across devices.
Randomness each rank draws for itself (QSGD's stochastic rounding, O(d) numbers) comes from
:meth:`Compressor.private_generator` on the input's device (on the CPU, from a counter-based
stream, :class:`~thinwire.compression.quantize.CounterUniform`); it also mixes in the rank, so
draws are independent across ranks yet reproducible on one device. A CPU and a CUDA rank therefore draw
different (equally distributed) roundings.

One concept, one file (over 400 lines): the one codec interface every slot calls, with the wire
format and the randomness its codecs share.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from thinwire.runtime.comm import Comm
from thinwire.runtime.ledger import nbytes

Payload = tuple[torch.Tensor, ...]
"""The encoded form of a tensor: its parts, in their wire dtypes."""

Collective = tuple[str, int]
"""``(op, payload bytes)``: one collective an exchange issues ("all_reduce" or "all_gather")."""

Shapes = Sequence[Sequence[int]]

_MASK64 = (1 << 64) - 1

BLOCK = 1 << 16
"""Elements per block of the CPU fast paths: a block and its temporaries stay in the caches, so
the input is read from memory once and the output written once, however many operations a
codec applies in between (and blocks are large enough that numpy's per-call overhead stays
small)."""

LARGE_BLOCK = 1 << 19
"""Elements per block of the CPU fast paths that issue many calls per block (torch's per-call
cost is several microseconds): 2 MB of fp32 stays in the last-level cache, and the calls'
fixed cost is spread over eight times as many elements as at :data:`BLOCK`."""


@dataclass(frozen=True)
class Part:
    """One tensor of a payload: how many elements of which dtype go on the wire."""

    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix_seed(*parts: int) -> int:
    """A well-spread 63-bit seed from integers (seed, step, key, ...): distinct tuples differ."""
    h = 0
    for p in parts:
        h = _splitmix64(h ^ (p & _MASK64))
    return h >> 1


def generator(*parts: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with :func:`mix_seed` of ``parts``."""
    return torch.Generator(device=device).manual_seed(mix_seed(*parts))


def on_cpu(x: torch.Tensor) -> bool:
    """Whether ``x`` is in CPU memory, where the numpy fast paths apply (every other device
    takes the torch path, which is also the fast paths' reference in the tests)."""
    return x.is_cpu


def is_cpu_float32(x: torch.Tensor) -> bool:
    """Whether the float32 numpy fast paths apply: a float32 tensor in CPU memory."""
    return on_cpu(x) and x.dtype == torch.float32


def as_numpy(x: torch.Tensor) -> np.ndarray:
    """The numpy view of a CPU tensor (no copy; autograd's flag dropped)."""
    return x.detach().numpy()


NUMPY_DTYPES = MappingProxyType({
    torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
    torch.bfloat16: np.uint16, torch.int8: np.int8, torch.uint8: np.uint8,
    torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
})
"""Torch dtypes -> numpy dtypes of the same width (bfloat16's bits as uint16)."""


def empty(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised flat tensor on ``device``. On the CPU numpy allocates it: numpy asks the
    kernel for huge pages for large buffers, so a fresh 64 MB output costs about half as much
    to touch as one from torch's allocator."""
    if (device != "cpu" and torch.device(device).type != "cpu") or dtype not in NUMPY_DTYPES:
        return torch.empty(numel, dtype=dtype, device=device)
    t = torch.from_numpy(np.empty(numel, NUMPY_DTYPES[dtype]))
    return t if t.dtype is dtype else t.view(dtype)  # bfloat16 is numpy's uint16


def blocks(numel: int, block: int = BLOCK) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of consecutive blocks covering ``range(numel)``."""
    for start in range(0, numel, block):
        yield start, min(start + block, numel)


def chunk_rows(flat: torch.Tensor, chunk: int) -> torch.Tensor:
    """``flat`` as rows of ``chunk`` elements, the last one padded with zeros (a view where
    ``chunk`` divides its length): the chunks of the codecs with one scale per chunk."""
    pad = (-flat.numel()) % chunk
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, chunk)


def byte_bits() -> np.ndarray:
    """(256, 8) booleans: row b holds the bits of byte b, most significant first."""
    return np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(bool)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Booleans -> uint8, 8 to a byte, most significant bit first: exactly ceil(d / 8) bytes.

    On CPU through ``numpy.packbits`` (same layout, ~20x faster than the torch expression); on
    any other device :func:`pack_bits_torch`. The result is on the input's device."""
    if on_cpu(bits):
        return torch.from_numpy(np.packbits(as_numpy(bits.reshape(-1).bool())))
    return pack_bits_torch(bits)


def pack_bits_torch(bits: torch.Tensor) -> torch.Tensor:
    """:func:`pack_bits` in torch operations (any device; the bit weights live on it too)."""
    flat = bits.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=flat.device)
    return (flat.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` booleans, on the input's device."""
    if on_cpu(packed):
        return torch.from_numpy(np.unpackbits(as_numpy(packed), count=numel)).bool()
    return unpack_bits_torch(packed, numel)


def unpack_bits_torch(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """:func:`unpack_bits` in torch operations (any device; the shifts live on it too)."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    bits = (packed.reshape(-1, 1) >> shifts) & 1
    return bits.reshape(-1)[:numel].bool()


def to_bytes(payload: Payload) -> torch.Tensor:
    """Concatenate heterogeneous payload tensors into one uint8 buffer (their exact bytes)."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in payload])


def from_bytes(buf: torch.Tensor, spec: Sequence[Part]) -> Payload:
    """Split a :func:`to_bytes` buffer back into typed tensors: views where the offset is aligned
    to the part's dtype, aligned copies where it is not."""
    out: list[torch.Tensor] = []
    offset = 0
    start = buf.storage_offset()
    for part in spec:
        piece = buf[offset:offset + part.nbytes]
        aligned = (start + offset) % part.dtype.itemsize == 0
        out.append(piece.view(part.dtype) if aligned else piece.clone().view(part.dtype))
        offset += part.nbytes
    if offset != buf.numel():
        raise ValueError(f"payload of {buf.numel()} bytes does not match its spec ({offset} bytes)")
    return tuple(out)


def count_k(ratio: float, numel: int) -> int:
    """Elements kept by a sparsifier: ceil(ratio * d), at least 1 and at most d."""
    return max(1, min(numel, math.ceil(ratio * numel - 1e-9)))


def _format(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Site:
    """Where a tensor is encoded, besides its values: the training step, the ``key`` of the
    codec's per-key state and shared randomness (a DDP bucket, a micro-batch's slot, a
    fragment, a call site), and the ids of its samples, one int64 per row, where the slot has
    them (a pipeline boundary; :attr:`Compressor.needs_samples`)."""

    step: int
    key: int = 0
    samples: torch.Tensor | None = None


def done(value: torch.Tensor) -> torch.futures.Future:
    """A Future already holding ``value``."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


class Compressor(ABC):
    """Encode a flat tensor into a payload of typed tensors, decode it back, and average a
    tensor over all ranks through a :class:`~thinwire.runtime.comm.Comm`."""

    name: str = ""
    #: payloads may be summed by all-reduce and decoded once
    linear: bool = False
    #: E[decode(encode(x))] = x
    unbiased: bool = False
    #: reads the tensor's shape: encoded only through the tensor forms (:meth:`encode_tensor`)
    shaped: bool = False
    #: keeps state per sample: the slot hands it the samples' ids (:class:`Site`)
    needs_samples: bool = False

    def __init__(self, *, seed: int = 0, rank: int = 0) -> None:
        self.seed = seed
        self.rank = rank

    # --- what the codec is ---------------------------------------------------------------------
    @property
    def wants_error_feedback(self) -> bool:
        """Whether the generic error feedback (:class:`~.feedback.ErrorFeedback`) should wrap
        this codec when EF is on: the biased codecs that keep no residual of their own."""
        return not self.unbiased

    def params(self) -> dict[str, Any]:
        """The settings that make this codec what it is (for :meth:`describe`)."""
        return {}

    def describe(self) -> str:
        """A label such as ``topk(ratio=0.01,ef)``: true flags by name, false ones left out."""
        items = [k if v is True else f"{k}={_format(v)}" for k, v in self.params().items()
                 if v is not False]
        return f"{self.name}({','.join(items)})" if items else self.name

    def __repr__(self) -> str:
        return self.describe()

    # --- the wire format -----------------------------------------------------------------------
    @abstractmethod
    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        """The payload's parts for an input of ``numel`` elements of ``dtype``."""

    @abstractmethod
    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        """The payload of flat ``x`` at ``step`` (``key``: the bucket, for shared randomness)."""

    @abstractmethod
    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The flat tensor of ``numel`` elements a payload stands for; written into ``out``
        (any float dtype, on the payload's device) and returned when it is given."""

    def decode_add(self, payload: Payload, out: torch.Tensor, step: int, *, key: int = 0) -> None:
        """``out += decode(payload)`` (sparse codecs add in place, without a dense temporary)."""
        out.add_(self.decode(payload, out.numel(), step, key=key))

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return sum(p.nbytes for p in self.spec(numel, dtype))

    # --- the tensor forms: a tensor of known shape at a site ----------------------------------
    def tensor_spec(self, shape: Sequence[int]) -> tuple[Part, ...]:
        """The payload's parts for a float32 tensor of ``shape`` (flat codecs: of its numel)."""
        return self.spec(math.prod(shape), torch.float32)

    def tensor_bytes(self, shape: Sequence[int]) -> int:
        """The payload's exact bytes for a float32 tensor of ``shape``."""
        return sum(p.nbytes for p in self.tensor_spec(shape))

    def encode_tensor(self, x: torch.Tensor, site: Site) -> Payload:
        """The payload of ``x`` (any shape, as float32) at ``site`` (flat codecs: of its
        flattening, with the site's step and key)."""
        return self.encode(x.detach().reshape(-1).float(), site.step, key=site.key)

    def decode_tensor(self, payload: Payload, shape: Sequence[int], site: Site) -> torch.Tensor:
        """The tensor of ``shape`` a payload of :meth:`encode_tensor` stands for."""
        return self.decode(payload, math.prod(shape), site.step, key=site.key).view(*shape)

    def nominal_ratio(self, numel: int, dtype: torch.dtype = torch.float32) -> float:
        """Input bytes over payload bytes (> 1 is a saving), computed without running."""
        return numel * dtype.itemsize / self.payload_bytes(numel, dtype)

    # --- the exchange --------------------------------------------------------------------------
    def collectives(self, numel: int, shapes: Shapes | None = None,
                    dtype: torch.dtype = torch.float32, *, world: int = 1) -> list[Collective]:
        """The collectives one :meth:`average_async` of ``numel`` elements (the tensors of
        ``shapes``, flattened and concatenated) over ``world`` ranks issues, with the payload
        bytes this rank hands to each: what the ledger records, computed without running
        anything. Only the scattered exchange (:mod:`.scatter`) depends on ``world``."""
        del shapes, world  # only PowerSGD's layout depends on the tensors' shapes
        return [("all_reduce" if self.linear else "all_gather", self.payload_bytes(numel, dtype))]

    def cannot_compress(self, shapes: Shapes) -> str:
        """Why this codec would send no fewer bytes than plain averaging for gradients of
        ``shapes`` (a one-line reason naming the fix), or '' when it compresses them. Codecs
        whose saving depends on the shapes override it (PowerSGD's rank)."""
        del shapes
        return ""

    def exchange_bytes(self, numel: int, shapes: Shapes | None = None,
                       dtype: torch.dtype = torch.float32, *, world: int = 1) -> int:
        """Payload bytes this rank hands to collectives per exchange (sum of
        :meth:`collectives`)."""
        return sum(b for _, b in self.collectives(numel, shapes, dtype, world=world))

    def average_async(self, comm: Comm, x: torch.Tensor, step: int, *, key: int = 0,
                      tag: str = "grad", shapes: Shapes | None = None
                      ) -> tuple[torch.futures.Future, int]:
        """Future of the all-rank mean of ``x`` (``x``'s shape, dtype and device) and the
        payload bytes this rank handed to collectives. ``x`` is
        overwritten when contiguous (the mean is decoded into it). ``shapes``: the tensors ``x`` concatenates
        (DDP's bucket), used by codecs with a per-tensor layout."""
        del shapes
        world, numel = comm.world_size, x.numel()
        flat = x.reshape(-1)
        if self.linear:
            # 1. divide; 2. encode
            payload = self.encode(flat.div_(world), step, key=key)
            if len(payload) != 1:
                raise TypeError(f"{self.describe()}: a linear codec's payload is one tensor")
            (wire,) = payload

            def decode_sum(f: torch.futures.Future) -> torch.Tensor:
                # 4. decode the sum once, into x
                return self.decode((f.value(),), numel, step, key=key, out=flat).view_as(x)

            # 3. sum the payloads
            return comm.all_reduce_async(wire, tag=tag).then(decode_sum), nbytes(wire)
        # 1. encode (x is free afterwards)
        wire = to_bytes(self.encode(flat, step, key=key))
        spec = self.spec(numel, x.dtype)

        def decode_all(f: torch.futures.Future) -> torch.Tensor:
            # 3. decode every rank's payload, summed in rank order; 4. divide
            rows = f.value().view(world, -1)
            self.decode(from_bytes(rows[0], spec), numel, step, key=key, out=flat)
            for r in range(1, world):
                self.decode_add(from_bytes(rows[r], spec), flat, step, key=key)
            return flat.div_(world).view_as(x)

        # 2. gather every rank's exact bytes
        return comm.all_gather_async(wire, tag=tag).then(decode_all), nbytes(wire)

    # --- randomness ----------------------------------------------------------------------------
    def shared_generator(self, step: int, key: int = 0) -> torch.Generator:
        """Randomness every rank draws identically at (step, key): a CPU generator, whose draws
        are moved to the input's device (identical on every device)."""
        return generator(self.seed, step, key)

    def private_generator(self, step: int, key: int = 0,
                          device: torch.device | str = "cpu") -> torch.Generator:
        """Randomness of this rank alone at (step, key), on ``device``, independent across
        ranks."""
        return generator(self.seed, step, key, self.rank, 0x5EED, device=device)

    def close(self) -> None:
        """Finish the exchanges in flight and free what the exchange holds (a thread); nothing
        by default."""
        return None

    # --- state ---------------------------------------------------------------------------------
    def reset(self, key: int | None = None) -> None:
        """Forget per-key state (residuals, warm starts): all of it when ``key`` is None."""
        del key  # stateless by default

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        del state

    def split_state(self, key: int, shapes: Shapes) -> list[dict[str, torch.Tensor]]:
        """Key ``key``'s state cut per tensor of its flat buffer (``shapes`` in buffer order),
        so it can follow a tensor into another bucket (:class:`~.hooks.HookState`); the key's
        state is left in place. Stateless codecs: empty pieces."""
        del key
        return [{} for _ in shapes]

    def join_state(self, key: int, shapes: Shapes,
                   pieces: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Install per-tensor ``pieces`` (from :meth:`split_state`, possibly of other keys) as
        key ``key``'s state; a tensor with no piece starts from zero state."""
        del key, shapes, pieces


class Shaped(Compressor):
    """A codec that reads its tensor's shape (:attr:`Compressor.shaped`): its wire format is
    that of the tensor forms, which it defines; its flat forms are the tensor forms of a
    vector of ``numel`` elements (where the codec needs rows, a vector is refused by the codec's
    own one-line check)."""

    shaped = True

    @abstractmethod
    def tensor_spec(self, shape: Sequence[int]) -> tuple[Part, ...]: ...

    @abstractmethod
    def encode_tensor(self, x: torch.Tensor, site: Site) -> Payload: ...

    @abstractmethod
    def decode_tensor(self, payload: Payload, shape: Sequence[int], site: Site) -> torch.Tensor: ...

    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        del dtype  # the wire format is fixed
        return self.tensor_spec((numel,))

    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        return self.encode_tensor(x.reshape(-1), Site(step, key))

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return write_out(self.decode_tensor(payload, (numel,), Site(step, key)).reshape(-1), out)


def write_out(values: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``values`` as the decoded result: copied into ``out`` when given (unless it is ``out``)."""
    if out is None:
        return values
    target = out.view(-1)
    if values.data_ptr() != target.data_ptr() or values.dtype != target.dtype:
        target.copy_(values.reshape(-1))
    return out

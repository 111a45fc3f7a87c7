"""Predict thinwire's own measured runs: an MLP trained with dp / localsgd / ist / compressed.

The counts follow thinwire's byte ledger, per worker per optimizer step, fp32 (4 bytes):
- dp: payload = all gradient bytes, 4*Psi, handed to a ring all-reduce; estimated wire bytes
  2(n-1)/n x payload; time 2(n-1) alpha + wire / bandwidth.
- localsgd: the same all-reduce once every H steps (payload, wire and time / H).
- compressed: payload 4*Psi / ratio through the same all-reduce, plus encode + decode at
  ``codec_bytes_per_s`` of uncompressed gradient (0: free).
- ist (Yuan et al. 2022), subnet S = 4 x (d*h/n + (L-1)*h^2/n^2 + h*C/n + vectors) bytes, once
  per round of K local steps. Central deployment (rank 0 holds the full model and is also a
  worker): each other worker receives its subnet and sends it back, payload 2S per round; rank
  0 sends and receives the n-1 other subnets, 2(n-1)S, and its link sets the round's time,
  2(n-1) alpha + 2(n-1) S / bandwidth. Sharded deployment: each worker exchanges ~2S, (n-1)/n
  of it on the wire.
Compute: 6 x (weights of the net a worker trains) x batch / compute_flops_per_s, plus a fixed
``step_overhead_s`` per step (Python, autograd and optimizer launch costs; 0 by default).

**Exact ledger bytes** (``steps`` given, :func:`ledger_bytes`): the totals a run of ``steps``
steps writes into its ledgers, to the byte, for thinwire's MLP with ``norm`` (batch: no linear
biases, 2 norm vectors per hidden neuron, nothing shared; layer: 3 vectors per hidden neuron
and the C output biases shared; none: 1 and C):
- dp: DDP hands the hook one bucket of all gradients at step 0 and, from step 1 on, the buckets
  it rebuilt in gradient-ready order (output layer first; within a layer the norm's vectors,
  then the bias, then the weight), each closed as soon as it holds >= its cap, 1 MiB for the
  first bucket and 25 MiB after (torch's defaults, :data:`BUCKET_FIRST`, :data:`BUCKET_CAP`).
  Each bucket b is one all-reduce: payload 4 d_b, sent round(2(n-1)/n x 4 d_b).
- compressed with ``topk_keep`` = r (Top-k with error feedback): per bucket, k_b =
  ceil(r d_b) values (fp32) and int32 indices, 8 k_b bytes all-gathered: sent (n-1) x 8 k_b.
- localsgd: every H-th step one all-reduce of the 4 Psi bytes of the flat parameters.
- ist: per round r, worker j's group of hidden layer i has g_i(j, r) neurons (Partitioner:
  floor(h_i/n), plus one for the (h_i mod n) workers (r + m) mod n, m < h_i mod n); its subnet
  has S_j = d g_0 + sum_i g_i g_{i-1} + g_{L-1} C + v sum_i g_i + shared elements (x copies of
  optimizer state with ``state_copies``). Central: rank 0 sends each j > 0 its S_j and receives
  it back; sharded: owner o sends worker j the part of j's subnet indexed by the neurons o
  owns, and gets it back. Payload counts both directions (send and receive entries), sent one.
Two places where the per-step form above is only the mean: a subnet of the mean size, where the
ledger's groups differ by a neuron when n does not divide h; and a compressed payload handed to
an all-reduce (linear compressors), where Top-k all-gathers, (n-1) x payload on the wire. The
per-step form's IST "wire" counts both directions; the exact form's ``sent`` is the ledger's.

Time with ``steps`` (rank 0, whose clock summary.json reports): per call ``hops x alpha +
wire / bandwidth`` summed over rank 0's calls (all-reduce 2(n-1) hops, all-gather n-1, a
point-to-point exchange n-1), per-op (alpha, bytes/s) from ``links`` (default: ``latency_s``,
``link_bytes_per_s`` for every op), plus ``bucket_overhead_s`` per DDP bucket; compute
(t0 + F / R) and Top-k's codec times ``straggler``, the wait for the slowest worker between
synchronisations; IST adds rank 0's bookkeeping per round, ``round_overhead_s`` / K. ``thinwire plan --calibrate`` (:mod:`thinwire.planner.calibrate`)
measures those constants on this machine and compares with measured runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from thinwire.errors import UsageError
from thinwire.planner.memory import ist_subnet_params
from thinwire.planner.specs import MLPSpec

BUCKET_FIRST = 1 << 20
"""DDP's first bucket cap in bytes (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``)."""
BUCKET_CAP = 25 << 20
"""DDP's bucket cap in bytes (``bucket_cap_mb=25``)."""
HOPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "p2p": lambda n: n - 1}
"""Sequential message steps of one call over n ranks (ring all-reduce, ring all-gather, rank
0's fan-out / fan-in of an exchange)."""


def mlp_layout(widths: Sequence[int], norm: str) -> tuple[int, int]:
    """(vectors per hidden neuron, parameters shared by every subnet) of thinwire's MLP."""
    if norm == "batch":
        return 2, 0
    if norm == "layer":
        return 3, int(widths[-1])
    if norm == "none":
        return 1, int(widths[-1])
    raise UsageError(f"norm={norm!r}; use batch, layer or none")


def mlp_params(widths: Sequence[int], norm: str) -> int:
    """Parameters of thinwire's MLP with these widths and normalisation."""
    vec, shared = mlp_layout(widths, norm)
    w = [int(x) for x in widths]
    return sum(a * b for a, b in zip(w[:-1], w[1:])) + vec * sum(w[1:-1]) + shared


def grad_ready_sizes(widths: Sequence[int], norm: str) -> list[int]:
    """Parameter sizes in the order their gradients become ready (last layer first)."""
    w = [int(x) for x in widths]
    out: list[int] = []
    for i in range(len(w) - 2, -1, -1):  # Linear i maps w[i] -> w[i+1]
        hidden = i < len(w) - 2
        if hidden and norm in ("batch", "layer"):
            out += [w[i + 1], w[i + 1]]
        if norm != "batch":
            out.append(w[i + 1])
        out.append(w[i] * w[i + 1])
    return out


def ddp_buckets(
    widths: Sequence[int],
    norm: str,
    *,
    bytes_per_element: int = 4,
    first: int = BUCKET_FIRST,
    cap: int = BUCKET_CAP,
) -> list[int]:
    """Elements per bucket from step 1 on (module docstring); step 0 is one bucket of all."""
    buckets, size, limit = [], 0, first
    for numel in grad_ready_sizes(widths, norm):
        size += numel
        if size * bytes_per_element >= limit:
            buckets.append(size)
            size, limit = 0, cap
    if size:
        buckets.append(size)
    return buckets


def subnet_sizes(widths: Sequence[int], norm: str, n: int, round_: int) -> list[int]:
    """S_j: parameters of worker j's subnet in ``round_`` (exact Partitioner group sizes)."""
    from thinwire.strategies.ist.partition import group_sizes  # imports torch: on use only

    vec, shared = mlp_layout(widths, norm)
    d, c = int(widths[0]), int(widths[-1])
    sizes = [group_sizes(int(h), n, round_) for h in widths[1:-1]]
    out = []
    for j in range(n):
        g = [s[j] for s in sizes]
        weights = d * g[0] + sum(a * b for a, b in zip(g[1:], g[:-1])) + g[-1] * c
        out.append(weights + vec * sum(g) + shared)
    return out


def ist_pieces(
    widths: Sequence[int],
    norm: str,
    n: int,
    round_: int,
    *,
    deployment: str = "central",
    seed: int = 0,
    copies: int = 1,
) -> np.ndarray:
    """[owner, worker] elements the owner sends the worker at the start of ``round_`` (and gets
    back at its end); the diagonal stays on the rank."""
    from thinwire.strategies.ist.partition import Partitioner  # imports torch: on use only

    vec, shared = mlp_layout(widths, norm)
    d, hidden, c = int(widths[0]), [int(h) for h in widths[1:-1]], int(widths[-1])
    out = np.zeros((n, n), dtype=np.int64)
    if deployment == "central":
        out[0] = subnet_sizes(widths, norm, n, round_)
    elif deployment == "sharded":
        groups = Partitioner(tuple(hidden), n, seed)(round_).groups
        # Ownership.sharded: contiguous blocks, the first (h mod n) one neuron larger
        bounds = [np.cumsum([0] + [h // n + (r < h % n) for r in range(n)]) for h in hidden]
        for o in range(n):
            for j in range(n):
                own = [
                    int(np.count_nonzero((g[j] >= b[o]) & (g[j] < b[o + 1])))
                    for g, b in zip(groups, bounds)
                ]
                full = [len(g[j]) for g in groups]
                e = d * own[0] + sum(a * b for a, b in zip(own[1:], full[:-1])) + own[-1] * c
                out[o, j] = e + vec * sum(own) + (shared if o == 0 else 0)
    else:
        raise UsageError(f"deployment={deployment!r}; use central or sharded")
    np.fill_diagonal(out, 0)
    return out * copies


@dataclass(frozen=True)
class LedgerBytes:
    """Ledger totals of a run (control traffic excluded, as in summary.json) and rank 0's calls.

    ``rank0_calls[op] = (calls, wire bytes)``: what rank 0's communication time is made of.
    """

    sent: tuple[int, ...]
    payload: tuple[int, ...]
    rank0_calls: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def sent_mean(self) -> float:
        return sum(self.sent) / len(self.sent)

    @property
    def payload_mean(self) -> float:
        return sum(self.payload) / len(self.payload)


def ledger_bytes(
    method: str,
    widths: Sequence[int],
    workers: int,
    steps: int,
    *,
    norm: str = "batch",
    period: int = 1,
    local_steps: int = 1,
    deployment: str = "central",
    seed: int = 0,
    topk_keep: float | None = None,
    state_copies: int = 0,
    bytes_per_element: int = 4,
) -> LedgerBytes:
    """The exact bytes of a thinwire run (module docstring); ``method`` as in
    :func:`predict_thinwire_run` (``compressed`` needs ``topk_keep``)."""
    n, e = workers, bytes_per_element
    if n <= 1:
        return LedgerBytes((0,) * max(n, 1), (0,) * max(n, 1))
    if method in ("dp", "compressed"):
        first = [mlp_params(widths, norm)]
        later = ddp_buckets(widths, norm, bytes_per_element=e)
        per_step = [first] + [later] * (steps - 1)
        if method == "dp":
            pay = sum(e * d for bs in per_step for d in bs)
            wire = sum(round(2 * (n - 1) / n * e * d) for bs in per_step for d in bs)
            op = "all_reduce"
        else:
            if topk_keep is None:
                raise UsageError("exact compressed bytes need topk_keep (Top-k's kept fraction)")
            pay = sum(8 * _count_k(topk_keep, d) for bs in per_step for d in bs)
            wire = (n - 1) * pay
            op = "all_gather"
        calls = sum(len(bs) for bs in per_step)
        return LedgerBytes((wire,) * n, (pay,) * n, {op: (calls, wire)})
    if method == "localsgd":
        syncs = steps // period
        pay = e * mlp_params(widths, norm)
        wire = round(2 * (n - 1) / n * pay)
        return LedgerBytes(
            (syncs * wire,) * n, (syncs * pay,) * n, {"all_reduce": (syncs, syncs * wire)}
        )
    if method != "ist":
        raise UsageError(f"method={method!r}; use dp, localsgd, ist or compressed")
    sent = np.zeros(n, dtype=np.int64)
    recv = np.zeros(n, dtype=np.int64)
    rank0_wire = rank0_calls = 0
    for r in range(steps // local_steps):
        p = (
            ist_pieces(
                widths, norm, n, r, deployment=deployment, seed=seed, copies=1 + state_copies
            )
            * e
        )
        out, into = p.sum(axis=1), p.sum(axis=0)  # what each rank sends / receives at the start
        sent += out + into  # the end of the round sends the pieces back
        recv += into + out
        rank0_wire += int(max(out[0], into[0]) + max(into[0], out[0]))
        rank0_calls += 2
    return LedgerBytes(
        tuple(int(x) for x in sent),
        tuple(int(x) for x in sent + recv),
        {"p2p": (rank0_calls, rank0_wire)},
    )


def _count_k(ratio: float, numel: int) -> int:
    """Top-k's k: ceil(ratio d), at least 1, at most d (compression.base.count_k)."""
    return max(1, min(numel, math.ceil(ratio * numel - 1e-9)))


def _subnet_weights(widths: Sequence[int], n: int) -> float:
    w = [widths[0], *(x / n for x in widths[1:-1]), widths[-1]]
    return sum(a * b for a, b in zip(w[:-1], w[1:]))


def _ist_sub_weights(widths: Sequence[int], n: int, steps: int, k: int) -> float:
    """Rank 0's subnet weights averaged over the rounds (exact group sizes)."""
    from thinwire.strategies.ist.partition import group_sizes

    rounds = max(1, steps // k)
    total = 0.0
    for r in range(rounds):
        g = [group_sizes(int(h), n, r)[0] for h in widths[1:-1]]
        w = [widths[0], *g, widths[-1]]
        total += sum(a * b for a, b in zip(w[:-1], w[1:]))
    return total / rounds


def predict_thinwire_run(
    method: str,
    widths: Sequence[int],
    batch_size: int,
    workers: int,
    local_steps: int = 1,
    compression_ratio: float = 1.0,
    compute_flops_per_s: float = 1e11,
    link_bytes_per_s: float = 125e6,
    latency_s: float = 50e-6,
    *,
    period: int | None = None,
    deployment: str = "central",
    bytes_per_element: int = 4,
    codec_bytes_per_s: float = 0.0,
    bias: bool = True,
    steps: int | None = None,
    norm: str = "batch",
    seed: int = 0,
    topk_keep: float | None = None,
    state_copies: int = 0,
    step_overhead_s: float = 0.0,
    round_overhead_s: float = 0.0,
    straggler: float = 1.0,
    bucket_overhead_s: float = 0.0,
    links: Mapping[str, tuple[float, float]] | None = None,
) -> dict[str, float | str]:
    """Bytes and seconds per step of one thinwire run (module docstring for the formulas).

    ``local_steps`` is K for IST and H for local SGD (``period`` overrides it for local SGD);
    ``batch_size`` is per worker; ``link_bytes_per_s`` is the per-worker goodput.
    With ``steps``: exact ledger bytes of a run of that many steps of thinwire's MLP with
    ``norm`` (``bias`` is then unused), per-step means of them, the run totals
    (``sent_per_worker_mean``, ``sent_per_worker_max``, ``payload_per_worker_mean`` as in
    summary.json) and the time of rank 0's actual calls under ``links``
    (``{"all_reduce" | "all_gather" | "p2p": (alpha_s, bytes_per_s)}``). ``round_overhead_s``
    is IST's bookkeeping on rank 0 per round (partition, subnet gather and scatter, the subnet
    module and its optimizer); ``step_overhead_s`` is added to every step's compute;
    ``straggler`` (>= 1) multiplies the work each worker does between two synchronisations (compute, and the codec of compressed DP): a synchronous step
    waits for the slowest of the n workers, not for the mean one; ``bucket_overhead_s`` is
    DDP's cost per bucket and step (dp, compressed) beyond the collective, counted as
    communication.
    """
    if method not in ("dp", "localsgd", "ist", "compressed"):
        raise UsageError(f"method={method!r}; use dp, localsgd, ist or compressed")
    if workers < 1 or batch_size < 1 or local_steps < 1 or compression_ratio < 1:
        raise UsageError(
            "workers, batch_size, local_steps >= 1 and compression_ratio >= 1 required"
        )
    if compute_flops_per_s <= 0 or link_bytes_per_s <= 0 or latency_s < 0:
        raise UsageError("compute_flops_per_s and link_bytes_per_s must be > 0, latency_s >= 0")
    if steps is not None:
        return _predict_exact(
            method,
            widths,
            batch_size,
            workers,
            steps,
            k=(period or local_steps) if method == "localsgd" else local_steps,
            compute_flops_per_s=compute_flops_per_s,
            step_overhead_s=step_overhead_s,
            links=links or {},
            default_link=(latency_s, link_bytes_per_s),
            deployment=deployment,
            norm=norm,
            seed=seed,
            topk_keep=topk_keep,
            state_copies=state_copies,
            e=bytes_per_element,
            codec_bytes_per_s=codec_bytes_per_s,
            round_overhead_s=round_overhead_s,
            straggler=straggler,
            bucket_overhead_s=bucket_overhead_s,
        )
    model = MLPSpec(name="thinwire-run", widths=tuple(widths), bias=bias)
    n, e = workers, float(bytes_per_element)
    full = float(model.params)
    ring = 2.0 * (n - 1) / n if n > 1 else 0.0
    out: dict[str, float | str] = {"method": method, "workers": float(n), "full_params": full}
    codec = 0.0
    root = 0.0
    if method == "ist":
        sub = ist_subnet_params(model, n) if n > 1 else full
        flops = 6.0 * _subnet_weights(widths, n) * batch_size
        s_bytes = sub * e
        k = local_steps
        if n == 1:
            payload = wire = comm = 0.0
        elif deployment == "central":
            payload, root = 2.0 * s_bytes / k, 2.0 * (n - 1) * s_bytes / k
            wire = payload
            comm = (2 * (n - 1) * latency_s + 2 * (n - 1) * s_bytes / link_bytes_per_s) / k
        elif deployment == "sharded":
            payload = 2.0 * s_bytes / k
            wire = payload * (n - 1) / n
            comm = (2 * (n - 1) * latency_s + wire * k / link_bytes_per_s) / k
        else:
            raise UsageError(f"deployment={deployment!r}; use central or sharded")
        out["subnet_params"] = sub
    else:
        flops = 6.0 * _subnet_weights(widths, 1) * batch_size
        grads = full * e
        every = (period or local_steps) if method == "localsgd" else 1
        ratio = compression_ratio if method == "compressed" else 1.0
        payload = grads / ratio / every
        wire = ring * payload
        comm = (
            (2 * (n - 1) * latency_s if n > 1 else 0.0) + wire * every / link_bytes_per_s
        ) / every
        if method == "compressed" and codec_bytes_per_s > 0 and n > 1:
            codec = grads / codec_bytes_per_s
        out["subnet_params"] = full
    compute = flops / compute_flops_per_s + step_overhead_s
    step = compute + comm + codec
    out.update(
        {
            "bytes_per_worker_per_step": payload,
            "wire_bytes_per_worker_per_step": wire,
            "root_bytes_per_step": root if method == "ist" and deployment == "central" else payload,
            "compute_time_s": compute,
            "comm_time_s": comm,
            "codec_time_s": codec,
            "step_time_s": step,
            "samples_per_s": batch_size * n / step,
            "param_bytes_per_worker": float(out["subnet_params"]) * e,
        }
    )
    return out


def _predict_exact(
    method: str,
    widths: Sequence[int],
    batch_size: int,
    n: int,
    steps: int,
    *,
    k: int,
    compute_flops_per_s: float,
    step_overhead_s: float,
    links: Mapping[str, tuple[float, float]],
    default_link: tuple[float, float],
    deployment: str,
    norm: str,
    seed: int,
    topk_keep: float | None,
    state_copies: int,
    e: int,
    codec_bytes_per_s: float,
    round_overhead_s: float,
    straggler: float,
    bucket_overhead_s: float,
) -> dict[str, float | str]:
    """:func:`predict_thinwire_run` with ``steps``: exact bytes, rank 0's calls timed."""
    if steps < 1 or steps % k:
        raise UsageError(f"steps={steps} must be a positive multiple of K or H = {k}")
    full = float(mlp_params(widths, norm))
    lb = ledger_bytes(
        method,
        widths,
        n,
        steps,
        norm=norm,
        period=k,
        local_steps=k,
        deployment=deployment,
        seed=seed,
        topk_keep=topk_keep,
        state_copies=state_copies,
        bytes_per_element=e,
    )
    comm = 0.0
    for op, (calls, wire) in lb.rank0_calls.items():
        alpha, rate = links.get(op, default_link)
        comm += calls * HOPS[op](n) * alpha + wire / rate
        if method in ("dp", "compressed"):
            comm += calls * bucket_overhead_s
    comm /= steps
    codec = 0.0
    if method == "ist" and n > 1:
        weights = _ist_sub_weights(widths, n, steps, k)
        codec = round_overhead_s / k
        sub = float(subnet_sizes(widths, norm, n, 0)[0])
    else:
        weights = _subnet_weights(widths, 1)
        sub = full
        if method == "compressed" and codec_bytes_per_s > 0 and n > 1:
            codec = full * e / codec_bytes_per_s * straggler
    compute = (6.0 * weights * batch_size / compute_flops_per_s + step_overhead_s) * straggler
    step = compute + comm + codec
    return {
        "method": method,
        "workers": float(n),
        "full_params": full,
        "subnet_params": sub,
        "bytes_per_worker_per_step": lb.payload_mean / steps,
        "wire_bytes_per_worker_per_step": lb.sent_mean / steps,
        "root_bytes_per_step": lb.payload[0] / steps,
        "sent_per_worker_mean": lb.sent_mean,
        "sent_per_worker_max": float(max(lb.sent)),
        "payload_per_worker_mean": lb.payload_mean,
        "compute_time_s": compute,
        "comm_time_s": comm,
        "codec_time_s": codec,
        "straggler": straggler,
        "step_time_s": step,
        "samples_per_s": batch_size * n / step,
        "param_bytes_per_worker": sub * e,
    }

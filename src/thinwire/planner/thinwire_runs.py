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
Compute: 6 x (weights of the net a worker trains) x batch / compute_flops_per_s.
A lead wires ``thinwire plan --calibrate`` to measured runs through this function.
"""

from __future__ import annotations

from collections.abc import Sequence

from thinwire.errors import UsageError
from thinwire.planner.memory import ist_subnet_params
from thinwire.planner.specs import MLPSpec


def _subnet_weights(widths: Sequence[int], n: int) -> float:
    w = [widths[0], *(x / n for x in widths[1:-1]), widths[-1]]
    return sum(a * b for a, b in zip(w[:-1], w[1:]))


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
) -> dict[str, float | str]:
    """Bytes and seconds per step of one thinwire run (module docstring for the formulas).

    ``local_steps`` is K for IST and H for local SGD (``period`` overrides it for local SGD);
    ``batch_size`` is per worker; ``link_bytes_per_s`` is the per-worker goodput.
    """
    if method not in ("dp", "localsgd", "ist", "compressed"):
        raise UsageError(f"method={method!r}; use dp, localsgd, ist or compressed")
    if workers < 1 or batch_size < 1 or local_steps < 1 or compression_ratio < 1:
        raise UsageError(
            "workers, batch_size, local_steps >= 1 and compression_ratio >= 1 required"
        )
    if compute_flops_per_s <= 0 or link_bytes_per_s <= 0 or latency_s < 0:
        raise UsageError("compute_flops_per_s and link_bytes_per_s must be > 0, latency_s >= 0")
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
    compute = flops / compute_flops_per_s
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

"""Approximate top-k (``TopK(approx=True)``) against the exact selection: what it leaves out.

For each size d and kind of input (fp32, ``--seeds`` draws each), encode with the exact and the
approximate top-k at the same ratio and report, as the mean over the draws:

- ``err``: ||x - C(x)||^2 / ||x||^2, the share of x's energy the payload does not carry (what
  error feedback keeps for the next step), for each selection;
- ``kept``: the share of the exact k largest the approximate selection sends;
- ``topped up``: the share of draws where fewer than k entries passed the sampled threshold
  (the count then topped up with the lowest free indices);

then, with error feedback over ``--steps`` steps of fresh inputs, the residual's energy at the
end relative to the exact selection's (what the approximation still owes). Inputs: ``gauss``
(N(0, 1)), ``cubed`` (N(0, 1)^3, heavy tails as gradients have), ``lognormal`` scales per block
of 4096 (layers of very different magnitude). Runs in a few seconds at the defaults.

    python benchmarks/topk_approx_error.py [--sizes 1M,16M] [--ratio 0.01] [--seeds 8]
                                           [--steps 10]
"""

from __future__ import annotations

import argparse
import math

import torch

from thinwire.compression import ErrorFeedback, TopK
from thinwire.compression.sparse import _approx_plan

MI = 2**20


def draw(kind: str, d: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(d, generator=g)
    if kind == "cubed":
        return x**3
    if kind == "lognormal":
        scales = torch.randn(math.ceil(d / 4096), generator=g).mul_(2).exp_()
        return x * scales.repeat_interleave(4096)[:d]
    return x


def residual_energy(x: torch.Tensor, codec: TopK) -> float:
    values, idx = codec.encode(x, 0)
    rest = x.clone()
    rest[idx.long()] = 0
    return float(rest.double().square().sum() / x.double().square().sum())


def short_of_k(x: torch.Tensor, k: int) -> bool:
    """Whether fewer than k entries reach the approximate selection's lower threshold."""
    plan = _approx_plan(x.numel(), k)
    if plan is None:
        return False
    stride, want, _ = plan
    sample = x.abs()[::stride]
    t = torch.kthvalue(sample, sample.numel() - want + 1).values
    return int((x.abs() >= t).sum()) < k


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,16M", help="input sizes in M = 2^20 floats")
    ap.add_argument("--ratio", type=float, default=0.01, help="fraction kept, k = ceil(ratio d)")
    ap.add_argument("--seeds", type=int, default=8, help="draws per size and kind")
    ap.add_argument("--steps", type=int, default=10, help="error feedback steps")
    args = ap.parse_args(argv)
    if not 0 < args.ratio <= 1 or args.seeds < 1 or args.steps < 1:
        ap.exit(2, "--ratio must be in (0, 1], --seeds and --steps at least 1\n")
    exact, approx = TopK(args.ratio), TopK(args.ratio, approx=True)
    print(f"ratio {args.ratio}, {args.seeds} draws per cell, error feedback over {args.steps} "
          "steps")
    print()
    print("| d | input | err exact | err approx | kept | topped up | EF residual approx/exact |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for size in args.sizes.split(","):
        d = int(float(size.strip().upper().rstrip("M")) * MI)
        k = math.ceil(args.ratio * d)
        for kind in ("gauss", "cubed", "lognormal"):
            g = torch.Generator().manual_seed(d)
            err_e = err_a = kept = short = 0.0
            for _ in range(args.seeds):
                x = draw(kind, d, g)
                err_e += residual_energy(x, exact)
                err_a += residual_energy(x, approx)
                best = torch.zeros(d, dtype=torch.bool)
                best[exact.encode(x, 0)[1].long()] = True
                kept += float(best[approx.encode(x, 0)[1].long()].float().mean())
                short += short_of_k(x, k)
            owed = []
            for codec in (exact, approx):
                ef = ErrorFeedback(codec)
                g2 = torch.Generator().manual_seed(d + 1)
                for step in range(args.steps):
                    ef.encode(draw(kind, d, g2), step)
                owed.append(float(ef.residuals[0].double().square().sum()))
            n = args.seeds
            print(f"| {size.strip()} | {kind} | {err_e / n:.4f} | {err_a / n:.4f} | "
                  f"{kept / n:.3f} | {short / n:.0%} | {owed[1] / owed[0]:.3f} |")


if __name__ == "__main__":
    main()

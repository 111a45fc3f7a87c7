"""IST's time to DP's converged accuracy on a thin wire: the tables and the figure.

Reads the runs written by ``benchmarks/ist_fast.sh`` (which runs them): loopback runs of every
method and variant for accuracy against steps (accuracy does not depend on the wire), and
testbed runs at 100 Mbit/s for measured wall time. Prints:

1. the target: DP's converged accuracy, the mean of its evaluations over the last
   ``--tail`` of its steps (DP has flattened there; the printed curve shows it);
2. per loopback run: final and best accuracy, steps to the target (first evaluation at or
   above it);
3. per testbed run: measured training wall time to the target (rank 0, evaluation excluded),
   steps to it, the mean measured seconds per step; for DP, whose run to convergence at 100
   Mbit/s is too long here, a *derived* time: its measured seconds per step on the testbed x
   its steps to the target on loopback;
4. the ratios of the best IST variant against the best local SGD and against DP.

Writes the figure (accuracy against steps, and against wall time at 100 Mbit/s) to ``--fig``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from thinwire.report.tables import Run, load_run

LOWER = (0.85, 0.86, 0.87, 0.88, 0.89)


def curve(run: Run) -> list[tuple[int, float, float]]:
    """(step, accuracy, training wall s) of every evaluation."""
    return [(int(r["step"]), float(r["accuracy"]), float(r["wall_s"])) for r in run.evals]


def first_at(run: Run, target: float) -> tuple[int, float] | None:
    """(step, wall s) of the first evaluation at or above ``target``."""
    for step, acc, wall in curve(run):
        if acc >= target:
            return step, wall
    return None


def seconds_per_step(run: Run) -> float:
    """Mean measured training seconds per step, without the first logged interval (one-time
    costs) where there are more."""
    t = [(int(r["step"]), float(r["wall_s"])) for r in run.trains]
    if len(t) >= 3:
        (s0, w0), (s1, w1) = t[0], t[-1]
        return (w1 - w0) / (s1 - s0)
    return t[-1][1] / t[-1][0]


def runs_in(dirs: list[str]) -> list[Run]:
    out = []
    for d in dirs:
        for p in sorted(Path(d).iterdir()):
            if (p / "summary.json").is_file():
                out.append(load_run(p))
    return out


def kind(run: Run) -> str:
    label = run.label
    return "ist" if label.startswith("ist") else label.split("(")[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loopback", nargs="+", default=["runs/istfast/acc", "runs/istfast/accB",
                                                  "runs/istfast/accC"])
    p.add_argument("--testbed", nargs="*", default=["runs/istfast/tb/100mbit",
                                                   "runs/istfast/tb2/100mbit"])
    p.add_argument("--tail", type=float, default=0.2, help="DP's last fraction of steps")
    p.add_argument("--target", type=float, default=None, help="instead of DP's converged one")
    p.add_argument("--fig", default="docs/figures/ist_fast_100mbit.png")
    args = p.parse_args()
    loop = runs_in(args.loopback)
    dp = next(r for r in loop if r.label == "dp")
    dcurve = curve(dp)
    last = dcurve[-1][0]
    tail = [a for s, a, _ in dcurve if s > last * (1 - args.tail)]
    target = args.target if args.target is not None else sum(tail) / len(tail)
    print(f"target: {target:.4f} = DP's mean test accuracy over steps "
          f"{int(last * (1 - args.tail))}-{last} ({len(tail)} evaluations, "
          f"min {min(tail):.4f}, max {max(tail):.4f})")
    print("\nLoopback (accuracy against steps):\n")
    print("| method | final acc | best acc | steps to target |")
    print("|---|---:|---:|---:|")
    steps_to: dict[str, int | None] = {}
    for r in loop:
        c = curve(r)
        hit = first_at(r, target)
        steps_to[r.label] = None if hit is None else hit[0]
        print(f"| {r.label} | {c[-1][1]:.4f} | {max(a for _, a, _ in c):.4f} | "
              f"{'not reached' if hit is None else hit[0]} |")
    print("\nModelled at 100 Mbit/s from the loopback runs (thinwire.testbed.modelled: loopback "
          "compute + ledger bytes / goodput; every figure modelled):\n")
    print("| method | compute s/step (loopback) | s to target (modelled) |")
    print("|---|---:|---:|")
    modelled = {r.label: modelled_curve(r) for r in loop}
    mtimes: dict[str, float] = {}
    for r in loop:
        at = next((w for s, a, w in modelled[r.label] if a >= target), None)
        if at is not None:
            mtimes[r.label] = at
        per = float(r.summary["compute_s"]) / int(r.summary["steps"])
        print(f"| {r.label} | {per:.3f} | {'not reached' if at is None else f'{at:.1f}'} |")
    ratios("modelled", mtimes)
    print("\nModelled time to lower targets (the crossover): best of each family, s; "
          "x = local SGD's or DP's time / IST's\n")
    print("| target | best IST | s | best local SGD | s | dp s | IST vs local SGD | IST vs dp |")
    print("|---:|---|---:|---|---:|---:|---:|---:|")
    for t in (*LOWER, round(target, 4)):
        hits = {lb: next((w for _, a, w in c if a >= t), None) for lb, c in modelled.items()}
        row = [f"{t:.4f}"]
        best: dict[str, float] = {}
        for fam in ("ist", "localsgd"):
            got = {k: v for k, v in hits.items() if k.startswith(fam) and v is not None}
            if got:
                k = min(got, key=lambda x: got[x])
                best[fam] = got[k]
                row += [k, f"{got[k]:.1f}"]
            else:
                row += ["none", "-"]
        d = hits.get("dp")
        row.append("-" if d is None else f"{d:.1f}")
        if "ist" in best:
            row.append(f"{best['localsgd'] / best['ist']:.2f}x" if "localsgd" in best else "-")
            row.append("-" if d is None else f"{d / best['ist']:.2f}x")
        else:
            row += ["-", "-"]
        print("| " + " | ".join(row) + " |")
    bench = [r for d in args.testbed if Path(d).is_dir() for r in runs_in([d])]
    times: dict[str, tuple[float, str]] = {}
    if bench:
        print("\nTestbed, 100 Mbit/s, 4 workers (measured unless marked derived):\n")
        print("| method | steps run | final acc | s/step (measured) | "
              + " | ".join(f"s to {t:.2f}" for t in LOWER)
              + " | steps to target | s to target |")
        print("|---|---:|---:|---:|" + "---:|" * len(LOWER) + "---:|---:|")
        for r in bench:
            c = curve(r)
            sps = seconds_per_step(r)
            hit = first_at(r, target)
            if hit is not None:
                times[r.label] = (hit[1], "measured")
                to = f"{hit[1]:.1f}"
            elif r.label in steps_to and steps_to[r.label] is not None:
                n = steps_to[r.label]
                assert n is not None
                times[r.label] = (sps * n, "derived")
                to = f"{sps * n:.1f} (derived: {sps:.3f} s/step x {n} loopback steps)"
            else:
                to = "not reached"
            low = [first_at(r, t) for t in LOWER]
            print(f"| {r.label} | {c[-1][0]} | {c[-1][1]:.4f} | {sps:.3f} | "
                  + " | ".join("-" if h is None else f"{h[1]:.1f}" for h in low)
                  + f" | {'-' if hit is None else hit[0]} | {to} |")
        ratios("testbed (dp derived)", {k: v[0] for k, v in times.items()})
    plot(loop, bench, target, dp, Path(args.fig), modelled)
    print(f"\nwrote {args.fig}")
    return 0


def modelled_curve(run: Run) -> list[tuple[int, float, float]]:
    """(step, accuracy, modelled wall s at 100 Mbit/s) of a loopback run."""
    from thinwire.testbed.measure import read_ledgers
    from thinwire.testbed.modelled import model_run
    from thinwire.testbed.rates import parse_links

    n = int(run.summary["workers"])
    return model_run(run.summary, run.records, read_ledgers(run.path, n),
                     parse_links("100mbit")[0]).curve


def ratios(kind: str, times: dict[str, float]) -> None:
    """The best IST variant against the best local SGD and against DP."""
    ist = {k: v for k, v in times.items() if k.startswith("ist")}
    local = {k: v for k, v in times.items() if k.startswith("localsgd")}
    if not ist:
        print(f"\n{kind}: no IST variant reached the target")
        return
    best = min(ist, key=lambda k: ist[k])
    line = f"\n{kind}: best IST variant {best} {ist[best]:.1f} s"
    if local:
        bl = min(local, key=lambda k: local[k])
        line += (f"; best local SGD {bl} {local[bl]:.1f} s: IST {local[bl] / ist[best]:.2f}x "
                 "faster (goal 4x)")
    if "dp" in times:
        line += f"; dp {times['dp']:.1f} s: IST {times['dp'] / ist[best]:.2f}x faster (goal 12x)"
    print(line)


def plot(loop: list[Run], bench: list[Run], target: float, dp: Run, path: Path,
         modelled: dict[str, list[tuple[int, float, float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if bench else 2
    fig, axs = plt.subplots(1, panels, figsize=(6.2 * panels, 4.6), squeeze=False)
    ax = axs[0][0]
    for r in loop:
        c = curve(r)
        ax.plot([s for s, _, _ in c], [a for _, a, _ in c], lw=1.2, label=r.label)
    ax.axhline(target, ls="--", lw=0.8, color="grey")
    ax.set_ylim(0.82, 0.905)
    ax.set_xlabel("step")
    ax.set_ylabel("test accuracy")
    ax.set_title("loopback: accuracy against steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax = axs[0][1]
    for r in loop:
        c = modelled[r.label]
        ax.plot([w for _, _, w in c], [a for _, a, _ in c], lw=1.2, label=r.label)
    ax.axhline(target, ls="--", lw=0.8, color="grey")
    ax.set_xscale("log")
    ax.set_ylim(0.82, 0.905)
    ax.set_xlabel("wall time at 100 Mbit/s, s (modelled from loopback; log)")
    ax.set_title("modelled, 100 Mbit/s")
    ax.grid(alpha=0.3)
    if bench:
        ax = axs[0][2]
        for r in bench:
            c = curve(r)
            ax.plot([w for _, _, w in c], [a for _, a, _ in c], marker="o", ms=2.5, lw=1.2,
                    label=f"{r.label} (measured)")
            if r.label == "dp":
                sps = seconds_per_step(r)
                d = curve(dp)
                ax.plot([s * sps for s, _, _ in d], [a for _, a, _ in d], ls=":", lw=1.2,
                        label=f"dp (derived: {sps:.2f} s/step x loopback steps)")
        ax.axhline(target, ls="--", lw=0.8, color="grey")
        ax.set_xscale("log")
        ax.set_ylim(0.82, 0.905)
        ax.set_xlabel("training wall time at 100 Mbit/s, s (log)")
        ax.set_title("testbed, 100 Mbit/s, 4 workers")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())

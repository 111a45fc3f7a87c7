"""The bench table and the accuracy-against-wall-time plot, one panel per link speed.

Every wall time is labelled with how it was obtained: *measured* (training time on the testbed's
shaped links, rank 0, evaluation excluded) or *modelled* (see :mod:`thinwire.testbed.modelled`).
Bytes are labelled *measured* (kernel interface counters) or *ledger* (payload exact, wire bytes
estimated for collectives).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from thinwire.report.tables import Run, fmt_bytes
from thinwire.testbed.measure import WireComparison
from thinwire.testbed.rates import Link


@dataclass(frozen=True)
class BenchResult:
    """One method on one link: its accuracy curve against wall time and its bytes."""

    link: Link
    run: Run
    kind: str  # "measured" or "modelled"
    curve: list[tuple[int, float, float]]  # (step, test accuracy, wall s)
    wall_s: float
    wire: WireComparison | None = None  # measured runs only

    @property
    def method(self) -> str:
        return self.run.label

    @property
    def is_dp(self) -> bool:
        """The registry's first method with its default options (plain data parallelism): the
        reference of the "vs dp" column."""
        import dataclasses

        from thinwire.strategies import METHODS

        m = dict(self.run.summary.get("config", {}).get("method", {}))
        base = METHODS.names()[0]
        if not m:  # no recorded config: the label says it
            return self.method == base
        if m.pop("name", None) != base:
            return False
        defaults = dataclasses.asdict(METHODS.get(base).options())
        return all(defaults.get(k) == v for k, v in m.items())

    def to_target(self, target: float) -> tuple[int, float, float] | None:
        """(step, wall s, ledger bytes sent per worker) at the first evaluation reaching target
        (at or above an accuracy, at or below a perplexity)."""
        sent = {int(r["step"]): float(r["sent_bytes"]) for r in self.run.evals}
        for step, value, wall in self.curve:
            if self.run.reached(value, target):
                return step, wall, sent.get(step, float("nan"))
        return None


def common_target(results: list[BenchResult]) -> float:
    """The best metric value every result reached."""
    if not results:
        return 0.0
    if results[0].run.higher_is_better:
        return min(max((a for _, a, _ in r.curve), default=0.0) for r in results)
    return max(min((a for _, a, _ in r.curve), default=float("inf")) for r in results)


def bench_table(results: list[BenchResult], target: float) -> str:
    kind = results[0].kind if results else "measured"
    metric = results[0].run.metric if results else "accuracy"
    head = (f"| link | method | final {metric} | train wall s ({kind}) | s to {target:.3f} ({kind}) "
            f"| vs dp | steps to {target:.3f} | sent/worker to {target:.3f} (ledger) ")
    if kind == "measured":
        head += ("| wire tx, all workers (measured) | wire sent incl. control (ledger estimate) "
                 "| payload (ledger) ")
        head += "| measured / estimated |"
        sep = "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    else:
        head += "| wire sent, all workers (ledger estimate) | payload (ledger) |"
        sep = "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    lines = [head, sep]
    for res in results:
        hit = res.to_target(target)
        dp = next((r for r in results if r.link == res.link and r.is_dp), None)
        dp_hit = dp.to_target(target) if dp else None
        speed = (f"{dp_hit[1] / hit[1]:.2f}x" if hit and dp_hit and hit[1] > 0 else "-")
        ttt = (f"{hit[1]:.1f} | {speed} | {hit[0]} | {fmt_bytes(hit[2])}" if hit
               else "not reached | - | - | -")
        acc = res.curve[-1][1] if res.curve else float("nan")
        row = f"| {res.link.label} | {res.method} | {acc:.4f} | {res.wall_s:.1f} | {ttt} "
        ledgers = res.run.summary["bytes"]
        est = sum(ledgers["per_rank_sent"])
        payload = ledgers["payload_per_worker_mean"] * len(ledgers["per_rank_sent"])
        if res.wire is not None:
            w = res.wire
            scope = "" if w.control_sent is not None else " (training only*)"
            row += (f"| {fmt_bytes(w.measured_total)} | {fmt_bytes(w.compared_total)}{scope} "
                    f"| {fmt_bytes(sum(w.payload))} | {w.ratio:.3f} ({(w.ratio - 1) * 100:+.1f}%) |")
        else:
            row += f"| {fmt_bytes(est)} | {fmt_bytes(payload)} |"
        lines.append(row)
    return "\n".join(lines) + "\n\n" + notes(kind)


def notes(kind: str) -> str:
    if kind == "measured":
        return ("Measured: wall times on the testbed's rate-limited links (rank 0's training time, "
                "evaluation excluded) and wire bytes from the kernel counters of each worker's "
                "veth (headers, ACKs, rendezvous, set-up and control traffic included). Ledger: "
                "payload exact (a point-to-point message counts at both ends); wire bytes "
                "estimated for collectives (ring), exact for point-to-point, control traffic "
                "(evaluation) included where the ledger files carry it (*: they did not, so the "
                "estimate covers training traffic only). vs dp: dp's time to target / this "
                "method's.")
    return ("Modelled (no thin wire was used): wall = compute time measured over loopback + "
            "per ledger call latency x hops + bytes / (rate x 1448/1538); see "
            "thinwire.testbed.modelled. Ledger: payload exact (a point-to-point message counts "
            "at both ends); wire bytes estimated for collectives (ring), exact for "
            "point-to-point, training traffic only. vs dp: dp's time to target / this method's.")


def plot_bench(results: list[BenchResult], target: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r.link for r in results))
    kind = results[0].kind if results else "measured"
    fig, axs = plt.subplots(1, len(links), figsize=(5.2 * len(links), 4.2), squeeze=False)
    for ax, link in zip(axs[0], links):
        for res in (r for r in results if r.link == link):
            ax.plot([w for _, _, w in res.curve], [a for _, a, _ in res.curve], marker="o",
                    ms=3, label=res.method)
        ax.axhline(target, ls="--", lw=0.8, color="grey")
        ax.set_title(f"{link.label} ({kind})")
        ax.set_xlabel(f"training wall time, s ({kind})")
        ax.set_ylabel(f"test {res.run.metric}" if results else "")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

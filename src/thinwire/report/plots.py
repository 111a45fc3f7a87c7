"""Plots of accuracy and loss against steps, bytes sent and wall time (matplotlib, PNG)."""

from __future__ import annotations

from pathlib import Path

from thinwire.report.tables import Run


def plot_runs(runs: list[Run], out_dir: Path, *, title: str = "") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    axes_spec = [("step", "steps", False), ("sent_bytes", "bytes sent per worker", True),
                 ("wall_s", "wall time (s)", False)]
    fig, axs = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, xlabel, logx) in zip(axs, axes_spec):
        for run in runs:
            ev = run.evals
            xs = [max(r[key], 1.0) if logx else r[key] for r in ev]
            ax.plot(xs, [r[run.metric] for r in ev], marker="o", ms=3, label=run.label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"test {runs[0].metric}" if runs else "")
        if logx:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axs[0].legend(fontsize=8)
    fig.suptitle(title or (f"test {runs[0].metric}" if runs else ""))
    fig.tight_layout()
    p = out_dir / "accuracy.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, axs = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        tr = run.trains
        axs[0].plot([r["step"] for r in tr], [r["loss"] for r in tr], label=run.label, lw=1)
        ev = run.evals
        axs[1].plot([r["step"] for r in ev], [r["nll"] for r in ev], marker="o", ms=3, label=run.label)
    axs[0].set_ylabel("training loss (rank 0 batch)")
    axs[1].set_ylabel("test NLL")
    for ax in axs:
        ax.set_xlabel("steps")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axs[0].legend(fontsize=8)
    fig.tight_layout()
    p = out_dir / "loss.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths

"""Plots of accuracy and loss against steps, bytes sent and wall time (matplotlib, PNG).

Each PNG is rendered in memory and written atomically (:func:`thinwire.rundir.write_bytes`),
so a link at its path is replaced, never followed; the caller chooses a directory thinwire
owns (:func:`thinwire.rundir.open_output_dir`)."""

from __future__ import annotations

import io
from pathlib import Path

from thinwire.report.tables import Run


def plot_runs(runs: list[Run], out_dir: Path, *, title: str = "") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from thinwire.rundir import write_bytes

    def save(fig: object, path: Path) -> None:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)  # type: ignore[attr-defined]
        write_bytes(path, buf.getvalue())

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
    save(fig, p)
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
    save(fig, p)
    plt.close(fig)
    paths.append(p)
    return paths

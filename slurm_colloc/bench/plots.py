"""Plots of a replay (matplotlib, optional: ``pip install matplotlib``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from slurm_colloc.bench.metrics import PolicyMetrics
from slurm_colloc.bench.sampler import GpuPoint


def available() -> bool:
    """matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def bars(rows: Sequence[PolicyMetrics], path: Path) -> None:
    """Makespan, mean and p95 JCT per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.policy for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (title, vals) in zip(axes, [
        ("makespan (h)", [r.makespan_h for r in rows]),
        ("mean JCT (h)", [r.mean_jct_h for r in rows]),
        ("p95 JCT (h)", [r.p95_jct_h for r in rows]),
    ], strict=True):
        ax.bar(names, vals, color=["#777", "#d95f02", "#1b9e77", "#7570b3"][: len(names)])
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=25)
    fig.suptitle(rows[0].trace if rows else "")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gpu_timelines(
    series: Mapping[str, Sequence[GpuPoint]], t0: float, scale: float, path: Path,
) -> None:
    """GPU memory and SM activity over trace time, one row per policy, one line per GPU.

    Nothing is drawn when no policy has samples (a one-policy run whose sampler saw
    nothing used to end the replay with matplotlib's "rows must be positive")."""
    if not series:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(series), 2, figsize=(12, 2.6 * len(series)), squeeze=False)
    for row, (policy, pts) in enumerate(series.items()):
        for gpu in sorted({p.gpu for p in pts}):
            g = [p for p in pts if p.gpu == gpu]
            t = [(p.t - t0) * scale / 3600 for p in g]
            axes[row][0].plot(t, [p.memory_mib / 1024 for p in g], lw=0.8, label=f"GPU {gpu}")
            axes[row][1].plot(t, [p.sm_pct for p in g], lw=0.8, label=f"GPU {gpu}")
        axes[row][0].set_ylabel(f"{policy}\nmemory GiB")
        axes[row][1].set_ylabel("SM activity %")
    axes[-1][0].set_xlabel("trace hours")
    axes[-1][1].set_xlabel("trace hours")
    axes[0][1].legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

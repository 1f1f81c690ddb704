"""PNG plots (matplotlib, Agg backend): share over time per policy, and max/min against a swept value."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import ScalarFormatter  # noqa: E402

from fairgate.sim.experiment import PolicyStats  # noqa: E402


def _mean_timeline(stats: PolicyStats) -> tuple[list[float], list[list[float]]]:
    """Cumulative shares of every seed, interpolated onto one 1-second grid and averaged."""
    runs = [r for r in stats.per_seed if r.timeline_s]
    end = min(r.timeline_s[-1] for r in runs)
    grid = np.arange(1.0, max(end, 1.0) + 1e-9, 1.0)  # the first second is start-up: one request is 100 %
    tenants = len(runs[0].tenants)
    mean = np.zeros((len(grid), tenants))
    for run in runs:
        shares = np.asarray(run.timeline_share)
        for k in range(tenants):
            mean[:, k] += np.interp(grid, run.timeline_s, shares[:, k])
    return grid.tolist(), (mean / len(runs)).tolist()


def share_over_time(results: Sequence[PolicyStats], path: Path, title: str) -> Path:
    """Cumulative GPU share per tenant over time, one panel per policy, averaged over seeds. Returns ``path``."""
    count = len(results)
    columns = min(3, count)
    rows = (count + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows), squeeze=False, sharey=True)
    for index, stats in enumerate(results):
        axis = axes[index // columns][index % columns]
        times, shares = _mean_timeline(stats)
        for k, tenant in enumerate(stats.mean.tenants):
            axis.plot(times, [share[k] * 100 for share in shares], label=tenant.name, lw=1.4)
        axis.set_title(f"{stats.mean.policy}  (max/min {stats.mean.max_min_ratio:.2f})", fontsize=10)
        axis.set_xlabel("time (s)")
        axis.set_ylabel("cumulative GPU share (%)")
        axis.grid(alpha=0.3)
    for index in range(count, rows * columns):
        axes[index // columns][index % columns].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    seeds = len(results[0].per_seed)
    figure.suptitle(title + (f"\n(mean of {seeds} seeds)" if seeds > 1 else ""), fontsize=11)
    figure.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), frameon=False)
    figure.tight_layout(rect=(0, 0.05, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


def ratio_against(values: Sequence[float], ratios: Mapping[str, Sequence[float]], path: Path, xlabel: str,
                  title: str, ylabel: str = "max/min GPU share") -> Path:
    """``ratios[policy][i]`` against ``values[i]``, one line per policy (log y). Returns ``path``."""
    figure, axis = plt.subplots(figsize=(7.6, 4.4))
    for policy, ys in ratios.items():
        axis.plot(values, ys, marker="o", ms=3.5, lw=1.4, label=policy)
    axis.set_yscale("log")
    axis.yaxis.set_major_formatter(ScalarFormatter())
    axis.yaxis.set_minor_formatter(ScalarFormatter())
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.set_title(title, fontsize=10, wrap=True)
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path

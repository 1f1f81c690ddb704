"""PNG plots (matplotlib, Agg backend): share over time per policy, and max/min against a swept value."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import ScalarFormatter  # noqa: E402

from fairgate.sim.experiment import PolicyStats  # noqa: E402


def share_over_time(results: Sequence[PolicyStats], path: Path, title: str) -> Path:
    """Cumulative GPU share per tenant over time, one panel per policy (first seed). Returns ``path``."""
    count = len(results)
    columns = min(3, count)
    rows = (count + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows), squeeze=False, sharey=True)
    for index, stats in enumerate(results):
        axis = axes[index // columns][index % columns]
        run = stats.per_seed[0]
        # The first second is all start-up (one request in an empty replica is 100 % of it).
        points = [(t, share) for t, share in zip(run.timeline_s, run.timeline_share) if t >= 1.0]
        for k, tenant in enumerate(run.tenants):
            axis.plot([t for t, _ in points], [share[k] * 100 for _, share in points], label=tenant.name, lw=1.4)
        axis.set_title(f"{run.policy}  (max/min {run.max_min_ratio:.2f})", fontsize=10)
        axis.set_xlabel("time (s)")
        axis.set_ylabel("cumulative GPU share (%)")
        axis.grid(alpha=0.3)
    for index in range(count, rows * columns):
        axes[index // columns][index % columns].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.suptitle(title, fontsize=11)
    figure.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), frameon=False)
    figure.tight_layout(rect=(0, 0.05, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


def ratio_against(values: Sequence[float], ratios: Mapping[str, Sequence[float]], path: Path, xlabel: str,
                  title: str, ylabel: str = "max/min GPU share") -> Path:
    """``ratios[policy][i]`` against ``values[i]``, one line per policy (log y). Returns ``path``."""
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for policy, ys in ratios.items():
        axis.plot(values, ys, marker="o", ms=3.5, lw=1.4, label=policy)
    axis.set_yscale("log")
    axis.yaxis.set_major_formatter(ScalarFormatter())
    axis.yaxis.set_minor_formatter(ScalarFormatter())
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.set_title(title, fontsize=11)
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8, ncol=2)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path

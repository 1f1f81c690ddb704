"""PNG plots (matplotlib, Agg backend): share over time per policy, max/min against a swept value, queue
times per tenant and rejections per reason (the simulator's and the live report's charts: `fairgate report`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, ScalarFormatter

from fairgate.sim.experiment import PolicyStats


def _mean_timeline(stats: PolicyStats, step_s: float = 1.0) -> tuple[list[float], list[list[float]]]:
    """Cumulative shares of every seed, interpolated onto one grid of ``step_s`` seconds and averaged."""
    runs = [r for r in stats.per_seed if r.timeline_s]
    end = min(r.timeline_s[-1] for r in runs)
    # The grid starts one step in: the first moments are start-up (one request is 100 %).
    grid = np.arange(step_s, max(end, step_s) + step_s * 1e-9, step_s)
    tenants = len(runs[0].tenants)
    mean = np.zeros((len(grid), tenants))
    for run in runs:
        shares = np.asarray(run.timeline_share)
        for k in range(tenants):
            mean[:, k] += np.interp(grid, run.timeline_s, shares[:, k])
    return grid.tolist(), (mean / len(runs)).tolist()


def share_over_time(results: Sequence[PolicyStats], path: Path, title: str, step_s: float = 1.0) -> Path:
    """Cumulative GPU share per tenant over time, one panel per policy, averaged over seeds, sampled every
    ``step_s`` seconds from ``step_s`` on. Returns ``path``."""
    count = len(results)
    columns = min(3, count)
    rows = (count + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows), squeeze=False, sharey=True)
    for index, stats in enumerate(results):
        axis = axes[index // columns][index % columns]
        times, shares = _mean_timeline(stats, step_s)
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
    return _save(figure, path)


def ratio_against(
    values: Sequence[float],
    ratios: Mapping[str, Sequence[float]],
    path: Path,
    xlabel: str,
    title: str,
    ylabel: str = "max/min GPU share",
) -> Path:
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
    return _save(figure, path)


def _titled(axis: Axes, title: str, figure: Figure, path: Path) -> Path:
    axis.set_title(title, fontsize=10, wrap=True)
    return _save(figure, path)


def _save(figure: Figure, path: Path) -> Path:
    """Write ``figure`` to ``path`` (its folder made if needed) and close it. Returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path


def _no_data(axis: Axes, text: str) -> None:
    axis.text(0.5, 0.5, text, ha="center", va="center", transform=axis.transAxes, fontsize=10, color="0.4")
    axis.set_xticks([])
    axis.set_yticks([])


def queue_times(queue_ms: Mapping[str, Sequence[float]], path: Path, title: str) -> Path:
    """Queue time per tenant (ms a request waited for a slot), as empirical CDFs on a log time axis (waits
    under 0.01 ms are drawn at 0.01 ms); the legend gives each tenant's p50 / p99. Returns ``path``."""
    figure, axis = plt.subplots(figsize=(7.6, 4.4))
    floor = 0.01
    drawn = False
    for tenant, values in queue_ms.items():
        waits = np.sort(np.maximum(np.asarray(values, dtype=float), floor))
        if not len(waits):
            continue
        fraction = np.arange(1, len(waits) + 1) / len(waits) * 100
        p50, p99 = np.percentile(waits, 50), np.percentile(waits, 99)
        axis.step(
            np.concatenate(([waits[0]], waits)),
            np.concatenate(([0.0], fraction)),
            where="post",
            lw=1.4,
            label=f"{tenant}  (p50 {p50:,.1f} ms, p99 {p99:,.1f} ms, n={len(waits)})",
        )
        drawn = True
    if drawn:
        axis.set_xscale("log")
        axis.set_xlabel("queue time (ms)")
        axis.set_ylabel("requests waiting at most this long (%)")
        axis.set_ylim(0, 101)
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:
        _no_data(axis, "no request was given a slot")
    return _titled(axis, title, figure, path)


def rejections_by_reason(counts: Mapping[str, Mapping[str, int]], path: Path, title: str) -> Path:
    """Rejected requests per reason (``counts[reason][tenant]``), one bar per reason stacked by tenant, the
    most frequent reason first. Returns ``path``."""
    figure, axis = plt.subplots(figsize=(7.6, 4.4))
    reasons = sorted((r for r in counts if sum(counts[r].values()) > 0), key=lambda r: (-sum(counts[r].values()), r))
    tenants = list(dict.fromkeys(t for r in reasons for t in counts[r]))
    if reasons:
        bottom = np.zeros(len(reasons))
        for tenant in tenants:
            heights = np.array([counts[r].get(tenant, 0) for r in reasons], dtype=float)
            axis.bar(reasons, heights, bottom=bottom, label=tenant, width=0.6)
            bottom += heights
        for x, total in enumerate(bottom):
            axis.text(x, total, f"{total:,.0f}", ha="center", va="bottom", fontsize=8)
        axis.set_xlabel("reason")
        axis.yaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_ylabel("rejected requests")
        axis.grid(alpha=0.3, axis="y")
        axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:
        _no_data(axis, "no request was rejected")
    return _titled(axis, title, figure, path)

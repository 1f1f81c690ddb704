"""Tables (rich) and JSON documents for simulation results."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fairgate.sim.experiment import PolicyStats


def results_json(scenario: str, results: Sequence[PolicyStats], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"scenario": ..., "results": [one object per policy]}``."""
    document: dict[str, Any] = {"scenario": scenario, "results": [r.to_json() for r in results]}
    if extra:
        document.update(extra)
    return document


def dumps(document: dict[str, Any]) -> str:
    """JSON text; non-finite floats (an empty percentile, an infinite ratio) become ``null``."""
    return json.dumps(_finite(document), indent=2)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _ms(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:,.0f}"


def policy_table(title: str, results: Sequence[PolicyStats]) -> Table:
    """Per policy and tenant: GPU share %, decode tokens, mean output tokens, TTFT p50/p99; per policy
    max/min, Jain's index, the VTC paper's service difference (max / mean, tokens/s), total decode tokens,
    prefill fraction and requests left unfinished."""
    table = Table(title=escape(title), title_justify="left")
    for column, justify in [
        ("policy", "left"),
        ("tenant", "left"),
        ("GPU share %", "right"),
        ("decode tokens", "right"),
        ("mean out tok", "right"),
        ("TTFT p50 ms", "right"),
        ("TTFT p99 ms", "right"),
        ("max/min", "right"),
        ("Jain", "right"),
        ("VTC diff", "right"),
        ("prefill %", "right"),
        ("undone", "right"),
    ]:
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for stats in results:
        run = stats.mean
        for k, tenant in enumerate(run.tenants):
            table.add_row(
                run.policy if k == 0 else "",
                escape(tenant.name),
                f"{tenant.gpu_share * 100:.1f}",
                f"{tenant.decode_tokens:,.0f}",
                f"{tenant.mean_output_tokens:.1f}",
                _ms(tenant.ttft_ms["p50"]),
                _ms(tenant.ttft_ms["p99"]),
                "",
                "",
                "",
                "",
                "",
            )
        table.add_row(
            "",
            "[b]all[/b]",
            "100.0",
            f"[b]{run.decode_tokens:,.0f}[/b]",
            "",
            "",
            "",
            f"[b]{run.max_min_ratio:.3f}[/b]",
            f"{run.jain_index:.4f}",
            f"{_ms(run.service_diff_max)}/{_ms(run.service_diff_avg)}",
            f"{run.prefill_fraction * 100:.1f}",
            f"{run.unfinished:,.0f}",
            end_section=True,
        )
    return table


def shares_markdown(results: Sequence[PolicyStats]) -> str:
    """A compact Markdown table: one row per policy, GPU share % per tenant, max/min, the VTC paper's service
    difference (max / mean, tokens/s), decode tokens, prefill %."""
    names = [t.name for t in results[0].mean.tenants]
    lines = [
        "| policy | " + " | ".join(names) + " | max/min | VTC diff max / avg | decode tokens | prefill % |",
        "|---|" + "---:|" * (len(names) + 4),
    ]
    for stats in results:
        run = stats.mean
        shares = " | ".join(f"{t.gpu_share * 100:.1f}" for t in run.tenants)
        lines.append(
            f"| {run.policy} | {shares} | {run.max_min_ratio:.2f} | "
            f"{_ms(run.service_diff_max)} / {_ms(run.service_diff_avg)} | {run.decode_tokens:,.0f} | "
            f"{run.prefill_fraction * 100:.1f} |"
        )
    return "\n".join(lines)


def print_table(console: Console, title: str, results: Sequence[PolicyStats]) -> None:
    console.print(policy_table(title, results))

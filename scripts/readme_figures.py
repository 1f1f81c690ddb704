"""The README's figure tables, generated from the runs `bash scripts/figures` writes to docs/.

Each table stands in the README between ``<!-- figures:NAME -->`` and ``<!-- /figures -->``: ``seed`` is
docs/seed_study.md (``fairgate simulate ... --markdown``), ``flood`` is rendered from docs/flood.json
(``fairgate sweep``), ``replay`` from docs/replay_azure.json and docs/replay_burstgpt.json (``fairgate
replay``). ``scripts/figures`` runs this after the runs; ``--check`` only compares (exit 1 and the blocks that
differ), as tests/test_docs_figures.py does, so a README figure cannot drift from what the code computes.

Usage: .venv/bin/python scripts/readme_figures.py [--check]
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
BLOCK = re.compile(r"(<!-- figures:(\w+) -->\n)(.*?)(<!-- /figures -->)", re.S)
REPLAY_POLICIES = ("fcfs", "request_quota", "vtc", "gpu_fair")
REPLAYS = (
    ("replay_azure.json", "Azure 2023 code + conv, 1 h (2)"),
    ("replay_burstgpt.json", "BurstGPT week 1 by Model, ×60 (1)"),
)


def seed_table() -> str:
    return (DOCS / "seed_study.md").read_text()


def flood_table() -> str:
    data = json.loads((DOCS / "flood.json").read_text())
    configs = sorted(data["configurations"], key=lambda c: c["values"]["flood.agent"])
    floods = [c["values"]["flood.agent"] for c in configs]
    lines = ["| policy | " + " | ".join(f"{f:g}×" for f in floods) + " |", "|---|" + "---:|" * len(floods)]
    for policy in data["policies"]:
        lines.append(f"| {policy} | " + " | ".join(f"{c['max_min_ratio'][policy]:.2f}" for c in configs) + " |")
    return "\n".join(lines) + "\n"


def _tenants(result: dict[str, Any]) -> str:
    return "; ".join(
        f"{t['name']}: {100 * t['gpu_share']:.1f}, {t['ttft_ms']['p50'] / 1000:.1f} / {t['ttft_ms']['p99'] / 1000:.1f}"
        for t in result["tenants"]
    )


def replay_table() -> str:
    lines = [
        "| trace (replicas) | policy | tenant: GPU share %, TTFT p50 / p99 s | VTC diff max / avg tok/s |",
        "|---|---|---|---:|",
    ]
    for file, label in REPLAYS:
        results = {r["policy"]: r for r in json.loads((DOCS / file).read_text())["results"]}
        for policy in REPLAY_POLICIES:
            r = results[policy]
            diff = f"{r['service_diff_max']:,.0f} / {r['service_diff_avg']:,.0f}"
            lines.append(f"| {label} | {policy} | {_tenants(r)} | {diff} |")
    return "\n".join(lines) + "\n"


TABLES = {"seed": seed_table, "flood": flood_table, "replay": replay_table}


def synced(readme: str) -> tuple[str, list[str]]:
    """``readme`` with every figures block rendered anew, and the names of the blocks that changed.
    Raises ``KeyError``: a block of an unknown name."""
    changed: list[str] = []

    def render(match: re.Match[str]) -> str:
        name = match.group(2)
        table = TABLES[name]()
        if table != match.group(3):
            changed.append(name)
        return match.group(1) + table + match.group(4)

    return BLOCK.sub(render, readme), changed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when a block differs")
    args = parser.parse_args()
    path = REPO / "README.md"
    readme = path.read_text()
    updated, changed = synced(readme)
    if args.check:
        if changed:
            diff = difflib.unified_diff(
                readme.splitlines(), updated.splitlines(), "README.md", "generated", lineterm=""
            )
            print("\n".join(diff))
            print(f"README figures out of date: {', '.join(changed)} (run: bash scripts/figures)", file=sys.stderr)
            return 1
        return 0
    path.write_text(updated)
    print(f"README figures: {', '.join(changed) or 'all up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

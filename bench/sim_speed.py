"""Simulator speed, measured in one run (machines here are shared and noisy: read the ratio).

1. The reference engine (every iteration) and the event-compressed engine on the seed scenario, same
   workloads, all nine policies: wall time of each and their ratio (goal: compressed >= 20x faster).
2. The full grid (scenarios/grid.toml: 1,728 configurations) x 9 policies on ``--jobs`` processes:
   wall time (goal: <= 120 s with 2 jobs).

Usage: .venv/bin/python bench/sim_speed.py [--jobs 2] [--skip-grid] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from fairgate.core import POLICY_NAMES
from fairgate.sim.experiment import simulate
from fairgate.sim.generate import poisson_workload
from fairgate.sim.scenario import load_raw, load_scenario
from fairgate.sim.sweep import configurations, load_grid, run_sweep

REPO = Path(__file__).resolve().parents[1]
GOAL_RATIO = 20  # compressed vs reference on the seed scenario
GOAL_GRID_S = 120  # the grid on 2 jobs


def engines(repeat: int) -> None:
    scenario = load_scenario(REPO / "scenarios" / "seed.toml")
    workloads = [poisson_workload(scenario.cost, scenario.tenants, 120, seed) for seed in range(1, repeat + 1)]
    seconds = {"reference": 0.0, "compressed": 0.0}
    iterations = 0
    for engine in ("reference", "compressed"):
        start = time.perf_counter()
        for workload in workloads:
            for policy in POLICY_NAMES:
                result = simulate(scenario, workload, policy, engine)
                if engine == "reference":
                    iterations += sum(result.iterations)
        seconds[engine] = time.perf_counter() - start
    runs = len(workloads) * len(POLICY_NAMES)
    print(f"seed scenario, {runs} runs (9 policies x {len(workloads)} seeds, 120 s each, {iterations:,} iterations):")
    for engine, s in seconds.items():
        print(f"  {engine:10s} {s:7.2f} s   {s / runs * 1000:7.1f} ms/run")
    ratio = seconds["reference"] / seconds["compressed"]
    print(f"  speed-up compressed vs reference: {ratio:.1f}x (goal >= {GOAL_RATIO}x)")


def grid(jobs: int) -> None:
    grid_path = REPO / "scenarios" / "grid.toml"
    scenario_path = REPO / "scenarios" / "seed.toml"
    config = load_grid(grid_path)
    configs = configurations(config, grid_path, scenario_path, load_raw(scenario_path))
    start = time.perf_counter()
    result = run_sweep(config, configs, scenario_path, jobs)
    elapsed = time.perf_counter() - start
    runs = len(configs) * len(config.policy_names())
    print(
        f"grid: {len(configs):,} configurations x {len(config.policy_names())} policies = {runs:,} runs "
        f"on {jobs} jobs: {elapsed:.1f} s ({elapsed / runs * 1000 * jobs:.1f} ms/run/process; "
        f"goal <= {GOAL_GRID_S} s on 2 jobs)"
    )
    for policy in config.policy_names():
        worst, where = result.worst(policy)
        print(f"  {policy:15s} worst max/min {worst:8.3f} at {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2, help="seeds of the engine comparison")
    parser.add_argument("--skip-grid", action="store_true")
    args = parser.parse_args()
    engines(args.repeat)
    if not args.skip_grid:
        grid(args.jobs)


if __name__ == "__main__":
    main()

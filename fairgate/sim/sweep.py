"""Parameter sweeps: a grid of scenario variations x policies, run over a process pool.

A grid file (TOML):

```toml
policies = "all"              # or a list of policy names
seeds = [1]                   # workload seeds per configuration
long_tenants = ["summarise", "agent"]   # the tenants the "spread" axis multiplies
slot_cap = "fair_share"       # optional: slot_cap.max_running = max_batch * replicas / tenants per config

[[axis]]
key = "flood.agent"           # multiply that tenant's offered load
values = [1, 2, 4, 8]
[[axis]]
key = "spread"                # multiply the mean output of long_tenants
values = [0.5, 1, 2]
[[axis]]
key = "replica.max_batch"     # any scenario key, as with --set (tenant.*.prompt_tokens for all tenants)
values = [8, 24, 64]
```

The grid is the cartesian product of the axes. Each configuration builds one workload per seed and
runs every policy on it.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fairgate.core.policies.factory import POLICY_NAMES
from fairgate.sim.experiment import policy_ratio
from fairgate.sim.generate import MAX_FLOOD, WorkloadError, check_workload_size, poisson_workload
from fairgate.sim.scenario import ScenarioError, _message, build_scenario, load_raw, set_key

MAX_CONFIGURATIONS = 100_000


def _distinct(values: list[Any], what: str) -> list[Any]:
    """``values``, checked to hold no value twice. Raises ``ValueError`` naming ``what`` is listed twice."""
    if len(set(values)) != len(values):
        raise ValueError(f"{what} is listed twice")
    return values


class AxisConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    key: str = Field(min_length=1)
    values: list[Any] = Field(min_length=1, max_length=10_000)


class GridConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    policies: Literal["all"] | list[str] = "all"
    seeds: list[Annotated[int, Field(ge=0, le=2**32 - 1)]] = Field(
        default_factory=lambda: [1], min_length=1, max_length=1000
    )
    long_tenants: list[str] = Field(default_factory=list)
    slot_cap: Literal["scenario", "fair_share"] = "scenario"
    axis: list[AxisConfig] = Field(min_length=1)

    @field_validator("policies")
    @classmethod
    def _known(cls, value: Literal["all"] | list[str]) -> Literal["all"] | list[str]:
        if isinstance(value, list):
            if not value:
                raise ValueError('give at least one policy, or "all"')
            for name in value:
                if name not in POLICY_NAMES:
                    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
            _distinct(value, "a policy")
        return value

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, value: list[int]) -> list[int]:
        return _distinct(value, "a seed")

    @field_validator("axis")
    @classmethod
    def _distinct_axes(cls, value: list[AxisConfig]) -> list[AxisConfig]:
        keys = [a.key for a in value]
        for key in keys:
            if keys.count(key) > 1:
                raise ValueError(f"axis {key!r} appears twice")
        size = 1
        for axis in value:
            size *= len(axis.values)
        if size > MAX_CONFIGURATIONS:
            raise ValueError(f"the grid has {size:,} configurations (at most {MAX_CONFIGURATIONS:,})")
        return value

    def policy_names(self) -> list[str]:
        return list(POLICY_NAMES) if self.policies == "all" else list(self.policies)


@dataclass
class Configuration:
    """One point of the grid: the axis values, and the scenario data and flood they produce."""

    index: int
    values: dict[str, Any]
    data: dict[str, Any]
    flood: dict[str, float]


@dataclass
class SweepResult:
    """Max/min per configuration and policy (mean over seeds)."""

    grid: GridConfig
    configurations: list[Configuration]
    ratios: dict[str, list[float]] = field(default_factory=dict)  # policy -> one per configuration

    def worst(self, policy: str) -> tuple[float, dict[str, Any]]:
        """Largest max/min of ``policy`` and the axis values where it occurred."""
        ratios = self.ratios[policy]
        index = max(range(len(ratios)), key=lambda i: ratios[i] if math.isfinite(ratios[i]) else math.inf)
        return ratios[index], self.configurations[index].values

    def by_axis(self, key: str, policy: str, reduce: Callable[[list[float]], float] = fmean) -> list[float]:
        """``reduce`` of ``policy``'s max/min over the other axes, for each value of axis ``key``."""
        axis = next(a for a in self.grid.axis if a.key == key)
        return [
            reduce([r for c, r in zip(self.configurations, self.ratios[policy], strict=True) if c.values[key] == value])
            for value in axis.values
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "axes": {a.key: a.values for a in self.grid.axis},
            "policies": {
                policy: {
                    "worst_max_min_ratio": self.worst(policy)[0],
                    "worst_at": self.worst(policy)[1],
                    "mean_max_min_ratio": fmean(self.ratios[policy]),
                }
                for policy in self.ratios
            },
            "configurations": [
                {"values": c.values, "max_min_ratio": {p: self.ratios[p][c.index] for p in self.ratios}}
                for c in self.configurations
            ],
        }


def load_grid(path: str | Path) -> GridConfig:
    """Read and validate a grid file.

    Raises:
        ScenarioError: the file is missing, not TOML, or has an unknown key or bad value.
    """
    data = load_raw(path)
    try:
        return GridConfig.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(_message(path, exc)) from None


def configurations(
    grid: GridConfig, grid_path: str | Path, scenario_path: str | Path, scenario_data: dict[str, Any]
) -> list[Configuration]:
    """Every configuration of the grid, validated against the scenario (fails fast on the first bad one).

    Raises:
        ScenarioError: an axis key or value that makes an invalid scenario (named with its grid file).
    """
    keys = [a.key for a in grid.axis]
    tenants = [t.get("name") for t in scenario_data.get("tenant", [])]
    for name in grid.long_tenants:
        if name not in tenants:
            raise ScenarioError(f"{grid_path}: long_tenants: no tenant {name!r} in {scenario_path}")
    for key in keys:
        if key.startswith("flood.") and key.split(".", 1)[1] not in tenants:
            raise ScenarioError(f"{grid_path}: axis {key!r}: no tenant {key.split('.', 1)[1]!r} in {scenario_path}")
        if key == "spread" and not grid.long_tenants:
            raise ScenarioError(f"{grid_path}: axis 'spread' needs long_tenants = [...]")
    out = []
    for index, combo in enumerate(itertools.product(*(a.values for a in grid.axis))):
        values = dict(zip(keys, combo, strict=True))
        data = copy.deepcopy(scenario_data)
        flood: dict[str, float] = {}
        for key, value in values.items():
            where = f"{grid_path}: axis {key!r} value {value!r}"
            if key.startswith("flood."):
                if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value <= MAX_FLOOD:
                    raise ScenarioError(f"{where}: a flood multiplier must be a number in (0, {MAX_FLOOD:g}]")
                flood[key.split(".", 1)[1]] = float(value)
            elif key == "spread":
                if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value <= 1000:
                    raise ScenarioError(f"{where}: a spread multiplier must be a number in (0, 1000]")
                for tenant in data.get("tenant", []):
                    if tenant.get("name") in grid.long_tenants:
                        output = tenant.get("output")
                        if not isinstance(output, dict) or "mean" not in output:
                            raise ScenarioError(f"{where}: tenant {tenant.get('name')!r} has no output mean to spread")
                        output["mean"] = output["mean"] * value
            else:
                try:
                    set_key(data, key, value, f"{grid_path}: axis")
                except ScenarioError:
                    raise
        if grid.slot_cap == "fair_share":
            data.setdefault("policy", {}).pop("slot_cap", None)
        try:
            built = build_scenario(scenario_path, data)
            # Fail here, not in a worker an hour later, on a configuration too large to simulate.
            check_workload_size(built.cost, built.tenants, built.config.run.duration_s, flood)
        except (ScenarioError, WorkloadError) as exc:
            raise ScenarioError(f"{grid_path}: configuration {values}: {exc}") from None
        out.append(Configuration(index, values, data, flood))
    return out


def _run_configuration(args: tuple[str, dict[str, Any], dict[str, float], list[str], list[int]]) -> list[float]:
    scenario_path, data, flood, policies, seeds = args
    scenario = build_scenario(scenario_path, data)
    workloads = {
        seed: poisson_workload(scenario.cost, scenario.tenants, scenario.config.run.duration_s, seed, flood)
        for seed in seeds
    }
    return [policy_ratio(scenario, policy, list(workloads.values())) for policy in policies]


def run_sweep(
    grid: GridConfig,
    configs: Sequence[Configuration],
    scenario_path: str | Path,
    jobs: int,
    progress: Callable[[int], None] | None = None,
) -> SweepResult:
    """Run every configuration x policy on ``jobs`` worker processes (1: in this process).

    Args:
        progress: called with the number of configurations just finished.
    """
    policies = grid.policy_names()
    tasks = [(str(scenario_path), c.data, c.flood, policies, grid.seeds) for c in configs]
    result = SweepResult(grid, list(configs), {p: [] for p in policies})

    def collect(rows: Iterator[list[float]]) -> None:
        for row in rows:
            for policy, ratio in zip(policies, row, strict=True):
                result.ratios[policy].append(ratio)
            if progress:
                progress(1)

    if jobs <= 1:
        collect(map(_run_configuration, tasks))
    else:
        # Small chunks: a worker left without one idles while the other ends its last (scenarios/grid.toml's last
        # 54 configurations, its chunk at 16 chunks a job, take ~6 s; 13 at 64, ~1.5 s).
        chunk = max(1, len(tasks) // (jobs * 64))
        with ProcessPoolExecutor(max_workers=min(jobs, os.cpu_count() or 1, len(tasks))) as pool:
            collect(pool.map(_run_configuration, tasks, chunksize=chunk))
    return result

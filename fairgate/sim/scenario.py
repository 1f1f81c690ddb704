"""Scenario files (TOML): the replica, the run, policy parameters and the tenants.

```toml
[replica]   # iter_base_ms, iter_slope_ms, prefill_ms_per_token, max_batch, replicas
[run]       # duration_s, seed
[policy]    # per-policy parameters, e.g. request_quota.requests_per_minute, slot_cap.max_running
[[tenant]]  # name, prompt_tokens (int or {dist=...}), output = {dist="lognormal", mean=.., cv=..},
            # offered_ms_per_s, weight, priority
```

Unknown keys, wrong types and out-of-range values are rejected with a ``ScenarioError`` whose message
names the file and the key (e.g. ``seed.toml: tenant[2].output.mean: must be greater than 0``).
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fairgate.configerrors import pydantic_message
from fairgate.core.cost import CostModel
from fairgate.core.policies.factory import PolicySpec, TenantShare
from fairgate.core.policies.params import PolicyConfig
from fairgate.core.request import MAX_TOKENS_PER_REQUEST, PRIORITIES
from fairgate.sim.distributions import Distribution, Empirical, Fixed, LogNormal
from fairgate.sim.generate import TenantLoad
from fairgate.tomlfile import read_toml


class ScenarioError(ValueError):
    """A scenario file or override is invalid; ``str()`` is one line naming the file and key."""


class _Strict(BaseModel):
    # strict: "24" or true where a number belongs is an error, not a conversion; floats must be finite.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


def _range(low: float, high: float, *, low_open: bool = False) -> object:
    return Field(gt=low, le=high) if low_open else Field(ge=low, le=high)


# Bounds keep every run finite and every number representable: times are integer ns (a cost below
# 1 us would round towards 0), a run is at most a day of virtual time, a request at most 10M tokens.
MAX_TOKENS = MAX_TOKENS_PER_REQUEST


class ReplicaConfig(_Strict):
    iter_base_ms: Annotated[float, _range(0.001, 1e6)]
    iter_slope_ms: Annotated[float, _range(0.0, 1e5)]
    prefill_ms_per_token: Annotated[float, _range(0.0, 1e4)]
    max_batch: Annotated[int, Field(ge=1, le=100_000)]
    replicas: Annotated[int, Field(ge=1, le=1_000)] = 1


class RunConfig(_Strict):
    duration_s: Annotated[float, _range(0.0, 86_400.0, low_open=True)]
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] = 1


class FixedDist(_Strict):
    dist: Literal["fixed"]
    value: Annotated[int, Field(ge=0, le=MAX_TOKENS)]


class LogNormalDist(_Strict):
    dist: Literal["lognormal"]
    mean: Annotated[float, _range(0.0, 1e6, low_open=True)]
    cv: Annotated[float, _range(0.0, 10.0)]


class EmpiricalDist(_Strict):
    dist: Literal["empirical"]
    trace: Annotated[str, Field(min_length=1)]  # path, relative to the scenario file
    column: Annotated[str, Field(min_length=1)]
    format: Literal["azure", "burstgpt"] = "azure"


DistConfig = Annotated[FixedDist | LogNormalDist | EmpiricalDist, Field(discriminator="dist")]


class TenantConfig(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=200, pattern=r"\S")]
    prompt_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)] | DistConfig
    output: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | DistConfig
    offered_ms_per_s: Annotated[float, _range(0.0, 1e6)]
    weight: Annotated[float, _range(1e-6, 1e6)] = 1.0
    priority: Literal["interactive", "batch", "eval"] = "interactive"


class ScenarioConfig(_Strict):
    replica: ReplicaConfig
    run: RunConfig
    policy: PolicyConfig = PolicyConfig()
    tenant: list[TenantConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_tenants(self) -> ScenarioConfig:
        seen: dict[str, int] = {}
        for i, t in enumerate(self.tenant):
            if t.name in seen:
                raise ValueError(f"tenant[{i}].name: {t.name!r} is also tenant[{seen[t.name]}]'s name")
            seen[t.name] = i
        return self


class Scenario:
    """A validated scenario, with the objects the simulator needs.

    Attributes:
        path: where it was read from (for messages and relative trace paths).
        config: the validated TOML.
        cost: the replica cost model.
        replicas: replicas behind the policy.
        tenants: synthetic tenant loads (may be empty for trace replay).
        shares: tenant -> weight and priority.
    """

    def __init__(self, path: Path, config: ScenarioConfig) -> None:
        self.path = path
        self.config = config
        r = config.replica
        self.cost = CostModel(r.iter_base_ms, r.iter_slope_ms, r.prefill_ms_per_token, r.max_batch)
        self.replicas = r.replicas
        self.tenants = [
            TenantLoad(
                t.name,
                self._dist(t.prompt_tokens, f"tenant[{i}].prompt_tokens"),
                self._dist(t.output, f"tenant[{i}].output"),
                t.offered_ms_per_s,
            )
            for i, t in enumerate(config.tenant)
        ]
        self.shares = {t.name: TenantShare(t.weight, t.priority) for t in config.tenant}

    @property
    def name(self) -> str:
        return self.path.stem

    def _dist(self, value: int | FixedDist | LogNormalDist | EmpiricalDist, key: str) -> Distribution:
        if isinstance(value, int):
            return Fixed(value)
        if isinstance(value, FixedDist):
            if key.endswith(".output") and value.value < 1:
                raise ScenarioError(f"{self.path}: {key}.value: a request generates at least 1 output token")
            return Fixed(value.value)
        if isinstance(value, LogNormalDist):
            return LogNormal(value.mean, value.cv)
        from fairgate.sim.traces import TraceError, read_trace  # a trace only when one is named

        trace = (self.path.parent / value.trace).resolve()
        try:
            rows = read_trace(trace, value.format)
        except TraceError as exc:
            raise ScenarioError(f"{self.path}: {key}.trace: {exc}") from None
        column = value.column
        if rows and column not in rows[0].fields:
            raise ScenarioError(f"{self.path}: {key}.column: {trace.name} has no column {column!r}")
        values = []
        for line, row in enumerate(rows, start=2):
            text = row.fields[column].strip()
            if not text.isdigit() or int(text) > MAX_TOKENS:
                raise ScenarioError(
                    f"{self.path}: {key}.column: {trace.name} line {line}: {column!r} is "
                    f"{text!r}, not a whole number of tokens from 0 to {MAX_TOKENS:,}"
                )
            values.append(int(text))
        minimum = 1 if key.endswith(".output") else 0
        kept = [v for v in values if v >= minimum]
        if not kept:
            raise ScenarioError(f"{self.path}: {key}.column: {column!r} of {trace.name} has no value >= {minimum}")
        return Empirical.of(kept, str(trace))

    def policy_spec(self, name: str) -> PolicySpec:
        """The ``PolicySpec`` for policy ``name`` with this scenario's parameters."""
        params: dict[str, dict[str, Any]] = {}
        for policy_name, value in self.config.policy:
            if value is not None:
                params[policy_name] = value.model_dump(exclude_none=True)
        if "slot_cap" not in params:
            tenants = max(len(self.shares), 1)
            params["slot_cap"] = {"max_running": max(1, self.cost.max_batch * self.replicas // tenants)}
        return PolicySpec(name, params)


def _message(path: Path | str, error: ValidationError) -> str:
    return pydantic_message(path, error, lambda _location: "must contain a character other than spaces")


def apply_override(data: dict[str, Any], assignment: str, source: str = "--set") -> None:
    """Apply ``dotted.key=value`` to raw scenario ``data`` (value parsed as TOML, else a string).

    ``tenant.NAME.key`` and ``tenant.*.key`` address tenants by name.

    Raises:
        ScenarioError: malformed assignment or unknown tenant.
    """
    if "=" not in assignment:
        raise ScenarioError(f"{source} {assignment!r}: expected KEY=VALUE, e.g. replica.max_batch=48")
    key, raw = assignment.split("=", 1)
    key = key.strip()
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    set_key(data, key, value, source)


def set_key(data: dict[str, Any], key: str, value: Any, source: str) -> None:
    """Set dotted ``key`` in raw scenario ``data`` (see ``apply_override``)."""
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ScenarioError(f"{source} {key!r}: empty key")
    if parts[0] == "tenant" and len(parts) >= 3:
        tenants = data.get("tenant", [])
        names = [t.get("name") for t in tenants]
        targets = tenants if parts[1] == "*" else [t for t in tenants if t.get("name") == parts[1]]
        if not targets:
            raise ScenarioError(
                f"{source} {key!r}: no tenant named {parts[1]!r} (tenants: {', '.join(map(str, names))})"
            )
        for tenant in targets:
            _set_path(tenant, parts[2:], value)
        return
    _set_path(data, parts, value)


def _set_path(node: dict[str, Any], parts: list[str], value: Any) -> None:
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = copy.deepcopy(value)


def load_raw(path: str | Path) -> dict[str, Any]:
    """The TOML document at ``path`` as a dict.

    Raises:
        ScenarioError: the file is missing, unreadable or not TOML.
    """
    return read_toml(path, ScenarioError, "scenario")


def build_scenario(path: str | Path, data: dict[str, Any], require_tenants: bool = True) -> Scenario:
    """Validate raw ``data`` (read from ``path``) into a ``Scenario``.

    Raises:
        ScenarioError: any invalid key or value, or no tenants when ``require_tenants``.
    """
    path = Path(path)
    try:
        config = ScenarioConfig.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(_message(path, exc)) from None
    if require_tenants and not config.tenant:
        raise ScenarioError(f"{path}: tenant: no tenants; add at least one [[tenant]] table")
    try:
        return Scenario(path, config)
    except ValueError as exc:
        if isinstance(exc, ScenarioError):
            raise
        raise ScenarioError(f"{path}: {exc}") from None


def load_scenario(path: str | Path, overrides: list[str] | None = None, require_tenants: bool = True) -> Scenario:
    """Read, override (``KEY=VALUE`` strings) and validate the scenario at ``path``.

    Raises:
        ScenarioError: see ``load_raw``, ``apply_override`` and ``build_scenario``.
    """
    data = load_raw(path)
    for assignment in overrides or []:
        apply_override(data, assignment)
    try:
        return build_scenario(path, data, require_tenants)
    except ScenarioError as exc:
        if overrides:
            raise ScenarioError(f"{exc} (with --set {' --set '.join(overrides)})") from None
        raise


__all__ = [
    "PRIORITIES",
    "Scenario",
    "ScenarioError",
    "apply_override",
    "build_scenario",
    "load_raw",
    "load_scenario",
    "set_key",
]

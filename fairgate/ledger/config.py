"""The quota vector and tiers, loaded from TOML and validated (seed 003, "Quota is a resource vector").

```toml
[tiers.free]
on_ledger_unavailable = "reject"          # or "emergency"
[tiers.paid]
on_ledger_unavailable = "emergency"
emergency = { requests = 20, tokens = 20000, seconds = 60 }   # local budget while the ledger is down

[defaults]                                # limits every tenant gets unless it overrides them
requests_per_minute = 600
requests_burst = 20                       # bucket capacity; unused quota never accumulates beyond it
input_tokens_per_minute = 200000
input_tokens_burst = 40000
output_tokens_per_minute = 100000
output_tokens_burst = 20000
max_concurrent = 16                       # active sequences; does not accumulate
max_queued = 64
gpu_seconds = 3600                        # per gpu_window_s
gpu_window_s = 86400
gpu_seconds_total = 100000                # optional lifetime budget
max_model_calls = 50                      # per agent run (run_id)
max_tool_rounds = 20
max_tokens = 200000
reservation_ttl_s = 600
spend_budget = 500.0                      # in [pricing] currency, per spend_period
spend_period = "month"                    # or "day": calendar periods, UTC

[pricing]                                 # what usage costs: prices per model class (optional)
currency = "USD"
[pricing.model_class.small]
input_per_mtok = 0.15                     # per million input (prompt) tokens
output_per_mtok = 0.60                    # per million output tokens
[pricing.model_class.large]
gpu_per_s = 0.0012                        # per GPU-second: the benchmarked inference unit

[tenants.acme]
tier = "paid"
weight = 2.0
limits = { max_concurrent = 32 }          # overrides of [defaults]
[tenants.acme.model_class.large]          # per model class, inside the tenant's limits
gpu_seconds = 1800
```

A table overrides the tables under it key by key (a tenant's ``limits`` over ``[defaults]``, a model class
over its tenant's limits): a tenant may set only ``requests_burst`` and take ``requests_per_minute`` from
``[defaults]``.

A tenant's limits hold across its model classes: every reservation is checked against, and charged to, the
tenant-wide account (key ``TENANT_ACCOUNT``, ``"*"``, which is therefore not a model class name), and a
class with a table of its own is in addition checked against, and charged to, its own account with its
merged limits: the class's table caps inside the tenant's limits, never beyond them
(``TenantQuota.accounts``).

Every key is checked: an unknown key, a negative limit, a burst below the largest single request it must
admit (``requests_burst < 1``, ``*_tokens_burst`` below ``max_tokens_per_request``), a burst with no rate
in its table or the ones it overrides raise ``QuotaConfigError`` naming the file and key.

A spend budget is checked like the GPU budgets: a reservation holds what its worst case would cost at its
class's price (the prompt, ``max_tokens`` of output, the GPU estimate) and settlement replaces that by what was
billed. A class with no ``[pricing]`` table costs nothing: the gateway refuses to start with a spend budget
set and a served class unpriced (``gateway.config``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from fairgate.ledger.model import FREE, InvalidUsage, Price, check_name
from fairgate.ledger.periods import PERIOD_CODES, Period
from fairgate.tomlfile import read_toml


class QuotaConfigError(ValueError):
    """An invalid quota configuration; ``str()`` is one line naming the file and key."""


# Bounds that keep every product and sum of the ledger's arithmetic a normal double: PostgreSQL's float8 raises
# where Python rounds to 0 or inf (an outside tester: a rate of 1e-320 a minute, a GPU budget of 1e306 s), and a
# backend must not refuse what another admits. Far outside any real quota: a rate of once in 2,000 years.
Positive = Annotated[float, Field(ge=1e-9, le=1e15)]
Count = Annotated[int, Field(ge=0, le=10**12)]
Budget = Annotated[float, Field(ge=0, le=1e15)]


def _zero_or_at_least_a_billionth(value: float) -> float:
    if 0.0 < value < 1e-9:
        raise ValueError(f"a price is 0 or at least 1e-9, got {value!r}")
    return value


PriceRate = Annotated[float, Field(ge=0, le=1e6), AfterValidator(_zero_or_at_least_a_billionth)]


class _Strict(BaseModel):
    # strict: "16" or true where a number belongs is an error; floats must be finite (inf is not "no limit":
    # leave the key out for that).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def _key_text(part: object) -> str:
    """A key of an error's location, quoted when it is not plain text (empty, spaces, control characters)."""
    text = str(part)
    return text if text and text.isprintable() and " " not in text and len(text) <= 60 else repr(text)[:62]


def _ledger_name(value: str) -> str:
    try:
        check_name(value, "the name")
    except InvalidUsage as exc:
        raise ValueError(str(exc)) from None
    return value


# A tenant, tier or model class name: what the ledger accepts (non-empty, at most 200 characters, no control
# characters), so a name the configuration takes is never refused by the ledger at request time.
Name = Annotated[str, AfterValidator(_ledger_name)]

# The key of a tenant's tenant-wide account (``TenantQuota.accounts``); a model class cannot be named so.
TENANT_ACCOUNT = "*"


def _class_name(value: str) -> str:
    if value == TENANT_ACCOUNT:
        raise ValueError(
            f"{TENANT_ACCOUNT!r} cannot name a model class: it is the key of the tenant-wide account, which the "
            "tenant's own limits apply to"
        )
    return value


ClassName = Annotated[Name, AfterValidator(_class_name)]


class LimitsConfig(_Strict):
    """A table of limits (``[defaults]``, a tenant's ``limits``, a model class): ``None`` inherits."""

    requests_per_minute: Positive | None = None
    requests_burst: Annotated[float, Field(ge=1, le=1e15)] | None = None
    input_tokens_per_minute: Positive | None = None
    input_tokens_burst: Positive | None = None
    output_tokens_per_minute: Positive | None = None
    output_tokens_burst: Positive | None = None
    max_tokens_per_request: Annotated[int, Field(ge=1, le=10**12)] | None = None
    max_concurrent: Count | None = None
    max_queued: Count | None = None
    gpu_seconds: Budget | None = None
    gpu_window_s: Positive | None = None
    gpu_seconds_total: Budget | None = None
    max_model_calls: Count | None = None
    max_tool_rounds: Count | None = None
    max_tokens: Count | None = None
    reservation_ttl_s: Positive | None = None
    spend_budget: Annotated[float, Field(ge=0, le=1e12)] | None = None
    spend_period: Period | None = None


class PriceConfig(_Strict):
    """``[pricing.model_class.NAME]``: prices in the pricing currency, per million tokens or per GPU-second."""

    input_per_mtok: PriceRate = 0.0
    output_per_mtok: PriceRate = 0.0
    gpu_per_s: PriceRate = 0.0

    def price(self) -> Price:
        """As a ``Price`` in micros: per million tokens is micros per token; per second, 1,000 per ms."""
        return Price(self.input_per_mtok, self.output_per_mtok, self.gpu_per_s * 1000.0)


class PricingConfig(_Strict):
    """``[pricing]``: the currency amounts are shown in, and each model class's prices."""

    currency: Annotated[str, Field(pattern=r"^[A-Z]{3}$")] = "USD"
    model_class: dict[ClassName, PriceConfig] = Field(default_factory=dict)


class EmergencyConfig(_Strict):
    """A tier's emergency budget: requests, tokens (prompt + max output) and seconds from the first grant."""

    requests: Annotated[int, Field(ge=1, le=1_000_000)]
    tokens: Annotated[int, Field(ge=1, le=10**12)]
    seconds: Annotated[float, Field(gt=0, le=86_400)]


class TierConfig(_Strict):
    """``[tiers.NAME]``."""

    on_ledger_unavailable: Literal["reject", "emergency"] = "reject"
    emergency: EmergencyConfig | None = None

    @model_validator(mode="after")
    def _emergency_needs_budget(self) -> TierConfig:
        if self.on_ledger_unavailable == "emergency" and self.emergency is None:
            raise ValueError(
                "on_ledger_unavailable = 'emergency' needs an emergency = {requests, tokens, seconds} budget"
            )
        if self.on_ledger_unavailable == "reject" and self.emergency is not None:
            raise ValueError("an emergency budget is only used with on_ledger_unavailable = 'emergency'")
        return self


class TenantConfig(_Strict):
    """``[tenants.NAME]``."""

    tier: Name = "default"
    weight: Positive = 1.0
    priority: Literal["interactive", "batch", "eval"] = "interactive"
    limits: LimitsConfig = LimitsConfig()
    model_class: dict[ClassName, LimitsConfig] = Field(default_factory=dict)


class QuotaFile(_Strict):
    """The whole quota document."""

    tiers: dict[Name, TierConfig] = Field(default_factory=lambda: {"default": TierConfig()})
    defaults: LimitsConfig = LimitsConfig()
    tenants: dict[Name, TenantConfig] = Field(default_factory=dict)
    pricing: PricingConfig = PricingConfig()

    @model_validator(mode="after")
    def _known_tiers(self) -> QuotaFile:
        for name, tenant in self.tenants.items():
            if tenant.tier not in self.tiers:
                raise ValueError(f"tenant {name!r}: unknown tier {tenant.tier!r} (tiers: {', '.join(self.tiers)})")
        return self


@dataclass(frozen=True)
class Limits:
    """The effective quota vector of one tenant and model class. ``None``: no limit on that dimension.

    Rates are per minute; bursts are bucket capacities (default: one minute's worth); GPU budgets are
    seconds; the spend budget is in the pricing currency per calendar ``spend_period`` (UTC); run limits
    apply per agent run (``run_id``).
    """

    requests_per_minute: float | None = None
    requests_burst: float | None = None
    input_tokens_per_minute: float | None = None
    input_tokens_burst: float | None = None
    output_tokens_per_minute: float | None = None
    output_tokens_burst: float | None = None
    max_tokens_per_request: int | None = None
    max_concurrent: int | None = None
    max_queued: int | None = None
    gpu_seconds: float | None = None
    gpu_window_s: float = 86_400.0
    gpu_seconds_total: float | None = None
    max_model_calls: int | None = None
    max_tool_rounds: int | None = None
    max_tokens: int | None = None
    reservation_ttl_s: float = 600.0
    spend_budget: float | None = None  # in the pricing currency, per spend_period
    spend_period: Period = "month"

    def burst(self, dimension: str) -> float | None:
        """Bucket capacity of ``requests``, ``input_tokens`` or ``output_tokens`` (None: unlimited)."""
        rate = getattr(self, f"{dimension}_per_minute")
        if rate is None:
            return None
        burst = getattr(self, f"{dimension}_burst")
        return float(burst) if burst is not None else float(rate)


@dataclass(frozen=True)
class Tier:
    """What a tier does when the ledger cannot be reached."""

    name: str
    on_ledger_unavailable: Literal["reject", "emergency"] = "reject"
    emergency_requests: int = 0
    emergency_tokens: int = 0
    emergency_seconds: float = 0.0


@dataclass(frozen=True)
class TenantQuota:
    """A tenant's tier, weight, priority pool and limits (per model class)."""

    name: str
    tier: Tier
    weight: float
    priority: str
    limits: Limits
    by_model_class: dict[str, Limits]

    def for_model_class(self, model_class: str) -> Limits:
        """The limits of ``model_class`` (the tenant's own where the class has no table): those of the account
        that binds for it (the last of ``accounts``), its run limits and reservation TTL."""
        return self.by_model_class.get(model_class, self.limits)

    def accounts(self, model_class: str) -> tuple[tuple[str, Limits], ...]:
        """The accounts a reservation in ``model_class`` is checked against and charged to, each with the
        limits it is checked against: the tenant-wide account (``TENANT_ACCOUNT``, the tenant's limits, every
        class counted), then, when the class has a table of its own, the class's (key: the class name, its
        merged limits)."""
        own = self.by_model_class.get(model_class)
        tenant_wide = ((TENANT_ACCOUNT, self.limits),)
        return tenant_wide if own is None else (*tenant_wide, (model_class, own))


@dataclass(frozen=True)
class Quotas:
    """All tenants' quotas. ``tenant(name)`` raises ``KeyError`` for an unknown tenant."""

    tenants: dict[str, TenantQuota]
    tiers: dict[str, Tier]
    prices: dict[str, Price] = field(default_factory=dict)  # by model class; a class absent costs nothing
    currency: str = "USD"

    def price(self, model_class: str) -> Price:
        """The price of ``model_class`` (``Price()``, nothing, when it has none)."""
        return self.prices.get(model_class, FREE)

    @property
    def spend_limited(self) -> bool:
        """Some tenant has a spend budget (on its own limits or a model class's)."""
        return any(
            limits.spend_budget is not None
            for quota in self.tenants.values()
            for limits in (quota.limits, *quota.by_model_class.values())
        )

    def tenant(self, name: str) -> TenantQuota:
        """The tenant's quota. Raises ``KeyError``."""
        return self.tenants[name]


def _merge(base: Limits, override: LimitsConfig) -> Limits:
    values = {k: v for k, v in override.model_dump().items() if v is not None}
    return replace(base, **values)


def _check_bursts(limits: Limits, where: str) -> None:
    """Each burst of ``limits`` (a table merged over the ones it overrides) has a rate and admits the
    largest request. Raises ``QuotaConfigError``."""
    for dimension in ("requests", "input_tokens", "output_tokens"):
        if getattr(limits, f"{dimension}_burst") is not None and getattr(limits, f"{dimension}_per_minute") is None:
            raise QuotaConfigError(
                f"{where}.{dimension}_burst: set, but no {dimension}_per_minute applies (neither in this table "
                "nor in the ones it overrides): a burst needs a rate"
            )
    largest = limits.max_tokens_per_request
    for dimension in ("input_tokens", "output_tokens"):
        burst = limits.burst(dimension)
        if burst is not None and largest is not None and burst < largest:
            raise QuotaConfigError(
                f"{where}.{dimension}_burst: {burst:g} is below max_tokens_per_request "
                f"({largest}): a request of that size could never be admitted"
            )


def quotas_from_dict(data: dict[str, Any], source: str = "<quotas>") -> Quotas:
    """Validate a parsed quota document.

    Raises:
        QuotaConfigError: unknown key, wrong type, negative limit, burst below the per-request maximum.
    """
    try:
        parsed = QuotaFile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        location = ".".join(_key_text(p) for p in first["loc"] if p != "[key]") or "(top level)"
        message = "unknown key" if first["type"] == "extra_forbidden" else first["msg"].replace("Value error, ", "")
        raise QuotaConfigError(f"{source}: {location}: {message}") from None
    tiers = {}
    for name, tier in parsed.tiers.items():
        budget = tier.emergency
        tiers[name] = Tier(
            name,
            tier.on_ledger_unavailable,
            budget.requests if budget else 0,
            budget.tokens if budget else 0,
            budget.seconds if budget else 0.0,
        )
    defaults = _merge(Limits(), parsed.defaults)
    _check_bursts(defaults, f"{source}: defaults")
    tenants = {}
    for name, tenant in parsed.tenants.items():
        limits = _merge(defaults, tenant.limits)
        _check_bursts(limits, f"{source}: tenants.{name}.limits")
        by_class = {}
        for model_class, override in tenant.model_class.items():
            by_class[model_class] = _merge(limits, override)
            _check_bursts(by_class[model_class], f"{source}: tenants.{name}.model_class.{model_class}")
        tenants[name] = TenantQuota(name, tiers[tenant.tier], tenant.weight, tenant.priority, limits, by_class)
    prices = {model_class: price.price() for model_class, price in parsed.pricing.model_class.items()}
    return Quotas(tenants, tiers, prices, parsed.pricing.currency)


def load_quotas(path: str | Path) -> Quotas:
    """Read and validate a quota TOML file.

    Raises:
        QuotaConfigError: missing file, bad TOML, or any invalid key or value (named with the file).
    """
    data = read_toml(path, QuotaConfigError, "quota file")
    return quotas_from_dict(data, str(path))


LIMIT_FIELDS = tuple(f.name for f in fields(Limits))
# The order in which the server-side code reads a book's limits, packed one after another: the Redis scripts
# (prelude.lua's unpack_limits) and PostgreSQL's functions (postgres_functions.sql's header). A ``*_burst`` is
# ``Limits.burst``, ``spend_period`` its code (``periods.PERIOD_CODES``).
PACKED_LIMITS = (
    "requests_per_minute",
    "input_tokens_per_minute",
    "output_tokens_per_minute",
    "requests_burst",
    "input_tokens_burst",
    "output_tokens_burst",
    "max_tokens_per_request",
    "max_concurrent",
    "max_queued",
    "gpu_seconds",
    "gpu_window_s",
    "gpu_seconds_total",
    "max_model_calls",
    "max_tool_rounds",
    "max_tokens",
    "reservation_ttl_s",
    "spend_budget",
    "spend_period",
)


def packed_limit_values(limits: Limits) -> tuple[float | None, ...]:
    """``limits`` in ``PACKED_LIMITS`` order, as numbers; None where there is no limit."""
    values: list[float | None] = []
    for name in PACKED_LIMITS:
        if name.endswith("_burst"):
            value: float | None = limits.burst(name.removesuffix("_burst"))
        elif name == "spend_period":
            value = PERIOD_CODES[limits.spend_period]
        else:
            value = getattr(limits, name)
        values.append(None if value is None else float(value))
    return tuple(values)

"""Usage as money: what ``/v1/usage``, ``/admin/usage``, ``/admin/tenants`` and the dashboard show of spend.

Seed 003: "use benchmarked inference units for pricing, but still display user-understandable tokens,
concurrency, and amounts". The ledger prices every reservation at its model class's ``[quotas.pricing]``
(``fairgate.ledger.model.Price``) and books spend in micros of the currency; this module turns those into
amounts of the currency and reads the spend budget's period from the tenant's accounts::

    "spend": {"currency": "USD", "amount": 0.00164,            # billed in the usage window
              "period": {"spend_period": "month", "start_ms": ..., "end_ms": ...,
                         "used": 0.0051, "budget": 0.01, "remaining": 0.0049,   # held + billed, this period
                         "model_class": {"large": {"used": ..., "budget": ..., "remaining": ...}}}}

``used`` counts what open reservations hold (their worst case) with what was billed, as the budget does;
``budget`` and ``remaining`` are null without a spend budget.
"""

from __future__ import annotations

import math
from typing import Any

from fairgate.ledger import Ledger, Quotas, rules
from fairgate.ledger.config import Limits
from fairgate.ledger.periods import next_period_start_ms

MICROS = 1e6


def amount(micros: float) -> float:
    """Micros as an amount of the currency, to the micro (no float noise such as 0.0016400000000000002)."""
    return round(micros / MICROS, 6)


def _balance(account: rules.Account, limits: Limits) -> dict[str, Any]:
    budget = limits.spend_budget
    left = rules.spend_left_micros(account, limits)
    return {
        "used": amount(account.spend_used_micros),
        "budget": budget,
        "remaining": None if math.isinf(left) else amount(max(0.0, left)),
    }


async def spend_document(
    ledger: Ledger, quotas: Quotas, tenant: str, window_spend_micros: float, now_ms: float
) -> dict[str, Any]:
    """The ``spend`` object of a tenant's usage (this module's docstring): the window's billed amount and the
    current period's balances, tenant-wide and for each model class with a table of its own. Raises
    ``LedgerError`` (the accounts are read from the ledger) and ``KeyError`` for an unknown tenant."""
    quota = quotas.tenant(tenant)
    account = rules.refreshed(await ledger.account(tenant, "*"), quota.limits, now_ms)
    period = quota.limits.spend_period
    classes = {}
    for model_class, limits in quota.by_model_class.items():
        own = rules.refreshed(await ledger.account(tenant, model_class), limits, now_ms)
        classes[model_class] = _balance(own, limits)
    return {
        "currency": quotas.currency,
        "amount": amount(window_spend_micros),
        "period": {
            "spend_period": period,
            "start_ms": account.spend_period_start_ms,
            "end_ms": next_period_start_ms(account.spend_period_start_ms, period),
            **_balance(account, quota.limits),
            "model_class": classes,
        },
    }


def pricing_document(quotas: Quotas) -> dict[str, Any]:
    """The prices in force, as configured: currency, then per model class per million input and output tokens
    and per GPU-second."""
    return {
        "currency": quotas.currency,
        "model_class": {
            name: {
                "input_per_mtok": price.input_micros_per_token,
                "output_per_mtok": price.output_micros_per_token,
                "gpu_per_s": price.gpu_micros_per_ms / 1000.0,
            }
            for name, price in sorted(quotas.prices.items())
        },
    }

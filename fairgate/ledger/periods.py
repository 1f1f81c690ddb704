"""Spend periods: the calendar day or month (UTC) a spend budget is counted over, from a time in ms.

Pure integer arithmetic on days since the epoch (Howard Hinnant's ``days_from_civil`` / ``civil_from_days``,
"chrono-Compatible Low-Level Date Algorithms"), so ``redis/scripts/prelude.lua`` can compute the same
boundaries to the millisecond: the Lua copy is a line-for-line port.
"""

from __future__ import annotations

from typing import Literal

DAY_MS = 86_400_000
Period = Literal["day", "month"]
PERIODS: tuple[Period, ...] = ("day", "month")
# How a period is packed in the Redis limits hash (a double per limit): codec.packed_limits, prelude.lua.
PERIOD_CODES: dict[str, int] = {"day": 1, "month": 2}


def days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date (``month`` 1-12)."""
    year -= month <= 2
    era = (year if year >= 0 else year - 399) // 400
    yoe = year - era * 400
    doy = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def civil_from_days(days: int) -> tuple[int, int, int]:
    """(year, month 1-12, day) of ``days`` since 1970-01-01."""
    z = days + 719468
    era = (z if z >= 0 else z - 146096) // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (month <= 2), month, day


def period_start_ms(now_ms: float, period: str) -> float:
    """Start (ms since the epoch, UTC) of the ``period`` (``day`` or ``month``) holding ``now_ms``."""
    days = int(now_ms // DAY_MS)
    if period == "day":
        return float(days * DAY_MS)
    year, month, _ = civil_from_days(days)
    return float(days_from_civil(year, month, 1) * DAY_MS)


def next_period_start_ms(start_ms: float, period: str) -> float:
    """Start of the period after the one starting at ``start_ms`` (a ``period_start_ms``)."""
    days = int(start_ms // DAY_MS)
    if period == "day":
        return float((days + 1) * DAY_MS)
    year, month, _ = civil_from_days(days)
    year, month = (year + 1, 1) if month == 12 else (year, month + 1)
    return float(days_from_civil(year, month, 1) * DAY_MS)

"""The token-bucket arithmetic against one table of cases: refill, the burst cap, exact boundaries, the wait
before a retry, giving units back. Each case runs on the Python implementation (``fairgate.core.ratelimit``)
and on the Lua one the Redis ledger runs (``fairgate/ledger/redis/scripts/bucket.lua``, on the real
server); the refills at a rate per minute also on the PostgreSQL ledger's (``fg_refill_level`` and
``fg_refill_time`` in ``fairgate/ledger/postgres_functions.sql``). They must agree bit for bit, so every
expected value is a literal double compared with ``==``."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import psycopg
import pytest
from redis.asyncio import Redis

from fairgate.core import ratelimit
from fairgate.ledger import postgres_functions
from fairgate.ledger.redis.lua import source

MINUTE_MS = 60_000.0

# (case id, operation, arguments, expected result). ``refill`` returns (level, updated_ms).
BUCKET_CASES: list[tuple[str, str, tuple[Any, ...], Any]] = [
    ("refill-new-bucket-starts-full", "refill", (None, 0.0, 5_000.0, 600.0, 20.0, MINUTE_MS), (20.0, 5_000.0)),
    ("refill-half-a-minute", "refill", (2.0, 0.0, 30_000.0, 10.0, 20.0, MINUTE_MS), (7.0, 30_000.0)),
    ("refill-capped-at-burst", "refill", (15.0, 0.0, 60_000.0, 10.0, 20.0, MINUTE_MS), (20.0, 60_000.0)),
    ("refill-reaches-burst-exactly", "refill", (10.0, 0.0, 60_000.0, 10.0, 20.0, MINUTE_MS), (20.0, 60_000.0)),
    ("refill-a-long-idle-banks-no-more", "refill", (0.0, 0.0, 1e12, 10.0, 20.0, MINUTE_MS), (20.0, 1e12)),
    ("refill-debt-refills", "refill", (-5.0, 1_000.0, 4_000.0, 1_500.0, 1_500.0, MINUTE_MS), (70.0, 4_000.0)),
    ("refill-clock-behind-reads-no-time", "refill", (3.5, 9_000.0, 4_000.0, 600.0, 20.0, MINUTE_MS), (3.5, 9_000.0)),
    ("refill-same-instant", "refill", (3.5, 9_000.0, 9_000.0, 600.0, 20.0, MINUTE_MS), (3.5, 9_000.0)),
    (
        "refill-above-a-lowered-burst-is-cut",
        "refill",
        (30.0, 9_000.0, 9_000.0, 600.0, 20.0, MINUTE_MS),
        (20.0, 9_000.0),
    ),
    # (elapsed * rate) / per, in that order: elapsed * (rate / per) gives -28.57920166666667.
    (
        "refill-order-of-operations",
        "refill",
        (-39.75, 0.0, 95_749.7, 7.0, 20.0, MINUTE_MS),
        (-28.579201666666666, 95_749.7),
    ),
    ("refill-per-ms-rate", "refill", (0.1, 0.0, 333.3, 0.3, 1_000.0, 1.0), (100.08999999999999, 333.3)),
    ("wait-holds-enough", "wait", (5.0, 1.0, 8.0, 60.0), 0.0),
    ("wait-exact-boundary", "wait", (1.0, 1.0, 8.0, 60.0), 0.0),
    ("wait-retry-after-seconds", "wait", (0.25, 1.0, 8.0, 60.0), 5.625),
    ("wait-out-of-debt", "wait", (-37.5, 1_000.0, 3_000.0, 60.0), 20.75),
    ("wait-ms-bucket", "wait", (-5.0, 3.0, 1.0, 1.0), 8.0),
    ("credit-gives-back", "credit", (100.0, 250.0, 1_500.0), 350.0),
    ("credit-capped-at-burst", "credit", (1_400.0, 250.0, 1_500.0), 1_500.0),
    ("credit-reaches-burst-exactly", "credit", (1_250.0, 250.0, 1_500.0), 1_500.0),
    ("credit-takes", "credit", (100.0, -250.0, 1_500.0), -150.0),
]


Bucket = Callable[[str, tuple[Any, ...]], Awaitable[Any]]

# Calls bucket.lua's functions with ARGV: the operation, then its arguments ('' for a nil level); returns
# the results as %.17g strings, which Python reads back to the same doubles.
_LUA_DRIVER = """
local function arg(i) if ARGV[i] == '' then return nil end return tonumber(ARGV[i]) end
local function fmt(x) return string.format('%.17g', x) end
local op = ARGV[1]
if op == 'refill' then
  local level, updated = bucket_refill(arg(2), arg(3), arg(4), arg(5), arg(6), arg(7))
  return {fmt(level), fmt(updated)}
elseif op == 'wait' then
  return fmt(bucket_wait(arg(2), arg(3), arg(4), arg(5)))
end
return fmt(bucket_credit(arg(2), arg(3), arg(4)))
"""


async def _python(operation: str, args: tuple[Any, ...]) -> Any:
    return {"refill": ratelimit.refill, "wait": ratelimit.wait, "credit": ratelimit.credit}[operation](*args)


@pytest.fixture(params=["python", "lua"])
async def bucket(request: pytest.FixtureRequest) -> AsyncIterator[Bucket]:
    if request.param == "python":
        yield _python
        return
    async with Redis.from_url(request.getfixturevalue("redis_url"), decode_responses=True) as client:
        script = source("bucket") + _LUA_DRIVER

        async def lua(operation: str, args: tuple[Any, ...]) -> Any:
            argv = [operation, *("" if a is None else repr(float(a)) for a in args)]
            reply = await client.eval(script, 0, *argv)
            return tuple(map(float, reply)) if isinstance(reply, list) else float(reply)

        yield lua


@pytest.mark.parametrize(
    ("operation", "args", "expected"), [c[1:] for c in BUCKET_CASES], ids=[c[0] for c in BUCKET_CASES]
)
async def test_bucket_arithmetic(bucket, operation, args, expected):
    assert await bucket(operation, args) == expected


# The PostgreSQL functions refill at a rate per minute only (every bucket of the ledger's).
PER_MINUTE_REFILLS = [c for c in BUCKET_CASES if c[1] == "refill" and c[2][-1] == MINUTE_MS]


@pytest.fixture(scope="module")
def postgres_refill(postgres_url: str) -> Iterator[Callable[[tuple[Any, ...]], tuple[float, float]]]:
    """``refill(args)`` with ``ratelimit.refill``'s arguments, on the two functions in a schema of their own."""
    schema = f"fgt_refill_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_url, autocommit=True) as connection:
        connection.execute(f'CREATE SCHEMA "{schema}"')
        try:
            for statement in postgres_functions.definitions(schema):
                if f'FUNCTION "{schema}".fg_refill_' in statement:
                    connection.execute(statement)
            query = (
                f'SELECT "{schema}".fg_refill_level(%s::float8, %s::float8, %s::float8, %s::float8, %s::float8), '
                f'"{schema}".fg_refill_time(%s::float8, %s::float8, %s::float8, %s::float8)'
            )

            def refill(args: tuple[Any, ...]) -> tuple[float, float]:
                level, updated_ms, now_ms, rate, burst, _per_ms = args
                row = connection.execute(
                    query, (level, updated_ms, now_ms, rate, burst, level, updated_ms, now_ms, rate)
                )
                return tuple(row.fetchone() or ())

            yield refill
        finally:
            connection.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.mark.parametrize(
    ("args", "expected"), [c[2:] for c in PER_MINUTE_REFILLS], ids=[c[0] for c in PER_MINUTE_REFILLS]
)
def test_refill_on_postgresql(postgres_refill, args, expected):
    assert postgres_refill(args) == expected


def test_postgresql_refill_without_a_rate_leaves_the_bucket_as_it_is(postgres_refill):
    assert postgres_refill((3.5, 9_000.0, 4_000.0, None, 20.0, MINUTE_MS)) == (3.5, 9_000.0)
    assert postgres_refill((None, 9_000.0, 4_000.0, None, 20.0, MINUTE_MS)) == (None, 9_000.0)


def test_token_bucket_is_the_same_arithmetic_per_ms():
    bucket = ratelimit.TokenBucket(rate_per_ms=0.3, burst=1_000.0, level=0.1)
    assert bucket.available(333.3) == 100.08999999999999
    bucket.spend(0.09, 333.3)
    assert (bucket.level, bucket.updated_ms) == (99.99999999999999, 333.3)
    assert bucket.available(100.0) == bucket.level  # a clock behind reads the last level
    assert bucket.ready_at(bucket.level, 400.0) == 400.0
    assert bucket.ready_at(5_000.0, 400.0) == 400.0 + (1_000.0 - bucket.available(400.0)) / 0.3

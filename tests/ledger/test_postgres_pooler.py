"""A transaction-mode pooler the URL does not name (no ``pooler=transaction``) is found at open: the ledger then
prepares no statement and sends no cancel request, as if it were named. Without that, psycopg's prepared statements
(named per client connection) met other clients' on PgBouncer's shared server connections, and an outside tester's
two ledgers behind one PgBouncer wrote acknowledged reservations into each other's schemas."""

from __future__ import annotations

import asyncio
import logging

import psycopg
import pytest

from fairgate.ledger import connect, quotas_from_dict
from fairgate.ledger.postgres import PostgresLedger
from tests.conftest import run_token

QUOTAS = quotas_from_dict({"defaults": {"max_concurrent": 1000}, "tenants": {"t": {}}})
CALLS = 120  # each ledger's, at once


async def test_two_ledgers_behind_one_pgbouncer_without_pooler_in_the_url_keep_to_their_schemas(
    pgbouncer_url: str, postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    schemas = [f"pooler_{run_token()}_{side}" for side in ("x", "y")]
    with caplog.at_level(logging.WARNING, logger="fairgate.ledger"):
        ledgers = [await connect(f"{pgbouncer_url}?schema={schema}", QUOTAS) for schema in schemas]
    try:
        assert all(isinstance(ledger, PostgresLedger) and not ledger._cancel for ledger in ledgers)
        assert sum("a pooler or proxy stands between" in r.getMessage() for r in caplog.records) == 2
        # Both at once, many rounds each: statements of both ledgers run on the pooler's shared server connections.
        await asyncio.gather(
            *(
                ledger.reserve("t", f"{schema}-{i}", 10, 5, 1.0)
                for ledger, schema in zip(ledgers, schemas, strict=True)
                for i in range(CALLS)
            )
        )
        async with await psycopg.AsyncConnection.connect(postgres_url) as direct:
            for schema in schemas:
                cursor = await direct.execute(f"SELECT request_id FROM {schema}.fg_reservations")
                request_ids = {row[0] for row in await cursor.fetchall()}
                assert request_ids == {f"{schema}-{i}" for i in range(CALLS)}, schema
    finally:
        for ledger in ledgers:
            assert isinstance(ledger, PostgresLedger)
            await ledger.drop_schema()
            await ledger.close()


async def test_a_direct_connection_is_not_taken_for_a_pooler(postgres_url: str) -> None:
    ledger = await connect(f"{postgres_url}?schema=direct_{run_token()}", QUOTAS)
    try:
        assert isinstance(ledger, PostgresLedger) and ledger._cancel  # statements prepared, cancels sent
    finally:
        await ledger.drop_schema()
        await ledger.close()

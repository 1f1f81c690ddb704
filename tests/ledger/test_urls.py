"""How the PostgreSQL and Redis ledgers open connections: a bad URL is a one-line ``ValueError`` naming
the part at fault; an unreachable or misbehaving server is a one-line ``LedgerUnavailable`` giving the
real cause, within a few seconds (never a raw driver exception, never a silent default); ``create=False``
refuses to address a ledger that does not exist.

The misbehaving servers are tiny asyncio servers on 127.0.0.1: one that accepts and never answers, an
HTTP server, a fake Redis that replies with chosen errors, and a proxy to the real Redis that stops
forwarding replies on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlparse

import psycopg
import pytest
from redis.asyncio import Redis

from fairgate.ledger import InvalidUsage, LedgerUnavailable, quotas_from_dict
from fairgate.ledger import postgres_functions as fn
from fairgate.ledger.postgres import PostgresLedger
from fairgate.ledger.redis import RedisLedger

QUOTAS = quotas_from_dict({"defaults": {"max_concurrent": 5}, "tenants": {"a": {}}})
FAST_S = 5.0  # every failure below must come within this (the default timeout_s is 2)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


# --- helpers ---------------------------------------------------------------------------------------
def token() -> str:
    return f"fgu_{uuid.uuid4().hex[:12]}"


def assert_one_line(exc: BaseException, *needles: str) -> str:
    text = str(exc)
    assert text and "\n" not in text and "\r" not in text, repr(text)
    assert len(text) < 500, text
    for needle in needles:
        assert needle.lower() in text.lower(), f"{needle!r} not in {text!r}"
    return text


async def fails(make: Awaitable[Any], kind: type[BaseException], *needles: str, within: float = FAST_S) -> str:
    """Await ``make``: it must raise exactly ``kind`` (no driver exception) within ``within`` s, one line."""
    started = time.monotonic()
    with pytest.raises(Exception) as info:
        await make
    elapsed = time.monotonic() - started
    assert type(info.value) is kind, f"{type(info.value).__module__}.{type(info.value).__name__}: {info.value}"
    assert elapsed < within, f"took {elapsed:.1f} s: {info.value}"
    return assert_one_line(info.value, *needles)


class TcpServer:
    """An asyncio server on 127.0.0.1 running ``handler`` per connection; ``close()`` ends every handler."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self) -> TcpServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            await self._handler(reader, writer)
        except (asyncio.CancelledError, ConnectionError, OSError, asyncio.IncompleteReadError):
            pass  # the test is over or the client went away: end quietly
        finally:
            writer.close()
            self._writers.discard(writer)
            self._tasks.discard(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        for _ in range(50):
            if not self._tasks:
                break
            await asyncio.sleep(0.01)
        if self._server is not None:
            await self._server.wait_closed()


@pytest.fixture
async def tcp_server() -> AsyncIterator[Callable[[Handler], Awaitable[TcpServer]]]:
    started: list[TcpServer] = []

    async def start(handler: Handler) -> TcpServer:
        server = await TcpServer(handler).start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.close()


async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Accept, read whatever comes, never answer."""
    while await reader.read(65536):
        pass


async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """An HTTP server: answers anything with a 400 and closes."""
    await reader.read(65536)
    writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    await writer.drain()


class FakeRedis:
    """Speaks just enough RESP: HELLO -> a RESP3 map, PING -> PONG, SCRIPT LOAD -> a sha, anything else -> OK, unless
    ``replies`` maps the command (upper case) to raw reply bytes."""

    def __init__(self, replies: dict[str, bytes] | None = None) -> None:
        self.replies = dict(replies or {})

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            line = await reader.readline()
            if not line:
                return
            if not line.startswith(b"*"):
                continue
            args = []
            for _ in range(int(line[1:])):
                size = int((await reader.readline())[1:])
                args.append((await reader.readexactly(size + 2))[:-2].decode(errors="replace"))
            command = args[0].upper() if args else ""
            if command in self.replies:
                reply = self.replies[command]
            elif command == "PING":
                reply = b"+PONG\r\n"
            elif command == "HELLO":  # redis-py 8 speaks RESP3 by default: it opens with HELLO 3
                reply = b"%1\r\n$5\r\nproto\r\n:3\r\n"
            elif command == "SCRIPT":
                reply = b"$40\r\n" + b"0" * 40 + b"\r\n"
            else:
                reply = b"+OK\r\n"
            writer.write(reply)
            await writer.drain()


class StallingProxy:
    """Forwards to a real server until ``stall()``: then requests still go through but no reply comes back
    (on open connections and new ones alike), like a server that hangs."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.stalled = False

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, reply: bool) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await source.read(65536):
                    if reply and self.stalled:
                        continue
                    sink.write(data)
                    await sink.drain()

        try:
            await asyncio.wait(
                [
                    asyncio.ensure_future(pipe(reader, upstream_writer, False)),
                    asyncio.ensure_future(pipe(upstream_reader, writer, True)),
                ],
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            upstream_writer.close()

    def stall(self) -> None:
        self.stalled = True


class FirstOnlyProxy(StallingProxy):
    """Forwards the first connection to a real server; closes every later one at once."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(host, port)
        self.served = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.served += 1
        if self.served == 1:
            await super().__call__(reader, writer)


@contextlib.asynccontextmanager
async def opened(kind: type[RedisLedger] | type[PostgresLedger], url: str, **kwargs: Any) -> AsyncIterator[Any]:
    """``kind.open(url, QUOTAS, **kwargs)``; its keys or schema dropped and it closed after."""
    ledger = await kind.open(url, QUOTAS, **kwargs)
    try:
        yield ledger
    finally:
        await (ledger.drop_keys() if isinstance(ledger, RedisLedger) else ledger.drop_schema())
        await ledger.close()


def hostport(url: str, default_port: int) -> tuple[str, int]:
    parts = urlparse(url)
    return parts.hostname or "127.0.0.1", parts.port or default_port


# --- Redis: a peer that does not answer, or answers wrongly, at open ----------------------------------
# (id, URL without its host (the peer is put there), the peer (a handler, or the replies of a FakeRedis), the
# error, what the error must say ({where}: the peer's host:port), within how many seconds)
PEERS_AT_OPEN: list[tuple[str, str, Handler | dict[str, bytes], type[Exception], list[str], float]] = [
    ("default-timeout", "redis:///0", silent, LedgerUnavailable, ["{where}", "did not answer within 2 s"], FAST_S),
    ("timeout_s", "redis:///0?timeout_s=0.5", silent, LedgerUnavailable, ["within 0.5 s", "redis ledger"], 1.5),
    ("rediss-silent", "rediss:///0", silent, LedgerUnavailable, ["did not answer"], FAST_S),
    ("http", "redis:///0", http, LedgerUnavailable, ["does not speak the Redis protocol", "HTTP/1.1 400"], FAST_S),
    (
        "db-out-of-range",
        "redis:///5",
        {"SELECT": b"-ERR DB index is out of range\r\n"},
        ValueError,
        ["database 5"],
        FAST_S,
    ),
    *[
        (f"reply-{'-'.join(replies)}-{needles[0]}", "redis:///0", replies, LedgerUnavailable, needles, FAST_S)
        for replies, needles in [
            ({"PING": b"-LOADING Redis is loading the dataset in memory\r\n"}, ["LOADING", "loading"]),
            ({"PING": b"-NOAUTH Authentication required.\r\n"}, ["Authentication required"]),
            ({"PING": b"-MASTERDOWN Link with MASTER is down\r\n"}, ["MASTERDOWN"]),
            ({"PING": b"-ERR max number of clients reached\r\n"}, ["max number of clients"]),
            ({"PING": b"?what is this\r\n"}, ["does not speak the Redis protocol"]),
            (
                {"SCRIPT": b"-READONLY You can't write against a read only replica.\r\n"},
                ["READONLY", "read only replica"],
            ),
            ({"SCRIPT": b"-OOM command not allowed when used memory > 'maxmemory'.\r\n"}, ["OOM"]),
            ({"SCRIPT": b"-NOPERM this user has no permissions to run the 'script|load' command\r\n"}, ["NOPERM"]),
            ({"SCRIPT": b"-ERR unknown command 'SCRIPT'\r\n"}, ["ERR unknown command"]),
        ]
    ],
]


@pytest.mark.parametrize(
    ("url", "peer", "kind", "needles", "within"), [c[1:] for c in PEERS_AT_OPEN], ids=[c[0] for c in PEERS_AT_OPEN]
)
async def test_redis_peer_misbehaving_at_open_fails_fast_and_says_why(tcp_server, url, peer, kind, needles, within):
    server = await tcp_server(FakeRedis(peer) if isinstance(peer, dict) else peer)
    where = f"127.0.0.1:{server.port}"
    scheme, rest = url.split(":///")
    await fails(
        RedisLedger.open(f"{scheme}://{where}/{rest}{'&' if '?' in rest else '?'}prefix={token()}", QUOTAS),
        kind,
        *(needle.format(where=where) for needle in needles),
        within=within,
    )


# --- Redis: a server that stops answering, or answers wrongly, later -----------------------------------
async def test_redis_server_that_stops_answering_fails_every_later_call_fast(tcp_server, redis_url):
    proxy = StallingProxy(*hostport(redis_url, 6379))
    server = await tcp_server(proxy)
    prefix = token()
    ledger = await RedisLedger.open(f"redis://127.0.0.1:{server.port}/0?prefix={prefix}", QUOTAS)
    try:
        await ledger.reserve("a", "r1", 10, 10)
        proxy.stall()
        await fails(ledger.reserve("a", "r2", 10, 10), LedgerUnavailable, "did not answer within 2 s")
        await fails(ledger.events(), LedgerUnavailable, "did not answer")
        await fails(ledger.account("a"), LedgerUnavailable, "did not answer")
    finally:
        await ledger.close()
        async with Redis.from_url(redis_url) as client:
            keys = [k async for k in client.scan_iter(match=f"*{prefix}*")]
            if keys:
                await client.delete(*keys)


@pytest.mark.parametrize(
    ("url", "kind", "needles"),
    [
        ("rediss://{where}/0", LedgerUnavailable, ["did not answer within 2 s", "TLS"]),
        ("redis://{where}/99", ValueError, ["database 99", "DB index is out of range"]),
        ("redis://nobody_x:s3cr3t@{where}/0", LedgerUnavailable, ["refused the credentials"]),
    ],
    ids=["rediss-to-plain-text", "database-out-of-range", "wrong-credentials"],
)
async def test_the_real_server_refusing_the_url_fails_fast_and_says_why(redis_url, url, kind, needles):
    host, port = hostport(redis_url, 6379)
    text = await fails(
        RedisLedger.open(f"{url.format(where=f'{host}:{port}')}?prefix={token()}", QUOTAS), kind, *needles
    )
    assert "s3cr3t" not in text


async def test_redis_connection_refused_is_unavailable(tcp_server):
    server = await tcp_server(silent)
    port = server.port
    await server.close()  # nothing listens there now
    await fails(
        RedisLedger.open(f"redis://127.0.0.1:{port}/0?prefix={token()}", QUOTAS),
        LedgerUnavailable,
        f"127.0.0.1:{port}",
        "connect",
    )


@pytest.mark.parametrize(
    "reply",
    [
        b"-READONLY You can't write against a read only replica.\r\n",
        b"-BUSY Redis is busy running a script.\r\n",
        b"-ERR Error running script (call to f_x): @user_script:1: boom\r\n",
        b"-LOADING Redis is loading the dataset in memory\r\n",
    ],
)
async def test_redis_error_replies_on_later_calls_are_unavailable(tcp_server, reply):
    fake = FakeRedis()
    server = await tcp_server(fake)
    ledger = await RedisLedger.open(f"redis://127.0.0.1:{server.port}/0?prefix={token()}", QUOTAS)
    try:
        fake.replies["EVALSHA"] = fake.replies["HGETALL"] = reply
        code = reply[1:].split(b" ")[0].decode()
        await fails(ledger.reserve("a", "r1", 10, 10), LedgerUnavailable, code)
        await fails(ledger.events(), LedgerUnavailable, code)
    finally:
        await ledger.close()


async def test_redis_wrong_type_under_the_prefix_is_unavailable(redis_url):
    prefix = token()
    async with opened(RedisLedger, f"{redis_url}?prefix={prefix}") as ledger:
        async with Redis.from_url(redis_url) as client:
            await client.set(f"{prefix}:tenants", "not a hash")
        await fails(ledger.events(), LedgerUnavailable, "WRONGTYPE")


async def test_redis_argument_redis_py_cannot_send_is_invalid_usage_not_unavailable(redis_url):
    async with opened(RedisLedger, f"{redis_url}?prefix={token()}") as ledger:
        await fails(ledger.account("a", None), InvalidUsage)  # type: ignore[arg-type]


# --- Redis: bad URLs -----------------------------------------------------------------------------
# What follows the real server's host:port in a Redis URL the ledger refuses, and what the error must say.
BAD_REDIS_TAILS = [
    ("/abc?prefix=x", ["path", "/abc", "database number"]),
    ("/0/1?prefix=x", ["path", "/0/1"]),
    ("/-1?prefix=x", ["path", "/-1"]),
    ("/0?foo=1", ["unknown parameter", "foo"]),
    ("/0?prefix=x&socket_timeout=1", ["unknown parameter", "socket_timeout"]),
    ("/0?db=1", ["unknown parameter", "db"]),
    ("/0?prefix=a&prefix=b", ["more than once", "prefix"]),
    ("/0?timeout_s=1&timeout_s=2", ["more than once", "timeout_s"]),
    ("/0?timeout_s=0", ["timeout_s", "(0, 600]"]),
    ("/0?timeout_s=-1", ["timeout_s"]),
    ("/0?timeout_s=601", ["timeout_s"]),
    ("/0?timeout_s=nan", ["timeout_s"]),
    ("/0?timeout_s=inf", ["timeout_s"]),
    ("/0?timeout_s=soon", ["timeout_s"]),
    ("/0?timeout_s=", ["timeout_s"]),
    ("/0?prefix=", ["prefix"]),
    ("/0?retention_days=0", ["retention_days"]),
    ("/0?ssl_cert_reqs=none", ["ssl_cert_reqs", "rediss://"]),
    ("/0#frag", ["fragment"]),
]


@pytest.mark.parametrize(
    ("url", "needles"),
    [
        *((f"redis://{{where}}{tail}", needles) for tail, needles in BAD_REDIS_TAILS),
        ("redis://127.0.0.1:99999/0", ["port"]),
        ("redis://127.0.0.1:abc/0", ["port"]),
        ("redis:///0", ["no host"]),
        ("http://127.0.0.1:6379/0", ["scheme"]),
        ("rediss://127.0.0.1:6379/0?ssl_cert_reqs=maybe", ["ssl_cert_reqs"]),
        ("rediss://127.0.0.1:6379/0?ssl_ca_certs=/no/such/ca.pem", ["ssl_ca_certs", "not a file"]),
        ("rediss://127.0.0.1:6379/0?ssl_check_hostname=perhaps", ["ssl_check_hostname"]),
    ],
)
async def test_redis_bad_url_is_a_value_error(redis_url, url, needles):
    where = "{}:{}".format(*hostport(redis_url, 6379))
    await fails(RedisLedger.open(url.format(where=where), QUOTAS), ValueError, *needles, within=0.5)


async def test_redis_password_is_not_shown_in_url_errors():
    text = await fails(RedisLedger.open("redis://user:s3cr3t@127.0.0.1:6379/abc", QUOTAS), ValueError, "path")
    assert "s3cr3t" not in text and "***" in text


async def test_redis_good_url_with_explicit_timeout_and_no_path_opens(redis_url):
    host, port = hostport(redis_url, 6379)
    async with opened(RedisLedger, f"redis://{host}:{port}?prefix={token()}&timeout_s=5") as ledger:
        assert ledger.timeout_s == 5.0
        await ledger.reserve("a", "r1", 1, 1)


# --- Redis: create=False -------------------------------------------------------------------------
async def test_redis_create_false_refuses_a_prefix_with_no_keys(redis_url):
    host, port = hostport(redis_url, 6379)
    url = f"redis://:s3cr3t@{host}:{port}/0?prefix={token()}"  # the server has no password: AUTH is ignored
    text = await fails(RedisLedger.open(url, QUOTAS, create=False), LedgerUnavailable, "no ledger at", "(create=False)")
    assert "s3cr3t" not in text


@pytest.mark.parametrize("kind", [RedisLedger, PostgresLedger], ids=["redis", "postgres"])
async def test_create_false_opens_an_existing_ledger(kind, request):
    """On Redis, a ledger whose tenant registry exists (the reservation registers the tenant)."""
    if kind is RedisLedger:
        url = f"{request.getfixturevalue('redis_url')}?prefix={token()}"
    else:
        url = f"{request.getfixturevalue('postgres_url')}?schema={token()}"
    async with opened(kind, url) as ledger:
        await ledger.reserve("a", "r1", 10, 10)
        again = await kind.open(url, QUOTAS, create=False)
        assert [r.request_id for r in await again.reservations()] == ["r1"]
        await again.close()


async def test_redis_create_false_accepts_any_key_under_the_prefix(redis_url):
    prefix = token()
    async with Redis.from_url(redis_url) as client:
        await client.set(f"{{{prefix}:0123456789abcdef}}:seq", "1")
        try:
            ledger = await RedisLedger.open(f"{redis_url}?prefix={prefix}", QUOTAS, create=False)
            await ledger.close()
        finally:
            await client.delete(f"{{{prefix}:0123456789abcdef}}:seq")


# --- PostgreSQL: bad URLs ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("query", "kind", "needles"),
    [
        ("schema=", ValueError, ["schema is empty"]),
        ("schema=information_schema", ValueError, ["information_schema", "system schema"]),
        ("schema=pg_x", ValueError, ["pg_x", "system schema"]),
        ("schema=pg_catalog", ValueError, ["pg_catalog", "system schema"]),
        ("schema=Bad-Name", ValueError, ["schema"]),
        ("schema=a&schema=b", ValueError, ["more than once", "schema"]),
        ("schema=a&sslmode=disable&sslmode=require", ValueError, ["more than once", "sslmode"]),
        ("schema=a&timeout_s=0", ValueError, ["timeout_s"]),
        ("schema=a&timeout_s=601", ValueError, ["timeout_s"]),
        ("schema=a&timeout_s=soon", ValueError, ["timeout_s"]),
        ("schema=a&foo=1", ValueError, ['invalid URI query parameter: "foo"']),
        ("schema=a&sslmode=bogus", ValueError, ['invalid sslmode value: "bogus"']),
        ("schema=a&target_session_attrs=x", ValueError, ["target_session_attrs"]),
    ],
)
async def test_postgres_bad_url_is_a_value_error(postgres_url, query, kind, needles):
    await fails(PostgresLedger.open(f"{postgres_url}?{query}", QUOTAS), kind, *needles, within=2.0)


async def test_postgres_real_libpq_parameters_still_pass(postgres_url):
    schema = token()
    url = f"{postgres_url}?schema={schema}&sslmode=disable&application_name=fg_test"
    async with opened(PostgresLedger, url) as ledger, ledger._pool.connection() as connection:
        cursor = await connection.execute(
            "SELECT current_setting('application_name'), current_schema(), "
            "to_regclass(format('%%I.fg_reservations', %s::text)) IS NOT NULL",
            (schema,),
        )
        # The ledger's tables are in its schema; its connections keep no session state (no search_path set):
        # every statement names the schema, so a transaction-mode pooler may hand out any server connection.
        assert await cursor.fetchone() == ("fg_test", "public", True)


async def test_postgres_sslmode_require_without_ssl_on_the_server_says_so(postgres_url):
    async with await psycopg.AsyncConnection.connect(postgres_url) as connection:
        cursor = await connection.execute("SHOW ssl")
        row = await cursor.fetchone()
    if row and row[0] == "on":
        pytest.skip("this server speaks TLS")  # the case needs a plain-text server
    await fails(
        PostgresLedger.open(f"{postgres_url}?schema={token()}&sslmode=require", QUOTAS),
        LedgerUnavailable,
        "postgres ledger:",
        "SSL",
    )


# --- PostgreSQL: the real cause, fast ------------------------------------------------------------
class PoolWarnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def pool_warnings():  # type: ignore[no-untyped-def]
    handler = PoolWarnings()
    logger = logging.getLogger("psycopg.pool")
    logger.addHandler(handler)
    yield handler.records
    logger.removeHandler(handler)


async def test_postgres_connection_refused_gives_the_cause_fast(tcp_server, postgres_url, pool_warnings):
    server = await tcp_server(silent)
    port = server.port
    await server.close()
    user = urlparse(postgres_url).username or "postgres"
    await fails(
        PostgresLedger.open(f"postgresql://{user}@127.0.0.1:{port}/test?schema={token()}", QUOTAS),
        LedgerUnavailable,
        "postgres ledger:",
        "Connection refused",
        within=2.0,
    )
    assert not [r for r in pool_warnings if r.levelno >= logging.WARNING]


async def test_postgres_missing_database_gives_the_cause_fast(postgres_url, pool_warnings):
    parts = urlparse(postgres_url)
    url = parts._replace(path=f"/nodb_{uuid.uuid4().hex[:8]}", query=f"schema={token()}").geturl()
    await fails(PostgresLedger.open(url, QUOTAS), LedgerUnavailable, "postgres ledger:", "does not exist", within=2.0)
    assert not pool_warnings


async def test_postgres_unknown_role_gives_the_cause_fast(postgres_url):
    parts = urlparse(postgres_url)
    netloc = f"nobody_{uuid.uuid4().hex[:8]}:s3cr3t@{parts.hostname}:{parts.port or 5432}"
    text = await fails(
        PostgresLedger.open(parts._replace(netloc=netloc, query=f"schema={token()}").geturl(), QUOTAS),
        LedgerUnavailable,
        "postgres ledger:",
        "nobody_",
        within=2.0,
    )
    assert "s3cr3t" not in text


async def test_postgres_silent_server_fails_within_the_timeout(tcp_server, pool_warnings):
    server = await tcp_server(silent)
    await fails(
        PostgresLedger.open(f"postgresql://postgres@127.0.0.1:{server.port}/test?schema={token()}", QUOTAS),
        LedgerUnavailable,
        "postgres ledger:",
        "timeout",
        f"127.0.0.1:{server.port}",
    )
    assert not pool_warnings


async def test_postgres_pool_failing_after_the_first_connection_gives_the_cause(
    tcp_server, postgres_url, pool_warnings
):
    server = await tcp_server(FirstOnlyProxy(*hostport(postgres_url, 5432)))
    parts = urlparse(postgres_url)
    url = f"postgresql://{parts.username or 'postgres'}@127.0.0.1:{server.port}{parts.path}?schema={token()}"
    try:
        text = await fails(PostgresLedger.open(url, QUOTAS), LedgerUnavailable, "postgres ledger:")
        assert "pool initialization incomplete" not in text and "closed" in text
        assert not pool_warnings
    finally:
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as connection:
            await connection.execute(f"DROP SCHEMA IF EXISTS {url.rsplit('=', 1)[1]} CASCADE")


async def test_postgres_http_peer_is_unavailable(tcp_server):
    server = await tcp_server(http)
    await fails(
        PostgresLedger.open(f"postgresql://postgres@127.0.0.1:{server.port}/test?schema={token()}", QUOTAS),
        LedgerUnavailable,
        "postgres ledger:",
    )


# --- Either server: a host name that does not resolve ---------------------------------------------
@pytest.mark.parametrize(
    "ledger, url",
    [
        (RedisLedger, "redis://no-such-host.invalid:6379/0?prefix={token}"),
        (PostgresLedger, "postgresql://postgres@no-such-host.invalid:5432/test?schema={token}"),
    ],
    ids=["redis", "postgres"],
)
async def test_unknown_host_is_unavailable(ledger, url):
    await fails(ledger.open(url.format(token=token()), QUOTAS), LedgerUnavailable, "no-such-host.invalid")


# --- PostgreSQL: create=False --------------------------------------------------------------------
async def _schema_exists(postgres_url: str, schema: str) -> bool:
    async with await psycopg.AsyncConnection.connect(postgres_url) as connection:
        cursor = await connection.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,))
        return await cursor.fetchone() is not None


async def test_postgres_create_false_refuses_a_missing_schema_and_creates_nothing(postgres_url):
    schema = token()
    parts = urlparse(postgres_url)
    url = parts._replace(
        netloc=f"{parts.username or 'postgres'}:s3cr3t@{parts.hostname}:{parts.port or 5432}", query=f"schema={schema}"
    ).geturl()
    text = await fails(
        PostgresLedger.open(url, QUOTAS, create=False), LedgerUnavailable, "no ledger at", "(create=False)", schema
    )
    assert "s3cr3t" not in text
    assert not await _schema_exists(postgres_url, schema)


async def test_postgres_create_false_refuses_a_schema_without_the_tables(postgres_url):
    schema = token()
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as connection:
        await connection.execute(f"CREATE SCHEMA {schema}")
        try:
            await fails(
                PostgresLedger.open(f"{postgres_url}?schema={schema}", QUOTAS, create=False),
                LedgerUnavailable,
                "no ledger at",
                "fg_reservations",
            )
        finally:
            await connection.execute(f"DROP SCHEMA {schema} CASCADE")


def test_postgres_create_false_requires_every_function_the_ledger_creates():
    """A call's helpers too: a call whose helper is missing fails only when it runs, not when the ledger opens."""
    names = fn.function_names()
    assert len(names) == len(set(names)) == len(fn.definitions("s"))  # each statement creates one function
    assert set(fn.FUNCTIONS) <= set(names)
    assert {"fg_checked_accounts", "fg_close_writes", "fg_refill_level", "fg_refill_time"} <= set(names)


# A call (fg_claim) and a helper of one (fg_close_writes, called by fg_close).
@pytest.mark.parametrize("function", ["fg_claim", "fg_close_writes"])
async def test_postgres_create_false_refuses_a_ledger_without_its_functions(postgres_url, function):
    """The request path runs in the ledger's server-side functions: tables without them are no ledger to serve."""
    schema = token()
    url = f"{postgres_url}?schema={schema}"
    made = await PostgresLedger.open(url, QUOTAS)
    try:
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as connection:
            await connection.execute(f"DROP FUNCTION {schema}.{function}")
        await fails(PostgresLedger.open(url, QUOTAS, create=False), LedgerUnavailable, function, "create=True")
        again = await PostgresLedger.open(url, QUOTAS)  # create=True installs them again
        await again.close()
        ledger = await PostgresLedger.open(url, QUOTAS, create=False)
        await ledger.close()
    finally:
        await made.drop_schema()
        await made.close()

"""Ledger throughput and server time: reserve + final settle pairs per second, per backend, with 1 and 8 concurrent
clients; then the server's time per operation and the ceiling it implies.

Throughput: each client is its own process with its own connection (as gateway processes are), running pairs on
its own tenant for ``--seconds``; the figure is all clients' pairs over the wall time. Then 8 clients on one
tenant: every call takes that tenant's lock, so how long a call holds it bounds them. One run measures every
backend, so the figures compare (goals on this machine: SQLite >= 5,000/s, PostgreSQL >= 2,000/s, Redis >=
10,000/s).

Server time: one client runs ``--ops`` requests one after another, in batches of ``BATCH``, each request twice, in
the two call patterns of a gateway request: the gateway's, a reserve that takes the run claim in the same call
(``reserve(..., claim_owner=...)``) then a final settle; and, beside it in the same run, reserve, claim, final
settle as three calls (the account read too: the pattern before the claim joined the reserve). Each batch runs
both, one operation kind at a time (which pattern first alternates between batches), and the server's time is read
before and after each kind:

- Redis: ``INFO commandstats`` deltas. A script call's ``usec`` includes the commands it runs, which Redis counts
  under their own names too: the time is that of the calls the client sent (scripts and plain commands), the
  commands counted are the client's calls and, apart, the commands run inside the scripts. The server is
  shared: calls of other clients show as more calls than this client made, and the figures are then flagged.
- PostgreSQL: the CPU time of the backend processes serving the ledger's connections (found by the URL's
  ``application_name``; ``/proc/<pid>/schedstat``, the server runs on this machine). Every other client runs in
  backends of its own, so the figure is this ledger's alone.
- SQLite: no server; the figure is this process's CPU (the gateway's own process pays it: Python included).

The floor (``bench/ledger_floor.py``), in the same run: three of the smallest write calls the server answers (a
no-op FCALL of a reserve's shape; a one-row UPDATE transaction), and the gateway request as a multiple of it.

The ceiling is 1e6 / µs per request: requests per second one server core sustains (a Redis shard is one core;
a fleet of gateways sharing one shard cannot go faster, whatever its size). ``--shards``: the same requests
over 12 tenants on one throwaway Redis server and on a throwaway Redis Cluster of three masters, each node's
µs per request, and the ceiling each gives (the busiest node's core full).

Usage: .venv/bin/python bench/ledger_ops.py [--seconds 3] [--ops 2000] [--repeat 1]
       [--backends sqlite,postgres,redis] [--no-throughput] [--shards]
       (PostgreSQL/Redis: $FAIRGATE_TEST_POSTGRES_URL / $FAIRGATE_TEST_REDIS_URL, default 127.0.0.1.)
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
from redis.asyncio import Redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ledger_floor import floor_us
from fairgate.harness.ledger import bench_quotas, drop_ledger
from fairgate.ledger import Ledger, Reservation, connect, quotas_from_dict
from fairgate.ledger.model import RunClaim
from fairgate.ledger.postgres import PostgresLedger
from fairgate.ledger.postgres_batch import CallBatches, LoneCall, Refusal, Row
from fairgate.ledger.rules import Account

QUOTAS = bench_quotas(8)
BATCH = 250  # requests open at once in the server-time run (below max_concurrent)
AT_ONCE_PER_CLIENT = 16  # pairs at once in each client process of the one-tenant throughput run's second figure
# The operation kinds timed: the three-call pattern's (reserve, claim, account, settle) and the gateway's
# (reserve_claim: the reserve that takes the run claim; settle_claimed: its final settle).
OPS = (
    "reserve",
    "claim",
    "account",
    "settle",
    "reserve_claim",
    "settle_claimed",
    "reserve_claim_at_once",
    "settle_claimed_at_once",
)
REQUEST = ("reserve_claim", "settle_claimed")  # a gateway request
AT_ONCE = ("reserve_claim_at_once", "settle_claimed_at_once")  # the same, BATCH requests at once (PostgreSQL: batched)
THREE_CALLS = ("reserve", "claim", "settle")  # the same request as three calls
SCRIPT_COMMANDS = frozenset({"eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro"})
NOT_OURS = frozenset({"info"})  # the sampler's own calls
T = TypeVar("T")
R = TypeVar("R")


def _client(
    url: str,
    index: int,
    seconds: float,
    start_at: float,
    out: mp.Queue,  # type: ignore[type-arg]
    one_tenant: bool,
    at_once: int,
    batched: bool,
) -> None:
    async def pairs(ledger: Ledger, tenant: str, name: str, end: float) -> int:
        done = 0
        while time.time() < end:
            r = await ledger.reserve(tenant, f"{name}-{done}", 100, 50, 10.0)
            await ledger.settle(r.id, 100, 20, 8.0, final=True)
            done += 1
        return done

    async def run() -> int:
        ledger = await connect(url, quotas_from_dict(QUOTAS))
        if not batched and isinstance(ledger, PostgresLedger):
            ledger._batches = _Unbatched(ledger._lone)
        tenant = f"bench{0 if one_tenant else index}"
        run = f"{start_at:.6f}"  # request ids of this measurement's own: a repeated one is a retry, not a request
        await asyncio.sleep(max(0.0, start_at - time.time()))
        end = time.time() + seconds
        done = await asyncio.gather(*(pairs(ledger, tenant, f"{run}-{index}-{k}", end) for k in range(at_once)))
        await ledger.close()
        return sum(done)

    out.put(asyncio.run(run()))


class _Unbatched(CallBatches):
    """PostgreSQL's calls as without ``postgres_batch``: each alone, as many in flight as the pool has
    connections."""

    def __init__(self, lone: LoneCall) -> None:
        self._lone_call = lone

    async def call(self, function: str, params: dict[str, Any]) -> Row | Refusal:
        return await self._lone_call(function, params)


def measure(
    url: str, clients: int, seconds: float, one_tenant: bool = False, at_once: int = 1, batched: bool = True
) -> float:
    """Pairs per second of ``clients`` processes, each on a tenant of its own or (``one_tenant``) all on one: the
    tenant's lock, which every call on it takes, then bounds them. Each process runs ``at_once`` pairs at a time
    (a gateway process serves many requests at once: PostgreSQL batches their calls, unless not ``batched``)."""
    queue: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    start_at = time.time() + 1.5  # every client connected before the clock starts
    processes = [
        mp.Process(target=_client, args=(url, i, seconds, start_at, queue, one_tenant, at_once, batched))
        for i in range(clients)
    ]
    for p in processes:
        p.start()
    total: float = sum(queue.get(timeout=seconds + 60) for _ in processes)
    for p in processes:
        p.join()
    return total / seconds


# --- server time -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """The server's counters at one instant: µs of work, calls this client sent, commands run inside them."""

    us: float = 0.0
    calls: int = 0
    inner: int = 0
    foreign: bool = False  # more calls than this client made: another client used the server meanwhile
    cpu_us: float | None = None  # Redis: the server process's CPU time, where it runs on this machine


class Sampler(Protocol):
    async def read(self) -> dict[str, Any]: ...
    def between(self, before: dict[str, Any], after: dict[str, Any], calls: int) -> Sample: ...
    async def close(self) -> None: ...


class RedisSampler:
    """``INFO commandstats``: per command, calls and µs (script calls' µs include the commands they run); and,
    when the server runs on this machine, its process's CPU time (``cpu_us``: what the commands cost plus reading
    and answering them, and whatever else the server did meanwhile)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self._client = Redis.from_url(urlunsplit(parts._replace(query="")), decode_responses=True)
        self._pid: int | None = None

    async def read(self) -> dict[str, Any]:
        if self._pid is None:
            pid = int((await self._client.info("server"))["process_id"])
            self._pid = pid if "redis" in _command_line(pid) else 0
        stats: dict[str, Any] = await self._client.info("commandstats")
        commands = {name.removeprefix("cmdstat_"): (int(v["calls"]), float(v["usec"])) for name, v in stats.items()}
        return {"commands": commands, "cpu_ns": _cpu_ns(self._pid) if self._pid else None}

    def between(self, before: dict[str, Any], after: dict[str, Any], calls: int) -> Sample:
        us, sent, scripted, inner, plain_us = 0.0, 0, 0, 0, 0.0
        for name, (n, usec) in after["commands"].items():
            n0, usec0 = before["commands"].get(name, (0, 0.0))
            if name in NOT_OURS or n == n0:
                continue
            if name in SCRIPT_COMMANDS:
                us, sent, scripted = us + usec - usec0, sent + n - n0, scripted + n - n0
            else:
                inner, plain_us = inner + n - n0, plain_us + usec - usec0
        if scripted == 0:  # plain commands only (the account read): they are the client's calls
            us, sent, inner = plain_us, inner, 0
        cpu_us = None if after["cpu_ns"] is None else (after["cpu_ns"] - before["cpu_ns"]) / 1000.0
        return Sample(us, sent, inner, foreign=sent > calls, cpu_us=cpu_us)

    async def close(self) -> None:
        await self._client.aclose()


def _command_line(pid: int) -> str:
    """The command line of process ``pid`` on this machine ("" when there is none)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _cpu_ns(pid: int) -> int:
    """A process's CPU time, ns (``schedstat``; else ``stat``'s utime + stime, in clock ticks)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


class PostgresSampler:
    """The CPU time of the backends whose ``application_name`` is the ledger's."""

    def __init__(self, url: str, name: str) -> None:
        parts = urlsplit(url)
        query = [(k, v) for k, v in parse_qsl(parts.query) if k not in ("schema", "timeout_s", "application_name")]
        self._dsn, self._name = urlunsplit(parts._replace(query=urlencode(query))), name

    async def read(self) -> dict[str, Any]:
        async with await psycopg.AsyncConnection.connect(self._dsn, autocommit=True) as connection:
            cursor = await connection.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (self._name,)
            )
            pids = [int(row[0]) for row in await cursor.fetchall()]
        return {str(pid): _cpu_ns(pid) for pid in pids}

    def between(self, before: dict[str, Any], after: dict[str, Any], calls: int) -> Sample:
        ns = sum(v - before.get(pid, v) for pid, v in after.items())  # a backend new meanwhile: not counted
        return Sample(ns / 1000.0, calls)

    async def close(self) -> None:
        return None


class ProcessSampler:
    """This process's CPU time (SQLite runs in it)."""

    async def read(self) -> dict[str, Any]:
        return {"cpu": time.process_time()}

    def between(self, before: dict[str, Any], after: dict[str, Any], calls: int) -> Sample:
        return Sample((after["cpu"] - before["cpu"]) * 1e6, calls)

    async def close(self) -> None:
        return None


@dataclass
class Totals:
    """Per operation kind: the summed samples and how many operations they cover."""

    samples: dict[str, Sample] = field(default_factory=lambda: {op: Sample() for op in OPS})
    ops: int = 0

    def add(self, op: str, s: Sample) -> None:
        t = self.samples[op]
        cpu = None if s.cpu_us is None else (t.cpu_us or 0.0) + s.cpu_us
        self.samples[op] = Sample(t.us + s.us, t.calls + s.calls, t.inner + s.inner, t.foreign or s.foreign, cpu)

    def per_op(self, op: str) -> Sample:
        s, n = self.samples[op], max(1, self.ops)
        cpu = None if s.cpu_us is None else s.cpu_us / n
        return Sample(s.us / n, round(s.calls / n), round(s.inner / n), s.foreign, cpu)

    def us(self, *ops: str) -> float:
        """µs per request of ``ops`` together."""
        return sum(self.per_op(op).us for op in ops)


async def _phase(
    sampler: Sampler,
    totals: Totals,
    op: str,
    call: Callable[[T], Awaitable[R]],
    items: Sequence[T],
    at_once: bool = False,
) -> list[R]:
    """``call`` on every item, one after another (``at_once``: all at once), with the server's counters read
    before and after."""
    before = await sampler.read()
    if at_once:
        results = list(await asyncio.gather(*(call(item) for item in items)))
    else:
        results = [await call(item) for item in items]
    totals.add(op, sampler.between(before, await sampler.read(), len(items)))
    return results


async def server_time(ledger: Ledger, sampler: Sampler, ops: int) -> Totals:
    """``ops`` requests, ``BATCH`` at a time (module docstring), after a warm-up batch that is not counted."""
    totals, tenant, run = Totals(), "bench0", uuid.uuid4().hex[:8]

    async def reserve(request_id: str) -> Reservation:
        return await ledger.reserve(tenant, request_id, 100, 50, 10.0)

    async def claim(r: Reservation) -> RunClaim:
        return await ledger.claim(r.id, "bench", 60_000.0)

    async def account(r: Reservation) -> Account:
        return await ledger.account(r.tenant)

    async def settle(r: Reservation) -> Reservation:
        return await ledger.settle(r.id, 100, 20, 8.0, final=True)

    async def reserve_claim(request_id: str) -> Reservation:
        return await ledger.reserve(tenant, request_id, 100, 50, 10.0, claim_owner="bench", claim_lease_ms=60_000.0)

    async def three_calls(batch: int, counted: Totals) -> None:
        rs = await _phase(sampler, counted, "reserve", reserve, [f"{run}-{batch}-{i}" for i in range(BATCH)])
        await _phase(sampler, counted, "claim", claim, rs)
        await _phase(sampler, counted, "account", account, rs)
        await _phase(sampler, counted, "settle", settle, rs)

    async def gateway(batch: int, counted: Totals) -> None:
        ids = [f"{run}-{batch}-c{i}" for i in range(BATCH)]
        await _phase(
            sampler,
            counted,
            "settle_claimed",
            settle,
            await _phase(sampler, counted, "reserve_claim", reserve_claim, ids),
        )

    async def gateway_at_once(batch: int, counted: Totals) -> None:
        ids = [f"{run}-{batch}-a{i}" for i in range(BATCH)]
        reserved = await _phase(sampler, counted, "reserve_claim_at_once", reserve_claim, ids, at_once=True)
        await _phase(sampler, counted, "settle_claimed_at_once", settle, reserved, at_once=True)

    for batch in range(-1, max(1, ops // BATCH)):
        counted = totals if batch >= 0 else Totals()
        for pattern in (three_calls, gateway) if batch % 2 == 0 else (gateway, three_calls):
            await pattern(batch, counted)
        await gateway_at_once(batch, counted)
        counted.ops += BATCH
    return totals


def _sampler(name: str, url: str) -> tuple[str, Sampler]:
    """The URL the ledger is opened with (PostgreSQL: named for the sampler) and the backend's sampler."""
    if name == "redis":
        return url, RedisSampler(url)
    if name == "postgres":
        app = f"fgbench_{uuid.uuid4().hex[:8]}"
        return f"{url}&application_name={app}", PostgresSampler(url, app)
    return url, ProcessSampler()


async def report_server_time(name: str, url: str, ops: int, repeat: int) -> None:
    """Print the server time per operation kind of the best of ``repeat`` runs (lowest per pair: a shared
    machine only ever adds time) and the ceilings it implies."""
    url, sampler = _sampler(name, url)
    ledger = await connect(url, quotas_from_dict(QUOTAS))
    try:
        runs = [await server_time(ledger, sampler, ops) for _ in range(repeat)]
    finally:
        await ledger.close()
        await sampler.close()
    best = min(runs, key=lambda t: t.us(*REQUEST))
    where = {"redis": "Redis commandstats", "postgres": "PostgreSQL backend CPU", "sqlite": "in-process CPU"}[name]
    parts = []
    for op in OPS:
        s = best.per_op(op)
        inner = f", {s.inner} inside" if name == "redis" else ""
        cpu = f", server CPU {s.cpu_us:.1f}" if s.cpu_us is not None else ""
        parts.append(f"{op} {s.us:.1f} µs ({s.calls} call{'s' if s.calls != 1 else ''}{inner}{cpu})")
    print(f"  {name:9s} {where}, per operation: " + "; ".join(parts))
    pair, request, three = best.us("reserve", "settle"), best.us(*REQUEST), best.us(*THREE_CALLS)
    foreign = any(s.foreign for s in best.samples.values())
    print(
        f"  {'':9s} pair (reserve + final settle) {pair:.1f} µs -> {1e6 / pair:,.0f} pairs/s per server core; "
        f"gateway request (reserve with its run claim + final settle) {request:.1f} µs -> {1e6 / request:,.0f} "
        f"requests/s per server core{' [other clients used the server meanwhile: upper bounds]' if foreign else ''}"
    )
    print(
        f"  {'':9s} the same request as three calls (reserve + claim + final settle) {three:.1f} µs -> "
        f"{1e6 / three:,.0f} requests/s per server core; gateway request / three calls: {request / three:.2f}"
    )
    at_once = best.us(*AT_ONCE)
    print(
        f"  {'':9s} gateway request, {BATCH} at once{' (calls batched: postgres_batch)' if name == 'postgres' else ''}"
        f" {at_once:.1f} µs -> {1e6 / at_once:,.0f} requests/s per server core; at once / one at a time: "
        f"{at_once / request:.2f}"
    )
    floor, what = await floor_us(name, url)
    print(
        f"  {'':9s} floor (bench/ledger_floor.py): 3 minimal write calls, each {what}, {3 * floor:.1f} µs; the "
        f"gateway request is {request / (3 * floor):.1f}x it"
    )
    cpu_ops = [best.per_op(op).cpu_us for op in (*REQUEST, *THREE_CALLS)]
    if name == "redis" and all(c is not None for c in cpu_ops):
        cpu_request = sum(c for c in cpu_ops[: len(REQUEST)] if c is not None)
        cpu_three = sum(c for c in cpu_ops[len(REQUEST) :] if c is not None)
        print(
            f"  {'':9s} Redis process CPU per gateway request {cpu_request:.1f} µs (I/O included; three calls "
            f"{cpu_three:.1f}) -> {1e6 / cpu_request:,.0f} requests/s per shard: the fleet's ceiling per Redis shard"
        )


# --- shards -------------------------------------------------------------------------------------------------
SHARD_TENANTS = 12  # tenants the shard run spreads its requests over (each tenant's keys on one node)


async def _shard_load(url: str, node_urls: list[str], ops: int) -> list[float]:
    """``ops`` gateway requests (reserve with the run claim, final settle) round-robin over ``SHARD_TENANTS``
    tenants on the ledger at ``url``; the µs of script calls each node served, per request."""
    quotas = dict(QUOTAS, tenants={f"bench{i}": {} for i in range(SHARD_TENANTS)})
    ledger = await connect(url, quotas_from_dict(quotas))
    samplers = [RedisSampler(node) for node in node_urls]
    run = uuid.uuid4().hex[:8]
    try:
        before = [await sampler.read() for sampler in samplers]
        for i in range(ops):
            tenant = f"bench{i % SHARD_TENANTS}"
            r = await ledger.reserve(tenant, f"{run}-{i}", 100, 50, 10.0, claim_owner="bench", claim_lease_ms=6e4)
            await ledger.settle(r.id, 100, 20, 8.0, final=True)
        after = [await sampler.read() for sampler in samplers]
        return [s.between(b, a, 2 * ops).us / ops for s, b, a in zip(samplers, before, after, strict=True)]
    finally:
        await drop_ledger(ledger)
        await ledger.close()
        for sampler in samplers:
            await sampler.close()


def report_shards(ops: int) -> None:
    """One Redis server against a Redis Cluster of three masters (both throwaway, started here): the server
    time each node spends per gateway request, and the fleet's ceiling: requests/s until the busiest node's
    core is full (1e6 / its µs per request). Tenants, not requests, are spread over the shards."""
    from fairgate.harness.redis import redis_cluster, redis_server

    print(f"shards: {ops:,} gateway requests over {SHARD_TENANTS} tenants (server µs per request, per node)")
    with tempfile.TemporaryDirectory() as tmp:
        with redis_server(Path(tmp) / "single", durable=False) as single:
            one = asyncio.run(_shard_load(f"{single.url}?prefix=shards", [single.url], ops))
        with redis_cluster(Path(tmp) / "cluster") as nodes:
            urls_ = [f"redis://127.0.0.1:{node.port}/0" for node in nodes]
            three = asyncio.run(_shard_load(f"{urls_[0]}?prefix=shards&cluster=true", urls_, ops))
    for name, per_node in (("1 shard", one), ("3 shards", three)):
        busiest = max(per_node)
        nodes_text = " / ".join(f"{us:.1f}" for us in per_node)
        print(
            f"  {name:9s} per node {nodes_text} µs (total {sum(per_node):.1f}) -> ceiling {1e6 / busiest:,.0f} "
            "requests/s (the busiest node's core full)"
        )
    print(f"  ceiling 3 shards / 1 shard: x{max(one) / max(three):.2f}")


# --- the run ----------------------------------------------------------------------------------------------
def urls(backends: list[str], tmp: str) -> dict[str, str]:
    token = f"bench_{uuid.uuid4().hex[:8]}"
    pg = os.environ.get("FAIRGATE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
    redis = os.environ.get("FAIRGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    every = {
        "sqlite": f"sqlite:///{tmp}/{token}.db",
        "postgres": f"{pg}?schema={token}",
        "redis": f"{redis}?prefix={token}",
    }
    return {name: every[name] for name in backends}


async def _prepare_and_clean(url: str, clean: bool) -> None:
    ledger = await connect(url, quotas_from_dict(QUOTAS))
    if clean:
        await drop_ledger(ledger)
    await ledger.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--ops", type=int, default=2000, help="requests in the server-time run (BATCH at a time)")
    parser.add_argument("--backends", default="sqlite,postgres,redis")
    parser.add_argument("--repeat", type=int, default=1, help="server-time runs per backend; the best is printed")
    parser.add_argument("--no-throughput", action="store_true", help="only the server-time run")
    parser.add_argument("--shards", action="store_true", help="also: one Redis server against a 3-master cluster")
    args = parser.parse_args()
    goals = {"sqlite": 5000, "postgres": 2000, "redis": 10000}
    with tempfile.TemporaryDirectory() as tmp:
        chosen = urls(args.backends.split(","), tmp)
        if not args.no_throughput:
            print(
                f"reserve + final settle pairs per second ({args.seconds:g} s per measurement, {os.cpu_count()} cores)"
            )
            for name, url in chosen.items():
                asyncio.run(_prepare_and_clean(url, clean=False))
                one = measure(url, 1, args.seconds)
                eight = measure(url, 8, args.seconds)
                shared = measure(url, 8, args.seconds, one_tenant=True)
                shared_at_once = measure(url, 8, args.seconds, one_tenant=True, at_once=AT_ONCE_PER_CLIENT)
                unbatched = ""
                if name == "postgres":
                    alone = measure(url, 8, args.seconds, one_tenant=True, at_once=AT_ONCE_PER_CLIENT, batched=False)
                    unbatched = f" (not batched {alone:,.0f}/s: x{shared_at_once / alone:.2f})"
                asyncio.run(_prepare_and_clean(url, clean=True))
                print(
                    f"  {name:9s} 1 client {one:8,.0f}/s   8 clients {eight:8,.0f}/s   (x{eight / one:.2f}; "
                    f"goal >= {goals[name]:,}/s)   8 clients of one tenant {shared:8,.0f}/s, "
                    f"{AT_ONCE_PER_CLIENT} pairs at once each {shared_at_once:8,.0f}/s{unbatched}"
                )
        print(f"server time per operation ({args.ops:,} requests, {BATCH} at a time, one client)")
        for name, url in chosen.items():
            asyncio.run(report_server_time(name, url, args.ops, max(1, args.repeat)))
            asyncio.run(_prepare_and_clean(url, clean=True))
    if args.shards:
        report_shards(args.ops)


if __name__ == "__main__":
    main()

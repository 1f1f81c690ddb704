"""The fault matrix: two ``fairgate serve`` processes (A, B) on one ledger - an SQLite file both open, a
throwaway PostgreSQL or a throwaway Redis - and two emulated replica processes, under one fault per cell; the
history checker (``fairgate.harness.history``) then holds every request id to what the ledger and the
replicas counted: nothing run, reserved or billed twice, what the clients received billed (within the
in-flight bound per cut attempt), nothing left open or held.

Faults (``FAULTS``):

- ``retries``: every id is also sent to the other process, at the same instant (a storm) or up to 1.5 s later;
- ``kill9``: SIGKILL to process A with requests in flight and queued, started again 0.5 s later; one id in
  three asks for ``long_output_tokens`` (150-200): those sent first have streamed ~100 tokens by the kill at
  ``kill_at_s``, so a gateway that settled less often than every ``SETTLE_EVERY_TOKENS`` (64) tokens or
  ``SETTLE_EVERY_S`` (0.5 s) would leave more than the checker's bound of 64 delivered and unbilled;
- ``ledger_stop``: the ledger server stopped for 10 s, then started again on its data (SQLite, which has no
  server: another connection holds the file's exclusive lock for 10 s);
- ``ledger_pause``: the ledger server (PostgreSQL: with its backends) paused with SIGSTOP for 5 s;
- ``upstream_kill``: SIGKILL to one replica with sequences running;
- ``client_cuts``: two ids in three are cut by their clients (after k chunks, after the headers, after a time).

The load: ``ids`` request ids over two tenants - ``free`` (tier ``reject``: 503 while the ledger is down)
and ``paid`` (tier ``emergency``: a small local budget) - sent evenly over ``spread_s`` (longer with the
ledger down), alternately to A and B, one in five collected (not streamed; two in three when a replica is
killed, so that collected requests are running on it). A client whose attempt fails
(connection broken, 5xx, 409 ``request_in_progress``, an error event) retries the same id on the other
process after ``Retry-After`` (at most ``backoff_s_max``), at most ``attempts_max`` attempts: as a real
client does, so that a fault meets the retries it causes.

At the end, beside the checker: both gateways' gauges (``/metrics``: requests queued and sequences running)
are back to 0, as in the ``restart`` drill.
"""

from __future__ import annotations

import asyncio
import random
import signal
import sqlite3
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fairgate.harness.config import UNBOUNDED, TenantSpec
from fairgate.harness.gauges import gateway_gauges
from fairgate.harness.history import (
    HistoryReport,
    ReplicaCounts,
    check_history,
    read_ledger_state,
    read_replica_counts,
    replica_counts,
)
from fairgate.harness.ledger import wait_settled
from fairgate.harness.loadgen import Cut, LoadGenerator, Request
from fairgate.harness.postgres import throwaway_postgres_server
from fairgate.harness.process import ServerProcess
from fairgate.harness.records import RequestRecord
from fairgate.harness.redis import redis_server
from fairgate.harness.replica import ReplicaModel, read_replica
from fairgate.harness.run import poll, until
from fairgate.harness.stack import Stack, StackSpec, replicas, start_stack, temporary_folder
from fairgate.ledger.config import EmergencyConfig, TierConfig

BACKENDS = ("sqlite", "postgresql", "redis")
FAULTS = ("retries", "kill9", "ledger_stop", "ledger_pause", "upstream_kill", "client_cuts")
MODEL = "emu"
# Why a cell does not run: (backend, fault) -> the reason, as the table says it.
NOT_APPLICABLE = {
    ("sqlite", "ledger_pause"): "no ledger process to pause: SQLite runs inside each gateway process "
    "(a ledger that does not answer is the ledger_stop cell's lock)"
}


@dataclass(frozen=True)
class MatrixConfig:
    """One cell's setting."""

    ids: int = 30
    spread_s: float = 6.0  # the ids are sent evenly over this long
    outage_spread_s: float = 14.0  # ... over this long when the ledger is stopped (it is back by 12 s)
    fault_at_s: float = 2.0
    kill_at_s: float = 4.5  # kill9's fault comes later: its first long requests have streamed ~100 tokens
    ledger_down_s: float = 10.0
    ledger_pause_s: float = 5.0
    restart_after_s: float = 0.5  # kill9: A is started again after this long
    output_tokens: tuple[int, int] = (15, 60)
    long_output_tokens: tuple[int, int] = (150, 200)  # kill9: one id in three (~40 ms a token: 6-8 s)
    prompt_tokens: int = 24
    replica: ReplicaModel = field(default_factory=lambda: ReplicaModel(40.0, 0.5, 0.02, 8, 4096))
    gateway_batch: int = 4  # each gateway uses this many of each replica's slots
    reservation_ttl_s: float = 2.0
    sweep_s: float = 0.5
    ledger_timeout_s: float = 1.0  # the gateways' ledger client timeout (PostgreSQL, Redis)
    emergency: EmergencyConfig = field(default_factory=lambda: EmergencyConfig(requests=6, tokens=600, seconds=120.0))
    attempts_max: int = 4
    backoff_s_max: float = 2.0
    client_timeout_s: float = 30.0  # an attempt taking longer is recorded as a broken connection (a hang)
    settle_s_max: float = 20.0  # after the last client, time for the ledger to close everything

    def spec(self, ledger_url: str | None) -> StackSpec:
        emergency = TierConfig(on_ledger_unavailable="emergency", emergency=self.emergency)
        return StackSpec(
            (TenantSpec("free", tier="reject"), TenantSpec("paid", tier="emergency")),
            replicas=replicas(2, gateway_slots=self.gateway_batch),
            replica=self.replica,
            processes=True,
            gateways=2,
            ledger=ledger_url,
            tiers={"reject": TierConfig(), "emergency": emergency},
            defaults=UNBOUNDED.model_copy(update={"reservation_ttl_s": self.reservation_ttl_s}),
            sweep_s=self.sweep_s,
            admin=True,
        )


@dataclass(frozen=True)
class CellResult:
    """One cell: what ran, the fault as injected, how the attempts ended, and the checker's report."""

    backend: str
    fault: str
    injected: str
    outcomes: dict[str, int]
    report: HistoryReport | None  # None: not applicable
    wall_s: float
    # gateway -> (queued requests, active sequences) from its /metrics at the end (both 0 when it holds nothing)
    gauges: dict[str, tuple[float, float]] = field(default_factory=dict)
    longest: int = 0  # the most tokens one attempt had received when the fault came

    @property
    def held(self) -> dict[str, tuple[float, float]]:
        """The gateways whose gauges are not back to 0."""
        return {name: g for name, g in self.gauges.items() if any(g)}

    @property
    def ok(self) -> bool:
        return self.report is not None and self.report.ok and not self.held

    @property
    def row(self) -> tuple[str, str, str, str, str]:
        """(cell, requests, fault injected, client outcomes, discrepancies) for the table."""
        cell = f"{self.backend} x {self.fault}"
        if self.report is None:
            return cell, "-", "n/a", "-", f"not applicable: {self.injected}"
        r = self.report
        load = f"{r.requests} ids, {r.attempts} attempts"
        outcomes = ", ".join(f"{k} {n}" for k, n in sorted(self.outcomes.items()))
        held = "; gauges not 0: " + ", ".join(f"{k} queued {q:g}, running {a:g}" for k, (q, a) in self.held.items())
        return cell, load, self.injected, outcomes, r.summary() + (held if self.held else "")


def run_cell(backend: str, fault: str, config: MatrixConfig | None = None, seed: int = 1) -> CellResult:
    """Run one cell on a fresh stack (and a fresh ledger server) and check its history.

    Raises:
        ValueError: an unknown backend or fault. RuntimeError: a server did not start.
    """
    if backend not in BACKENDS or fault not in FAULTS:
        raise ValueError(f"unknown cell {backend} x {fault}")
    config = config or MatrixConfig()
    start = time.monotonic()
    if (backend, fault) in NOT_APPLICABLE:
        return CellResult(backend, fault, NOT_APPLICABLE[(backend, fault)], {}, None, 0.0)
    with temporary_folder(f"fairgate-matrix-{backend}-{fault}-") as folder, _ledger_server(backend, folder) as server:
        url = None if server is None else _ledger_url(backend, server, config)
        with start_stack(config.spec(url), folder=folder / "stack") as stack:
            cell = Cell(backend, fault, config, stack, server)
            injected, records, report, gauges = asyncio.run(cell.run(seed))
    outcomes = Counter(_outcome(r) for r in records)
    wall_s = time.monotonic() - start
    return CellResult(backend, fault, injected, dict(outcomes), report, wall_s, gauges, cell.longest)


@contextmanager
def _ledger_server(backend: str, folder: Path) -> Iterator[ServerProcess | None]:
    """A throwaway server of the backend's own (never a shared one: a cell stops it); None for SQLite."""
    with ExitStack() as stack:
        if backend == "postgresql":
            yield stack.enter_context(throwaway_postgres_server())
        elif backend == "redis":
            yield stack.enter_context(redis_server(folder / "redis", durable=True))
        else:
            yield None


def _ledger_url(backend: str, server: ServerProcess, config: MatrixConfig) -> str:
    """The server's URL with the gateways' ledger timeout (the stack adds a schema / prefix of its own)."""
    return f"{server.url}?timeout_s={config.ledger_timeout_s:g}"


class Cell:
    """One cell's run: the load, the fault beside it, then the checker."""

    def __init__(self, backend: str, fault: str, config: MatrixConfig, stack: Stack, server: ServerProcess | None):
        self.backend, self.fault, self.config, self.stack, self.server = backend, fault, config, stack, server
        self.lost: list[ReplicaCounts] = []  # the last counts of a replica killed by the fault
        self.longest = 0  # the most tokens one attempt had received when the fault came

    async def run(self, seed: int) -> tuple[str, list[RequestRecord], HistoryReport, dict[str, tuple[float, float]]]:
        c = self.config
        targets = {"A": self.stack.gateways[0].url, "B": self.stack.gateways[1].url}
        async with LoadGenerator(targets, self.stack.keys, MODEL, seed, timeout_s=c.client_timeout_s) as generator:
            clients = [asyncio.ensure_future(self._client(generator, request)) for request in self._requests(seed)]
            injected = await self._inject(generator)
            await asyncio.gather(*clients)
            report = await self._check(generator.history.records)
        gauges = {}
        for name, gateway in zip("AB", self.stack.gateways, strict=True):
            g = await gateway_gauges(gateway.url, self.stack.admin_key or "")
            gauges[name] = (g.queued, g.active_sequences)
        return injected, generator.history.records, report, gauges

    def _requests(self, seed: int) -> list[Request]:
        c, rng = self.config, random.Random(f"matrix-{seed}-{self.backend}-{self.fault}")
        spread = c.outage_spread_s if self.fault == "ledger_stop" else c.spread_s
        cuts = (Cut("chunks", chunks=rng.randint(2, 12)), Cut("headers"), Cut("time", seconds=0.8))
        out = []
        for i in range(c.ids):
            cut = cuts[i % 3] if self.fault == "client_cuts" and i % 3 else None
            tokens = rng.randint(*c.output_tokens)
            if self.fault == "kill9" and i % 3 == 0:
                tokens = rng.randint(*c.long_output_tokens)
            out.append(
                Request(
                    ("free", "paid")[i % 2],
                    f"{self.fault}-{i}",
                    tokens,
                    c.prompt_tokens,
                    "AB"[(i // 2) % 2],
                    stream=cut is not None or (i % 3 == 0 if self.fault == "upstream_kill" else i % 5 != 4),
                    cut=cut,
                    at_s=0.2 + spread * i / c.ids,
                )
            )
        return out

    async def _client(self, generator: LoadGenerator, request: Request) -> None:
        """Send ``request``; retry the same id on the other process while it fails in a retryable way. The
        ``retries`` fault also sends it to the other process meanwhile."""
        c = self.config
        await until(generator, request.at_s)
        if self.fault == "retries":
            rng = random.Random(request.request_id)
            delay = 0.0 if rng.random() < 0.3 else rng.uniform(0.0, 1.5)
            other = _other(request)
            duplicate = asyncio.ensure_future(_later(generator, other, delay))
        for attempt in range(c.attempts_max):
            record = await generator.send(request)
            if attempt + 1 == c.attempts_max or not _retryable(record):
                break
            await asyncio.sleep(_backoff(record, c.backoff_s_max))
            request = _other(request)
        if self.fault == "retries":
            await duplicate

    async def _inject(self, generator: LoadGenerator) -> str:
        """Inject the cell's fault at ``fault_at_s``; a line saying what was done."""
        c = self.config
        await until(generator, c.kill_at_s if self.fault == "kill9" else c.fault_at_s)
        running = len(generator.history.running())
        self.longest = max((r.tokens for r in generator.history.running()), default=0)
        if self.fault == "kill9":
            a = self.stack.gateways[0].process
            assert a is not None
            on_a = generator.history.running("A")
            streamed = max((r.tokens for r in on_a), default=0)
            await asyncio.to_thread(a.kill)
            await asyncio.sleep(c.restart_after_s)
            await asyncio.to_thread(lambda: a.start().wait_ready())
            return (
                f"kill -9 A at {c.kill_at_s:g} s ({len(on_a)} requests on it, one streamed {streamed} tokens), "
                f"restarted after {c.restart_after_s:g} s"
            )
        if self.fault == "ledger_stop":
            return await self._stop_ledger(running)
        if self.fault == "ledger_pause":
            assert self.server is not None
            self.server.send_tree(signal.SIGSTOP)
            await asyncio.sleep(c.ledger_pause_s)
            self.server.send_tree(signal.SIGCONT)
            return f"ledger SIGSTOP {c.ledger_pause_s:g} s ({running} requests running)"
        if self.fault == "upstream_kill":
            replica = self.stack.replicas[0]
            assert replica.process is not None
            stats = await read_replica(replica.url)
            await asyncio.to_thread(replica.process.kill)
            if stats is not None:
                self.lost.append(replica_counts("replica-0", stats, complete=False))
            return f"kill -9 replica 0 (running {stats.running if stats else '?'})"
        if self.fault == "retries":
            return "each id also sent to the other process (30 % at once, else within 1.5 s)"
        return f"{self.config.ids * 2 // 3} of {self.config.ids} ids cut by their clients"

    async def _stop_ledger(self, running: int) -> str:
        c = self.config
        if self.server is None:  # SQLite: another connection holds the file's exclusive lock
            await asyncio.to_thread(_hold_exclusive, self.stack.folder / "ledger.db", c.ledger_down_s)
            return f"ledger file locked (BEGIN EXCLUSIVE) {c.ledger_down_s:g} s ({running} requests running)"
        server = self.server
        await asyncio.to_thread(server.stop)
        await asyncio.sleep(c.ledger_down_s)
        await asyncio.to_thread(lambda: server.start().wait_ready())
        return f"ledger server stopped {c.ledger_down_s:g} s ({running} requests running)"

    async def _check(self, records: list[RequestRecord]) -> HistoryReport:
        """Once the ledger has closed everything it will (bounded), and the journals are replayed: the checker."""
        c = self.config
        journals = [g.config.journal_path for g in self.stack.gateways]

        async def replayed() -> bool:
            return not any(_journal_records(j) for j in journals)

        async with self.stack.ledger() as ledger:
            await wait_settled(ledger, c.settle_s_max)
            await poll(replayed, time.monotonic() + c.settle_s_max, time.monotonic, 0.2)
            await asyncio.sleep(2 * c.sweep_s)  # the replicas stop the last sequences closed
            state = await read_ledger_state(ledger, self.stack.spec.tenant_names, [MODEL])
        alive = [r.url for i, r in enumerate(self.stack.replicas) if not (self.lost and i == 0)]
        counts = await read_replica_counts(alive)
        return check_history(records, state, [*self.lost, *counts])


async def _later(generator: LoadGenerator, request: Request, delay_s: float) -> RequestRecord:
    await asyncio.sleep(delay_s)
    return await generator.send(request)


def _other(request: Request) -> Request:
    """The same request (same id and body) to the other process."""
    from dataclasses import replace

    return replace(request, target="B" if request.target == "A" else "A")


def _retryable(record: RequestRecord) -> bool:
    """What a client retries: a broken connection, a 5xx, 409 ``request_in_progress``, an error event."""
    if record.outcome in ("connection", "stream"):
        return True
    return record.outcome == "error" and (
        (record.status or 0) >= 500 or (record.status == 409 and record.code == "request_in_progress")
    )


def _backoff(record: RequestRecord, most_s: float) -> float:
    try:
        return min(most_s, max(0.2, float(record.retry_after or 0.5)))
    except ValueError:
        return 0.5


def _outcome(record: RequestRecord) -> str:
    return record.error or record.outcome


def _journal_records(path: Path) -> int:
    """Records in a gateway's emergency journal (0 when it does not exist)."""
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def _hold_exclusive(path: Path, seconds: float) -> None:
    """Hold ``path``'s SQLite exclusive lock for ``seconds`` (waiting up to 30 s to take it)."""
    connection = sqlite3.connect(path, timeout=30.0, isolation_level=None)
    try:
        connection.execute("BEGIN EXCLUSIVE")
        time.sleep(seconds)
        connection.execute("ROLLBACK")
    finally:
        connection.close()


def table(results: list[CellResult]) -> str:
    """The matrix as a Markdown table."""
    lines = ["| cell | requests | fault injected | client outcomes | discrepancies |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r.row) + " |" for r in results]
    return "\n".join(lines)


__all__ = ["BACKENDS", "FAULTS", "NOT_APPLICABLE", "CellResult", "MatrixConfig", "run_cell", "table"]

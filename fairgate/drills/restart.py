"""Drill ``restart`` (seed 003, "simulate ... queue worker restart ... confirm that invalid reservations
eventually converge"): one of two gateway processes sharing a ledger and the same replicas is killed with
SIGKILL while it has requests queued and in flight, and started again. The claim:

- the killed process's clients see their connections fail (nothing hangs): its queue lives in its memory,
  so a queued request is failed with it; a client that retries with the same ``X-Request-Id`` while the
  original reservation is still open is re-admitted under that reservation (nothing deducted twice);
- its open reservations converge: the liveness sweep of the surviving (or restarted) process expires each
  once nobody has heartbeat it for ``reservation_ttl_s`` (billing what was settled so far). The time from
  the kill until the last of them is final is held to ``reservation_ttl_s + sweep_s`` (+ slack): a sweep
  that finds a reservation due with a heartbeat less than a TTL old extends it to a TTL after that
  heartbeat (``expire_due`` with the default registry), so the first sweep a TTL after the last heartbeat
  ends it;
- nothing is released while it still runs: the other process's requests, longer than the TTL, all end
  ``settled``, billed exactly what their clients received, as does every request that completed anywhere;
- at the end no reservation is open, the ledger's concurrency and queue counts, both gateways' gauges and
  the replicas' batches are back to 0, and the restarted process serves again.

The stack: a throwaway ``redis-server`` as the shared ledger, two emulated replicas and two ``fairgate
serve`` processes (``A``, killed, and ``B``), all as processes, with one configuration (each gateway its own
journal and request log). Each gateway uses half of every replica's slots. Tenant ``alpha`` keeps more
clients on A than A has slots (so some queue there), ``long`` sends requests longer than the TTL to B,
and ``beta`` short ones to B. A's clients back off after an error and go on, so once A is back they are
served again. After the kill, a few of A's requests that were queued (the ledger says so) are retried on B
with their own request id.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fairgate.drills import DrillOptions
from fairgate.drills.report import ConfiguredResult, fmt_counts, fmt_s, grouped, table
from fairgate.harness.config import UNBOUNDED, TenantSpec
from fairgate.harness.gauges import gateway_gauges
from fairgate.harness.history import HistoryReport, check_history, read_ledger_state, read_replica_counts
from fairgate.harness.ledger import wait_settled
from fairgate.harness.loadgen import LoadGenerator, Request, TenantLoad
from fairgate.harness.logs import log_lines, summarise_log
from fairgate.harness.records import RequestRecord
from fairgate.harness.redis import redis_server, redis_url
from fairgate.harness.replica import ReplicaModel
from fairgate.harness.run import until
from fairgate.harness.stack import Stack, StackSpec, replicas, start_stack, temporary_folder

HUNG_S = 2.0  # a client of the killed process must see its request fail within this long
MODEL = "emu"


@dataclass(frozen=True)
class RestartConfig:
    """The drill's setting."""

    kill_at_s: float = 5.0  # when A is killed
    restart_after_s: float = 0.5  # when it is started again, after the kill
    load_after_s: float = 8.0  # how long the clients go on sending after the kill
    # the ledger's TTL and the gateways' liveness sweep (small, so that expiry happens within the
    # drill and B's long requests outlive several TTLs)
    reservation_ttl_s: float = 2.0
    sweep_s: float = 0.5
    # the emulated replicas (each gateway is configured with ``gateway_batch`` of their slots)
    replica: ReplicaModel = field(default_factory=lambda: ReplicaModel(80.0, 0.5, 0.02, 12, 4096))
    replicas: int = 2
    gateway_batch: int = 6
    alpha_clients: int = 18  # tenant ``alpha``'s clients on A (more than A's slots) and outputs
    alpha_output: tuple[int, int] = (10, 40)
    long_clients: int = 4  # tenant ``long``'s clients on B, outputs longer than the TTL
    long_output: tuple[int, int] = (50, 60)
    beta_clients: int = 6  # tenant ``beta``'s clients on B
    beta_output: tuple[int, int] = (8, 24)
    prompt_tokens: int = 32
    retry_queued: int = 2  # how many of A's queued requests are retried on B with the same request id
    backoff_s: float = 0.5
    drain_s_max: float = 15.0  # time allowed for the requests running when the clients stop sending
    settle_s_max: float = 10.0  # time allowed, after that, for the last reservations to close
    # allowance over ``reservation_ttl_s + sweep_s`` for the kill-to-expiry bound (scheduling and
    # ledger round trips on a loaded machine)
    converge_slack_s: float = 1.0

    def __post_init__(self) -> None:
        if 2 * self.gateway_batch > self.replica.max_batch:
            raise ValueError("restart drill: two gateways need 2 x gateway_batch <= the replica's max_batch")
        if self.long_output[0] * self.replica.iteration_ms(self.gateway_batch * 2) / 1000.0 <= self.reservation_ttl_s:
            raise ValueError("restart drill: the long requests must outlive the reservation TTL")

    @property
    def tenants(self) -> tuple[TenantSpec, ...]:
        return (TenantSpec("alpha"), TenantSpec("long"), TenantSpec("beta"))

    def spec(self, policy: str, ledger_url: str) -> StackSpec:
        return StackSpec(
            self.tenants,
            policy,
            replicas(self.replicas, gateway_slots=self.gateway_batch),
            self.replica,
            processes=True,
            gateways=2,
            ledger=ledger_url,
            defaults=UNBOUNDED.model_copy(update={"reservation_ttl_s": self.reservation_ttl_s}),
            sweep_s=self.sweep_s,
            admin=True,
        )

    def loads(self) -> list[TenantLoad]:
        def load(tenant: str, target: str, clients: int, output: tuple[int, int]) -> TenantLoad:
            return TenantLoad(
                tenant,
                target,
                clients=clients,
                output_tokens=output,
                prompt_tokens=self.prompt_tokens,
                ramp_s=0.05 * clients,  # spread the first requests a little
                error_backoff_s=self.backoff_s,
                backoff_jitter=0.2,
            )

        return [
            load("alpha", "A", self.alpha_clients, self.alpha_output),
            load("long", "B", self.long_clients, self.long_output),
            load("beta", "B", self.beta_clients, self.beta_output),
        ]

    @property
    def ttl_sweep_s(self) -> float:
        """What the ledger guarantees for a reservation nobody heartbeats any more: final by the first sweep
        a TTL after its last heartbeat (see the module docstring)."""
        return self.reservation_ttl_s + self.sweep_s

    @property
    def converge_bound_s(self) -> float:
        return self.ttl_sweep_s + self.converge_slack_s


@dataclass(frozen=True)
class Killed:
    """A reservation of A's that was open when A died."""

    request_id: str
    queued: bool  # waiting in A's queue (the ledger's queue place)
    tokens_received: int  # by its client before the connection broke
    status: str  # at the end
    billed_output: int
    final_after_s: float | None  # ledger time from the kill until it became final (None: still open)
    client_outcome: str
    retried: bool = False  # its client retried it on B with the same request id


@dataclass(frozen=True)
class RestartFigures:
    kill_at_s: float
    restart_ready_s: float  # A answered /health again, seconds after the kill
    killed: tuple[Killed, ...]
    at_kill: dict[str, int]  # A's requests at the kill: "in flight" / "queued" (client view)
    killed_clients: dict[str, int]  # how A's requests active at the kill ended (outcome -> count; "ok": it
    #                                 had ended just before the kill)
    hung: int  # of those, how many took longer than HUNG_S after the kill to fail
    retries: dict[str, str]  # request id -> what the retry on B got ("ok", "409:...", ...)
    sent: dict[str, Counter[str]]  # target -> outcome -> count
    long_outlived_ttl: int  # B's long requests that ran longer than the TTL
    long_settled: int  # of them, settled billing exactly what the client received
    mismatches: tuple[str, ...]  # completed requests billed differently (or not settled)
    expired_not_killed: tuple[str, ...]  # expired reservations that were not A's at the kill
    a_after_restart_ok: int  # requests A served after its restart
    open_left: int
    statuses: dict[str, int]
    accounts: dict[str, tuple[int, int]]  # tenant -> (concurrent, queued) in the ledger at the end
    gauges: dict[str, tuple[float, float]]  # gateway -> (active sequences, queued requests) at the end
    replicas: dict[str, tuple[int, int]]  # replica -> (running, waiting) at the end
    unbilled_killed_tokens: int  # streamed to A's killed clients beyond what was settled before the kill
    gateway_log: tuple[str, ...]
    history: HistoryReport  # the history checker: every id's attempts against the ledger and the replicas

    @property
    def converge_s(self) -> float | None:
        """From the kill until the last of A's reservations not retried elsewhere was final."""
        times = [k.final_after_s for k in self.killed if not k.retried]
        if not times or any(t is None for t in times):
            return None
        return max(t for t in times if t is not None)


@dataclass(frozen=True)
class RestartResult(ConfiguredResult[RestartConfig, RestartFigures]):
    name: str = "restart"

    def checks(self) -> dict[str, bool]:
        c, f = self.config, self.main
        queued = sum(1 for k in f.killed if k.queued)
        in_flight, queued_clients = f.at_kill.get("in flight", 0), f.at_kill.get("queued", 0)
        return {
            f"A had requests queued and in flight at the kill ({in_flight} in flight, {queued_clients} queued; "
            f"ledger: {queued} queued)": in_flight > 0 and queued_clients > 0 and queued > 0,
            "A's clients got connection errors (failed, nothing hung)": f.killed_clients.get("connection", 0) > 0
            and set(f.killed_clients) <= {"connection", "ok"}
            and f.hung == 0,
            "A's open reservations all ended expired (or settled, when retried on B)": bool(f.killed)
            and all(k.status == "expired" or (k.retried and k.status == "settled") for k in f.killed),
            f"... within TTL + sweep ({c.reservation_ttl_s:g} + {c.sweep_s:g} s, + {c.converge_slack_s:g} s "
            "slack) of the kill": f.converge_s is not None and f.converge_s <= c.converge_bound_s,
            "a killed request is never billed more than its client received": all(
                k.billed_output <= k.tokens_received or k.status == "settled" for k in f.killed
            ),
            "queued requests retried on B with their id: re-admitted once, or refused 409": all(
                v == "ok" or v.startswith("409") for v in f.retries.values()
            ),
            f"B's long requests outlived the TTL ({f.long_outlived_ttl}) and all ended settled, billed exactly": (
                f.long_outlived_ttl > 0 and f.long_settled == f.long_outlived_ttl
            ),
            "nothing released while running: every completed request settled, billed exactly": not f.mismatches
            and not f.expired_not_killed,
            "B served without an error": set(f.sent.get("B", {})) <= {"ok"},
            "no open reservation at the end": f.open_left == 0,
            "ledger concurrency and queue counts back to 0": all(v == (0, 0) for v in f.accounts.values()),
            "gateways' active and queued gauges back to 0, replicas idle": all(
                v == (0.0, 0.0) for v in f.gauges.values()
            )
            and all(v == (0, 0) for v in f.replicas.values()),
            "the restarted process serves again": f.a_after_restart_ok > 0,
            f"history checker: {f.history.summary()}": f.history.ok,
        }

    INTRO = """
        [bold]drill restart[/bold]: two gateway processes (A, B) on one Redis ledger and {c.replicas} emulated
        replicas ({c.gateway_batch} slots each per gateway); reservation TTL {c.reservation_ttl_s:g} s, sweep
        {c.sweep_s:g} s. Load: alpha {c.alpha_clients} clients on A (outputs
        {c.alpha_output[0]}-{c.alpha_output[1]}), long {c.long_clients} on B
        ({c.long_output[0]}-{c.long_output[1]} tokens, longer than the TTL), beta {c.beta_clients} on B.

        Fault: SIGKILL to A at {main.kill_at_s:.1f} s with {at_kill[in flight]} requests in flight and
        {at_kill[queued]} queued; A started again {c.restart_after_s:g} s later, answering
        {main.restart_ready_s:.1f} s after the kill.

        Load held: B served {b[ok]} requests ({main.long_outlived_ttl} of them longer than the TTL) with
        {b_errors} errors; A served {a[ok]} ({main.a_after_restart_ok} after its restart).
    """

    def intro_fields(self) -> dict[str, Any]:
        sent = self.main.sent
        b = sent.get("B", Counter())
        return super().intro_fields() | {
            "a": sent.get("A", Counter()),
            "b": b,
            "b_errors": b.total() - b["ok"],
            "at_kill": Counter(self.main.at_kill),
        }

    def body(self) -> list[Any]:
        f = self.main
        rows = [(target, fmt_counts(outcomes)) for target, outcomes in sorted(f.sent.items())]
        out: list[Any] = [table("requests by gateway", ("gateway", "outcomes"), rows, left=("gateway", "outcomes"))]
        columns = ("", "count", "client saw", "ended", "kill -> final s (min-max)", "tokens streamed / billed")
        killed = [
            self._killed_row(name, queued, retried)
            for name, queued, retried in (
                ("in flight", False, False),
                ("queued", True, False),
                ("queued, retried on B", True, True),
            )
        ]
        out.append(
            table(
                "A's reservations open at the kill", columns, [r for r in killed if r], left=("", "client saw", "ended")
            )
        )
        if f.retries:
            out.append(
                "Retried on B with the same request id: "
                + ", ".join(f"{rid} -> {what}" for rid, what in sorted(f.retries.items()))
            )
        out.append(
            f"B's long requests longer than the TTL: {f.long_outlived_ttl}, settled exactly: {f.long_settled}. "
            f"A served {f.a_after_restart_ok} requests after its restart."
        )
        out.append(
            f"At the end: reservations {dict(sorted(f.statuses.items()))}, open {f.open_left}; ledger (concurrent, "
            f"queued) {f.accounts}; gateway gauges (active, queued) {f.gauges}; replicas (running, waiting) "
            f"{f.replicas}."
        )
        return out + self._lost()

    def _killed_row(self, name: str, queued: bool, retried: bool) -> tuple[str, ...] | None:
        rows = [k for k in self.main.killed if k.queued == queued and k.retried == retried]
        if retried and not rows:
            return None
        times = [k.final_after_s for k in rows if k.final_after_s is not None]
        return (
            name,
            str(len(rows)),
            fmt_counts(Counter(k.client_outcome for k in rows)),
            fmt_counts(Counter(k.status for k in rows)),
            f"{min(times):.2f}-{max(times):.2f}" if times else "-",
            f"{sum(k.tokens_received for k in rows)} / {sum(k.billed_output for k in rows)}",
        )

    def _lost(self) -> list[str]:
        c, f = self.config, self.main
        lost = [f"{len(f.mismatches)} completed requests billed differently"] if f.mismatches else []
        lost += [f"{f.open_left} reservations left open"] if f.open_left else []
        if f.expired_not_killed:
            lost.append(f"{len(f.expired_not_killed)} reservations expired that A's death does not explain")
        out = [
            f"Lost: {'; '.join(lost) if lost else 'nothing'} ({f.unbilled_killed_tokens} tokens streamed to A's "
            f"killed clients after their last partial settlement are not billed, by design). Time to converge: "
            f"{fmt_s(f.converge_s)} from the kill until A's last reservation was final (TTL + sweep = "
            f"{c.ttl_sweep_s:g} s)."
        ]
        late = [
            k for k in f.killed if not k.retried and k.final_after_s is not None and k.final_after_s > c.ttl_sweep_s
        ]
        if late:
            out.append(
                f"  [yellow]note[/yellow] {len(late)} of A's {sum(not k.retried for k in f.killed)} reservations were "
                f"final later than TTL + sweep ({c.ttl_sweep_s:g} s) after the kill (latest "
                f"{max(k.final_after_s or 0.0 for k in late):.2f} s): sweeps and ledger round trips late on a loaded "
                "machine (the slack)."
            )
        out += [f"  [red]problem[/red] {line}" for line in (*f.mismatches[:8], *f.expired_not_killed[:8])]
        out += [f"  [red]history[/red] {d.kind.value} {d.subject}: {d.detail}" for d in f.history.discrepancies[:8]]
        return out + [f"  gateway: {line}" for line in f.gateway_log[:8]]

    def verdict(self) -> str:
        return "gateway A killed under load and restarted."


@dataclass(frozen=True)
class Kill:
    """What the drill saw of the kill; times in seconds since the load began."""

    active: list[RequestRecord]  # A's requests active at the kill
    snapshot: list[Any]  # A's open reservations
    final_ms: dict[str, float]  # reservation id -> when it became final (ledger ms)
    wall_ms: float  # the kill on the wall clock
    at_s: float
    restart_ready_s: float
    retries: dict[str, RequestRecord]


@dataclass(frozen=True)
class End:
    """The stack at the end: every request, every reservation, accounts, gauges and replicas."""

    records: list[RequestRecord]
    reservations: list[Any]
    accounts: dict[str, tuple[int, int]]
    gauges: dict[str, tuple[float, float]]
    replicas: dict[str, tuple[int, int]]
    history: HistoryReport


def run(options: DrillOptions, config: RestartConfig | None = None) -> RestartResult:
    """Run the drill (``options.seconds``: how long the load goes on after the kill; ``options.policy``: the
    gateways' policy). The gateways and replicas are always processes (one of them is killed)."""
    config = options.setting(config or RestartConfig(), "load_after_s")
    with temporary_folder("fairgate-drill-restart-") as folder, redis_server(folder / "redis", durable=False) as redis:
        with start_stack(config.spec(options.policy, redis_url(redis, "drill")), folder=folder / "stack") as stack:
            kill, end = asyncio.run(_run(stack, config, options.seed))
        logs = [g.config.path.parent / "gateway.log" for g in stack.gateways]
        lines = summarise_log(log_lines([], *logs), keep_whole=("expired",))
    return RestartResult(config, restart_figures(config, kill, end, lines))


async def _run(stack: Stack, c: RestartConfig, seed: int) -> tuple[Kill, End]:
    a = stack.gateways[0].process
    assert a is not None
    targets = {"A": stack.gateways[0].url, "B": stack.gateways[1].url}
    send_until = c.kill_at_s + c.load_after_s
    async with LoadGenerator(targets, stack.keys, MODEL, seed) as generator:
        now = generator.now
        load = asyncio.ensure_future(generator.run(c.loads(), send_until, c.drain_s_max))
        reader = await stack.open_ledger()
        try:
            await until(generator, c.kill_at_s)
            active = generator.history.running("A")
            kill_wall_ms = time.time() * 1000.0
            await asyncio.to_thread(a.kill)
            kill_at = now()
            snapshot = [r for r in await reader.reservations(status="open") if r.request_id.startswith("A-")]

            async def restart() -> float:
                await asyncio.sleep(c.restart_after_s)
                await asyncio.to_thread(lambda: a.start().wait_ready())
                return now() - kill_at

            restarting = asyncio.ensure_future(restart())
            retrying = await _retry_queued(generator, c, active, snapshot, kill_at)
            final_ms = await _finals(reader, snapshot, now() + c.load_after_s + c.drain_s_max, now)
            restart_ready = await restarting
            retries = {rid: await task for rid, task in retrying.items()}
            await load
            await wait_settled(reader, c.settle_s_max)
            await asyncio.sleep(2 * c.sweep_s)  # the gauges follow the last requests
            end = await _end(stack, reader, c, generator.history.records)
        finally:
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
            await reader.close()
    return Kill(active, snapshot, final_ms, kill_wall_ms, kill_at, restart_ready, retries), end


async def _retry_queued(
    generator: LoadGenerator, c: RestartConfig, active: list[RequestRecord], snapshot: list[Any], kill_at: float
) -> dict[str, asyncio.Future[RequestRecord]]:
    """Retry a few of A's queued requests on B with their own request id (same body), once their client saw
    the connection fail."""
    by_id = {r.request_id: r for r in active}
    queued = [r.request_id for r in snapshot if r.queued and r.billed.output_tokens == 0 and r.request_id in by_id]
    queued = queued[: c.retry_queued]
    for rid in queued:
        while generator.now() < kill_at + 5.0:
            if by_id[rid].outcome != "running":
                break
            await asyncio.sleep(0.02)
    return {
        rid: asyncio.ensure_future(generator.send(Request("alpha", rid, by_id[rid].max_tokens, c.prompt_tokens, "B")))
        for rid in queued
    }


async def _finals(reader: Any, snapshot: list[Any], deadline_s: float, now: Any) -> dict[str, float]:
    """Reservation id -> the ledger time (ms) each of ``snapshot`` became final, polled until all are or the
    deadline (seconds since the load began)."""
    final_ms: dict[str, float] = {}
    while len(final_ms) < len(snapshot) and now() < deadline_s:
        for r in snapshot:
            if r.id not in final_ms:
                latest = await reader.get(r.id)
                if latest.is_final and latest.final_ms is not None:
                    final_ms[r.id] = latest.final_ms
        await asyncio.sleep(0.1)
    return final_ms


async def _end(stack: Stack, reader: Any, c: RestartConfig, records: list[RequestRecord]) -> End:
    accounts = {}
    for t in c.tenants:
        account = await reader.account(t.name, MODEL)
        accounts[t.name] = (account.concurrent, account.queued)
    gauges = {}
    for name, gateway in zip(("A", "B"), stack.gateways, strict=True):
        g = await gateway_gauges(gateway.url, stack.admin_key or "")
        gauges[name] = (g.active_sequences, g.queued)
    replicas_now = {f"emu-{i}": (s.running, s.waiting) for i, s in enumerate(await stack.replica_stats())}
    state = await read_ledger_state(reader, [t.name for t in c.tenants], [MODEL])
    history = check_history(records, state, await read_replica_counts(stack.replica_urls))
    return End(records, list(state.reservations), accounts, gauges, replicas_now, history)


def restart_figures(c: RestartConfig, kill: Kill, end: End, lines: list[str]) -> RestartFigures:
    by_request = grouped(end.reservations, lambda r: r.request_id)
    originals = {r.request_id: r for r in kill.active}
    retried = {r.request_id for r in kill.retries.values()}
    killed, unbilled = [], 0
    for r in kill.snapshot:
        final = next(iter(by_request.get(r.request_id, [])), None)
        call = originals.get(r.request_id)
        tokens = call.tokens if call is not None else 0
        billed = final.billed.output_tokens if final is not None else 0
        unbilled += max(0, tokens - billed) if r.request_id not in retried else 0
        after = (kill.final_ms[r.id] - kill.wall_ms) / 1000.0 if r.id in kill.final_ms else None
        outcome = call.outcome if call is not None else "unknown"
        status = final.status if final is not None else "missing"
        killed.append(
            Killed(r.request_id, bool(r.queued), tokens, status, billed, after, outcome, r.request_id in retried)
        )
    sent: dict[str, Counter[str]] = {}
    for call in end.records:
        if not (call.request_id in retried and call.target == "B"):
            sent.setdefault(call.target, Counter())[_key(call)] += 1
    long_calls = [
        call
        for call in end.records
        if call.tenant == "long" and call.outcome == "ok" and (call.ended_s or 0.0) - call.sent_s > c.reservation_ttl_s
    ]
    long_settled = sum(
        1
        for call in long_calls
        if [(r.status, r.billed.output_tokens) for r in by_request.get(call.request_id, [])]
        == [("settled", call.tokens)]
    )
    ready_at = kill.at_s + kill.restart_ready_s - 1.0
    statuses = Counter(r.status for r in end.reservations)
    killed_ids = {r.request_id for r in kill.snapshot}
    return RestartFigures(
        kill.at_s,
        kill.restart_ready_s,
        tuple(killed),
        dict(Counter("in flight" if call.first_s is not None else "queued" for call in kill.active)),
        dict(Counter(call.outcome for call in kill.active)),
        sum(1 for call in kill.active if call.ended_s is None or call.ended_s - kill.at_s > HUNG_S),
        {rid: _key(call) for rid, call in kill.retries.items()},
        sent,
        len(long_calls),
        long_settled,
        tuple(_mismatches(end.records, by_request)),
        tuple(
            f"{r.request_id}: expired, billed {r.billed.output_tokens} tokens"
            for r in end.reservations
            if r.status == "expired" and r.request_id not in killed_ids
        ),
        sum(1 for call in end.records if call.target == "A" and call.outcome == "ok" and call.sent_s >= ready_at),
        statuses.get("open", 0),
        dict(statuses),
        end.accounts,
        end.gauges,
        end.replicas,
        unbilled,
        tuple(lines),
        end.history,
    )


def _key(record: RequestRecord) -> str:
    return f"{record.status}:{record.code}" if record.outcome == "error" else record.outcome


def _mismatches(records: list[RequestRecord], by_request: dict[str, list[Any]]) -> list[str]:
    """Every request that completed (anywhere) but is not settled billing exactly what its client received."""
    out = []
    for call in records:
        if call.outcome != "ok":
            continue
        found = by_request.get(call.request_id, [])
        if len(found) != 1:
            out.append(f"{call.request_id}: {len(found)} reservations")
            continue
        r = found[0]
        wrong_input = call.usage_input is not None and r.billed.input_tokens != call.usage_input
        if r.status != "settled" or r.billed.output_tokens != call.tokens or wrong_input:
            out.append(
                f"{call.request_id} ({call.target}): client received {call.tokens} tokens, ledger "
                f"{r.status} billing {r.billed.output_tokens} (input {r.billed.input_tokens})"
            )
    return out

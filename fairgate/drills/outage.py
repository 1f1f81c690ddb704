"""Drill ``outage`` (seed 003, "simulate ... accounting service interruption"): the ledger server is stopped
for ``outage_s`` seconds (30 by default) in the middle of a load and started again. The claim:

- a ``reject`` tier's requests sent while it is down get 503 ``ledger_unavailable`` with ``Retry-After``,
  and nothing else odd happens (no other status, no hung or broken stream, requests in flight finish);
- an ``emergency`` tier is admitted no more than its local budget (requests and tokens) and refused with
  the same 503 beyond it;
- once the ledger is back, the gateway replays its journal (``fairgate.gateway.background.recover`` runs
  ``ResilientLedger.recover`` every second while the journal holds records; nobody has to call it): every
  emergency grant becomes a *settled* reservation under its request id, every settlement kept while the
  ledger was down is applied, the journal is empty, and the ledger's totals equal what the clients
  received, exactly: per request (billed output == tokens streamed, billed input == the usage the client
  was sent) and per tenant (requests, input and output tokens); the GPU time billed per request equals the
  gateway's own meter (its request log).

The stack: a throwaway ``redis-server`` (append-only file, fsync always, so a stop loses nothing it
acknowledged) as the gateway's ledger, one emulated replica and the gateway (threads of this process, or
``fairgate`` processes with ``--processes``), two tenants: ``free`` (tier ``reject``) and ``paid`` (tier
``emergency`` with a small budget). Both send streamed chat completions through the real ``openai`` client
in closed loops, each request with its own ``X-Request-Id`` so the ledger's reservations can be matched
to what each client saw. Clients back off ``backoff_s`` after an error (the gateway's Retry-After is
5-7 s; a client honouring it would send fewer requests into the outage and test less). The ledger is
stopped with SIGTERM after ``warmup_s``; the load goes on ``after_s`` past its restart; then the clients
stop sending and let what runs finish. Time to converge: from the ledger answering again until every
request admitted before then has ended and is reconciled in the ledger and the journal is empty.

"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fairgate.drills import DrillOptions
from fairgate.drills.report import ConfiguredResult, fmt_counts, fmt_s, grouped, history_check, history_lines, table
from fairgate.harness.config import UNBOUNDED, TenantSpec
from fairgate.harness.history import HistoryReport, check_stack
from fairgate.harness.loadgen import LoadGenerator, TenantLoad
from fairgate.harness.logs import LogCapture, log_lines, summarise_log
from fairgate.harness.records import RequestRecord
from fairgate.harness.redis import redis_server, redis_url
from fairgate.harness.replica import ReplicaModel
from fairgate.harness.run import poll
from fairgate.harness.stack import Stack, StackSpec, replicas, start_stack, temporary_folder
from fairgate.ledger import Usage
from fairgate.ledger.base import tenant_tag
from fairgate.ledger.config import EmergencyConfig, TierConfig

EMERGENCY_PREFIX = "emg-"  # fairgate.ledger.emergency.EMERGENCY_PREFIX (ids of emergency grants)
EDGE_S = 1.0  # a request sent this close before the restart may reach the ledger once it is back


@dataclass(frozen=True)
class OutageConfig:
    """The drill's setting."""

    outage_s: float = 30.0  # how long the ledger server is down (the test uses less to fit its time bound)
    warmup_s: float = 4.0  # load before the stop
    after_s: float = 4.0  # load after the restart
    free: str = "free"  # the ``reject`` tier's tenant
    paid: str = "paid"  # the ``emergency`` tier's tenant
    clients: int = 4  # closed-loop clients per tenant
    output_tokens: tuple[int, int] = (8, 24)  # (min, max) per request
    prompt_tokens: int = 32
    # the paid tier's local budget
    emergency: EmergencyConfig = field(default_factory=lambda: EmergencyConfig(requests=6, tokens=400, seconds=120.0))
    reservation_ttl_s: float = 60.0  # the ledger's TTL
    sweep_s: float = 1.0  # the gateway's liveness sweep
    replica: ReplicaModel = field(default_factory=lambda: ReplicaModel(50.0, 0.5, 0.02, 12, 4096))
    backoff_s: float = 0.5  # a client's wait after an error
    converge_s_max: float = 10.0  # time allowed, after the ledger answers again, for everything to reconcile
    drain_s_max: float = 15.0  # time allowed for the requests running when the clients stop sending

    def __post_init__(self) -> None:
        if self.outage_s < 2.0:
            raise ValueError(f"outage drill: an outage of {self.outage_s:g} s is too short (at least 2 s)")

    @property
    def tenants(self) -> tuple[TenantSpec, ...]:
        return (TenantSpec(self.free, tier="reject"), TenantSpec(self.paid, tier="emergency"))

    def spec(self, policy: str, processes: bool, ledger_url: str) -> StackSpec:
        emergency = TierConfig(on_ledger_unavailable="emergency", emergency=self.emergency)
        return StackSpec(
            self.tenants,
            policy,
            replicas(1),
            self.replica,
            processes,
            ledger=ledger_url,
            tiers={"reject": TierConfig(), "emergency": emergency},
            defaults=UNBOUNDED.model_copy(update={"reservation_ttl_s": self.reservation_ttl_s}),
            sweep_s=self.sweep_s,
            admin=True,
        )

    def loads(self) -> list[TenantLoad]:
        return [
            TenantLoad(
                t.name,
                clients=self.clients,
                output_tokens=self.output_tokens,
                prompt_tokens=self.prompt_tokens,
                ramp_s=0.05 * self.clients,  # spread the first requests a little
                error_backoff_s=self.backoff_s,
                backoff_jitter=0.2,
            )
            for t in self.tenants
        ]


@dataclass(frozen=True)
class Phase:
    """One tenant's requests sent in one phase: how each ended."""

    sent: int
    ok: int
    refused_503: int  # 503 ledger_unavailable with a Retry-After header
    odd: dict[str, int]  # anything else: "<status>:<code>", "503 without Retry-After", "connection", ...
    tokens: int


@dataclass(frozen=True)
class TenantOutage:
    tenant: str
    tier: str
    phases: dict[str, Phase]  # before / during / after (edges: sent while the server stopped or started)
    grants: int  # emergency grants (reservations made from the local budget)
    grant_tokens: int  # their prompt + max output tokens
    grants_settled: int  # of them, settled reservations in the ledger after recovery (under their request id)
    client_requests: int  # requests that ran (ok)
    client_input: int  # prompt tokens in the usage the clients were sent
    client_output: int  # content tokens the clients received
    ledger_requests: int
    ledger_input: int
    ledger_output: int
    ledger_gpu_ms: float
    metered_gpu_ms: float  # the gateway's request log (finished records)
    gpu_mismatches: int  # requests whose billed GPU ms differs from the request log's by more than 1 us
    # reservations of requests their clients saw refused, closed billing nothing: made by a ledger call that
    # timed out (the client got 503) and completed once the ledger answered, then cancelled by request id
    phantoms: int = 0


@dataclass(frozen=True)
class Timeline:
    """The outage, in seconds since the load began."""

    stop_at_s: float  # SIGTERM sent
    down_at_s: float  # the server process was gone
    restart_at_s: float
    up_at_s: float  # answering again

    @property
    def down_s(self) -> float:
        return self.up_at_s - self.down_at_s


@dataclass(frozen=True)
class OutageFigures:
    """What was measured. Times in seconds since the drill's start."""

    timeline: Timeline
    tenants: dict[str, TenantOutage]
    journal_at_restart: dict[str, int]  # record type -> count, just before the restart
    journal_left: int  # records left at the end
    converge_s: float | None  # from timeline.up_at_s until everything reconciled (None: not within converge_s_max)
    mismatches: tuple[str, ...]  # per-request differences between client and ledger (each a sentence)
    open_left: int  # open reservations at the end
    statuses: dict[str, int]  # reservations by status at the end
    orphans: int  # reservations with no request of the clients behind them
    still_running: int  # requests still running after drain_s_max (cut)
    gateway_log: tuple[str, ...]  # the gateway's warnings about the journal and the sweep
    history: HistoryReport  # the history checker: every request id against the ledger and the replica


@dataclass(frozen=True)
class OutageResult(ConfiguredResult[OutageConfig, OutageFigures]):
    processes: bool
    name: str = "outage"

    def checks(self) -> dict[str, bool]:
        c, f = self.config, self.main
        free, paid = f.tenants[c.free], f.tenants[c.paid]
        budget = c.emergency
        during_free, during_paid = free.phases["during"], paid.phases["during"]
        return {
            "load held before and after the outage (both tenants served)": all(
                t.phases[p].ok > 0 for t in f.tenants.values() for p in ("before", "after")
            ),
            f"reject tier: every request sent during the outage got 503 + Retry-After ({during_free.sent} sent)": (
                during_free.sent > 0 and during_free.refused_503 == during_free.sent
            ),
            f"emergency tier admitted within its budget ({budget.requests} requests, {budget.tokens} tokens)": (
                paid.grants <= budget.requests
                and paid.grant_tokens <= budget.tokens
                and during_paid.ok <= budget.requests
            ),
            "emergency tier: the budget was used, and past it 503 + Retry-After": paid.grants > 0
            and during_paid.refused_503 > 0
            and during_paid.ok + during_paid.refused_503 == during_paid.sent,
            "the reject tier got no emergency grant": free.grants == 0,
            "nothing else odd (no other status, no broken stream, nothing left running)": not any(
                ph.odd for t in f.tenants.values() for ph in t.phases.values()
            )
            and f.still_running == 0,
            "after recovery the journal is empty": f.journal_left == 0,
            "after recovery every emergency grant is a settled reservation in the ledger": all(
                t.grants_settled == t.grants for t in f.tenants.values()
            ),
            "every request is billed exactly what its client received (or nothing, if refused)": not f.mismatches,
            "ledger totals == what the clients received (requests, input and output tokens)": all(
                (t.ledger_requests - t.phantoms, t.ledger_input, t.ledger_output)
                == (t.client_requests, t.client_input, t.client_output)
                for t in f.tenants.values()
            ),
            "ledger GPU time == the gateway's meter, per request (to the request log's 1 us)": all(
                t.gpu_mismatches == 0 for t in f.tenants.values()
            ),
            "no open reservation and no orphan left": f.open_left == 0 and f.orphans == 0,
            f"converged within {c.converge_s_max:g} s of the ledger's return": f.converge_s is not None,
        } | history_check(f.history, "emergency grants replayed as reservations of their ids; exact")

    INTRO = """
        [bold]drill outage[/bold]: ledger = a throwaway redis-server (AOF, fsync always); tenants {c.free!r} (tier
        reject) and {c.paid!r} (tier emergency: {c.emergency.requests} requests, {c.emergency.tokens} tokens,
        {c.emergency.seconds:g} s), {c.clients} closed-loop clients each (outputs
        {c.output_tokens[0]}-{c.output_tokens[1]} tokens), gateway {gateway}, sweep {c.sweep_s:g} s, reservation
        TTL {c.reservation_ttl_s:g} s.

        Fault: SIGTERM to the ledger server at {t.stop_at_s:.1f} s (gone at {t.down_at_s:.1f} s), started again at
        {t.restart_at_s:.1f} s, answering at {t.up_at_s:.1f} s: down {t.down_s:.1f} s. Journal just before the
        restart: {journal}.
    """

    def intro_fields(self) -> dict[str, Any]:
        return super().intro_fields() | {
            "t": self.main.timeline,
            "gateway": "process" if self.processes else "in-process",
            "journal": fmt_counts(self.main.journal_at_restart) or "empty",
        }

    def body(self) -> list[Any]:
        f = self.main
        tenants = f.tenants.values()
        phases = [
            (
                t.tenant,
                t.tier,
                *(_cells(t.phases[p]) for p in ("before", "during", "edge", "after")),
                f"{t.grants} ({t.grant_tokens})",
            )
            for t in tenants
        ]
        caption = (
            "grants: emergency reservations from the local budget (their prompt + max output tokens); "
            f"'during' = sent from the server's exit to {EDGE_S:g} s before its restart"
        )
        columns: tuple[str, ...] = ("tenant", "tier", "before", "during outage", "edges", "after", "grants (tokens)")
        out: list[Any] = [
            table(
                "requests by phase (sent / ok / 503+Retry-After / other)", columns, phases, caption, ("tenant", "tier")
            )
        ]
        rows = [
            (
                t.tenant,
                f"{t.client_requests} / {t.ledger_requests}" + (f" ({t.phantoms} billing 0)" if t.phantoms else ""),
                f"{t.client_input:,} / {t.ledger_input:,}",
                f"{t.client_output:,} / {t.ledger_output:,}",
                f"{t.metered_gpu_ms:,.1f} / {t.ledger_gpu_ms:,.1f}",
            )
            for t in tenants
        ]
        columns = ("tenant", "requests ok / billed", "input tokens client / billed", "output tokens client / billed")
        caption = (
            f"reservations at the end: {dict(sorted(f.statuses.items()))}; open {f.open_left}, orphans {f.orphans}; "
            f"journal records left {f.journal_left}"
        )
        out.append(table("clients vs ledger, whole run", (*columns, "GPU ms metered / billed"), rows, caption))
        out.append(self._load_line())
        out += [f"  [red]mismatch[/red] {line}" for line in f.mismatches[:12]]
        out += [f"  ... and {len(f.mismatches) - 12} more"] if len(f.mismatches) > 12 else []
        out += history_lines(f.history)
        return out + [f"  gateway: {line}" for line in f.gateway_log[:8]]

    def _load_line(self) -> str:
        f, tenants = self.main, self.main.tenants.values()
        unbilled = {
            kind: sum(getattr(t, f"client_{kind}") - getattr(t, f"ledger_{kind}") for t in tenants)
            for kind in ("requests", "input", "output")
        }
        unbilled_gpu = sum(t.metered_gpu_ms - t.ledger_gpu_ms for t in tenants)
        gpu_mismatches = sum(t.gpu_mismatches for t in tenants)
        lost = [
            f"{len({m.split(':')[0] for m in f.mismatches})} requests billed other than what their client received"
            if f.mismatches
            else "",
            f"{unbilled['requests']} requests, {unbilled['input']:,} input and {unbilled['output']:,} output tokens, "
            f"{unbilled_gpu:,.1f} GPU ms ({gpu_mismatches} requests) not billed"
            if any(unbilled.values()) or gpu_mismatches
            else "",
            f"{f.open_left} reservations left open" if f.open_left else "",
            f"{f.orphans} orphan reservations" if f.orphans else "",
            f"{f.journal_left} journal records never replayed" if f.journal_left else "",
        ]
        lost = [item for item in lost if item]
        refused = sum(ph.refused_503 for t in tenants for ph in t.phases.values())
        converge = fmt_s(f.converge_s, f"not within {self.config.converge_s_max:g} s")
        return (
            f"Load held: {sum(ph.sent for t in tenants for ph in t.phases.values())} requests sent, "
            f"{sum(t.client_requests for t in tenants)} served, {refused} refused with 503 + Retry-After while the "
            f"ledger was down. Lost: {'; '.join(lost) if lost else 'nothing'}. Time to converge: {converge} after the "
            "ledger answered again (the gateway replays its journal by itself)."
        )

    def verdict(self) -> str:
        return f"ledger down {self.main.timeline.down_s:.1f} s under load."


def _cells(ph: Phase) -> str:
    return f"{ph.sent} / {ph.ok} / {ph.refused_503} / {sum(ph.odd.values())}"


def _key(record: RequestRecord) -> str:
    return record.error or record.outcome


def _phase_of(record: RequestRecord, t: Timeline) -> str:
    """``before`` the stop, ``during`` the outage (sent once the server was gone and at least ``EDGE_S``
    before its restart, so it reached the gateway's reservation while the ledger was down), ``after`` it
    answered again, else ``edge``. (``tenant_figures`` also counts as ``edge`` a request sent during the
    outage that the ledger shows reserved after the restart: one that was slow to reach the gateway.)"""
    if record.sent_s < t.stop_at_s:
        return "before"
    if t.down_at_s <= record.sent_s < t.restart_at_s - EDGE_S:
        return "during"
    return "after" if record.sent_s >= t.up_at_s else "edge"


def _phase(records: list[RequestRecord]) -> Phase:
    odd: Counter[str] = Counter()
    ok = refused = 0
    for r in records:
        if r.outcome == "ok" and r.tokens == r.max_tokens:
            ok += 1
        elif r.outcome == "error" and r.status == 503 and r.code == "ledger_unavailable":
            if r.retry_after is not None and r.retry_after.isdigit() and int(r.retry_after) >= 1:
                refused += 1
            else:
                odd["503 without Retry-After"] += 1
        elif r.outcome == "ok":
            odd[f"ok with {r.tokens}/{r.max_tokens} tokens"] += 1
        else:
            odd[_key(r)] += 1
    return Phase(len(records), ok, refused, dict(odd), sum(r.tokens for r in records))


def read_journal(path: Path) -> list[dict[str, Any]]:
    """The records of a gateway's emergency journal (none if it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_events(path: Path) -> list[dict[str, Any]]:
    """The records of a gateway's request log (``[gateway].event_log``), rotated files included."""
    from fairgate.gateway.eventlog import read_records

    return [record for _, _, record in read_records(path)] if path.exists() else []


async def _reconciled(ledger: Any, records: list[RequestRecord], before_s: float, journal: Path) -> bool:
    """Every request sent before ``before_s`` has ended, each admitted one has a final reservation billing
    exactly what its client received, and the journal is empty."""
    if any(r.sent_s < before_s and r.outcome == "running" for r in records) or read_journal(journal):
        return False
    by_request = {r.request_id: r for r in await ledger.reservations()}
    for record in records:
        if record.sent_s >= before_s or not record.admitted:
            continue
        r = by_request.get(record.request_id)
        if r is None or r.status != "settled" or r.billed.output_tokens != record.tokens:
            return False
    return True


def _phantom(r: Any) -> bool:
    """A reservation closed billing nothing: for a request its client saw refused, one a timed-out ledger call
    made after all, cancelled by request id once the ledger answered (``ResilientLedger.doubt``)."""
    return bool(r.is_final and r.billed == Usage())


def _mismatches(records: list[RequestRecord], reservations: list[Any]) -> list[str]:
    """Every request whose reservation does not bill exactly what its client received (each a sentence)."""
    by_request = grouped(reservations, lambda r: r.request_id)
    out = []
    for call in records:
        rid, found = call.request_id, by_request.get(call.request_id, [])
        if len(found) > 1:
            out.append(f"{rid}: {len(found)} reservations")
        elif not call.admitted:
            if found and not _phantom(found[0]):
                out.append(
                    f"{rid}: refused ({_key(call)}) but the ledger holds a {found[0].status} reservation billing "
                    f"{found[0].billed.output_tokens} tokens"
                )
        elif not found:
            out.append(f"{rid}: ran ({call.tokens} tokens) but the ledger has no reservation")
        else:
            r = found[0]
            if r.status != "settled":
                out.append(f"{rid}: ran to the end but its reservation is {r.status}")
            if r.billed.output_tokens != call.tokens:
                out.append(
                    f"{rid}: client received {call.tokens} tokens, ledger billed {r.billed.output_tokens} "
                    f"({r.status}, id {r.id[:12]}...)"
                )
            if call.usage_input is not None and r.billed.input_tokens != call.usage_input:
                out.append(
                    f"{rid}: client's usage says {call.usage_input} prompt tokens, billed {r.billed.input_tokens}"
                )
            if call.usage_output is not None and call.usage_output != call.tokens:
                out.append(f"{rid}: client's usage says {call.usage_output} output tokens, received {call.tokens}")
    return out


@dataclass(frozen=True)
class Observed:
    """What the drill read at the end: the clients' records, the ledger, the gateway's request log."""

    records: list[RequestRecord]
    reservations: list[Any]
    usage: dict[str, Any]
    journal_left: list[dict[str, Any]]
    journal_at_restart: dict[str, int]
    converge_s: float | None
    wall_start: float
    history: HistoryReport


def run(options: DrillOptions, config: OutageConfig | None = None) -> OutageResult:
    """Run the drill (``options.seconds``: the outage's length; ``options.policy``: the gateway's policy)."""
    config = options.setting(config or OutageConfig(), "outage_s")
    with (
        temporary_folder("fairgate-drill-outage-") as folder,
        LogCapture() as capture,
        redis_server(folder / "redis") as redis,
    ):
        spec = config.spec(options.policy, options.in_processes(False), redis_url(redis, "drill"))
        with start_stack(spec, folder=folder / "stack") as stack:
            timeline, observed = asyncio.run(_run(stack, redis, config, options.seed))
        # The gateway has stopped: its request log is flushed.
        assert stack.config.event_log_path is not None
        events = read_events(stack.config.event_log_path)
        log = summarise_log(log_lines(capture.lines, stack.config.path.parent / "gateway.log"))
    return OutageResult(config, outage_figures(config, timeline, observed, events, log), options.in_processes(False))


async def _run(stack: Stack, redis: Any, config: OutageConfig, seed: int) -> tuple[Timeline, Observed]:
    journal, limit_s = stack.config.journal_path, config.converge_s_max
    send_until = config.warmup_s + config.outage_s + config.after_s
    async with LoadGenerator(stack.url, stack.keys, stack.spec.model, seed) as generator:
        now = generator.now
        load = asyncio.ensure_future(generator.run(config.loads(), send_until, config.drain_s_max))
        try:
            await asyncio.sleep(max(0.0, config.warmup_s - now()))
            stop_at = now()
            await asyncio.to_thread(redis.stop)
            down_at = now()
            await asyncio.sleep(max(0.0, stop_at + config.outage_s - now()))
            journal_at_restart = Counter(record["type"] for record in read_journal(journal))
            restart_at = now()
            await asyncio.to_thread(lambda: redis.start().wait_ready())
            up_at = now()
            # Convergence: poll the ledger (a connection of our own) until everything admitted before the
            # ledger came back is reconciled and the journal is empty.
            records = generator.history.records
            async with stack.ledger() as reader:
                reconciled = await poll(lambda: _reconciled(reader, records, up_at, journal), up_at + limit_s, now)
                converge_s = None if reconciled is None else reconciled - up_at
                await load

                async def landed() -> bool:
                    """The last settlements and a journal replay have landed."""
                    return not (read_journal(journal) or await reader.reservations(status="open"))

                await poll(landed, now() + limit_s, now)
                reservations = await reader.reservations()
                usage = {t.name: await reader.usage(t.name, 86_400.0) for t in config.tenants}
            history = await check_stack(stack, records)
        finally:
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
    timeline = Timeline(stop_at, down_at, restart_at, up_at)
    observed = Observed(
        records,
        reservations,
        usage,
        read_journal(journal),
        dict(journal_at_restart),
        converge_s,
        generator.history.wall_start,
        history,
    )
    return timeline, observed


def _grants_and_meter(
    config: OutageConfig, events: list[dict[str, Any]]
) -> tuple[dict[str, list[dict[str, Any]]], dict[tuple[str, str], float]]:
    """From the gateway's request log: each tenant's emergency grants (``admitted`` records of grant ids),
    and the GPU ms its meter charged per (tenant, request id)."""
    tags = {tenant_tag(t.name): t.name for t in config.tenants}
    grants: dict[str, list[dict[str, Any]]] = {t.name: [] for t in config.tenants}
    metered: dict[tuple[str, str], float] = {}
    for record in events:
        tenant = tags.get(record.get("tenant_hash") or "")
        if tenant is None:
            continue
        if record.get("event") == "admitted" and str(record.get("reservation_id", "")).startswith(EMERGENCY_PREFIX):
            grants[tenant].append(record)
        if record.get("event") == "finished":
            key = (tenant, str(record.get("request_id")))
            metered[key] = metered.get(key, 0.0) + float(record.get("gpu_ms") or 0.0)
    return grants, metered


def outage_figures(
    config: OutageConfig, t: Timeline, o: Observed, events: list[dict[str, Any]], gateway_log: list[str]
) -> OutageFigures:
    grants, metered = _grants_and_meter(config, events)
    statuses = Counter(r.status for r in o.reservations)
    known = {r.request_id for r in o.records}
    tenants = {spec.name: tenant_figures(config, spec, t, o, grants[spec.name], metered) for spec in config.tenants}
    return OutageFigures(
        t,
        tenants,
        o.journal_at_restart,
        len(o.journal_left),
        o.converge_s,
        tuple(_mismatches(o.records, o.reservations)),
        statuses.get("open", 0),
        dict(statuses),
        sum(1 for r in o.reservations if r.request_id not in known),
        sum(1 for r in o.records if r.outcome == "cut"),
        tuple(gateway_log),
        o.history,
    )


def tenant_figures(
    config: OutageConfig,
    spec: TenantSpec,
    t: Timeline,
    o: Observed,
    grants: list[dict[str, Any]],
    metered: dict[tuple[str, str], float],
) -> TenantOutage:
    """One tenant's requests by phase, its emergency grants, and what it received against what was billed."""
    granted = {str(g.get("request_id")) for g in grants}
    created_ms = {r.request_id: r.created_ms for r in o.reservations}
    restart_wall_ms = (o.wall_start + t.restart_at_s) * 1000.0
    mine = [r for r in o.records if r.tenant == spec.name]
    by_phase: dict[str, list[RequestRecord]] = {p: [] for p in ("before", "during", "edge", "after")}
    for r in mine:
        phase = _phase_of(r, t)
        created = created_ms.get(r.request_id)
        if (
            phase == "during"
            and r.outcome == "ok"
            and r.request_id not in granted
            and (created or 0.0) >= restart_wall_ms
        ):
            phase = "edge"  # reserved in the ledger once it was back (a slow request, not a leak)
        by_phase[phase].append(r)
    ran = [r for r in mine if r.admitted]
    refused_ids = {r.request_id for r in mine if not r.admitted}
    billed = {(r.tenant, r.request_id): r.billed.gpu_ms for r in o.reservations if r.tenant == spec.name}
    mine_metered = {k: v for k, v in metered.items() if k[0] == spec.name}
    u = o.usage[spec.name]
    return TenantOutage(
        spec.name,
        spec.tier,
        {p: _phase(rs) for p, rs in by_phase.items()},
        len(grants),
        sum(int(g["input_tokens"]) + int(g["max_output_tokens"]) for g in grants),
        sum(1 for r in o.reservations if r.tenant == spec.name and r.status == "settled" and r.request_id in granted),
        len(ran),
        sum(r.usage_input or 0 for r in ran),
        sum(r.tokens for r in ran),
        u.requests,
        u.input_tokens,
        u.output_tokens,
        u.gpu_ms,
        sum(mine_metered.values()),
        sum(1 for k in set(mine_metered) | set(billed) if abs(mine_metered.get(k, 0.0) - billed.get(k, 0.0)) > 0.001),
        sum(1 for r in o.reservations if r.tenant == spec.name and r.request_id in refused_ids and _phantom(r)),
    )

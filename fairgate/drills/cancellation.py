"""Drill ``cancellation`` (seed 003, "simulate ... client cancellation"): 1,000 streamed requests, each
cut by its client at a random point - before any byte of the answer, right after the headers, after ``k``
chunks, or never - by closing the stream. Afterwards every slot must be released (the gateway's
dispatcher, the replicas and the ledger's concurrency and queue counters back to zero), every reservation
final, and each reservation billed the output tokens the replica generated for it.

The load: ``requests`` chat completions over four tenants, ``concurrency`` at a time (more than the
fleet's slots, so some are cut while they wait in the gateway's queue), short prompts, ``max_tokens``
log-uniform in ``output_tokens`` with ``ignore_eos``. Each request carries its own ``X-Request-Id`` (its
reservation in the ledger) and the same id as the last word of its prompt, which a tap on each in-process
emulated replica reads to find the request's sequence, and when each of its tokens was generated: for
every request the drill knows what the client received, what the ledger billed and what the replica
generated. The replicas run in this process (tapped); the gateway runs as a ``fairgate serve`` process
(its own core: the drill takes half the time).

What "tokens generated" can be compared with, exactly. The replica generates a token at the end of each
iteration and streams it; the gateway bills what it has read of the upstream's stream when it closes it
(the upstream reports no usage for a stream cut short). After a client hangs up, the gateway notices,
closes the upstream stream, and the replica stops the sequence when it notices (vLLM and the emulator:
within an iteration). Tokens generated after the hang-up may be billed (read before the gateway noticed) or
not (generated after it closed the stream: no gateway can bill what it never saw), and so may the last
tokens generated just *before* the hang-up: on the wire, or read by the kernel but not yet by the
gateway's event loop when it closed the stream. On an idle machine that is at most one token (one
iteration); a loaded machine delays the gateway's reads by up to some hundred ms. So, per request:

- completed (never cut): billed == generated == received == ``max_tokens``, status ``settled`` (exact);
- cut before it reached a replica (queued in the gateway): billed 0 tokens and 0 GPU ms (exact);
- cut in a replica's queue (never in an iteration): billed 0 tokens == generated (exact);
- cut while running: received <= billed <= generated (exact: never billed more than the replica generated,
  nor less than the client was sent), and every token generated more than ``read_lag_ms_max`` (250 ms)
  before the hang-up billed (tokens are billed in order, so the unbilled ones are the youngest; the age of
  the oldest one is reported: a gateway that lost a cut stream's tokens, billed only its last partial
  settlement, or billed nothing for cancels would fail by seconds).

And for the whole run: at most one reservation per request id and one sequence per request; the ledger's
event log sums to the reservations' billed totals for every tenant (``fairgate.ledger.reconcile``); no
reservation open or expired; the replicas' token counters equal the sum of the per-request figures; the
GPU time billed within ``gpu_ratio_tolerance`` of the replicas' own charge-rule figure per tenant (the live
meter is an estimate, not an invoice: a loose bound against gross errors, such as a cancel billed twice).
"Converged" is the time from the last client's end until the gateway, the replicas and the ledger hold
nothing. Requests that reach a replica after their client hung up are reported ("late"); with
``late_dispatches_max`` set, their count is part of the claim.

With ``DrillOptions.processes`` the replicas run as processes and cannot be tapped: only totals are
compared then (billed <= the replicas' token counters <= billed + a bound per hang-up of a running stream).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from fairgate.drills import DrillOptions
from fairgate.drills.report import (
    ConfiguredResult,
    fleet,
    fmt_counts,
    fmt_ms,
    fmt_s,
    grouped,
    history_check,
    history_lines,
    table,
)
from fairgate.gateway.state import state_of
from fairgate.harness.config import TenantSpec
from fairgate.harness.gauges import GatewayGauges, gateway_gauges
from fairgate.harness.history import Bounds, HistoryReport, check_stack
from fairgate.harness.loadgen import Cut, LoadGenerator, Request
from fairgate.harness.logs import quiet_hang_ups
from fairgate.harness.records import RequestRecord, percentile
from fairgate.harness.replica import ReplicaModel, ReplicaStats
from fairgate.harness.stack import Stack, StackSpec, replicas, start_stack

CUT_POINTS = ("before_bytes", "after_headers", "after_chunks", "never")
CUTS = ("before_bytes", "after_headers", "after_chunks")  # where a client hangs up (``Plan.cut``, but "never")


@dataclass(frozen=True)
class CancellationConfig:
    """The drill's setting (defaults: the acceptance scenario)."""

    requests: int = 1000  # streamed requests sent, over ``tenants``, ``concurrency`` at a time
    tenants: tuple[str, ...] = ("alpha", "beta", "gamma", "delta")
    concurrency: int = 48
    # how often each cut point is drawn (``CUT_POINTS`` order)
    cut_weights: tuple[float, float, float, float] = (0.2, 0.2, 0.4, 0.2)
    # a "before any byte" cut comes this long (uniform) after sending: while the request waits in the
    # gateway's queue, in the replica's, or is prefilled
    before_bytes_s: tuple[float, float] = (0.0, 0.08)
    output_tokens: tuple[int, int] = (20, 200)  # max_tokens (log-uniform, inclusive), with ignore_eos
    prompt_tokens: int = 12  # prompt length as the emulator counts it
    replicas: int = 2  # the emulated fleet (fast iterations, so 1,000 streams fit the time)
    replica: ReplicaModel = field(default_factory=lambda: ReplicaModel(20.0, 0.1, 0.05, 16, 4096))
    # with in-process (tapped) replicas, run the gateway as a process of its own (its own core: the
    # drill takes about half the time)
    gateway_process: bool = True
    converge_s_max: float = 10.0  # after the last client is done, how long the stack may take to release everything
    # per request cut while running, every token generated more than this long before its client hung
    # up must be billed (younger ones may still have been on their way to, or unread in, the gateway
    # when it closed the stream; see the module docstring)
    read_lag_ms_max: float = 250.0
    # per request cut by its client, how long the gateway may go on relaying (and billing) tokens the client
    # will not read before it notices the hang-up: the history checker's billed-unread allowance is the
    # tokens generated in this long (a loaded two-core machine measured up to 21 tokens, 420 ms)
    unread_ms_max: float = 500.0
    # with processes (no per-token times), the most tokens a replica may generate after a
    # hang-up that are not billed, per hang-up of a running stream (totals check only)
    untapped_hangup_tokens_max: int = 4
    # billed GPU time vs the replicas' charge-rule figure, per tenant (relative; the live meter
    # sees the replicas' real iteration times, which run late on a loaded machine, where the charge
    # rule counts planned ones: a loose bound against gross errors, not a meter accuracy test)
    gpu_ratio_tolerance: float = 0.25
    # if set, a check: at most this many requests reach a replica after their client hung up
    # (None: reported only)
    late_dispatches_max: int | None = None

    @property
    def history_bounds(self) -> Bounds:
        """The history checker's allowance per stream a client cut: billed but unread, the tokens the replica
        generates in ``unread_ms_max`` (one per iteration); generated but unbilled, those it makes while the
        hang-up travels to it (``untapped_hangup_tokens_max``). A client that hangs up on a live gateway is
        never billed less than it received: that stays exact (a check of its own)."""
        unread = math.ceil(self.unread_ms_max / self.replica.iter_base_ms)
        return Bounds(unbilled_per_cut=self.untapped_hangup_tokens_max, overbilled_per_cut=unread)

    def spec(self, policy: str, processes: bool) -> StackSpec:
        tenants = tuple(TenantSpec(t) for t in self.tenants)
        gateway_process = processes or self.gateway_process
        return StackSpec(
            tenants,
            policy,
            replicas(self.replicas),
            self.replica,
            processes,
            gateway_process,
            tapped=not processes,
            admin=True,
        )


@dataclass(frozen=True)
class Plan:
    """One request: who sends it, its id, its ``max_tokens`` and where its client cuts it."""

    index: int
    tenant: str
    request_id: str
    max_tokens: int
    cut: str
    after_chunks: int = 0  # for "after_chunks": content chunks read before closing
    after_s: float = 0.0  # for "before_bytes": seconds after sending

    def request(self, prompt_tokens: int) -> Request:
        """The request its client sends, hanging up where the plan says."""
        cuts = {"before_bytes": Cut("headers", seconds=self.after_s), "after_headers": Cut("headers")}
        cuts["after_chunks"] = Cut("chunks", chunks=self.after_chunks)
        cut = cuts.get(self.cut)
        return Request(self.tenant, self.request_id, self.max_tokens, prompt_tokens, tag=True, cut=cut)


def plans(config: CancellationConfig, seed: int) -> list[Plan]:
    rng = random.Random(f"cancellation-{seed}")
    out = []
    for i in range(config.requests):
        low, high = config.output_tokens
        max_tokens = min(high, max(low, int(math.exp(rng.uniform(math.log(low), math.log(high + 1))))))
        cut = rng.choices(CUT_POINTS, weights=config.cut_weights)[0]
        out.append(
            Plan(
                i,
                config.tenants[i % len(config.tenants)],
                f"cx{seed}-{i:05d}",
                max_tokens,
                cut,
                after_chunks=rng.randint(1, max_tokens - 1) if cut == "after_chunks" else 0,
                after_s=rng.uniform(*config.before_bytes_s) if cut == "before_bytes" else 0.0,
            )
        )
    return out


def cut_at(record: RequestRecord) -> str:
    """Where the request really ended: a cut point, ``completed`` or ``error``."""
    if record.cut_at in CUTS:
        return record.cut_at
    return "completed" if record.outcome == "ok" else "error"


@dataclass(frozen=True)
class RequestFigures:
    """One request: the client's, the ledger's and the replica's view."""

    request_id: str
    tenant: str
    max_tokens: int
    cut_at: str
    received: int
    reservations: int  # in the ledger under this request id (0 or 1)
    status: str | None  # the reservation's status
    billed_output: int
    billed_gpu_ms: float
    sequences: int | None  # replica sequences run for it (None: not tapped)
    generated: int | None  # tokens the replica generated for it
    charge_rule_ms: float | None  # the replica's charge-rule GPU ms for it
    submitted_after_hangup: bool | None  # the replica got it after its client had hung up
    ran: bool | None  # the replica ran it in at least one iteration
    hangup_ms: float | None  # from the client's hang-up to the replica stopping the sequence
    token_offsets_ms: tuple[float, ...] | None  # when each token was generated, ms after the hang-up (sorted)

    @property
    def unbilled(self) -> int:
        """Tokens generated but never seen by the gateway (0 when not tapped)."""
        return 0 if self.generated is None else self.generated - self.billed_output

    @property
    def oldest_unbilled_ms(self) -> float | None:
        """How long before the hang-up the oldest unbilled token was generated (ms; negative: after it). Tokens
        are billed in order, so the unbilled ones are the last ``unbilled``. None: none unbilled, or unknown."""
        if self.unbilled <= 0 or not self.token_offsets_ms or self.unbilled > len(self.token_offsets_ms):
            return None
        return -self.token_offsets_ms[-self.unbilled]


def request_figures(
    record: RequestRecord, hangup: float | None, mine: list[Any], seqs: list[Any] | None
) -> RequestFigures:
    """One request's figures from its record, its reservations and (tapped) its replica sequences;
    ``hangup``: when its client hung up, on this process's monotonic clock (None: not tapped or no hang-up)."""
    first = mine[0] if mine else None
    tapped = seqs is not None
    seqs = seqs or []
    cancelled = [(s.cancelled_at_s - hangup) * 1000.0 for s in seqs if getattr(s, "cancelled_at_s", None) is not None]
    return RequestFigures(
        record.request_id,
        record.tenant,
        record.max_tokens,
        cut_at(record),
        record.tokens,
        len(mine),
        first.status if first else None,
        first.billed.output_tokens if first else 0,
        first.billed.gpu_ms if first else 0.0,
        len(seqs) if tapped else None,
        sum(s.generated for s in seqs) if tapped else None,
        sum(s.charged_ms for s in seqs) if tapped else None,
        None if hangup is None else any(s.arrival_s > hangup for s in seqs),
        any(s.charged_ms > 0 for s in seqs) if tapped else None,
        None if hangup is None else max(cancelled, default=None),
        None if hangup is None else tuple(sorted((t - hangup) * 1000.0 for s in seqs for t in s.events.token_s)),
    )


@dataclass(frozen=True)
class Held:
    """What the stack still holds: the gateway's gauges, the replicas, the ledger's accounts and open
    reservations."""

    gateway: dict[str, float]
    replicas: list[ReplicaStats]
    concurrent: dict[str, int]  # tenant -> the ledger's open-request counter
    queued: dict[str, int]
    open_reservations: int

    @property
    def slots(self) -> list[float]:
        """Each count of slots, queue places or sequences held (gateway, replicas, ledger)."""
        replicas = (s.occupancy for s in self.replicas)
        return [*self.gateway.values(), *replicas, *self.concurrent.values(), *self.queued.values()]

    @property
    def idle(self) -> bool:
        return not (any(self.slots) or self.open_reservations)


@dataclass(frozen=True)
class CancellationFigures:
    policy: str
    requests: list[RequestFigures]
    cut_counts: dict[str, int]  # realized cut points
    errors: dict[str, int]
    load_s: float  # the clients' phase
    converge_s: float | None  # from the last client's end to everything released (None: never)
    after: Held
    by_status: dict[str, int]
    reconcile_differences: dict[str, list[str]]
    tenant_gpu: dict[str, tuple[float, float]]  # tenant -> (billed GPU ms, replicas' charge-rule ms)
    tapped: bool
    untagged_sequences: int
    history: HistoryReport  # the history checker: every request id against the ledger and the replicas

    @property
    def replica_tokens(self) -> int:
        return sum(s.tokens_generated for s in self.after.replicas)

    @property
    def billed_tokens(self) -> int:
        return sum(r.billed_output for r in self.requests)

    @property
    def faults(self) -> int:
        """Client hang-ups (every cut but "never")."""
        return sum(n for point, n in self.cut_counts.items() if point in CUTS)

    @property
    def overbilled(self) -> int:
        """Tokens billed above what the replica generated (tapped) or above ``max_tokens``."""
        return sum(
            max(0, r.billed_output - (r.max_tokens if r.generated is None else r.generated)) for r in self.requests
        )

    @property
    def held_slots(self) -> float:
        """Slots, queue places and sequences still held after the run (gateway, replicas, ledger)."""
        return sum(self.after.slots)

    @property
    def late(self) -> list[RequestFigures]:
        """Requests the gateway sent to a replica after their client had hung up (tapped runs only)."""
        return [r for r in self.requests if r.submitted_after_hangup]


@dataclass(frozen=True)
class CancellationResult(ConfiguredResult[CancellationConfig, CancellationFigures]):
    name: str = "cancellation"

    def checks(self) -> dict[str, bool]:
        c, f = self.config, self.main
        rs = f.requests
        completed = [r for r in rs if r.cut_at == "completed"]
        checks = {
            f"all {c.requests} requests sent, no errors": len(rs) == c.requests and not f.errors,
            "every cut point exercised": all(f.cut_counts.get(p, 0) > 0 for p in (*CUTS, "completed")),
            f"every slot released within {c.converge_s_max:g} s (gateway, replicas, ledger)": f.converge_s is not None
            and f.held_slots == 0,
            "every reservation final (none open, none expired)": f.by_status.get("open", 0) == 0
            and f.by_status.get("expired", 0) == 0,
            "at most one reservation per request id": all(r.reservations <= 1 for r in rs),
            "completed: billed == received == max_tokens (exact)": all(
                r.billed_output == r.received == r.max_tokens and r.status == "settled" for r in completed
            ),
            "cut: received <= billed <= max_tokens": all(
                r.received <= r.billed_output <= r.max_tokens for r in rs if r.cut_at != "completed"
            ),
            "event log sums == reservations' billed totals, every tenant": not f.reconcile_differences,
        }
        checks.update(self._tapped_checks() if f.tapped else self._totals_checks())
        b = c.history_bounds
        allowing = f"per cut: <= {b.overbilled_per_cut} tokens billed unread, <= {b.unbilled_per_cut} made unbilled"
        checks.update(history_check(f.history, allowing))
        checks[f"billed GPU within {c.gpu_ratio_tolerance:.0%} of the replicas' charge rule, per tenant"] = all(
            truth > 0 and abs(billed / truth - 1) <= c.gpu_ratio_tolerance for billed, truth in f.tenant_gpu.values()
        )
        return checks

    def _tapped_checks(self) -> dict[str, bool]:
        c, f, rs = self.config, self.main, self.main.requests
        completed = [r for r in rs if r.cut_at == "completed"]
        ran = [r for r in rs if r.ran and r.cut_at != "completed"]
        checks = {
            "every request ran at most once on a replica": all((r.sequences or 0) <= 1 for r in rs)
            and f.untagged_sequences == 0,
            "completed: billed == generated (exact)": all(r.generated == r.billed_output for r in completed),
            "cut before reaching a replica: billed 0 tokens, 0 GPU ms (exact)": all(
                r.billed_output == 0 and r.billed_gpu_ms == 0 for r in rs if r.reservations and r.sequences == 0
            ),
            "cut in a replica's queue (never run): billed 0 tokens (exact)": all(
                r.billed_output == 0 == r.generated for r in rs if r.sequences and not r.ran
            ),
            "cut while running: billed <= generated": all(r.billed_output <= (r.generated or 0) for r in ran),
            f"cut while running: every token generated over {c.read_lag_ms_max:g} ms before the hang-up billed": all(
                (r.oldest_unbilled_ms or 0.0) <= c.read_lag_ms_max for r in ran
            ),
            "replicas' token counters == sum of generated": f.replica_tokens == sum(r.generated or 0 for r in rs),
        }
        if c.late_dispatches_max is not None:
            checks[f"at most {c.late_dispatches_max} requests sent to a replica after their client left"] = (
                len(f.late) <= c.late_dispatches_max
            )
        return checks

    def _totals_checks(self) -> dict[str, bool]:
        f, bound = self.main, self.config.untapped_hangup_tokens_max
        cut_running = sum(1 for r in f.requests if r.cut_at != "completed" and r.billed_output > 0)
        return {
            f"billed <= replicas' tokens <= billed + {bound} per hang-up of a running stream": f.billed_tokens
            <= f.replica_tokens
            <= f.billed_tokens + bound * cut_running
        }

    INTRO = """
        [bold]drill cancellation[/bold]: {c.requests} streamed requests over {tenants} tenants, {c.concurrency} at
        a time, on {fleet} ({c.replica.iter_base_ms:g} ms iterations), policy {main.policy}; max_tokens
        {c.output_tokens[0]}-{c.output_tokens[1]} (log-uniform, ignore_eos); each client closes its stream at a
        random point.

        Claim: every slot released, every reservation final, billed tokens == tokens generated.
    """

    def intro_fields(self) -> dict[str, Any]:
        return super().intro_fields() | {"fleet": fleet(self.config), "tenants": len(self.config.tenants)}

    def body(self) -> list[Any]:
        f = self.main
        caption = (
            f"load: {self.config.requests} requests in {f.load_s:.1f} s; faults injected: {f.faults} client "
            f"hang-ups; reservations {fmt_counts(f.by_status)}. unbilled: generated but not billed, total (most in "
            "one request) / how many ms before its hang-up the oldest was generated (negative: after); late: "
            "reached a replica after its client hung up; hang-up ms: p50 / max from the client's hang-up to the "
            "replica stopping the sequence."
        )
        columns = ("cut at", "n", "tokens recv/billed/gen", "unbilled", "GPU s billed/rule", "late", "hang-up ms")
        cut_at = grouped(f.requests, lambda r: r.cut_at)
        rows = [self._row(p, cut_at[p]) for p in (*CUTS, "completed", "error") if p in cut_at]
        by_cut = table("by where the client cut", (*columns, "reservations"), rows, caption, ("cut at", "reservations"))
        gpu = table(
            "GPU time per tenant",
            ("tenant", "billed GPU s", "replicas' charge rule s", "billed / rule"),
            [
                (t, f"{b / 1000:,.2f}", f"{rule / 1000:,.2f}", "-" if rule <= 0 else f"{b / rule:.3f}")
                for t, (b, rule) in f.tenant_gpu.items()
            ],
        )
        return [by_cut, gpu, *self._notes(), *history_lines(f.history)]

    def _row(self, point: str, rows: list[RequestFigures]) -> tuple[str, ...]:
        tapped = self.main.tapped
        hangups = [r.hangup_ms for r in rows if r.hangup_ms is not None]
        oldest = max((r.oldest_unbilled_ms for r in rows if r.oldest_unbilled_ms is not None), default=None)
        generated = f"{sum(r.generated or 0 for r in rows):,}" if tapped else "-"
        rule = f"{sum(r.charge_rule_ms or 0 for r in rows) / 1000:,.2f}" if tapped else "-"
        return (
            point,
            str(len(rows)),
            f"{sum(r.received for r in rows):,} / {sum(r.billed_output for r in rows):,} / {generated}",
            f"{sum(r.unbilled for r in rows):,} ({max(r.unbilled for r in rows)}) / {fmt_ms(oldest)}"
            if tapped
            else "-",
            f"{sum(r.billed_gpu_ms for r in rows) / 1000:,.2f} / {rule}",
            str(sum(1 for r in rows if r.submitted_after_hangup)) if tapped else "-",
            f"{fmt_ms(percentile(hangups, 50))} / {fmt_ms(max(hangups, default=None))}" if hangups else "-",
            fmt_counts(Counter(r.status or "none" for r in rows)),
        )

    def _notes(self) -> list[str]:
        f, a = self.main, self.main.after
        unbilled = (
            f"{sum(r.unbilled for r in f.requests):,}"
            if f.tapped
            else f"{f.replica_tokens - f.billed_tokens:,} (totals only)"
        )
        out = [
            f"after: gateway {', '.join(f'{k} {v:g}' for k, v in a.gateway.items())}; replicas running "
            f"{sum(s.running for s in a.replicas)}, waiting {sum(s.waiting for s in a.replicas)}; ledger open "
            f"requests {sum(a.concurrent.values())}, queued {sum(a.queued.values())}, open reservations "
            f"{f.by_status.get('open', 0)}; converged {fmt_s(f.converge_s)} after the last client.",
            f"tokens: ledger billed {f.billed_tokens:,}, replicas generated {f.replica_tokens:,}; lost: over-billed "
            f"{f.overbilled:,} tokens, held slots {f.held_slots:g}, open reservations {f.by_status.get('open', 0)}; "
            f"unbilled (generated while a hang-up travelled to the replica) {unbilled}.",
        ]
        if f.tapped and f.late:
            waits = [r.hangup_ms for r in f.late if r.hangup_ms is not None]
            gpu_s = sum(r.billed_gpu_ms for r in f.late) / 1000
            out.append(
                f"[yellow]late[/yellow]: {len(f.late)} requests reached a replica after their client had hung up: "
                f"{sum(r.generated or 0 for r in f.late):,} tokens and {gpu_s:,.2f} GPU s billed for them; their "
                f"hang-up reached the replica after p50 {fmt_ms(percentile(waits, 50))} "
                f"ms, max {fmt_ms(max(waits, default=None))} ms."
            )
        if f.errors:
            out.append(f"[red]errors[/red]: {f.errors}")
        cut = [r for r in f.requests if r.oldest_unbilled_ms is not None and r.cut_at != "completed"]
        for r in sorted(cut, key=lambda r: -(r.oldest_unbilled_ms or 0.0))[:3]:
            if (r.oldest_unbilled_ms or 0.0) > self.config.read_lag_ms_max:
                offsets = ", ".join(f"{t:.0f}" for t in (r.token_offsets_ms or ())[-(r.unbilled + 2) :])
                out.append(
                    f"[red]{r.request_id}[/red] ({r.cut_at}): received {r.received}, billed {r.billed_output}, "
                    f"generated {r.generated}; tokens at ms from the hang-up: {offsets}"
                )
        return out

    def verdict(self) -> str:
        f = self.main
        done = "nothing lost" if self.passed else "see the FAIL lines"
        return f"{f.faults} hang-ups in {self.config.requests} streams; {done}; converged in {fmt_s(f.converge_s)}."


async def gateway_load(stack: Stack) -> dict[str, float]:
    """What the gateway holds now: requests on upstream slots, queued, active sequences (from
    ``state_of(app).dispatcher`` in process, else ``/metrics`` with the admin key)."""
    app = stack.gateways[0].app
    if app is None:
        assert stack.admin_key is not None
        return asdict(await gateway_gauges(stack.url, stack.admin_key))
    dispatcher = state_of(app).dispatcher
    in_flight = float(sum(u.in_flight for u in dispatcher.upstreams()))
    queued, running = dispatcher.queued_by_tenant().values(), dispatcher.running_by_tenant().values()
    return asdict(GatewayGauges(in_flight, float(sum(queued)), float(sum(running))))


async def held(stack: Stack, ledger: Any) -> Held:
    """What the gateway, the replicas and the ledger hold now."""
    accounts = {t: await ledger.account(t, stack.spec.model) for t in stack.spec.tenant_names}
    return Held(
        await gateway_load(stack),
        await stack.replica_stats(),
        {t: a.concurrent for t, a in accounts.items()},
        {t: a.queued for t, a in accounts.items()},
        len(await ledger.reservations(status="open")),
    )


async def converge(stack: Stack, ledger: Any, start: float, limit_s: float) -> tuple[float | None, Held]:
    """Poll until the stack holds nothing: the seconds from ``start`` (monotonic) until it did (None: not
    within ``limit_s``), and the last reading."""
    while True:
        now = await held(stack, ledger)
        elapsed = time.monotonic() - start
        if now.idle or elapsed > limit_s:
            return (elapsed if now.idle else None), now
        await asyncio.sleep(0.05)


def run(options: DrillOptions, config: CancellationConfig | None = None) -> CancellationResult:
    """Run the drill under ``options.policy`` (``seconds`` and ``compare`` do not apply: the load is
    1,000 requests, and the claim does not depend on the policy)."""
    config = config or CancellationConfig()
    with quiet_hang_ups(), start_stack(config.spec(options.policy, options.in_processes(False))) as stack:
        return CancellationResult(config, asyncio.run(_run(stack, config, options)))


async def _run(stack: Stack, config: CancellationConfig, options: DrillOptions) -> CancellationFigures:
    from fairgate.ledger.base import tenant_tag
    from fairgate.ledger.reconcile import reconcile

    async with LoadGenerator(stack.url, stack.keys, stack.spec.model, options.seed, timeout_s=120.0) as generator:
        begin = generator.now()
        todo = [p.request(config.prompt_tokens) for p in plans(config, options.seed)]
        records = await generator.run_requests(todo, config.concurrency)
    start = generator.history.start
    last = start + max(r.ended_s or 0.0 for r in records)
    async with stack.ledger() as ledger:
        converge_s, after = await converge(stack, ledger, last, config.converge_s_max)
        reservations = await ledger.reservations()
        report = await reconcile(ledger, freeze=False)
    history = await check_stack(stack, records, config.history_bounds)
    by_id = grouped(reservations, lambda r: r.request_id)
    tapped = stack.is_tapped
    sequences = stack.tapped("sequences")
    rows = []
    for record in records:
        # The replicas' clock is this process's: per-token times compare with the hang-up when tapped.
        hangup = start + record.hangup_s if tapped and record.hangup_s is not None else None
        seqs = sequences.get(record.request_id, []) if tapped else None
        rows.append(request_figures(record, hangup, by_id.get(record.request_id, []), seqs))
    truth: Counter[str] = Counter()
    for stats in after.replicas:
        truth.update(stats.charge_ms_by_salt)
    tenant_gpu = {
        t: (sum(r.billed.gpu_ms for r in reservations if r.tenant == t), truth.get(tenant_tag(t), 0.0))
        for t in config.tenants
    }
    return CancellationFigures(
        options.policy,
        rows,
        dict(Counter(row.cut_at for row in rows)),
        dict(Counter(e for r in records if (e := r.error) is not None)),
        last - start - begin,
        converge_s,
        after,
        dict(Counter(r.status for r in reservations)),
        {t.tenant: t.differences for t in report.tenants if t.differences},
        tenant_gpu,
        tapped,
        stack.untagged,
        history,
    )

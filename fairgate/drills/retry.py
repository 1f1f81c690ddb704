"""Drill ``retry`` (seed 003, "simulate ... gateway retry ... confirm that the same request is not
double-deducted"): requests each carrying an ``X-Request-Id`` are re-sent one to three times with random
jitter; not one may be run twice, reserved twice or billed twice.

The load: ``ids`` request ids over two tenants, arriving evenly over ``seconds``, half streamed, short
outputs (a request runs for a few hundred ms). Every id is sent once and then re-sent ``1..3`` times with
the same body, by one of these patterns (``patterns`` weights):

- ``jitter``: each re-send ``uniform(0, jitter_s)`` after the original: while it runs (the gateway must
  answer 409 ``request_in_progress``) or after it ended (409 ``request_already_completed``);
- ``storm``: the original and its re-sends leave at the same instant, racing to the ledger's reserve;
- ``timeout``: the original's client gives up mid-way (a client timeout: the connection is closed) and
  re-sends after a jitter: the first attempt is billed what ran, the re-sends are not run;
- ``changed``: one re-send, after the original's answer, changes ``max_tokens`` (a client bug reusing an
  id): 409 ``idempotency_conflict``;
- ``sdk``: the re-sends go through the ``openai`` client with its own retries on (``max_retries=2``): the
  SDK retries every 409 it gets, with its back-off, as a second wave of re-sends.

The claim, checked in the ledger and on the replicas (tapped, as in the ``cancellation`` drill):

- exactly one reservation per id, with one ``reserve`` event that counts a request (a re-send of an original
  cancelled while it was queued re-opens the reservation: a ``reserve`` event counting none), and one
  sequence on a replica at most;
- for every id at most one attempt answered 200, and it or the original its client gave up on was the one
  served; every other attempt was answered 409 (``request_in_progress`` / ``request_already_completed``, or
  ``idempotency_conflict`` for a changed body), no 5xx, no 429 (a client that gives up before the gateway
  has read its request leaves no trace, and its re-send is then served: that is not a double run, which
  the reservation and replica counts would show);
- billed once: each reservation billed what its one served attempt got (``max_tokens`` output tokens for a
  200, no more than the tokens the replica generated for one cut by its client), and the event log sums to
  the reservations' totals (``fairgate.ledger.reconcile``);
- the ``requests_per_minute`` bucket was deducted exactly once per id: the tenant's bucket level, replayed
  from its first reservation with the refill rate, equals ``burst - ids`` (to 1e-6); its burst is the
  tenant's ids + 1, so a double deduction would also show as 429s;
- every reservation final, and the stack idle, soon after the last answer ("converged").

The ``sdk`` pattern also counts the SDK's futile attempts: re-sends after a 409 ``request_already_completed``,
which can never succeed.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fairgate.drills import DrillOptions
from fairgate.drills.report import (
    ConfiguredResult,
    fleet,
    fmt_counts,
    fmt_s,
    grouped,
    history_check,
    history_lines,
    problems_by,
    table,
)
from fairgate.harness.config import TenantSpec
from fairgate.harness.history import Bounds, HistoryReport, check_stack
from fairgate.harness.loadgen import Cut, LoadGenerator, Request
from fairgate.harness.records import RequestRecord
from fairgate.harness.replica import ReplicaModel
from fairgate.harness.run import poll
from fairgate.harness.stack import Stack, StackSpec, replicas, start_stack
from fairgate.ledger.config import LimitsConfig

PATTERNS = ("jitter", "storm", "timeout", "changed", "sdk")
# 409 codes any attempt but the one served may get (``changed``: also ``idempotency_conflict``).
RESEND_CODES = {"request_in_progress", "request_already_completed"}


@dataclass(frozen=True)
class RetryConfig:
    """The drill's setting (defaults: the acceptance scenario)."""

    seconds: float = 8.0  # the originals arrive evenly over this long
    ids: int = 300  # request ids, split evenly over ``tenants``
    tenants: tuple[str, ...] = ("alpha", "beta")
    resends: tuple[int, int] = (1, 3)  # (min, max) re-sends per id, uniform
    patterns: tuple[float, ...] = (0.45, 0.15, 0.15, 0.1, 0.15)  # weight of each pattern (``PATTERNS`` order)
    jitter_s: float = 1.2  # a re-send leaves uniform(0, jitter_s) after its original (``timeout``: after the cut)
    timeout_s: tuple[float, float] = (0.1, 0.4)  # ``timeout`` originals are cut uniform(*timeout_s) after sending
    output_tokens: tuple[int, int] = (4, 24)  # each request's max_tokens (uniform, ignore_eos)
    prompt_tokens: int = 12
    requests_per_minute: int = 6  # the tenants' request rate; their burst is their ids + 1
    sdk_max_retries: int = 2  # the openai client's own retries in the ``sdk`` pattern
    replicas: int = 2  # the emulated fleet
    replica: ReplicaModel = field(default_factory=lambda: ReplicaModel(30.0, 0.2, 0.05, 24, 4096))
    converge_s_max: float = 10.0  # after the last answer, how long the stack may take to hold nothing
    gateway_process: bool = True

    def ids_of(self, tenant: str) -> int:
        index = self.tenants.index(tenant)
        return self.ids // len(self.tenants) + (1 if index < self.ids % len(self.tenants) else 0)

    def burst(self, tenant: str) -> int:
        return self.ids_of(tenant) + 1

    def spec(self, policy: str, processes: bool) -> StackSpec:
        tenants = tuple(
            TenantSpec(
                t, limits=LimitsConfig(requests_per_minute=self.requests_per_minute, requests_burst=self.burst(t))
            )
            for t in self.tenants
        )
        gateway_process = processes or self.gateway_process
        return StackSpec(
            tenants, policy, replicas(self.replicas), self.replica, processes, gateway_process, tapped=not processes
        )


@dataclass(frozen=True)
class IdPlan:
    """One request id: who sends it, when, how, and its re-sends' delays (seconds after the original, or
    after its cut for ``timeout``)."""

    tenant: str
    request_id: str
    at_s: float
    stream: bool
    max_tokens: int
    pattern: str
    resend_delays_s: tuple[float, ...]
    cut_after_s: float = 0.0  # ``timeout``: the original's client gives up after this long


def id_plans(config: RetryConfig, seed: int) -> list[IdPlan]:
    rng = random.Random(f"retry-{seed}")
    out = []
    for i in range(config.ids):
        tenant = config.tenants[i % len(config.tenants)]
        pattern = rng.choices(PATTERNS, weights=config.patterns)[0]
        count = rng.randint(*config.resends)
        delays = tuple(0.0 if pattern == "storm" else rng.uniform(0.0, config.jitter_s) for _ in range(count))
        out.append(
            IdPlan(
                tenant,
                f"rt{seed}-{i:05d}",
                config.seconds * i / config.ids,
                rng.random() < 0.5,
                rng.randint(*config.output_tokens),
                pattern,
                delays,
                rng.uniform(*config.timeout_s) if pattern == "timeout" else 0.0,
            )
        )
    return out


@dataclass
class Attempt:
    """One HTTP attempt (the SDK's own retries are attempts too), as the client saw it."""

    request_id: str
    role: str  # original | resend | changed | sdk (a re-send through the SDK's retries)
    status: int | None = None  # HTTP status (None: the client gave up first, or no answer)
    code: str | None = None  # the error code of a 4xx/5xx
    tokens: int = 0  # output tokens received (streamed chunks, or the usage of a plain answer)
    cut: bool = False  # the client gave up on it (the ``timeout`` pattern's original)
    sent_s: float = 0.0
    ended_s: float = 0.0


@dataclass(frozen=True)
class IdFigures:
    """One id: its attempts and what the ledger and the replicas hold for it."""

    plan: IdPlan
    attempts: list[Attempt]
    reservations: int
    reserve_events: int
    status: str | None
    billed_input: int
    billed_output: int
    sequences: int | None  # on the replicas (None: not tapped)
    generated: int | None

    @property
    def answered_ok(self) -> list[Attempt]:
        """Attempts answered 200 (at most one may be)."""
        return [a for a in self.attempts if a.status == 200]

    @property
    def served(self) -> list[Attempt]:
        """The attempt the gateway served: the one answered 200, else the ones cut by their client."""
        return self.answered_ok or [a for a in self.attempts if a.cut]

    @property
    def refused(self) -> list[Attempt]:
        return [a for a in self.attempts if a.status is not None and a.status != 200]

    def problems(self, prompt_tokens: int) -> list[str]:
        """Why this id breaks the claim (empty: it holds)."""
        out = []
        p = self.plan
        if self.reservations != 1 or self.reserve_events != 1:
            out.append(f"{self.reservations} reservations, {self.reserve_events} reserve events")
        if self.sequences is not None and self.sequences > 1:
            out.append(f"run {self.sequences} times on the replicas")
        served = self.served
        if len(self.answered_ok) > 1 or not served:
            out.append(f"{len(self.answered_ok)} attempts answered 200 ({[a.status for a in self.attempts]})")
        for a in self.attempts:
            if a.status is not None and a.status != 200:
                allowed = RESEND_CODES | ({"idempotency_conflict"} if a.role == "changed" else set())
                if a.status != 409 or a.code not in allowed:
                    out.append(f"{a.role} answered {a.status} {a.code}")
            if a.status is None and not a.cut:
                out.append(f"{a.role} got no answer")
        if self.status not in ("settled", "cancelled"):
            out.append(f"reservation {self.status}")
        if served and not served[0].cut:
            if not (self.billed_output == served[0].tokens == p.max_tokens and self.status == "settled"):
                out.append(f"billed {self.billed_output} tokens, served {served[0].tokens} of {p.max_tokens}")
        elif self.generated is not None and self.billed_output > self.generated:
            out.append(f"billed {self.billed_output} tokens, the replica generated {self.generated}")
        if self.billed_output > p.max_tokens or self.billed_input not in (0, prompt_tokens):
            out.append(f"billed {self.billed_input} in / {self.billed_output} out")
        return out


@dataclass(frozen=True)
class BucketFigures:
    """A tenant's ``requests_per_minute`` bucket, replayed: deductions = burst + refill - level."""

    tenant: str
    ids: int
    burst: float
    level: float
    refill: float
    usage_requests: int

    @property
    def deductions(self) -> float:
        return self.burst + self.refill - self.level


@dataclass(frozen=True)
class RetryFigures:
    policy: str
    ids: list[IdFigures]
    buckets: dict[str, BucketFigures]
    load_s: float
    converge_s: float | None
    open_after: int
    by_status: dict[str, int]
    reconcile_differences: dict[str, list[str]]
    replicas_running_after: int
    tapped: bool
    untagged_sequences: int
    peak_in_flight: int
    sdk_calls: list[list[Attempt]]
    history: HistoryReport  # the history checker: every attempt of every id against the ledger and the replicas

    @property
    def futile_sdk_attempts(self) -> int:
        """SDK re-sends after a 409 ``request_already_completed`` (they can never succeed)."""
        futile = 0
        for call in self.sdk_calls:
            codes = [a.code for a in call]
            if "request_already_completed" in codes:
                futile += len(codes) - 1 - codes.index("request_already_completed")
        return futile

    @property
    def attempts(self) -> list[Attempt]:
        return [a for f in self.ids for a in f.attempts]

    @property
    def answers(self) -> Counter[str]:
        return Counter(
            "cut by client" if a.cut else ("no answer" if a.status is None else f"{a.status} {a.code or 'ok'}")
            for a in self.attempts
        )


def attempts(record: RequestRecord, role: str) -> list[Attempt]:
    """The HTTP attempts behind one sent request: one, or every answer the SDK's own retries got (the last
    one's tokens are the request's)."""
    cut = record.cut_at is not None
    code = record.code if record.outcome == "error" else record.error
    rid, sent, ended = record.request_id, record.sent_s, record.ended_s or record.sent_s
    if role != "sdk" or not record.answers:
        return [Attempt(rid, role, None if cut else record.status, code, record.tokens, cut, sent, ended)]
    out = [Attempt(rid, "sdk", a.status, a.code, 0, False, sent, ended) for a in record.answers]
    if record.status == 200:
        out[-1].tokens = record.tokens
    return out


@dataclass(frozen=True)
class RetryResult(ConfiguredResult[RetryConfig, RetryFigures]):
    name: str = "retry"

    def problems(self) -> dict[str, list[str]]:
        """Request id -> why it breaks the claim."""
        return problems_by((f.plan.request_id, f.problems(self.config.prompt_tokens)) for f in self.main.ids)

    def checks(self) -> dict[str, bool]:
        c, f = self.config, self.main
        answers = f.answers
        patterns = Counter(i.plan.pattern for i in f.ids)
        return {
            f"all {c.ids} ids sent, every pattern exercised": len(f.ids) == c.ids
            and all(patterns[p] for p in PATTERNS),
            "every id: one reservation, one reserve event": all(i.reservations == 1 == i.reserve_events for i in f.ids),
            "every id: run at most once on a replica": (not f.tapped or all((i.sequences or 0) <= 1 for i in f.ids))
            and f.untagged_sequences == 0,
            "every id: at most one attempt answered 200, the others 409 (or cut by the client)": all(
                len(i.answered_ok) <= 1 and i.served for i in f.ids
            )
            and not any(k.startswith(("5", "429")) or k == "no answer" for k in answers),
            "every id billed once (what its one served attempt got)": not self.problems(),
            "requests_per_minute deducted once per id (exact)": all(
                abs(b.deductions - b.ids) < 1e-6 and b.usage_requests == b.ids for b in f.buckets.values()
            ),
            "event log sums == reservations' billed totals, every tenant": not f.reconcile_differences,
            f"every reservation final within {c.converge_s_max:g} s": f.converge_s is not None
            and f.open_after == 0
            and f.replicas_running_after == 0,
        } | history_check(f.history, f"a timed-out original: <= {c.output_tokens[1]} tokens billed unread")

    INTRO = """
        [bold]drill retry[/bold]: {c.ids} request ids over {tenants} in {c.seconds:g} s, each re-sent
        {c.resends[0]}-{c.resends[1]}x (patterns: {patterns}), half streamed, outputs
        {c.output_tokens[0]}-{c.output_tokens[1]} tokens; {fleet}, policy {main.policy}; requests_per_minute
        {c.requests_per_minute}, burst ids+1.

        Claim: the same request id is never run, reserved, billed or deducted twice.
    """

    def intro_fields(self) -> dict[str, Any]:
        c = self.config
        return super().intro_fields() | {
            "fleet": fleet(c),
            "tenants": ", ".join(c.tenants),
            "patterns": ", ".join(PATTERNS),
        }

    def body(self) -> list[Any]:
        f, problems = self.main, self.problems()
        resends = sum(1 for a in f.attempts if a.role != "original")
        sdk = [a for a in f.attempts if a.role == "sdk"]
        caption = (
            f"load: {len(f.attempts):,} attempts for {self.config.ids} ids in {f.load_s:.1f} s (peak "
            f"{f.peak_in_flight} in flight); faults injected: {resends:,} re-sends"
            + (f" ({len(sdk)} by the SDK's own retries)" if sdk else "")
        )
        columns: tuple[str, ...] = (
            "pattern",
            "ids",
            "attempts",
            "answers",
            "reservations",
            "billed out tok",
            "replica runs",
            "ids wrong",
        )
        by_pattern = grouped(f.ids, lambda i: i.plan.pattern)
        rows = [self._row(p, by_pattern[p], problems) for p in PATTERNS if p in by_pattern]
        out: list[Any] = [table("by pattern", columns, rows, caption, ("pattern", "answers"), ("answers",))]
        columns = ("tenant", "ids", "burst", "refill since first", "level now", "deducted", "ledger requests")
        rows = [
            (
                b.tenant,
                str(b.ids),
                f"{b.burst:g}",
                f"{b.refill:.4f}",
                f"{b.level:.4f}",
                f"{b.deductions:.6f}",
                str(b.usage_requests),
            )
            for b in f.buckets.values()
        ]
        out.append(table("requests_per_minute bucket per tenant", columns, rows))
        double = sum(
            max(0, i.reservations - 1) + max(0, (i.sequences or 0) - 1) + max(0, len(i.answered_ok) - 1) for i in f.ids
        )
        extra = sum(b.deductions - b.ids for b in f.buckets.values())
        out.append(
            f"lost: {double} double runs/reservations/answers, {0.0 if abs(extra) < 1e-9 else extra:+.6f} extra bucket "
            f"deductions, {len(problems)} ids wrong; reservations {fmt_counts(f.by_status)}; converged "
            f"{fmt_s(f.converge_s)} after the last answer."
        )
        if f.sdk_calls:
            answered = fmt_counts(Counter(str(a.code or a.status) for a in sdk), " x")
            out.append(
                f"sdk: {len(f.sdk_calls)} re-sends through the openai SDK (max_retries={self.config.sdk_max_retries}) "
                f"became {len(sdk)} HTTP attempts ({answered}); {f.futile_sdk_attempts} of them came after a 409 "
                "request_already_completed, which can never succeed."
            )
        out += [f"[red]{rid}[/red]: {'; '.join(found)}" for rid, found in list(problems.items())[:8]]
        return out + history_lines(f.history)

    def _row(self, pattern: str, rows: list[IdFigures], problems: dict[str, list[str]]) -> tuple[str, ...]:
        answers = Counter(
            "cut" if a.cut else ("none" if a.status is None else f"{a.status} {a.code or 'ok'}")
            for i in rows
            for a in i.attempts
        )
        return (
            pattern,
            str(len(rows)),
            str(sum(len(i.attempts) for i in rows)),
            fmt_counts(answers, " x"),
            str(sum(i.reservations for i in rows)),
            f"{sum(i.billed_output for i in rows):,}",
            "-" if not self.main.tapped else str(sum(i.sequences or 0 for i in rows)),
            str(sum(1 for i in rows if i.plan.request_id in problems)),
        )

    def verdict(self) -> str:
        resends = sum(1 for a in self.main.attempts if a.role != "original")
        done = "not one double deduction" if self.passed else "see the FAIL lines"
        return f"{resends:,} re-sends of {self.config.ids} ids; {done}."


async def drive(
    generator: LoadGenerator, config: RetryConfig, todo: list[IdPlan]
) -> tuple[dict[str, list[Attempt]], list[list[Attempt]]]:
    """Send every id and its re-sends; the attempts by id, and the HTTP attempts of each call through the
    SDK's own retries."""
    by_id: dict[str, list[Attempt]] = {p.request_id: [] for p in todo}
    sdk_calls: list[list[Attempt]] = []

    async def send(plan: IdPlan, role: str, cut_after_s: float = 0.0) -> list[Attempt]:
        request = Request(
            plan.tenant,
            plan.request_id,
            plan.max_tokens + (1 if role == "changed" else 0),
            config.prompt_tokens,
            stream=plan.stream,
            tag=True,
            cut=Cut("time", seconds=cut_after_s) if cut_after_s > 0 else None,
            sdk_retries=config.sdk_max_retries if role == "sdk" else 0,
        )
        return attempts(await generator.send(request), role)

    async def one(plan: IdPlan) -> None:
        await asyncio.sleep(max(0.0, plan.at_s - generator.now()))
        mine = by_id[plan.request_id]
        if plan.pattern == "storm":
            sent = await asyncio.gather(send(plan, "original"), *(send(plan, "resend") for _ in plan.resend_delays_s))
            mine.extend(a for answer in sent for a in answer)
            return
        original = None
        if plan.pattern == "timeout":
            mine.extend(await send(plan, "original", cut_after_s=plan.cut_after_s))
        else:
            original = asyncio.ensure_future(send(plan, "original"))
        base = generator.now()

        async def resend(index: int, delay: float) -> None:
            role = "resend"
            if plan.pattern == "changed" and index == 0 and original is not None:
                role = "changed"  # after the original's answer: it must not win the race to the ledger
                await asyncio.wait([original])
                await asyncio.sleep(delay)
            await asyncio.sleep(max(0.0, base + delay - generator.now()))
            sent = await send(plan, "sdk" if plan.pattern == "sdk" else role)
            if plan.pattern == "sdk":
                sdk_calls.append(sent)
            mine.extend(sent)

        await asyncio.gather(*(resend(i, d) for i, d in enumerate(plan.resend_delays_s)))
        if original is not None:
            mine[:0] = await original

    await asyncio.gather(*(one(p) for p in todo))
    return by_id, sdk_calls


async def idle(stack: Stack, ledger: Any) -> bool:
    """No reservation is open and the replicas are idle."""
    open_now = await ledger.reservations(status="open")
    return not open_now and not any(s.occupancy for s in await stack.replica_stats())


async def buckets(ledger: Any, config: RetryConfig, model: str, events: list[Any]) -> dict[str, BucketFigures]:
    """Each tenant's ``requests_per_minute`` bucket, replayed from its first reservation."""
    out = {}
    for tenant in config.tenants:
        account = await ledger.account(tenant, model)
        usage = await ledger.usage(tenant, 10 * 365 * 86_400)
        reserves = [e.at_ms for e in events if e.tenant == tenant and e.kind == "reserve"]
        first_ms = min(reserves, default=account.requests_updated_ms)
        refill = (account.requests_updated_ms - first_ms) * config.requests_per_minute / 60_000.0
        level = float(account.requests_level or 0.0)
        out[tenant] = BucketFigures(
            tenant, config.ids_of(tenant), float(config.burst(tenant)), level, refill, usage.requests
        )
    return out


def run(options: DrillOptions, config: RetryConfig | None = None) -> RetryResult:
    """Run the drill under ``options.policy`` (``seconds``: how long the originals arrive over)."""
    config = options.setting(config or RetryConfig())
    with start_stack(config.spec(options.policy, options.in_processes(False))) as stack:
        return RetryResult(config, asyncio.run(_run(stack, config, options)))


async def _run(stack: Stack, config: RetryConfig, options: DrillOptions) -> RetryFigures:
    from fairgate.ledger.reconcile import reconcile

    todo = id_plans(config, options.seed)
    async with LoadGenerator(stack.url, stack.keys, stack.spec.model, options.seed, timeout_s=60.0) as generator:
        begin = generator.now()
        by_id, sdk_calls = await drive(generator, config, todo)
    last = max(a.ended_s for rows in by_id.values() for a in rows)
    async with stack.ledger() as ledger:
        idle_at = await poll(lambda: idle(stack, ledger), last + config.converge_s_max, generator.now, 0.05)
        converge_s = None if idle_at is None else idle_at - last
        reservations = await ledger.reservations()
        events = await ledger.events()
        report = await reconcile(ledger, freeze=False)
        bucket_figures = await buckets(ledger, config, stack.spec.model, events)
    # A client that times out on a collected request reads nothing of an answer the gateway may have run
    # whole before it noticed: billed unread up to its ``max_tokens`` (the tap holds it to what ran).
    history = await check_stack(stack, generator.history.records, Bounds(overbilled_per_cut=config.output_tokens[1]))
    reserved = grouped(reservations, lambda r: (r.tenant, r.request_id))
    # A re-open (a retry of a request cancelled before it ran) is a ``reserve`` event counting no request.
    reserve_events = Counter(e.reservation_id for e in events if e.kind == "reserve" and e.requests)
    tapped = stack.is_tapped
    sequences = stack.tapped("sequences")
    rows = []
    for plan in todo:
        mine = reserved.get((plan.tenant, plan.request_id), [])
        first = mine[0] if mine else None
        seqs = sequences.get(plan.request_id, [])
        rows.append(
            IdFigures(
                plan,
                by_id[plan.request_id],
                len(mine),
                sum(reserve_events[r.id] for r in mine),
                first.status if first else None,
                first.billed.input_tokens if first else 0,
                first.billed.output_tokens if first else 0,
                len(seqs) if tapped else None,
                sum(s.generated for s in seqs) if tapped else None,
            )
        )
    return RetryFigures(
        options.policy,
        rows,
        bucket_figures,
        last - begin,
        converge_s,
        sum(1 for r in reservations if r.status == "open"),
        dict(Counter(r.status for r in reservations)),
        {t.tenant: t.differences for t in report.tenants if t.differences},
        sum(s.occupancy for s in await stack.replica_stats()),
        tapped,
        stack.untagged,
        generator.peak_in_flight,
        sdk_calls,
        history,
    )

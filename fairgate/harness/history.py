"""The history checker: what every client saw, request id by request id (``RequestRecord``: status, tokens
received, the usage it was sent, its error code), set beside what the ledger holds (reservations, the event
log, the accounts) and what the replicas counted themselves (``/emulator/stats``). ``check_history`` returns
a ``HistoryReport``: every discrepancy, typed and per request id, printable as a table.

What it holds the run to (each a ``Kind`` when it fails):

- ``reserved_twice``: at most one reservation per request id, with one ``reserve`` event (a reservation
  cancelled billing nothing may be reserved again by a retry: one ``reserve`` per life);
- ``ran_twice``: at most one attempt of a request id received tokens; and the replicas started no more
  sequences than request ids were admitted, plus one per attempt that received nothing because its gateway
  connection broke or the upstream failed it (that run delivered and billed nothing, and its retry runs it
  for the client once - the replica's lost time is the platform's);
- ``billed_twice``: at most one final event (``settle_final`` / ``cancel`` / ``expire``) per reservation, and
  the event log sums to the reservation's billed output (a settlement booked twice shows there);
- ``unbilled`` / ``overbilled``: billed output tokens = tokens the client received. Exact when every attempt
  of the id ended with a whole answer (or an HTTP error); for each attempt cut short (the client hung up, the
  connection broke, an error event ended the stream) the in-flight bound of ``Bounds`` is allowed: a gateway
  killed mid-stream leaves up to one partial-settlement interval delivered and unbilled
  (``SETTLE_EVERY_TOKENS``), and a client that hangs up has not read the last tokens the gateway billed;
- ``unreserved``: no token reaches a client without a reservation (the ledger must know the id);
- ``usage``: a whole answer's usage says what the client counted and what the ledger billed (input too);
- ``open``: no reservation open at the end; ``counters``: every account's concurrent and queued back to 0;
- ``unknown``: no reservation for a request id no client sent;
- ``replica_tokens``: the replicas generated no less than was billed (counts of a replica lost midway are a
  lower bound: this half is then skipped) and no more than billed + the in-flight bound per cut attempt +
  the ``max_tokens`` of each attempt the upstream failed before it received anything (refunded: the
  platform's failure is not the tenant's to pay);
  ``replica_busy``: nothing running or waiting on a replica at the end.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from fairgate.gateway.call import SETTLE_EVERY_TOKENS
from fairgate.harness.records import RequestRecord
from fairgate.ledger.emergency import late_base

if TYPE_CHECKING:
    from fairgate.harness.stack import Stack
    from fairgate.ledger import Event, Ledger, Reservation

FINAL_EVENTS = ("settle_final", "cancel", "expire")
CUT_OUTCOMES = ("cut", "connection", "stream", "client", "running")  # an attempt that ended without a whole answer


class Kind(StrEnum):
    """What differs (see the module docstring)."""

    RESERVED_TWICE = "reserved_twice"
    RAN_TWICE = "ran_twice"
    BILLED_TWICE = "billed_twice"
    UNBILLED = "unbilled"
    OVERBILLED = "overbilled"
    UNRESERVED = "unreserved"
    USAGE = "usage"
    OPEN = "open"
    COUNTERS = "counters"
    UNKNOWN = "unknown"
    REPLICA_TOKENS = "replica_tokens"
    REPLICA_BUSY = "replica_busy"


@dataclass(frozen=True)
class Bounds:
    """The in-flight bounds allowed per attempt cut short, in output tokens.

    ``unbilled_per_cut``: delivered but not billed (a gateway killed between partial settlements;
    ``fairgate.gateway.call.SETTLE_EVERY_TOKENS``). ``overbilled_per_cut``: billed but not read by a client
    that hung up (tokens on the wire or in the client's buffers when it closed the stream).
    """

    unbilled_per_cut: int = SETTLE_EVERY_TOKENS
    overbilled_per_cut: int = 8


@dataclass(frozen=True)
class ReplicaCounts:
    """One replica's own counts (``/emulator/stats``). ``complete``: read at the end of the run (False: the
    replica was lost and these are its last counts, a lower bound)."""

    name: str
    sequences_finished: int
    sequences_cancelled: int
    tokens_generated: int
    running: int
    waiting: int
    complete: bool = True

    @property
    def sequences(self) -> int:
        """Sequences it was sent: finished, cancelled, or still in its batch or queue."""
        return self.sequences_finished + self.sequences_cancelled + self.running + self.waiting


@dataclass(frozen=True)
class LedgerState:
    """What the ledger holds at the end: every reservation, the event log, and (tenant, model class) ->
    (concurrent, queued) of each account read."""

    reservations: tuple[Reservation, ...]
    events: tuple[Event, ...]
    accounts: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)


async def read_ledger_state(ledger: Ledger, tenants: Iterable[str], model_classes: Iterable[str]) -> LedgerState:
    """``ledger``'s reservations, events and the accounts of every tenant and model class given."""
    accounts = {}
    for tenant in tenants:
        for model_class in model_classes:
            account = await ledger.account(tenant, model_class)
            accounts[(tenant, model_class)] = (account.concurrent, account.queued)
    return LedgerState(tuple(await ledger.reservations()), tuple(await ledger.events()), accounts)


async def read_replica_counts(urls: Sequence[str]) -> list[ReplicaCounts]:
    """Every replica's counts now (``fairgate.harness.replica.read_replicas``; raises as it does)."""
    from fairgate.harness.replica import read_replicas

    return [replica_counts(f"replica-{i}", s) for i, s in enumerate(await read_replicas(urls))]


async def check_stack(
    stack: Stack,
    records: Sequence[RequestRecord],
    bounds: Bounds | None = None,
    lost: Sequence[tuple[int, ReplicaCounts]] = (),
    settle_s: float = 10.0,
) -> HistoryReport:
    """``check_history`` of a drill's ``records`` against ``stack``: its ledger once no reservation is open
    (waiting at most ``settle_s``: the gateways bill the last hang-ups and sweeps after the clients end) over
    every tenant and model class it serves, and its replicas' counts. ``lost``: (index, last counts) of each
    replica the drill killed (its counts a lower bound; it no longer answers). The replicas are not compared
    on a staggered stack (their pacer sequences, which no gateway sees, run on them) nor on real engines
    (no ``/emulator/stats``)."""
    from fairgate.gateway.aliases import served_models
    from fairgate.harness.ledger import wait_settled

    served = served_models(stack.config.models, stack.config.upstreams).values()
    classes = sorted({s.quota_class for s in served})
    async with stack.ledger() as ledger:
        await wait_settled(ledger, settle_s)
        state = await read_ledger_state(ledger, stack.spec.tenant_names, classes)
    if stack.spec.staggered or stack.spec.engine_urls:
        return check_history(records, state, None, bounds)
    gone = {index for index, _ in lost}
    alive = await read_replica_counts([r.url for i, r in enumerate(stack.replicas) if i not in gone])
    return check_history(records, state, [*(counts for _, counts in lost), *alive], bounds)


def replica_counts(name: str, stats: object, complete: bool = True) -> ReplicaCounts:
    """A ``ReplicaStats`` reading as ``ReplicaCounts``."""
    from fairgate.harness.replica import ReplicaStats

    assert isinstance(stats, ReplicaStats)
    return ReplicaCounts(
        name,
        stats.sequences_finished,
        stats.sequences_cancelled,
        stats.tokens_generated,
        stats.running,
        stats.waiting,
        complete,
    )


@dataclass(frozen=True)
class Discrepancy:
    """One thing that differs: its kind, whom it is about (a request id, ``tenant/model class``, a replica,
    or ``replicas``) and what differs."""

    kind: Kind
    subject: str
    detail: str


@dataclass(frozen=True)
class HistoryReport:
    """The checker's answer: request ids and attempts seen, reservations read, and every discrepancy."""

    requests: int
    attempts: int
    reservations: int
    discrepancies: tuple[Discrepancy, ...]

    @property
    def ok(self) -> bool:
        return not self.discrepancies

    def by_kind(self) -> dict[str, int]:
        return dict(sorted(Counter(d.kind.value for d in self.discrepancies).items()))

    def summary(self) -> str:
        """``0 discrepancies`` or e.g. ``3 (unbilled 2, open 1)``."""
        if self.ok:
            return "0 discrepancies"
        kinds = ", ".join(f"{k} {n}" for k, n in self.by_kind().items())
        return f"{len(self.discrepancies)} ({kinds})"

    def table(self, most: int = 40) -> str:
        """The discrepancies as a text table (the first ``most``)."""
        head = f"{self.requests} request ids, {self.attempts} attempts, {self.reservations} reservations: "
        if self.ok:
            return head + "0 discrepancies"
        rows = [("kind", "subject", "what differs")]
        rows += [(d.kind.value, d.subject, d.detail) for d in self.discrepancies[:most]]
        widths = [max(len(r[i]) for r in rows) for i in range(2)]
        lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}" for r in rows]
        more = len(self.discrepancies) - most
        return "\n".join([head + self.summary(), *lines] + ([f"... and {more} more"] if more > 0 else []))


def check_history(
    records: Sequence[RequestRecord],
    ledger: LedgerState,
    replicas: Sequence[ReplicaCounts] | None = None,
    bounds: Bounds | None = None,
) -> HistoryReport:
    """Compare every client's ``records`` (several attempts may share a request id) with ``ledger`` and the
    ``replicas``' counts (None: not compared). See the module docstring for what is checked. A request id is
    its tenant's (the ledger's key): a record counts for the tenant it names, the one it is to be billed to."""
    bounds = bounds or Bounds()
    attempts: dict[tuple[str, str], list[RequestRecord]] = defaultdict(list)
    for record in records:
        attempts[(record.tenant, record.request_id)].append(record)
    by_id: dict[tuple[str, str], list[Reservation]] = defaultdict(list)
    late: dict[tuple[str, str], list[Reservation]] = defaultdict(list)
    for r in ledger.reservations:
        base = late_base(r.request_id)
        (late if base != r.request_id else by_id)[(r.tenant, base)].append(r)
    events: dict[str, list[Event]] = defaultdict(list)
    for e in ledger.events:
        events[e.reservation_id].append(e)
    out: list[Discrepancy] = []
    for (_, rid), tried in attempts.items():
        key = (tried[0].tenant, rid)
        out += _check_id(rid, tried, by_id.get(key, []), events, bounds, late.get(key, []))
    out += [
        Discrepancy(Kind.UNKNOWN, f"{tenant}/{rid}", f"{len(found)} reservation(s) no client sent ({found[0].status})")
        for (tenant, rid), found in [*by_id.items(), *late.items()]
        if (tenant, rid) not in attempts
    ]
    out += [
        Discrepancy(Kind.COUNTERS, f"{tenant}/{model_class}", f"concurrent {concurrent}, queued {queued} (want 0, 0)")
        for (tenant, model_class), (concurrent, queued) in sorted(ledger.accounts.items())
        if concurrent or queued
    ]
    if replicas is not None:
        cuts = sum(1 for r in records if r.outcome in CUT_OUTCOMES)
        # Runs that delivered nothing and were not billed (the gateway died, or the upstream failed the call):
        # a retry of the id runs it again, once for the client.
        lost = sum(1 for r in records if r.tokens == 0 and (r.outcome == "connection" or r.code == "upstream_error"))
        refunded = sum(r.max_tokens for r in records if r.tokens == 0 and r.code == "upstream_error")
        out += _check_replicas(replicas, ledger.reservations, len(by_id) + lost, cuts, bounds, refunded)
    return HistoryReport(len(attempts), len(records), len(ledger.reservations), tuple(out))


def _check_id(
    rid: str,
    tried: list[RequestRecord],
    found: list[Reservation],
    events: dict[str, list[Event]],
    bounds: Bounds,
    late: Sequence[Reservation] = (),
) -> list[Discrepancy]:
    """One request id: its attempts against its reservations and their events; ``late``: the reservations that
    bill what its reservation missed once closed (counted in what it billed)."""
    out: list[Discrepancy] = []

    def flag(kind: Kind, detail: str) -> None:
        out.append(Discrepancy(kind, rid, detail))

    if len(found) > 1:
        flag(Kind.RESERVED_TWICE, f"{len(found)} reservations ({', '.join(r.status for r in found)})")
    ran = [a for a in tried if a.tokens > 0]
    if len(ran) > 1:
        flag(Kind.RAN_TWICE, "attempts received tokens: " + ", ".join(f"{a.target} {a.tokens}" for a in ran))
    for r in found:
        out += [Discrepancy(k, rid, d) for k, d in _check_events(r, events.get(r.id, []))]
        if r.status == "open":
            flag(Kind.OPEN, f"reservation open at the end (billed {r.billed.output_tokens} output tokens)")
    for r in late:
        out += [Discrepancy(k, r.request_id, d) for k, d in _check_events(r, events.get(r.id, []))]
    received = sum(a.tokens for a in tried)
    billed = sum(r.billed.output_tokens for r in [*found, *late])
    if received and not found:
        flag(Kind.UNRESERVED, f"client received {received} tokens, the ledger has no reservation")
        return out
    cut = sum(1 for a in tried if a.outcome in CUT_OUTCOMES)
    statuses = "/".join(r.status for r in found)
    seen = f"client received {received} ({_outcomes(tried)}), billed {billed} ({statuses})"
    if received - billed > bounds.unbilled_per_cut * cut:
        flag(Kind.UNBILLED, f"{seen}: {received - billed} unbilled (bound {bounds.unbilled_per_cut * cut})")
    if billed - received > bounds.overbilled_per_cut * cut:
        flag(Kind.OVERBILLED, f"{seen}: {billed - received} over (bound {bounds.overbilled_per_cut * cut})")
    for a in tried:
        if a.outcome == "ok" and a.usage_output is not None and a.usage_output != a.tokens:
            flag(Kind.USAGE, f"{a.target}: usage says {a.usage_output} output tokens, the client counted {a.tokens}")
        billed_input = found[0].billed.input_tokens if len(found) == 1 else None
        if a.outcome == "ok" and a.usage_input is not None and billed_input not in (None, a.usage_input):
            flag(Kind.USAGE, f"{a.target}: usage says {a.usage_input} input tokens, billed {billed_input}")
    return out


def _check_events(r: Reservation, events: list[Event]) -> list[tuple[Kind, str]]:
    """One reservation's event log: one reserve and at most one final event per life, deltas summing to what
    it billed. A reservation cancelled having billed nothing (it never ran, or the platform failed it) may be
    reserved again by a retry of its id (``Ledger.reserve``): each earlier life must end so, billing 0."""
    out = []
    lives: list[list[Event]] = []
    for e in events:
        if e.kind == "reserve" or not lives:
            lives.append([])
        lives[-1].append(e)
    for life in lives[:-1]:
        billed = sum(e.input_tokens + e.output_tokens + e.gpu_ms for e in life)
        if life[-1].kind != "cancel" or billed:
            kinds = ", ".join(e.kind for e in life)
            out.append(
                (Kind.RESERVED_TWICE, f"reservation {r.id[-8:]}: reserved again after {kinds} (billed {billed})")
            )
    last = Counter(e.kind for e in lives[-1]) if lives else Counter()
    if last["reserve"] != 1:
        out.append((Kind.RESERVED_TWICE, f"reservation {r.id[-8:]}: {last['reserve']} reserve events"))
    finals = sum(last[k] for k in FINAL_EVENTS)
    if finals > 1 or (finals == 0 and r.is_final):
        described = ", ".join(f"{k} {last[k]}" for k in FINAL_EVENTS if last[k])
        out.append((Kind.BILLED_TWICE, f"reservation {r.id[-8:]} ({r.status}): final events: {described or 'none'}"))
    logged = sum(e.output_tokens for e in events)
    if logged != r.billed.output_tokens:
        detail = f"reservation {r.id[-8:]}: events sum to {logged} output tokens, billed {r.billed.output_tokens}"
        out.append((Kind.BILLED_TWICE, detail))
    return out


def _check_replicas(
    replicas: Sequence[ReplicaCounts],
    reservations: Sequence[Reservation],
    admitted: int,
    cuts: int,
    bounds: Bounds,
    refunded: int = 0,
) -> list[Discrepancy]:
    """The replicas' own counts against the ledger's: sequences per admitted id, tokens generated against billed
    (beyond which ``refunded`` tokens at most: what calls the upstream failed before the client received
    anything may have generated, which the tenant does not pay)."""
    out = []
    sequences = sum(r.sequences for r in replicas)
    if sequences > admitted:
        out.append(
            Discrepancy(
                Kind.RAN_TWICE, "replicas", f"{sequences} sequences started for {admitted} request ids admitted"
            )
        )
    generated = sum(r.tokens_generated for r in replicas)
    billed = sum(r.billed.output_tokens for r in reservations)
    complete = all(r.complete for r in replicas)
    if complete and generated < billed:
        out.append(
            Discrepancy(Kind.REPLICA_TOKENS, "replicas", f"generated {generated} output tokens, billed {billed}")
        )
    if generated > billed + bounds.unbilled_per_cut * cuts + refunded:
        bound = f"bound {bounds.unbilled_per_cut} x {cuts} cut + {refunded} refunded"
        out.append(
            Discrepancy(
                Kind.REPLICA_TOKENS, "replicas", f"generated {generated} output tokens, billed {billed} ({bound})"
            )
        )
    for r in replicas:
        if r.complete and (r.running or r.waiting):
            out.append(Discrepancy(Kind.REPLICA_BUSY, r.name, f"running {r.running}, waiting {r.waiting} at the end"))
    return out


def _outcomes(tried: list[RequestRecord]) -> str:
    return ", ".join(f"{a.target}:{a.error or a.outcome}{'@' + str(a.tokens) if a.tokens else ''}" for a in tried)


__all__ = [
    "Bounds",
    "Discrepancy",
    "HistoryReport",
    "Kind",
    "LedgerState",
    "ReplicaCounts",
    "check_history",
    "check_stack",
    "read_ledger_state",
    "read_replica_counts",
    "replica_counts",
]

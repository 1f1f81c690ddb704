"""Drill ``capacity`` (seed 003: "simulate ... shared pool capacity reduction ... confirm that batch tasks
actually yield resources"): one of two upstreams is removed mid-load. Batch yields first,
interactive tenants keep their weighted shares, and no request is lost without an error to its client.

Two interactive tenants with weights 2 : 1 (``gold``, ``silver``) and a batch tenant (``bulk``, priority pool
``batch``) send closed loop (each client its next request as soon as one ends) to two emulated replicas, run
as ``fairgate emulate`` processes. The interactive tenants together want more than one replica but less than
two: with both replicas up they get everything they ask (24 : 12 clients, their weight ratio) and the batch
tenant, whose queue in the gateway stays full, the slots they leave. At ``remove_at_s`` one replica is killed
(SIGKILL: a crash, its streams cut mid-way) and ``silver``'s demand rises to ``gold``'s (12 more clients): from
then on demand alone (FIFO) would split what is left 1 : 1, the weights 2 : 1. Then:

- **batch yields first**: the batch tenant's share of the GPU billed in the ledger after the removal (from
  ``remove_at_s + converge_s_max`` on) is at most ``batch_share_after_max``, against what it had before;
  nothing running is preempted, so it keeps the slots it holds until those requests end: the time that takes
  (the *time to converge*: from the kill until the batch tenant's share of the surviving replica's GPU stays
  at most ``batch_share_after_max``, from the replica's own charge rule sampled every ``sample_s``) is
  reported and must be within ``converge_s_max``;
- **interactive tenants keep their weighted shares**: the capacity left is less than they want, so the fair
  policy splits it by weight: ``gold``'s GPU over ``silver``'s after the removal is 2 within
  ``ratio_tolerance`` (10 %). Before the removal their usage follows their demand (24 : 12 by default; an
  equal-demand variant, 20 : 20, is in ``tests/drills/test_capacity.py``);
- **nothing is lost**: every request a client sent ended in a success or an explicit error (HTTP 502, or an
  error event inside a stream that was cut with the replica) - the clients wait up to ``drain_s`` after the
  load for the requests still queued, so a request that hangs shows as ``cut``; every reservation is final
  once the gateway has billed the ends (no open reservation, every account's concurrency back to 0); the
  ledger's settled reservations are the successes and its cancelled ones the errors, one for one.

The replicas are time-scaled (40 ms iterations) and outputs short (20-60 tokens), so the token stream stays
small for a two-core machine, and the batch tenant's running requests end within a few seconds of the kill.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field, replace
from typing import Any

from fairgate.drills import DrillOptions
from fairgate.drills.report import (
    Cells,
    ComparedResult,
    cell_table,
    fmt_errors,
    history_check,
    history_lines,
    holds_from,
    main_and_compare,
)
from fairgate.harness.config import TenantSpec
from fairgate.harness.history import HistoryReport, ReplicaCounts, check_stack, replica_counts
from fairgate.harness.ledger import LedgerReport, RequestOutcomes, ledger_totals, wait_settled
from fairgate.harness.loadgen import LoadGenerator, TenantLoad
from fairgate.harness.records import History
from fairgate.harness.replica import ReplicaModel, read_replica
from fairgate.harness.run import until
from fairgate.harness.stack import Stack, StackSpec, replicas, start_stack

SETTLE_S_MAX = 15.0


@dataclass(frozen=True)
class CapacityConfig:
    """The drill's setting."""

    seconds: float = 34.0  # the load
    remove_at_s: float = 10.0  # when one replica is killed
    warmup_s: float = 4.0  # the start of the load left out of the shares before the removal
    replicas: int = 2  # the emulated fleet (``fairgate emulate`` processes)
    replica: ReplicaModel = field(default_factory=lambda: ReplicaModel(40.0, 1.0, 0.05, 24, 4096))
    # the interactive tenants and their weights
    weights: dict[str, float] = field(default_factory=lambda: {"gold": 2.0, "silver": 1.0})
    batch: str = "bulk"  # the batch tenant
    # closed-loop clients per tenant. The default gives the interactive tenants demand in their weight ratio
    # (24 : 12), together 36 requests: less than two replicas' 48 slots, more than one's 24.
    clients: dict[str, int] = field(default_factory=lambda: {"gold": 24, "silver": 12, "bulk": 40})
    # more closed-loop clients per tenant from the removal on (default: ``silver`` doubles to 24, as many as
    # ``gold``: from then on demand alone would split the capacity 1 : 1, the weights 2 : 1)
    surge: dict[str, int] = field(default_factory=lambda: {"silver": 12})
    output_tokens: tuple[int, int] = (20, 60)  # every request's length (uniform range)
    prompt_tokens: int = 64
    kill_signal: int = signal.SIGKILL  # how the replica is removed (SIGKILL: a crash; SIGTERM: a shutdown)
    # the claim: the batch tenant has yielded within this long of the removal; the shares after the
    # removal are those billed from then on
    converge_s_max: float = 8.0
    batch_share_after_max: float = 0.05  # the claim: the batch tenant's share of the GPU after the removal
    ratio_tolerance: float = 0.10  # the claim: the interactive tenants' GPU ratio within this of their weight ratio
    drain_s: float = 20.0  # after the load, how long the clients wait for the requests still queued or running
    sample_s: float = 0.5  # how often the replicas' own charge-rule totals are read (the convergence timeline)
    error_backoff_s: float = 0.5  # a client that got an error waits this long before its next request

    def __post_init__(self) -> None:
        if self.replicas < 2:
            raise ValueError("capacity drill: needs at least two replicas (one is removed)")
        if self.remove_at_s < self.warmup_s + 3.0:
            raise ValueError(
                f"capacity drill: the removal at {self.remove_at_s:g} s leaves under 3 s after the "
                f"{self.warmup_s:g} s warm-up"
            )
        if set(self.clients) != set(self.tenants) or not set(self.surge) <= set(self.tenants):
            raise ValueError(
                f"capacity drill: clients must name every tenant ({', '.join(self.tenants)}), surge only those"
            )
        if self.seconds < self.remove_at_s + self.converge_s_max + 5.0:
            raise ValueError(
                f"capacity drill: {self.seconds:g} s leaves under 5 s after the removal at "
                f"{self.remove_at_s:g} s and the {self.converge_s_max:g} s allowed to converge"
            )

    @property
    def interactive(self) -> tuple[str, ...]:
        return tuple(self.weights)

    @property
    def tenants(self) -> tuple[str, ...]:
        return (*self.interactive, self.batch)

    @property
    def after_from_s(self) -> float:
        return self.remove_at_s + self.converge_s_max

    def weight_ratio(self) -> float:
        """The first interactive tenant's weight over the last's."""
        first, last = self.interactive[0], self.interactive[-1]
        return self.weights[first] / self.weights[last]

    def spec(self, policy: str, processes: bool) -> StackSpec:
        tenants = (*(TenantSpec(t, w) for t, w in self.weights.items()), TenantSpec(self.batch, priority="batch"))
        # The replicas are processes: one is killed.
        return StackSpec(tenants, policy, replicas(self.replicas), self.replica, True, processes, share_charges_s=0.0)

    def loads(self) -> list[TenantLoad]:
        lengths: dict[str, Any] = {"output_tokens": self.output_tokens, "prompt_tokens": self.prompt_tokens}
        loads = [TenantLoad(t, clients=self.clients[t], error_backoff_s=self.error_backoff_s) for t in self.tenants]
        surge = [
            TenantLoad(t, clients=n, start_s=self.remove_at_s, error_backoff_s=self.error_backoff_s)
            for t, n in self.surge.items()
            if n > 0
        ]
        return [replace(load, **lengths) for load in (*loads, *surge)]


@dataclass(frozen=True)
class TenantFigures:
    tenant: str
    share_before: float  # of the GPU billed from warmup_s to remove_at_s
    share_after: float  # ... from after_from_s to the end of the load
    truth_before: float  # the same windows by the replicas' own charge rule
    truth_after: float
    requests: RequestOutcomes  # what its clients saw, its reservations in the ledger after the drain
    concurrent_at_end: int  # the ledger account's concurrency after the drain


# The columns of a run's table, a row per tenant.
TENANT_CELLS: Cells[TenantFigures] = (
    ("tenant", lambda t: t.tenant),
    ("GPU % before", lambda t: f"{t.share_before * 100:.1f}"),
    ("GPU % after", lambda t: f"{t.share_after * 100:.1f}"),
    ("replica GPU % before/after", lambda t: f"{t.truth_before * 100:.1f} / {t.truth_after * 100:.1f}"),
    ("sent/ok/cut", lambda t: f"{t.requests.sent}/{t.requests.ok}/{t.requests.cut}"),
    ("errors", lambda t: fmt_errors(t.requests.errors)),
    ("ledger settled/cancelled/open", lambda t: f"{t.requests.settled}/{t.requests.cancelled}/{t.requests.open}"),
)


@dataclass(frozen=True)
class CapacityFigures:
    policy: str
    tenants: dict[str, TenantFigures]
    removed: str  # the replica killed
    killed_at_s: float
    converge_s: float | None  # from the kill until the batch tenant's share of the survivors stayed low
    timeline: list[tuple[float, dict[str, float]]]  # (s since start, tenant -> share of the GPU in the window)
    ledger_gpu_s: dict[str, float]  # before / after windows, billed
    wall_s: float
    settle_s: float  # after the drain, until no reservation was open
    history: HistoryReport  # the history checker: every request id against the ledger and the replicas

    def ratio(self, config: CapacityConfig, before: bool = False) -> float:
        """The first interactive tenant's GPU share over the last's, after (or ``before``) the removal."""
        first, last = (self.tenants[t] for t in (config.interactive[0], config.interactive[-1]))
        high, low = (first.share_before, last.share_before) if before else (first.share_after, last.share_after)
        return high / low if low > 0 else float("inf")

    @property
    def sent(self) -> int:
        return sum(t.requests.sent for t in self.tenants.values())

    @property
    def errors(self) -> int:
        return sum(sum(t.requests.errors.values()) for t in self.tenants.values())


def lost_requests(t: TenantFigures) -> list[str]:
    """Why some of ``t``'s requests are not accounted for (empty: each ended in a success or an explicit error
    to its client, and the ledger agrees). A transport error (``connection``: the client never got an HTTP
    answer) is explicit to the client but leaves no reservation."""
    out, r = [], t.requests
    transport = r.errors.get("connection", 0)
    if r.cut:
        out.append(f"{r.cut} requests still unanswered after the drain")
    if r.open or t.concurrent_at_end:
        out.append(f"{r.open} reservations open, account concurrency {t.concurrent_at_end} at the end")
    if r.reservations != r.sent - transport:
        out.append(f"{r.sent} sent ({transport} transport errors) but {r.reservations} reservations")
    if r.settled != r.ok:
        out.append(f"{r.ok} successes but {r.settled} settled reservations")
    if r.cancelled != sum(r.errors.values()) - transport:
        out.append(
            f"{sum(r.errors.values()) - transport} errors after admission but {r.cancelled} cancelled reservations"
        )
    return out


@dataclass(frozen=True)
class CapacityRun:
    """What one run saw; the ledger's ``reservations`` and ``concurrent`` are those at the end."""

    history: History
    snapshots: dict[str, LedgerReport]  # "warm", "removal", "after" (after_from_s), "end"
    samples: list[tuple[float, dict[str, float]]]  # (s, tenant -> the replicas' cumulative charge-rule ms)
    killed_at_s: float
    reservations: list[Any]
    concurrent: dict[str, int]
    settle_s: float  # how long the last bills took
    history_check: HistoryReport  # the history checker's report


def run_capacity(
    config: CapacityConfig, policy: str = "gpu_fair", processes: bool = False, seed: int = 1
) -> CapacityFigures:
    """One run on a fresh stack: replicas as processes (one is killed), the gateway in this process (or as a
    process with ``processes``), an SQLite ledger in a temporary folder."""
    started = time.monotonic()
    with start_stack(config.spec(policy, processes)) as stack:
        run = asyncio.run(_run(stack, config, seed))
    return capacity_figures(config, policy, run, f"emu-{config.replicas - 1}", time.monotonic() - started)


async def _run(stack: Stack, config: CapacityConfig, seed: int) -> CapacityRun:
    victim = stack.replicas[-1].process
    assert victim is not None
    snapshots: dict[str, LedgerReport] = {}
    samples: list[tuple[float, dict[str, float]]] = []
    killed_at: list[float] = []
    lost: list[tuple[int, ReplicaCounts]] = []  # the killed replica's last counts
    async with stack.ledger() as ledger:
        async with LoadGenerator(stack.url, stack.keys, stack.spec.model, seed) as generator:

            async def snapshot(name: str, at_s: float) -> None:
                await until(generator, at_s)
                snapshots[name] = await ledger_totals(ledger, config.tenants)

            async def remove() -> None:
                await snapshot("removal", config.remove_at_s)
                killed_at.append(generator.now())
                last = await read_replica(stack.replicas[-1].url, timeout_s=1.0)
                await asyncio.to_thread(victim.kill, config.kill_signal)
                if last is not None:
                    lost.append((len(stack.replicas) - 1, replica_counts("killed", last, complete=False)))

            async def sample() -> None:
                """Each replica's own charge-rule totals per tenant (a dead replica keeps its last)."""
                last: dict[int, dict[str, float]] = {}
                while generator.now() < config.seconds:
                    for i, replica in enumerate(stack.replicas):
                        alive = replica.process is not None and replica.process.alive
                        stats = await read_replica(replica.url, timeout_s=1.0) if alive else None
                        if stats is not None:
                            last[i] = stats.by_tenant(config.tenants)
                    samples.append(
                        (generator.now(), {t: sum(v.get(t, 0.0) for v in last.values()) for t in config.tenants})
                    )
                    await asyncio.sleep(config.sample_s)

            timed = [snapshot("warm", config.warmup_s), snapshot("after", config.after_from_s)]
            timed += [snapshot("end", config.seconds - 0.05), remove(), sample()]
            tasks = [asyncio.ensure_future(t) for t in timed]
            history = await generator.run(config.loads(), config.seconds, config.drain_s)
            await asyncio.gather(*tasks)
        settle_s = await wait_settled(ledger, SETTLE_S_MAX)
        reservations = await ledger.reservations()
        concurrent = {t: (await ledger.account(t, stack.spec.model)).concurrent for t in config.tenants}
    report = await check_stack(stack, history.records, lost=lost)
    kill_s = killed_at[0] if killed_at else config.remove_at_s
    return CapacityRun(history, snapshots, samples, kill_s, reservations, concurrent, settle_s, report)


def capacity_figures(
    config: CapacityConfig, policy: str, run: CapacityRun, removed: str, wall_s: float
) -> CapacityFigures:
    before = run.snapshots["removal"].minus(run.snapshots["warm"])
    after = run.snapshots["end"].minus(run.snapshots["after"])
    timeline = _windows(run.samples, 1.0)
    truth_before = _between(run.samples, config.warmup_s, run.killed_at_s)
    truth_after = _between(run.samples, config.after_from_s, config.seconds)
    share_before, share_after = before.shares(), after.shares()
    tenants = {}
    for tenant in config.tenants:
        mine = [r for r in run.reservations if r.tenant == tenant]
        tenants[tenant] = TenantFigures(
            tenant,
            share_before.get(tenant, 0.0),
            share_after.get(tenant, 0.0),
            truth_before.get(tenant, 0.0),
            truth_after.get(tenant, 0.0),
            RequestOutcomes.of(run.history.stats(tenant), mine),
            run.concurrent[tenant],
        )
    return CapacityFigures(
        policy,
        tenants,
        removed,
        run.killed_at_s,
        _converged(timeline, run.killed_at_s, config.batch, config.batch_share_after_max),
        timeline,
        {"before": before.gpu_ms / 1000.0, "after": after.gpu_ms / 1000.0},
        wall_s,
        run.settle_s,
        run.history_check,
    )


def _windows(samples: list[tuple[float, dict[str, float]]], width_s: float) -> list[tuple[float, dict[str, float]]]:
    """(end of window, tenant -> share of the GPU charged in the ``width_s`` before it) from cumulative
    per-tenant samples."""
    out = []
    start = 0
    for end in range(len(samples)):
        while start < end and samples[end][0] - samples[start + 1][0] >= width_s:
            start += 1
        if start == end:
            continue
        at, now = samples[end]
        _, then = samples[start]
        delta = {t: now[t] - then.get(t, 0.0) for t in now}
        total = sum(delta.values())
        if total > 0:
            out.append((at, {t: d / total for t, d in delta.items()}))
    return out


def _between(samples: list[tuple[float, dict[str, float]]], start_s: float, end_s: float) -> dict[str, float]:
    """Tenant -> share of the GPU charged between the first sample at or after ``start_s`` and the last at or
    before ``end_s`` (cumulative per-tenant samples); empty if there are not two such samples."""
    inside = [(at, totals) for at, totals in samples if start_s <= at <= end_s]
    if len(inside) < 2:
        return {}
    (_, first), (_, last) = inside[0], inside[-1]
    delta = {t: last[t] - first.get(t, 0.0) for t in last}
    total = sum(delta.values())
    return {t: (d / total if total > 0 else 0.0) for t, d in delta.items()}


def _converged(
    timeline: list[tuple[float, dict[str, float]]], kill_s: float, batch: str, share_max: float
) -> float | None:
    """Seconds from the kill until the batch tenant's windowed share stays at most ``share_max`` (None:
    it never did, to the end of the load)."""
    since = holds_from((at, shares.get(batch, 0.0) <= share_max) for at, shares in timeline if at >= kill_s)
    return None if since is None else max(0.0, since - kill_s)


def capacity_checks(c: CapacityConfig, figs: CapacityFigures) -> dict[str, bool]:
    """Each part of the claim for one run's figures."""
    batch = figs.tenants[c.batch]
    target = c.weight_ratio()
    lost = [t.tenant for t in figs.tenants.values() if lost_requests(t)]
    share_max = c.batch_share_after_max
    return {
        f"batch had a share before the removal (> {share_max:.0%})": batch.share_before > share_max,
        f"batch yields: <= {share_max:.0%} of the GPU after the removal": batch.share_after <= share_max,
        f"batch yielded within {c.converge_s_max:g} s of the removal": figs.converge_s is not None
        and figs.converge_s <= c.converge_s_max,
        f"interactive GPU ratio after the removal {target:g} within {c.ratio_tolerance:.0%}": abs(
            figs.ratio(c) / target - 1.0
        )
        <= c.ratio_tolerance,
        "every request got a success or an explicit error (none cut, none open, counts match the ledger)": not lost,
        "the removal cut requests (the fault was real)": figs.errors > 0,
    } | history_check(figs.history, "the killed replica's counts a lower bound; its cut streams billed as received")


@dataclass(frozen=True)
class CapacityResult(ComparedResult[CapacityConfig, CapacityFigures]):
    name: str = "capacity"

    def checks(self) -> dict[str, bool]:
        return capacity_checks(self.config, self.main)

    def intro(self) -> list[str]:
        c = self.config
        interactive = ", ".join(
            f"{t} (weight {w:g}, {c.clients[t]} clients"
            + (f", +{c.surge[t]} from the removal" if c.surge.get(t) else "")
            + ")"
            for t, w in c.weights.items()
        )
        return [
            f"[bold]drill capacity[/bold]: {interactive} interactive and {c.batch} (batch pool, {c.clients[c.batch]} "
            f"clients), all sending closed loop to {c.replicas} emulated replica processes x {c.replica.max_batch} "
            f"slots; at {c.remove_at_s:g} s one replica is killed ({signal.Signals(c.kill_signal).name}); "
            f"{c.seconds:g} s of load, then up to {c.drain_s:g} s for the requests still queued.",
            f"Claim: after the removal {c.batch} yields (<= {c.batch_share_after_max:.0%} of the GPU billed from "
            f"{c.after_from_s:g} s, within {c.converge_s_max:g} s), the interactive tenants split what is left "
            f"{c.weight_ratio():g} : 1 (+-{c.ratio_tolerance:.0%}), and every request ends in a success or an "
            "explicit error.",
        ]

    def body(self) -> list[Any]:
        out = super().body()
        if self.compare is not None:
            failed = [check for check, ok in capacity_checks(self.config, self.compare).items() if not ok]
            out.append(
                f"  comparison {self.compare.policy}: " + ("holds" if not failed else "fails: " + "; ".join(failed))
            )
        return out + history_lines(self.main.history)

    def policy_table(self, figs: CapacityFigures) -> Any:
        c = self.config
        converge = "never" if figs.converge_s is None else f"{figs.converge_s:.1f} s"
        tenants = figs.tenants.values()
        caption = (
            f"{figs.removed} killed at {figs.killed_at_s:.1f} s; the ledger billed {figs.ledger_gpu_s['before']:,.1f} "
            f"GPU s before it ({c.warmup_s:g}-{c.remove_at_s:g} s), {figs.ledger_gpu_s['after']:,.1f} after "
            f"({c.after_from_s:g}-{c.seconds:g} s). Interactive ratio {figs.ratio(c, before=True):.2f} before "
            f"(uncontended), {figs.ratio(c):.2f} after (weights {c.weight_ratio():g}). Load held: {figs.sent} "
            f"requests; faults injected: 1 replica removed; lost: {sum(t.requests.cut for t in tenants)} hung, "
            f"{sum(t.requests.open for t in tenants)} open reservations ({figs.errors} requests ended in an explicit "
            f"error); converged (batch yielded) {converge} after the removal; reservations all final "
            f"{figs.settle_s:.1f} s after the drain; wall {figs.wall_s:.0f} s."
        )
        return cell_table(self.title(figs), TENANT_CELLS, tenants, caption, wrap=())

    def verdict(self) -> str:
        c, batch = self.config, self.main.tenants[self.config.batch]
        return (
            f"under {self.main.policy} {c.batch} went from {batch.share_before:.1%} to {batch.share_after:.1%} of the "
            f"GPU, the interactive ratio is {self.main.ratio(c):.2f} (weights {c.weight_ratio():g}), "
            f"{self.main.errors} explicit errors, nothing lost."
        )


def run(options: DrillOptions, config: CapacityConfig | None = None) -> CapacityResult:
    """Run the drill under ``options.policy`` (and ``options.compare``, if any). ``options.seconds`` sets the
    load's length (the removal stays at ``remove_at_s``)."""
    config = options.setting(config or CapacityConfig())
    runs = main_and_compare(
        options, lambda policy: run_capacity(config, policy, options.in_processes(False), options.seed)
    )
    return CapacityResult(config, *runs)

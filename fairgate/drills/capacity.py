"""Drill ``capacity`` (seed 003: "simulate ... shared pool capacity reduction ... confirm that batch tasks
actually yield resources"; issue 6): one of two upstreams is removed mid-load. Batch yields first,
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
  ``ratio_tolerance`` (10 %). Before the removal their usage follows their demand (24 : 12 by default; the
  equal-demand variant in ``tests/drills/test_capacity.py``, 20 : 20, found ``gpu_fair`` banking the unused
  weighted share of a tenant that ran but was not backlogged - gold then took 3-7x silver's GPU for ~30 s
  after the removal; now lifted to the virtual time, ``fairgate.core.policies.counters``);
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
import shutil
import signal
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fairgate.drills import CheckedResult, DrillOptions, fmt_errors
from fairgate.drills.loadgen import LoadReport, TenantLoad, run_load
from fairgate.drills.scale_out import (
    Child,
    ReplicaTruth,
    TenantEntry,
    UpstreamEntry,
    by_tenant,
    children,
    emulator_spec,
    gateway_config_text,
    gateway_spec,
    read_replica,
    tenant_keys,
    wait_settled,
)
from fairgate.drills.stack import LedgerReport, ReplicaModel, TenantTotals, serve_in_thread

SETTLE_S_MAX = 15.0


@dataclass(frozen=True)
class CapacityConfig:
    """The drill's setting.

    Attributes:
        seconds: the load; ``remove_at_s``: when one replica is killed; ``warmup_s``: the start of the load
            left out of the shares before the removal.
        replicas / replica: the emulated fleet (``fairgate emulate`` processes).
        weights: the interactive tenants and their weights; ``batch``: the batch tenant.
        clients: closed-loop clients per tenant. The default gives the interactive tenants demand in their
            weight ratio (24 : 12), together 36 requests: less than two replicas' 48 slots, more than one's 24.
        surge: more closed-loop clients per tenant from the removal on (default: ``silver`` doubles to 24, as
            many as ``gold``: from then on demand alone would split the capacity 1 : 1, the weights 2 : 1).
        output_tokens / prompt_tokens: every request's length (uniform range) and prompt.
        kill_signal: how the replica is removed (SIGKILL: a crash; SIGTERM: a shutdown).
        converge_s_max: the claim: the batch tenant has yielded within this long of the removal; the shares
            after the removal are those billed from then on.
        batch_share_after_max: the claim: the batch tenant's share of the GPU after the removal.
        ratio_tolerance: the claim: the interactive tenants' GPU ratio within this of their weight ratio.
        drain_s: after the load, how long the clients wait for the requests still queued or running.
        sample_s: how often the replicas' own charge-rule totals are read (the convergence timeline).
        error_backoff_s: a client that got an error waits this long before its next request.
    """

    seconds: float = 34.0
    remove_at_s: float = 10.0
    warmup_s: float = 4.0
    replicas: int = 2
    replica: ReplicaModel = field(
        default_factory=lambda: ReplicaModel(
            iter_base_ms=40.0, iter_slope_ms=1.0, prefill_ms_per_token=0.05, max_batch=24, max_model_len=4096
        )
    )
    weights: dict[str, float] = field(default_factory=lambda: {"gold": 2.0, "silver": 1.0})
    batch: str = "bulk"
    clients: dict[str, int] = field(default_factory=lambda: {"gold": 24, "silver": 12, "bulk": 40})
    surge: dict[str, int] = field(default_factory=lambda: {"silver": 12})
    output_tokens: tuple[int, int] = (20, 60)
    prompt_tokens: int = 64
    kill_signal: int = signal.SIGKILL
    converge_s_max: float = 8.0
    batch_share_after_max: float = 0.05
    ratio_tolerance: float = 0.10
    drain_s: float = 20.0
    sample_s: float = 0.5
    error_backoff_s: float = 0.5

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

    def tenant_entries(self) -> list[TenantEntry]:
        return [TenantEntry(t, weight=w) for t, w in self.weights.items()] + [TenantEntry(self.batch, priority="batch")]

    def loads(self, keys: dict[str, str]) -> list[TenantLoad]:
        common = {
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "error_backoff_s": self.error_backoff_s,
        }
        loads = [TenantLoad(t, keys[t], clients=self.clients[t], **common) for t in self.tenants]
        return loads + [
            TenantLoad(t, keys[t], clients=n, start_s=self.remove_at_s, **common)
            for t, n in self.surge.items()
            if n > 0
        ]


@dataclass(frozen=True)
class TenantFigures:
    tenant: str
    share_before: float  # of the GPU billed from warmup_s to remove_at_s
    share_after: float  # ... from after_from_s to the end of the load
    truth_before: float  # the same windows by the replicas' own charge rule
    truth_after: float
    sent: int
    ok: int
    cut: int
    errors: dict[str, int]
    reservations: int
    settled: int
    cancelled: int
    open_at_end: int
    concurrent_at_end: int  # the ledger account's concurrency after the drain


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

    def ratio_after(self, config: CapacityConfig) -> float:
        first, last = config.interactive[0], config.interactive[-1]
        low = self.tenants[last].share_after
        return self.tenants[first].share_after / low if low > 0 else float("inf")

    def ratio_before(self, config: CapacityConfig) -> float:
        first, last = config.interactive[0], config.interactive[-1]
        low = self.tenants[last].share_before
        return self.tenants[first].share_before / low if low > 0 else float("inf")

    def truth_ratio_after(self, config: CapacityConfig) -> float:
        first, last = config.interactive[0], config.interactive[-1]
        low = self.tenants[last].truth_after
        return self.tenants[first].truth_after / low if low > 0 else float("inf")

    @property
    def sent(self) -> int:
        return sum(t.sent for t in self.tenants.values())

    @property
    def errors(self) -> int:
        return sum(sum(t.errors.values()) for t in self.tenants.values())


def lost_requests(t: TenantFigures) -> list[str]:
    """Why some of ``t``'s requests are not accounted for (empty: each ended in a success or an explicit error
    to its client, and the ledger agrees). A transport error (``connection``: the client never got an HTTP
    answer) is explicit to the client but leaves no reservation."""
    out = []
    transport = t.errors.get("connection", 0)
    if t.cut:
        out.append(f"{t.cut} requests still unanswered after the drain")
    if t.open_at_end or t.concurrent_at_end:
        out.append(f"{t.open_at_end} reservations open, account concurrency {t.concurrent_at_end} at the end")
    if t.reservations != t.sent - transport:
        out.append(f"{t.sent} sent ({transport} transport errors) but {t.reservations} reservations")
    if t.settled != t.ok:
        out.append(f"{t.ok} successes but {t.settled} settled reservations")
    if t.cancelled != sum(t.errors.values()) - transport:
        out.append(
            f"{sum(t.errors.values()) - transport} errors after admission but {t.cancelled} cancelled reservations"
        )
    return out


async def _totals(ledger: Any, tenants: tuple[str, ...]) -> LedgerReport:
    out = {}
    for tenant in tenants:
        usage = await ledger.usage(tenant, 10 * 365 * 86_400)
        out[tenant] = TenantTotals(
            tenant, usage.requests, usage.input_tokens, usage.output_tokens, usage.gpu_ms, dict(usage.by_status)
        )
    return LedgerReport(out)


def run_capacity(
    config: CapacityConfig, policy: str = "gpu_fair", processes: bool = False, seed: int = 1
) -> CapacityFigures:
    """One run on a fresh stack: replicas as processes (one is killed), the gateway in this process (or as a
    process with ``processes``), an SQLite ledger in a temporary folder."""
    from fairgate.gateway.app import create_gateway
    from fairgate.gateway.config import load_gateway_config
    from fairgate.ledger import connect

    started = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix="fairgate-drill-capacity-"))
    tenants = config.tenant_entries()
    keys = tenant_keys(tenants)
    specs = [emulator_spec(f"emulator-{i}", config.replica) for i in range(config.replicas)]
    with ExitStack() as servers:
        emulators: list[Child] = servers.enter_context(children(specs, folder))
        upstreams = [
            UpstreamEntry(f"emu-{i}", e.url, "emu", config.replica.max_batch, config.replica)
            for i, e in enumerate(emulators)
        ]
        path = folder / "gateway.toml"
        path.write_text(
            gateway_config_text(
                folder, 0, policy, f"sqlite:///{folder}/ledger.db", upstreams, tenants, keys, share_charges_s=0.0
            )
        )
        gateway_config = load_gateway_config(path)
        if processes:
            url = servers.enter_context(children([gateway_spec("gateway", path)], folder))[0].url
        else:
            url = servers.enter_context(serve_in_thread(create_gateway(gateway_config)))
        victim = emulators[-1]

        async def go() -> CapacityFigures:
            ledger = await connect(gateway_config.ledger_url, gateway_config.quotas, create=False)
            try:
                begin = time.monotonic()
                snapshots: dict[str, LedgerReport] = {}
                timeline_raw: list[tuple[float, dict[str, float]]] = []
                last_truth: dict[int, dict[str, float]] = {}
                killed_at: list[float] = []

                async def snapshot(name: str, at_s: float) -> None:
                    await asyncio.sleep(max(0.0, begin + at_s - time.monotonic()))
                    snapshots[name] = await _totals(ledger, config.tenants)

                async def remove() -> None:
                    await asyncio.sleep(max(0.0, begin + config.remove_at_s - time.monotonic()))
                    snapshots["removal"] = await _totals(ledger, config.tenants)
                    killed_at.append(time.monotonic() - begin)
                    await asyncio.to_thread(victim.kill, config.kill_signal)

                async def sample() -> None:
                    """Each replica's own charge-rule totals per tenant (a dead replica keeps its last)."""
                    while time.monotonic() - begin < config.seconds:
                        for i, emulator in enumerate(emulators):
                            if not emulator.alive:
                                continue
                            truth: ReplicaTruth | None = await read_replica(emulator.url, timeout_s=1.0)
                            if truth is not None:
                                last_truth[i] = by_tenant(truth, config.tenants)
                        total = {t: sum(v.get(t, 0.0) for v in last_truth.values()) for t in config.tenants}
                        timeline_raw.append((time.monotonic() - begin, total))
                        await asyncio.sleep(config.sample_s)

                tasks = [
                    asyncio.ensure_future(snapshot("warm", config.warmup_s)),
                    asyncio.ensure_future(snapshot("after", config.after_from_s)),
                    asyncio.ensure_future(snapshot("end", config.seconds - 0.05)),
                    asyncio.ensure_future(remove()),
                    asyncio.ensure_future(sample()),
                ]
                report: LoadReport = await run_load(
                    url, config.loads(keys), config.seconds, seed=seed, drain_s=config.drain_s
                )
                await asyncio.gather(*tasks)
                settle_s = await wait_settled(ledger, SETTLE_S_MAX)
                reservations = await ledger.reservations()
                accounts = {t: (await ledger.account(t, "emu")).concurrent for t in config.tenants}
            finally:
                await ledger.close()
            kill_s = killed_at[0] if killed_at else config.remove_at_s
            before = snapshots["removal"].minus(snapshots["warm"])
            after = snapshots["end"].minus(snapshots["after"])
            timeline = _windows(timeline_raw, 1.0)
            truth_before = _between(timeline_raw, config.warmup_s, kill_s)
            truth_after = _between(timeline_raw, config.after_from_s, config.seconds)
            converge = _converged(timeline, kill_s, config.batch, config.batch_share_after_max)
            share_before, share_after = before.shares(), after.shares()
            figures = {}
            for tenant in config.tenants:
                stats = report.stats(tenant)
                mine = [r for r in reservations if r.tenant == tenant]
                figures[tenant] = TenantFigures(
                    tenant,
                    share_before.get(tenant, 0.0),
                    share_after.get(tenant, 0.0),
                    truth_before.get(tenant, 0.0),
                    truth_after.get(tenant, 0.0),
                    stats.requests,
                    stats.completed,
                    stats.cut,
                    stats.errors,
                    len(mine),
                    sum(r.status == "settled" for r in mine),
                    sum(r.status == "cancelled" for r in mine),
                    sum(r.status == "open" for r in mine),
                    accounts[tenant],
                )
            return CapacityFigures(
                policy,
                figures,
                "emu-" + str(len(emulators) - 1),
                kill_s,
                converge,
                timeline,
                {"before": before.gpu_ms / 1000.0, "after": after.gpu_ms / 1000.0},
                time.monotonic() - started,
                settle_s,
            )

        figures = asyncio.run(go())
    shutil.rmtree(folder, ignore_errors=True)  # kept (with the servers' logs) when the run raised
    return figures


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
    since = None
    for at, shares in timeline:
        if at < kill_s:
            continue
        if shares.get(batch, 0.0) <= share_max:
            since = at if since is None else since
        else:
            since = None
    return None if since is None else max(0.0, since - kill_s)


@dataclass(frozen=True)
class CapacityResult(CheckedResult):
    config: CapacityConfig
    main: CapacityFigures
    compare: CapacityFigures | None
    name: str = "capacity"

    def checks(self, figs: CapacityFigures | None = None) -> dict[str, bool]:
        """Each part of the claim for ``figs`` (default: the policy tested)."""
        figs = figs or self.main
        c = self.config
        batch = figs.tenants[c.batch]
        ratio = figs.ratio_after(c)
        target = c.weight_ratio()
        lost = [t.tenant for t in figs.tenants.values() if lost_requests(t)]
        return {
            f"batch had a share before the removal (> {c.batch_share_after_max:.0%})": batch.share_before
            > c.batch_share_after_max,
            f"batch yields: <= {c.batch_share_after_max:.0%} of the GPU after the removal": batch.share_after
            <= c.batch_share_after_max,
            f"batch yielded within {c.converge_s_max:g} s of the removal": figs.converge_s is not None
            and figs.converge_s <= c.converge_s_max,
            f"interactive GPU ratio after the removal {target:g} within {c.ratio_tolerance:.0%}": abs(
                ratio / target - 1.0
            )
            <= c.ratio_tolerance,
            "every request got a success or an explicit error (none cut, none open, counts match the ledger)": not lost,
            "the removal cut requests (the fault was real)": figs.errors > 0,
        }

    def render(self) -> list[Any]:
        from rich.table import Table

        c = self.config
        out: list[Any] = [
            f"[bold]drill capacity[/bold]: "
            f"{', '.join(f'{t} (weight {w:g}, {c.clients[t]} clients' + (f', +{c.surge[t]} from the removal' if c.surge.get(t) else '') + ')' for t, w in c.weights.items())} "
            f"interactive and {c.batch} (batch pool, {c.clients[c.batch]} clients), all sending closed loop to {c.replicas} "
            f"emulated replica processes x {c.replica.max_batch} slots; at {c.remove_at_s:g} s one replica is killed "
            f"({signal.Signals(c.kill_signal).name}); {c.seconds:g} s of load, then up to {c.drain_s:g} s for the "
            f"requests still queued.",
            f"Claim: after the removal {c.batch} yields (<= {c.batch_share_after_max:.0%} of the GPU billed from "
            f"{c.after_from_s:g} s, within {c.converge_s_max:g} s), the interactive tenants split what is left "
            f"{c.weight_ratio():g} : 1 (+-{c.ratio_tolerance:.0%}), and every request ends in a success or an "
            f"explicit error.",
        ]
        for figs in (self.main, self.compare):
            if figs is None:
                continue
            table = Table(
                title=f"policy {figs.policy}" + (" (comparison)" if figs is self.compare else ""), title_justify="left"
            )
            for column in (
                "tenant",
                "GPU % before",
                "GPU % after",
                "replica GPU % before/after",
                "sent/ok/cut",
                "errors",
                "ledger settled/cancelled/open",
            ):
                table.add_column(column, justify="left" if column in ("tenant", "errors") else "right")
            for t in figs.tenants.values():
                table.add_row(
                    t.tenant,
                    f"{t.share_before * 100:.1f}",
                    f"{t.share_after * 100:.1f}",
                    f"{t.truth_before * 100:.1f} / {t.truth_after * 100:.1f}",
                    f"{t.sent}/{t.ok}/{t.cut}",
                    fmt_errors(t.errors),
                    f"{t.settled}/{t.cancelled}/{t.open_at_end}",
                )
            converge = "never" if figs.converge_s is None else f"{figs.converge_s:.1f} s"
            table.caption = (
                f"{figs.removed} killed at {figs.killed_at_s:.1f} s; the ledger billed {figs.ledger_gpu_s['before']:,.1f} "
                f"GPU s before it ({c.warmup_s:g}-{c.remove_at_s:g} s), {figs.ledger_gpu_s['after']:,.1f} after "
                f"({c.after_from_s:g}-{c.seconds:g} s). Interactive ratio {figs.ratio_before(c):.2f} "
                f"before (uncontended), {figs.ratio_after(c):.2f} after (weights {c.weight_ratio():g}). Load held: "
                f"{figs.sent} requests; faults injected: 1 replica removed; lost: "
                f"{sum(t.cut for t in figs.tenants.values())} hung, "
                f"{sum(t.open_at_end for t in figs.tenants.values())} open reservations ({figs.errors} requests "
                f"ended in an explicit error); converged (batch yielded) {converge} after the removal; "
                f"reservations all final {figs.settle_s:.1f} s after the drain; wall {figs.wall_s:.0f} s."
            )
            table.caption_justify = "left"
            out.append(table)
        out.extend(self.check_lines())
        if self.compare is not None:
            failed = [check for check, ok in self.checks(self.compare).items() if not ok]
            out.append(
                f"  comparison {self.compare.policy}: " + ("holds" if not failed else "fails: " + "; ".join(failed))
            )
        verdict = "[green]PASS[/green]" if self.passed else "[red]FAIL[/red]"
        batch = self.main.tenants[c.batch]
        out.append(
            f"{verdict}: under {self.main.policy} {c.batch} went from {batch.share_before:.1%} to "
            f"{batch.share_after:.1%} of the GPU, the interactive ratio is {self.main.ratio_after(c):.2f} "
            f"(weights {c.weight_ratio():g}), {self.main.errors} explicit errors, nothing lost."
        )
        return out


def run(options: DrillOptions, config: CapacityConfig | None = None) -> CapacityResult:
    """Run the drill under ``options.policy`` (and ``options.compare``, if any). ``options.seconds`` sets the
    load's length (the removal stays at ``remove_at_s``)."""
    config = config or CapacityConfig()
    if options.seconds is not None:
        config = replace(config, seconds=options.seconds)
    main = run_capacity(config, options.policy, options.processes, options.seed)
    compare = None
    if options.compare and options.compare != options.policy:
        compare = run_capacity(config, options.compare, options.processes, options.seed)
    return CapacityResult(config, main, compare)


__all__ = ["CapacityConfig", "CapacityFigures", "CapacityResult", "run", "run_capacity"]

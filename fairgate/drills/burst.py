"""Drill ``burst`` (seed 003, "simulate a single tenant burst ... confirm that other tenants' latency is
still within target"): one tenant suddenly wants 20 times its share of the machine; the other tenants'
p99 time to first token must stay within 1.5 times what it was before the burst.

One run per policy on a fresh stack (four emulated replicas behind the gateway). Three tenants ("others")
send Poisson arrivals throughout, each at 60 % of its share of the capacity, so whatever latency they get
beyond the replicas' own iteration time is queueing. Halfway through, the fourth tenant ("noisy") starts
``burst_factor`` times its share of the slots in closed-loop clients (ramped in over ``ramp_s``), every one
of them sending its next request as soon as one ends: its queue in the gateway stays hundreds deep for
the rest of the run. The others' TTFT before the burst is the solo baseline (the same load without the
bursting tenant); after it (past ``settle_s`` of onset) the burst figure. The claim holds when the
others' pooled p99 with the burst is at most ``ttft_ratio_max`` times their baseline p99.

Why this can fail: under FIFO the others' requests queue behind the burster's backlog (seconds); under a
fair policy they wait only for the next slot to free, since their GPU-time counters are far below the
burster's. What no policy that does not preempt can remove: with every slot busy, a request first waits
for a sequence to end somewhere (up to an iteration / K on K replicas whose boundaries are spread), and is
then dispatched just after that replica's boundary, so it waits a whole iteration for the next one, where
on a fleet with free slots it waits half of one on average. A perfect fair policy thus shows a p99 ratio
of about 1.1-1.3 here. The replicas are sized so that slots free often (outputs of 1-3 tokens, 12 slots
each) and their boundaries are spread (``StackSpec.staggered``); iterations are long (500 ms: a
time-scaled replica) so that the Python stack's own milliseconds and the shared machine's jitter stay small
beside them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from fairgate.drills import DrillOptions
from fairgate.drills.report import (
    Cells,
    ComparedResult,
    cell_table,
    fleet,
    fmt_errors,
    fmt_ms,
    history_check,
    history_lines,
    main_and_compare,
)
from fairgate.harness.config import TenantSpec
from fairgate.harness.history import HistoryReport
from fairgate.harness.ledger import LedgerReport
from fairgate.harness.loadgen import TenantLoad
from fairgate.harness.records import TenantStats, percentile
from fairgate.harness.replica import ReplicaModel
from fairgate.harness.run import Run, run_on_stack
from fairgate.harness.stack import StackSpec, replicas


@dataclass(frozen=True)
class BurstConfig:
    """The drill's setting (defaults: the acceptance scenario)."""

    seconds: float = 12.0  # length of each half of the run (before and during the burst)
    others: tuple[str, ...] = ("alpha", "beta", "gamma")
    burster: str = "noisy"
    replicas: int = 4  # the emulated fleet
    replica: ReplicaModel = field(default_factory=lambda: ReplicaModel(500.0, 0.0, 0.0, 12))
    output_tokens: tuple[int, int] = (1, 3)  # every request's length (uniform range)
    prompt_tokens: int = 64
    others_load: float = 0.6  # each other tenant's offered load, as a fraction of its share of the capacity
    burst_factor: float = 20.0  # the burster's closed-loop clients, as a multiple of its share of the slots
    ramp_s: float = 2.0  # the burster's clients start over this long
    settle_s: float = 1.5  # after the ramp, the onset transient left out of the burst window
    baseline_skip_s: float = 1.0  # the start of the run left out of the baseline window (the fleet warming up)
    ttft_ratio_max: float = 1.5  # the claim: others' p99 TTFT during the burst <= this times their baseline p99

    def __post_init__(self) -> None:
        for name, (low, high) in (("before", self.baseline_window_s), ("during", self.burst_window_s)):
            if high - low < 2.0:
                raise ValueError(
                    f"burst drill: {self.seconds:g} s per half leaves {max(0.0, high - low):.1f} s to "
                    f"measure {name} the burst; give at least {self.ramp_s + self.settle_s + 2.0:g} s"
                )

    @property
    def tenants(self) -> tuple[str, ...]:
        return (*self.others, self.burster)

    @property
    def slots(self) -> int:
        return self.replicas * self.replica.max_batch

    def capacity_per_s(self) -> float:
        """Requests per second the fleet completes when full: each slot holds a request for its output
        tokens plus about one iteration (its wait for the boundary it is admitted at)."""
        mean_output = (self.output_tokens[0] + self.output_tokens[1]) / 2
        iteration_s = self.replica.iteration_ms(self.replica.max_batch + 1) / 1000.0
        return self.slots / ((mean_output + 1) * iteration_s)

    @property
    def others_rate_per_s(self) -> float:
        return self.others_load * self.capacity_per_s() / len(self.tenants)

    @property
    def burst_clients(self) -> int:
        return math.ceil(self.burst_factor * self.slots / len(self.tenants))

    @property
    def baseline_window_s(self) -> tuple[float, float]:
        # A request sent in the last few iterations before the burst may get its first token after the burst
        # starts: four iterations (about twice the slowest TTFT without a burst) are left out.
        guard_s = 4 * self.replica.iteration_ms(self.replica.max_batch + 1) / 1000.0
        return self.baseline_skip_s, self.seconds - guard_s

    @property
    def burst_window_s(self) -> tuple[float, float]:
        return self.seconds + self.ramp_s + self.settle_s, 2 * self.seconds

    def loads(self) -> list[TenantLoad]:
        lengths: dict[str, Any] = {"output_tokens": self.output_tokens, "prompt_tokens": self.prompt_tokens}
        loads = [TenantLoad(t, rate_per_s=self.others_rate_per_s, **lengths) for t in self.others]
        burst = TenantLoad(self.burster, clients=self.burst_clients, start_s=self.seconds, ramp_s=self.ramp_s)
        return [*loads, replace(burst, **lengths)]

    def spec(self, policy: str, processes: bool) -> StackSpec:
        tenants = tuple(TenantSpec(t) for t in self.tenants)
        return StackSpec(tenants, policy, replicas(self.replicas), self.replica, processes, staggered=True)


@dataclass(frozen=True)
class TenantFigures:
    """One tenant's figures in one run: TTFT before / during the burst, requests, errors, GPU shares."""

    tenant: str
    baseline_p50_ms: float | None
    baseline_p99_ms: float | None
    burst_p50_ms: float | None
    burst_p99_ms: float | None
    clients: TenantStats  # what its clients saw (the burster: from its start on)
    share_before: float  # of the GPU time billed in the first half
    share_during: float  # ... in the second half
    ledger_requests: int
    ledger_gpu_s: float

    @property
    def ratio(self) -> float | None:
        return _ratio(self.baseline_p99_ms, self.burst_p99_ms)

    @property
    def errors(self) -> dict[str, int]:
        """Its clients' errors but 429s (``clients.rejected``)."""
        return {k: v for k, v in self.clients.errors.items() if not k.startswith("429")}


# The columns of a run's table, a row per tenant.
TENANT_CELLS: Cells[TenantFigures] = (
    ("tenant", lambda t: t.tenant),
    ("TTFT ms before p50/p99", lambda t: f"{fmt_ms(t.baseline_p50_ms)} / {fmt_ms(t.baseline_p99_ms)}"),
    ("TTFT ms burst p50/p99", lambda t: f"{fmt_ms(t.burst_p50_ms)} / {fmt_ms(t.burst_p99_ms)}"),
    ("p99 x", lambda t: "-" if t.ratio is None else f"{t.ratio:.2f}"),
    ("sent/done/cut", lambda t: f"{t.clients.requests}/{t.clients.completed}/{t.clients.cut}"),
    ("429", lambda t: str(t.clients.rejected)),
    ("errors", lambda t: fmt_errors(t.errors)),
    ("GPU % before/burst", lambda t: f"{t.share_before * 100:.1f} / {t.share_during * 100:.1f}"),
    ("ledger GPU s", lambda t: f"{t.ledger_gpu_s:,.1f}"),
)


def _ratio(before: float | None, during: float | None) -> float | None:
    return None if before is None or during is None or before <= 0 else during / before


@dataclass(frozen=True)
class PolicyFigures:
    """One policy's run, summarised: the others' pooled p99 before and during the burst, and per tenant."""

    policy: str
    baseline_p99_ms: float | None
    burst_p99_ms: float | None
    baseline_samples: int
    burst_samples: int
    tenants: dict[str, TenantFigures]
    ledger: LedgerReport
    history: HistoryReport | None  # the history checker: every request id against the ledger

    @property
    def ratio(self) -> float | None:
        return _ratio(self.baseline_p99_ms, self.burst_p99_ms)


def figures(config: BurstConfig, run: Run) -> PolicyFigures:
    """Summarise ``run`` (see ``BurstConfig`` for the windows)."""
    before, during = config.baseline_window_s, config.burst_window_s
    others = list(config.others)
    baseline, burst = run.history.ttft_values(others, *before), run.history.ttft_values(others, *during)
    half = run.snapshots.get(config.seconds)
    share_1 = (half or run.ledger).shares()
    share_2 = (run.ledger.minus(half) if half is not None else run.ledger).shares()
    tenants = {}
    for tenant in config.tenants:
        b, d = run.history.stats(tenant, *before), run.history.stats(tenant, *during)
        total = run.ledger.totals[tenant]
        tenants[tenant] = TenantFigures(
            tenant,
            b.ttft_p50_ms,
            b.ttft_p99_ms,
            d.ttft_p50_ms,
            d.ttft_p99_ms,
            run.history.stats(tenant, config.seconds if tenant == config.burster else 0.0),
            share_1.get(tenant, 0.0),
            share_2.get(tenant, 0.0),
            total.requests,
            total.gpu_ms / 1000.0,
        )
    return PolicyFigures(
        run.policy,
        percentile(baseline, 99),
        percentile(burst, 99),
        len(baseline),
        len(burst),
        tenants,
        run.ledger,
        run.history_check,
    )


@dataclass(frozen=True)
class BurstResult(ComparedResult[BurstConfig, PolicyFigures]):
    """The drill's verdict and figures: ``main`` under the policy tested, ``compare`` under the comparison."""

    problems: tuple[str, ...]  # why the run does not show what it should (besides the ratio)
    name: str = "burst"

    def checks(self) -> dict[str, bool]:
        c = self.config
        return {
            "the run tests the claim (enough samples, no errors, a real burst)": not self.problems,
            f"the others' p99 TTFT during the burst <= {c.ttft_ratio_max:g} x before it": self.main.ratio is not None
            and self.main.ratio <= c.ttft_ratio_max,
        } | history_check(self.main.history, "the load's end hangs up on those still running: <= 8 tokens read short")

    INTRO = """
        [bold]drill burst[/bold]: {c.burster!r} starts {c.burst_clients} closed-loop clients ({c.burst_factor:g}x
        its share of {c.slots} slots) at {c.seconds:g} s; {others} send {c.others_rate_per_s:.2f} req/s each
        throughout ({c.others_load:.0%} of a share); {fleet}, {c.replica.iter_base_ms:g} ms iterations, outputs
        {c.output_tokens[0]}-{c.output_tokens[1]} tokens.

        Claim: the others' p99 TTFT during the burst (requests sent {c.burst_window_s[0]:g}-{c.burst_window_s[1]:g}
        s) <= {c.ttft_ratio_max:g} x their p99 before it ({c.baseline_window_s[0]:g}-{c.baseline_window_s[1]:g} s,
        same load without {c.burster!r}).
    """

    def intro_fields(self) -> dict[str, Any]:
        return super().intro_fields() | {"fleet": fleet(self.config), "others": ", ".join(self.config.others)}

    def body(self) -> list[Any]:
        problems = [f"[red]problem[/red]: {problem}" for problem in self.problems]
        return super().body() + problems + history_lines(self.main.history)

    def policy_table(self, figs: PolicyFigures) -> Any:
        c = self.config
        holds = figs.ratio is not None and figs.ratio <= c.ttft_ratio_max
        caption = (
            f"others pooled: p99 {fmt_ms(figs.baseline_p99_ms)} ms before ({figs.baseline_samples} requests), "
            f"{fmt_ms(figs.burst_p99_ms)} ms during the burst ({figs.burst_samples}): x{_fmt(figs.ratio)} - "
            f"{'within' if holds else 'OVER'} {c.ttft_ratio_max:g}x"
        )
        return cell_table(self.title(figs), TENANT_CELLS, figs.tenants.values(), caption)

    def verdict(self) -> str:
        compared = self.compare
        tail = "" if compared is None or compared.ratio is None else f"; under {compared.policy}: x{compared.ratio:.2f}"
        return (
            f"under {self.main.policy} the others' p99 TTFT went x{_fmt(self.main.ratio)} with the burst "
            f"(limit {self.config.ttft_ratio_max:g}x){tail}."
        )


def _fmt(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def _problems(config: BurstConfig, figs: PolicyFigures) -> list[str]:
    """Reasons the run does not test the claim: too few samples, errors, or no real burst."""
    problems = []
    if figs.baseline_samples < 20 or figs.burst_samples < 20:
        problems.append(
            f"{figs.policy}: too few of the others' requests to measure ({figs.baseline_samples} "
            f"before, {figs.burst_samples} during the burst)"
        )
    problems += [f"{figs.policy}: {t.tenant} had errors: {t.errors}" for t in figs.tenants.values() if t.errors]
    burster, fair = figs.tenants[config.burster], 1.0 / len(config.tenants)
    if burster.share_during < fair:
        problems.append(
            f"{figs.policy}: {config.burster} got {burster.share_during:.1%} of the GPU during its burst, "
            f"not more than its share ({fair:.0%}): it did not load the fleet"
        )
    return problems


def run(options: DrillOptions, config: BurstConfig | None = None) -> BurstResult:
    """Run the drill under ``options.policy`` (and ``options.compare``, if any)."""
    config = options.setting(config or BurstConfig())

    def one(policy: str) -> PolicyFigures:
        spec = config.spec(policy, options.in_processes(True))
        load = run_on_stack(spec, config.loads(), 2 * config.seconds, options.seed, (config.seconds,), check=True)
        return figures(config, load)

    main, compare = main_and_compare(options, one)
    return BurstResult(config, main, compare, tuple(_problems(config, main)))

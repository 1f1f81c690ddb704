"""Drill ``ultra_long`` (seed 003, "simulate ... ultra-long output"): an agent tenant whose requests each
generate 8k tokens (``max_tokens=8192`` with ``ignore_eos``) runs beside ordinary tenants. None of its
requests ends within the run, so every slot it is given stays its own: a policy that hands out slots
without counting GPU time lets it take the fleet, one freed slot at a time.

All four tenants keep their queues full (closed loop, more clients than the fleet has slots). The claim,
from the GPU time the ledger billed from the agent's start on (the clients hang up at the end and the
gateway bills what ran): no tenant has more than its share plus ``agent_margin`` (seed 003: "no tenant over
its share"), the agent included; max/min of the weighted shares is reported. Its agent runs are limited
too: its clients share ``agent_runs`` run ids (``x-fairgate-run-id``), more clients per run than
``max_model_calls`` allows, so the ledger must refuse the extra calls of every run (429, dimension
``max_model_calls``) and admit no run more than the limit.
"""

from __future__ import annotations

from collections import Counter
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
from fairgate.harness.loadgen import TenantLoad
from fairgate.harness.records import TenantStats
from fairgate.harness.replica import ReplicaModel
from fairgate.harness.run import Run, run_on_stack
from fairgate.harness.stack import StackSpec, replicas
from fairgate.ledger.config import LimitsConfig

RUN_DIMENSION = "max_model_calls"


@dataclass(frozen=True)
class UltraLongConfig:
    """The drill's setting (defaults: the acceptance scenario)."""

    seconds: float = 20.0  # length of the run
    others: tuple[str, ...] = ("alpha", "beta", "gamma")  # tenant names (``agent``: the agent's)
    agent: str = "agent"
    weights: dict[str, float] = field(default_factory=dict)  # tenant -> share weight (default 1)
    replicas: int = 2  # the emulated fleet
    replica: ReplicaModel = field(default_factory=lambda: ReplicaModel(max_batch=24))
    agent_output_tokens: int = 8192  # every agent request's output
    other_output_tokens: tuple[int, int] = (4, 12)  # the others' outputs (uniform range)
    prompt_tokens: int = 64
    clients_per_tenant: int = 48  # the others' closed-loop clients (each tenant alone could fill the fleet)
    agent_clients: int = 64  # the agent's clients, sharing ``agent_runs`` run ids
    agent_runs: int = 16
    max_model_calls: int = 3  # the agent's limits per run (the ledger's ``max_model_calls`` and ``max_tokens``)
    run_max_tokens: int = 30_000
    # reported: max / min of the weighted GPU shares (not part of the claim: over a window shorter
    # than one agent request, a policy can only approximate the shares)
    share_ratio_max: float = 1.10
    agent_margin: float = 0.03  # the claim: every tenant's share <= its fair share + this
    # when the agent starts (the others are backlogged by then, as on a busy fleet); the shares are
    # those of the GPU time billed from then on
    agent_start_s: float = 3.0

    def __post_init__(self) -> None:
        if self.seconds < self.agent_start_s + 5.0:
            raise ValueError(
                f"ultra_long drill: {self.seconds:g} s is too short; the agent starts at "
                f"{self.agent_start_s:g} s and needs at least 5 s more"
            )

    @property
    def tenants(self) -> tuple[str, ...]:
        return (*self.others, self.agent)

    def fair_share(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0) / sum(self.weights.get(t, 1.0) for t in self.tenants)

    def loads(self) -> list[TenantLoad]:
        others = [
            TenantLoad(t, clients=self.clients_per_tenant, output_tokens=self.other_output_tokens) for t in self.others
        ]
        agent = TenantLoad(
            self.agent,
            clients=self.agent_clients,
            output_tokens=(self.agent_output_tokens, self.agent_output_tokens),
            runs=self.agent_runs,
            error_backoff_s=1.0,
            start_s=self.agent_start_s,
        )
        return [replace(load, prompt_tokens=self.prompt_tokens) for load in (*others, agent)]

    def spec(self, policy: str, processes: bool) -> StackSpec:
        per_run = LimitsConfig(max_model_calls=self.max_model_calls, max_tokens=self.run_max_tokens)
        tenants = tuple(
            TenantSpec(t, self.weights.get(t, 1.0), limits=per_run if t == self.agent else LimitsConfig())
            for t in self.tenants
        )
        return StackSpec(tenants, policy, replicas(self.replicas), self.replica, processes)


@dataclass(frozen=True)
class TenantFigures:
    tenant: str
    share: float  # of the GPU time billed from the agent's start on
    weighted: float  # share / fair share (1.0: exactly its share)
    clients: TenantStats  # what its clients saw over the whole run (errors: "<status>:<code>[dimension]")
    ledger_requests: int
    ledger_output_tokens: int
    ledger_gpu_s: float


# The columns of a run's table, a row per tenant.
TENANT_CELLS: Cells[TenantFigures] = (
    ("tenant", lambda t: t.tenant),
    ("GPU %", lambda t: f"{t.share * 100:.1f}"),
    ("x share", lambda t: f"{t.weighted:.2f}"),
    ("sent/done/cut", lambda t: f"{t.clients.requests}/{t.clients.completed}/{t.clients.cut}"),
    ("errors", lambda t: fmt_errors(t.clients.errors)),
    ("TTFT ms p50/p99", lambda t: f"{fmt_ms(t.clients.ttft_p50_ms)} / {fmt_ms(t.clients.ttft_p99_ms)}"),
    ("TPOT ms p50", lambda t: fmt_ms(t.clients.tpot_p50_ms)),
    ("ledger req", lambda t: str(t.ledger_requests)),
    ("ledger out tok", lambda t: f"{t.ledger_output_tokens:,}"),
    ("ledger GPU s", lambda t: f"{t.ledger_gpu_s:,.1f}"),
)


@dataclass(frozen=True)
class RunLimits:
    """The agent's runs as the ledger admitted them: run id -> (calls admitted, tokens reserved)."""

    calls: dict[str, int]
    tokens: dict[str, int]
    refused: int  # the agent's calls answered 429 with dimension max_model_calls

    @property
    def most_calls(self) -> int:
        return max(self.calls.values(), default=0)


@dataclass(frozen=True)
class PolicyFigures:
    policy: str
    tenants: dict[str, TenantFigures]
    runs: RunLimits
    gpu_s: float
    history: HistoryReport | None  # the history checker: every request id against the ledger and the replicas

    @property
    def ratio(self) -> float:
        weighted = [t.weighted for t in self.tenants.values()]
        return max(weighted) / min(weighted) if min(weighted) > 0 else float("inf")


def figures(config: UltraLongConfig, run: Run) -> PolicyFigures:
    before = run.snapshots.get(config.agent_start_s)
    window = run.ledger.minus(before) if before is not None else run.ledger
    shares = window.shares()
    tenants = {}
    for tenant in config.tenants:
        total = window.totals[tenant]
        tenants[tenant] = TenantFigures(
            tenant,
            shares[tenant],
            shares[tenant] / config.fair_share(tenant),
            run.history.stats(tenant),
            total.requests,
            total.output_tokens,
            total.gpu_ms / 1000.0,
        )
    calls: Counter[str] = Counter()
    tokens: Counter[str] = Counter()
    for r in run.reservations:
        if r.tenant == config.agent and r.run_id is not None:
            calls[r.run_id] += 1
            tokens[r.run_id] += r.input_tokens + r.max_output_tokens
    refused = sum(n for code, n in tenants[config.agent].clients.errors.items() if f"[{RUN_DIMENSION}]" in code)
    limits = RunLimits(dict(calls), dict(tokens), refused)
    return PolicyFigures(run.policy, tenants, limits, window.gpu_ms / 1000.0, run.history_check)


@dataclass(frozen=True)
class UltraLongResult(ComparedResult[UltraLongConfig, PolicyFigures]):
    name: str = "ultra_long"

    def checks(self) -> dict[str, bool]:
        c, figs = self.config, self.main
        agent = figs.tenants[c.agent]
        unexpected = [k for t in figs.tenants.values() for k in t.clients.errors if f"[{RUN_DIMENSION}]" not in k]
        return {
            f"no tenant over its share + {c.agent_margin:.0%}": all(
                t.share <= c.fair_share(name) + c.agent_margin for name, t in figs.tenants.items()
            ),
            f"agent share <= {c.fair_share(c.agent):.0%} + {c.agent_margin:.0%}": agent.share
            <= c.fair_share(c.agent) + c.agent_margin,
            f"no run admitted more than {c.max_model_calls} calls": figs.runs.most_calls <= c.max_model_calls,
            "the run limit refused calls (it was exercised)": figs.runs.refused > 0,
            f"no run reserved more than {c.run_max_tokens:,} tokens": max(figs.runs.tokens.values(), default=0)
            <= c.run_max_tokens,
            "no other errors": not unexpected,
            "the agent ran": agent.ledger_output_tokens > 0,
        } | history_check(figs.history, "the load's end hangs up on every agent stream: <= 8 tokens read short")

    def body(self) -> list[Any]:
        return super().body() + history_lines(self.main.history)

    INTRO = """
        [bold]drill ultra_long[/bold]: {c.agent!r} sends {c.agent_output_tokens}-token requests ({c.agent_clients}
        clients in {c.agent_runs} agent runs, {c.max_model_calls} calls and {c.run_max_tokens:,} tokens per run)
        beside {others} ({c.clients_per_tenant} clients each, outputs
        {c.other_output_tokens[0]}-{c.other_output_tokens[1]} tokens); all backlogged for {c.seconds:g} s on
        {fleet}.

        Claim: GPU shares billed in the ledger from the agent's start ({c.agent_start_s:g} s) on, within
        {c.share_ratio_max:g}x of each other (weighted), the agent at most its share + {c.agent_margin:.0%}; the
        agent's run limits hold.
    """

    def intro_fields(self) -> dict[str, Any]:
        return super().intro_fields() | {"fleet": fleet(self.config), "others": ", ".join(self.config.others)}

    def policy_table(self, figs: PolicyFigures) -> Any:
        caption = (
            f"max/min {figs.ratio:.3f}; ledger billed {figs.gpu_s:,.1f} GPU s; agent runs: {len(figs.runs.calls)} "
            f"runs, at most {figs.runs.most_calls} calls admitted per run, {figs.runs.refused} calls refused "
            f"({RUN_DIMENSION})"
        )
        return cell_table(self.title(figs), TENANT_CELLS, figs.tenants.values(), caption)

    def verdict(self) -> str:
        c, agent = self.config, self.main.tenants[self.config.agent]
        line = (
            f"under {self.main.policy} max/min {self.main.ratio:.3f}, agent {agent.share:.1%} of the GPU "
            f"(share {c.fair_share(c.agent):.0%})"
        )
        if self.compare is not None:
            other = self.compare.tenants[c.agent]
            line += f"; under {self.compare.policy}: max/min {self.compare.ratio:.3f}, agent {other.share:.1%}"
        return line + "."


def run(options: DrillOptions, config: UltraLongConfig | None = None) -> UltraLongResult:
    """Run the drill under ``options.policy`` (and ``options.compare``, if any)."""
    config = options.setting(config or UltraLongConfig())

    def one(policy: str) -> PolicyFigures:
        spec = config.spec(policy, options.in_processes(True))
        snapshot_at_s = (config.agent_start_s,) if config.agent_start_s > 0 else ()
        load = run_on_stack(spec, config.loads(), config.seconds, options.seed, snapshot_at_s, check=True)
        return figures(config, load)

    return UltraLongResult(config, *main_and_compare(options, one))

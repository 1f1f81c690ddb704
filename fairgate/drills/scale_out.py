"""Drill ``scale_out`` (issue 6): several ``fairgate serve`` processes share one PostgreSQL or Redis ledger.

Two claims, each checked on real processes (``fairgate emulate`` replicas, ``fairgate serve`` gateways) driven
by the real ``openai`` client:

1. **Limits are global** - "N processes never admit more than the limit allows, for N = 1, 2, 4". One
   group of tenants per N, each tenant tight on one dimension of the quota vector (``rate``: requests per
   minute; ``tokens``: output and input tokens per minute; ``slots``: ``max_concurrent`` and ``max_queued``;
   ``gpu``: a GPU-seconds budget), its closed-loop clients spread round robin over the group's N processes.
   The groups run at once, each on its own model (pool) and its own emulated replica, so one stack of
   ``max(N)`` processes serves them all; a group's gateway slots are ``gateway_slots`` in total
   (``gateway_slots / N`` per process and model), so requests wait in the gateways' queues at every N.
   After the load the clients send nothing more and wait for what is in flight (no hang-up: every admitted
   request ends in an answer). Then every reservation in the ledger is checked, on the ledger's own clock
   (``created_ms``, ``final_ms``):

   - token buckets (requests, input tokens, output tokens): over every window ``[t_i, t_j]`` between two
     admissions, what was admitted minus what final settlements gave back (``max_output_tokens`` held,
     fewer generated) is at most ``burst + rate * (t_j - t_i)``: no process admitted on credit another had
     spent. The figure shown is the peak of that left side beyond the refill, against the burst;
   - ``max_concurrent``: the most reservations open at one instant (their ``[created_ms, final_ms)``
     intervals overlap), and the most the ledger's account showed when sampled every ``sample_s``;
   - ``max_queued``: the most queue places the account showed when sampled (a place is held only between
     ``enqueue`` and ``dequeue``, with no timestamps kept: sampling is the only view);
   - GPU seconds, by the documented overage rule (``fairgate.ledger.rules``): an open reservation holds
     ``max(estimate, billed)``, a final one what was billed, and a reservation is admitted only if the
     holds plus its estimate fit the budget. So ``sum(min(billed, estimate))`` over the admitted
     reservations is at most the budget; anything billed beyond it is metered overage of requests already
     running (``overage_gpu_ms``), booked, never dropped;
   - the responses: every success is a settled reservation, every admitted request ended in a success or an
     error its client saw; nothing stays open, and every account's ``concurrent`` and ``queued`` are 0 again.

   Also shown per group: the GPU the ledger billed against the replica's own busy time.

2. **Fair dispatch across processes** - "the shares stay fair when tenants' traffic lands on different
   processes". Four tenants with seed 002's output mix (means 23.7 / 53 / 197 / 353.8 tokens, uniform
   within +-50 % of the mean, as the load generator draws lengths uniformly; 400-token prompts) behind two
   gateway processes in front of two emulated replicas (seed 002's cost model, 24 slots each). The clients
   are split unevenly: ``classify`` only through gateway 0, ``agent`` only through gateway 1, ``chat`` mostly
   through 0 and ``summarise`` mostly through 1. Each gateway's ``max_batch`` per upstream is half the
   replica's slots: a gateway knows only its own requests in flight, so two gateways each allowed the
   replica's 24 would send it up to 48, and the replica would queue the extra first-come-first-served, out
   of the fair policy's sight (its own queue, not the tenants'). At half each they never exceed a replica's
   capacity together (checked: the replicas' running + waiting sequences, sampled), and every slot is
   handed out by a gateway's fair policy; the price is that a gateway whose clients are idle leaves its half
   unused. Each policy counts every tenant's *global* usage through the ledger (``[gateway].share_charges_s``,
   ``fairgate.gateway.sharing``): the GPU shares billed in the ledger over the run must be within
   ``ratio_max`` (max/min) of each other. The comparison run turns sharing off (``share_charges_s = 0``):
   each process is fair only among the tenants it sees, so ``classify`` and ``agent`` get about a third of
   their gateway (a sixth of the GPU) and the two tenants on both gateways about a third of the GPU.

   Also shown: the shares by the replicas' own charge rule (``/emulator/stats``), and the GPU billed against
   the replicas' busy time. They exposed a gateway bug (the report of issue 6): each process's live meter
   charged the whole busy time of an upstream it shares with other processes to its own requests, so the
   ledger billed each replica-second N times (x2.1 here; x1.96 and x3.5 at N = 2 and 4 in claim 1) and the
   shares the ledger equalized were not the GPU shares (the replicas' max/min 1.4-1.6). The meters now share
   their occupancy through the ledger (``Ledger.share_occupancy``, ``fairgate.core.meter``): billed / busy
   1.03 here, 1.01 / 1.03 / 1.05 at N = 1 / 2 / 4; the replicas' own max/min 1.06.

Faults injected: none beyond the number of processes and the placement. Lost must be nothing: in claim 2 the
clients hang up at the deadline; a reservation left open is reported.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

from fairgate.drills import DrillOptions, RenderedResult, fmt_errors
from fairgate.drills.loadgen import LoadReport, TenantLoad
from fairgate.drills.stack import STARTUP_S_MAX, ReplicaModel, free_port
from fairgate.gateway.auth import hash_api_key

if TYPE_CHECKING:
    from fairgate.ledger import Ledger, Reservation

SETTLE_S_MAX = 15.0  # after the load: how long the gateways may take to bill what ended or was cancelled
FAIRNESS_SETTLE_S_MAX = 5.0  # the same after the fairness run's hang-up (measured: 0.1 s when nothing is lost)
NOT_EXERCISED = "the limit was not exercised"
LEDGER_ENV = "FAIRGATE_DRILL_LEDGERS"  # comma-separated base ledger URLs for ``fairgate drill scale_out``
DEFAULT_LEDGERS = ("postgresql://127.0.0.1:5432/test", "redis://127.0.0.1:6379/0")
SEED_MIX = {"classify": 23.7, "chat": 53.0, "summarise": 197.0, "agent": 353.8}  # seed 002, mean output tokens
EPSILON = 1e-6


# --- processes --------------------------------------------------------------------------------------------------


@dataclass
class Child:
    """A ``python -m fairgate`` server process of a drill."""

    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL: a crash, no clean-up) and wait for the process to end."""
        if self.alive:
            self.popen.send_signal(sig)
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=30)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass(frozen=True)
class ChildSpec:
    """A server to start: ``python -m fairgate ARGS`` listening on ``port``."""

    name: str
    args: tuple[str, ...]
    port: int


@contextmanager
def children(specs: Sequence[ChildSpec], folder: Path) -> Iterator[list[Child]]:
    """Start every spec at once (logs in ``folder``), wait until each answers ``/health``, and yield them;
    stop the ones still running (SIGTERM, then SIGKILL) when the block ends.

    Raises:
        RuntimeError: a server did not start within ``STARTUP_S_MAX`` (its log's tail in the message).
    """
    import httpx

    started: list[Child] = []
    logs = []
    try:
        for spec in specs:
            log_path = folder / f"{spec.name}.log"
            log = open(log_path, "wb")  # noqa: SIM115 - closed below, after the child ends
            logs.append(log)
            popen = subprocess.Popen([sys.executable, "-m", "fairgate", *spec.args], stdout=log, stderr=log)
            started.append(Child(spec.name, f"http://127.0.0.1:{spec.port}", popen, log_path))
        deadline = time.monotonic() + STARTUP_S_MAX
        waiting = list(started)
        while waiting:
            for child in list(waiting):
                try:
                    if httpx.get(f"{child.url}/health", timeout=1).status_code == 200:
                        waiting.remove(child)
                        continue
                except httpx.TransportError:
                    pass
                if not child.alive or time.monotonic() > deadline:
                    raise RuntimeError(f"{child.name} did not start:\n{child.log_tail()}")
            if waiting:
                time.sleep(0.1)
        yield started
    finally:
        for child in started:
            if child.alive:
                child.popen.terminate()
        for child in started:
            try:
                child.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.popen.kill()
                child.popen.wait(timeout=30)
        for log in logs:
            log.close()


def emulator_spec(name: str, replica: ReplicaModel, model: str = "emu", port: int | None = None) -> ChildSpec:
    """A ``fairgate emulate`` replica with ``replica``'s cost model and slots."""
    port = port or free_port()
    return ChildSpec(
        name,
        (
            "emulate",
            "--port",
            str(port),
            "--model",
            model,
            "--iter-base-ms",
            repr(replica.iter_base_ms),
            "--iter-slope-ms",
            repr(replica.iter_slope_ms),
            "--prefill-ms-per-token",
            repr(replica.prefill_ms_per_token),
            "--max-batch",
            str(replica.max_batch),
            "--max-model-len",
            str(replica.max_model_len),
        ),
        port,
    )


def gateway_spec(name: str, config_path: Path, port: int | None = None) -> ChildSpec:
    port = port or free_port()
    return ChildSpec(name, ("serve", "--config", str(config_path), "--port", str(port)), port)


# --- configuration ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UpstreamEntry:
    """One ``[[upstream]]`` of a gateway: a replica serving ``model``, of which this gateway uses ``max_batch``
    slots (its cost model is the replica's)."""

    name: str
    url: str
    model: str
    max_batch: int
    replica: ReplicaModel


@dataclass(frozen=True)
class TenantEntry:
    """A tenant of the quota document: weight, priority pool and ``limits`` (any key of the quota file's
    ``limits`` table; ints for counts, floats for rates and seconds)."""

    name: str
    weight: float = 1.0
    priority: str = "interactive"
    limits: dict[str, int | float] = field(default_factory=dict)


def tenant_keys(tenants: Sequence[TenantEntry]) -> dict[str, str]:
    """An API key per tenant (deterministic: every gateway of a drill hashes the same keys)."""
    return {t.name: f"fg-drill-{i}-{'k' * 32}" for i, t in enumerate(tenants)}


def gateway_config_text(
    folder: Path,
    index: int,
    policy: str,
    ledger_url: str,
    upstreams: Sequence[UpstreamEntry],
    tenants: Sequence[TenantEntry],
    keys: dict[str, str],
    share_charges_s: float = 0.25,
    default_max_tokens: int = 256,
    sweep_s: float = 10.0,
) -> str:
    """Gateway ``index``'s TOML: the shared ledger, its own journal and event log in ``folder``, and the same
    quota document and keys as every other gateway of the drill."""

    def value(v: int | float) -> str:
        return repr(v) if isinstance(v, int) else repr(float(v))

    ups = "".join(
        f'[[upstream]]\nname = "{u.name}"\nurl = "{u.url}/v1"\nmodel = "{u.model}"\nmax_batch = {u.max_batch}\n'
        f"iter_base_ms = {u.replica.iter_base_ms!r}\niter_slope_ms = {u.replica.iter_slope_ms!r}\n"
        f"prefill_ms_per_token = {u.replica.prefill_ms_per_token!r}\nmax_model_len = {u.replica.max_model_len}\n\n"
        for u in upstreams
    )
    quota_tenants = "".join(
        f'[quotas.tenants."{t.name}"]\ntier = "drill"\nweight = {float(t.weight)!r}\npriority = "{t.priority}"\n'
        + ("limits = { " + ", ".join(f"{k} = {value(v)}" for k, v in t.limits.items()) + " }\n" if t.limits else "")
        for t in tenants
    )
    key_tables = "".join(
        f'[[key]]\ntenant = "{tenant}"\nhash = "{hash_api_key(key)}"\nname = "drill"\n' for tenant, key in keys.items()
    )
    return (
        f'[gateway]\npolicy = "{policy}"\nledger = "{ledger_url}"\njournal = "{folder}/journal-{index}.jsonl"\n'
        f'event_log = "{folder}/events-{index}.jsonl"\ndefault_max_tokens = {default_max_tokens}\n'
        f"request_timeout_s = 600\nshare_charges_s = {float(share_charges_s)!r}\nsweep_s = {float(sweep_s)!r}\n\n"
        f'{ups}[quotas.tiers.drill]\non_ledger_unavailable = "reject"\n\n'
        f"[quotas.defaults]\nmax_concurrent = 100000\nmax_queued = 100000\n\n{quota_tenants}\n{key_tables}"
    )


def fresh_ledger_url(base: str, token: str) -> str:
    """``base`` (``postgresql://...`` or ``redis://...``) with a schema / key prefix of its own (``token``);
    an ``sqlite:///`` URL is returned as is."""
    parts = urlparse(base)
    if parts.scheme in ("postgresql", "postgres"):
        name = "schema"
    elif parts.scheme in ("redis", "rediss"):
        name = "prefix"
    else:
        return base
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != name] + [(name, token)]
    return urlunparse(parts._replace(query=urlencode(query)))


def backend_of(url: str) -> str:
    scheme = urlparse(url).scheme
    return {"postgres": "postgresql", "rediss": "redis"}.get(scheme, scheme)


def default_ledgers() -> tuple[str, ...]:
    """``$FAIRGATE_DRILL_LEDGERS`` (comma-separated), else the PostgreSQL and Redis servers on 127.0.0.1."""
    given = os.environ.get(LEDGER_ENV, "")
    urls = tuple(u.strip() for u in given.split(",") if u.strip())
    return urls or DEFAULT_LEDGERS


async def drop_ledger(ledger: Ledger) -> None:
    """Drop the drill's schema / keys (best effort)."""
    drop = getattr(ledger, "drop_schema", None) or getattr(ledger, "drop_keys", None)
    if drop is not None:
        try:
            await drop()
        except Exception:
            pass


# --- checks over the ledger's reservations (pure) ---------------------------------------------------------------


def bucket_peak(
    consumed: Sequence[tuple[float, float]], credits: Sequence[tuple[float, float]], rate_per_minute: float
) -> float:
    """The most a token bucket let through in one window beyond its refill.

    ``consumed``: (ledger ms, units) taken at each admission; ``credits``: (ledger ms, units) given back
    (final settlements of reservations that used less than they held). Returns the maximum, over windows
    ``[t_i, t_j]`` between two admissions, of ``consumed - credits - rate * (t_j - t_i)`` within the window:
    a bucket of capacity ``burst`` that never goes below zero keeps this at most ``burst``. Credits at the
    window's ends count in it (the lenient side). 0 for no admissions."""
    if not consumed:
        return 0.0
    rate_per_ms = rate_per_minute / 60_000.0
    events = sorted(consumed)
    credit_times = sorted(credits)
    times = [t for t, _ in events]
    # Credits with time <= x and < x, at each admission time (two pointers over sorted lists).
    up_to: list[float] = []
    before: list[float] = []
    total = 0.0
    k = 0
    for t in times:
        while k < len(credit_times) and credit_times[k][0] < t:
            total += credit_times[k][1]
            k += 1
        before.append(total)
        extra, m = 0.0, k
        while m < len(credit_times) and credit_times[m][0] <= t:
            extra += credit_times[m][1]
            m += 1
        up_to.append(total + extra)
    peak = -math.inf
    best_start = -math.inf  # max over i <= j of (-C[i] + before[i] + rate * t_i)
    cumulative = 0.0  # C[j + 1]: units consumed by admissions 0..j
    for j, (t, units) in enumerate(events):
        best_start = max(best_start, -cumulative + before[j] + rate_per_ms * t)
        cumulative += units
        peak = max(peak, cumulative - up_to[j] - rate_per_ms * t + best_start)
    return peak


def peak_overlap(intervals: Sequence[tuple[float, float | None]]) -> int:
    """The most intervals ``[start, end)`` open at one instant (``end`` None: still open). An interval that
    ends at the instant another starts does not overlap it (a slot freed, then taken)."""
    points: list[tuple[float, int]] = []
    for start, end in intervals:
        points.append((start, 1))
        if end is not None:
            points.append((end, -1))
    points.sort(key=lambda p: (p[0], p[1]))  # ends (-1) before starts (+1) at the same instant
    running = peak = 0
    for _, step in points:
        running += step
        peak = max(peak, running)
    return peak


@dataclass(frozen=True)
class GpuBudgetUse:
    """A tenant's GPU budget as the overage rule sees it (ms): ``within`` = sum(min(billed, estimate)) must
    be at most the budget; ``overage`` = sum(billed - estimate where above) is booked beyond it."""

    within_ms: float
    billed_ms: float
    overage_ms: float
    estimate_ms: float


def gpu_budget_use(reservations: Sequence[Reservation]) -> GpuBudgetUse:
    within = sum(min(r.billed.gpu_ms, r.gpu_ms_estimate) for r in reservations)
    billed = sum(r.billed.gpu_ms for r in reservations)
    overage = sum(max(0.0, r.billed.gpu_ms - r.gpu_ms_estimate) for r in reservations)
    return GpuBudgetUse(within, billed, overage, sum(r.gpu_ms_estimate for r in reservations))


def bucket_events(
    reservations: Sequence[Reservation], dimension: str
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(consumed, credits) of one bucket (``requests``, ``input_tokens`` or ``output_tokens``) from the
    reservations (``fairgate.ledger.rules``: reserve takes the prompt and ``max_output_tokens``; the final
    settlement gives back what was held and not billed)."""
    consumed, credits = [], []
    for r in reservations:
        if dimension == "requests":
            consumed.append((r.created_ms, 1.0))
            continue
        if dimension == "input_tokens":
            held = max(r.input_tokens, r.billed.input_tokens)
            consumed.append((r.created_ms, float(held)))
            back = held - r.billed.input_tokens
        else:
            consumed.append((r.created_ms, float(r.max_output_tokens)))
            back = r.max_output_tokens - r.billed.output_tokens
        if r.final_ms is not None and back > 0:
            credits.append((r.final_ms, float(back)))
    return consumed, credits


# --- claim 1: limits ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """A tenant of each group, tight on one dimension: its ``limits``, closed-loop ``clients`` (spread round
    robin over the group's processes) and request lengths."""

    role: str
    limits: dict[str, int | float]
    clients: int
    output_tokens: tuple[int, int] = (8, 16)
    prompt_tokens: int = 16


def default_probes() -> tuple[Probe, ...]:
    return (
        Probe("rate", {"requests_per_minute": 60.0, "requests_burst": 6.0}, clients=6),
        Probe(
            "tokens",
            {
                "output_tokens_per_minute": 600.0,
                "output_tokens_burst": 120.0,
                "input_tokens_per_minute": 3000.0,
                "input_tokens_burst": 240.0,
            },
            clients=6,
        ),
        Probe("slots", {"max_concurrent": 5, "max_queued": 2}, clients=12),
        Probe("gpu", {}, clients=6),  # gpu_seconds set per group (``LimitsConfig.gpu_budget_requests``)
    )


@dataclass(frozen=True)
class LimitsConfig:
    """Claim 1's setting.

    Attributes:
        seconds: the load (all groups at once).
        process_counts: the groups' N (gateway processes each group's traffic is spread over).
        gateway_slots: a group's slots on its replica, in total over its N processes (``/ N`` each).
        replica: each group's emulated replica (one per group, with slots to spare: it never queues).
        probes: the tenants of each group.
        gpu_budget_requests: the gpu tenant's budget, in estimated requests of mean length.
        sample_s: how often the ledger accounts of the slots tenants are read during the load.
        error_backoff_s: a client that got an error waits this long before its next request.
        drain_s: after the load the clients send nothing more and wait this long for the requests in flight
            (queued ones included) before hanging up, so every admitted request ends in an answer.
    """

    seconds: float = 8.0
    process_counts: tuple[int, ...] = (1, 2, 4)
    gateway_slots: int = 4
    replica: ReplicaModel = field(
        default_factory=lambda: ReplicaModel(
            iter_base_ms=25.0, iter_slope_ms=0.5, prefill_ms_per_token=0.02, max_batch=64, max_model_len=4096
        )
    )
    probes: tuple[Probe, ...] = field(default_factory=default_probes)
    gpu_budget_requests: int = 12
    sample_s: float = 0.1
    error_backoff_s: float = 0.5
    drain_s: float = 10.0

    def __post_init__(self) -> None:
        for n in self.process_counts:
            if n < 1 or self.gateway_slots % n:
                raise ValueError(f"scale_out: gateway_slots {self.gateway_slots} must split evenly over {n} processes")

    @property
    def processes(self) -> int:
        return max(self.process_counts)

    def model(self, n: int) -> str:
        return f"n{n}"

    def tenant(self, probe: Probe, n: int) -> str:
        return f"{probe.role}-n{n}"

    def slots_per_process(self, n: int) -> int:
        return self.gateway_slots // n

    def gpu_estimate_ms(self, n: int, probe: Probe) -> float:
        """The gateway's GPU estimate of a request of mean length (``app.serve``: prefill + max_tokens x the
        decode charge at the upstream's ``max_batch``)."""
        from fairgate.core.cost import CostModel

        r = self.replica
        cost = CostModel(r.iter_base_ms, r.iter_slope_ms, r.prefill_ms_per_token, self.slots_per_process(n))
        mean = (probe.output_tokens[0] + probe.output_tokens[1]) / 2
        return cost.prefill_ms(probe.prompt_tokens) + mean * cost.decode_charge_ms(cost.max_batch)

    def limits_of(self, probe: Probe, n: int) -> dict[str, int | float]:
        if probe.role != "gpu":
            return dict(probe.limits)
        budget_s = round(self.gpu_budget_requests * self.gpu_estimate_ms(n, probe) / 1000.0, 3)
        return {**probe.limits, "gpu_seconds": budget_s, "gpu_seconds_total": budget_s}

    def tenants(self) -> list[TenantEntry]:
        return [
            TenantEntry(self.tenant(p, n), limits=self.limits_of(p, n))
            for n in self.process_counts
            for p in self.probes
        ]


@dataclass(frozen=True)
class TenantLimitFigures:
    """One probe tenant's figures: what the ledger admitted against each limit, and what its clients saw."""

    tenant: str
    role: str
    n: int
    sent: int
    ok: int
    cut: int
    errors: dict[str, int]
    admitted: int  # reservations in the ledger
    settled: int
    open_at_end: int
    peaks: dict[str, tuple[float, float]]  # bucket -> (peak beyond refill, burst)
    concurrent_peak: int  # overlapping [created, final) intervals
    concurrent_sampled: int  # most the account showed when sampled
    queued_sampled: int
    samples: int
    gpu: GpuBudgetUse | None
    gpu_budget_ms: float | None
    limits: dict[str, int | float]
    account_after: tuple[int, int]  # (concurrent, queued) of the account at the end

    def problems(self) -> list[str]:
        """Every limit exceeded and every request unaccounted for (empty: the tenant's part holds)."""
        out = []
        for bucket, (peak, burst) in self.peaks.items():
            if peak > burst + EPSILON * max(1.0, burst):
                out.append(
                    f"{self.tenant}: {bucket} bucket let {peak:.3f} through in one window beyond its refill "
                    f"(burst {burst:g})"
                )
        limit = self.limits.get("max_concurrent")
        if limit is not None:
            if self.concurrent_peak > limit:
                out.append(f"{self.tenant}: {self.concurrent_peak} reservations open at once (max_concurrent {limit})")
            if self.concurrent_sampled > limit:
                out.append(
                    f"{self.tenant}: the account showed {self.concurrent_sampled} concurrent (max_concurrent {limit})"
                )
        limit = self.limits.get("max_queued")
        if limit is not None and self.queued_sampled > limit:
            out.append(f"{self.tenant}: the account showed {self.queued_sampled} queued (max_queued {limit})")
        if self.gpu is not None and self.gpu_budget_ms is not None:
            if self.gpu.within_ms > self.gpu_budget_ms * (1 + EPSILON):
                out.append(
                    f"{self.tenant}: {self.gpu.within_ms:.1f} GPU ms billed within estimates, over the "
                    f"budget of {self.gpu_budget_ms:.1f}"
                )
        if self.open_at_end:
            out.append(f"{self.tenant}: {self.open_at_end} reservations still open after the hang-ups were billed")
        if self.account_after != (0, 0):
            out.append(
                f"{self.tenant}: the account holds {self.account_after[0]} concurrent and "
                f"{self.account_after[1]} queued after the load (leaked)"
            )
        # A success is a settled reservation; a request settled just before its client hung up at the deadline
        # (the final settlement precedes ``[DONE]``) is settled too.
        if not self.ok <= self.settled <= self.ok + self.cut:
            out.append(
                f"{self.tenant}: {self.ok} successes and {self.cut} hang-ups, but {self.settled} settled reservations"
            )
        # Every reservation is a request its client saw succeed, fail after admission (queue full, upstream
        # error) or hung up on at the deadline; a hang-up may also come before the request was admitted.
        answered = self.ok + sum(n for code, n in self.errors.items() if _after_admission(code))
        if not answered <= self.admitted <= answered + self.cut:
            out.append(
                f"{self.tenant}: {self.admitted} reservations, but {answered} requests answered after "
                f"admission and {self.cut} hung up on"
            )
        return out


def _dimension(error: str) -> str:
    """The quota dimension a client's error names (``429:rate_limit_exceeded[max_concurrent]``); a queue-full
    429 carries none (the gateway sends ``x-fairgate-quota-dimension`` only with refusals at admission), and
    is ``max_queued``."""
    if "queue_full" in error:
        return "max_queued"
    return error.partition("[")[2].rstrip("]")


def _after_admission(error: str) -> bool:
    """An error a client gets after its request was admitted (it has a reservation)."""
    return "queue_full" in error or "upstream_error" in error or "no_upstream" in error or error.startswith("stream:")


@dataclass(frozen=True)
class ReplicaTruth:
    """An emulated replica's own figures: busy ms and the charge rule's ms per tenant (``cache_salt``)."""

    busy_ms: float
    by_tenant_ms: dict[str, float]
    running: int
    waiting: int  # submitted, not yet admitted (a request waits for the next iteration boundary even with free slots)

    @property
    def occupancy(self) -> int:
        """Sequences running or waiting: more than ``max_batch`` means the replica queues beyond its slots."""
        return self.running + self.waiting


@dataclass(frozen=True)
class GroupFigures:
    n: int
    tenants: dict[str, TenantLimitFigures]
    ledger_gpu_ms: float  # billed to the group's tenants
    replica: ReplicaTruth | None
    occupancy_max: int  # most sequences the group's replica held (running + waiting) when sampled


@dataclass(frozen=True)
class LimitsFigures:
    backend: str
    groups: dict[int, GroupFigures]
    seconds: float
    wall_s: float
    settle_s: float  # after the hang-up, until no reservation was open
    folder: str | None = None  # the servers' logs and event logs, kept when a check failed


async def _sample_accounts(
    ledger: Ledger, pairs: list[tuple[str, str]], every_s: float, seen: dict[str, list[int]], stop: asyncio.Event
) -> None:
    """Read each (tenant, model) account every ``every_s`` until ``stop``; ``seen[tenant]`` = [max concurrent,
    max queued, samples]."""
    from fairgate.ledger import LedgerError

    while not stop.is_set():
        for tenant, model in pairs:
            try:
                account = await ledger.account(tenant, model)
            except LedgerError:
                continue
            row = seen.setdefault(tenant, [0, 0, 0])
            row[0] = max(row[0], account.concurrent)
            row[1] = max(row[1], account.queued)
            row[2] += 1
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


async def read_replica(url: str, timeout_s: float = 2.0) -> ReplicaTruth | None:
    """An emulator's ``/emulator/stats`` (None if it does not answer); tenants mapped back from their
    ``cache_salt`` by the caller."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            stats = (await http.get(f"{url}/emulator/stats")).json()
    except (httpx.HTTPError, ValueError):
        return None
    return ReplicaTruth(
        float(stats["busy_ms"]),
        dict(stats["charge_rule_ms_by_cache_salt"]),
        int(stats["running"]),
        int(stats["waiting"]),
    )


def by_tenant(truth: ReplicaTruth, tenants: Sequence[str]) -> dict[str, float]:
    """The replica's charge-rule ms per tenant (its ``cache_salt`` is the tenant's tag)."""
    from fairgate.ledger.base import tenant_tag

    return {t: float(truth.by_tenant_ms.get(tenant_tag(t), 0.0)) for t in tenants}


async def watch_replicas(
    urls: dict[Any, str], every_s: float, occupancy: dict[Any, int], stop: asyncio.Event, until: float | None = None
) -> None:
    """Sample each replica's occupancy (running + waiting) every ``every_s`` until ``stop`` (or the monotonic
    time ``until``); ``occupancy[key]`` = the most seen."""
    while not stop.is_set() and (until is None or time.monotonic() < until):
        for key, url in urls.items():
            truth = await read_replica(url, timeout_s=1.0)
            if truth is not None:
                occupancy[key] = max(occupancy.get(key, 0), truth.occupancy)
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


async def wait_settled(ledger: Ledger, deadline_s: float) -> float:
    """Wait until no reservation is open (the gateways billed every hang-up) or ``deadline_s`` passes;
    returns the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        if not await ledger.reservations(status="open"):
            break
        await asyncio.sleep(0.1)
    return time.monotonic() - start


def spread(load: TenantLoad, urls: Sequence[str]) -> list[tuple[str, TenantLoad]]:
    """``load``'s clients dealt round robin over ``urls`` (client i to url i mod len(urls))."""
    out = []
    for i, url in enumerate(urls):
        clients = len(range(i, load.clients, len(urls)))
        if clients:
            out.append((url, replace(load, clients=clients)))
    return out


async def drive(
    assignments: Sequence[tuple[str, TenantLoad]],
    seconds: float,
    model_of: dict[str, str],
    seed: int,
    drain_s: float = 0.0,
) -> LoadReport:
    """Run every (gateway URL, load) at once (one ``run_load`` per URL and model, each with its own seed)
    and merge what the clients saw into one report."""
    from fairgate.drills.loadgen import run_load

    by_target: dict[tuple[str, str], list[TenantLoad]] = {}
    for url, load in assignments:
        by_target.setdefault((url, model_of[load.tenant]), []).append(load)
    reports = await asyncio.gather(
        *(
            run_load(url, loads, seconds, model=model, seed=seed * 1000 + i, drain_s=drain_s)
            for i, ((url, model), loads) in enumerate(sorted(by_target.items()))
        )
    )
    merged = LoadReport(seconds)
    for report in reports:
        merged.samples.extend(report.samples)
        merged.skipped.update(report.skipped)
    return merged


def run_limits(config: LimitsConfig, ledger_base: str, policy: str = "gpu_fair", seed: int = 1) -> LimitsFigures:
    """Claim 1 on the ledger at ``ledger_base`` (a fresh schema / prefix, dropped after)."""
    from fairgate.gateway.config import load_gateway_config
    from fairgate.ledger import connect

    started = time.monotonic()
    token = f"fgdrill_{uuid.uuid4().hex[:10]}"
    ledger_url = fresh_ledger_url(ledger_base, token)
    tenants = config.tenants()
    keys = tenant_keys(tenants)
    folder = Path(tempfile.mkdtemp(prefix="fairgate-drill-scale-"))
    replicas = {n: emulator_spec(f"emulator-n{n}", config.replica, model="emu") for n in config.process_counts}
    gateway_ports = [free_port() for _ in range(config.processes)]
    with children(list(replicas.values()), folder) as emulators:
        urls = {n: child.url for n, child in zip(replicas, emulators)}
        paths = []
        for i in range(config.processes):
            upstreams = [
                UpstreamEntry(f"emu-n{n}", urls[n], config.model(n), config.slots_per_process(n), config.replica)
                for n in config.process_counts
                if i < n
            ]
            path = folder / f"gateway-{i}.toml"
            path.write_text(
                gateway_config_text(folder, i, policy, ledger_url, upstreams, tenants, keys, default_max_tokens=64)
            )
            paths.append(path)
        gateway_config = load_gateway_config(paths[0])

        async def go() -> tuple[
            LoadReport,
            list[Reservation],
            dict[str, list[int]],
            dict[int, int],
            dict[str, tuple[int, int]],
            float,
            dict[int, ReplicaTruth | None],
        ]:
            ledger = await connect(ledger_url, gateway_config.quotas)  # creates the schema before the gateways
            try:
                with children(
                    [gateway_spec(f"gateway-{i}", p, port) for i, (p, port) in enumerate(zip(paths, gateway_ports))],
                    folder,
                ) as gateways:
                    assignments = []
                    model_of = {}
                    for n in config.process_counts:
                        group_urls = [g.url for g in gateways[:n]]
                        for probe in config.probes:
                            name = config.tenant(probe, n)
                            model_of[name] = config.model(n)
                            load = TenantLoad(
                                name,
                                keys[name],
                                clients=probe.clients,
                                output_tokens=probe.output_tokens,
                                prompt_tokens=probe.prompt_tokens,
                                error_backoff_s=config.error_backoff_s,
                            )
                            assignments += spread(load, group_urls)
                    stop = asyncio.Event()
                    seen: dict[str, list[int]] = {}
                    occupancy: dict[int, int] = {}
                    sampled = [
                        (config.tenant(p, n), config.model(n))
                        for n in config.process_counts
                        for p in config.probes
                        if "max_concurrent" in p.limits or "max_queued" in p.limits
                    ]
                    sampler = asyncio.ensure_future(_sample_accounts(ledger, sampled, config.sample_s, seen, stop))
                    watcher = asyncio.ensure_future(watch_replicas(urls, 0.25, occupancy, stop))
                    report = await drive(assignments, config.seconds, model_of, seed, drain_s=config.drain_s)
                    stop.set()
                    await asyncio.gather(sampler, watcher)
                    settle_s = await wait_settled(ledger, SETTLE_S_MAX)
                    reservations = await ledger.reservations()
                    accounts = {}
                    for name, model in model_of.items():
                        account = await ledger.account(name, model)
                        accounts[name] = (account.concurrent, account.queued)
                    truths = {n: await read_replica(url) for n, url in urls.items()}
                    return report, reservations, seen, occupancy, accounts, settle_s, truths
            finally:
                await drop_ledger(ledger)
                await ledger.close()

        report, reservations, seen, occupancy, accounts, settle_s, truths = asyncio.run(go())
    groups = {}
    for n in config.process_counts:
        tenants_n = {
            config.tenant(p, n): _tenant_limit_figures(config, p, n, reservations, report, seen, accounts)
            for p in config.probes
        }
        gpu_ms = sum(r.billed.gpu_ms for r in reservations if r.tenant in tenants_n)
        groups[n] = GroupFigures(n, tenants_n, gpu_ms, truths.get(n), occupancy.get(n, 0))
    figures = LimitsFigures(backend_of(ledger_base), groups, config.seconds, time.monotonic() - started, settle_s)
    if limits_problems(figures):
        return replace(figures, folder=str(folder))
    shutil.rmtree(folder, ignore_errors=True)  # kept (with the servers' logs) when the run raised or a check failed
    return figures


def _tenant_limit_figures(
    config: LimitsConfig,
    probe: Probe,
    n: int,
    reservations: Sequence[Reservation],
    report: LoadReport,
    seen: dict[str, list[int]],
    accounts: dict[str, tuple[int, int]],
) -> TenantLimitFigures:
    """One probe tenant's figures from every reservation, what its clients saw and the accounts sampled."""
    name = config.tenant(probe, n)
    limits = config.limits_of(probe, n)
    mine = [r for r in reservations if r.tenant == name]
    stats = report.stats(name)
    peaks = {}
    for bucket in ("requests", "input_tokens", "output_tokens"):
        rate = limits.get(f"{bucket}_per_minute")
        if rate is None:
            continue
        burst = float(limits.get(f"{bucket}_burst", rate))
        consumed, credits = bucket_events(mine, bucket)
        peaks[bucket] = (bucket_peak(consumed, credits, float(rate)), burst)
    budget = limits.get("gpu_seconds")
    concurrent, queued, samples = seen.get(name, [0, 0, 0])
    return TenantLimitFigures(
        name,
        probe.role,
        n,
        stats.requests,
        stats.completed,
        stats.cut,
        stats.errors,
        len(mine),
        sum(r.status == "settled" for r in mine),
        sum(r.status == "open" for r in mine),
        peaks,
        peak_overlap([(r.created_ms, r.final_ms) for r in mine]),
        concurrent,
        queued,
        samples,
        gpu_budget_use(mine) if budget is not None else None,
        float(budget) * 1000.0 if budget is not None else None,
        limits,
        accounts.get(name, (0, 0)),
    )


def limits_problems(figs: LimitsFigures) -> list[str]:
    """Every violated limit, lost request and missing exercise (a limit that never bound at the largest N)."""
    out = []
    for group in figs.groups.values():
        for t in group.tenants.values():
            out.extend(t.problems())
            if t.sent == 0:
                out.append(f"{t.tenant}: sent nothing")
            unexpected = {k: v for k, v in t.errors.items() if not k.startswith("429") and k != "connection"}
            if unexpected:
                out.append(f"{t.tenant}: errors other than 429: {unexpected}")
    largest = figs.groups[max(figs.groups)]
    bound = Counter(_dimension(code) for t in largest.tenants.values() for code in t.errors)
    for dimension in ("requests_per_minute", "output_tokens_per_minute", "max_concurrent", "max_queued", "gpu_seconds"):
        if not bound.get(dimension):
            out.append(f"N={largest.n}: no request was refused for {dimension}: {NOT_EXERCISED}")
    return out


# --- claim 2: fair dispatch across processes --------------------------------------------------------------------


@dataclass(frozen=True)
class FairnessConfig:
    """Claim 2's setting.

    Attributes:
        seconds / warmup_s: the load, and the start of it left out of the shares (default none: the policy
            equalizes the counters every tenant has run up since its first request, so the whole run is what
            it answers for; a window after a warm-up also counts the repayment of what the start owed).
        gateways / replicas / replica: the processes (each gateway gets ``max_batch / gateways`` of every
            replica's slots).
        mix: tenant -> mean output tokens (seed 002); lengths uniform within +-``spread`` of the mean.
        clients: tenant -> closed-loop clients through each gateway (a tenant absent from a gateway sends
            nothing there).
        share_charges_s: the gateways' ``[gateway].share_charges_s``.
        ratio_max: the claim: max/min of the GPU shares billed (after the warm-up, if any).
        snapshot_every_s: ledger snapshots for the convergence time.
    """

    seconds: float = 30.0
    warmup_s: float = 0.0
    gateways: int = 2
    replicas: int = 2
    replica: ReplicaModel = field(
        default_factory=lambda: ReplicaModel(
            iter_base_ms=9.0, iter_slope_ms=0.55, prefill_ms_per_token=0.06, max_batch=24, max_model_len=4096
        )
    )
    mix: dict[str, float] = field(default_factory=lambda: dict(SEED_MIX))
    spread: float = 0.5
    prompt_tokens: int = 400
    clients: dict[str, tuple[int, ...]] = field(
        default_factory=lambda: {"classify": (32, 0), "chat": (24, 8), "summarise": (8, 24), "agent": (0, 32)}
    )
    share_charges_s: float = 0.25
    ratio_max: float = 1.10
    snapshot_every_s: float = 2.0

    def __post_init__(self) -> None:
        if self.replica.max_batch % self.gateways:
            raise ValueError(
                f"scale_out: a replica's {self.replica.max_batch} slots must split evenly over {self.gateways} gateways"
            )
        if self.warmup_s < 0 or self.seconds < self.warmup_s + 5.0:
            raise ValueError(f"scale_out: {self.seconds:g} s leaves under 5 s after the {self.warmup_s:g} s warm-up")
        for tenant, split in self.clients.items():
            if tenant not in self.mix or len(split) != self.gateways:
                raise ValueError(f"scale_out: clients of {tenant!r} must name one count per gateway")

    @property
    def tenants(self) -> tuple[str, ...]:
        return tuple(self.mix)

    def output_range(self, tenant: str) -> tuple[int, int]:
        mean = self.mix[tenant]
        return max(1, round(mean * (1 - self.spread))), max(1, round(mean * (1 + self.spread)))


@dataclass(frozen=True)
class FairnessFigures:
    share_charges_s: float
    shares: dict[str, float]  # ledger, after the warm-up (the whole run without one)
    truth_shares: dict[str, float]  # the replicas' charge rule, same window
    by_gateway: dict[str, tuple[int, ...]]  # tenant -> requests sent through each gateway
    sent: dict[str, int]
    completed: dict[str, int]
    errors: dict[str, dict[str, int]]
    ledger_gpu_ms: float  # after the warm-up
    replica_busy_ms: float  # same window, every replica
    converge_s: float | None  # from the start: the cumulative max/min stays within ratio_max from here on
    timeline: list[tuple[float, float]]  # (s, max/min of the shares billed from the warm-up to then)
    open_at_end: int
    occupancy_max: int  # most sequences a replica held during the load (<= its slots: never overfilled)
    wall_s: float
    whole_shares: dict[str, float] = field(default_factory=dict)  # ledger, the whole run
    left_open: tuple[str, ...] = ()  # the reservations still open at the end, described
    folder: str | None = None  # the servers' logs and event logs, kept when something was left open

    @property
    def ratio(self) -> float:
        values = list(self.shares.values())
        return max(values) / min(values) if values and min(values) > 0 else math.inf

    @property
    def truth_ratio(self) -> float:
        values = list(self.truth_shares.values())
        return max(values) / min(values) if values and min(values) > 0 else math.inf

    @property
    def billed_over_busy(self) -> float:
        return self.ledger_gpu_ms / self.replica_busy_ms if self.replica_busy_ms > 0 else math.inf


def _describe(r: Reservation) -> str:
    return (
        f"{r.tenant} {r.request_id} created {r.created_ms:.0f} ms queued={r.queued} billed "
        f"{r.billed.input_tokens}/{r.billed.output_tokens} tokens {r.billed.gpu_ms:.1f} GPU ms"
    )


def _ratio(shares: dict[str, float]) -> float:
    values = list(shares.values())
    return max(values) / min(values) if values and min(values) > 0 else math.inf


def run_fairness(
    config: FairnessConfig, ledger_base: str, policy: str = "gpu_fair", seed: int = 1, keep_logs: bool = True
) -> FairnessFigures:
    """Claim 2 on the ledger at ``ledger_base`` (a fresh schema / prefix, dropped after). With ``keep_logs``
    the servers' logs are kept (``FairnessFigures.folder``) when a reservation was left open."""
    from fairgate.drills.stack import LedgerReport, TenantTotals
    from fairgate.gateway.config import load_gateway_config
    from fairgate.ledger import connect

    started = time.monotonic()
    ledger_url = fresh_ledger_url(ledger_base, f"fgdrill_{uuid.uuid4().hex[:10]}")
    tenants = [TenantEntry(t) for t in config.tenants]
    keys = tenant_keys(tenants)
    folder = Path(tempfile.mkdtemp(prefix="fairgate-drill-fair-"))
    per_gateway = config.replica.max_batch // config.gateways
    with children([emulator_spec(f"emulator-{i}", config.replica) for i in range(config.replicas)], folder) as emus:
        upstreams = [UpstreamEntry(f"emu-{i}", e.url, "emu", per_gateway, config.replica) for i, e in enumerate(emus)]
        paths = []
        for i in range(config.gateways):
            path = folder / f"gateway-{i}.toml"
            path.write_text(
                gateway_config_text(
                    folder,
                    i,
                    policy,
                    ledger_url,
                    upstreams,
                    tenants,
                    keys,
                    share_charges_s=config.share_charges_s,
                    default_max_tokens=1024,
                )
            )
            paths.append(path)
        quotas = load_gateway_config(paths[0]).quotas

        async def totals(ledger: Ledger) -> LedgerReport:
            out = {}
            for tenant in config.tenants:
                usage = await ledger.usage(tenant, 10 * 365 * 86_400)
                out[tenant] = TenantTotals(
                    tenant, usage.requests, usage.input_tokens, usage.output_tokens, usage.gpu_ms, dict(usage.by_status)
                )
            return LedgerReport(out)

        async def truth_now() -> tuple[dict[str, float], float]:
            found = [await read_replica(e.url) for e in emus]
            gpu = dict.fromkeys(config.tenants, 0.0)
            busy = 0.0
            for truth in found:
                if truth is None:
                    continue
                for t, ms in by_tenant(truth, config.tenants).items():
                    gpu[t] += ms
                busy += truth.busy_ms
            return gpu, busy

        async def go() -> FairnessFigures:
            ledger = await connect(ledger_url, quotas)
            try:
                with children([gateway_spec(f"gateway-{i}", p) for i, p in enumerate(paths)], folder) as gateways:
                    assignments = []
                    for tenant, split in config.clients.items():
                        for gateway, clients in zip(gateways, split):
                            if clients:
                                assignments.append(
                                    (
                                        gateway.url,
                                        TenantLoad(
                                            tenant,
                                            keys[tenant],
                                            clients=clients,
                                            output_tokens=config.output_range(tenant),
                                            prompt_tokens=config.prompt_tokens,
                                        ),
                                    )
                                )
                    model_of = dict.fromkeys(config.tenants, "emu")
                    begin = time.monotonic()
                    snapshots: list[tuple[float, LedgerReport]] = []
                    warm: dict[str, Any] = {}
                    occupancy: dict[int, int] = {}
                    stop = asyncio.Event()
                    # Until just before the hang-up (a cancelled sequence holds its slot until the replica's next
                    # boundary, while the gateway has handed the slot on).
                    occupied = asyncio.ensure_future(
                        watch_replicas(
                            dict(enumerate(e.url for e in emus)), 0.25, occupancy, stop, begin + config.seconds - 0.5
                        )
                    )

                    async def watch() -> None:
                        next_at = config.warmup_s
                        while True:
                            await asyncio.sleep(max(0.0, begin + next_at - time.monotonic()))
                            report = await totals(ledger)
                            gpu, busy = await truth_now()
                            if not warm:
                                warm.update(report=report, gpu=gpu, busy=busy)
                            snapshots.append((time.monotonic() - begin, report))
                            next_at += config.snapshot_every_s

                    watcher = asyncio.ensure_future(watch())
                    report = await drive(assignments, config.seconds, model_of, seed)
                    watcher.cancel()
                    stop.set()
                    await asyncio.gather(watcher, occupied, return_exceptions=True)
                    await wait_settled(ledger, FAIRNESS_SETTLE_S_MAX)
                    end = await totals(ledger)
                    gpu, busy = await truth_now()
                    left_open = await ledger.reservations(status="open")
                    open_left = len(left_open)
            finally:
                await drop_ledger(ledger)
                await ledger.close()
            base = warm.get("report")
            window = end.minus(base) if base is not None else end
            truth_window = {t: gpu[t] - warm.get("gpu", {}).get(t, 0.0) for t in config.tenants}
            truth_total = sum(truth_window.values())
            timeline = []
            for at_s, snap in snapshots[1:]:
                timeline.append((at_s, _ratio(snap.minus(base).shares() if base is not None else snap.shares())))
            timeline.append((config.seconds, _ratio(window.shares())))
            converge = None
            for at_s, ratio in timeline:
                if ratio <= config.ratio_max:
                    converge = at_s if converge is None else converge
                else:
                    converge = None
            stats = {t: report.stats(t) for t in config.tenants}
            return FairnessFigures(
                config.share_charges_s,
                window.shares(),
                {t: (g / truth_total if truth_total > 0 else 0.0) for t, g in truth_window.items()},
                {t: config.clients[t] for t in config.tenants},
                {t: s.requests for t, s in stats.items()},
                {t: s.completed for t, s in stats.items()},
                {t: s.errors for t, s in stats.items()},
                window.gpu_ms,
                busy - warm.get("busy", 0.0),
                converge,
                timeline,
                open_left,
                max(occupancy.values(), default=0),
                time.monotonic() - started,
                end.shares(),
                tuple(_describe(r) for r in left_open),
                str(folder) if left_open and keep_logs else None,
            )

        figures = asyncio.run(go())
    if figures.folder is None:
        shutil.rmtree(folder, ignore_errors=True)  # kept (with the servers' logs) when the run raised
    return figures


# --- the drill ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScaleOutConfig:
    """Both claims: the limits on every ledger of ``ledgers``, the fairness on the first."""

    limits: LimitsConfig = field(default_factory=LimitsConfig)
    fairness: FairnessConfig = field(default_factory=FairnessConfig)
    ledgers: tuple[str, ...] = field(default_factory=default_ledgers)


@dataclass(frozen=True)
class ScaleOutResult(RenderedResult):
    config: ScaleOutConfig
    limits: tuple[LimitsFigures, ...]
    fairness: FairnessFigures | None
    compare: FairnessFigures | None  # the same with share_charges_s = 0
    policy: str
    name: str = "scale_out"

    def problems(self) -> list[str]:
        out = []
        for figs in self.limits:
            out.extend(f"{figs.backend}: {p}" for p in limits_problems(figs))
        if self.fairness is not None:
            out.extend(fairness_problems(self.config.fairness, self.fairness))
        return out

    @property
    def passed(self) -> bool:
        return not self.problems()

    def render(self) -> list[Any]:
        out: list[Any] = []
        for figs in self.limits:
            out.extend(render_limits(self.config.limits, figs))
        for figs in (self.fairness, self.compare):
            if figs is not None:
                out.extend(render_fairness(self.config.fairness, figs, comparison=figs is self.compare))
        problems = self.problems()
        for problem in problems:
            out.append(f"[red]problem[/red]: {problem}")
        verdict = "[green]PASS[/green]" if not problems else "[red]FAIL[/red]"
        line = f"{verdict}: under {self.policy}"
        if self.limits:
            exceeded = any(p for f in self.limits for p in limits_problems(f) if NOT_EXERCISED not in p)
            unexercised = any(NOT_EXERCISED in p for f in self.limits for p in limits_problems(f))
            line += (
                f", N = {', '.join(str(n) for n in self.config.limits.process_counts)} processes admitted "
                f"{'BEYOND' if exceeded else 'nothing beyond'} the limits on "
                f"{', '.join(f.backend for f in self.limits)}"
                + (" (but not every limit was reached: a longer --seconds exercises them all)" if unexercised else "")
            )
        if self.fairness is not None:
            line += f"; GPU shares across {self.config.fairness.gateways} processes max/min {self.fairness.ratio:.3f}"
        if self.compare is not None:
            line += f" (without shared counters: {self.compare.ratio:.3f})"
        out.append(line + ".")
        return out


def fairness_problems(config: FairnessConfig, figs: FairnessFigures) -> list[str]:
    out = []
    if figs.ratio > config.ratio_max:
        out.append(f"GPU shares across processes: max/min {figs.ratio:.3f} > {config.ratio_max:g}")
    if figs.open_at_end:
        out.append(
            f"fairness: {figs.open_at_end} reservations open {FAIRNESS_SETTLE_S_MAX:g} s after the hang-ups: "
            f"{'; '.join(figs.left_open[:3])}" + (f" (logs kept in {figs.folder})" if figs.folder else "")
        )
    for tenant, errors in figs.errors.items():
        if errors:
            out.append(f"fairness: {tenant} had errors: {errors}")
    if figs.occupancy_max > config.replica.max_batch:
        out.append(
            f"fairness: a replica held {figs.occupancy_max} sequences, more than its {config.replica.max_batch} "
            "slots: the gateways together overfilled it"
        )
    return out


def render_limits(config: LimitsConfig, figs: LimitsFigures) -> list[Any]:
    from rich.table import Table

    out: list[Any] = [
        f"[bold]drill scale_out[/bold] - limits on {figs.backend}: groups N = "
        f"{', '.join(str(n) for n in config.process_counts)} of `fairgate serve` processes sharing one ledger, "
        f"{config.seconds:g} s of closed-loop load at once ({config.gateway_slots} gateway slots per group, "
        f"split over its N processes); every reservation checked against the limits."
    ]
    table = Table(title=f"limits held ({figs.backend})", title_justify="left")
    for column in ("N", "tenant", "limits", "sent/ok/cut", "admitted", "refused (429)", "peak / allowed", "open"):
        table.add_column(
            column,
            justify="left" if column in ("tenant", "limits", "refused (429)", "peak / allowed") else "right",
            no_wrap=column not in ("limits", "refused (429)", "peak / allowed"),
        )
    for n, group in figs.groups.items():
        for t in group.tenants.values():
            peaks = [f"{b.replace('_tokens', '')} {p:.1f}/{burst:g}" for b, (p, burst) in t.peaks.items()]
            if "max_concurrent" in t.limits:
                peaks.append(f"open {t.concurrent_peak} (sampled {t.concurrent_sampled})/{t.limits['max_concurrent']}")
            if "max_queued" in t.limits:
                peaks.append(f"queued {t.queued_sampled}/{t.limits['max_queued']} ({t.samples} samples)")
            if t.gpu is not None and t.gpu_budget_ms is not None:
                peaks.append(
                    f"GPU {t.gpu.within_ms / 1000:.2f}/{t.gpu_budget_ms / 1000:.2f} s "
                    f"(+{t.gpu.overage_ms / 1000:.2f} s overage)"
                )
            limits = ", ".join(
                f"{k.replace('_per_minute', '/min')}={v:g}" for k, v in t.limits.items() if k != "gpu_seconds_total"
            )
            table.add_row(
                str(n),
                t.tenant,
                limits,
                f"{t.sent}/{t.ok}/{t.cut}",
                str(t.admitted),
                fmt_errors({k: v for k, v in t.errors.items()}),
                "; ".join(peaks),
                str(t.open_at_end),
            )
    table.caption = (
        f"peak: the most a bucket let through in one window beyond its refill (<= burst), the most "
        f"reservations open at once, the most queue places sampled, GPU billed within estimates "
        f"(<= budget). Hang-ups billed {figs.settle_s:.1f} s after the load; wall {figs.wall_s:.0f} s."
    )
    table.caption_justify = "left"
    out.append(table)
    billing = Table(title="GPU billed by the ledger vs the replica's own charge rule, per group", title_justify="left")
    for column in ("N", "ledger GPU s", "replica busy s", "billed / busy", "replica occupancy (max)"):
        billing.add_column(column, justify="right")
    for n, group in figs.groups.items():
        busy = group.replica.busy_ms if group.replica is not None else 0.0
        billing.add_row(
            str(n),
            f"{group.ledger_gpu_ms / 1000:.2f}",
            f"{busy / 1000:.2f}",
            f"{group.ledger_gpu_ms / busy:.2f}" if busy > 0 else "-",
            str(group.occupancy_max),
        )
    out.append(billing)
    problems = limits_problems(figs)
    if figs.folder:
        out.append(f"servers' logs and event logs kept in {figs.folder}")
    out.append(
        f"load held: {sum(t.sent for g in figs.groups.values() for t in g.tenants.values())} requests; "
        f"faults injected: none (N processes); lost: "
        f"{sum(t.open_at_end for g in figs.groups.values() for t in g.tenants.values())} open reservations, "
        f"{len(problems)} problem{'' if len(problems) == 1 else 's'}; converged (no reservation open) {figs.settle_s:.1f} s after the hang-up."
    )
    return out


def render_fairness(config: FairnessConfig, figs: FairnessFigures, comparison: bool = False) -> list[Any]:
    from rich.table import Table

    sharing = f"share_charges_s = {figs.share_charges_s:g}" + (
        " (counters not shared)" if not figs.share_charges_s else ""
    )
    out: list[Any] = []
    if not comparison:
        out.append(
            f"[bold]drill scale_out[/bold] - fair dispatch across {config.gateways} gateway processes, "
            f"{config.replicas} emulated replicas x {config.replica.max_batch} slots (each gateway "
            f"{config.replica.max_batch // config.gateways} per replica), seed 002's output mix, clients split "
            f"unevenly; {config.seconds:g} s, shares "
            + (f"after {config.warmup_s:g} s." if config.warmup_s else "over the whole run.")
        )
    table = Table(title=f"GPU shares, {sharing}" + (" - comparison" if comparison else ""), title_justify="left")
    for column in ("tenant", "mean out", "clients per gateway", "sent/done", "errors", "ledger GPU %", "replica GPU %"):
        table.add_column(column, justify="left" if column in ("tenant", "errors") else "right")
    for tenant in config.tenants:
        table.add_row(
            tenant,
            f"{config.mix[tenant]:g}",
            " / ".join(str(c) for c in figs.by_gateway[tenant]),
            f"{figs.sent[tenant]}/{figs.completed[tenant]}",
            fmt_errors(figs.errors[tenant]),
            f"{figs.shares[tenant] * 100:.1f}",
            f"{figs.truth_shares[tenant] * 100:.1f}",
        )
    converge = "never" if figs.converge_s is None else f"{figs.converge_s:.0f} s"
    table.caption = (
        f"max/min {figs.ratio:.3f} (ledger), {figs.truth_ratio:.3f} (replicas' charge rule); limit "
        f"{config.ratio_max:g}. Within the limit from {converge} on. Ledger billed "
        f"{figs.ledger_gpu_ms / 1000:,.1f} GPU s for {figs.replica_busy_ms / 1000:,.1f} s of replica busy "
        f"time (x{figs.billed_over_busy:.2f}); replica occupancy max {figs.occupancy_max}/"
        f"{config.replica.max_batch}; open at end "
        f"{figs.open_at_end}; wall {figs.wall_s:.0f} s."
    )
    table.caption_justify = "left"
    out.append(table)
    errors = sum(sum(e.values()) for e in figs.errors.values())
    out.append(
        f"load held: {sum(figs.sent.values())} requests over {config.gateways} processes for "
        f"{config.seconds:g} s; faults injected: none (uneven placement{'' if figs.share_charges_s else ', counters not shared'}); "
        f"lost: {figs.open_at_end} open reservations, {errors} errors; converged (max/min within "
        f"{config.ratio_max:g} to the end) from {converge}."
    )
    return out


def run(options: DrillOptions, config: ScaleOutConfig | None = None) -> ScaleOutResult:
    """Both claims (``options.seconds`` sets the limits load; ``options.compare``, if set, adds the
    no-sharing comparison run of claim 2; the drill always runs processes)."""
    config = config or ScaleOutConfig()
    if options.seconds is not None:
        config = replace(config, limits=replace(config.limits, seconds=options.seconds))
    limits = tuple(run_limits(config.limits, url, options.policy, options.seed) for url in config.ledgers)
    fairness = (
        run_fairness(config.fairness, config.ledgers[0], options.policy, options.seed) if config.ledgers else None
    )
    compare = None
    if options.compare and config.ledgers:
        compare = run_fairness(
            replace(config.fairness, share_charges_s=0.0), config.ledgers[0], options.policy, options.seed
        )
    return ScaleOutResult(config, limits, fairness, compare, options.policy)


__all__ = [
    "Child",
    "ChildSpec",
    "FairnessConfig",
    "FairnessFigures",
    "LimitsConfig",
    "LimitsFigures",
    "Probe",
    "ReplicaTruth",
    "ScaleOutConfig",
    "ScaleOutResult",
    "TenantEntry",
    "UpstreamEntry",
    "bucket_peak",
    "by_tenant",
    "children",
    "emulator_spec",
    "fresh_ledger_url",
    "gateway_config_text",
    "gateway_spec",
    "gpu_budget_use",
    "peak_overlap",
    "read_replica",
    "run",
    "run_fairness",
    "run_limits",
    "tenant_keys",
    "wait_settled",
    "watch_replicas",
]

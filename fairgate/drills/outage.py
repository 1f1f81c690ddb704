"""Drill ``outage`` (seed 003, "simulate ... accounting service interruption"): the ledger server is stopped
for ``outage_s`` seconds (30 by default) in the middle of a load and started again. The claim:

- a ``reject`` tier's requests sent while it is down get 503 ``ledger_unavailable`` with ``Retry-After``,
  and nothing else odd happens (no other status, no hung or broken stream, requests in flight finish);
- an ``emergency`` tier is admitted no more than its local budget (requests and tokens) and refused with
  the same 503 beyond it;
- once the ledger is back, the gateway replays its journal (``fairgate.gateway.app._recover`` runs
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

The pieces here (a restartable throwaway Redis, a gateway configuration with tiers, a closed-loop client
that records each request by id) are also used by the ``restart`` drill.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fairgate.drills import CheckedResult, DrillOptions
from fairgate.drills.stack import STARTUP_S_MAX, ReplicaModel, fairgate_process, free_port, serve_in_thread
from fairgate.gateway.auth import hash_api_key
from fairgate.ledger.base import tenant_tag

EMERGENCY_PREFIX = "emg-"  # fairgate.ledger.emergency.EMERGENCY_PREFIX (ids of emergency grants)
MODEL = "emu"
CHAT_OVERHEAD_TOKENS = 3  # the emulator counts 3 tokens of template per chat message


# --- a throwaway Redis that can be stopped and started again ---------------------------------------------


class RedisServer:
    """A ``redis-server`` of its own on a free port of 127.0.0.1, with its data in ``folder``.

    ``durable`` (default): append-only file with ``appendfsync always``, so stopping (even SIGKILL) and
    starting it again keeps every write it acknowledged - a ledger outage, not a ledger wipe. Never the
    shared server: ``stop`` only ever signals the process this object started.
    """

    def __init__(self, folder: Path, durable: bool = True, binary: str | None = None) -> None:
        found = binary or shutil.which("redis-server")
        if found is None:
            raise RuntimeError("the drill needs redis-server (Debian: apt-get install redis-server)")
        self.binary = found
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.durable = durable
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, prefix: str, timeout_s: float = 1.0) -> str:
        return f"redis://127.0.0.1:{self.port}/0?prefix={prefix}&timeout_s={timeout_s:g}"

    def start(self) -> None:
        """Start it (again, on the same port and data) and wait until it answers PING."""
        if self.process is not None and self.process.poll() is None:
            return
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.durable else ["--appendonly", "no"]
        log = open(self.folder / "redis.log", "ab")  # noqa: SIM115 - the child keeps it
        try:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    str(self.folder),
                    "--save",
                    "",
                    *persistence,
                    "--daemonize",
                    "no",
                    "--protected-mode",
                    "no",
                ],
                stdout=log,
                stderr=log,
            )
        finally:
            log.close()
        deadline = time.monotonic() + STARTUP_S_MAX
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port} (log: {self.folder}/redis.log)")
            time.sleep(0.02)

    def answers(self) -> bool:
        """True when the server answers PING with PONG (not while it loads its data)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop it (SIGTERM: a clean shutdown; SIGKILL: a crash) and wait until the process is gone."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(signal.SIGKILL)


# --- a gateway configuration with tiers --------------------------------------------------------------------


@dataclass(frozen=True)
class DrillTenant:
    """A tenant of a drill's gateway: its tier (``reject``, ``emergency`` or another tier's name) and limits."""

    name: str
    tier: str = "reject"
    limits: dict[str, int | float] = field(default_factory=dict)


@dataclass(frozen=True)
class Emergency:
    """An emergency tier's local budget (per gateway process, per tenant, per outage)."""

    requests: int
    tokens: int
    seconds: float


def api_key(tenant: str) -> str:
    return f"fg-drill-{tenant}-{'k' * 32}"


ADMIN_KEY = f"fg-drill-admin-{'a' * 32}"


def gateway_config(
    folder: Path,
    ledger_url: str,
    upstream_urls: list[str],
    replica: ReplicaModel,
    tenants: list[DrillTenant],
    policy: str,
    sweep_s: float,
    reservation_ttl_s: float,
    emergency: Emergency | None = None,
    upstream_max_batch: int | None = None,
    share_charges_s: float = 0.25,
) -> str:
    """A gateway TOML: the ledger at ``ledger_url``, journal and request log in ``folder``, one upstream per
    URL (model ``emu``), tiers ``reject`` and (with ``emergency``) ``emergency``, a key per tenant (see
    ``api_key``) and the admin key ``ADMIN_KEY``."""
    r = replica
    batch = upstream_max_batch or r.max_batch
    upstreams = "".join(
        f'[[upstream]]\nname = "emu-{i}"\nurl = "{url}/v1"\nmodel = "{MODEL}"\nmax_batch = {batch}\n'
        f"iter_base_ms = {r.iter_base_ms!r}\niter_slope_ms = {r.iter_slope_ms!r}\n"
        f"prefill_ms_per_token = {r.prefill_ms_per_token!r}\nmax_model_len = {r.max_model_len}\n\n"
        for i, url in enumerate(upstream_urls)
    )
    tiers = '[quotas.tiers.reject]\non_ledger_unavailable = "reject"\n'
    if emergency is not None:
        tiers += (
            f'[quotas.tiers.emergency]\non_ledger_unavailable = "emergency"\nemergency = {{ requests = '
            f"{emergency.requests}, tokens = {emergency.tokens}, seconds = {float(emergency.seconds)!r} }}\n"
        )
    defaults = (
        f"[quotas.defaults]\nmax_concurrent = 100000\nmax_queued = 100000\n"
        f"reservation_ttl_s = {float(reservation_ttl_s)!r}\n"
    )
    blocks = ""
    for t in tenants:
        limits = ", ".join(f"{k} = {v!r}" for k, v in t.limits.items())
        blocks += f'[quotas.tenants."{t.name}"]\ntier = "{t.tier}"\n' + (f"limits = {{ {limits} }}\n" if limits else "")
    keys = "".join(
        f'[[key]]\ntenant = "{t.name}"\nhash = "{hash_api_key(api_key(t.name))}"\nname = "drill"\n' for t in tenants
    )
    return (
        f'[gateway]\npolicy = "{policy}"\nledger = "{ledger_url}"\njournal = "{folder}/journal.jsonl"\n'
        f'event_log = "{folder}/events.jsonl"\ndefault_max_tokens = 256\nrequest_timeout_s = 600\n'
        f"sweep_s = {float(sweep_s)!r}\nshare_charges_s = {float(share_charges_s)!r}\n\n"
        f'{upstreams}[admin]\nkey_hashes = ["{hash_api_key(ADMIN_KEY)}"]\n\n{tiers}\n{defaults}\n{blocks}\n{keys}'
    )


def emulator_args(replica: ReplicaModel, port: int, max_batch: int | None = None) -> list[str]:
    r = replica
    return [
        "emulate",
        "--port",
        str(port),
        "--model",
        MODEL,
        "--iter-base-ms",
        repr(r.iter_base_ms),
        "--iter-slope-ms",
        repr(r.iter_slope_ms),
        "--prefill-ms-per-token",
        repr(r.prefill_ms_per_token),
        "--max-batch",
        str(max_batch or r.max_batch),
        "--max-model-len",
        str(r.max_model_len),
    ]


# --- clients that record every request by id ---------------------------------------------------------------


@dataclass
class Call:
    """One request as its client saw it.

    Attributes:
        target: which gateway it was sent to (a label). request_id: its ``X-Request-Id``.
        sent_s / first_s / ended_s: seconds since the drill's start (first_s: first content token).
        outcome: ``ok``, ``error`` (an HTTP error status before the stream), ``connection`` (the connection
            failed or broke), ``stream`` (an error event inside the stream), ``running`` (not ended yet).
        status / code / retry_after: the HTTP status, OpenAI error code and ``Retry-After`` header of an error.
        tokens: content tokens received. usage_input / usage_output: the usage chunk the client was sent.
    """

    tenant: str
    target: str
    request_id: str
    max_tokens: int
    sent_s: float
    first_s: float | None = None
    ended_s: float | None = None
    outcome: str = "running"
    status: int | None = None
    code: str | None = None
    retry_after: str | None = None
    tokens: int = 0
    usage_input: int | None = None
    usage_output: int | None = None

    @property
    def admitted(self) -> bool:
        """It ran (at least started) on an upstream: the ledger must hold a reservation for it."""
        return self.outcome == "ok" or self.tokens > 0

    def key(self) -> str:
        if self.outcome == "error":
            return f"{self.status}:{self.code}"
        return self.outcome


@dataclass(frozen=True)
class ClientLoad:
    """``clients`` closed-loop clients of ``tenant`` against the gateway labelled ``target``."""

    tenant: str
    target: str
    clients: int
    output_tokens: tuple[int, int]
    prompt_tokens: int = 32
    backoff_s: float = 0.5  # after an error


class Clients:
    """Closed-loop clients on the real ``openai`` client; every request recorded in ``calls`` (by id)."""

    def __init__(self, urls: dict[str, str], seed: int = 1) -> None:
        self.urls = dict(urls)  # target label -> gateway base URL
        self.seed = seed
        self.start = time.monotonic()
        self.wall_start = time.time()  # the same instant on the wall clock (the ledger's clock is the machine's)
        self.calls: list[Call] = []
        self.active: dict[str, Call] = {}
        self._openai: dict[tuple[str, str], Any] = {}

    def now(self) -> float:
        return time.monotonic() - self.start

    def _client(self, target: str, tenant: str) -> Any:
        import openai

        key = (target, tenant)
        if key not in self._openai:
            self._openai[key] = openai.AsyncOpenAI(
                base_url=f"{self.urls[target]}/v1", api_key=api_key(tenant), max_retries=0, timeout=600.0
            )
        return self._openai[key]

    async def one(self, load: ClientLoad, request_id: str, max_tokens: int) -> Call:
        import httpx
        import openai

        call = Call(load.tenant, load.target, request_id, max_tokens, self.now())
        self.calls.append(call)
        self.active[request_id] = call
        try:
            stream: Any = await self._client(load.target, load.tenant).chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "w " * (load.prompt_tokens - CHAT_OVERHEAD_TOKENS)}],
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
                extra_headers={"x-request-id": request_id},
            )
            async with stream:
                async for chunk in stream:
                    if chunk.usage is not None:
                        call.usage_input, call.usage_output = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
                    if chunk.choices and chunk.choices[0].delta.content:
                        if call.first_s is None:
                            call.first_s = self.now()
                        call.tokens += 1
            call.outcome = "ok"
        except asyncio.CancelledError:
            call.outcome = "cut"
            raise
        except openai.APIStatusError as exc:
            call.outcome, call.status, call.code = "error", exc.status_code, exc.code
            call.retry_after = exc.response.headers.get("retry-after")
        except (openai.APIConnectionError, httpx.TransportError):
            call.outcome = "connection"
        except openai.APIError as exc:
            call.outcome, call.code = "stream", exc.code
        except Exception as exc:
            call.outcome, call.code = "client", type(exc).__name__
        finally:
            call.ended_s = self.now()
            self.active.pop(request_id, None)
        return call

    async def closed_loop(self, load: ClientLoad, index: int, until_s: float) -> None:
        """Send one request after another until ``until_s`` (then let the last one finish)."""
        rng = random.Random(f"{self.seed}-{load.tenant}-{load.target}-{index}")
        n = 0
        await asyncio.sleep(0.05 * index)  # spread the first requests a little
        while self.now() < until_s:
            n += 1
            call = await self.one(load, f"{load.target}-{load.tenant}-{index}-{n}", rng.randint(*load.output_tokens))
            if call.outcome != "ok":
                await asyncio.sleep(load.backoff_s * (1 + 0.2 * rng.random()))

    async def close(self) -> None:
        for client in self._openai.values():
            await client.close()


def read_journal(path: Path) -> list[dict[str, Any]]:
    """The records of a gateway's emergency journal (none if it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_events(path: Path) -> list[dict[str, Any]]:
    """The records of a gateway's request log (``[gateway].event_log``), rotated files included."""
    from fairgate.gateway.eventlog import read_records

    if not path.exists():
        return []
    return [record for _, _, record in read_records(path)]


@contextlib.contextmanager
def drill_folder(prefix: str, keep: bool = False) -> Iterator[Path]:
    """A temporary folder for a drill's files, deleted after (kept with ``FAIRGATE_DRILL_KEEP=1``)."""
    keep = keep or os.environ.get("FAIRGATE_DRILL_KEEP") == "1"
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield folder
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


# --- the drill ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutageConfig:
    """The drill's setting.

    Attributes:
        outage_s: how long the ledger server is down (30 s; the test uses less to fit its time bound).
        warmup_s / after_s: load before the stop and after the restart.
        free / paid: the ``reject`` and the ``emergency`` tier's tenants.
        clients: closed-loop clients per tenant. output_tokens: (min, max) per request. prompt_tokens.
        emergency: the paid tier's local budget.
        reservation_ttl_s / sweep_s: the ledger's TTL and the gateway's liveness sweep.
        replica: the emulated replica.
        backoff_s: a client's wait after an error.
        converge_s_max: time allowed, after the ledger answers again, for everything to reconcile.
        drain_s_max: time allowed for the requests running when the clients stop sending.
    """

    outage_s: float = 30.0
    warmup_s: float = 4.0
    after_s: float = 4.0
    free: str = "free"
    paid: str = "paid"
    clients: int = 4
    output_tokens: tuple[int, int] = (8, 24)
    prompt_tokens: int = 32
    emergency: Emergency = field(default_factory=lambda: Emergency(requests=6, tokens=400, seconds=120.0))
    reservation_ttl_s: float = 60.0
    sweep_s: float = 1.0
    replica: ReplicaModel = field(
        default_factory=lambda: ReplicaModel(
            iter_base_ms=50.0, iter_slope_ms=0.5, prefill_ms_per_token=0.02, max_batch=12, max_model_len=4096
        )
    )
    backoff_s: float = 0.5
    converge_s_max: float = 10.0
    drain_s_max: float = 15.0

    def __post_init__(self) -> None:
        if self.outage_s < 2.0:
            raise ValueError(f"outage drill: an outage of {self.outage_s:g} s is too short (at least 2 s)")

    @property
    def tenants(self) -> list[DrillTenant]:
        return [DrillTenant(self.free, "reject"), DrillTenant(self.paid, "emergency")]


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


@dataclass(frozen=True)
class OutageFigures:
    """What was measured. Times in seconds since the drill's start."""

    stop_at_s: float  # SIGTERM sent
    down_at_s: float  # the server process was gone
    restart_at_s: float
    up_at_s: float  # answering again
    tenants: dict[str, TenantOutage]
    journal_at_restart: dict[str, int]  # record type -> count, just before the restart
    journal_left: int  # records left at the end
    converge_s: float | None  # from up_at_s until everything reconciled (None: not within converge_s_max)
    mismatches: tuple[str, ...]  # per-request differences between client and ledger (each a sentence)
    open_left: int  # open reservations at the end
    statuses: dict[str, int]  # reservations by status at the end
    orphans: int  # reservations with no request of the clients behind them
    still_running: int  # requests still running after drain_s_max (cut)
    gateway_log: tuple[str, ...]  # the gateway's warnings about the journal and the sweep


@dataclass(frozen=True)
class OutageResult(CheckedResult):
    config: OutageConfig
    figures: OutageFigures
    processes: bool
    name: str = "outage"

    def checks(self) -> dict[str, bool]:
        c, f = self.config, self.figures
        free, paid = f.tenants[c.free], f.tenants[c.paid]
        budget = c.emergency
        during_free, during_paid = free.phases["during"], paid.phases["during"]
        return {
            "load held before and after the outage (both tenants served)": all(
                t.phases[p].ok > 0 for t in f.tenants.values() for p in ("before", "after")
            ),
            f"reject tier: every request sent during the outage got 503 + Retry-After ({during_free.sent} sent)": during_free.sent
            > 0
            and during_free.refused_503 == during_free.sent,
            f"emergency tier admitted within its budget ({budget.requests} requests, {budget.tokens} tokens)": paid.grants
            <= budget.requests
            and paid.grant_tokens <= budget.tokens
            and during_paid.ok <= budget.requests,
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
                t.ledger_requests == t.client_requests
                and t.ledger_input == t.client_input
                and t.ledger_output == t.client_output
                for t in f.tenants.values()
            ),
            "ledger GPU time == the gateway's meter, per request (to the request log's 1 us)": all(
                t.gpu_mismatches == 0 for t in f.tenants.values()
            ),
            "no open reservation and no orphan left": f.open_left == 0 and f.orphans == 0,
            f"converged within {c.converge_s_max:g} s of the ledger's return": f.converge_s is not None,
        }

    def render(self) -> list[Any]:
        from rich.table import Table

        c, f = self.config, self.figures
        out: list[Any] = [
            f"[bold]drill outage[/bold]: ledger = a throwaway redis-server (AOF, fsync always); tenants "
            f"{c.free!r} (tier reject) and {c.paid!r} (tier emergency: {c.emergency.requests} requests, "
            f"{c.emergency.tokens} tokens, {c.emergency.seconds:g} s), {c.clients} closed-loop clients each "
            f"(outputs {c.output_tokens[0]}-{c.output_tokens[1]} tokens), gateway "
            f"{'process' if self.processes else 'in-process'}, sweep {c.sweep_s:g} s, reservation TTL "
            f"{c.reservation_ttl_s:g} s.",
            f"Fault: SIGTERM to the ledger server at {f.stop_at_s:.1f} s (gone at {f.down_at_s:.1f} s), started "
            f"again at {f.restart_at_s:.1f} s, answering at {f.up_at_s:.1f} s: down {f.up_at_s - f.down_at_s:.1f} s. "
            f"Journal just before the restart: "
            + (", ".join(f"{n} {kind}" for kind, n in sorted(f.journal_at_restart.items())) or "empty")
            + ".",
        ]
        table = Table(title="requests by phase (sent / ok / 503+Retry-After / other)", title_justify="left")
        for column in ("tenant", "tier", "before", "during outage", "edges", "after", "grants (tokens)"):
            table.add_column(column, justify="left" if column in ("tenant", "tier") else "right")
        for t in f.tenants.values():
            cells = []
            for name in ("before", "during", "edge", "after"):
                ph = t.phases[name]
                odd = sum(ph.odd.values())
                cells.append(f"{ph.sent} / {ph.ok} / {ph.refused_503} / {odd}")
            table.add_row(t.tenant, t.tier, *cells, f"{t.grants} ({t.grant_tokens})")
        table.caption = (
            "grants: emergency reservations from the local budget (their prompt + max output tokens); "
            f"'during' = sent from the server's exit to {EDGE_S:g} s before its restart"
        )
        table.caption_justify = "left"
        out.append(table)
        ledger = Table(title="clients vs ledger, whole run", title_justify="left")
        for column in (
            "tenant",
            "requests ok / billed",
            "input tokens client / billed",
            "output tokens client / billed",
            "GPU ms metered / billed",
        ):
            ledger.add_column(column, justify="left" if column == "tenant" else "right")
        for t in f.tenants.values():
            ledger.add_row(
                t.tenant,
                f"{t.client_requests} / {t.ledger_requests}",
                f"{t.client_input:,} / {t.ledger_input:,}",
                f"{t.client_output:,} / {t.ledger_output:,}",
                f"{t.metered_gpu_ms:,.1f} / {t.ledger_gpu_ms:,.1f}",
            )
        ledger.caption = (
            f"reservations at the end: {dict(sorted(f.statuses.items()))}; open {f.open_left}, orphans "
            f"{f.orphans}; journal records left {f.journal_left}"
        )
        ledger.caption_justify = "left"
        out.append(ledger)
        unbilled = {
            kind: sum(getattr(t, f"client_{kind}") - getattr(t, f"ledger_{kind}") for t in f.tenants.values())
            for kind in ("requests", "input", "output")
        }
        unbilled_gpu = sum(t.metered_gpu_ms - t.ledger_gpu_ms for t in f.tenants.values())
        gpu_mismatches = sum(t.gpu_mismatches for t in f.tenants.values())
        lost = [
            f"{len({m.split(':')[0] for m in f.mismatches})} requests billed differently from what their client "
            "received"
            if f.mismatches
            else "",
            f"{unbilled['requests']} requests, {unbilled['input']:,} input and {unbilled['output']:,} output "
            "tokens, "
            f"{unbilled_gpu:,.1f} GPU ms ({gpu_mismatches} requests) not billed"
            if any(unbilled.values()) or gpu_mismatches
            else "",
            f"{f.open_left} reservations left open" if f.open_left else "",
            f"{f.orphans} orphan reservations" if f.orphans else "",
            f"{f.journal_left} journal records never replayed" if f.journal_left else "",
        ]
        lost = [item for item in lost if item]
        refused = sum(ph.refused_503 for t in f.tenants.values() for ph in t.phases.values())
        out.append(
            f"Load held: {sum(ph.sent for t in f.tenants.values() for ph in t.phases.values())} requests "
            f"sent, {sum(t.client_requests for t in f.tenants.values())} served, {refused} refused with 503 + "
            "Retry-After while the ledger was down. Lost: "
            f"{'; '.join(lost) if lost else 'nothing'}. Time to converge: "
            + (f"{f.converge_s:.2f} s" if f.converge_s is not None else f"not within {c.converge_s_max:g} s")
            + " after the ledger answered again (the gateway replays its journal by itself)."
        )
        for line in f.mismatches[:12]:
            out.append(f"  [red]mismatch[/red] {line}")
        if len(f.mismatches) > 12:
            out.append(f"  ... and {len(f.mismatches) - 12} more")
        for line in f.gateway_log[:8]:
            out.append(f"  gateway: {line}")
        out.extend(self.check_lines())
        out.append(
            f"{'[green]PASS[/green]' if self.passed else '[red]FAIL[/red]'}: ledger down "
            f"{f.up_at_s - f.down_at_s:.1f} s under load."
        )
        return out


EDGE_S = 1.0  # a request sent this close before the restart may reach the ledger once it is back


def _phase_of(call: Call, stop_at: float, down_at: float, restart_at: float, up_at: float) -> str:
    """``before`` the stop, ``during`` the outage (sent once the server was gone and at least ``EDGE_S``
    before its restart, so it reached the gateway's reservation while the ledger was down), ``after`` it
    answered again, else ``edge``. (``_figures`` also counts as ``edge`` a request sent during the outage
    that the ledger shows reserved after the restart: one that was slow to reach the gateway.)"""
    if call.sent_s < stop_at:
        return "before"
    if down_at <= call.sent_s < restart_at - EDGE_S:
        return "during"
    if call.sent_s >= up_at:
        return "after"
    return "edge"


def _phase(calls: list[Call]) -> Phase:
    odd: Counter[str] = Counter()
    ok = refused = 0
    for call in calls:
        if call.outcome == "ok" and call.tokens == call.max_tokens:
            ok += 1
        elif call.outcome == "error" and call.status == 503 and call.code == "ledger_unavailable":
            if call.retry_after is not None and call.retry_after.isdigit() and int(call.retry_after) >= 1:
                refused += 1
            else:
                odd["503 without Retry-After"] += 1
        elif call.outcome == "ok":
            odd[f"ok with {call.tokens}/{call.max_tokens} tokens"] += 1
        else:
            odd[call.key()] += 1
    return Phase(len(calls), ok, refused, dict(odd), sum(c.tokens for c in calls))


async def _reconciled(ledger: Any, calls: list[Call], active: dict[str, Call], before_s: float, journal: Path) -> bool:
    """Every request sent before ``before_s`` has ended, each admitted one has a final reservation billing
    exactly what its client received, and the journal is empty."""
    if any(call.sent_s < before_s for call in list(active.values())):
        return False
    if read_journal(journal):
        return False
    by_request = {r.request_id: r for r in await ledger.reservations()}
    for call in list(calls):
        if call.sent_s >= before_s or not call.admitted:
            continue
        r = by_request.get(call.request_id)
        if r is None or r.status != "settled" or r.billed.output_tokens != call.tokens:
            return False
    return True


def _mismatches(calls: list[Call], reservations: list[Any]) -> list[str]:
    by_request: dict[str, list[Any]] = {}
    for r in reservations:
        by_request.setdefault(r.request_id, []).append(r)
    out = []
    for call in calls:
        found = by_request.get(call.request_id, [])
        if len(found) > 1:
            out.append(f"{call.request_id}: {len(found)} reservations")
            continue
        if not call.admitted:
            if found:
                out.append(
                    f"{call.request_id}: refused ({call.key()}) but the ledger holds a {found[0].status} "
                    f"reservation billing {found[0].billed.output_tokens} tokens"
                )
            continue
        if not found:
            out.append(f"{call.request_id}: ran ({call.tokens} tokens) but the ledger has no reservation")
            continue
        r = found[0]
        if r.status != "settled":
            out.append(f"{call.request_id}: ran to the end but its reservation is {r.status}")
        if r.billed.output_tokens != call.tokens:
            out.append(
                f"{call.request_id}: client received {call.tokens} tokens, ledger billed "
                f"{r.billed.output_tokens} ({r.status}, id {r.id[:12]}...)"
            )
        if call.usage_input is not None and r.billed.input_tokens != call.usage_input:
            out.append(
                f"{call.request_id}: client's usage says {call.usage_input} prompt tokens, ledger billed "
                f"{r.billed.input_tokens}"
            )
        if call.usage_output is not None and call.usage_output != call.tokens:
            out.append(
                f"{call.request_id}: client's usage says {call.usage_output} output tokens, received {call.tokens}"
            )
    return out


class LogCapture(logging.Handler):
    """The warnings of the gateway's logger (``fairgate.gateway``) while a drill runs a gateway in this
    process; they are reported in the summary instead of printed. Only the logger's own handlers change."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self._logger = logging.getLogger("fairgate.gateway")
        self._propagate = self._logger.propagate

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> LogCapture:
        self._logger.addHandler(self)
        self._logger.propagate = False
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.propagate = self._propagate


LOG_WORDS = (
    "journal",
    "expired",
    "sweep",
    "settle_failed",
    "release_failed",
    "paused",
    "upstream",
    "Traceback",
    "Error",
)


def log_lines(captured: list[str], *logs: Path) -> list[str]:
    """Warning lines of the gateways: those captured in this process and those in process logs (the lines
    naming the journal, the sweep, settlements, upstreams or errors)."""
    lines = list(captured)
    for path in logs:
        if path.exists():
            lines += [
                line.strip()
                for line in path.read_text(errors="replace").splitlines()
                if any(word in line for word in LOG_WORDS)
            ]
    return lines


def summarise_log(lines: list[str], keep_whole: tuple[str, ...] = ("replayed",)) -> list[str]:
    """One line per kind of gateway warning, with a count; lines containing a ``keep_whole`` word each
    in full (e.g. the journal replay reports)."""
    counts: Counter[str] = Counter()
    firsts: dict[str, str] = {}
    whole = []
    for line in lines:
        if any(word in line for word in keep_whole):
            whole.append(line[:300])
            continue
        try:
            record = json.loads(line)
            kind = str(record.get("event"))
            text = f"{kind}: {record.get('error') or record.get('reservation') or ''}".rstrip(": ")
        except (ValueError, AttributeError):
            kind = line.split(":")[0][:80]
            text = line
        counts[kind] += 1
        firsts.setdefault(kind, text[:160])
    return whole + [f"{firsts[k]} (x{n})" if n > 1 else firsts[k] for k, n in counts.most_common()]


def run(options: DrillOptions, config: OutageConfig | None = None) -> OutageResult:
    """Run the drill (``options.seconds``: the outage's length; ``options.policy``: the gateway's policy)."""
    config = config or OutageConfig()
    if options.seconds is not None:
        config = replace(config, outage_s=options.seconds)
    return asyncio.run(_run(options, config))


async def _run(options: DrillOptions, config: OutageConfig) -> OutageResult:
    from fairgate.gateway.app import create_gateway
    from fairgate.gateway.config import load_gateway_config
    from fairgate.ledger import connect

    with drill_folder("fairgate-drill-outage-") as folder, LogCapture() as capture, ExitStack() as servers:
        redis = servers.enter_context(RedisServer(folder / "redis"))
        ledger_url = redis.url("drill")
        if options.processes:
            port = free_port()
            upstream = servers.enter_context(
                fairgate_process(emulator_args(config.replica, port), port, folder / "emulator.log")
            )
        else:
            from fairgate.emulator.api import EmulatorSettings, create_app

            r = config.replica
            upstream = servers.enter_context(
                serve_in_thread(
                    create_app(
                        EmulatorSettings(
                            model=MODEL,
                            iter_base_ms=r.iter_base_ms,
                            iter_slope_ms=r.iter_slope_ms,
                            prefill_ms_per_token=r.prefill_ms_per_token,
                            max_batch=r.max_batch,
                            max_model_len=r.max_model_len,
                        )
                    )
                )
            )
        config_path = folder / "fairgate.toml"
        config_path.write_text(
            gateway_config(
                folder,
                ledger_url,
                [upstream],
                config.replica,
                config.tenants,
                options.policy,
                config.sweep_s,
                config.reservation_ttl_s,
                config.emergency,
            )
        )
        gateway_config_loaded = load_gateway_config(config_path)
        quotas = gateway_config_loaded.quotas
        journal = gateway_config_loaded.journal_path
        events_path = gateway_config_loaded.event_log_path
        assert events_path is not None
        gateway_stack = ExitStack()
        if options.processes:
            port = free_port()
            url = gateway_stack.enter_context(
                fairgate_process(
                    ["serve", "--config", str(config_path), "--port", str(port)], port, folder / "gateway.log"
                )
            )
        else:
            url = gateway_stack.enter_context(serve_in_thread(create_gateway(gateway_config_loaded)))
        with gateway_stack:
            clients = Clients({"gw": url}, seed=options.seed)
            loads = [
                ClientLoad(t.name, "gw", config.clients, config.output_tokens, config.prompt_tokens, config.backoff_s)
                for t in config.tenants
            ]
            send_until = config.warmup_s + config.outage_s + config.after_s
            tasks = [
                asyncio.ensure_future(clients.closed_loop(load, i, send_until))
                for load in loads
                for i in range(load.clients)
            ]
            try:
                await asyncio.sleep(max(0.0, config.warmup_s - clients.now()))
                stop_at = clients.now()
                await asyncio.to_thread(redis.stop, signal.SIGTERM)
                down_at = clients.now()
                await asyncio.sleep(max(0.0, stop_at + config.outage_s - clients.now()))
                journal_at_restart = Counter(record["type"] for record in read_journal(journal))
                restart_at = clients.now()
                await asyncio.to_thread(redis.start)
                up_at = clients.now()
                # Convergence: poll the ledger (our own connection) until everything admitted before the
                # ledger came back is reconciled and the journal is empty.
                converge_s: float | None = None
                reader = await connect(ledger_url, quotas, create=False)
                try:
                    while clients.now() < up_at + config.converge_s_max:
                        if await _reconciled(reader, clients.calls, clients.active, up_at, journal):
                            converge_s = clients.now() - up_at
                            break
                        await asyncio.sleep(0.1)
                    done, pending = await asyncio.wait(
                        tasks, timeout=max(0.0, send_until - clients.now()) + config.drain_s_max
                    )
                    for task in pending:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    still_running = sum(1 for call in clients.calls if call.outcome == "cut")
                    # Let the last settlements and a journal replay land.
                    deadline = clients.now() + config.converge_s_max
                    while clients.now() < deadline and (
                        read_journal(journal) or await reader.reservations(status="open")
                    ):
                        await asyncio.sleep(0.1)
                    reservations = await reader.reservations()
                    usage = {t.name: await reader.usage(t.name, 86_400.0) for t in config.tenants}
                finally:
                    await reader.close()
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await clients.close()
        # The gateway has stopped: its request log is flushed.
        events = read_events(events_path)
        figures = _figures(
            config,
            clients.calls,
            reservations,
            usage,
            events,
            read_journal(journal),
            (stop_at, down_at, restart_at, up_at),
            dict(journal_at_restart),
            converge_s,
            still_running,
            summarise_log(log_lines(capture.lines, folder / "gateway.log")),
            clients.wall_start,
        )
    return OutageResult(config, figures, options.processes)


def _figures(
    config: OutageConfig,
    calls: list[Call],
    reservations: list[Any],
    usage: dict[str, Any],
    events: list[dict[str, Any]],
    journal_left: list[dict[str, Any]],
    marks: tuple[float, float, float, float],
    journal_at_restart: dict[str, int],
    converge_s: float | None,
    still_running: int,
    gateway_log: list[str],
    wall_start: float,
) -> OutageFigures:
    stop_at, down_at, restart_at, up_at = marks
    tags = {tenant_tag(t.name): t.name for t in config.tenants}
    grants: Counter[str] = Counter()
    grant_tokens: Counter[str] = Counter()
    grant_requests: dict[str, set[str]] = {}
    metered: Counter[str] = Counter()
    metered_by_request: dict[tuple[str, str], float] = {}
    for record in events:
        tenant = tags.get(record.get("tenant_hash") or "")
        if tenant is None:
            continue
        if record.get("event") == "admitted" and str(record.get("reservation_id", "")).startswith(EMERGENCY_PREFIX):
            grants[tenant] += 1
            grant_tokens[tenant] += int(record["input_tokens"]) + int(record["max_output_tokens"])
            grant_requests.setdefault(tenant, set()).add(str(record.get("request_id")))
        if record.get("event") == "finished":
            metered[tenant] += float(record.get("gpu_ms") or 0.0)
            key = (tenant, str(record.get("request_id")))
            metered_by_request[key] = metered_by_request.get(key, 0.0) + float(record.get("gpu_ms") or 0.0)
    billed_by_request = {(r.tenant, r.request_id): r.billed.gpu_ms for r in reservations}
    created_ms = {r.request_id: r.created_ms for r in reservations}
    restart_wall_ms = (wall_start + restart_at) * 1000.0
    tenants = {}
    for t in config.tenants:
        mine = [call for call in calls if call.tenant == t.name]
        by_phase: dict[str, list[Call]] = {p: [] for p in ("before", "during", "edge", "after")}
        for call in mine:
            phase = _phase_of(call, stop_at, down_at, restart_at, up_at)
            created = created_ms.get(call.request_id)
            if (
                phase == "during"
                and call.outcome == "ok"
                and call.request_id not in grant_requests.get(t.name, set())
                and created is not None
                and created >= restart_wall_ms
            ):
                phase = "edge"  # reserved in the ledger once it was back (a slow request, not a leak)
            by_phase[phase].append(call)
        ran = [call for call in mine if call.admitted]
        u = usage[t.name]
        tenants[t.name] = TenantOutage(
            t.name,
            t.tier,
            {p: _phase(cs) for p, cs in by_phase.items()},
            grants[t.name],
            grant_tokens[t.name],
            sum(
                1
                for r in reservations
                if r.tenant == t.name and r.status == "settled" and r.request_id in grant_requests.get(t.name, set())
            ),
            len(ran),
            sum(call.usage_input or 0 for call in ran),
            sum(call.tokens for call in ran),
            u.requests,
            u.input_tokens,
            u.output_tokens,
            u.gpu_ms,
            metered[t.name],
            sum(
                1
                for key in set(metered_by_request) | set(billed_by_request)
                if key[0] == t.name and abs(metered_by_request.get(key, 0.0) - billed_by_request.get(key, 0.0)) > 0.001
            ),
        )
    known = {call.request_id for call in calls}
    statuses = Counter(r.status for r in reservations)
    return OutageFigures(
        stop_at,
        down_at,
        restart_at,
        up_at,
        tenants,
        journal_at_restart,
        len(journal_left),
        converge_s,
        tuple(_mismatches(calls, reservations)),
        statuses.get("open", 0),
        dict(statuses),
        sum(1 for r in reservations if r.request_id not in known),
        still_running,
        tuple(gateway_log),
    )


__all__ = [
    "ADMIN_KEY",
    "Call",
    "ClientLoad",
    "Clients",
    "DrillTenant",
    "Emergency",
    "OutageConfig",
    "OutageFigures",
    "OutageResult",
    "RedisServer",
    "api_key",
    "emulator_args",
    "gateway_config",
    "read_events",
    "read_journal",
    "run",
]

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
iteration); a loaded machine delays the gateway's reads by up to some hundred ms (measured: the oldest
unbilled token generated up to ~100 ms before its hang-up at load average 2). So, per request:

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
nothing.

With ``DrillOptions.processes`` the replicas run as processes and cannot be tapped: only totals are
compared then (billed <= the replicas' token counters <= billed + a bound per hang-up of a running stream).

Found (reported as "late to replica", not part of the claim unless ``late_dispatches_max`` is set): the
gateway does not watch for the hang-up of a *streamed* request before its first chunk (the non-streamed
path has ``_watch_disconnect``). A request whose client leaves while it is queued keeps its queue place,
its ledger reservation (``max_concurrent`` / ``max_queued``) and its fair-queue position until it is
dispatched; it then takes a replica slot and is prefilled, and is dropped only when the gateway relays its
first chunk into the closed connection. Measured: about 85 % of the requests cut before any byte reached a
replica after their client had left, their hang-up taking p50 ~340 ms and up to ~1.8 s (the queue wait)
to get there. The billing stays right (they are billed what the replica did: a prefill, rarely a token).

This module also holds ``open_stack``: ``fairgate.drills.stack.start_stack`` plus an admin key, extra
configuration (``[delegation]``), environment variables for the gateway, the gateway as a process beside
in-process replicas, and handles on the in-process apps; the ``retry`` and ``forged`` drills use it too.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from fairgate.drills import CheckedResult, DrillOptions, fmt_ms
from fairgate.drills.loadgen import CHAT_OVERHEAD_TOKENS, percentile
from fairgate.drills.stack import (
    ReplicaModel,
    Stack,
    StackSpec,
    TenantSpec,
    _emulator_args,
    config_text,
    fairgate_process,
    free_port,
    new_stack_folder,
    pace_replicas,
    serve_in_thread,
)
from fairgate.emulator.api import replica_of
from fairgate.gateway.auth import hash_api_key
from fairgate.gateway.state import state_of

ADMIN_KEY = "fg-drill-admin-" + "a" * 32


# --- a stack with handles ---------------------------------------------------------------------------------
_TAG: contextvars.ContextVar[str | None] = contextvars.ContextVar("fairgate_drill_tag", default=None)


class EmulatorTap:
    """ASGI wrapper of an in-process emulated replica: maps each generation request to the replica's
    ``Sequence`` by a tag, the last word of the request's last message (or prompt).

    ``sequences``: tag -> every sequence submitted under it (more than one would be a request run twice);
    ``bodies``: tag -> the body of every generation request received under it, as parsed JSON.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.sequences: dict[str, list[Any]] = {}
        self.bodies: dict[str, list[Any]] = {}
        self.untagged = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        pieces: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                await self.app(scope, _replay([message], receive), send)
                return
            pieces.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        raw = b"".join(pieces)
        tag = _tag_of(raw)
        if tag is not None:
            self.bodies.setdefault(tag, []).append(json.loads(raw))
        token = _TAG.set(tag)
        try:
            await self.app(scope, _replay([{"type": "http.request", "body": raw, "more_body": False}], receive), send)
        finally:
            _TAG.reset(token)

    def attach(self) -> None:
        """Wrap the replica's ``submit`` (call once the app has started: the replica exists then)."""
        replica = replica_of(self.app)
        original = replica.submit

        def submit(prompt_tokens: int, output_tokens: int, cache_salt: str | None = None) -> Any:
            seq = original(prompt_tokens, output_tokens, cache_salt)
            seq.events = _TimedQueue()  # nothing is in it yet: records when each token is generated
            tag = _TAG.get()
            if tag is None:
                self.untagged += 1
            else:
                self.sequences.setdefault(tag, []).append(seq)
            return seq

        original_cancel = replica.cancel

        def cancel(seq: Any) -> None:
            if not seq.finished and not seq.cancelled:
                seq.drill_cancelled_s = time.monotonic()  # when the hang-up reached the replica
            original_cancel(seq)

        replica.submit = submit
        replica.cancel = cancel

    @property
    def replica(self) -> Any:
        return replica_of(self.app)


class _TimedQueue(asyncio.Queue):  # type: ignore[type-arg]
    """A sequence's token queue that notes when each token was generated (``token_s``, monotonic)."""

    def __init__(self) -> None:
        super().__init__()
        self.token_s: list[float] = []

    def put_nowait(self, item: Any) -> None:
        if item is not None:
            self.token_s.append(time.monotonic())
        super().put_nowait(item)


def _replay(messages: list[dict[str, Any]], receive: Any) -> Any:
    pending = list(messages)

    async def replayed() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


def _tag_of(raw: bytes) -> str | None:
    try:
        body = json.loads(raw)
        if "messages" in body:
            content = body["messages"][-1]["content"]
        else:
            content = body["prompt"]
        words = content.split() if isinstance(content, str) else []
        return words[-1] if words else None
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


@dataclass(frozen=True)
class DrillStack:
    """A running stack (``stack``) with its admin key and, in process, the apps themselves.

    Attributes:
        gateway_app: the gateway's ASGI app (``state.dispatcher``, ``state.ledger``); None for processes.
        taps: one ``EmulatorTap`` per replica, in process (empty for processes).
    """

    stack: Stack
    admin_key: str
    gateway_app: Any | None
    taps: tuple[EmulatorTap, ...]

    @property
    def url(self) -> str:
        return self.stack.url

    @property
    def keys(self) -> dict[str, str]:
        return self.stack.keys


@contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def open_stack(
    spec: StackSpec,
    extra_config: str = "",
    environment: Mapping[str, str] | None = None,
    gateway_process: bool = False,
    keep_folder: bool = False,
) -> Iterator[DrillStack]:
    """``fairgate.drills.stack.start_stack`` with an ``[admin]`` key (``ADMIN_KEY``), ``extra_config`` appended
    to the gateway's file (e.g. a ``[delegation]`` table), ``environment`` set for the gateway (in this
    process's environment while the block runs, inherited by processes), and in process an
    ``EmulatorTap`` on every replica and the gateway app.

    ``gateway_process``: with in-process replicas (``spec.processes`` false), run the gateway alone as a
    ``fairgate serve`` process: the replicas stay tapped, and the gateway gets a core of its own (the drill
    sees it through ``/metrics`` then)."""
    folder, keys, config_path = new_stack_folder(spec)

    def write_config(upstreams: list[str]) -> None:
        text = config_text(folder, spec, upstreams, keys)
        text += f'\n[admin]\nkey_hashes = ["{hash_api_key(ADMIN_KEY)}"]\n\n{extra_config}'
        config_path.write_text(text)

    try:
        with _environment(environment or {}), ExitStack() as servers:
            taps: list[EmulatorTap] = []
            gateway_app = None
            if spec.processes:
                upstreams = []
                for i in range(spec.replicas):
                    port = free_port()
                    upstreams.append(
                        servers.enter_context(
                            fairgate_process(_emulator_args(spec, port), port, folder / f"emulator-{i}.log")
                        )
                    )
                if spec.staggered:
                    servers.enter_context(pace_replicas(spec, upstreams))
                write_config(upstreams)
                port = free_port()
                gateway = servers.enter_context(
                    fairgate_process(
                        ["serve", "--config", str(config_path), "--port", str(port)], port, folder / "gateway.log"
                    )
                )
            else:
                from fairgate.emulator.api import EmulatorSettings, create_app
                from fairgate.gateway.app import create_gateway
                from fairgate.gateway.config import load_gateway_config

                r = spec.replica
                settings = EmulatorSettings(
                    model=spec.model,
                    iter_base_ms=r.iter_base_ms,
                    iter_slope_ms=r.iter_slope_ms,
                    prefill_ms_per_token=r.prefill_ms_per_token,
                    max_batch=r.max_batch + int(spec.staggered),
                    max_model_len=r.max_model_len,
                )
                upstreams = []
                for _ in range(spec.replicas):
                    tap = EmulatorTap(create_app(settings))
                    upstreams.append(servers.enter_context(serve_in_thread(tap)))
                    tap.attach()
                    taps.append(tap)
                if spec.staggered:
                    servers.enter_context(pace_replicas(spec, upstreams))
                write_config(upstreams)
                if gateway_process:
                    port = free_port()
                    gateway = servers.enter_context(
                        fairgate_process(
                            ["serve", "--config", str(config_path), "--port", str(port)], port, folder / "gateway.log"
                        )
                    )
                else:
                    gateway_app = create_gateway(load_gateway_config(config_path))
                    gateway = servers.enter_context(serve_in_thread(gateway_app))
            yield DrillStack(
                Stack(spec, gateway, keys, folder, config_path, tuple(upstreams)), ADMIN_KEY, gateway_app, tuple(taps)
            )
    finally:
        if not keep_folder:
            shutil.rmtree(folder, ignore_errors=True)


async def open_ledger(stack: Stack) -> Any:
    """A second connection to the stack's ledger (the caller closes it)."""
    from fairgate.gateway.config import load_gateway_config
    from fairgate.ledger import connect

    config = load_gateway_config(stack.config_path)
    return await connect(config.ledger_url, config.quotas, create=False)


def metric_values(text: str, name: str) -> dict[str, float]:
    """``{labels text: value}`` of one metric in a Prometheus exposition."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line.rpartition(" ")
            try:
                out[labels[len(name) :]] = float(value)
            except ValueError:
                continue
    return out


async def gateway_load(drill: DrillStack) -> dict[str, float]:
    """What the gateway holds now: requests on upstream slots, queued, active sequences (from
    ``state_of(app).dispatcher`` in process, else ``/metrics`` with the admin key)."""
    if drill.gateway_app is not None:
        dispatcher = state_of(drill.gateway_app).dispatcher
        return {
            "upstream_in_flight": float(sum(u.in_flight for u in dispatcher.upstreams())),
            "queued": float(sum(dispatcher.queued_by_tenant().values())),
            "active_sequences": float(sum(dispatcher.running_by_tenant().values())),
        }
    import httpx

    async with httpx.AsyncClient(timeout=10) as http:
        reply = await http.get(f"{drill.url}/metrics", headers={"Authorization": f"Bearer {drill.admin_key}"})
        reply.raise_for_status()
    text = reply.text
    return {
        "upstream_in_flight": sum(metric_values(text, "fairgate_upstream_in_flight").values()),
        "queued": sum(metric_values(text, "fairgate_queued_requests").values()),
        "active_sequences": sum(metric_values(text, "fairgate_active_sequences").values()),
    }


async def replica_stats(drill: DrillStack) -> list[dict[str, Any]]:
    """Each replica's ``/emulator/stats``."""
    import httpx

    async with httpx.AsyncClient(timeout=10) as http:
        replies = [await http.get(f"{url}/emulator/stats") for url in drill.stack.upstream_urls]
    return [reply.json() for reply in replies]


# --- the drill ----------------------------------------------------------------------------------------------
CUT_POINTS = ("before_bytes", "after_headers", "after_chunks", "never")


@dataclass(frozen=True)
class CancellationConfig:
    """The drill's setting (defaults: the acceptance scenario of issue 6).

    Attributes:
        requests: streamed requests sent, over ``tenants``, ``concurrency`` at a time.
        cut_weights: how often each cut point is drawn (``CUT_POINTS`` order).
        before_bytes_s: a "before any byte" cut comes this long (uniform) after sending: while the request
            waits in the gateway's queue, in the replica's, or is prefilled.
        output_tokens: ``max_tokens`` (uniform, inclusive), with ``ignore_eos``.
        prompt_tokens: prompt length as the emulator counts it.
        replicas / replica: the emulated fleet (fast iterations, so 1,000 streams fit the time).
        converge_s_max: after the last client is done, how long the stack may take to release everything.
        read_lag_ms_max: per request cut while running, every token generated more than this long before its
            client hung up must be billed (younger ones may still have been on their way to, or unread in, the
            gateway when it closed the stream; see the module docstring).
        untapped_hangup_tokens_max: with processes (no per-token times), the most tokens a replica may
            generate after a hang-up that are not billed, per hang-up of a running stream (totals check only).
        gpu_ratio_tolerance: billed GPU time vs the replicas' charge-rule figure, per tenant (relative; the live
            meter sees the replicas' real iteration times, which run late on a loaded machine, where the charge
            rule counts planned ones: a loose bound against gross errors, not a meter accuracy test).
        late_dispatches_max: if set, a check: at most this many requests reach a replica after their
            client hung up (None: reported only; see the module docstring, "Found").
        gateway_process: with in-process (tapped) replicas, run the gateway as a process of its own (its
            own core: the drill takes about half the time).
    """

    requests: int = 1000
    tenants: tuple[str, ...] = ("alpha", "beta", "gamma", "delta")
    concurrency: int = 48
    cut_weights: tuple[float, float, float, float] = (0.2, 0.2, 0.4, 0.2)
    before_bytes_s: tuple[float, float] = (0.0, 0.08)
    output_tokens: tuple[int, int] = (20, 200)
    prompt_tokens: int = 12
    replicas: int = 2
    replica: ReplicaModel = field(
        default_factory=lambda: ReplicaModel(
            iter_base_ms=20.0, iter_slope_ms=0.1, prefill_ms_per_token=0.05, max_batch=16, max_model_len=4096
        )
    )
    gateway_process: bool = True
    converge_s_max: float = 10.0
    read_lag_ms_max: float = 250.0
    untapped_hangup_tokens_max: int = 4
    gpu_ratio_tolerance: float = 0.25
    late_dispatches_max: int | None = None

    @property
    def slots(self) -> int:
        return self.replicas * self.replica.max_batch

    def spec(self, policy: str, processes: bool) -> StackSpec:
        return StackSpec(
            tuple(TenantSpec(t) for t in self.tenants),
            policy=policy,
            replicas=self.replicas,
            replica=self.replica,
            processes=processes,
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


def plans(config: CancellationConfig, seed: int) -> list[Plan]:
    rng = random.Random(f"cancellation-{seed}")
    out = []
    for i in range(config.requests):
        tenant = config.tenants[i % len(config.tenants)]
        low, high = config.output_tokens
        max_tokens = min(high, max(low, int(math.exp(rng.uniform(math.log(low), math.log(high + 1))))))
        cut = rng.choices(CUT_POINTS, weights=config.cut_weights)[0]
        out.append(
            Plan(
                i,
                tenant,
                f"cx{seed}-{i:05d}",
                max_tokens,
                cut,
                after_chunks=rng.randint(1, max_tokens - 1) if cut == "after_chunks" else 0,
                after_s=rng.uniform(*config.before_bytes_s) if cut == "before_bytes" else 0.0,
            )
        )
    return out


@dataclass
class ClientSide:
    """One request as its client saw it."""

    plan: Plan
    cut_at: str = ""  # where it really ended: before_bytes, after_headers, after_chunks, completed, error
    received: int = 0  # content chunks (tokens) received
    usage_tokens: int | None = None  # completion_tokens of the final usage chunk, if read
    error: str | None = None
    hangup_s: float | None = None  # when the client gave up (monotonic; None: it read to the end)
    ended_s: float = 0.0


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
    def generated_after_hangup(self) -> int | None:
        """Tokens the replica generated after the client hung up (None: not tapped, or never hung up)."""
        return None if self.token_offsets_ms is None else sum(1 for t in self.token_offsets_ms if t > 0)

    @property
    def oldest_unbilled_ms(self) -> float | None:
        """How long before the hang-up the oldest unbilled token was generated (ms; negative: after it). Tokens
        are billed in order, so the unbilled ones are the last ``unbilled``. None: none unbilled, or unknown."""
        if self.unbilled <= 0 or not self.token_offsets_ms or self.unbilled > len(self.token_offsets_ms):
            return None
        return -self.token_offsets_ms[-self.unbilled]


@dataclass(frozen=True)
class CancellationFigures:
    policy: str
    requests: list[RequestFigures]
    cut_counts: dict[str, int]  # realized cut points
    errors: dict[str, int]
    load_s: float  # the clients' phase
    converge_s: float | None  # from the last client's end to everything released (None: never)
    gateway_after: dict[str, float]
    replicas_after: list[dict[str, Any]]
    concurrent_after: dict[str, int]  # tenant -> the ledger's open-request counter
    queued_after: dict[str, int]
    by_status: dict[str, int]
    reconcile_differences: dict[str, list[str]]
    tenant_gpu: dict[str, tuple[float, float]]  # tenant -> (billed GPU ms, replicas' charge-rule ms)
    tapped: bool
    untagged_sequences: int

    @property
    def replica_tokens(self) -> int:
        return sum(int(s["tokens_generated"]) for s in self.replicas_after)

    @property
    def billed_tokens(self) -> int:
        return sum(r.billed_output for r in self.requests)

    @property
    def faults(self) -> int:
        """Client hang-ups (every cut but "never")."""
        return sum(
            n for point, n in self.cut_counts.items() if point in ("before_bytes", "after_headers", "after_chunks")
        )

    @property
    def overbilled(self) -> int:
        """Tokens billed above what the replica generated (tapped) or above ``max_tokens``."""
        return sum(
            max(0, r.billed_output - (r.max_tokens if r.generated is None else r.generated)) for r in self.requests
        )

    @property
    def held_slots(self) -> float:
        """Slots, queue places and sequences still held after the run (gateway, replicas, ledger)."""
        return (
            sum(self.gateway_after.values())
            + sum(s["running"] + s["waiting"] for s in self.replicas_after)
            + sum(self.concurrent_after.values())
            + sum(self.queued_after.values())
        )

    @property
    def late(self) -> list[RequestFigures]:
        """Requests the gateway sent to a replica after their client had hung up (tapped runs only)."""
        return [r for r in self.requests if r.submitted_after_hangup]


@dataclass(frozen=True)
class CancellationResult(CheckedResult):
    config: CancellationConfig
    main: CancellationFigures
    name: str = "cancellation"

    def checks(self) -> dict[str, bool]:
        c, f = self.config, self.main
        rs = f.requests
        completed = [r for r in rs if r.cut_at == "completed"]
        held = {k: v for k, v in f.gateway_after.items() if v} | {
            f"replica {i} {k}": s[k] for i, s in enumerate(f.replicas_after) for k in ("running", "waiting") if s[k]
        }
        checks = {
            f"all {c.requests} requests sent, no errors": len(rs) == c.requests and not f.errors,
            "every cut point exercised": all(
                f.cut_counts.get(p, 0) > 0 for p in ("before_bytes", "after_headers", "after_chunks", "completed")
            ),
            f"every slot released within {c.converge_s_max:g} s (gateway, replicas, ledger)": f.converge_s is not None
            and not held
            and not any(f.concurrent_after.values())
            and not any(f.queued_after.values()),
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
        if f.tapped:
            never_sent = [r for r in rs if r.reservations and r.sequences == 0]
            never_ran = [r for r in rs if r.sequences and not r.ran]
            ran = [r for r in rs if r.ran and r.cut_at != "completed"]
            checks.update(
                {
                    "every request ran at most once on a replica": all((r.sequences or 0) <= 1 for r in rs)
                    and f.untagged_sequences == 0,
                    "completed: billed == generated (exact)": all(r.generated == r.billed_output for r in completed),
                    "cut before reaching a replica: billed 0 tokens, 0 GPU ms (exact)": all(
                        r.billed_output == 0 and r.billed_gpu_ms == 0 for r in never_sent
                    ),
                    "cut in a replica's queue (never run): billed 0 tokens (exact)": all(
                        r.billed_output == 0 == r.generated for r in never_ran
                    ),
                    "cut while running: billed <= generated": all(r.billed_output <= (r.generated or 0) for r in ran),
                    f"cut while running: every token generated over {c.read_lag_ms_max:g} ms before the hang-up billed": all(
                        (r.oldest_unbilled_ms or 0.0) <= c.read_lag_ms_max for r in ran
                    ),
                    "replicas' token counters == sum of generated": f.replica_tokens
                    == sum(r.generated or 0 for r in rs),
                }
            )
            if c.late_dispatches_max is not None:
                checks[f"at most {c.late_dispatches_max} requests sent to a replica after their client left"] = (
                    len(f.late) <= c.late_dispatches_max
                )
        else:
            cut_running = sum(1 for r in rs if r.cut_at != "completed" and r.billed_output > 0)
            bound = c.untapped_hangup_tokens_max
            checks[f"billed <= replicas' tokens <= billed + {bound} per hang-up of a running stream"] = (
                f.billed_tokens <= f.replica_tokens <= f.billed_tokens + bound * cut_running
            )
        checks[f"billed GPU within {c.gpu_ratio_tolerance:.0%} of the replicas' charge rule, per tenant"] = all(
            truth > 0 and abs(billed / truth - 1) <= c.gpu_ratio_tolerance for billed, truth in f.tenant_gpu.values()
        )
        return checks

    def render(self) -> list[Any]:
        from rich.table import Table

        c, f = self.config, self.main
        out: list[Any] = [
            f"[bold]drill cancellation[/bold]: {c.requests} streamed requests over {len(c.tenants)} tenants, "
            f"{c.concurrency} at a time, on {c.replicas} emulated replicas x {c.replica.max_batch} slots "
            f"({c.replica.iter_base_ms:g} ms iterations), policy {f.policy}; max_tokens {c.output_tokens[0]}-"
            f"{c.output_tokens[1]} (log-uniform, ignore_eos); each client closes its stream at a random point.",
            "Claim: every slot released, every reservation final, billed tokens == tokens generated.",
        ]
        table = Table(title="by where the client cut", title_justify="left")
        for column in (
            "cut at",
            "n",
            "tokens recv/billed/gen",
            "unbilled",
            "GPU s billed/rule",
            "late",
            "hang-up ms",
            "reservations",
        ):
            table.add_column(
                column,
                justify="left" if column in ("cut at", "reservations") else "right",
                no_wrap=column != "reservations",
            )
        for point in ("before_bytes", "after_headers", "after_chunks", "completed", "error"):
            rows = [r for r in f.requests if r.cut_at == point]
            if not rows:
                continue
            statuses = Counter(r.status or "none" for r in rows)
            tapped = f.tapped
            hangups = [r.hangup_ms for r in rows if r.hangup_ms is not None]
            generated = f"{sum(r.generated or 0 for r in rows):,}" if tapped else "-"
            oldest = max((r.oldest_unbilled_ms for r in rows if r.oldest_unbilled_ms is not None), default=None)
            rule = f"{sum(r.charge_rule_ms or 0 for r in rows) / 1000:,.2f}" if tapped else "-"
            table.add_row(
                point,
                str(len(rows)),
                f"{sum(r.received for r in rows):,} / {sum(r.billed_output for r in rows):,} / {generated}",
                (
                    f"{sum(r.unbilled for r in rows):,} ({max(r.unbilled for r in rows)}) / {fmt_ms(oldest)}"
                    if tapped
                    else "-"
                ),
                f"{sum(r.billed_gpu_ms for r in rows) / 1000:,.2f} / {rule}",
                str(sum(1 for r in rows if r.submitted_after_hangup)) if tapped else "-",
                f"{fmt_ms(percentile(hangups, 50))} / {fmt_ms(max(hangups, default=None))}" if hangups else "-",
                ", ".join(f"{k} {v}" for k, v in sorted(statuses.items())),
            )
        table.caption = (
            f"load: {c.requests} requests in {f.load_s:.1f} s; faults injected: {f.faults} client "
            f"hang-ups; reservations {', '.join(f'{k} {v}' for k, v in sorted(f.by_status.items()))}. "
            "unbilled: generated but not billed, total (most in one request) / how many ms before its "
            "hang-up the oldest was generated (negative: after); late: reached a replica after its "
            "client hung up; hang-up ms: p50 / max from the client's hang-up to the replica stopping "
            "the sequence."
        )
        table.caption_justify = "left"
        out.append(table)
        gpu = Table(title="GPU time per tenant", title_justify="left")
        for column in ("tenant", "billed GPU s", "replicas' charge rule s", "billed / rule"):
            gpu.add_column(column, justify="left" if column == "tenant" else "right")
        for tenant, (billed, truth) in f.tenant_gpu.items():
            gpu.add_row(
                tenant, f"{billed / 1000:,.2f}", f"{truth / 1000:,.2f}", "-" if truth <= 0 else f"{billed / truth:.3f}"
            )
        out.append(gpu)
        after = ", ".join(f"{k} {v:g}" for k, v in f.gateway_after.items())
        out.append(
            f"after: gateway {after}; replicas running {sum(s['running'] for s in f.replicas_after)}, "
            f"waiting {sum(s['waiting'] for s in f.replicas_after)}; ledger open requests "
            f"{sum(f.concurrent_after.values())}, queued {sum(f.queued_after.values())}, open reservations "
            f"{f.by_status.get('open', 0)}; converged "
            + ("never" if f.converge_s is None else f"{f.converge_s:.2f} s")
            + " after the last client."
        )
        out.append(
            f"tokens: ledger billed {f.billed_tokens:,}, replicas generated {f.replica_tokens:,}; "
            f"lost: over-billed {f.overbilled:,} tokens, held slots {f.held_slots:g}, open reservations "
            f"{f.by_status.get('open', 0)}; unbilled (generated while a hang-up travelled to the replica) "
            + (
                f"{sum(r.unbilled for r in f.requests):,}"
                if f.tapped
                else f"{f.replica_tokens - f.billed_tokens:,} (totals only)"
            )
            + "."
        )
        if f.tapped and f.late:
            late = f.late
            waits = [r.hangup_ms for r in late if r.hangup_ms is not None]
            out.append(
                f"[yellow]found[/yellow]: {len(late)} requests reached a replica after their client had hung up "
                f"(cut while queued in the gateway, which only notices a streamed request's hang-up once it "
                f"relays the first chunk): {sum(r.generated or 0 for r in late):,} tokens and "
                f"{sum(r.billed_gpu_ms for r in late) / 1000:,.2f} GPU s billed for them; their hang-up "
                f"reached the replica after p50 {fmt_ms(percentile(waits, 50))} ms, max "
                f"{fmt_ms(max(waits, default=None))} ms."
            )
        if f.errors:
            out.append(f"[red]errors[/red]: {f.errors}")
        worst = sorted(
            (r for r in f.requests if r.oldest_unbilled_ms is not None and r.cut_at != "completed"),
            key=lambda r: -(r.oldest_unbilled_ms or 0.0),
        )[:3]
        for r in worst:
            if (r.oldest_unbilled_ms or 0.0) > c.read_lag_ms_max:
                out.append(
                    f"[red]{r.request_id}[/red] ({r.cut_at}): received {r.received}, billed {r.billed_output}, "
                    f"generated {r.generated}; tokens at ms from the hang-up: "
                    f"{', '.join(f'{t:.0f}' for t in (r.token_offsets_ms or ())[-(r.unbilled + 2) :])}"
                )
        out.extend(self.check_lines())
        verdict = "[green]PASS[/green]" if self.passed else "[red]FAIL[/red]"
        out.append(
            f"{verdict}: {f.faults} hang-ups in {c.requests} streams; "
            + ("nothing lost" if self.passed else "see the FAIL lines")
            + "; converged in "
            + ("never" if f.converge_s is None else f"{f.converge_s:.2f} s")
            + "."
        )
        return out


async def _drive(drill: DrillStack, config: CancellationConfig, todo: list[Plan], model: str) -> list[ClientSide]:
    import openai

    clients = {
        t: openai.AsyncOpenAI(base_url=f"{drill.url}/v1", api_key=drill.keys[t], max_retries=0, timeout=120.0)
        for t in config.tenants
    }
    gate = asyncio.Semaphore(config.concurrency)
    filler = "w " * (config.prompt_tokens - CHAT_OVERHEAD_TOKENS - 1)

    async def one(plan: Plan) -> ClientSide:
        side = ClientSide(plan)
        async with gate:
            create = clients[plan.tenant].chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": filler + plan.request_id}],
                max_tokens=plan.max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
                extra_headers={"X-Request-Id": plan.request_id},
            )
            try:
                if plan.cut == "before_bytes":
                    try:
                        stream = await asyncio.wait_for(create, timeout=plan.after_s)
                    except TimeoutError:
                        side.cut_at, side.hangup_s = "before_bytes", time.monotonic()
                        return side
                else:
                    stream = await create
                try:
                    if plan.cut in ("before_bytes", "after_headers"):
                        side.cut_at, side.hangup_s = "after_headers", time.monotonic()
                        return side
                    async for chunk in stream:
                        if chunk.usage is not None:
                            side.usage_tokens = chunk.usage.completion_tokens
                        if chunk.choices and chunk.choices[0].delta.content:
                            side.received += 1
                            if plan.cut == "after_chunks" and side.received >= plan.after_chunks:
                                side.cut_at, side.hangup_s = "after_chunks", time.monotonic()
                                return side
                    side.cut_at = "completed"
                finally:
                    await stream.close()  # closes the connection: the gateway sees the hang-up
            except Exception as exc:
                from fairgate.drills.loadgen import _error_key

                side.cut_at, side.error = "error", _error_key(exc)
            finally:
                side.ended_s = time.monotonic()
            return side

    try:
        return list(await asyncio.gather(*(one(p) for p in todo)))
    finally:
        for client in clients.values():
            await client.close()


async def _converge(
    drill: DrillStack, ledger: Any, tenants: tuple[str, ...], model: str, start: float, limit_s: float
) -> tuple[float | None, dict[str, float], list[dict[str, Any]], dict[str, int], dict[str, int]]:
    """Poll until the gateway, the replicas and the ledger hold nothing; seconds from ``start`` (monotonic)
    until they did (None: not within ``limit_s``) and the last readings."""
    while True:
        held = await gateway_load(drill)
        replicas = await replica_stats(drill)
        accounts = {t: await ledger.account(t, model) for t in tenants}
        concurrent = {t: a.concurrent for t, a in accounts.items()}
        queued = {t: a.queued for t, a in accounts.items()}
        open_count = len(await ledger.reservations(status="open"))
        idle = (
            not any(held.values())
            and not any(s["running"] or s["waiting"] for s in replicas)
            and not any(concurrent.values())
            and not any(queued.values())
            and open_count == 0
        )
        elapsed = time.monotonic() - start
        if idle or elapsed > limit_s:
            return (elapsed if idle else None), held, replicas, concurrent, queued
        await asyncio.sleep(0.05)


def run(options: DrillOptions, config: CancellationConfig | None = None) -> CancellationResult:
    """Run the drill under ``options.policy`` (``seconds`` and ``compare`` do not apply: the load is
    1,000 requests, and the claim does not depend on the policy)."""
    config = config or CancellationConfig()
    spec = config.spec(options.policy, options.processes)
    todo = plans(config, options.seed)

    # Replicas writing to a gateway connection that has just closed make asyncio log "socket.send() raised
    # exception." by the hundred, and streams abandoned mid-iteration make httpx's generators complain when
    # they are finalised: expected here, and not what the drill reports.
    asyncio_log = logging.getLogger("asyncio")
    level, hook = asyncio_log.level, sys.unraisablehook

    def quiet(unraisable: Any) -> None:
        if not (isinstance(unraisable.exc_value, ValueError) and "already executing" in str(unraisable.exc_value)):
            hook(unraisable)

    asyncio_log.setLevel(logging.ERROR)
    sys.unraisablehook = quiet
    try:
        return _run(options, config, spec, todo)
    finally:
        asyncio_log.setLevel(level)
        sys.unraisablehook = hook


def _run(options: DrillOptions, config: CancellationConfig, spec: StackSpec, todo: list[Plan]) -> CancellationResult:
    from fairgate.ledger.base import tenant_tag
    from fairgate.ledger.reconcile import reconcile

    with open_stack(spec, gateway_process=config.gateway_process) as drill:

        async def go() -> CancellationFigures:
            start = time.monotonic()
            sides = await _drive(drill, config, todo, spec.model)
            last = max(s.ended_s for s in sides)
            load_s = last - start
            ledger = await open_ledger(drill.stack)
            try:
                converge_s, held, replicas, concurrent, queued = await _converge(
                    drill, ledger, config.tenants, spec.model, last, config.converge_s_max
                )
                reservations = await ledger.reservations()
                report = await reconcile(ledger, freeze=False)
            finally:
                await ledger.close()
            by_id: dict[str, list[Any]] = {}
            for r in reservations:
                by_id.setdefault(r.request_id, []).append(r)
            sequences: dict[str, list[Any]] = {}
            for tap in drill.taps:
                for tag, seqs in tap.sequences.items():
                    sequences.setdefault(tag, []).extend(seqs)
            tapped = bool(drill.taps)
            rows = []
            for side in sides:
                plan = side.plan
                mine = by_id.get(plan.request_id, [])
                first = mine[0] if mine else None
                seqs = sequences.get(plan.request_id, [])
                hangup = side.hangup_s if tapped else None  # the replicas' clock is this process's
                rows.append(
                    RequestFigures(
                        plan.request_id,
                        plan.tenant,
                        plan.max_tokens,
                        side.cut_at,
                        side.received,
                        len(mine),
                        first.status if first else None,
                        first.billed.output_tokens if first else 0,
                        first.billed.gpu_ms if first else 0.0,
                        len(seqs) if tapped else None,
                        sum(s.generated for s in seqs) if tapped else None,
                        sum(s.charged_ms for s in seqs) if tapped else None,
                        None if hangup is None else any(s.arrival_s > hangup for s in seqs),
                        any(s.charged_ms > 0 for s in seqs) if tapped else None,
                        None
                        if hangup is None
                        else max(
                            (
                                (s.drill_cancelled_s - hangup) * 1000.0
                                for s in seqs
                                if getattr(s, "drill_cancelled_s", None) is not None
                            ),
                            default=None,
                        ),
                        None
                        if hangup is None
                        else tuple(sorted((t - hangup) * 1000.0 for s in seqs for t in s.events.token_s)),
                    )
                )
            truth = {}
            for stats in replicas:
                for salt, ms in stats["charge_rule_ms_by_cache_salt"].items():
                    truth[salt] = truth.get(salt, 0.0) + ms
            tenant_gpu = {
                t: (sum(r.billed.gpu_ms for r in reservations if r.tenant == t), truth.get(tenant_tag(t), 0.0))
                for t in config.tenants
            }
            return CancellationFigures(
                policy=options.policy,
                requests=rows,
                cut_counts=dict(Counter(s.cut_at for s in sides)),
                errors=dict(Counter(s.error for s in sides if s.error)),
                load_s=load_s,
                converge_s=converge_s,
                gateway_after=held,
                replicas_after=replicas,
                concurrent_after=concurrent,
                queued_after=queued,
                by_status=dict(Counter(r.status for r in reservations)),
                reconcile_differences={t.tenant: t.differences for t in report.tenants if t.differences},
                tenant_gpu=tenant_gpu,
                tapped=tapped,
                untagged_sequences=sum(t.untagged for t in drill.taps),
            )

        figures = asyncio.run(go())
    return CancellationResult(config, figures)

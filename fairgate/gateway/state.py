"""The gateway's state, typed: everything the stages of the request path and the operator views share.

``create_gateway`` builds one ``GatewayState``; the app's lifespan opens what needs the event loop (the
ledger, the upstream clients, the background tasks) and hands the state to every request through
Starlette's lifespan state (``request.state.gateway``, read by ``gateway_of``). Modules receive it as an
argument; nothing else is kept on the app or in module globals. The clock and the random source are
injected here, so tests can drive time and jitter.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import socket
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI, Request
from pydantic import SecretStr

from fairgate.gateway.config import GatewayConfig, UpstreamConfig
from fairgate.gateway.dispatch import Dispatcher
from fairgate.gateway.dispatch import Upstream as Dispatched
from fairgate.gateway.identity import Identity
from fairgate.gateway.observe import Fanout
from fairgate.gateway.upstream import UpstreamClient
from fairgate.ledger import Ledger
from fairgate.ledger.emergency import ResilientLedger

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from fairgate.gateway.records import RequestRecorder

log = logging.getLogger("fairgate.gateway")
CLAIM_LEASE_SWEEPS = 3


class Clock(Protocol):
    """The gateway's two clocks, in seconds."""

    def wall_s(self) -> float:
        """Seconds since the epoch (event times, token expiry)."""

    def monotonic_s(self) -> float:
        """Seconds on a clock that never goes back (durations, the policy's and the meter's time)."""


class SystemClock:
    """The real clocks: ``time.time`` and ``time.monotonic``."""

    def wall_s(self) -> float:
        return time.time()

    def monotonic_s(self) -> float:
        return time.monotonic()


class CallRegistry:
    """The requests this process serves now (queued or running): ``(tenant, request id)`` -> reservation id.

    The liveness sweep heartbeats their reservations; a second request with an id served here is refused.
    """

    def __init__(self) -> None:
        self._calls: dict[tuple[str, str], str] = {}
        self._reservation_ids: set[str] = set()  # of ``_calls``: asked at every admission and renewal
        # reservation id -> when its run claim lapses by this process's monotonic clock (s): the lease from the
        # moment the call that took or renewed it was sent, so never later than the ledger's own lapse
        self._claim_until_s: dict[str, float] = {}

    def claim(self, tenant: str, request_id: str, reservation_id: str) -> bool:
        """Register a request; ``False`` if this process serves that id already."""
        if (tenant, request_id) in self._calls:
            return False
        self._calls[(tenant, request_id)] = reservation_id
        self._reservation_ids.add(reservation_id)
        return True

    def run_claim_held(self, reservation_id: str, until_s: float) -> None:
        """The ledger took or renewed the run claim of a request served here, this process's until ``until_s``
        (monotonic s: the call's send time plus the lease). A reservation not registered is ignored."""
        if reservation_id in self._reservation_ids:
            self._claim_until_s[reservation_id] = until_s

    def run_claim_lost(self, reservation_id: str) -> None:
        """Another process holds the run claim of a request served here: it may run it."""
        if reservation_id in self._claim_until_s:
            self._claim_until_s[reservation_id] = -math.inf

    def run_claim_left_s(self, reservation_id: str, now_s: float) -> float:
        """How long the run claim of a request served here holds by this process's clock (s; negative: lapsed
        or lost, and another process may run the request; ``inf``: no ledger claim is known, an emergency grant
        answered here)."""
        return self._claim_until_s.get(reservation_id, math.inf) - now_s

    def serves(self, tenant: str, request_id: str) -> bool:
        """Whether a request of this id is registered (``claim`` would return ``False``)."""
        return (tenant, request_id) in self._calls

    def release(self, tenant: str, request_id: str) -> None:
        """Forget a request (idempotent)."""
        reservation_id = self._calls.pop((tenant, request_id), None)
        if reservation_id is not None:
            self._reservation_ids.discard(reservation_id)
            self._claim_until_s.pop(reservation_id, None)

    def reservation_ids(self) -> list[str]:
        """The reservations of every request served now."""
        return list(self._calls.values())

    def __len__(self) -> int:
        return len(self._calls)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(list(self._calls))


# Opens an upstream's client: (the dispatcher's upstream, its table, its API key or None) -> the client.
UpstreamOpener = Callable[["Dispatched", UpstreamConfig, "SecretStr | None"], UpstreamClient]


@dataclass(eq=False)
class GatewayState:
    """What one gateway app holds (see module docstring).

    Attributes:
        config: the validated configuration.
        clock, rng: the injected clock and random source (``Retry-After`` jitter).
        events: every request's events go here; the operator views observe them.
        identity: API keys and delegation (who is calling, for which tenant).
        dispatcher: per-model queues and the fair policy.
        calls: the requests this process serves now.
        unsettled: reservations whose request ran here but whose final settlement the ledger did not take
            (journalled for replay while it is down, or refused): open and unbilled in the ledger, they look
            never run; a retry of their id is not run again (``admission``). Dropped once seen final.
        unsettled_requests: the (tenant, request id) of each of ``unsettled``: a retry of one is reserved without
            asking for the run claim (``admission``: it is refused, and the claim left as it is).
        upstreams: upstream name -> its client and live meter (from start-up).
        metrics_registry: the Prometheus registry of ``/metrics``, once installed.
        request_records: the recorder behind the access log and the traces (``fairgate.gateway.records``),
            once installed; None: both off.
        on_reload: told of the configuration a reload applied, once it is ``config`` (the views that keep
            something of it: weights, tenants).
        apply_lock: held by whatever applies a configuration (a reload, an admin write), one at a time: a
            reload that read the file before a write's change would otherwise undo it.
        process_id: this process's name among the gateway processes sharing the ledger (the owner of its
            run claims and of its shared occupancy): host, pid and a random part, unique per start.
        request_rate_refused: tenant -> until when (monotonic s) the ledger's request-rate bucket holds no
            request for it, as its last refusal said (``admission``): till then its requests are not counted
            by an engine's tokenizer, which the ledger would refuse whatever their size.
    """

    config: GatewayConfig
    clock: Clock
    rng: random.Random
    events: Fanout
    identity: Identity
    dispatcher: Dispatcher
    calls: CallRegistry = field(default_factory=CallRegistry)
    unsettled: set[str] = field(default_factory=set)
    unsettled_requests: set[tuple[str, str]] = field(default_factory=set)
    upstreams: dict[str, UpstreamClient] = field(default_factory=dict)
    metrics_registry: CollectorRegistry | None = None
    request_records: RequestRecorder | None = None
    process_id: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}")
    on_reload: list[Callable[[GatewayConfig], None]] = field(default_factory=list)
    apply_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    request_rate_refused: dict[str, float] = field(default_factory=dict)
    _ledger: ResilientLedger | None = None
    _backend: Ledger | None = None
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _opener: UpstreamOpener | None = None

    @property
    def ledger(self) -> ResilientLedger:
        """The request path's ledger (emergency grants while the backend is down). Raises ``RuntimeError``
        before the app has started."""
        if self._ledger is None:
            raise RuntimeError("the gateway has not started: its ledger is not open")
        return self._ledger

    @property
    def backend(self) -> Ledger:
        """The ledger backend itself: operator functions and multi-process coordination."""
        if self._backend is None:
            raise RuntimeError("the gateway has not started: its ledger is not open")
        return self._backend

    def open_ledger(self, backend: Ledger) -> None:
        """Set the ledger the app has opened (its lifespan does)."""
        self._backend = backend
        self._ledger = ResilientLedger(backend, self.config.journal_path)

    def set_upstream_opener(self, opener: UpstreamOpener) -> None:
        """How this app opens an upstream's client (its lifespan sets it: the clients live on its loop)."""
        self._opener = opener

    def open_upstream(
        self, upstream: Dispatched, settings: UpstreamConfig, api_key: SecretStr | None
    ) -> UpstreamClient:
        """A client and live meter for ``upstream`` (at start, and for one a reload adds). Raises
        ``RuntimeError`` before the app has started."""
        if self._opener is None:
            raise RuntimeError("the gateway has not started: it opens no upstream")
        return self._opener(upstream, settings, api_key)

    def wall_ms(self) -> float:
        return self.clock.wall_s() * 1000.0

    @property
    def claim_lease_ms(self) -> float:
        """How long a run claim holds unless renewed: three liveness sweeps (each renews the claims of the
        requests this process serves), so one late or failed sweep loses none, and a process that died
        frees its requests for another process within three sweeps."""
        return CLAIM_LEASE_SWEEPS * self.config.gateway.sweep_s * 1000.0

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` without waiting for it; a failure is logged, the task kept alive until done."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)

        def finished(done: asyncio.Task[Any]) -> None:
            self._tasks.discard(done)
            if not done.cancelled() and done.exception() is not None:
                log.warning("background ledger call failed: %s", done.exception())

        task.add_done_callback(finished)


def gateway_of(request: Request) -> GatewayState:
    """The state of the gateway serving ``request`` (from the lifespan state); a FastAPI dependency."""
    state = request.state.gateway
    assert isinstance(state, GatewayState), "the gateway's lifespan has not run"
    return state


async def gateway_dependency(request: Request) -> GatewayState:
    """``gateway_of`` as a FastAPI dependency: ``async``, so it runs on the event loop (FastAPI runs a plain
    ``def`` dependency on its thread pool)."""
    return gateway_of(request)


def state_of(app: FastAPI) -> GatewayState:
    """The state of a gateway app built by ``create_gateway`` (for tests and drills holding the app)."""
    state = app.state.gateway
    assert isinstance(state, GatewayState), "not an app of create_gateway"
    return state

"""The gateway's background work, one task each while the app runs: the liveness sweep, the upstream
probe, the emergency journal's replay, and the sharing of policy counters and meter occupancy with other
gateway processes (``fairgate.gateway.sharing``)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp

from fairgate.gateway.dispatch import Upstream
from fairgate.gateway.engine_load import poll_engine_load
from fairgate.gateway.sharing import ChargeSync
from fairgate.gateway.state import GatewayState
from fairgate.ledger import LedgerError, Reservation, ReservationFinal, ReservationNotFound
from fairgate.ledger.emergency import ResilientLedger

log = logging.getLogger("fairgate.gateway")
PROBE_EVERY_S = 1.0
RECOVER_EVERY_S = 1.0
PROBE_TIMEOUT_S = 2.0
PROBE_BYTES_MAX = 64 * 1024  # of a /v1/models answer (only its status counts)


def start(state: GatewayState) -> list[asyncio.Task[None]]:
    """Start every background task of ``state``'s gateway (cancel them to stop)."""
    config = state.config
    longest_ttl_s = max(
        (
            limits.reservation_ttl_s
            for quota in config.quotas.tenants.values()
            for limits in (quota.limits, *quota.by_model_class.values())
        ),
        default=0.0,
    )
    tasks = [
        asyncio.ensure_future(sweep(state.ledger, claimant_of(state), config.gateway.sweep_s, longest_ttl_s)),
        asyncio.ensure_future(probe(state)),
        asyncio.ensure_future(poll_engine_load(state)),
        asyncio.ensure_future(recover(state.ledger, f"{state.process_id}/doubts", state.claim_lease_ms)),
    ]
    if config.gateway.share_charges_s > 0:
        sync = ChargeSync(
            state.backend, state.dispatcher, config.gateway.share_charges_s, state.upstreams, state.process_id
        )
        tasks.append(asyncio.ensure_future(sync.run()))
    return tasks


def _ignore_renewal(reservation_id: str, until_s: float | None) -> None:
    return None


@dataclass(frozen=True)
class Claimant:
    """Whose requests a sweep keeps alive: ``running()`` names the reservations of the requests this process
    serves, ``owner`` is the process (the owner of their run claims), ``lease_ms`` how long a renewed claim
    holds. ``renewed(reservation_id, until_s)`` is told each renewal's outcome: held until ``until_s`` (``clock``
    seconds: the renewal's send time plus the lease), or None, lost to another process."""

    running: Callable[[], Iterable[str]]
    owner: str
    lease_ms: float
    renewed: Callable[[str, float | None], None] = _ignore_renewal
    clock: Callable[[], float] = time.monotonic


def claimant_of(state: GatewayState) -> Claimant:
    """The claimant of this process's requests, its renewals kept in ``state.calls`` (``CallRegistry``)."""

    def renewed(reservation_id: str, until_s: float | None) -> None:
        if until_s is None:
            state.calls.run_claim_lost(reservation_id)
        else:
            state.calls.run_claim_held(reservation_id, until_s)

    return Claimant(
        state.calls.reservation_ids, state.process_id, state.claim_lease_ms, renewed, state.clock.monotonic_s
    )


async def sweep(
    front: ResilientLedger, claimant: Claimant, interval_s: float, hold_after_outage_s: float = 0.0
) -> None:
    """The liveness check, every ``interval_s`` (``sweep_once`` for ``claimant``: this process's requests).
    After a ledger outage no process expires anything for ``hold_after_outage_s`` (the longest reservation
    TTL): nobody could heartbeat during the outage, and every other process gets that long to replay its
    journal and heartbeat its requests before their reservations could be expired with their usage still in
    its journal."""
    loop = asyncio.get_running_loop()
    hold_until = 0.0
    outage = False
    while True:
        await asyncio.sleep(interval_s)
        try:
            expired = await sweep_once(front, claimant, expire=loop.time() >= hold_until)
            if outage:
                outage, hold_until = False, loop.time() + hold_after_outage_s
            if expired:
                log.warning("expired %d reservations nobody was running", len(expired))
        except LedgerError as exc:
            outage = True
            hold_until = math.inf  # until a sweep goes through again
            log.warning("liveness sweep skipped: %s", exc)
        except Exception:  # an error no backend mapped: the loop must outlive it, held as after an outage
            outage, hold_until = True, math.inf
            log.exception("liveness sweep failed; tried again next round")


async def sweep_once(front: ResilientLedger, claimant: Claimant, expire: bool = True) -> list[Reservation]:
    """One liveness sweep: replay this process's emergency journal if it holds anything (so usage kept
    during an outage is billed before its reservation could expire), renew the run claims (which heartbeat)
    of the requests this process serves (``claimant``; emergency grants under the id their replay made), then
    expire the open reservations nobody has heartbeat within their TTL (those of a process that died;
    billing what was settled so far). Every gateway process runs it; expiry is idempotent. A process that
    still holds journal records expires nothing, nor does ``expire=False``. Returns the reservations
    expired. Raises ``LedgerError``."""
    if front.outstanding():
        await front.recover()
    running = list(claimant.running())
    for start in range(0, len(running), RENEWALS_AT_ONCE):
        batch = [
            _renew(front, claimant, reservation_id) for reservation_id in running[start : start + RENEWALS_AT_ONCE]
        ]
        failed = [r for r in await asyncio.gather(*batch, return_exceptions=True) if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
    if not expire:
        return []
    return await front.expire_due()  # nothing while the journal holds usage not yet in the ledger


# Renewals in flight at once: one after another, 60 streams behind a ledger 400 ms away took longer than the lease
# (an outside tester: 24 of 60 taken over by retries mid-stream).
RENEWALS_AT_ONCE = 16


async def _renew(front: ResilientLedger, claimant: Claimant, reservation_id: str) -> None:
    """Renew one request's run claim and tell ``claimant.renewed``. Raises ``LedgerError``."""
    sent_s = claimant.clock()
    try:
        claim = await front.claim(reservation_id, claimant.owner, claimant.lease_ms)
    except (ReservationFinal, ReservationNotFound):  # closed since it was listed, by its end or by another process
        claimant.renewed(reservation_id, None)
        return
    if claim.held_by(claimant.owner):
        claimant.renewed(reservation_id, sent_s + claimant.lease_ms / 1000.0)
    else:  # this process missed three sweeps: another took the request
        claimant.renewed(reservation_id, None)
        log.warning("run claim of %s lost to %s", reservation_id, claim.owner)


async def recover(front: ResilientLedger, owner: str, lease_ms: float, interval_s: float = RECOVER_EVERY_S) -> None:
    """Every ``interval_s`` while the emergency journal holds records (grants made or settlements kept
    while the ledger was down), replay it into the ledger once it answers (``ResilientLedger.recover``); while
    refused reserves may have committed after all, cancel what they left (``clear_doubts``, claiming as
    ``owner``: not this process's request claims, so a retry running here is never taken for one)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            if front.outstanding():
                log.warning("emergency journal replayed into the ledger: %s", await front.recover())
            if front.doubtful():
                cancelled = await front.clear_doubts(owner, lease_ms)
                if cancelled:
                    log.warning("cancelled %d reservation(s) committed after their reserve timed out", cancelled)
        except LedgerError:
            continue  # still down: the journal is kept whole, the doubts too
        except Exception:  # an error no backend mapped: the journal is kept whole, and the loop goes on
            log.exception("emergency journal replay failed; tried again next round")


async def probe(state: GatewayState, interval_s: float = PROBE_EVERY_S) -> None:
    """Every ``interval_s``, ask each upstream for its models (all at once, each bounded by ``PROBE_TIMEOUT_S``):
    one marked down that answers is back; one marked up that refuses the connection is down. No request has to
    fail first: a replica that never came up, or went away while idle, is not counted ready (``/health/ready``,
    ``fairgate_upstream_up``) - a new user's gateway in front of two dead ports read ready with both up. A slow
    answer or an error status changes nothing (an engine busy, or serving no ``/models``, is not gone)."""
    while True:
        await asyncio.sleep(interval_s)
        probes = [_probe_one(state, upstream) for upstream in state.dispatcher.upstreams()]
        for failure in await asyncio.gather(*probes, return_exceptions=True):
            if isinstance(failure, Exception):  # the loop must outlive it
                log.error("upstream probe failed: %r", failure)


async def _probe_one(state: GatewayState, upstream: Upstream) -> None:
    client = state.upstreams.get(upstream.name)
    if client is None or client.upstream is not upstream:  # a reload took it out meanwhile
        return
    try:
        status, _ = await client.get("/models", PROBE_TIMEOUT_S, PROBE_BYTES_MAX)
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):  # refused, unreachable, or no answer
        # to a connect (a host gone without a reset): nothing listens there
        state.dispatcher.mark_down(upstream)  # logs it
        return
    except (aiohttp.ClientError, TimeoutError):
        return
    if status == 200:
        state.dispatcher.mark_up(upstream)  # logs it

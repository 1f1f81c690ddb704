"""What every backend implements alike: argument checks, then the backend's storage steps.

A backend subclasses ``Backend`` and supplies the steps (``_reserve``, which takes the run claim too when asked,
``_claim``, ``_close``, ``_queue_step``, and for the sweep ``_due``, ``_last_beat_ms``, ``_extend``, ``_expire``)
plus the rest of ``Ledger``; the checks, the order they run in, and the sweep's decision (running or not, extended
until when) are written once here.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import replace

from fairgate.ledger import rules
from fairgate.ledger.base import IsRunning, Ledger
from fairgate.ledger.checks import check_claim_args, check_consumed, check_reservation_id, check_reserve_args
from fairgate.ledger.config import Limits
from fairgate.ledger.model import Reservation, RunClaim, Usage


class Backend(Ledger):
    """``Ledger`` with the request path's checks and the sweep's loop written once."""

    async def reserve_args(
        self, args: rules.ReserveArgs, claim_owner: str | None = None, claim_lease_ms: float = 0.0
    ) -> Reservation:
        check_reserve_args(args.tenant, args.request_id, args.model_class, args.run_id, args.tool_round)
        if claim_owner is not None:
            check_claim_args(claim_owner, claim_lease_ms)
        limits = self.limits(args.tenant, args.model_class)
        rules.check_amounts(args.input_tokens, args.max_output_tokens, args.gpu_ms_estimate, "reserve")
        # The price is the ledger's configuration's, never the caller's: a reservation is priced where its
        # budget is kept.
        priced = replace(args, price=self.quotas.price(args.model_class))
        return await self._reserve(priced, limits, claim_owner, float(claim_lease_ms))

    async def claim(self, reservation_id: str, owner: str, lease_ms: float) -> RunClaim:
        check_claim_args(owner, lease_ms)
        return await self._claim(check_reservation_id(reservation_id), owner, float(lease_ms))

    async def settle(
        self, reservation_id: str, input_tokens: int, output_tokens: int, gpu_ms: float, final: bool = False
    ) -> Reservation:
        rules.check_amounts(input_tokens, output_tokens, gpu_ms, "settle")
        return await self._close(reservation_id, Usage(input_tokens, output_tokens, float(gpu_ms)), final, "settle")

    async def cancel(self, reservation_id: str, consumed: Usage) -> Reservation:
        return await self._close(reservation_id, check_consumed(consumed), True, "cancel")

    async def enqueue(self, reservation_id: str) -> Reservation:
        return await self._queue_step(reservation_id, enter=True)

    async def dequeue(self, reservation_id: str) -> Reservation:
        return await self._queue_step(reservation_id, enter=False)

    async def expire_due(self, is_running: IsRunning | None = None) -> list[Reservation]:
        expired = []
        for r in await self._due():
            ttl_s = self.closing_limits(r.tenant, r.model_class).reservation_ttl_s
            if is_running is not None:
                running, since_ms = await is_running(r), None
            else:  # the heartbeat registry: running if beaten within the TTL, and only a TTL from that beat
                since_ms, now_ms = await self._last_beat_ms(r)
                running = since_ms is not None and now_ms - since_ms <= ttl_s * 1000.0
            if running:
                await self._extend(r, ttl_s, since_ms)
                continue
            done = await self._expire(r)
            if done is not None:
                expired.append(done)
        return expired

    # --- the backend's steps -------------------------------------------------------------------
    @abstractmethod
    async def _reserve(
        self, args: rules.ReserveArgs, limits: Limits, claim_owner: str | None, claim_lease_ms: float
    ) -> Reservation:
        """``reserve`` once its arguments are checked: the reservation made, or the one ``args.request_id``
        made before (``rules.check_retry``); with ``claim_owner``, the run claim too, in the same transaction
        (``rules.claim_on_reserve``, on ``Reservation.claim``). Raises ``QuotaExceeded``,
        ``IdempotencyConflict``, ``LedgerUnavailable``."""

    @abstractmethod
    async def _claim(self, reservation_id: str, owner: str, lease_ms: float) -> RunClaim:
        """``claim`` once its arguments are checked (``rules.claim`` decides). Raises as ``claim``."""

    @abstractmethod
    async def _close(self, reservation_id: str, billed: Usage, final: bool, kind: str) -> Reservation:
        """Bill ``billed`` (cumulative, checked) to the reservation; ``final`` closes it with status ``kind``
        (settle, cancel). Raises as ``settle``."""

    @abstractmethod
    async def _queue_step(self, reservation_id: str, enter: bool) -> Reservation:
        """``enqueue`` (``enter``) or ``dequeue``."""

    @abstractmethod
    async def _due(self) -> list[Reservation]:
        """The open reservations past their TTL now, of tenants not frozen, in the order to sweep them."""

    @abstractmethod
    async def _last_beat_ms(self, r: Reservation) -> tuple[float | None, float]:
        """(the last heartbeat of ``r`` or None, now), ms on the ledger clock."""

    @abstractmethod
    async def _extend(self, r: Reservation, ttl_s: float, since_ms: float | None) -> None:
        """Extend ``r`` (if still open) to ``ttl_s`` after ``since_ms`` (None: now)."""

    @abstractmethod
    async def _expire(self, r: Reservation) -> Reservation | None:
        """Expire ``r`` billing what was settled so far: the expired reservation, or None when it is not
        to be expired after all (settled, extended or frozen meanwhile)."""

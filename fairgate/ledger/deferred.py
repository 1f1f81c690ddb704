"""A ledger that is connected in the background: a gateway starts while its ledger cannot be reached.

``DeferredLedger`` is a ``Ledger`` whose every call raises ``LedgerUnavailable`` until ``connect`` has opened
the backend, and goes to the backend from then on. Wrapped in ``ResilientLedger`` (``emergency.py``), a
gateway started during an outage serves its ``emergency`` tiers from their local budgets and refuses its
``reject`` tiers with 503, as it would in an outage that began later, and converges (journal replay, expiry)
once the ledger answers. Seed 003: the platform must "never fail-open indefinitely" - and never fail-closed
for the tiers promised an emergency budget either.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from fairgate.ledger.base import ChargeTotals, IsRunning, Ledger
from fairgate.ledger.config import Quotas
from fairgate.ledger.model import Event, LedgerUnavailable, Reservation, RunClaim, TenantUsage, Usage
from fairgate.ledger.rules import Account, ReserveArgs

log = logging.getLogger("fairgate.ledger")
RETRY_EVERY_S = 1.0


class DeferredLedger(Ledger):
    """``Ledger`` over a backend opened by ``connect`` (see module docstring).

    Args:
        quotas: the quota configuration (the backend is opened with the same).
        opener: opens the backend; raises ``LedgerUnavailable`` while it cannot be reached.
    """

    def __init__(self, quotas: Quotas, opener: Callable[[], Awaitable[Ledger]]) -> None:
        super().__init__(quotas)
        self._opener = opener
        self._backend: Ledger | None = None

    async def connect(self, retry_every_s: float = RETRY_EVERY_S) -> None:
        """Open the backend, retrying every ``retry_every_s`` while it cannot be reached (logged once)."""
        warned = False
        while self._backend is None:
            try:
                backend = await self._opener()
            except LedgerUnavailable as exc:
                if not warned:
                    log.warning("ledger unavailable at start, serving the outage policy until it answers: %s", exc)
                    warned = True
                await asyncio.sleep(retry_every_s)
            else:
                backend.apply_quotas(self.quotas)  # opened with the quotas of the start; a reload may have come
                self._backend = backend
        if warned:
            log.warning("ledger connected")

    def apply_quotas(self, quotas: Quotas) -> None:
        """``Ledger.apply_quotas``, on the backend too once it is open."""
        super().apply_quotas(quotas)
        if self._backend is not None:
            self._backend.apply_quotas(quotas)

    @property
    def connected(self) -> bool:
        return self._backend is not None

    def _ledger(self) -> Ledger:
        if self._backend is None:
            raise LedgerUnavailable("the ledger has not been reached since the gateway started")
        return self._backend

    async def reserve_args(
        self, args: ReserveArgs, claim_owner: str | None = None, claim_lease_ms: float = 0.0
    ) -> Reservation:
        return await self._ledger().reserve_args(args, claim_owner, claim_lease_ms)

    async def claim(self, reservation_id: str, owner: str, lease_ms: float) -> RunClaim:
        return await self._ledger().claim(reservation_id, owner, lease_ms)

    async def settle(
        self, reservation_id: str, input_tokens: int, output_tokens: int, gpu_ms: float, final: bool = False
    ) -> Reservation:
        return await self._ledger().settle(reservation_id, input_tokens, output_tokens, gpu_ms, final)

    async def cancel(self, reservation_id: str, consumed: Usage) -> Reservation:
        return await self._ledger().cancel(reservation_id, consumed)

    async def enqueue(self, reservation_id: str) -> Reservation | None:
        return await self._ledger().enqueue(reservation_id)

    async def dequeue(self, reservation_id: str) -> Reservation | None:
        return await self._ledger().dequeue(reservation_id)

    async def get(self, reservation_id: str) -> Reservation:
        return await self._ledger().get(reservation_id)

    async def account(self, tenant: str, model_class: str = "default") -> Account:
        return await self._ledger().account(tenant, model_class)

    async def heartbeat(self, reservation_id: str) -> None:
        await self._ledger().heartbeat(reservation_id)

    async def usage(self, tenant: str, window_s: float) -> TenantUsage:
        return await self._ledger().usage(tenant, window_s)

    async def reservations(self, tenant: str | None = None, status: str | None = None) -> list[Reservation]:
        return await self._ledger().reservations(tenant, status)

    async def events(self, tenant: str | None = None) -> list[Event]:
        return await self._ledger().events(tenant)

    async def freeze(self, tenant: str, reason: str) -> None:
        await self._ledger().freeze(tenant, reason)

    async def unfreeze(self, tenant: str) -> None:
        await self._ledger().unfreeze(tenant)

    async def frozen(self) -> dict[str, str]:
        return await self._ledger().frozen()

    async def expire_due(self, is_running: IsRunning | None = None) -> list[Reservation]:
        return await self._ledger().expire_due(is_running)

    async def add_charges(self, scope: str, deltas: dict[str, ChargeTotals]) -> dict[str, ChargeTotals]:
        return await self._ledger().add_charges(scope, deltas)

    async def share_occupancy(
        self, process: str, occupancy: dict[str, tuple[float, float]], stale_after_ms: float
    ) -> dict[str, tuple[float, float]]:
        return await self._ledger().share_occupancy(process, occupancy, stale_after_ms)

    async def close(self) -> None:
        if self._backend is not None:
            await self._backend.close()


__all__ = ["DeferredLedger"]

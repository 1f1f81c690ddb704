"""The Redis ledger's operator calls (``Operator``): usage, the records, freezing settlement.

``Event.seq`` is a per-tenant sequence here (not ledger-wide, as on SQL), and ``events()`` over all
tenants merges the tenants' logs by ``at_ms`` (each tenant's own order kept).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Sequence
from typing import cast

from fairgate.ledger.base import Event, tenant_tag
from fairgate.ledger.checks import check_filters, check_freeze, check_window
from fairgate.ledger.model import Reservation, TenantUsage, check_name
from fairgate.ledger.redis import codec
from fairgate.ledger.redis.keys import EVENTS, FROZEN, RES
from fairgate.ledger.redis.store import RedisStore
from fairgate.ledger.usage_minutes import usage_from_totals


class RedisOperator(RedisStore):
    """usage / reservations / events / freeze / unfreeze / frozen on Redis."""

    async def usage(self, tenant: str, window_s: float) -> TenantUsage:
        """``usage.lua``: the window's first, partial minute's events, its whole minutes' buckets
        (``usage_minutes``) and the status counts, read at one instant."""
        check_name(tenant, "tenant")
        window_s = check_window(window_s)
        async with self._unavailable():
            edge_raw, buckets, flat = await self._scripts.usage(
                keys=self._keys.tenant(tenant_tag(tenant)), args=[*self._head(), codec.number(window_s)]
            )
        edge = (codec.event(tenant, raw) for raw in edge_raw)
        parts: list[Sequence[float]] = [
            (e.requests, e.input_tokens, e.output_tokens, e.gpu_ms, e.overage_gpu_ms, e.spend_micros) for e in edge
        ]
        parts += [[float(x) for x in json.loads(codec.text(raw))] for raw in buckets]
        by_status = {flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2) if int(flat[i + 1]) > 0}
        return usage_from_totals(tenant, window_s, parts, by_status)

    async def reservations(self, tenant: str | None = None, status: str | None = None) -> list[Reservation]:
        check_filters(tenant, status)
        async with self._unavailable():
            tags = [tenant_tag(tenant)] if tenant is not None else sorted(await self._tenants())
            found: list[Reservation] = []
            for tag in tags:
                found.extend(codec.reservation(raw) for raw in await self._client.hvals(self._keys.tenant(tag)[RES]))
        return sorted((r for r in found if status is None or r.status == status), key=lambda r: (r.created_ms, r.id))

    async def events(self, tenant: str | None = None) -> list[Event]:
        """One tenant's log by its sequence; all tenants' merged by ``at_ms`` (see the module docstring)."""
        check_name(tenant, "tenant", optional=True)
        async with self._unavailable():
            tenants = {tenant_tag(tenant): tenant} if tenant is not None else await self._tenants()
            logs = []
            for tag in sorted(tenants):
                raws = cast(list[str], await self._client.zrange(self._keys.tenant(tag)[EVENTS], 0, -1))  # no scores
                logs.append(sorted((codec.event(tenants[tag], raw) for raw in raws), key=lambda e: e.seq))
        if len(logs) == 1:
            return logs[0]
        return list(heapq.merge(*logs, key=lambda e: e.at_ms))

    async def freeze(self, tenant: str, reason: str) -> None:
        """``freeze.lua`` (registers the tenant, so the sweep and ``frozen()`` find it)."""
        check_freeze(tenant, reason)
        async with self._unavailable():
            await self._ensure_registered(tenant)
            await self._scripts.freeze(keys=self._keys.tenant(tenant_tag(tenant)), args=[*self._head(), tenant, reason])

    async def unfreeze(self, tenant: str) -> None:
        check_name(tenant, "tenant")
        async with self._unavailable():
            await self._client.delete(self._keys.tenant(tenant_tag(tenant))[FROZEN])

    async def frozen(self) -> dict[str, str]:
        async with self._unavailable():
            found: dict[str, str] = {}
            for tag, name in (await self._tenants()).items():
                reason = await self._client.hget(self._keys.tenant(tag)[FROZEN], "reason")
                if reason is not None:
                    found[name] = codec.text(reason)
        return dict(sorted(found.items()))

"""The Redis ledger's coordination of gateway processes (``Coordination``): the liveness sweep's steps,
shared fair-policy counters and shared replica occupancy."""

from __future__ import annotations

from redis.typing import EncodableT, FieldT

from fairgate.ledger.base import ChargeTotals, tenant_tag
from fairgate.ledger.checks import check_charges
from fairgate.ledger.model import Reservation, UnknownTenant
from fairgate.ledger.redis import codec
from fairgate.ledger.redis.store import RedisStore

# The field of a process's occupancy hash holding when it was written (ledger clock, ms); no upstream URL
# holds a newline, so it cannot be an upstream's name.
WRITTEN_AT = "\nwritten_at_ms"


class RedisCoordination(RedisStore):
    """expire_due's steps (``Backend.expire_due`` runs them), add_charges and share_occupancy on Redis."""

    async def _due(self) -> list[Reservation]:
        """``due.lua`` per registered tenant (none of a frozen one)."""
        async with self._unavailable():
            due: list[Reservation] = []
            for tag in sorted(await self._tenants()):
                replies = await self._scripts.due(keys=self._keys.tenant(tag), args=self._head())
                due.extend(codec.reservation(raw) for raw in replies)
        due.sort(key=lambda r: (r.expires_at_ms, r.created_ms, r.id))
        return due

    async def _last_beat_ms(self, r: Reservation) -> tuple[float | None, float]:
        """``beat.lua``: the heartbeat and the clock, read at one instant."""
        async with self._unavailable():
            beat, now = await self._scripts.beat(
                keys=self._keys.tenant(tenant_tag(r.tenant)), args=[*self._head(), r.id]
            )
        return (float(beat) if beat not in ("", b"") else None), float(now)

    async def _extend(self, r: Reservation, ttl_s: float, since_ms: float | None) -> None:
        """``extend.lua``."""
        async with self._unavailable():
            await self._scripts.extend(
                keys=self._keys.tenant(tenant_tag(r.tenant)),
                args=[
                    *self._head(),
                    r.id,
                    codec.number(float(ttl_s)),
                    "" if since_ms is None else codec.number(since_ms),
                ],
            )

    async def _expire(self, r: Reservation) -> Reservation | None:
        """``close.lua`` with kind expire, which skips a reservation no longer due or whose tenant is frozen
        (extended or frozen by someone else meanwhile: skipped rather than raising)."""
        reply = await self._close_call(r.id, "expire", True, None)
        code = reply[0]
        if code == "ok" or (code == "final" and codec.reservation(reply[-1]).status == "expired"):
            return codec.reservation(reply[-1])
        if code == "unknown_tenant":
            raise UnknownTenant(f"tenant {r.tenant!r} has no quota configuration")
        return None  # final (settled or cancelled meanwhile), not_due (extended meanwhile), frozen, not_found

    async def add_charges(self, scope: str, deltas: dict[str, ChargeTotals]) -> dict[str, ChargeTotals]:
        """One hash per scope (``keys.py``), updated and read in one MULTI/EXEC."""
        check_charges(scope, deltas)
        key = self._keys.charges(scope)
        async with self._unavailable(), self._client.pipeline(transaction=True) as pipe:
            for tenant, (gpu_ms, tokens_in, tokens_out) in sorted(deltas.items()):
                pipe.hincrbyfloat(key, f"{tenant}\ngpu_ms", float(gpu_ms))
                pipe.hincrby(key, f"{tenant}\ninput", int(tokens_in))
                pipe.hincrby(key, f"{tenant}\noutput", int(tokens_out))
            pipe.pexpire(key, self.retention_ms)  # every key carries the retention TTL (``keys.py``)
            pipe.hgetall(key)
            fields = (await pipe.execute())[-1]
        totals: dict[str, list[float]] = {}
        for field, value in fields.items():
            name, _, part = codec.text(field).rpartition("\n")
            totals.setdefault(name, [0.0, 0, 0])[("gpu_ms", "input", "output").index(part)] = float(value)
        return {
            tenant: (gpu_ms, int(tokens_in), int(tokens_out))
            for tenant, (gpu_ms, tokens_in, tokens_out) in totals.items()
        }

    async def share_occupancy(
        self, process: str, occupancy: dict[str, tuple[float, float]], stale_after_ms: float
    ) -> dict[str, tuple[float, float]]:
        """A hash per process that expires ``stale_after_ms`` after its last write, and a set of the processes
        (``keys.py``); two round trips. Redis expires the hash on its own clock, the ledger clock unless one was
        injected: then the hash also holds its write time on that clock, and a stale one is not counted."""
        members = self._keys.occupancy
        mine = f"{members}:{process}"
        async with self._unavailable():
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(mine)
                if occupancy:
                    mapping: dict[FieldT, EncodableT] = {
                        upstream: f"{float(sequences)!r} {float(prefill_share)!r}"
                        for upstream, (sequences, prefill_share) in occupancy.items()
                    }
                    if self._clock is not None:
                        mapping[WRITTEN_AT] = repr(float(self._clock()))
                    pipe.hset(mine, mapping=mapping)
                    pipe.pexpire(mine, max(1, int(stale_after_ms)))
                pipe.sadd(members, process)
                pipe.pexpire(members, self.retention_ms)
                # Not pipe.smembers: redis-py's cluster MULTI passes it a ``keys`` argument its reply parser
                # refuses (redis 8.1); the command itself is the same.
                pipe.execute_command("SMEMBERS", members)
                processes = sorted(codec.text(p) for p in (await pipe.execute())[-1])
            others = [p for p in processes if p != process]
            async with self._client.pipeline(transaction=False) as pipe:
                for other in others:
                    pipe.hgetall(f"{members}:{other}")
                published = await pipe.execute()
            gone = [other for other, fields in zip(others, published, strict=True) if not fields]
            if gone:
                await self._client.srem(members, *gone)
        totals: dict[str, tuple[float, float]] = {}
        now_ms = self._clock() if self._clock is not None else None
        for fields in published:
            texts = {codec.text(name): codec.text(value) for name, value in fields.items()}
            written_ms = texts.pop(WRITTEN_AT, None)
            if now_ms is not None and written_ms is not None and now_ms - float(written_ms) > stale_after_ms:
                continue
            for upstream, value in texts.items():
                sequences, prefill_share = map(float, value.split())
                before = totals.get(upstream, (0.0, 0.0))
                totals[upstream] = (before[0] + sequences, before[1] + prefill_share)
        return totals

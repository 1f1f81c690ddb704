"""The Redis ledger's request path (``RequestPath``): each call one script, or one read."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fairgate.ledger import rules
from fairgate.ledger.base import new_reservation_id, tenant_tag
from fairgate.ledger.checks import check_account_args
from fairgate.ledger.config import Limits
from fairgate.ledger.model import (
    InvalidUsage,
    QuotaExceeded,
    Reservation,
    ReservationFinal,
    ReservationNotFound,
    RunClaim,
    SettlementFrozen,
    UnknownTenant,
    Usage,
)
from fairgate.ledger.redis import codec
from fairgate.ledger.redis.keys import ACCOUNTS, RES
from fairgate.ledger.redis.store import RedisStore


class RedisRequestPath(RedisStore):
    """reserve / claim / settle / cancel / enqueue / dequeue / get / account / heartbeat on Redis."""

    async def _reserve(
        self, args: rules.ReserveArgs, limits: Limits, claim_owner: str | None, claim_lease_ms: float
    ) -> Reservation:
        """``reserve.lua``: reads the request id's reservation, the accounts charged and the run; writes only if
        all fit (or returns the earlier reservation, unless it re-opens: ``rules.reopens``); then takes the run
        claim asked (``rules.claim_on_reserve``). Its reply carries the binding account (``Reservation.balances``)
        and the claim (``Reservation.claim``)."""
        tenant, tag = args.tenant, tenant_tag(args.tenant)
        keys, _ = self._limited_keys(tag)
        script_args = [
            *self._head(),
            tenant,
            args.request_id,
            new_reservation_id(tenant),
            str(args.input_tokens),
            str(args.max_output_tokens),
            codec.number(float(args.gpu_ms_estimate)),
            args.model_class,
            args.run_id or "",
            "0" if args.run_id is None else "1",
            "1" if args.tool_round else "0",
            codec.number(float(args.price.input_micros_per_token)),
            codec.number(float(args.price.output_micros_per_token)),
            codec.number(float(args.price.gpu_micros_per_ms)),
            claim_owner or "",
            codec.number(claim_lease_ms),
        ]
        async with self._unavailable():
            await self._ensure_registered(tenant)
            reply = await self._with_limits(tag, lambda: self._scripts.reserve(keys=keys, args=script_args))
        code = reply[0]
        if code == "quota":
            dimension, retry, remaining, key = reply[1], reply[2], float(reply[3]), reply[4]
            raise QuotaExceeded(
                tenant,
                dimension,
                None if retry == "" else float(retry),
                getattr(dict(self.books(tenant, args.model_class))[key], dimension),
                int(remaining) if dimension in codec.INT_LIMITS else remaining,
            )
        r = codec.reservation(reply[1], codec.account(reply[2]))
        if len(reply) > 3:
            r = replace(r, claim=RunClaim(str(reply[3]), float(reply[4]), float(reply[5])))
        return rules.check_retry(r, args) if code == "existing" else r

    async def _close(self, reservation_id: str, billed: Usage, final: bool, kind: str) -> Reservation:
        """``close.lua``; its reply codes mapped to the errors ``rules.settle`` raises, with their messages."""
        reply = await self._close_call(reservation_id, kind, final, billed)
        code = reply[0]
        if code == "not_found":
            raise ReservationNotFound(f"no reservation {reservation_id!r}")
        r = codec.reservation(reply[-1])
        if code == "final":
            return rules.check_final_again(r, billed, final, kind)
        if code == "frozen":
            raise SettlementFrozen(f"automatic settlement is frozen for tenant {r.tenant!r}")
        if code == "unknown_tenant":
            raise UnknownTenant(f"tenant {r.tenant!r} has no quota configuration")
        if code in ("above", "below"):
            rules.check_billing(r, billed, kind)  # the script found the amounts invalid: the rules say why
            raise InvalidUsage(f"{kind}: amounts {billed} do not fit reservation {reservation_id!r}")
        return r  # ok | unchanged

    async def _queue_step(self, reservation_id: str, enter: bool) -> Reservation:
        """``queue.lua``."""
        tag = self._tag_of(reservation_id)
        reply: list[Any] = ["not_found"]
        if tag is not None:
            keys, configured = self._limited_keys(tag)
            if enter and not configured:  # a tenant no longer configured: UnknownTenant, as the SQL backends raise
                r = await self.get(reservation_id)
                self.books(r.tenant, r.model_class)
            args = [*self._head(), reservation_id, "1" if enter else "0", configured]
            async with self._unavailable():
                reply = await self._with_limits(tag, lambda: self._scripts.queue(keys=keys, args=args))
        if reply[0] == "not_found":
            raise ReservationNotFound(f"no reservation {reservation_id!r}")
        r = codec.reservation(reply[1])
        if reply[0] == "quota":
            raise rules.queue_full(r, dict(self.books(r.tenant, r.model_class))[reply[2]])
        return r

    async def get(self, reservation_id: str) -> Reservation:
        tag = self._tag_of(reservation_id)
        raw = None
        if tag is not None:
            async with self._unavailable():
                raw = await self._client.hget(self._keys.tenant(tag)[RES], reservation_id)
        if raw is None:
            raise ReservationNotFound(f"no reservation {reservation_id!r}")
        return codec.reservation(raw)

    async def account(self, tenant: str, model_class: str = "default") -> rules.Account:
        check_account_args(tenant, model_class)
        async with self._unavailable():
            raw = await self._client.hget(
                self._keys.tenant(tenant_tag(tenant))[ACCOUNTS], self.account_key(tenant, model_class)
            )
        return codec.account(raw)

    async def _claim(self, reservation_id: str, owner: str, lease_ms: float) -> RunClaim:
        """``claim.lua``."""
        tag = self._tag_of(reservation_id)
        reply = ["not_found"]
        if tag is not None:
            async with self._unavailable():
                reply = await self._scripts.claim(
                    keys=self._keys.tenant(tag), args=[*self._head(), reservation_id, owner, codec.number(lease_ms)]
                )
        if reply[0] == "not_found":
            raise ReservationNotFound(f"no reservation {reservation_id!r}")
        if reply[0] == "final":
            raise ReservationFinal(f"reservation {reservation_id!r} is final already")
        return RunClaim(str(reply[1]), float(reply[2]), float(reply[3]))

    async def heartbeat(self, reservation_id: str) -> None:
        """``heartbeat.lua``."""
        tag = self._tag_of(reservation_id)
        reply = ["not_found"]
        if tag is not None:
            async with self._unavailable():
                reply = await self._scripts.heartbeat(keys=self._keys.tenant(tag), args=[*self._head(), reservation_id])
        if reply[0] == "not_found":
            raise ReservationNotFound(f"no reservation {reservation_id!r}")

"""The Redis ledger's key layout.

``P`` = prefix, ``T`` = ``tenant_tag(tenant)``, 16 hex digits. Every key of a tenant contains the hash tag
``{P:T}``, so all of them live in one cluster hash slot and one script can touch them all; a reservation
id starts with ``T``, so the slot is known from the id alone.

==========================  ======  =====================================================================
key                         type    content
==========================  ======  =====================================================================
``{P:T}:accounts``          hash    account key (``*``: tenant-wide, or a model class with its own
                                    limits) -> JSON of ``rules.Account`` (numbers as strings; an
                                    uninitialised bucket level is absent)
``{P:T}:runs``              hash    run id -> JSON ``{model_calls, tool_rounds, tokens}``
``{P:T}:res``               hash    reservation id -> JSON of the reservation (numbers as strings)
``{P:T}:reqs``              hash    request id -> reservation id (idempotency index)
``{P:T}:open``              zset    open reservation ids, scored by ``expires_at_ms`` rounded up to a
                                    whole ms (the sweeper, which checks each against its record)
``{P:T}:status``            hash    status -> number of reservations (``usage().by_status``)
``{P:T}:events``            zset    the event log: JSON ``[seq, kind, id, requests, input, output,
                                    gpu_ms, overage_gpu_ms, at_ms, spend_micros]`` scored by ``at_ms``
                                    (no ``spend_micros`` in members written before it: 0)
``{P:T}:seq``               string  the tenant's event sequence (INCR)
``{P:T}:hb``                hash    reservation id -> last heartbeat ms (open reservations only)
``{P:T}:claims``            hash    reservation id -> ``"OWNER\\nUNTIL_MS"``: its run claim (open reservations only)
``{P:T}:frozen``            hash    ``tenant``, ``reason``, ``at_ms`` while settlement is frozen
``{P:T}:minutes``           hash    minute (``usage_minutes.minute_of``) -> JSON ``[requests, input, output,
                                    gpu_ms, overage_gpu_ms, spend_micros]``, the sums of its events; ``hi``: the
                                    newest minute written (``usage()`` reads these, not every event)
``{P:T}:limits:V``          hash    the tenant's limits as the scripts read them (``codec.limits_hash``):
                                    ``*`` and each model class with limits of its own -> the limits
                                    packed as doubles; ``\\njson`` -> the same as text. ``V`` names the
                                    version (a hash of the limits): processes with different quotas use
                                    different hashes, side by side
``P:tenants``               hash    tenant tag -> tenant name: the registry ``events()``,
                                    ``reservations()``, ``expire_due()`` and ``frozen()`` iterate over
                                    (the one key outside a tenant's slot; written by its own script)
``{P:charges}:SCOPE``       hash    ``add_charges``: ``TENANT\\ngpu_ms`` / ``\\ninput`` / ``\\noutput`` -> totals
``{P:occupancy}``           set     ``share_occupancy``: the processes that published
``{P:occupancy}:PROCESS``   hash    upstream -> ``"SEQUENCES PREFILL_SHARE"``, expiring when not republished
==========================  ======  =====================================================================

TTL: every key carries a retention TTL (default 35 days). The tenant's twelve keys (``TENANT_KEYS``) have
theirs set afresh together by the first script that writes once ``{P:T}:accounts``' TTL has run down by a
minute (``prelude.lua``: a script reads one TTL rather than writing twelve), and a key a script creates after
the tenant's first reservation gets its TTL as it is created: after every write, each of the tenant's keys
holds at least the retention less a minute. So a tenant's state lives as a whole while it is written at
least once per retention period and then expires as a whole (an idle tenant's history, freeze and open
reservations included). A limits hash is a copy of the configuration: it gets the retention TTL when a
process writes it (on ``open``, and whenever a script finds it missing) and is not refreshed, so one no
process uses any more goes a retention period after it was written, and one in use is written again then.
The registry's TTL is refreshed whenever a process registers a tenant (at most every ``REGISTER_EVERY_S``
per tenant and process, on reserve and freeze). As with the SQL backends, an active tenant's event log and
reservation hash are never trimmed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The tenant keys, in the order of the scripts' KEYS (prelude.lua names them).
TENANT_KEYS = (
    "accounts",
    "runs",
    "res",
    "reqs",
    "open",
    "status",
    "events",
    "seq",
    "hb",
    "frozen",
    "claims",
    "minutes",
)
ACCOUNTS, RES, EVENTS, FROZEN = (TENANT_KEYS.index(name) for name in ("accounts", "res", "events", "frozen"))
_RESERVATION_ID = re.compile(r"^([0-9a-f]{16})-")


@dataclass(frozen=True)
class Keys:
    """The key names of one ledger (one prefix)."""

    prefix: str

    def tenant(self, tag: str) -> list[str]:
        """The tenant's keys (``TENANT_KEYS`` order), all in the hash slot of ``{prefix:tag}``."""
        return [f"{{{self.prefix}:{tag}}}:{name}" for name in TENANT_KEYS]

    def limits(self, tag: str, version: str) -> str:
        """The tenant's limits hash of ``version`` (``codec.limits_hash``), in the tenant's hash slot."""
        return f"{{{self.prefix}:{tag}}}:limits:{version}"

    @property
    def tenants(self) -> str:
        """The tenant registry."""
        return f"{self.prefix}:tenants"

    def charges(self, scope: str) -> str:
        """The shared fair-policy counters of ``scope``."""
        return f"{{{self.prefix}:charges}}:{scope}"

    @property
    def occupancy(self) -> str:
        """The set of processes publishing occupancy; ``occupancy:PROCESS`` is each one's hash."""
        return f"{{{self.prefix}:occupancy}}"

    @property
    def patterns(self) -> tuple[str, str]:
        """SCAN patterns that match every key of this ledger."""
        return f"{{{self.prefix}:*", f"{self.prefix}:*"


def tag_of(reservation_id: str) -> str | None:
    """The tenant tag a reservation id starts with (None: not an id this ledger makes)."""
    match = _RESERVATION_ID.match(reservation_id)
    return match.group(1) if match else None

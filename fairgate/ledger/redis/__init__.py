"""The ledger on Redis (redis-py asyncio): the rules of ``rules.py`` as Lua scripts, one EVALSHA per call.

Every mutating call (reserve, settle, cancel, expiry, extension, heartbeat, freeze) is a single Lua
script, so it reads and writes a tenant's balances atomically: concurrent callers in any number of
processes never both read the same balance. The scripts implement the arithmetic and the check order
of ``rules.reserve`` / ``rules.settle`` / ``rules.refreshed`` line by line (Lua numbers are IEEE doubles
like Python floats; every number the scripts write is stored as a ``%.17g`` string, and limits as doubles,
so they round-trip exactly; the token
buckets are ``fairgate.core.ratelimit``'s arithmetic in ``scripts/bucket.lua``). The clock is the server's
``TIME`` read inside the script, so gateway processes with different clocks agree; a ``clock`` passed to
``open`` (tests) is sent as an argument instead.

The scripts read a tenant's limits from a hash on the server (``keys.py``), named by a hash of the limits:
``open`` writes one per configured tenant, processes with different quotas each use their own, and a script
that finds its hash missing (a server restarted or flushed) answers so before writing anything; the client
then writes the hash and calls once more. ``reserve`` returns the binding account it wrote (the balances of
the rate-limit headers) in the same reply.

A server that does not answer raises ``LedgerUnavailable`` after about ``timeout_s`` (a connection the
server closed is retried once; a timeout is not). Every redis-py error (connection, timeout, protocol,
server error reply) surfaces as a one-line ``LedgerUnavailable``; a database number the server does not
have is a ``ValueError`` at ``open``.

Differences from the SQL backends: ``Event.seq`` is a per-tenant sequence (not ledger-wide), and
``events()`` over all tenants merges the tenants' logs by ``at_ms`` (each tenant's own order kept);
the expiry script closes a reservation only if it is still due and its tenant not frozen (a reservation
extended or frozen by someone else meanwhile is skipped rather than raising).

Modules: ``url`` (the URL and its parameters), ``keys`` (the key layout and TTLs), ``lua`` (loading
``scripts/*.lua``), ``codec`` (values as stored), ``errors`` (redis-py's errors, wrapped once), ``store``
(what the parts share), ``request_path`` / ``operator_api`` / ``coordination`` (the three interfaces),
``backend`` (``RedisLedger`` and ``open``).
"""

from __future__ import annotations

from fairgate.ledger.redis.backend import RedisLedger, open_ledger
from fairgate.ledger.redis.keys import TENANT_KEYS
from fairgate.ledger.redis.url import DEFAULT_PREFIX, DEFAULT_RETENTION_DAYS, check_url

__all__ = ["DEFAULT_PREFIX", "DEFAULT_RETENTION_DAYS", "TENANT_KEYS", "RedisLedger", "check_url", "open_ledger"]

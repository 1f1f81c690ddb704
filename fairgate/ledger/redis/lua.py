"""The Redis ledger's Lua scripts, read from the package's ``scripts/*.lua`` and registered on a client.

Each tenant script is ``bucket.lua`` + ``prelude.lua`` + its own file, so it runs as one chunk: every
mutating call is one EVALSHA, atomic on the tenant's keys. ``register.lua`` (the tenant registry) stands
alone. ``register`` makes redis-py script objects (EVALSHA, falling back to EVAL once if the server lost
the script); ``load`` sends them all with SCRIPT LOAD, which ``RedisLedger.open`` does so that a server
refusing scripts (read-only replica, no permission) fails at open, not on the first request.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cache
from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

_PACKAGE = "fairgate.ledger.redis"
_LIBRARY = ("bucket", "prelude")


@cache
def source(name: str) -> str:
    """The text of ``scripts/<name>.lua`` (package data)."""
    return resources.files(_PACKAGE).joinpath("scripts").joinpath(f"{name}.lua").read_text(encoding="utf-8")


@cache
def tenant_script(name: str) -> str:
    """A tenant script as the server runs it: the library files, then ``scripts/<name>.lua``."""
    return "\n".join(source(part) for part in (*_LIBRARY, name))


@dataclass(frozen=True)
class Scripts:
    """Every script, registered on one client (each a callable ``(keys=..., args=...)``)."""

    reserve: AsyncScript
    claim: AsyncScript
    close: AsyncScript
    extend: AsyncScript
    heartbeat: AsyncScript
    queue: AsyncScript
    freeze: AsyncScript
    usage: AsyncScript
    due: AsyncScript
    beat: AsyncScript
    register: AsyncScript

    @classmethod
    def register_on(cls, client: Redis) -> Scripts:
        """Register every script on ``client`` (no round trip: redis-py computes the SHA1s)."""
        texts = {f.name: source(f.name) if f.name == "register" else tenant_script(f.name) for f in fields(cls)}
        return cls(**{name: client.register_script(text) for name, text in texts.items()})

    async def load(self, client: Redis) -> None:
        """SCRIPT LOAD every script. Raises redis-py's errors (the caller wraps them)."""
        for f in fields(self):
            await client.script_load(getattr(self, f.name).script)

"""The Redis ledger's Lua scripts, read from the package's ``scripts/*.lua`` and registered on a client.

Each tenant script is ``globals.lua`` + ``bucket.lua`` + ``prelude.lua`` + its own file, so it runs as one
chunk: every mutating call is one call on the server, atomic on the tenant's keys. ``register.lua`` (the tenant
registry) does not need the library files (it also runs alone, so it reads the globals as such).

Two ways to run them, the same code either way. On a server with functions (Redis >= 7) ``load`` puts them in
one function library (``library``: the library files once, each script a function of it) and every call is an
FCALL: the library's helpers are defined once when it is loaded, not again by every call as an EVAL script's
are (measured on this machine: 2.4 us per FCALL against 9.9 us per EVALSHA that only defines them). The
library and its functions are named by a hash of its text, so processes running other versions of the scripts
use their own, side by side. A server without functions (or refusing FUNCTION LOAD) gets the scripts as EVAL
scripts (EVALSHA, falling back to EVAL once if the server lost the script). A server that lost the library
(restarted without persistence, flushed) gets it again on the first call that misses it.

``load`` also sends every EVAL script with SCRIPT LOAD, which ``RedisLedger.open`` does so that a server
refusing scripts (read-only replica, no permission) fails at open, not on the first request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from functools import cache
from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import ResponseError
from redis.typing import EncodableT

_PACKAGE = "fairgate.ledger.redis"
_LIBRARY = ("globals", "bucket", "prelude")
# On Redis < 5 a script must ask for effects replication before it writes after TIME (functions always do).
# The script's KEYS and ARGV are taken before prelude.lua's names of the library's shadow them.
_EVAL_TOP = "local EVAL_KEYS, EVAL_ARGV = KEYS, ARGV\n"
_EVAL_HEAD = "bind(EVAL_KEYS, EVAL_ARGV)\nif redis.replicate_commands then redis.replicate_commands() end\n"
_MISSING_FUNCTION = "Function not found"
# FUNCTION LOAD refused for want of functions or of permission: the EVAL scripts run instead. Any other error
# (the library's own, an OOM server) is raised.
_NO_FUNCTIONS = ("unknown command", "unknown subcommand", "NOPERM", "READONLY")


@cache
def source(name: str) -> str:
    """The text of ``scripts/<name>.lua`` (package data)."""
    return resources.files(_PACKAGE).joinpath("scripts").joinpath(f"{name}.lua").read_text(encoding="utf-8")


@cache
def tenant_script(name: str) -> str:
    """A tenant script as an EVAL script: the library files, then ``scripts/<name>.lua``."""
    return _EVAL_TOP + "\n".join(source(part) for part in _LIBRARY) + "\n" + _EVAL_HEAD + source(name)


@cache
def library(names: tuple[str, ...]) -> tuple[str, str]:
    """(the function library of the scripts ``names``: its text, its name). Function ``NAME_<script>`` runs
    ``scripts/<script>.lua`` as the EVAL script does (``bind`` first)."""
    bodies = "\n".join(f"local function run_{name}()\n{source(name)}\nend" for name in names)
    code = "\n".join([*(source(part) for part in _LIBRARY), bodies])
    lib = "fairgate_" + hashlib.sha1(code.encode()).hexdigest()[:16]
    registered = "\n".join(
        f"register_function('{lib}_{name}', function(keys, args) bind(keys, args) return run_{name}() end)"
        for name in names
    )
    return f"#!lua name={lib}\n{code}\n{registered}\n", lib


@dataclass
class Library:
    """The function library on one client: its name once loaded (None: the EVAL scripts run)."""

    client: Redis = field(repr=False)
    name: str | None = None

    async def load(self, names: tuple[str, ...]) -> None:
        """FUNCTION LOAD the library of the scripts ``names`` (REPLACE: every process of this version loads the
        same text); a server that refuses it (no functions: Redis < 7, or no permission) runs the EVAL
        scripts."""
        code, name = library(names)
        try:
            reply = await self.client.function_load(code, replace=True)
        except ResponseError as exc:
            if not any(sign in str(exc) for sign in _NO_FUNCTIONS):
                raise
            reply = None
        self.name = name if _names_library(reply, name) else None


@dataclass
class Script:
    """One script, callable as ``(keys=..., args=...)``: an FCALL when the server has the library, else an
    EVALSHA."""

    name: str
    evalsha: AsyncScript
    library: Library = field(repr=False)

    async def __call__(self, keys: Sequence[str], args: Sequence[EncodableT]) -> Any:
        library = self.library
        if library.name is None:
            return await self.evalsha(keys=keys, args=args)
        try:
            return await library.client.fcall(f"{library.name}_{self.name}", len(keys), *keys, *args)
        except ResponseError as exc:
            if _MISSING_FUNCTION not in str(exc):
                raise
        await library.load(Scripts.names())  # the server lost it (restarted, flushed): once more, then as it goes
        if library.name is None:
            return await self.evalsha(keys=keys, args=args)
        return await library.client.fcall(f"{library.name}_{self.name}", len(keys), *keys, *args)


@dataclass
class Scripts:
    """Every script, registered on one client (each a callable ``(keys=..., args=...)``), and their library."""

    library: Library
    reserve: Script
    claim: Script
    close: Script
    extend: Script
    heartbeat: Script
    queue: Script
    freeze: Script
    usage: Script
    due: Script
    beat: Script
    register: Script

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.type == "Script")

    @classmethod
    def register_on(cls, client: Redis) -> Scripts:
        """Register every script on ``client`` (no round trip: redis-py computes the SHA1s)."""
        shared = Library(client)
        texts = {name: source(name) if name == "register" else tenant_script(name) for name in cls.names()}
        return cls(shared, **{name: Script(name, client.register_script(text), shared) for name, text in texts.items()})

    @property
    def library_name(self) -> str | None:
        """The function library's name on the server (None: the EVAL scripts run)."""
        return self.library.name

    async def load(self, client: Redis) -> None:
        """SCRIPT LOAD every script, then FUNCTION LOAD the library. Raises redis-py's errors (the caller
        wraps them)."""
        for name in self.names():
            await client.script_load(getattr(self, name).evalsha.script)
        await self.library.load(self.names())

    def run_as_eval(self) -> None:
        """Run the EVAL scripts from now on, as on a server without functions (tests)."""
        self.library.name = None


def _names_library(reply: object, name: str) -> bool:
    """Whether FUNCTION LOAD's reply is the library's name, as a server with functions answers (a cluster
    client: each primary's reply); anything else (no reply, a server that answers OK to every command) runs
    the EVAL scripts."""
    replies = list(reply.values()) if isinstance(reply, dict) else reply if isinstance(reply, list) else [reply]
    texts = [r.decode() if isinstance(r, bytes) else r for r in replies]
    return bool(texts) and all(text == name for text in texts)

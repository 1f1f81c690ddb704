"""The loopback stack: N emulated replicas behind 1..N gateways, on threads of this process or as
``fairgate emulate`` / ``fairgate serve`` processes, with an SQLite ledger in a temporary folder or a fresh
schema / key prefix on a PostgreSQL or Redis server.

``StackSpec`` says what differs from a plain stack; ``start_stack(spec)`` starts it and yields a ``Stack``
(URLs, keys, processes, taps, configurations, the ledger), and stops everything when the block ends.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping
from contextlib import ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fairgate.core.policies.params import PolicyConfig
from fairgate.gateway.config import GatewayConfig, GatewaySection, UpstreamConfig
from fairgate.harness.config import ADMIN_KEY, UNBOUNDED, TenantSpec, gateway_file, quota_file, tenant_key
from fairgate.harness.ledger import LedgerReport, drop_ledger, fresh_ledger_url, ledger_totals
from fairgate.harness.pacer import pace_replicas
from fairgate.harness.process import ServerProcess, environment, fairgate_server, free_port, running
from fairgate.harness.replica import ReplicaModel, ReplicaStats, read_replicas
from fairgate.harness.tap import EmulatorTap
from fairgate.harness.threads import serve_in_thread
from fairgate.ledger.config import LimitsConfig, TierConfig

if TYPE_CHECKING:
    from fairgate.ledger import Ledger, Reservation

T = TypeVar("T")
KEEP_ENV = "FAIRGATE_DRILL_KEEP"  # "1": keep every stack's folder (configs, logs, SQLite ledger)


@dataclass(frozen=True)
class ReplicaSpec:
    """One emulated replica: the model the gateways serve it as, and how many of its slots each gateway
    uses (None: all of them; gateways that share a replica split its slots between them)."""

    model: str = "emu"
    gateway_slots: int | None = None


def replicas(count: int, model: str = "emu", gateway_slots: int | None = None) -> tuple[ReplicaSpec, ...]:
    """``count`` alike replicas."""
    return tuple(ReplicaSpec(model, gateway_slots) for _ in range(count))


@dataclass(frozen=True)
class StackSpec:
    """What to start; every field but ``tenants`` has the plain stack's value."""

    tenants: tuple[TenantSpec, ...]  # one API key each (``fairgate.harness.config.tenant_key``)
    policy: str = "gpu_fair"
    replicas: tuple[ReplicaSpec, ...] = replicas(2)
    replica: ReplicaModel = field(default_factory=ReplicaModel)  # the replicas' common cost model
    # run the replicas and the gateways as ``fairgate`` processes (as deployed) instead of on threads of
    # this process; gateway_process: the gateways' own choice (None: as ``processes``)
    processes: bool = False
    gateway_process: bool | None = None
    policy_params: PolicyConfig | None = None  # the gateways' ``[policy]`` parameters
    gateways: int = 1
    # gateway i -> the indexes of the replicas it sends to (None: every gateway to every replica)
    gateway_replicas: tuple[tuple[int, ...], ...] | None = None
    # a PostgreSQL / Redis server URL (the stack uses a fresh schema / prefix of it, dropped when it stops);
    # None: an SQLite file in the stack's folder
    ledger: str | None = None
    # the quota document's tiers (default: one, ``drill``, rejecting while the ledger is down) and default
    # limits (default: no bound on concurrency or queueing)
    tiers: Mapping[str, TierConfig] | None = None
    defaults: LimitsConfig = UNBOUNDED
    # default_max_tokens / request_timeout_s / share_charges_s / sweep_s: the gateways' ``[gateway]``
    default_max_tokens: int = 256
    request_timeout_s: float = 3600.0
    share_charges_s: float = 0.25
    sweep_s: float = 10.0
    # spread the replicas' iteration boundaries (``fairgate.harness.pacer``; each emulator gets one slot
    # more than the gateways use, for its pacer)
    staggered: bool = False
    tapped: bool = False  # wrap each in-process replica in an ``EmulatorTap``
    admin: bool = False  # give the gateways the admin key ``ADMIN_KEY``
    delegates: tuple[str, ...] = ()  # the gateways' ``[delegation]``, with ``secret_env``
    secret_env: str | None = None
    # variables set in this process while the stack runs (gateway processes inherit them)
    environment: Mapping[str, str] = field(default_factory=dict)
    # running engines (base URLs, one per ``replicas`` entry) to use instead of starting emulators: the
    # gateways' upstreams are these, with ``replica``'s cost model and ``upstream_kind``
    engine_urls: tuple[str, ...] = ()
    upstream_kind: str | None = None

    def __post_init__(self) -> None:
        names = [t.name for t in self.tenants]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a stack needs distinct tenant names, got {names}")
        if not self.replicas or self.gateways < 1:
            raise ValueError("a stack needs at least one replica and one gateway")
        if self.gateway_replicas is not None and len(self.gateway_replicas) != self.gateways:
            raise ValueError("gateway_replicas must name the replicas of every gateway")
        if self.engine_urls and len(self.engine_urls) != len(self.replicas):
            raise ValueError("engine_urls must give one URL per replica")

    @property
    def model(self) -> str:
        """The model clients ask for (the first replica's)."""
        return self.replicas[0].model

    @property
    def gateway_processes(self) -> bool:
        return self.processes if self.gateway_process is None else self.gateway_process

    @property
    def tenant_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tenants)

    def replicas_of(self, gateway: int) -> tuple[int, ...]:
        every = tuple(range(len(self.replicas)))
        return every if self.gateway_replicas is None else self.gateway_replicas[gateway]


@dataclass(frozen=True)
class Replica:
    """A running replica: its base URL, and its process (None: on a thread) or tap (None: untapped)."""

    url: str
    process: ServerProcess | None
    tap: EmulatorTap | None


@dataclass(frozen=True)
class Gateway:
    """A running gateway: its base URL, configuration, and its process (None: on a thread) or ASGI app."""

    url: str
    config: GatewayConfig
    process: ServerProcess | None
    app: Any | None


@dataclass
class Stack:
    """A running stack. ``keep_folder``: keep its folder (configs, logs) after it stops."""

    spec: StackSpec
    folder: Path
    keys: dict[str, str]
    ledger_url: str
    replicas: list[Replica]
    gateways: list[Gateway]
    keep_folder: bool = False

    @property
    def url(self) -> str:
        """The first gateway's base URL (clients use url + "/v1")."""
        return self.gateways[0].url

    @property
    def config(self) -> GatewayConfig:
        return self.gateways[0].config

    @property
    def admin_key(self) -> str | None:
        return ADMIN_KEY if self.spec.admin else None

    @property
    def replica_urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    async def open_ledger(self) -> Ledger:
        """A connection of the caller's own to the stack's ledger (the caller closes it). A shared server's
        schema / prefix is the stack's own (an empty Redis prefix has no key to find: it may be created);
        the SQLite file is the gateways' (never created elsewhere by mistake)."""
        from fairgate.ledger import connect

        return await connect(self.ledger_url, self.config.quotas, create=self.spec.ledger is not None)

    @asynccontextmanager
    async def ledger(self) -> AsyncIterator[Ledger]:
        """``open_ledger()``, closed when the block ends."""
        ledger = await self.open_ledger()
        try:
            yield ledger
        finally:
            await ledger.close()

    async def totals(self) -> LedgerReport:
        """Every tenant's ledger totals now."""
        async with self.ledger() as ledger:
            return await ledger_totals(ledger, self.spec.tenant_names)

    async def reservations(self) -> list[Reservation]:
        """Every reservation in the ledger now."""
        async with self.ledger() as ledger:
            return await ledger.reservations()

    async def replica_stats(self) -> list[ReplicaStats]:
        return await read_replicas(self.replica_urls)

    @property
    def is_tapped(self) -> bool:
        return any(r.tap is not None for r in self.replicas)

    @property
    def untagged(self) -> int:
        """Sequences the taps saw without a request's tag."""
        return sum(r.tap.untagged for r in self.replicas if r.tap is not None)

    def tapped(self, what: str = "sequences") -> dict[str, list[Any]]:
        """Over every tap: tag -> the ``sequences`` (or ``bodies``) it saw under that tag."""
        out: dict[str, list[Any]] = {}
        for replica in self.replicas:
            if replica.tap is not None:
                for tag, seen in getattr(replica.tap, what).items():
                    out.setdefault(tag, []).extend(seen)
        return out


@contextmanager
def start_stack(spec: StackSpec, keep_folder: bool = False, folder: Path | None = None) -> Iterator[Stack]:
    """Start ``spec``'s replicas and gateways; stop them when the block ends, and delete their folder
    (configs, logs, SQLite ledger) unless ``keep_folder``, the stack's own ``keep_folder`` or
    ``$FAIRGATE_DRILL_KEEP`` is set. ``folder``: put the files there (the caller's; never deleted).

    Raises:
        RuntimeError: a server did not start. GatewayConfigError: a bad spec (e.g. an unknown policy).
    """
    keep_folder = keep_folder or folder is not None
    folder = folder or Path(tempfile.mkdtemp(prefix="fairgate-stack-"))
    folder.mkdir(parents=True, exist_ok=True)
    keys = {t: tenant_key(t) for t in spec.tenant_names}
    ledger_url = (
        fresh_ledger_url(spec.ledger, f"fgh_{uuid.uuid4().hex[:10]}")
        if spec.ledger is not None
        else f"sqlite:///{folder}/ledger.db"
    )
    stack = Stack(spec, folder, keys, ledger_url, [], [], keep_folder)
    try:
        with environment(dict(spec.environment)), ExitStack() as servers:
            stack.replicas = _start_replicas(spec, folder, servers)
            if spec.staggered:
                servers.enter_context(pace_replicas(spec.replica, spec.model, stack.replica_urls))
            configs = [_write_config(spec, stack, i) for i in range(spec.gateways)]
            if spec.ledger is not None:  # a shared server: create the schema once, before several gateways race to
                _run_sync(_touch(ledger_url, configs[0]))
                servers.callback(lambda: _run_sync(_drop(ledger_url, configs[0])))
            stack.gateways = _start_gateways(spec, configs, servers)
            yield stack
    finally:
        if not (stack.keep_folder or os.environ.get(KEEP_ENV) == "1"):
            shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def temporary_folder(prefix: str = "fairgate-") -> Iterator[Path]:
    """A new folder under the system temp dir for a run's files, deleted when the block ends (kept with
    ``$FAIRGATE_DRILL_KEEP=1``)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield folder
    finally:
        if os.environ.get(KEEP_ENV) != "1":
            shutil.rmtree(folder, ignore_errors=True)


def _start_replicas(spec: StackSpec, folder: Path, servers: ExitStack) -> list[Replica]:
    if spec.engine_urls:  # engines someone else runs
        return [Replica(url, None, None) for url in spec.engine_urls]
    extra = int(spec.staggered)
    if spec.processes:
        processes = []
        for i, r in enumerate(spec.replicas):
            port = free_port()
            args = spec.replica.emulate_args(port, r.model, extra)
            processes.append(fairgate_server(args, port, folder / f"replica-{i}.log"))
        servers.enter_context(running(processes))
        return [Replica(p.url, p, None) for p in processes]
    from fairgate.emulator.api import create_app

    out = []
    for r in spec.replicas:
        app = create_app(spec.replica.settings(r.model, extra))
        tap = EmulatorTap(app) if spec.tapped else None
        url = servers.enter_context(serve_in_thread(tap or app))
        if tap is not None:
            tap.attach()
        out.append(Replica(url, None, tap))
    return out


def _write_config(spec: StackSpec, stack: Stack, index: int) -> GatewayConfig:
    """Gateway ``index``'s configuration, in a folder of its own (its journal and request log)."""
    folder = stack.folder / f"gateway-{index}"
    folder.mkdir()
    replica_specs = spec.replicas
    upstreams = [
        _kind(
            spec.replica.upstream(
                f"emu-{i}", stack.replicas[i].url, replica_specs[i].model, replica_specs[i].gateway_slots
            ),
            spec.upstream_kind,
        )
        for i in spec.replicas_of(index)
    ]
    section = GatewaySection(
        policy=spec.policy,
        ledger=stack.ledger_url,
        default_max_tokens=spec.default_max_tokens,
        request_timeout_s=spec.request_timeout_s,
        share_charges_s=spec.share_charges_s,
        sweep_s=spec.sweep_s,
    )
    quotas = quota_file(spec.tenants, spec.tiers, spec.defaults)
    draft = gateway_file(
        section, upstreams, quotas, stack.keys, stack.admin_key, spec.delegates, spec.secret_env, spec.policy_params
    )
    return draft.write(folder / "fairgate.toml")


def _kind(upstream: UpstreamConfig, kind: str | None) -> UpstreamConfig:
    """``upstream`` as a real engine of ``kind`` (None: the emulator): its tokenizer endpoint asked, as an
    operator's ``[[upstream]]`` would by default."""
    if kind is None:
        return upstream
    return UpstreamConfig.model_validate({**upstream.model_dump(), "kind": kind, "tokenize": True})


def _start_gateways(spec: StackSpec, configs: list[GatewayConfig], servers: ExitStack) -> list[Gateway]:
    if spec.gateway_processes:
        processes = []
        for config in configs:
            port = free_port()
            args = ["serve", "--config", str(config.path), "--port", str(port)]
            processes.append(fairgate_server(args, port, config.path.parent / "gateway.log"))
        servers.enter_context(running(processes))
        return [Gateway(p.url, c, p, None) for p, c in zip(processes, configs, strict=True)]
    from fairgate.gateway.app import create_gateway

    out = []
    for config in configs:
        app = create_gateway(config)
        out.append(Gateway(servers.enter_context(serve_in_thread(app)), config, None, app))
    return out


def _run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` to its end on a new event loop in a thread of its own (callable whether or not this
    thread runs a loop)."""
    result: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(coroutine))
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, name="harness-sync")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


async def _touch(url: str, config: GatewayConfig) -> None:
    from fairgate.ledger import connect

    ledger = await connect(url, config.quotas)
    await ledger.close()


async def _drop(url: str, config: GatewayConfig) -> None:
    from fairgate.ledger import connect

    try:
        ledger = await connect(url, config.quotas, create=False)
    except Exception:
        return  # the server is gone: nothing to drop
    try:
        await drop_ledger(ledger)
    finally:
        await ledger.close()


__all__ = ["Gateway", "Replica", "ReplicaSpec", "Stack", "StackSpec", "replicas", "start_stack", "temporary_folder"]

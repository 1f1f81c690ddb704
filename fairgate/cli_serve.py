"""``fairgate serve``: the gateway, or without a config the demo (an emulated replica, an SQLite ledger,
four tenants with seed 002's output mix sending traffic, their keys printed)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from rich.console import Console
from rich.table import Table

from fairgate.cli_common import check_port
from fairgate.cli_common import fail as _fail
from fairgate.cli_common import note as _note
from fairgate.cli_common import say as _say
from fairgate.gateway.config import ACCESS_LOG_STDERR, GatewayConfig
from fairgate.ledger import LedgerError

if TYPE_CHECKING:
    from fairgate.gateway.demo import PhaseShares

DEMO_GRACE_S = 2  # the demo's servers wait this long for streams still open when they stop
SETTLED_WAIT_S = 3.0  # at the end of the demo, how long cancelled requests get to settle what they generated


class DemoServer(uvicorn.Server):
    """A uvicorn server that leaves SIGINT/SIGTERM to ``_run`` (two servers share its loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class Plan:
    """What ``serve`` runs: the servers, the gateway's config, the demo's keys (empty: not the demo)."""

    config: GatewayConfig
    host: str
    port: int
    servers: list[uvicorn.Server] = field(default_factory=list)
    keys: dict[str, str] = field(default_factory=dict)
    meter: PhaseShares | None = None

    @property
    def gateway(self) -> uvicorn.Server:
        return self.servers[-1]


def serve(config: Path | None, host: str, port: int, demo_traffic: bool, duration: float | None) -> None:
    """Run the gateway of ``config`` (None: the demo) on ``host:port`` until stopped or ``duration`` s.
    Raises ``typer.Exit(2)`` with one line for a port in use or a config or ledger that cannot be used."""
    check_port(host, port)
    servers: list[uvicorn.Server] = []
    keys: dict[str, str] = {}
    if config is None:
        config, keys, emulator = _demo(host, port)
        servers.append(emulator)
    plan = Plan(_load(config), host, port, servers, keys)
    plan.servers.append(_gateway_server(plan))
    _say(f"gateway on http://{host}:{port}/v1 (policy {plan.config.gateway.policy}, ledger {plan.config.ledger_url})")
    for line in startup_lines(plan.config):
        (_note if line.startswith("warning:") else _say)(line)
    traffic = bool(keys) and demo_traffic
    if traffic:
        _say(
            "demo traffic: 4 tenants (classify 24, chat 53, summarise 197, agent 354 output tokens on average), "
            "each keeping as many requests in flight; in the overload phases GPU time should split 25 % each"
        )
    with asyncio.Runner(loop_factory=fast_loop_factory()) as runner:
        runner.run(_run(plan, traffic, duration))


def _demo(host: str, port: int) -> tuple[Path, dict[str, str], uvicorn.Server]:
    """The demo's emulated replica (a server, not started), its config file and keys; prints how to use it."""
    from fairgate.emulator.api import EmulatorSettings, create_app
    from fairgate.gateway.demo import DEMO_MODEL, demo_folder, write_demo_config

    folder = demo_folder()
    upstream_port = free_port(host)
    app = create_app(EmulatorSettings(model=DEMO_MODEL))
    emulator = DemoServer(
        uvicorn.Config(app, host=host, port=upstream_port, log_level="warning", timeout_graceful_shutdown=DEMO_GRACE_S)
    )
    config, keys = write_demo_config(folder, f"http://{host}:{upstream_port}")
    _say(f"demo: emulated replica on http://{host}:{upstream_port}/v1; ledger, config and access log in {folder}")
    for tenant, key in keys.items():
        _say(f"  {'admin' if tenant == 'admin' else 'tenant ' + tenant:16s} key {key}")
    _say(f"dashboard: http://{host}:{port}/dashboard (log in with a key)   metrics: http://{host}:{port}/metrics")
    _say(
        f"try: curl -s http://{host}:{port}/v1/chat/completions -H 'Authorization: Bearer {keys['chat']}' "
        f'-H \'Content-Type: application/json\' -d \'{{"model": "{DEMO_MODEL}", "messages": '
        f'[{{"role": "user", "content": "hello"}}], "max_tokens": 16}}\''
    )
    return config, keys, emulator


def _load(path: Path) -> GatewayConfig:
    from fairgate.gateway.config import GatewayConfigError, load_gateway_config

    try:
        loaded = load_gateway_config(path)
        loaded.upstream_keys()  # read as the gateway will: a missing or empty key stops it here, exit 2
        loaded.delegation_secret()  # too short a secret stops it here, not each delegated request with a 500
    except GatewayConfigError as exc:
        raise _fail(str(exc)) from None
    problem = startup_problem(loaded, path)
    if problem is not None:
        raise _fail(problem)
    return loaded


def _gateway_server(plan: Plan) -> uvicorn.Server:
    from fairgate.gateway.app import create_gateway
    from fairgate.gateway.serving import uvicorn_config

    app = create_gateway(plan.config)
    section = plan.config.gateway
    if plan.keys:  # the demo: Ctrl-C stops the traffic, prints the shares and closes the streams at once
        config = uvicorn_config(
            app, section, plan.host, plan.port, log_level="warning", timeout_graceful_shutdown=DEMO_GRACE_S
        )
        return DemoServer(config)
    # uvicorn's own signal handling: a graceful shutdown waits for the streams in flight
    return uvicorn.Server(uvicorn_config(app, section, plan.host, plan.port, log_level="warning"))


async def _run(plan: Plan, traffic: bool, duration: float | None) -> None:
    """Serve until the servers stop, or (the demo, or a ``duration``) until Ctrl-C or the time is up; then
    print the billed shares and stop the servers."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    stop = asyncio.Event()
    if plan.keys:
        _stop_on_signals(loop, stop, plan.servers)
    serving = asyncio.gather(*(server.serve() for server in plan.servers))
    driver = await _start_traffic(plan, serving) if traffic else None
    if duration is not None or plan.keys:
        timeout = None if duration is None else max(0.0, duration - (loop.time() - started))
        ends: list[asyncio.Future[Any]] = [asyncio.ensure_future(stop.wait()), serving]
        await asyncio.wait(ends, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not serving.done():
            if driver is not None:
                driver.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await driver
            if plan.meter is not None:
                await plan.meter.mark(None)
                print_phase_shares(plan.meter)
            try:
                await print_shares(plan.config)
            except LedgerError as exc:  # an outage at the end: nothing to print, the gateway still stops cleanly
                _note(f"no billed shares to print: {exc}")
            for server in plan.servers:
                server.should_exit = True
    await serving


def _stop_on_signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event, servers: list[uvicorn.Server]) -> None:
    def on_signal() -> None:
        if stop.is_set():  # a second Ctrl-C: do not wait for anything
            for server in servers:
                server.force_exit = True
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)


async def _start_traffic(plan: Plan, serving: asyncio.Future[Any]) -> asyncio.Task[Any]:
    from fairgate.gateway.demo import PhaseShares, demo_traffic

    while not plan.gateway.started and not serving.done():  # noqa: ASYNC110 - uvicorn has a flag, no event
        await asyncio.sleep(0.05)
    tenants = {t: k for t, k in plan.keys.items() if t != "admin"}
    url = f"http://{plan.host}:{plan.port}"
    plan.meter = PhaseShares(url, plan.keys["admin"], tuple(tenants))
    return asyncio.ensure_future(demo_traffic(url, tenants, announce=_say, meter=plan.meter))


def startup_lines(config: GatewayConfig) -> list[str]:
    """What an operator should see at start besides the address: where traces go when tracing is on (the
    collector's URL without credentials, query or headers), and a warning when processes share a ledger but
    no delegation secret, so each signs dashboard links with a secret of its own."""
    from urllib.parse import urlsplit, urlunsplit

    lines = []
    collector = config.telemetry.otlp_traces_url
    if collector is not None:
        parts = urlsplit(collector)
        netloc = parts.hostname or ""
        netloc = f"[{netloc}]" if ":" in netloc else netloc
        netloc += f":{parts.port}" if parts.port is not None else ""
        shown = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
        lines.append(f"tracing: OTLP/HTTP traces to {shown} (service.name {config.telemetry.service_name!r})")
    shared = not config.ledger_url.startswith("sqlite")
    if shared and config.delegation_secret() is None:
        lines.append(
            f"warning: ${config.delegation.secret_env} is not set: this process signs dashboard sign-in links "
            "with a random secret of its own, so a link made here fails (401) on the other processes sharing "
            "this ledger and after a restart; give every process the same secret"
        )
    return lines


def startup_problem(config: GatewayConfig, path: Path) -> str | None:
    """What would stop the gateway starting, as one line naming the key: a journal, event log or access log that
    cannot be written, a ledger that cannot be opened (checked by opening it, as the gateway will; a ledger
    server that does not answer is an outage, not a configuration problem: the gateway starts), no key at all."""
    from fairgate.ledger import LedgerError, LedgerUnavailable, connect

    access_log = config.gateway.access_log
    access_path = Path(access_log) if access_log not in ("", ACCESS_LOG_STDERR) else None
    for key, file in (
        ("journal", config.journal_path),
        ("event_log", config.event_log_path),
        ("access_log", access_path),
    ):
        if file is None:
            continue
        if file.exists() and not (file.is_file() or file.is_char_device()):
            return f"{path}: gateway.{key}: {file} is not a regular file"  # a FIFO would block the start for good
        try:
            file.parent.mkdir(parents=True, exist_ok=True)  # its writer makes the folder too: a state/ folder
            with open(file, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            return f"{path}: gateway.{key}: cannot write {file} ({exc.strerror or exc})"

    async def open_ledger() -> None:
        ledger = await connect(config.ledger_url, config.quotas)
        await ledger.close()

    try:
        asyncio.run(open_ledger())
    except LedgerUnavailable as exc:
        if config.ledger_url.startswith("sqlite"):  # a local file that cannot be opened: the config's fault
            return f"{path}: gateway.ledger: cannot open the ledger ({exc})"
        # A server that does not answer: start anyway, serving each tier's outage policy until it does.
        _note(f"warning: the ledger does not answer ({exc}); serving each tier's outage policy until it does")
    except (LedgerError, ValueError, OSError) as exc:
        return f"{path}: gateway.ledger: cannot open the ledger ({exc})"
    if not config.keys and not config.admin.key_hashes:
        return (
            f"{path}: key: no [[key]] and no admin key, so nobody could call this gateway; make one with "
            f"`fairgate keys add TENANT --config {path}` (it prints the key)"
        )
    return None


def fast_loop_factory() -> Any:
    """uvloop's event loop where it is installed (as uvicorn picks it by itself), else asyncio's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds (not on Windows)
        return None
    return uvloop.new_event_loop


async def print_shares(config: GatewayConfig) -> None:
    """Each tenant's share of the GPU time billed in the ledger so far (the demo's closing figures)."""
    from fairgate.ledger import connect

    async with await connect(config.ledger_url, config.quotas, create=False) as ledger:
        for _ in range(int(SETTLED_WAIT_S / 0.05)):  # cancelled demo requests settle what they generated
            if not await ledger.reservations(status="open"):
                break
            await asyncio.sleep(0.05)
        billed = {tenant: (await ledger.usage(tenant, 86_400.0)) for tenant in config.quotas.tenants}
    total_ms = sum(u.gpu_ms for u in billed.values()) or 1.0
    table = Table(title="GPU time billed per tenant")
    for column in ("tenant", "requests", "output tokens", "GPU s", "share"):
        table.add_column(column, justify="left" if column == "tenant" else "right")
    for tenant, usage in billed.items():
        table.add_row(
            tenant,
            str(usage.requests),
            str(usage.output_tokens),
            f"{usage.gpu_ms / 1000:.1f}",
            f"{100 * usage.gpu_ms / total_ms:.1f} %",
        )
    Console().print(table)


def print_phase_shares(meter: PhaseShares) -> None:
    """Each demo phase's GPU share per tenant (the live meter's), so the even split of the overload phases is
    seen apart from the within-capacity ones, where each tenant gets what it asks."""
    from fairgate.gateway.demo import DEMO_TENANTS

    phases = meter.phases()
    seen = {tenant for _, _, spent in phases for tenant in spent}
    tenants = [t for t in DEMO_TENANTS if t in seen] + sorted(seen - set(DEMO_TENANTS))
    if not phases or not tenants:
        return
    table = Table(title="GPU share per demo phase (live meter)")
    for column in ("phase", "s", *tenants):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for label, seconds, spent in phases:
        total = sum(spent.values())
        shares = [f"{100 * spent.get(t, 0.0) / total:.1f} %" if total > 0 else "-" for t in tenants]
        table.add_row(label, f"{seconds:.0f}", *shares)
    Console().print(table)


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])

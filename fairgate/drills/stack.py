"""A throwaway stack for drills: K emulated replicas behind a gateway, with a config and an SQLite ledger in
a temporary folder, in this process (each server on its own thread and event loop) or as ``fairgate
emulate`` / ``fairgate serve`` processes, as deployed. After a run, ``read_ledger`` gives each tenant's
billed totals and GPU share, from the ledger the gateway wrote.

The pieces are those of ``bench/live_fairness.py`` and ``tests/support/servers.py``, made reusable here
(the package cannot import from ``tests/`` or ``bench/``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fairgate.gateway.auth import hash_api_key

if TYPE_CHECKING:
    from fairgate.ledger import Reservation

STARTUP_S_MAX = 30.0  # a server that does not answer /health by then failed to start


@dataclass(frozen=True)
class ReplicaModel:
    """The emulated replicas' cost model (``shared/DESIGN.md``: dt = base + slope * B + prefill * tokens)."""

    iter_base_ms: float = 100.0
    iter_slope_ms: float = 0.5
    prefill_ms_per_token: float = 0.02
    max_batch: int = 12
    max_model_len: int = 16_384

    def iteration_ms(self, batch: int, prefill_tokens: int = 0) -> float:
        return self.iter_base_ms + self.iter_slope_ms * batch + self.prefill_ms_per_token * prefill_tokens


@dataclass(frozen=True)
class TenantSpec:
    """A tenant of the drill's quota file: share weight and the gateway's per-tenant bounds.

    ``max_concurrent`` and ``max_queued`` are high by default so that scheduling, not a quota, decides
    what a tenant gets; a drill about quotas sets them. ``limits`` adds any other key of the quota file's
    ``limits`` table (``max_model_calls``, ``max_tokens`` per agent run, ``requests_per_minute``, ...).
    """

    name: str
    weight: float = 1.0
    max_concurrent: int = 100_000
    max_queued: int = 100_000
    limits: dict[str, int | float] = field(default_factory=dict)

    def limits_toml(self) -> str:
        """The tenant's ``limits`` as an inline TOML table."""
        items = {"max_concurrent": self.max_concurrent, "max_queued": self.max_queued, **self.limits}
        return "{ " + ", ".join(f"{key} = {value!r}" for key, value in items.items()) + " }"


@dataclass(frozen=True)
class StackSpec:
    """What to start.

    Attributes:
        tenants: the tenants (one API key each).
        policy: the gateway's policy (``fairgate.core.policies.factory.POLICY_NAMES``).
        replicas: how many emulated replicas (upstreams) serve the model.
        replica: their cost model and slots (the gateway's ``[[upstream]]`` tables say the same).
        staggered: spread the replicas' iteration boundaries evenly. Emulated replicas with one cost model,
            started together and kept busy, iterate in lock-step for ever (their clocks are exact), so all
            their slots free at the same instants, an artefact no real fleet has. With ``staggered``, before
            the gateway starts, each replica gets one endless "pacer" sequence straight from the stack (not
            through the gateway: neither the policy nor the ledger sees it), replica ``i`` at ``i / K`` of
            an iteration after replica 0; a busy replica keeps the phase it started with. Each emulator has
            one slot more than the gateway uses, for its pacer.
        processes: run the replicas and the gateway as ``python -m fairgate`` processes (as deployed);
            default: in this process, each server on its own thread.
        model: the model name clients ask for.
    """

    tenants: tuple[TenantSpec, ...]
    policy: str = "gpu_fair"
    replicas: int = 2
    replica: ReplicaModel = field(default_factory=ReplicaModel)
    staggered: bool = False
    processes: bool = False
    model: str = "emu"

    @property
    def slots(self) -> int:
        """Sequences the stack runs at once (every replica's ``max_batch``)."""
        return self.replicas * self.replica.max_batch


@dataclass(frozen=True)
class Stack:
    """A running stack: where the gateway listens, each tenant's API key, and where its files are."""

    spec: StackSpec
    url: str  # the gateway's base URL (clients use url + "/v1")
    keys: dict[str, str]  # tenant -> API key
    folder: Path
    config_path: Path
    upstream_urls: tuple[str, ...]


@dataclass(frozen=True)
class TenantTotals:
    """One tenant's totals in the ledger: reservations, billed tokens and GPU time, reservations by status."""

    tenant: str
    requests: int
    input_tokens: int
    output_tokens: int
    gpu_ms: float
    by_status: dict[str, int]


@dataclass(frozen=True)
class LedgerReport:
    """Every tenant's ledger totals and its share of the GPU time billed."""

    totals: dict[str, TenantTotals]

    @property
    def gpu_ms(self) -> float:
        return sum(t.gpu_ms for t in self.totals.values())

    def minus(self, before: LedgerReport) -> LedgerReport:
        """What was billed since ``before`` (an earlier report of the same ledger)."""
        totals = {}
        for name, now in self.totals.items():
            then = before.totals.get(name)
            if then is None:
                totals[name] = now
                continue
            by_status = {
                k: now.by_status.get(k, 0) - then.by_status.get(k, 0) for k in set(now.by_status) | set(then.by_status)
            }
            totals[name] = TenantTotals(
                name,
                now.requests - then.requests,
                now.input_tokens - then.input_tokens,
                now.output_tokens - then.output_tokens,
                now.gpu_ms - then.gpu_ms,
                by_status,
            )
        return LedgerReport(totals)

    def shares(self) -> dict[str, float]:
        """Tenant -> fraction of all GPU ms billed (0 for every tenant when nothing was billed)."""
        total = self.gpu_ms
        return {name: (t.gpu_ms / total if total > 0 else 0.0) for name, t in self.totals.items()}


def config_text(folder: Path, spec: StackSpec, upstream_urls: list[str], keys: dict[str, str]) -> str:
    """The gateway configuration of ``spec`` (ledger and journal in ``folder``)."""
    r = spec.replica
    upstreams = "".join(
        f'[[upstream]]\nname = "emu-{i}"\nurl = "{url}/v1"\nmodel = "{spec.model}"\nmax_batch = {r.max_batch}\n'
        f"iter_base_ms = {r.iter_base_ms!r}\niter_slope_ms = {r.iter_slope_ms!r}\n"
        f"prefill_ms_per_token = {r.prefill_ms_per_token!r}\nmax_model_len = {r.max_model_len}\n\n"
        for i, url in enumerate(upstream_urls)
    )
    tenants = "".join(
        f'[quotas.tenants."{t.name}"]\ntier = "drill"\nweight = {float(t.weight)!r}\nlimits = {t.limits_toml()}\n'
        for t in spec.tenants
    )
    key_tables = "".join(
        f'[[key]]\ntenant = "{tenant}"\nhash = "{hash_api_key(key)}"\nname = "drill"\n' for tenant, key in keys.items()
    )
    return (
        f'[gateway]\npolicy = "{spec.policy}"\nledger = "sqlite:///{folder}/ledger.db"\n'
        f'journal = "{folder}/journal.jsonl"\ndefault_max_tokens = 256\nrequest_timeout_s = 3600\n\n'
        f'{upstreams}[quotas.tiers.drill]\non_ledger_unavailable = "reject"\n\n{tenants}\n{key_tables}'
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_in_thread(app: Any, port: int | None = None) -> Iterator[str]:
    """Run the ASGI ``app`` under uvicorn on 127.0.0.1 (``port``, default a free one), on its own thread and
    event loop, until the block ends; yields its base URL."""
    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True, name=f"drill-server-{port}")
    thread.start()
    deadline = time.monotonic() + STARTUP_S_MAX
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"a drill server did not start on port {port}")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def fairgate_process(
    args: list[str], port: int, log_path: Path | None = None, startup_s: float = STARTUP_S_MAX
) -> Iterator[str]:
    """Run ``python -m fairgate ARGS`` (a server on ``port``; its output to ``log_path``, default discarded)
    until the block ends; yields its base URL once ``/health`` answers (within ``startup_s``)."""
    import httpx

    url = f"http://127.0.0.1:{port}"
    with open(log_path or os.devnull, "wb") as log:
        child = subprocess.Popen([sys.executable, "-m", "fairgate", *args], stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + startup_s
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or child.poll() is not None:
                    raise RuntimeError(f"fairgate {' '.join(args)} did not start (log: {log_path or 'discarded'})")
                time.sleep(0.1)
            yield url
        finally:
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(timeout=30)


def _emulator_args(spec: StackSpec, port: int) -> list[str]:
    r = spec.replica
    return [
        "emulate",
        "--port",
        str(port),
        "--model",
        spec.model,
        "--iter-base-ms",
        repr(r.iter_base_ms),
        "--iter-slope-ms",
        repr(r.iter_slope_ms),
        "--prefill-ms-per-token",
        repr(r.prefill_ms_per_token),
        "--max-batch",
        str(r.max_batch + int(spec.staggered)),
        "--max-model-len",
        str(r.max_model_len),
    ]


PACER_PROMPT_TOKENS = 1


@contextmanager
def pace_replicas(spec: StackSpec, urls: list[str]) -> Iterator[None]:
    """Keep one endless sequence on each replica, replica ``i`` started ``i / K`` of an iteration after
    replica 0 (see ``StackSpec.staggered``); stopped (the connections closed) when the block ends."""
    import httpx

    loop = asyncio.new_event_loop()
    started = threading.Event()
    failure: list[BaseException] = []
    stop: asyncio.Future[None] = loop.create_future()

    async def pacer(url: str, http: httpx.AsyncClient, first_token: asyncio.Event) -> None:
        body = {
            "model": spec.model,
            "prompt": "x",
            "max_tokens": spec.replica.max_model_len - PACER_PROMPT_TOKENS - 1,
            "ignore_eos": True,
            "stream": True,
        }
        async with http.stream("POST", f"{url}/v1/completions", json=body) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("data: {"):
                    first_token.set()

    async def main() -> None:
        try:
            async with httpx.AsyncClient(timeout=None) as http:
                tasks, first_tokens = [], []
                period_s = spec.replica.iteration_ms(1) / 1000.0
                begin = time.monotonic()
                for i, url in enumerate(urls):
                    # An idle replica starts an iteration when a request arrives: replica i's iterations
                    # begin i/K of an iteration after replica 0's (and keep that phase while it is busy).
                    await asyncio.sleep(max(0.0, begin + period_s * i / len(urls) - time.monotonic()))
                    first_tokens.append(asyncio.Event())
                    tasks.append(asyncio.create_task(pacer(url, http, first_tokens[-1])))
                for event in first_tokens:
                    await asyncio.wait_for(event.wait(), STARTUP_S_MAX)
                started.set()
                await stop
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException as exc:
            failure.append(exc)
            started.set()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True, name="drill-pacer")
    thread.start()
    started.wait(STARTUP_S_MAX * (len(urls) + 1))
    try:
        if failure or not started.is_set():
            raise RuntimeError(f"could not start the replicas' pacer sequences: {failure[:1]}")
        yield
    finally:
        loop.call_soon_threadsafe(lambda: stop.done() or stop.set_result(None))
        thread.join(timeout=30)
        loop.close()


def new_stack_folder(spec: StackSpec) -> tuple[Path, dict[str, str], Path]:
    """Check ``spec`` and make its folder: (folder, tenant -> API key, the config path to write).

    Raises:
        ValueError: no replica, or no or repeated tenant names.
    """
    if spec.replicas < 1:
        raise ValueError("a drill stack needs at least one replica")
    names = [t.name for t in spec.tenants]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"a drill stack needs distinct tenant names, got {names}")
    folder = Path(tempfile.mkdtemp(prefix="fairgate-drill-"))
    keys = {t.name: f"fg-drill-{i}-{'k' * 32}" for i, t in enumerate(spec.tenants)}
    return folder, keys, folder / "fairgate.toml"


@contextmanager
def start_stack(spec: StackSpec, keep_folder: bool = False) -> Iterator[Stack]:
    """Start ``spec``'s replicas and gateway; stop them (and delete the folder unless ``keep_folder``) when
    the block ends.

    Raises:
        RuntimeError: a server did not start. GatewayConfigError: a bad spec (e.g. an unknown policy).
    """
    folder, keys, config_path = new_stack_folder(spec)
    try:
        with ExitStack() as servers:
            if spec.processes:
                upstreams = []
                for i in range(spec.replicas):
                    port = free_port()
                    upstreams.append(
                        servers.enter_context(
                            fairgate_process(_emulator_args(spec, port), port, folder / f"emulator-{i}.log")
                        )
                    )
                if spec.staggered:
                    servers.enter_context(pace_replicas(spec, upstreams))
                config_path.write_text(config_text(folder, spec, upstreams, keys))
                port = free_port()
                gateway = servers.enter_context(
                    fairgate_process(
                        ["serve", "--config", str(config_path), "--port", str(port)], port, folder / "gateway.log"
                    )
                )
            else:
                from fairgate.emulator.api import EmulatorSettings, create_app
                from fairgate.gateway.app import create_gateway
                from fairgate.gateway.config import load_gateway_config

                r = spec.replica
                settings = EmulatorSettings(
                    model=spec.model,
                    iter_base_ms=r.iter_base_ms,
                    iter_slope_ms=r.iter_slope_ms,
                    prefill_ms_per_token=r.prefill_ms_per_token,
                    max_batch=r.max_batch + int(spec.staggered),
                    max_model_len=r.max_model_len,
                )
                upstreams = [servers.enter_context(serve_in_thread(create_app(settings))) for _ in range(spec.replicas)]
                if spec.staggered:
                    servers.enter_context(pace_replicas(spec, upstreams))
                config_path.write_text(config_text(folder, spec, upstreams, keys))
                gateway = servers.enter_context(serve_in_thread(create_gateway(load_gateway_config(config_path))))
            yield Stack(spec, gateway, keys, folder, config_path, tuple(upstreams))
    finally:
        if not keep_folder:
            shutil.rmtree(folder, ignore_errors=True)


async def read_ledger(stack: Stack) -> LedgerReport:
    """Every tenant's totals in the stack's ledger now (safe while the gateway runs: SQLite in WAL mode)."""
    from fairgate.gateway.config import load_gateway_config
    from fairgate.ledger import connect

    config = load_gateway_config(stack.config_path)
    ledger = await connect(config.ledger_url, config.quotas, create=False)
    try:
        totals = {}
        for tenant in stack.keys:
            usage = await ledger.usage(tenant, 10 * 365 * 86_400)
            totals[tenant] = TenantTotals(
                tenant, usage.requests, usage.input_tokens, usage.output_tokens, usage.gpu_ms, dict(usage.by_status)
            )
    finally:
        await ledger.close()
    return LedgerReport(totals)


async def read_reservations(stack: Stack) -> list[Reservation]:
    """Every reservation in the stack's ledger now."""
    from fairgate.gateway.config import load_gateway_config
    from fairgate.ledger import connect

    config = load_gateway_config(stack.config_path)
    ledger = await connect(config.ledger_url, config.quotas, create=False)
    try:
        return await ledger.reservations()
    finally:
        await ledger.close()

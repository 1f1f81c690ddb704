"""Drill ``restart`` (seed 003, "simulate ... queue worker restart ... confirm that invalid reservations
eventually converge"): one of two gateway processes sharing a ledger and the same replicas is killed with
SIGKILL while it has requests queued and in flight, and started again. The claim:

- the killed process's clients see their connections fail (nothing hangs): its queue lives in its memory,
  so a queued request is failed with it; a client that retries with the same ``X-Request-Id`` while the
  original reservation is still open is re-admitted under that reservation (nothing deducted twice);
- its open reservations converge: the liveness sweep of the surviving (or restarted) process expires each
  once nobody has heartbeat it for ``reservation_ttl_s`` (billing what was settled so far). The time from
  the kill until the last of them is final is held to ``reservation_ttl_s + sweep_s`` (+ slack): a sweep
  that finds a reservation due with a heartbeat less than a TTL old extends it to a TTL after that
  heartbeat (``expire_due`` with the default registry), so the first sweep a TTL after the last heartbeat
  ends it (it used to extend it a TTL from the sweep: up to 2 x TTL + sweep, 3.5 s here);
- nothing is released while it still runs: the other process's requests, longer than the TTL, all end
  ``settled``, billed exactly what their clients received, as does every request that completed anywhere;
- at the end no reservation is open, the ledger's concurrency and queue counts, both gateways' gauges and
  the replicas' batches are back to 0, and the restarted process serves again.

The stack: a throwaway ``redis-server`` as the shared ledger, two emulated replicas and two ``fairgate
serve`` processes (``A``, killed, and ``B``), all as processes, with one configuration (each gateway its own
journal and request log). Each gateway uses half of every replica's slots. Tenant ``alpha`` keeps more
clients on A than A has slots (so some queue there), ``long`` sends requests longer than the TTL to B,
and ``beta`` short ones to B. A's clients back off after an error and go on, so once A is back they are
served again. After the kill, a few of A's requests that were queued (the ledger says so) are retried on B
with their own request id.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fairgate.drills import CheckedResult, DrillOptions
from fairgate.drills.outage import (
    ADMIN_KEY,
    MODEL,
    Call,
    ClientLoad,
    Clients,
    DrillTenant,
    LogCapture,
    RedisServer,
    drill_folder,
    emulator_args,
    gateway_config,
    log_lines,
    summarise_log,
)
from fairgate.drills.stack import STARTUP_S_MAX, ReplicaModel, free_port

HUNG_S = 2.0  # a client of the killed process must see its request fail within this long


class ServerProcess:
    """``python -m fairgate ARGS`` serving on ``port``, that can be killed and started again."""

    def __init__(self, args: list[str], port: int, log_path: Path) -> None:
        self.args, self.port, self.log_path = args, port, log_path
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "fairgate", *self.args], stdout=log, stderr=log)

    def wait_ready(self, timeout_s: float = STARTUP_S_MAX) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.process is None or self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"fairgate {self.args[0]} did not start (log: {self.log_path})")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no clean-up, as a crashed worker."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)


@dataclass(frozen=True)
class RestartConfig:
    """The drill's setting.

    Attributes:
        kill_at_s: when A is killed. restart_after_s: when it is started again, after the kill.
        load_after_s: how long the clients go on sending after the kill.
        reservation_ttl_s / sweep_s: the ledger's TTL and the gateways' liveness sweep (small, so that
            expiry happens within the drill and B's long requests outlive several TTLs).
        replica: the emulated replicas (each gateway is configured with ``gateway_batch`` of their slots).
        alpha_clients / alpha_output: tenant ``alpha``'s clients on A (more than A's slots) and outputs.
        long_clients / long_output: tenant ``long``'s clients on B, outputs longer than the TTL.
        beta_clients / beta_output: tenant ``beta``'s clients on B.
        retry_queued: how many of A's queued requests are retried on B with the same request id.
        drain_s_max: time allowed for the requests running when the clients stop sending.
        settle_s_max: time allowed, after that, for the last reservations to close.
        converge_slack_s: allowance over ``reservation_ttl_s + sweep_s`` for the kill-to-expiry bound
            (scheduling and ledger round trips on a loaded machine).
    """

    kill_at_s: float = 5.0
    restart_after_s: float = 0.5
    load_after_s: float = 8.0
    reservation_ttl_s: float = 2.0
    sweep_s: float = 0.5
    replica: ReplicaModel = field(
        default_factory=lambda: ReplicaModel(
            iter_base_ms=80.0, iter_slope_ms=0.5, prefill_ms_per_token=0.02, max_batch=12, max_model_len=4096
        )
    )
    replicas: int = 2
    gateway_batch: int = 6
    alpha_clients: int = 18
    alpha_output: tuple[int, int] = (10, 40)
    long_clients: int = 4
    long_output: tuple[int, int] = (50, 60)
    beta_clients: int = 6
    beta_output: tuple[int, int] = (8, 24)
    prompt_tokens: int = 32
    retry_queued: int = 2
    backoff_s: float = 0.5
    drain_s_max: float = 15.0
    settle_s_max: float = 10.0
    converge_slack_s: float = 1.0

    def __post_init__(self) -> None:
        if 2 * self.gateway_batch > self.replica.max_batch:
            raise ValueError("restart drill: two gateways need 2 x gateway_batch <= the replica's max_batch")
        if self.long_output[0] * self.replica.iteration_ms(self.gateway_batch * 2) / 1000.0 <= self.reservation_ttl_s:
            raise ValueError("restart drill: the long requests must outlive the reservation TTL")

    @property
    def tenants(self) -> list[DrillTenant]:
        return [DrillTenant("alpha"), DrillTenant("long"), DrillTenant("beta")]

    @property
    def converge_bound_s(self) -> float:
        """What the ledger guarantees for a reservation nobody heartbeats any more: final by the first sweep
        a TTL after its last heartbeat (see the module docstring); plus ``converge_slack_s``."""
        return self.reservation_ttl_s + self.sweep_s + self.converge_slack_s

    @property
    def ttl_sweep_s(self) -> float:
        """TTL + sweep: the bound one would expect from the TTL alone."""
        return self.reservation_ttl_s + self.sweep_s


@dataclass(frozen=True)
class Killed:
    """A reservation of A's that was open when A died."""

    request_id: str
    queued: bool  # waiting in A's queue (the ledger's queue place)
    tokens_received: int  # by its client before the connection broke
    status: str  # at the end
    billed_output: int
    final_after_s: float | None  # ledger time from the kill until it became final (None: still open)
    client_outcome: str
    retried: bool = False  # its client retried it on B with the same request id


@dataclass(frozen=True)
class RestartFigures:
    kill_at_s: float
    restart_ready_s: float  # A answered /health again, seconds after the kill
    killed: tuple[Killed, ...]
    at_kill: dict[str, int]  # A's requests at the kill: "in flight" / "queued" (client view)
    killed_clients: dict[str, int]  # how A's requests active at the kill ended (outcome -> count; "ok": it
    #                                 had ended just before the kill)
    hung: int  # of those, how many took longer than HUNG_S after the kill to fail
    retries: dict[str, str]  # request id -> what the retry on B got ("ok", "409:...", ...)
    sent: dict[str, Counter[str]]  # target -> outcome -> count
    long_outlived_ttl: int  # B's long requests that ran longer than the TTL
    long_settled: int  # of them, settled billing exactly what the client received
    mismatches: tuple[str, ...]  # completed requests billed differently (or not settled)
    expired_not_killed: tuple[str, ...]  # expired reservations that were not A's at the kill
    a_after_restart_ok: int  # requests A served after its restart
    open_left: int
    statuses: dict[str, int]
    accounts: dict[str, tuple[int, int]]  # tenant -> (concurrent, queued) in the ledger at the end
    gauges: dict[str, tuple[float, float]]  # gateway -> (active sequences, queued requests) at the end
    replicas: dict[str, tuple[int, int]]  # replica -> (running, waiting) at the end
    unbilled_killed_tokens: int  # streamed to A's killed clients beyond what was settled before the kill
    gateway_log: tuple[str, ...]

    @property
    def converge_s(self) -> float | None:
        """From the kill until the last of A's reservations not retried elsewhere was final."""
        times = [k.final_after_s for k in self.killed if not k.retried]
        if not times or any(t is None for t in times):
            return None
        return max(t for t in times if t is not None)


@dataclass(frozen=True)
class RestartResult(CheckedResult):
    config: RestartConfig
    figures: RestartFigures
    name: str = "restart"

    def checks(self) -> dict[str, bool]:
        c, f = self.config, self.figures
        queued = sum(1 for k in f.killed if k.queued)
        return {
            f"A had requests queued and in flight at the kill ({f.at_kill.get('in flight', 0)} in flight, "
            f"{f.at_kill.get('queued', 0)} queued; ledger: {queued} queued)": f.at_kill.get("in flight", 0) > 0
            and f.at_kill.get("queued", 0) > 0
            and queued > 0,
            "A's clients got connection errors (failed, nothing hung)": f.killed_clients.get("connection", 0) > 0
            and set(f.killed_clients) <= {"connection", "ok"}
            and f.hung == 0,
            "A's open reservations all ended expired (or settled, when retried on B)": bool(f.killed)
            and all(k.status == "expired" or (k.retried and k.status == "settled") for k in f.killed),
            f"... within TTL + sweep ({c.reservation_ttl_s:g} + {c.sweep_s:g} s, + {c.converge_slack_s:g} s "
            "slack) of the kill": f.converge_s is not None and f.converge_s <= c.converge_bound_s,
            "a killed request is never billed more than its client received": all(
                k.billed_output <= k.tokens_received or k.status == "settled" for k in f.killed
            ),
            "queued requests retried on B with their id: re-admitted once, or refused 409": all(
                v == "ok" or v.startswith("409") for v in f.retries.values()
            ),
            f"B's long requests outlived the TTL ({f.long_outlived_ttl}) and all ended settled, billed exactly": f.long_outlived_ttl
            > 0
            and f.long_settled == f.long_outlived_ttl,
            "nothing released while running: every completed request settled, billed exactly": not f.mismatches
            and not f.expired_not_killed,
            "B served without an error": set(f.sent.get("B", {})) <= {"ok"},
            "no open reservation at the end": f.open_left == 0,
            "ledger concurrency and queue counts back to 0": all(v == (0, 0) for v in f.accounts.values()),
            "gateways' active and queued gauges back to 0, replicas idle": all(
                v == (0.0, 0.0) for v in f.gauges.values()
            )
            and all(v == (0, 0) for v in f.replicas.values()),
            "the restarted process serves again": f.a_after_restart_ok > 0,
        }

    def render(self) -> list[Any]:
        from rich.table import Table

        c, f = self.config, self.figures
        out: list[Any] = [
            f"[bold]drill restart[/bold]: two gateway processes (A, B) on one Redis ledger and {c.replicas} emulated "
            f"replicas ({c.gateway_batch} slots each per gateway); reservation TTL {c.reservation_ttl_s:g} s, sweep "
            f"{c.sweep_s:g} s. Load: alpha {c.alpha_clients} clients on A (outputs {c.alpha_output[0]}-"
            f"{c.alpha_output[1]}), long {c.long_clients} on B ({c.long_output[0]}-{c.long_output[1]} tokens, "
            f"longer than the TTL), beta {c.beta_clients} on B.",
            f"Fault: SIGKILL to A at {f.kill_at_s:.1f} s with {f.at_kill.get('in flight', 0)} requests in flight and "
            f"{f.at_kill.get('queued', 0)} queued; A started again {c.restart_after_s:g} s later, answering "
            f"{f.restart_ready_s:.1f} s after the kill.",
        ]
        b = f.sent.get("B", Counter())
        out.append(
            f"Load held: B served {b.get('ok', 0)} requests ({f.long_outlived_ttl} of them longer than the TTL) "
            f"with {sum(n for k, n in b.items() if k != 'ok')} errors; A served "
            f"{f.sent.get('A', Counter()).get('ok', 0)}"
            f" ({f.a_after_restart_ok} after its restart)."
        )
        table = Table(title="requests by gateway", title_justify="left")
        table.add_column("gateway")
        table.add_column("outcomes")
        for target, outcomes in sorted(f.sent.items()):
            table.add_row(target, ", ".join(f"{k} {n}" for k, n in sorted(outcomes.items())))
        out.append(table)
        killed = Table(title="A's reservations open at the kill", title_justify="left")
        for column in ("", "count", "client saw", "ended", "kill -> final s (min-max)", "tokens streamed / billed"):
            killed.add_column(column, justify="left" if column in ("", "client saw", "ended") else "right")
        for name, queued, retried in (
            ("in flight", False, False),
            ("queued", True, False),
            ("queued, retried on B", True, True),
        ):
            rows = [k for k in f.killed if k.queued == queued and k.retried == retried]
            if retried and not rows:
                continue
            times = [k.final_after_s for k in rows if k.final_after_s is not None]
            killed.add_row(
                name,
                str(len(rows)),
                ", ".join(f"{k} {n}" for k, n in sorted(Counter(k.client_outcome for k in rows).items())),
                ", ".join(f"{k} {n}" for k, n in sorted(Counter(k.status for k in rows).items())),
                f"{min(times):.2f}-{max(times):.2f}" if times else "-",
                f"{sum(k.tokens_received for k in rows)} / {sum(k.billed_output for k in rows)}",
            )
        out.append(killed)
        if f.retries:
            out.append(
                "Retried on B with the same request id: "
                + ", ".join(f"{rid} -> {what}" for rid, what in sorted(f.retries.items()))
            )
        out.append(
            f"B's long requests longer than the TTL: {f.long_outlived_ttl}, settled exactly: {f.long_settled}. "
            f"A served {f.a_after_restart_ok} requests after its restart."
        )
        out.append(
            f"At the end: reservations {dict(sorted(f.statuses.items()))}, open {f.open_left}; ledger "
            f"(concurrent, queued) {f.accounts}; gateway gauges (active, queued) {f.gauges}; replicas "
            f"(running, waiting) {f.replicas}."
        )
        lost = (
            ([f"{len(f.mismatches)} completed requests billed differently"] if f.mismatches else [])
            + ([f"{f.open_left} reservations left open"] if f.open_left else [])
            + (
                [f"{len(f.expired_not_killed)} reservations expired that A's death does not explain"]
                if f.expired_not_killed
                else []
            )
        )
        converge = f.converge_s
        out.append(
            f"Lost: {'; '.join(lost) if lost else 'nothing'} ({f.unbilled_killed_tokens} tokens streamed to A's "
            "killed clients after their last partial settlement are not billed, by design). Time to converge: "
            + (f"{converge:.2f} s" if converge is not None else "never")
            + f" from the kill until A's last reservation was final (TTL + sweep = "
            f"{c.reservation_ttl_s + c.sweep_s:g} s)."
        )
        late = [
            k for k in f.killed if not k.retried and k.final_after_s is not None and k.final_after_s > c.ttl_sweep_s
        ]
        if late:
            out.append(
                f"  [yellow]note[/yellow] {len(late)} of A's {sum(not k.retried for k in f.killed)} "
                "reservations "
                f"were final later than TTL + sweep ({c.ttl_sweep_s:g} s) after the kill (latest "
                f"{max(k.final_after_s or 0.0 for k in late):.2f} s): sweeps and ledger round trips late "
                "on a loaded machine (the slack)."
            )
        for line in (*f.mismatches[:8], *f.expired_not_killed[:8]):
            out.append(f"  [red]problem[/red] {line}")
        for line in f.gateway_log[:8]:
            out.append(f"  gateway: {line}")
        out.extend(self.check_lines())
        out.append(
            f"{'[green]PASS[/green]' if self.passed else '[red]FAIL[/red]'}: gateway A killed under load and restarted."
        )
        return out


def run(options: DrillOptions, config: RestartConfig | None = None) -> RestartResult:
    """Run the drill (``options.seconds``: how long the load goes on after the kill; ``options.policy``: the
    gateways' policy). The gateways and replicas are always processes (one of them is killed)."""
    config = config or RestartConfig()
    if options.seconds is not None:
        config = replace(config, load_after_s=options.seconds)
    return asyncio.run(_run(options, config))


async def _gauges(url: str) -> tuple[float, float]:
    """(active sequences, queued requests) summed over tenants, from the gateway's /metrics."""
    import httpx

    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})).text
    active = queued = 0.0
    for line in text.splitlines():
        if line.startswith("fairgate_active_sequences{"):
            active += float(line.rsplit(" ", 1)[1])
        elif line.startswith("fairgate_queued_requests{"):
            queued += float(line.rsplit(" ", 1)[1])
    return active, queued


async def _replica(url: str) -> tuple[int, int]:
    import httpx

    async with httpx.AsyncClient(timeout=10) as http:
        stats = (await http.get(f"{url}/emulator/stats")).json()
    return int(stats["running"]), int(stats["waiting"])


async def _run(options: DrillOptions, c: RestartConfig) -> RestartResult:
    from fairgate.gateway.config import load_gateway_config
    from fairgate.ledger import connect

    with drill_folder("fairgate-drill-restart-") as folder, LogCapture() as capture, ExitStack() as stack:
        redis = stack.enter_context(RedisServer(folder / "redis", durable=False))
        ledger_url = redis.url("drill")
        replicas = [
            ServerProcess(emulator_args(c.replica, port), port, folder / f"emulator-{i}.log")
            for i, port in enumerate(free_port() for _ in range(c.replicas))
        ]
        for server in replicas:
            server.start()
            stack.callback(server.stop)
        for server in replicas:
            await asyncio.to_thread(server.wait_ready)
        gateways: dict[str, ServerProcess] = {}
        for name in ("A", "B"):
            sub = folder / name
            sub.mkdir()
            path = sub / "fairgate.toml"
            path.write_text(
                gateway_config(
                    sub,
                    ledger_url,
                    [r.url for r in replicas],
                    c.replica,
                    c.tenants,
                    options.policy,
                    c.sweep_s,
                    c.reservation_ttl_s,
                    upstream_max_batch=c.gateway_batch,
                )
            )
            port = free_port()
            gateways[name] = ServerProcess(
                ["serve", "--config", str(path), "--port", str(port)], port, sub / "gateway.log"
            )
            gateways[name].start()
            stack.callback(gateways[name].stop)
        for server in gateways.values():
            await asyncio.to_thread(server.wait_ready)
        quotas = load_gateway_config(folder / "A" / "fairgate.toml").quotas
        reader = await connect(ledger_url, quotas)
        clients = Clients({name: g.url for name, g in gateways.items()}, seed=options.seed)
        loads = [
            ClientLoad("alpha", "A", c.alpha_clients, c.alpha_output, c.prompt_tokens, c.backoff_s),
            ClientLoad("long", "B", c.long_clients, c.long_output, c.prompt_tokens, c.backoff_s),
            ClientLoad("beta", "B", c.beta_clients, c.beta_output, c.prompt_tokens, c.backoff_s),
        ]
        send_until = c.kill_at_s + c.load_after_s
        tasks = [
            asyncio.ensure_future(clients.closed_loop(load, i, send_until))
            for load in loads
            for i in range(load.clients)
        ]
        retries: dict[str, Call] = {}
        try:
            await asyncio.sleep(max(0.0, c.kill_at_s - clients.now()))
            active_at_kill = [call for call in clients.active.values() if call.target == "A"]
            kill_wall_ms = time.time() * 1000.0
            await asyncio.to_thread(gateways["A"].kill)
            kill_at = clients.now()
            at_kill = Counter("in flight" if call.first_s is not None else "queued" for call in active_at_kill)
            snapshot = [r for r in await reader.reservations(status="open") if r.request_id.startswith("A-")]

            async def restart() -> float:
                await asyncio.sleep(c.restart_after_s)
                gateways["A"].start()
                await asyncio.to_thread(gateways["A"].wait_ready)
                return clients.now() - kill_at

            restarting = asyncio.ensure_future(restart())
            # Retry a few of A's queued requests on B with their own request id (same body).
            calls_by_id = {call.request_id: call for call in active_at_kill}
            queued_ids = [
                r.request_id
                for r in snapshot
                if r.queued and r.billed.output_tokens == 0 and r.request_id in calls_by_id
            ][: c.retry_queued]
            for rid in queued_ids:
                original = calls_by_id[rid]
                while original.outcome == "running" and clients.now() < kill_at + 5.0:
                    await asyncio.sleep(0.02)
            retry_tasks = {
                rid: asyncio.ensure_future(
                    clients.one(
                        ClientLoad("alpha", "B", 1, c.alpha_output, c.prompt_tokens), rid, calls_by_id[rid].max_tokens
                    )
                )
                for rid in queued_ids
            }
            # Convergence: each of A's reservations open at the kill becomes final.
            final_ms: dict[str, float] = {}
            deadline = clients.now() + c.load_after_s + c.drain_s_max
            while len(final_ms) < len(snapshot) and clients.now() < deadline:
                for r in snapshot:
                    if r.id not in final_ms:
                        now = await reader.get(r.id)
                        if now.is_final and now.final_ms is not None:
                            final_ms[r.id] = now.final_ms
                await asyncio.sleep(0.1)
            restart_ready = await restarting
            for rid, task in retry_tasks.items():
                retries[rid] = await task
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, send_until - clients.now()) + c.drain_s_max)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            deadline = clients.now() + c.settle_s_max
            while clients.now() < deadline and await reader.reservations(status="open"):
                await asyncio.sleep(0.1)
            await asyncio.sleep(2 * c.sweep_s)  # the gauges follow the last requests
            reservations = await reader.reservations()
            accounts = {}
            for t in c.tenants:
                account = await reader.account(t.name, MODEL)
                accounts[t.name] = (account.concurrent, account.queued)
            gauges = {name: await _gauges(g.url) for name, g in gateways.items()}
            replica_state = {f"emu-{i}": await _replica(r.url) for i, r in enumerate(replicas)}
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await clients.close()
            await reader.close()
        for server in gateways.values():
            server.stop()
        lines = summarise_log(
            log_lines(capture.lines, *(folder / n / "gateway.log" for n in gateways)), keep_whole=("expired",)
        )
        figures = _figures(
            c,
            clients.calls,
            active_at_kill,
            snapshot,
            final_ms,
            kill_wall_ms,
            kill_at,
            restart_ready,
            dict(at_kill),
            retries,
            reservations,
            accounts,
            gauges,
            replica_state,
            lines,
        )
    return RestartResult(c, figures)


def _figures(
    c: RestartConfig,
    calls: list[Call],
    active_at_kill: list[Call],
    snapshot: list[Any],
    final_ms: dict[str, float],
    kill_wall_ms: float,
    kill_at: float,
    restart_ready: float,
    at_kill: dict[str, int],
    retries: dict[str, Call],
    reservations: list[Any],
    accounts: dict[str, tuple[int, int]],
    gauges: dict[str, tuple[float, float]],
    replica_state: dict[str, tuple[int, int]],
    lines: list[str],
) -> RestartFigures:
    by_request: dict[str, list[Any]] = {}
    for r in reservations:
        by_request.setdefault(r.request_id, []).append(r)
    originals = {call.request_id: call for call in active_at_kill}
    retried = {call.request_id for call in retries.values()}
    killed = []
    unbilled = 0
    for r in snapshot:
        end = next(iter(by_request.get(r.request_id, [])), None)
        call = originals.get(r.request_id)
        tokens = call.tokens if call is not None else 0
        status = end.status if end is not None else "missing"
        billed = end.billed.output_tokens if end is not None else 0
        if r.request_id not in retried:
            unbilled += max(0, tokens - billed)
        after = (final_ms[r.id] - kill_wall_ms) / 1000.0 if r.id in final_ms else None
        killed.append(
            Killed(
                r.request_id,
                bool(r.queued),
                tokens,
                status,
                billed,
                after,
                call.outcome if call is not None else "unknown",
                r.request_id in retried,
            )
        )
    sent: dict[str, Counter[str]] = {}
    for call in calls:
        if call.request_id in retried and call.target == "B":
            continue
        sent.setdefault(call.target, Counter())[call.key()] += 1
    # Every request that completed (anywhere) must be settled, billing exactly what its client received.
    mismatches = []
    for call in calls:
        if call.outcome != "ok":
            continue
        found = by_request.get(call.request_id, [])
        if len(found) != 1:
            mismatches.append(f"{call.request_id}: {len(found)} reservations")
            continue
        r = found[0]
        if (
            r.status != "settled"
            or r.billed.output_tokens != call.tokens
            or (call.usage_input is not None and r.billed.input_tokens != call.usage_input)
        ):
            mismatches.append(
                f"{call.request_id} ({call.target}): client received {call.tokens} tokens, ledger "
                f"{r.status} billing {r.billed.output_tokens} (input {r.billed.input_tokens})"
            )
    killed_ids = {r.request_id for r in snapshot}
    expired_not_killed = tuple(
        f"{r.request_id}: expired, billed {r.billed.output_tokens} tokens"
        for r in reservations
        if r.status == "expired" and r.request_id not in killed_ids
    )
    long_calls = [
        call
        for call in calls
        if call.tenant == "long"
        and call.outcome == "ok"
        and call.ended_s is not None
        and call.ended_s - call.sent_s > c.reservation_ttl_s
    ]
    long_settled = sum(
        1
        for call in long_calls
        if [(r.status, r.billed.output_tokens) for r in by_request.get(call.request_id, [])]
        == [("settled", call.tokens)]
    )
    a_after = sum(
        1
        for call in calls
        if call.target == "A" and call.outcome == "ok" and call.sent_s >= kill_at + restart_ready - 1.0
    )
    statuses = Counter(r.status for r in reservations)
    return RestartFigures(
        kill_at,
        restart_ready,
        tuple(killed),
        at_kill,
        dict(Counter(call.outcome for call in active_at_kill)),
        sum(1 for call in active_at_kill if call.ended_s is None or call.ended_s - kill_at > HUNG_S),
        {
            rid: call.key() if call.outcome != "ok" else "ok"
            for rid, call in ((call.request_id, call) for call in retries.values())
        },
        sent,
        len(long_calls),
        long_settled,
        tuple(mismatches),
        expired_not_killed,
        a_after,
        statuses.get("open", 0),
        dict(statuses),
        accounts,
        gauges,
        replica_state,
        unbilled,
        tuple(lines),
    )


__all__ = ["RestartConfig", "RestartFigures", "RestartResult", "ServerProcess", "run"]

"""The ``fairgate`` command line: simulate, sweep and replay (typer + rich).

Every error a user can cause (a bad file, key, value or option) prints one line naming the file and
key or line, and exits with code 2; no traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fairgate.core.policies.factory import POLICY_NAMES

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="GPU-time fair scheduling for multi-tenant LLM inference.",
)
_WIDTH = None if sys.stdout.isatty() else 140  # tables stay whole when piped or captured
console = Console(width=_WIDTH)
error_console = Console(stderr=True, width=_WIDTH)
T = TypeVar("T")


class UsageError(ValueError):
    """A bad command-line value; the message names the option."""


def _fail(message: str) -> typer.Exit:
    # User text (file names, keys, values) is printed as it is: no markup, no emoji codes.
    error_console.print(f"error: {message}", markup=False, emoji=False, highlight=False, soft_wrap=True)
    return typer.Exit(code=2)


def _note(message: str) -> None:
    error_console.print(message, markup=False, emoji=False, highlight=False, soft_wrap=True)


def _guard(action: Callable[[], T]) -> T:
    """Run ``action``, turning user errors into one line on stderr and exit code 2."""
    from fairgate.sim.generate import WorkloadError
    from fairgate.sim.scenario import ScenarioError
    from fairgate.sim.traces import TraceError

    try:
        return action()
    except (ScenarioError, TraceError, UsageError, WorkloadError) as exc:
        raise _fail(str(exc)) from None


def parse_seeds(text: str) -> list[int]:
    """``"1-5"``, ``"1,3,7"`` or ``"4"`` -> seeds (0 .. 2**32-1, at most 1000). Raises ``UsageError``."""
    spans: list[tuple[int, int]] = []
    for part in (p.strip() for p in text.split(",")):
        low, sep, high = part.partition("-") if "-" in part.lstrip("-") else (part, "", "")
        try:
            first, last = int(low), int(high) if sep else int(low)
        except ValueError:
            raise UsageError(f"--seeds {text!r}: expected N, N-M or a comma list such as 1,2,5") from None
        if last < first:
            raise UsageError(f"--seeds {text!r}: range {part!r} runs backwards")
        if first < 0 or last > 2**32 - 1:
            raise UsageError(f"--seeds {text!r}: seeds are whole numbers from 0 to {2**32 - 1}")
        spans.append((first, last))
    if sum(last - first + 1 for first, last in spans) > 1000:
        raise UsageError(f"--seeds {text!r}: give between 1 and 1000 seeds")
    seeds = [seed for first, last in spans for seed in range(first, last + 1)]
    if len(set(seeds)) != len(seeds):
        raise UsageError(f"--seeds {text!r}: a seed is listed twice")
    return seeds


def parse_flood(items: list[str]) -> dict[str, float]:
    """``["agent=4"]`` -> ``{"agent": 4.0}``. Raises ``UsageError``."""
    flood: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            factor = float(value)
        except ValueError:
            factor = float("nan")
        if not sep or not name or not 0 < factor <= 1000:
            raise UsageError(
                f"--flood {item!r}: expected TENANT=MULTIPLIER with a multiplier in (0, 1000], e.g. agent=4"
            )
        if name in flood:
            raise UsageError(f"--flood {item!r}: tenant {name!r} is flooded twice")
        flood[name] = factor
    return flood


def parse_policies(text: str) -> list[str]:
    """``all`` or a comma list of policy names. Raises ``UsageError``."""
    if text == "all":
        return list(POLICY_NAMES)
    names = [p.strip() for p in text.split(",") if p.strip()]
    if len(set(names)) != len(names):
        raise UsageError(f"--policy {text!r}: a policy is listed twice")
    for name in names:
        if name not in POLICY_NAMES:
            raise UsageError(f"--policy {name!r}: unknown policy; choose all or one of {', '.join(POLICY_NAMES)}")
    if not names:
        raise UsageError("--policy: give a policy name or all")
    return names


def _emit_json(document: dict[str, Any], target: str) -> None:
    from fairgate.sim.report import dumps

    text = dumps(document)
    if target == "-":
        sys.stdout.write(text + "\n")
        return
    _write_text(target, text + "\n", "--json")


def _write_text(target: str, text: str, option: str) -> None:
    try:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(text)
    except OSError as exc:
        raise UsageError(f"{option} {target}: cannot write: {exc.strerror or exc}") from None
    _note(f"wrote {target}")


def _plot_dir(target: str) -> Path:
    """Check (and create) a ``--plot`` directory before any work is done."""
    if not target.strip():
        raise UsageError("--plot: give a directory")
    path = Path(target)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--plot {target}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--plot {target}: cannot create the directory: {exc.strerror or exc}") from None
    return path


def _check_output(target: str | None, option: str) -> None:
    """Fail fast, before any work, on an output file that cannot be written."""
    if target is None or target == "-":
        return
    if not target.strip():
        raise UsageError(f"{option}: give a file path, or - for stdout")
    path = Path(target)
    if path.is_dir():
        raise UsageError(f"{option} {target}: is a directory")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"{option} {target}: {parent} is a file, not a directory")
            break


Policy = Annotated[str, typer.Option("--policy", "-p", help="A policy name, a comma list, or all.")]
JsonOut = Annotated[str | None, typer.Option("--json", help="Write JSON results to PATH, or - for stdout.")]
PlotDir = Annotated[str | None, typer.Option("--plot", help="Write PNG plots into DIR.")]


@app.command()
def simulate(
    scenario: Annotated[Path, typer.Argument(help="Scenario TOML file.")],
    policy: Policy = "all",
    seeds: Annotated[str | None, typer.Option(help="Workload seeds: N, N-M or a comma list.")] = None,
    flood: Annotated[list[str], typer.Option(help="TENANT=MULTIPLIER on its offered load (repeatable).")] = [],  # noqa: B006
    set_: Annotated[list[str], typer.Option("--set", help="Override a scenario key: KEY=VALUE (repeatable).")] = [],  # noqa: B006
    engine: Annotated[str, typer.Option(help="compressed (fast) or reference (every iteration).")] = "compressed",
    json_out: JsonOut = None,
    plot: PlotDir = None,
    markdown: Annotated[str | None, typer.Option(help="Write a Markdown share table to PATH.")] = None,
) -> None:
    """Simulate a scenario's tenants on continuous-batching replicas under one or all policies."""
    from fairgate.sim.experiment import ENGINES, run_policy
    from fairgate.sim.plots import share_over_time
    from fairgate.sim.report import print_table, results_json, shares_markdown
    from fairgate.sim.scenario import load_scenario

    def run() -> None:
        if engine not in ENGINES:
            raise UsageError(f"--engine {engine!r}: choose compressed or reference")
        policies = parse_policies(policy)
        floods = parse_flood(flood)
        _check_output(json_out, "--json")
        _check_output(markdown, "--markdown")
        loaded = load_scenario(scenario, set_)
        names = [t.name for t in loaded.tenants]
        for name in floods:
            if name not in names:
                raise UsageError(f"--flood {name}: no such tenant in {scenario} (tenants: {', '.join(names)})")
        seed_list = parse_seeds(seeds) if seeds is not None else [loaded.config.run.seed]
        plot_dir = _plot_dir(plot) if plot is not None else None
        results = [run_policy(loaded, p, seed_list, floods, engine) for p in policies]
        title = f"{scenario}  seeds {seed_list[0]}..{seed_list[-1]} ({len(seed_list)})" + (
            f"  flood {floods}" if floods else ""
        )
        print_table(error_console if json_out == "-" else console, title, results)
        if json_out:
            _emit_json(results_json(str(scenario), results, {"seeds": seed_list, "flood": floods}), json_out)
        if plot_dir:
            path = share_over_time(results, plot_dir / f"{loaded.name}_shares.png", title)
            _note(f"wrote {path}")
        if markdown:
            _write_text(markdown, shares_markdown(results) + "\n", "--markdown")

    _guard(run)


@app.command()
def sweep(
    scenario: Annotated[Path, typer.Argument(help="Scenario TOML file.")],
    grid: Annotated[Path, typer.Option(help="Grid TOML file (axes to sweep).")],
    jobs: Annotated[int, typer.Option(min=1, max=64, help="Worker processes.")] = 2,
    json_out: JsonOut = None,
    plot: PlotDir = None,
) -> None:
    """Run every configuration of a grid for each policy; report the worst max/min per policy."""
    from statistics import fmean

    from rich.markup import escape
    from rich.table import Table

    from fairgate.sim.plots import ratio_against
    from fairgate.sim.scenario import load_raw
    from fairgate.sim.sweep import configurations, load_grid, run_sweep

    def run() -> None:
        _check_output(json_out, "--json")
        grid_config = load_grid(grid)
        data = load_raw(scenario)
        configs = configurations(grid_config, grid, scenario, data)
        plot_dir = _plot_dir(plot) if plot is not None else None
        policies = grid_config.policy_names()
        with Progress(
            TextColumn("sweep"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=error_console,
            transient=False,
        ) as bar:
            task = bar.add_task("configurations", total=len(configs))
            result = run_sweep(grid_config, configs, scenario, jobs, lambda n: bar.advance(task, n))
        table = Table(
            title=f"{len(configs):,} configurations x {len(policies)} policies ({len(grid_config.seeds)} seed(s) each)",
            title_justify="left",
        )
        for column in ("policy", "worst max/min", "mean max/min", "worst at"):
            table.add_column(column)
        for name in policies:
            worst, where = result.worst(name)
            table.add_row(
                name,
                f"{worst:.3f}",
                f"{fmean(result.ratios[name]):.3f}",
                escape(", ".join(f"{k}={v}" for k, v in where.items())),
            )
        (error_console if json_out == "-" else console).print(table)
        if json_out:
            _emit_json({"scenario": str(scenario), "grid": str(grid), **result.to_json()}, json_out)
        if plot_dir:
            for axis in grid_config.axis:
                ratios = {p: result.by_axis(axis.key, p) for p in policies}
                reduce_note = "" if len(grid_config.axis) == 1 else "\n(mean over the other axes)"
                name = axis.key.replace("*", "all").replace(".", "_")
                path = ratio_against(
                    axis.values,
                    ratios,
                    plot_dir / f"sweep_{name}.png",
                    axis.key,
                    f"{scenario.name}: max/min GPU share vs {axis.key}{reduce_note}",
                )
                _note(f"wrote {path}")

    _guard(run)


@app.command()
def replay(
    traces: Annotated[list[Path], typer.Argument(help="Trace CSV files (NAME=PATH names the tenant).")],
    format_: Annotated[str, typer.Option("--format", help="azure or burstgpt.")],
    scenario: Annotated[Path, typer.Option(help="Scenario TOML with the replica and policy parameters.")],
    tenant_by: Annotated[str, typer.Option(help="file, a column name (e.g. Model), or hash:N.")] = "file",
    policy: Policy = "all",
    speedup: Annotated[float, typer.Option(help="Divide trace time by this.")] = 1.0,
    start: Annotated[float, typer.Option(help="Window start, s of trace time.")] = 0.0,
    duration: Annotated[float | None, typer.Option(help="Window length, s of trace time (default: all).")] = None,
    set_: Annotated[list[str], typer.Option("--set", help="Override a scenario key: KEY=VALUE.")] = [],  # noqa: B006
    json_out: JsonOut = None,
    plot: PlotDir = None,
) -> None:
    """Replay real request traces through one or all policies on a scenario's replicas."""
    from fairgate.sim.experiment import run_workload
    from fairgate.sim.plots import share_over_time
    from fairgate.sim.report import print_table, results_json
    from fairgate.sim.scenario import load_scenario
    from fairgate.sim.traces import trace_workload

    def run() -> None:
        if format_ not in ("azure", "burstgpt"):
            raise UsageError(f"--format {format_!r}: choose azure or burstgpt")
        policies = parse_policies(policy)
        _check_output(json_out, "--json")
        loaded = load_scenario(scenario, set_, require_tenants=False)
        plot_dir = _plot_dir(plot) if plot is not None else None
        workload, summary = trace_workload([str(t) for t in traces], format_, tenant_by, speedup, start, duration)
        unused = sorted(set(loaded.shares) - set(workload.tenants))
        if unused:
            _note(
                f"note: scenario tenants not in the trace are ignored: {', '.join(unused)} "
                f"(trace tenants: {', '.join(workload.tenants)})"
            )
        _note(
            f"replaying {len(workload):,} requests of {len(workload.tenants)} tenant(s) over "
            f"{workload.duration_ns / 1e9:,.0f} s on {loaded.replicas} replica(s); "
            f"skipped {summary.skipped_failed} failed rows (0 output tokens)"
        )
        results = [run_workload(loaded, workload, p) for p in policies]
        title = f"replay {', '.join(t.name for t in traces)} ({format_}, tenants by {tenant_by})"
        print_table(error_console if json_out == "-" else console, title, results)
        if json_out:
            _emit_json(results_json(str(scenario), results, {"traces": [str(t) for t in traces]}), json_out)
        if plot_dir:
            stem = "_".join(t.stem for t in traces)[:80]
            path = share_over_time(results, plot_dir / f"replay_{stem}_shares.png", title)
            _note(f"wrote {path}")

    _guard(run)


@app.command()
def emulate(
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8001,
    model: Annotated[str, typer.Option(help="Model name served at /v1/models.")] = "fairgate-emulated",
    iter_base_ms: Annotated[float, typer.Option()] = 9.0,
    iter_slope_ms: Annotated[float, typer.Option()] = 0.55,
    prefill_ms_per_token: Annotated[float, typer.Option()] = 0.06,
    max_batch: Annotated[int, typer.Option()] = 24,
    output_mean_tokens: Annotated[float, typer.Option(help="Mean of the lognormal output length.")] = 128.0,
    output_cv: Annotated[float, typer.Option(help="Coefficient of variation of the output length.")] = 0.5,
    max_model_len: Annotated[int, typer.Option(help="Context length, tokens.")] = 32_768,
    require_tenant_context: Annotated[
        bool, typer.Option("--require-tenant-context", help="Refuse (400) generation requests without a cache_salt.")
    ] = False,
) -> None:
    """Serve an OpenAI-compatible emulated replica: continuous batching on a real clock with the cost model."""
    import uvicorn
    from pydantic import ValidationError

    from fairgate.emulator.api import EmulatorSettings, create_app

    try:
        settings = EmulatorSettings(
            model=model,
            iter_base_ms=iter_base_ms,
            iter_slope_ms=iter_slope_ms,
            prefill_ms_per_token=prefill_ms_per_token,
            max_batch=max_batch,
            output_mean_tokens=output_mean_tokens,
            output_cv=output_cv,
            max_model_len=max_model_len,
            require_tenant_context=require_tenant_context,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        raise _fail(f"--{str(first['loc'][0]).replace('_', '-')}: {first['msg']}") from None
    _note(
        f"emulated replica {settings.model}: dt = {settings.iter_base_ms} + {settings.iter_slope_ms}*B + "
        f"{settings.prefill_ms_per_token}*prefill ms, max_batch {settings.max_batch}, on http://{host}:{port}/v1"
    )
    uvicorn.run(create_app(settings), host=host, port=port, log_level="warning")


@app.command()
def serve(
    config: Annotated[
        Path | None,
        typer.Option(
            help="Gateway TOML (see config/fairgate.example.toml). Without it: a demo with an emulated upstream."
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    demo_traffic: Annotated[
        bool, typer.Option(help="Demo only: four tenants keep requests in flight (seed 002's output mix).")
    ] = True,
    duration: Annotated[
        float | None,
        typer.Option(
            min=1.0, help="Stop after this many seconds and print each tenant's GPU share (default: run until Ctrl-C)."
        ),
    ] = None,
) -> None:
    """Run the gateway: OpenAI-compatible, per-tenant quotas, GPU-time fair dispatch."""
    import asyncio
    import contextlib
    import signal
    from collections.abc import Iterator

    import uvicorn

    from fairgate.emulator.api import EmulatorSettings, create_app
    from fairgate.gateway.app import create_gateway
    from fairgate.gateway.config import GatewayConfigError, load_gateway_config
    from fairgate.gateway.demo import DEMO_MODEL, demo_folder, write_demo_config
    from fairgate.gateway.demo import demo_traffic as drive_demo_traffic

    class DemoServer(uvicorn.Server):
        """A uvicorn server that leaves SIGINT/SIGTERM to ``run_all`` below (two servers share its loop)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        def install_signal_handlers(self) -> None:  # uvicorn < 0.29
            return None

    servers = []
    keys: dict[str, str] = {}
    try:  # a port in use is a one-line error, before anything is printed or started
        import socket

        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
            probe.bind((host, port))
    except OSError as exc:
        raise _fail(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None
    if config is None:
        folder = demo_folder()
        upstream_port = _free_port(host)
        emulator = DemoServer(
            uvicorn.Config(
                create_app(EmulatorSettings(model=DEMO_MODEL)),
                host=host,
                port=upstream_port,
                log_level="warning",
                timeout_graceful_shutdown=DEMO_GRACE_S,
            )
        )
        servers.append(emulator)
        config, keys = write_demo_config(folder, f"http://{host}:{upstream_port}")
        _note(f"demo: emulated replica on http://{host}:{upstream_port}/v1, ledger and config in {folder}")
        for tenant, key in keys.items():
            _note(f"  {'admin' if tenant == 'admin' else 'tenant ' + tenant:16s} key {key}")
        _note(f"dashboard: http://{host}:{port}/dashboard (log in with a key)   metrics: http://{host}:{port}/metrics")
        _note(
            f"try: curl -s http://{host}:{port}/v1/chat/completions -H 'Authorization: Bearer {keys['chat']}' "
            f'-H \'Content-Type: application/json\' -d \'{{"model": "{DEMO_MODEL}", "messages": '
            f'[{{"role": "user", "content": "hello"}}], "max_tokens": 16}}\''
        )
    try:
        loaded = load_gateway_config(config)
    except GatewayConfigError as exc:
        raise _fail(str(exc)) from None
    problem = _startup_problem(loaded, config)
    if problem is not None:
        raise _fail(problem)
    if keys:  # the demo: Ctrl-C stops the traffic, prints the shares and closes the streams at once
        gateway = DemoServer(
            uvicorn.Config(
                create_gateway(loaded),
                host=host,
                port=port,
                log_level="warning",
                timeout_graceful_shutdown=DEMO_GRACE_S,
            )
        )
    else:  # uvicorn's own signal handling: a graceful shutdown waits for the streams in flight
        gateway = uvicorn.Server(uvicorn.Config(create_gateway(loaded), host=host, port=port, log_level="warning"))
    servers.append(gateway)
    _note(f"gateway on http://{host}:{port}/v1 (policy {loaded.gateway.policy}, ledger {loaded.ledger_url})")
    traffic = bool(keys) and demo_traffic
    if traffic:
        _note(
            "demo traffic: 4 tenants x 12 clients (classify 24, chat 53, summarise 197, agent 354 tokens on "
            "average); GPU time should split 25 % each"
        )

    async def run_all() -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        stop = asyncio.Event()
        if keys:

            def on_signal() -> None:
                if stop.is_set():  # a second Ctrl-C: do not wait for anything
                    for server in servers:
                        server.force_exit = True
                stop.set()

            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, on_signal)
        serving = asyncio.gather(*(server.serve() for server in servers))
        driver = None
        if traffic:
            while not gateway.started and not serving.done():
                await asyncio.sleep(0.05)
            driver = asyncio.ensure_future(
                drive_demo_traffic(f"http://{host}:{port}", {t: k for t, k in keys.items() if t != "admin"})
            )
        if duration is not None or keys:
            timeout = None if duration is None else max(0.0, duration - (loop.time() - started))
            done, _ = await asyncio.wait(
                [asyncio.ensure_future(stop.wait()), serving], timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if not serving.done():
                if driver is not None:
                    driver.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await driver
                await _print_shares(loaded)
                for server in servers:
                    server.should_exit = True
        await serving

    with asyncio.Runner(loop_factory=_fast_loop_factory()) as runner:
        runner.run(run_all())


def _startup_problem(config: Any, path: Path) -> str | None:
    """What would stop the gateway starting, as one line naming the key: a journal or event log that
    cannot be written, a ledger that cannot be opened (checked by opening it, as the gateway will)."""
    import asyncio

    from fairgate.ledger import LedgerError, connect

    for key, file in (("journal", config.journal_path), ("event_log", config.event_log_path)):
        if file is None:
            continue
        try:
            with open(file, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            return f"{path}: gateway.{key}: cannot write {file} ({exc.strerror or exc})"

    async def open_ledger() -> None:
        ledger = await connect(config.ledger_url, config.quotas)
        await ledger.close()

    try:
        asyncio.run(open_ledger())
    except (LedgerError, ValueError, OSError) as exc:
        return f"{path}: gateway.ledger: cannot open the ledger ({exc})"
    return None


def _fast_loop_factory() -> Any:
    """uvloop's event loop where it is installed (as uvicorn picks it by itself), else asyncio's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds (not on Windows)
        return None
    return uvloop.new_event_loop


DEMO_GRACE_S = 2  # the demo's servers wait this long for streams still open when they stop


async def _print_shares(config: Any) -> None:
    """Each tenant's share of the GPU time billed in the ledger so far (the demo's closing figures)."""
    import asyncio

    from fairgate.ledger import connect

    async with await connect(config.ledger_url, config.quotas, create=False) as ledger:
        for _ in range(60):  # the cancelled demo requests settle what they generated (within a second or so)
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


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def main() -> None:
    """Console-script entry point."""
    from fairgate.cli_drill import drill_app
    from fairgate.cli_keys import keys_app
    from fairgate.cli_ledger import ledger_app
    from fairgate.cli_ops import ops_app

    app.add_typer(ledger_app, name="ledger")
    app.add_typer(keys_app, name="keys")
    app.add_typer(ops_app)  # explain, report
    app.add_typer(drill_app)  # drill
    app()

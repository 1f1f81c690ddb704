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
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fairgate.cli_common import check_port, console, error_console, output_dir
from fairgate.cli_common import fail as _fail
from fairgate.cli_common import note as _note
from fairgate.core.policies.factory import POLICY_NAMES

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="GPU-time fair scheduling for multi-tenant LLM inference.",
)
T = TypeVar("T")


class UsageError(ValueError):
    """A bad command-line value; the message names the option."""


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
    return output_dir(target, "--plot", UsageError)


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
    drain: Annotated[
        bool, typer.Option("--drain/--cut", help="Run until every request finished, or stop at run.duration_s.")
    ] = False,
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
        results = [run_policy(loaded, p, seed_list, floods, engine, drain=drain) for p in policies]
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
    drain: Annotated[
        bool, typer.Option("--drain/--cut", help="Run until every request finished, or stop at the window's end.")
    ] = True,
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
            f"{workload.duration_ns / 1e9:,.0f} s on {loaded.replicas} replica(s), "
            f"{'draining to the last request' if drain else 'cut at the window'}; "
            f"skipped {summary.skipped_failed} failed rows (0 output tokens)"
        )
        results = [run_workload(loaded, workload, p, drain=drain) for p in policies]
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
    embedding_dimensions: Annotated[int, typer.Option(help="Length of the vectors of /v1/embeddings.")] = 64,
    prefix_caching: Annotated[
        bool,
        typer.Option(
            "--prefix-caching", help="Reuse cached prompt prefixes per cache_salt; usage reports cached_tokens."
        ),
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
            embedding_dimensions=embedding_dimensions,
            prefix_caching=prefix_caching,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        raise _fail(f"--{str(first['loc'][0]).replace('_', '-')}: {first['msg']}") from None
    check_port(host, port)  # before the banner: a port in use is one line, not the banner and uvicorn's error
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
    from fairgate.cli_serve import serve as run

    run(config, host, port, demo_traffic, duration)


def main() -> None:
    """Console-script entry point."""
    from fairgate.cli_calibrate import calibrate_app
    from fairgate.cli_drill import drill_app
    from fairgate.cli_keys import keys_app
    from fairgate.cli_ledger import ledger_app
    from fairgate.cli_ops import ops_app

    app.add_typer(ledger_app, name="ledger")
    app.add_typer(keys_app, name="keys")
    app.add_typer(ops_app)  # explain, report
    app.add_typer(drill_app)  # drill
    app.add_typer(calibrate_app)  # calibrate
    app()

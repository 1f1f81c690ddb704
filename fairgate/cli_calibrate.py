"""``fairgate calibrate URL``: fit an engine's cost model from timed probes (``fairgate.gateway.calibrate``),
print the fit with its errors and write the ``[[upstream]]`` table.

Exit codes: 0 fitted, 1 the engine could not be probed, 2 a usage error (bad option or output file).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Annotated

import httpx
import typer
from rich.table import Table

from fairgate.cli_common import console, fail, note

calibrate_app = typer.Typer()  # its one command joins the main app (fairgate.cli.main)
KINDS = ("vllm", "sglang", "llamacpp", "tgi", "openai")


@calibrate_app.command("calibrate")
def calibrate(
    url: Annotated[str, typer.Argument(help="The engine's base URL (http://host:port, with or without /v1).")],
    model: Annotated[str | None, typer.Option(help="The model to probe (default: the engine's first).")] = None,
    kind: Annotated[str, typer.Option(help=f"The upstream kind: {', '.join(KINDS)}.")] = "openai",
    max_batch: Annotated[
        int | None, typer.Option(min=1, max=4096, help="Its batch size (default: what the engine reports).")
    ] = None,
    name: Annotated[str, typer.Option(help="The [[upstream]] name to write.")] = "engine-0",
    max_model_len: Annotated[int, typer.Option(min=2, help="Its context length, for the table.")] = 4096,
    api_key_env: Annotated[
        str | None, typer.Option(help="Environment variable holding the engine's API key (Bearer).")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Write the [[upstream]] table to this file.")] = None,
) -> None:
    """Probe a live engine (decode steps at batch sizes 1, 2, 4, ..., max_batch; prefill at several prompt
    lengths), print iter_base_ms, iter_slope_ms, prefill_ms_per_token and max_batch with their standard
    errors, and write the gateway's [[upstream]] table (stdout, or --out). Takes ~10-60 s."""
    from fairgate.gateway.calibrate import CalibrationError, Engine, base_url, report_rows, upstream_table
    from fairgate.gateway.calibrate import calibrate as run

    if kind not in KINDS:
        raise fail(f"--kind {kind!r}: choose one of {', '.join(KINDS)}")
    if not url.startswith(("http://", "https://")):
        raise fail(f"URL {url!r}: give an http:// or https:// URL")
    headers: tuple[tuple[str, str], ...] = ()
    if api_key_env is not None:
        key = os.environ.get(api_key_env, "").strip()
        if not key:
            raise fail(f"--api-key-env {api_key_env}: the environment variable is not set or empty")
        headers = (("Authorization", f"Bearer {key}"),)
    if out is not None and out.is_dir():
        raise fail(f"--out {out}: is a directory")
    v1 = base_url(url)
    try:
        engine = Engine(v1, model or _first_model(v1, dict(headers)), kind, headers)
        note(f"calibrating {engine.model} at {v1} ...")
        result = asyncio.run(run(engine, max_batch))
    except CalibrationError as exc:
        note(f"error: {exc}")
        raise typer.Exit(code=1) from None
    table = Table("parameter", "value", "std error", "worst probe off the fit")
    for row in report_rows(result):
        table.add_row(*row)
    console.print(table)
    text = upstream_table(result, name, v1, engine.model, kind, max_model_len)
    if out is None:
        console.print(text, markup=False, highlight=False)
    else:
        out.write_text(text)
        note(f"wrote {out}")


def _first_model(v1: str, headers: dict[str, str]) -> str:
    from fairgate.gateway.calibrate import CalibrationError

    try:
        answer = httpx.get(f"{v1}/models", headers=headers, timeout=10.0)
        return str(answer.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise CalibrationError(f"{v1}/models: no model listed ({type(exc).__name__}); give --model") from None

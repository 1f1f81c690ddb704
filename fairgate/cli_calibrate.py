"""``fairgate calibrate URL``: fit an engine's cost model from timed probes (``fairgate.gateway.calibrate``),
print the fit with its errors and write the ``[[upstream]]`` table.

The engine's ``/v1/models`` is read first: it must list ``--model`` (default: its first), and its entry's
``max_model_len`` (vLLM reports one per model) is the table's unless ``--max-model-len`` is given.

Exit codes: 0 fitted, 1 the engine could not be probed, 2 a usage error (bad option or output file), or an
engine that does not answer, does not serve ``--model``, or reports no context length when none is given.
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
# --max-batch-limit: a probe of one stream counts nothing; each stream is a connection (a file descriptor).
LIMIT_RANGE = (2, 1024)


@calibrate_app.command("calibrate")
def calibrate(
    url: Annotated[str, typer.Argument(help="The engine's base URL (http://host:port, with or without /v1).")],
    model: Annotated[str | None, typer.Option(help="The model to probe (default: the engine's first).")] = None,
    kind: Annotated[str, typer.Option(help=f"The upstream kind: {', '.join(KINDS)}.")] = "openai",
    max_batch: Annotated[
        int | None, typer.Option(min=1, max=4096, help="Its batch size (default: fitted from slot probes).")
    ] = None,
    max_batch_limit: Annotated[
        int, typer.Option(help=f"The most streams a slot probe sends at once, {LIMIT_RANGE[0]}-{LIMIT_RANGE[1]}.")
    ] = 256,  # fairgate.gateway.calibrate.MAX_BATCH_LIMIT (imported only when a command runs)
    name: Annotated[str, typer.Option(help="The name of the upstream table to write.")] = "engine-0",
    max_model_len: Annotated[
        int | None,
        typer.Option(min=2, help="Its context length, for the table (default: the engine's own, from /v1/models)."),
    ] = None,
    api_key_env: Annotated[
        str | None, typer.Option(help="Environment variable holding the engine's API key (Bearer).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Write the upstream table to this file (its folder must exist).")
    ] = None,
) -> None:
    """Probe a live engine (unless --max-batch is given, its slots: 2, 4, 8, ... long streams at once until
    some wait for a free slot; decode steps at batch sizes 1, 2, 4, ..., max_batch; prefill at several prompt
    lengths), print iter_base_ms, iter_slope_ms, prefill_ms_per_token and max_batch with their standard
    errors (and the fitted slots beside the engine's own count), and write the gateway's upstream table
    (stdout, or --out). Takes ~10-60 s."""
    from fairgate.gateway.calibrate import (
        CalibrationError,
        Engine,
        max_batch_note,
        report_rows,
        slot_probes,
        upstream_table,
    )
    from fairgate.gateway.calibrate import calibrate as run

    v1, headers = _checked(url, kind, name, model, api_key_env, out)
    if not LIMIT_RANGE[0] <= max_batch_limit <= LIMIT_RANGE[1]:
        raise fail(f"--max-batch-limit {max_batch_limit}: give a number of streams {LIMIT_RANGE[0]}-{LIMIT_RANGE[1]}")
    served, context, context_note = _served(v1, dict(headers), model, kind, max_model_len)
    try:
        engine = Engine(v1, served, kind, headers)
        note(f"calibrating {engine.model} at {v1} ...")
        result = asyncio.run(run(engine, max_batch, max_batch_limit))
    except CalibrationError as exc:
        note(f"error: {exc}")
        raise typer.Exit(code=1) from None
    table = Table("parameter", "value", "std error", "worst probe off the fit")
    for row in report_rows(result):
        table.add_row(*row)
    console.print(table)
    if result.fitted is not None:
        note(f"slot probes: {slot_probes(result.fitted)}")
    note(f"{'warning: ' if result.disagree else ''}max_batch: {max_batch_note(result)}")
    text = upstream_table(result, name, v1, engine.model, kind, context, context_note)
    if out is not None:
        try:
            out.write_text(text)
            note(f"wrote {out}")
            return
        except OSError as exc:  # the measurement is not lost: the table goes to stdout
            console.print(text, markup=False, highlight=False, soft_wrap=True)
            raise fail(f"--out {out}: cannot write it ({exc.strerror or exc}); the table is above") from None
    console.print(text, markup=False, highlight=False, soft_wrap=True)  # unwrapped: a TOML line is one line


def _checked(
    url: str, kind: str, name: str, model: str | None, api_key_env: str | None, out: Path | None
) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The options checked before anything is probed: the OpenAI base URL and the request headers.
    Raises ``typer.Exit`` (2) naming the option at fault."""
    from pydantic import TypeAdapter, ValidationError

    from fairgate.gateway.calibrate import base_url
    from fairgate.gateway.config import Name
    from fairgate.gateway.credentials import CredentialError, valid_key

    if kind not in KINDS:
        raise fail(f"--kind {kind!r}: choose one of {', '.join(KINDS)}")
    try:
        parsed = httpx.URL(url)
        port_ok = parsed.port is None or 0 < parsed.port < 65536
    except (httpx.InvalidURL, ValueError):
        parsed, port_ok = None, False
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host or not port_ok:
        raise fail(f"URL {url!r}: give the engine's http:// or https:// base URL (host, a port 1-65535)")
    if parsed.path.rstrip("/") not in ("", "/v1"):
        raise fail(f"URL {url!r}: give the engine's base URL (http://host:port or .../v1), not an endpoint")
    try:  # what the gateway's config takes as an upstream's name
        TypeAdapter(Name).validate_python(name)
    except ValidationError:
        raise fail(f"--name {name!r}: letters, digits, '.', '_', '-' (what an upstream's name may be)") from None
    if model is not None and not model.strip():
        raise fail("--model: give a model name (or leave the option out: the engine's first)")
    headers: tuple[tuple[str, str], ...] = ()
    if api_key_env is not None:
        try:
            key = valid_key(os.environ.get(api_key_env, "").strip(), f"--api-key-env ${api_key_env}")
        except CredentialError as exc:
            raise fail(f"{exc} (set the variable to the engine's key)") from None
        headers = (("Authorization", f"Bearer {key.get_secret_value()}"),)
    if out is not None and (out.is_dir() or not out.parent.is_dir()):
        raise fail(f"--out {out}: {'is a directory' if out.is_dir() else 'its folder does not exist'}")
    return base_url(url), headers


def _served(v1: str, headers: dict[str, str], model: str | None, kind: str, given: int | None) -> tuple[str, int, str]:
    """From the engine's ``/v1/models``: the model to probe (``--model``, else the first listed), its context
    length in tokens (``--max-model-len``, else the engine's own ``max_model_len`` for it) and where that came
    from (the table's comment). Raises ``typer.Exit`` (2): the engine does not answer or lists no model, does
    not list ``--model`` (the line names those it serves; llama-server serves its one model under any name),
    or reports no context length and none is given."""
    try:
        answer = httpx.get(f"{v1}/models", headers=headers, timeout=10.0)
        data = answer.json()["data"] if answer.status_code == 200 else None
    except httpx.HTTPError as exc:
        raise fail(f"URL {v1}: cannot reach it ({type(exc).__name__})") from None
    except (ValueError, KeyError, TypeError):
        data = None
    entries = {str(e["id"]): e for e in data if isinstance(e, dict) and "id" in e} if isinstance(data, list) else {}
    if not entries:
        key = " (a key? --api-key-env)" if answer.status_code in (401, 403) else ""
        raise fail(f"{v1}/models: answered {answer.status_code} with no model listed{key}")
    chosen = model if model is not None else next(iter(entries))
    if chosen not in entries and kind != "llamacpp":
        names = ", ".join(repr(name) for name in list(entries)[:10]) + (" ..." if len(entries) > 10 else "")
        raise fail(f"--model {model!r}: {v1} does not serve it (its /v1/models lists {names})")
    reported = entries.get(chosen, {}).get("max_model_len")
    reported = reported if type(reported) is int and reported >= 2 else None
    if given is not None:
        differs = f"; the engine reports {reported}" if reported not in (None, given) else ""
        return chosen, given, f"given (--max-model-len){differs}"
    if reported is None:
        raise fail(f"{v1}/models reports no max_model_len for {chosen!r}: give --max-model-len (its context length)")
    return chosen, reported, "the engine's own (its /v1/models)"

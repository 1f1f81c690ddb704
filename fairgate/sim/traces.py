"""Replay real LLM request traces: CSV loaders that build a :class:`~fairgate.sim.workload.Workload`.

Two formats are understood (both are CSV files with a header row, UTF-8, an optional BOM):

``azure``
    The Azure LLM inference trace 2023 (``AzureLLMInferenceTrace_{code,conv}.csv`` from
    ``Azure/AzurePublicDataset``), described in Patel et al., "Splitwise: Efficient generative LLM
    inference using phase splitting", ISCA 2024. Columns ``TIMESTAMP,ContextTokens,GeneratedTokens``;
    ``TIMESTAMP`` is a wall-clock time such as ``2023-11-16 18:17:03.9799600`` (any number of
    fractional digits, kept to the nanosecond; an optional ``Z`` or ``+HH:MM`` offset; no offset
    means UTC). Input (prompt) = ``ContextTokens``, output = ``GeneratedTokens``.

``burstgpt``
    BurstGPT (``HPMLL/BurstGPT``), described in Wang et al., "BurstGPT: A Real-World Workload Dataset
    to Optimize LLM Serving Systems", KDD 2025. Columns include ``Timestamp,Model,Request tokens,
    Response tokens,Total tokens,Log Type`` (``BurstGPT_3`` adds ``Session ID,Elapsed time``);
    ``Timestamp`` is seconds (integer or decimal) on the trace's own clock. Input = ``Request tokens``,
    output = ``Response tokens``.

Limits (each violation is a :class:`TraceError`, never a silent clamp):

- a token count above :data:`MAX_TOKENS_PER_REQUEST` (10,000,000);
- a BurstGPT ``Timestamp`` outside ``[0, MAX_BURSTGPT_SECONDS]`` (1e11 s, ~3,170 years); Azure
  times are limited to the years 1..9999 by their format;
- a file that is not a regular file (FIFO, device, directory) or is larger than
  :data:`MAX_TRACE_BYTES` (2 GiB); a header that names a column twice;
- in :func:`trace_workload`: ``speedup`` outside ``[MIN_SPEEDUP, MAX_SPEEDUP]`` (0.001 .. 1e6),
  ``start_s`` or ``duration_s`` above :data:`MAX_WINDOW_SECONDS` (1e10), ``hash:N`` with N above
  :data:`MAX_HASH_TENANTS` (10,000), and a replay (the window divided by ``speedup``) longer than
  :data:`MAX_REPLAY_SECONDS` (10 years of 365.25 days), which keeps every arrival well inside int64 ns.

Rows whose output token count is 0 are failed requests (BurstGPT logs them: 1,538 in the first week
of ``BurstGPT_1``). :func:`read_trace` returns them; :func:`trace_workload` skips them and reports how
many it skipped in :class:`TraceSummary`.

All times inside the simulator are integer nanoseconds; trace times are parsed exactly to
nanoseconds before any arithmetic, and the public float fields are seconds.
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
import os
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from decimal import ROUND_HALF_EVEN, Decimal, DecimalException
from functools import lru_cache
from pathlib import Path
from typing import TextIO

import numpy as np

from fairgate.core.request import MAX_TOKENS_PER_REQUEST
from fairgate.inputfile import open_regular
from fairgate.sim.generate import merge
from fairgate.sim.workload import Workload

NS_PER_S = 1_000_000_000

MAX_BURSTGPT_SECONDS = 10**11
"""Largest BurstGPT ``Timestamp`` in seconds (BurstGPT's clock starts near 0; 1e11 s is ~3,170 years)."""
MAX_TRACE_BYTES = 2 * 1024**3
"""Largest trace file read (2 GiB)."""
MIN_SPEEDUP = 1e-3
MAX_SPEEDUP = 1e6
"""Bounds of ``speedup`` (CLI ``--speedup``)."""
MAX_WINDOW_SECONDS = 1e10
"""Largest ``start_s`` / ``duration_s`` (CLI ``--start`` / ``--duration``), in trace seconds."""
MAX_HASH_TENANTS = 10_000
"""Largest N in ``tenant_by="hash:N"`` (CLI ``--tenant-by hash:N``)."""
MAX_REPLAY_SECONDS = 10 * 36525 * 86400 // 100
"""Longest replay (the kept window divided by ``speedup``): 10 years of 365.25 days, 315,576,000 s."""
_MAX_REPLAY_NS = MAX_REPLAY_SECONDS * NS_PER_S


class TraceError(ValueError):
    """Bad trace input or bad loader arguments.

    ``str()`` is a one-line message that names the file and the line (``<file>: line N: <problem>``)
    or the column (``<file>: missing column 'X' (has: a, b, c)``) where that applies; errors in the
    arguments alone name the argument by its ``fairgate replay`` option, which passes it straight
    through: ``--speedup`` (``speedup``), ``--start`` (``start_s``), ``--duration`` (``duration_s``),
    ``--tenant-by`` (``tenant_by``), e.g. ``--speedup 1e-300: must be between 0.001 and 1000000``.
    """


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace.

    Attributes:
        time_s: arrival time in seconds, relative to the earliest row of the file (that row has 0.0).
        prompt_tokens: input tokens (>= 0).
        output_tokens: generated tokens (>= 0; 0 marks a failed request).
        fields: every raw column of the CSV row, by header name, as text.
    """

    time_s: float
    prompt_tokens: int
    output_tokens: int
    fields: dict[str, str]


@dataclass(frozen=True)
class TraceSummary:
    """What :func:`trace_workload` kept and skipped.

    Attributes:
        tenants: tenant names, in the workload's order.
        requests: requests kept per tenant (every tenant listed, possibly with 0).
        skipped_failed: rows inside the window with 0 output tokens, not replayed.
        rows_read: data rows read from all files (before windowing and skipping).
        span_s: trace seconds from the first to the last kept request (before ``speedup``).
        duration_s: replay duration of the workload in seconds (``Workload.duration_ns / 1e9``).
        mean_prompt_tokens: mean prompt tokens over the kept requests.
        mean_output_tokens: mean output tokens over the kept requests.
    """

    tenants: tuple[str, ...]
    requests: dict[str, int]
    skipped_failed: int
    rows_read: int
    span_s: float
    duration_s: float
    mean_prompt_tokens: float
    mean_output_tokens: float

    @property
    def total_requests(self) -> int:
        """Requests kept over all tenants."""
        return sum(self.requests.values())


# ---------------------------------------------------------------------------------------------
# Parsing


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_S = timedelta(seconds=1)
_AZURE_TIME = re.compile(r"\s*(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?\s*\Z")


@lru_cache(maxsize=4096)
def _epoch_seconds(whole: str, tz: str | None) -> int:
    """``YYYY-MM-DD HH:MM:SS`` at offset ``tz`` (None or ``Z`` = UTC) -> whole seconds since the epoch.
    Cached: consecutive trace rows mostly share their second."""
    dt = datetime.fromisoformat(whole)  # validates month/day/hour ranges
    if tz is None or tz == "Z":
        dt = dt.replace(tzinfo=UTC)
    else:
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        hours, minutes = int(digits[:2]), int(digits[2:])
        if hours > 23 or minutes > 59:
            raise ValueError(f"bad UTC offset {tz}")
        dt = dt.replace(tzinfo=timezone(sign * timedelta(hours=hours, minutes=minutes)))
    try:
        return (dt - _EPOCH) // _ONE_S
    except OverflowError:
        raise ValueError("time out of range") from None


def _wall_clock_ns(text: str) -> int:
    """``YYYY-MM-DD HH:MM:SS[.fffffff][Z|+HH:MM]`` -> ns since the Unix epoch (no offset = UTC)."""
    m = _AZURE_TIME.match(text)
    if m is None:
        raise ValueError("not a time like 2023-11-16 18:17:03.9799600")
    whole, frac, tz = m.groups()
    seconds = _epoch_seconds(whole, tz)
    ns = int((frac or "")[:9].ljust(9, "0"))
    return seconds * NS_PER_S + ns


def _seconds_ns(text: str) -> int:
    """Decimal seconds (``5``, ``19440110.0``, ``1.5e3``) in ``[0, MAX_BURSTGPT_SECONDS]`` -> integer ns,
    rounded half to even."""
    try:
        value = Decimal(text)
    except (DecimalException, ValueError):
        raise ValueError("not a number of seconds") from None
    if not value.is_finite():
        raise ValueError("not a finite number of seconds")
    if not 0 <= value <= MAX_BURSTGPT_SECONDS:
        raise ValueError(f"outside 0 .. {MAX_BURSTGPT_SECONDS:.0e} seconds".replace("e+", "e"))
    try:
        return int((value * NS_PER_S).to_integral_value(ROUND_HALF_EVEN))
    except DecimalException:  # Overflow, InvalidOperation: not reachable after the range check
        raise ValueError("not a representable number of seconds") from None


@dataclass(frozen=True)
class _Format:
    time: str
    prompt: str
    output: str
    parse_time: Callable[[str], int]


FORMATS: dict[str, _Format] = {
    "azure": _Format("TIMESTAMP", "ContextTokens", "GeneratedTokens", _wall_clock_ns),
    "burstgpt": _Format("Timestamp", "Request tokens", "Response tokens", _seconds_ns),
}
"""Known trace formats: name -> (time column, prompt column, output column, time parser)."""


@dataclass
class _Parsed:
    """A file's data rows in file order; times in ns on the file's own clock."""

    label: str
    header: list[str]
    lines: list[int]
    times_ns: list[int]
    prompts: list[int]
    outputs: list[int]
    raw: list[list[str]]


def _one_line(value: str, limit: int = 40) -> str:
    text = value if len(value) <= limit else value[:limit] + "..."
    return repr(text)


def _printable(text: str, limit: int = 300) -> str:
    """``text`` for a one-line message: escaped (as by ``repr``) if it has line breaks or other
    unprintable characters, and cut to ``limit`` characters."""
    if not text.isprintable():
        text = repr(text)[1:-1]
    return text if len(text) <= limit else text[:limit] + "..."


def _tokens(text: str) -> int:
    try:
        n = int(text)
    except ValueError:  # also raised for more than 4,300 digits: float() below then gives inf
        try:
            x = float(text)
        except ValueError:
            raise ValueError("not a number") from None
        if math.isinf(x):
            raise ValueError("negative" if x < 0 else f"above the cap of {MAX_TOKENS_PER_REQUEST}") from None
        if not x.is_integer():
            raise ValueError("not a whole number") from None
        n = int(x)
    if n < 0:
        raise ValueError("negative")
    if n > MAX_TOKENS_PER_REQUEST:
        raise ValueError(f"above the cap of {MAX_TOKENS_PER_REQUEST}")
    return n


def _format(fmt: str, where: str) -> _Format:
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise TraceError(f"{where}unknown trace format {fmt!r} (known: {', '.join(FORMATS)})") from None


def _open_text(path: Path, label: str) -> TextIO:
    """Open a regular file of at most ``MAX_TRACE_BYTES`` as UTF-8 text (BOM dropped, newlines kept)."""
    binary = open_regular(path, TraceError, "a trace file", MAX_TRACE_BYTES, label)
    return io.TextIOWrapper(binary, newline="", encoding="utf-8-sig")


def _cell(text: str, parse: Callable[[str], int], label: str, line: int, column: str, what: str) -> int:
    """``parse(text)``; a ``ValueError`` becomes a ``TraceError`` naming the file, line and column."""
    try:
        return parse(text)
    except ValueError as e:
        raise TraceError(f"{label}: line {line}: column {column!r}: bad {what} {_one_line(text)} ({e})") from None


def _parse(path: Path, fmt: _Format) -> _Parsed:
    label = _printable(str(path), limit=1000)
    try:
        with _open_text(path, label) as f:
            reader = csv.reader(f)
            try:
                header_row = next(reader, None)
                if header_row is None:
                    raise TraceError(f"{label}: empty file (no header row)")
                header = [h.strip() for h in header_row]
                index: dict[str, int] = {}
                for k, name in enumerate(header):
                    if name in index:
                        raise TraceError(f"{label}: duplicate column {_printable(repr(name), 80)} in the header")
                    index[name] = k
                for col in (fmt.time, fmt.prompt, fmt.output):
                    if col not in index:
                        raise TraceError(f"{label}: missing column {col!r} (has: {_printable(', '.join(header))})")
                it, ip, io = index[fmt.time], index[fmt.prompt], index[fmt.output]
                width = len(header)
                parsed = _Parsed(label, header, [], [], [], [], [])
                parse_time = fmt.parse_time
                for row in reader:
                    if not row or (len(row) == 1 and not row[0].strip()):
                        continue  # blank line
                    line = reader.line_num
                    if len(row) != width:
                        raise TraceError(f"{label}: line {line}: {len(row)} fields, header has {width}")
                    t = _cell(row[it], parse_time, label, line, fmt.time, "timestamp")
                    p = _cell(row[ip], _tokens, label, line, fmt.prompt, "token count")
                    o = _cell(row[io], _tokens, label, line, fmt.output, "token count")
                    parsed.lines.append(line)
                    parsed.times_ns.append(t)
                    parsed.prompts.append(p)
                    parsed.outputs.append(o)
                    parsed.raw.append(row)
            except csv.Error as e:
                raise TraceError(f"{label}: line {reader.line_num}: malformed CSV ({_printable(str(e))})") from None
    except UnicodeDecodeError:
        raise TraceError(f"{label}: not UTF-8 text") from None
    except OSError as e:
        raise TraceError(f"{label}: cannot read ({_printable(e.strerror or str(e))})") from None
    except MemoryError:
        raise TraceError(f"{label}: out of memory while reading") from None
    if not parsed.times_ns:
        raise TraceError(f"{label}: no data rows (header only)")
    return parsed


def read_trace(path: str | Path, fmt: str) -> list[TraceRow]:
    """Read every data row of one trace file.

    Args:
        path: CSV file in format ``fmt``.
        fmt: ``"azure"`` (Azure LLM inference trace 2023; Patel et al., Splitwise, ISCA 2024) or
            ``"burstgpt"`` (Wang et al., BurstGPT, KDD 2025); see the module docstring for columns.

    Returns:
        One :class:`TraceRow` per data row (blank lines ignored), sorted by time (stable: equal times keep
        file order), with ``time_s`` in seconds relative to the earliest row (which gets 0.0).
        Failed requests (0 output tokens) are included.

    Raises:
        TraceError: unknown format; file not found, unreadable, not a regular file or larger than 2 GiB;
            missing or duplicate column; a row with the wrong number of fields, an unparseable or
            out-of-range timestamp, or a non-numeric, fractional, negative or too large (above
            ``MAX_TOKENS_PER_REQUEST``) token count (message names the file, line and column); no data
            rows.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TraceError(f"read_trace: the trace file must be a str or Path, got {_arg_text(path)}")
    p = Path(path)
    spec = _format(fmt, f"{_printable(str(p), 1000)}: ")
    parsed = _parse(p, spec)
    t0 = min(parsed.times_ns)
    order = sorted(range(len(parsed.times_ns)), key=parsed.times_ns.__getitem__)
    header = parsed.header
    return [
        TraceRow(
            (parsed.times_ns[i] - t0) / NS_PER_S,
            parsed.prompts[i],
            parsed.outputs[i],
            dict(zip(header, parsed.raw[i], strict=False)),
        )
        for i in order
    ]


# ---------------------------------------------------------------------------------------------
# Workloads


def _split_named(item: str | Path) -> tuple[str | None, Path]:
    """``NAME=PATH`` -> (NAME, PATH). Only a ``str`` whose text before the first ``=`` has no path
    separator is split; a ``Path`` is never split."""
    if isinstance(item, str) and "=" in item:
        name, _, rest = item.partition("=")
        if "/" not in name and "\\" not in name:
            return name, Path(rest)
    return None, Path(item)


def _hash_bucket(file_name: str, row: int, n: int) -> int:
    digest = hashlib.sha256(f"{file_name}:{row}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % n


def _arg_text(value: object) -> str:
    """An argument's value as the user wrote it, for a message (``1e-300``, ``0``, ``'abc'``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value) if value.bit_length() < 128 else f"<{value.bit_length()}-bit integer>"
    if isinstance(value, float):
        return repr(float(value))
    return _printable(repr(value), 60)


def _option(option: str, value: object, low: float, high: float, low_open: bool, want: str) -> float:
    """``value`` as a float in ``[low, high]`` (``(low, high]`` if ``low_open``), else TraceError
    ``<option> <value>: must be <want>``."""
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        x = math.nan
    if isinstance(value, bool) or not (low < x <= high if low_open else low <= x <= high):  # False for nan
        raise TraceError(f"{option} {_arg_text(value)}: must be {want}")
    return x


def _tenant_value(text: str) -> str:
    """A tenant name from a column value: surrounding whitespace stripped; a value with nothing
    visible (empty, whitespace, control or invisible format characters such as a zero-width space
    or a BOM) becomes ``(none)``."""
    value = text.strip()
    if all(ch.isspace() or unicodedata.category(ch) in ("Cc", "Cf") for ch in value):
        return "(none)"
    return value


def _years(seconds: float) -> str:
    years = seconds / (MAX_REPLAY_SECONDS / 10)
    return f"{years:,.0f} years" if years >= 100 else f"{years:.3g} years"


def trace_workload(
    paths: Sequence[str | Path],
    fmt: str,
    tenant_by: str = "file",
    speedup: float = 1.0,
    start_s: float = 0.0,
    duration_s: float | None = None,
) -> tuple[Workload, TraceSummary]:
    """Build a replayable workload from one or more trace files of one format.

    Args:
        paths: CSV files in format ``fmt``. With ``tenant_by="file"`` an entry may be the string
            ``NAME=PATH`` to name that file's tenant (a ``str`` is split at its first ``=`` when the text
            before it contains no ``/`` or ``\\``; a ``Path`` is never split).
        fmt: ``"azure"`` (Azure LLM inference trace 2023; Patel et al., Splitwise, ISCA 2024) or
            ``"burstgpt"`` (Wang et al., BurstGPT, KDD 2025).
        tenant_by: how requests are assigned to tenants:

            - ``"file"``: one tenant per file, named after the file stem (``azure_llm_2023_code``) or
              the given ``NAME``; tenants in the order of ``paths``. Each file's times are relative to
              its own earliest row, so files replay side by side from time 0.
            - ``"hash:N"`` (1 <= N <= 10,000): tenants ``t0`` .. ``t{N-1}`` (all listed, in that order); row ``i``
              (0-based position among the file's data rows, in file order, failed rows included) of
              file ``F`` (base name, e.g. ``azure_llm_2023_code.csv``) goes to tenant
              ``int.from_bytes(sha256(f"{F}:{i}")[:8], "big") % N`` -- stable across runs, machines,
              windows and ``PYTHONHASHSEED``.
            - anything else: a column name (e.g. ``Model`` -> tenants ``ChatGPT``, ``GPT-4``); tenants
              are the distinct values (surrounding whitespace stripped; a value with nothing visible --
              empty, only whitespace, control or invisible format characters such as a zero-width
              space -- becomes ``(none)``) of the kept requests, sorted by name.

            With ``"hash:N"`` or a column, all files share one clock (their raw timestamps are taken to
            be comparable, as for the two Azure 2023 files): times are relative to the earliest row
            over all files.
        speedup: replay speed factor, 0.001 .. 1e6; 2.0 replays the trace twice as fast.
        start_s: start of the window in trace seconds (0 .. 1e10) from time 0 defined above.
        duration_s: length of the window in trace seconds (> 0, at most 1e10), or None for "to the end
            of the trace".

    Rows with ``start_s <= time_s < start_s + duration_s`` are kept, shifted so the window starts at 0
    and divided by ``speedup``; arrivals are rounded to whole ns. Rows with 0 output tokens (failed
    requests) inside the window are skipped and counted in ``TraceSummary.skipped_failed``.

    ``Workload.duration_ns`` is ``round(duration_s * 1e9 / speedup)``; with ``duration_s=None`` it is
    the time from ``start_s`` to the latest row of the trace (failed rows included), divided by
    ``speedup``, plus 1 ns, so that the last row lies inside ``[0, duration_ns)``. In both cases it is
    raised, if needed, to one past the last arrival (rounding can otherwise collide). The replay
    (``duration_s / speedup``, or with ``duration_s=None`` the time from ``start_s`` to the latest row
    divided by ``speedup``) may last at most :data:`MAX_REPLAY_SECONDS` (10 years); a longer one is an
    error (with ``duration_s=None`` the message names the latest row, which is often a bad timestamp),
    never an int64 overflow.

    Returns:
        ``(workload, summary)``: the requests sorted by arrival (ties by tenant index, then file order),
        and a :class:`TraceSummary`.

    Raises:
        TraceError: any :func:`read_trace` error; unknown format; no paths; bad ``NAME=PATH`` (empty
            name, two files with the same tenant name, or a name with a ``tenant_by`` other than
            ``"file"``); a ``tenant_by`` column missing from a file (message lists its columns); bad
            ``hash:N`` (N not in 1 .. 10,000); ``speedup``, ``start_s`` or ``duration_s`` out of the
            bounds above or not finite (messages name them ``--speedup``, ``--start``, ``--duration``,
            ``--tenant-by``, as the CLI options); a replay longer than 10 years; no requests in the
            window (message names the files and the window).
    """
    spec = _format(fmt, "trace_workload: ")
    speedup = _option("--speedup", speedup, MIN_SPEEDUP, MAX_SPEEDUP, False, "between 0.001 and 1000000")
    start_s = _option("--start", start_s, 0.0, MAX_WINDOW_SECONDS, False, "between 0 and 1e10 (seconds of trace time)")
    if duration_s is not None:
        duration_s = _option(
            "--duration", duration_s, 0.0, MAX_WINDOW_SECONDS, True, "above 0 and at most 1e10 (seconds of trace time)"
        )
    named, hash_n = _trace_files(paths, tenant_by)
    files = [_parse(path, spec) for _, path in named]
    names, per_file_tenant, origins = _row_tenants(named, files, tenant_by, hash_n)
    rows = _window_rows(files, origins, per_file_tenant, start_s, duration_s)
    if hash_n is None and tenant_by != "file":
        names = sorted(set(rows.tenants))
    duration_ns = _replay_ns(files, spec, rows, tenant_by, speedup, start_s, duration_s)
    return _build(names, rows, speedup, duration_ns, sum(len(parsed.times_ns) for parsed in files))


def _trace_files(paths: Sequence[str | Path], tenant_by: str) -> tuple[list[tuple[str | None, Path]], int | None]:
    """The files as ``(tenant name or None, path)``, and N of ``hash:N``. Raises ``TraceError``."""
    if not isinstance(tenant_by, str):
        raise TraceError(f"--tenant-by {_arg_text(tenant_by)}: must be file, a column name or hash:N")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    try:
        paths = list(paths)
    except TypeError:
        raise TraceError(f"trace_workload: paths must be a list of files, got {_arg_text(paths)}") from None
    if not paths:
        raise TraceError("trace_workload: no trace files given")
    for item in paths:
        if not isinstance(item, (str, os.PathLike)):
            raise TraceError(f"trace_workload: a trace file must be a str or Path, got {_arg_text(item)}")
    hash_n: int | None = None
    if tenant_by.startswith("hash:"):
        text = tenant_by[len("hash:") :]
        if not (text.isascii() and text.isdigit() and len(text) <= 6 and 1 <= int(text) <= MAX_HASH_TENANTS):
            raise TraceError(
                f"--tenant-by {_printable(repr(tenant_by), 60)}: N in hash:N must be a whole number "
                f"from 1 to {MAX_HASH_TENANTS}"
            )
        hash_n = int(text)
    named = [_split_named(item) for item in paths]
    for (name, _path), item in zip(named, paths, strict=True):
        if name is not None:
            shown = _printable(str(item), 1000)
            if tenant_by != "file":
                raise TraceError(
                    f"{shown}: NAME=PATH names a tenant, which needs --tenant-by file "
                    f"(got --tenant-by {_printable(repr(tenant_by), 60)})"
                )
            if not name.strip():
                raise TraceError(f"{shown}: empty tenant name in NAME=PATH")
    return named, hash_n


def _row_tenants(
    named: list[tuple[str | None, Path]], files: list[_Parsed], tenant_by: str, hash_n: int | None
) -> tuple[list[str], list[list[str]], list[int]]:
    """The tenants (in order; empty when they come from a column: the kept rows decide), the tenant of
    every row of every file, and each file's time origin (its own, or one shared by every file)."""
    per_file_tenant: list[list[str]] = []
    names: list[str] = []
    if tenant_by == "file":
        for (name, path), parsed in zip(named, files, strict=True):
            tenant = name.strip() if name is not None else path.stem
            if tenant in names:
                raise TraceError(
                    f"{parsed.label}: tenant name {_printable(repr(tenant), 60)} is used by two files; "
                    f"name them with NAME=PATH"
                )
            names.append(tenant)
            per_file_tenant.append([tenant] * len(parsed.times_ns))
        return names, per_file_tenant, [min(parsed.times_ns) for parsed in files]
    if hash_n is not None:
        names = [f"t{k}" for k in range(hash_n)]
        for (_, path), parsed in zip(named, files, strict=True):
            per_file_tenant.append([names[_hash_bucket(path.name, i, hash_n)] for i in range(len(parsed.times_ns))])
    else:
        for parsed in files:
            if tenant_by not in parsed.header:
                raise TraceError(
                    f"{parsed.label}: --tenant-by column {_printable(repr(tenant_by), 60)} not found "
                    f"(has: {_printable(', '.join(parsed.header))})"
                )
            col = parsed.header.index(tenant_by)
            per_file_tenant.append([_tenant_value(row[col]) for row in parsed.raw])
    origin = min(min(parsed.times_ns) for parsed in files)
    return names, per_file_tenant, [origin] * len(files)


@dataclass
class _Rows:
    """The rows kept in the window (times relative to its start, ns), and what the rest held."""

    times_ns: list[int] = field(default_factory=list)
    tenants: list[str] = field(default_factory=list)
    prompts: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    failed: int = 0  # rows in the window with 0 output tokens, skipped
    last_rel_ns: int = 0  # the latest row of the trace, from the origin
    last_at: tuple[int, int] = (0, 0)  # (file, row) of the latest row


def _window_rows(
    files: list[_Parsed], origins: list[int], per_file_tenant: list[list[str]], start_s: float, duration_s: float | None
) -> _Rows:
    """The rows in ``[start_s, start_s + duration_s)``. Raises ``TraceError`` when none is."""
    start_ns = round(start_s * NS_PER_S)
    end_ns = None if duration_s is None else start_ns + round(duration_s * NS_PER_S)
    rows = _Rows()
    for f, (parsed, origin, tenants_of) in enumerate(zip(files, origins, per_file_tenant, strict=True)):
        outputs, prompts = parsed.outputs, parsed.prompts
        for i, t in enumerate(parsed.times_ns):
            rel = t - origin
            if rel > rows.last_rel_ns:
                rows.last_rel_ns = rel
                rows.last_at = (f, i)
            if rel < start_ns or (end_ns is not None and rel >= end_ns):
                continue
            if outputs[i] == 0:
                rows.failed += 1
                continue
            rows.times_ns.append(rel - start_ns)
            rows.tenants.append(tenants_of[i])
            rows.prompts.append(prompts[i])
            rows.outputs.append(outputs[i])
    if not rows.times_ns:
        window = f"[{start_s:g}, {'end' if duration_s is None else f'{start_s + duration_s:g}'}) s"
        extra = f" ({rows.failed} failed rows skipped)" if rows.failed else ""
        raise TraceError(f"{', '.join(p.label for p in files)}: no requests in window {window}{extra}")
    return rows


def _replay_ns(
    files: list[_Parsed],
    spec: _Format,
    rows: _Rows,
    tenant_by: str,
    speedup: float,
    start_s: float,
    duration_s: float | None,
) -> int:
    """The workload's duration (ns), checked against ``MAX_REPLAY_SECONDS`` before anything goes into int64.
    Raises ``TraceError`` naming the latest row (with ``duration_s=None``) or the options."""
    start_ns = round(start_s * NS_PER_S)
    if duration_s is not None:
        replay_ns = round(duration_s * NS_PER_S) / speedup
        if replay_ns > _MAX_REPLAY_NS:
            raise TraceError(
                f"--duration {duration_s:g} at --speedup {speedup:g} is "
                f"{_years(replay_ns / NS_PER_S)} of replay, above the cap of 10 years"
            )
        return round(replay_ns)
    replay_ns = (rows.last_rel_ns - start_ns) / speedup
    if replay_ns > _MAX_REPLAY_NS:
        f, i = rows.last_at
        parsed = files[f]
        ts = parsed.raw[i][parsed.header.index(spec.time)]
        oi = min(range(len(parsed.times_ns)), key=parsed.times_ns.__getitem__)
        of = f
        if tenant_by != "file":  # shared clock: the earliest row over all files
            of = min(range(len(files)), key=lambda k: min(files[k].times_ns))
            oi = min(range(len(files[of].times_ns)), key=files[of].times_ns.__getitem__)
        first = files[of]
        where = f"line {first.lines[oi]}" if of == f else f"{first.label} line {first.lines[oi]}"
        raise TraceError(
            f"{parsed.label}: line {parsed.lines[i]}: column {spec.time!r}: timestamp {_one_line(ts)} is "
            f"{_years(rows.last_rel_ns / NS_PER_S)} after the earliest row ({where}); replaying from --start "
            f"{start_s:g} to it at --speedup {speedup:g} would take {_years(replay_ns / NS_PER_S)}, "
            f"above the cap of 10 years (use --duration, or fix the timestamp)"
        )
    return round(replay_ns) + 1


def _build(
    names: list[str], rows: _Rows, speedup: float, duration_ns: int, rows_read: int
) -> tuple[Workload, TraceSummary]:
    """The workload of the kept rows, and its summary."""
    # Every kept time is inside the window, so every arrival is at most ~10 years in ns: int64 is safe.
    # Trace times before ``speedup`` may not fit in int64 (speedup up to 1e6), hence float64 here.
    if speedup == 1:
        arrival = np.asarray(rows.times_ns, dtype=np.int64)
    else:
        arrival = np.rint(np.asarray(rows.times_ns, dtype=np.float64) / speedup).astype(np.int64)
    duration_ns = max(duration_ns, int(arrival.max()) + 1, 1)
    index_of = {name: k for k, name in enumerate(names)}
    tenant_idx = np.fromiter((index_of[t] for t in rows.tenants), dtype=np.int64, count=len(rows.tenants))
    prompt = np.asarray(rows.prompts, dtype=np.int64)
    output = np.asarray(rows.outputs, dtype=np.int64)
    columns = []
    for k in range(len(names)):
        mask = tenant_idx == k
        if mask.any():
            columns.append((arrival[mask], k, prompt[mask], output[mask]))
    workload = merge(list(names), columns, duration_ns)
    workload.check()
    counts = np.bincount(tenant_idx, minlength=len(names))
    summary = TraceSummary(
        tenants=tuple(names),
        requests={name: int(counts[k]) for k, name in enumerate(names)},
        skipped_failed=rows.failed,
        rows_read=rows_read,
        span_s=(max(rows.times_ns) - min(rows.times_ns)) / NS_PER_S,
        duration_s=duration_ns / NS_PER_S,
        mean_prompt_tokens=float(prompt.mean()),
        mean_output_tokens=float(output.mean()),
    )
    return workload, summary


__all__ = [
    "FORMATS",
    "MAX_BURSTGPT_SECONDS",
    "MAX_HASH_TENANTS",
    "MAX_REPLAY_SECONDS",
    "MAX_SPEEDUP",
    "MAX_TOKENS_PER_REQUEST",
    "MAX_TRACE_BYTES",
    "MAX_WINDOW_SECONDS",
    "MIN_SPEEDUP",
    "TraceError",
    "TraceRow",
    "TraceSummary",
    "read_trace",
    "trace_workload",
]

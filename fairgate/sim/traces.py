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

Rows whose output token count is 0 are failed requests (BurstGPT logs them: 1,538 in the first week
of ``BurstGPT_1``). :func:`read_trace` returns them; :func:`trace_workload` skips them and reports how
many it skipped in :class:`TraceSummary`.

All times inside the simulator are integer nanoseconds; trace times are parsed exactly to
nanoseconds before any arithmetic, and the public float fields are seconds.
"""

from __future__ import annotations

import csv
import hashlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from functools import lru_cache
from pathlib import Path

import numpy as np

from fairgate.sim.generate import merge
from fairgate.sim.workload import Workload

NS_PER_S = 1_000_000_000


class TraceError(ValueError):
    """Bad trace input or bad loader arguments.

    ``str()`` is a one-line message that names the file and the line (``<file>: line N: <problem>``)
    or the column (``<file>: missing column 'X' (has: a, b, c)``) where that applies; errors in the
    arguments alone (``speedup``, ``start_s``, ...) name the argument instead.
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
    requests: dict[str, int] = field(default_factory=dict)
    skipped_failed: int = 0
    rows_read: int = 0
    span_s: float = 0.0
    duration_s: float = 0.0
    mean_prompt_tokens: float = 0.0
    mean_output_tokens: float = 0.0

    @property
    def total_requests(self) -> int:
        """Requests kept over all tenants."""
        return sum(self.requests.values())


# ---------------------------------------------------------------------------------------------
# Parsing


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_ONE_S = timedelta(seconds=1)
_AZURE_TIME = re.compile(
    r"\s*(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?\s*\Z")


@lru_cache(maxsize=4096)
def _epoch_seconds(whole: str, tz: str | None) -> int:
    """``YYYY-MM-DD HH:MM:SS`` at offset ``tz`` (None or ``Z`` = UTC) -> whole seconds since the epoch.
    Cached: consecutive trace rows mostly share their second."""
    dt = datetime.fromisoformat(whole)  # validates month/day/hour ranges
    if tz is None or tz == "Z":
        dt = dt.replace(tzinfo=timezone.utc)
    else:
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        dt = dt.replace(tzinfo=timezone(sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))))
    return (dt - _EPOCH) // _ONE_S


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
    """Decimal seconds (``5``, ``19440110.0``, ``1.5e3``) -> integer ns, rounded half to even."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise ValueError("not a number of seconds") from None
    if not value.is_finite():
        raise ValueError("not a finite number of seconds")
    return int((value * NS_PER_S).to_integral_value(ROUND_HALF_EVEN))


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


def _tokens(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        try:
            x = float(text)
        except ValueError:
            raise ValueError("not a number") from None
        if not (math.isfinite(x) and x.is_integer()):
            raise ValueError("not a whole number") from None
        n = int(x)
    if n < 0:
        raise ValueError("negative")
    return n


def _format(fmt: str, where: str) -> _Format:
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise TraceError(f"{where}unknown trace format {fmt!r} (known: {', '.join(FORMATS)})") from None


def _parse(path: Path, fmt: _Format) -> _Parsed:
    label = str(path)
    if not path.exists():
        raise TraceError(f"{label}: file not found")
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            try:
                header_row = next(reader, None)
                if header_row is None:
                    raise TraceError(f"{label}: empty file (no header row)")
                header = [h.strip() for h in header_row]
                index: dict[str, int] = {}
                for k, name in enumerate(header):
                    index.setdefault(name, k)
                for col in (fmt.time, fmt.prompt, fmt.output):
                    if col not in index:
                        raise TraceError(f"{label}: missing column {col!r} (has: {', '.join(header)})")
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
                    try:
                        t = parse_time(row[it])
                    except ValueError as e:
                        raise TraceError(f"{label}: line {line}: column {fmt.time!r}: "
                                         f"bad timestamp {_one_line(row[it])} ({e})") from None
                    try:
                        p = _tokens(row[ip])
                    except ValueError as e:
                        raise TraceError(f"{label}: line {line}: column {fmt.prompt!r}: "
                                         f"bad token count {_one_line(row[ip])} ({e})") from None
                    try:
                        o = _tokens(row[io])
                    except ValueError as e:
                        raise TraceError(f"{label}: line {line}: column {fmt.output!r}: "
                                         f"bad token count {_one_line(row[io])} ({e})") from None
                    parsed.lines.append(line)
                    parsed.times_ns.append(t)
                    parsed.prompts.append(p)
                    parsed.outputs.append(o)
                    parsed.raw.append(row)
            except csv.Error as e:
                raise TraceError(f"{label}: line {reader.line_num}: malformed CSV ({e})") from None
    except UnicodeDecodeError:
        raise TraceError(f"{label}: not UTF-8 text") from None
    except OSError as e:
        raise TraceError(f"{label}: cannot read ({e.strerror or e})") from None
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
        TraceError: unknown format; file not found or unreadable; missing column; a row with the wrong
            number of fields, an unparseable timestamp, or a non-numeric, fractional or negative token
            count (message names the file, line and column); no data rows.
    """
    p = Path(path)
    spec = _format(fmt, f"{p}: ")
    parsed = _parse(p, spec)
    t0 = min(parsed.times_ns)
    order = sorted(range(len(parsed.times_ns)), key=parsed.times_ns.__getitem__)
    header = parsed.header
    return [TraceRow((parsed.times_ns[i] - t0) / NS_PER_S, parsed.prompts[i], parsed.outputs[i],
                     dict(zip(header, parsed.raw[i]))) for i in order]


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


def _number(name: str, value: object, want: str, ok: Callable[[float], bool]) -> float:
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        x = math.nan
    if isinstance(value, bool) or not math.isfinite(x) or not ok(x):
        raise TraceError(f"trace_workload: {name} must be {want}, got {value!r}")
    return x


def trace_workload(paths: Sequence[str | Path], fmt: str, tenant_by: str = "file", speedup: float = 1.0,
                   start_s: float = 0.0, duration_s: float | None = None) -> tuple[Workload, TraceSummary]:
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
            - ``"hash:N"`` (N >= 1): tenants ``t0`` .. ``t{N-1}`` (all listed, in that order); row ``i``
              (0-based position among the file's data rows, in file order, failed rows included) of
              file ``F`` (base name, e.g. ``azure_llm_2023_code.csv``) goes to tenant
              ``int.from_bytes(sha256(f"{F}:{i}")[:8], "big") % N`` -- stable across runs, machines,
              windows and ``PYTHONHASHSEED``.
            - anything else: a column name (e.g. ``Model`` -> tenants ``ChatGPT``, ``GPT-4``); tenants
              are the distinct values (surrounding whitespace stripped; an empty value becomes
              ``(none)``) of the kept requests, sorted by name.

            With ``"hash:N"`` or a column, all files share one clock (their raw timestamps are taken to
            be comparable, as for the two Azure 2023 files): times are relative to the earliest row
            over all files.
        speedup: replay speed factor (> 0); 2.0 replays the trace twice as fast.
        start_s: start of the window in trace seconds (>= 0) from time 0 defined above.
        duration_s: length of the window in trace seconds (> 0), or None for "to the end of the trace".

    Rows with ``start_s <= time_s < start_s + duration_s`` are kept, shifted so the window starts at 0
    and divided by ``speedup``; arrivals are rounded to whole ns. Rows with 0 output tokens (failed
    requests) inside the window are skipped and counted in ``TraceSummary.skipped_failed``.

    ``Workload.duration_ns`` is ``round(duration_s * 1e9 / speedup)``; with ``duration_s=None`` it is
    the time from ``start_s`` to the latest row of the trace (failed rows included), divided by
    ``speedup``, plus 1 ns, so that the last row lies inside ``[0, duration_ns)``. In both cases it is
    raised, if needed, to one past the last arrival (rounding can otherwise collide).

    Returns:
        ``(workload, summary)``: the requests sorted by arrival (ties by tenant index, then file order),
        and a :class:`TraceSummary`.

    Raises:
        TraceError: any :func:`read_trace` error; unknown format; no paths; bad ``NAME=PATH`` (empty
            name, two files with the same tenant name, or a name with a ``tenant_by`` other than
            ``"file"``); a ``tenant_by`` column missing from a file (message lists its columns); bad
            ``hash:N``; ``speedup <= 0``; ``start_s < 0``; ``duration_s <= 0``; non-finite numbers; no
            requests in the window (message names the files and the window).
    """
    # --- arguments -----------------------------------------------------------------------------
    spec = _format(fmt, "trace_workload: ")
    speedup = _number("speedup", speedup, "a finite number > 0", lambda x: x > 0)
    start_s = _number("start_s", start_s, "a finite number >= 0", lambda x: x >= 0)
    if duration_s is not None:
        duration_s = _number("duration_s", duration_s, "a finite number > 0 or None", lambda x: x > 0)
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise TraceError("trace_workload: no trace files given")
    hash_n: int | None = None
    if tenant_by.startswith("hash:"):
        text = tenant_by[len("hash:"):]
        if not (text.isascii() and text.isdigit()) or int(text) < 1:
            raise TraceError(f"trace_workload: tenant_by {tenant_by!r}: N in 'hash:N' must be an integer >= 1")
        hash_n = int(text)

    named = [_split_named(item) for item in paths]
    for (name, path), item in zip(named, paths):
        if name is not None:
            if tenant_by != "file":
                raise TraceError(f"{item}: NAME=PATH names a tenant, which needs tenant_by='file' "
                                 f"(got tenant_by={tenant_by!r})")
            if not name.strip():
                raise TraceError(f"{item}: empty tenant name in NAME=PATH")

    # --- read ----------------------------------------------------------------------------------
    files = [_parse(path, spec) for _, path in named]
    if tenant_by != "file" and hash_n is None:
        for parsed in files:
            if tenant_by not in parsed.header:
                raise TraceError(f"{parsed.label}: tenant_by column {tenant_by!r} not found "
                                 f"(has: {', '.join(parsed.header)})")

    # --- tenants of every row ------------------------------------------------------------------
    per_file_tenant: list[list[str]] = []
    if tenant_by == "file":
        names: list[str] = []
        for (name, path), parsed in zip(named, files):
            tenant = name.strip() if name is not None else path.stem
            if tenant in names:
                raise TraceError(f"{parsed.label}: tenant name {tenant!r} is used by two files; "
                                 f"name them with NAME=PATH")
            names.append(tenant)
            per_file_tenant.append([tenant] * len(parsed.times_ns))
        origins = [min(parsed.times_ns) for parsed in files]
    else:
        if hash_n is not None:
            names = [f"t{k}" for k in range(hash_n)]
            for (_, path), parsed in zip(named, files):
                per_file_tenant.append([names[_hash_bucket(path.name, i, hash_n)]
                                        for i in range(len(parsed.times_ns))])
        else:
            names = []  # filled from the kept rows below
            for parsed in files:
                col = parsed.header.index(tenant_by)
                per_file_tenant.append([row[col].strip() or "(none)" for row in parsed.raw])
        origin = min(min(parsed.times_ns) for parsed in files)
        origins = [origin] * len(files)

    # --- window --------------------------------------------------------------------------------
    start_ns = round(start_s * NS_PER_S)
    end_ns = None if duration_s is None else start_ns + round(duration_s * NS_PER_S)
    kept_t: list[int] = []
    kept_tenant: list[str] = []
    kept_p: list[int] = []
    kept_o: list[int] = []
    failed = 0
    last_rel = 0
    for parsed, origin, tenants_of in zip(files, origins, per_file_tenant):
        outputs, prompts = parsed.outputs, parsed.prompts
        for i, t in enumerate(parsed.times_ns):
            rel = t - origin
            if rel > last_rel:
                last_rel = rel
            if rel < start_ns or (end_ns is not None and rel >= end_ns):
                continue
            if outputs[i] == 0:
                failed += 1
                continue
            kept_t.append(rel - start_ns)
            kept_tenant.append(tenants_of[i])
            kept_p.append(prompts[i])
            kept_o.append(outputs[i])
    if not kept_t:
        window = f"[{start_s:g}, {'end' if duration_s is None else f'{start_s + duration_s:g}'}) s"
        extra = f" ({failed} failed rows skipped)" if failed else ""
        raise TraceError(f"{', '.join(p.label for p in files)}: no requests in window {window}{extra}")

    if hash_n is None and tenant_by != "file":
        names = sorted(set(kept_tenant))
    index_of = {name: k for k, name in enumerate(names)}

    # --- build ---------------------------------------------------------------------------------
    rel_ns = np.asarray(kept_t, dtype=np.int64)
    arrival = np.rint(rel_ns / speedup).astype(np.int64) if speedup != 1 else rel_ns
    last_arrival = int(arrival.max())
    if duration_s is None:
        window_ns = last_rel - start_ns
        duration_ns = round(window_ns / speedup) + 1
    else:
        duration_ns = round(round(duration_s * NS_PER_S) / speedup)
    duration_ns = max(duration_ns, last_arrival + 1, 1)

    tenant_idx = np.fromiter((index_of[t] for t in kept_tenant), dtype=np.int64, count=len(kept_tenant))
    prompt = np.asarray(kept_p, dtype=np.int64)
    output = np.asarray(kept_o, dtype=np.int64)
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
        skipped_failed=failed,
        rows_read=sum(len(parsed.times_ns) for parsed in files),
        span_s=float(rel_ns.max() - rel_ns.min()) / NS_PER_S,
        duration_s=duration_ns / NS_PER_S,
        mean_prompt_tokens=float(prompt.mean()),
        mean_output_tokens=float(output.mean()),
    )
    return workload, summary


__all__ = ["FORMATS", "TraceError", "TraceRow", "TraceSummary", "read_trace", "trace_workload"]

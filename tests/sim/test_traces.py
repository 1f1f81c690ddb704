"""Trace loaders: real Azure 2023 / BurstGPT files (values from SOURCES.md) and every error path.

The real traces live outside the repo: ``$FAIRGATE_TRACES_DIR`` if set, else ``<repo>/../shared/data/traces``.
Tests that need them fail when the directory is absent (they are part of the contract, never skipped).
"""

from __future__ import annotations

import collections
import csv
import hashlib
import itertools
import os
from pathlib import Path

import pytest

from fairgate.sim.traces import TraceError, TraceRow, TraceSummary, read_trace, trace_workload
from tests.conftest import fairgate

REPO = Path(__file__).resolve().parents[2]
TRACES = Path(os.environ.get("FAIRGATE_TRACES_DIR") or REPO.parent / "shared" / "data" / "traces")
AZURE_CODE = TRACES / "azure_llm_2023_code.csv"
AZURE_CONV = TRACES / "azure_llm_2023_conv.csv"
BURST1 = TRACES / "burstgpt1_first7days.csv"
BURST3 = TRACES / "burstgpt3_first400.csv"


@pytest.fixture(scope="module")
def code_rows() -> list[TraceRow]:
    return read_trace(AZURE_CODE, "azure")


@pytest.fixture(scope="module")
def burst1_raw() -> list[dict[str, str]]:
    with BURST1.open(newline="") as f:
        return list(csv.DictReader(f))


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def azure_csv(tmp_path: Path, name: str, rows: list[str]) -> Path:
    return write(tmp_path, name, "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(r + "\n" for r in rows))


BURST_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def burst_csv(tmp_path: Path, name: str, rows: list[str]) -> Path:
    return write(tmp_path, name, BURST_HEADER + "".join(r + "\n" for r in rows))


# ---------------------------------------------------------------------------------------------
# Real traces: without them these tests fail (file not found), never skip


def test_read_azure_code_matches_sources(code_rows: list[TraceRow]) -> None:
    rows = code_rows
    assert len(rows) == 8819
    assert rows[0].time_s == 0.0
    assert rows[-1].time_s == pytest.approx(3435.948056, abs=1e-9)  # 18:17:03.9799600 -> 19:14:19.9280160
    assert all(a.time_s <= b.time_s for a, b in itertools.pairwise(rows))
    assert round(sum(r.output_tokens for r in rows) / len(rows), 1) == 27.9
    assert round(sum(r.prompt_tokens for r in rows) / len(rows), 1) == 2047.8
    assert min(r.output_tokens for r in rows) == 6 and max(r.output_tokens for r in rows) == 1899
    assert rows[0].prompt_tokens == 4808 and rows[0].output_tokens == 10
    assert rows[0].fields == {
        "TIMESTAMP": "2023-11-16 18:17:03.9799600",
        "ContextTokens": "4808",
        "GeneratedTokens": "10",
    }
    assert rows[1].time_s == pytest.approx(0.052, abs=1e-12)  # 7th fractional digit kept


def test_azure_code_workload(code_rows: list[TraceRow]) -> None:
    w, s = trace_workload([AZURE_CODE], "azure")
    w.check()
    assert w.tenants == ["azure_llm_2023_code"]
    assert len(w) == 8819 and s.requests == {"azure_llm_2023_code": 8819} and s.total_requests == 8819
    assert s.skipped_failed == 0 and s.rows_read == 8819
    assert s.span_s == pytest.approx(3435.948056, abs=1e-9)
    assert w.arrival_ns[0] == 0 and w.arrival_ns[-1] == 3_435_948_056_000
    assert w.duration_ns == 3_435_948_056_001  # to the end of the trace: last row + 1 ns
    assert s.duration_s == pytest.approx(3435.948056001)
    assert round(s.mean_output_tokens, 1) == 27.9 and round(s.mean_prompt_tokens, 1) == 2047.8
    assert w.prompt_tokens == [r.prompt_tokens for r in code_rows]
    assert w.output_tokens == [r.output_tokens for r in code_rows]


def test_burstgpt1_by_model(burst1_raw: list[dict[str, str]]) -> None:
    total = collections.Counter(r["Model"] for r in burst1_raw)
    failed = collections.Counter(r["Model"] for r in burst1_raw if int(r["Response tokens"]) == 0)
    assert total == {"ChatGPT": 12845, "GPT-4": 6586}  # SOURCES.md
    assert sum(failed.values()) == 1538  # SOURCES.md

    w, s = trace_workload([str(BURST1)], "burstgpt", tenant_by="Model")
    w.check()
    assert w.tenants == ["ChatGPT", "GPT-4"]
    assert s.requests == {"ChatGPT": 12845 - failed["ChatGPT"], "GPT-4": 6586 - failed["GPT-4"]}
    assert s.requests == {"ChatGPT": 11957, "GPT-4": 5936}
    assert s.skipped_failed == 1538 and s.rows_read == 19431
    assert collections.Counter(w.tenant_index) == {0: 11957, 1: 5936}
    assert min(w.output_tokens) >= 1
    assert round(s.mean_prompt_tokens, 1) == 682.8 and round(s.mean_output_tokens, 1) == 264.4  # non-failed
    assert s.span_s == 604753.0  # Timestamp 5 -> 604758
    assert w.arrival_ns[0] == 0 and w.duration_ns == 604_753 * 10**9 + 1


def test_burstgpt3_columns_and_failed_row() -> None:
    rows = read_trace(BURST3, "burstgpt")
    assert len(rows) == 400
    assert rows[-1].time_s == 41453.0  # 19,440,110 -> 19,481,563
    assert [r.fields["Timestamp"] for r in rows if r.output_tokens == 0] == ["19473253.0"]
    assert set(rows[0].fields) == {
        "Timestamp",
        "Session ID",
        "Elapsed time",
        "Model",
        "Request tokens",
        "Response tokens",
        "Total tokens",
        "Log Type",
    }
    assert collections.Counter(r.fields["Model"] for r in rows) == {"ChatGPT": 305, "GPT-4": 95}

    w, s = trace_workload([BURST3], "burstgpt", tenant_by="Log Type")
    assert w.tenants == ["API log", "Conversation log"]
    assert s.requests == {"API log": 6, "Conversation log": 393} and s.skipped_failed == 1


def test_window_and_speedup_on_real_slice(code_rows: list[TraceRow]) -> None:
    start, length, speedup = 600.0, 120.0, 4.0
    inside = [r for r in code_rows if start <= r.time_s < start + length]
    w, s = trace_workload([AZURE_CODE], "azure", start_s=start, duration_s=length, speedup=speedup)
    w.check()
    assert len(w) == len(inside) > 100
    assert w.duration_ns == 30 * 10**9  # 120 s / 4
    for got, row in zip(w.arrival_ns, inside, strict=False):
        assert got == pytest.approx((row.time_s - start) / speedup * 1e9, abs=1)
    assert w.prompt_tokens == [r.prompt_tokens for r in inside]
    assert s.span_s == pytest.approx(inside[-1].time_s - inside[0].time_s, abs=1e-9)
    assert s.duration_s == 30.0

    # Open-ended window: to the end of the trace, + 1 ns.
    w2, _s2 = trace_workload([AZURE_CODE], "azure", start_s=3000.0, speedup=2.0)
    tail = [r for r in code_rows if r.time_s >= 3000.0]
    assert len(w2) == len(tail)
    assert w2.duration_ns == round((3435.948056 - 3000.0) / 2 * 1e9) + 1
    assert w2.arrival_ns[-1] == w2.duration_ns - 1


def test_burstgpt_window_counts_failed_rows_inside_it() -> None:
    rows = read_trace(BURST1, "burstgpt")
    day = 86400.0
    inside = [r for r in rows if day <= r.time_s < 2 * day]
    w, s = trace_workload([BURST1], "burstgpt", start_s=day, duration_s=day, speedup=24.0)
    assert s.skipped_failed == sum(r.output_tokens == 0 for r in inside) > 0
    assert len(w) == sum(r.output_tokens > 0 for r in inside)
    assert w.duration_ns == 3600 * 10**9


def test_hash_tenants_spread_and_stable(code_rows: list[TraceRow]) -> None:
    w, s = trace_workload([AZURE_CODE], "azure", tenant_by="hash:4")
    assert w.tenants == ["t0", "t1", "t2", "t3"]
    assert sum(s.requests.values()) == 8819
    assert all(n > 8819 * 0.2 for n in s.requests.values()), s.requests
    again, _ = trace_workload([AZURE_CODE], "azure", tenant_by="hash:4")
    assert again.tenant_index == w.tenant_index

    # The documented formula: sha256(f"{file name}:{row index}")[:8] % N (the file is in time order).
    def bucket(i: int) -> int:
        return int.from_bytes(hashlib.sha256(f"{AZURE_CODE.name}:{i}".encode()).digest()[:8], "big") % 4

    expected = sorted((round(r.time_s * 1e9), bucket(i)) for i, r in enumerate(code_rows))
    assert sorted(zip(w.arrival_ns, w.tenant_index, strict=False)) == expected

    # A row keeps its tenant when a window cuts the trace.
    win, _ = trace_workload([AZURE_CODE], "azure", tenant_by="hash:4", start_s=1100.0, duration_s=50.0)
    first = next(i for i, r in enumerate(code_rows) if r.time_s >= 1100.0)
    assert win.tenant_index[0] == bucket(first)


def test_two_real_files_side_by_side() -> None:
    w, s = trace_workload([f"code={AZURE_CODE}", AZURE_CONV], "azure")
    assert w.tenants == ["code", "azure_llm_2023_conv"]
    assert s.requests == {"code": 8819, "azure_llm_2023_conv": 19366}
    firsts = {k: next(a for a, t in zip(w.arrival_ns, w.tenant_index, strict=False) if t == k) for k in (0, 1)}
    assert firsts == {0: 0, 1: 0}  # each file starts at its own first row
    assert w.duration_ns == 3_501_721_937_001  # the longer file (conv, 3,501.7 s) + 1 ns


def test_real_loads_are_fast() -> None:
    import time

    t = time.perf_counter()
    trace_workload([AZURE_CONV], "azure")
    assert time.perf_counter() - t < 1.0


# ---------------------------------------------------------------------------------------------
# Synthetic files: semantics


def test_read_sorts_stably_and_parses_time_variants(tmp_path: Path) -> None:
    path = azure_csv(
        tmp_path,
        "a.csv",
        [
            "2023-11-16 18:00:02.5,10,1",
            "2023-11-16 18:00:01,20,2",
            "2023-11-16T19:00:02.500000000+01:00,30,3",  # same instant as the first row
            "2023-11-16 18:00:01.0000001Z,40,0",
            "",  # blank lines are ignored
        ],
    )
    rows = read_trace(path, "azure")
    assert [r.prompt_tokens for r in rows] == [20, 40, 10, 30]
    assert [r.time_s for r in rows] == [0.0, pytest.approx(1e-7, abs=1e-15), 1.5, 1.5]
    assert rows[1].output_tokens == 0  # failed rows are returned by read_trace


def test_burstgpt_decimal_seconds(tmp_path: Path) -> None:
    path = burst_csv(tmp_path, "b.csv", ["100.25,ChatGPT,5,6,11,API log", "1e2,GPT-4,0,3,3,API log"])
    rows = read_trace(path, "burstgpt")
    assert [r.time_s for r in rows] == [0.0, 0.25]
    assert rows[0].prompt_tokens == 0  # prompt 0 is fine


def test_column_tenants_share_one_clock(tmp_path: Path) -> None:
    a = burst_csv(tmp_path, "a.csv", ["10,GPT-4,1,1,2,x", "12,ChatGPT,1,0,1,x"])
    b = burst_csv(tmp_path, "b.csv", ["11,ChatGPT,2,2,4,x", "13.5,GPT-4,3,3,6,x"])
    w, s = trace_workload([a, b], "burstgpt", tenant_by="Model")
    assert w.tenants == ["ChatGPT", "GPT-4"]
    assert w.arrival_ns == [0, 1 * 10**9, 3_500_000_000]
    assert w.tenant_index == [1, 0, 1]
    assert s.requests == {"ChatGPT": 1, "GPT-4": 2} and s.skipped_failed == 1
    assert w.duration_ns == 3_500_000_001

    # With tenant_by="file" each file starts at 0.
    w, s = trace_workload([a, f"second={b}"], "burstgpt")
    assert w.tenants == ["a", "second"]
    assert w.arrival_ns == [0, 0, 2_500_000_000] and w.tenant_index == [0, 1, 1]


def test_empty_column_value_and_ties(tmp_path: Path) -> None:
    a = write(
        tmp_path,
        "s.csv",
        "Timestamp,Session ID,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "0,,ChatGPT,1,1,2,API log\n0,abc,ChatGPT,1,1,2,Conversation log\n",
    )
    w, _s = trace_workload([a], "burstgpt", tenant_by="Session ID")
    assert w.tenants == ["(none)", "abc"] and w.arrival_ns == [0, 0] and w.tenant_index == [0, 1]
    assert w.duration_ns == 1


def test_window_rounding_keeps_arrivals_inside_duration(tmp_path: Path) -> None:
    path = burst_csv(tmp_path, "r.csv", ["0,m,1,1,2,x", "0.000999999,m,1,1,2,x"])
    w, _ = trace_workload([path], "burstgpt", speedup=1e6, duration_s=0.001)
    assert w.arrival_ns == [0, 1] and w.duration_ns == 2  # 1 ms / 1e6 = 1 ns, raised to last arrival + 1
    w.check()


def test_summary_type(tmp_path: Path) -> None:
    path = azure_csv(tmp_path, "s.csv", ["2023-01-01 00:00:00,1,2", "2023-01-01 00:00:04,3,4"])
    _, s = trace_workload([path], "azure", speedup=2.0)
    assert isinstance(s, TraceSummary)
    assert (s.tenants, s.requests, s.rows_read, s.skipped_failed) == (("s",), {"s": 2}, 2, 0)
    assert (s.span_s, s.duration_s) == (4.0, 2.000000001)  # 4 trace s at 2x; ends 1 ns after the last arrival
    assert (s.mean_prompt_tokens, s.mean_output_tokens) == (2.0, 3.0)


# ---------------------------------------------------------------------------------------------
# Errors: one-line TraceError naming the file and line/column


def raises(fn, *args, **kwargs) -> str:
    with pytest.raises(TraceError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert isinstance(info.value, ValueError)
    return message


def test_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nope.csv"
    assert raises(read_trace, missing, "azure") == f"{missing}: file not found"
    assert raises(trace_workload, [missing], "azure") == f"{missing}: file not found"


def test_unknown_format(tmp_path: Path) -> None:
    path = azure_csv(tmp_path, "a.csv", ["2023-01-01 00:00:00,1,1"])
    assert raises(read_trace, path, "mooncake") == f"{path}: unknown trace format 'mooncake' (known: azure, burstgpt)"
    assert "unknown trace format 'Azure'" in raises(trace_workload, [path], "Azure")


def test_missing_column(tmp_path: Path) -> None:
    path = write(tmp_path, "m.csv", "TIMESTAMP,ContextTokens\n2023-01-01 00:00:00,1\n")
    assert (
        raises(read_trace, path, "azure") == f"{path}: missing column 'GeneratedTokens' (has: TIMESTAMP, ContextTokens)"
    )
    path = write(tmp_path, "b.csv", "Timestamp,Model,Request tokens\n1,m,2\n")
    assert (
        raises(read_trace, path, "burstgpt")
        == f"{path}: missing column 'Response tokens' (has: Timestamp, Model, Request tokens)"
    )


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ("2023-01-01 00:00:01,abc,1", "column 'ContextTokens': bad token count 'abc' (not a number)"),
        ("2023-01-01 00:00:01,,1", "column 'ContextTokens': bad token count '' (not a number)"),
        ("2023-01-01 00:00:01,-3,1", "column 'ContextTokens': bad token count '-3' (negative)"),
        ("2023-01-01 00:00:01,3,-1", "column 'GeneratedTokens': bad token count '-1' (negative)"),
        ("2023-01-01 00:00:01,3,1.5", "column 'GeneratedTokens': bad token count '1.5' (not a whole number)"),
        ("2023-01-01 00:00:01,3,nan", "column 'GeneratedTokens': bad token count 'nan' (not a whole number)"),
        ("yesterday,3,1", "column 'TIMESTAMP': bad timestamp 'yesterday'"),
        ("2023-11-16 18:17:03.97x,3,1", "column 'TIMESTAMP': bad timestamp"),
        ("2023-13-16 18:17:03.9799600,3,1", "column 'TIMESTAMP': bad timestamp"),
        ("1700000000,3,1", "column 'TIMESTAMP': bad timestamp"),
        ("2023-01-01 00:00:01,3", "2 fields, header has 3"),
    ],
)
def test_bad_azure_row_names_line(tmp_path: Path, row: str, problem: str) -> None:
    path = azure_csv(tmp_path, "bad.csv", ["2023-01-01 00:00:00,1,1", "", row])  # header line 1, blank line 3
    message = raises(read_trace, path, "azure")
    assert message.startswith(f"{path}: line 4: ")
    assert problem in message
    assert raises(trace_workload, [path], "azure") == message


# Per format: its file writer, a row's fields after the timestamp, and the timestamp column's name.
TIMESTAMP_ROWS = {"burstgpt": (burst_csv, ",m,1,1,2,x", "Timestamp"), "azure": (azure_csv, ",1,1", "TIMESTAMP")}


@pytest.mark.parametrize(
    ("fmt", "value", "problem"),
    [
        ("burstgpt", "abc", "not a number of seconds"),
        ("burstgpt", "", "not a number"),
        ("burstgpt", "inf", "not a finite number"),
        ("burstgpt", "NaN", "not a finite number"),
        ("azure", "2023-11-16 18:17:03+00:99", "bad UTC offset +00:99"),
        ("azure", "2023-11-16 18:17:03+24:00", "bad UTC offset +24:00"),
        ("azure", "0000-01-01 00:00:00", "bad timestamp '0000-01-01 00:00:00'"),
    ],
)
def test_bad_timestamp(tmp_path: Path, fmt: str, value: str, problem: str) -> None:
    write_csv, rest, column = TIMESTAMP_ROWS[fmt]
    path = write_csv(tmp_path, "bad.csv", [value + rest])
    message = raises(read_trace, path, fmt)
    assert message.startswith(f"{path}: line 2: column '{column}': bad timestamp ")
    assert problem in message


def test_long_bad_value_is_truncated(tmp_path: Path) -> None:
    path = burst_csv(tmp_path, "long.csv", ["1,m," + "x" * 500 + ",1,2,y"])
    message = raises(read_trace, path, "burstgpt")
    assert message.startswith(f"{path}: line 2: column 'Request tokens'") and len(message) < 200 + len(str(path))


def test_empty_trace(tmp_path: Path) -> None:
    empty = write(tmp_path, "empty.csv", "")
    assert raises(read_trace, empty, "azure") == f"{empty}: empty file (no header row)"
    header_only = azure_csv(tmp_path, "header.csv", ["", ""])
    assert raises(read_trace, header_only, "azure") == f"{header_only}: no data rows (header only)"
    assert raises(trace_workload, [header_only], "azure") == f"{header_only}: no data rows (header only)"


def test_unreadable_file(tmp_path: Path) -> None:
    folder = tmp_path / "dir.csv"
    folder.mkdir()
    assert raises(read_trace, folder, "azure") == f"{folder}: is a directory, not a trace file"
    binary = tmp_path / "bin.csv"
    binary.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n\xff\xfe,1,1\n")
    assert raises(read_trace, binary, "azure") == f"{binary}: not UTF-8 text"


def test_empty_window(tmp_path: Path) -> None:
    path = burst_csv(tmp_path, "w.csv", ["0,m,1,1,2,x", "10,m,1,0,1,x", "20,m,1,1,2,x"])
    assert raises(trace_workload, [path], "burstgpt", start_s=30.0) == f"{path}: no requests in window [30, end) s"
    assert (
        raises(trace_workload, [path], "burstgpt", start_s=1.0, duration_s=5.0)
        == f"{path}: no requests in window [1, 6) s"
    )
    # Only a failed row in the window: still empty, and the skipped row is reported.
    assert (
        raises(trace_workload, [path], "burstgpt", start_s=5.0, duration_s=10.0)
        == f"{path}: no requests in window [5, 15) s (1 failed rows skipped)"
    )


@pytest.mark.parametrize(
    "spec",
    [
        "hash:",
        "hash:0",
        "hash:-1",
        "hash:x",
        "hash:2.5",
        "hash: 3",
        "hash:10001",
        "hash:100000000",
        "hash:" + "9" * 5000,
    ],
)
def test_bad_hash_spec(tmp_path: Path, spec: str) -> None:
    import time

    path = burst_csv(tmp_path, "h.csv", ["0,m,1,1,2,x"])
    t = time.perf_counter()
    message = raises(trace_workload, [path], "burstgpt", tenant_by=spec)
    assert time.perf_counter() - t < 1.0  # hash:100000000 used to build 1e8 tenants (> 60 s)
    shown = repr(spec) if len(repr(spec)) <= 60 else repr(spec)[:60] + "..."
    assert message == f"--tenant-by {shown}: N in hash:N must be a whole number from 1 to 10000"


def test_hash_spec_at_the_cap(tmp_path: Path) -> None:
    path = burst_csv(tmp_path, "h.csv", ["0,m,1,1,2,x", "1,m,1,1,2,x"])
    w, s = trace_workload([path], "burstgpt", tenant_by="hash:10000")
    assert len(w.tenants) == 10_000 and w.tenants[-1] == "t9999" and s.total_requests == 2


SPEEDUP_RANGE = "must be between 0.001 and 1000000"
START_RANGE = "must be between 0 and 1e10 (seconds of trace time)"
DURATION_RANGE = "must be above 0 and at most 1e10 (seconds of trace time)"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"speedup": 0}, f"--speedup 0: {SPEEDUP_RANGE}"),
        ({"speedup": -2.0}, f"--speedup -2.0: {SPEEDUP_RANGE}"),
        ({"speedup": float("nan")}, f"--speedup nan: {SPEEDUP_RANGE}"),
        ({"speedup": float("inf")}, f"--speedup inf: {SPEEDUP_RANGE}"),
        ({"speedup": 1e-300}, f"--speedup 1e-300: {SPEEDUP_RANGE}"),  # used to overflow
        ({"speedup": 1e-6}, f"--speedup 1e-06: {SPEEDUP_RANGE}"),  # used to give arrivals past int64
        ({"speedup": 0.000999}, f"--speedup 0.000999: {SPEEDUP_RANGE}"),
        ({"speedup": 1e6 + 1}, f"--speedup 1000001.0: {SPEEDUP_RANGE}"),
        ({"speedup": 10**400}, f"--speedup <1329-bit integer>: {SPEEDUP_RANGE}"),
        ({"speedup": True}, f"--speedup True: {SPEEDUP_RANGE}"),
        ({"speedup": "fast"}, f"--speedup 'fast': {SPEEDUP_RANGE}"),
        ({"start_s": -1.0}, f"--start -1.0: {START_RANGE}"),
        ({"start_s": 1e10 + 1e3}, f"--start 10000001000.0: {START_RANGE}"),
        ({"start_s": float("inf")}, f"--start inf: {START_RANGE}"),
        ({"start_s": float("nan")}, f"--start nan: {START_RANGE}"),
        ({"duration_s": 0.0}, f"--duration 0.0: {DURATION_RANGE}"),
        ({"duration_s": -5}, f"--duration -5: {DURATION_RANGE}"),
        ({"duration_s": float("inf")}, f"--duration inf: {DURATION_RANGE}"),
        ({"duration_s": 1e300}, f"--duration 1e+300: {DURATION_RANGE}"),
        ({"tenant_by": None}, "--tenant-by None: must be file, a column name or hash:N"),
        (
            {"tenant_by": "model"},
            "{path}: --tenant-by column 'model' not found (has: Timestamp, Model, Request tokens, Response tokens, "
            "Total tokens, Log Type)",
        ),
        ({"duration_s": 1e10}, "--duration 1e+10 at --speedup 1 is 317 years of replay, above the cap of 10 years"),
        (
            {"duration_s": 1e6, "speedup": 1e-3},
            "--duration 1e+06 at --speedup 0.001 is 31.7 years of replay, above the cap of 10 years",
        ),
    ],
)
def test_bad_window_arguments(tmp_path: Path, kwargs: dict, message: str) -> None:
    path = burst_csv(tmp_path, "a.csv", ["0,m,1,1,2,x"])
    assert raises(trace_workload, [path], "burstgpt", **kwargs) == message.format(path=path)


def test_bad_names(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    a = burst_csv(tmp_path, "a.csv", ["0,m,1,1,2,x"])
    a2 = burst_csv(tmp_path / "x", "a.csv", ["0,m,1,1,2,x"])
    assert (
        raises(trace_workload, [a, a2], "burstgpt")
        == f"{a2}: tenant name 'a' is used by two files; name them with NAME=PATH"
    )
    assert raises(trace_workload, [f"={a}"], "burstgpt") == f"={a}: empty tenant name in NAME=PATH"
    assert (
        raises(trace_workload, [f"n={a}"], "burstgpt", tenant_by="Model")
        == f"n={a}: NAME=PATH names a tenant, which needs --tenant-by file (got --tenant-by 'Model')"
    )
    assert raises(trace_workload, [], "burstgpt") == "trace_workload: no trace files given"
    w, _ = trace_workload([f"one={a}", f"two={a2}"], "burstgpt")
    assert w.tenants == ["one", "two"]


def test_argument_bounds_are_inclusive(tmp_path: Path) -> None:
    path = burst_csv(tmp_path, "a.csv", ["0,m,1,1,2,x", "1,m,1,1,2,x"])
    w, _ = trace_workload([path], "burstgpt", speedup=1e-3)
    assert w.arrival_ns == [0, 1000 * 10**9] and w.duration_ns == 1000 * 10**9 + 1
    w, _ = trace_workload([path], "burstgpt", speedup=1e6)
    assert w.arrival_ns == [0, 1000]
    assert raises(trace_workload, [path], "burstgpt", start_s=1e10) == f"{path}: no requests in window [1e+10, end) s"
    w, _ = trace_workload([path], "burstgpt", speedup=1e6, duration_s=1e10)  # 1e4 s of replay
    assert w.duration_ns == 10**13


def test_bad_paths_argument(tmp_path: Path) -> None:
    assert raises(trace_workload, [5], "azure") == "trace_workload: a trace file must be a str or Path, got 5"
    assert raises(trace_workload, 5, "azure") == "trace_workload: paths must be a list of files, got 5"
    assert raises(read_trace, None, "azure") == "read_trace: the trace file must be a str or Path, got None"


# ---------------------------------------------------------------------------------------------
# QA: inputs that used to crash, hang or give garbage


@pytest.mark.parametrize(
    ("row", "column", "value"),
    [
        ("2023-11-16 18:17:03,5,99999999999999999999", "GeneratedTokens", "'99999999999999999999'"),
        ("2023-11-16 18:17:03,1e300,5", "ContextTokens", "'1e300'"),
        ("2023-11-16 18:17:03,10000001,5", "ContextTokens", "'10000001'"),
        ("2023-11-16 18:17:03,5,1e400", "GeneratedTokens", "'1e400'"),  # float inf
        ("2023-11-16 18:17:03,5," + "9" * 5000, "GeneratedTokens", "'" + "9" * 40 + "...'"),  # > int digit limit
    ],
)
def test_token_count_above_the_cap(tmp_path: Path, row: str, column: str, value: str) -> None:
    path = azure_csv(tmp_path, "big.csv", ["2023-11-16 18:17:00,1,1", row])
    message = f"{path}: line 3: column {column!r}: bad token count {value} (above the cap of 10000000)"
    assert raises(read_trace, path, "azure") == message
    assert raises(trace_workload, [path], "azure") == message


def test_token_count_at_the_cap(tmp_path: Path) -> None:
    from fairgate.sim.traces import MAX_TOKENS_PER_REQUEST

    assert MAX_TOKENS_PER_REQUEST == 10_000_000
    path = azure_csv(tmp_path, "cap.csv", ["2023-11-16 18:17:03,10000000,1e7"])
    w, _s = trace_workload([path], "azure")
    assert w.prompt_tokens == [10_000_000] and w.output_tokens == [10_000_000]
    assert raises(read_trace, azure_csv(tmp_path, "neg.csv", ["2023-11-16 18:17:03,-1e400,1"]), "azure").endswith(
        "bad token count '-1e400' (negative)"
    )


@pytest.mark.parametrize("value", ["1e12", "100000000000.000000001", "-1", "-0.5", "1e999999999", "-1e999999999"])
def test_burstgpt_timestamp_out_of_range(tmp_path: Path, value: str) -> None:
    path = burst_csv(tmp_path, "t.csv", ["0,m,1,1,2,x", f"{value},m,1,1,2,x"])
    message = f"{path}: line 3: column 'Timestamp': bad timestamp {value!r} (outside 0 .. 1e11 seconds)"
    assert raises(read_trace, path, "burstgpt") == message  # 1e999999999 used to raise decimal.Overflow
    assert raises(trace_workload, [path], "burstgpt") == message


def test_burstgpt_span_above_ten_years(tmp_path: Path) -> None:
    path = burst_csv(tmp_path, "t.csv", ["0,m,1,1,2,x", "1e10,m,1,1,2,x"])
    assert read_trace(path, "burstgpt")[-1].time_s == 1e10  # reading alone is fine
    assert raises(trace_workload, [path], "burstgpt") == (
        f"{path}: line 3: column 'Timestamp': timestamp '1e10' is 317 years after the earliest row (line 2); "
        f"replaying from --start 0 to it at --speedup 1 would take 317 years, above the cap of 10 years "
        f"(use --duration, or fix the timestamp)"
    )
    # A window that leaves the far row out replays fine; so does a speedup that brings it under 10 years.
    w, _ = trace_workload([path], "burstgpt", duration_s=100.0)
    assert w.arrival_ns == [0] and w.duration_ns == 100 * 10**9
    w, _ = trace_workload([path], "burstgpt", speedup=1e6)  # 1e10 s = 1e19 ns of trace time > int64
    assert w.arrival_ns == [0, 10**13] and w.duration_ns == 10**13 + 1


def test_burstgpt_largest_timestamp_replays_exactly(tmp_path: Path) -> None:
    path = burst_csv(tmp_path, "t.csv", ["0,m,1,1,2,x", "1e11,m,1,1,2,x", "1e11,m,1,1,2,x"])
    w, s = trace_workload([path], "burstgpt", speedup=1e6)
    assert w.arrival_ns == [0, 10**14, 10**14] and s.span_s == 1e11


def test_azure_span_above_ten_years(tmp_path: Path) -> None:
    path = azure_csv(tmp_path, "t.csv", ["0001-01-01 00:00:00-05:00,1,1", "9999-12-31 23:59:59,1,1"])
    assert raises(trace_workload, [path], "azure") == (
        f"{path}: line 3: column 'TIMESTAMP': timestamp '9999-12-31 23:59:59' is 9,999 years after the "
        f"earliest row (line 2); replaying from --start 0 to it at --speedup 1 would take 9,999 years, above "
        f"the cap of 10 years (use --duration, or fix the timestamp)"
    )
    # Slowed down, an otherwise fine 4-year trace exceeds the cap too.
    four = azure_csv(tmp_path, "four.csv", ["2020-01-01 00:00:00,1,1", "2024-01-01 00:00:00,1,1"])
    assert raises(trace_workload, [four], "azure", speedup=0.25) == (
        f"{four}: line 3: column 'TIMESTAMP': timestamp '2024-01-01 00:00:00' is 4 years after the earliest row "
        f"(line 2); replaying from --start 0 to it at --speedup 0.25 would take 16 years, above the cap of "
        f"10 years (use --duration, or fix the timestamp)"
    )
    w, _ = trace_workload([four], "azure", speedup=0.5)  # 8 years: fine
    assert w.arrival_ns == [0, 8 * 315_576_000 // 10 * 10**9]
    w, _ = trace_workload([four], "azure", speedup=0.25, start_s=3 * 365 * 86400)  # window leaves row 1 out
    assert len(w) == 1


def test_span_error_names_the_earliest_row_of_another_file(tmp_path: Path) -> None:
    a = burst_csv(tmp_path, "a.csv", ["5,m,1,1,2,x"])
    b = burst_csv(tmp_path, "b.csv", ["6,m,1,1,2,x", "9e9,m,1,0,0,x"])  # the far row is a failed one
    assert raises(trace_workload, [a, b], "burstgpt", tenant_by="Model") == (
        f"{b}: line 3: column 'Timestamp': timestamp '9e9' is 285 years after the earliest row ({a} line 2); "
        f"replaying from --start 0 to it at --speedup 1 would take 285 years, above the cap of 10 years "
        f"(use --duration, or fix the timestamp)"
    )


def test_duration_of_exactly_ten_years_of_replay(tmp_path: Path) -> None:
    path = burst_csv(tmp_path, "d.csv", ["0,m,1,1,2,x"])  # above ten years: test_bad_window_arguments
    w, _ = trace_workload([path], "burstgpt", duration_s=315_576_000.0)  # exactly 10 years
    assert w.duration_ns == 315_576_000 * 10**9


def test_azure_extreme_years_read(tmp_path: Path) -> None:
    path = azure_csv(tmp_path, "y.csv", ["0001-01-01 00:00:00+05:00,1,1", "9999-12-31 23:59:59-05:00,1,1"])
    rows = read_trace(path, "azure")
    assert rows[-1].time_s > 3.15e11


@pytest.mark.parametrize(
    ("header", "column"),
    [
        ("TIMESTAMP,ContextTokens,GeneratedTokens,GeneratedTokens", "GeneratedTokens"),
        ("TIMESTAMP, ContextTokens ,ContextTokens,GeneratedTokens", "ContextTokens"),  # equal once stripped
        ("TIMESTAMP,ContextTokens,GeneratedTokens,Note,Note", "Note"),  # any column, not only the used ones
        ("TIMESTAMP,ContextTokens,GeneratedTokens,,", ""),
    ],
)
def test_duplicate_header_column(tmp_path: Path, header: str, column: str) -> None:
    width = header.count(",") + 1
    path = write(tmp_path, "dup.csv", header + "\n2023-11-16 18:17:03,1,2" + ",3" * (width - 3) + "\n")
    message = f"{path}: duplicate column {column!r} in the header"
    assert raises(read_trace, path, "azure") == message
    assert raises(trace_workload, [path], "azure") == message


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    import threading

    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    fifo = tmp_path / "trace.csv"
    os.mkfifo(fifo)

    def unblock() -> None:  # only matters if the loader wrongly opens the FIFO: then the test fails, not hangs
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass

    timer = threading.Timer(5.0, unblock)
    timer.start()
    try:
        assert raises(read_trace, fifo, "azure") == f"{fifo}: not a regular file"
        assert raises(trace_workload, [fifo], "azure") == f"{fifo}: not a regular file"
    finally:
        timer.cancel()


def test_device_is_refused() -> None:
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    assert raises(read_trace, "/dev/zero", "azure") == "/dev/zero: not a regular file"
    assert raises(trace_workload, ["/dev/null"], "burstgpt") == "/dev/null: not a regular file"


def test_file_above_two_gib_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.csv"
    with big.open("wb") as f:
        f.truncate(2 * 1024**3 + 1)  # sparse: no disk space used
    assert raises(read_trace, big, "azure") == f"{big}: too large (2,147,483,649 bytes; the cap is 2 GiB)"


def test_symlink_to_a_regular_file_is_read(tmp_path: Path) -> None:
    target = azure_csv(tmp_path, "real.csv", ["2023-11-16 18:17:03,1,2"])
    link = tmp_path / "link.csv"
    try:
        link.symlink_to(target)
    except OSError:
        pytest.skip("no symlinks here")
    assert read_trace(link, "azure")[0].output_tokens == 2
    (tmp_path / "dangling.csv").symlink_to(tmp_path / "gone.csv")
    assert raises(read_trace, tmp_path / "dangling.csv", "azure") == f"{tmp_path / 'dangling.csv'}: file not found"


def test_blank_tenant_values_become_none(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "s.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        '0,,1,1,2,x\n1,   ,1,1,2,x\n2,"\t",1,1,2,x\n3,\u00a0\u3000,1,1,2,x\n'
        "4,\u200b,1,1,2,x\n5,\ufeff ,1,1,2,x\n6, GPT-4 ,1,1,2,x\n",
    )
    w, s = trace_workload([path], "burstgpt", tenant_by="Model")
    assert w.tenants == ["(none)", "GPT-4"]
    assert s.requests == {"(none)": 6, "GPT-4": 1}


def test_messages_with_line_breaks_stay_on_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "nl.csv", 'TIMESTAMP,"Context\nTokens",X\n2023-11-16 18:17:03,1,2\n')
    assert (
        raises(read_trace, path, "azure")
        == f"{path}: missing column 'ContextTokens' (has: TIMESTAMP, Context\\nTokens, X)"
    )


def test_cli_reports_a_bad_option_in_one_line(tmp_path: Path) -> None:
    path = burst_csv(tmp_path, "a.csv", ["0,m,1,1,2,x"])
    options = ["--format", "burstgpt", "--scenario", str(REPO / "scenarios" / "replay.toml"), "--speedup", "1e-300"]
    done = fairgate("replay", str(path), *options, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "--speedup 1e-300: must be between 0.001 and 1000000" in done.stderr

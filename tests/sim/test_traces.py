"""Trace loaders: real Azure 2023 / BurstGPT files (values from SOURCES.md) and every error path.

The real traces live outside the repo: ``$FAIRGATE_TRACES_DIR`` if set, else ``<repo>/../shared/data/traces``.
Tests that need them fail when the directory is absent (they are part of the contract, never skipped).
"""

from __future__ import annotations

import collections
import csv
import hashlib
import os
from pathlib import Path

import pytest

from fairgate.sim.traces import TraceError, TraceRow, TraceSummary, read_trace, trace_workload

REPO = Path(__file__).resolve().parents[2]
TRACES = Path(os.environ.get("FAIRGATE_TRACES_DIR") or REPO.parent / "shared" / "data" / "traces")
AZURE_CODE = TRACES / "azure_llm_2023_code.csv"
AZURE_CONV = TRACES / "azure_llm_2023_conv.csv"
BURST1 = TRACES / "burstgpt1_first7days.csv"
BURST3 = TRACES / "burstgpt3_first400.csv"



def real(function):  # type: ignore[no-untyped-def]
    """Marks a test that reads the real traces: without them it fails (file not found), never skips."""
    return function





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
# Real traces


@real
def test_read_azure_code_matches_sources(code_rows: list[TraceRow]) -> None:
    rows = code_rows
    assert len(rows) == 8819
    assert rows[0].time_s == 0.0
    assert rows[-1].time_s == pytest.approx(3435.948056, abs=1e-9)  # 18:17:03.9799600 -> 19:14:19.9280160
    assert all(a.time_s <= b.time_s for a, b in zip(rows, rows[1:]))
    assert round(sum(r.output_tokens for r in rows) / len(rows), 1) == 27.9
    assert round(sum(r.prompt_tokens for r in rows) / len(rows), 1) == 2047.8
    assert min(r.output_tokens for r in rows) == 6 and max(r.output_tokens for r in rows) == 1899
    assert rows[0].prompt_tokens == 4808 and rows[0].output_tokens == 10
    assert rows[0].fields == {"TIMESTAMP": "2023-11-16 18:17:03.9799600", "ContextTokens": "4808",
                              "GeneratedTokens": "10"}
    assert rows[1].time_s == pytest.approx(0.052, abs=1e-12)  # 7th fractional digit kept


@real
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


@real
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


@real
def test_burstgpt3_columns_and_failed_row() -> None:
    rows = read_trace(BURST3, "burstgpt")
    assert len(rows) == 400
    assert rows[-1].time_s == 41453.0  # 19,440,110 -> 19,481,563
    assert [r.fields["Timestamp"] for r in rows if r.output_tokens == 0] == ["19473253.0"]
    assert set(rows[0].fields) == {"Timestamp", "Session ID", "Elapsed time", "Model", "Request tokens",
                                   "Response tokens", "Total tokens", "Log Type"}
    assert collections.Counter(r.fields["Model"] for r in rows) == {"ChatGPT": 305, "GPT-4": 95}

    w, s = trace_workload([BURST3], "burstgpt", tenant_by="Log Type")
    assert w.tenants == ["API log", "Conversation log"]
    assert s.requests == {"API log": 6, "Conversation log": 393} and s.skipped_failed == 1


@real
def test_window_and_speedup_on_real_slice(code_rows: list[TraceRow]) -> None:
    start, length, speedup = 600.0, 120.0, 4.0
    inside = [r for r in code_rows if start <= r.time_s < start + length]
    w, s = trace_workload([AZURE_CODE], "azure", start_s=start, duration_s=length, speedup=speedup)
    w.check()
    assert len(w) == len(inside) > 100
    assert w.duration_ns == 30 * 10**9  # 120 s / 4
    for got, row in zip(w.arrival_ns, inside):
        assert got == pytest.approx((row.time_s - start) / speedup * 1e9, abs=1)
    assert w.prompt_tokens == [r.prompt_tokens for r in inside]
    assert s.span_s == pytest.approx(inside[-1].time_s - inside[0].time_s, abs=1e-9)
    assert s.duration_s == 30.0

    # Open-ended window: to the end of the trace, + 1 ns.
    w2, s2 = trace_workload([AZURE_CODE], "azure", start_s=3000.0, speedup=2.0)
    tail = [r for r in code_rows if r.time_s >= 3000.0]
    assert len(w2) == len(tail)
    assert w2.duration_ns == round((3435.948056 - 3000.0) / 2 * 1e9) + 1
    assert w2.arrival_ns[-1] == w2.duration_ns - 1


@real
def test_burstgpt_window_counts_failed_rows_inside_it() -> None:
    rows = read_trace(BURST1, "burstgpt")
    day = 86400.0
    inside = [r for r in rows if day <= r.time_s < 2 * day]
    w, s = trace_workload([BURST1], "burstgpt", start_s=day, duration_s=day, speedup=24.0)
    assert s.skipped_failed == sum(r.output_tokens == 0 for r in inside) > 0
    assert len(w) == sum(r.output_tokens > 0 for r in inside)
    assert w.duration_ns == 3600 * 10**9


@real
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
    assert sorted(zip(w.arrival_ns, w.tenant_index)) == expected

    # A row keeps its tenant when a window cuts the trace.
    win, _ = trace_workload([AZURE_CODE], "azure", tenant_by="hash:4", start_s=1100.0, duration_s=50.0)
    first = next(i for i, r in enumerate(code_rows) if r.time_s >= 1100.0)
    assert win.tenant_index[0] == bucket(first)


@real
def test_two_real_files_side_by_side() -> None:
    w, s = trace_workload([f"code={AZURE_CODE}", AZURE_CONV], "azure")
    assert w.tenants == ["code", "azure_llm_2023_conv"]
    assert s.requests == {"code": 8819, "azure_llm_2023_conv": 19366}
    firsts = {k: next(a for a, t in zip(w.arrival_ns, w.tenant_index) if t == k) for k in (0, 1)}
    assert firsts == {0: 0, 1: 0}  # each file starts at its own first row
    assert w.duration_ns == 3_501_721_937_001  # the longer file (conv, 3,501.7 s) + 1 ns


@real
def test_real_loads_are_fast() -> None:
    import time

    t = time.perf_counter()
    trace_workload([AZURE_CONV], "azure")
    assert time.perf_counter() - t < 1.0


# ---------------------------------------------------------------------------------------------
# Synthetic files: semantics


def test_read_sorts_stably_and_parses_time_variants(tmp_path: Path) -> None:
    path = azure_csv(tmp_path, "a.csv", [
        "2023-11-16 18:00:02.5,10,1",
        "2023-11-16 18:00:01,20,2",
        "2023-11-16T19:00:02.500000000+01:00,30,3",  # same instant as the first row
        "2023-11-16 18:00:01.0000001Z,40,0",
        "",  # blank lines are ignored
    ])
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
    a = write(tmp_path, "s.csv", "Timestamp,Session ID,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                                 "0,,ChatGPT,1,1,2,API log\n0,abc,ChatGPT,1,1,2,Conversation log\n")
    w, s = trace_workload([a], "burstgpt", tenant_by="Session ID")
    assert w.tenants == ["(none)", "abc"] and w.arrival_ns == [0, 0] and w.tenant_index == [0, 1]
    assert w.duration_ns == 1


def test_window_rounding_keeps_arrivals_inside_duration(tmp_path: Path) -> None:
    path = burst_csv(tmp_path, "r.csv", ["0,m,1,1,2,x", "0.999999999,m,1,1,2,x"])
    w, _ = trace_workload([path], "burstgpt", speedup=1e9, duration_s=1.0)
    assert w.arrival_ns == [0, 1] and w.duration_ns == 2  # 1 s / 1e9 = 1 ns, raised to last arrival + 1
    w.check()


def test_summary_type(tmp_path: Path) -> None:
    path = azure_csv(tmp_path, "s.csv", ["2023-01-01 00:00:00,1,2", "2023-01-01 00:00:04,3,4"])
    _, s = trace_workload([path], "azure", speedup=2.0)
    assert s == TraceSummary(tenants=("s",), requests={"s": 2}, skipped_failed=0, rows_read=2, span_s=4.0,
                             duration_s=2.000000001, mean_prompt_tokens=2.0, mean_output_tokens=3.0)


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
    assert raises(read_trace, path, "mooncake") == \
        f"{path}: unknown trace format 'mooncake' (known: azure, burstgpt)"
    assert "unknown trace format 'Azure'" in raises(trace_workload, [path], "Azure")


def test_missing_column(tmp_path: Path) -> None:
    path = write(tmp_path, "m.csv", "TIMESTAMP,ContextTokens\n2023-01-01 00:00:00,1\n")
    assert raises(read_trace, path, "azure") == f"{path}: missing column 'GeneratedTokens' (has: TIMESTAMP, ContextTokens)"
    path = write(tmp_path, "b.csv", "Timestamp,Model,Request tokens\n1,m,2\n")
    assert raises(read_trace, path, "burstgpt") == \
        f"{path}: missing column 'Response tokens' (has: Timestamp, Model, Request tokens)"


@pytest.mark.parametrize(("row", "problem"), [
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
])
def test_bad_azure_row_names_line(tmp_path: Path, row: str, problem: str) -> None:
    path = azure_csv(tmp_path, "bad.csv", ["2023-01-01 00:00:00,1,1", "", row])  # header line 1, blank line 3
    message = raises(read_trace, path, "azure")
    assert message.startswith(f"{path}: line 4: ")
    assert problem in message
    assert raises(trace_workload, [path], "azure") == message


@pytest.mark.parametrize(("value", "problem"), [("abc", "not a number of seconds"), ("", "not a number"),
                                                ("inf", "not a finite number"), ("NaN", "not a finite number")])
def test_bad_burstgpt_timestamp(tmp_path: Path, value: str, problem: str) -> None:
    path = burst_csv(tmp_path, "bad.csv", [f"{value},m,1,1,2,x"])
    message = raises(read_trace, path, "burstgpt")
    assert message.startswith(f"{path}: line 2: column 'Timestamp': bad timestamp ")
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
    assert raises(read_trace, folder, "azure").startswith(f"{folder}: cannot read")
    binary = tmp_path / "bin.csv"
    binary.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n\xff\xfe,1,1\n")
    assert raises(read_trace, binary, "azure") == f"{binary}: not UTF-8 text"


def test_empty_window(tmp_path: Path) -> None:
    path = burst_csv(tmp_path, "w.csv", ["0,m,1,1,2,x", "10,m,1,0,1,x", "20,m,1,1,2,x"])
    assert raises(trace_workload, [path], "burstgpt", start_s=30.0) == \
        f"{path}: no requests in window [30, end) s"
    assert raises(trace_workload, [path], "burstgpt", start_s=1.0, duration_s=5.0) == \
        f"{path}: no requests in window [1, 6) s"
    # Only a failed row in the window: still empty, and the skipped row is reported.
    assert raises(trace_workload, [path], "burstgpt", start_s=5.0, duration_s=10.0) == \
        f"{path}: no requests in window [5, 15) s (1 failed rows skipped)"


def test_unknown_tenant_column(tmp_path: Path) -> None:
    path = burst_csv(tmp_path, "t.csv", ["0,m,1,1,2,x"])
    assert raises(trace_workload, [path], "burstgpt", tenant_by="model") == \
        f"{path}: tenant_by column 'model' not found (has: Timestamp, Model, Request tokens, Response tokens, " \
        f"Total tokens, Log Type)"


@pytest.mark.parametrize("spec", ["hash:", "hash:0", "hash:-1", "hash:x", "hash:2.5", "hash: 3"])
def test_bad_hash_spec(tmp_path: Path, spec: str) -> None:
    path = burst_csv(tmp_path, "h.csv", ["0,m,1,1,2,x"])
    assert raises(trace_workload, [path], "burstgpt", tenant_by=spec) == \
        f"trace_workload: tenant_by {spec!r}: N in 'hash:N' must be an integer >= 1"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"speedup": 0}, "trace_workload: speedup must be a finite number > 0, got 0"),
    ({"speedup": -2.0}, "trace_workload: speedup must be a finite number > 0, got -2.0"),
    ({"speedup": float("nan")}, "trace_workload: speedup must be a finite number > 0, got nan"),
    ({"start_s": -1.0}, "trace_workload: start_s must be a finite number >= 0, got -1.0"),
    ({"duration_s": 0.0}, "trace_workload: duration_s must be a finite number > 0 or None, got 0.0"),
    ({"duration_s": -5}, "trace_workload: duration_s must be a finite number > 0 or None, got -5"),
    ({"duration_s": float("inf")}, "trace_workload: duration_s must be a finite number > 0 or None, got inf"),
])
def test_bad_window_arguments(tmp_path: Path, kwargs: dict, message: str) -> None:
    path = burst_csv(tmp_path, "a.csv", ["0,m,1,1,2,x"])
    assert raises(trace_workload, [path], "burstgpt", **kwargs) == message


def test_bad_names(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    a = burst_csv(tmp_path, "a.csv", ["0,m,1,1,2,x"])
    a2 = burst_csv(tmp_path / "x", "a.csv", ["0,m,1,1,2,x"])
    assert raises(trace_workload, [a, a2], "burstgpt") == \
        f"{a2}: tenant name 'a' is used by two files; name them with NAME=PATH"
    assert raises(trace_workload, [f"={a}"], "burstgpt") == f"={a}: empty tenant name in NAME=PATH"
    assert raises(trace_workload, [f"n={a}"], "burstgpt", tenant_by="Model") == \
        f"n={a}: NAME=PATH names a tenant, which needs tenant_by='file' (got tenant_by='Model')"
    assert raises(trace_workload, [], "burstgpt") == "trace_workload: no trace files given"
    w, _ = trace_workload([f"one={a}", f"two={a2}"], "burstgpt")
    assert w.tenants == ["one", "two"]

"""``fairgate calibrate`` fits ``max_batch`` from slot probes (fairgate.gateway.calibrate): the count of streams
an engine runs at once, against emulated replicas of known slots (``fairgate emulate --max-batch N``, its own
process as deployed), and how the fit is reported beside the engine's own count. The llama-server fit is
checked in tests/engine/test_llamacpp.py."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fairgate.core.fit import fit_line
from fairgate.gateway.calibrate import Calibration, SlotFit, at_once, max_batch_note, report_rows, upstream_table
from fairgate.harness.process import fairgate_process, free_port


def _waves(slots: int, sent: int, step_s: float = 0.01, tokens: int = 64) -> list[tuple[float, float, float]]:
    """(sent, first token, last token) of ``sent`` streams of ``tokens`` each on an engine of ``slots`` slots,
    first come first served: stream i runs in wave i // slots, each wave starting one step after the last ended."""
    wave_s = tokens * step_s
    return [
        (0.0, w * (wave_s + step_s) + step_s, (w + 1) * wave_s + w * step_s) for w in (i // slots for i in range(sent))
    ]


def test_the_streams_run_at_once_are_those_started_before_any_ended():
    assert at_once(_waves(slots=8, sent=8)) == 8  # all taken
    assert at_once(_waves(slots=5, sent=8)) == 5  # three waited for a slot
    assert at_once(_waves(slots=1, sent=2)) == 1
    # The second wave's first token read a little before the first wave's last (a loaded client reads the
    # sockets of one pass in any order): still counted as waiting.
    late_read = [*_waves(slots=3, sent=3), (0.0, 0.63, 0.63 + 0.64)]
    assert at_once(late_read) == 3


def test_a_stream_that_started_between_the_waves_makes_the_count_unclear():
    straggler = (0.0, 0.40, 0.40 + 0.64)  # reached the engine late: 0.40 s of a 0.64 s wave
    assert at_once([*_waves(slots=4, sent=4), straggler]) is None


def _calibration(fitted: SlotFit | None, reported: int | None, written: int) -> Calibration:
    line = fit_line([(1.0, 10.0), (2.0, 11.0)])
    return Calibration(line, line, written, fitted, reported)


@pytest.mark.parametrize(
    ("fitted", "reported", "written", "said", "rows"),
    [
        (SlotFit(12, False, ((2, 2), (4, 4), (8, 8), (16, 12))), None, 12, "fitted (the slot probes found 12", 5),
        (SlotFit(8, False, ((2, 2), (16, 8))), 8, 8, "the engine's own slot count, 8; the slot probes found 8", 6),
        (SlotFit(6, False, ((2, 2), (8, 6))), 8, 8, "found 6 at once: they disagree", 6),
        (SlotFit(256, True, ((256, 256),)), None, 256, "found >= 256 at once (all they sent", 5),
        (None, None, 4, "given (--max-batch)", 4),
    ],
)
def test_the_table_says_where_max_batch_came_from_and_the_report_shows_both_counts(
    fitted, reported, written, said, rows
):
    calibration = _calibration(fitted, reported, written)
    assert said in max_batch_note(calibration)
    assert calibration.disagree == ("disagree" in said)
    text = upstream_table(calibration, "engine-0", "http://127.0.0.1:1/v1", "m", "vllm", 4096)
    assert tomllib.loads(text)["upstream"][0]["max_batch"] == written
    assert f"# max_batch: {max_batch_note(calibration)}" in text.splitlines()
    shown = {row[0]: row[1] for row in report_rows(calibration)}
    assert len(shown) == rows and shown["max_batch"] == str(written)
    assert shown.get("max_batch_fitted") == (None if fitted is None else str(fitted))
    assert shown.get("max_batch_engine") == (None if reported is None else str(reported))


@pytest.mark.parametrize("limit", ["1", "1025", "-3"])
def test_a_max_batch_limit_out_of_range_is_refused_before_probing(limit):
    command = [sys.executable, "-m", "fairgate", "calibrate", "http://127.0.0.1:1", "--max-batch-limit", limit]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"--max-batch-limit {limit}: give a number of streams 2-1024" in done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1


def _calibrate(url: str, out: Path, *more: str) -> tuple[dict[str, object], subprocess.CompletedProcess[str]]:
    command = [sys.executable, "-m", "fairgate", "calibrate", url, "--kind", "vllm", "--out", str(out), *more]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return tomllib.loads(out.read_text())["upstream"][0], done


@pytest.mark.slow
@pytest.mark.parametrize("slots", [5, 12])
def test_calibrate_fits_the_slots_of_an_engine_that_reports_none(tmp_path, slots):
    port = free_port()
    with fairgate_process(["emulate", "--port", str(port), "--model", "emu", "--max-batch", str(slots)], port) as url:
        table, done = _calibrate(url, tmp_path / "upstream.toml")
    print(done.stdout, done.stderr)
    assert table["max_batch"] == slots
    assert f"max_batch: fitted (the slot probes found {slots} at once)" in done.stderr
    fitted_row = next(line for line in done.stdout.splitlines() if "max_batch_fitted" in line)
    assert fitted_row.split("│")[2].strip() == str(slots)


@pytest.mark.slow
def test_an_engine_taking_every_stream_sent_is_fitted_at_the_limit_as_a_lower_bound(tmp_path):
    port = free_port()
    with fairgate_process(["emulate", "--port", str(port), "--model", "emu", "--max-batch", "24"], port) as url:
        table, done = _calibrate(url, tmp_path / "upstream.toml", "--max-batch-limit", "6")
    assert table["max_batch"] == 6
    assert "slot probes: 2 -> 2, 4 -> 4, 6 -> 6 (streams sent -> run at once)" in done.stderr
    assert "found >= 6 at once (all they sent: --max-batch-limit)" in done.stderr

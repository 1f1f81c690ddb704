"""``fairgate calibrate`` fits ``max_batch`` from slot probes (fairgate.gateway.calibrate): the count of streams
an engine runs at once, against emulated replicas of known slots (``fairgate emulate --max-batch N``, its own
process as deployed), and how the fit is reported beside the engine's own count; the table's ``max_model_len``
(the engine's own, from its ``/v1/models``, unless given) and the engines refused before any probe. The
llama-server fit is checked in tests/engine/test_llamacpp.py."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fairgate.core.fit import fit_line
from fairgate.gateway.calibrate import Calibration, SlotFit, at_once, max_batch_note, report_rows, upstream_table
from fairgate.harness.process import fairgate_process, free_port
from fairgate.harness.threads import serve_in_thread


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
    text = upstream_table(
        calibration, "engine-0", "http://127.0.0.1:1/v1", "m", "vllm", 4096, "given (--max-model-len)"
    )
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


def _run(url: str, *more: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "fairgate", "calibrate", url, "--kind", "vllm", *more]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def _calibrate(url: str, out: Path, *more: str) -> tuple[dict[str, object], subprocess.CompletedProcess[str]]:
    done = _run(url, "--out", str(out), *more)
    assert done.returncode == 0, done.stderr
    return tomllib.loads(out.read_text())["upstream"][0], done


@pytest.fixture(scope="module")
def emulated() -> Iterator[str]:
    """``fairgate emulate`` serving model ``emu`` with a context of 8,192 tokens, its own process."""
    port = free_port()
    with fairgate_process(["emulate", "--port", str(port), "--model", "emu", "--max-model-len", "8192"], port) as url:
        yield url


@pytest.mark.parametrize(
    ("given", "written", "said"),
    [
        ((), 8192, "the engine's own (its /v1/models)"),
        (("--max-model-len", "4096"), 4096, "given (--max-model-len); the engine reports 8192"),
    ],
)
def test_the_table_takes_the_engines_own_context_length_unless_given(tmp_path, emulated, given, written, said):
    out = tmp_path / "upstream.toml"
    table, _ = _calibrate(emulated, out, "--model", "emu", "--max-batch", "2", *given)
    assert table["max_model_len"] == written
    assert f"# max_model_len: {said}" in out.read_text().splitlines()


def test_a_model_the_engine_does_not_list_is_refused_naming_those_it_serves(emulated):
    done = _run(emulated, "--model", "llama-70b", "--max-batch", "2")
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    assert f"--model 'llama-70b': {emulated}/v1 does not serve it (its /v1/models lists 'emu')" in done.stderr


def test_an_engine_reporting_no_context_length_is_refused_unless_given():
    """An engine whose ``/v1/models`` has no ``max_model_len`` (llama.cpp's, a hosted provider's): a stand-in
    serving only that list, since the refusal comes before any probe. Given ``--max-model-len``, calibrate goes
    on to probe it (and fails there: exit 1); llama-server serves its one model under any ``--model``."""

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "/models/m.gguf", "object": "model", "owned_by": "x"}]})

    with serve_in_thread(Starlette(routes=[Route("/v1/models", models)])) as url:
        refused = _run(url, "--max-batch", "2")
        probed = _run(url, "--kind", "llamacpp", "--model", "m", "--max-batch", "2", "--max-model-len", "4096")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr and refused.stderr.count("\n") == 1
    assert f"{url}/v1/models reports no max_model_len for '/models/m.gguf': give --max-model-len" in refused.stderr
    assert probed.returncode == 1 and f"{url}/v1/completions answered 404" in probed.stderr, probed.stderr

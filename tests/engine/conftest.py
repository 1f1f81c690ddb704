"""A real engine for the tests of this folder: llama.cpp's ``llama-server`` (built once per machine,
``fairgate.harness.llamacpp``) on a tiny random-weight llama (``fairgate.harness.tinyllama``), 8 slots of
continuous batching, one CPU thread, every iteration logged; and its cost model as ``fairgate calibrate``
measures it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fairgate.harness.llamacpp import ServerFlags, llama_server
from fairgate.harness.replica import ReplicaModel
from fairgate.harness.tinyllama import write_random_gguf

SLOTS = 8
CONTEXT_TOKENS = 16384
MODEL = "tiny"  # the name clients ask the gateway for (llama-server serves whatever it loaded under any name)
# The module's engine logs every iteration (the fairness test's engine-side truth), and so is calibrated as it
# runs: the debug log costs the engine time per token (a full batch's step 11.6 ms without it, 20-25 ms with).
ENGINE_FLAGS = ServerFlags(SLOTS, CONTEXT_TOKENS, threads=1, log_iterations=True)


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The running engine's base URL (``http://127.0.0.1:PORT``, no ``/v1``)."""
    folder = tmp_path_factory.mktemp("engine")
    model = write_random_gguf(folder / "tiny.gguf")
    with llama_server(model, ENGINE_FLAGS, log=folder / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def calibrated(engine_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``fairgate calibrate`` run against the engine: the ``[[upstream]]`` table it wrote, and its output."""
    return run_calibrate(engine_url, tmp_path_factory.mktemp("calibrate") / "upstream.toml")


def run_calibrate(engine_url: str, out: Path) -> dict[str, Any]:
    """``fairgate calibrate`` against ``engine_url``, its table written to ``out``: the table and the output."""
    done = subprocess.run(
        [sys.executable, "-m", "fairgate", "calibrate", engine_url, "--kind", "llamacpp", "--model", MODEL,
         "--name", "llama-0", "--max-model-len", str(CONTEXT_TOKENS), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    table = tomllib.loads(out.read_text())["upstream"][0]
    return {**table, "stdout": done.stdout}


def cost_model(calibrated: dict[str, Any]) -> ReplicaModel:
    """The calibrated cost model, as the harness writes it into a gateway's ``[[upstream]]``."""
    return ReplicaModel(
        calibrated["iter_base_ms"],
        calibrated["iter_slope_ms"],
        calibrated["prefill_ms_per_token"],
        calibrated["max_batch"],
        CONTEXT_TOKENS,
    )


def engine_path() -> Path:
    """Where the test engine's binary is (built on first use)."""
    from fairgate.harness.llamacpp import build_server

    return build_server()

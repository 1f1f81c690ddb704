"""The engine's own iterations, read from ``llama-server``'s debug log (``-lv 5``): an engine-side truth of
who used how much of the engine, independent of the gateway's meter and of any client's clock.

llama-server's main loop logs, at debug verbosity, the start of every batch it hands to ``llama_decode``
(``srv  decode: n_batch (effective) = N, off = 0``), each new prompt put into it (``new prompt, ...,
task.n_tokens = P``), and, once the batch is computed, one ``process_toke`` line per sequence that got a token
from it (``n_gen = G, n_remaining = R``: ``G + R`` is the request's ``n_predict``, its ``max_tokens``; a
sequence with ``G == 1`` was prefilled in that batch). One iteration runs from one batch's start to the next
(or to ``all slots are idle``): its compute plus the sampling, the sending and the taking in of new requests
around it, on the engine's clock (the log's timestamps, microseconds).

``gpu_ms_by_task`` splits every iteration by the charge rule of seed 002 (``dt / B`` per decoding sequence),
with the engine's own step times in place of a fitted cost model: a pure decode iteration of ``B`` sequences
goes ``1/B`` to each; an iteration that also prefilled prompts goes ``d(B)`` (the median pure decode iteration
of that ``B`` in the same log) ``1/B`` to each decoding sequence, and the rest to the prompts prefilled in it,
in proportion to their tokens.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

# ``S.SS.MMM.UUU`` (minutes.seconds.milliseconds.microseconds since the server started) at the start of a line.
_STAMP = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) ")
_BATCH = re.compile(r"srv +decode: n_batch \(effective\) = \d+, off = (\d+)")
_PROMPT = re.compile(r"task (\d+) \| new prompt, .*task\.n_tokens = (\d+)")
_TOKEN = re.compile(r"process_toke: id +\d+ \| task (\d+) \| n_gen = (\d+), n_remaining = (-?\d+)")
_IDLE = "update_slots: all slots are idle"


@dataclass
class Iteration:
    """One iteration of the engine: ``start_s`` / ``end_s`` on its clock (seconds), the tasks that decoded a
    token in it, and task -> prompt tokens of those prefilled in it."""

    start_s: float
    end_s: float = 0.0
    decoded: list[int] = field(default_factory=list)
    prefilled: dict[int, int] = field(default_factory=dict)

    @property
    def ms(self) -> float:
        return (self.end_s - self.start_s) * 1000.0


@dataclass(frozen=True)
class EngineLog:
    """What the log says: the iterations in order, and each task's ``n_predict`` (its ``max_tokens``)."""

    iterations: list[Iteration]
    n_predict: dict[int, int]


def _stamp_s(line: str) -> float | None:
    match = _STAMP.match(line)
    if match is None:
        return None
    minutes, seconds, millis, micros = (int(g) for g in match.groups())
    return minutes * 60 + seconds + millis / 1e3 + micros / 1e6


def read_engine_log(path: Path) -> EngineLog:
    """Parse a ``llama-server -lv 5`` log (``path``). Raises ``OSError`` if it cannot be read and
    ``ValueError`` if it holds no iteration (not a debug log)."""
    iterations: list[Iteration] = []
    n_predict: dict[int, int] = {}
    prompts: dict[int, int] = {}  # task -> prompt tokens, put in the batch about to start
    current: Iteration | None = None
    last_s = 0.0
    with open(path, errors="replace") as lines:
        for line in lines:
            at = _stamp_s(line)
            if at is None:
                continue
            if (batch := _BATCH.search(line)) is not None:
                if batch.group(1) != "0":
                    continue  # the same iteration's batch, split at n_batch
                if current is not None:
                    current.end_s = at
                current = Iteration(at, prefilled=prompts)
                iterations.append(current)
                prompts = {}
            elif (prompt := _PROMPT.search(line)) is not None:
                prompts[int(prompt.group(1))] = int(prompt.group(2))
            elif (token := _TOKEN.search(line)) is not None and current is not None:
                task, generated, remaining = (int(g) for g in token.groups())
                n_predict[task] = generated + remaining
                if task not in current.prefilled:
                    current.decoded.append(task)
            elif _IDLE in line and current is not None:
                current.end_s, current = at, None
            last_s = at
    if current is not None:
        current.end_s = last_s
    if not iterations:
        raise ValueError(f"{path}: no iteration in it (run llama-server with -lv 5)")
    return EngineLog(iterations, n_predict)


def decode_step_ms(iterations: list[Iteration]) -> dict[int, float]:
    """Batch size -> the median length (ms) of the iterations that only decoded (no prompt in them)."""
    by_batch: dict[int, list[float]] = {}
    for it in iterations:
        if it.decoded and not it.prefilled:
            by_batch.setdefault(len(it.decoded), []).append(it.ms)
    return {b: statistics.median(v) for b, v in by_batch.items()}


def _pure_decode_ms(steps: dict[int, float], batch: int) -> float:
    """``d(batch)``: the median pure decode iteration of that batch size, else that of the nearest one seen."""
    if not steps:
        return 0.0
    return steps[batch] if batch in steps else steps[min(steps, key=lambda b: (abs(b - batch), b))]


def gpu_ms_by_task(log: EngineLog) -> dict[int, float]:
    """Task -> the engine's time it used (ms), every iteration split by the charge rule (module docstring).
    The values add up to the length of the iterations that decoded or prefilled someone."""
    steps = decode_step_ms(log.iterations)
    out: dict[int, float] = {}
    for it in log.iterations:
        if not it.decoded:
            decode_ms = 0.0
        elif it.prefilled:
            decode_ms = min(it.ms, _pure_decode_ms(steps, len(it.decoded)))
        else:
            decode_ms = it.ms
        for task in it.decoded:
            out[task] = out.get(task, 0.0) + decode_ms / len(it.decoded)
        prompt_tokens = sum(it.prefilled.values())
        for task, tokens in it.prefilled.items():
            share = tokens / prompt_tokens if prompt_tokens else 1.0 / len(it.prefilled)
            out[task] = out.get(task, 0.0) + (it.ms - decode_ms) * share
    return out

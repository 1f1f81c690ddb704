"""``fairgate calibrate``: measure a live engine's cost model from timed probes.

Decode: ``B`` streams sent at once (``max_tokens`` each, ``ignore_eos`` where the engine takes it) run as one
batch; the step time at ``B`` is the median gap between consecutive tokens while all ``B`` decode
(``fairgate.core.fit.steady_step_ms``), probed at ``B = 1, 2, 4, ..., max_batch``; a line through them gives
``iter_base_ms`` and ``iter_slope_ms``. Prefill: one request at a time with one output token, at several
prompt lengths (a fresh random prefix each time, and ``cache_prompt: false`` for llama.cpp, so no prefix
cache serves it); the slope of time-to-first-token over the prompt tokens the engine reports gives
``prefill_ms_per_token``. ``max_batch``: given, else the engine's slot count where it reports one
(llama.cpp ``/props`` ``total_slots``).
"""

from __future__ import annotations

import asyncio
import json
import random
import string
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from fairgate.core.fit import Line, fit_line, median, steady_step_ms
from fairgate.gateway import sse

DECODE_TOKENS = 40  # per probe stream: enough gaps while the whole batch decodes
PREFILL_WORDS = (8, 48, 144, 288)  # random words per prefill probe: ~30 to ~1,000 tokens on the test model
PREFILL_REPEATS = 3  # per length; the median is kept (one slow probe is noise, not the engine)
IGNORE_EOS_KINDS = ("vllm", "sglang", "llamacpp")


class CalibrationError(Exception):
    """The engine could not be probed (unreachable, an error answer, no usable timings); the message says
    what and where."""


@dataclass(frozen=True)
class Engine:
    """Where to probe: ``url`` is the OpenAI base URL (ending in ``/v1``), ``kind`` the upstream kind."""

    url: str
    model: str
    kind: str = "openai"
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")


@dataclass(frozen=True)
class Calibration:
    """The fit: ``decode`` (step ms over batch size) and ``prefill`` (TTFT ms over prompt tokens) lines,
    and the ``max_batch`` probed up to."""

    decode: Line
    prefill: Line
    max_batch: int

    @property
    def iter_base_ms(self) -> float:
        return max(0.001, self.decode.intercept)

    @property
    def iter_slope_ms(self) -> float:
        return max(0.0, self.decode.slope)

    @property
    def prefill_ms_per_token(self) -> float:
        return max(0.0, self.prefill.slope)


def base_url(url: str) -> str:
    """``url`` as an OpenAI base URL: ``/v1`` appended unless it ends with it."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


async def calibrate(engine: Engine, max_batch: int | None = None) -> Calibration:
    """Probe ``engine`` and fit its cost model. Raises ``CalibrationError``."""
    # A connection per probe: llama-server drops ~12 % of connections reused right after a stream ("Server
    # disconnected without sending a response"), and a few dozen probes do not need keep-alive.
    fresh = httpx.Limits(max_keepalive_connections=0)
    timeout = httpx.Timeout(120.0, connect=5.0)
    async with httpx.AsyncClient(timeout=timeout, headers=dict(engine.headers), limits=fresh) as http:
        batch = max_batch or await _slots(http, engine)
        await _completion(http, engine, "warm up", 4)  # first-call set-up is not a step
        decode = []
        for b in _batch_sizes(batch):
            streams = await asyncio.gather(*(_completion(http, engine, _words(8), DECODE_TOKENS) for _ in range(b)))
            step = steady_step_ms([s.arrivals_s for s in streams])
            if step is not None:
                decode.append((float(b), step))
        prefill = []
        for words in PREFILL_WORDS:
            runs = [await _completion(http, engine, _words(words), 1) for _ in range(PREFILL_REPEATS)]
            prefill.append((float(median([r.prompt_tokens for r in runs])), median([r.ttft_ms for r in runs])))
    try:
        return Calibration(fit_line(decode), fit_line(prefill), batch)
    except ValueError as exc:
        raise CalibrationError(f"{engine.url}: too few usable probes ({exc})") from None


def _batch_sizes(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return [*sizes, max_batch]


async def _slots(http: httpx.AsyncClient, engine: Engine) -> int:
    """The engine's slot count (llama.cpp ``/props``); ``CalibrationError`` where it has none."""
    if engine.kind == "llamacpp":
        try:
            answer = await http.get(f"{engine.root}/props")
            return int(answer.json()["total_slots"])
        except httpx.HTTPError as exc:
            raise CalibrationError(f"{engine.url}: cannot reach it ({type(exc).__name__})") from None
        except (ValueError, KeyError, TypeError):
            pass
    raise CalibrationError(f"{engine.url}: the engine does not report its batch size; give --max-batch")


def _words(count: int) -> str:
    """``count`` random lowercase words: a prompt no cache has seen."""
    rng = random.Random()
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))) for _ in range(count))


@dataclass(frozen=True)
class _Stream:
    arrivals_s: list[float]  # when each content chunk arrived (monotonic)
    ttft_ms: float
    prompt_tokens: int


async def _completion(http: httpx.AsyncClient, engine: Engine, prompt: str, tokens: int) -> _Stream:
    body: dict[str, Any] = {
        "model": engine.model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if engine.kind in IGNORE_EOS_KINDS:
        body["ignore_eos"] = True
    if engine.kind == "llamacpp":
        body["cache_prompt"] = False
    started = time.monotonic()
    arrivals: list[float] = []
    prompt_tokens = 0
    try:
        async with http.stream("POST", f"{engine.url}/completions", json=body) as answer:
            if answer.status_code != 200:
                raise CalibrationError(f"{engine.url}/completions answered {answer.status_code}: {await _said(answer)}")
            async for line in answer.aiter_lines():
                chunk = _chunk(line)
                if chunk is None:
                    continue
                if chunk.get("choices"):
                    arrivals.append(time.monotonic())
                prompt_tokens = int((chunk.get("usage") or {}).get("prompt_tokens", prompt_tokens))
    except httpx.HTTPError as exc:
        raise CalibrationError(f"{engine.url}: {type(exc).__name__}: {exc}") from None
    if not arrivals:
        raise CalibrationError(f"{engine.url}/completions streamed no tokens")
    return _Stream(arrivals, (arrivals[0] - started) * 1000.0, prompt_tokens)


async def _said(answer: httpx.Response) -> str:
    """An error answer's message: OpenAI's ``error.message`` when it is that JSON, else its content type
    (an HTML page is no message)."""
    body = (await answer.aread())[:4000].decode(errors="replace")
    try:
        document = json.loads(body)
        error = document.get("error", document) if isinstance(document, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        if isinstance(message, str):
            return message[:300]
    except json.JSONDecodeError:
        pass
    return f"a {answer.headers.get('content-type', 'body of no type')} answer, not an OpenAI error"


def _chunk(line: str) -> dict[str, Any] | None:
    """A stream line's chunk (``fairgate.gateway.sse``); None for framing, ``[DONE]`` or what is not one (a
    probe only times the tokens it can read)."""
    try:
        data = sse.data_of(line)
        return None if data is None or data.strip() == sse.DONE else sse.chunk_of(data)
    except sse.MalformedStream:
        return None


def upstream_table(calibration: Calibration, name: str, url: str, model: str, kind: str, max_model_len: int) -> str:
    """The ``[[upstream]]`` TOML table for the gateway's config."""
    return "\n".join(
        [
            "[[upstream]]",
            f"name = {json.dumps(name)}",
            f"url = {json.dumps(url)}",
            f"model = {json.dumps(model)}",
            f"kind = {json.dumps(kind)}",
            f"max_batch = {calibration.max_batch}",
            f"iter_base_ms = {calibration.iter_base_ms:.3f}",
            f"iter_slope_ms = {calibration.iter_slope_ms:.4f}",
            f"prefill_ms_per_token = {calibration.prefill_ms_per_token:.4f}",
            f"max_model_len = {max_model_len}",
            "",
        ]
    )


def report_rows(calibration: Calibration) -> Sequence[tuple[str, str, str, str]]:
    """(parameter, value, standard error, worst probe off the fit) for printing."""
    c, d, p = calibration, calibration.decode, calibration.prefill
    return [
        ("iter_base_ms", f"{c.iter_base_ms:.3f}", f"{d.intercept_se:.3f}", f"{d.max_rel_residual:.1%}"),
        ("iter_slope_ms", f"{c.iter_slope_ms:.4f}", f"{d.slope_se:.4f}", f"{d.max_rel_residual:.1%}"),
        ("prefill_ms_per_token", f"{c.prefill_ms_per_token:.4f}", f"{p.slope_se:.4f}", f"{p.max_rel_residual:.1%}"),
        ("max_batch", str(calibration.max_batch), "-", "-"),
    ]

"""``fairgate calibrate``: measure a live engine's cost model from timed probes.

Decode: ``B`` streams sent at once (``max_tokens`` each, ``ignore_eos`` where the engine takes it) run as one
batch; the step time at ``B`` is the median gap between consecutive tokens while all ``B`` decode
(``fairgate.core.fit.steady_step_ms``), probed at ``B = 1, 2, 4, ..., max_batch``; a line through them gives
``iter_base_ms`` and ``iter_slope_ms``. Prefill: one request at a time with one output token, at several
prompt lengths (a fresh random prefix each time, and ``cache_prompt: false`` for llama.cpp, so no prefix
cache serves it); the slope of time-to-first-token over the prompt tokens the engine reports gives
``prefill_ms_per_token``.

``max_batch`` (the engine's slots): given (``--max-batch``), else fitted from slot probes, beside the
engine's own count where it reports one (llama.cpp ``/props`` ``total_slots``). An engine with ``S`` slots
runs at most ``S`` sequences at once; a request beyond them waits inside it, first come first served, until
one ends, so its first token comes only after another stream's last. A slot probe sends ``B`` streams at
once, each asking for the same ``SLOT_TOKENS`` tokens (``ignore_eos``), and counts those generating together
(``at_once``: the ones whose first token came in the first half of the time to the first stream's end);
``B = 2, 4, 8, ...`` until the engine takes fewer than ``B`` at once (that count is its slots: the probe
before took all of half as many, so this one ran in two waves at most), or up to ``--max-batch-limit``
streams (default ``MAX_BATCH_LIMIT``; an engine taking them all has at least that many). A probe whose
count is unclear (a first token between the waves: requests that reached the engine late) is sent again
with streams twice, then four times as long. Bounds: fewer than ``2 x limit`` streams, or ``6 x limit``
with every probe resent twice; at most ``SLOT_PROBE_BUDGET_S`` seconds, else an error asking for
``--max-batch``. The written table uses the engine's own count where it reports one, the fit where it
does not; the report shows both, and says when they disagree.
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
# Output tokens per slot-probe stream, and the longer ones a probe whose count was unclear is sent again
# with: its waves are this many steps apart, which the stragglers of a burst of requests must stay within.
SLOT_TOKENS = (64, 128, 256)
MAX_BATCH_LIMIT = 256  # streams a slot probe sends at once at most, unless told (vLLM's default max_num_seqs)
SLOT_PROBE_BUDGET_S = 300.0
# A stream held back for a slot gets its first token after another stream's last; none of them before this
# fraction of the time to the first stream's end, however late the client reads its sockets (the client of
# a loaded machine reads tokens sent an iteration apart in one pass, in any order). A first token between
# half of it and this is a request that reached the engine late: the count is unclear.
QUIET_END = 0.9


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
class SlotFit:
    """What the slot probes found: ``slots`` sequences run at once; ``at_least``: every stream of the largest
    probe ran at once (the engine may take more); ``probes``: (streams sent, of them run at once) each."""

    slots: int
    at_least: bool
    probes: tuple[tuple[int, int], ...]

    def __str__(self) -> str:
        return f"{'>= ' if self.at_least else ''}{self.slots}"


@dataclass(frozen=True)
class Calibration:
    """The fit: ``decode`` (step ms over batch size) and ``prefill`` (TTFT ms over prompt tokens) lines,
    and the ``max_batch`` probed up to and written; ``fitted``: what the slot probes found (None: the batch
    size was given); ``reported``: the engine's own slot count (None: it reports none)."""

    decode: Line
    prefill: Line
    max_batch: int
    fitted: SlotFit | None = None
    reported: int | None = None

    @property
    def disagree(self) -> bool:
        """The engine's own slot count and the fit differ (a fit ``at_least`` its count agrees with more)."""
        f, r = self.fitted, self.reported
        return f is not None and r is not None and (r < f.slots if f.at_least else r != f.slots)

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


async def calibrate(
    engine: Engine, max_batch: int | None = None, max_batch_limit: int = MAX_BATCH_LIMIT
) -> Calibration:
    """Probe ``engine`` and fit its cost model; its ``max_batch`` too unless given (slot probes of up to
    ``max_batch_limit`` streams). Raises ``CalibrationError``."""
    # A connection per probe: llama-server drops ~12 % of connections reused right after a stream ("Server
    # disconnected without sending a response"), and a few dozen probes do not need keep-alive. No cap on
    # connections: httpx's default of 100 would hold streams back itself, counted as the engine's doing.
    fresh = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    timeout = httpx.Timeout(120.0, connect=5.0)
    async with httpx.AsyncClient(timeout=timeout, headers=dict(engine.headers), limits=fresh) as http:
        reported = fitted = None
        if max_batch is None:
            reported = await _reported_slots(http, engine)
        await _completion(http, engine, "warm up", 4)  # first-call set-up is not a step
        if max_batch is None and reported is None:  # the batch sizes to probe: the slots, found first
            fitted = await fit_slots(http, engine, max_batch_limit)
        batch = max_batch or reported or (fitted.slots if fitted is not None else 1)
        decode, prefill = await _timed_probes(http, engine, batch)
        if max_batch is None and reported is not None:
            # For the report only, so after the timed probes: a stream of theirs that an engine is still
            # finishing when the client has moved on must not run beside a timed one.
            fitted = await fit_slots(http, engine, max_batch_limit)
    try:
        return Calibration(fit_line(decode), fit_line(prefill), batch, fitted, reported)
    except ValueError as exc:
        raise CalibrationError(f"{engine.url}: too few usable probes ({exc})") from None


async def _timed_probes(
    http: httpx.AsyncClient, engine: Engine, batch: int
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The decode probes (batch size, step ms) up to ``batch``, and the prefill probes (prompt tokens, TTFT ms)."""
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
    return decode, prefill


def _batch_sizes(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return [*sizes, max_batch]


async def _reported_slots(http: httpx.AsyncClient, engine: Engine) -> int | None:
    """The engine's own slot count (llama.cpp ``/props`` ``total_slots``); None where it reports none."""
    if engine.kind != "llamacpp":
        return None
    try:
        answer = await http.get(f"{engine.root}/props")
        slots = int(answer.json()["total_slots"])
        return slots if slots >= 1 else None
    except httpx.HTTPError as exc:
        raise CalibrationError(f"{engine.url}: cannot reach it ({type(exc).__name__})") from None
    except (ValueError, KeyError, TypeError):
        return None


async def fit_slots(http: httpx.AsyncClient, engine: Engine, limit: int = MAX_BATCH_LIMIT) -> SlotFit:
    """The engine's slots from slot probes of 2, 4, 8, ... streams, up to ``limit`` (module docstring).
    Raises ``CalibrationError``."""
    probes: list[tuple[int, int]] = []
    streams = min(2, limit)
    try:
        async with asyncio.timeout(SLOT_PROBE_BUDGET_S):
            while True:
                ran = await _slot_probe(http, engine, streams)
                probes.append((streams, ran))
                if ran < streams or streams >= limit:
                    return SlotFit(ran, ran >= streams, tuple(probes))
                streams = min(2 * streams, limit)
    except TimeoutError:
        raise CalibrationError(
            f"{engine.url}: the slot probes took over {SLOT_PROBE_BUDGET_S:g} s (at {streams} streams); "
            "give --max-batch"
        ) from None


async def _slot_probe(http: httpx.AsyncClient, engine: Engine, streams: int) -> int:
    """How many of ``streams`` streams sent at once the engine ran at once (``at_once``), sent again with
    longer streams while unclear. Raises ``CalibrationError``."""
    for tokens in SLOT_TOKENS:
        runs = await asyncio.gather(*(_completion(http, engine, _words(8), tokens) for _ in range(streams)))
        if any(r.finish_reason != "length" for r in runs):  # a stream that ended early freed its slot early
            raise CalibrationError(
                f"{engine.url}: a probe stream stopped before its {tokens} tokens (no ignore_eos for kind "
                f"{engine.kind!r}?): its slots cannot be counted; give --max-batch"
            )
        ran = at_once([(r.sent_s, r.arrivals_s[0], r.arrivals_s[-1]) for r in runs])
        if ran is not None:
            return ran
    raise CalibrationError(
        f"{engine.url}: cannot count the sequences it runs at once ({streams} streams sent together started "
        f"at scattered times, even at {SLOT_TOKENS[-1]} tokens each); give --max-batch"
    )


def at_once(streams: Sequence[tuple[float, float, float]]) -> int | None:
    """How many of ``streams`` (each: sent, first token, last token, in seconds), sent together and asked
    for one fixed length, the engine generated at the same time: those whose first token came in the first
    half of the time from sending to the first stream's end. One it held back for a slot gets its first
    token after another stream's last, so after ``QUIET_END`` of that time; a first token in between is
    neither (a request that reached the engine late): None, unclear."""
    start = min(sent for sent, _, _ in streams)
    span = min(last for _, _, last in streams) - start
    firsts = [first - start for _, first, _ in streams]
    early = sum(1 for first in firsts if first < span / 2)
    if span <= 0 or early == 0 or any(span / 2 <= first < QUIET_END * span for first in firsts):
        return None
    return early


def _words(count: int) -> str:
    """``count`` random lowercase words: a prompt no cache has seen."""
    rng = random.Random()
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))) for _ in range(count))


@dataclass(frozen=True)
class _Stream:
    arrivals_s: list[float]  # when each content chunk arrived (monotonic)
    ttft_ms: float
    prompt_tokens: int
    sent_s: float  # when it was sent (monotonic)
    finish_reason: str | None  # its last choice's ("length": it ran to max_tokens)


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
    prompt_tokens, finish = 0, None
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
                    finish = _finish_reason(chunk["choices"]) or finish
                prompt_tokens = int((chunk.get("usage") or {}).get("prompt_tokens", prompt_tokens))
    except httpx.HTTPError as exc:
        raise CalibrationError(f"{engine.url}: {type(exc).__name__}: {exc}") from None
    if not arrivals:
        raise CalibrationError(f"{engine.url}/completions streamed no tokens")
    return _Stream(arrivals, (arrivals[0] - started) * 1000.0, prompt_tokens, started, finish)


def _finish_reason(choices: Any) -> str | None:
    choice = choices[-1] if isinstance(choices, list) else None
    reason = choice.get("finish_reason") if isinstance(choice, dict) else None
    return reason if isinstance(reason, str) else None


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


def upstream_table(
    calibration: Calibration, name: str, url: str, model: str, kind: str, max_model_len: int, max_model_len_note: str
) -> str:
    """The ``[[upstream]]`` TOML table for the gateway's config; ``max_model_len_note``: where the context
    length came from (a comment of the table, as ``max_batch``'s)."""
    return "\n".join(
        [
            "[[upstream]]",
            f"name = {json.dumps(name)}",
            f"url = {json.dumps(url)}",
            f"model = {json.dumps(model)}",
            f"kind = {json.dumps(kind)}",
            f"# max_batch: {max_batch_note(calibration)}",
            f"max_batch = {calibration.max_batch}",
            f"iter_base_ms = {calibration.iter_base_ms:.3f}",
            f"iter_slope_ms = {calibration.iter_slope_ms:.4f}",
            f"prefill_ms_per_token = {calibration.prefill_ms_per_token:.4f}",
            f"# max_model_len: {max_model_len_note}",
            f"max_model_len = {max_model_len}",
            "",
        ]
    )


def max_batch_note(calibration: Calibration) -> str:
    """Where the written ``max_batch`` came from, and the other count beside it: one short line (a comment
    of the table)."""
    c, fitted = calibration, calibration.fitted
    if fitted is None:
        return "given (--max-batch)"
    found = f"the slot probes found {fitted} at once"
    if fitted.at_least:
        found += " (all they sent: --max-batch-limit)"
    if c.reported is None:
        return f"fitted ({found}); the engine reports no slot count"
    if c.disagree:
        return f"the engine's own slot count, {c.reported}; {found}: they disagree (--max-batch chooses)"
    return f"the engine's own slot count, {c.reported}; {found}"


def slot_probes(fitted: SlotFit) -> str:
    """The slot probes, one line: streams sent -> how many ran at once, each."""
    return ", ".join(f"{sent} -> {ran}" for sent, ran in fitted.probes) + " (streams sent -> run at once)"


def report_rows(calibration: Calibration) -> Sequence[tuple[str, str, str, str]]:
    """(parameter, value, standard error, worst probe off the fit) for printing; ``max_batch`` is the value
    written, ``max_batch_fitted`` and ``max_batch_engine`` the counts it was chosen from, where known."""
    c, d, p = calibration, calibration.decode, calibration.prefill
    rows = [
        ("iter_base_ms", f"{c.iter_base_ms:.3f}", f"{d.intercept_se:.3f}", f"{d.max_rel_residual:.1%}"),
        ("iter_slope_ms", f"{c.iter_slope_ms:.4f}", f"{d.slope_se:.4f}", f"{d.max_rel_residual:.1%}"),
        ("prefill_ms_per_token", f"{c.prefill_ms_per_token:.4f}", f"{p.slope_se:.4f}", f"{p.max_rel_residual:.1%}"),
        ("max_batch", str(calibration.max_batch), "-", "-"),
    ]
    if c.fitted is not None:
        rows.append(("max_batch_fitted", str(c.fitted), "-", "-"))
    if c.reported is not None:
        rows.append(("max_batch_engine", str(c.reported), "-", "-"))
    return rows

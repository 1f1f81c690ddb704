"""What the load generator records: every HTTP request as its client saw it (``RequestRecord``), kept in
send order (``History``), with per-tenant latency figures over a window of send times (``TenantStats``).

The request id is the one the client sent as ``X-Request-Id``: the ledger's reservation for the request
carries it, so what each client received can be set beside what the ledger holds, id by id.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class HttpAnswer:
    """One HTTP answer to a request (the SDK's own retries make several): status and error code."""

    status: int
    code: str | None


@dataclass
class RequestRecord:
    """One request as its client saw it; times in seconds since the load generator started.

    Attributes:
        request_id / tenant / target: its ``X-Request-Id``, who sent it, the label of the gateway it went to.
        max_tokens: the output it asked for. run_id: its agent run, if any.
        sent_s / headers_s / first_s / last_s / ended_s: sent; the answer's headers arrived; the first and
            the last content token; it ended (None: not yet).
        outcome: ``running``, ``ok``, ``cut`` (the client hung up: see ``cut_at``), ``error`` (an HTTP error
            status), ``connection`` (the connection failed or broke), ``stream`` (an error event inside the
            stream) or ``client`` (the client itself failed).
        status / code / dimension / retry_after: HTTP status (200 once the answer began), the error's code,
            the gateway's ``x-fairgate-quota-dimension`` and ``Retry-After`` headers.
        tokens: content tokens received. usage_input / usage_output: the usage the client was sent.
        cut_at / hangup_s: where and when the client hung up (``before_bytes``, ``after_headers``,
            ``after_chunks``, ``timeout``, ``deadline``).
        answers: every HTTP answer when the SDK retried by itself (``Request.sdk_retries``).
    """

    request_id: str
    tenant: str
    target: str
    max_tokens: int
    sent_s: float
    run_id: str | None = None
    headers_s: float | None = None
    first_s: float | None = None
    last_s: float | None = None
    ended_s: float | None = None
    outcome: str = "running"
    status: int | None = None
    code: str | None = None
    dimension: str | None = None
    retry_after: str | None = None
    tokens: int = 0
    usage_input: int | None = None
    usage_output: int | None = None
    cut_at: str | None = None
    hangup_s: float | None = None
    answers: list[HttpAnswer] = field(default_factory=list)

    @property
    def error(self) -> str | None:
        """``<status>:<code>`` (with ``[<dimension>]`` when the gateway named one), ``connection``,
        ``stream:<code>`` or ``client:<code>``; None for a request that did not fail."""
        if self.outcome == "error":
            return f"{self.status}:{self.code or 'unknown'}" + (f"[{self.dimension}]" if self.dimension else "")
        if self.outcome in ("stream", "client"):
            return f"{self.outcome}:{self.code or 'unknown'}"
        return "connection" if self.outcome == "connection" else None

    @property
    def admitted(self) -> bool:
        """It ran (at least started) on an upstream: the ledger must hold a reservation for it."""
        return self.outcome == "ok" or self.tokens > 0

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_s is None else (self.first_s - self.sent_s) * 1000.0

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first (None: fewer than two)."""
        if self.first_s is None or self.last_s is None or self.tokens < 2:
            return None
        return (self.last_s - self.first_s) * 1000.0 / (self.tokens - 1)

    @property
    def ttft_bound_ms(self) -> float | None:
        """TTFT, or for a request cut before its first token the wait (a lower bound); None for errors.

        A request the load left queued past its end cannot look good by dropping out of the percentiles."""
        if self.ttft_ms is not None:
            return self.ttft_ms
        return ((self.ended_s or self.sent_s) - self.sent_s) * 1000.0 if self.outcome == "cut" else None


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation, as numpy); None for no values."""
    return float(np.percentile(values, q)) if values else None


@dataclass(frozen=True)
class TenantStats:
    """One tenant's figures over the requests it sent in a window."""

    tenant: str
    requests: int  # sent
    completed: int
    cut: int  # hung up on (still running at the load's end)
    errors: dict[str, int]  # ``RequestRecord.error`` -> count
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    output_tokens: int

    @property
    def rejected(self) -> int:
        """Requests answered 429 (rate, quota or queue full)."""
        return sum(n for code, n in self.errors.items() if code.startswith("429"))


@dataclass
class History:
    """Every request a load generator sent, in send order."""

    start: float = field(default_factory=time.monotonic)  # when the generator started, ``time.monotonic()``
    wall_start: float = field(default_factory=time.time)  # and ``time.time()``
    records: list[RequestRecord] = field(default_factory=list)

    def now(self) -> float:
        """Seconds since the start."""
        return time.monotonic() - self.start

    def running(self, target: str | None = None) -> list[RequestRecord]:
        """The requests not ended yet (to the gateway ``target``, if given)."""
        return [r for r in self.records if r.outcome == "running" and target in (None, r.target)]

    def window(self, tenants: list[str], sent_from_s: float, sent_to_s: float) -> list[RequestRecord]:
        return [r for r in self.records if r.tenant in tenants and sent_from_s <= r.sent_s < sent_to_s]

    def stats(self, tenant: str, sent_from_s: float = 0.0, sent_to_s: float = float("inf")) -> TenantStats:
        """``tenant``'s figures over the requests it sent in ``[sent_from_s, sent_to_s)``."""
        chosen = self.window([tenant], sent_from_s, sent_to_s)
        ttft = [v for r in chosen if (v := r.ttft_bound_ms) is not None]
        tpot = [v for r in chosen if (v := r.tpot_ms) is not None]
        errors = Counter(e for r in chosen if (e := r.error) is not None)
        return TenantStats(
            tenant=tenant,
            requests=len(chosen),
            completed=sum(r.outcome == "ok" for r in chosen),
            cut=sum(r.outcome == "cut" for r in chosen),
            errors=dict(sorted(errors.items())),
            ttft_p50_ms=percentile(ttft, 50),
            ttft_p99_ms=percentile(ttft, 99),
            tpot_p50_ms=percentile(tpot, 50),
            output_tokens=sum(r.tokens for r in chosen),
        )

    def ttft_values(self, tenants: list[str], sent_from_s: float = 0.0, sent_to_s: float = float("inf")) -> list[float]:
        """TTFT (or its lower bound) of every request of ``tenants`` sent in the window."""
        return [v for r in self.window(tenants, sent_from_s, sent_to_s) if (v := r.ttft_bound_ms) is not None]


__all__ = ["History", "HttpAnswer", "RequestRecord", "TenantStats", "percentile"]

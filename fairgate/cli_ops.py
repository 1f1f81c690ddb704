"""``fairgate explain`` and ``fairgate report``: read the gateway's request log (``fairgate.gateway.eventlog``).

``fairgate explain REQUEST_ID [--log PATH | --config fairgate.toml]`` prints what happened to one request
in plain words: admitted, how long it queued, where it ran, what it was billed; or why it was rejected,
when to retry and what to do. ``fairgate report [--log PATH | --config fairgate.toml] --out DIR`` writes
``DIR/report.html`` with ``DIR/shares.png`` (cumulative GPU share per tenant over time: the simulator's
chart), ``DIR/queue_times.png`` and ``DIR/rejections.png``.

The log is ``--log PATH`` or the ``[gateway].event_log`` of ``--config`` (default ``fairgate-events.jsonl``
beside it), read with its rotated predecessors (``PATH.N`` ... ``PATH.1``). Tenants appear as their
16-hex-digit hash; with ``--config``, also by the name of the configured tenant with that hash.

Exit codes: 0 done; 1 ``explain``: the request id is not in the log; 2 a bad option, configuration or log
(one line on stderr naming the file and line; no traceback).
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from fairgate.cli_common import output_dir
from fairgate.core.fairness import BACKLOG_QUEUE_MS

ops_app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, help="Read the gateway's request log."
)
out = Console(soft_wrap=True, highlight=False, markup=False, emoji=False)
errors = Console(stderr=True, soft_wrap=True, highlight=False, markup=False, emoji=False)
T = TypeVar("T")

LogOption = Annotated[Path | None, typer.Option("--log", help="The request log (JSON lines) to read.")]
ConfigOption = Annotated[
    Path | None, typer.Option("--config", help="Gateway TOML: read its gateway.event_log and name its tenants.")
]


class OpsError(ValueError):
    """A bad option or input; ``str()`` is the one-line message."""


def _guard(action: Callable[[], T]) -> T:
    """Run ``action``; a bad option, configuration or log -> one line on stderr, exit code 2."""
    from fairgate.gateway.config import GatewayConfigError
    from fairgate.gateway.eventlog import EventLogError

    try:
        return action()
    except (OpsError, EventLogError, GatewayConfigError) as exc:
        errors.print(printable(f"error: {exc}"))  # a bad log line is quoted in the message
        raise typer.Exit(2) from None


def _source(log: Path | None, config: Path | None) -> tuple[Path, dict[str, str]]:
    """The log to read and ``{tenant hash: configured name}``, with ``{key id: the key's label}`` for the
    configured keys that have one (empty without ``--config``; a key id is never a tenant hash)."""
    if log is not None and config is not None:
        raise OpsError("give --log PATH or --config FILE, not both")
    if log is not None:
        return log, {}
    if config is None:
        raise OpsError("give --log PATH (the request log) or --config FILE (a gateway configuration)")
    from fairgate.gateway.config import load_gateway_config
    from fairgate.gateway.identity import KEY_ID_CHARS
    from fairgate.ledger.base import tenant_tag

    loaded = load_gateway_config(config)
    if loaded.event_log_path is None:
        raise OpsError(f"{config}: gateway.event_log: the request log is off in this configuration; pass --log PATH")
    names = {tenant_tag(name): name for name in loaded.quotas.tenants}
    names |= {key.hash[:KEY_ID_CHARS]: key.name for key in loaded.keys if key.name}
    return loaded.event_log_path, names


def _tenant(tag: str | None, names: dict[str, str]) -> str:
    if tag is None:
        return "an unidentified caller"
    return f"tenant {tag} ({names[tag]})" if tag in names else f"tenant {tag}"


def _label(tag: str | None, names: dict[str, str]) -> str:
    """A tenant's label in charts and tables: the hash, with the configured name when known."""
    if tag is None:
        return "(no tenant)"
    return f"{names[tag]} ({tag})" if tag in names else tag


def printable(text: str) -> str:
    """``text`` with each character a terminal could act on (control and format characters: ESC, BEL, C1
    controls, line breaks, bidi overrides) written as its Python escape (``\\x1b``): request fields come
    from callers, and what they sent must be shown to the operator, never obeyed by the terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _clock(ts: float) -> str:
    ms = round(ts * 1000)
    moment = datetime.fromtimestamp(ms // 1000, tz=UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{ms % 1000:03d} UTC"


def _duration(ms: float) -> str:
    if ms < 1:
        return f"{ms:.2f} ms"
    if ms < 10_000:
        return f"{ms:,.0f} ms" if ms >= 100 else f"{ms:.1f} ms"
    return f"{ms / 1000:,.1f} s"


# -- explain ------------------------------------------------------------------------------------------------------

_DIMENSIONS = {
    "requests_per_minute": "its requests-per-minute allowance",
    "input_tokens_per_minute": "its prompt-tokens-per-minute allowance",
    "output_tokens_per_minute": "its output-tokens-per-minute allowance (max_tokens is reserved up front)",
    "max_tokens_per_request": "its cap on tokens in one request",
    "max_concurrent": "its limit on requests running at once",
    "gpu_seconds": "its GPU-time budget for the current window",
    "gpu_seconds_total": "its lifetime GPU-time budget",
    "spend_budget": "its spend budget for the current period (what the request could cost at most counts)",
    "max_model_calls": "the agent run's limit on model calls",
    "max_tool_rounds": "the agent run's limit on tool rounds",
    "max_tokens": "the agent run's token limit",
}

# reason -> (why, what to do)
_ADVICE = {
    "rate": (
        "the tenant had used up {dimension}.",
        "wait for the Retry-After delay and retry, spread requests out over time, or ask the operator for a "
        "higher {key}.",
    ),
    "tokens": (
        "the request's tokens would have gone over {dimension}.",
        "send fewer or shorter requests, lower max_tokens, wait for the Retry-After delay, or ask the "
        "operator for a higher {key}.",
    ),
    "concurrency": (
        "the tenant already had as many requests running as {dimension} allows.",
        "wait for running requests to finish before sending more, or ask for a higher {key}.",
    ),
    "queue_full": (
        "the tenant's queue already held its max_queued requests waiting for a GPU slot (the request "
        "was admitted, then released without being billed).",
        "retry after the Retry-After delay and keep fewer requests waiting at once: each tenant's queue "
        "is served fairly, so queueing more does not buy a bigger share.",
    ),
    "gpu_budget": (
        "the tenant had used up {dimension}.",
        "wait until the budget window refills, or ask the operator to raise {key}.",
    ),
    "spend_budget": (
        "the tenant had used up {dimension}.",
        "wait for the next period (the Retry-After delay), lower max_tokens (the worst case is held while "
        "a request runs), or ask the operator to raise {key}.",
    ),
    "agent_run": (
        "the agent run had reached {dimension}.",
        "finish this run and start a new one (a new x-fairgate-run-id), or ask for a higher {key}.",
    ),
    "ledger_down": (
        "the accounting ledger was unreachable and this tenant's tier refuses requests while it is.",
        "retry after the Retry-After delay; operators: check the ledger's server.",
    ),
    "no_upstream": (
        "no upstream replica serving the model was available.",
        "retry after the Retry-After delay; operators: check the upstreams' health.",
    ),
    "auth": (
        "the credential was missing or invalid, or the caller was not allowed to act for another tenant.",
        "send a valid key as Authorization: Bearer <key>, and a valid on-behalf-of token only from a "
        "configured delegate.",
    ),
    "invalid": (
        "the request was malformed or too large for the model.",
        "fix the request as the message says; sending it again unchanged fails the same way.",
    ),
    "conflict": (
        "the request id was in use: the same id was sent before with another body, is still running, "
        "or has completed (a completed request is never run or billed twice).",
        "use a new X-Request-Id / Idempotency-Key for a new request.",
    ),
    "upstream_error": (
        "the gateway or the upstream failed while serving it.",
        "retry; if it keeps failing, operators should check the gateway's log and the upstreams.",
    ),
}


def explain_lines(request_id: str, records: Sequence[dict[str, Any]], names: dict[str, str]) -> list[str]:
    """The story of ``request_id`` from its log records (in log order), one paragraph per tenant that used
    the id; every line ``printable``."""
    by_tenant: dict[str | None, list[dict[str, Any]]] = {}
    for record in records:
        by_tenant.setdefault(record["tenant_hash"], []).append(record)
    lines = []
    for tag, story in by_tenant.items():
        story = sorted(story, key=lambda r: r["ts"])
        models = sorted({r["model"] for r in story if r["model"]})
        delegates = sorted({r["delegate_hash"] for r in story if r.get("delegate_hash")})
        head = f"Request {request_id} from {_tenant(tag, names)}"
        if models:
            head += f", model {', '.join(models)}"
        if delegates:
            head += f", sent on its behalf by {', '.join(_tenant(d, names) for d in delegates)}"
        lines.append(head + ":")
        for record in story:
            lines.extend(_step(record, names))
        lines.append(_summary(story))
        lines.append("")
    return [printable(line) for line in lines[:-1]]


def _step(record: dict[str, Any], names: dict[str, str]) -> list[str]:
    when = _clock(record["ts"])
    kind = record["event"]
    if kind == "admitted":
        return [
            f"  {when}  admitted: reserved {record['input_tokens']:,} prompt tokens, up to "
            f"{record['max_output_tokens']:,} output tokens and {record['gpu_ms_estimate']:,.1f} GPU ms; "
            "it joined the tenant's queue."
        ]
    if kind == "dispatched":
        return [
            f"  {when}  dispatched to upstream {record['upstream']} after {_duration(record['queue_ms'])} "
            "in the tenant's queue."
        ]
    if kind == "finished":
        outcome = {
            "completed": "completed",
            "cancelled": "the client went away; billed for what was generated",
            "error": "the upstream failed; billed for what was generated",
        }.get(record["outcome"], record["outcome"])
        text = (
            f"  {when}  finished ({outcome}): {record['input_tokens']:,} prompt + {record['output_tokens']:,} "
            f"output tokens (up to {record['max_output_tokens']:,} allowed), {record['gpu_ms']:,.1f} GPU ms "
            f"billed ({record['gpu_ms_estimate']:,.1f} reserved)"
        )
        if record["first_token_after_dispatch_ms"] is not None:
            text += f"; first token {_duration(record['first_token_after_dispatch_ms'])} after dispatch"
            if record["tpot_ms"] is not None:
                text += f", then {_duration(record['tpot_ms'])} per token"
        return [text + "."]
    if kind == "left":
        return [
            f"  {when}  the client left after {_duration(record['queue_ms'])} in the tenant's queue: the request "
            "never ran, its reservation was released and nothing was billed."
        ]
    if kind == "rejected":
        reason = record["reason"]
        dimension = record.get("dimension")
        label = f"{reason}: {dimension}" if dimension else reason
        when_text = "after admission " if record["after_admission"] else ""
        message = re.sub(
            r"tenant:([0-9a-f]{16})",
            lambda m: f"{m.group(0)} ({names[m.group(1)]})" if m.group(1) in names else m.group(0),
            record["message"],
        )
        lines = [f"  {when}  rejected {when_text}with HTTP {record['status']} ({label}): {message}"]
        why, todo = _ADVICE.get(reason, ("the gateway gave the reason above.", "see the message."))
        words = _DIMENSIONS.get(dimension or "", f"its {dimension} limit" if dimension else "its limit")
        key = dimension or "limit"
        lines.append("      why: " + why.format(dimension=words, key=key))
        retry = record.get("retry_after_s")
        if retry is not None:
            lines.append(f"      retry after: {retry:g} s (the Retry-After header adds up to 25 % jitter)")
        elif record["status"] in (429, 503):
            lines.append("      retry after: as the response's Retry-After header said")
        lines.append("      what to do: " + todo.format(dimension=words, key=key))
        return lines
    return []


def _summary(story: Sequence[dict[str, Any]]) -> str:
    finished = [r for r in story if r["event"] == "finished"]
    rejected = [r for r in story if r["event"] == "rejected"]
    admitted = [r for r in story if r["event"] == "admitted"]
    if finished:
        last = finished[-1]
        start = admitted[0]["ts"] if admitted else last["ts"]
        return (
            f"  In short: {last['outcome']} in {_duration((last['ts'] - start) * 1000)} from admission "
            f"({_duration(last['queue_ms'])} queued), {last['output_tokens']:,} output tokens, "
            f"{last['gpu_ms']:,.1f} GPU ms billed."
        )
    if rejected:
        last = rejected[-1]
        billed = " (its reservation was released; nothing was billed)" if last["after_admission"] else ""
        return f"  In short: rejected ({last['reason']}, HTTP {last['status']}){billed}."
    left = [r for r in story if r["event"] == "left"]
    if left:
        return f"  In short: the client left after {_duration(left[-1]['queue_ms'])} queued; nothing was billed."
    if admitted and not any(r["event"] == "dispatched" for r in story):
        return "  In short: admitted but never given a slot in this log (still queued, or the client left)."
    return "  In short: still running when the log ends (or the gateway stopped before it finished)."


@ops_app.command()
def explain(
    request_id: Annotated[str, typer.Argument(help="The request id (x-request-id of the response).")],
    log: LogOption = None,
    config: ConfigOption = None,
) -> None:
    """Tell what happened to one request, in plain words.

    Admitted, queued, dispatched, finished (tokens, GPU ms); or rejected, why and what to do.

    Exit code 1 if the id is not in the log, 2 for a bad option or log."""
    from fairgate.gateway.eventlog import read_records

    def run() -> tuple[list[dict[str, Any]], Path, int]:
        path, names = _source(log, config)
        found = []
        total = 0
        for _, _, record in read_records(path):
            total += 1
            if record.get("request_id") == request_id:
                found.append(record)
        if found:
            out.print("\n".join(explain_lines(request_id, found, names)))
        return found, path, total

    found, path, total = _guard(run)
    if not found:
        errors.print(f"request {request_id!r} is not in {path} or its rotated files ({total:,} records read)")
        raise typer.Exit(1)


# -- report -------------------------------------------------------------------------------------------------------


@dataclass
class TenantSummary:
    """One tenant's figures in a live run (times in ms)."""

    tag: str | None
    admitted: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # outcome -> count
    rejected: int = 0
    gpu_ms: float = 0.0
    billed_gpu_ms: float = 0.0  # sum of finished records' gpu_ms
    input_tokens: int = 0
    output_tokens: int = 0
    queue_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)  # from admission to the first token: the queue included
    spend_micros: float = 0.0  # what finished requests cost (``spend_micros`` of ``finished`` records)

    @property
    def backlogged(self) -> bool:
        """Whether a request of its waited for a slot (``BACKLOG_QUEUE_MS``): a tenant that never did is
        demand-limited, and a work-conserving policy gave it all it asked whatever its share."""
        return any(ms >= BACKLOG_QUEUE_MS for ms in self.queue_ms)


@dataclass
class KeyUsage:
    """What the requests that came with one API key (``key_id``) of one tenant were billed."""

    finished: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    gpu_ms: float = 0.0
    spend_micros: float = 0.0

    def add(self, record: dict[str, Any]) -> None:
        """Count one ``finished`` record."""
        self.finished += 1
        self.input_tokens += record["input_tokens"]
        self.output_tokens += record["output_tokens"]
        self.gpu_ms += float(record["gpu_ms"])
        self.spend_micros += float(record.get("spend_micros") or 0.0)


@dataclass
class LiveRun:
    """What ``fairgate report`` reads from a log: per-tenant figures, rejections and the GPU-share timeline.

    ``timeline`` holds ``(seconds since start_ts, {tenant hash: cumulative GPU ms})``; ``share_source`` says
    whether it comes from the ``usage`` aggregates or from finished requests.
    """

    start_ts: float
    end_ts: float
    records: int
    policies: list[str]
    weights: dict[str, float]
    tenants: dict[str | None, TenantSummary]
    rejections: dict[str, dict[str | None, int]]  # reason -> tenant hash -> count
    timeline: list[tuple[float, dict[str, float]]]
    share_source: str
    keys: dict[tuple[str, str], KeyUsage] = field(default_factory=dict)  # (tenant hash, key id) -> billed
    currency: str = "USD"  # of the spend figures: the ``started`` records' (``[quotas.pricing]``)


def _configured(record: dict[str, Any], policies: list[str], weights: dict[str, float]) -> str | None:
    """What a ``started`` or ``reloaded`` record says of the configuration: its policy added to ``policies``,
    its tenants' weights into ``weights``; returns its currency (None: it names none)."""
    policy = record.get("policy")
    if isinstance(policy, str) and policy not in policies:
        policies.append(policy)
    for tag, info in (record.get("tenants") or {}).items():
        if isinstance(info, dict) and isinstance(info.get("weight"), (int, float)):
            weights[tag] = float(info["weight"])
    currency = record.get("currency")
    return currency if isinstance(currency, str) else None


def summarise_log(records: Iterable[dict[str, Any]]) -> LiveRun:
    """Per-tenant figures, rejections by reason and the cumulative GPU timeline of a log's records.

    GPU time per tenant comes from the ``usage`` aggregates when the log has at least two of them, else from
    each finished request's billed ``gpu_ms`` at its finish time (short runs).
    """
    count = 0
    start, end = math.inf, -math.inf
    tenants: dict[str | None, TenantSummary] = {}
    rejections: dict[str, dict[str | None, int]] = {}
    policies: list[str] = []
    weights: dict[str, float] = {}
    usage: list[tuple[float, dict[str, float]]] = []
    billed: list[tuple[float, str, float]] = []  # (ts, tenant hash, GPU ms) of finished requests
    key_of: dict[tuple[str, str], str] = {}  # (tenant hash, request id) -> its key id, admitted, not finished
    keys: dict[tuple[str, str], KeyUsage] = {}
    currency = "USD"

    def tenant(tag: str | None) -> TenantSummary:
        if tag not in tenants:
            tenants[tag] = TenantSummary(tag)
        return tenants[tag]

    for record in records:  # in file order (several processes may interleave): only the samples are sorted
        count += 1
        start, end = min(start, record["ts"]), max(end, record["ts"])
        kind = record["event"]
        if kind in ("started", "reloaded"):  # a reload's weights hold from then on: the last ones are used
            currency = _configured(record, policies, weights) or currency
        elif kind == "usage":
            usage.append((record["ts"], {tag: float(ms) for tag, ms in record["gpu_ms"].items()}))
            for tag in record["gpu_ms"]:
                tenant(tag)
        elif kind == "admitted":
            tenant(record["tenant_hash"]).admitted += 1
            if record.get("key_id"):
                key_of[(record["tenant_hash"], record["request_id"])] = record["key_id"]
        elif kind == "dispatched":
            tenant(record["tenant_hash"]).queue_ms.append(float(record["queue_ms"]))
        elif kind == "finished":
            summary = tenant(record["tenant_hash"])
            summary.finished[record["outcome"]] = summary.finished.get(record["outcome"], 0) + 1
            summary.billed_gpu_ms += record["gpu_ms"]
            summary.input_tokens += record["input_tokens"]
            summary.output_tokens += record["output_tokens"]
            summary.spend_micros += float(record.get("spend_micros") or 0.0)
            if record["ttft_incl_queue_ms"] is not None:  # as /metrics and the dashboard count it
                summary.ttft_ms.append(float(record["ttft_incl_queue_ms"]))
            if record["tenant_hash"] is not None:
                billed.append((record["ts"], record["tenant_hash"], float(record["gpu_ms"])))
                key = key_of.pop((record["tenant_hash"], record["request_id"]), None)
                if key is not None:
                    keys.setdefault((record["tenant_hash"], key), KeyUsage()).add(record)
        elif kind == "left":  # the client left while queued: cancelled, as a request that ran and was left
            summary = tenant(record["tenant_hash"])
            summary.finished["cancelled"] = summary.finished.get("cancelled", 0) + 1
            summary.queue_ms.append(float(record["queue_ms"]))
        elif kind == "rejected":
            tenant(record["tenant_hash"]).rejected += 1
            by_tenant = rejections.setdefault(record["reason"], {})
            by_tenant[record["tenant_hash"]] = by_tenant.get(record["tenant_hash"], 0) + 1
    if not count:
        raise OpsError("the log holds no records")
    if len(usage) >= 2:
        source, samples = "usage", sorted(usage, key=lambda sample: sample[0])
    else:
        source, samples = "finished", [(ts, {tag: ms}) for ts, tag, ms in sorted(billed)]
    cumulative: dict[str, float] = {}
    timeline = []
    for ts, amounts in samples:
        for tag, ms in amounts.items():
            cumulative[tag] = cumulative.get(tag, 0.0) + ms
        timeline.append((ts - start, dict(cumulative)))
    for tag, ms in cumulative.items():
        tenant(tag).gpu_ms = ms
    return LiveRun(start, end, count, policies, weights, tenants, rejections, timeline, source, keys, currency)


def share_stats(run: LiveRun, names: dict[str, str]) -> Any:
    """The run as the simulator's ``PolicyStats`` (one "seed"), so ``sim.plots.share_over_time`` draws it
    exactly as it draws a simulated policy. Tenants with GPU time only; shares are of the GPU time charged."""
    from fairgate.core.fairness import jain_index, max_min_ratio, weighted
    from fairgate.sim.experiment import PolicyStats, RunStats, TenantStats

    tags = [t for t in run.tenants if t is not None and run.tenants[t].gpu_ms > 0]
    total = sum(run.tenants[t].gpu_ms for t in tags)
    shares = {t: run.tenants[t].gpu_ms / total for t in tags} if total > 0 else {}
    fair = weighted(shares, run.weights)
    stats = [
        TenantStats(
            name=_label(t, names),
            gpu_ms=run.tenants[t].gpu_ms,
            gpu_share=shares[t],
            prefill_ms=0.0,
            decode_tokens=run.tenants[t].output_tokens,
            requests_finished=sum(run.tenants[t].finished.values()),
            mean_output_tokens=run.tenants[t].output_tokens / max(1, sum(run.tenants[t].finished.values())),
            ttft_ms={"p50": _percentile(run.tenants[t].ttft_ms, 50), "p99": _percentile(run.tenants[t].ttft_ms, 99)},
        )
        for t in tags
    ]
    timeline_s, timeline_share = [], []
    for seconds, cumulative in run.timeline:
        subtotal = sum(cumulative.get(t, 0.0) for t in tags)
        if subtotal > 0:
            timeline_s.append(seconds)
            timeline_share.append([cumulative.get(t, 0.0) / subtotal for t in tags])
    mean = RunStats(
        policy=", ".join(run.policies) or "live",
        seed=0,
        busy_ms=total,
        charged_ms=total,
        max_min_ratio=max_min_ratio(fair) if fair else math.nan,
        jain_index=jain_index(fair) if fair else math.nan,
        decode_tokens=sum(run.tenants[t].output_tokens for t in tags),
        prefill_fraction=math.nan,
        tenants=stats,
        timeline_s=timeline_s,
        timeline_share=timeline_share,
    )
    return PolicyStats(mean=mean, per_seed=[mean])


def _percentile(values: Sequence[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else math.nan


@ops_app.command()
def report(
    out_dir: Annotated[Path, typer.Option("--out", help="Directory for report.html and its PNG charts.")],
    log: LogOption = None,
    config: ConfigOption = None,
) -> None:
    """Write an HTML report with PNG charts of a live run from the request log.

    Writes DIR/report.html, DIR/shares.png (the simulator's GPU-share chart), DIR/queue_times.png, DIR/rejections.png.

    Exit code 2 for a bad option or log."""
    from fairgate.gateway.eventlog import read_records

    def run() -> list[Path]:
        path, names = _source(log, config)
        target = output_dir(out_dir, "--out", OpsError)
        try:
            live = summarise_log(r for _, _, r in read_records(path))
        except OpsError as exc:
            raise OpsError(f"{path}: {exc}") from None
        return write_report(live, names, target, path)

    for written in _guard(run):
        errors.print(f"wrote {written}")


def write_report(run: LiveRun, names: dict[str, str], target: Path, source: Path) -> list[Path]:
    """Write ``shares.png`` (if any GPU time was charged), ``queue_times.png``, ``rejections.png`` and
    ``report.html`` into ``target``; return the paths written.

    Raises:
        OpsError: a file cannot be written.
    """
    from fairgate.sim.plots import queue_times, rejections_by_reason, share_over_time

    span = f"{_clock(run.start_ts)} to {_clock(run.end_ts)}"
    policy = ", ".join(run.policies) or "unknown policy"
    written: list[Path] = []
    try:
        stats = share_stats(run, names)
        if stats.mean.timeline_s:
            source_text = "metered usage" if run.share_source == "usage" else "finished requests"
            written.append(
                share_over_time(
                    [stats],
                    target / "shares.png",
                    f"live run, {policy}: cumulative GPU share per tenant ({source_text})",
                    step_s=_share_step_s(stats.mean.timeline_s[-1]),
                )
            )
        queues = {_label(t, names): s.queue_ms for t, s in run.tenants.items() if s.queue_ms}
        written.append(queue_times(queues, target / "queue_times.png", f"live run, {policy}: time in the queue"))
        counts = {reason: {_label(t, names): n for t, n in by.items()} for reason, by in run.rejections.items()}
        written.append(
            rejections_by_reason(counts, target / "rejections.png", f"live run, {policy}: rejected requests by reason")
        )
        page = target / "report.html"
        page.write_text(_html(run, names, stats, span, policy, source, {p.name for p in written}), encoding="utf-8")
    except OSError as exc:
        raise OpsError(f"--out {target}: cannot write: {exc.strerror or exc}") from None
    written.append(page)
    return written


def _share_step_s(span_s: float) -> float:
    """The share chart's sampling step for a run of ``span_s`` seconds: the simulator's 1 s for runs of five
    minutes or more (at most 2,000 samples), finer for shorter runs (300 samples)."""
    if span_s >= 300:
        return max(1.0, span_s / 2000)
    return max(span_s / 300, 0.001)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:,.{digits}f}"


def backlogged_ratio(run: LiveRun) -> float:
    """Max/min of the weighted GPU shares among the tenants that waited for slots (``TenantSummary.backlogged``;
    nan: fewer than two of them), the shares being of the GPU time they were charged together."""
    from fairgate.core.fairness import max_min_ratio, weighted

    tags = [t for t, s in run.tenants.items() if t is not None and s.gpu_ms > 0 and s.backlogged]
    total = sum(run.tenants[t].gpu_ms for t in tags)
    if len(tags) < 2 or total <= 0:
        return math.nan
    return max_min_ratio(weighted({t: run.tenants[t].gpu_ms / total for t in tags}, run.weights))


def _tenant_cell(tag: str | None, summary: TenantSummary, names: dict[str, str]) -> str:
    if tag is None:
        return "(no tenant)"
    e = html.escape
    cell = f"<code>{e(tag)}</code>" + (f" {e(names[tag])}" if tag in names else "")
    return cell + ("" if summary.backlogged else " <em>(demand-limited)</em>")


def _figures_text(run: LiveRun, stats: Any) -> str:
    """What the report's figures are and how to read them (HTML)."""
    source = (
        "the gateway's metered usage aggregates"
        if run.share_source == "usage"
        else "the GPU ms billed to each finished request, at its finish time"
    )
    waited, every = _fmt(backlogged_ratio(run), 2), _fmt(stats.mean.max_min_ratio, 2)
    return f"""GPU shares are of the GPU time charged to tenants, from {html.escape(source)}; max/min of weighted shares
among the tenants that waited for slots {waited} (all tenants: {every}), Jain's index {_fmt(stats.mean.jain_index, 3)}.
A tenant marked demand-limited never waited {BACKLOG_QUEUE_MS:g} ms for a slot: it got all it asked, so its share says
how much it asked, not how fairly it was served. Tenants are shown by their hash. TTFT is from admission to the
first token, the queue included."""


def _money(micros: float) -> str:
    """Micros of the currency as an amount: to the cent from one unit up, else to 1/10,000 (0 as 0)."""
    value = micros / 1e6
    return "0" if value == 0 else f"{value:,.2f}" if value >= 1 else f"{value:.4f}"


def _key_label(key_id: str, names: dict[str, str]) -> str:
    """A key in the report: its id (the stored hash's prefix), with its configured label when it has one."""
    return f"{names[key_id]} ({key_id}...)" if key_id in names else f"{key_id}..."


def _keys_html(run: LiveRun, names: dict[str, str]) -> str:
    """The table of usage by API key inside each tenant (seed 003: secondary dimensions under the billable
    tenant), from the ``key_id`` of ``admitted`` records; empty when the log has none."""
    if not run.keys:
        return ""
    e = html.escape
    rows = [
        f"<tr><td>{e(_label(tag, names))}</td><td>{e(_key_label(key, names))}</td><td>{u.finished}</td>"
        f"<td>{u.input_tokens:,}</td><td>{u.output_tokens:,}</td><td>{_fmt(u.gpu_ms)}</td>"
        f"<td>{_money(u.spend_micros)}</td></tr>"
        for (tag, key), u in sorted(run.keys.items(), key=lambda item: (item[0][0], -item[1].gpu_ms))
    ]
    head = (
        "<tr><th>tenant</th><th>key</th><th>finished</th><th>prompt tokens</th><th>output tokens</th>"
        f"<th>GPU ms</th><th>spend {html.escape(run.currency)}</th></tr>"
    )
    return "<h2>Usage by key</h2>\n<table>" + head + "\n".join(rows) + "</table>"


def _html(
    run: LiveRun, names: dict[str, str], stats: Any, span: str, policy: str, source: Path, charts: set[str]
) -> str:
    e = html.escape
    total_gpu = sum(s.gpu_ms for s in run.tenants.values())
    rows = []
    for tag, s in sorted(run.tenants.items(), key=lambda item: (item[0] is None, -item[1].gpu_ms, item[0] or "")):
        share = s.gpu_ms / total_gpu * 100 if total_gpu > 0 else math.nan
        finished = ", ".join(f"{n} {o}" for o, n in sorted(s.finished.items())) or "0"
        rows.append(
            "<tr>"
            + "".join(
                f"<td>{c}</td>"
                for c in (
                    _tenant_cell(tag, s, names),
                    s.admitted,
                    e(finished),
                    s.rejected,
                    _fmt(s.gpu_ms),
                    _fmt(share),
                    _fmt(run.weights.get(tag or ""), 2),
                    _fmt(_percentile(s.queue_ms, 50)),
                    _fmt(_percentile(s.queue_ms, 99)),
                    _fmt(_percentile(s.ttft_ms, 50)),
                    _fmt(_percentile(s.ttft_ms, 99)),
                    f"{s.input_tokens:,}",
                    f"{s.output_tokens:,}",
                    _money(s.spend_micros),
                )
            )
            + "</tr>"
        )
    reject_rows = []
    for reason, by in sorted(run.rejections.items(), key=lambda item: -sum(item[1].values())):
        detail = ", ".join(f"{e(_label(t, names))}: {n}" for t, n in sorted(by.items(), key=lambda i: -i[1]))
        reject_rows.append(f"<tr><td>{e(reason)}</td><td>{sum(by.values())}</td><td>{detail}</td></tr>")
    figures = []
    if "shares.png" in charts:
        figures.append(("shares.png", "Cumulative GPU share per tenant over time (the simulator's chart)"))
    else:
        figures.append(("", "No GPU time was charged in this log: no share chart."))
    figures += [("queue_times.png", "Time in the queue per tenant"), ("rejections.png", "Rejected requests by reason")]
    figure_html = "\n".join(
        f'<figure><img src="{e(name)}" alt="{e(caption)}"><figcaption>{e(caption)}</figcaption></figure>'
        if name
        else f"<p>{e(caption)}</p>"
        for name, caption in figures
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>fairgate live report: {e(span)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}td:first-child,th:first-child{{text-align:left}}
figure{{margin:1.5em 0}}img{{max-width:100%}}code{{font-size:90%}}</style></head>
<body>
<h1>fairgate live report</h1>
<p>From <code>{e(str(source))}</code>: {run.records:,} records, {e(span)}, policy {e(policy)}.
{_figures_text(run, stats)}</p>
<h2>Tenants</h2>
<table><tr><th>tenant</th><th>admitted</th><th>finished</th><th>rejected</th><th>GPU ms</th><th>GPU share %</th>
<th>weight</th><th>queue p50 ms</th><th>queue p99 ms</th><th>TTFT p50 ms (queue incl.)</th>
<th>TTFT p99 ms (queue incl.)</th>
<th>prompt tokens</th><th>output tokens</th><th>spend {e(run.currency)}</th></tr>
{chr(10).join(rows)}
</table>
{_keys_html(run, names)}
<h2>Rejections</h2>
{
        "<table><tr><th>reason</th><th>requests</th><th>by tenant</th></tr>" + chr(10).join(reject_rows) + "</table>"
        if reject_rows
        else "<p>No request was rejected.</p>"
    }
<h2>Charts</h2>
{figure_html}
</body></html>
"""

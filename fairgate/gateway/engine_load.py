"""Engine-aware dispatch: each upstream engine's own load, read from its Prometheus ``/metrics``.

Where the upstream's kind names its load series (``kinds.Metrics``: vLLM ``vllm:num_requests_running`` /
``vllm:num_requests_waiting``, SGLang ``sglang:num_running_reqs`` / ``sglang:num_queue_reqs``, llama.cpp
``llamacpp:requests_processing`` / ``llamacpp:requests_deferred``, TGI ``tgi_batch_current_size`` /
``tgi_queue_size``), every ``ENGINE_LOAD_EVERY_S`` the gateway reads them (summed over their labels) and tells
the dispatcher (``Dispatcher.engine_load``): an engine found full and queueing requests inside itself on two
reads in a row (``Upstream.overfilled``: not a request waiting for the next iteration while a slot is free,
but another client sharing it, or ``max_batch`` set above its real slots) gets nothing more until its queue
drains, since those requests wait first come, first served, outside any fairness. The running count is exported beside
the gateway's own in-flight count (``fairgate_upstream_engine_running``). An engine that does not answer, or
lacks the series, counts as unknown (no effect on dispatch).

The meter's batch size is checked against the engine's on each read (``BatchCheck``). The meter splits each
iteration's ``dt`` among the ``B`` sequences it knows of (``UpstreamClient.batch_size``: this process's and
the other gateway processes'); another client sharing the engine, or a ``max_batch`` above the engine's
slots (the excess waits inside it, metered as running), makes that ``B`` wrong and every ``dt / B`` share
with it. A read disagrees when the two differ by more than ``MISMATCH_SEQUENCES`` (2) sequences and more than
``MISMATCH_FRACTION`` (25 %) of the larger; ``MISMATCH_READS`` (4) such reads in a row (2 s at the default
interval) are a mismatch: a request sent and not yet admitted, or ended and not yet counted by the engine,
is half an iteration's difference on one read, not on four. It is logged once, as a warning
``{"event": "batch_size_mismatch", "upstream", "engine_running", "gateway_batch"}``, and its end (as many
agreeing reads in a row) as an info line ``batch_size_mismatch_ended``, as the step-time drift is
(``cost_model_drift``, ``fairgate.core.drift``); ``fairgate_upstream_batch_mismatch`` is 1 meanwhile, 0
otherwise (``fairgate.gateway.metrics``). An unknown count breaks a run of reads and changes nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from fairgate.gateway.kinds import Metrics
from fairgate.gateway.metrics import batch_mismatch_gauge
from fairgate.gateway.state import GatewayState
from fairgate.gateway.upstream import UpstreamClient

log = logging.getLogger("fairgate.gateway")

ENGINE_LOAD_EVERY_S = 0.5
ENGINE_LOAD_TIMEOUT_S = 2.0
MISMATCH_SEQUENCES = 2
MISMATCH_FRACTION = 0.25
MISMATCH_READS = 4


def disagree(engine_running: float, gateway_batch: int) -> bool:
    """Whether one read's counts differ by more than ``MISMATCH_SEQUENCES`` and ``MISMATCH_FRACTION`` of the
    larger."""
    tolerated = max(MISMATCH_SEQUENCES, MISMATCH_FRACTION * max(engine_running, gateway_batch))
    return abs(engine_running - gateway_batch) > tolerated


@dataclass
class BatchCheck:
    """The engine's running count against the gateway's batch size on one upstream, read after read
    (module docstring). ``mismatched``: the state declared; ``streak``: reads in a row saying otherwise."""

    mismatched: bool = False
    streak: int = 0

    def read(self, engine_running: float | None, gateway_batch: int) -> bool | None:
        """One read (None: the engine's count is unknown). Returns True when a mismatch has just begun,
        False when it has just ended, None otherwise."""
        if engine_running is None:
            self.streak = 0
            return None
        differs = disagree(engine_running, gateway_batch)
        self.streak = self.streak + 1 if differs != self.mismatched else 0
        if self.streak < MISMATCH_READS:
            return None
        self.mismatched, self.streak = differs, 0
        return differs


def parse_load(text: str, metrics: Metrics) -> tuple[float | None, float | None]:
    """(running, waiting) from a Prometheus text exposition: each series' samples summed (an engine labels
    them by model); None for a series the text lacks. Raises ``ValueError`` for text that is not the format."""
    found: dict[str, float] = {}
    wanted = {name for name in (metrics.running, metrics.waiting) if name is not None}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                found[sample.name] = found.get(sample.name, 0.0) + float(sample.value)
    return (
        found.get(metrics.running) if metrics.running else None,
        found.get(metrics.waiting) if metrics.waiting else None,
    )


async def read_load(client: UpstreamClient, root_url: str, metrics: Metrics) -> tuple[float | None, float | None]:
    """The engine's (running, waiting) from ``<root_url>/metrics``; (None, None) when it cannot be read."""
    try:
        status, text = await client.get(f"{root_url}/metrics", ENGINE_LOAD_TIMEOUT_S)
        if status != 200:
            return None, None
        return parse_load(text, metrics)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None, None


async def poll_engine_load(state: GatewayState, interval_s: float | None = None) -> None:
    """Forever: every ``interval_s`` (default ``ENGINE_LOAD_EVERY_S``, read at each round), each upstream
    whose kind reports its load is read, the dispatcher told and the batch sizes checked (see module
    docstring); ``fairgate_upstream_batch_mismatch`` is on the gateway's registry meanwhile."""
    checks: dict[str, BatchCheck] = {}
    gauge = batch_mismatch_gauge()
    registry = state.metrics_registry
    if registry is not None:
        registry.register(gauge)
    try:
        while True:
            await asyncio.sleep(interval_s or ENGINE_LOAD_EVERY_S)
            checked: dict[str, BatchCheck] = {}  # this round's upstreams: one a reload took out is forgotten
            values: list[tuple[tuple[str, ...], float]] = []
            for upstream in state.dispatcher.upstreams():
                client = state.upstreams.get(upstream.name)
                if client is None or (client.kind.metrics.running is None and client.kind.metrics.waiting is None):
                    continue
                root = upstream.url.rstrip("/").removesuffix("/v1")
                running, waiting = await read_load(client, root, client.kind.metrics)
                state.dispatcher.engine_load(upstream, running, waiting)
                check = checked[upstream.name] = checks.get(upstream.name) or BatchCheck()
                _check_batch(upstream.name, check, running, client.batch_size)
                values.append(((upstream.name, upstream.model), 1.0 if check.mismatched else 0.0))
            checks, gauge.values = checked, tuple(values)
    finally:
        if registry is not None:
            registry.unregister(gauge)


def _check_batch(name: str, check: BatchCheck, running: float | None, gateway_batch: int) -> None:
    """Feed ``check`` one read; log a mismatch begun (warning) or ended (info)."""
    changed = check.read(running, gateway_batch)
    if changed is None or running is None:
        return
    line = {
        "event": "batch_size_mismatch" if changed else "batch_size_mismatch_ended",
        "upstream": name,
        "engine_running": int(running) if running.is_integer() else running,
        "gateway_batch": gateway_batch,
    }
    (log.warning if changed else log.info)(json.dumps(line))

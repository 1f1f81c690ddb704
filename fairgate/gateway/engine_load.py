"""Engine-aware dispatch: each upstream engine's own load, read from its Prometheus ``/metrics``.

Where the upstream's kind names its load series (``kinds.Metrics``: vLLM ``vllm:num_requests_running`` /
``vllm:num_requests_waiting``, SGLang ``sglang:num_running_reqs`` / ``sglang:num_queue_reqs``, llama.cpp
``llamacpp:requests_processing`` / ``llamacpp:requests_deferred``, TGI ``tgi_batch_current_size`` /
``tgi_queue_size``), every ``ENGINE_LOAD_EVERY_S`` the gateway reads them (summed over their labels) and tells
the dispatcher (``Dispatcher.engine_load``): an engine found full and queueing requests inside itself on two
reads in a row (``Upstream.overfilled``: not a request waiting for the next iteration while a slot is free,
but another client sharing it, or ``max_batch`` set above its real slots) gets nothing more until its queue
drains, since those requests wait first come, first served, outside any fairness. The running count is exported beside
the gateway's own in-flight count (``fairgate_upstream_engine_running``) so the meter's batch size can be
checked against the engine's. An engine that does not answer, or lacks the series, counts as unknown (no
effect on dispatch).
"""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from fairgate.gateway.kinds import Metrics
from fairgate.gateway.state import GatewayState
from fairgate.gateway.upstream import UpstreamClient

ENGINE_LOAD_EVERY_S = 0.5
ENGINE_LOAD_TIMEOUT_S = 2.0


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
    whose kind reports its load is read and the dispatcher told (see module docstring)."""
    while True:
        await asyncio.sleep(interval_s or ENGINE_LOAD_EVERY_S)
        for upstream in state.dispatcher.upstreams():
            client = state.upstreams.get(upstream.name)
            if client is None or (client.kind.metrics.running is None and client.kind.metrics.waiting is None):
                continue
            root = upstream.url.rstrip("/").removesuffix("/v1")
            running, waiting = await read_load(client, root, client.kind.metrics)
            state.dispatcher.engine_load(upstream, running, waiting)

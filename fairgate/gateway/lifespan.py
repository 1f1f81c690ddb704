"""The gateway's lifespan: what starts with the app and stops with it (the ledger, the upstream clients, the
background work), kept apart from the wiring in ``fairgate.gateway.app``."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from pydantic import SecretStr

from fairgate.gateway import background, upstream_reload
from fairgate.gateway.config import UpstreamConfig
from fairgate.gateway.dispatch import Dispatcher, Upstream
from fairgate.gateway.state import GatewayState
from fairgate.gateway.upstream import UpstreamClient
from fairgate.ledger import Ledger, connect
from fairgate.ledger.deferred import DeferredLedger

CONNECT_WAIT_S = 2.0  # the start waits this long for the ledger, then serves its outage policy meanwhile


def lifespan(state: GatewayState, ledger: Ledger | None, keys: Mapping[str, SecretStr]) -> Any:
    """Open the ledger and the upstream clients (with their API ``keys``), start the background work; undo
    it all at shutdown."""

    @asynccontextmanager
    async def run(_: FastAPI) -> AsyncIterator[dict[str, Any]]:
        config = state.config
        opened = ledger
        connecting = None
        if opened is None:  # started during an outage, it serves the outage policy until the ledger answers
            deferred = DeferredLedger(config.quotas, lambda: connect(config.ledger_url, config.quotas))
            connecting = asyncio.ensure_future(deferred.connect())
            await asyncio.wait({connecting}, timeout=CONNECT_WAIT_S)
            opened = deferred
        state.open_ledger(opened)

        def open_upstream(upstream: Upstream, settings: UpstreamConfig, api_key: SecretStr | None) -> UpstreamClient:
            return UpstreamClient(
                upstream,
                _charge_sink(state.dispatcher, upstream.pool),
                clock=state.clock.monotonic_s,
                timeout_s=config.gateway.request_timeout_s,
                on_down=state.dispatcher.mark_down,
                settings=settings,
                api_key=api_key,
                correct=functools.partial(state.dispatcher.correct, upstream.pool),
            )

        state.set_upstream_opener(open_upstream)
        state.dispatcher.on_gone = lambda upstream: upstream_reload.forget(state, upstream)
        settings = {u.name: u for u in config.upstreams}
        for upstream in state.dispatcher.upstreams():
            state.upstreams[upstream.name] = open_upstream(upstream, settings[upstream.name], keys.get(upstream.name))
        tasks = background.start(state)
        yield {"gateway": state}
        for task in tasks:
            task.cancel()
        if connecting is not None:
            connecting.cancel()
        for client in state.upstreams.values():
            await client.close()
        if ledger is None:
            await opened.close()

    return run


def _charge_sink(dispatcher: Dispatcher, pool: str) -> Any:
    def charge(tenant: str, gpu_ms: float, output_tokens: int, batch_size: int) -> None:
        dispatcher.charge(pool, tenant, gpu_ms, output_tokens, batch_size)

    return charge

"""Emulated replicas: their cost model as a stack declares it (``ReplicaModel``), turned into the
emulator's settings, its ``fairgate emulate`` arguments and the gateway's ``[[upstream]]`` table; and what
a running replica reports about itself (``ReplicaStats``, from ``/emulator/stats``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fairgate.emulator.api import EmulatorSettings
from fairgate.gateway.config import UpstreamConfig


@dataclass(frozen=True)
class ReplicaModel:
    """An emulated replica's cost model (``dt = base + slope * B + prefill * tokens``, ms), slots, context
    length (tokens), mean output length (tokens, for requests that do not fix theirs), and whether it reuses
    cached prompt prefixes per ``cache_salt`` (vLLM's automatic prefix caching,
    https://docs.vllm.ai/en/latest/design/prefix_caching.html; off by default)."""

    iter_base_ms: float = 100.0
    iter_slope_ms: float = 0.5
    prefill_ms_per_token: float = 0.02
    max_batch: int = 12
    max_model_len: int = 16_384
    output_mean_tokens: float = 128.0
    prefix_caching: bool = False

    def iteration_ms(self, batch: int, prefill_tokens: int = 0) -> float:
        return self.iter_base_ms + self.iter_slope_ms * batch + self.prefill_ms_per_token * prefill_tokens

    def settings(self, model: str, extra_slots: int = 0) -> EmulatorSettings:
        """The emulator's settings serving ``model``, with ``extra_slots`` beyond ``max_batch``."""
        return EmulatorSettings(
            model=model,
            iter_base_ms=self.iter_base_ms,
            iter_slope_ms=self.iter_slope_ms,
            prefill_ms_per_token=self.prefill_ms_per_token,
            max_batch=self.max_batch + extra_slots,
            output_mean_tokens=self.output_mean_tokens,
            max_model_len=self.max_model_len,
            prefix_caching=self.prefix_caching,
        )

    def emulate_args(self, port: int, model: str, extra_slots: int = 0) -> list[str]:
        """``fairgate emulate`` arguments for the same replica on ``port``."""
        out = ["emulate", "--port", str(port)]
        for name, value in self.settings(model, extra_slots).model_dump(exclude={"require_tenant_context"}).items():
            flag = f"--{name.replace('_', '-')}"
            if isinstance(value, bool):  # a switch: named when on, absent when off
                out += [flag] if value else []
            else:
                out += [flag, str(value)]
        return out

    def upstream(self, name: str, url: str, model: str, max_batch: int | None = None, **more: Any) -> UpstreamConfig:
        """The gateway's ``[[upstream]]`` for this replica at ``url`` (its base URL, without ``/v1``), of
        whose slots the gateway uses ``max_batch`` (default: all); ``more``: other keys of the table (a cost
        model's keys in it override this replica's). The
        emulator speaks vLLM's dialect (``cache_salt``, ``ignore_eos``), so the kind is ``vllm`` unless given; the
        gateway estimates its prompts (``tokenize = false``: no ``/tokenize`` round trip before each request)
        unless ``more`` sets ``tokenize``."""
        return UpstreamConfig(
            name=name,
            url=f"{url}/v1",
            model=model,
            max_batch=max_batch or self.max_batch,
            **{
                "iter_base_ms": self.iter_base_ms,
                "iter_slope_ms": self.iter_slope_ms,
                "prefill_ms_per_token": self.prefill_ms_per_token,
                "max_model_len": self.max_model_len,
                "kind": "vllm",
                "tokenize": False,
                **more,
            },
        )


@dataclass(frozen=True)
class ReplicaStats:
    """One reading of a replica's ``/emulator/stats``."""

    busy_ms: float  # time it spent in iterations
    # its own charge rule's GPU ms per cache scope (a tenant's ``cache_salt``:
    # ``fairgate.ledger.base.tenant_tag``)
    charge_ms_by_salt: dict[str, float]
    running: int  # sequences in its batch
    waiting: int  # submitted but not yet admitted
    tokens_generated: int  # output tokens generated so far
    # its recent iterations' planned and measured time, ms: their ratio is its timing lag
    # (bench/live_fairness.py reports it beside the shares)
    planned_ms: float
    measured_ms: float
    sequences_finished: int = 0  # sequences it ran to their end
    sequences_cancelled: int = 0  # sequences stopped before their end (the gateway closed the stream)

    @property
    def occupancy(self) -> int:
        """Sequences running or waiting: more than its slots means it queues beyond them."""
        return self.running + self.waiting

    def by_tenant(self, tenants: Sequence[str]) -> dict[str, float]:
        """Its charge-rule GPU ms per tenant."""
        from fairgate.ledger.base import tenant_tag

        return {t: float(self.charge_ms_by_salt.get(tenant_tag(t), 0.0)) for t in tenants}


async def read_replica(url: str, timeout_s: float = 2.0) -> ReplicaStats | None:
    """The replica at ``url``'s stats now (None: it does not answer)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            stats = (await http.get(f"{url}/emulator/stats")).json()
    except (httpx.HTTPError, ValueError):
        return None
    return ReplicaStats(
        float(stats["busy_ms"]),
        {salt: float(ms) for salt, ms in stats["charge_rule_ms_by_cache_salt"].items()},
        int(stats["running"]),
        int(stats["waiting"]),
        int(stats["tokens_generated"]),
        float(stats["planned_ms"]),
        float(stats["measured_ms"]),
        int(stats["sequences_finished"]),
        int(stats["sequences_cancelled"]),
    )


async def read_replicas(urls: Sequence[str]) -> list[ReplicaStats]:
    """Every replica's stats now.

    Raises:
        RuntimeError: one does not answer.
    """
    out = []
    for url in urls:
        stats = await read_replica(url, timeout_s=10.0)
        if stats is None:
            raise RuntimeError(f"the replica at {url} does not answer /emulator/stats")
        out.append(stats)
    return out


async def watch_occupancy(
    urls: Mapping[object, str], every_s: float, most: dict[object, int], stop: asyncio.Event, until: float | None = None
) -> None:
    """Read each replica every ``every_s`` until ``stop`` is set (or the monotonic time ``until``);
    ``most[key]``: the most sequences it held (running + waiting)."""
    while not stop.is_set() and (until is None or time.monotonic() < until):
        for key, url in urls.items():
            stats = await read_replica(url, timeout_s=1.0)
            if stats is not None:
                most[key] = max(most.get(key, 0), stats.occupancy)
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


__all__ = ["ReplicaModel", "ReplicaStats", "read_replica", "read_replicas", "watch_occupancy"]

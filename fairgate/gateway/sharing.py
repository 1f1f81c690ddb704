"""Sharing the fair policy's counters between gateway processes (scale-out).

Several ``fairgate serve`` processes in front of the same upstreams each run a policy object; for the
shares to stay fair when a tenant's traffic lands on different processes, each policy must count every
tenant's *global* usage. Every ``interval_s`` each process adds the charges its policy booked since the last
round to per-model totals in the shared ledger (``Ledger.add_charges``, atomic) and books the growth of the
totals that is not its own with its policy (``Dispatcher.charge_remote``). A process that starts (or
restarts) books the whole history once, so every process counts the same totals.

Staleness is bounded by ``interval_s`` (plus a ledger round trip): a policy may favour a tenant for that
long on the strength of counters that other processes have already moved. With the ledger down, rounds
are skipped and the local charges are kept for the next round, so nothing is lost.

The same rounds share the live meters' occupancy (``Ledger.share_occupancy``): each process publishes, per
upstream URL, how many of its requests were in the upstream's iterations on average since its last round,
and what share of its time went to their prefill, and tells each of its meters what the other processes
hold of that upstream, so that processes sharing a replica split its busy time instead of each billing all
of it (``fairgate.core.meter``). A publication counts for ``4 * interval_s + 1 s``: a process that stops
drops out of the others' meters by then.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping

from fairgate.core.meter import Occupancy
from fairgate.gateway.dispatch import Dispatcher
from fairgate.gateway.upstream import UpstreamClient
from fairgate.ledger import Ledger, LedgerError

log = logging.getLogger("fairgate.gateway")


class ChargeSync:
    """Pushes this process's charges to the ledger and books the others' (see module docstring).

    Args:
        ledger: the shared ledger (not the emergency front).
        dispatcher: this process's dispatcher.
        interval_s: seconds between rounds.
        clients: this process's upstream clients, whose meters' occupancy is shared (none: counters only).
        process: this process's name among those sharing the ledger (default: a fresh random one).
    """

    def __init__(
        self,
        ledger: Ledger,
        dispatcher: Dispatcher,
        interval_s: float,
        clients: Mapping[str, UpstreamClient] | None = None,
        process: str | None = None,
    ) -> None:
        self.ledger, self.dispatcher, self.interval_s = ledger, dispatcher, interval_s
        self.clients = clients if clients is not None else {}  # the live mapping: a reload adds and retires
        self.process = process or uuid.uuid4().hex
        self._known: dict[str, dict[str, tuple[float, int, int]]] = {}  # model -> tenant -> totals seen
        self._pending: dict[str, dict[str, tuple[float, int, int]]] = {}  # not yet added (ledger was down)

    async def sync_once(self) -> None:
        """One round for every model. Raises ``LedgerError`` (the charges taken are kept for next time)."""
        for model in self.dispatcher.models():
            mine = _add(self._pending.pop(model, {}), self.dispatcher.take_local_charges(model))
            try:
                totals = await self.ledger.add_charges(model, mine)
            except BaseException:
                self._pending[model] = _add(self._pending.get(model, {}), mine)
                raise
            known = self._known.setdefault(model, {})
            for tenant, total in totals.items():
                before = known.get(tenant, (0.0, 0, 0))
                own = mine.get(tenant, (0.0, 0, 0))
                remote = tuple(t - b - o for t, b, o in zip(total, before, own, strict=True))
                known[tenant] = total
                if remote[0] > 1e-9 or remote[1] > 0 or remote[2] > 0:
                    self.dispatcher.charge_remote(
                        model, tenant, max(0.0, remote[0]), max(0, int(remote[1])), max(0, int(remote[2]))
                    )
        await self.share_occupancy()

    async def share_occupancy(self) -> None:
        """Publish this process's meters' occupancy and set the others' on them. Raises ``LedgerError``."""
        if not self.clients:
            return
        mine: dict[str, tuple[float, float]] = {}
        clients = list(self.clients.values())  # as they are now: a reload may change them during the call
        for client in clients:
            taken = client.take_occupancy()
            before = mine.get(upstream_key(client), (0.0, 0.0))
            mine[upstream_key(client)] = (before[0] + taken.sequences, before[1] + taken.prefill_share)
        others = await self.ledger.share_occupancy(self.process, mine, 4000.0 * self.interval_s + 1000.0)
        for client in clients:
            sequences, prefill_share = others.get(upstream_key(client), (0.0, 0.0))
            client.set_remote(Occupancy(sequences, min(1.0, prefill_share)))

    async def run(self) -> None:
        """Rounds every ``interval_s`` until cancelled; a ledger outage is logged once per outage."""
        down = False
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sync_once()
                down = False
            except LedgerError as exc:
                if not down:
                    log.warning("charge sharing paused: %s", exc)
                down = True
            except Exception:  # an error no backend mapped: the loop must outlive it (its charges are kept)
                log.exception("charge sharing round failed; tried again next round")


def upstream_key(client: UpstreamClient) -> str:
    """The name processes share an upstream's occupancy under: its URL (their ``[[upstream]]`` names may
    differ)."""
    return client.upstream.url.rstrip("/")


def _add(
    a: dict[str, tuple[float, int, int]], b: dict[str, tuple[float, int, int]]
) -> dict[str, tuple[float, int, int]]:
    out = dict(a)
    for tenant, (gpu_ms, tokens_in, tokens_out) in b.items():
        g, i, o = out.get(tenant, (0.0, 0, 0))
        out[tenant] = (g + gpu_ms, i + tokens_in, o + tokens_out)
    return out

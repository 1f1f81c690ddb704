"""Upstreams added and removed by a reload (``fairgate.gateway.reload``), while requests run.

An ``[[upstream]]`` table new in the file is opened (its client, its live meter) and takes requests at once,
in the pool it names; one gone from the file takes no new request, its requests run to their end (streams
included: they were dispatched to it and are billed from its meter), then its client is closed
(``Dispatcher.retire``). This is how replicas are added to and taken out of a running model, as an
autoscaler or an operator does it with vLLM or llama.cpp behind the gateway.

What a reload cannot do is refused, the running upstreams kept whole: an upstream whose table changed (a
changed URL, batch size, cost model or credential is another replica: give it a new name, the old one
drains), a new pool or model (its queues and policy are built at start: a restart adds it), taking out the
last upstream of a pool, reusing the name of one still draining for another table, and the API key of an
added upstream that cannot be read. An upstream configured again, unchanged, while it still drains (a reload
undone) serves again.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, field

from pydantic import SecretStr

from fairgate.gateway import aliases
from fairgate.gateway.config import GatewayConfig, GatewayConfigError, UpstreamConfig
from fairgate.gateway.dispatch import Upstream
from fairgate.gateway.state import GatewayState


@dataclass(frozen=True)
class UpstreamPlan:
    """What a reload changes of the upstreams: the tables to open and the names to retire."""

    added: tuple[UpstreamConfig, ...] = ()
    removed: tuple[str, ...] = ()
    keys: Mapping[str, SecretStr] = field(default_factory=dict)
    revived: tuple[str, ...] = ()  # draining, configured again unchanged: they serve again

    @property
    def empty(self) -> bool:
        return not self.added and not self.removed and not self.revived


def plan(state: GatewayState, new: GatewayConfig) -> UpstreamPlan:
    """The upstream changes from the running gateway to ``new`` (module docstring). Raises
    ``GatewayConfigError`` naming the table when ``new`` asks for what a reload cannot do."""
    running = state.config
    path = running.path
    before = {u.name: u for u in running.upstreams}
    after = {u.name: (i, u) for i, u in enumerate(new.upstreams)}
    for name, (i, table) in after.items():
        if name in before and before[name] != table:
            raise GatewayConfigError(
                f"{path}: upstream[{i}]: upstream {name!r} changed: a changed upstream is applied by a restart; "
                "or give it a new name (the one running drains its requests, then closes)"
            )
    added = tuple(table for name, (_, table) in after.items() if name not in before)
    removed = tuple(name for name in before if name not in after)
    if not added and not removed:
        return UpstreamPlan()
    pools = set(state.dispatcher.models())
    revived = []
    for table in added:
        i = after[table.name][0]
        if table.pool_name not in pools:
            raise GatewayConfigError(
                f"{path}: upstream[{i}]: pool {table.pool_name!r} is not running (a new model or pool is added "
                "by a restart; a reload adds upstreams to the running ones)"
            )
        draining = state.upstreams.get(table.name)
        if draining is not None and draining.settings != table:
            raise GatewayConfigError(
                f"{path}: upstream[{i}]: upstream {table.name!r} is still draining the requests it ran before it "
                "was removed: reload again once they end, or give it another name"
            )
        if draining is not None:
            revived.append(table.name)
    if aliases.served_models(running.models, new.upstreams) != running.served:
        emptied = sorted({before[name].pool_name for name in removed} - {u.pool_name for u in new.upstreams})
        raise GatewayConfigError(
            f"{path}: upstream: pool {emptied[0] if emptied else '?'!r} would have no upstream left: keep one "
            "(the last upstream of a running model is removed by a restart)"
        )
    opened = tuple(table for table in added if table.name not in revived)
    keys = new.upstream_keys(names=[table.name for table in opened])  # those kept keep the key they run with
    return UpstreamPlan(opened, removed, keys, tuple(revived))


def apply(state: GatewayState, change: UpstreamPlan) -> None:
    """Retire ``change.removed``, open and add ``change.added`` (``plan``'s; nothing here refuses)."""
    if change.empty:
        return
    present = {u.name: u for u in state.dispatcher.upstreams()}
    for name in change.revived:
        state.dispatcher.revive(present[name])
    for name in change.removed:
        upstream = present.get(name)
        if upstream is not None and not upstream.retired:
            state.dispatcher.retire(upstream)
    for table in change.added:
        upstream = Upstream(table.name, table.model, table.url, table.max_batch, table.cost, pool=table.pool_name)
        state.upstreams[table.name] = state.open_upstream(upstream, table, change.keys.get(table.name))
        state.dispatcher.add(upstream)


def undo(state: GatewayState, previous: GatewayConfig) -> None:
    """Bring the upstreams back to ``previous``'s as far as a reload can (``reload.restore``): what it cannot
    (one still draining) stays as it is."""
    with suppress(GatewayConfigError):
        apply(state, plan(state, previous))


def forget(state: GatewayState, upstream: Upstream) -> None:
    """A retired upstream's last request ended: close its client (``Dispatcher.on_gone``)."""
    client = state.upstreams.get(upstream.name)
    if client is not None and client.upstream is upstream:
        del state.upstreams[upstream.name]
        state.spawn(client.close())

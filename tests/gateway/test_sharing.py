"""Two gateway processes' dispatchers share their policies' counters through one ledger (a real SQLite
file; ``add_charges`` itself is held to the same behaviour on PostgreSQL and Redis by the conformance suite)."""

from __future__ import annotations

import pytest

from fairgate.core.cost import CostModel
from fairgate.core.policies.factory import PolicySpec, TenantShare, make_policy
from fairgate.gateway.dispatch import Dispatcher, Upstream
from fairgate.gateway.sharing import ChargeSync
from fairgate.gateway.upstream import UpstreamClient
from fairgate.ledger import LedgerUnavailable, connect
from fairgate.ledger.config import quotas_from_dict

COST = CostModel(9.0, 0.55, 0.06, 24)
QUOTAS = quotas_from_dict({"tiers": {"t": {}}, "tenants": {"a": {"tier": "t"}, "b": {"tier": "t"}}})


def dispatcher() -> Dispatcher:
    shares = {"a": TenantShare(), "b": TenantShare()}
    upstream = Upstream("emu-0", "emu", "http://127.0.0.1:1/v1", 24, COST)
    return Dispatcher(
        lambda: make_policy(PolicySpec("gpu_fair"), COST, shares), [upstream], lambda: 0.0, lambda tenant: None
    )


def counters(d: Dispatcher) -> dict[str, float]:
    return dict(d.policy("emu").counters)  # type: ignore[attr-defined]


async def test_each_process_counts_the_others_charges_once(tmp_path):
    async with await connect(f"sqlite:///{tmp_path}/ledger.db", QUOTAS) as ledger:
        one, two = dispatcher(), dispatcher()
        sync_one, sync_two = ChargeSync(ledger, one, 0.25), ChargeSync(ledger, two, 0.25)
        one.charge("emu", "a", 120.0, 5, 8)
        two.charge("emu", "b", 30.0, 2, 8)
        await sync_one.sync_once()
        await sync_two.sync_once()
        await sync_one.sync_once()
        assert counters(one) == pytest.approx({"a": 120.0, "b": 30.0})
        assert counters(two) == pytest.approx({"a": 120.0, "b": 30.0})
        for _ in range(3):  # rounds without new work change nothing
            await sync_one.sync_once()
            await sync_two.sync_once()
        assert counters(one) == counters(two) == pytest.approx({"a": 120.0, "b": 30.0})
        # A process that starts late books the history once.
        late = dispatcher()
        await ChargeSync(ledger, late, 0.25).sync_once()
        assert counters(late) == pytest.approx({"a": 120.0, "b": 30.0})


async def test_charges_taken_while_the_ledger_is_down_are_kept_for_the_next_round(tmp_path):
    async with await connect(f"sqlite:///{tmp_path}/ledger.db", QUOTAS) as ledger:
        one = dispatcher()
        sync = ChargeSync(ledger, one, 0.25)
        one.charge("emu", "a", 50.0, 1, 8)
        real = ledger.add_charges

        async def down(scope, deltas):  # type: ignore[no-untyped-def]
            raise LedgerUnavailable("stopped for the test")

        ledger.add_charges = down  # type: ignore[method-assign]
        with pytest.raises(LedgerUnavailable):
            await sync.sync_once()
        ledger.add_charges = real  # type: ignore[method-assign]
        one.charge("emu", "a", 25.0, 1, 8)
        await sync.sync_once()
        assert await ledger.add_charges("emu", {}) == {"a": (75.0, 0, 2)}
        assert counters(one) == pytest.approx({"a": 75.0})  # its own charges are not booked twice


async def test_processes_sharing_a_replica_split_its_busy_time_instead_of_each_billing_all_of_it(tmp_path):
    """Two processes with two decoding requests each on one replica: after a round each meter knows the
    other's two, so each charges half of the replica's time (each charged all of it before)."""
    now = [0.0]
    async with await connect(f"sqlite:///{tmp_path}/ledger.db", QUOTAS) as ledger:
        processes = []
        for name in ("one", "two"):
            d = dispatcher()
            upstream = d.upstreams()[0]
            client = UpstreamClient(
                upstream,
                lambda tenant, ms, tokens, batch, d=d: d.charge("emu", tenant, ms, tokens, batch),
                clock=lambda: now[0],
            )
            processes.append((d, client, ChargeSync(ledger, d, 0.25, {upstream.name: client}, process=name)))
        for index, (_, client, _) in enumerate(processes):
            for r in range(2):
                client.meter.start(f"{index}-{r}", "ab"[index], 0, 0.0)
            client.meter.token(10.0)  # an iteration boundary: the second one joins the batch
        now[0] = 1.0  # one second of decoding, the meters not yet told of each other: each charges it all
        for _, _, sync in processes:
            await sync.sync_once()
        assert [client.meter.charged_total_ms for _, client, _ in processes] == pytest.approx([1000.0, 1000.0])
        for _, _, sync in processes:  # each learns the other's 2 sequences (two's round published after one's)
            await sync.sync_once()
        assert [client.meter.remote.sequences for _, client, _ in processes] == pytest.approx([2.0, 2.0], rel=0.01)
        now[0] = 2.0
        for _, client, _ in processes:
            client.take_occupancy()  # meters up to now
        assert [client.meter.charged_total_ms for _, client, _ in processes] == pytest.approx(
            [1500.0, 1500.0], rel=0.01
        )
        for _, client, _ in processes:
            await client.close()

"""The request record's life (``fairgate.gateway.records``) and the metrics of a request that never ran, found
by an outside tester: a request an upstream refused the connection to went back to the queue, its client left,
and no access-log line was written (its record waited for the settlement of the refused dispatch); requests
whose clients left while queued were counted in ``fairgate_admissions_total`` and nowhere else."""

from __future__ import annotations

import contextvars

from prometheus_client import CollectorRegistry

from fairgate.gateway.metrics import MetricsObserver, TenantLabels
from fairgate.gateway.observe import Admitted, Dispatched, Left
from fairgate.gateway.records import RequestRecord, RequestRecorder, note_requeued, open_record
from fairgate.ledger.base import tenant_tag


def _admitted() -> Admitted:
    return Admitted("r-1", "alpha", None, "emu", "res-1", 10, 16, 5.0, 100.0, "key")


def _answered_after(events: list[object], requeued: bool) -> list[RequestRecord]:
    """The records reported for one request that got ``events``, maybe went back to the queue, and was answered
    499 (its client left)."""
    reported: list[RequestRecord] = []
    recorder = RequestRecorder([reported.append])

    def serve() -> None:
        record = open_record("/v1/completions", 99.0)
        for event in events:
            recorder.observe(event)  # type: ignore[arg-type]
        if requeued:
            note_requeued()
        recorder.answered(record, "r-1", 499, 101.0)

    contextvars.copy_context().run(serve)
    return reported


def test_a_request_sent_back_to_the_queue_is_reported_once_its_client_is_answered() -> None:
    dispatched = Dispatched("r-1", "alpha", "emu", "emu-1", 3.0, 100.5)
    [record] = _answered_after([_admitted(), dispatched], requeued=True)
    assert (record.status, record.outcome, record.upstream, record.queue_ms) == (499, "cancelled", None, None)
    # Without going back to the queue, a dispatched request waits for its call's settlement.
    assert _answered_after([_admitted(), dispatched], requeued=False) == []


def test_a_client_that_left_while_queued_is_counted_once_in_the_metrics() -> None:
    registry = CollectorRegistry()
    observer = MetricsObserver(registry, TenantLabels(tenants=["alpha"]))
    observer.observe(_admitted())
    observer.observe(Left("r-1", "alpha", "emu", 250.0, 101.0))
    labels = {"tenant": tenant_tag("alpha")}
    assert registry.get_sample_value("fairgate_admissions_total", {**labels, "model": "emu"}) == 1.0
    assert registry.get_sample_value("fairgate_requests_left_queued_total", labels) == 1.0
    assert registry.get_sample_value("fairgate_requests_finished_total", {**labels, "outcome": "cancelled"}) is None

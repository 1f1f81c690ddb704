"""/metrics over real HTTP (openai client -> gateway -> emulated replica), the Grafana dashboard's queries
against what it exposes, and the observer's label cap."""

from __future__ import annotations

import json
import re
import time
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fairgate.gateway.app import create_gateway
from fairgate.gateway.config import load_gateway_config
from fairgate.gateway.metrics import OVERFLOW_LABEL, UNAUTHENTICATED_LABEL, TenantLabels, build
from fairgate.gateway.observe import Admitted, Charged, Dispatched, Finished, Rejected
from fairgate.gateway.state import state_of
from fairgate.gateway.stats import Stats
from fairgate.ledger.base import tenant_tag
from fairgate.ledger.config import LimitsConfig
from tests.gateway.conftest import TENANTS, Stack, serve_stack, write_config

ADMIN_KEY = "fg-test-admin-" + "a" * 24
GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "fairgate.json"


def admin_stack(
    tmp: Path, limits: dict[str, LimitsConfig] | None = None, delegates: tuple[str, ...] = ()
) -> AbstractContextManager[Stack]:
    """A gateway with an admin key (``ADMIN_KEY``) in front of one emulated replica; ``limits``: tenant ->
    its limits; ``delegates``: the tenants that may act for others."""
    return serve_stack(tmp, limits=limits, admin_key=ADMIN_KEY, delegates=delegates)


def scrape(url: str, key: str = ADMIN_KEY) -> str:
    reply = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain")
    return reply.text


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(table, name: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    return table.get((name, frozenset(labels.items())), 0.0)


def wait_for(check, timeout_s: float = 10.0):  # type: ignore[no-untyped-def]
    """Poll ``check()`` until it returns a truthy value (a streamed request's end is observed just after the
    client has read [DONE])."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.1)


def test_metrics_count_a_known_sequence_exactly(tmp_path):
    with admin_stack(tmp_path, {"gamma": LimitsConfig(requests_per_minute=1, requests_burst=1)}) as stack:
        url = stack.url
        alpha = openai.OpenAI(base_url=f"{url}/v1", api_key=stack.keys["alpha"], max_retries=0)
        beta = openai.OpenAI(base_url=f"{url}/v1", api_key=stack.keys["beta"], max_retries=0)
        gamma = openai.OpenAI(base_url=f"{url}/v1", api_key=stack.keys["gamma"], max_retries=0)
        usage = {"alpha": [0, 0], "beta": [0, 0], "gamma": [0, 0]}
        for _ in range(2):
            reply = alpha.chat.completions.create(
                model="emu",
                messages=[{"role": "user", "content": "a b c"}],
                max_tokens=5,
                extra_body={"ignore_eos": True},
            )
            usage["alpha"][0] += reply.usage.prompt_tokens
            usage["alpha"][1] += reply.usage.completion_tokens
        chunks = list(
            beta.completions.create(
                model="emu",
                prompt="x y",
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        usage["beta"] = [chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens]
        reply = gamma.completions.create(model="emu", prompt="z", max_tokens=3, extra_body={"ignore_eos": True})
        usage["gamma"] = [reply.usage.prompt_tokens, reply.usage.completion_tokens]
        with pytest.raises(openai.RateLimitError):  # gamma's burst of one request is spent
            gamma.completions.create(model="emu", prompt="z", max_tokens=3)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="fg-nobody", max_retries=0).completions.create(
                model="emu", prompt="z"
            )
        with pytest.raises(openai.BadRequestError):
            alpha.completions.create(model="emu", prompt="z", max_tokens=-1)
        with pytest.raises(openai.NotFoundError):
            alpha.completions.create(model="no-such-model", prompt="z")

        tag = {t: tenant_tag(t) for t in TENANTS}
        done = wait_for(
            lambda: (
                value(samples(scrape(url)), "fairgate_requests_finished_total", tenant=tag["beta"], outcome="completed")
                == 1
            )
        )
        assert done
        text = scrape(url)
        table = samples(text)

        # Labels are hashes, never the names.
        for tenant in TENANTS:
            assert tenant not in text
        tenant_labels = {dict(labels).get("tenant") for _, labels in table} - {None}
        assert tenant_labels <= {*tag.values(), UNAUTHENTICATED_LABEL}

        assert value(table, "fairgate_admissions_total", tenant=tag["alpha"], model="emu") == 2
        assert value(table, "fairgate_admissions_total", tenant=tag["beta"], model="emu") == 1
        assert value(table, "fairgate_admissions_total", tenant=tag["gamma"], model="emu") == 1
        rejections = {
            (dict(labels)["tenant"], dict(labels)["reason"]): v
            for (name, labels), v in table.items()
            if name == "fairgate_rejections_total"
        }
        assert rejections == {
            (tag["gamma"], "rate"): 1,
            (UNAUTHENTICATED_LABEL, "auth"): 1,
            (tag["alpha"], "invalid"): 2,
        }
        for tenant in TENANTS:
            inputs, outputs = usage[tenant]
            assert value(table, "fairgate_input_tokens_total", tenant=tag[tenant]) == inputs
            assert value(table, "fairgate_output_tokens_total", tenant=tag[tenant]) == outputs
        assert usage["alpha"][1] == 10 and usage["beta"][1] == 4 and usage["gamma"][1] == 3
        assert value(table, "fairgate_requests_finished_total", tenant=tag["alpha"], outcome="completed") == 2
        assert value(table, "fairgate_queue_time_seconds_count", tenant=tag["alpha"]) == 2
        assert value(table, "fairgate_ttft_seconds_count", tenant=tag["alpha"]) == 2
        assert value(table, "fairgate_tpot_seconds_count", tenant=tag["alpha"]) == 2
        assert value(table, "fairgate_reserved_output_tokens_total", tenant=tag["alpha"]) == 10

        # GPU seconds: what the ledger billed, and the reservations' estimates.
        billed: dict[str, float] = dict.fromkeys(TENANTS, 0.0)
        estimated: dict[str, float] = dict.fromkeys(TENANTS, 0.0)
        for r in stack.reservations():
            billed[r.tenant] += r.billed.gpu_ms / 1000.0
            estimated[r.tenant] += r.gpu_ms_estimate / 1000.0
        for tenant in TENANTS:
            settled = value(table, "fairgate_settled_gpu_seconds_total", tenant=tag[tenant])
            assert settled > 0 and settled == pytest.approx(billed[tenant], rel=1e-6, abs=1e-9)
            assert value(table, "fairgate_reserved_gpu_seconds_total", tenant=tag[tenant]) == pytest.approx(
                estimated[tenant], rel=1e-9
            )
            # Charged to the policy: the prefill estimate, then metered time beyond it: at least what the meter
            # measured (the billed time).
            charged = value(table, "fairgate_gpu_seconds_total", tenant=tag[tenant], model="emu")
            assert charged >= settled * (1 - 1e-9)

        # Gauges: nothing runs now; the pool saw three tenants; the upstream was busy.
        assert value(table, "fairgate_active_sequences", tenant=tag["alpha"]) == 0
        assert value(table, "fairgate_upstream_in_flight", upstream="emu-0", model="emu") == 0
        assert value(table, "fairgate_upstream_busy_seconds_total", upstream="emu-0", model="emu") > 0
        assert value(table, "fairgate_active_tenants", policy="gpu_fair", model="emu") == 3
        shares = [value(table, "fairgate_gpu_share_ratio", tenant=tag[t], model="emu") for t in TENANTS]
        assert sum(shares) == pytest.approx(1.0)
        assert value(table, "fairgate_gpu_share_max_ratio", policy="gpu_fair", model="emu") == pytest.approx(
            max(shares)
        )
        assert value(table, "fairgate_gpu_share_min_ratio", policy="gpu_fair", model="emu") == pytest.approx(
            min(shares)
        )
        assert 1 / 3 <= value(table, "fairgate_jain_index", policy="gpu_fair", model="emu") <= 1.0
        # Exposed for the requests finished in the window (its value is checked in test_stats.py).
        labels = frozenset({"policy": "gpu_fair", "model": "emu"}.items())
        assert ("fairgate_service_difference_tokens_per_second", labels) in table
        assert value(table, "fairgate_service_difference_tokens_per_second", policy="gpu_fair", model="emu") >= 0

        # Every metric the Grafana dashboard queries is exposed.
        check_grafana_dashboard(text)


def check_grafana_dashboard(text: str) -> None:
    dashboard = json.loads(GRAFANA.read_text())
    exposed = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert len(exprs) >= 7
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for word in ("share", "jain", "queue", "ttft", "rejections", "gpu", "busy"):
        assert word in titles
    for expr in exprs:
        names = set(re.findall(r"\bfairgate_[a-z0-9_]+", expr))
        assert names, expr
        assert names <= exposed, f"{expr}: {names - exposed} not exposed"


def test_metrics_need_an_admin_key(tmp_path):
    with admin_stack(tmp_path) as stack:
        assert httpx.get(f"{stack.url}/metrics", timeout=10).status_code == 401
        bad = httpx.get(f"{stack.url}/metrics", headers={"Authorization": "Bearer nope"}, timeout=10)
        assert bad.status_code == 401
        tenant = httpx.get(
            f"{stack.url}/metrics", headers={"Authorization": f"Bearer {stack.keys['alpha']}"}, timeout=10
        )
        assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "admin_only"
        text = scrape(stack.url)
        # Before any traffic: the configured tenants have their series at zero, under their hashes.
        table = samples(text)
        for tenant in TENANTS:
            assert value(table, "fairgate_active_sequences", tenant=tenant_tag(tenant)) == 0
            assert ("fairgate_active_sequences", frozenset({("tenant", tenant)})) not in table


def test_without_admin_keys_metrics_are_closed(stack):
    assert httpx.get(f"{stack.url}/metrics", timeout=10).status_code == 401
    reply = httpx.get(f"{stack.url}/metrics", headers={"Authorization": f"Bearer {stack.keys['alpha']}"}, timeout=10)
    assert reply.status_code == 403


def test_two_gateways_in_one_process_have_their_own_registries(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = create_gateway(load_gateway_config(write_config(tmp_path / "a", ["http://127.0.0.1:9"])[0]))
    second = create_gateway(load_gateway_config(write_config(tmp_path / "b", ["http://127.0.0.1:9"])[0]))
    assert state_of(first).metrics_registry is not state_of(second).metrics_registry
    state_of(first).events.observe(Charged("alpha", "emu", 1500.0, time.time()))
    get = lambda app: state_of(app).metrics_registry.get_sample_value(
        "fairgate_gpu_seconds_total", {"tenant": tenant_tag("alpha"), "model": "emu"}
    )
    assert get(first) == 1.5 and get(second) is None


def test_the_tenant_label_cap():
    labels = TenantLabels(cap=2, tenants=["a"])
    assert labels("a") == tenant_tag("a") and labels("b") == tenant_tag("b")
    assert labels("c") == OVERFLOW_LABEL and labels("d") == OVERFLOW_LABEL
    assert labels("b") == tenant_tag("b") and labels(None) == UNAUTHENTICATED_LABEL
    assert labels.labelled() == [tenant_tag("a"), tenant_tag("b")]


def test_the_observer_folds_tenants_over_the_cap_into_other():
    now = [1000.0]
    stats = Stats(clock=lambda: now[0])
    registry, observer = build(stats, tenants=["t0"], policy="gpu_fair", cap=3)
    events = (stats, observer)
    for i in range(6):
        tenant = f"t{i}"
        for event in (
            Admitted(f"r{i}", tenant, None, "emu", f"res{i}", 10, 5, 100.0, now[0]),
            Dispatched(f"r{i}", tenant, "emu", "u0", 2.0, now[0]),
            Charged(tenant, "emu", 100.0 * (i + 1), now[0]),
            Finished(
                f"r{i}", tenant, "emu", "u0", "completed", 2.0, 30.0, 5.0, 10, 5, 100.0 * (i + 1), 100.0, 5, now[0]
            ),
            Rejected(f"x{i}", tenant, "emu", "rate", 429, "slow down", now[0]),
        ):
            for sink in events:
                sink.observe(event)
    text = "\n".join(f"{s.name} {s.labels} {s.value}" for m in registry.collect() for s in m.samples)
    table = samples(_exposition(registry))
    tenant_labels = {dict(labels).get("tenant") for _, labels in table} - {None}
    assert tenant_labels == {tenant_tag("t0"), tenant_tag("t1"), tenant_tag("t2"), OVERFLOW_LABEL}, text
    # t3, t4, t5 are summed under "other".
    assert value(table, "fairgate_admissions_total", tenant=OVERFLOW_LABEL, model="emu") == 3
    assert value(table, "fairgate_rejections_total", tenant=OVERFLOW_LABEL, reason="rate") == 3
    assert value(table, "fairgate_gpu_seconds_total", tenant=OVERFLOW_LABEL, model="emu") == pytest.approx(1.5)
    assert value(table, "fairgate_gpu_seconds_total", tenant=tenant_tag("t2"), model="emu") == pytest.approx(0.3)
    assert value(table, "fairgate_gpu_share_ratio", tenant=OVERFLOW_LABEL, model="emu") == pytest.approx(15 / 21)
    assert value(table, "fairgate_overage_gpu_seconds_total", tenant=OVERFLOW_LABEL) == pytest.approx(1.2)
    assert value(table, "fairgate_queue_time_seconds_count", tenant=OVERFLOW_LABEL) == 3
    for i in range(6):
        assert f"t{i}" not in {dict(labels).get("tenant") for _, labels in table}


def _exposition(registry) -> str:  # type: ignore[no-untyped-def]
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()


def test_a_charged_event_is_cheap():
    """The per-token path (``Charged`` through both observers) stays in the microseconds."""
    stats = Stats()
    _, observer = build(stats, tenants=["alpha"], policy="gpu_fair")
    event = Charged("alpha", "emu", 0.5, time.time())
    n = 20_000
    start = time.perf_counter()
    for _ in range(n):
        stats.observe(event)
        observer.observe(event)
    per_event_us = (time.perf_counter() - start) / n * 1e6
    assert per_event_us < 50, per_event_us  # ~2 us on a quiet core; generous for a loaded 2-core machine

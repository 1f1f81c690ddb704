"""The scoped usage APIs over real HTTP (gateway + emulated replica + SQLite ledger): a tenant sees exactly its
own usage and nothing of anyone else's, through any endpoint, parameter, header or path; admins see all."""

from __future__ import annotations

import json
import socket
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from fairgate.gateway.auth import make_on_behalf_of
from fairgate.gateway.observe import REJECT_REASONS, Rejected
from fairgate.gateway.usage_api import WINDOW_MAX_S, CallLimit, RejectionLog
from fairgate.ledger.config import LimitsConfig
from tests.gateway import conftest
from tests.gateway.conftest import Clock

ADMIN_KEY = f"fg-test-admin-{'y' * 24}"
SECRET_ENV = "FAIRGATE_TEST_USAGE_API_SECRET"
SECRET = "usage-api-test-secret-0123456789"
# beta: 2 requests per minute (burst 2) and at most 100 tokens per request, to force 429s of known reasons.
BETA_LIMITS = LimitsConfig(requests_per_minute=2, requests_burst=2, max_tokens_per_request=100)
ADMIN_PATHS = ("/admin/tenants", "/admin/usage", "/admin/reservations", "/admin/frozen", "/admin/reconcile")


class Stack(conftest.Stack):
    def headers(self, tenant: str, **extra: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_KEY if tenant == 'admin' else self.keys[tenant]}", **extra}

    def get(
        self,
        path: str,
        tenant: str = "alpha",
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
    ) -> httpx.Response:
        return httpx.get(
            f"{self.url}{path}", headers={**self.headers(tenant), **(headers or {})}, params=params, timeout=20
        )

    def complete(self, tenant: str, max_tokens: int, prompt: str = "a b c", **extra: object) -> httpx.Response:
        body = {"model": "emu", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}
        return httpx.post(f"{self.url}/v1/completions", json=body, headers=self.headers(tenant), timeout=30)


@pytest.fixture
def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    with conftest.serve_stack(
        tmp_path, limits={"beta": BETA_LIMITS}, admin_key=ADMIN_KEY, delegates=["gamma"], secret_env=SECRET_ENV
    ) as served:
        yield Stack(**vars(served))


def raw_get(url: str, target: str, authorization: str) -> tuple[int, str]:
    """GET ``target`` sent byte for byte (no client-side path normalisation); (status, body)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=20) as sock:
        sock.sendall(
            f"GET {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: {authorization}\r\n"
            "Connection: close\r\n\r\n".encode("latin-1")
        )
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body.decode("utf-8", "replace")


# --- the tenant's own usage ------------------------------------------------------------------------


def test_own_usage_is_exact_and_excludes_other_tenants(stack: Stack) -> None:
    for _ in range(3):
        assert stack.complete("alpha", 7).status_code == 200  # 3 prompt tokens, exactly 7 output tokens each
    assert stack.complete("beta", 11, prompt="x").status_code == 200
    reply = stack.get("/v1/usage?window=3600")
    assert reply.status_code == 200, reply.text
    assert reply.headers["cache-control"] == "no-store" and reply.headers["x-request-id"]
    usage = reply.json()
    assert (usage["tenant"], usage["window_s"], usage["delegate"]) == ("alpha", 3600, None)
    assert (usage["requests"], usage["input_tokens"], usage["output_tokens"]) == (3, 9, 21)
    assert usage["open_reservations"] == 0 and usage["overage_gpu_seconds"] >= 0
    billed = stack.ledger_call(lambda ledger: ledger.reservations("alpha"))
    assert usage["gpu_seconds"] > 0
    assert usage["gpu_seconds"] == pytest.approx(sum(r.billed.gpu_ms for r in billed) / 1000.0)
    assert usage["rejections"] == {"total": 0, "by_reason": dict.fromkeys(REJECT_REASONS, 0), "window_s": 3600.0}
    assert "beta" not in reply.text
    beta = stack.get("/v1/usage?window=3600", "beta").json()
    assert (beta["tenant"], beta["requests"], beta["input_tokens"], beta["output_tokens"]) == ("beta", 1, 1, 11)
    assert "alpha" not in json.dumps(beta)


def test_rejections_are_counted_by_reason_for_the_rejected_tenant_only(stack: Stack) -> None:
    over = stack.complete("beta", 200)  # 3 + 200 tokens > max_tokens_per_request 100
    assert over.status_code == 429 and over.json()["error"]["code"] == "insufficient_quota"
    assert [stack.complete("beta", 5).status_code for _ in range(3)] == [200, 200, 429]  # burst of 2 requests
    bad = conftest.post(stack.url, stack.keys["beta"], {"model": "emu", "prompt": "x", "max_tokens": "5"}, timeout=10)
    assert bad.status_code == 400
    assert conftest.post(stack.url, "fg-nobody", {"model": "emu", "prompt": "x"}, timeout=10).status_code == 401
    usage = stack.get("/v1/usage?window=60", "beta").json()
    assert (usage["requests"], usage["output_tokens"]) == (2, 10)  # rejected requests reserve nothing
    expected = {**dict.fromkeys(REJECT_REASONS, 0), "tokens": 1, "rate": 1, "invalid": 1}
    assert usage["rejections"] == {"total": 3, "by_reason": expected, "window_s": 60.0}
    alpha = stack.get("/v1/usage?window=60").json()
    assert alpha["rejections"]["total"] == 0 and alpha["requests"] == 0
    admin = stack.get("/admin/usage?window=60", "admin").json()
    by_tenant = {row["tenant"]: row for row in admin["data"]}
    assert by_tenant["beta"]["rejections"]["by_reason"] == expected and by_tenant["gamma"]["rejections"]["total"] == 0
    assert admin["unauthenticated_rejections"]["total"] == 1  # the bad key: attributed to nobody
    assert admin["unauthenticated_rejections"]["by_reason"]["auth"] == 1


def test_open_reservations_are_counted(stack: Stack) -> None:
    stack.ledger_call(lambda ledger: ledger.reserve("gamma", "held-open-1", 4, 6))
    usage = stack.get("/v1/usage", "gamma").json()
    assert (usage["window_s"], usage["requests"], usage["open_reservations"]) == (86_400, 1, 1)
    assert usage["output_tokens"] == 0
    assert stack.get("/v1/usage").json()["open_reservations"] == 0


@pytest.mark.parametrize(
    "window",
    [
        "-1",
        "0",
        "abc",
        "1e3",
        "3600.5",
        "+60",
        " 60",
        "60 ",
        "0x10",
        "inf",
        "NaN",
        "",
        "１２",
        "99999999999999999999",
        str(WINDOW_MAX_S + 1),
        "3_600",
    ],
)
def test_a_bad_window_is_400_naming_window(stack: Stack, window: str) -> None:
    for path, tenant in (("/v1/usage", "alpha"), ("/admin/usage", "admin")):
        reply = stack.get(path, tenant, params={"window": window})
        assert reply.status_code == 400, (path, window, reply.text)
        error = reply.json()["error"]
        assert (error["param"], error["code"], error["type"]) == ("window", "invalid_window", "invalid_request_error")
        assert "window" in error["message"]


def test_window_edges_repeats_and_unknown_parameters(stack: Stack) -> None:
    assert stack.get("/v1/usage?window=1").json()["window_s"] == 1
    assert stack.get(f"/v1/usage?window={WINDOW_MAX_S}").json()["rejections"]["window_s"] == 86_400.0
    reply = stack.get("/v1/usage?window=60&window=3600")
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "window"
    reply = stack.get("/v1/usage?user=beta")
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "user"


# --- nobody reads another tenant's data --------------------------------------------------------------


def test_a_tenant_parameter_or_header_naming_another_tenant_is_refused(stack: Stack) -> None:
    assert stack.complete("beta", 9).status_code == 200
    refusals = [
        stack.get("/v1/usage?tenant=beta"),
        stack.get("/v1/usage?tenant=nobody-at-all"),
        stack.get("/v1/usage?tenant="),
        stack.get("/v1/usage?tenant=alpha&tenant=beta"),
    ]
    for header in ("X-Tenant", "X-Tenant-Id", "X-Fairgate-Tenant", "x-tenant"):
        refusals.append(stack.get("/v1/usage", headers={header: "beta"}))
    for reply in refusals[:2] + refusals[4:]:
        assert reply.status_code == 403, reply.text
        assert reply.json()["error"]["code"] == "tenant_mismatch"
        assert reply.json()["error"]["type"] == "permission_error"
    # The same answer whether the other tenant exists or not: no oracle for tenant names.
    assert refusals[0].json()["error"]["message"] == refusals[1].json()["error"]["message"]
    assert refusals[2].status_code == 403 and refusals[3].status_code == 400
    assert all("beta" not in r.text or r.json()["error"]["param"] for r in refusals)
    assert all('"output_tokens"' not in r.text for r in refusals)
    # Naming oneself is fine; a body, the user field or other headers change nothing.
    mine = [
        stack.get("/v1/usage?tenant=alpha"),
        stack.get("/v1/usage", headers={"X-Tenant": "alpha"}),
        stack.get("/v1/usage", headers={"OpenAI-Organization": "beta", "X-User": "beta"}),
        httpx.request(
            "GET",
            f"{stack.url}/v1/usage",
            headers=stack.headers("alpha"),
            timeout=10,
            json={"user": "beta", "tenant": "beta"},
        ),
    ]
    for reply in mine:
        assert reply.status_code == 200, reply.text
        assert (reply.json()["tenant"], reply.json()["output_tokens"]) == ("alpha", 0)


def test_the_user_field_of_a_completion_bills_and_reports_the_caller(stack: Stack) -> None:
    assert stack.complete("alpha", 4, user="beta").status_code == 200
    assert stack.get("/v1/usage").json()["output_tokens"] == 4
    assert stack.get("/v1/usage", "beta").json()["output_tokens"] == 0


@pytest.mark.parametrize("path", ADMIN_PATHS)
def test_admin_endpoints_refuse_tenant_keys_and_missing_keys(stack: Stack, path: str) -> None:
    assert stack.complete("beta", 3).status_code == 200
    for query in ("", "?tenant=beta", "?window=60", "?status=all&tenant=beta"):
        reply = stack.get(path + query)
        assert reply.status_code == 403, reply.text
        assert reply.json()["error"]["code"] == "admin_only" and "beta" not in reply.text
    for headers in ({}, {"Authorization": "Bearer fg-not-a-key"}, {"Authorization": f"Basic {ADMIN_KEY}"}):
        reply = httpx.get(f"{stack.url}{path}", headers=headers, timeout=10)
        assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
    assert stack.get(path, "admin").status_code == 200
    # An admin key is not a tenant key: it reads no tenant's usage through /v1/usage.
    assert stack.get("/v1/usage", "admin").status_code == 401


@pytest.mark.parametrize(
    "target",
    [
        "/admin/../v1/usage?tenant=beta",
        "/v1/usage/../../admin/usage",
        "/admin/%2e%2e/v1/usage?tenant=beta",
        "/v1/usage/..%2f..%2fadmin/usage",
        "/V1/USAGE?tenant=beta",
        "/ADMIN/USAGE",
        "/Admin/Reservations?status=all",
        "//admin/usage",
        "/admin/usage/",
        "/admin//usage",
        "/v1//usage?tenant=beta",
        "/v1/usage/?tenant=beta",
        "/v1/usage%3Ftenant=beta",
        "/v1/usage;tenant=beta",
        "/admin/usage%00",
        "/v1/usage?tenant=%62eta",
        "/v1/usage?TENANT=beta",
        "/v1/usage?tenant[]=beta",
        "/admin/reservations/../usage",
        "/%61dmin/usage",
    ],
)
def test_path_tricks_with_a_tenant_key_reveal_nothing(stack: Stack, target: str) -> None:
    assert stack.complete("beta", 13, prompt="secret words here").status_code == 200
    status, body = raw_get(stack.url, target, f"Bearer {stack.keys['alpha']}")
    assert "beta" not in body and "secret" not in body
    if status == 200:
        assert (json.loads(body)["tenant"], json.loads(body)["output_tokens"]) == ("alpha", 0)
    else:
        assert status in (307, 400, 403, 404), (status, body)


# --- delegates --------------------------------------------------------------------------------------


def test_a_delegate_reads_the_usage_of_the_tenant_it_acts_for(stack: Stack) -> None:
    assert stack.complete("alpha", 5).status_code == 200
    assert stack.complete("gamma", 2).status_code == 200
    token = make_on_behalf_of(SECRET.encode(), "gamma", "alpha", time.time() + 60)
    acting = stack.get("/v1/usage", "gamma", headers={"x-fairgate-on-behalf-of": token})
    assert acting.status_code == 200, acting.text
    assert (acting.json()["tenant"], acting.json()["delegate"], acting.json()["output_tokens"]) == ("alpha", "gamma", 5)
    own = stack.get("/v1/usage", "gamma").json()
    assert (own["tenant"], own["delegate"], own["output_tokens"]) == ("gamma", None, 2)
    # Acting for alpha, it cannot name itself or anyone else.
    mixed = stack.get("/v1/usage?tenant=gamma", "gamma", headers={"x-fairgate-on-behalf-of": token})
    assert mixed.status_code == 403 and mixed.json()["error"]["code"] == "tenant_mismatch"
    # A token is only honoured for its delegate, and only a configured delegate may present one.
    stolen = stack.get("/v1/usage", "beta", headers={"x-fairgate-on-behalf-of": token})
    assert stolen.status_code == 403 and stolen.json()["error"]["code"] == "delegation_not_allowed"
    expired = make_on_behalf_of(SECRET.encode(), "gamma", "alpha", time.time() - 1)
    reply = stack.get("/v1/usage", "gamma", headers={"x-fairgate-on-behalf-of": expired})
    assert reply.status_code == 403 and reply.json()["error"]["code"] == "invalid_delegation"


# --- the operator's views ---------------------------------------------------------------------------


def test_admin_tenants_and_frozen(stack: Stack) -> None:
    stack.ledger_call(lambda ledger: ledger.freeze("beta", "review: metered difference"))
    tenants = stack.get("/admin/tenants", "admin").json()["data"]
    assert [t["tenant"] for t in tenants] == ["alpha", "beta", "gamma"]
    beta = tenants[1]
    assert (beta["tier"], beta["weight"], beta["priority"], beta["keys"], beta["frozen"]) == (
        "free",
        1.0,
        "interactive",
        1,
        True,
    )
    assert beta["frozen_reason"] == "review: metered difference"
    assert [t["delegate"] for t in tenants] == [False, False, True] and not tenants[0]["frozen"]
    assert stack.get("/admin/frozen", "admin").json()["data"] == [
        {"tenant": "beta", "reason": "review: metered difference"}
    ]
    assert stack.get("/admin/frozen?tenant=beta", "admin").status_code == 400


def test_admin_usage_lists_every_tenant(stack: Stack) -> None:
    assert stack.complete("alpha", 3).status_code == 200
    assert stack.complete("gamma", 8, prompt="one two").status_code == 200
    answer = stack.get("/admin/usage?window=600", "admin").json()
    rows = {r["tenant"]: (r["requests"], r["input_tokens"], r["output_tokens"]) for r in answer["data"]}
    assert rows == {"alpha": (1, 3, 3), "beta": (0, 0, 0), "gamma": (1, 2, 8)}
    assert answer["window_s"] == 600


def test_admin_reservations_filter_and_page(stack: Stack) -> None:
    for tokens in (2, 3, 4):
        assert stack.complete("alpha", tokens).status_code == 200
    assert stack.complete("beta", 5).status_code == 200
    stack.ledger_call(lambda ledger: ledger.reserve("gamma", "held-open-2", 1, 9))
    open_now = stack.get("/admin/reservations", "admin").json()
    assert [(r["tenant"], r["request_id"], r["status"]) for r in open_now["data"]] == [("gamma", "held-open-2", "open")]
    assert (open_now["total"], open_now["has_more"], open_now["limit"]) == (1, False, 100)
    settled = stack.get("/admin/reservations?status=settled&tenant=alpha", "admin").json()
    assert [r["billed"]["output_tokens"] for r in settled["data"]] == [2, 3, 4]
    page = stack.get("/admin/reservations?status=all&limit=2&offset=1", "admin").json()
    assert [r["billed"]["output_tokens"] for r in page["data"]] == [3, 4]
    assert (page["total"], page["has_more"], page["offset"]) == (5, True, 1)
    for query, param, status in (
        ("?status=bogus", "status", 400),
        ("?limit=0", "limit", 400),
        ("?limit=1001", "limit", 400),
        ("?limit=-1", "limit", 400),
        ("?offset=x", "offset", 400),
        ("?tenant=nobody", "tenant", 404),
        ("?window=5", "window", 400),
    ):
        reply = stack.get(f"/admin/reservations{query}", "admin")
        assert reply.status_code == status and reply.json()["error"]["param"] == param, (query, reply.text)


def test_admin_reconcile_is_a_dry_run_reused_for_a_while(stack: Stack, tmp_path: Path) -> None:
    assert stack.complete("alpha", 3).status_code == 200
    first = stack.get("/admin/reconcile", "admin").json()
    assert first["clean"] and first["dry_run"] and first["frozen"] == []
    assert [(t["tenant"], t["events"]["output_tokens"]) for t in first["tenants"]] == [("alpha", 3)]
    assert stack.get("/admin/reconcile", "admin").json()["generated_at_s"] == first["generated_at_s"]
    # Make the event log disagree with the reservations: a refreshed report shows it, and freezes nobody.
    with sqlite3.connect(stack.ledger_url[len("sqlite:///") :]) as db:
        db.execute(
            "UPDATE fg_events SET output_tokens = output_tokens + 1 WHERE seq = (SELECT MAX(seq) FROM fg_events)"
        )
    stale = stack.get("/admin/reconcile", "admin").json()
    assert stale["clean"] and stale["generated_at_s"] == first["generated_at_s"]
    fresh = stack.get("/admin/reconcile?refresh=true", "admin").json()
    assert not fresh["clean"] and fresh["generated_at_s"] > first["generated_at_s"] and fresh["frozen"] == []
    assert "output_tokens" in fresh["tenants"][0]["differences"][0]
    assert stack.get("/admin/frozen", "admin").json()["data"] == []
    assert stack.get("/admin/reconcile?refresh=maybe", "admin").json()["error"]["param"] == "refresh"


def test_admin_reconcile_lists_parked_emergency_grants(stack: Stack, tmp_path: Path) -> None:
    assert stack.get("/admin/reconcile", "admin").json()["parked_grants"] == []
    parked = {"type": "parked", "tenant": "alpha", "request_id": "twice", "usage": [10, 30, 2.0], "reason": "final"}
    (tmp_path / "journal.parked.jsonl").write_text(json.dumps(parked) + "\n")  # beside [gateway] journal
    report = stack.get("/admin/reconcile", "admin").json()
    assert report["parked_grants"] == [parked] and not report["clean"], report


# --- the rejection counter, on its own --------------------------------------------------------------


def rejected(tenant: str | None, reason: str, time_s: float) -> Rejected:
    return Rejected("r", tenant, "emu", reason, 429, "no", time_s)


def test_rejection_log_windows_and_tenants() -> None:
    clock = Clock(1_000_000.0)
    log = RejectionLog(["alpha", "beta"], retention_s=3600, bucket_s=10, clock=clock)
    log.observe(rejected("alpha", "rate", clock.now - 100))
    log.observe(rejected("alpha", "rate", clock.now - 5))
    log.observe(rejected("alpha", "made-up", clock.now))
    log.observe(rejected("mallory", "rate", clock.now))  # not configured: dropped
    log.observe(rejected(None, "auth", clock.now))
    assert log.counts("alpha", 60)["rate"] == 1 and log.counts("alpha", 60)["other"] == 1
    assert log.counts("alpha", 3600)["rate"] == 2
    assert sum(log.counts("beta", 3600).values()) == 0 and log.counts("mallory", 3600)["rate"] == 0
    assert log.counts(None, 60)["auth"] == 1
    clock.now += 3700  # past the retention: forgotten
    assert sum(log.counts("alpha", 10**9).values()) == 0


def test_rejection_log_memory_is_bounded_under_a_flood() -> None:
    clock = Clock(0.0)
    log = RejectionLog(["alpha"], retention_s=600, bucket_s=10, clock=clock)
    for i in range(200_000):
        clock.now = i * 0.05  # 20 rejections a second for 10 000 s
        log.add("alpha", "rate", clock.now)
    buckets = log._by_tenant["alpha"]
    assert len(buckets) <= 61
    assert log.counts("alpha", 600)["rate"] == pytest.approx(600 * 20, abs=10 * 20)


# --- reads are rate-limited per caller --------------------------------------------------------------


def test_usage_reads_past_the_burst_are_429_with_retry_after_per_caller(stack: Stack) -> None:
    limit = CallLimit()
    burst, start, answers = int(limit.burst), time.monotonic(), []
    while len(answers) < burst + 20 and (not answers or answers[-1].status_code == 200):
        answers.append(stack.get("/v1/usage", "alpha"))
    elapsed_s = time.monotonic() - start
    # A burst is served, then the next read is refused; a slow machine's reads let the bucket refill meanwhile.
    served, limited = len(answers) - 1, answers[-1]
    assert burst <= served <= burst + elapsed_s * limit.per_s + 1, (served, elapsed_s)
    assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(limited.headers["retry-after"]) >= 1
    assert stack.get("/v1/usage", "beta").status_code == 200  # another caller has its own bucket


def test_a_call_limit_refills_at_its_rate() -> None:
    clock = Clock(100.0)
    limit = CallLimit(burst=2, per_s=0.5, clock=clock)
    assert [limit.take("a"), limit.take("a")] == [0.0, 0.0]
    assert limit.take("a") == pytest.approx(2.0) and limit.take("b") == 0.0
    clock.now += 1.0
    assert limit.take("a") == pytest.approx(1.0)
    clock.now += 1.0
    assert limit.take("a") == 0.0

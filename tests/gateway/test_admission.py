"""Admission over real HTTP: quota 429s with Retry-After, queue bounds, delegation, the ledger down."""

from __future__ import annotations

import time

from fairgate.gateway.app import create_gateway
from fairgate.gateway.auth import make_on_behalf_of
from fairgate.gateway.config import load_gateway_config
from fairgate.harness.threads import serve_in_thread
from fairgate.ledger.config import LimitsConfig
from tests.gateway.conftest import post, post_at_once, serve_stack, write_config


def test_request_quota_gives_429_with_retry_after_and_headers(tmp_path):
    with serve_stack(tmp_path, defaults=LimitsConfig(requests_per_minute=60, requests_burst=2)) as stack:
        url, keys = stack.url, stack.keys
        ok = [post(url, keys["alpha"]) for _ in range(2)]
        assert [r.status_code for r in ok] == [200, 200]
        assert ok[0].headers["x-ratelimit-limit-requests"] == "60"
        limited = post(url, keys["alpha"])
        assert limited.status_code == 429
        assert limited.json()["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(limited.headers["retry-after"]) <= 2 and limited.headers["x-request-id"]
        assert post(url, keys["beta"]).status_code == 200  # another tenant is not affected


def test_queue_bound_gives_429_queue_full(tmp_path):
    with serve_stack(tmp_path, defaults=LimitsConfig(max_queued=1)) as stack:
        body = {"model": "emu", "prompt": "x", "max_tokens": 60, "ignore_eos": True}
        codes = [r.status_code for r in post_at_once([(stack.url, stack.keys["alpha"], body, None)] * 8)]
    # 4 slots run, 1 waits in the queue, the other 3 are refused at once.
    assert sorted(codes) == [200] * 5 + [429] * 3


def test_delegation_bills_the_original_tenant(tmp_path, monkeypatch):
    secret = "s" * 32
    monkeypatch.setenv("FAIRGATE_DELEGATION_SECRET", secret)
    with serve_stack(tmp_path, delegates=["gamma"]) as stack:
        url, keys = stack.url, stack.keys
        token = make_on_behalf_of(secret.encode(), "gamma", "alpha", time.time() + 60)
        assert post(url, keys["gamma"], headers={"X-Fairgate-On-Behalf-Of": token}).status_code == 200
        # Not a delegate, a token for another delegate, an expired token: 403, nothing billed.
        assert post(url, keys["beta"], headers={"X-Fairgate-On-Behalf-Of": token}).status_code == 403
        forged = make_on_behalf_of(b"x" * 32, "gamma", "alpha", time.time() + 60)
        assert post(url, keys["gamma"], headers={"X-Fairgate-On-Behalf-Of": forged}).status_code == 403
        expired = make_on_behalf_of(secret.encode(), "gamma", "alpha", time.time() - 1)
        assert post(url, keys["gamma"], headers={"X-Fairgate-On-Behalf-Of": expired}).status_code == 403
        assert [r.tenant for r in stack.reservations()] == ["alpha"]


def test_no_upstream_answers_503(tmp_path):
    path, keys = write_config(tmp_path, ["http://127.0.0.1:9"])  # nothing listens there
    with serve_in_thread(create_gateway(load_gateway_config(path))) as url:
        reply = post(url, keys["alpha"])
        assert reply.status_code == 502 and reply.json()["error"]["code"] == "upstream_error"

"""Admission over real HTTP: quota 429s with Retry-After, queue bounds, delegation, the ledger down."""

from __future__ import annotations

import asyncio
import time

import httpx

from fairgate.emulator.api import create_app
from fairgate.gateway.app import create_gateway
from fairgate.gateway.auth import make_on_behalf_of
from fairgate.gateway.config import load_gateway_config
from fairgate.harness.threads import serve_in_thread
from fairgate.ledger.config import LimitsConfig
from tests.gateway.conftest import EMULATOR, write_config


def post(url: str, key: str, body: dict, headers: dict | None = None) -> httpx.Response:  # type: ignore[type-arg]
    return httpx.post(
        f"{url}/v1/completions", json=body, timeout=30, headers={"Authorization": f"Bearer {key}", **(headers or {})}
    )


BODY = {"model": "emu", "prompt": "x", "max_tokens": 2, "ignore_eos": True}


def test_request_quota_gives_429_with_retry_after_and_headers(tmp_path):
    with serve_in_thread(create_app(EMULATOR)) as emulator:
        path, keys = write_config(tmp_path, [emulator], defaults=LimitsConfig(requests_per_minute=60, requests_burst=2))
        with serve_in_thread(create_gateway(load_gateway_config(path))) as url:
            ok = [post(url, keys["alpha"], BODY) for _ in range(2)]
            assert [r.status_code for r in ok] == [200, 200]
            assert ok[0].headers["x-ratelimit-limit-requests"] == "60"
            limited = post(url, keys["alpha"], BODY)
            assert limited.status_code == 429
            assert limited.json()["error"]["code"] == "rate_limit_exceeded"
            assert 1 <= int(limited.headers["retry-after"]) <= 2 and limited.headers["x-request-id"]
            assert post(url, keys["beta"], BODY).status_code == 200  # another tenant is not affected


def test_queue_bound_gives_429_queue_full(tmp_path):
    with serve_in_thread(create_app(EMULATOR)) as emulator:
        path, keys = write_config(tmp_path, [emulator], defaults=LimitsConfig(max_queued=1))
        with serve_in_thread(create_gateway(load_gateway_config(path))) as url:

            async def flood() -> list[int]:
                async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                    body = {"model": "emu", "prompt": "x", "max_tokens": 60, "ignore_eos": True}
                    replies = await asyncio.gather(
                        *(
                            http.post(
                                "/v1/completions", json=body, headers={"Authorization": f"Bearer {keys['alpha']}"}
                            )
                            for _ in range(8)
                        )
                    )
                return [r.status_code for r in replies]

            codes = asyncio.run(flood())
            # 4 slots run, 1 waits in the queue, the other 3 are refused at once.
            assert sorted(codes) == [200] * 5 + [429] * 3


def test_delegation_bills_the_original_tenant(tmp_path, monkeypatch):
    secret = "s" * 32
    monkeypatch.setenv("FAIRGATE_DELEGATION_SECRET", secret)
    with serve_in_thread(create_app(EMULATOR)) as emulator:
        path, keys = write_config(tmp_path, [emulator])
        path.write_text(path.read_text() + '\n[delegation]\ndelegates = ["gamma"]\n')
        config = load_gateway_config(path)
        with serve_in_thread(create_gateway(config)) as url:
            token = make_on_behalf_of(secret.encode(), "gamma", "alpha", time.time() + 60)
            assert post(url, keys["gamma"], BODY, {"X-Fairgate-On-Behalf-Of": token}).status_code == 200
            # Not a delegate, a token for another delegate, an expired token: 403, nothing billed.
            assert post(url, keys["beta"], BODY, {"X-Fairgate-On-Behalf-Of": token}).status_code == 403
            forged = make_on_behalf_of(b"x" * 32, "gamma", "alpha", time.time() + 60)
            assert post(url, keys["gamma"], BODY, {"X-Fairgate-On-Behalf-Of": forged}).status_code == 403
            expired = make_on_behalf_of(secret.encode(), "gamma", "alpha", time.time() - 1)
            assert post(url, keys["gamma"], BODY, {"X-Fairgate-On-Behalf-Of": expired}).status_code == 403

            async def billed() -> list[str]:
                from fairgate.ledger import connect

                ledger = await connect(config.ledger_url, config.quotas)
                try:
                    return [r.tenant for r in await ledger.reservations()]
                finally:
                    await ledger.close()

            assert asyncio.run(billed()) == ["alpha"]


def test_no_upstream_answers_503(tmp_path):
    path, keys = write_config(tmp_path, ["http://127.0.0.1:9"])  # nothing listens there
    with serve_in_thread(create_gateway(load_gateway_config(path))) as url:
        reply = post(url, keys["alpha"], BODY)
        assert reply.status_code == 502 and reply.json()["error"]["code"] == "upstream_error"

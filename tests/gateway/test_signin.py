"""Sign-in links for the dashboard (``fairgate.gateway.signin``): an admin makes a short-lived signed link
for a tenant's view or its own; the token opens ``/dashboard/data`` with that view and nothing else, and a
token expired, tampered with, of another secret or of a tenant gone is refused."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from fairgate.gateway.signin import LINK_TTL_S_MAX, PREFIX, make_token, verify_token
from tests.gateway.test_metrics import ADMIN_KEY, admin_stack

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
BODY = {"model": "emu", "prompt": "x y", "max_tokens": 3, "ignore_eos": True}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_link_opens_its_view_of_the_dashboard_and_nothing_else(tmp_path: Path) -> None:
    with admin_stack(tmp_path) as stack:
        url = stack.url
        httpx.post(f"{url}/v1/completions", json=BODY, headers=bearer(stack.keys["beta"]), timeout=30)
        made = httpx.post(f"{url}/admin/dashboard-links", json={"tenant": "beta", "ttl_s": 120}, headers=ADMIN)
        assert made.status_code == 201, made.text
        link = made.json()
        assert link["url"].startswith(f"/dashboard#signin={PREFIX}") and link["tenant"] == "beta"
        assert time.time() + 100 < link["expires_at_s"] < time.time() + 121
        token = link["url"].split("#signin=")[1]
        data = httpx.get(f"{url}/dashboard/data", headers=bearer(token), timeout=10)
        assert data.status_code == 200 and data.json()["scope"] == "tenant", data.text
        assert list(data.json()["series"]) == ["you"] and data.json()["totals"]["you"]["admissions"] == 1
        # The token is no key: no other route takes it.
        assert httpx.post(f"{url}/v1/completions", json=BODY, headers=bearer(token), timeout=10).status_code == 401
        assert httpx.get(f"{url}/v1/usage", headers=bearer(token), timeout=10).status_code == 401
        assert httpx.get(f"{url}/admin/tenants", headers=bearer(token), timeout=10).status_code == 401
        admin_link = httpx.post(f"{url}/admin/dashboard-links", json={"tenant": None}, headers=ADMIN).json()
        admin_view = httpx.get(f"{url}/dashboard/data", headers=bearer(admin_link["url"].split("#signin=")[1]))
        assert admin_view.json()["scope"] == "admin" and "beta" in admin_view.json()["series"]
        # Tampered: the tenant changed in the payload, or a signature cut. Refused with a plain 401.
        payload, signature = token.removeprefix(PREFIX).split(".")
        for bad in (f"{PREFIX}{payload}.{signature[:-2]}", f"{PREFIX}{payload}x.{signature}", PREFIX, f"{PREFIX}a.b.c"):
            refused = httpx.get(f"{url}/dashboard/data", headers=bearer(bad), timeout=10)
            assert refused.status_code == 401 and "sign-in link is not valid" in refused.text, (bad, refused.text)
        # Only an admin makes links, for a tenant that exists, for at most a day.
        for body, key, status in [
            ({"tenant": "beta"}, stack.keys["beta"], 403),
            ({"tenant": "beta"}, None, 401),
            ({"tenant": "nobody"}, ADMIN_KEY, 404),
            ({"tenant": "beta", "ttl_s": LINK_TTL_S_MAX + 1}, ADMIN_KEY, 400),
            ({"tenant": "beta", "ttl_s": 1}, ADMIN_KEY, 400),
            ({}, ADMIN_KEY, 400),
        ]:
            headers = bearer(key) if key else {}
            answer = httpx.post(f"{url}/admin/dashboard-links", json=body, headers=headers, timeout=10)
            assert answer.status_code == status, (body, answer.text)
        # A link cannot be taken back before it expires: who made which, until when, is in the audit log.
        records = httpx.get(f"{url}/admin/audit", headers=ADMIN, timeout=10).json()["data"]
        made_links = [r for r in records if r["action"] == "dashboard_link.make"]
        assert [r["target"]["tenant"] for r in made_links] == ["beta", None], made_links
        assert made_links[0]["target"]["expires_at_s"] == link["expires_at_s"]
        assert all(r["actor"].startswith("admin:sha256$") for r in made_links)
        assert token.removeprefix(PREFIX) not in str(records)


def test_a_token_is_refused_expired_with_another_secret_or_too_far_ahead() -> None:
    secret, now = b"k" * 32, 1_800_000_000.0
    token = make_token(secret, "acme", now + 60)
    assert verify_token(secret, token, now).tenant == "acme"
    assert verify_token(secret, make_token(secret, None, now + 60), now).tenant is None
    with pytest.raises(ValueError, match="expired"):
        verify_token(secret, token, now + 60)
    with pytest.raises(ValueError, match="bad signature"):
        verify_token(b"j" * 32, token, now)
    with pytest.raises(ValueError, match="too far ahead"):
        verify_token(secret, make_token(secret, "acme", now + LINK_TTL_S_MAX + 10), now)

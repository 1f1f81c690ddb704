"""The gateway serves no interactive docs (Swagger UI and ReDoc load scripts from a CDN) and its OpenAPI
schema only to admin keys, over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.gateway.conftest import Stack, serve_stack

ADMIN_KEY = f"fg-test-admin-{'a' * 24}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with serve_stack(tmp_path_factory.mktemp("docs"), admin_key=ADMIN_KEY) as served:
        yield served


def get(stack: Stack, path: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{stack.url}{path}", headers=headers, timeout=10)


@pytest.mark.parametrize("path", ["/docs", "/docs/oauth2-redirect", "/redoc"])
def test_interactive_docs_are_not_served_to_anyone(stack, path):
    for key in (None, stack.keys["alpha"], ADMIN_KEY):
        reply = get(stack, path, key)
        assert reply.status_code == 404, (path, key, reply.text[:200])
        assert reply.json()["error"]["code"] == "not_found"
        assert "swagger" not in reply.text.lower() and "cdn" not in reply.text.lower()


def test_the_openapi_schema_is_for_admin_keys_only(stack):
    anonymous = get(stack, "/openapi.json")
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
    tenant = get(stack, "/openapi.json", stack.keys["alpha"])
    assert tenant.status_code == 403 and "admin" in tenant.json()["error"]["message"]
    assert get(stack, "/openapi.json", "fg-not-a-key").status_code == 401
    admin = get(stack, "/openapi.json", ADMIN_KEY)
    assert admin.status_code == 200, admin.text
    schema = admin.json()
    assert schema["info"]["title"] == "fairgate gateway"
    assert {"/v1/chat/completions", "/v1/completions"} <= set(schema["paths"])
    assert "/openapi.json" not in schema["paths"] and "/docs" not in schema["paths"]


def test_an_admin_key_on_a_tenant_route_is_told_so_and_no_route_redirects(stack):
    """An outside tester's findings: an admin key on a generation route was answered "Invalid API key.", and a
    POST to a path with a trailing slash was redirected to a Location built from the client's Host header."""
    body = {"model": "emu", "prompt": "hi", "max_tokens": 1}
    admin = httpx.post(f"{stack.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert admin.status_code == 401 and admin.json()["error"]["code"] == "invalid_api_key", admin.text
    assert "admin key" in admin.json()["error"]["message"] and "tenant" in admin.json()["error"]["message"]
    wrong = httpx.post(f"{stack.url}/v1/completions", json=body, headers={"Authorization": "Bearer fg-not-a-key"})
    assert wrong.json()["error"]["message"] == "Invalid API key."
    headers = {"Authorization": f"Bearer {stack.keys['alpha']}", "Host": "evil.example"}
    slashed = httpx.post(f"{stack.url}/v1/completions/", json=body, headers=headers)
    assert slashed.status_code == 404 and "location" not in slashed.headers, slashed.headers

"""The one table from outcome to HTTP answer (``fairgate.gateway.outcomes``)."""

import random
from pathlib import Path

import httpx
import openai
import pytest

from fairgate.gateway.outcomes import ANSWERS, JITTER_MAX_S, Outcome, Rejection, respond
from fairgate.ledger.config import LimitsConfig
from tests.gateway.conftest import serve_stack


def test_every_outcome_has_one_answer():
    assert set(ANSWERS) == set(Outcome)
    for outcome, answer in ANSWERS.items():
        assert 400 <= answer.status < 600, outcome
        assert answer.kind in (
            "invalid_request_error",
            "authentication_error",
            "permission_error",
            "rate_limit_error",
            "server_error",
        ), outcome


def test_a_quota_rejection_answers_429_with_a_jittered_retry_after_and_the_dimension_reason():
    rejection = Rejection(
        Outcome.RATE_LIMITED, "Quota requests_per_minute exceeded.", retry_after_s=4.0, dimension="requests_per_minute"
    )
    rng = random.Random(7)
    reply = respond(rejection, "req-1", rng)
    assert reply.status_code == 429
    assert reply.headers["x-request-id"] == "req-1" and "x-should-retry" not in reply.headers
    assert 4 <= int(reply.headers["retry-after"]) <= 5  # 4 s + up to 25 % jitter, whole seconds
    assert rejection.reason == "rate"
    event = rejection.about("acme", None, "m").event("req-1", 1.0)
    assert (event.tenant, event.model, event.status, event.code, event.retry_after_s) == (
        "acme",
        "m",
        429,
        "rate_limit_exceeded",
        4.0,
    )


def test_final_statuses_tell_clients_not_to_retry():
    reply = respond(Rejection(Outcome.MODEL_NOT_FOUND, "no such model", "model"), "req-2", random.Random(1))
    assert reply.status_code == 404 and reply.headers["x-should-retry"] == "false"
    assert "retry-after" not in reply.headers


def test_an_upstream_status_is_relayed_and_only_there():
    relayed = Rejection(Outcome.UPSTREAM_ERROR, "upstream answered 400", status=400)
    assert relayed.status == 400 and relayed.reason == "invalid"
    assert Rejection(Outcome.UPSTREAM_ERROR, "upstream gone").status == 502
    with pytest.raises(AssertionError):
        Rejection(Outcome.QUEUE_FULL, "full", status=503)


def test_a_client_that_left_is_not_recorded():
    assert not ANSWERS[Outcome.CLIENT_CLOSED].recorded and ANSWERS[Outcome.CLIENT_CLOSED].status == 499
    assert ANSWERS[Outcome.QUEUE_FULL].after_admission and ANSWERS[Outcome.NO_UPSTREAM].after_admission


def test_a_long_wait_gets_at_most_a_minute_of_jitter():
    """A spend budget's wait runs to the next month: 25 % of it would be a week."""
    month_s = 30 * 86_400.0
    rejection = Rejection(Outcome.RATE_LIMITED, "Quota spend_budget exceeded.", retry_after_s=month_s)
    waits = [int(respond(rejection, "r", random.Random(seed)).headers["retry-after"]) for seed in range(50)]
    assert all(month_s <= wait <= month_s + JITTER_MAX_S for wait in waits), (min(waits), max(waits))
    assert max(waits) - min(waits) > JITTER_MAX_S / 2  # still spread


def test_a_quota_no_wait_can_meet_is_a_429_the_openai_client_does_not_retry(tmp_path: Path) -> None:
    """``max_tokens`` above the tenant's ``max_tokens_per_request`` cannot succeed however long the client
    waits: 429 ``insufficient_quota`` with no ``Retry-After`` and ``x-should-retry: false``, so the OpenAI SDK
    (which retries a 429 twice by default) sends it once."""
    with serve_stack(tmp_path, limits={"alpha": LimitsConfig(max_tokens_per_request=8)}) as stack:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["alpha"], max_retries=2)
        with pytest.raises(openai.RateLimitError) as raised:
            client.completions.create(model="emu", prompt="x", max_tokens=9)
        reply = raised.value.response
        usage = httpx.get(f"{stack.url}/v1/usage", headers={"Authorization": f"Bearer {stack.keys['alpha']}"}).json()
    assert reply.status_code == 429 and reply.json()["error"]["code"] == "insufficient_quota", reply.text
    assert reply.headers["x-should-retry"] == "false" and "retry-after" not in reply.headers, reply.headers
    assert usage["rejections"]["total"] == 1 and usage["requests"] == 0, usage

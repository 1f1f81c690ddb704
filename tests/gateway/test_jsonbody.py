"""Numbers a request body cannot carry (thousands of digits, beyond a float's range) are refused with a 400
naming the field and saying what is wrong with the number, over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from fairgate.gateway import jsonbody
from tests.gateway.conftest import Stack, serve_stack

LONG = b"9" * 5000


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with serve_stack(tmp_path_factory.mktemp("jsonbody")) as served:
        yield served


def post_raw(stack: Stack, body: bytes) -> httpx.Response:
    headers = {"Authorization": f"Bearer {stack.keys['alpha']}", "Content-Type": "application/json"}
    return httpx.post(f"{stack.url}/v1/completions", content=body, headers=headers, timeout=30)


@pytest.mark.parametrize(
    "number, param, message",
    [
        (LONG, "max_tokens", "max_tokens: number too long (5,000 characters; at most 100)"),
        (b"-" + LONG, "max_tokens", "max_tokens: number too long (5,001 characters; at most 100)"),
        (b"1" + b"0" * 5000 + b".5", "max_tokens", "max_tokens: number too long (5,003 characters; at most 100)"),
        (b"1e400", "max_tokens", "max_tokens: number out of range (beyond what a 64-bit float holds)"),
        (b"-1.5e999", "max_tokens", "max_tokens: number out of range (beyond what a 64-bit float holds)"),
    ],
)
def test_an_unreadable_number_is_a_400_naming_its_field(stack, number, param, message):
    reply = post_raw(stack, b'{"model": "emu", "prompt": "x", "max_tokens": ' + number + b"}")
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["param"], error["message"]) == (param, message)
    assert "NaN" not in error["message"]
    assert stack.reservations() == []


def test_a_long_number_deep_in_the_body_is_named_by_its_path(stack):
    reply = post_raw(stack, b'{"model": "emu", "prompt": "x", "logit_bias": {"50256": ' + LONG + b"}}")
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "logit_bias.50256"
    reply = post_raw(stack, b'{"model": "emu", "prompt": "x", "stop": ["a", ' + LONG + b"]}")
    assert reply.json()["error"]["param"] == "stop.1"


def test_numbers_up_to_the_bound_still_reach_the_schema(stack):
    # 100 digits parse; the schema then names the field and its own range.
    reply = post_raw(stack, b'{"model": "emu", "prompt": "x", "max_tokens": ' + b"9" * 100 + b"}")
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens"
    assert "too long" not in reply.json()["error"]["message"]
    ok = post_raw(stack, b'{"model": "emu", "prompt": "x", "max_tokens": 2, "seed": 9223372036854775807}')
    assert ok.status_code == 200, ok.text


def test_decode_leaves_ordinary_numbers_as_python_numbers():
    data = jsonbody.decode(b'{"a": 12, "b": -0.25, "c": 1e-400, "d": [1.5e300]}')
    assert data == {"a": 12, "b": -0.25, "c": 0.0, "d": [1.5e300]}
    assert jsonbody.unsendable(data) is None
    assert type(data["a"]) is int

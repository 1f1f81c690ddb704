"""The emulated replica's ``n`` choices and ``/v1/embeddings``, over real HTTP with the real ``openai`` client."""

from __future__ import annotations

import httpx
import openai
import pytest

from fairgate.emulator.api import EmulatorSettings, create_app, replica_of
from fairgate.emulator.embeddings import vector
from fairgate.harness.threads import serve_in_thread

SETTINGS = EmulatorSettings(
    iter_base_ms=4.0, prefill_ms_per_token=0.01, max_batch=8, max_model_len=64, model="emu", embedding_dimensions=16
)


@pytest.fixture(scope="module")
def served():  # type: ignore[no-untyped-def]
    app = create_app(SETTINGS)
    with serve_in_thread(app) as url:
        yield url, app


def test_n_sequences_run_side_by_side(served) -> None:  # type: ignore[no-untyped-def]
    url, app = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    before = replica_of(app).sequences_finished
    reply = client.chat.completions.create(
        model="emu", messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert [(c.index, c.message.content, c.finish_reason) for c in reply.choices] == [
        (i, " t1 t2 t3 t4", "length") for i in range(3)
    ]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (4, 12)
    assert replica_of(app).sequences_finished - before == 3


def test_embeddings_are_deterministic_unit_vectors(served) -> None:  # type: ignore[no-untyped-def]
    url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    one = client.embeddings.create(model="emu", input=["a b", "c"], encoding_format="float")
    two = client.embeddings.create(model="emu", input="a b", dimensions=4)  # base64, decoded by the client
    assert [len(d.embedding) for d in one.data] == [16, 16] and one.usage.prompt_tokens == 3
    assert one.data[0].embedding == pytest.approx(vector("a b", 16))
    assert sum(v * v for v in one.data[1].embedding) == pytest.approx(1.0)
    assert two.data[0].embedding == pytest.approx(vector("a b", 4), abs=1e-6)


@pytest.mark.parametrize(
    ("body", "param"),
    [({"input": ""}, "input"), ({"input": "w " * 65}, "input"), ({"input": "x", "dimensions": 17}, "dimensions")],
)
def test_bad_embedding_requests_are_400(served, body, param) -> None:  # type: ignore[no-untyped-def]
    url, _ = served
    reply = httpx.post(f"{url}/v1/embeddings", json={"model": "emu", **body}, timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text

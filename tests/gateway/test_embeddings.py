"""``/v1/embeddings`` through the gateway, over real HTTP on loopback, with the real ``openai`` client, an
emulated replica and an SQLite ledger: billed by the input tokens the replica reports, queued fairly, bad
bodies answered 400 naming the field, a client cut cancelling the reservation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path

import httpx
import openai
import pytest

from fairgate.core.cost import CostModel
from fairgate.emulator.api import create_app, replica_of
from fairgate.emulator.embeddings import vector
from fairgate.gateway.eventlog import read_records
from fairgate.gateway.observe import Admitted, Dispatched, Finished
from tests.conftest import fairgate
from tests.gateway.conftest import EMULATOR, REPLICA, Recorder, serve_stack

COST = CostModel(REPLICA.iter_base_ms, REPLICA.iter_slope_ms, REPLICA.prefill_ms_per_token, REPLICA.max_batch)


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_embeddings_are_billed_by_the_input_tokens_the_replica_reports(tmp_path: Path) -> None:
    recorder = Recorder()
    emulator = create_app(EMULATOR)
    with serve_stack(tmp_path, upstream=emulator, observers=[recorder]) as stack:
        client = _client(stack.url, stack.keys["alpha"])
        texts = ["one two three", "four five"]
        reply = client.embeddings.create(model="emu", input=texts, extra_headers={"x-request-id": "emb-1"})
        floats = client.embeddings.create(
            model="emu", input=[[5, 6, 7]], encoding_format="float", dimensions=8, extra_headers={"x-request-id": "e2"}
        )
        [r1] = [r for r in stack.reservations() if r.request_id == "emb-1"]
        [r2] = [r for r in stack.reservations() if r.request_id == "e2"]
        finished_at_replica = replica_of(emulator).sequences_finished
    # What the client received ...
    assert reply.model == "emu" and [d.index for d in reply.data] == [0, 1]
    assert reply.usage.prompt_tokens == 5 and reply.usage.total_tokens == 5
    for item, data in zip(texts, reply.data, strict=True):  # base64 (the client's default), decoded
        assert data.embedding == pytest.approx(vector(item, EMULATOR.embedding_dimensions), abs=1e-6)
    assert floats.data[0].embedding == pytest.approx(vector([5, 6, 7], 8)) and floats.usage.prompt_tokens == 3
    # ... is what the ledger holds: input tokens as reported, no output, the metered GPU time, once.
    assert (r1.status, r1.billed.input_tokens, r1.billed.output_tokens) == ("settled", 5, 0)
    assert (r2.status, r2.billed.input_tokens, r2.billed.output_tokens) == ("settled", 3, 0)
    assert r1.max_output_tokens == 0
    assert r1.gpu_ms_estimate == pytest.approx(COST.worst_case_ms(r1.input_tokens, 1))
    [finished] = recorder.of(Finished, "emb-1")
    assert finished.outcome == "completed" and finished.gpu_ms == pytest.approx(r1.billed.gpu_ms)
    # One iteration at least: its prefill plus its dt / B share, never less than the prefill alone.
    assert r1.billed.gpu_ms >= COST.prefill_ms(5)
    assert finished_at_replica == 2  # one sequence (slot) per request


def test_embeddings_wait_in_the_fair_queue_like_any_request(tmp_path: Path) -> None:
    recorder = Recorder()
    with serve_stack(tmp_path, observers=[recorder]) as stack:
        long = {"model": "emu", "prompt": "x", "max_tokens": 80, "ignore_eos": True}

        async def run() -> openai.types.CreateEmbeddingResponse:
            async with httpx.AsyncClient(timeout=60) as http:
                flood = [
                    http.post(
                        f"{stack.url}/v1/completions",
                        json=long,
                        headers={"Authorization": f"Bearer {stack.keys['alpha']}", "x-request-id": f"alpha-{i}"},
                    )
                    for i in range(REPLICA.max_batch + 2)
                ]
                started = asyncio.gather(*flood)
                await asyncio.sleep(0.15)  # alpha holds every slot and queues two more
                beta = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=stack.keys["beta"], max_retries=0)
                async with beta:  # closed on this loop, not by the garbage collector after it is gone
                    embedded = await beta.embeddings.create(
                        model="emu", input="a b c", extra_headers={"x-request-id": "beta-emb"}
                    )
                assert all(r.status_code == 200 for r in await started)
                return embedded

        embedded = asyncio.run(run())
    assert embedded.usage.prompt_tokens == 3
    order = [e.request_id for e in recorder.of(Dispatched)]
    [dispatched] = recorder.of(Dispatched, "beta-emb")
    [admitted] = recorder.of(Admitted, "beta-emb")
    assert admitted.max_output_tokens == 0 and admitted.input_tokens >= 3
    # It waited for a slot (alpha held all of them), and got the first that freed: beta had used no GPU
    # time, alpha's queued requests came after it.
    assert dispatched.queue_ms > 50
    assert order.index("beta-emb") == REPLICA.max_batch, order


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": 5}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [-1, 2]}, "input"),
        ({"input": ["w"] * 2049}, "input"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": "8"}, "dimensions"),
        ({}, "input"),
        ({"input": "x", "model": 7}, "model"),
    ],
)
def test_bad_bodies_get_400_naming_the_field(stack, body: dict[str, object], param: str) -> None:  # type: ignore[no-untyped-def]
    reply = httpx.post(
        f"{stack.url}/v1/embeddings",
        json={"model": "emu", **body},
        headers={"Authorization": f"Bearer {stack.keys['alpha']}"},
        timeout=30,
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    assert stack.reservations() == []


def test_a_field_the_replica_refuses_comes_back_as_its_error_and_bills_nothing(
    stack, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    """Found by a new user: the replica's 400 for ``dimensions`` came back as ``server_error`` / ``upstream_error``
    with no ``param``, and the ``upstream_failed`` line said ``"error": "None"``."""
    caplog.set_level(logging.WARNING, logger="fairgate.gateway")
    too_many = EMULATOR.embedding_dimensions + 1
    with _client(stack.url, stack.keys["alpha"]) as client, pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(
            model="emu", input="a b", dimensions=too_many, extra_headers={"x-request-id": "too-wide"}
        )
    error = refused.value.body
    assert refused.value.status_code == 400 and refused.value.response.headers["x-request-id"] == "too-wide"
    assert error == {  # as the replica answered it
        "message": f"dimensions: at most {EMULATOR.embedding_dimensions} for this model, got {too_many}.",
        "type": "invalid_request_error",
        "param": "dimensions",
        "code": "invalid_request_error",
    }, error
    [r] = stack.reservations()  # billed nothing, as any request the upstream did not run
    assert r.status == "cancelled" and (r.billed.input_tokens, r.billed.output_tokens, r.billed.gpu_ms) == (0, 0, 0)
    [line] = [json.loads(m) for m in caplog.messages if '"upstream_failed"' in m]
    assert line["problem"] == "request_refused" and line["request_id"] == "too-wide", line
    assert "dimensions: at most" in line["error"] and '"param":"dimensions"' in line["sent"], line


def test_unknown_model_and_missing_key(stack) -> None:  # type: ignore[no-untyped-def]
    client = _client(stack.url, stack.keys["alpha"])
    with pytest.raises(openai.NotFoundError) as missing:
        client.embeddings.create(model="nope", input="x")
    assert missing.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.AuthenticationError):
        _client(stack.url, "fg-wrong-key").embeddings.create(model="emu", input="x")
    assert stack.reservations() == []


def test_a_client_that_leaves_while_queued_cancels_its_reservation(tmp_path: Path) -> None:
    with serve_stack(tmp_path) as stack:
        long = {"model": "emu", "prompt": "x", "max_tokens": 120, "ignore_eos": True}

        async def run() -> None:
            async with httpx.AsyncClient(timeout=60) as http:
                auth = {"Authorization": f"Bearer {stack.keys['alpha']}"}
                flood = asyncio.gather(
                    *(http.post(f"{stack.url}/v1/completions", json=long, headers=auth) for _ in range(4))
                )
                await asyncio.sleep(0.1)
                queued = asyncio.ensure_future(
                    http.post(
                        f"{stack.url}/v1/embeddings",
                        json={"model": "emu", "input": "a b"},
                        headers={**auth, "x-request-id": "cut"},
                    )
                )
                for _ in range(200):  # until the gateway holds its reservation (however loaded the machine)
                    await asyncio.sleep(0.02)
                    if any(r.request_id == "cut" for r in await asyncio.to_thread(stack.reservations)):
                        break
                assert not queued.done()  # still queued behind the flood
                queued.cancel()  # the client leaves
                with contextlib.suppress(asyncio.CancelledError):
                    await queued
                await flood

        asyncio.run(run())
        [cut] = [r for r in stack.reservations() if r.request_id == "cut"]
    assert cut.status == "cancelled" and cut.billed.input_tokens == 0 and cut.billed.gpu_ms == 0
    # The request log ends its story too: a ``left`` record after its ``admitted`` one, told by explain.
    log = stack.config.event_log_path
    assert log is not None
    story = [r["event"] for _, _, r in read_records(log) if r.get("request_id") == "cut"]
    assert story == ["admitted", "left"], story
    told = fairgate("explain", "cut", "--log", str(log))
    assert told.returncode == 0 and "the client left after" in told.stdout and "nothing was billed" in told.stdout

"""Automatic prefix caching in the emulated replica (vLLM's, https://docs.vllm.ai/en/latest/design/prefix_caching.html):
the replica's loop on its clock, and the usage over real HTTP on loopback. Every expected time is computed
from the cost model, every expected count from the prompt's length and the 16-token block."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys

import httpx
import openai
import pytest

from fairgate.api import ChatRequest, CompletionRequest, count_prompt_tokens
from fairgate.core.cost import CostModel
from fairgate.emulator.api import create_app, prompt_token_list, replica_of
from fairgate.emulator.replica import BLOCK_TOKENS, EmulatedReplica, Iteration, Sequence, block_hashes
from fairgate.harness.process import fairgate_process, free_port
from fairgate.harness.replica import ReplicaModel
from fairgate.harness.threads import serve_in_thread

# dt = 1 + 0.5 B + 0.01 per prefilled token (ms): short iterations, so the loop's tests run in milliseconds
COST = CostModel(1.0, 0.5, 0.01, 8)


def words(count: int, first: int = 0) -> list[str | int]:
    return [f"w{i}" for i in range(first, first + count)]


def most_cached(prompt_tokens: int) -> int:
    """The most a prompt can find cached: whole blocks, leaving at least one token to compute."""
    return (prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS


async def finish(seq: Sequence) -> Sequence:
    while await seq.events.get() is not None:
        pass
    return seq


async def alone(
    replica: EmulatedReplica, prompt: list[str | int], salt: str | None = "a", output: int = 3
) -> tuple[Sequence, Iteration]:
    """Run one request on an idle replica to its end: the sequence and the iteration that admitted it."""
    before = len(replica.iterations)
    seq = await finish(replica.submit(len(prompt), output, salt, block_hashes(prompt)))
    return seq, replica.iterations[before]


def on_replica(test, **options):  # type: ignore[no-untyped-def]
    """Run ``test(replica)`` on a started replica of ``COST`` (with ``options``), then stop it."""

    async def run():  # type: ignore[no-untyped-def]
        replica = EmulatedReplica(COST, **options)
        replica.start()
        try:
            return await test(replica)
        finally:
            await replica.stop()

    return asyncio.run(run())


# --- block hashes --------------------------------------------------------------------------------------
def test_block_hashes_chain_full_blocks_and_are_the_same_in_every_process():
    prompt = words(100)
    hashes = block_hashes(prompt)
    assert len(hashes) == 100 // BLOCK_TOKENS and len(set(hashes)) == len(hashes)
    assert block_hashes(prompt[:40]) == hashes[:2]  # a partial block has no hash
    changed = block_hashes(["x", *prompt[1:]])
    assert all(a != b for a, b in zip(changed, hashes, strict=True))  # each block's hash covers its prefix
    assert block_hashes(list(range(32))) != block_hashes([str(i) for i in range(32)])  # ids are not words
    code = (
        "from fairgate.emulator.replica import block_hashes; print(list(block_hashes([f'w{i}' for i in range(100)])))"
    )
    for seed in ("1", "2"):
        other = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed}
        )
        assert json.loads(other.stdout) == list(hashes)


def test_the_rendered_prompt_is_the_tokens_counted():
    bodies = [
        ChatRequest.model_validate(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "be  brief"},
                    {"role": "user", "content": [{"type": "text", "text": "a b"}, {"type": "text", "text": "c"}]},
                    {"role": "assistant", "content": None},
                ],
            }
        ),
        CompletionRequest.model_validate({"model": "m", "prompt": " one two\tthree "}),
        CompletionRequest.model_validate({"model": "m", "prompt": ["x y"]}),
        CompletionRequest.model_validate({"model": "m", "prompt": [5, 6, 7]}),
        CompletionRequest.model_validate({"model": "m", "prompt": [[5, 6]]}),
    ]
    for body in bodies:
        assert len(prompt_token_list(body)) == count_prompt_tokens(body)
    assert prompt_token_list(bodies[3]) == [5, 6, 7]


# --- the replica on its clock ----------------------------------------------------------------------------
def test_the_same_prompt_again_prefills_only_its_uncached_tokens():
    prompt = words(100)

    async def test(replica):  # type: ignore[no-untyped-def]
        first, admitted_first = await alone(replica, prompt)
        second, admitted_second = await alone(replica, prompt)
        return first, second, admitted_first, admitted_second

    first, second, admitted_first, admitted_second = on_replica(test, prefix_caching=True)
    cached = most_cached(100)
    assert (first.cached_tokens, second.cached_tokens) == (0, cached)
    assert (admitted_first.prefill_tokens, admitted_first.cached_tokens) == (100, 0)
    assert (admitted_second.prefill_tokens, admitted_second.cached_tokens) == (100 - cached, cached)
    assert admitted_second.planned_ms == pytest.approx(COST.iteration_ms(1, 100 - cached))
    assert admitted_first.planned_ms - admitted_second.planned_ms == pytest.approx(COST.prefill_ms(cached))


def test_a_prompt_of_whole_blocks_computes_its_last_block_and_a_shared_prefix_is_cached_up_to_the_difference():
    async def test(replica):  # type: ignore[no-untyped-def]
        await alone(replica, words(64))
        whole, _ = await alone(replica, words(64))
        branch, admitted = await alone(replica, [*words(40), *words(30, first=1000)])  # 2 blocks + 8 shared
        return whole.cached_tokens, branch.cached_tokens, admitted.prefill_tokens

    whole, branch, prefilled = on_replica(test, prefix_caching=True)
    assert whole == 64 - BLOCK_TOKENS  # all 4 blocks cached, the last recomputed for its logits
    assert (branch, prefilled) == (2 * BLOCK_TOKENS, 70 - 2 * BLOCK_TOKENS)


def test_no_reuse_across_salts_nor_with_caching_off():
    prompt = words(100)

    async def test(replica):  # type: ignore[no-untyped-def]
        await alone(replica, prompt, salt="a")
        other, _ = await alone(replica, prompt, salt="b")
        unsalted, _ = await alone(replica, prompt, salt=None)
        same, _ = await alone(replica, prompt, salt="b")
        return other.cached_tokens, unsalted.cached_tokens, same.cached_tokens

    assert on_replica(test, prefix_caching=True) == (0, 0, most_cached(100))

    async def off(replica):  # type: ignore[no-untyped-def]
        await alone(replica, prompt)
        again, admitted = await alone(replica, prompt)
        return replica.prefix_cache, again.cached_tokens, admitted

    cache, cached, admitted = on_replica(off)
    assert cache is None and cached == 0
    assert (admitted.prefill_tokens, admitted.cached_tokens) == (100, 0)
    assert admitted.planned_ms == pytest.approx(COST.iteration_ms(1, 100))


def test_the_charge_rule_counts_only_uncached_prefill():
    prompt, output = words(100), 5

    async def test(replica):  # type: ignore[no-untyped-def]
        first, _ = await alone(replica, prompt, salt="t", output=output)
        second, _ = await alone(replica, prompt, salt="t", output=output)
        return first.charged_ms, second.charged_ms, dict(replica.charged_ms_by_salt)

    first, second, by_salt = on_replica(test, prefix_caching=True)
    decode = output * COST.decode_ms(1)  # each ran alone: B = 1 in every iteration
    assert first == pytest.approx(decode + COST.prefill_ms(100))
    assert second == pytest.approx(decode + COST.prefill_ms(100 - most_cached(100)))
    assert by_salt == {"t": pytest.approx(first + second)}


def test_a_prompt_admitted_beside_its_twin_finds_the_blocks_the_twin_just_cached():
    prompt = words(50)

    async def test(replica):  # type: ignore[no-untyped-def]
        before = len(replica.iterations)
        seqs = [replica.submit(50, 2, "a", block_hashes(prompt)) for _ in range(2)]  # admitted together
        for seq in seqs:
            await finish(seq)
        return [seq.cached_tokens for seq in seqs], replica.iterations[before]

    cached, admitted = on_replica(test, prefix_caching=True)
    assert cached == [0, most_cached(50)]
    assert (admitted.batch, admitted.prefill_tokens) == (2, 50 + 50 - most_cached(50))


def test_the_cache_is_bounded_and_evicts_the_least_recently_used():
    a, b, c = words(49), words(49, first=100), words(49, first=200)  # 3 blocks each, all cacheable

    async def test(replica):  # type: ignore[no-untyped-def]
        sizes, found = [], []
        for prompt in (a, b, a, c, a, b):  # a is used again before c comes: b is the least recently used
            seq, _ = await alone(replica, prompt)
            sizes.append(len(replica.prefix_cache))
            found.append(seq.cached_tokens)
        return sizes, found

    sizes, found = on_replica(test, prefix_caching=True, cache_blocks=6)
    assert sizes == [3, 6, 6, 6, 6, 6]
    assert found == [0, 0, 48, 0, 48, 0]  # c evicted b's blocks, not a's


def test_a_prompt_longer_than_the_cache_keeps_its_head():
    prompt = words(97)  # 6 blocks in a cache of 4: its tail goes first, so its first 4 blocks stay usable

    async def test(replica):  # type: ignore[no-untyped-def]
        await alone(replica, prompt)
        again, _ = await alone(replica, prompt)
        return again.cached_tokens

    assert on_replica(test, prefix_caching=True, cache_blocks=4) == 4 * BLOCK_TOKENS


def test_more_blocks_than_the_prompt_has_are_refused():
    replica = EmulatedReplica(COST, prefix_caching=True)
    with pytest.raises(ValueError, match="prompt blocks"):
        replica.submit(31, 1, "a", block_hashes(words(32)))
    with pytest.raises(ValueError, match="capacity"):
        EmulatedReplica(COST, prefix_caching=True, cache_blocks=0)


# --- over HTTP -----------------------------------------------------------------------------------------------
MODEL = ReplicaModel(4.0, 0.5, 0.05, 8, 4096, 20.0)
PROMPT = " ".join(f"word{i}" for i in range(200))  # a chat of one message: 203 tokens


@pytest.fixture(scope="module")
def caching():  # type: ignore[no-untyped-def]
    app = create_app(dataclasses.replace(MODEL, prefix_caching=True).settings("emu"))
    with serve_in_thread(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def plain():  # type: ignore[no-untyped-def]
    app = create_app(MODEL.settings("emu"))
    with serve_in_thread(app) as url:
        yield url, app


def chat(salt: str | None, stream: bool = False, max_tokens: int = 4) -> dict:
    body = {"model": "emu", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens}
    body |= {"ignore_eos": True} | ({"cache_salt": salt} if salt is not None else {})
    return body | ({"stream": True, "stream_options": {"include_usage": True}} if stream else {})


def post(url: str, body: dict) -> tuple[dict, list[dict]]:
    """The usage of one request (non-streamed: the body's; streamed: the last chunk's), and the chunks."""
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    if not body.get("stream"):
        return reply.json()["usage"], []
    chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    return chunks[-1]["usage"], chunks


def admitting(app, send):  # type: ignore[no-untyped-def]
    """``send()``'s result and the iteration that admitted it (the replica is idle before and after)."""
    replica = replica_of(app)
    before = len(replica.iterations)
    result = send()
    return result, replica.iterations[before]


def test_usage_reports_the_cached_prompt_tokens_and_the_iteration_is_shorter(caching):
    url, app = caching
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def send():  # type: ignore[no-untyped-def]
        return client.chat.completions.create(
            model="emu",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=4,
            extra_body={"ignore_eos": True, "cache_salt": "tenant-1"},
        ).usage

    first, admitted_first = admitting(app, send)
    second, admitted_second = admitting(app, send)
    prompt_tokens = count_prompt_tokens(ChatRequest.model_validate(chat(None)))
    cached = second.prompt_tokens_details.cached_tokens
    assert first.prompt_tokens == second.prompt_tokens == prompt_tokens
    assert first.prompt_tokens_details.cached_tokens == 0
    assert cached == most_cached(prompt_tokens) and cached % BLOCK_TOKENS == 0 and 0 < cached < prompt_tokens
    assert admitted_second.prefill_tokens == prompt_tokens - cached
    shorter = admitted_first.planned_ms - admitted_second.planned_ms
    assert shorter == pytest.approx(MODEL.prefill_ms_per_token * cached)


def test_the_streamed_usage_chunk_has_the_same_shape(caching):
    url, _ = caching
    post(url, chat("tenant-2", stream=True))
    usage, chunks = post(url, chat("tenant-2", stream=True, max_tokens=3))
    prompt_tokens = count_prompt_tokens(ChatRequest.model_validate(chat(None)))
    assert chunks[-1]["choices"] == []
    assert usage == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 3,
        "total_tokens": prompt_tokens + 3,
        "prompt_tokens_details": {"cached_tokens": most_cached(prompt_tokens)},
    }
    other, _ = post(url, chat("tenant-3"))  # the same prompt under another salt
    assert other["prompt_tokens_details"] == {"cached_tokens": 0}


def test_the_ground_truth_charges_only_uncached_prefill(caching):
    url, app = caching
    replica = replica_of(app)
    output = 6
    post(url, chat("tenant-4", max_tokens=output))
    usage, _ = post(url, chat("tenant-4", max_tokens=output))
    cost = MODEL.settings("emu").cost()
    prompt_tokens, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    expected = 2 * output * cost.decode_ms(1) + cost.prefill_ms(prompt_tokens) + cost.prefill_ms(prompt_tokens - cached)
    assert replica.charged_ms_by_salt["tenant-4"] == pytest.approx(expected)


def test_completions_of_token_ids_and_n_choices_are_cached_too(caching):
    url, _ = caching
    body = {"model": "emu", "prompt": list(range(40)), "max_tokens": 2, "ignore_eos": True, "cache_salt": "t5"}
    for expected in (0, most_cached(40)):
        usage = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": expected}
    usage, _ = post(url, chat("tenant-6") | {"n": 3})
    usage, _ = post(url, chat("tenant-6") | {"n": 3})
    assert usage["prompt_tokens_details"]["cached_tokens"] == most_cached(usage["prompt_tokens"])
    assert usage["completion_tokens"] == 3 * 4


def test_with_caching_off_nothing_is_cached_and_usage_has_no_details(plain):
    url, app = plain
    prompt_tokens = count_prompt_tokens(ChatRequest.model_validate(chat(None)))
    for stream in (False, True):
        usage, admitted = admitting(app, lambda stream=stream: post(url, chat("tenant-1", stream=stream))[0])
        assert "prompt_tokens_details" not in usage
        assert (admitted.prefill_tokens, admitted.cached_tokens) == (prompt_tokens, 0)
    assert replica_of(app).prefix_cache is None


def test_fairgate_emulate_takes_the_switch():
    model = ReplicaModel(4.0, 0.5, 0.05, 8, 4096, 20.0, prefix_caching=True)
    port = free_port()
    args = model.emulate_args(port, "emu")
    assert "--prefix-caching" in args and "--prefix-caching" not in MODEL.emulate_args(port, "emu")
    with fairgate_process(args, port) as url:
        post(url, chat("t"))
        usage, _ = post(url, chat("t"))
    assert usage["prompt_tokens_details"] == {"cached_tokens": most_cached(usage["prompt_tokens"])}

"""An engine's prefix cache, as the meter accounts for it: guessed when a request is sent, settled when the
engine says what it read from it.

The live meter weighs a request being prefilled by the cost model's prefill time of its prompt
(``fairgate.core.meter``). An engine with a prefix cache (vLLM's automatic prefix caching and SGLang's radix
cache, scoped to the tenant by ``cache_salt``; OpenAI's prompt caching) prefills only the part of a prompt
it has not cached, and says how much it read from the cache only in the usage at the end
(``prompt_tokens_details.cached_tokens``, OpenAI's usage field, which vLLM and SGLang fill). Weighed by its
whole prompt, a request that hits the cache takes too much of the iterations it is prefilled in, and the
requests beside it too little. Measured on llama-server with its prompt cache on: a tenant re-sending one
long prompt was billed 49 % of the engine's time against a true 40 %.

**At send** (``PrefixGuess``), the gateway guesses the cached part the way llm-d's prefix-cache-aware
scorer tracks an engine's cache: the prompt's text in blocks of ``BLOCK_CHARS`` characters, each block's
hash covering the text up to its end (vLLM hashes its token blocks so), and the blocks of the prompts sent
to the upstream lately (per cache scope: the tenant where the engine isolates tenants) in a bounded LRU;
the leading blocks found there are the guess, and the meter sizes the prefill by the rest. Characters are
not tokens, an engine evicts what it likes, and a prompt sent beside its twin may miss: the guess is only a
guess, settled below. An upstream that has not yet reported cached tokens is guessed to cache nothing (an
engine started without prefix caching, or that does not say, must not be under-billed).

**At settlement** (``prefix_cache_credit``) the iterations of its prefill are split again with the prefill
weight it should have had. Over them the request, of decode weight ``d`` and prefill weight ``p`` (as the
meter sized it), beside others of weight ``W``, got a share ``(d + p) / (d + p + W)`` of the time,
``T = prefill_charged * (d + p + W) / p`` in all; with the weight the engine's usage implies, ``p' = p * r``
(``r``: its uncached prompt over the one the meter sized), it would have got ``(d + p') / (d + p' + W)``.
The difference goes to (or, guessed too high, comes from) the requests beside it, in proportion to their
weight: nothing when it ran alone (``W = 0``: all the time was its own either way). The part of its own
tenant's other requests stays on it (the tenant's total is the same either way, and those requests may be
settled already); the rest is the credit: the request is billed its charge less the credit, and the policy
books the credit to the other tenants (the other gateway processes' share is theirs to book). The other
tenants' bills in the ledger are not changed: their requests may be settled already; the credit is
reported instead, so that billed + credited = busy time. The re-split is exact where the meter saw the
iteration the request was prefilled in (tests/core/test_prefix_cache.py).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from fairgate.core.meter import MeteredCall

BLOCK_CHARS = 64  # about 16 tokens of English text: vLLM's default block
GUESS_BLOCKS_MAX = 65_536  # blocks remembered per upstream (4 MiB of prompt text)


class PrefixGuess:
    """What an engine's prefix cache probably holds: the block hashes of the prompts sent to it lately, per
    cache scope, at most ``max_blocks`` (least recently used first out). See the module docstring."""

    def __init__(self, max_blocks: int = GUESS_BLOCKS_MAX) -> None:
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()  # hash((scope, block)): ~100 bytes a block

    def send(self, scope: str, text: str) -> float:
        """A prompt of ``text`` is sent in cache scope ``scope``: the share (0-1, less than 1: an engine
        computes a prompt's last token at least) of its characters guessed cached, from the prompts sent
        before it; its blocks are remembered from now."""
        hashes, previous = [], 0
        for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
            previous = hash((previous, text[start : start + BLOCK_CHARS]))
            hashes.append(previous)
        keys = [hash((scope, block)) for block in hashes]
        found = 0
        while found < len(keys) and keys[found] in self._blocks:
            found += 1
        for key in reversed(keys):  # the prompt's head is used last: the tail goes out first
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
        return min(found * BLOCK_CHARS, len(text) - 1) / len(text) if found else 0.0


def prompt_text(body: Mapping[str, Any]) -> str:
    """The prompt of an OpenAI request body as the text a prefix cache would see first to last: each chat
    message's role and content (text parts; other parts by their JSON), or the completion's prompt (token
    ids and lists by their JSON)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(_message_text(m) for m in messages)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def _message_text(message: object) -> str:
    if not isinstance(message, dict):
        return json.dumps(message)
    content = message.get("content")
    if isinstance(content, list):
        parts = [
            p["text"] if isinstance(p, dict) and isinstance(p.get("text"), str) else json.dumps(p) for p in content
        ]
        content = "".join(parts)
    elif not isinstance(content, str):
        content = json.dumps(content)
    return f"{message.get('role')}\n{content}\n"


def cached_fraction(cached_tokens: object, prompt_tokens: int) -> float | None:
    """The cached share of a prompt of ``prompt_tokens`` (the count the usage reports) from the usage's
    ``cached_tokens``; None for anything but a whole number in ``[0, prompt_tokens]`` (an engine's count is
    not believed beyond the prompt it read; no count says nothing)."""
    if type(cached_tokens) is not int or prompt_tokens <= 0 or not 0 <= cached_tokens <= prompt_tokens:
        return None
    return cached_tokens / prompt_tokens


def prefix_cache_credit(call: MeteredCall, ratio: float) -> tuple[float, dict[str, float]]:
    """The GPU ms to take off ``call``'s charge (negative: to add to it) when its prefill should have
    weighed ``ratio`` times what the meter sized (>= 0: its uncached prompt over the one the meter was
    given), and the other tenants that ran beside it with the ms each is to be booked (negative: taken
    back). See the module docstring for the formula.

    Returns:
        ``(credit_ms, tenant -> ms)``; ``(0.0, {})`` when the meter was right or nothing ran beside it.
    """
    p, d, charged = call.prefill_weight, call.decode_weight, call.prefill_charged_ms
    w = sum(call.beside.values()) + call.remote_weight
    if not ratio >= 0.0 or ratio == 1.0 or p <= 0.0 or w <= 0.0 or charged <= 0.0:
        return 0.0, {}
    p_right = p * ratio
    time_ms = charged * (d + p + w) / p
    credit_ms = time_ms * ((d + p) / (d + p + w) - (d + p_right) / (d + p_right + w))
    bound_ms = charged * abs(1.0 - ratio)  # beside a large batch: the whole difference of the prefill
    credit_ms = max(-bound_ms, min(bound_ms, credit_ms))
    moves = {tenant: credit_ms * weight / w for tenant, weight in call.beside.items() if weight > 0.0}
    own_ms = moves.pop(call.tenant, 0.0)  # its own tenant's: stays on it
    return credit_ms - own_ms, moves

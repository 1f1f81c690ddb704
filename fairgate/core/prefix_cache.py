"""An engine's prefix cache, as the meter accounts for it: settled when the engine says what it read from it.

The live meter weighs a request being prefilled by the cost model's prefill time of its whole prompt
(``fairgate.core.meter``). An engine with a prefix cache (vLLM's automatic prefix caching and SGLang's radix
cache, scoped to the tenant by ``cache_salt``; OpenAI's prompt caching) prefills only the part of a prompt
it has not cached, and says how much it read from the cache only in the usage at the end
(``prompt_tokens_details.cached_tokens``, OpenAI's usage field, which vLLM and SGLang fill). Weighed by its
whole prompt, a request that hits the cache takes too much of the iterations it is prefilled in, and the
requests beside it too little. Measured on llama-server with its prompt cache on: a tenant re-sending one
long prompt was billed 49 % of the engine's time against a true 40 %.

At settlement (``prefix_cache_credit``) the iterations of its prefill are split again with the prefill
weight it should have had. Over them the request, of decode weight ``d`` and prefill weight ``p``, beside
others of weight ``W``, got a share ``(d + p) / (d + p + W)`` of the time, ``T = prefill_charged * (d + p +
W) / p`` in all; with the weight of its uncached prompt, ``p' = p * r`` (``r``: uncached over whole), it
would have got ``(d + p') / (d + p' + W)``. The difference goes to the requests beside it, in proportion to
their weight: nothing when it ran alone (``W = 0``: all the time was its own either way). The part of its
own tenant's other requests stays on it (the tenant's total is the same either way, and those requests may
be settled already); the rest is the credit: the request is billed its charge less the credit, and the
policy books the credit to the other tenants (the other gateway processes' share is theirs to book). The
other tenants' bills in the ledger are not raised: their requests may be settled already; the credit is
reported instead, so that billed + credited = busy time. The re-split is exact where the meter saw the
iteration the request was prefilled in (tests/core/test_prefix_cache.py); where it did not (a request that
made the very next step unseen) or where the requests beside it hit the cache too (their weights were
inflated as well), it credits less than the truth: a tenant re-sending one long prompt is billed 8-17 % over
the engine's charge rule instead of 33-45 % (tests/gateway/test_prefix_cache_billing.py).

Only the engine's word lowers a bill. Guessing the cached part when a request is sent (as llm-d's
prefix-cache-aware scorer tracks an engine's cache, from the prompt's text) was tried and dropped: a guess
too high - the engine evicted the prefix, or a prompt alike in text but not in tokens - let a tenant be
billed 12-40 % of its GPU time, the meter having weighed a prefill the engine did.
"""

from __future__ import annotations

from fairgate.core.meter import MeteredCall


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
    given; below 1 when the engine read part of it from its cache), and the other tenants that ran beside it
    with the ms each is to be booked (negative: taken back). See the module docstring for the formula.

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

"""A prompt's cached prefix, learnt at settlement: the share of the GPU time the meter charged a request for
prefill that the engine never did.

The live meter weighs a request being prefilled by the cost model's prefill time of its whole prompt
(``fairgate.core.meter``): when the request is sent nobody knows how much of the prompt the engine will find
in its prefix cache (vLLM's automatic prefix caching and SGLang's radix cache, both scoped to the tenant by
``cache_salt``). The engine says it only in the usage at the end (``prompt_tokens_details.cached_tokens``,
OpenAI's usage field, which vLLM and SGLang fill). The iterations that prefilled the request were shorter by
the cached part, and the meter split them by a prefill weight too large: that request got too much of them,
the requests beside it too little. Measured on llama-server with its prompt cache on: a tenant re-sending
one long prompt was billed 49 % of the engine's time against a true 40 %.

The correction re-splits the iterations of its prefill with the weight it should have had. Over them the
request, of decode weight ``d`` and prefill weight ``p``, beside others of weight ``W``, got a share
``(d + p) / (d + p + W)`` of the time, ``T = prefill_charged * (d + p + W) / p`` in all; with the uncached
prefill weight ``p' = p * (1 - cached / prompt)`` it would have got ``(d + p') / (d + p' + W)``. The
difference is the credit: nothing when it ran alone (``W = 0``: all the time was its own either way), up to
``prefill_charged * cached / prompt`` beside a large batch. The request is billed its charge less the
credit, and the policy books the credit to the tenants that ran beside it, in proportion to their weight
(the share of the other gateway processes' sequences is theirs to book, not this process's). Their bills in
the ledger are not raised: their requests may be settled already; the credit is reported instead, so that
billed + credited = busy time.
"""

from __future__ import annotations

from fairgate.core.meter import MeteredCall


def cached_fraction(cached_tokens: object, prompt_tokens: int) -> float:
    """The cached share of a prompt of ``prompt_tokens`` (the count the usage reports) from the usage's
    ``cached_tokens``: 0 for anything but a whole number in ``[0, prompt_tokens]`` (an engine's count is not
    believed beyond the prompt it read)."""
    if type(cached_tokens) is not int or prompt_tokens <= 0 or not 0 <= cached_tokens <= prompt_tokens:
        return 0.0
    return cached_tokens / prompt_tokens


def prefix_cache_credit(call: MeteredCall, fraction: float) -> tuple[float, dict[str, float]]:
    """The GPU ms to take off ``call``'s charge when ``fraction`` (0-1) of its prompt was cached, and the
    tenants that ran beside it with the ms each is to be booked (summing to the credit less the other
    processes' share). See the module docstring for the formula.

    Returns:
        ``(credit_ms, tenant -> ms)``; ``(0.0, {})`` when nothing was cached or nothing ran beside it.
    """
    p, d, charged = call.prefill_weight, call.decode_weight, call.prefill_charged_ms
    others = sum(call.beside.values())
    w = others + call.remote_weight
    if not 0.0 < fraction <= 1.0 or p <= 0.0 or w <= 0.0 or charged <= 0.0:
        return 0.0, {}
    p_uncached = p * (1.0 - fraction)
    time_ms = charged * (d + p + w) / p
    credit_ms = time_ms * ((d + p) / (d + p + w) - (d + p_uncached) / (d + p_uncached + w))
    credit_ms = min(max(0.0, credit_ms), charged * fraction)
    moves = {tenant: credit_ms * weight / w for tenant, weight in call.beside.items() if weight > 0.0}
    return credit_ms, moves

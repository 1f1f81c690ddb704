"""What a call is billed when the upstream's usage and the gateway's own counts disagree.

The upstream's ``usage`` is the exact count when it is honest: its tokenizer, its chat template, the EOS
token, tokens that decode to no text (half a UTF-8 character) and text cut by a stop string all make it
differ from what the gateway counted by a few tokens, and then it is billed as reported. It is not
believed when it contradicts what the gateway relayed:

- ``completion_tokens`` below the pieces of generated text relayed (each took at least one token: no slack
  here, or the client would receive tokens it is not billed), or above the UTF-8 bytes of all generated text
  seen (content, reasoning, refusal, tool-call names and arguments: every token of a byte-level tokenizer
  decodes to at least one byte, besides the special ones the slack covers): the pieces relayed are billed;
- ``prompt_tokens`` below the gateway's admission estimate divided by ``PROMPT_UNDER_RATIO`` (the estimate
  counts words or one token per 8 bytes, which no tokenizer undercuts 8-fold even for an image's data; and a
  prompt is at least one token), or
  above the most the serving upstreams' context lets them read (``Generation.prompt_tokens_max``): the
  estimate is billed.

Either way the call is logged once, ``usage_contradicts_relay``, naming the upstream. A believed prompt count
above the reservation's ``rules.input_allowance`` (the estimate missed what the engine's tokenizer and chat
template made of the prompt) is billed as reported, and flagged: logged ``usage_above_reservation`` and listed
by the reconciliation (``fairgate.ledger.reconcile``). Output is billed at most ``max_tokens``, which the relay
enforces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fairgate.gateway.upstream import CallState, billable_usage

USAGE_SLACK_TOKENS = 4
PROMPT_UNDER_RATIO = 8


@dataclass(frozen=True)
class Billed:
    """Tokens to bill a call, and what the upstream's usage said when it was not believed."""

    input_tokens: int
    output_tokens: int
    contradicted: dict[str, Any]  # field -> what the upstream reported, for a count not believed

    def usage(self) -> dict[str, int]:
        """The billed counts as OpenAI's ``usage`` names them."""
        return {"prompt_tokens": self.input_tokens, "completion_tokens": self.output_tokens}


def billed_tokens(call: CallState, max_output: int, prompt_tokens_estimated: int, prompt_tokens_max: int) -> Billed:
    """The tokens to bill ``call`` (see module docstring): the upstream's usage where it is believed, the
    gateway's counts (the prompt as sized, pieces relayed) elsewhere; output within ``max_output``.
    ``prompt_tokens_estimated``: the gateway's own estimate, the base of the under-report check (an engine's
    count of the prompt, which sized the request, is the engine's word too)."""
    usage = billable_usage(call.usage) or {}
    contradicted: dict[str, Any] = {}
    reported_input = usage.get("prompt_tokens", call.prompt_tokens)
    prompt_tokens_min = max(1, prompt_tokens_estimated // PROMPT_UNDER_RATIO - USAGE_SLACK_TOKENS)  # never 0
    if not prompt_tokens_min <= reported_input <= prompt_tokens_max:
        contradicted["prompt_tokens"] = reported_input
        reported_input = call.prompt_tokens
    output = usage.get("completion_tokens", call.output_tokens)
    low, high = call.output_tokens, call.generated_bytes + USAGE_SLACK_TOKENS
    if not low <= output <= high:
        contradicted["completion_tokens"] = output
        output = call.output_tokens
    return Billed(reported_input, min(output, max_output), contradicted)

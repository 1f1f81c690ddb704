"""``/v1/embeddings``: the call stage of an embeddings request (intake, admission and queueing are the
generation routes', ``fairgate.gateway.completions``).

An embeddings request is one sequence that is only prefilled: it holds one slot, its inputs are reserved
as input tokens with no output, and it is forwarded to the upstream's ``/v1/embeddings`` (not streamed: the
API has none). It is billed at its end, once: input tokens as the upstream reports them
(``usage.prompt_tokens``; the gateway's estimate when it reports none), and the GPU time the live meter
charged it from the send to the answer. The meter, not the reserved estimate, because it is what the
fair policy was charged and what the meter's split of the upstream's busy time gives it: the replica runs
the request in one iteration's slot (counted in ``B``), so the charge rule charges it its prefill plus
``dt / B`` of that iteration; billing the estimate instead would leave that share unbilled, or bill it to
no one. A client that leaves cancels the call: the connection to the upstream is closed (the replica stops
it at its next iteration) and the reservation is cancelled billing what was metered and the estimated
input (as a generation cut before its first token is). An upstream that fails is billed nothing, like a
generation that fails before the client received anything.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fairgate.gateway.call import Call, TryAnotherUpstream, upstream_failed, while_connected
from fairgate.gateway.upstream import UpstreamError

EMBEDDING_FIELDS = ("input", "encoding_format", "dimensions")


class EmbeddingCall(Call):
    """One admitted embeddings request on one upstream slot (see module docstring); the slot, meter
    registration and settlement paths are ``Call``'s."""

    async def respond(self, request: Request) -> Response:
        """Forward the request and answer the client with the upstream's vectors (``model`` is the model
        the client asked for). Raises ``Rejection`` (the upstream failed, the client left) or
        ``TryAnotherUpstream``."""
        generation = self.admitted.generation
        headers = {"x-request-id": generation.request_id, **self._rate_headers()}
        reply = self.client.embed(self._upstream_body(), self.progress, self.lease.prefill_estimate_ms)
        document = await while_connected(request, self._fetch(reply))
        return JSONResponse({**document, "model": generation.model}, headers=headers)

    def _upstream_body(self) -> dict[str, Any]:
        """OpenAI's embeddings fields only, whatever the upstream's kind (no engine takes more from the
        gateway for an embedding; a client's ``user`` is dropped like every client-set identity), under the
        engine's own model name."""
        body = self.admitted.generation.body.model_dump(exclude_none=True)
        out = {name: body[name] for name in EMBEDDING_FIELDS if name in body}
        out["model"] = self.lease.upstream.model
        return out

    async def _fetch(self, reply: AsyncGenerator[dict[str, Any], None]) -> dict[str, Any]:
        """The upstream's answer; the call ends (slot freed, settled once) on every path."""
        finished = retrying = False
        document: dict[str, Any] = {}
        try:
            async for answer in reply:
                document = answer
            finished = True
        except UpstreamError as exc:
            self.progress.failed, self.progress.failure = True, exc  # the refund's log line says how
            if self._another_upstream(exc):
                retrying = True
                raise TryAnotherUpstream() from None
            raise upstream_failed(exc) from None
        finally:
            await self._end(reply, finished, retrying)
        return document

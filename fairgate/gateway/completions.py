"""The request routes (``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``) and ``/v1/models``
(the model names a tenant may send: aliases and plain models, ``fairgate.gateway.aliases``): the request
path's stages in order.

intake (``fairgate.gateway.intake``: headers, body, sizing) -> admission (``admission``: the ledger
reservation) -> queueing (``queueing``: the fair policy gives it a slot, or ``n`` of them) -> call (``call``:
the upstream call, relayed or collected, settled on every path; ``embeddings`` for an embeddings request).
An upstream that refuses the connection sends the request back to the queue for another upstream of its
pools, under the same reservation (``CONNECT_ATTEMPTS``).

Every rejection on these routes, from a dependency (the caller's key) or a stage, is recorded as a
``Rejected`` event and answered from the outcome table (``RecordedRoute``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from fairgate.api import ChatRequest, CompletionRequest, EmbeddingRequest, openapi_request_body
from fairgate.gateway import admission, intake, tokenizer
from fairgate.gateway.call import Call, TryAnotherUpstream
from fairgate.gateway.embeddings import EmbeddingCall
from fairgate.gateway.identity import Caller, require_tenant
from fairgate.gateway.outcomes import Outcome, Rejection, respond
from fairgate.gateway.queueing import wait_for_slot
from fairgate.gateway.records import note_admission, note_requeued, open_record
from fairgate.gateway.state import GatewayState, gateway_dependency, gateway_of

log = logging.getLogger("fairgate.gateway")

# Upstreams a request is sent to at most, when the ones before refused the connection (each is taken out).
CONNECT_ATTEMPTS = 3

Gateway = Annotated[GatewayState, Depends(gateway_dependency)]
Tenant = Annotated[Caller, Depends(require_tenant)]


class RecordedRoute(APIRoute):
    """A generation route whose every rejection is recorded: the request id is read first (so that every answer
    and event carries it), then the caller's key and the endpoint; a ``Rejection`` from any of them is
    observed as ``Rejected`` (unless the client is gone) and answered from the outcome table.

    Its endpoint is ``(request, state: Gateway, caller: Tenant) -> Response``. Those two dependencies are
    declared for the OpenAPI schema (the bearer scheme) but resolved here, not by FastAPI's dependency solver:
    they read nothing but the request, and solving them was 7 % of the gateway's CPU per request (py-spy)."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        declared = [dependency.call for dependency in self.dependant.dependencies]
        if declared != [gateway_dependency, require_tenant] or self.body_field is not None:
            raise TypeError(f"{path}: a RecordedRoute's endpoint takes (request, state: Gateway, caller: Tenant)")

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = self.endpoint

        async def recorded(request: Request) -> Response:
            state = gateway_of(request)
            # The route's path as matched (``request.url`` would build and parse the whole URL).
            record = open_record(request.scope["path"], state.clock.wall_s(), request.headers)
            request_id: str | None = None
            try:
                request.state.request_id = request_id = intake.request_id_of(request)
                response: Response = await endpoint(request, state, state.identity.tenant_of(request))
            except Rejection as rejection:
                request_id = request_id or intake.new_request_id()  # the id itself was refused
                if rejection.answer.recorded:
                    state.events.observe(rejection.event(request_id, state.clock.wall_s()))
                response = respond(rejection, request_id, state.rng)
            except Exception:  # answered here, not by the app's handler, so that it is recorded and reported
                request_id = request_id or intake.new_request_id()
                log.exception("unexpected error serving %s", request_id)
                message = "Internal error; the request was not billed beyond what ran."
                response = respond(Rejection(Outcome.INTERNAL_ERROR, message), request_id, state.rng)
            if state.request_records is not None:
                state.request_records.answered(record, request_id, response.status_code, state.clock.wall_s())
            return response

        return recorded


def request_id(request: Request) -> str:
    """The id ``RecordedRoute`` read for this request."""
    value = request.state.request_id
    assert isinstance(value, str)
    return value


async def serve(
    state: GatewayState,
    request: Request,
    caller: Caller,
    schema: type[ChatRequest | CompletionRequest | EmbeddingRequest],
) -> Response:
    """Run a request of ``schema`` through the stages (see module docstring). Raises ``Rejection``."""
    model: str | None = None
    try:
        body = await intake.read_body(request, schema, state.config.gateway.max_body_bytes)
        model = body.model[:200]
        if not state.config.access.allows(caller.tenant, body.model):  # to this tenant, no such model
            raise intake.no_model(body.model)
        run = intake.run_of(request)
        if isinstance(body, EmbeddingRequest):
            generation = intake.size_up_embedding(state.config, body, request_id(request), run)
        else:
            # The engine's count sizes a reservation the ledger may grant; not one it is bound to refuse. A
            # request with an id of its client's may be a retry of one admitted, sized by the count: counted.
            refused = admission.request_rate_refused(state, caller.tenant) and not intake.names_its_id(request)
            counted = None if refused else await tokenizer.engine_prompt_tokens(state, body)
            chat = isinstance(body, ChatRequest)
            generation = intake.size_up(state.config, body, chat, request_id(request), run, counted)
        note_admission(state.clock.wall_s())
        admitted = await admission.admit(state, caller, generation)
    except Rejection as rejection:
        raise rejection.about(caller.tenant, caller.delegate, model, caller.key_id) from None
    try:
        return await _run(state, request, admitted)
    except BaseException as exc:
        state.calls.release(caller.tenant, generation.request_id)
        if isinstance(exc, Rejection):
            raise exc.about(caller.tenant, caller.delegate, model, caller.key_id) from None
        raise


async def _run(state: GatewayState, request: Request, admitted: admission.Admitted) -> Response:
    kind = EmbeddingCall if admitted.generation.embedding else Call
    for attempt in range(1, CONNECT_ATTEMPTS + 1):
        lease, queue_ms = await wait_for_slot(state, request, admitted)
        try:
            return await kind(state, admitted, lease, queue_ms, attempt < CONNECT_ATTEMPTS).respond(request)
        except TryAnotherUpstream:  # its upstream refused the connection and is out: back to the queue for another
            note_requeued()
    raise AssertionError("unreachable: the last attempt does not ask for another")  # pragma: no cover


def install(app: FastAPI) -> None:
    """Add the request routes and ``/v1/models`` to ``app``."""

    async def chat_completions(request: Request, state: Gateway, caller: Tenant) -> Response:
        return await serve(state, request, caller, ChatRequest)

    async def completions(request: Request, state: Gateway, caller: Tenant) -> Response:
        return await serve(state, request, caller, CompletionRequest)

    async def embeddings(request: Request, state: Gateway, caller: Tenant) -> Response:
        return await serve(state, request, caller, EmbeddingRequest)

    # On the app's own router, not an included one: matching a request through an included router's layer was
    # 3 % of the gateway's CPU per request (py-spy).
    for path, endpoint, schema in (
        ("/v1/chat/completions", chat_completions, ChatRequest),
        ("/v1/completions", completions, CompletionRequest),
        ("/v1/embeddings", embeddings, EmbeddingRequest),
    ):
        extra = {"requestBody": openapi_request_body(schema)}
        app.router.add_api_route(
            path, endpoint, methods=["POST"], openapi_extra=extra, route_class_override=RecordedRoute
        )

    @app.get("/v1/models")
    async def models(state: Gateway, caller: Tenant) -> dict[str, Any]:
        """Every model name the caller's tenant may send (``[access]``), sorted."""
        allowed = [name for name in sorted(state.config.served) if state.config.access.allows(caller.tenant, name)]
        return {"object": "list", "data": [model_object(name) for name in allowed]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, state: Gateway, caller: Tenant) -> dict[str, Any]:
        """One model object; 404 ``model_not_found`` for a name no alias or upstream serves, or one the
        caller's tenant may not send."""
        if model_id not in state.config.served or not state.config.access.allows(caller.tenant, model_id):
            raise intake.no_model(model_id)
        return model_object(model_id)


def model_object(name: str) -> dict[str, Any]:
    """OpenAI's model object for ``name`` (no creation time is known: 0)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "fairgate"}

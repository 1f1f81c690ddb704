"""The gateway: OpenAI-compatible, tenants from their credential, quota admission, GPU-time fair dispatch.

Request path (``shared/DESIGN.md``, "Request path and errors"):

1. size and JSON checks (413 / 400 naming the field); the tenant from ``Authorization: Bearer <key>``
   (401), or from a signed on-behalf-of token presented by a delegate service (403 otherwise); a tenant
   named in the body (``user``) or a header is never used;
2. the model (404) and the prompt against its context (413); the request id from ``X-Request-Id`` or
   ``Idempotency-Key`` (generated if absent, echoed as ``x-request-id``);
3. a ledger reservation for the prompt, ``max_tokens`` and a GPU-time estimate (429 with ``Retry-After``
   when a quota dimension is full, 503 when the ledger is down for a ``reject`` tier); a retry of a request
   id that already completed is answered 409 and never charged twice;
4. the tenant's queue (429 when ``max_queued`` is reached) and the fair policy, which picks the next
   request whenever an upstream slot frees;
5. the upstream call, always streamed; the live meter charges GPU time as tokens arrive (to the policy at
   once, to the ledger in partial settlements); the final settlement bills the upstream's usage and the
   metered GPU time; a client that disconnects closes the upstream stream (the sequence stops within an
   iteration) and is billed for what was generated. The slot is released on every path. An upstream that
   refuses the connection (it never saw the request) is taken out, and the request goes back to the queue
   for another upstream of its model, if one is up, under the same reservation (``CONNECT_ATTEMPTS``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request, Security
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPBearer
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from fairgate.core.policies.factory import TenantShare, make_policy
from fairgate.core.request import Request as CoreRequest
from fairgate.emulator.api import CHAT_MESSAGE_OVERHEAD_TOKENS, ChatRequest, CompletionRequest, count_tokens
from fairgate.gateway.auth import DelegationError, KeyRing, verify_on_behalf_of
from fairgate.gateway.config import GatewayConfig
from fairgate.gateway.dispatch import Dispatcher, Lease, NoUpstream, QueueFull, Upstream
from fairgate.gateway.errors import GatewayError
from fairgate.gateway.errors import error_response as _error_response
from fairgate.gateway.headers import quota_headers, rate_limit_headers
from fairgate.gateway.observe import (
    Admitted,
    Charged,
    Dispatched,
    Fanout,
    Finished,
    Observer,
    Rejected,
    reason_for_dimension,
)
from fairgate.gateway.sharing import ChargeSync
from fairgate.gateway.upstream import CallState, UpstreamClient, UpstreamError
from fairgate.ledger import (
    IdempotencyConflict,
    Ledger,
    LedgerError,
    LedgerUnavailable,
    QuotaExceeded,
    Reservation,
    ReservationFinal,
    UnknownTenant,
    Usage,
)
from fairgate.ledger.base import tenant_tag
from fairgate.ledger.emergency import EMERGENCY_PREFIX, ResilientLedger
from fairgate.ledger.rules import Account

log = logging.getLogger("fairgate.gateway")
ON_BEHALF_OF_HEADER = "x-fairgate-on-behalf-of"
# Body fields that steer the upstream's own scheduling, identity or caches (vLLM's ``priority`` would let a
# client jump the replica's queue past fair dispatch; ``user`` names a tenant): dropped from what a client
# sends; the gateway sets ``cache_salt`` itself.
UPSTREAM_CONTROL_FIELDS = ("user", "priority", "request_id", "cache_salt", "kv_transfer_params", "vllm_xargs")
RUN_ID_HEADER = "x-fairgate-run-id"  # an agent run's id: its calls count against the run limits
TOOL_ROUND_HEADER = "x-fairgate-tool-round"
PARTIAL_SETTLE_EVERY_S = 2.0
# OpenAPI only: declares the bearer key (auto_error=False: ``authenticate`` does the checking).
_API_KEY = HTTPBearer(auto_error=False, scheme_name="apiKey", description="Authorization: Bearer <tenant key>")


def create_gateway(config: GatewayConfig, ledger: Ledger | None = None, observers: Iterable[Observer] = ()) -> FastAPI:
    """The gateway's ASGI app for ``config``.

    Args:
        ledger: an open ledger to use (the caller closes it); default: open ``[gateway].ledger`` when the
            app starts (on its own event loop) and close it when it stops.
        observers: receive every request's events (``fairgate.gateway.observe``); more can be added to
            ``app.state.events`` (a ``Fanout``) before the app starts.
    """
    events = Fanout(observers)
    keys = KeyRing.from_config(config)
    admin_keys = KeyRing(("admin", stored) for stored in config.admin.key_hashes)
    front: ResilientLedger = None  # type: ignore[assignment]  # set when the app starts
    shares = {name: TenantShare(t.weight, t.priority) for name, t in config.quotas.tenants.items()}
    upstreams = [Upstream(u.name, u.model, u.url, u.max_batch, u.cost) for u in config.upstreams]
    by_name = {u.name: u for u in config.upstreams}
    spec = config.policy_spec()

    def max_queued(tenant: str) -> int | None:
        try:
            return config.quotas.tenant(tenant).limits.max_queued
        except KeyError:
            return 0

    def booked(model: str, tenant: str, gpu_ms: float) -> None:
        events.observe(Charged(tenant, model, gpu_ms, time.time()))

    dispatcher = Dispatcher(
        lambda: make_policy(spec, upstreams[0].cost, shares),
        upstreams,
        lambda: time.monotonic() * 1000.0,
        max_queued,
        on_charge=booked,
    )
    clients: dict[str, UpstreamClient] = {}
    # (tenant, request id) -> reservation id, for the requests this process serves (queued or running).
    in_flight: dict[tuple[str, str], str] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        nonlocal front
        from fairgate.ledger import connect

        opened = ledger if ledger is not None else await connect(config.ledger_url, config.quotas)
        front = ResilientLedger(opened, config.journal_path)
        app.state.ledger = front
        for upstream in upstreams:
            model = upstream.model
            clients[upstream.name] = UpstreamClient(
                upstream,
                lambda tenant, ms, tokens, batch, model=model: dispatcher.charge(model, tenant, ms, tokens, batch),
                timeout_s=config.gateway.request_timeout_s,
                on_down=dispatcher.mark_down,
            )
        longest_ttl_s = max(
            (
                limits.reservation_ttl_s
                for quota in config.quotas.tenants.values()
                for limits in (quota.limits, *quota.by_model_class.values())
            ),
            default=0.0,
        )
        tasks = [
            asyncio.ensure_future(_sweep(front, in_flight, config.gateway.sweep_s, longest_ttl_s)),
            asyncio.ensure_future(_probe(dispatcher, clients)),
            asyncio.ensure_future(_recover(front)),
        ]
        if config.gateway.share_charges_s > 0:
            tasks.append(
                asyncio.ensure_future(ChargeSync(opened, dispatcher, config.gateway.share_charges_s, clients).run())
            )
        yield
        for task in tasks:
            task.cancel()
        for client in clients.values():
            await client.close()
        if ledger is None:
            await opened.close()

    app = FastAPI(title="fairgate gateway", lifespan=lifespan)
    app.state.dispatcher = dispatcher
    app.state.events = events
    app.state.clients = clients
    app.state.config = config
    app.state.slo_ttft_p99_target_ms = config.gateway.slo_ttft_p99_s * 1000.0

    def authenticate(request: Request) -> tuple[str, str | None]:
        """(tenant billed, delegate acting for it). Raises ``GatewayError`` 401/403."""
        if len(request.headers.getlist("authorization")) > 1:
            raise GatewayError(
                400, "Send one Authorization header.", "invalid_api_key", "authorization", kind="authentication_error"
            )
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise GatewayError(
                401,
                "Missing API key: send Authorization: Bearer <key>.",
                "invalid_api_key",
                kind="authentication_error",
            )
        caller = keys.tenant_for(key.strip())
        if caller is None:
            raise GatewayError(401, "Invalid API key.", "invalid_api_key", kind="authentication_error")
        if len(request.headers.getlist(ON_BEHALF_OF_HEADER)) > 1:
            raise GatewayError(
                400,
                "Send one X-Fairgate-On-Behalf-Of header.",
                "invalid_delegation",
                ON_BEHALF_OF_HEADER,
                caller=caller,
            )
        token = request.headers.get(ON_BEHALF_OF_HEADER)
        if token is None:
            return caller, None
        if caller not in config.delegation.delegates:
            raise GatewayError(
                403,
                f"Tenant {caller!r} may not act on behalf of others.",
                "delegation_not_allowed",
                kind="permission_error",
                caller=caller,
            )
        secret = config.delegation_secret()
        if secret is None:
            raise GatewayError(
                403,
                "Delegation is not configured on this gateway.",
                "delegation_not_allowed",
                kind="permission_error",
                caller=caller,
            )
        try:
            tenant = verify_on_behalf_of(secret, token, caller, time.time())
        except DelegationError as exc:
            raise GatewayError(
                403, f"On-behalf-of token rejected: {exc}", "invalid_delegation", kind="permission_error", caller=caller
            ) from None
        if tenant not in config.quotas.tenants:
            raise GatewayError(
                403,
                "The on-behalf-of token names an unknown tenant.",
                "invalid_delegation",
                kind="permission_error",
                caller=caller,
            )
        return tenant, caller

    def authenticate_admin(request: Request) -> None:
        """Accept only an ``[admin]`` key. Raises ``GatewayError`` 401 (no/unknown key) or 403 (a tenant's key)."""
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise GatewayError(
                401,
                "Missing API key: send Authorization: Bearer <admin key>.",
                "invalid_api_key",
                kind="authentication_error",
            )
        if admin_keys.tenant_for(key.strip()) == "admin":
            return
        if keys.tenant_for(key.strip()) is not None:
            raise GatewayError(403, "This endpoint needs an admin key.", "admin_only", kind="permission_error")
        raise GatewayError(401, "Invalid API key.", "invalid_api_key", kind="authentication_error")

    def is_admin(request: Request) -> bool:
        try:
            authenticate_admin(request)
        except GatewayError:
            return False
        return True

    app.state.authenticate = authenticate
    app.state.authenticate_admin = authenticate_admin
    app.state.is_admin = is_admin

    async def read_body(request: Request, chat: bool) -> ChatRequest | CompletionRequest:
        declared = request.headers.get("content-length")
        limit = config.gateway.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise GatewayError(413, f"Request body is {declared} bytes; the limit is {limit}.", "body_too_large")
        raw = b""
        async for piece in request.stream():
            raw += piece
            if len(raw) > limit:
                raise GatewayError(413, f"Request body exceeds {limit} bytes.", "body_too_large")
        try:
            data = json.loads(raw, parse_constant=_reject_constant, object_pairs_hook=_object_once)
        except _DuplicateKey as exc:
            raise GatewayError(
                400, f"{exc.key}: given twice in one object (which one was meant?).", "invalid_json", exc.key
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError):
            raise GatewayError(
                400, "The body is not valid JSON (NaN, Infinity and deep nesting are refused).", "invalid_json"
            ) from None
        if not isinstance(data, dict):
            raise GatewayError(400, "The body must be a JSON object.", "invalid_json")
        problem = _unsendable(data)
        if problem is not None:
            raise GatewayError(400, f"{problem[0] or 'body'}: {problem[1]}", "invalid_request", problem[0] or None)
        try:
            return (ChatRequest if chat else CompletionRequest).model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first["loc"] if not _is_type_tag(p)) or None
            message = first["msg"].removeprefix("Value error, ")
            named = re.match(r"([a-z_]+): (.*)", message) if param is None else None
            if named:  # a check across fields names the one at fault first ("top_logprobs: needs logprobs")
                param, message = named.group(1), named.group(2)
            raise GatewayError(400, f"{param or 'body'}: {message}", "invalid_request", param) from None

    def one_header(request: Request, name: str) -> str | None:
        """The header ``name``, given at most once. Raises ``GatewayError`` 400 naming it."""
        values = request.headers.getlist(name)
        if len(values) > 1:
            raise GatewayError(400, f"{name} given {len(values)} times; send it once.", "invalid_request", name)
        return values[0] if values else None

    def request_id_of(request: Request) -> str:
        request_id, key = one_header(request, "x-request-id"), one_header(request, "idempotency-key")
        if request_id is not None and key is not None and request_id != key:
            raise GatewayError(
                400,
                "X-Request-Id and Idempotency-Key differ; send one (or the same value).",
                "invalid_request_id",
                "x-request-id",
            )
        given = request_id if request_id is not None else key
        if given is None:
            return f"req-{uuid.uuid4().hex}"
        if not _printable_id(given):
            raise GatewayError(
                400,
                "X-Request-Id / Idempotency-Key must be 1-200 printable ASCII characters.",
                "invalid_request_id",
                "x-request-id" if request_id is not None else "idempotency-key",
            )
        return given

    async def rate_headers(tenant: str, model: str, balances: asyncio.Future[Account] | None) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers: limits from the config, what remains from the ledger's balances
        (read beside the dispatch; omitted if that read failed or is slow)."""
        try:
            limits = config.quotas.tenant(tenant).for_model_class(model)
        except KeyError:
            return {}
        account = None
        if balances is not None:
            try:
                account = await asyncio.wait_for(asyncio.shield(balances), timeout=0.25)
            except (TimeoutError, LedgerError, Exception):
                account = None
        return rate_limit_headers(limits, account, time.time() * 1000.0)

    async def handle(request: Request, chat: bool) -> Any:
        request_id = f"req-{uuid.uuid4().hex}"
        tenant: str | None = None
        delegate: str | None = None
        model: str | None = None
        try:
            request_id = request_id_of(request)
            tenant, delegate = authenticate(request)
            body = await read_body(request, chat)
            model = body.model[:200]
            run = run_of(request)
            return await serve(request, body, chat, tenant, delegate, request_id, run)
        except GatewayError as error:
            events.observe(
                Rejected(
                    request_id,
                    tenant or error.caller,
                    model,
                    error.reason,
                    error.status,
                    error.message,
                    time.time(),
                    error.dimension,
                    error.after_admission,
                    error.retry_after_s,
                    error.code,
                    delegate,
                )
            )
            return _error_response(error, request_id)

    def run_of(request: Request) -> tuple[str | None, bool]:
        """The agent run this call belongs to (``x-fairgate-run-id``) and whether it is a tool round
        (``x-fairgate-tool-round: 1``): the client names its own run; the run limits only restrict it."""
        run_id = one_header(request, RUN_ID_HEADER)
        if run_id is not None and not _printable_id(run_id):
            raise GatewayError(
                400, f"{RUN_ID_HEADER} must be 1-200 printable ASCII characters.", "invalid_run_id", RUN_ID_HEADER
            )
        flag = (one_header(request, TOOL_ROUND_HEADER) or "0").strip().lower()
        if flag not in ("0", "1", "true", "false"):
            raise GatewayError(
                400, f"{TOOL_ROUND_HEADER} must be 0 or 1 (or false / true).", "invalid_tool_round", TOOL_ROUND_HEADER
            )
        if flag in ("1", "true") and run_id is None:
            raise GatewayError(
                400, f"{TOOL_ROUND_HEADER} needs {RUN_ID_HEADER}.", "invalid_tool_round", TOOL_ROUND_HEADER
            )
        return run_id, flag in ("1", "true")

    async def serve(
        request: Request,
        body: ChatRequest | CompletionRequest,
        chat: bool,
        tenant: str,
        delegate: str | None,
        request_id: str,
        run: tuple[str | None, bool],
    ) -> Any:
        serving = config.upstreams_for(body.model)
        if not serving:
            raise GatewayError(404, f"The model {body.model[:100]!r} does not exist.", "model_not_found", "model")
        context = min(u.max_model_len for u in serving)
        if chat:
            assert isinstance(body, ChatRequest)
            prompt_tokens = sum(estimate_tokens(m.text()) + CHAT_MESSAGE_OVERHEAD_TOKENS for m in body.messages)
            # What else the model reads as prompt: tool definitions, tool calls, names, a response schema.
            prompt_tokens += estimate_tokens(_prompt_extras(body))
        else:
            assert isinstance(body, CompletionRequest)
            text = body.prompt_text()
            prompt_tokens = estimate_tokens(text) if text is not None else len(body.prompt_token_ids())
        if prompt_tokens >= context:
            raise GatewayError(
                413,
                f"The prompt has {prompt_tokens} tokens; the model's context is {context}.",
                "context_length_exceeded",
                "messages" if chat else "prompt",
            )
        max_tokens = body.token_cap() or min(config.gateway.default_max_tokens, context - prompt_tokens)
        if prompt_tokens + max_tokens > context:
            raise GatewayError(
                400,
                f"max_tokens {max_tokens} plus the prompt's {prompt_tokens} tokens exceed the context of {context}.",
                "context_length_exceeded",
                "max_tokens",
            )
        cost = serving[0].cost
        estimate = cost.prefill_ms(prompt_tokens) + max_tokens * cost.decode_charge_ms(cost.max_batch)
        try:
            reservation = await front.reserve(
                tenant, request_id, prompt_tokens, max_tokens, estimate, body.model, run[0], run[1]
            )
        except QuotaExceeded as exc:
            raise GatewayError(
                429,
                f"Quota {exc.dimension} exceeded for this tenant.",
                "insufficient_quota" if exc.retry_after_s is None else "rate_limit_exceeded",
                kind="rate_limit_error",
                retry_after_s=exc.retry_after_s,
                reason=reason_for_dimension(exc.dimension),
                dimension=exc.dimension,
                headers=quota_headers(exc),
            ) from None
        except IdempotencyConflict:
            raise GatewayError(
                409, "This request id was used before with a different request.", "idempotency_conflict", "x-request-id"
            ) from None
        except LedgerUnavailable:
            raise GatewayError(
                503,
                "Accounting is unavailable; retry later.",
                "ledger_unavailable",
                kind="server_error",
                retry_after_s=5.0,
                reason="ledger_down",
            ) from None
        except UnknownTenant:
            raise GatewayError(
                403, "This tenant has no quota configuration.", "tenant_not_configured", kind="permission_error"
            ) from None
        if reservation.is_final:
            raise GatewayError(
                409,
                f"Request {request_id!r} has completed already ({reservation.status}); it is not run or charged again.",
                "request_already_completed",
                "x-request-id",
            )
        await mark_readmitted(front, reservation, time.time() * 1000.0)
        if (tenant, request_id) in in_flight:
            raise GatewayError(
                409,
                f"Request {request_id!r} is being served already; it is not run twice.",
                "request_in_progress",
                "x-request-id",
            )
        in_flight[(tenant, request_id)] = reservation.id
        events.observe(
            Admitted(
                request_id,
                tenant,
                delegate,
                body.model,
                reservation.id,
                prompt_tokens,
                max_tokens,
                estimate,
                time.time(),
            )
        )
        balances: asyncio.Future[Account] | None = None
        if not reservation.id.startswith(EMERGENCY_PREFIX):
            balances = asyncio.ensure_future(front.ledger.account(tenant, body.model))
        try:
            return await dispatch_and_relay(
                request, body, chat, tenant, delegate, request_id, reservation, prompt_tokens, max_tokens, balances
            )
        except BaseException:
            in_flight.pop((tenant, request_id), None)
            raise

    async def dispatch_and_relay(
        request: Request,
        body: ChatRequest | CompletionRequest,
        chat: bool,
        tenant: str,
        delegate: str | None,
        request_id: str,
        reservation: Reservation,
        prompt_tokens: int,
        max_tokens: int,
        balances: asyncio.Future[Account] | None,
    ) -> Any:
        done = lambda: in_flight.pop((tenant, request_id), None)
        for attempt in range(1, CONNECT_ATTEMPTS + 1):
            try:
                return await dispatch_once(
                    request,
                    body,
                    chat,
                    tenant,
                    request_id,
                    reservation,
                    prompt_tokens,
                    max_tokens,
                    balances,
                    done,
                    attempt < CONNECT_ATTEMPTS,
                )
            except _TryAnotherUpstream:
                continue  # its upstream refused the connection and is out: back to the queue for another
        raise AssertionError("unreachable: the last attempt does not ask for another")  # pragma: no cover

    async def dispatch_once(
        request: Request,
        body: ChatRequest | CompletionRequest,
        chat: bool,
        tenant: str,
        request_id: str,
        reservation: Reservation,
        prompt_tokens: int,
        max_tokens: int,
        balances: asyncio.Future[Account] | None,
        done: Any,
        may_retry: bool,
    ) -> Any:
        """Queue, dispatch and relay once. Raises ``_TryAnotherUpstream`` (``may_retry`` only) when the upstream
        refused the connection before anything was relayed and another upstream of the model is up: the slot
        is released, the reservation is left open for the next attempt."""
        core_request = CoreRequest(_sequence(), tenant, prompt_tokens, time.monotonic() * 1000.0, max_tokens)
        queued_at = time.monotonic()
        waited = False

        async def take_queue_place() -> None:
            nonlocal waited
            waited = True
            await front.enqueue(reservation.id)  # the tenant's queue bound, global across processes

        waiting = asyncio.ensure_future(dispatcher.acquire(core_request, body.model, take_queue_place))
        # A client gone while its request is queued: it leaves the queue (checked every 0.25 s).
        watcher = asyncio.ensure_future(_watch_disconnect(request, waiting, 0.25))
        try:
            lease = await waiting
        except asyncio.CancelledError:
            with anyio.CancelScope(shield=True):
                await _release_reservation(reservation, Usage())  # it never ran: nothing is billed
            if watcher.done() and not watcher.cancelled():  # the watcher ended the wait: the client left
                done()
                return JSONResponse(
                    {
                        "error": {
                            "message": "client closed the request while it was queued",
                            "type": "invalid_request_error",
                            "param": None,
                            "code": "client_closed",
                        }
                    },
                    status_code=499,
                )
            raise
        except QuotaExceeded as exc:
            await _release_reservation(reservation, Usage())
            raise GatewayError(
                429,
                f"Too many requests queued for this tenant ({exc.limit:g}, all gateway processes).",
                "queue_full",
                kind="rate_limit_error",
                retry_after_s=exc.retry_after_s,
                reason="queue_full",
                dimension=exc.dimension,
                after_admission=True,
                headers=quota_headers(exc),
            ) from None
        except QueueFull as exc:
            await _release_reservation(reservation, Usage())
            error = GatewayError(
                429,
                f"Too many requests queued for this tenant ({exc.limit}).",
                "queue_full",
                kind="rate_limit_error",
                retry_after_s=2.0,
                reason="queue_full",
                after_admission=True,
            )
            raise error from None
        except NoUpstream:
            await _release_reservation(reservation, Usage())
            error = GatewayError(
                503,
                f"No upstream is available for {body.model!r}.",
                "no_upstream",
                kind="server_error",
                retry_after_s=5.0,
                reason="no_upstream",
                after_admission=True,
            )
            raise error from None
        finally:
            watcher.cancel()
        client = clients[lease.upstream.name]
        if waited:  # give the queue place back, off the request path (if lost, the final settlement does)
            _background(front.dequeue(reservation.id))
        queue_ms = (time.monotonic() - queued_at) * 1000.0
        events.observe(Dispatched(request_id, tenant, body.model, lease.upstream.name, queue_ms, time.time()))
        call = CallState(f"{request_id}#{uuid.uuid4().hex[:8]}", tenant, prompt_tokens)
        call.queue_ms = queue_ms
        call.model, call.upstream = body.model, lease.upstream.name
        upstream_body = body.model_dump(exclude_none=True)
        upstream_body["max_tokens"] = max_tokens
        upstream_body.pop("max_completion_tokens", None)
        for name in UPSTREAM_CONTROL_FIELDS:  # the gateway's to set, never a client's
            upstream_body.pop(name, None)
        upstream_body["cache_salt"] = tenant_tag(tenant)  # per-tenant prefix-cache isolation (vLLM)
        path = "/chat/completions" if chat else "/completions"
        headers = {"x-request-id": request_id, **await rate_headers(tenant, body.model, balances)}
        stream = client.stream(path, upstream_body, call, lease.prefill_estimate_ms)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            relay = _relay(stream, call, reservation, lease, include_usage, done, may_retry)
            # Start the relay before answering: an upstream that fails at once gets an HTTP error status, and
            # the relay's clean-up (slot, settlement) is armed even if the client leaves before the body
            # starts (asyncio finalizes a started generator; one never started would hold its slot forever).
            first = await relay.__anext__()
            return _RelayedStream(first, relay, headers)
        collect = asyncio.ensure_future(
            _collect(stream, call, reservation, lease, chat, body.model, headers, done, may_retry)
        )
        watcher = asyncio.ensure_future(_watch_disconnect(request, collect))
        try:
            return await collect
        except asyncio.CancelledError:
            if watcher.done():  # the client went away: nobody is left to answer
                return JSONResponse(
                    {
                        "error": {
                            "message": "client closed the request",
                            "type": "invalid_request_error",
                            "param": None,
                            "code": "client_closed",
                        }
                    },
                    status_code=499,
                )
            raise
        finally:
            watcher.cancel()

    async def _release_reservation(reservation: Reservation, consumed: Usage) -> None:
        try:
            await front.cancel(reservation.id, consumed)
        except (ReservationFinal, LedgerError):
            log.warning(json.dumps({"event": "release_failed", "reservation": reservation.id}))

    async def _settle(call: CallState, reservation: Reservation, final: bool, cancelled: bool) -> None:
        usage = call.usage or {}
        input_tokens = int(usage.get("prompt_tokens", call.prompt_tokens))
        output_tokens = min(int(usage.get("completion_tokens", call.output_tokens)), reservation.max_output_tokens)
        gpu_ms = min(call.gpu_ms, 86_400_000.0)
        if final:
            events.observe(
                _finished(
                    call, reservation, "cancelled" if cancelled else "completed", input_tokens, output_tokens, gpu_ms
                )
            )
        try:
            if cancelled:
                await front.cancel(reservation.id, Usage(input_tokens, output_tokens, gpu_ms))
            else:
                await front.settle(reservation.id, input_tokens, output_tokens, gpu_ms, final)
        except (ReservationFinal, LedgerError) as exc:
            log.warning(json.dumps({"event": "settle_failed", "reservation": reservation.id, "error": str(exc)}))

    def _another_upstream(lease: Lease, exc: UpstreamError, may_retry: bool) -> bool:
        """Send the request to another upstream? Only if this one never saw it and another one is up."""
        return (
            may_retry
            and exc.unreachable
            and any(
                u.healthy for u in dispatcher.upstreams() if u.model == lease.upstream.model and u is not lease.upstream
            )
        )

    async def _end_call(
        stream: AsyncIterator[dict[str, Any]],
        call: CallState,
        reservation: Reservation,
        lease: Lease,
        done: Any,
        finished: bool,
        retrying: bool,
    ) -> None:
        """A call's clean-up on every path: close the upstream stream, free the slot, settle the reservation
        (final) and forget the request - unless it goes on, under the same reservation, on another upstream.
        The client may be gone and this task cancelled: the clean-up still runs to the end."""
        with anyio.CancelScope(shield=True):
            try:
                await stream.aclose()  # type: ignore[attr-defined]
                dispatcher.release(lease, call.output_tokens)
            finally:  # whatever went wrong above, the request is settled and forgotten
                if not retrying:
                    await _settle(call, reservation, final=True, cancelled=not finished)
                    done()

    async def _relay(
        stream: AsyncIterator[dict[str, Any]],
        call: CallState,
        reservation: Reservation,
        lease: Lease,
        include_usage: bool,
        done: Any,
        may_retry: bool,
    ) -> AsyncIterator[str]:
        finished = sent = closed = retrying = False
        last_settle = time.monotonic()

        async def close() -> None:
            nonlocal closed
            if closed:
                return
            closed = True
            await _end_call(stream, call, reservation, lease, done, finished, retrying)

        try:
            async for chunk in stream:
                if not chunk.get("choices") and chunk.get("usage") and not include_usage:
                    continue  # the gateway asked for usage; this client did not
                if not include_usage:
                    chunk.pop("usage", None)
                yield f"data: {json.dumps(chunk)}\n\n"
                sent = True
                if time.monotonic() - last_settle > PARTIAL_SETTLE_EVERY_S:
                    last_settle = time.monotonic()
                    await _settle(call, reservation, final=False, cancelled=False)
            finished = True
            await close()  # settled before the client reads [DONE]: its usage is in the ledger by then
            yield "data: [DONE]\n\n"
        except UpstreamError as exc:
            call.failed = True
            if not sent and _another_upstream(lease, exc, may_retry):
                retrying = True
                raise _TryAnotherUpstream() from None
            if not sent:  # nothing relayed yet: the client gets a plain HTTP error
                raise GatewayError(exc.status, str(exc), "upstream_error", kind="server_error") from None
            error = {"error": {"message": str(exc), "type": "server_error", "param": None, "code": "upstream_error"}}
            yield f"data: {json.dumps(error)}\n\n"
        finally:
            await close()

    async def _collect(
        stream: AsyncIterator[dict[str, Any]],
        call: CallState,
        reservation: Reservation,
        lease: Lease,
        chat: bool,
        model: str,
        headers: dict[str, str],
        done: Any,
        may_retry: bool,
    ) -> Any:
        finished = retrying = False
        try:
            async for _ in stream:
                pass
            finished = True
        except UpstreamError as exc:
            call.failed = True
            if not call.output_tokens and _another_upstream(lease, exc, may_retry):
                retrying = True
                raise _TryAnotherUpstream() from None
            raise GatewayError(exc.status, str(exc), "upstream_error", kind="server_error") from None
        finally:
            await _end_call(stream, call, reservation, lease, done, finished, retrying)
        text = "".join(call.text)
        usage = call.usage or {
            "prompt_tokens": call.prompt_tokens,
            "completion_tokens": call.output_tokens,
            "total_tokens": call.prompt_tokens + call.output_tokens,
        }
        finish = call.finish_reason or "stop"
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": None}
            if chat
            else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        )
        document = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": usage,
        }
        return JSONResponse(document, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error_response(GatewayError(exc.status_code, str(exc.detail), code), f"req-{uuid.uuid4().hex}")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = request.headers.get("x-request-id", f"req-{uuid.uuid4().hex}")[:200]
        log.exception("unexpected error serving %s", request_id)
        return _error_response(
            GatewayError(
                500,
                "Internal error; the request was not billed beyond what ran.",
                "internal_error",
                kind="server_error",
            ),
            request_id,
        )

    @app.post(
        "/v1/chat/completions",
        dependencies=[Security(_API_KEY)],
        openapi_extra={"requestBody": _body_schema(ChatRequest)},
    )
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    @app.post(
        "/v1/completions",
        dependencies=[Security(_API_KEY)],
        openapi_extra={"requestBody": _body_schema(CompletionRequest)},
    )
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.get("/v1/models", dependencies=[Security(_API_KEY)])
    async def models(request: Request) -> Any:
        try:
            authenticate(request)
        except GatewayError as error:
            return _error_response(error, f"req-{uuid.uuid4().hex}")
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "created": 0, "owned_by": "fairgate"} for m in dispatcher.models()],
        }

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    del by_name
    for install in _operator_views():
        install(app)
    return app


def _operator_views() -> list[Any]:
    """The operator's and tenants' views (issue 5), each adding its observer and routes to the app:
    each module's ``install(app)`` reads ``app.state`` (config, events, dispatcher, clients, ledger,
    authenticate, authenticate_admin)."""
    from fairgate.gateway import dashboard, eventlog, metrics, usage_api

    return [metrics.install, usage_api.install, eventlog.install, dashboard.install]


# Upstreams a request is sent to at most, when the ones before refused the connection (each is taken out).
CONNECT_ATTEMPTS = 3


class _TryAnotherUpstream(Exception):
    """The upstream refused the connection before anything was relayed; another one is up."""


_tasks: set[asyncio.Task[Any]] = set()


async def _sweep(
    front: ResilientLedger, in_flight: dict[tuple[str, str], str], interval_s: float, hold_after_outage_s: float = 0.0
) -> None:
    """The liveness check, every ``interval_s``: replay this process's emergency journal if it holds
    anything (so usage kept during an outage is billed before its reservation could expire), heartbeat the
    reservations of the requests this process serves (emergency grants under the id their replay made),
    then expire the open reservations nobody has heartbeat within their TTL (those of a process that died;
    billing what was settled so far). Every gateway process runs it; expiry is idempotent. A process that
    still holds journal records does not expire anything, and after a ledger outage no process expires
    anything for ``hold_after_outage_s`` (the longest reservation TTL): nobody could heartbeat during the
    outage, and every other process gets that long to replay its journal and heartbeat its requests before
    their reservations could be expired with their usage still in its journal."""
    loop = asyncio.get_running_loop()
    hold_until = 0.0
    outage = False
    while True:
        await asyncio.sleep(interval_s)
        try:
            expired = await sweep_once(front, list(in_flight.values()), expire=loop.time() >= hold_until)
            if outage:
                outage, hold_until = False, loop.time() + hold_after_outage_s
            if expired:
                log.warning("expired %d reservations nobody was running", len(expired))
        except LedgerError as exc:
            outage = True
            hold_until = math.inf  # until a sweep goes through again
            log.warning("liveness sweep skipped: %s", exc)


async def sweep_once(front: ResilientLedger, running: Iterable[str], expire: bool = True) -> list[Reservation]:
    """One liveness sweep (see ``_sweep``): ``running`` are the reservation ids of this process's requests;
    ``expire=False`` replays and heartbeats only. Returns the reservations expired. Raises ``LedgerError``."""
    if front.outstanding():
        await front.recover()
    for reservation_id in running:
        live = front.live_id(reservation_id)
        if live is not None:
            await front.ledger.heartbeat(live)
    if front.outstanding() or not expire:
        return []  # usage not yet in the ledger: expiring now could drop it
    return await front.ledger.expire_due()


async def mark_readmitted(front: ResilientLedger, reservation: Reservation, now_ms: float) -> None:
    """A request admitted under an open reservation made more than a second ago (a client's retry of a
    request whose gateway process died, say) is marked running at once, before another process's liveness
    sweep could expire it while it runs."""
    if reservation.is_final or reservation.id.startswith(EMERGENCY_PREFIX) or now_ms - reservation.created_ms <= 1000.0:
        return
    try:
        await front.ledger.heartbeat(reservation.id)
    except LedgerError:
        pass


async def _recover(front: ResilientLedger, interval_s: float = 1.0) -> None:
    """Every ``interval_s`` while the emergency journal holds records (grants made or settlements kept
    while the ledger was down), replay it into the ledger once it answers (``ResilientLedger.recover``)."""
    while True:
        await asyncio.sleep(interval_s)
        if not front.outstanding():
            continue
        try:
            report = await front.recover()
        except LedgerError:
            continue  # still down: the journal is kept whole
        log.warning("emergency journal replayed into the ledger: %s", report)


async def _probe(dispatcher: Dispatcher, clients: dict[str, UpstreamClient], interval_s: float = 1.0) -> None:
    """Every ``interval_s``, ask each upstream marked down for its models; one that answers is back."""
    while True:
        await asyncio.sleep(interval_s)
        for upstream in dispatcher.upstreams():
            if upstream.healthy:
                continue
            try:
                reply = await clients[upstream.name].http.get("/models", timeout=2.0)
            except httpx.HTTPError:
                continue
            if reply.status_code == 200:
                log.warning("upstream %s is back", upstream.name)
                dispatcher.mark_up(upstream)


def _background(work: Any) -> None:
    """Run ``work`` (a coroutine) without waiting for it; errors are logged, the task is kept alive."""
    task = asyncio.ensure_future(work)
    _tasks.add(task)

    def finished(done: asyncio.Task[Any]) -> None:
        _tasks.discard(done)
        if not done.cancelled() and done.exception() is not None:
            log.warning("background ledger call failed: %s", done.exception())

    task.add_done_callback(finished)


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for piece in rest:
        yield piece


class _RelayedStream(StreamingResponse):
    """The SSE response of a relayed stream; when the response ends - sent, failed, or its client gone at
    any point - the relay is closed, which runs its clean-up (slot, settlement) at once rather than
    whenever the garbage collector finalizes it."""

    def __init__(self, first: str, relay: Any, headers: dict[str, str]) -> None:
        super().__init__(_prepend(first, relay), media_type="text/event-stream", headers=headers)
        self._relay = relay

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._relay.aclose()


def _finished(
    call: CallState, reservation: Reservation, outcome: str, input_tokens: int, output_tokens: int, gpu_ms: float
) -> Finished:
    ttft_ms = tpot_ms = None
    if call.first_token_s is not None:
        ttft_ms = (call.first_token_s - call.started_s) * 1000.0
        if output_tokens > 1 and call.last_token_s is not None:
            tpot_ms = (call.last_token_s - call.first_token_s) * 1000.0 / (output_tokens - 1)
    return Finished(
        reservation.request_id,
        call.tenant,
        call.model,
        call.upstream,
        "error" if call.failed else outcome,
        call.queue_ms,
        ttft_ms,
        tpot_ms,
        input_tokens,
        output_tokens,
        gpu_ms,
        reservation.gpu_ms_estimate,
        reservation.max_output_tokens,
        time.time(),
    )


def _body_schema(model: Any) -> dict[str, Any]:
    """OpenAPI ``requestBody`` for a route that parses ``model`` itself from a raw ``Request`` ($defs inlined)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, list):
            return [inline(item) for item in node]
        if not isinstance(node, dict):
            return node
        rest = {key: inline(value) for key, value in node.items() if key != "$ref"}
        ref = node.get("$ref")
        return {**inline(defs[ref.rsplit("/", 1)[-1]]), **rest} if isinstance(ref, str) else rest

    return {"required": True, "content": {"application/json": {"schema": inline(schema)}}}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _is_type_tag(part: object) -> bool:
    """pydantic's union-branch markers in an error location (``str``, ``list[ContentPart]``, ...)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


PROMPT_FIELDS = ("tools", "functions", "tool_choice", "response_format")  # a chat body's prompt besides messages


def _prompt_extras(body: ChatRequest) -> str:
    """The text a chat body gives the model besides its messages' content, as JSON (empty for plain
    messages): tool definitions, a response schema, and each message's other fields (tool calls, names)."""
    extra = {name: value for name in PROMPT_FIELDS if (value := getattr(body, name, None)) is not None}
    messages = [
        fields
        for m in body.messages  # its fields besides role and content: name, tool_calls, ...
        if (fields := {k: v for k, v in (m.model_extra or {}).items() if v is not None})
    ]
    if messages:
        extra["messages"] = messages
    return json.dumps(extra) if extra else ""


def _printable_id(value: str) -> bool:
    """A request or run id as a header carries it: 1-200 printable ASCII characters, not only spaces (raw
    bytes beyond ASCII arrive decoded as Latin-1, and would be stored garbled)."""
    return 0 < len(value) <= 200 and value.isascii() and value.isprintable() and bool(value.strip())


BYTES_PER_TOKEN_MAX = 8  # no tokenizer in use gives fewer tokens than one per 8 bytes of UTF-8 text


def estimate_tokens(text: str) -> int:
    """The gateway's prompt-token estimate (for admission: the context check, the reservation): the emulated
    replica's tokenizer (whitespace-separated words), but at least one token per ``BYTES_PER_TOKEN_MAX``
    bytes - BPE tokenizers give one per ~4 bytes of English - so text without spaces (found by a helper: a
    900 KB word reserved 1 token) is not admitted for almost nothing. The upstream's usage settles the
    exact count."""
    return max(count_tokens(text), math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN_MAX))


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _object_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' object hook: a key given twice is refused (RFC 8259 leaves its meaning open)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


MAX_JSON_DEPTH = 64  # nesting a request body may have (the upstream call re-encodes it; deeper ones recursed)


def _unsendable(value: Any, path: str = "", depth: int = 0) -> tuple[str, str] | None:
    """The first value that cannot be forwarded as JSON: a non-finite number, text that is not UTF-8, or
    nesting deeper than ``MAX_JSON_DEPTH``."""
    if depth > MAX_JSON_DEPTH:
        return path, f"nested deeper than {MAX_JSON_DEPTH} levels"
    if isinstance(value, float) and not math.isfinite(value):
        return path, "numbers must be finite"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path, "text must be valid UTF-8 (no lone surrogates)"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _unsendable(key, path) or _unsendable(item, f"{path}.{key}" if path else str(key), depth + 1)
            if found:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _unsendable(item, f"{path}.{index}", depth + 1)
            if found:
                return found
    return None


async def _watch_disconnect(request: Request, work: asyncio.Future[Any], interval_s: float = 0.05) -> None:
    """Cancel ``work`` when the client disconnects (checked every ``interval_s``)."""
    while not work.done():
        if await request.is_disconnected():
            work.cancel()
            return
        await asyncio.sleep(interval_s)


_counter = iter(range(1, 1 << 62))


def _sequence() -> int:
    """Increasing ids for the policy's tie-breaks (arrival order within this process)."""
    return next(_counter)

"""Every answer the gateway gives other than a result: one table from ``Outcome`` to HTTP.

Each stage of the request path raises a ``Rejection`` naming its ``Outcome``; ``ANSWERS`` says, for every
outcome, the HTTP status, the OpenAI error ``type`` and ``code``, the rejection reason recorded in metrics
(seed 003's quota vector: ``rate``, ``tokens``, ``concurrency``, ...), the suggested wait, and whether the
request had a reservation that was released. ``respond`` builds the client's answer from it: the OpenAI
error body (``fairgate.api.error_body``), ``x-request-id``, ``x-should-retry: false`` where the same
request would get the same answer (OpenAI's SDKs obey it), and ``Retry-After`` in whole seconds with up to
+25 % jitter, at most ``JITTER_MAX_S``, so rejected clients do not come back as one wave (seed 003) and a wait
for the next spend period (a month) is not made days longer. The shape follows llm-d's flow
control, which maps a typed ``QueueOutcome`` to HTTP in one place.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum, auto

from fastapi.responses import JSONResponse

from fairgate.api import error_body
from fairgate.gateway.observe import Rejected, reason_for_dimension

# Statuses at which a retry of the same request gets the same answer.
_FINAL_STATUSES = frozenset((400, 401, 403, 404, 409, 413, 429))
_BY_DIMENSION = "by_dimension"  # the reason of a quota outcome is the dimension's (``reason_for_dimension``)


JITTER_MAX_S = 60.0  # enough to spread a wave of clients; a long wait gains no more


class Outcome(StrEnum):
    """Why a request was not answered with its result (the rows of ``ANSWERS``)."""

    AUTH_HEADER_REPEATED = auto()
    API_KEY_MISSING = auto()
    API_KEY_INVALID = auto()
    API_KEY_EXPIRED = auto()
    ADMIN_ONLY = auto()
    DELEGATION_HEADER_REPEATED = auto()
    DELEGATION_NOT_ALLOWED = auto()
    DELEGATION_INVALID = auto()
    TENANT_MISMATCH = auto()
    TENANT_NOT_CONFIGURED = auto()
    INVALID_REQUEST = auto()
    INVALID_JSON = auto()
    INVALID_REQUEST_ID = auto()
    INVALID_RUN_ID = auto()
    INVALID_TOOL_ROUND = auto()
    INVALID_WINDOW = auto()
    BODY_TOO_LARGE = auto()
    ROUTE_NOT_FOUND = auto()
    METHOD_NOT_ALLOWED = auto()
    HTTP_ERROR = auto()
    MODEL_NOT_FOUND = auto()
    TENANT_NOT_FOUND = auto()
    PROMPT_TOO_LONG = auto()
    OUTPUT_TOO_LONG = auto()
    QUOTA_EXHAUSTED = auto()
    RATE_LIMITED = auto()
    QUEUE_FULL = auto()
    IDEMPOTENCY_CONFLICT = auto()
    REQUEST_ALREADY_COMPLETED = auto()
    REQUEST_IN_PROGRESS = auto()
    LEDGER_UNAVAILABLE = auto()
    NO_UPSTREAM = auto()
    UPSTREAM_ERROR = auto()
    UPSTREAM_CONTEXT_EXCEEDED = auto()
    UPSTREAM_REFUSED = auto()
    CLIENT_CLOSED = auto()
    INTERNAL_ERROR = auto()
    CONFIG_INVALID = auto()
    KEY_NOT_FOUND = auto()
    AUDIT_UNAVAILABLE = auto()


@dataclass(frozen=True)
class Answer:
    """How one outcome is answered.

    Attributes:
        status: HTTP status; for ``UPSTREAM_ERROR``, ``UPSTREAM_REFUSED`` and ``HTTP_ERROR`` the default when
            none is relayed.
        kind: OpenAI error ``type``.
        code: OpenAI error ``code``.
        reason: the rejection reason (``fairgate.gateway.observe.REJECT_REASONS``).
        retry_after_s: the wait suggested by default (None: waiting will not help).
        after_admission: the request held a reservation, released before answering.
        recorded: a ``Rejected`` event is emitted (not when the client is gone: nobody was answered).
    """

    status: int
    kind: str
    code: str
    reason: str
    retry_after_s: float | None = None
    after_admission: bool = False
    recorded: bool = True


_AUTH, _PERMISSION, _INVALID = "authentication_error", "permission_error", "invalid_request_error"
_RATE, _SERVER = "rate_limit_error", "server_error"

ANSWERS: Mapping[Outcome, Answer] = {
    Outcome.AUTH_HEADER_REPEATED: Answer(400, _AUTH, "invalid_api_key", "invalid"),
    Outcome.API_KEY_MISSING: Answer(401, _AUTH, "invalid_api_key", "auth"),
    Outcome.API_KEY_INVALID: Answer(401, _AUTH, "invalid_api_key", "auth"),
    Outcome.API_KEY_EXPIRED: Answer(401, _AUTH, "invalid_api_key", "auth"),
    Outcome.ADMIN_ONLY: Answer(403, _PERMISSION, "admin_only", "auth"),
    Outcome.DELEGATION_HEADER_REPEATED: Answer(400, _INVALID, "invalid_delegation", "invalid"),
    Outcome.DELEGATION_NOT_ALLOWED: Answer(403, _PERMISSION, "delegation_not_allowed", "auth"),
    Outcome.DELEGATION_INVALID: Answer(403, _PERMISSION, "invalid_delegation", "auth"),
    Outcome.TENANT_MISMATCH: Answer(403, _PERMISSION, "tenant_mismatch", "auth"),
    Outcome.TENANT_NOT_CONFIGURED: Answer(403, _PERMISSION, "tenant_not_configured", "auth"),
    Outcome.INVALID_REQUEST: Answer(400, _INVALID, "invalid_request", "invalid"),
    Outcome.INVALID_JSON: Answer(400, _INVALID, "invalid_json", "invalid"),
    Outcome.INVALID_REQUEST_ID: Answer(400, _INVALID, "invalid_request_id", "invalid"),
    Outcome.INVALID_RUN_ID: Answer(400, _INVALID, "invalid_run_id", "invalid"),
    Outcome.INVALID_TOOL_ROUND: Answer(400, _INVALID, "invalid_tool_round", "invalid"),
    Outcome.INVALID_WINDOW: Answer(400, _INVALID, "invalid_window", "invalid"),
    Outcome.BODY_TOO_LARGE: Answer(413, _INVALID, "body_too_large", "invalid"),
    Outcome.ROUTE_NOT_FOUND: Answer(404, _INVALID, "not_found", "invalid"),
    Outcome.METHOD_NOT_ALLOWED: Answer(405, _INVALID, "method_not_allowed", "invalid"),
    Outcome.HTTP_ERROR: Answer(400, _INVALID, "http_error", "invalid"),
    Outcome.MODEL_NOT_FOUND: Answer(404, _INVALID, "model_not_found", "invalid"),
    Outcome.TENANT_NOT_FOUND: Answer(404, _INVALID, "tenant_not_found", "invalid"),
    Outcome.PROMPT_TOO_LONG: Answer(413, _INVALID, "context_length_exceeded", "invalid"),
    Outcome.OUTPUT_TOO_LONG: Answer(400, _INVALID, "context_length_exceeded", "invalid"),
    Outcome.QUOTA_EXHAUSTED: Answer(429, _RATE, "insufficient_quota", _BY_DIMENSION),
    Outcome.RATE_LIMITED: Answer(429, _RATE, "rate_limit_exceeded", _BY_DIMENSION),
    Outcome.QUEUE_FULL: Answer(429, _RATE, "queue_full", "queue_full", after_admission=True),
    Outcome.IDEMPOTENCY_CONFLICT: Answer(409, _INVALID, "idempotency_conflict", "conflict"),
    Outcome.REQUEST_ALREADY_COMPLETED: Answer(409, _INVALID, "request_already_completed", "conflict"),
    Outcome.REQUEST_IN_PROGRESS: Answer(409, _INVALID, "request_in_progress", "conflict"),
    Outcome.LEDGER_UNAVAILABLE: Answer(503, _SERVER, "ledger_unavailable", "ledger_down", 5.0),
    Outcome.NO_UPSTREAM: Answer(503, _SERVER, "no_upstream", "no_upstream", 5.0, after_admission=True),
    Outcome.UPSTREAM_ERROR: Answer(502, _SERVER, "upstream_error", "upstream_error"),
    # The upstream counted the prompt over its context (the gateway's estimate fit): the client's to fix.
    Outcome.UPSTREAM_CONTEXT_EXCEEDED: Answer(400, _INVALID, "context_length_exceeded", "invalid"),
    # The upstream refused the request with its own OpenAI error (a 400 naming a field the gateway does not
    # check, such as an embedding's dimensions): the client's to fix, answered with the upstream's status,
    # type, param and code (``Rejection.relayed``); this code is the default and the one recorded.
    Outcome.UPSTREAM_REFUSED: Answer(400, _INVALID, "upstream_refused", "invalid"),
    Outcome.CLIENT_CLOSED: Answer(499, _INVALID, "client_closed", "invalid", recorded=False),
    Outcome.INTERNAL_ERROR: Answer(500, _SERVER, "internal_error", "upstream_error"),
    # A configuration an operator asked the gateway to reload is refused; the running one stays.
    Outcome.CONFIG_INVALID: Answer(400, _INVALID, "config_invalid", "invalid"),
    # An admin write names a key the configuration does not hold.
    Outcome.KEY_NOT_FOUND: Answer(404, _INVALID, "key_not_found", "invalid"),
    # A change that could not be recorded is not made (fairgate.gateway.audit).
    Outcome.AUDIT_UNAVAILABLE: Answer(503, _SERVER, "audit_log_unavailable", "upstream_error"),
}


_RELAYED = frozenset((Outcome.UPSTREAM_ERROR, Outcome.UPSTREAM_REFUSED, Outcome.HTTP_ERROR))


class Rejection(Exception):
    """A request answered with an error: its ``Outcome`` and what the answer says.

    Args:
        outcome: the row of ``ANSWERS``.
        message: for people; never holds a secret.
        param: the field, header or query parameter at fault.
        retry_after_s: the wait to suggest (default: the outcome's).
        dimension: the ledger's quota dimension, for quota outcomes.
        headers: extra response headers (the quota's ``x-ratelimit-*``).
        status: a status relayed: the upstream's own for ``UPSTREAM_ERROR`` and ``UPSTREAM_REFUSED`` (a 4xx
            it gave the request), Starlette's for ``HTTP_ERROR``.
        relayed: the ``type`` and ``code`` of the upstream's own OpenAI error, answered as they are
            (``UPSTREAM_REFUSED``; the code None when it gave none a client can read).
        tenant: the tenant the request is attributed to (for a refused delegation: the caller whose key
            made it), when known where it is raised; ``about`` fills it in later otherwise.
    """

    def __init__(
        self,
        outcome: Outcome,
        message: str,
        param: str | None = None,
        *,
        retry_after_s: float | None = None,
        dimension: str | None = None,
        headers: Mapping[str, str] | None = None,
        status: int | None = None,
        tenant: str | None = None,
        relayed: tuple[str, str | None] | None = None,
    ) -> None:
        super().__init__(message)
        assert status is None or outcome in _RELAYED, f"{outcome} has a fixed status"
        assert relayed is None or outcome is Outcome.UPSTREAM_REFUSED, f"{outcome} has its own type and code"
        self.outcome, self.message, self.param, self.dimension = outcome, message, param, dimension
        self.answer = ANSWERS[outcome]
        self.status = status if status is not None else self.answer.status
        self.retry_after_s = retry_after_s if retry_after_s is not None else self.answer.retry_after_s
        self.headers = dict(headers or {})
        self.relayed = relayed
        self.tenant: str | None = tenant
        self.delegate: str | None = None
        self.model: str | None = None
        self.key_id: str | None = None  # the key the refused request came with (``identity.Caller.key_id``)

    @property
    def reason(self) -> str:
        """The rejection reason recorded in metrics and the request log."""
        if self.answer.reason == _BY_DIMENSION:
            return reason_for_dimension(self.dimension or "")
        if self.outcome is Outcome.UPSTREAM_ERROR and self.status < 500:
            return "invalid"  # the upstream refused the request itself (a 4xx it gave, relayed)
        return self.answer.reason

    def about(
        self, tenant: str | None, delegate: str | None, model: str | None, key_id: str | None = None
    ) -> Rejection:
        """Attribute the rejection to a request's tenant, delegate, model and key (those not set already)."""
        self.tenant = self.tenant or tenant
        self.delegate = self.delegate or delegate
        self.model = self.model or model
        self.key_id = self.key_id or key_id
        return self

    def event(self, request_id: str, time_s: float) -> Rejected:
        """The ``Rejected`` event of this answer."""
        return Rejected(
            request_id,
            self.tenant,
            self.model,
            self.reason,
            self.status,
            self.message,
            time_s,
            self.dimension,
            self.answer.after_admission,
            self.retry_after_s,
            self.answer.code,
            self.delegate,
            self.key_id,
        )


def respond(rejection: Rejection, request_id: str, rng: random.Random) -> JSONResponse:
    """The client's answer to ``rejection`` (see module docstring); ``rng`` draws the jitter."""
    answer = rejection.answer
    headers = {"x-request-id": request_id, **rejection.headers}
    if rejection.status in _FINAL_STATUSES and rejection.retry_after_s is None:
        headers["x-should-retry"] = "false"  # a retry would get the same answer (one with a wait may not)
    if rejection.retry_after_s is not None:
        wait_s = rejection.retry_after_s
        headers["retry-after"] = str(max(1, math.ceil(wait_s + min(0.25 * wait_s, JITTER_MAX_S) * rng.random())))
    kind, code = rejection.relayed or (answer.kind, answer.code)
    body = error_body(rejection.message, kind, rejection.param, code)
    return JSONResponse(status_code=rejection.status, content=body, headers=headers)

"""Checks of the arguments callers pass to a ledger, the same on every backend. Each raises ``InvalidUsage``."""

from __future__ import annotations

from fairgate.ledger.base import STATUSES
from fairgate.ledger.model import InvalidUsage, Usage, check_name
from fairgate.ledger.rules import check_amounts

MAX_WINDOW_S = 10 * 365 * 86_400  # ten years


def check_reserve_args(
    tenant: object, request_id: object, model_class: object, run_id: object, tool_round: object
) -> None:
    """Validate ``reserve``'s names and flags (amounts: ``rules.check_amounts``)."""
    check_name(tenant, "tenant")
    check_name(request_id, "request_id")
    check_name(model_class, "model_class")
    check_name(run_id, "run_id", optional=True)
    if not isinstance(tool_round, bool):
        raise InvalidUsage(f"tool_round must be true or false, got {tool_round!r:.80}")


def check_consumed(consumed: object, what: str = "cancel") -> Usage:
    """``cancel``'s ``consumed`` (or the usage of ``what``): a ``Usage`` of valid amounts, returned with
    ``gpu_ms`` as a float."""
    if not isinstance(consumed, Usage):
        raise InvalidUsage(f"{what}: consumed must be a Usage, got {consumed!r:.80}")
    check_amounts(consumed.input_tokens, consumed.output_tokens, consumed.gpu_ms, what)
    return Usage(consumed.input_tokens, consumed.output_tokens, float(consumed.gpu_ms))


def check_window(window_s: object) -> float:
    """``usage``'s window: a number of seconds in (0, 10 years], returned as a float."""
    if isinstance(window_s, bool) or not isinstance(window_s, int | float) or not 0 < window_s <= MAX_WINDOW_S:
        raise InvalidUsage(f"usage: window_s must be a number of seconds in (0, 10 years], got {window_s!r:.80}")
    return float(window_s)


def check_filters(tenant: object, status: object) -> None:
    """``reservations``' filters: an optional tenant name and an optional status of ``STATUSES``."""
    check_name(tenant, "tenant", optional=True)
    if status is not None and status not in STATUSES:
        raise InvalidUsage(f"status must be one of {', '.join(STATUSES)}, got {status!r:.80}")


def check_reservation_id(reservation_id: object) -> str:
    """A reservation id as a backend looks it up: a name as ``check_name`` takes one (an unknown one is not
    found, later). A NUL or a lone surrogate would fail in the database driver, not as the caller's error."""
    checked = check_name(reservation_id, "reservation_id")
    assert checked is not None
    return checked


def check_charges(scope: object, deltas: object) -> None:
    """``add_charges``' arguments: a scope name and tenant -> (GPU ms, prompt tokens, output tokens) of amounts
    a policy books (never negative: ``core.policies`` charge only what was spent), each within one call's
    bounds. Checked before anything is added, so a bad entry adds nothing."""
    check_name(scope, "scope")
    if not isinstance(deltas, dict):
        raise InvalidUsage(
            f"add_charges: deltas must be a dict of tenant -> (gpu_ms, input, output), got {deltas!r:.80}"
        )
    for tenant, delta in deltas.items():
        check_name(tenant, "tenant")
        if not isinstance(delta, tuple | list) or len(delta) != 3:
            raise InvalidUsage(f"add_charges: {tenant!r:.80}: (gpu_ms, input, output) expected, got {delta!r:.80}")
        check_amounts(delta[1], delta[2], delta[0], "add_charges")


def check_freeze(tenant: object, reason: object) -> None:
    """``freeze``'s arguments: a tenant name and a reason (text)."""
    check_name(tenant, "tenant")
    if not isinstance(reason, str):
        raise InvalidUsage(f"freeze: reason must be text, got {reason!r:.80}")


def check_account_args(tenant: object, model_class: object) -> None:
    """``account``'s arguments: a tenant name and a model class name."""
    check_name(tenant, "tenant")
    check_name(model_class, "model_class")


MAX_CLAIM_LEASE_MS = 86_400_000.0  # a day: a lease is a few sweep intervals


def check_claim_args(owner: object, lease_ms: object) -> None:
    """``claim``'s arguments: the owner's name and a lease in (0, a day] ms."""
    check_name(owner, "owner")
    if isinstance(lease_ms, bool) or not isinstance(lease_ms, int | float) or not 0 < lease_ms <= MAX_CLAIM_LEASE_MS:
        raise InvalidUsage(f"claim: lease_ms must be a number of ms in (0, 86400000], got {lease_ms!r:.80}")

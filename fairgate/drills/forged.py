"""Drill ``forged`` (seed 003, "confirm ... that no path can forge a tenant"): every header, body, query
and delegation trick we know is tried against a live gateway; none may bill, run or read anything as
another tenant.

The tenants: ``mallory`` (the attacker, an ordinary tenant), ``victim`` (sends nothing at all), ``client``
(a tenant the delegate legitimately acts for), and two delegates, ``batchsvc`` and ``othersvc``
(``[delegation] delegates``; the HMAC secret is a fresh random value in an environment variable named by
``secret_env``). The gateway also has an admin key.

Each attack is one request with its own ``X-Request-Id`` and an expected answer: its HTTP status (and error
code), and whom it may be billed to - the caller itself (a trick the gateway must ignore, e.g. ``user`` in
the body or an ``X-Tenant`` header: served, billed to the key's tenant), the tenant a valid on-behalf-of
token names (the controls), or nobody (refused: no reservation at all). Groups: ``body`` (``user``,
``tenant``, ``cache_salt`` and other fields), ``header`` (``X-Tenant``-like headers, ``OpenAI-Organization``,
forwarded identities, cookies), ``query`` (``?tenant=victim`` and friends), ``authorization`` (a second
``Authorization`` header, bearer scheme, whitespace and case tricks, another scheme, the victim's name as a
key), ``delegation`` (an on-behalf-of token from a non-delegate, signed with the wrong secret, expired,
issued to another delegate, replayed, tampered, malformed, naming an unknown tenant, two tokens), ``admin``
(the admin key on the completion paths), ``request id`` (the attacker reusing the client's request id,
while it runs and after), ``read`` (reading the victim's usage with the attacker's key).

The claim, checked in the ledger and on the replicas after the run:

- every attack answered as expected (status and code); no 5xx;
- the victim: no reservation, no event, zero usage (requests, tokens, GPU ms), and no GPU time charged
  under its cache scope on any replica (the emulator's ``charge_rule_ms_by_cache_salt``);
- every request served is billed to exactly the tenant expected (its reservation, found by request id),
  and every request refused has no reservation under any tenant;
- each tenant's usage is exactly what it legitimately sent: its request count and its output tokens equal
  the sums over the attacks expected to bill it;
- every request served reached the replica under the cache scope (``cache_salt``) of the tenant billed,
  and none under the victim's (the tap of the in-process replicas sees each request's body).

Found (reported, not part of the claim): the gateway forwards tenant-like body fields it does not use
(``tenant``, ``organization``, ``metadata``, an ``on_behalf_of`` token ...) to the replicas; it drops only
``user``, ``priority``, ``request_id``, ``cache_salt`` and vLLM's private fields. And of two
``X-Fairgate-On-Behalf-Of`` headers it uses the first, where two ``Authorization`` headers are refused.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fairgate.drills import CheckedResult, DrillOptions
from fairgate.drills.cancellation import ADMIN_KEY, DrillStack, open_ledger, open_stack, replica_stats
from fairgate.drills.loadgen import CHAT_OVERHEAD_TOKENS
from fairgate.drills.stack import ReplicaModel, StackSpec, TenantSpec
from fairgate.gateway.auth import make_on_behalf_of
from fairgate.gateway.identity import ON_BEHALF_OF_HEADER

ATTACKER, VICTIM, CLIENT, DELEGATE, OTHER_DELEGATE = "mallory", "victim", "client", "batchsvc", "othersvc"
SECRET_ENV = "FAIRGATE_DRILL_DELEGATION_SECRET"
NOBODY = "-"  # an attack that must be refused: billed to nobody


@dataclass(frozen=True)
class ForgedConfig:
    """The drill's setting.

    Attributes:
        max_tokens: each attack's output (small: the drill is about who pays, not how much).
        prompt_tokens: each prompt, as the emulator counts it (chat) or words (completions).
        replicas / replica: the emulated fleet.
    """

    max_tokens: int = 3
    prompt_tokens: int = 8
    replicas: int = 1
    replica: ReplicaModel = field(
        default_factory=lambda: ReplicaModel(
            iter_base_ms=10.0, iter_slope_ms=0.1, prefill_ms_per_token=0.01, max_batch=32, max_model_len=4096
        )
    )
    gateway_process: bool = False

    @property
    def tenants(self) -> tuple[str, ...]:
        return (ATTACKER, VICTIM, CLIENT, DELEGATE, OTHER_DELEGATE)

    def spec(self, policy: str, processes: bool) -> StackSpec:
        return StackSpec(
            tuple(TenantSpec(t) for t in self.tenants),
            policy=policy,
            replicas=self.replicas,
            replica=self.replica,
            processes=processes,
        )

    def extra_config(self) -> str:
        return f'[delegation]\nsecret_env = "{SECRET_ENV}"\ndelegates = ["{DELEGATE}", "{OTHER_DELEGATE}"]\n'


@dataclass(frozen=True)
class Attack:
    """One request and what the gateway must do with it.

    Attributes:
        group / name: what is tried.
        method / path / headers / params / body: the request (``headers`` as a list: names may repeat).
        statuses: acceptable HTTP statuses; codes: acceptable error codes (empty: any).
        billed_to: the tenant it must be billed to (``NOBODY``: refused, no reservation).
        request_id: its ``X-Request-Id`` (already among ``headers``).
        after: names of attacks that must have been answered before this one is sent.
        concurrent_with: the name of an attack sent at the same time (the request-id collision).
    """

    group: str
    name: str
    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    params: tuple[tuple[str, str], ...]
    body: dict[str, Any] | None
    statuses: frozenset[int]
    codes: frozenset[str]
    billed_to: str
    request_id: str
    stage: int = 0  # attacks run stage by stage (0 first); within a stage, all at once
    raw: bool = False  # written byte for byte on a socket (headers an HTTP client would refuse to send)

    @property
    def generates(self) -> bool:
        return self.path.startswith("/v1/") and self.path.endswith("completions")


@dataclass(frozen=True)
class Outcome:
    attack: Attack
    status: int | None
    code: str | None
    output_tokens: int | None  # from the answer's usage (a 200)
    error: str | None = None  # transport failure


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def attacks(config: ForgedConfig, keys: dict[str, str], secret: bytes, model: str) -> list[Attack]:
    """The attack list for a stack with ``keys`` (tenant -> API key) and the delegation ``secret``."""
    out: list[Attack] = []
    filler = " ".join(["w"] * (config.prompt_tokens - CHAT_OVERHEAD_TOKENS - 1))
    legacy_filler = " ".join(["w"] * (config.prompt_tokens - 1))
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": filler}],
        "max_tokens": config.max_tokens,
        "ignore_eos": True,
    }
    legacy = {
        "model": model,
        "prompt": " ".join(["w"] * config.prompt_tokens),
        "max_tokens": config.max_tokens,
        "ignore_eos": True,
    }
    now = time.time()
    good_for_client = make_on_behalf_of(secret, DELEGATE, CLIENT, now + 600)
    good_for_victim_other = make_on_behalf_of(secret, OTHER_DELEGATE, VICTIM, now + 600)

    def bearer(tenant: str) -> tuple[str, str]:
        return ("authorization", f"Bearer {keys[tenant]}")

    def add(
        group: str,
        name: str,
        headers: list[tuple[str, str]],
        billed_to: str,
        statuses: set[int],
        codes: set[str] = frozenset(),
        body: dict[str, Any] | None = None,
        path: str = "/v1/chat/completions",
        params: list[tuple[str, str]] = (),
        method: str = "POST",
        stage: int = 0,
        request_id: str | None = None,
        raw: bool = False,
    ) -> None:
        rid = request_id or f"forged-{len(out):03d}"
        payload = dict(chat if path == "/v1/chat/completions" else legacy) if body is None else dict(body)
        # The request id as the prompt's last word: the replicas' tap finds what reached them by it.
        if "messages" in payload:
            payload["messages"] = [{"role": "user", "content": f"{filler} {rid}"}]
        elif "prompt" in payload:
            payload["prompt"] = f"{legacy_filler} {rid}"
        if method == "GET":
            payload = None
        out.append(
            Attack(
                group,
                name,
                method,
                path,
                (*headers, ("x-request-id", rid)),
                tuple(params),
                payload,
                frozenset(statuses),
                frozenset(codes),
                billed_to,
                rid,
                stage,
                raw,
            )
        )

    me = bearer(ATTACKER)
    # --- controls: what legitimately works, so that every refusal below means something --------------------
    add("control", "mallory's own key", [me], ATTACKER, {200})
    add(
        "control",
        "delegate acts for client (valid token)",
        [bearer(DELEGATE), (ON_BEHALF_OF_HEADER, good_for_client)],
        CLIENT,
        {200},
    )
    add("control", "client's own key", [bearer(CLIENT)], CLIENT, {200}, request_id="client-finished")
    add("control", "mallory's own key, legacy completions", [me], ATTACKER, {200}, path="/v1/completions")
    # --- body --------------------------------------------------------------------------------------------------
    for name, extra in (
        ("user = victim", {"user": VICTIM}),
        ("tenant / tenant_id / organization = victim", {"tenant": VICTIM, "tenant_id": VICTIM, "organization": VICTIM}),
        ("cache_salt = the victim's cache scope", {"cache_salt": _tag(VICTIM)}),
        (
            "on_behalf_of token in the body",
            {"on_behalf_of": good_for_victim_other, ON_BEHALF_OF_HEADER: good_for_victim_other},
        ),
        ("metadata.tenant = victim", {"metadata": {"tenant": VICTIM, "user": VICTIM}}),
        ("request_id / priority fields", {"request_id": "victim-1", "priority": -100}),
    ):
        add("body", name, [me], ATTACKER, {200}, body={**chat, **extra})
    add(
        "body",
        "user = victim, legacy completions",
        [me],
        ATTACKER,
        {200},
        path="/v1/completions",
        body={**legacy, "user": VICTIM},
    )
    # --- headers -------------------------------------------------------------------------------------------------
    for header in (
        "x-tenant",
        "x-tenant-id",
        "x-fairgate-tenant",
        "openai-organization",
        "openai-project",
        "x-forwarded-user",
        "x-user-id",
        "x-api-key",
        "x-auth-request-user",
        "x-remote-user",
    ):
        add("header", f"{header}: victim", [me, (header, VICTIM)], ATTACKER, {200})
    add("header", "cookie tenant=victim", [me, ("cookie", f"tenant={VICTIM}; user={VICTIM}")], ATTACKER, {200})
    add(
        "header",
        "x-forwarded-authorization: Bearer victim",
        [me, ("x-forwarded-authorization", f"Bearer {VICTIM}"), ("proxy-authorization", f"Bearer {VICTIM}")],
        ATTACKER,
        {200},
    )
    add("header", "x-fairgate-run-id of the victim", [me, ("x-fairgate-run-id", f"{VICTIM}-run-1")], ATTACKER, {200})
    # --- query string ----------------------------------------------------------------------------------------------
    add("query", "?tenant=victim&user=victim", [me], ATTACKER, {200}, params=[("tenant", VICTIM), ("user", VICTIM)])
    add("query", "?api_key= / ?key= victim", [me], ATTACKER, {200}, params=[("api_key", VICTIM), ("key", VICTIM)])
    add(
        "query",
        "?x-fairgate-on-behalf-of=<token>",
        [me],
        ATTACKER,
        {200},
        params=[(ON_BEHALF_OF_HEADER, good_for_victim_other)],
    )
    add(
        "query",
        "no key, ?api_key=<mallory's key>",
        [],
        NOBODY,
        {401},
        {"invalid_api_key"},
        params=[("api_key", keys[ATTACKER])],
    )
    # --- authorization -------------------------------------------------------------------------------------------
    refused = {"invalid_api_key"}
    add(
        "authorization",
        "second Authorization header (victim's name)",
        [me, ("authorization", f"Bearer {VICTIM}")],
        NOBODY,
        {400, 401},
        refused,
    )
    add(
        "authorization",
        "second Authorization header, first the victim",
        [("authorization", f"Bearer {VICTIM}"), me],
        NOBODY,
        {400, 401},
        refused,
    )
    add(
        "authorization",
        "two keys in one header",
        [("authorization", f"Bearer {keys[ATTACKER]}, Bearer {VICTIM}")],
        NOBODY,
        {401},
        refused,
    )
    add("authorization", "Bearer <victim's name>", [("authorization", f"Bearer {VICTIM}")], NOBODY, {401}, refused)
    add(
        "authorization",
        "Bearer <key upper-cased>",
        [("authorization", f"Bearer {keys[ATTACKER].upper()}")],
        NOBODY,
        {401},
        refused,
    )
    add(
        "authorization",
        "Bearer <key> + victim suffix",
        [("authorization", f"Bearer {keys[ATTACKER]}{VICTIM}")],
        NOBODY,
        {401},
        refused,
    )
    add(
        "authorization",
        "Basic auth",
        [("authorization", "Basic " + base64.b64encode(f"{VICTIM}:{keys[ATTACKER]}".encode()).decode())],
        NOBODY,
        {401},
        refused,
    )
    add("authorization", "Bearer<TAB><key>", [("authorization", f"Bearer\t{keys[ATTACKER]}")], NOBODY, {401}, refused)
    add("authorization", "no Authorization", [], NOBODY, {401}, refused)
    add("authorization", "empty bearer", [("authorization", "Bearer ")], NOBODY, {401}, refused, raw=True)
    # A different spelling of one's own valid key is still one's own key: served, billed to the attacker.
    add("authorization", "bearer (lower case) <key>", [("authorization", f"bearer {keys[ATTACKER]}")], ATTACKER, {200})
    add(
        "authorization", "BEARER  <key> (two spaces)", [("authorization", f"BEARER  {keys[ATTACKER]}")], ATTACKER, {200}
    )
    add(
        "authorization",
        "Bearer <key> (trailing space)",
        [("authorization", f"Bearer {keys[ATTACKER]} ")],
        ATTACKER,
        {200},
        raw=True,
    )
    add(
        "authorization",
        "Authorization and AUTHORIZATION (the victim's name)",
        [me, ("AUTHORIZATION", f"Bearer {VICTIM}")],
        NOBODY,
        {400, 401},
        refused,
        raw=True,
    )
    # --- delegation ------------------------------------------------------------------------------------------------
    delegate = bearer(DELEGATE)
    not_allowed, invalid = {"delegation_not_allowed"}, {"invalid_delegation"}
    wrong_secret = make_on_behalf_of(secrets.token_bytes(32), DELEGATE, VICTIM, now + 600)
    expired = make_on_behalf_of(secret, DELEGATE, VICTIM, now - 60)
    just_expired = make_on_behalf_of(secret, DELEGATE, VICTIM, now - 0.001)
    minted_by_mallory = make_on_behalf_of(secret, ATTACKER, VICTIM, now + 600)
    payload, _, signature = good_for_client.partition(".")
    document = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    victim_payload = _b64(json.dumps({**document, "t": VICTIM}, separators=(",", ":"), sort_keys=True).encode())
    tampered = f"{victim_payload}.{signature}"
    unsigned = f"{victim_payload}."
    unknown = make_on_behalf_of(secret, DELEGATE, "nobody-such", now + 600)
    add(
        "delegation",
        "non-delegate presents a token issued to a delegate (stolen)",
        [me, (ON_BEHALF_OF_HEADER, good_for_victim_other)],
        NOBODY,
        {403},
        not_allowed,
    )
    add(
        "delegation",
        "non-delegate mints a token naming itself (leaked secret)",
        [me, (ON_BEHALF_OF_HEADER, minted_by_mallory)],
        NOBODY,
        {403},
        not_allowed,
    )
    add(
        "delegation",
        "non-delegate replays the client's token",
        [me, (ON_BEHALF_OF_HEADER, good_for_client)],
        NOBODY,
        {403},
        not_allowed,
    )
    add("delegation", "non-delegate, empty token", [me, (ON_BEHALF_OF_HEADER, "")], NOBODY, {403}, not_allowed)
    add(
        "delegation",
        "token signed with the wrong secret",
        [delegate, (ON_BEHALF_OF_HEADER, wrong_secret)],
        NOBODY,
        {403},
        invalid,
    )
    add("delegation", "expired token (60 s ago)", [delegate, (ON_BEHALF_OF_HEADER, expired)], NOBODY, {403}, invalid)
    add(
        "delegation",
        "expired token (1 ms ago)",
        [delegate, (ON_BEHALF_OF_HEADER, just_expired)],
        NOBODY,
        {403},
        invalid,
    )
    add(
        "delegation",
        "token issued to another delegate",
        [delegate, (ON_BEHALF_OF_HEADER, good_for_victim_other)],
        NOBODY,
        {403},
        invalid,
    )
    add(
        "delegation",
        "another delegate replays batchsvc's token",
        [bearer(OTHER_DELEGATE), (ON_BEHALF_OF_HEADER, good_for_client)],
        NOBODY,
        {403},
        invalid,
    )
    add(
        "delegation",
        "payload changed to the victim, signature kept",
        [delegate, (ON_BEHALF_OF_HEADER, tampered)],
        NOBODY,
        {403},
        invalid,
    )
    add(
        "delegation",
        "payload changed, no signature",
        [delegate, (ON_BEHALF_OF_HEADER, unsigned)],
        NOBODY,
        {403},
        invalid,
    )
    add("delegation", "malformed token", [delegate, (ON_BEHALF_OF_HEADER, "a.b.c")], NOBODY, {403}, invalid)
    add(
        "delegation",
        "token naming an unknown tenant",
        [delegate, (ON_BEHALF_OF_HEADER, unknown)],
        NOBODY,
        {403},
        invalid,
    )
    add(
        "delegation",
        "valid token, X-Tenant and user = victim",
        [delegate, (ON_BEHALF_OF_HEADER, good_for_client), ("x-tenant", VICTIM)],
        CLIENT,
        {200},
        body={**chat, "user": VICTIM},
    )
    # Two tokens: the first is the client's (valid), the second a victim's (forged). Refusing (400) or taking
    # the first is acceptable; billing the victim is not.
    add(
        "delegation",
        "two on-behalf-of headers (client's, then a forged victim's)",
        [delegate, (ON_BEHALF_OF_HEADER, good_for_client), (ON_BEHALF_OF_HEADER, tampered)],
        CLIENT,
        {200, 400},
    )
    add("delegation", "token without a key", [(ON_BEHALF_OF_HEADER, good_for_client)], NOBODY, {401}, refused)
    # --- admin -------------------------------------------------------------------------------------------------
    admin = ("authorization", f"Bearer {ADMIN_KEY}")
    add("admin", "admin key on /v1/chat/completions", [admin], NOBODY, {401, 403})
    add("admin", "admin key on /v1/completions", [admin], NOBODY, {401, 403}, path="/v1/completions")
    add(
        "admin",
        "admin key + on-behalf-of token for the client",
        [admin, (ON_BEHALF_OF_HEADER, good_for_client)],
        NOBODY,
        {401, 403},
    )
    add("admin", "admin key + X-Tenant: victim", [admin, ("x-tenant", VICTIM)], NOBODY, {401, 403})
    # --- request ids: the attacker reuses the client's ids (separate tenants: separate reservations) ----------
    slow = {**chat, "max_tokens": 40}
    add(
        "request id",
        "client's request (40 tokens)",
        [bearer(CLIENT)],
        CLIENT,
        {200},
        body=slow,
        request_id="shared-running",
        stage=1,
    )
    add(
        "request id",
        "mallory reuses it while it runs",
        [me],
        ATTACKER,
        {200},
        body=slow,
        request_id="shared-running",
        stage=1,
    )
    add(
        "request id",
        "mallory reuses the client's finished id",
        [me],
        ATTACKER,
        {200},
        request_id="client-finished",
        stage=2,
    )
    # --- reads: nobody reads the victim's usage -----------------------------------------------------------------
    add(
        "read",
        "/v1/usage?tenant=victim",
        [me],
        NOBODY,
        {403},
        {"tenant_mismatch"},
        path="/v1/usage",
        params=[("tenant", VICTIM)],
        method="GET",
    )
    add(
        "read",
        "/v1/usage with X-Tenant: victim",
        [me, ("x-tenant", VICTIM)],
        NOBODY,
        {403},
        {"tenant_mismatch"},
        path="/v1/usage",
        method="GET",
    )
    add(
        "read",
        "/v1/usage with a forged on-behalf-of token",
        [delegate, (ON_BEHALF_OF_HEADER, tampered)],
        NOBODY,
        {403},
        invalid,
        path="/v1/usage",
        method="GET",
    )
    add(
        "read", "/admin/usage with a tenant key", [me], NOBODY, {403}, {"admin_only"}, path="/admin/usage", method="GET"
    )
    add(
        "read",
        "/admin/reservations with a tenant key",
        [me],
        NOBODY,
        {403},
        {"admin_only"},
        path="/admin/reservations",
        method="GET",
    )
    return out


def _tag(tenant: str) -> str:
    from fairgate.ledger.base import tenant_tag

    return tenant_tag(tenant)


# Body fields naming a tenant, a user or a scheduling privilege: the gateway must not act on them, and an
# upstream should not receive them as if they were trusted context.
SUSPECT_FIELDS = (
    "user",
    "tenant",
    "tenant_id",
    "organization",
    "metadata",
    "on_behalf_of",
    ON_BEHALF_OF_HEADER,
    "request_id",
    "priority",
)


@dataclass(frozen=True)
class AttackFigures:
    outcome: Outcome
    reservations: tuple[tuple[str, int], ...]  # (tenant, billed output tokens) under its request id
    upstream_salts: tuple[str, ...] | None  # cache_salt of each request the replicas got for it (None: not tapped)
    forwarded: tuple[str, ...] = ()  # SUSPECT_FIELDS the replicas received in its body

    @property
    def attack(self) -> Attack:
        return self.outcome.attack

    def problems(self, max_tokens_of: Callable[[Attack], int]) -> list[str]:
        a, o = self.attack, self.outcome
        out = []
        if o.status not in a.statuses:
            out.append(f"answered {o.status} {o.code or o.error or ''}, expected {sorted(a.statuses)}")
        elif o.status != 200 and a.codes and o.code not in a.codes:
            out.append(f"code {o.code}, expected {sorted(a.codes)}")
        if not a.generates:
            return out
        billed = [tenant for tenant, _ in self.reservations]
        if a.billed_to == NOBODY or o.status != 200:
            if billed:
                out.append(f"refused but reserved for {billed}")
        elif billed != [a.billed_to]:
            out.append(f"billed to {billed or 'nobody'}, expected {a.billed_to}")
        if VICTIM in billed:
            out.append("BILLED TO THE VICTIM")
        if o.status == 200 and o.output_tokens != max_tokens_of(a):
            out.append(f"served {o.output_tokens} tokens, expected {max_tokens_of(a)}")
        if self.upstream_salts is not None:
            salts = set(self.upstream_salts)
            if o.status == 200 and a.billed_to != NOBODY and _tag(a.billed_to) not in salts:
                out.append(f"reached the replica under cache scope(s) {sorted(salts)}, not {a.billed_to}'s")
            if _tag(VICTIM) in salts:
                out.append("REACHED THE REPLICA UNDER THE VICTIM'S CACHE SCOPE")
        return out


@dataclass(frozen=True)
class ForgedFigures:
    policy: str
    attacks: list[AttackFigures]
    usage: dict[str, tuple[int, int, int, float]]  # tenant -> (requests, input, output tokens, GPU ms)
    victim_events: int
    victim_salt_ms: float  # GPU ms charged on the replicas under the victim's cache_salt
    seconds: float


@dataclass(frozen=True)
class ForgedResult(CheckedResult):
    config: ForgedConfig
    main: ForgedFigures
    name: str = "forged"

    def max_tokens_of(self, attack: Attack) -> int:
        return int((attack.body or {}).get("max_tokens", self.config.max_tokens))

    def problems(self) -> dict[str, list[str]]:
        out = {}
        for f in self.main.attacks:
            found = f.problems(self.max_tokens_of)
            if found:
                out[f"{f.attack.group}: {f.attack.name}"] = found
        return out

    def expected_usage(self) -> dict[str, tuple[int, int]]:
        """Tenant -> (requests, output tokens) it legitimately sent: the served attacks expected to bill it."""
        out: dict[str, list[int]] = {t: [0, 0] for t in self.config.tenants}
        for f in self.main.attacks:
            a = f.attack
            if a.generates and a.billed_to != NOBODY and f.outcome.status == 200:
                out[a.billed_to][0] += 1
                out[a.billed_to][1] += self.max_tokens_of(a)
        return {t: (n, tokens) for t, (n, tokens) in out.items()}

    def checks(self) -> dict[str, bool]:
        f = self.main
        victim = f.usage[VICTIM]
        expected = self.expected_usage()
        statuses = Counter(a.outcome.status for a in f.attacks)
        return {
            f"all {len(f.attacks)} attacks answered as expected (status, code)": not any(
                "expected" in p or "code" in p for ps in self.problems().values() for p in ps
            ),
            "no 5xx, no transport error": not any((s or 0) >= 500 for s in statuses) and None not in statuses,
            "the controls work (the refusals mean something)": all(
                a.outcome.status == 200 for a in f.attacks if a.attack.group == "control"
            ),
            "victim: no reservation, no event, zero usage": victim == (0, 0, 0, 0.0) and f.victim_events == 0,
            "victim: no GPU time under its cache scope on any replica": f.victim_salt_ms == 0.0,
            "every request served reached the replica under the billed tenant's cache scope": not any(
                p.startswith("reached") or "REACHED" in p for ps in self.problems().values() for p in ps
            ),
            "every served request billed to exactly the tenant expected; every refused one to nobody": not any(
                p.startswith(("billed", "refused", "BILLED")) for ps in self.problems().values() for p in ps
            ),
            "each tenant's usage == what it legitimately sent (requests, output tokens)": all(
                (f.usage[t][0], f.usage[t][2]) == expected[t] for t in self.config.tenants
            ),
        }

    def render(self) -> list[Any]:
        from rich.table import Table

        f = self.main
        problems = self.problems()
        out: list[Any] = [
            f"[bold]drill forged[/bold]: {len(f.attacks)} requests by {ATTACKER!r} and the delegates "
            f"{DELEGATE!r} / {OTHER_DELEGATE!r} try every header, body, query, credential and delegation trick "
            f"to be billed as {VICTIM!r} (who sends nothing), with {CLIENT!r} as the legitimate delegation target; "
            f"policy {f.policy}.",
            f"Claim: none is billed to another tenant; {VICTIM!r}'s usage stays exactly zero.",
        ]
        table = Table(title="by group", title_justify="left")
        for column in ("group", "attacks", "answers", "billed to", "wrong"):
            table.add_column(column, justify="left" if column in ("group", "answers", "billed to") else "right")
        for group in dict.fromkeys(a.attack.group for a in f.attacks):
            rows = [a for a in f.attacks if a.attack.group == group]
            answers = Counter(f"{a.outcome.status}" + (f" {a.outcome.code}" if a.outcome.code else "") for a in rows)
            billed = Counter(t for a in rows for t, _ in a.reservations)
            table.add_row(
                group,
                str(len(rows)),
                ", ".join(f"{k} x{v}" for k, v in sorted(answers.items())),
                ", ".join(f"{k} x{v}" for k, v in sorted(billed.items())) or "nobody",
                str(sum(1 for a in rows if f"{group}: {a.attack.name}" in problems)),
            )
        refused = sum(1 for a in f.attacks if a.attack.billed_to == NOBODY)
        table.caption = (
            f"load: {len(f.attacks)} requests in {f.seconds:.1f} s; faults injected: "
            f"{len(f.attacks) - sum(1 for a in f.attacks if a.attack.group == 'control')} forgery "
            f"attempts ({refused} must be refused, the rest served as the caller)"
        )
        table.caption_justify = "left"
        out.append(table)
        usage = Table(title="ledger usage per tenant (expected: what it legitimately sent)", title_justify="left")
        for column in ("tenant", "requests", "input tok", "output tok", "GPU ms", "expected requests / output tok"):
            usage.add_column(column, justify="left" if column == "tenant" else "right")
        expected = self.expected_usage()
        for tenant, (requests, input_tokens, output_tokens, gpu_ms) in f.usage.items():
            usage.add_row(
                tenant,
                str(requests),
                str(input_tokens),
                str(output_tokens),
                f"{gpu_ms:,.1f}",
                f"{expected[tenant][0]} / {expected[tenant][1]}",
            )
        out.append(usage)
        wrong = sum(1 for ps in problems.values() for p in ps if "BILLED TO THE VICTIM" in p or p.startswith("billed"))
        out.append(
            f"lost: {wrong} requests billed to a wrong tenant; victim usage {f.usage[VICTIM]}, events "
            f"{f.victim_events}, GPU ms under its cache scope {f.victim_salt_ms:g}; converged: immediately "
            "(nothing to release)."
        )
        forwarded = Counter(k for a in f.attacks for k in a.forwarded)
        if forwarded:
            fields = ", ".join(f"{k} x{v}" for k, v in sorted(forwarded.items()))
            out.append(
                f"[yellow]found[/yellow]: the gateway forwards untrusted tenant-like body fields to the "
                f"replicas ({fields}); it drops only user, priority, request_id, cache_salt and vLLM's private "
                "fields. Nothing here acts on them (billing and the cache scope come from the credential), but "
                "a hop that read a body 'tenant' would be misled."
            )
        for a in f.attacks:
            if a.attack.name.startswith("two on-behalf-of headers") and a.outcome.status == 200:
                billed = ", ".join(t for t, _ in a.reservations) or "nobody"
                out.append(
                    "[yellow]found[/yellow]: with two X-Fairgate-On-Behalf-Of headers the gateway uses the "
                    f"first (billed to {billed}), where two Authorization headers are refused (400); a proxy in "
                    "front that keeps the last would disagree about whom a request bills. Not exploitable "
                    "without a valid token, but ambiguous."
                )
        for name, found in problems.items():
            out.append(f"[red]{name}[/red]: {'; '.join(found)}")
        out.extend(self.check_lines())
        verdict = "[green]PASS[/green]" if self.passed else "[red]FAIL[/red]"
        out.append(
            f"{verdict}: {len(f.attacks)} forgery attempts; "
            + ("none billed to another tenant" if self.passed else "see the FAIL lines")
            + "."
        )
        return out


async def _send_all(drill: DrillStack, todo: list[Attack]) -> list[Outcome]:
    import httpx

    async def send(http: httpx.AsyncClient, attack: Attack) -> Outcome:
        try:
            if attack.raw:
                status, content = await _raw_request(drill.url, attack)
            else:
                reply = await http.request(
                    attack.method,
                    drill.url + attack.path,
                    headers=list(attack.headers),
                    params=list(attack.params),
                    json=attack.body,
                )
                status, content = reply.status_code, reply.content
        except (httpx.HTTPError, OSError, ValueError) as exc:
            return Outcome(attack, None, None, None, f"{type(exc).__name__}: {exc}")
        code = tokens = None
        try:
            document = json.loads(content)
        except ValueError:
            document = None
        if isinstance(document, dict):
            if status != 200:
                code = (document.get("error") or {}).get("code")
            elif isinstance(document.get("usage"), dict):
                tokens = document["usage"].get("completion_tokens")
        return Outcome(attack, status, code, tokens)

    outcomes: dict[str, Outcome] = {}
    async with httpx.AsyncClient(timeout=60.0) as http:
        for stage in sorted({a.stage for a in todo}):
            batch = [a for a in todo if a.stage == stage]
            for attack, outcome in zip(batch, await asyncio.gather(*(send(http, a) for a in batch))):
                outcomes[f"{attack.request_id}|{attack.name}"] = outcome
    return [outcomes[f"{a.request_id}|{a.name}"] for a in todo]


async def _raw_request(base_url: str, attack: Attack) -> tuple[int, bytes]:
    """Send ``attack`` as HTTP/1.1 bytes, its headers exactly as given; (status, body)."""
    from urllib.parse import urlencode, urlsplit

    where = urlsplit(base_url)
    body = b"" if attack.body is None else json.dumps(attack.body).encode("utf-8")
    target = attack.path + (f"?{urlencode(attack.params)}" if attack.params else "")
    lines = [
        f"{attack.method} {target} HTTP/1.1",
        f"host: {where.netloc}",
        "connection: close",
        *(f"{name}: {value}" for name, value in attack.headers),
    ]
    if body:
        lines += ["content-type: application/json", f"content-length: {len(body)}"]
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    try:
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=60.0)
    finally:
        writer.close()
    head, _, content = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        content = _dechunk(content)
    return status, content


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out


def run(options: DrillOptions, config: ForgedConfig | None = None) -> ForgedResult:
    """Run the drill under ``options.policy`` (``seconds`` and ``compare`` do not apply)."""
    config = config or ForgedConfig()
    spec = config.spec(options.policy, options.processes)
    secret = secrets.token_urlsafe(32)
    with open_stack(
        spec,
        extra_config=config.extra_config(),
        environment={SECRET_ENV: secret},
        gateway_process=config.gateway_process,
    ) as drill:
        todo = attacks(config, drill.keys, secret.encode("utf-8"), spec.model)

        async def go() -> ForgedFigures:
            start = time.monotonic()
            outcomes = await _send_all(drill, todo)
            seconds = time.monotonic() - start
            await asyncio.sleep(0.2)  # the last settlements
            ledger = await open_ledger(drill.stack)
            try:
                reservations = await ledger.reservations()
                usage = {}
                for tenant in config.tenants:
                    u = await ledger.usage(tenant, 10 * 365 * 86_400)
                    usage[tenant] = (u.requests, u.input_tokens, u.output_tokens, u.gpu_ms)
                victim_events = len(await ledger.events(VICTIM))
            finally:
                await ledger.close()
            by_id: dict[str, list[tuple[str, int]]] = {}
            for r in reservations:
                by_id.setdefault(r.request_id, []).append((r.tenant, r.billed.output_tokens))
            # Request ids reused across tenants (the collision attacks) are matched by the tenant billed.
            bodies: dict[str, list[Any]] = {}
            for tap in drill.taps:
                for tag, received in tap.bodies.items():
                    bodies.setdefault(tag, []).extend(received)
            tapped = bool(drill.taps)
            figures = []
            for outcome in outcomes:
                attack = outcome.attack
                found = by_id.get(attack.request_id, [])
                received = bodies.get(attack.request_id, [])
                shared = sum(1 for a in todo if a.request_id == attack.request_id) > 1
                if shared:  # the request-id collisions: each attack's share is its tenant's
                    found = [r for r in found if r[0] == attack.billed_to]
                    received = [b for b in received if b.get("cache_salt") == _tag(attack.billed_to)]
                forwarded = sorted({k for b in received for k in SUSPECT_FIELDS if k in b})
                figures.append(
                    AttackFigures(
                        outcome,
                        tuple(found),
                        tuple(str(b.get("cache_salt")) for b in received) if tapped else None,
                        tuple(forwarded),
                    )
                )
            stats = await replica_stats(drill)
            victim_ms = sum(float(s["charge_rule_ms_by_cache_salt"].get(_tag(VICTIM), 0.0)) for s in stats)
            return ForgedFigures(options.policy, figures, usage, victim_events, victim_ms, seconds)

        figures = asyncio.run(go())
    return ForgedResult(config, figures)

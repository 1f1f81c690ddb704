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

Also reported: the tenant-like body fields the gateway forwards to the replicas (it drops only ``user``,
``priority``, ``request_id``, ``cache_salt`` and vLLM's private fields), and which of two on-behalf-of
headers it used if it served such a request.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from fairgate.drills import DrillOptions
from fairgate.drills.report import (
    ConfiguredResult,
    fmt_counts,
    grouped,
    history_check,
    history_lines,
    problems_by,
    table,
)
from fairgate.gateway.auth import make_on_behalf_of
from fairgate.gateway.identity import ON_BEHALF_OF_HEADER as OBO
from fairgate.harness.config import ADMIN_KEY, TenantSpec
from fairgate.harness.history import HistoryReport, check_stack
from fairgate.harness.ledger import ALL_TIME_S
from fairgate.harness.loadgen import CHAT_OVERHEAD_TOKENS, HttpRequest, LoadGenerator
from fairgate.harness.records import RequestRecord
from fairgate.harness.replica import ReplicaModel
from fairgate.harness.stack import Stack, StackSpec, replicas, start_stack
from fairgate.ledger.base import tenant_tag

ATTACKER, VICTIM, CLIENT, DELEGATE, OTHER_DELEGATE = "mallory", "victim", "client", "batchsvc", "othersvc"
SECRET_ENV = "FAIRGATE_DRILL_DELEGATION_SECRET"
NOBODY = "-"  # an attack that must be refused: billed to nobody
CHAT, LEGACY = "/v1/chat/completions", "/v1/completions"
# Body fields naming a tenant, a user or a scheduling privilege: the gateway must not act on them, and an
# upstream should not receive them as if they were trusted context.
SUSPECT_FIELDS = (
    "user",
    "tenant",
    "tenant_id",
    "organization",
    "metadata",
    "on_behalf_of",
    OBO,
    "request_id",
    "priority",
)


@dataclass(frozen=True)
class ForgedConfig:
    """The drill's setting."""

    max_tokens: int = 3  # each attack's output (small: the drill is about who pays, not how much)
    prompt_tokens: int = 8  # each prompt, as the emulator counts it (chat) or words (completions)
    replicas: int = 1  # the emulated fleet
    replica: ReplicaModel = field(default_factory=lambda: ReplicaModel(10.0, 0.1, 0.01, 32, 4096))
    gateway_process: bool = False  # run the gateway as a process

    @property
    def tenants(self) -> tuple[str, ...]:
        return (ATTACKER, VICTIM, CLIENT, DELEGATE, OTHER_DELEGATE)

    def spec(self, policy: str, processes: bool, secret: str) -> StackSpec:
        return StackSpec(
            tuple(TenantSpec(t) for t in self.tenants),
            policy,
            replicas(self.replicas),
            self.replica,
            processes,
            processes or self.gateway_process,
            tapped=not processes,
            admin=True,
            delegates=(DELEGATE, OTHER_DELEGATE),
            secret_env=SECRET_ENV,
            environment={SECRET_ENV: secret},
        )


@dataclass(frozen=True)
class Attack:
    """One request (its ``X-Request-Id`` among its headers) and what the gateway must do with it."""

    group: str  # what is tried, with ``name``
    name: str
    request: HttpRequest
    statuses: frozenset[int]  # acceptable HTTP statuses
    codes: frozenset[str]  # acceptable error codes (empty: any)
    billed_to: str  # the tenant it must be billed to (``NOBODY``: refused, no reservation)
    stage: int = 0  # attacks run stage by stage (0 first); within a stage, all at once

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def generates(self) -> bool:
        return self.request.path.startswith("/v1/") and self.request.path.endswith("completions")

    @property
    def max_tokens(self) -> int:
        return int((self.request.body or {}).get("max_tokens", 0))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


class _Attacks:
    """The attack list under construction, group by group: ``add`` fills in the request id, the bodies and
    their tags; the tokens and credentials are made once for every group."""

    def __init__(self, config: ForgedConfig, keys: dict[str, str], secret: bytes, model: str) -> None:
        self.out: list[Attack] = []
        self.keys, self.secret, self.now = keys, secret, time.time()
        self.filler = " ".join(["w"] * (config.prompt_tokens - CHAT_OVERHEAD_TOKENS - 1))
        self.legacy_filler = " ".join(["w"] * (config.prompt_tokens - 1))
        self.chat = {"model": model, "messages": [], "max_tokens": config.max_tokens, "ignore_eos": True}
        self.legacy = {"model": model, "prompt": "", "max_tokens": config.max_tokens, "ignore_eos": True}
        self.key, self.me, self.delegate = keys[ATTACKER], self.bearer(ATTACKER), self.bearer(DELEGATE)
        self.for_client = self.token(DELEGATE, CLIENT)
        self.for_victim_other = self.token(OTHER_DELEGATE, VICTIM)
        payload, _, signature = self.for_client.partition(".")
        document = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        self.victim_payload = _b64(
            json.dumps({**document, "t": VICTIM}, separators=(",", ":"), sort_keys=True).encode()
        )
        self.tampered = f"{self.victim_payload}.{signature}"  # the client's token, naming the victim

    def bearer(self, tenant: str) -> tuple[str, str]:
        return ("authorization", f"Bearer {self.keys[tenant]}")

    def token(self, issuer: str, tenant: str, expires_in_s: float = 600, secret: bytes | None = None) -> str:
        return make_on_behalf_of(secret or self.secret, issuer, tenant, self.now + expires_in_s)

    def add(
        self,
        group: str,
        name: str,
        headers: Sequence[tuple[str, str]],
        billed_to: str,
        statuses: Collection[int],
        codes: Collection[str] = (),
        body: dict[str, Any] | None = None,
        path: str = CHAT,
        params: Sequence[tuple[str, str]] = (),
        method: str = "POST",
        stage: int = 0,
        request_id: str | None = None,
        raw: bool = False,
    ) -> None:
        rid = request_id or f"forged-{len(self.out):03d}"
        payload = dict(self.chat if path == CHAT else self.legacy) if body is None else dict(body)
        # The request id as the prompt's last word: the replicas' tap finds what reached them by it.
        if "messages" in payload:
            payload["messages"] = [{"role": "user", "content": f"{self.filler} {rid}"}]
        elif "prompt" in payload:
            payload["prompt"] = f"{self.legacy_filler} {rid}"
        headers = (*headers, ("x-request-id", rid))
        body = None if method == "GET" else payload
        request = HttpRequest(billed_to, rid, method, path, headers, tuple(params), body, on_socket=raw)
        self.out.append(Attack(group, name, request, frozenset(statuses), frozenset(codes), billed_to, stage))

    def controls_and_fields(self) -> None:
        """What legitimately works (so that every refusal below means something), then tenant-like body
        fields, headers and query parameters: served as the caller, never as the victim."""
        add, me, delegate = self.add, self.me, self.delegate
        add("control", "mallory's own key", [me], ATTACKER, {200})
        add("control", "delegate acts for client (valid token)", [delegate, (OBO, self.for_client)], CLIENT, {200})
        add("control", "client's own key", [self.bearer(CLIENT)], CLIENT, {200}, request_id="client-finished")
        add("control", "mallory's own key, legacy completions", [me], ATTACKER, {200}, path=LEGACY)
        for name, extra in (  # the gateway's own fields: dropped, the request served as the caller
            ("user = victim", {"user": VICTIM}),
            ("cache_salt = the victim's cache scope", {"cache_salt": tenant_tag(VICTIM)}),
            ("request_id / priority fields", {"request_id": "victim-1", "priority": -100}),
        ):
            add("body", name, [me], ATTACKER, {200}, body={**self.chat, **extra})
        refused: tuple[tuple[str, dict[str, Any]], ...] = (
            (
                "tenant / tenant_id / organization = victim",
                {"tenant": VICTIM, "tenant_id": VICTIM, "organization": VICTIM},
            ),
            ("on_behalf_of token in the body", {"on_behalf_of": self.for_victim_other, OBO: self.for_victim_other}),
            ("metadata.tenant = victim", {"metadata": {"tenant": VICTIM, "user": VICTIM}}),
        )
        for name, refused_extra in refused:  # fields no upstream kind is sent: refused before anything is reserved
            add("body", name, [me], NOBODY, {400}, {"invalid_request"}, body={**self.chat, **refused_extra})
        legacy = {**self.legacy, "user": VICTIM}
        add("body", "user = victim, legacy completions", [me], ATTACKER, {200}, path=LEGACY, body=legacy)
        for header in ("x-tenant", "x-tenant-id", "x-fairgate-tenant", "openai-organization", "openai-project"):
            add("header", f"{header}: victim", [me, (header, VICTIM)], ATTACKER, {200})
        for header in ("x-forwarded-user", "x-user-id", "x-api-key", "x-auth-request-user", "x-remote-user"):
            add("header", f"{header}: victim", [me, (header, VICTIM)], ATTACKER, {200})
        add("header", "cookie tenant=victim", [me, ("cookie", f"tenant={VICTIM}; user={VICTIM}")], ATTACKER, {200})
        forwarded = [me, ("x-forwarded-authorization", f"Bearer {VICTIM}"), ("proxy-authorization", f"Bearer {VICTIM}")]
        add("header", "x-forwarded-authorization: Bearer victim", forwarded, ATTACKER, {200})
        add(
            "header", "x-fairgate-run-id of the victim", [me, ("x-fairgate-run-id", f"{VICTIM}-run-1")], ATTACKER, {200}
        )
        add("query", "?tenant=victim&user=victim", [me], ATTACKER, {200}, params=[("tenant", VICTIM), ("user", VICTIM)])
        add("query", "?api_key= / ?key= victim", [me], ATTACKER, {200}, params=[("api_key", VICTIM), ("key", VICTIM)])
        add("query", "?x-fairgate-on-behalf-of=<token>", [me], ATTACKER, {200}, params=[(OBO, self.for_victim_other)])
        no_key = "no key, ?api_key=<mallory's key>"
        add("query", no_key, [], NOBODY, {401}, {"invalid_api_key"}, params=[("api_key", self.key)])

    def authorization(self) -> None:
        """Credential tricks: refused (no reservation), or the caller's own key spelled otherwise (served)."""
        key, me, auth, refused = self.key, self.me, "authorization", {"invalid_api_key"}
        victim = (auth, f"Bearer {VICTIM}")
        basic = "Basic " + base64.b64encode(f"{VICTIM}:{key}".encode()).decode()
        for name, headers, statuses, raw in (
            ("second Authorization header (victim's name)", [me, victim], {400, 401}, False),
            ("second Authorization header, first the victim", [victim, me], {400, 401}, False),
            ("two keys in one header", [(auth, f"Bearer {key}, Bearer {VICTIM}")], {401}, False),
            ("Bearer <victim's name>", [victim], {401}, False),
            ("Bearer <key upper-cased>", [(auth, f"Bearer {key.upper()}")], {401}, False),
            ("Bearer <key> + victim suffix", [(auth, f"Bearer {key}{VICTIM}")], {401}, False),
            ("Basic auth", [(auth, basic)], {401}, False),
            ("Bearer<TAB><key>", [(auth, f"Bearer\t{key}")], {401}, False),
            ("no Authorization", [], {401}, False),
            ("empty bearer", [(auth, "Bearer ")], {401}, True),
        ):
            self.add("authorization", name, headers, NOBODY, statuses, refused, raw=raw)
        # A different spelling of one's own valid key is still one's own key: served, billed to the attacker.
        self.add("authorization", "bearer (lower case) <key>", [(auth, f"bearer {key}")], ATTACKER, {200})
        self.add("authorization", "BEARER  <key> (two spaces)", [(auth, f"BEARER  {key}")], ATTACKER, {200})
        trailing = [(auth, f"Bearer {key} ")]
        self.add("authorization", "Bearer <key> (trailing space)", trailing, ATTACKER, {200}, raw=True)
        two_cases = [me, ("AUTHORIZATION", f"Bearer {VICTIM}")]
        name = "Authorization and AUTHORIZATION (the victim's name)"
        self.add("authorization", name, two_cases, NOBODY, {400, 401}, refused, raw=True)

    def delegation(self) -> None:
        """On-behalf-of tokens a caller may not use, and one it may (billed to the tenant it names)."""
        me, delegate = self.me, self.delegate
        for name, token in (
            ("non-delegate presents a token issued to a delegate (stolen)", self.for_victim_other),
            ("non-delegate mints a token naming itself (leaked secret)", self.token(ATTACKER, VICTIM)),
            ("non-delegate replays the client's token", self.for_client),
            ("non-delegate, empty token", ""),
        ):
            self.add("delegation", name, [me, (OBO, token)], NOBODY, {403}, {"delegation_not_allowed"})
        for name, caller, token in (
            (
                "token signed with the wrong secret",
                delegate,
                self.token(DELEGATE, VICTIM, secret=secrets.token_bytes(32)),
            ),
            ("expired token (60 s ago)", delegate, self.token(DELEGATE, VICTIM, -60)),
            ("expired token (1 ms ago)", delegate, self.token(DELEGATE, VICTIM, -0.001)),
            ("token issued to another delegate", delegate, self.for_victim_other),
            ("another delegate replays batchsvc's token", self.bearer(OTHER_DELEGATE), self.for_client),
            ("payload changed to the victim, signature kept", delegate, self.tampered),
            ("payload changed, no signature", delegate, f"{self.victim_payload}."),
            ("malformed token", delegate, "a.b.c"),
            ("token naming an unknown tenant", delegate, self.token(DELEGATE, "nobody-such")),
        ):
            self.add("delegation", name, [caller, (OBO, token)], NOBODY, {403}, {"invalid_delegation"})
        also = [delegate, (OBO, self.for_client), ("x-tenant", VICTIM)]
        body = {**self.chat, "user": VICTIM}
        self.add("delegation", "valid token, X-Tenant and user = victim", also, CLIENT, {200}, body=body)
        # Two tokens: the first is the client's (valid), the second a victim's (forged). Refusing (400) or taking
        # the first is acceptable; billing the victim is not.
        two = [delegate, (OBO, self.for_client), (OBO, self.tampered)]
        self.add("delegation", "two on-behalf-of headers (client's, then a forged victim's)", two, CLIENT, {200, 400})
        self.add("delegation", "token without a key", [(OBO, self.for_client)], NOBODY, {401}, {"invalid_api_key"})

    def admin_ids_and_reads(self) -> None:
        """The admin key on the completion paths, the attacker reusing the client's request ids (separate
        tenants: separate reservations), and reads of the victim's usage."""
        add, me = self.add, self.me
        admin = ("authorization", f"Bearer {ADMIN_KEY}")
        add("admin", "admin key on /v1/chat/completions", [admin], NOBODY, {401, 403})
        add("admin", "admin key on /v1/completions", [admin], NOBODY, {401, 403}, path=LEGACY)
        add(
            "admin",
            "admin key + on-behalf-of token for the client",
            [admin, (OBO, self.for_client)],
            NOBODY,
            {401, 403},
        )
        add("admin", "admin key + X-Tenant: victim", [admin, ("x-tenant", VICTIM)], NOBODY, {401, 403})
        running: dict[str, Any] = {"body": {**self.chat, "max_tokens": 40}, "request_id": "shared-running", "stage": 1}
        add("request id", "client's request (40 tokens)", [self.bearer(CLIENT)], CLIENT, {200}, **running)
        add("request id", "mallory reuses it while it runs", [me], ATTACKER, {200}, **running)
        reuse = "mallory reuses the client's finished id"
        add("request id", reuse, [me], ATTACKER, {200}, request_id="client-finished", stage=2)
        usage: dict[str, Any] = {"path": "/v1/usage", "method": "GET"}
        mismatch = {"tenant_mismatch"}
        add("read", "/v1/usage?tenant=victim", [me], NOBODY, {403}, mismatch, params=[("tenant", VICTIM)], **usage)
        add("read", "/v1/usage with X-Tenant: victim", [me, ("x-tenant", VICTIM)], NOBODY, {403}, mismatch, **usage)
        forged = [self.delegate, (OBO, self.tampered)]
        add(
            "read", "/v1/usage with a forged on-behalf-of token", forged, NOBODY, {403}, {"invalid_delegation"}, **usage
        )
        for path in ("/admin/usage", "/admin/reservations"):
            add("read", f"{path} with a tenant key", [me], NOBODY, {403}, {"admin_only"}, path=path, method="GET")


def attacks(config: ForgedConfig, keys: dict[str, str], secret: bytes, model: str) -> list[Attack]:
    """The attack list for a stack with ``keys`` (tenant -> API key) and the delegation ``secret``."""
    a = _Attacks(config, keys, secret, model)
    a.controls_and_fields()
    a.authorization()
    a.delegation()
    a.admin_ids_and_reads()
    return a.out


@dataclass(frozen=True)
class AttackFigures:
    attack: Attack
    outcome: RequestRecord  # what its client got
    reservations: tuple[tuple[str, int], ...]  # (tenant, billed output tokens) under its request id
    upstream_salts: tuple[str, ...] | None  # cache_salt of each request the replicas got for it (None: not tapped)
    forwarded: tuple[str, ...] = ()  # SUSPECT_FIELDS the replicas received in its body

    def problems(self) -> list[str]:
        a, o = self.attack, self.outcome
        out = []
        if o.status not in a.statuses:
            out.append(f"answered {o.status} {o.code or ''}, expected {sorted(a.statuses)}")
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
        if o.status == 200 and o.usage_output != a.max_tokens:
            out.append(f"served {o.usage_output} tokens, expected {a.max_tokens}")
        if self.upstream_salts is not None:
            salts = set(self.upstream_salts)
            if o.status == 200 and a.billed_to != NOBODY and tenant_tag(a.billed_to) not in salts:
                out.append(f"reached the replica under cache scope(s) {sorted(salts)}, not {a.billed_to}'s")
            if tenant_tag(VICTIM) in salts:
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
    # the history checker: each attack's record names the tenant it must bill (nobody for a refusal), so a
    # reservation under any other tenant (the victim's) is one no client sent
    history: HistoryReport


@dataclass(frozen=True)
class ForgedResult(ConfiguredResult[ForgedConfig, ForgedFigures]):
    name: str = "forged"

    def problems(self) -> dict[str, list[str]]:
        return problems_by((f"{f.attack.group}: {f.attack.name}", f.problems()) for f in self.main.attacks)

    def expected_usage(self) -> dict[str, tuple[int, int]]:
        """Tenant -> (requests, output tokens) it legitimately sent: the served attacks expected to bill it."""
        out = dict.fromkeys(self.config.tenants, (0, 0))
        for f in self.main.attacks:
            a = f.attack
            if a.generates and a.billed_to != NOBODY and f.outcome.status == 200:
                requests, tokens = out[a.billed_to]
                out[a.billed_to] = (requests + 1, tokens + a.max_tokens)
        return out

    def checks(self) -> dict[str, bool]:
        f = self.main
        expected = self.expected_usage()
        statuses = {a.outcome.status for a in f.attacks}
        found = [p for ps in self.problems().values() for p in ps]
        return {
            f"all {len(f.attacks)} attacks answered as expected (status, code)": not any(
                "expected" in p or "code" in p for p in found
            ),
            "no 5xx, no transport error": not any((s or 0) >= 500 for s in statuses) and None not in statuses,
            "the controls work (the refusals mean something)": all(
                a.outcome.status == 200 for a in f.attacks if a.attack.group == "control"
            ),
            "victim: no reservation, no event, zero usage": f.usage[VICTIM] == (0, 0, 0, 0.0) and f.victim_events == 0,
            "victim: no GPU time under its cache scope on any replica": f.victim_salt_ms == 0.0,
            "every request served reached the replica under the billed tenant's cache scope": not any(
                p.startswith("reached") or "REACHED" in p for p in found
            ),
            "every served request billed to exactly the tenant expected; every refused one to nobody": not any(
                p.startswith(("billed", "refused", "BILLED")) for p in found
            ),
            "each tenant's usage == what it legitimately sent (requests, output tokens)": all(
                (f.usage[t][0], f.usage[t][2]) == expected[t] for t in self.config.tenants
            ),
        } | history_check(f.history, "each id keyed by the tenant it must bill: nothing to the victim; exact")

    def intro(self) -> list[str]:
        return [
            f"[bold]drill forged[/bold]: {len(self.main.attacks)} requests by {ATTACKER!r} and the delegates "
            f"{DELEGATE!r} / {OTHER_DELEGATE!r} try every header, body, query, credential and delegation trick "
            f"to be billed as {VICTIM!r} (who sends nothing), with {CLIENT!r} as the legitimate delegation target; "
            f"policy {self.main.policy}.",
            f"Claim: none is billed to another tenant; {VICTIM!r}'s usage stays exactly zero.",
        ]

    def body(self) -> list[Any]:
        f, problems = self.main, self.problems()
        rows: list[tuple[str, ...]] = []
        for group, mine in grouped(f.attacks, lambda a: a.attack.group).items():
            answers = Counter(f"{a.outcome.status}" + (f" {a.outcome.code}" if a.outcome.code else "") for a in mine)
            billed = Counter(t for a in mine for t, _ in a.reservations)
            wrong = sum(1 for a in mine if f"{group}: {a.attack.name}" in problems)
            rows.append(
                (group, str(len(mine)), fmt_counts(answers, " x"), fmt_counts(billed, " x") or "nobody", str(wrong))
            )
        refused = sum(1 for a in f.attacks if a.attack.billed_to == NOBODY)
        controls = sum(1 for a in f.attacks if a.attack.group == "control")
        caption = (
            f"load: {len(f.attacks)} requests in {f.seconds:.1f} s; faults injected: {len(f.attacks) - controls} "
            f"forgery attempts ({refused} must be refused, the rest served as the caller)"
        )
        by_group = table(
            "by group",
            ("group", "attacks", "answers", "billed to", "wrong"),
            rows,
            caption,
            ("group", "answers", "billed to"),
            ("answers",),
        )
        expected = self.expected_usage()
        columns = ("tenant", "requests", "input tok", "output tok", "GPU ms", "expected requests / output tok")
        rows = [
            (t, str(n), str(i), str(o), f"{g:,.1f}", f"{expected[t][0]} / {expected[t][1]}")
            for t, (n, i, o, g) in f.usage.items()
        ]
        usage = table("ledger usage per tenant (expected: what it legitimately sent)", columns, rows)
        wrong = sum(1 for ps in problems.values() for p in ps if "BILLED TO THE VICTIM" in p or p.startswith("billed"))
        lost = (
            f"lost: {wrong} requests billed to a wrong tenant; victim usage {f.usage[VICTIM]}, events "
            f"{f.victim_events}, GPU ms under its cache scope {f.victim_salt_ms:g}; converged: immediately "
            "(nothing to release)."
        )
        return [
            by_group,
            usage,
            lost,
            *self._notes(),
            *(f"[red]{name}[/red]: {'; '.join(ps)}" for name, ps in problems.items()),
            *history_lines(f.history),
        ]

    def _notes(self) -> list[str]:
        out = []
        forwarded = Counter(k for a in self.main.attacks for k in a.forwarded)
        if forwarded:
            out.append(
                f"[yellow]note[/yellow]: the gateway forwards untrusted tenant-like body fields to the replicas "
                f"({fmt_counts(forwarded, ' x')}); it drops only user, priority, request_id, cache_salt and vLLM's "
                "private fields. Nothing here acts on them (billing and the cache scope come from the credential), "
                "but a hop that read a body 'tenant' would be misled."
            )
        for a in self.main.attacks:
            if a.attack.name.startswith("two on-behalf-of headers") and a.outcome.status == 200:
                out.append(
                    "[yellow]note[/yellow]: with two X-Fairgate-On-Behalf-Of headers the gateway used one (billed to "
                    f"{', '.join(t for t, _ in a.reservations) or 'nobody'}) where two Authorization headers are "
                    "refused; a proxy in front that keeps the other would disagree about whom a request bills."
                )
        return out

    def verdict(self) -> str:
        done = "none billed to another tenant" if self.passed else "see the FAIL lines"
        return f"{len(self.main.attacks)} forgery attempts; {done}."


async def send_all(generator: LoadGenerator, todo: list[Attack]) -> list[RequestRecord]:
    """Every attack's answer, stage by stage (within a stage, all at once), in the order of ``todo``."""
    answers: dict[int, RequestRecord] = {}
    for stage in sorted({a.stage for a in todo}):
        batch = [i for i, a in enumerate(todo) if a.stage == stage]
        for i, record in zip(
            batch, await asyncio.gather(*(generator.send_http(todo[i].request) for i in batch)), strict=True
        ):
            answers[i] = record
    return [answers[i] for i in range(len(todo))]


def run(options: DrillOptions, config: ForgedConfig | None = None) -> ForgedResult:
    """Run the drill under ``options.policy`` (``seconds`` and ``compare`` do not apply)."""
    config = config or ForgedConfig()
    secret = secrets.token_urlsafe(32)
    with start_stack(config.spec(options.policy, options.in_processes(False), secret)) as stack:
        todo = attacks(config, stack.keys, secret.encode("utf-8"), stack.spec.model)
        return ForgedResult(config, asyncio.run(_run(stack, config, todo, options.policy)))


async def _run(stack: Stack, config: ForgedConfig, todo: list[Attack], policy: str) -> ForgedFigures:
    async with LoadGenerator(stack.url, stack.keys, stack.spec.model) as generator:
        answers = await send_all(generator, todo)
        seconds = generator.now()
    await asyncio.sleep(0.2)  # the last settlements
    async with stack.ledger() as ledger:
        reservations = await ledger.reservations()
        usage = {}
        for tenant in config.tenants:
            u = await ledger.usage(tenant, ALL_TIME_S)
            usage[tenant] = (u.requests, u.input_tokens, u.output_tokens, u.gpu_ms)
        victim_events = len(await ledger.events(VICTIM))
    by_id = {
        rid: [(r.tenant, r.billed.output_tokens) for r in found]
        for rid, found in grouped(reservations, lambda r: r.request_id).items()
    }
    bodies = stack.tapped("bodies")
    tapped = stack.is_tapped
    shared = Counter(a.request_id for a in todo)
    figures = []
    for attack, answer in zip(todo, answers, strict=True):
        found, received = by_id.get(attack.request_id, []), bodies.get(attack.request_id, [])
        if shared[attack.request_id] > 1:  # the request-id collisions: each attack's share is its tenant's
            found = [r for r in found if r[0] == attack.billed_to]
            received = [b for b in received if b.get("cache_salt") == tenant_tag(attack.billed_to)]
        forwarded = tuple(sorted({k for b in received for k in SUSPECT_FIELDS if k in b}))
        salts = tuple(str(b.get("cache_salt")) for b in received) if tapped else None
        figures.append(AttackFigures(attack, answer, tuple(found), salts, forwarded))
    victim_ms = sum(s.charge_ms_by_salt.get(tenant_tag(VICTIM), 0.0) for s in await stack.replica_stats())
    history = await check_stack(stack, answers)
    return ForgedFigures(policy, figures, usage, victim_events, victim_ms, seconds, history)

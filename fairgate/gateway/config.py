"""The gateway's configuration file (TOML): upstreams, policy, quotas, API keys, admin and delegation.

```toml
[gateway]
policy = "gpu_fair"                        # one of fairgate.core.POLICY_NAMES
ledger = "sqlite:///fairgate-ledger.db"    # sqlite:///relative.db, sqlite:////absolute.db, postgresql://…, redis://…
journal = "fairgate-journal.jsonl"         # emergency journal
default_max_tokens = 512                   # output cap of a request that gives none
max_body_bytes = 1048576
request_timeout_s = 600
delegation_token_lifetime_max_s = 86400    # an on-behalf-of token expiring further ahead is refused
max_header_bytes = 65536                   # request line and headers; longer: 431
max_headers = 100                          # header fields; more: 431
header_timeout_s = 10                      # a head not complete this long after its first byte: 408
body_timeout_s = 30                        # a body not complete this long after its head: 408
keep_alive_s = 5                           # a connection with no request open is closed after this
max_connections = 1000                     # open connections; a request beyond them gets a 503
event_log = "fairgate-events.jsonl"        # the request log (JSON lines: fairgate.gateway.eventlog); "": none
access_log = "-"                           # one JSON line per request: "-" stderr, a file, "": none
audit_log = "fairgate-audit.jsonl"         # one JSON line per configuration change (admin API, reload, keys)
dashboard_history = "fairgate-dashboard.jsonl"  # the dashboard's samples, kept across restarts; "": memory only

[[upstream]]                               # at least one; names unique
name = "emu-0"
url = "http://127.0.0.1:8001/v1"           # http(s) base URL ending in /v1
model = "fairgate-emulated"                # the engine's model name (sent upstream); several upstreams may serve one
pool = "fairgate-emulated"                 # optional, default: model; the upstreams sharing one fair queue
max_batch = 24                             # requests in flight at once on this upstream
iter_base_ms = 9.0                         # its cost model (the live meter's proportions)
iter_slope_ms = 0.55
prefill_ms_per_token = 0.06
max_model_len = 32768
kind = "vllm"                              # openai (default), vllm, sglang, llamacpp, tgi: fairgate.gateway.kinds
api_key_env = "VLLM_API_KEY"               # or api_key_file = "vllm.key": sent as Authorization: Bearer
headers = { "x-team" = "ml" }              # extra headers (no authorization, no hop-by-hop ones)
verify_tls = true                          # check an https upstream's certificate ...
ca_file = "ca.pem"                         # ... against this CA bundle (default: the system's)
connect_timeout_s = 5                      # connecting to the upstream
stream_idle_timeout_s = 60                 # longest wait for the next byte of a response

[[model]]                                  # optional: an alias and its approved pools (fairgate.gateway.aliases)
name = "chat"                              # what clients send as "model"
pools = ["fairgate-emulated"]              # pool names; the first is primary, the others fallbacks in order
quota_class = "chat"                       # optional, default: name; the ledger's model class

[policy]                                   # per-policy parameters, as a scenario's [policy]
[quotas]                                   # the ledger's quota document: tiers, defaults, tenants

[[key]]                                    # an API key, stored hashed (make one with `fairgate keys add`)
tenant = "acme"                            # a tenant of [quotas.tenants]
hash = "sha256$<64 hex digits>"            # the key's SHA-256 (a salted sha256$<salt hex>$<digest> works too)
name = "ci"                                # optional label
created = 2026-01-05T09:30:00Z             # optional: when it was made
expires = 2027-01-05T09:30:00Z             # optional: from then on it is refused (401, "expired")

[admin]
key_hashes = ["sha256$…"]                  # admin credentials, hashed like API keys

[delegation]
secret_env = "FAIRGATE_DELEGATION_SECRET"  # the NAME of the variable holding the HMAC secret, never the secret
delegates = ["batch-service"]              # tenants allowed to act for other tenants

[telemetry]                                # optional: OpenTelemetry traces (fairgate.gateway.telemetry)
otlp_traces_url = "http://127.0.0.1:4318/v1/traces"   # a collector's OTLP/HTTP endpoint; absent: off

[access]                                   # optional: which model names each tenant may send
default = ["chat"]                         # tenants without a table below (absent: every model)
tenants.acme.models = ["chat", "acme-lora"]  # acme's own list; any other name is 404 model_not_found to it
```

Relative paths (a ``sqlite:///`` ledger, the journal, an upstream's ``api_key_file`` and ``ca_file``) are
relative to the configuration file's folder and are resolved to absolute ones on loading. An upstream's key
is read when the gateway starts (``GatewayConfig.upstream_keys``): an unset or empty variable, or a missing,
unreadable or empty file, is a ``GatewayConfigError`` naming the key and the upstream.

Every key is checked: an unknown key at any level, a wrong type ("24" where a number belongs), a value
out of range, an unknown policy, a bad URL, a malformed key hash, two upstreams with one name, a key or
delegate naming a tenant absent from ``[quotas.tenants]``, a ``[[model]]`` naming a pool no upstream has (or
an alias clashing with another name), and every quota error raise
``GatewayConfigError``, whose message is one line ``<file>: <dotted.key>: <problem>``
(e.g. ``fairgate.toml: upstream[1].url: must be an http(s) base URL ending in /v1``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import ssl
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from fairgate.configerrors import pydantic_message
from fairgate.core.cost import CostModel
from fairgate.core.policies.factory import POLICY_NAMES, PolicySpec
from fairgate.core.policies.params import PolicyConfig
from fairgate.core.request import MAX_TOKENS_PER_REQUEST
from fairgate.gateway import aliases
from fairgate.gateway.aliases import EngineModelName, ModelConfig, PoolName, ServedModel
from fairgate.gateway.auth import DELEGATION_SECRET_BYTES_MIN, KEY_HASH_FORMS, TOKEN_LIFETIME_MAX_S, is_key_hash
from fairgate.gateway.credentials import CredentialError, header_problem, read_key
from fairgate.gateway.kinds import KINDS, Kind, KindName
from fairgate.ledger import SCHEMES
from fairgate.ledger.config import QuotaConfigError, Quotas, quotas_from_dict
from fairgate.tomlfile import read_toml


class GatewayConfigError(ValueError):
    """An invalid gateway configuration; ``str()`` is one line ``<file>: <dotted.key>: <problem>``."""


class _Strict(BaseModel):
    # strict: "24" or true where a number belongs is an error, not a conversion; floats must be finite.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


def _key_hash(text: str) -> str:
    if not is_key_hash(text):
        raise ValueError(f"must look like {KEY_HASH_FORMS} (make keys with `fairgate keys add`)")
    return text


KeyHash = Annotated[str, AfterValidator(_key_hash)]
Name = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
TenantName = Annotated[str, Field(min_length=1, max_length=200)]
ACCESS_LOG_STDERR = "-"  # ``[gateway].access_log`` value: the access log goes to stderr


def _file_name(value: str | None) -> str | None:
    """A file path as the config gives it: no control characters (a NUL made opening the file fail with a
    traceback), not blank (three spaces made a file named three spaces). ``""`` is left to mean "off"."""
    if value is None or value == "":
        return value
    if not value.strip():
        raise ValueError("a file path, not blank ('' turns it off where that is allowed)")
    if any(not c.isprintable() for c in value):
        raise ValueError("a file path without control characters")
    return value


FileName = Annotated[str, AfterValidator(_file_name)]
EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=200)]


class GatewaySection(_Strict):
    """``[gateway]``. After loading, ``ledger`` and ``journal`` are absolute (see ``GatewayConfig``)."""

    policy: str = "gpu_fair"
    ledger: str
    journal: Annotated[FileName, Field(min_length=1)] = "fairgate-journal.jsonl"
    # JSON lines; "": no file (the records go to the ``fairgate.gateway`` logger only)
    event_log: FileName | None = "fairgate-events.jsonl"
    # One JSON line per request answered (fairgate.gateway.accesslog): "-" stderr, a file path, or "" (off).
    access_log: FileName = "-"
    # The dashboard's samples, kept across restarts (fairgate.gateway.dashboard_history); "": memory only.
    dashboard_history: FileName | None = "fairgate-dashboard.jsonl"
    # One JSON line per configuration change (fairgate.gateway.audit): admin API writes, reloads, `fairgate keys`.
    audit_log: Annotated[FileName, Field(min_length=1)] = "fairgate-audit.jsonl"
    default_max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_PER_REQUEST)] = 512
    max_body_bytes: Annotated[int, Field(ge=1024, le=1024**3)] = 1024 * 1024
    request_timeout_s: Annotated[float, Field(gt=0, le=86_400)] = 600.0
    # Seconds between rounds of sharing the policy's counters and the meters' occupancy of the upstreams
    # with other gateway processes (0: off; then processes sharing a replica each bill all of its time).
    share_charges_s: Annotated[float, Field(ge=0, le=60)] = 0.25  # 0, or at least 0.05 (checked below)
    # The shared pool's latency objective: p99 time to first token (the dashboard's SLO line).
    slo_ttft_p99_s: Annotated[float, Field(gt=0, le=3600)] = 2.0
    # Seconds between liveness sweeps: heartbeat this process's reservations, expire abandoned ones.
    sweep_s: Annotated[float, Field(ge=0.05, le=3600)] = 10.0
    # How far ahead of its use an on-behalf-of token may expire: a leaked token stays good at most this long.
    delegation_token_lifetime_max_s: Annotated[float, Field(gt=0, le=365 * 86_400)] = TOKEN_LIFETIME_MAX_S
    # What a connection may make the gateway hold before its request reaches the app, and for how long
    # (enforced as bytes arrive: fairgate.gateway.serving). 64 KiB and 100 fields leave room for many
    # headers of a few KiB (nginx's default is 4 x 8 KiB, Apache's 100 fields of 8 KiB each).
    max_header_bytes: Annotated[int, Field(ge=1024, le=1024**2)] = 64 * 1024  # request line and headers
    max_headers: Annotated[int, Field(ge=8, le=10_000)] = 100
    header_timeout_s: Annotated[float, Field(ge=0.05, le=3600)] = 10.0  # from a head's first byte to its end
    # From the end of the head to the end of the body: the default body (1 MiB) at 35 KB/s.
    body_timeout_s: Annotated[float, Field(ge=0.05, le=3600)] = 30.0
    keep_alive_s: Annotated[float, Field(ge=0.05, le=3600)] = 5.0  # a connection with no request open
    max_connections: Annotated[int, Field(ge=1, le=1_000_000)] = 1000  # beyond: requests get a 503

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICY_NAMES:
            raise ValueError(f"unknown policy {value!r}; choose one of {', '.join(POLICY_NAMES)}")
        return value

    @field_validator("share_charges_s")
    @classmethod
    def _share_interval(cls, value: float) -> float:
        if 0 < value < 0.05:
            raise ValueError(f"{value:g} s: 0 (off) or at least 0.05 s (each round is ledger work)")
        return value

    @field_validator("ledger")
    @classmethod
    def _ledger_url(cls, value: str) -> str:
        scheme, sep, rest = value.partition("://")
        if not sep or scheme not in SCHEMES:
            raise ValueError(f"{value!r}: expected sqlite:///path.db, postgresql://... or redis://...")
        if scheme == "sqlite" and (not rest.startswith("/") or rest == "/"):
            raise ValueError(f"{value!r}: expected sqlite:///relative/path.db or sqlite:////absolute/path.db")
        if scheme != "sqlite" and not rest:
            raise ValueError(f"{value!r}: names no server")
        from fairgate.ledger import check_url

        check_url(value)  # the backend's own parameters (schema, prefix, database, ...)
        return value


class UpstreamConfig(_Strict):
    """One ``[[upstream]]``: an OpenAI-compatible server, the model it serves and its cost model."""

    name: Name
    url: str
    # The engine's model name, sent upstream in the body; also a plain model name clients may send (with
    # itself as the ledger's model class) unless a ``[[model]]`` lists this upstream's pool - which one must
    # when the name holds "/" or ":" (``fairgate.gateway.aliases``).
    model: EngineModelName
    pool: PoolName | None = None  # the upstreams sharing one fair queue; None: ``model``
    max_batch: Annotated[int, Field(ge=1, le=100_000)]
    iter_base_ms: Annotated[float, Field(ge=0.001, le=1e6)]
    iter_slope_ms: Annotated[float, Field(ge=0.0, le=1e5)]
    prefill_ms_per_token: Annotated[float, Field(ge=0.0, le=1e4)]
    max_model_len: Annotated[int, Field(ge=2, le=MAX_TOKENS_PER_REQUEST)]
    kind: KindName = "openai"  # the engine behind the URL: which fields it gets, its cache isolation
    # The upstream's API key: the NAME of an environment variable or the path of a file holding it (never
    # the key itself); sent as ``Authorization: Bearer``. Read when the gateway starts (``upstream_keys``).
    api_key_env: EnvName | None = None
    api_key_file: Annotated[str, Field(min_length=1)] | None = None
    headers: dict[str, Annotated[str, Field(max_length=8192)]] = Field(default_factory=dict)
    verify_tls: bool = True  # false: an https upstream's certificate is not checked (a test rig only)
    ca_file: Annotated[str, Field(min_length=1)] | None = None  # CA bundle (PEM) to check it against
    connect_timeout_s: Annotated[float, Field(gt=0, le=600)] = 5.0
    # The longest wait for the next byte of an upstream's answer (its first token included): a stream idle
    # this long is failed, so a stalled engine cannot hold a slot until request_timeout_s.
    # At least 0.05 s, as the gateway's other waits: a smaller one fails every stream as stalled.
    stream_idle_timeout_s: Annotated[float, Field(ge=0.05, le=86_400)] = 60.0
    # Size each request by the engine's own count of its prompt (chat template included) where its kind
    # has a tokenizer endpoint (``fairgate.gateway.tokenizer``); false, or no answer within
    # ``tokenize_timeout_s``: the gateway's estimate.
    tokenize: bool = True
    tokenize_timeout_s: Annotated[float, Field(ge=0.05, le=10)] = 0.5

    @field_validator("headers")
    @classmethod
    def _headers(cls, value: dict[str, str]) -> dict[str, str]:
        seen: dict[str, str] = {}
        for name, text in value.items():
            problem = header_problem(name, text)
            if problem is not None:
                raise ValueError(problem)
            if name.lower() in seen:  # header names are case-insensitive: which one is sent is the client's pick
                raise ValueError(f"{name}: the same header as {seen[name.lower()]}")
            seen[name.lower()] = name
        return value

    @model_validator(mode="after")
    def _one_key_source(self) -> UpstreamConfig:
        if self.api_key_env is not None and self.api_key_file is not None:
            raise ValueError("api_key_env: give api_key_env or api_key_file, not both")
        if self.ca_file is not None and not self.verify_tls:
            raise ValueError("ca_file: a CA bundle with verify_tls = false would not be used")
        if self.ca_file is not None and not self.url.startswith("https://"):
            raise ValueError(f"ca_file: a CA bundle is used only with an https:// url, and url is {self.url!r}")
        return self

    @property
    def engine(self) -> Kind:
        """What the gateway knows about this upstream's engine (``fairgate.gateway.kinds``)."""
        return KINDS[self.kind]

    @field_validator("url")
    @classmethod
    def _base_url(cls, value: str) -> str:
        problem = "must be an http(s) base URL ending in /v1, e.g. http://127.0.0.1:8001/v1"
        try:
            parts = urlsplit(value)
            port = parts.port  # raises ValueError on a bad port
        except ValueError:
            raise ValueError(problem) from None
        del port
        if (
            parts.scheme not in ("http", "https")
            or not parts.hostname
            or not parts.path.endswith("/v1")
            or parts.query
            or parts.fragment
            or re.search(r"\s", value)
        ):
            raise ValueError(problem)
        return value

    @property
    def pool_name(self) -> str:
        """The pool this upstream serves in (``pool``, default ``model``)."""
        return self.pool if self.pool is not None else self.model

    @property
    def cost(self) -> CostModel:
        """This upstream's cost model."""
        return CostModel(self.iter_base_ms, self.iter_slope_ms, self.prefill_ms_per_token, self.max_batch)


class KeyConfig(_Strict):
    """One ``[[key]]``: a tenant's API key, hashed, with an optional label, when it was made and when it stops
    working (TOML offset date-times, e.g. ``2027-01-01T00:00:00Z``; ``fairgate keys add`` / ``rotate`` write
    them)."""

    tenant: TenantName
    hash: KeyHash
    name: Annotated[str, Field(max_length=200)] | None = None
    created: AwareDatetime | None = None
    expires: AwareDatetime | None = None

    @property
    def expires_s(self) -> float | None:
        """``expires`` in seconds since the epoch (None: never)."""
        return None if self.expires is None else self.expires.timestamp()


class AdminConfig(_Strict):
    """``[admin]``: hashed admin credentials."""

    key_hashes: list[KeyHash] = Field(default_factory=list)


class TelemetryConfig(_Strict):
    """``[telemetry]``: OpenTelemetry traces (``fairgate.gateway.telemetry``), off unless ``otlp_traces_url``
    names a collector's OTLP/HTTP traces endpoint."""

    otlp_traces_url: Annotated[str, Field(max_length=2000)] | None = None
    service_name: Annotated[str, Field(min_length=1, max_length=200)] = "fairgate"
    headers: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9-]{1,100}$")], str] = Field(default_factory=dict)

    @field_validator("otlp_traces_url")
    @classmethod
    def _collector_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            parts = urlsplit(value)
            _ = parts.port  # a port out of range or not a number raises ValueError
        except ValueError as exc:
            raise ValueError(f"not a URL ({exc})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname or any(not c.isprintable() for c in value):
            raise ValueError("an http(s) URL with a host, e.g. http://127.0.0.1:4318/v1/traces")
        if parts.path in ("", "/"):
            raise ValueError(f"give the traces path too: {value.rstrip('/')}/v1/traces (OTLP/HTTP's)")
        return value

    @field_validator("headers")
    @classmethod
    def _header_values(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            if any(not c.isprintable() for c in text):
                raise ValueError(f"{name}: a header value without control characters")
        return value

    @model_validator(mode="after")
    def _sdk_installed(self) -> TelemetryConfig:
        if self.otlp_traces_url is not None and importlib.util.find_spec("opentelemetry.sdk") is None:
            raise ValueError("otlp_traces_url: the OpenTelemetry SDK is not installed: pip install 'fairgate[otel]'")
        return self


class TenantAccess(_Strict):
    """``[access.tenants.NAME]``: the model names (aliases, plain models, adapters) the tenant may send."""

    models: list[Annotated[str, Field(min_length=1, max_length=200)]]


class AccessConfig(_Strict):
    """``[access]``: which model names each tenant may send (seed 003: "model adapters ... must include
    verified tenant scopes"). ``default``: what a tenant without a table of its own may send (absent: every
    model); ``tenants``: a tenant's own list, which replaces the default. A name a tenant may not send is to
    it a model that does not exist (404 ``model_not_found``, not listed by ``/v1/models``)."""

    default: list[Annotated[str, Field(min_length=1, max_length=200)]] | None = None
    tenants: dict[TenantName, TenantAccess] = Field(default_factory=dict)

    def allows(self, tenant: str, model: str) -> bool:
        """Whether ``tenant`` may send the model name ``model``."""
        own = self.tenants.get(tenant)
        listed = own.models if own is not None else self.default
        return listed is None or model in listed


class DelegationConfig(_Strict):
    """``[delegation]``: the environment variable holding the on-behalf-of secret, and who may delegate (how
    long a token may live is ``[gateway].delegation_token_lifetime_max_s``)."""

    secret_env: EnvName = "FAIRGATE_DELEGATION_SECRET"
    delegates: list[TenantName] = Field(default_factory=list)


class GatewayConfig(_Strict):
    """A validated gateway configuration (build it with ``load_gateway_config``).

    Attributes:
        gateway: ``[gateway]``, with ``ledger`` and ``journal`` resolved to absolute paths.
        upstreams: the ``[[upstream]]`` tables, in file order.
        models: the ``[[model]]`` tables (aliases and their pools), in file order.
        policy: ``[policy]``, per-policy parameters.
        keys: the ``[[key]]`` tables.
        admin: ``[admin]``.
        delegation: ``[delegation]``.
        access: ``[access]``, the model names each tenant may send.
        telemetry: ``[telemetry]``, where traces go (off by default).
        quotas: the validated ``[quotas]`` (a ``fairgate.ledger.config.Quotas``).
        path: the file it was read from.
    """

    gateway: GatewaySection
    upstreams: list[UpstreamConfig] = Field(default_factory=list, alias="upstream")
    models: list[ModelConfig] = Field(default_factory=list, alias="model")
    policy: PolicyConfig = PolicyConfig()
    quotas_document: dict[str, Any] = Field(alias="quotas")
    keys: list[KeyConfig] = Field(default_factory=list, alias="key")
    admin: AdminConfig = AdminConfig()
    delegation: DelegationConfig = DelegationConfig()
    access: AccessConfig = AccessConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    _path: Path = PrivateAttr(default=Path("<gateway config>"))
    _quotas: Quotas | None = PrivateAttr(default=None)
    _served: dict[str, ServedModel] | None = PrivateAttr(default=None)

    @property
    def path(self) -> Path:
        return self._path

    @property
    def quotas(self) -> Quotas:
        if self._quotas is None:
            self._quotas = _quotas(self._path, self.quotas_document)
        return self._quotas

    @property
    def ledger_url(self) -> str:
        """The ledger URL (a ``sqlite:///`` path made absolute)."""
        return self.gateway.ledger

    @property
    def event_log_path(self) -> Path | None:
        """The structured request log (JSON lines), absolute; None: not written."""
        return Path(self.gateway.event_log) if self.gateway.event_log else None

    @property
    def dashboard_history_path(self) -> Path | None:
        """The dashboard's samples file (``fairgate.gateway.dashboard_history``), absolute; None: not kept."""
        return Path(self.gateway.dashboard_history) if self.gateway.dashboard_history else None

    @property
    def audit_log_path(self) -> Path:
        """The audit log of configuration changes (JSON lines: ``fairgate.gateway.audit``), absolute."""
        return Path(self.gateway.audit_log)

    @property
    def journal_path(self) -> Path:
        """The emergency journal, absolute."""
        return Path(self.gateway.journal)

    @property
    def served(self) -> dict[str, ServedModel]:
        """Every model name clients may send -> its pools and quota class: the ``[[model]]`` aliases, then
        the plain upstream models (``fairgate.gateway.aliases.served_models``)."""
        if self._served is None:
            self._served = aliases.served_models(self.models, self.upstreams)
        return self._served

    def with_tables(self, new: GatewayConfig, fields: Iterable[str]) -> GatewayConfig:
        """This configuration with ``new``'s ``fields`` (field names: ``keys``, ``quotas_document``, ...) in place
        of its own, the rest of it kept (what a reload applies); its path stays this one's."""
        names = tuple(fields)
        merged = self.model_copy(update={name: getattr(new, name) for name in names})
        merged._quotas = new.quotas if "quotas_document" in names else self._quotas
        return merged

    def upstreams_for(self, model: str) -> list[UpstreamConfig]:
        """The upstreams that may serve the model name ``model``, of all its pools (empty for an unknown
        model)."""
        served = self.served.get(model)
        if served is None:
            return []
        return [u for u in self.upstreams if u.pool_name in served.pools]

    def policy_spec(self, name: str | None = None) -> PolicySpec:
        """The ``PolicySpec`` of ``name`` (default ``[gateway].policy``) with this file's ``[policy]`` parameters.

        Without ``[policy.slot_cap]``, ``max_running`` is the upstreams' total ``max_batch`` over the tenants.
        """
        params: dict[str, dict[str, Any]] = {}
        for policy_name, value in self.policy:
            if value is not None:
                params[policy_name] = value.model_dump(exclude_none=True)
        if "slot_cap" not in params:
            tenants = max(len(self.quotas.tenants), 1)
            params["slot_cap"] = {"max_running": max(1, sum(u.max_batch for u in self.upstreams) // tenants)}
        return PolicySpec(name or self.gateway.policy, params)

    def upstream_keys(
        self, environ: Mapping[str, str] | None = None, names: Iterable[str] | None = None
    ) -> dict[str, SecretStr]:
        """Each upstream's API key (by upstream name; an upstream without ``api_key_env`` or
        ``api_key_file`` has none), read now from ``environ`` (default ``os.environ``) or the file; only
        those of ``names`` when given (a reload reads the keys of the upstreams it adds).

        Raises:
            GatewayConfigError: a variable unset or empty, a file missing, unreadable or empty; the message
                names the key, the upstream and the variable or file, never the key's value.
        """
        keys: dict[str, SecretStr] = {}
        wanted = None if names is None else set(names)
        for i, upstream in enumerate(self.upstreams):
            if wanted is not None and upstream.name not in wanted:
                continue
            try:
                key = read_key(upstream.api_key_env, upstream.api_key_file, environ)
            except CredentialError as exc:
                source = "api_key_env" if upstream.api_key_env is not None else "api_key_file"
                raise GatewayConfigError(
                    f"{self._path}: upstream[{i}].{source}: {exc} (the API key of upstream {upstream.name!r})"
                ) from None
            if key is not None:
                keys[upstream.name] = key
        return keys

    def delegation_secret(self, environ: Mapping[str, str] | None = None) -> bytes | None:
        """The on-behalf-of secret from ``$[delegation].secret_env`` (``None`` when the variable is unset).

        Raises:
            GatewayConfigError: the variable holds fewer than 16 bytes.
        """
        value = (os.environ if environ is None else environ).get(self.delegation.secret_env)
        if value is None:
            return None
        secret = value.encode("utf-8")
        if len(secret) < DELEGATION_SECRET_BYTES_MIN:
            raise GatewayConfigError(
                f"{self._path}: delegation.secret_env: ${self.delegation.secret_env} holds "
                f"{len(secret)} bytes; a delegation secret needs at least "
                f"{DELEGATION_SECRET_BYTES_MIN}"
            )
        return secret


def _message(path: Path | str, error: ValidationError) -> str:
    return pydantic_message(
        path,
        error,
        lambda location: (
            "must be an environment variable name"
            if location.endswith(("secret_env", "api_key_env"))
            else "must be a letter or digit followed by letters, digits, '.', '_' or '-'"
        ),
    )


_QUOTAS_SOURCE = "\x00quotas\x00"


def _quotas(path: Path, document: dict[str, Any]) -> Quotas:
    try:
        return quotas_from_dict(document, _QUOTAS_SOURCE)
    except QuotaConfigError as exc:
        text = str(exc)
        if not text.startswith(_QUOTAS_SOURCE + ": "):
            raise GatewayConfigError(f"{path}: quotas: {text}") from None
        rest = text[len(_QUOTAS_SOURCE) + 2 :]
        if rest.startswith("(top level): "):
            rest = rest[len("(top level): ") :].replace("Value error, ", "")
            raise GatewayConfigError(f"{path}: quotas: {rest}") from None
        raise GatewayConfigError(f"{path}: quotas.{rest}") from None


def _resolve(path: Path, gateway: GatewaySection) -> GatewaySection:
    folder = path.parent
    ledger = gateway.ledger
    if ledger.startswith("sqlite:///"):
        ledger = "sqlite:///" + str((folder / ledger[len("sqlite:///") :]).resolve())
    journal = str((folder / gateway.journal).resolve())
    event_log = str((folder / gateway.event_log).resolve()) if gateway.event_log else None
    access_log = gateway.access_log
    if access_log not in ("", ACCESS_LOG_STDERR):
        access_log = str((folder / access_log).resolve())
    audit_log = str((folder / gateway.audit_log).resolve())
    history = str((folder / gateway.dashboard_history).resolve()) if gateway.dashboard_history else None
    update = {
        "ledger": ledger,
        "journal": journal,
        "event_log": event_log,
        "access_log": access_log,
        "audit_log": audit_log,
        "dashboard_history": history,
    }
    return gateway.model_copy(update=update)


def _check_ca_file(path: Path, index: int, ca_file: Path) -> None:
    """A CA bundle the TLS layer can load (checked here: the gateway would otherwise fail as it starts)."""
    where = f"{path}: upstream[{index}].ca_file: {ca_file}"
    if not ca_file.is_file():
        raise GatewayConfigError(f"{where} is not a file")
    try:
        ssl.create_default_context(cafile=str(ca_file))
    except (ssl.SSLError, OSError, ValueError):
        raise GatewayConfigError(f"{where} holds no PEM certificate") from None


def _check_model_classes(path: Path, config: GatewayConfig, quotas: Quotas) -> None:
    """Every tenant's ``model_class`` table names a class some model is charged to: a misspelt one would
    otherwise be accepted and never apply. Raises ``GatewayConfigError`` naming the table."""
    classes = sorted({served.quota_class for served in aliases.served_models(config.models, config.upstreams).values()})
    for tenant in quotas.tenants.values():
        for model_class in tenant.by_model_class:
            if model_class not in classes:
                raise GatewayConfigError(
                    f"{path}: quotas.tenants.{tenant.name}.model_class.{model_class}: no model is charged to class "
                    f"{model_class!r} (classes: {', '.join(classes)}; a [[model]]'s quota_class, else its name)"
                )
    _check_prices(path, classes, quotas)


def _check_prices(path: Path, classes: list[str], quotas: Quotas) -> None:
    """Every ``[quotas.pricing.model_class]`` table names a served class, and with a spend budget set every
    served class has a price: an unpriced class would cost nothing and so run past the budget."""
    for model_class in quotas.prices:
        if model_class not in classes:
            raise GatewayConfigError(
                f"{path}: quotas.pricing.model_class.{model_class}: no model is charged to class {model_class!r} "
                f"(classes: {', '.join(classes)})"
            )
    unpriced = [model_class for model_class in classes if model_class not in quotas.prices]
    if quotas.spend_limited and unpriced:
        raise GatewayConfigError(
            f"{path}: quotas.pricing.model_class: a spend_budget is set but class {unpriced[0]!r} has no price "
            "(its requests would cost nothing and run past every budget): give it a "
            "[quotas.pricing.model_class.NAME] table"
        )


def _check_distinct_files(path: Path, config: GatewayConfig) -> None:
    """The files the gateway writes are distinct, and none is the configuration itself (an access log on
    the config appended JSON to it; one shared with the request log made ``fairgate explain`` fail)."""
    ledger = config.gateway.ledger
    named = {"the configuration": str(path.resolve())}
    if ledger.startswith("sqlite:///"):
        named["gateway.ledger"] = ledger[len("sqlite:///") :].split("?")[0]
    for key in ("journal", "event_log", "access_log", "audit_log", "dashboard_history"):
        value = getattr(config.gateway, key)
        if value and value != ACCESS_LOG_STDERR:
            where = str(Path(value).resolve())
            for other, taken in named.items():
                if where == taken:
                    raise GatewayConfigError(
                        f"{path}: gateway.{key}: {value} is also {other}; give it a file of its own"
                    )
            named[f"gateway.{key}"] = where


def _check_access(path: Path, config: GatewayConfig, quotas: Quotas) -> None:
    """Every ``[access]`` list names models clients may send, and every tenant table a tenant: a misspelt
    name would otherwise lock a tenant out of a model, or leave one open. Raises ``GatewayConfigError``."""
    served = aliases.served_models(config.models, config.upstreams)
    lists = [("access.default", config.access.default or [])]
    for tenant, access in config.access.tenants.items():
        if tenant not in quotas.tenants:
            raise GatewayConfigError(
                f"{path}: access.tenants.{tenant}: unknown tenant {tenant!r} "
                f"(tenants in [quotas.tenants]: {', '.join(quotas.tenants) or 'none'})"
            )
        lists.append((f"access.tenants.{tenant}.models", access.models))
    for where, names in lists:
        for i, name in enumerate(names):
            if name not in served:
                raise GatewayConfigError(
                    f"{path}: {where}[{i}]: no model {name!r} (models clients may send: {', '.join(served)})"
                )


def _resolve_upstream(path: Path, upstream: UpstreamConfig) -> UpstreamConfig:
    files = {
        name: str((path.parent / value).resolve())
        for name in ("api_key_file", "ca_file")
        if (value := getattr(upstream, name)) is not None
    }
    return upstream.model_copy(update=files) if files else upstream


def gateway_config_from_dict(data: dict[str, Any], path: str | Path) -> GatewayConfig:
    """Validate a parsed gateway document read from ``path`` (used for messages and relative paths).

    Raises:
        GatewayConfigError: any invalid key or value (see the module docstring).
    """
    path = Path(path)
    try:
        config = GatewayConfig.model_validate(data)
    except ValidationError as exc:
        raise GatewayConfigError(_message(path, exc)) from None
    if not config.upstreams:
        raise GatewayConfigError(f"{path}: upstream: no upstreams; add at least one [[upstream]] table")
    seen: dict[str, int] = {}
    urls: dict[str, int] = {}
    for i, upstream in enumerate(config.upstreams):
        if upstream.name in seen:
            raise GatewayConfigError(
                f"{path}: upstream[{i}].name: {upstream.name!r} is also upstream[{seen[upstream.name]}]'s name"
            )
        seen[upstream.name] = i
        # One replica and model listed twice would get two meters that each see half of its batch (billing both
        # halves as if alone) and twice its slots. One URL for two models is an engine serving both (vLLM's LoRA
        # adapters).
        served = f"{upstream.url.rstrip('/')} {upstream.model}"
        if served in urls:
            raise GatewayConfigError(
                f"{path}: upstream[{i}].url: {upstream.url!r} serving {upstream.model!r} "
                f"is upstream[{urls[served]}] again"
            )
        urls[served] = i
    problem = aliases.check(config.models, config.upstreams)
    if problem is not None:
        raise GatewayConfigError(f"{path}: {problem}")
    quotas = _quotas(path, config.quotas_document)
    _check_model_classes(path, config, quotas)
    _check_access(path, config, quotas)
    tenants = ", ".join(quotas.tenants) or "none"
    hashes: dict[str, str] = {}
    for i, key in enumerate(config.keys):
        if key.tenant not in quotas.tenants:
            raise GatewayConfigError(
                f"{path}: key[{i}].tenant: unknown tenant {key.tenant!r} (tenants in [quotas.tenants]: {tenants})"
            )
        if key.hash in hashes:
            raise GatewayConfigError(f"{path}: key[{i}].hash: the same hash as {hashes[key.hash]}")
        hashes[key.hash] = f"key[{i}]"
    for i, stored in enumerate(config.admin.key_hashes):
        if stored in hashes:
            raise GatewayConfigError(
                f"{path}: admin.key_hashes[{i}]: the same hash as {hashes[stored]}; "
                "admin credentials must be keys of their own"
            )
        hashes[stored] = f"admin.key_hashes[{i}]"
    for i, delegate in enumerate(config.delegation.delegates):
        if delegate not in quotas.tenants:
            raise GatewayConfigError(
                f"{path}: delegation.delegates[{i}]: unknown tenant {delegate!r} "
                f"(tenants in [quotas.tenants]: {tenants})"
            )
    for i, upstream in enumerate(config.upstreams):
        if upstream.ca_file is not None:
            _check_ca_file(path, i, path.parent / upstream.ca_file)
    upstreams = [_resolve_upstream(path, u) for u in config.upstreams]
    config = config.model_copy(update={"gateway": _resolve(path, config.gateway), "upstreams": upstreams})
    _check_distinct_files(path, config)
    config._path = path
    config._quotas = quotas
    return config


def load_gateway_config(path: str | Path) -> GatewayConfig:
    """Read and validate the gateway configuration at ``path``.

    Raises:
        GatewayConfigError: a missing, unreadable or non-TOML file, or any invalid key or value; one line
            ``<file>: <dotted.key>: <problem>``.
    """
    data = read_toml(path, GatewayConfigError, "gateway configuration")
    return gateway_config_from_dict(data, path)


__all__ = [
    "AdminConfig",
    "DelegationConfig",
    "GatewayConfig",
    "GatewayConfigError",
    "GatewaySection",
    "KeyConfig",
    "ModelConfig",
    "ServedModel",
    "UpstreamConfig",
    "gateway_config_from_dict",
    "load_gateway_config",
]

"""The gateway configuration: the example loads; every malformed file gives one line naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fairgate.core import POLICY_NAMES, PolicySpec
from fairgate.gateway.auth import hash_api_key
from fairgate.gateway.config import GatewayConfigError, load_gateway_config
from fairgate.ledger.config import Quotas

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "config" / "fairgate.example.toml"
EXAMPLE_TEXT = EXAMPLE.read_text()
HASH = hash_api_key("fg-test-key")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fairgate.toml"
    path.write_text(text)
    return path


def with_key(text: str, tenant: str = "chat", hash_: str = HASH, extra: str = "") -> str:
    return text + f'\n[[key]]\ntenant = "{tenant}"\nhash = "{hash_}"\n{extra}'


def test_example_loads() -> None:
    config = load_gateway_config(EXAMPLE)
    assert config.path == EXAMPLE
    assert config.gateway.policy == "gpu_fair"
    assert [u.name for u in config.upstreams] == ["emu-0", "emu-1"]
    assert {u.url for u in config.upstreams} == {"http://127.0.0.1:8001/v1", "http://127.0.0.1:8002/v1"}
    assert [u.name for u in config.upstreams_for("fairgate-emulated")] == ["emu-0", "emu-1"]
    assert isinstance(config.quotas, Quotas)
    assert set(config.quotas.tenants) == {"classify", "chat", "summarise", "agent", "batch"}
    assert all(config.quotas.tenant(t).weight == 1.0 for t in ("classify", "chat", "summarise", "agent"))
    assert config.quotas.tenant("batch").priority == "batch"
    assert set(config.quotas.tiers) == {"free", "paid"}
    assert config.keys == []
    assert config.delegation.delegates == ["batch"]
    spec = config.policy_spec()
    assert isinstance(spec, PolicySpec) and spec.name == "gpu_fair"
    assert config.policy_spec("drr").params["drr"] == {"quantum_ms": 50.0}
    assert config.upstreams[0].cost.max_batch == 24


def test_relative_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    config = load_gateway_config(write(tmp_path, EXAMPLE_TEXT))
    assert config.ledger_url == f"sqlite:///{(tmp_path / 'state' / 'fairgate-ledger.db').resolve()}"
    assert config.journal_path == (tmp_path / "state" / "fairgate-journal.jsonl").resolve()
    absolute = EXAMPLE_TEXT.replace('"sqlite:///state/fairgate-ledger.db"', '"sqlite:////var/tmp/x.db"')
    assert load_gateway_config(write(tmp_path, absolute)).ledger_url == "sqlite:////var/tmp/x.db"
    redis = EXAMPLE_TEXT.replace('"sqlite:///state/fairgate-ledger.db"', '"redis://127.0.0.1:6379/0"')
    assert load_gateway_config(write(tmp_path, redis)).ledger_url == "redis://127.0.0.1:6379/0"


def test_an_empty_event_log_means_no_file(tmp_path: Path) -> None:
    text = EXAMPLE_TEXT.replace('event_log = "state/fairgate-events.jsonl"', 'event_log = ""')
    assert text != EXAMPLE_TEXT
    config = load_gateway_config(write(tmp_path, text))
    assert config.gateway.event_log is None and config.event_log_path is None
    assert load_gateway_config(write(tmp_path, EXAMPLE_TEXT)).event_log_path == tmp_path / "state/fairgate-events.jsonl"


def test_default_slot_cap_splits_the_upstreams_batch_among_tenants(tmp_path: Path) -> None:
    text = EXAMPLE_TEXT.replace("slot_cap = { max_running = 9 }", "")
    spec = load_gateway_config(write(tmp_path, text)).policy_spec("slot_cap")
    assert spec.params["slot_cap"] == {"max_running": 48 // 5}


def test_keys_admin_and_delegation(tmp_path: Path) -> None:
    admin = hash_api_key("fg-admin")
    text = with_key(EXAMPLE_TEXT, extra='name = "ci"\n').replace("key_hashes = []", f'key_hashes = ["{admin}"]')
    config = load_gateway_config(write(tmp_path, text))
    assert [(k.tenant, k.hash, k.name) for k in config.keys] == [("chat", HASH, "ci")]
    assert config.admin.key_hashes == [admin]
    assert config.delegation_secret({}) is None
    assert config.delegation_secret({"FAIRGATE_DELEGATION_SECRET": "s" * 32}) == b"s" * 32
    with pytest.raises(GatewayConfigError, match=r"delegation.secret_env: .* at least 16"):
        config.delegation_secret({"FAIRGATE_DELEGATION_SECRET": "short"})


def sub(old: str, new: str, count: int = 1):
    def edit(text: str) -> str:
        assert old in text, old
        return text.replace(old, new, count)

    return edit


def append(extra: str):
    return lambda text: text + "\n" + extra + "\n"


CASES = [
    # unknown keys, at every level
    (append("[bogus]\nx = 1"), "bogus: unknown key"),
    (sub("max_body_bytes =", "max_body_byte ="), "gateway.max_body_byte: unknown key"),
    (sub("max_batch = 24", "max_bach = 24"), "upstream[0].max_bach: unknown key"),
    (sub("drr = { quantum_ms = 50.0 }", "drr = { quantum_ms = 50.0, speed = 2 }"), "policy.drr.speed: unknown key"),
    (sub("\n[policy]\n", "\n[policy]\nfastest = {}\n"), "policy.fastest: unknown key"),
    (sub("max_queued = 64", "max_queue = 64"), "quotas.defaults.max_queue: unknown key"),
    (
        sub('[quotas.tenants.chat]\ntier = "paid"', '[quotas.tenants.chat]\ntier = "paid"\ncolour = "red"'),
        "quotas.tenants.chat.colour: unknown key",
    ),
    (lambda t: with_key(t, extra="colour = 1\n"), "key[0].colour: unknown key"),
    (sub("key_hashes = []", "key_hashes = []\nusers = []"), "admin.users: unknown key"),
    (sub('delegates = ["batch"]', 'delegates = ["batch"]\nsecret = "x"'), "delegation.secret: unknown key"),
    # [gateway]
    (sub('policy = "gpu_fair"', 'policy = "fastest"'), "gateway.policy: unknown policy 'fastest'"),
    (sub('ledger = "sqlite:///state/fairgate-ledger.db"', 'ledger = "mysql://db"'), "gateway.ledger: 'mysql://db'"),
    (sub('ledger = "sqlite:///state/fairgate-ledger.db"', 'ledger = "sqlite://x.db"'), "gateway.ledger:"),
    (lambda t: re.sub(r"^ledger = .*\n", "", t, flags=re.M), "gateway.ledger: missing required key"),
    # Found by a helper: these passed the config check, then failed the gateway's start-up with a traceback.
    (
        sub('ledger = "sqlite:///state/fairgate-ledger.db"', 'ledger = "postgresql://127.0.0.1/test?schema=bad;drop"'),
        "gateway.ledger: ledger URL: schema 'bad;drop' must match",
    ),
    (
        sub('ledger = "sqlite:///state/fairgate-ledger.db"', 'ledger = "redis://127.0.0.1:6379/0?foo=1"'),
        "gateway.ledger: ledger URL 'redis://127.0.0.1:6379/0?foo=1': unknown parameter(s) 'foo'",
    ),
    (
        sub("[quotas.tenants.batch]", '[quotas.tenants."a\\u0000b"]\n[quotas.tenants.batch]'),
        "quotas.tenants.'a\\x00b': the name contains a control character",
    ),
    (sub('model = "fairgate-emulated"', 'model = "m\\t"', 1), "upstream[0].model: must be a letter or digit"),
    (sub("default_max_tokens = 512", "default_max_tokens = 0"), "gateway.default_max_tokens: Input should be"),
    (sub("request_timeout_s = 600", "request_timeout_s = nan"), "gateway.request_timeout_s:"),
    # Found by a helper: an idle gateway spun a core on these.
    (sub("share_charges_s = 0.25", "share_charges_s = 1e-9"), "gateway.share_charges_s: 1e-09 s: 0 (off) or at least"),
    (sub("sweep_s = 10", "sweep_s = 1e-300"), "gateway.sweep_s: Input should be greater than or equal to 0.05"),
    # [[upstream]]
    (sub('name = "emu-1"', 'name = "emu-0"'), "upstream[1].name: 'emu-0' is also upstream[0]'s name"),
    (
        sub("http://127.0.0.1:8002/v1", "http://127.0.0.1:8001/v1"),  # found by a helper: two meters, one replica
        "upstream[1].url: 'http://127.0.0.1:8001/v1' serving 'fairgate-emulated' is upstream[0] again",
    ),
    (sub("http://127.0.0.1:8002/v1", "ftp://127.0.0.1:8002/v1"), "upstream[1].url: must be an http(s) base URL"),
    (sub("http://127.0.0.1:8002/v1", "http://127.0.0.1:8002"), "upstream[1].url: must be an http(s) base URL"),
    (sub("http://127.0.0.1:8002/v1", "http://127.0.0.1:99999/v1"), "upstream[1].url: must be"),
    (sub("http://127.0.0.1:8002/v1", "http:///v1"), "upstream[1].url: must be"),
    (sub("max_batch = 24", 'max_batch = "24"'), "upstream[0].max_batch: Input should be a valid integer"),
    (sub("iter_base_ms = 9.0", "iter_base_ms = inf"), "upstream[0].iter_base_ms:"),
    (sub('name = "emu-0"', 'name = "emu 0"'), "upstream[0].name: must be a letter or digit"),
    (sub('model = "fairgate-emulated"\n', "", 2), "upstream[0].model: missing required key"),
    (lambda t: t.split("[[upstream]]")[0] + "\n[policy]\n" + t.split("\n[policy]\n")[1], "upstream: no upstreams"),
    # [policy]
    (sub("drr = { quantum_ms = 50.0 }", "drr = { quantum_ms = -1.0 }"), "policy.drr.quantum_ms:"),
    # [quotas], prefixed
    (sub("requests_per_minute = 600", "requests_per_minute = -1"), "quotas.defaults.requests_per_minute:"),
    (
        sub("output_tokens_burst = 32768", "output_tokens_burst = 100"),
        "quotas.defaults.output_tokens_burst: 100 is below max_tokens_per_request",
    ),
    (
        sub(
            "[quotas.tenants.batch]                     # the internal batch service: yields to interactive tenants\n"
            'tier = "free"',
            '[quotas.tenants.batch]\ntier = "gold"',
        ),
        "quotas: tenant 'batch': unknown tier 'gold'",
    ),
    (
        sub(
            "[quotas.tenants.chat]",
            "[quotas.tenants.chat.model_class.fairgate-emulatd]\nmax_concurrent = 2\n[quotas.tenants.chat]",
        ),
        "quotas.tenants.chat.model_class.fairgate-emulatd: no model is charged to class 'fairgate-emulatd' "
        "(classes: fairgate-emulated;",
    ),
    (lambda t: t.replace("[quotas.", "[quota."), "quota: unknown key"),
    (lambda t: t.split("[quotas.tiers.free]")[0] + "[admin]" + t.split("[admin]")[1], "quotas: missing required key"),
    (lambda t: t.replace("[gateway]", "[gateways]"), "gateways: unknown key"),
    # [[key]]
    (lambda t: with_key(t, tenant="nobody"), "key[0].tenant: unknown tenant 'nobody'"),
    (lambda t: with_key(t, hash_="sha256$abc$def"), "key[0].hash: must look like sha256$<64 hex digits>"),
    (lambda t: with_key(t, hash_="md5$" + HASH.split("$", 1)[1]), "key[0].hash: must look like"),
    (lambda t: with_key(t, hash_=HASH.upper()), "key[0].hash: must look like"),
    (lambda t: with_key(with_key(t), tenant="agent"), "key[1].hash: the same hash as key[0]"),
    (lambda t: with_key(t, extra="name = 3\n"), "key[0].name: Input should be a valid string"),
    # [admin], [delegation]
    (sub("key_hashes = []", 'key_hashes = ["plain-text-password"]'), "admin.key_hashes[0]: must look like"),
    (
        lambda t: with_key(t).replace("key_hashes = []", f'key_hashes = ["{HASH}"]'),
        "admin.key_hashes[0]: the same hash as key[0]",
    ),
    (sub('delegates = ["batch"]', 'delegates = ["batch", "ghost"]'), "delegation.delegates[1]: unknown tenant 'ghost'"),
    (
        sub('secret_env = "FAIRGATE_DELEGATION_SECRET"', 'secret_env = "my secret!"'),
        "delegation.secret_env: must be an environment variable name",
    ),
    # the file itself
    (sub("[gateway]", "[gateway"), "not valid TOML"),
]


@pytest.mark.parametrize("edit, expected", CASES, ids=[c[1][:40] for c in CASES])
def test_malformed_config_gives_one_line_naming_the_key(tmp_path: Path, edit, expected: str) -> None:
    path = write(tmp_path, edit(EXAMPLE_TEXT))
    with pytest.raises(GatewayConfigError) as caught:
        load_gateway_config(path)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    assert expected in message, message


def test_quota_top_level_message(tmp_path: Path) -> None:
    text = EXAMPLE_TEXT.replace("[quotas.tiers.free]", "[quotas.tiers.freee]")
    with pytest.raises(GatewayConfigError, match=r"^.*fairgate\.toml: quotas: tenant 'batch': unknown tier 'free'"):
        load_gateway_config(write(tmp_path, text))


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(GatewayConfigError, match="file not found"):
        load_gateway_config(tmp_path / "absent.toml")
    with pytest.raises(GatewayConfigError, match="is a directory"):
        load_gateway_config(tmp_path)


def test_every_policy_name_is_accepted(tmp_path: Path) -> None:
    for name in POLICY_NAMES:
        text = EXAMPLE_TEXT.replace('policy = "gpu_fair"', f'policy = "{name}"')
        assert load_gateway_config(write(tmp_path, text)).policy_spec().name == name

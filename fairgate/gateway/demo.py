"""``fairgate serve`` without a configuration: a demo stack in one process.

An emulated replica (seed 002's cost model) on a free loopback port, a gateway config in a new folder with
an SQLite ledger and four tenants (classify, chat, summarise, agent), and a key per tenant, printed once.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from fairgate.gateway.auth import hash_api_key, new_api_key

DEMO_TENANTS = ("classify", "chat", "summarise", "agent")
DEMO_MODEL = "fairgate-emulated"


def write_demo_config(folder: Path, upstream_url: str) -> tuple[Path, dict[str, str]]:
    """Write ``folder/fairgate.toml`` for the demo; returns its path and tenant -> API key."""
    keys = {tenant: new_api_key() for tenant in DEMO_TENANTS}
    tenants = "".join(f'[quotas.tenants.{t}]\ntier = "demo"\n' for t in DEMO_TENANTS)
    key_tables = "".join(f'[[key]]\ntenant = "{t}"\nhash = "{hash_api_key(k)}"\nname = "demo"\n' for t, k in keys.items())
    text = f"""# fairgate demo configuration (written by `fairgate serve` without --config).
[gateway]
policy = "gpu_fair"
ledger = "sqlite:///ledger.db"
journal = "journal.jsonl"
default_max_tokens = 256

[[upstream]]
name = "emulated-0"
url = "{upstream_url}/v1"
model = "{DEMO_MODEL}"
max_batch = 24
iter_base_ms = 9.0
iter_slope_ms = 0.55
prefill_ms_per_token = 0.06
max_model_len = 32768

[quotas.tiers.demo]
on_ledger_unavailable = "reject"
[quotas.defaults]
requests_per_minute = 6000
requests_burst = 200
max_concurrent = 64
max_queued = 256

{tenants}
{key_tables}"""
    path = folder / "fairgate.toml"
    path.write_text(text)
    return path, keys


def demo_folder() -> Path:
    return Path(tempfile.mkdtemp(prefix="fairgate-demo-"))

"""The OpenAI-compatible gateway: identity, quotas and GPU-time fair scheduling in front of real upstreams.

``fairgate.gateway.config`` reads and validates the gateway's TOML file (``load_gateway_config``);
``fairgate.gateway.auth`` hashes and checks API keys (``KeyRing``) and signs and verifies the
on-behalf-of tokens internal services present when acting for a tenant.
"""

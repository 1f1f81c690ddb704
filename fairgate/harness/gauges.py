"""A gateway's gauges read from its ``/metrics`` (Prometheus text, with the admin key): what it holds now."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayGauges:
    """Requests on upstream slots, queued requests and active sequences, summed over tenants and upstreams."""

    upstream_in_flight: float
    queued: float
    active_sequences: float


def metric_values(text: str, name: str) -> dict[str, float]:
    """``{labels text: value}`` of one metric in a Prometheus exposition."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            labels, _, value = line.rpartition(" ")
            try:
                out[labels[len(name) :]] = float(value)
            except ValueError:
                continue
    return out


async def gateway_gauges(url: str, admin_key: str) -> GatewayGauges:
    """The gauges of the gateway at ``url`` now.

    Raises:
        httpx.HTTPError: it does not answer, or refuses the key.
    """
    import httpx

    async with httpx.AsyncClient(timeout=10) as http:
        reply = await http.get(f"{url}/metrics", headers={"Authorization": f"Bearer {admin_key}"})
        reply.raise_for_status()
    totals = [
        sum(metric_values(reply.text, name).values())
        for name in ("fairgate_upstream_in_flight", "fairgate_queued_requests", "fairgate_active_sequences")
    ]
    return GatewayGauges(*totals)


__all__ = ["GatewayGauges", "gateway_gauges", "metric_values"]

"""The dashboard: its JSON scoped by the key alone, and the page end to end in headless Chromium
(Playwright) while traffic flows through a real gateway to an emulated replica.

Screenshots go to ``$FAIRGATE_ARTIFACTS`` when set (created if missing), else to the test's ``tmp_path``."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from fairgate.gateway.auth import make_on_behalf_of
from fairgate.gateway.stats import SAMPLE_EVERY_S
from fairgate.ledger.base import tenant_tag
from fairgate.ledger.config import PriceConfig, PricingConfig
from tests.gateway.conftest import TENANTS, Stack, post, serve_stack
from tests.gateway.test_metrics import ADMIN_KEY, admin_stack

ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}
CHROMIUM = Path("/usr/bin/chromium")  # Debian's package `chromium` (scripts/setup installs it)
BODY = {"model": "emu", "prompt": "x y", "max_tokens": 3, "ignore_eos": True}


def get_data(url: str, key: str | None, query: str = "") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{url}/dashboard/data{query}", headers=headers, timeout=30)


def artefacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("FAIRGATE_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_the_data_endpoint_is_scoped_by_the_key_only(tmp_path, monkeypatch):
    secret = "s" * 32
    monkeypatch.setenv("FAIRGATE_DELEGATION_SECRET", secret)
    with admin_stack(tmp_path, delegates=("gamma",)) as stack:
        url = stack.url
        sent = {"alpha": 2, "beta": 1, "gamma": 3}
        for tenant, n in sent.items():
            for _ in range(n):
                assert post(url, stack.keys[tenant], BODY).status_code == 200
        assert post(url, stack.keys["alpha"], {"model": "emu"}).status_code == 400

        admin = get_data(url, ADMIN_KEY).json()
        assert admin["scope"] == "admin" and set(admin["series"]) == set(TENANTS)
        assert admin["priced"] is False  # no [quotas.pricing]: the page shows no spend column
        assert {t: admin["totals"][t]["admissions"] for t in TENANTS} == sent
        assert admin["totals"]["alpha"]["rejections"] == {"invalid": 1}
        # One request at a time: nobody waited for a slot, so every tenant is marked demand-limited.
        assert {t: admin["totals"][t]["demand_limited"] for t in TENANTS} == dict.fromkeys(TENANTS, True)
        assert {t: admin["totals"][t]["output_tokens"] for t in TENANTS} == {t: 3 * n for t, n in sent.items()}
        assert {"max_min", "jain", "busy", "queue_p99_ms"} <= set(admin["pool"])
        assert get_data(url, ADMIN_KEY, "?tenant=alpha").json()["series"].keys() == admin["series"].keys()

        baseline = get_data(url, stack.keys["beta"]).json()
        for query in (
            "",
            "?tenant=alpha",
            "?tenant=alpha&tenant=gamma",
            "?scope=admin",
            "?all=1&admin=true",
            "?tenant=" + tenant_tag("alpha"),
            "?tenant=beta&tenant=alpha",
        ):
            reply = get_data(url, stack.keys["beta"], query)
            assert reply.status_code == 200 and reply.headers["cache-control"] == "no-store"
            data = reply.json()
            assert data["scope"] == "tenant" and list(data["series"]) == ["you"] and list(data["totals"]) == ["you"]
            assert data["totals"] == baseline["totals"]
            assert data["totals"]["you"]["admissions"] == 1 and data["totals"]["you"]["output_tokens"] == 3
            assert set(data["pool"]) == {
                "ttft_target_ms",
                "ttft_incl_queue_p99_ms",
            }  # the pool's SLO, nothing per tenant
            assert "gpu_share" not in data["series"]["you"]  # a share of others' use would reveal their total
            for other in ("alpha", "gamma"):
                assert other not in reply.text and tenant_tag(other) not in reply.text
            assert "beta" not in reply.text and tenant_tag("beta") not in reply.text  # "you", not a name

        # No key, a bad key, two keys: refused. A delegate acting for alpha cannot read alpha's data.
        assert get_data(url, None).status_code == 401
        assert get_data(url, "nope").status_code == 401
        two = httpx.get(
            f"{url}/dashboard/data",
            timeout=10,
            headers=[("Authorization", f"Bearer {stack.keys['beta']}"), ("Authorization", f"Bearer {ADMIN_KEY}")],
        )
        assert two.status_code in (400, 401)
        token = make_on_behalf_of(secret.encode(), "gamma", "alpha", time.time() + 60)
        delegated = httpx.get(
            f"{url}/dashboard/data",
            timeout=10,
            headers={"Authorization": f"Bearer {stack.keys['gamma']}", "X-Fairgate-On-Behalf-Of": token},
        )
        assert delegated.status_code == 403 and "alpha" not in delegated.text

        page = httpx.get(f"{url}/dashboard", timeout=10)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert "alpha" not in page.text and "cdn" not in page.text.lower()
        script = httpx.get(f"{url}/dashboard/static/chart.umd.min.js", timeout=10)
        assert script.status_code == 200 and "Chart.js v4" in script.text[:200]
        for name in ("../app.py", "..%2Fapp.py", "dashboard.py", "nope.js"):
            assert httpx.get(f"{url}/dashboard/static/{name}", timeout=10).status_code == 404


@dataclass
class Load:
    done: dict[str, int]  # tenant -> requests answered 200
    stop: Callable[[], None]  # ends the load: once it returns, no request of it is in flight


@contextmanager
def traffic(url: str, keys: dict[str, str], clients: int = 2, limit_s: float = 120.0) -> Iterator[Load]:
    """Every tenant keeps ``clients`` requests in flight until the block ends or the load is stopped (at most
    ``limit_s``)."""
    done = dict.fromkeys(keys, 0)
    stop = threading.Event()

    async def client(http: httpx.AsyncClient, tenant: str, index: int) -> None:
        headers = {"Authorization": f"Bearer {keys[tenant]}"}
        tokens = 8 + 8 * TENANTS.index(tenant) + index
        deadline = time.monotonic() + limit_s
        while not stop.is_set() and time.monotonic() < deadline:
            body = {"model": "emu", "prompt": "w " * 20, "max_tokens": tokens, "ignore_eos": True}
            reply = await http.post("/v1/completions", json=body, headers=headers)
            if reply.status_code == 200:
                done[tenant] += 1
            else:
                await asyncio.sleep(0.2)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            await asyncio.gather(*(client(http, t, i) for t in keys for i in range(clients)))

    thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)

    def end() -> None:
        stop.set()
        thread.join(timeout=60)

    thread.start()
    try:
        yield Load(done, end)
    finally:
        end()


LABELS_WITH_DATA = """(id) => {
  const chart = window.fairgateCharts && window.fairgateCharts[id];
  if (!chart) return null;
  return chart.data.datasets.filter(d => d.data.some(p => p.y !== null)).map(d => d.label).sort();
}"""
COLOURED_PIXELS = """(id) => {
  const canvas = document.getElementById(id);
  const d = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  let coloured = 0;
  for (let i = 0; i < d.length; i += 4) {
    if (d[i + 3] > 0 && Math.abs(d[i] - d[i + 1]) + Math.abs(d[i + 1] - d[i + 2]) > 60) coloured++;
  }
  return coloured;
}"""
BROKEN_LINES = """(id) => window.fairgateCharts[id].data.datasets.filter(d => {
  const ys = d.data.map(p => p.y);
  return ys.some((y, i) => y === null && ys.slice(0, i).some(v => v !== null) && ys.slice(i + 1).some(v => v !== null));
}).map(d => d.label)"""
FIRST_CELLS = """() => [...document.querySelectorAll("#totals tbody tr td:first-child")].map(td => td.textContent)"""
ALL_LABELS = """() => Object.values(window.fairgateCharts || {}).flatMap(c => c.data.datasets.map(d => d.label))"""
PER_TENANT_CHARTS = {
    "share": "{}",
    "queue": "{}",
    "admissions": "{}",
    "active": "{}",
    "tokens": "{} out",
    "gpu": "{}",
    "gap": "{} GPU s",
}


def see_the_admin_view(page: Any, stack: Stack, folder: Path) -> None:
    """Signed in with the admin key: every tenant, by name, in every per-tenant chart; all demand-limited."""
    from playwright.sync_api import expect

    page.fill("#key", ADMIN_KEY)
    page.click("#signin")
    expect(page.locator("#status")).to_have_attribute("data-scope", "admin", timeout=20_000)
    for chart, label in PER_TENANT_CHARTS.items():
        wanted = sorted(label.format(t) for t in TENANTS)
        page.wait_for_function(
            f"(wanted) => {{ const l = ({LABELS_WITH_DATA})('{chart}'); "
            f"return l && wanted.every(w => l.includes(w)); }}",
            arg=wanted,
            timeout=30_000,
        )
    page.wait_for_function(f"() => ({LABELS_WITH_DATA})('slo').includes('emu TTFT p99 (queue incl.)')", timeout=30_000)
    page.wait_for_function(f"() => ({LABELS_WITH_DATA})('fairness').includes('emu Jain')", timeout=30_000)
    page.wait_for_function(f"() => ({LABELS_WITH_DATA})('busy').includes('emu-0')", timeout=30_000)
    # Wait for a few samples so the screenshot shows lines, not dots.
    page.wait_for_function(
        "() => window.fairgateCharts.gpu.data.datasets.every(d => d.data.filter(p => p.y !== null).length >= 3)",
        timeout=30_000,
    )
    expect(page.locator("#totals tbody tr")).to_have_count(3)
    marked = [f"{t} (demand-limited)" for t in sorted(TENANTS)]
    page.wait_for_function(f"(marked) => JSON.stringify(({FIRST_CELLS})()) === JSON.stringify(marked)", arg=marked)
    flags = {t: x["demand_limited"] for t, x in get_data(stack.url, ADMIN_KEY).json()["totals"].items()}
    assert flags == dict.fromkeys(TENANTS, True), flags
    expect(page.locator("#spend-head")).to_be_visible()
    spend = page.locator("#totals tbody tr td:nth-child(9)").all_inner_texts()
    assert all(re.fullmatch(r"\d+\.\d{2,4} EUR", cell) for cell in spend), spend
    assert any(float(cell.split()[0]) > 0 for cell in spend), spend  # what finished requests cost
    expect(page.locator("#fairness")).to_be_visible()
    page.screenshot(path=str(folder / "dashboard_admin.png"), full_page=True)
    assert page.evaluate("() => sessionStorage.getItem('fairgate.dashboard.key')") == ADMIN_KEY


def see_the_tenant_view(page: Any, stack: Stack, folder: Path) -> None:
    """Signed in with beta's key: only its own series, as "you"; no other tenant anywhere on the page."""
    from playwright.sync_api import expect

    page.fill("#key", stack.keys["beta"])
    page.click("#signin")
    expect(page.locator("#status")).to_have_attribute("data-scope", "tenant", timeout=20_000)
    for chart, label in PER_TENANT_CHARTS.items():
        page.wait_for_function(
            f"(wanted) => {{ const l = ({LABELS_WITH_DATA})('{chart}'); return l && l.includes(wanted); }}",
            arg=label.format("you"),
            timeout=30_000,
        )
    labels = page.evaluate(ALL_LABELS)
    assert labels and all(label.startswith(("you", "emu", "target")) for label in labels), labels
    text = page.inner_text("body")
    for tenant in TENANTS:
        assert tenant not in text and tenant_tag(tenant) not in text
    expect(page.locator("#totals tbody tr")).to_have_count(1)
    expect(page.locator("#fairness")).to_be_hidden()
    expect(page.locator("#busy")).to_be_hidden()
    page.screenshot(path=str(folder / "dashboard_tenant.png"), full_page=True)
    assert page.evaluate(FIRST_CELLS) == ["you (demand-limited)"]


def see_a_link_after_an_idle_stretch(page: Any, stack: Stack, folder: Path, problems: list[str]) -> None:
    """A sign-in link: opened as it is (a headless browser, a bookmark), no key typed; the token leaves the
    address bar at once. The gateway was idle before: the lines break there."""
    from playwright.sync_api import expect

    problems.clear()  # the wrong key's 401 above
    made = httpx.post(f"{stack.url}/admin/dashboard-links", json={"tenant": "gamma"}, headers=ADMIN_HEADERS, timeout=10)
    assert made.status_code == 201, made.text
    page.goto(f"{stack.url}{made.json()['url']}")
    expect(page.locator("#status")).to_have_attribute("data-scope", "tenant", timeout=20_000)
    page.wait_for_function(f"() => ({LABELS_WITH_DATA})('gpu').includes('you')", timeout=30_000)
    assert "signin" not in page.url and page.url.endswith("/dashboard")
    assert page.evaluate("() => window.fairgateCharts.gpu.options.spanGaps") is False
    page.wait_for_function(f"() => ({BROKEN_LINES})('gpu').includes('you')", timeout=30_000)
    assert page.evaluate(FIRST_CELLS) == ["you (demand-limited)"]
    expect(page.locator("#totals tbody tr")).to_have_count(1)
    page.screenshot(path=str(folder / "dashboard_link.png"), full_page=True)
    # The charts are drawn, not only filled with data: the GPU chart's canvas holds its line's colour
    # (the grid, axes and text are grey).
    assert page.evaluate(COLOURED_PIXELS, "gpu") > 200
    assert not problems, problems


@pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium; scripts/setup installs it)",
)
def test_the_dashboard_in_chromium(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    folder = artefacts(tmp_path)
    priced = PricingConfig(currency="EUR", model_class={"emu": PriceConfig(output_per_mtok=100_000.0)})  # 0.1/token
    served = serve_stack(tmp_path, admin_key=ADMIN_KEY, pricing=priced)
    # One request in flight per tenant, 3 on the replica's 4 slots: nobody waits, every tenant is demand-limited.
    with served as stack, traffic(stack.url, stack.keys, clients=1) as load, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            problems: list[str] = []
            page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
            page.on("console", lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None)
            page.goto(f"{stack.url}/dashboard")
            expect(page.locator("#login")).to_be_visible()
            expect(page.locator("#board")).to_be_hidden()

            see_the_admin_view(page, stack, folder)

            # Sign out: the key leaves the tab.
            page.click("#logout")
            expect(page.locator("#login")).to_be_visible()
            assert page.evaluate("() => sessionStorage.getItem('fairgate.dashboard.key')") is None

            see_the_tenant_view(page, stack, folder)
            assert not problems, problems  # no script error, no CSP violation, no missing file

            # An idle stretch: no request and nobody watching, so no sample is taken; the lines break there.
            load.stop()
            page.click("#logout")
            time.sleep(3 * SAMPLE_EVERY_S)

            # A wrong key: back to the form with the gateway's message.
            page.fill("#key", "fg-wrong-key")
            page.click("#signin")
            expect(page.locator("#error")).to_contain_text("Invalid API key", timeout=20_000)
            expect(page.locator("#board")).to_be_hidden()

            see_a_link_after_an_idle_stretch(page, stack, folder, problems)
        finally:
            browser.close()
    assert all(load.done[t] > 0 for t in TENANTS), load.done
    assert (folder / "dashboard_admin.png").stat().st_size > 10_000


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")
def test_the_dashboard_shows_no_spend_without_prices(tmp_path):
    """Found by a new user: with no [quotas.pricing] every tenant's spend read "0.0000 USD"."""
    from playwright.sync_api import expect, sync_playwright

    with admin_stack(tmp_path) as stack, sync_playwright() as p:
        for tenant in TENANTS:
            assert post(stack.url, stack.keys[tenant], BODY).status_code == 200
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            page = browser.new_page()
            page.goto(f"{stack.url}/dashboard")
            page.fill("#key", ADMIN_KEY)
            page.click("#signin")
            expect(page.locator("#totals tbody tr")).to_have_count(3, timeout=20_000)
            expect(page.locator("#spend-head")).to_be_hidden()
            cells = page.evaluate(
                "() => [...document.querySelectorAll('#totals tbody tr')].map(tr => tr.children.length)"
            )
            header = page.locator("#totals thead th:visible").all_inner_texts()
            text = page.inner_text("#totals")
        finally:
            browser.close()
    assert cells == [8, 8, 8] and len(header) == 8 and "spend" not in header
    assert "USD" not in text and "0.0000" not in text


def test_a_tenant_that_waited_for_slots_is_not_marked_demand_limited() -> None:
    from fairgate.gateway.dashboard import payload
    from fairgate.gateway.observe import Admitted, Dispatched
    from fairgate.gateway.stats import Stats

    now = [1_800_000_000.0]
    stats = Stats(clock=lambda: now[0])
    for i, (tenant, wait_ms) in enumerate([("alpha", 450.0), ("beta", 3.0), ("alpha", 20.0)]):
        stats.observe(Admitted(f"r{i}", tenant, None, "emu", f"res-{i}", 5, 5, 10.0, now[0]))
        stats.observe(Dispatched(f"r{i}", tenant, "emu", "emu-0", wait_ms, now[0]))
    totals = payload(stats, None, 2000.0)["totals"]
    assert (totals["alpha"]["demand_limited"], totals["beta"]["demand_limited"]) == (False, True)
    assert payload(stats, "beta", 2000.0)["totals"]["you"]["demand_limited"] is True

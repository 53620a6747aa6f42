"""The dashboard in a real headless Chromium: it shows the server's own numbers, live, loads
nothing from elsewhere, and its clear button works with the admin token.

Chromium is Debian's package (`.ci/install-browser`); Playwright only drives it. The screenshot is
kept as a test artifact in .cache/artifacts/; KVTIER_DOCS_SCREENSHOT=1 also refreshes docs/dashboard.png.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvtier.cache import TokenCache
from kvtier.client import KvtierClient
from kvtier_testing.kvtier_processes import ServerProcess
from kvtier_testing.workload import NS, fill_for, tokens

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / ".cache" / "artifacts"
TOKEN = "dash-s3cret"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path:
        return path
    pytest.skip("chromium is not installed (.ci/install-browser apt-gets Debian's; needs root)")


@pytest.fixture
def server(tmp_path):
    # A small L1 (about 130 objects) over a disk tier: the traffic below evicts, and hits both tiers.
    l2 = {"type": "fs", "base_path": str(tmp_path / "l2"), "max_capacity_gb": 0.05}
    proc = ServerProcess(tmp_path, "--l2-adapter", json.dumps(l2), "--admin-token", TOKEN, l1_gb=0.001).start()
    yield proc
    proc.stop()


def drive_traffic(cache: TokenCache, rounds: int, pause: float) -> None:
    """Prompts that share a long cached prefix (partly evicted from L1 to the disk tier), mixed with
    new prompts, with a hit rate that changes from round to round."""
    shared = tokens(0, 2400)
    cache.store(NS, shared, fill_for(shared))  # 150 chunks: more than L1 holds
    for i in range(rounds):
        cache.lookup(NS, tokens(0, 400 + 400 * (i % 5)))
        fresh = tokens(100_000 + 1000 * i, 200 + 150 * (i % 4))
        cache.lookup(NS, fresh)
        if i % 3 == 0:
            cache.store(NS, fresh, fill_for(fresh))
        if i % 4 == 1:
            with cache.retrieve(NS, tokens(0, 480)) as retrieval:  # promotes disk hits into L1
                assert retrieval.num_tokens == 480
        time.sleep(pause)


def quiet_status(server: ServerProcess) -> dict:
    """/status once it stops changing (the disk writes have landed), without the clock."""
    previous = None
    for _ in range(100):
        status = server.get("/status")
        status.pop("uptime_s")
        if status == previous:
            return status
        previous = status
        time.sleep(0.2)
    raise AssertionError("/status kept changing with no traffic")


def shown(page, field: str) -> str:
    return page.locator(f'[data-field="{field}"]').first.get_attribute("data-value")


def shown_text(page, field: str) -> str:
    return page.locator(f'[data-field="{field}"]').first.inner_text().replace(",", "")


@pytest.mark.slow
def test_dashboard_shows_the_servers_numbers(server):
    from playwright.sync_api import sync_playwright

    executable = chromium()
    outside: list[str] = []
    errors: list[str] = []
    client = KvtierClient(server.url, timeout_s=5)
    client_cache = TokenCache(client)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.on("request", lambda r: None if r.url.startswith(server.http) else outside.append(r.url))
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.goto(server.http + "/dashboard?interval=0.5")
            page.wait_for_function("() => Number(document.body.dataset.polls) >= 2")

            drive_traffic(client_cache, rounds=14, pause=0.35)
            status = quiet_status(server)
            polled = int(page.evaluate("() => document.body.dataset.polls"))
            page.wait_for_function("(n) => Number(document.body.dataset.polls) >= n", arg=polled + 2)

            traffic = status["traffic"]
            hit = sum(traffic["hit_tokens"].values())
            tiers = {tier["name"]: tier for tier in status["tiers"]}
            # The traffic did what the page is meant to show: hits in both tiers, evictions, misses.
            assert traffic["hit_tokens"]["memory"] > 0 and traffic["hit_tokens"]["disk"] > 0
            assert tiers["memory"]["stats"]["evictions"] > 0 and 0 < hit < traffic["requested_tokens"]

            expected = {
                "traffic.requested_tokens": traffic["requested_tokens"],
                "traffic.hit_tokens": hit,
                "computed_tokens": traffic["requested_tokens"] - hit,
                "traffic.lookups": traffic["lookups"],
                "traffic.stored_tokens": traffic["stored_tokens"],
                "traffic.retrieve_requests": traffic["retrieve_requests"],
                "evictions": sum(t["stats"]["evictions"] for t in tiers.values()),
                "store.dropped_writes": status["store"]["dropped_writes"],
                "store.promotions": status["store"]["promotions"],
                "corrupt": sum(t["stats"]["corrupt"] for t in tiers.values()),
                "connected_clients": status["connected_clients"],
                "requests.lookup": traffic["requests"]["lookup"],
            }
            for name, tier in tiers.items():
                expected[f"tiers.{name}.hit_tokens"] = traffic["hit_tokens"][name]
                for field in ("objects", "hits", "misses", "evictions", "corrupt", "errors"):
                    expected[f"tiers.{name}.{field}"] = tier[field] if field == "objects" else tier["stats"][field]
            for field, value in expected.items():
                assert shown(page, field) == str(value), field
                assert shown_text(page, field) == str(value), field
            for name, tier in tiers.items():
                assert shown(page, f"tiers.{name}.used_bytes") == str(tier["used_bytes"])
            assert float(shown(page, "hit_rate")) == pytest.approx(hit / traffic["requested_tokens"])
            assert shown_text(page, "hit_rate") == f"{100 * hit / traffic['requested_tokens']:.1f}%"
            assert shown_text(page, "config.store.l1.size_gb") == "0.001"
            assert shown_text(page, "config.admin_token") == "***"
            assert TOKEN not in page.content()
            # Every chart drew: hit rate per tier, tokens, usage, evictions.
            for chart in ("hit-rate", "tokens", "usage", "pressure"):
                assert page.locator(f"#chart-{chart} path.series").count() >= 1, chart
            assert page.locator("#chart-hit-rate path.series").count() == 3  # all tiers, memory, disk
            assert page.locator("#live").get_attribute("data-state") == "ok"

            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=ARTIFACTS / "dashboard.png", full_page=True)
            if os.environ.get("KVTIER_DOCS_SCREENSHOT") == "1":
                page.screenshot(path=ROOT / "docs" / "dashboard.png", full_page=True)

            assert errors == []  # no script error, no failed load

            # The clear button: refused without the right token, done with it.
            page.on("dialog", lambda dialog: dialog.accept())
            assert page.locator("#token").is_visible()
            page.fill("#token", "wrong")
            page.click("#clear-form button")
            page.wait_for_function("() => document.getElementById('clear-result').textContent.includes('Not cleared')")
            assert server.get("/status")["tiers"][0]["objects"] == tiers["memory"]["objects"]
            page.fill("#token", TOKEN)
            page.click("#clear-form button")
            page.wait_for_function("() => document.getElementById('clear-result').textContent.includes('Cleared')")
            assert server.get("/status")["tiers"][0]["objects"] == 0
            page.wait_for_function("() => document.querySelector('[data-field=\"tiers.memory.objects\"]')"
                                   ".dataset.value === '0'")
        finally:
            browser.close()
            client.close()
    assert outside == []  # no CDN, no fonts, nothing but this server


def test_dashboard_assets_are_the_packages_own(server):
    page = server.get("/dashboard")
    assert '<script src="dashboard/dashboard.js"' in page and "http" not in page.split("<body>")[0]
    for name in ("dashboard.js", "dashboard.css"):
        assert len(server.get(f"/dashboard/{name}")) > 1000
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(server.http + "/dashboard/..%2Fhttp.py")
    assert missing.value.code == 404


@pytest.mark.slow
def test_status_command_prints_a_colored_summary(server):
    client = KvtierClient(server.url, timeout_s=5)
    client_cache = TokenCache(client)
    try:
        toks = tokens(0, 320)
        client_cache.store(NS, toks, fill_for(toks))
        client_cache.lookup(NS, tokens(0, 400))
        env = {**os.environ, "FORCE_COLOR": "1", "COLUMNS": "100"}
        out = subprocess.run([sys.executable, "-m", "kvtier.cli", "status", "--url", server.http],
                             capture_output=True, text=True, timeout=30, env=env)
    finally:
        client.close()
    assert out.returncode == 0, out.stderr
    assert "\x1b[" in out.stdout  # colored
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout)
    assert "hit rate 80.0% (memory 80.0%, disk 0.0%)  320 of 400 tokens from cache" in plain
    assert re.search(r"^memory .* 20 +320 ", plain, re.M) and re.search(r"^disk ", plain, re.M)
    assert "clients 1" in plain

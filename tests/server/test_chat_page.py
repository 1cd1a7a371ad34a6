"""The chat page at `/` in a real browser: Debian's Chromium, headless, driven by Playwright,
against real `appliance serve` processes. A message streams, a long answer stops when asked
(and the server ends the request), tokens/s are shown; another site's page and a DNS
rebinding page are refused.

The screenshot goes to the test's tmp folder; to refresh the one in the docs:

    CHAT_PAGE_SCREENSHOT=docs/chat-page.png .venv/bin/python -m pytest \
        tests/server/test_chat_page.py
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright
from playwright.sync_api import Error as PlaywrightError
from prometheus_client.parser import text_string_to_metric_families
from server_process import API_KEY, ServerProcess, wait_until

from appliance.model.model_source import model_name

pytestmark = pytest.mark.process

CHROMIUM = Path("/usr/bin/chromium")
REBOUND = "rebind.test"  # a name the browser resolves to 127.0.0.1, as a rebinding DNS would
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1",
]
MODEL = model_name(None)
STATS = re.compile(r"(\d+) tokens · (\d+\.\d) tokens/s · first token after \d+\.\d\d s")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():  # a failure, not a skip: CI installs it (.ci/run)
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 960, "height": 760})
    page = context.new_page()
    yield page
    context.close()


@pytest.fixture(scope="module")
def keyless_server() -> Iterator[ServerProcess]:
    """A server on loopback without an API key, the one DNS rebinding could reach: one
    colocated worker, the smallest that serves."""
    process = ServerProcess(
        {
            "APPLIANCE_MODE": "colocated",
            "APPLIANCE_CPU_DEVICES": "1",
            "APPLIANCE_KV__MEMORY_MB": "64",
        }
    )
    process.start()
    yield process
    process.stop()


def open_chat(page: Page, server: ServerProcess, key: str | None = API_KEY) -> None:
    page.goto(server.url + "/")
    if key is not None:
        page.get_by_label("API key").fill(key)
        page.get_by_label("API key").press("Tab")  # `change`: the page asks /v1/models again
    expect(page.locator("#model")).to_have_text(f"model: {MODEL}")


def ask(page: Page, text: str, max_tokens: int, temperature: str) -> None:
    page.get_by_label("Temperature").fill(temperature)
    page.get_by_label("Max tokens").fill(str(max_tokens))
    page.get_by_label("Message").fill(text)
    page.get_by_label("Message").press("Enter")


def answer_lengths(page: Page, until_done: bool, bound_s: float = 60.0) -> list[int]:
    """The last answer's length every 50 ms until its stats line shows (the stream ended)."""
    answer = page.locator("#log li.assistant").last
    lengths = []
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        lengths.append(len(answer.locator(".content").inner_text()))
        if until_done and answer.locator(".stats").inner_text():
            return lengths
        page.wait_for_timeout(50)
    raise TimeoutError(f"the answer did not end within {bound_s:.0f} s")


def server_counts(server: ServerProcess) -> dict[str, float]:
    """From /metrics: aborted generations, generations in flight, sequences the workers run."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    counts = {"abort": 0.0, "in_flight": 0.0, "running": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "appliance_requests_total":
                if sample.labels.get("finish_reason") == "abort":
                    counts["abort"] = sample.value
            elif sample.name == "appliance_requests_in_flight":
                counts["in_flight"] = sample.value
            elif sample.name == "appliance_worker_running_sequences":
                counts["running"] += sample.value
    return counts


def test_an_answer_streams_with_its_tokens_per_second(
    server: ServerProcess, page: Page, tmp_path: Path
) -> None:
    open_chat(page, server)
    page.get_by_label("System prompt").fill("You are a helpful assistant.")
    prompt = page.get_by_label("Message")
    prompt.fill("Write a short story about a cat.")
    prompt.press("Shift+Enter")  # a new line, not a send
    expect(prompt).to_have_value("Write a short story about a cat.\n")
    expect(page.locator("#log li")).to_have_count(0)
    ask(page, "Write a short story about a cat.", max_tokens=48, temperature="0")
    expect(page.locator("#log li.user .content")).to_have_text("Write a short story about a cat.")

    lengths = answer_lengths(page, until_done=True)
    # Streamed: seen at several lengths on its way, each no shorter than the one before.
    grown = sorted(set(lengths))
    assert len(grown) >= 4 and lengths == sorted(lengths), lengths
    stats = page.locator("#log li.assistant .stats").last.inner_text()
    match = STATS.match(stats)
    assert match, stats
    assert 1 < int(match[1]) <= 48 and float(match[2]) > 0
    expect(page.get_by_role("button", name="Send")).to_be_enabled()
    expect(page.get_by_role("button", name="Stop")).to_be_disabled()
    expect(page.locator("#log li.assistant").last).to_have_attribute("aria-busy", "false")

    shot = tmp_path / "chat-page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes().startswith(b"\x89PNG")
    if target := os.environ.get("CHAT_PAGE_SCREENSHOT"):
        shutil.copyfile(shot, target)


def test_stop_ends_the_answer_and_the_servers_request(server: ServerProcess, page: Page) -> None:
    open_chat(page, server)
    before = server_counts(server)
    ask(page, "Write a very long story about a dragon and a knight.", 1500, temperature="0.8")
    answer = page.locator("#log li.assistant .content").last
    # The precondition of the rate below: a few tokens in before Stop (one is no rate).
    expect(answer).to_have_text(re.compile(r"\S+\s+\S+\s+\S+"), timeout=60_000)
    stop = page.get_by_role("button", name="Stop")
    expect(stop).to_be_enabled()  # still answering
    assert server_counts(server)["in_flight"] >= 1
    stop.click()

    stats = page.locator("#log li.assistant .stats").last
    expect(stats).to_contain_text("stopped")
    stopped_at = len(answer.inner_text())
    page.wait_for_timeout(1500)
    assert len(answer.inner_text()) == stopped_at, "the answer grew after Stop"
    assert stopped_at < 1500 * 8
    assert re.search(r"\d+ tokens received · \d+\.\d tokens/s", stats.inner_text())

    # The server saw the disconnect: the generation ended as an abort and the worker let go.
    def ended() -> dict[str, float] | None:
        now = server_counts(server)
        done = now["abort"] >= before["abort"] + 1 and now["in_flight"] == now["running"] == 0
        return now if done else None

    wait_until(ended, 15, "the stopped request ends on the server")
    # The conversation goes on: the stopped answer is kept, a new message is answered.
    ask(page, "Thank you.", max_tokens=8, temperature="0")
    answer_lengths(page, until_done=True)
    expect(page.locator("#log li.assistant")).to_have_count(2)


def test_without_the_key_the_page_says_so_and_the_api_refuses(
    server: ServerProcess, page: Page
) -> None:
    page.goto(server.url + "/")
    expect(page.locator("#model")).to_contain_text("enter the API key")
    ask(page, "Hello", max_tokens=8, temperature="0")
    error = page.locator("#log li.assistant.error .stats")
    expect(error).to_contain_text("error: missing or wrong API key")
    expect(page.get_by_label("Message")).to_have_value("Hello")  # kept, to send again


def test_a_keyless_server_serves_its_own_page(keyless_server: ServerProcess, page: Page) -> None:
    open_chat(page, keyless_server, key=None)
    ask(page, "Hello", max_tokens=8, temperature="0")
    answer_lengths(page, until_done=True)
    assert STATS.match(page.locator("#log li.assistant .stats").last.inner_text())


def test_a_rebound_name_is_refused(keyless_server: ServerProcess, page: Page) -> None:
    response = page.goto(f"http://{REBOUND}:{keyless_server.port}/")
    assert response is not None and response.status == 421
    assert "DNS rebinding" in page.content()
    # Its script, same-origin to the rebound name, cannot reach the API either.
    status = page.evaluate(
        """async () => (await fetch('/v1/chat/completions', {method: 'POST', body: '{}'})).status"""
    )
    assert status == 421


@pytest.fixture
def other_site() -> Iterator[str]:
    """Another site's page, on another loopback port (as a local dev server would be: a
    page off this machine Chromium already keeps from loopback, Private Network Access,
    but other browsers do not)."""

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<!doctype html><title>another site</title>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    site = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{site.server_address[1]}/"
    site.shutdown()
    site.server_close()


def test_another_sites_page_cannot_start_a_generation(
    keyless_server: ServerProcess, page: Page, other_site: str
) -> None:
    """Its script posts a "simple" request, which browsers send without asking first (no
    preflight): refused before anything runs."""
    page.goto(other_site)
    before = httpx.get(keyless_server.url + "/metrics", timeout=10).text
    target = f"{keyless_server.url}/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    with page.expect_response(target) as refused:
        page.evaluate(
            """([url, body]) => fetch(url, {method: 'POST', mode: 'no-cors',
                headers: {'Content-Type': 'text/plain'}, body: JSON.stringify(body)})""",
            [target, body],
        )
    assert refused.value.status == 403
    after = httpx.get(keyless_server.url + "/metrics", timeout=10).text
    assert prompt_tokens(after) == prompt_tokens(before)
    # Nor can it read an answer: no CORS headers, so a plain fetch fails in the browser.
    with pytest.raises(PlaywrightError, match="Failed to fetch"):
        page.evaluate("url => fetch(url).then(r => r.json())", keyless_server.url + "/v1/models")


def prompt_tokens(metrics_text: str) -> float:
    """Prompt tokens the server has prefilled so far."""
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "appliance_prompt_tokens_total":
                return sample.value
    raise AssertionError("no appliance_prompt_tokens_total in /metrics")

"""The page at `GET /` in a real headless browser (Debian's chromium through selenium): a question
with pasted documents streams the answer the JSON route gives, with its reused-token count, and
the live panels show what /picrag/stats says; with an API key the page asks for it and sends it.
The stats' own arithmetic (percentiles, the runtime's counters) is tested without a browser.

PICRAG_PAGE_SCREENSHOT=docs/page.png saves the page after its queries (the README's picture)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import httpx
import pytest

from rag_server.api.page import hit_rate
from rag_server.api.runtime_metrics import picrag_counters
from rag_server.api.request_stats import Answered, RequestStats
from rag_server.service.percentile import percentile
from tests.inprocess_frontend import frontend

QUESTION = "What colour is the lighthouse door?"
DOCUMENTS = [
    "The lighthouse on Skerry Point was built in 1871. Its door is painted bright green.",
    "Skerry Point lies on the north coast. Ferries to the island leave twice a day in summer.",
]
POLICY = "naive"
MAX_TOKENS = 12
WAIT_S = 300.0

T = TypeVar("T")


def test_percentile_interpolates_linearly_between_ranks():
    samples = [float(v) for v in range(1, 11)]
    assert percentile(samples, 50) == 5.5
    assert percentile(samples, 90) == pytest.approx(9.1)
    assert percentile(list(reversed(samples)), 90) == pytest.approx(9.1)
    assert percentile(samples, 0) == 1.0 and percentile(samples, 100) == 10.0
    assert percentile([7.0], 90) == 7.0
    assert percentile([], 50) is None


def test_request_stats_per_policy():
    stats = RequestStats()
    for ttft in (10.0, 20.0, 30.0):
        stats.record(Answered("naive", ttft, reused_tokens=40, computed_tokens=5))
    stats.record(Answered("full", 100.0, reused_tokens=0, computed_tokens=45))
    summary = stats.summary()
    assert summary["requests"] == 4
    assert summary["policies"]["naive"] == {
        "requests": 3, "reused_tokens": 120, "computed_tokens": 15, "ttft_p50_ms": 20.0, "ttft_p90_ms": 28.0}
    assert summary["policies"]["full"]["ttft_p50_ms"] == 100.0
    assert (summary["ttft_p50_ms"], summary["ttft_p90_ms"]) == pytest.approx((25.0, 79.0))
    assert [r["policy"] for r in summary["recent"]] == ["naive", "naive", "naive", "full"]


def test_picrag_counters_from_prometheus_text():
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    registry = CollectorRegistry()
    Counter("picrag_chunk_hits", "hits", registry=registry).inc(3)
    Counter("picrag_chunk_misses", "misses", registry=registry).inc(1)
    Counter("picrag_disk_saves", "saves", registry=registry)
    Counter("sglang_other", "not ours", registry=registry).inc(9)
    counters = picrag_counters(generate_latest(registry).decode())
    assert counters == {"chunk_hits": 3.0, "chunk_misses": 1.0, "disk_saves": 0.0}
    assert hit_rate(counters) == 0.75
    assert hit_rate({"chunk_hits": 0.0, "chunk_misses": 0.0}) is None


# ---- in the browser


def _wait(what: str, probe: Callable[[], T], timeout_s: float = WAIT_S) -> T:
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = probe()
        except StaleElementReferenceException:  # the panel re-rendered while it was read
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what} (last: {value!r})")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def browser() -> Iterator:
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver_path):
        pytest.fail("chromium and chromedriver are needed: `bash scripts/setup.sh --test` installs them")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1400,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()


def _by_id(driver, element_id: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


def _css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def _ask_on_page(driver) -> dict:
    """Ask QUESTION over DOCUMENTS with POLICY; what the page shows once the answer is done."""
    _by_id(driver, "ask").click()
    state = _wait("the answer", lambda: _by_id(driver, "answer").get_attribute("data-state") in ("done", "failed")
                  and _by_id(driver, "answer").get_attribute("data-state"))
    assert state == "done", _by_id(driver, "answer-error").text
    return {
        "answer": _by_id(driver, "answer").text,
        "policy": _by_id(driver, "answer-policy").text,
        "reused": int(_by_id(driver, "reused-tokens").text),
        "computed": int(_by_id(driver, "computed-tokens").text),
        "sources": len(_css(driver, "#sources li")),
    }


def _requests_shown(driver, policy: str) -> int | None:
    bars = _css(driver, f'#requests-chart [data-policy="{policy}"]')
    return int(bars[0].get_attribute("data-value")) if bars else None


@pytest.mark.server
def test_page_streams_an_answer_and_fills_the_panels(picrag_server, browser):
    from selenium.webdriver.support.ui import Select

    with picrag_server.client() as client:
        before = client.get("/picrag/stats").json()["policies"].get(POLICY, {}).get("requests", 0)
        quality_offered = client.get("/picrag/quality").status_code == 200

        browser.get(picrag_server.url + "/")
        menu = _wait("the policy menu", lambda: [o.get_attribute("value") for o in _css(browser, "#policy option")])
        assert POLICY in menu and "full" in menu
        Select(_by_id(browser, "policy")).select_by_value(POLICY)
        _by_id(browser, "question").send_keys(QUESTION)
        _by_id(browser, "documents").send_keys("\n\n".join(DOCUMENTS))
        _by_id(browser, "max-tokens").clear()
        _by_id(browser, "max-tokens").send_keys(str(MAX_TOKENS))

        _ask_on_page(browser)
        shown = _ask_on_page(browser)  # the documents' chunks are cached now
        reference = client.post("/rag/query", json={
            "question": QUESTION, "documents": [{"text": t} for t in DOCUMENTS], "policy": POLICY,
            "max_tokens": MAX_TOKENS}).json()
        assert shown["answer"] == reference["answer"]
        assert shown["policy"] == reference["policy"] == POLICY
        assert shown["reused"] == reference["usage"]["reused_tokens"] > 0
        assert shown["computed"] == reference["usage"]["computed_tokens"]
        assert shown["sources"] == len(DOCUMENTS)

        stats = client.get("/picrag/stats").json()
        assert stats["policies"][POLICY]["requests"] == before + 3
        _wait("the requests panel", lambda: _requests_shown(browser, POLICY) == before + 3, 15)
        assert stats["cache"]["chunk_hit_rate"] > 0
        rate = stats["cache"]["chunk_hit_rate"]
        _wait("the hit-rate panel", lambda: float(_by_id(browser, "hit-rate").get_attribute("data-value") or "nan")
              == rate, 15)
        compiled = _css(browser, '#store-table tr[data-counter="compile_chunk_misses"] td.n')
        assert compiled and float(compiled[0].text.replace(",", "")) > 0
        assert _by_id(browser, "ttft-p50").text.isdigit() and _by_id(browser, "ttft-p90").text.isdigit()
        _wait("the quality panel's state", lambda: _by_id(browser, "quality-panel").is_displayed() == quality_offered, 15)
    if os.environ.get("PICRAG_PAGE_SCREENSHOT"):
        browser.save_screenshot(os.environ["PICRAG_PAGE_SCREENSHOT"])


@pytest.mark.server
def test_page_sends_the_api_key(picrag_server, browser):
    """A keyed frontend (in this process, in front of the shared server): the page itself loads
    without the key, asks for it, refuses a wrong one, and with the right one fills its menu and panels."""
    key = "page-test-key"
    with frontend(picrag_server.url, api_key=key) as url:
        assert httpx.get(url + "/picrag/policies").status_code == 401
        browser.get(url + "/")
        browser.execute_script("localStorage.clear()")
        browser.refresh()
        notice = _wait("the key notice", lambda: _by_id(browser, "notice").is_displayed() and _by_id(browser, "notice").text)
        assert "needs an API key" in notice
        assert not _css(browser, "#policy option")

        _by_id(browser, "api-key").send_keys("wrong", "\t")
        _wait("the refusal", lambda: "refused this API key" in _by_id(browser, "notice").text, 15)
        _by_id(browser, "api-key").clear()
        _by_id(browser, "api-key").send_keys(key, "\t")
        _wait("the policy menu", lambda: _css(browser, "#policy option"), 30)
        assert not _by_id(browser, "notice").is_displayed()
        assert browser.execute_script("return localStorage.getItem('picrag.apiKey')") == key
        _wait("the chunk store panel", lambda: _css(browser, '#store-table tr[data-counter="chunk_hits"]'), 15)
        browser.execute_script("localStorage.clear()")

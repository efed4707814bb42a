"""The console page in a real headless browser (Debian's ``chromium`` and ``chromium-driver``
through Selenium) against a real node: the job row, its timeline and its preview are on the
page; Retry on a failed job requeues it and the page shows the new state; a screenshot is
saved (``console.png`` in the test's temporary folder)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port, wait_for
from tests.test_web import TOKEN, job_states, send_series, web_node_pacs_down


def _require(what: str, found: object) -> None:
    if found:
        return
    msg = f"{what} not installed (apt-get install chromium chromium-driver; pip install selenium)"
    if os.environ.get("SEGNODE_REQUIRE_TOOLS"):
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless Chromium driven by chromedriver."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _require("selenium", False)
        raise
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    _require("chromium", chromium)
    _require("chromedriver", driver_path)
    options = webdriver.ChromeOptions()
    options.binary_location = str(chromium)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1500,1300", "--no-first-run", "--disable-extensions"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(driver_path)))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def test_console_shows_jobs_timeline_preview_and_retries(
    make_node: Any, tmp_path: Path, browser: Any
) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    # the PACS is down: the first job's delivery fails
    scp, node, http = web_node_pacs_down(make_node, tmp_path)
    send_series(node.port, tmp_path, 51, rows=128, columns=128, slices=16)
    wait_for(lambda: job_states(http) == {1: "failed"}, 60, "job 1 failed (PACS down)")
    wait_for(lambda: http.json("/api/v1/jobs/1")["preview"], 60, "the preview of job 1")

    def find(css: str) -> Any:
        found = browser.find_elements(By.CSS_SELECTOR, css)
        return found[0] if found else None

    def click(css: str) -> None:
        """Click ``css`` once it is there (the page may replace it while refreshing)."""

        def attempt() -> bool:
            try:
                found = find(css)
                if found is None:
                    return False
                found.click()
                return True
            except StaleElementReferenceException:
                return False

        wait_for(attempt, 20, f"a click on {css}")

    def state(job: int) -> Any:
        return browser.execute_script(
            f"return document.querySelector('#job-{job}')?.dataset.state ?? null"
        )

    browser.get(f"{http.base}/?refresh=500")
    wait_for(lambda: state(1) == "failed", 20, "the job row")
    row = browser.execute_script(
        "const r = document.querySelector('#job-1'); return [r.innerText, "
        "[...r.querySelectorAll('.timeline .seg')].map((s) => s.dataset.stage), "
        "r.querySelectorAll('.st-delivery-failed').length]"
    )
    assert "not delivered within dispatch.max_age_s" in row[0]
    assert {"received", "volume", "inference", "encoded"} <= set(row[1]), row[1]
    assert row[2] > 0  # the failed delivery on the timeline

    click("#job-1")  # the job's detail, with its preview
    image = wait_for(
        lambda: (img := find("#preview")) and img.is_displayed() and img, 20, "the preview"
    )
    wait_for(
        lambda: browser.execute_script("return arguments[0].naturalWidth", image) > 600,
        20,
        "the preview decoded",
    )
    assert image.get_attribute("data-job") == "1"

    # Retry without the token is refused and says so; with it the job is requeued.
    click("#job-1 button.retry")
    wait_for(lambda: "needs the bearer token" in find("#message").text, 20, "the 401 message")
    assert job_states(http) == {1: "failed"}
    scp.start()
    try:
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        browser.find_element(By.CSS_SELECTOR, "#token-form button").click()
        click("#job-1 button.retry")
        wait_for(lambda: state(1) == "sent", 60, "the page showing job 1 sent")
        assert len(scp.counts()) == 2
        # a second series goes straight through; the page shows it without a reload
        send_series(node.port, tmp_path, 52, rows=128, columns=128, slices=16)
        wait_for(lambda: state(2) == "sent", 60, "job 2 sent on the page")
        wait_for(
            lambda: (
                browser.execute_script("return document.querySelector('#preview').naturalWidth")
                > 600
            ),
            20,
            "the preview still shown",
        )
    finally:
        scp.stop()
    assert "retry done, now encoded" in find("#message").text
    shot = tmp_path / "console.png"
    assert browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def test_console_asks_for_the_token_when_reads_need_it(tmp_path: Path, browser: Any) -> None:
    """What a console on a non-loopback address does (served on loopback here): the page
    says it needs the token, and shows the node once the token is given."""
    from selenium.webdriver.common.by import By

    from segnode.node.config import from_dict
    from segnode.node.ops.service import Node
    from segnode.node.web.app import Access, Console, create_app
    from segnode.node.web.server import WebServer
    from segnode.node.web.status import node_ready, node_status
    from tests.conftest import LOOPBACK

    cfg = from_dict(
        {
            "data_dir": str(tmp_path / "data"),
            "node": {"port": free_port(), "staging_pool_mb": 8},
            "model": {"load": "before"},
        }
    )
    node = Node(cfg)
    node.start()
    console = Console(
        node.ledger,
        cfg.data_dir,
        Access(TOKEN, reads_need_token=True),
        lambda: node_status(node),
        lambda: node_ready(node),
    )
    server = WebServer(create_app(console), LOOPBACK, 0)
    server.start()
    try:
        browser.get(server.url + "?refresh=500")
        wait_for(
            lambda: "needs the bearer token" in browser.find_element(By.ID, "message").text,
            20,
            "the page asking for the token",
        )
        assert "SEGNODE" not in browser.find_element(By.ID, "status").text
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        browser.find_element(By.CSS_SELECTOR, "#token-form button").click()
        wait_for(
            lambda: (
                f"SEGNODE @ 127.0.0.1:{node.scp.port}" in browser.find_element(By.ID, "status").text
            ),
            20,
            "the status once the token is given",
        )
        assert browser.find_element(By.ID, "page").text == "no jobs"
        assert browser.find_element(By.ID, "message").text == ""
    finally:
        server.stop()
        node.request_stop()
        node.shutdown()

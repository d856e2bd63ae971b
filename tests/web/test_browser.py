"""The dashboard in a real headless browser (Debian's chromium, driven by Selenium through
chromium-driver) against a real `jobq serve` process, on every engine: what a person sees on
the overview, a job page and the groups page, a retry that works with the token and is
refused without it (signing in then offers it again), and the pause button of a group whose
name holds a "/".

CI (CI set) fails when chromium or its driver is missing; elsewhere the test is skipped with
one line saying how to install them (apt-get install chromium chromium-driver).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

import jobq
from helpers_web import running_server

TOKEN = "browser-test-token"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def _browser_missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    for path in (CHROMIUM, DRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    missing = _browser_missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"the dashboard's browser test must run in CI: {missing}")
        pytest.skip(f"no headless browser: {missing}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,1000",
                "--no-first-run", "--disable-background-networking"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _failed_pair(engine: sa.Engine) -> tuple[int, int]:
    up = jobq.enqueue(engine, "fetch", {"url": "https://example.invalid/a"}, max_attempts=1, group_key="tenant-a")
    down = jobq.enqueue(engine, "publish", {}, depends_on=[up], group_key="tenant-a")
    lease = jobq.claim(engine, "w1", 30)
    jobq.fail(engine, up, "Traceback (most recent call last):\nConnectionError: host unreachable", worker_id="w1",
              token=lease.token)
    jobq.enqueue(engine, "resize", {"id": 7}, group_key="tenant-b")
    return up, down


def test_an_operator_sees_states_why_and_the_dag_and_retries_only_with_the_token(
        browser: object, engine: sa.Engine, db_url: str) -> None:
    """Overview counts (refreshed live), the why sentence and the coloured DAG are on screen,
    with JavaScript on and off; the Retry button
    is refused (401, nothing changes) until the operator signs in with the token, then it
    re-opens the job and its closed dependent."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d = browser
    up, down = _failed_pair(engine)
    jobq.set_group(engine, "org/team", weight=1)  # a stored policy, no jobs: the counts stay as they are
    with running_server(db_url, "--port", "0", "--token", TOKEN) as (base, _):
        d.delete_all_cookies()  # type: ignore[attr-defined]  # cookies ignore the port: one engine's sign-in
        d.get(base)  # type: ignore[attr-defined]  # would carry over to the next
        find = d.find_element  # type: ignore[attr-defined]

        def submit(element: object) -> None:
            """Click a link or button and wait until the page it leads to has loaded (a
            click returns before a form's navigation ends). The old page is marked on its
            window, which a new document does not inherit; an element reference to the old
            page is no witness, as a navigating Chromium may report it neither live nor stale
            but as an inspector error."""
            d.execute_script("window.jobqOldPage = true")  # type: ignore[attr-defined]
            element.click()  # type: ignore[attr-defined]

            def loaded(_: object) -> bool:
                try:
                    return bool(d.execute_script(  # type: ignore[attr-defined]
                        "return !window.jobqOldPage && document.readyState === 'complete'"))
                except WebDriverException:  # the old document went away mid-call: poll again
                    return False
            WebDriverWait(d, 60).until(loaded)
        assert find(By.TAG_NAME, "h1").text == "Overview"
        assert find(By.ID, "count-failed").text == "2" and find(By.ID, "count-ready").text == "1"
        chart = find(By.CSS_SELECTOR, "svg.chart")
        assert chart.is_displayed() and chart.size["width"] > 200
        assert find(By.ID, "live").is_displayed()  # JavaScript is on: the live-refresh switch shows
        jobq.enqueue(engine, "resize", {"id": 8}, group_key="tenant-b")
        # live refresh: the count changes without a reload (polled with a deadline, not timed)
        WebDriverWait(d, 60, ignored_exceptions=[WebDriverException]).until(  # a swapped node: stale or an inspector error
            lambda _: find(By.ID, "count-ready").text == "2")
        find(By.CSS_SELECTOR, "#live input").click()  # live refresh off (for this tab): no page swaps under the clicks below
        assert not find(By.CSS_SELECTOR, "#live input").is_selected()
        assert "tenant-b" in find(By.CSS_SELECTOR, "table.groups").text

        d.get(f"{base}jobs/{down}")  # type: ignore[attr-defined]
        why = find(By.ID, "why").text
        assert why == jobq.why(engine, down) and f"job {down} (publish, group tenant-a) is failed" in why
        dag = find(By.CSS_SELECTOR, "svg.dag")
        assert dag.is_displayed() and dag.size["height"] > 40
        nodes = dag.find_elements(By.CSS_SELECTOR, "a.node")
        assert sorted(n.get_attribute("data-state") for n in nodes) == ["failed", "failed"]
        fill = dag.find_element(By.CSS_SELECTOR, "a.node rect").get_attribute("fill")
        assert fill == jobq._COLOURS["failed"]

        d.get(f"{base}jobs/{up}")  # type: ignore[attr-defined]
        assert "ConnectionError: host unreachable" in find(By.ID, "error").text
        tb = find(By.CSS_SELECTOR, "table.attempts details.tb")  # the attempt's traceback: folded, then whole
        assert tb.text == "ConnectionError: host unreachable"
        tb.find_element(By.TAG_NAME, "summary").click()
        assert tb.find_element(By.TAG_NAME, "pre").text.splitlines() == [
            "Traceback (most recent call last):", "ConnectionError: host unreachable"]
        submit(find(By.ID, "retry"))  # not signed in
        assert find(By.TAG_NAME, "h1").text == "401 Unauthorized" and "sign in" in find(By.ID, "error").text
        assert jobq.get(engine, up).state == "failed"

        submit(find(By.LINK_TEXT, "Sign in"))
        find(By.ID, "token").send_keys("not-the-token")
        submit(find(By.ID, "signin"))
        assert find(By.TAG_NAME, "h1").text == "401 Unauthorized" and find(By.ID, "error").text == "wrong token"
        d.back()  # type: ignore[attr-defined]  # to the sign-in form the refused Retry led to
        WebDriverWait(d, 60).until(lambda _: find(By.ID, "token").is_displayed())
        find(By.ID, "token").clear()
        find(By.ID, "token").send_keys(TOKEN)
        submit(find(By.ID, "signin"))
        # signed in, the browser lands where the refused Retry was posted: a page offering it again
        assert find(By.TAG_NAME, "h1").text == f"Retry job {up}", find(By.TAG_NAME, "main").text
        assert not find(By.CSS_SELECTOR, "#live input").is_selected()  # still off after navigating
        # a forged request from the page's own origin without the CSRF field: refused
        status = d.execute_script(  # type: ignore[attr-defined]
            f"return fetch('/jobs/{up}/retry', {{method: 'POST'}}).then(r => r.status)")
        assert status == 403 and jobq.get(engine, up).state == "failed"
        submit(find(By.ID, "retry"))
        assert find(By.ID, "flash").text == f"re-opened {up}, {down}"
        assert jobq.get(engine, up).state == "ready" and jobq.get(engine, down).state == "waiting"
        assert "ready" in find(By.TAG_NAME, "h1").text

        d.get(f"{base}groups")  # type: ignore[attr-defined]
        assert find(By.TAG_NAME, "h1").text == "Groups"
        assert {"tenant-a", "tenant-b", "org/team"} <= {a.text for a in find(By.CSS_SELECTOR, "table.groups").find_elements(
            By.CSS_SELECTOR, "td:first-child a")}
        assert "jobq group KEY" in find(By.ID, "policy-note").text

        def group_row(name: str) -> object:
            return next(r for r in find(By.CSS_SELECTOR, "table.groups").find_elements(By.CSS_SELECTOR, "tbody tr")
                        if r.find_element(By.CSS_SELECTOR, "td:first-child").text == name)

        # a group whose name holds a "/" (sent as %2F, which a server decodes): its own button pauses it
        submit(group_row("org/team").find_element(By.CSS_SELECTOR, "button"))  # type: ignore[attr-defined]
        assert find(By.ID, "flash").text == "group org/team: paused"
        assert jobq.get_group(engine, "org/team").paused is True  # type: ignore[union-attr]
        assert jobq.get_group(engine, "org") is None and jobq.get_group(engine, "team") is None
        submit(group_row("org/team").find_element(By.CSS_SELECTOR, "button"))  # type: ignore[attr-defined]
        assert find(By.ID, "flash").text == "group org/team: resumed"
        assert jobq.get_group(engine, "org/team").paused is False  # type: ignore[union-attr]

        # JavaScript off: the read-only pages show the same (no live switch, nothing missing)
        d.execute_cdp_cmd("Emulation.setScriptExecutionDisabled", {"value": True})  # type: ignore[attr-defined]
        try:
            d.get(f"{base}jobs/{down}")  # type: ignore[attr-defined]
            assert find(By.ID, "why").text == jobq.why(engine, down)
            assert find(By.CSS_SELECTOR, "svg.dag").is_displayed() and not find(By.ID, "live").is_displayed()
            d.get(base)  # type: ignore[attr-defined]
            assert find(By.ID, "count-ready").text == "3" and find(By.CSS_SELECTOR, "svg.chart").is_displayed()  # 2 + the retried one
        finally:
            d.execute_cdp_cmd("Emulation.setScriptExecutionDisabled", {"value": False})  # type: ignore[attr-defined]

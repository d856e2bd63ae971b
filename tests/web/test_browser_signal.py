"""A suspended job in a real headless browser against a real `jobq serve` (as test_browser.py,
whose browser fixture this uses): the overview counts it, its page says what it waits for,
and an operator signed in with the token sends the signal from the page; the job wakes."""

from __future__ import annotations

import sqlalchemy as sa
import test_browser

import jobq
from helpers import FAST, db_now
from helpers_web import running_server

browser = test_browser.browser  # its headless Chromium fixture
TOKEN = test_browser.TOKEN


def test_an_operator_sends_a_waiting_jobs_signal_from_its_page(browser: object, engine: sa.Engine, db_url: str) -> None:
    """Correct: the overview shows 1 suspended, 1 waiting for a signal; the job's page says
    "suspended: waiting for signal 'approval-7' since ... (timeout at ...)"; Send is refused
    (401, nothing sent) before signing in; signed in, it sends the typed payload once, the
    flash says so and the job is due at once, and its re-run reads the payload."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d = browser
    job = jobq.enqueue(engine, "approve", {})
    handlers = {"approve": lambda ctx: {"approved_by": ctx.wait_for("approval-7", timeout=86400)}}
    assert jobq.Worker(engine, handlers, max_concurrency=1, **FAST).run_until_idle(timeout=30)
    with running_server(db_url, "--port", "0", "--token", TOKEN) as (base, _):
        d.delete_all_cookies()  # type: ignore[attr-defined]
        find = d.find_element  # type: ignore[attr-defined]

        def submit(element: object) -> None:  # click, then wait for the next page (see test_browser.py)
            d.execute_script("window.jobqOldPage = true")  # type: ignore[attr-defined]
            element.click()  # type: ignore[attr-defined]

            def loaded(_: object) -> bool:
                try:
                    return bool(d.execute_script(  # type: ignore[attr-defined]
                        "return !window.jobqOldPage && document.readyState === 'complete'"))
                except WebDriverException:
                    return False
            WebDriverWait(d, 60).until(loaded)

        d.get(base)  # type: ignore[attr-defined]
        assert (find(By.ID, "suspended").text, find(By.ID, "awaiting-signal").text) == ("1", "1")
        d.get(f"{base}jobs/{job}")  # type: ignore[attr-defined]
        text = find(By.ID, "suspended").text
        assert text.startswith("suspended: waiting for signal 'approval-7' since ") and "(timeout at " in text, text
        submit(find(By.ID, "send-signal"))  # not signed in
        assert find(By.TAG_NAME, "h1").text == "401 Unauthorized"
        assert jobq.signal(engine, "approval-7-probe") and jobq.stats(engine)["awaiting_signal"] == 1  # nothing sent
        submit(find(By.LINK_TEXT, "Sign in"))
        find(By.ID, "token").send_keys(TOKEN)
        submit(find(By.ID, "signin"))
        assert find(By.TAG_NAME, "h1").text == "Send signal approval-7"  # the refused action, offered again
        find(By.ID, "payload").clear()
        find(By.ID, "payload").send_keys('"ops@example.com"')
        submit(find(By.ID, "send-signal"))
        assert find(By.ID, "flash").text == "signal 'approval-7' sent"
        info = jobq.get(engine, job)
        assert info is not None and info.state == "ready" and info.run_after.replace(tzinfo=None) <= db_now(engine).replace(tzinfo=None)
    assert jobq.Worker(engine, handlers, max_concurrency=1, **FAST).run_until_idle(timeout=30)
    info = jobq.get(engine, job)
    assert info is not None and info.result == {"approved_by": "ops@example.com"}, info

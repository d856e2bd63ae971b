"""The dashboard's bulk retry ("Retry all failed jobs matching this filter") and its audit log
page: token-guarded like every action, applied through jobq.bulk (dependents re-opened),
recorded and shown escaped; and the same in a real headless Chromium against `jobq serve`."""

from __future__ import annotations

import re

import sqlalchemy as sa
from test_browser import browser  # noqa: F401 - the module's headless Chromium fixture

import jobq
import jobq_web
from helpers_web import running_server
from webclient import call

TOKEN = "s3cret-dashboard-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
EVIL = '<script>alert("x")</script>'


def _failed(engine: sa.Engine, type: str, group: str = "g") -> tuple[int, int]:
    """A failed job and the dependent its failure closed."""
    up = jobq.enqueue(engine, type, {}, group_key=group, max_attempts=1)
    down = jobq.enqueue(engine, "after", {}, depends_on=[up], group_key=group)
    lease = jobq.claim(engine, "w", 30, types=[type])
    assert lease == up
    jobq.fail(engine, up, "boom", worker_id="w", token=lease.token)
    return up, down


def test_bulk_retry_needs_the_token_and_is_recorded(engine: sa.Engine) -> None:
    a, a_down = _failed(engine, "fetch")
    b, _ = _failed(engine, "other")
    ro = jobq_web.app(engine)
    assert 'id="bulk-retry"' not in call(ro, "/jobs?state=failed").body
    assert call(ro, "/jobs/bulk-retry?type=fetch", "POST").status == 403
    app = jobq_web.app(engine, token=TOKEN)
    assert 'id="bulk-retry"' in call(app, "/jobs?state=failed&type=fetch", headers=BEARER).body
    assert 'id="bulk-retry"' not in call(app, "/jobs?state=ready", headers=BEARER).body
    assert call(app, "/jobs/bulk-retry?type=fetch", "POST").status == 401
    assert call(app, "/jobs/bulk-retry?type=fetch&state=done", "POST", headers=BEARER).status == 400
    assert jobq.get(engine, a).state == "failed" and jobq.audit_log(engine) == []
    page = call(app, "/jobs/bulk-retry?type=fetch")
    assert page.status == 200 and re.search(r'id="bulk-count">1 failed job', page.body)
    r = call(app, "/jobs/bulk-retry?type=fetch", "POST", headers=BEARER)
    assert r.status == 200 and r.json()["result"]["applied"] == 1, r.body
    assert (jobq.get(engine, a).state, jobq.get(engine, a_down).state, jobq.get(engine, b).state) == (
        "ready", "waiting", "failed")
    [entry] = call(app, "/api/audit").json()["audit"]
    assert (entry["actor"], entry["action"], entry["count"], entry["filter"]["type"]) == ("dashboard", "retry", 1, "fetch")


def test_the_audit_page_escapes_what_it_shows(engine: sa.Engine) -> None:
    _failed(engine, "t", group=EVIL[:60])
    jobq.bulk(engine, "retry", group=EVIL[:60], actor=EVIL[:60])
    body = call(jobq_web.app(engine), "/audit").body
    assert "<script>alert" not in body and "&lt;script&gt;" in body and 'class="audit"' in body


def test_an_operator_retries_all_failed_jobs_of_a_filter_in_chromium(browser: object, engine: sa.Engine,  # noqa: F811
                                                                    db_url: str) -> None:
    """Headless Chromium against `jobq serve`: the jobs page filtered to failed jobs of one type
    offers "Retry all failed ..."; refused until signed in; signed in, it re-opens the filter's
    jobs (not the others) and lands on the audit log, which shows the action."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d = browser
    a, a_down = _failed(engine, "fetch")
    b, _ = _failed(engine, "other")
    with running_server(db_url, "--port", "0", "--token", TOKEN) as (base, _):
        d.delete_all_cookies()  # type: ignore[attr-defined]
        find = d.find_element  # type: ignore[attr-defined]

        def submit(element: object) -> None:
            d.execute_script("window.jobqOldPage = true")  # type: ignore[attr-defined]
            element.click()  # type: ignore[attr-defined]
            WebDriverWait(d, 60).until(lambda _: d.execute_script(  # type: ignore[attr-defined]
                "return !window.jobqOldPage && document.readyState === 'complete'"))

        d.get(f"{base}jobs?state=failed&type=fetch")  # type: ignore[attr-defined]
        submit(find(By.ID, "bulk-retry"))  # not signed in
        assert find(By.TAG_NAME, "h1").text == "401 Unauthorized"
        assert jobq.get(engine, a).state == "failed"
        submit(find(By.LINK_TEXT, "Sign in"))
        find(By.ID, "token").send_keys(TOKEN)
        submit(find(By.ID, "signin"))
        # signed in, the browser lands where the refused action was posted: the count and the button
        assert find(By.ID, "bulk-count").text.startswith("1 failed job"), find(By.TAG_NAME, "main").text
        submit(find(By.ID, "bulk-retry"))
        assert find(By.TAG_NAME, "h1").text == "Audit log"
        assert find(By.ID, "flash").text == "retried 1 of 1 failed job(s)"
        row = find(By.CSS_SELECTOR, "table.audit tbody tr").text
        assert "dashboard" in row and "retry" in row and '"type": "fetch"' in row
    assert (jobq.get(engine, a).state, jobq.get(engine, a_down).state, jobq.get(engine, b).state) == (
        "ready", "waiting", "failed")

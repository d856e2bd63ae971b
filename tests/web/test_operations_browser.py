"""The operations pages in a real headless Chromium against `jobq serve`: editing a group's
policy (a good change stored, a bad one refused with the field named), pausing a schedule,
both shown in the audit log, and the per-type page."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from test_browser import browser  # noqa: F401 - the module's headless Chromium fixture

import jobq
from helpers_web import running_server

TOKEN = "s3cret-dashboard-token"


def test_an_operator_edits_a_group_pauses_a_schedule_and_reads_types_in_chromium(
        browser: object, engine: sa.Engine, db_url: str) -> None:  # noqa: F811
    """Signed in, the groups page's "edit policy" link opens the form prefilled; saving stores
    weight, cap and rate (the groups page says so); weight 0 is refused with a 400 naming the
    field and nothing changes; the schedule's pause button pauses it; the audit log lists both
    changes; /types lists the types with their figures. A bug shows a change without the token,
    a refused value stored, or a missing audit row."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    d = browser
    jobq.enqueue(engine, "resize", {}, group_key="tenant-a")
    jobq.schedule(engine, "nightly", "cleanup", every=dt.timedelta(hours=1))
    with running_server(db_url, "--port", "0", "--token", TOKEN) as (base, _):
        d.delete_all_cookies()  # type: ignore[attr-defined]
        find = d.find_element  # type: ignore[attr-defined]

        def submit(element: object) -> None:
            d.execute_script("window.jobqOldPage = true")  # type: ignore[attr-defined]
            element.click()  # type: ignore[attr-defined]
            WebDriverWait(d, 60).until(lambda _: d.execute_script(  # type: ignore[attr-defined]
                "return !window.jobqOldPage && document.readyState === 'complete'"))

        def fill(field: str, value: str) -> None:
            box = find(By.ID, field)
            box.clear()
            box.send_keys(value)

        d.get(f"{base}login?next=/groups")  # type: ignore[attr-defined]
        find(By.ID, "token").send_keys(TOKEN)
        submit(find(By.ID, "signin"))
        assert find(By.TAG_NAME, "h1").text == "Groups"
        submit(find(By.CSS_SELECTOR, "table.groups a.edit"))
        assert find(By.TAG_NAME, "h1").text == "Policy of group tenant-a"
        assert (find(By.ID, "cap").get_attribute("value"), find(By.ID, "rate").get_attribute("value")) == ("none", "none")
        fill("weight", "4")
        fill("cap", "2")
        fill("rate", "10/1m")
        submit(find(By.ID, "save-policy"))
        assert find(By.TAG_NAME, "h1").text == "Groups"
        assert find(By.ID, "flash").text == "group tenant-a: weight 4, cap 2, rate 10/60s"
        p = jobq.get_group(engine, "tenant-a")
        assert p is not None and (p.weight, p.max_in_flight, p.rate_limit) == (4, 2, (10, 60.0))

        submit(find(By.CSS_SELECTOR, "table.groups a.edit"))
        assert find(By.ID, "weight").get_attribute("value") == "4"
        fill("weight", "0")
        submit(find(By.ID, "save-policy"))
        assert find(By.TAG_NAME, "h1").text == "400 Bad Request"
        assert "weight" in find(By.ID, "error").text
        assert jobq.get_group(engine, "tenant-a") == p

        d.get(f"{base}schedules")  # type: ignore[attr-defined]
        submit(find(By.CSS_SELECTOR, "table.schedules button"))
        assert find(By.TAG_NAME, "h1").text == "Schedules"
        assert find(By.ID, "flash").text == "schedule nightly: paused"
        assert [s.paused for s in jobq.schedules(engine)] == [True]

        d.get(f"{base}audit")  # type: ignore[attr-defined]
        rows = [r.text for r in d.find_elements(By.CSS_SELECTOR, "table.audit tbody tr")]  # type: ignore[attr-defined]
        assert "schedule_pause" in rows[0] and "group_policy" in rows[1] and '"weight": 4' in rows[1], rows

        d.get(f"{base}types")  # type: ignore[attr-defined]
        assert find(By.TAG_NAME, "h1").text == "Types"
        row = find(By.CSS_SELECTOR, "table.types tbody tr").text
        assert row.startswith("resize 1 0 0"), row

"""The dashboard lists the recurring jobs (jobq.schedules) on /schedules and /api/schedules:
names, types and args escaped, args hidden with hide_args, the last slot's job linked."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa

import jobq
import jobq_web
from webclient import call


def test_the_schedules_page_lists_schedules_escaped_and_hides_args(engine: sa.Engine) -> None:
    jobq.create_schema(engine)
    app = jobq_web.app(engine)
    page = call(app, "/schedules")
    assert page.status == 200 and "<h1>Schedules</h1>" in page.body and "class=\"muted\">none</td>" in page.body
    info = jobq.schedule(engine, "<script>x</script>", "t<b>", every=dt.timedelta(hours=1), args={"secret": "s3"})
    [job] = jobq._fire_due(engine, info.next_run_at.replace(tzinfo=None))
    page = call(app, "/schedules")
    assert "&lt;script&gt;x&lt;/script&gt;" in page.body and "<script>x" not in page.body
    assert "t&lt;b&gt;" in page.body and "every 1h00m" in page.body and f'/jobs/{job}">{job}</a>' in page.body
    [row] = call(app, "/api/schedules").json()["schedules"]
    assert (row["name"], row["every"], row["runs"], row["last_job_id"], row["args"]) == (
        "<script>x</script>", 3600.0, 1, job, {"secret": "s3"})
    hidden = jobq_web.app(engine, hide_args=True)
    assert call(hidden, "/api/schedules").json()["schedules"][0]["args"] is None
    assert "s3" not in call(hidden, "/schedules").body
    assert call(app, "/schedules/x").status == 404

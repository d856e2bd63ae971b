"""The job page and its JSON twin show a job's log lines (ctx.log), escaped: a hostile
message or field must reach the page as text, never as markup."""

from __future__ import annotations

import sqlalchemy as sa

import jobq
import jobq_web
from helpers import FAST
from webclient import call

EVIL = '<script>alert("x")</script>'


def test_the_job_page_shows_the_lines_escaped(engine: sa.Engine) -> None:
    job = jobq.enqueue(engine, "t", {})
    w = jobq.Worker(engine, {"t": lambda ctx: ctx.log(EVIL, html=EVIL) and {}}, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=60)
    body = call(jobq_web.app(engine), f"/jobs/{job}").body
    assert 'id="log"' in body and EVIL not in body and "&lt;script&gt;alert(&quot;x&quot;)" in body
    assert call(jobq_web.app(engine), f"/api/jobs/{job}").json()["log"][0]["message"] == EVIL

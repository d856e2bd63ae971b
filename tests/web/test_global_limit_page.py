"""The dashboard shows the stored global limits (jobq.set_limit: the cap and rate every worker
obeys together) on the overview and the groups page, and in their JSON twins."""

from __future__ import annotations

import re

import sqlalchemy as sa

import jobq
import jobq_web
from webclient import call


def shown(body: str) -> str:
    found = re.search(r'<span id="global-limit">([^<]*)</span>', body)
    assert found, body
    return found.group(1)


def test_the_overview_and_groups_page_show_the_stored_global_limits(engine: sa.Engine) -> None:
    """The bug: a queue capped by `jobq limit --max-in-flight 7` showed nothing of it on the
    dashboard, so a full global cap looked like idle workers."""
    jobq.enqueue(engine, "t", group_key="tenant-a")
    app = jobq_web.app(engine)
    for path in ("/", "/groups"):
        assert shown(call(app, path).body) == "cap none, rate none (each worker&#x27;s max_concurrency caps what it runs)"
    jobq.set_limit(engine, max_in_flight=7, rate_limit="100/1m")
    for path in ("/", "/groups"):
        page = call(app, path)
        assert page.status == 200 and shown(page.body) == "cap 7, rate 100/60s", page.body
        data = call(app, "/api" + ("/overview" if path == "/" else path)).json()
        assert (data["global_limit"]["max_in_flight"], data["global_limit"]["rate_limit"]) == (7, [100, 60.0])
        assert data["global_limit"]["updated_at"]
    jobq.set_limit(engine, max_in_flight=jobq.UNLIMITED)
    assert shown(call(app, "/groups").body).startswith("cap none, rate 100/60s")

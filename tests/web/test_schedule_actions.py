"""Pausing and resuming a schedule from /schedules: a token-guarded POST to
``/schedules/pause?name=NAME`` (or resume) through jobq.pause_schedule / resume_schedule, each
recorded in the audit log in the same transaction; names escaped, unknown names a 404."""

from __future__ import annotations

import datetime as dt
import re
import urllib.parse

import sqlalchemy as sa

import jobq
import jobq_web
from webclient import call

TOKEN = "s3cret-dashboard-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
EVIL = '<script>alert("x")</script>&"\'/ é'


def _paused(engine: sa.Engine, name: str) -> bool:
    [s] = [s for s in jobq.schedules(engine) if s.name == name]
    return s.paused


def test_schedule_pause_and_resume_need_the_token_and_are_audited(engine: sa.Engine) -> None:
    """Refused without the token (401), with a cookie but no CSRF field (403) and read-only
    (403): the schedule stays active and nothing is audited. With it, pause then resume change
    the stored schedule and write one audit entry each. A bug shows a refused request that
    paused it, or a change without its entry."""
    jobq.schedule(engine, "nightly", "cleanup", every=dt.timedelta(hours=1))
    app = jobq_web.app(engine, token=TOKEN)
    assert call(app, "/schedules/pause?name=nightly", "POST").status == 401
    cookie = call(app, "/login", "POST", form={"token": TOKEN}).cookies[0].split(";")[0]
    assert call(app, "/schedules/pause?name=nightly", "POST", cookie=cookie).status == 403
    assert call(jobq_web.app(engine), "/schedules/pause?name=nightly", "POST").status == 403
    assert call(jobq_web.app(engine), "/schedules/pause?name=nightly").status == 405
    assert _paused(engine, "nightly") is False and jobq.audit_log(engine) == []
    assert 'action="/schedules/pause' not in call(jobq_web.app(engine), "/schedules").body

    r = call(app, "/schedules/pause?name=nightly", "POST", headers=BEARER)
    assert r.status == 200 and r.json()["paused"] is True and _paused(engine, "nightly") is True
    page = call(app, "/schedules", cookie=cookie).body
    assert "paused" in page and 'action="/schedules/resume?name=nightly"' in page
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert csrf is not None
    r = call(app, "/schedules/resume?name=nightly", "POST", form={"csrf": csrf.group(1)}, cookie=cookie)
    assert r.status == 303 and r.headers["Location"].startswith("/schedules?done=") and _paused(engine, "nightly") is False
    entries = jobq.audit_log(engine)
    assert [(e.actor, e.action, e.filter, e.count) for e in entries] == [
        ("dashboard", "schedule_resume", {"schedule": "nightly"}, 1),
        ("dashboard", "schedule_pause", {"schedule": "nightly"}, 1)]
    assert "schedule_pause" in call(app, "/audit").body


def test_unknown_and_hostile_schedule_names(engine: sa.Engine) -> None:
    """An unknown name is a 404 and audits nothing; a name holding HTML, quotes, a slash and
    accents is escaped on the page and its button pauses exactly that schedule; a control
    character or a missing name is a 400."""
    jobq.schedule(engine, EVIL, "t<b>", every=dt.timedelta(hours=1))
    app = jobq_web.app(engine, token=TOKEN)
    assert call(app, "/schedules/pause?name=nope", "POST", headers=BEARER).status == 404
    assert call(app, "/schedules/pause?name=a%00b", "POST", headers=BEARER).status == 400
    assert call(app, "/schedules/pause", "POST", headers=BEARER).status == 400
    assert jobq.audit_log(engine) == []
    cookie = call(app, "/login", "POST", form={"token": TOKEN}).cookies[0].split(";")[0]
    page = call(app, "/schedules", cookie=cookie).body
    assert "<script>alert" not in page and "&lt;script&gt;" in page and "t&lt;b&gt;" in page
    action = re.search(r'action="(/schedules/pause\?[^"]+)"', page)
    assert action is not None
    target = jobq_web.html.unescape(action.group(1))
    assert urllib.parse.parse_qs(target.partition("?")[2])["name"] == [EVIL]
    r = call(app, target, "POST", headers=BEARER)
    assert r.status == 200 and _paused(engine, EVIL) is True
    offer = call(app, target.replace("/pause", "/resume"), cookie=cookie)
    assert offer.status == 200 and "<script>alert" not in offer.body and 'id="resume"' in offer.body
    assert "<script>alert" not in call(app, "/audit").body

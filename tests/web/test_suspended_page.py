"""Suspended jobs on the dashboard (issue 42): the overview counts them, a job's page says
what it waits for (the signal and its timeout, or the end of its sleep), and a signal is sent
from the page with the token and a CSRF field, as every dashboard action is; a hostile key is
escaped and round-trips through the form."""

from __future__ import annotations

import re

import sqlalchemy as sa

import jobq
import jobq_web
from helpers import FAST
from webclient import call

TOKEN = "s3cret-dashboard-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
HOSTILE = "<script>alert(1)</script>&key=x/y?\"'"


def _suspend(engine: sa.Engine) -> tuple[int, int]:
    waiter = jobq.enqueue(engine, "w", {})
    sleeper = jobq.enqueue(engine, "s", {})
    handlers = {"w": lambda ctx: {"got": ctx.wait_for(HOSTILE, timeout=3600)}, "s": lambda ctx: ctx.sleep(3600)}
    assert jobq.Worker(engine, handlers, max_concurrency=2, **FAST).run_until_idle(timeout=30)
    return waiter, sleeper


def test_the_overview_and_a_job_page_show_a_suspended_job(engine: sa.Engine) -> None:
    """Correct: stats() and the overview count 2 suspended, 1 of them waiting for a signal; the
    waiter's page (and its JSON twin) says "waiting for signal K since T (timeout at T2)", the
    sleeper's "sleeping until T"; the key is escaped everywhere; without the token no form."""
    waiter, sleeper = _suspend(engine)
    st = jobq.stats(engine)
    assert (st["suspended"], st["awaiting_signal"]) == (2, 1), st
    app = jobq_web.app(engine)  # read-only
    page = call(app, "/")
    assert '<span id="suspended">2</span>, <span id="awaiting-signal">1</span> waiting for a signal' in page.body
    detail = call(app, f"/api/jobs/{waiter}").json()
    assert detail["suspended"]["kind"] == "signal" and detail["suspended"]["key"] == HOSTILE
    assert re.fullmatch(r"waiting for signal .* since \S+Z \(timeout at \S+Z\)", detail["suspended"]["text"])
    body = call(app, f"/jobs/{waiter}").body
    assert "<script>alert" not in body and 'id="suspended">suspended: waiting for signal' in body
    assert "send-signal" not in body  # read-only: nothing to send with
    sleep = call(app, f"/api/jobs/{sleeper}").json()["suspended"]
    assert sleep["kind"] == "sleep" and sleep["text"].startswith("sleeping until ")
    assert call(app, f"/api/jobs/{jobq.enqueue(engine, 'x', {})}").json()["suspended"] is None


def test_a_signal_sent_from_the_job_page_wakes_the_job(engine: sa.Engine) -> None:
    """Correct: the form posts to /signals/send with the key in its query; without the token
    (or with a session cookie but no CSRF field) it is refused and nothing is sent; with it the
    signal is sent once (a second send says the first stands), and the job wakes and reads it."""
    waiter, _ = _suspend(engine)
    app = jobq_web.app(engine, token=TOKEN)
    body = call(app, f"/jobs/{waiter}", headers=BEARER).body
    action = re.search(r'<form method="post" action="([^"]+)">', body)
    assert action is not None and "<script>" not in action.group(1)
    path = action.group(1).replace("&amp;", "&")
    assert call(app, path, "POST", form={"payload": "1"}).status == 401
    signed = call(app, "/login", "POST", form={"token": TOKEN})
    cookie = signed.cookies[0].split(";")[0]
    assert call(app, path, "POST", form={"payload": "1"}, cookie=cookie).status == 403  # no CSRF field
    assert jobq.signal(engine, "unrelated", None)  # (the refusals sent nothing: the key is still unsent)
    bad = call(app, path, "POST", form={"payload": "{nope"}, headers=BEARER)
    assert bad.status == 400 and "payload must be JSON" in bad.body
    csrf = re.search(r'name="csrf" value="([^"]+)"', call(app, f"/jobs/{waiter}", cookie=cookie).body)
    assert csrf is not None
    r = call(app, path, "POST", form={"payload": '{"paid": 12.5}', "csrf": csrf.group(1)}, cookie=cookie)
    assert r.status == 303 and r.headers["Location"].startswith(f"/jobs/{waiter}?done=signal+"), r.headers
    again = call(app, path, "POST", form={"payload": "2"}, headers=BEARER)  # a bearer token: JSON back
    assert again.json()["sent"] is False and "its first payload stands" in again.json()["message"]
    assert jobq.Worker(engine, {"w": lambda ctx: {"got": ctx.wait_for(HOSTILE)}, "s": lambda ctx: None},
                       max_concurrency=1, **FAST).run_until_idle(timeout=30)
    info = jobq.get(engine, waiter)
    assert info is not None and info.result == {"got": {"paid": 12.5}}, info
    offer = call(app, path, cookie=cookie)  # the GET at the action's address: the form again
    assert offer.status == 200 and 'id="send-signal"' in offer.body and "<script>alert" not in offer.body

"""The dashboard's WSGI app (jobq_web.py) on every engine: every page and its JSON twin, every
error answered as a clear page or JSON (never a traceback), every value escaped, and actions
only with the token and a CSRF field (else 401/403 and nothing changes)."""

from __future__ import annotations

import datetime as dt
import html
import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import sqlalchemy as sa

import jobq
import jobq_web
from dbs import needs
from helpers import JOBQ_CLI
from webclient import Reply, call

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOKEN = "s3cret-dashboard-token"
EVIL = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def failed_job(engine: sa.Engine, type: str = "fetch", error: str = "Traceback (most recent call last):\nboom",
               **kw: object) -> int:
    """A job that ran once and failed for good (its dependents are closed with it)."""
    job_id = jobq.enqueue(engine, type, {"n": 1}, max_attempts=1, **kw)  # type: ignore[arg-type]
    lease = jobq.claim(engine, "w1", 30)
    assert lease == job_id
    assert jobq.fail(engine, job_id, error, worker_id="w1", token=lease.token) == "failed"
    return job_id


def pipeline(engine: sa.Engine) -> dict[str, int]:
    """A failed upstream with a closed dependent, a container with a ready child, a done job."""
    done = jobq.enqueue(engine, "resize", {"id": 7}, group_key="tenant-b")
    lease = jobq.claim(engine, "w1", 30)
    jobq.finalize(engine, lease, {"ok": True}, worker_id="w1", token=lease.token)
    up = failed_job(engine, group_key="tenant-a")
    down = jobq.enqueue(engine, "publish", {}, depends_on=[up], group_key="tenant-a")
    box = jobq.enqueue(engine, "batch", {}, container=True)
    kid = jobq.enqueue(engine, "part", {"i": 1}, parent=box, group_key="tenant-b")
    return {"done": done, "up": up, "down": down, "box": box, "kid": kid}


def html_ok(r: Reply) -> str:
    assert r.status == 200, r.body
    assert r.headers["Content-Type"].startswith("text/html")
    shown = re.sub(r' title="[^"]*"', "", r.body)  # a list's error cell keeps the whole text in its title
    assert "Traceback" not in shown or "<pre id=\"error\">" in shown
    return r.body


def test_every_page_and_its_json_twin(engine: sa.Engine) -> None:
    """Overview, job list, job detail and groups render, with what an operator looks for; the
    JSON twins carry the same facts."""
    ids = pipeline(engine)
    app = jobq_web.app(engine)
    page = html_ok(call(app, "/"))
    assert 'id="count-failed">2<' in page and 'id="count-done">1<' in page and 'id="count-ready">1<' in page
    assert '<svg class="chart"' in page and "tenant-a" in page and "tenant-b" in page
    ov = call(app, "/api/overview").json()
    assert ov["states"]["failed"] == 2 and ov["states"]["done"] == 1  # the upstream, and the dependent it closed
    assert sum(ov["chart"]["finished"]["done"]) == 1 and sum(ov["chart"]["finished"]["failed"]) == 2
    groups = {g["group"]: g for g in ov["groups"]}
    assert groups["tenant-b"]["due"] == 1 and groups["tenant-b"]["weight"] == 1
    assert groups["tenant-b"]["starts_last_hour"] == 1 and groups["tenant-a"]["starts_last_hour"] == 1

    page = html_ok(call(app, "/jobs"))
    for i in ids.values():
        assert f'href="/jobs/{i}"' in page
    listed = call(app, "/api/jobs").json()
    assert [j["id"] for j in listed["jobs"]] == sorted(ids.values(), reverse=True) and listed["next_before"] is None

    page = html_ok(call(app, f"/jobs/{ids['down']}"))
    why = jobq.why(engine, ids["down"])
    assert f'<p class="why" id="why">{why}</p>' in page and "is failed" in why
    assert '<svg class="dag"' in page and f'href="/jobs/{ids["up"]}"' in page
    assert 'data-state="failed"' in page and jobq._COLOURS["failed"] in page
    detail = call(app, f"/api/jobs/{ids['down']}").json()
    assert detail["why"] == why and detail["depends_on"] == [ids["up"]]
    assert {n["id"] for n in detail["graph"]["nodes"]} == {ids["up"], ids["down"]}
    assert detail["graph"]["edges"] == [[ids["up"], ids["down"]]]
    assert detail["attempt_history"] == [] and detail["progress"] is None

    page = html_ok(call(app, f"/jobs/{ids['up']}"))
    assert 'id="error">Traceback (most recent call last):\nboom</pre>' in page
    assert f'href="/jobs/{ids["down"]}"' in page  # its dependent, as a link
    page = html_ok(call(app, f"/jobs/{ids['done']}"))
    assert '<pre id="result">{\n  &quot;ok&quot;: true\n}</pre>' in page
    page = html_ok(call(app, f"/jobs/{ids['kid']}"))
    assert f'href="/jobs/{ids["box"]}"' in page  # the container, in the picture and as its parent
    box = call(app, f"/api/jobs/{ids['box']}").json()
    assert box["children"] == [ids["kid"]] and {n["id"] for n in box["graph"]["nodes"]} == {ids["box"], ids["kid"]}

    page = html_ok(call(app, "/groups"))
    assert "tenant-a" in page and 'id="policy-note"' in page
    g = call(app, "/api/groups").json()
    assert g["policy_stored"] is True and {r["group"] for r in g["groups"]} >= {"tenant-a", "tenant-b"}
    assert call(app, "/static/jobq.css").headers["Content-Type"].startswith("text/css")
    assert call(app, "/static/jobq.js").status == 200
    assert call(app, "/", "HEAD").body == ""


def test_no_external_requests_and_a_strict_content_policy(engine: sa.Engine) -> None:
    """Every page refers only to the app's own files (no CDN), with no inline script: the CSP
    allows 'self' only, so even an escaping bug could not run a script."""
    ids = pipeline(engine)
    app = jobq_web.app(engine, token=TOKEN)
    for path in ("/", "/jobs", f"/jobs/{ids['down']}", "/groups", "/login"):
        r = call(app, path)
        assert "script-src 'self'" in r.headers["Content-Security-Policy"]
        assert not re.search(r'(src|href)="(https?:)?//', r.body), path
        assert re.findall(r"<script[^>]*>", r.body) == ['<script src="/static/jobq.js">'], path
        assert " style=" not in r.body, path


def test_filters_and_paging(engine: sa.Engine) -> None:
    """State, type, group and time range narrow the list; pages chain by id and cover every job once."""
    ids = pipeline(engine)
    extra = [jobq.enqueue(engine, "bulk", {}, group_key="tenant-c") for _ in range(5)]
    app = jobq_web.app(engine)
    get = lambda q: call(app, "/api/jobs?" + q).json()  # noqa: E731
    assert [j["id"] for j in get("state=failed")["jobs"]] == sorted([ids["up"], ids["down"]], reverse=True)
    assert [j["id"] for j in get("type=bulk&group=tenant-c")["jobs"]] == extra[::-1]
    assert get("group=nobody")["jobs"] == []
    assert len(get("since=1h")["jobs"]) == 10 and get("until=1h")["jobs"] == []
    later = (dt.datetime.now(dt.UTC) + dt.timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert get(f"since={later}")["jobs"] == [] and len(get(f"until={later}")["jobs"]) == 10
    seen, before, pages = [], None, 0
    while True:
        page = get("limit=3" + (f"&before={before}" if before else ""))
        seen += [j["id"] for j in page["jobs"]]
        pages += 1
        before = page["next_before"]
        if before is None:
            break
    assert seen == sorted(seen, reverse=True) and len(seen) == len(set(seen)) == 10 and pages == 4
    html = html_ok(call(app, "/jobs?limit=3&type=bulk"))
    assert 'id="older" href="/jobs?type=bulk&amp;limit=3&amp;before=' in html
    assert 'value="bulk"' in html


@pytest.mark.parametrize("path,status,needle", [
    ("/jobs/abc", 400, "a job id is a positive whole number"),
    ("/jobs/0", 400, "a job id is a positive whole number"),
    ("/jobs/-3", 400, "a job id is a positive whole number"),
    ("/jobs/99999999999999999999999", 400, "a job id is a positive whole number"),
    ("/jobs/424242", 404, "no job with id 424242"),
    ("/api/jobs/424242", 404, "no job with id 424242"),
    ("/nowhere", 404, "no page at /nowhere"),
    ("/static/evil.js", 404, "no file"),
    ("/jobs?state=bogus", 400, "state must be one of"),
    ("/jobs?limit=0", 400, "limit must be a whole number"),
    ("/jobs?limit=lots", 400, "limit must be a whole number"),
    ("/jobs?before=-1", 400, "before must be a whole number"),
    ("/jobs?since=yesterday", 400, "since must be a duration"),
    ("/jobs?until=2026-13-45T00:00:00Z", 400, "until must be a duration"),
    ("/jobs?type=" + "x" * 300, 400, "type is at most 200 characters"),
    ("/jobs/1/retry", 405, "actions are POST requests"),
])
def test_bad_requests_answer_a_clear_error(engine: sa.Engine, path: str, status: int, needle: str) -> None:
    """Each bad request gets its status and one sentence, as a page or (under /api, or asked
    for) as JSON; never a traceback."""
    jobq.enqueue(engine, "t", {})
    app = jobq_web.app(engine)
    r = call(app, path)
    assert r.status == status and needle in r.body and "Traceback" not in r.body, r.body
    if path.startswith("/api/"):
        assert r.json() == {"error": r.json()["error"], "status": status}
    else:
        assert r.headers["Content-Type"].startswith("text/html") and 'id="error"' in r.body
    r = call(app, path, headers={"Accept": "application/json"})
    assert r.status == status and needle in r.json()["error"]
    assert call(app, "/jobs", "DELETE").status == 405
    assert call(app, "/groups", "POST").status == 405
    assert call(app, "/whatever/else", "POST").status == 404


def test_a_database_that_went_away_is_a_503_without_its_url() -> None:
    """No server behind the URL: every page answers 503 with a sentence, and neither the
    password nor the URL appears in it."""
    engine = sa.create_engine("postgresql+psycopg://jobq:hunter2-secret@127.0.0.1:1/jobs",
                              connect_args={"connect_timeout": 2})
    app = jobq_web.app(engine, token=TOKEN)
    for path in ("/", "/jobs", "/jobs/1", "/groups", "/api/overview", "/api/jobs/1"):
        r = call(app, path)
        assert r.status == 503 and "the database did not answer" in r.body, (path, r.body)
        assert "hunter2" not in r.body and "127.0.0.1:1" not in r.body and "Traceback" not in r.body
    engine.dispose()


def test_a_deleted_sqlite_file_is_a_503(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "q.db"
    engine = sa.create_engine(f"sqlite:///{path}")
    jobq.create_schema(engine)
    app = jobq_web.app(engine)
    assert call(app, "/").status == 200
    engine.dispose()
    path.unlink()
    (tmp_path / "q.db").mkdir()  # the path is now a directory: SQLite cannot open it
    r = call(app, "/api/overview")
    assert r.status == 503 and "the database did not answer" in r.json()["error"]


def test_every_value_is_escaped(engine: sa.Engine) -> None:
    """A job whose type, group, args and error hold HTML and script renders them as text on
    every page (and keeps them intact in JSON)."""
    bad = failed_job(engine, type=EVIL[:60], error=f"Traceback\n{EVIL}", group_key="g" + EVIL[:40])
    jobq.enqueue(engine, "ok", {"html": EVIL}, depends_on=[bad])
    app = jobq_web.app(engine, token=TOKEN)
    pages = ["/", "/jobs", f"/jobs/{bad}", f"/jobs/{bad + 1}", "/groups", f"/jobs?type={EVIL[:60]}",
             f"/jobs?group=g{EVIL[:40]}", f"/nope{EVIL}", f"/login?next={EVIL}"]
    for path in pages:
        body = call(app, path).body
        assert "<script>alert" not in body and "<img src=x" not in body, path
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in call(app, f"/jobs/{bad}").body
    assert EVIL in call(app, f"/api/jobs/{bad}").json()["error"]
    assert call(app, f"/api/jobs/{bad + 1}").json()["args"] == {"html": EVIL}


def test_hide_args_keeps_arguments_off_every_page(engine: sa.Engine) -> None:
    job = jobq.enqueue(engine, "t", {"card": "4111-1111"})
    app = jobq_web.app(engine, hide_args=True)
    assert "4111" not in call(app, f"/jobs/{job}").body and "hidden" in call(app, f"/jobs/{job}").body
    data = call(app, f"/api/jobs/{job}").json()
    assert data["args"] is None and data["args_hidden"] is True
    assert "4111" in call(jobq_web.app(engine), f"/jobs/{job}").body


def _session(app: object) -> tuple[str, str]:
    """Sign in: the session cookie, and the CSRF field the job page carries."""
    r = call(app, "/login", "POST", form={"token": TOKEN, "next": "/groups"})
    assert r.status == 303 and r.headers["Location"] == "/groups"
    cookie = r.cookies[0].split(";")[0]
    assert "HttpOnly" in r.cookies[0] and "SameSite=Strict" in r.cookies[0]
    return cookie, ""


def test_actions_need_the_token_and_a_csrf_field(engine: sa.Engine) -> None:
    """Retry and cancel change the job only with the token (a session cookie plus the page's
    CSRF field, or a bearer header); otherwise 401/403, and the job is as it was."""
    up = failed_job(engine)
    live = jobq.enqueue(engine, "t", {})
    state = lambda i: jobq.get(engine, i).state  # noqa: E731

    ro = jobq_web.app(engine)  # no token: read-only
    for path in (f"/jobs/{up}/retry", f"/jobs/{live}/cancel"):
        r = call(ro, path, "POST")
        assert r.status == 403 and "read-only" in r.body
        assert call(ro, path, "POST", headers={"Authorization": f"Bearer {TOKEN}"}).status == 403
    assert 'id="retry"' not in call(ro, f"/jobs/{up}").body
    assert call(ro, "/login").status == 403

    app = jobq_web.app(engine, token=TOKEN)
    assert call(app, f"/jobs/{up}/retry", "POST").status == 401
    assert call(app, f"/jobs/{up}/retry", "POST", headers={"Authorization": "Bearer wrong-token"}).status == 401
    assert call(app, f"/jobs/{up}/retry", "POST", cookie="jobq_session=forged").status == 401
    assert call(app, "/login", "POST", form={"token": "wrong-token"}).status == 401
    cookie, _ = _session(app)
    page = call(app, f"/jobs/{up}", cookie=cookie).body
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page).group(1)
    assert call(app, f"/jobs/{up}/retry", "POST", cookie=cookie).status == 403  # no CSRF field
    assert call(app, f"/jobs/{up}/retry", "POST", cookie=cookie, form={"csrf": "0" * 64}).status == 403
    r = call(app, f"/jobs/{up}/retry", "POST", cookie=cookie, form={"csrf": csrf},
             headers={"Origin": "https://evil.example"})
    assert r.status == 403 and "CSRF" in r.body
    assert state(up) == "failed" and state(live) == "ready"

    r = call(app, f"/jobs/{up}/retry", "POST", cookie=cookie, form={"csrf": csrf},
             headers={"Origin": "http://127.0.0.1:8080"})
    assert r.status == 303 and r.headers["Location"].startswith(f"/jobs/{up}?done=re-opened")
    assert state(up) == "ready"
    r = call(app, f"/jobs/{live}/cancel", "POST", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status == 200 and r.json()["result"] == "cancelled" and state(live) == "cancelled"
    r = call(app, f"/jobs/{up}/retry", "POST", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status == 409 and "ready" in r.json()["error"]  # not failed or cancelled: refused, unchanged
    assert call(app, "/jobs/424242/cancel", "POST", headers={"Authorization": f"Bearer {TOKEN}"}).status == 404
    assert call(app, "/jobs/x/cancel", "POST", headers={"Authorization": f"Bearer {TOKEN}"}).status == 400
    r = call(app, "/logout", "POST", cookie=cookie)
    assert r.status == 303 and "Max-Age=0" in r.cookies[0]


def test_group_pause_needs_the_token_and_stores_the_policy(engine: sa.Engine) -> None:
    """Pause/resume go through the same token and CSRF checks, and then through jobq.set_group:
    the stored policy says paused (the groups page shows it), and resume clears it. A bug shows
    a pause without the token taking effect, or a pause that stores nothing."""
    jobq.enqueue(engine, "t", {}, group_key="tenant-a")
    app = jobq_web.app(engine, token=TOKEN)
    assert call(app, "/groups/tenant-a/pause", "POST").status == 401
    cookie, _ = _session(app)
    assert call(app, "/groups/tenant-a/pause", "POST", cookie=cookie).status == 403
    assert call(jobq_web.app(engine), "/groups/tenant-a/resume", "POST").status == 403
    assert jobq.get_group(engine, "tenant-a") is None  # nothing stored by the refused requests
    r = call(app, "/groups/tenant-a/pause", "POST", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status == 200 and jobq.get_group(engine, "tenant-a").paused is True  # type: ignore[union-attr]
    rows = {g["group"]: g for g in call(app, "/api/groups").json()["groups"]}
    assert rows["tenant-a"]["paused"] is True
    r = call(app, "/groups/tenant-a/resume", "POST", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status == 200 and jobq.get_group(engine, "tenant-a").paused is False  # type: ignore[union-attr]


def _follow_sign_in(app: object, refused: Reply) -> tuple[str, Reply]:
    """From a refused action's 401 page, as a person: its Sign in link, the form, the token;
    then the page the redirect leads to. Returns the session cookie and that page."""
    link = html.unescape(re.search(r'<a href="([^"]*)">Sign in</a>', refused.body).group(1))
    form = call(app, link).body
    nxt = html.unescape(re.search(r'name="next" value="([^"]*)"', form).group(1))
    r = call(app, "/login", "POST", form={"token": TOKEN, "next": nxt}, headers={"Origin": "http://127.0.0.1:8080"})
    assert r.status == 303
    cookie = r.cookies[0].split(";")[0]
    return cookie, call(app, r.headers["Location"], cookie=cookie)


def test_signing_in_after_a_refused_action_offers_it_again(engine: sa.Engine) -> None:
    """A refused Retry (or group pause) leads through sign-in to a page that offers the same
    action as a button, which then works, instead of a GET of the POST-only address (a 405)."""
    up = failed_job(engine, group_key="org/team")
    app = jobq_web.app(engine, token=TOKEN)
    origin = {"Origin": "http://127.0.0.1:8080"}
    refused = call(app, f"/jobs/{up}/retry", "POST")
    assert refused.status == 401 and jobq.get(engine, up).state == "failed"
    cookie, landed = _follow_sign_in(app, refused)
    assert landed.status == 200, (landed.status, landed.body)
    action = re.search(r'method="post" action="([^"]*/(?:retry|pause)\b[^"]*)"', landed.body).group(1)
    assert action == f"/jobs/{up}/retry" and 'id="retry"' in landed.body and jobq.why(engine, up) in html.unescape(landed.body)
    r = call(app, action, "POST", cookie=cookie, form={"csrf": re.search(r'name="csrf" value="([0-9a-f]+)"', landed.body).group(1)},
             headers=origin)
    assert r.status == 303 and jobq.get(engine, up).state == "ready"
    landed = call(app, f"/jobs/{up}/retry", cookie=cookie)  # nothing to retry now: said, no button
    assert landed.status == 200 and 'id="not-offered"' in landed.body and 'id="retry"' not in landed.body

    page = call(app, "/groups").body  # a group whose name needs encoding, the same way
    action = html.unescape(re.search(r'action="([^"]*pause[^"]*)"', page).group(1))
    refused = call(app, action, "POST")
    assert refused.status == 401
    cookie, landed = _follow_sign_in(app, refused)
    assert landed.status == 200 and "Pause group org/team" in landed.body and 'id="group-state"' in landed.body
    again = html.unescape(re.search(r'method="post" action="([^"]*/(?:retry|pause)\b[^"]*)"', landed.body).group(1))
    r = call(app, again, "POST", cookie=cookie, form={"csrf": re.search(r'name="csrf" value="([0-9a-f]+)"', landed.body).group(1)},
             headers=origin)
    assert r.status == 303 and jobq.get_group(engine, "org/team").paused is True  # type: ignore[union-attr]
    assert call(jobq_web.app(engine), f"/jobs/{up}/retry").status == 405  # read-only: nothing to offer
    assert call(app, f"/api/jobs/{up}/retry").status == 405
    assert call(app, f"/jobs/{up}/retry", headers={"Accept": "application/json"}).status == 405


def test_a_wrong_credential_is_told_apart_from_none(engine: sa.Engine) -> None:
    """No credential: sign in first. A wrong bearer token: wrong token. A session cookie that
    is not this dashboard's (its token changed): sign in again. All 401, nothing changes."""
    job = jobq.enqueue(engine, "t", {})
    app = jobq_web.app(engine, token=TOKEN)
    path = f"/jobs/{job}/cancel"
    r = call(app, path, "POST", headers={"Accept": "application/json"})
    assert r.status == 401 and "sign in with the dashboard token first" in r.json()["error"]
    r = call(app, path, "POST", headers={"Authorization": "Bearer wrong-token"})
    assert r.status == 401 and r.json()["error"].startswith("wrong token"), r.body
    r = call(app, path, "POST", headers={"Authorization": f"Basic {TOKEN}"})
    assert r.status == 401 and "Bearer" in r.json()["error"]
    r = call(app, path, "POST", cookie="jobq_session=" + "0" * 64, form={"csrf": "0" * 64})
    assert r.status == 401 and "sign in again" in r.body
    assert jobq.get(engine, job).state == "ready"


def test_cancelling_a_running_job_says_cancel_requested(engine: sa.Engine) -> None:
    """Cancel of a leased or running job only asks its handler to stop: the banner and the JSON
    say "cancel requested" (not "job N: running", read as done), and the job page marks it
    until the job ends."""
    job = jobq.enqueue(engine, "t", {})
    lease = jobq.claim(engine, "w1", 30)
    assert lease == job
    app = jobq_web.app(engine, token=TOKEN)
    cookie, _ = _session(app)
    page = call(app, f"/jobs/{job}", cookie=cookie).body
    assert 'id="cancel-requested"' not in page
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page).group(1)
    r = call(app, f"/jobs/{job}/cancel", "POST", cookie=cookie, form={"csrf": csrf},
             headers={"Origin": "http://127.0.0.1:8080"})
    assert r.status == 303
    page = html_ok(call(app, r.headers["Location"], cookie=cookie))
    flash = html.unescape(re.search(r'id="flash">([^<]*)<', page).group(1))
    assert "cancel requested" in flash and f"job {job}: {jobq.get(engine, job).state}" != flash, flash
    assert 'id="cancel-requested">cancel requested<' in page and 'id="cancel"' not in page
    assert call(app, f"/api/jobs/{job}").json()["cancel_requested"] is True
    r = call(app, f"/jobs/{job}/cancel", "POST", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status == 200 and "cancel requested" in r.json()["message"]
    assert jobq.fail(engine, job, "stopped", worker_id="w1", token=lease.token) == "cancelled"
    page = html_ok(call(app, f"/jobs/{job}"))
    assert 'id="cancel-requested"' not in page and "s-cancelled" in page
    done = jobq.enqueue(engine, "t", {})
    lease = jobq.claim(engine, "w1", 30)
    jobq.finalize(engine, lease, {}, worker_id="w1", token=lease.token)
    r = call(app, f"/jobs/{done}/cancel", "POST", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status == 409 and "nothing to cancel" in r.json()["error"] and jobq.get(engine, done).state == "done"


def test_cancelling_a_held_job_says_cancel_requested_and_when_it_applies(engine: sa.Engine) -> None:
    """A held job (spawned by a handler still running) offers Cancel; the action records the
    request and says when it applies (the spawner's release), not "job N: held"; the page
    marks the request and offers no second Cancel."""
    sid = jobq.enqueue(engine, "s", max_attempts=1)
    lease = jobq.claim_batch(engine, "w", 30)[0]
    x = jobq._spawn(engine, jobq._plan([{"type": "leaf"}], single=True),
                    jobq._Hold(sid, lease.token, frozenset()))[jobq._ONE]
    app = jobq_web.app(engine, token=TOKEN)
    cookie, _ = _session(app)
    assert 'id="cancel"' in html_ok(call(app, f"/jobs/{x}", cookie=cookie))
    r = call(app, f"/jobs/{x}/cancel", "POST", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status == 200 and r.json()["result"] == "held", r.body
    assert r.json()["message"].startswith(f"job {x}: cancel requested") and "spawner" in r.json()["message"]
    assert call(app, f"/api/jobs/{x}").json()["cancel_requested"] is True
    page = html_ok(call(app, f"/jobs/{x}", cookie=cookie))
    assert 'id="cancel-requested">cancel requested<' in page and 'id="cancel"' not in page


def test_a_short_token_is_refused(engine: sa.Engine) -> None:
    with pytest.raises(ValueError, match="at least 8"):
        jobq_web.app(engine, token="abc")


def test_mounted_under_a_prefix_links_stay_inside_it(engine: sa.Engine) -> None:
    """Under a framework the app sees SCRIPT_NAME: every link, form and file it writes starts with it."""
    ids = pipeline(engine)
    app = jobq_web.app(engine, token=TOKEN)

    def mounted(environ: dict, start_response: object) -> object:
        environ["SCRIPT_NAME"] = "/ops/jobq"
        return app(environ, start_response)

    body = call(mounted, f"/jobs/{ids['down']}").body
    assert 'href="/ops/jobq/static/jobq.css"' in body and f'href="/ops/jobq/jobs/{ids["up"]}"' in body
    assert not re.search(r'(href|src|action)="/(?!ops/jobq)', body)


@needs("partial_indexes")  # as test_stats_reads_only_indexes
def test_the_overview_reads_only_indexes(engine: sa.Engine) -> None:
    """The overview stays cheap on millions of finished rows: every statement it runs is
    planned on an index, none scans the jobs table."""
    pipeline(engine)
    seen: list[tuple[str, object]] = []

    def capture(conn, cursor, statement, parameters, context, executemany):  # noqa: ANN001
        if " jobs" in statement and not statement.lstrip().upper().startswith("EXPLAIN"):
            seen.append((statement, parameters))

    sa.event.listen(engine, "before_cursor_execute", capture)
    jobq_web.overview(engine)
    sa.event.remove(engine, "before_cursor_execute", capture)
    assert any("CASE WHEN" in s for s, _ in seen) and len(seen) >= 8
    with engine.connect() as conn:
        for statement, params in seen:
            if engine.dialect.name == "sqlite":
                plan = " | ".join(str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, params))
                bad = [s for s in plan.split(" | ") if s.startswith("SCAN jobs") and "INDEX ix_jobs_" not in s]
            else:
                conn.exec_driver_sql("SET enable_seqscan = off")
                plan = " | ".join(r[0] for r in conn.exec_driver_sql("EXPLAIN " + statement, params))
                bad = ["Seq Scan"] if "Seq Scan on jobs" in plan else []
            assert not bad, f"{statement}\n{plan}"
        conn.rollback()


# ---- the serve command


def test_serve_without_jobq_web_says_what_to_copy(tmp_path: pathlib.Path) -> None:
    shutil.copy(ROOT / "single" / "jobq.py", tmp_path / "jobq.py")
    db = tmp_path / "q.db"
    subprocess.run([sys.executable, "jobq.py", "--url", f"sqlite:///{db}", "init"], cwd=tmp_path, check=True,
                   capture_output=True)
    # jobq_web may be importable from the test's sys.path (an editable install): block it, so
    # that this jobq.py finds no dashboard, neither importable nor beside it
    stub = ("import runpy, sys; sys.modules['jobq_web'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path('jobq.py', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", stub, "jobq.py", "--url", f"sqlite:///{db}", "serve"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "copy jobq_web.py" in r.stderr and str(tmp_path / "jobq_web.py") in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("argv,code,needle", [
    (["--port", "http"], 2, "a port is a number from 0 to 65535"),
    (["--port", "70000"], 2, "a port is a number from 0 to 65535"),
    (["--token", "short"], 2, "at least 8 characters"),
])
def test_serve_refuses_bad_options(tmp_path: pathlib.Path, argv: list[str], code: int, needle: str) -> None:
    db = tmp_path / "q.db"
    subprocess.run([*JOBQ_CLI, "--url", f"sqlite:///{db}", "init"], check=True,
                   capture_output=True)
    r = subprocess.run([*JOBQ_CLI, "--url", f"sqlite:///{db}", "serve", *argv],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == code and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_serve_on_a_taken_port_says_so(tmp_path: pathlib.Path) -> None:
    import socket

    db = tmp_path / "q.db"
    subprocess.run([*JOBQ_CLI, "--url", f"sqlite:///{db}", "init"], check=True,
                   capture_output=True)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([*JOBQ_CLI, "--url", f"sqlite:///{db}", "serve", "--port",
                            str(port)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr


def test_serve_binds_loopback_and_warns_elsewhere_without_a_token(tmp_path: pathlib.Path) -> None:
    """`jobq serve` listens on 127.0.0.1 by default and answers; bound to every address without
    a token it prints a warning first."""
    import urllib.request

    from helpers_web import running_server

    db = tmp_path / "q.db"
    url = f"sqlite:///{db}"
    subprocess.run([*JOBQ_CLI, "--url", url, "init"], check=True, capture_output=True)
    with running_server(url, "--port", "0") as (base, err):
        assert base.startswith("http://127.0.0.1:") and "warning" not in err
        with urllib.request.urlopen(base + "api/overview", timeout=30) as r:
            assert json.loads(r.read())["states"]["ready"] == 0
    with running_server(url, "--host", "0.0.0.0", "--port", "0") as (base, err):
        assert "warning: the dashboard is bound to 0.0.0.0" in err and "without a token" in err


def test_the_seams_call_jobq_apis_where_they_exist(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where jobq has set_group and attempts (added by other work), the dashboard uses them:
    pause goes through jobq.set_group (on a connection of the dashboard's engine: the pause and
    its audit entry commit together), and the job page lists the attempt history."""
    job = failed_job(engine, group_key="tenant-a")
    calls: list[tuple[object, ...]] = []

    def set_group(e: sa.Connection, g: str, *, paused: bool) -> jobq.GroupPolicy:
        calls.append((e.engine, g, paused))
        return jobq.GroupPolicy(g, None, None, None, paused, dt.datetime.now(dt.UTC))

    monkeypatch.setattr(jobq, "set_group", set_group, raising=False)
    monkeypatch.setattr(jobq, "attempts", lambda e, i: [{"attempt": 1, "error": "<b>boom</b>"}], raising=False)
    app = jobq_web.app(engine, token=TOKEN)
    r = call(app, "/groups/tenant-a/pause", "POST", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status == 200 and calls == [(engine, "tenant-a", True)]
    page = call(app, f"/jobs/{job}").body
    assert "<h2>Attempts</h2>" in page and "&lt;b&gt;boom&lt;/b&gt;" in page
    assert call(app, f"/api/jobs/{job}").json()["attempt_history"] == [{"attempt": 1, "error": "<b>boom</b>"}]


def _statements(engine: sa.Engine, app: object, path: str) -> int:
    n = [0]

    def count(*_a: object) -> None:
        n[0] += 1

    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        assert call(app, path).status == 200
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)
    return n[0]


def test_thousands_of_groups_page_through_in_a_fixed_number_of_statements(engine: sa.Engine) -> None:
    """Issue 14's tenants on the dashboard: 600 groups with due work, past SQLite's 500 terms
    per compound SELECT, which the old per-group weight read hit (a 503 there; 7 s for 3,000
    groups on PostgreSQL). Overview and /groups answer with a bounded page, pages chain by name
    and cover every group once, the weight column still shows a stored weight and a job's
    weight, and a page costs the same statements as with a handful of groups."""
    jobq.submit(engine, [{"key": str(i), "type": "t", "group_key": f"g{i:04d}"} for i in range(6)])
    app = jobq_web.app(engine)
    few = (_statements(engine, app, "/"), _statements(engine, app, "/groups"))
    jobq.submit(engine, [{"key": str(i), "type": "t", "group_key": f"g{i:04d}", "weight": 3 if i == 7 else 1}
                         for i in range(6, 600)])
    jobq.set_group(engine, "g0008", weight=5)
    assert (_statements(engine, app, "/"), _statements(engine, app, "/groups")) == few
    html = html_ok(call(app, "/"))
    assert 'id="all-groups"' in html and "all 600 groups" in html and html.count('href="/jobs?group=g') == 20
    html = html_ok(call(app, "/groups"))
    assert html.count('href="/jobs?group=g') == 100 and "100 of 600 groups" in html
    assert 'id="next-groups" href="/groups?after=g0099"' in html
    assert "g0100" in html_ok(call(app, "/groups?after=g0099")) and "g0099" not in call(app, "/groups?after=g0099").body
    names, after, pages = [], None, 0
    while True:
        page = call(app, "/api/groups?limit=250" + (f"&after={after}" if after else "")).json()
        names += [g["group"] for g in page["groups"]]
        pages += 1
        after = page["next_after"]
        if after is None:
            break
    assert names == [f"g{i:04d}" for i in range(600)] and pages == 3
    every = {g["group"]: g for g in call(app, "/api/groups").json()["groups"]}  # the JSON twin: all, as before
    assert len(every) == 600 and (every["g0007"]["weight"], every["g0008"]["weight"], every["g0000"]["weight"]) == (3, 5, 1)
    assert every["g0008"]["weight_share"] == round(5 / 606, 3) and every["g0000"]["weight_share"] == round(1 / 606, 3)
    assert call(app, "/groups?after=" + "x" * 300).status == 400
    if engine.dialect.name == "sqlite":  # the broken variant: a per-group read, one UNION term per group
        with engine.connect() as conn, pytest.raises(sa.exc.OperationalError, match="too many terms"):
            conn.execute(_per_group_counts(sorted(every), dt.datetime(2030, 1, 1), 100)).all()


def _per_group_counts(groups: list[str], now: dt.datetime, limit: int) -> sa.CompoundSelect:
    """Per group: runnable jobs (up to ``limit``) and their largest weight, as one UNION term per
    group (the broken variant of the dashboard's weight column)."""
    c = jobq.Job.__table__.c
    parts = []
    for g in groups:
        sub = (sa.select(c.weight).where(c.state == "ready", c.group_key == g, c.run_after <= now)
               .order_by(c.priority.desc(), c.run_after, c.id).limit(limit).subquery())
        parts.append(sa.select(sa.literal(g), sa.func.count(), sa.func.max(sub.c.weight)).select_from(sub))
    return sa.union_all(*parts)

"""Editing a group's weight, cap and rate from the groups page: a token-guarded POST to
``/groups/policy?group=NAME`` through jobq.set_group, each change in the audit log; bad values
refused with a sentence naming the field, nothing stored and nothing audited."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa

import jobq
import jobq_web
from webclient import call

TOKEN = "s3cret-dashboard-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
EVIL = '<script>alert("x")</script>&"\'/ é'


def _post(app: object, group: str, **form: str) -> object:
    return call(app, f"/groups/policy?group={jobq_web.urllib.parse.quote(group, safe='')}", "POST",
                form=form, headers=BEARER)


def test_the_policy_form_needs_the_token_and_stores_and_audits(engine: sa.Engine) -> None:
    """Without the token (or read-only) the POST is refused and stores nothing; with it, weight,
    cap and rate are stored as set_group stores them, an empty field keeps its value, ``none``
    removes a cap or rate, and each change is one audit entry naming the group and the values.
    A bug shows a refused request that stored something, or a change without its entry."""
    jobq.enqueue(engine, "t", {}, group_key="tenant-a")
    app = jobq_web.app(engine, token=TOKEN)
    assert call(app, "/groups/policy?group=tenant-a", "POST", form={"weight": "3"}).status == 401
    assert call(jobq_web.app(engine), "/groups/policy?group=tenant-a", "POST", form={"weight": "3"}).status == 403
    cookie = call(app, "/login", "POST", form={"token": TOKEN}).cookies[0].split(";")[0]
    assert call(app, "/groups/policy?group=tenant-a", "POST", form={"weight": "3"}, cookie=cookie).status == 403
    assert jobq.get_group(engine, "tenant-a") is None and jobq.audit_log(engine) == []

    r = _post(app, "tenant-a", weight="3", cap="2", rate="10/1m")
    assert r.status == 200, r.body  # type: ignore[attr-defined]
    p = jobq.get_group(engine, "tenant-a")
    assert p is not None and (p.weight, p.max_in_flight, p.rate_limit, p.paused) == (3, 2, (10, 60.0), False)
    assert r.json()["policy"]["max_in_flight"] == 2  # type: ignore[attr-defined]
    r = _post(app, "tenant-a", cap="none")
    p = jobq.get_group(engine, "tenant-a")
    assert p is not None and (p.weight, p.max_in_flight, p.rate_limit) == (3, None, (10, 60.0))
    _post(app, "tenant-a", rate="none", weight="5")
    p = jobq.get_group(engine, "tenant-a")
    assert p is not None and (p.weight, p.max_in_flight, p.rate_limit) == (5, None, None)
    entries = jobq.audit_log(engine)
    assert [(e.actor, e.action, e.count) for e in entries] == [("dashboard", "group_policy", 1)] * 3
    assert entries[0].filter == {"group": "tenant-a", "weight": 5, "rate_limit": "none"}
    assert entries[1].filter == {"group": "tenant-a", "max_in_flight": "none"}
    assert entries[2].filter == {"group": "tenant-a", "weight": 3, "max_in_flight": 2, "rate_limit": "10/1m"}
    row = {g["group"]: g for g in call(app, "/api/groups").json()["groups"]}["tenant-a"]
    assert (row["weight"], row["cap"], row["rate"]) == (5, None, None)
    # pause and resume are audited too
    call(app, "/groups/pause?group=tenant-a", "POST", headers=BEARER)
    assert [e.action for e in jobq.audit_log(engine)][:1] == ["group_pause"]
    audit = call(app, "/audit").body
    assert "group_policy" in audit and "group_pause" in audit


BAD = [
    ({"weight": "0"}, "weight"), ({"weight": "-1"}, "weight"), ({"weight": "1.5"}, "weight"),
    ({"weight": "abc"}, "weight"), ({"weight": "true"}, "weight"), ({"weight": "9" * 40}, "weight"),
    ({"weight": "\u0663"}, "weight"), ({"weight": "1e3"}, "weight"), ({"weight": "\u00b2"}, "weight"),
    ({"cap": "0"}, "max_in_flight"), ({"cap": "NaN"}, "cap"), ({"cap": "-5"}, "cap"), ({"cap": "2**70"}, "cap"),
    ({"cap": "9" * 30}, "max_in_flight"), ({"rate": "0/1m"}, "rate"), ({"rate": "10/0"}, "rate"),
    ({"rate": "10"}, "rate"), ({"rate": "x/1m"}, "rate"), ({"rate": "10/1y"}, "rate"),
    ({"rate": "1/0.001"}, "rate"), ({"rate": "10/nan"}, "rate"), ({"rate": "10/inf"}, "rate"),
    ({"rate": "\u0661\u0660/1m"}, "rate"), ({"rate": "10/1m\x00"}, "rate"), ({"rate": "10/99999d"}, "rate"),
    ({"rate": "<b>1</b>/1m"}, "rate"), ({"weight": "3", "cap": "zero"}, "cap"), ({"weight": "", "cap": ""}, "nothing"),
    ({}, "nothing"), ({"weight": "3\n4"}, "weight"),
]


@pytest.mark.parametrize(("form", "needle"), BAD, ids=[repr(f) for f, _ in BAD])
def test_hostile_values_are_refused_and_change_nothing(engine: sa.Engine, form: dict[str, str], needle: str) -> None:
    """Each bad value is a 400 whose sentence names the field, and the stored policy (with its
    updated_at) and the audit log are as before, even when the other fields were good. A bug
    shows a 200, a 500, a clamped value stored, or an audit entry for a refused change."""
    jobq.create_schema(engine)
    before = jobq.set_group(engine, "g", weight=2, max_in_flight=4, rate_limit="5/30s")
    app = jobq_web.app(engine, token=TOKEN)
    r = _post(app, "g", **form)
    assert r.status == 400, (form, r.status, r.body)  # type: ignore[attr-defined]
    message = r.json()["error"]  # type: ignore[attr-defined]
    assert needle in message and "Traceback" not in message, message
    assert jobq.get_group(engine, "g") == before and jobq.audit_log(engine) == []


def test_hostile_group_names_are_escaped_and_round_trip(engine: sa.Engine) -> None:
    """A group named with HTML, quotes, a slash and accents shows escaped on the groups page and
    on its policy form, whose action names it exactly (set for that group, no other); a name
    with a control character is a 400."""
    jobq.enqueue(engine, "t", {}, group_key=EVIL)
    app = jobq_web.app(engine, token=TOKEN)
    page = call(app, "/groups", headers=BEARER).body
    assert "<script>alert" not in page and "&lt;script&gt;" in page and "edit policy" in page
    href = re.search(r'class="edit" href="([^"]+)"', page)
    assert href is not None
    cookie = call(app, "/login", "POST", form={"token": TOKEN}).cookies[0].split(";")[0]
    form_page = call(app, jobq_web.html.unescape(href.group(1)), cookie=cookie)
    assert form_page.status == 200 and "<script>alert" not in form_page.body and 'id="save-policy"' in form_page.body
    action = re.search(r'method="post" action="(/groups/policy[^"]+)"', form_page.body)
    assert action is not None
    r = call(app, jobq_web.html.unescape(action.group(1)), "POST", form={"weight": "7"}, headers=BEARER)
    assert r.status == 200, r.body
    assert [(p.group_key, p.weight) for p in jobq.groups(engine)] == [(EVIL, 7)]
    assert "<script>alert" not in call(app, "/audit").body
    assert _post(app, "a\x00b", weight="2").status == 400  # type: ignore[attr-defined]
    assert _post(app, "a\x1bb", weight="2").status == 400  # type: ignore[attr-defined]
    assert [p.group_key for p in jobq.groups(engine)] == [EVIL]


def test_the_policy_form_with_a_session_and_csrf(engine: sa.Engine) -> None:
    """As a browser does it: signed in, the form carries the CSRF field, and its values are the
    stored ones; posting it redirects to the groups page with the new policy in words."""
    jobq.set_group(engine, "g", weight=2, rate_limit="5/30s")
    app = jobq_web.app(engine, token=TOKEN)
    cookie = call(app, "/login", "POST", form={"token": TOKEN}).cookies[0].split(";")[0]
    page = call(app, "/groups/policy?group=g", cookie=cookie).body
    assert 'name="weight" id="weight" value="2"' in page and 'value="5/30s"' in page and 'id="cap" value="none"' in page
    csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert csrf is not None
    r = call(app, "/groups/policy?group=g", "POST", form={"csrf": csrf.group(1), "weight": "2", "cap": "3",
                                                          "rate": "5/30s"}, cookie=cookie)
    assert r.status == 303 and "cap+3" in r.headers["Location"], r.headers
    p = jobq.get_group(engine, "g")
    assert p is not None and (p.weight, p.max_in_flight, p.rate_limit) == (2, 3, (5, 30.0))
    assert call(jobq_web.app(engine), "/groups/policy?group=g").status == 405  # read-only: no form

"""The dashboard against hostile requests (test plan row D1), on every engine: names that
need escaping in a URL round-trip through the page's own links and buttons, in process and
under a real `jobq serve`; the sign-in's ``next`` leads only to a path on the same site; no
control character reaches a header; and malformed numbers, cookies and filters answer a
one-sentence 4xx, never a 5xx.

A bug shows as a 404 for a group the page itself listed (its name arrived split at an encoded
``/``), a ``Location`` to another host or with an injected header line, or a 500/503 (or an
exception out of the app) for a request that was merely malformed."""

from __future__ import annotations

import html
import http.client
import json
import re
import socket
import urllib.parse
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
import jobq_web
from webclient import Reply, call

TOKEN = "s3cret-dashboard-token"
ORIGIN = {"Origin": "http://127.0.0.1:8080"}
#: Valid group names that a URL's path cannot carry as they are: an encoded "/", empty
#: segments, dot segments (a browser resolves even "%2E%2E"), "?", "#", "%", "&", "+", and
#: non-ASCII text.
NAMES = ["org/team", "a//b", "x/", "/y", "..", "a/../b", "50%+off&more?#x", "org%2Fteam", "pause",
         "équipe/δ-\U0001f600"]
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _sign_in(app: Any) -> str:
    r = call(app, "/login", "POST", form={"token": TOKEN, "next": "/groups"}, headers=ORIGIN)
    assert r.status == 303, r.body
    return r.cookies[0].split(";")[0]


def _rows(page: str) -> dict[str, tuple[str, str]]:
    """The groups page's rows: each group's name -> (its jobs link, its button's form action)."""
    out = {}
    for link, name, action in re.findall(r'<tr><td><a href="([^"]*)">([^<]*)</a></td>.*?action="([^"]*)"', page):
        out[html.unescape(name)] = (html.unescape(link), html.unescape(action))
    return out


def _csrf(page: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert found, page
    return found.group(1)


def _paused(engine: sa.Engine, name: str) -> bool:
    g = jobq.get_group(engine, name)
    return bool(g and g.paused)


@pytest.mark.parametrize("prefix", ["", "/ops/jöbq"])
def test_every_group_name_round_trips_through_the_pages_links_and_buttons(engine: sa.Engine, prefix: str) -> None:
    """For each awkward name, the groups page's link lists that group's jobs, and its
    pause/resume button, posted as a browser posts it (the server percent-decodes the path),
    pauses and resumes exactly that group, also mounted under a prefix that needs encoding.
    Scripts' address ``/groups/<name>/pause`` keeps working for a name sent as ``%2F``."""
    jobs = {name: jobq.enqueue(engine, "t", {}, group_key=name) for name in NAMES}
    inner = jobq_web.app(engine, token=TOKEN)

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        environ["SCRIPT_NAME"] = prefix.encode().decode("latin-1")  # as a server hands it over
        return inner(environ, start_response)

    base = urllib.parse.quote(prefix)
    local = lambda url: url[len(base):] if url.startswith(base + "/") else pytest.fail(url)  # noqa: E731
    cookie = _sign_in(app)
    for act, want in (("pause", True), ("resume", False)):
        page = call(app, "/groups", cookie=cookie).body
        rows = _rows(page)
        assert set(rows) >= set(NAMES), sorted(rows)
        for name in NAMES:
            link, action = rows[name]
            assert local(action).split("?")[0].endswith("/" + act), action
            listed = call(app, "/api" + local(link)).json()["jobs"]
            assert [j["id"] for j in listed] == [jobs[name]], (name, link)
            r = call(app, local(action), "POST", cookie=cookie, form={"csrf": _csrf(page)}, headers=ORIGIN)
            assert r.status == 303, (name, action, r.status, r.body)
            assert _paused(engine, name) is want, name
        assert not any(_paused(engine, n) for n in ("org", "team", "a", "b", "x", "y")), "another group changed"
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    r = call(app, "/groups/org%2Fteam/pause", "POST", headers=bearer)
    assert r.status == 200 and r.json()["group"] == "org/team" and _paused(engine, "org/team")
    r = call(app, "/api/groups/%C3%A9quipe%2F%CE%B4-%F0%9F%98%80/pause", "POST", headers=bearer)
    assert r.status == 200 and _paused(engine, "équipe/δ-\U0001f600")
    r = call(app, "/groups/pause", "POST", headers=bearer)
    assert r.status == 400 and "group" in r.json()["error"]


def _http(base: str, method: str, path: str, *, body: str = "", headers: dict[str, str] | None = None
          ) -> tuple[int, list[tuple[str, str]], str]:
    """One request with the path sent exactly as given (percent escapes and all)."""
    parts = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        hdrs = {"Content-Type": "application/x-www-form-urlencoded", "Origin": f"http://{parts.netloc}"} | (headers or {})
        conn.request(method, path, body=body.encode(), headers=hdrs)
        r = conn.getresponse()
        return r.status, r.getheaders(), r.read().decode()
    finally:
        conn.close()


def test_group_names_round_trip_under_jobq_serve(engine: sa.Engine, db_url: str) -> None:
    """The same round trip through `jobq serve` (the standard library's server decodes the
    path before the app sees it): sign in, read the groups page, post each row's button."""
    from helpers_web import running_server

    for name in NAMES:
        jobq.enqueue(engine, "t", {}, group_key=name)
    with running_server(db_url, "--port", "0", "--token", TOKEN) as (base, _):
        status, headers, _ = _http(base, "POST", "/login", body=urllib.parse.urlencode({"token": TOKEN, "next": "/"}))
        assert status == 303
        cookie = dict(headers)["Set-Cookie"].split(";")[0]
        status, _, page = _http(base, "GET", "/groups", headers={"Cookie": cookie})
        rows = _rows(page)
        for name in NAMES:
            link, action = rows[name]
            status, _, listed = _http(base, "GET", "/api" + link)
            assert status == 200 and [j["group_key"] for j in json.loads(listed)["jobs"]] == [name], (name, link)
            status, _, body = _http(base, "POST", action, body=f"csrf={_csrf(page)}", headers={"Cookie": cookie})
            assert status == 303 and _paused(engine, name), (name, action, status, body)


# ---- the sign-in's next, and headers


HOSTILE_NEXT = ["//evil.example/x", "/\\evil.example/x", "/\\/evil.example", "\\\\evil.example", "https://evil.example/",
                "javascript:alert(1)", "/x\r\nSet-Cookie: evil=1", "/x\nLocation: https://evil.example/", "/\t/evil.example",
                "/x\x00y", "/x\x85y", "/x\x7fy", " /x", "evil.example", "/%0d%0aSet-Cookie:%20evil=1\r\n"]


def _headers_clean(r: Reply) -> None:
    for k, v in r.headers.items():
        assert not _CONTROL.search(v) and v.isascii(), (k, v)


@pytest.mark.parametrize("nxt", HOSTILE_NEXT)
def test_sign_in_sends_only_to_a_path_on_this_site(engine: sa.Engine, nxt: str) -> None:
    """After signing in, the browser goes to ``next`` only if it is a path here; anything a
    browser could read as another host, a scheme or a control character goes to the overview.
    The sign-in form does not carry such a value either."""
    app = jobq_web.app(engine, token=TOKEN)
    r = call(app, "/login", "POST", form={"token": TOKEN, "next": nxt}, headers=ORIGIN)
    assert r.status == 303 and r.headers["Location"] == "/", r.headers
    _headers_clean(r)
    page = call(app, "/login?" + urllib.parse.urlencode({"next": nxt})).body
    carried = html.unescape(re.search(r'name="next" value="([^"]*)"', page).group(1))
    assert carried in ("/", "/x", "/%0d%0aSet-Cookie:%20evil=1"), carried  # a query value loses its outer spaces


def test_sign_in_keeps_a_local_next_and_encodes_it(engine: sa.Engine) -> None:
    app = jobq_web.app(engine, token=TOKEN)
    for nxt, location in [("/jobs/5?state=failed", "/jobs/5?state=failed"),
                          ("/groups/pause?group=org%2Fteam", "/groups/pause?group=org%2Fteam"),
                          ("/jobs?type=é x", "/jobs?type=%C3%A9%20x")]:
        r = call(app, "/login", "POST", form={"token": TOKEN, "next": nxt}, headers=ORIGIN)
        assert r.status == 303 and r.headers["Location"] == location
        _headers_clean(r)


def test_no_control_character_reaches_a_header_under_jobq_serve(engine: sa.Engine, db_url: str) -> None:
    """Through the real server, the raw response: one Location, to this site, and no header
    line the request chose (CR/LF in ``next`` once became header lines verbatim)."""
    from helpers_web import running_server

    with running_server(db_url, "--port", "0", "--token", TOKEN) as (base, _):
        parts = urllib.parse.urlsplit(base)
        for nxt in HOSTILE_NEXT:
            body = urllib.parse.urlencode({"token": TOKEN, "next": nxt}).encode()
            with socket.create_connection((parts.hostname, parts.port), timeout=60) as s:
                s.sendall(b"POST /login HTTP/1.0\r\nHost: " + parts.netloc.encode() + b"\r\nOrigin: http://"
                          + parts.netloc.encode() + b"\r\nContent-Type: application/x-www-form-urlencoded\r\n"
                          + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                raw = b""
                while chunk := s.recv(65536):
                    raw += chunk
            head = raw.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
            assert head[0].split()[1] == "303", head
            names = [line.split(":", 1)[0].lower() for line in head[1:]]
            assert names.count("location") == 1 and names.count("set-cookie") == 1, head
            assert "Location: /" in head and "evil" not in "\r\n".join(head), head
            assert all(not _CONTROL.search(line) for line in head), head


# ---- malformed numbers, cookies and filters


@pytest.mark.parametrize("path,needle", [
    ("/jobs?limit=²", "limit must be a whole number"),
    ("/jobs?limit=٣", "limit must be a whole number"),  # an Arabic-Indic 3: int() reads it, str.isdigit() too
    ("/jobs?limit=" + "9" * 5000, "limit must be a whole number"),  # past int()'s 4,300 digits
    ("/jobs?before=²", "before must be a whole number"),
    ("/api/jobs?before=%C2%B2", "before must be a whole number"),
    ("/groups?limit=²", "limit must be a whole number"),
    ("/api/groups?limit=²", "limit must be a whole number"),
    ("/jobs/²", "a job id is a positive whole number"),
    ("/api/jobs/%C2%B2", "a job id is a positive whole number"),
    ("/jobs/" + "9" * 5000, "a job id is a positive whole number"),
    ("/jobs?type=%00", "type holds a control character"),
    ("/api/jobs?group=%00", "group holds a control character"),
    ("/jobs?type=a%0Ab", "type holds a control character"),
    ("/jobs?group=a%C2%85b", "group holds a control character"),  # NEL, a C1 control
    ("/groups?after=%00", "after holds a control character"),
    ("/jobs?since=²h", "since must be a duration"),
    ("/jobs?state=%00", "state must be one of"),
])
def test_malformed_values_answer_a_clear_4xx(engine: sa.Engine, path: str, needle: str) -> None:
    """Unicode digits (``str.isdigit()`` accepts "²", which ``int()`` refuses), numbers too long
    to read and control characters in filters are the client's mistake: 400 with one sentence,
    as a page and as JSON, never a 500 or (NUL on PostgreSQL) a 503."""
    jobq.enqueue(engine, "t", {})
    app = jobq_web.app(engine, token=TOKEN)
    path = urllib.parse.quote(path, safe="/?=&%")  # as a browser sends it: "²" as %C2%B2
    for headers in ({}, {"Accept": "application/json"}):
        r = call(app, path, headers=headers)
        assert r.status == 400 and needle in r.body and "Traceback" not in r.body, (path, r.status, r.body[:300])
        _headers_clean(r)


@pytest.mark.parametrize("cookie", ["jobq_session=é", "jobq_session=" + "\u2603" * 3, "jobq_session=\x85; other=ü"])
def test_a_cookie_with_non_ascii_text_is_no_session(engine: sa.Engine, cookie: str) -> None:
    """A non-ASCII session cookie (hmac.compare_digest refuses to compare such str) is simply
    not a session: pages answer 200 offering to sign in, an action 401; nothing raises, not
    even the page drawn for an error."""
    job = jobq.enqueue(engine, "t", {})
    app = jobq_web.app(engine, token=TOKEN)
    for path in ("/", "/jobs", f"/jobs/{job}", "/groups", "/login"):
        r = call(app, path, cookie=cookie)
        assert r.status == 200 and "sign in" in r.body.lower(), path
    assert call(app, "/nowhere", cookie=cookie).status == 404
    r = call(app, f"/jobs/{job}/cancel", "POST", cookie=cookie, form={"csrf": "x"})
    assert r.status == 401 and jobq.get(engine, job).state == "ready"


def test_a_malformed_origin_is_refused_not_a_crash(engine: sa.Engine) -> None:
    """An Origin or Referer that does not parse as a URL is another site: 403, not a 500."""
    job = jobq.enqueue(engine, "t", {})
    app = jobq_web.app(engine, token=TOKEN)
    cookie = _sign_in(app)
    csrf = _csrf(call(app, f"/jobs/{job}", cookie=cookie).body)
    for header in ({"Origin": "http://["}, {"Referer": "http://[::1/x"}):
        r = call(app, f"/jobs/{job}/cancel", "POST", cookie=cookie, form={"csrf": csrf}, headers=header)
        assert r.status == 403, (header, r.status, r.body[:200])
        assert call(app, "/login", "POST", form={"token": TOKEN}, headers=header).status == 403
    assert jobq.get(engine, job).state == "ready"

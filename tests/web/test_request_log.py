"""`jobq serve` writes one log line per request (logger ``jobq.web.access``): client, method,
path, status and milliseconds, and never the dashboard's token, whether it came in a form, a
header, the query or the path."""

from __future__ import annotations

import logging
import pathlib
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import sqlalchemy as sa

import jobq
import jobq_web
from helpers import JOBQ_CLI
from webclient import call

TOKEN = "s3cret-token-Zq9"
LINE = re.compile(r" INFO jobq\.web\.access (\S+) (\S+) (\S+) (\d{3}) (\d+\.\d)ms$")


def _send(base: str, path: str, *, data: dict[str, str] | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, float]:
    """One request; its status and how long the client waited for the whole answer, in ms."""
    body = urllib.parse.urlencode(data).encode() if data is not None else None
    req = urllib.request.Request(base.rstrip("/") + path, data=body, headers=headers or {})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as exc:
        exc.read()
        status = exc.code
    return status, (time.perf_counter() - start) * 1000


def test_serve_logs_one_line_per_request_without_the_token(tmp_path: pathlib.Path) -> None:
    """Each request is one INFO line on stderr whose method, path, status match the request and
    whose duration is at most what the client waited. The token, sent as a sign-in form field,
    a bearer header, a ``?token=`` query parameter and as a path segment, appears in no line:
    a query's secret parameters show as ``***``. A bug shows a missing or doubled line, a
    wrong status, or the token in the log."""
    from helpers_web import running_server

    url = f"sqlite:///{tmp_path / 'q.db'}"
    subprocess.run([*JOBQ_CLI, "--url", url, "init"], check=True, capture_output=True)
    engine = sa.create_engine(url)
    job = jobq.enqueue(engine, "t<b>", {})
    engine.dispose()
    log: list[str] = []
    sent: list[tuple[str, str, int, float]] = []
    with running_server(url, "--port", "0", "--token", TOKEN, log=log) as (base, _):
        for method, path, kw, want, logged in [
            ("GET", "/jobs?state=failed&type=t%3Cb%3E", {}, 200, "/jobs?state=failed&type=t%3Cb%3E"),
            ("GET", f"/api/jobs?limit=5&token={TOKEN}", {}, 200, "/api/jobs?limit=5&token=***"),
            ("GET", f"/api/jobs?csrf={TOKEN}&access_token={TOKEN}", {}, 200, "/api/jobs?csrf=***&access_token=***"),
            ("POST", "/login", {"data": {"token": TOKEN + "x"}}, 401, "/login"),
            ("POST", "/login", {"data": {"token": TOKEN, "next": "/"}}, 200, "/login"),  # 303, then GET /
            ("POST", f"/jobs/{job}/cancel", {"data": {}, "headers": {"Authorization": f"Bearer {TOKEN}"}}, 200,
             f"/jobs/{job}/cancel"),
            ("GET", f"/jobs/{TOKEN}", {}, 400, "/jobs/***"),
            ("GET", "/nowhere%0Aforged%20INFO", {}, 404, "/nowhere%0Aforged%20INFO"),
        ]:
            status, waited = _send(base, path, **kw)
            assert status == want, (path, status)
            sent.append((method, logged, status, waited))
    text = "\n".join(log)
    assert TOKEN not in text and "Bearer" not in text, text
    lines = [m for m in (LINE.search(ln) for ln in log) if m]
    assert len(lines) == len(sent) + 1, text  # the sign-in's redirect is followed: one more GET /
    lines = [m for m in lines if m.group(3) != "/" or m.group(2) != "GET"]
    assert len(lines) == len(sent), text
    for m, (method, path, status, waited) in zip(lines, sent, strict=True):
        client, got_method, got_path, got_status, ms = m.groups()
        assert (client, got_method, got_path) == ("127.0.0.1", method, path), m.group(0)
        assert int(got_status) == (303 if path == "/login" and status == 200 else status), m.group(0)
        assert float(ms) <= waited + 0.1, (m.group(0), waited)
    assert all(len(ln.split("jobq.web.access")) <= 2 for ln in log)  # a %0A in a path split no line


def test_the_request_line_carries_its_fields_for_routing(engine: sa.Engine, caplog: pytest.LogCaptureFixture) -> None:
    """The access log's record has flat ``extra`` keys (action, method, path, status,
    duration_ms) for structured handlers, the secret query value masked."""
    jobq.create_schema(engine)
    wsgi = jobq_web._access_log(jobq_web.app(engine, token=TOKEN))
    with caplog.at_level(logging.INFO, logger="jobq.web.access"):
        assert call(wsgi, f"/groups?password={TOKEN}&after=a").status == 200
    [rec] = [r for r in caplog.records if r.name == "jobq.web.access"]
    assert (rec.action, rec.method, rec.path, rec.status) == (  # type: ignore[attr-defined]
        "http_request", "GET", "/groups?password=***&after=a", 200)
    assert rec.duration_ms >= 0 and TOKEN not in rec.getMessage()  # type: ignore[attr-defined]

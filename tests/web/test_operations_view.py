"""The dashboard reads like an operations tool (issue 43, item 7): progress as a bar with its
numbers, a group's pause in words, priority, the attempts table with headings, durations and
each traceback in full, the job list's last error and total, and times relative to the
database clock with the absolute UTC time in the title; every value escaped.

A bug shows as a Python dict or True/False on a page, a traceback squashed onto one line, a
list row without its error, or a hostile value (in an attribute too) that is not escaped."""

from __future__ import annotations

import html
import re

import sqlalchemy as sa

import jobq
import jobq_web
from webclient import call

EVIL = '"><script>alert(1)</script><img src=x onerror=alert(2)>'
TRACE = 'ValueError: bad row 7\nTraceback (most recent call last):\n  File "h.py", line 3, in run\n    raise ValueError("bad row 7")'


def _fail(engine: sa.Engine, error: str, **kw: object) -> int:
    job = jobq.enqueue(engine, "fetch", {"n": 1}, max_attempts=1, **kw)  # type: ignore[arg-type]
    lease = jobq.claim(engine, "w1", 30)
    assert lease == job
    assert jobq.fail(engine, job, error, worker_id="w1", token=lease.token) == "failed"
    return job


def _set_progress(engine: sa.Engine, job: int, progress: object) -> None:
    with engine.begin() as conn:  # the heartbeat's write, without a worker (tests/core covers that path)
        conn.execute(sa.update(jobq.Job).where(jobq.Job.id == job).values(progress=progress))


def _visible(body: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", body))


def test_progress_is_a_bar_with_numbers_and_pause_and_priority_are_words(engine: sa.Engine) -> None:
    """The job page shows progress as a <progress> bar with "231 / 1,000 (23%)" and its note,
    the priority as a field and in the list; a group's pause reads "paused" or "active"."""
    job = jobq.enqueue(engine, "resize", {}, priority=7, group_key="tenant-a")
    other = jobq.enqueue(engine, "resize", {}, group_key="tenant-b")
    _set_progress(engine, job, {"done": 231, "total": 1000, "message": "rows"})
    _set_progress(engine, other, {"done": 5, "total": None, "message": None})
    jobq.set_group(engine, "tenant-a", paused=True)
    app = jobq_web.app(engine)

    page = call(app, f"/jobs/{job}").body
    assert '<progress class="bar" value="231" max="1000">23%</progress> 231 / 1,000 (23%) &middot; rows' in page
    assert "{'done'" not in page and "&#x27;done&#x27;" not in page
    assert "<dt>priority</dt><dd>7</dd>" in page
    assert "5 done" in call(app, f"/jobs/{other}").body  # no total: the count alone, no bar
    assert "<progress" not in call(app, f"/jobs/{other}").body
    listed = call(app, "/jobs").body
    assert "<th>priority</th>" in listed and f'<a href="/jobs/{job}">{job}</a></td><td>resize</td>' in listed
    assert re.search(rf'href="/jobs/{job}">{job}</a>.*?tenant-a</a></td><td>7</td>', listed)
    for path in ("/", "/groups"):
        body = call(app, path).body
        assert re.search(r">tenant-a</a>(</td><td>[^<]*){6}</td><td>paused</td>", body), path
        assert re.search(r">tenant-b</a>(</td><td>[^<]*){6}</td><td>active</td>", body), path
        assert "<td>True</td>" not in body and "<td>False</td>" not in body, path


def test_attempts_table_has_headings_durations_and_the_whole_traceback(engine: sa.Engine) -> None:
    """The attempts table's headings are words, each attempt says how long it ran, and its
    error keeps every line of the traceback in a <pre>, under the line that says what went
    wrong."""
    job = _fail(engine, TRACE)
    page = call(jobq_web.app(engine), f"/jobs/{job}").body
    table = page[page.index("<h2>Attempts</h2>"):]
    heads = re.findall(r"<th>([^<]*)</th>", table[:table.index("</thead>")])
    assert heads == ["#", "outcome", "worker", "started", "finished", "ran", "error"]
    assert "worker_id" not in table and "job_id" not in table
    assert '<span class="state s-failed">failed</span>' in table and "<td>w1</td>" in table
    assert re.search(r"<td>\d+\.\ds</td>", table)  # how long the attempt ran
    assert "<summary>ValueError: bad row 7</summary><pre>" + html.escape(TRACE) + "</pre>" in table


def test_job_list_shows_the_last_errors_first_line_and_the_total(engine: sa.Engine) -> None:
    """Each row carries its last error's first line (cut to 80 characters, the whole text in
    the title) and the page says how many jobs its filters match."""
    job = _fail(engine, TRACE)
    long = _fail(engine, "RuntimeError: " + "x" * 200)
    for _ in range(3):
        jobq.enqueue(engine, "t", {})
    app = jobq_web.app(engine)
    body = call(app, "/jobs?limit=2").body
    assert 'id="total">showing 2 of 5 matching jobs' in body
    assert 'showing 2 of 2 matching jobs' in call(app, "/jobs?state=failed").body
    body = call(app, "/jobs?state=failed").body
    assert f'<span class="err" title="{html.escape(TRACE)}">ValueError: bad row 7…</span>' in body, job
    cut = "RuntimeError: " + "x" * 66
    assert f'>{cut}…</span>' in body and f'title="RuntimeError: {"x" * 200}"' in body, long
    data = call(app, "/api/jobs?state=failed").json()
    assert data["total"] == 2 and data["total_capped"] is False and data["jobs"][1]["error"] == TRACE


def test_times_are_relative_to_the_database_clock_with_utc_in_the_title(engine: sa.Engine) -> None:
    """A time reads "… ago" (or "in …") by the database's clock; hovering shows it in UTC."""
    job = jobq.enqueue(engine, "t", {}, run_after=jobq_web._dt.timedelta(hours=2))
    app = jobq_web.app(engine)
    for path in (f"/jobs/{job}", "/jobs"):
        body = call(app, path).body
        assert re.search(r'<time datetime="(\S+Z)" title="\1">in (1h59m|2h00m)</time>', body), path
        assert re.search(r'<time datetime="(\S+Z)" title="\1">\d+\.\ds ago</time>', body), path
    _fail(engine, "Boom: x")
    overview = call(app, "/").body  # the next scheduled job and the recent failure
    assert re.search(r'<dd><time datetime="(\S+Z)" title="\1">in (1h59m|2h00m)</time></dd>', overview)
    assert re.search(r'</td><td><time datetime="(\S+Z)" title="\1">\d+\.\ds ago</time></td><td>Boom: x</td>', overview)
    now = jobq_web._dt.datetime(2026, 1, 1, 12, tzinfo=jobq_web._dt.UTC)
    assert jobq_web._ago(now.replace(tzinfo=None) - jobq_web._dt.timedelta(seconds=185), now) == (
        '<time datetime="2026-01-01T11:56:55Z" title="2026-01-01T11:56:55Z">3m05s ago</time>')
    assert jobq_web._took(now, now + jobq_web._dt.timedelta(seconds=2.4)) == "2.4s"


def test_hostile_error_progress_and_names_are_escaped_in_text_and_attributes(engine: sa.Engine) -> None:
    """A job whose type, group, args, error and progress note hold markup that would close
    an attribute renders it as text on the list, the job page and the overview."""
    job = _fail(engine, f"Boom: {EVIL}\n{EVIL}", group_key="g" + EVIL[:40])
    _set_progress(engine, job, {"done": 1, "total": 2, "message": EVIL})
    jobq.enqueue(engine, "ok", {"html": EVIL}, priority=-3)
    app = jobq_web.app(engine)
    for path in ("/", "/jobs", f"/jobs/{job}", f"/jobs/{job + 1}", "/groups", "/jobs?state=failed"):
        body = call(app, path).body
        assert "<script>" not in body and "<img" not in body and "onerror=alert" not in body.replace("onerror=alert(2)&gt;", ""), path
        assert not re.search(r'title="[^"]*<', body), path  # no raw markup inside a title
    page = call(app, f"/jobs/{job}").body
    assert EVIL in _visible(page) and html.escape(EVIL) in page


def test_job_list_pages_back_to_newer_jobs(engine: sa.Engine) -> None:
    """From an older page, "newer jobs" leads to the page just above it (not only back to the
    newest), and walking newer from the last page visits the same pages as walking older."""
    ids = [jobq.enqueue(engine, "t", {}, group_key="paging") for _ in range(7)]
    app = jobq_web.app(engine)

    def page(query: str) -> tuple[list[int], str | None, str | None]:
        body = call(app, "/jobs?group=paging&limit=3" + query).body
        rows = [int(i) for i in re.findall(r'<tr><td><a href="/jobs/(\d+)">', body)]
        older = re.search(r'id="older" href="([^"]*)"', body)
        newer = re.search(r'id="newer" href="([^"]*)"', body)
        return rows, html.unescape(older.group(1)) if older else None, html.unescape(newer.group(1)) if newer else None

    first, older, newer = page("")
    assert first == ids[:3:-1] and newer is None and older is not None
    pages = [first]
    while older is not None:
        rows, older, newer = page("&" + older.split("&", 2)[2])
        pages.append(rows)
        assert newer == f"/jobs?group=paging&limit=3&after={rows[0]}"
    assert pages == [ids[6:3:-1], ids[3:0:-1], ids[:1]]
    back = []
    while newer is not None:
        rows, _, newer = page("&" + newer.split("&", 2)[2])
        back.append(rows)
    assert back == [ids[3:0:-1], ids[6:3:-1]]
    data = call(app, f"/api/jobs?group=paging&limit=3&after={ids[0]}").json()
    assert [j["id"] for j in data["jobs"]] == ids[3:0:-1] and data["newer_after"] == ids[3]
    assert 'id="newest"' in call(app, f"/jobs?after={ids[0]}").body

"""The per-type page (/types, /api/types): per job type, ready and running now, and over the
last hour and day the jobs that finished, the failure rate and the last attempt's run time
(median, p95); type names escaped; the history read newest first through ix_jobs_finished and
capped at TYPE_SAMPLE rows, which the page says when it matters."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa

import jobq
import jobq_web
from dbs import needs
from webclient import call

EVIL = '<script>alert("x")</script>&"\''
JOBS = jobq.Job.__table__


def _finished(engine: sa.Engine, type: str, state: str, *, ago: dt.timedelta, ran: float | None) -> None:
    """A job of ``type`` that ended ``state`` ``ago`` before the database's now, its last attempt
    having run ``ran`` seconds (None: it never started)."""
    jid = jobq.enqueue(engine, type, {})
    now = jobq_web._db_now(engine).replace(tzinfo=None)
    end = now - ago
    with engine.begin() as conn:
        conn.execute(sa.update(JOBS).where(JOBS.c.id == jid).values(
            state=state, finished_at=end, started_at=None if ran is None else end - dt.timedelta(seconds=ran)))


def _fill(engine: sa.Engine) -> None:
    jobq.create_schema(engine)
    for i in range(1, 21):
        _finished(engine, "resize", "done", ago=dt.timedelta(minutes=10), ran=float(i))
    for _ in range(5):
        _finished(engine, "resize", "failed", ago=dt.timedelta(minutes=20), ran=100.0)
    _finished(engine, "resize", "cancelled", ago=dt.timedelta(minutes=5), ran=None)
    for _ in range(3):
        _finished(engine, "report", "done", ago=dt.timedelta(hours=5), ran=2.0)
    _finished(engine, "report", "failed", ago=dt.timedelta(days=2), ran=2.0)  # in neither window
    jobq.enqueue(engine, EVIL, {})
    jobq.enqueue(engine, "mail", {})
    jobq.enqueue(engine, "mail", {})
    assert jobq.claim(engine, "w1", 60, types=["mail"]) is not None


def test_the_types_page_counts_rates_and_runtimes(engine: sa.Engine) -> None:
    """Known finishes give known figures: resize in the last hour finished 26 (20 done, 5
    failed, 1 cancelled), failure rate 5/25, median run 13 s and p95 100 s by nearest rank over
    the 25 that started; report only in the 24h window (its 2-day-old failure in neither);
    mail one ready and one running. A bug shows a job counted in the wrong window, the
    cancelled job in the failure rate, or a run time for a job that never started."""
    _fill(engine)
    d = call(jobq_web.app(engine), "/api/types").json()
    t = {x["type"]: x for x in d["types"]}
    assert sorted(t) == sorted(["resize", "report", "mail", EVIL])
    r1 = t["resize"]["1h"]
    assert (r1["finished"], r1["done"], r1["failed"], r1["cancelled"]) == (26, 20, 5, 1)
    assert (r1["failure_rate"], r1["runtime_p50"], r1["runtime_p95"]) == (0.2, pytest.approx(13.0), pytest.approx(100.0))
    assert t["resize"]["24h"] == r1
    assert t["report"]["1h"]["finished"] == 0 and t["report"]["1h"]["failure_rate"] is None
    r24 = t["report"]["24h"]
    assert (r24["finished"], r24["failed"], r24["failure_rate"], r24["runtime_p95"]) == (3, 0, 0.0, pytest.approx(2.0))
    assert (t["mail"]["ready"], t["mail"]["running"], t[EVIL]["ready"], t["resize"]["ready"]) == (1, 1, 1, 0)
    assert [w["complete"] for w in d["windows"]] == [True, True]
    page = call(jobq_web.app(engine), "/types")
    assert page.status == 200 and 'class="types"' in page.body and 'class=here>Types' in page.body.replace('"', "")
    assert "<script>alert" not in page.body and "&lt;script&gt;alert(&quot;x&quot;)" in page.body
    assert "<td>20.0%</td><td>13s</td><td>100s</td>" in page.body and "partial-" not in page.body


def test_a_window_with_more_finishes_than_the_sample_says_so(engine: sa.Engine,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With TYPE_SAMPLE below the window's finishes, the page reads only the newest ones and
    marks the windows it could not cover whole (``complete`` false, ``covers_since``, a note);
    the counts are those of the rows read. A bug shows a silent undercount."""
    _fill(engine)
    monkeypatch.setattr(jobq_web, "TYPE_SAMPLE", 10)
    d = call(jobq_web.app(engine), "/api/types").json()
    assert [w["complete"] for w in d["windows"]] == [False, False] and d["sample"] == 10
    assert sum(x["1h"]["finished"] for x in d["types"]) == 10
    assert "partial-24h" in call(jobq_web.app(engine), "/types").body
    monkeypatch.setattr(jobq_web, "TYPE_SAMPLE", 28)  # 26 in the last hour, 29 in the last day
    d = call(jobq_web.app(engine), "/api/types").json()
    assert [w["complete"] for w in d["windows"]] == [True, False]


@needs("partial_indexes")  # as test_the_overview_reads_only_indexes
def test_the_types_page_reads_only_indexes(engine: sa.Engine) -> None:
    """Every statement of the page is planned on an index (ix_jobs_finished, the ready and
    in-flight indexes), none scans the jobs table, and the history read has a LIMIT."""
    _fill(engine)
    seen: list[tuple[str, object]] = []

    def capture(conn, cursor, statement, parameters, context, executemany):  # noqa: ANN001
        if " jobs" in statement and not statement.lstrip().upper().startswith("EXPLAIN"):
            seen.append((statement, parameters))

    sa.event.listen(engine, "before_cursor_execute", capture)
    jobq_web.type_page(engine)
    sa.event.remove(engine, "before_cursor_execute", capture)
    assert len(seen) == 2 and any("LIMIT" in s.upper() for s, _ in seen)
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

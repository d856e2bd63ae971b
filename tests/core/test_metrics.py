"""MetricsCollector on every engine: the gauges are the live rows, the counters count each
attempt and start once (none from before the collector, none lost to prune, none twice across
scrapes, none missed when a lower id commits after a higher one), and every statement a scrape
runs is planned on an index."""

from __future__ import annotations

import datetime as dt
from typing import Any

import sqlalchemy as sa

import jobq
from dbs import needs


def _run(engine: sa.Engine, outcome: str, **kw: Any) -> int:
    job_id = jobq.enqueue(engine, "t", {}, **kw)
    lease = jobq.claim(engine, "w1", 60)
    assert lease == job_id
    if outcome == "done":
        jobq.finalize(engine, lease, None, worker_id="w1", token=lease.token)
    else:
        jobq.fail(engine, job_id, "boom", worker_id="w1", token=lease.token)
    return job_id


def test_gauges_are_the_live_rows_by_state_and_group(engine: sa.Engine) -> None:
    a = jobq.enqueue(engine, "t", {}, group_key="a")
    jobq.enqueue(engine, "t", {}, group_key="a", depends_on=[a])
    jobq.enqueue(engine, "t", {}, group_key="b", run_after=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1))
    jobq.set_group(engine, "a", max_in_flight=3)
    jobq.set_limit(engine, max_in_flight=10)
    assert jobq.claim(engine, "w1", 60) == a
    r = jobq.MetricsCollector(engine).read()
    assert r["jobs"] == {("a", "leased"): 1, ("a", "waiting"): 1, ("b", "ready"): 1}
    assert r["due"] == {"b": 0} and r["oldest_due"] == {}
    assert r["in_flight"] == {"a": 1} and r["caps"] == {"a": 3} and r["global_cap"] == 10


def test_counters_count_each_attempt_once_from_the_collectors_start(engine: sa.Engine) -> None:
    """Attempts before the collector are not counted; each after it is counted once however
    often it is scraped, and prune (which deletes history) takes nothing back. A bug shows as
    a count that grows on a second scrape, or falls after prune."""
    _run(engine, "done")
    m = jobq.MetricsCollector(engine)
    assert m.read()["attempts"] == {}
    _run(engine, "done", group_key="g")
    _run(engine, "failed", group_key="g", max_attempts=3)  # retried: due again
    first = m.read()
    assert first["attempts"] == {("t", "done"): 1, ("t", "failed"): 1}
    assert first["retries"] == {"t": 1} and first["starts"] == {"g": 2}
    assert m.read()["attempts"] == first["attempts"]
    jobq.prune(engine, dt.timedelta(0))
    again = m.read()
    assert again["attempts"] == first["attempts"] and again["starts"] == first["starts"]
    text = m.text().decode()
    assert 'jobq_run_seconds_count{type="t"} 2.0' in text and 'jobq_wait_seconds_count{type="t"} 1.0' in text, text


@needs("row_locks")
def test_a_lower_id_committed_late_is_counted(engine: sa.Engine) -> None:
    """Ids are handed out before commit: an attempt row whose insert took id N but committed
    after N+1 was scraped is still counted once (the settle window reads it again). With no
    settle window (the broken variant) it is lost."""
    def row(conn: sa.Connection, job_id: int) -> None:
        conn.execute(sa.insert(jobq._attempts).values(job_id=job_id, attempt=1, outcome="done",
                                                      finished_at=sa.func.current_timestamp()))

    counts = []
    for settle in (5.0, 0.0):
        m = jobq.MetricsCollector(engine, settle=settle)
        m.read()
        late = engine.connect()
        late.begin()
        row(late, 1)  # takes the lower id, commits last
        with engine.begin() as conn:
            row(conn, 2)
        seen = sum(m.read()["attempts"].values())
        late.commit()
        late.close()
        counts.append((seen, sum(m.read()["attempts"].values())))
    assert counts[0] == (1, 2), counts
    assert counts[1][1] == 1, f"the broken variant (settle=0) should lose the late row: {counts}"


@needs("partial_indexes")
def test_a_scrape_reads_only_indexes(engine: sa.Engine) -> None:
    """Every statement a scrape runs is planned on an index (no scan of jobs, jobq_attempts or
    jobq_starts), so its cost follows the live rows and the new history, never the table."""
    _run(engine, "done")
    jobq.enqueue(engine, "t", {}, group_key="x", run_after=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1))
    m = jobq.MetricsCollector(engine)
    m.read()
    _run(engine, "done")
    seen: list[tuple[str, Any]] = []

    def capture(conn, cursor, statement, parameters, context, executemany):  # noqa: ANN001
        if not statement.lstrip().upper().startswith("EXPLAIN"):
            seen.append((statement, parameters))

    sa.event.listen(engine, "before_cursor_execute", capture)
    m.read()
    sa.event.remove(engine, "before_cursor_execute", capture)
    assert len(seen) >= 5
    with engine.connect() as conn:
        for statement, params in seen:
            if "jobs" not in statement and "jobq_attempts" not in statement and "jobq_starts" not in statement:
                continue
            if engine.dialect.name == "sqlite":
                plan = " | ".join(str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, params))
                bad = [s for s in plan.split(" | ") if s.startswith("SCAN") and "INDEX" not in s
                       and "PRIMARY KEY" not in s and "jobq_groups" not in s and "jobq_slots" not in s
                       and "jobq_meta" not in s and not s.startswith("SCAN CONSTANT")]
            else:
                conn.exec_driver_sql("SET enable_seqscan = off")
                plan = " | ".join(r[0] for r in conn.exec_driver_sql("EXPLAIN " + statement, params))
                bad = [t for t in ("Seq Scan on jobs", "Seq Scan on jobq_attempts", "Seq Scan on jobq_starts")
                       if t in plan]
            assert not bad, f"{statement}\n{plan}"
        conn.rollback()

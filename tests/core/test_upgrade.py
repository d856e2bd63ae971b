"""Schema evolution: a database created by the previous schema version (1) is upgraded in
place by create_schema, keeps its jobs, and works with the current code."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa

import jobq
from helpers import META, STARTS, db_now


def _schema_1() -> sa.MetaData:
    """jobq's schema version 1, as jobq.py created it before schema 2 (frozen here): the
    current tables minus jobq_starts.n, with a full (state, finished_at) index on every engine
    and no ix_jobs_finished / ix_jobs_waiting."""
    md = sa.MetaData()
    for table in jobq.Base.metadata.sorted_tables:
        t = table.to_metadata(md)
        if t.name == "jobq_starts":
            t._columns.remove(t.c.n)  # type: ignore[attr-defined]
        if t.name == "jobs":
            for ix in list(t.indexes):
                if ix.name in ("ix_jobs_finished", "ix_jobs_waiting", "ix_jobs_finished_my"):
                    t.indexes.discard(ix)
            sa.Index("ix_jobs_state_finished", t.c.state, t.c.finished_at)
    return md


def test_a_schema_1_database_is_upgraded_in_place_and_keeps_working(engine: sa.Engine) -> None:
    """A database created by schema version 1, holding ready, done and rate-limit rows, is upgraded
    in place by create_schema (twice: idempotent): the new column and indexes appear, the version
    reads 2, old rate-limit starts still count, and a Worker runs the old ready jobs to done. A
    broken upgrade shows as a missing column or index, lost rows, or a worker that fails on the
    old data."""
    jobq.Base.metadata.drop_all(engine)
    old = _schema_1()
    old.create_all(engine)
    now = db_now(engine)
    jobs, starts, meta = (old.tables[n] for n in ("jobs", "jobq_starts", "jobq_meta"))
    base = dict(args={}, is_container=False, group_key="g", weight=1, run_after=now, created_at=now, updated_at=now,
                attempts=0, max_attempts=3, in_flight=False, cancel_requested=False, pending_deps=0,
                pending_children=0, failed_children=0)
    with engine.begin() as conn:
        conn.execute(sa.insert(meta), [{"key": "schema_version", "value": "1"}, {"key": "claim_lock", "value": ""}])
        conn.execute(sa.insert(jobs), [dict(base, type="t", state="ready") for _ in range(5)])
        conn.execute(sa.insert(jobs), [dict(base, type="t", state="done", result={}, finished_at=now - dt.timedelta(days=2))])
        conn.execute(sa.insert(starts), [{"group_key": "g", "started_at": now - dt.timedelta(seconds=5)}] * 3)
    assert "n" not in {c["name"] for c in sa.inspect(engine).get_columns("jobq_starts")}

    jobq.create_schema(engine)
    jobq.create_schema(engine)  # and again: idempotent once upgraded

    insp = sa.inspect(engine)
    assert "n" in {c["name"] for c in insp.get_columns("jobq_starts")}
    assert "closed_by" in {c["name"] for c in insp.get_columns("jobs")}  # schema 3
    indexes = {i["name"] for i in insp.get_indexes("jobs")}
    if engine.dialect.name in ("postgresql", "sqlite"):
        assert {"ix_jobs_finished", "ix_jobs_waiting"} <= indexes and "ix_jobs_state_finished" not in indexes
    else:  # re-keyed without state (_rekey_mysql_indexes)
        assert "ix_jobs_finished_my" in indexes and "ix_jobs_state_finished" not in indexes
    with engine.connect() as conn:
        assert conn.execute(sa.select(META.c.value).where(META.c.key == "schema_version")).scalar() == str(jobq.SCHEMA_VERSION)
        assert conn.execute(sa.select(sa.func.sum(STARTS.c.n))).scalar() == 3  # old rows count one start each
    # the old starts still count against a rate limit: 3 of 5 per minute are used
    assert len(jobq.claim_batch(engine, "w", 30, limit=5, rate_limits={"g": (5, 60.0)})) == 2
    done: list[int] = []
    w = jobq.Worker(engine, {"t": lambda ctx: done.append(ctx.id)}, max_concurrency=2, poll_interval=0.05, lease_ttl=5)
    with engine.begin() as conn:  # the two leased above were a test's claim: give them back
        conn.execute(sa.update(jobq.Job.__table__).where(jobq.Job.state == "leased")
                     .values(state="ready", in_flight=False, lease_owner=None, lease_token=None, attempts=0))
    assert w.run_until_idle(timeout=30)
    assert len(done) == 5
    assert jobq.stats(engine, window=dt.timedelta(days=7))["states"]["done"] == 6
    # Leave the fresh schema the other tests expect (the fixture creates it once per database).
    jobq.Base.metadata.drop_all(engine)
    jobq.create_schema(engine)


def test_a_database_from_a_newer_jobq_is_refused(engine: sa.Engine) -> None:
    """A database whose schema_version is newer than this jobq.py is refused with a JobqError saying
    so, rather than used or downgraded."""
    with engine.begin() as conn:
        conn.execute(sa.update(META).where(META.c.key == "schema_version").values(value="99"))
    try:
        jobq.create_schema(engine)
    except jobq.JobqError as exc:
        assert "newer than this jobq.py" in str(exc)
    else:
        raise AssertionError("create_schema accepted a schema from the future")
    with engine.begin() as conn:
        conn.execute(sa.update(META).where(META.c.key == "schema_version").values(value=str(jobq.SCHEMA_VERSION)))

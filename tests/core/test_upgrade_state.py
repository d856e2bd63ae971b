"""Schema 3 -> 4 for issue 16 (_upgrade_4_state): a database created by schema version 3 is
upgraded in place by create_schema, keeps its jobs, and then orders, dedupes, checkpoints and
reports progress like a fresh one."""

from __future__ import annotations

import sqlalchemy as sa

import jobq
from helpers import FAST, db_now, schema_version

#: What schema 4 added for issue 16 (columns of jobs); schema 3 had none of them.
NEW_COLUMNS = ("priority", "unique_key", "checkpoint", "progress")


def _schema_3() -> sa.MetaData:
    """jobq's schema version 3, frozen here: the current tables without issue 16's columns, and
    the ready index without the priority column."""
    md = sa.MetaData()
    for table in jobq.Base.metadata.sorted_tables:
        t = table.to_metadata(md)
        if t.name == "jobs":
            for ix in list(t.indexes):
                if ix.name in ("ix_jobs_ready", "ix_jobs_ready_my", "ux_jobs_unique_live"):
                    t.indexes.discard(ix)
            for name in NEW_COLUMNS:
                t._columns.remove(t.c[name])  # type: ignore[attr-defined]
            sa.Index("ix_jobs_ready", t.c.group_key, t.c.run_after, t.c.id, postgresql_where=sa.text("state = 'ready'"),
                     sqlite_where=sa.text("state = 'ready'")).ddl_if(dialect=("postgresql", "sqlite"))
            sa.Index("ix_jobs_ready_my", t.c.state, t.c.group_key, t.c.run_after, t.c.id).ddl_if(dialect=("mysql", "mariadb"))
    return md


def test_a_schema_3_database_is_upgraded_in_place_and_keeps_working(engine: sa.Engine) -> None:
    """A schema 3 database holding ready and done jobs is upgraded by create_schema (twice:
    idempotent): the new columns appear (old rows read priority 0), the ready index gains the
    priority column, the version reads 4, and a Worker runs the old jobs and new prioritised
    ones in claim order. A broken upgrade shows as a missing column, a stale index, lost rows,
    or a failing worker."""
    jobq.Base.metadata.drop_all(engine)
    old = _schema_3()
    old.create_all(engine)
    now = db_now(engine)
    jobs, meta = old.tables["jobs"], old.tables["jobq_meta"]
    base = dict(is_container=False, group_key="g", weight=1, run_after=now, created_at=now, updated_at=now,
                attempts=0, max_attempts=3, in_flight=False, cancel_requested=False, pending_deps=0,
                pending_children=0, failed_children=0, type="t")
    with engine.begin() as conn:
        conn.execute(sa.insert(meta), [{"key": "schema_version", "value": "3"}, {"key": "claim_lock", "value": ""}])
        conn.execute(sa.insert(jobs), [dict(base, args={"n": i}, state="ready") for i in range(3)])
        conn.execute(sa.insert(jobs), [dict(base, args={}, state="done", result={}, finished_at=now)])
    assert "priority" not in {c["name"] for c in sa.inspect(engine).get_columns("jobs")}

    jobq.create_schema(engine)
    jobq.create_schema(engine)

    insp = sa.inspect(engine)
    assert set(NEW_COLUMNS) <= {c["name"] for c in insp.get_columns("jobs")}
    ready = {i["name"]: i["column_names"] for i in insp.get_indexes("jobs") if i["name"].startswith("ix_jobs_ready")}
    assert len(ready) == 1 and "priority" in next(iter(ready.values())), ready
    assert schema_version(engine) == str(jobq.SCHEMA_VERSION)
    assert jobq.get(engine, 1).priority == 0  # type: ignore[union-attr]
    if jobq._prepare(engine).live_key_column == "unique_live":
        assert "unique_live" in {c["name"] for c in insp.get_columns("jobs")}
    else:
        assert "ux_jobs_unique_live" in {i["name"] for i in insp.get_indexes("jobs")}
    keyed = jobq.enqueue(engine, "t", args={"n": 100}, unique_key="k", priority=-1, group_key="g")
    assert jobq.enqueue(engine, "t", unique_key="k") == keyed
    first = jobq.enqueue(engine, "t", args={"n": 99}, priority=1, group_key="g")
    ran: list[int] = []
    w = jobq.Worker(engine, {"t": lambda ctx: ran.append(ctx.args["n"])}, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=60)
    assert ran == [99, 0, 1, 2, 100]
    assert jobq.get(engine, first).state == "done"  # type: ignore[union-attr]
    # Leave the fresh schema the other tests expect (the fixture creates it once per database).
    jobq.Base.metadata.drop_all(engine)
    jobq.create_schema(engine)

"""Schema 3 -> 4 for spawning (issue 16): create_schema adds jobs.spawned_by, jobs.spawn_token
and the held-spawn index to a schema-3 database in place, keeps its jobs, and a Worker then
runs a handler that spawns. A broken upgrade shows as a missing column or index (the spawn
fails), lost rows, or a second create_schema that fails (not idempotent)."""

from __future__ import annotations

import sqlalchemy as sa

import jobq
from helpers import db_now, schema_version

NEW_COLUMNS = ("spawned_by", "spawn_token")
NEW_INDEXES = ("ix_jobs_held", "ix_jobs_held_my")


def _schema_3() -> sa.MetaData:
    """jobq's schema 3 as it was before spawning (frozen here): today's tables minus the new
    columns and index."""
    md = sa.MetaData()
    for table in jobq.Base.metadata.sorted_tables:
        t = table.to_metadata(md)
        if t.name == "jobs":
            for name in NEW_COLUMNS:
                t._columns.remove(t.c[name])  # type: ignore[attr-defined]
            for ix in list(t.indexes):
                if ix.name in NEW_INDEXES:
                    t.indexes.discard(ix)
    return md


def test_a_schema_3_database_gains_spawning_in_place(engine: sa.Engine) -> None:
    jobq.Base.metadata.drop_all(engine)
    old = _schema_3()
    old.create_all(engine)
    now = db_now(engine)
    jobs, meta = old.tables["jobs"], old.tables["jobq_meta"]
    base = dict(args={}, is_container=False, group_key="g", weight=1, run_after=now, created_at=now, updated_at=now,
                attempts=0, max_attempts=3, in_flight=False, cancel_requested=False, pending_deps=0,
                pending_children=0, failed_children=0)
    with engine.begin() as conn:
        conn.execute(sa.insert(meta), [{"key": "schema_version", "value": "3"}, {"key": "claim_lock", "value": ""}])
        conn.execute(sa.insert(jobs), [dict(base, type="spawner", state="ready") for _ in range(2)])
    assert not set(NEW_COLUMNS) & {c["name"] for c in sa.inspect(engine).get_columns("jobs")}

    jobq.create_schema(engine)
    jobq.create_schema(engine)  # idempotent

    insp = sa.inspect(engine)
    assert set(NEW_COLUMNS) <= {c["name"] for c in insp.get_columns("jobs")}
    want = "ix_jobs_held" if engine.dialect.name in ("postgresql", "sqlite") else "ix_jobs_held_my"
    assert want in {i["name"] for i in insp.get_indexes("jobs")}
    assert schema_version(engine) == str(jobq.SCHEMA_VERSION)

    def spawner(ctx: jobq.JobContext) -> dict[str, int]:
        return {"child": ctx.enqueue("child", depends_on=[ctx.id])}

    w = jobq.Worker(engine, {"spawner": spawner, "child": lambda ctx: None}, max_concurrency=2, poll_interval=0.05)
    assert w.run_until_idle(timeout=30)
    st = jobq.stats(engine)["states"]
    assert (st["done"], st["held"]) == (4, 0)  # the two old jobs and their spawns
    # Leave the fresh schema the other tests expect (the fixture creates it once per database).
    jobq.Base.metadata.drop_all(engine)
    jobq.create_schema(engine)

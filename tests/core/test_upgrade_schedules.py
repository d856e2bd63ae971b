"""Schema 6 -> 7: a database made before recurring jobs and trace propagation (both schema 7)
gains jobq_schedules and jobs.trace_parent in place (create_schema), keeps its jobs, and can
then hold a schedule whose slot is enqueued. (tests/core/test_upgrade_trace.py checks the trace
column's own use.)"""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa

import jobq
from helpers import recorded_version, schema_version


def test_a_schema_6_database_gains_schedules(engine: sa.Engine) -> None:
    """The table and the trace column dropped and the version set back to 6 (what a schema-6
    jobq.py made): create_schema (twice: idempotent) makes the table with its due index and the
    column, records 7, keeps the ready job, and a schedule made then fires its slot. A broken
    step shows as a missing table, index or column, or a version left at 6."""
    jobq.Base.metadata.tables["jobq_schedules"].drop(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE jobs DROP COLUMN trace_parent")
    recorded_version(engine, 6)
    job = jobq.enqueue(engine, "t", {})
    jobq.create_schema(engine)
    jobq.create_schema(engine)
    assert "jobq_schedules" in sa.inspect(engine).get_table_names()
    assert "ix_jobq_schedules_due" in {i["name"] for i in sa.inspect(engine).get_indexes("jobq_schedules")}
    assert "trace_parent" in {c["name"] for c in sa.inspect(engine).get_columns("jobs")}
    assert schema_version(engine) == str(jobq.SCHEMA_VERSION) == "7"
    assert jobq.get(engine, job).state == "ready"  # type: ignore[union-attr]
    info = jobq.schedule(engine, "s", "t", every=dt.timedelta(minutes=1))
    assert len(jobq._fire_due(engine, info.next_run_at.replace(tzinfo=None))) == 1

"""Schema 6 -> 7: a database made before trace propagation gains jobs.trace_parent in place
(create_schema), keeps its jobs, and stores a trace context after it."""

from __future__ import annotations

import sqlalchemy as sa
from opentelemetry.sdk.trace import TracerProvider

import jobq
from helpers import recorded_version, schema_version


def test_a_schema_6_database_gains_the_trace_column(engine: sa.Engine) -> None:
    """The column dropped and the version set back to 6 (what a schema-6 jobq.py made):
    create_schema (twice: idempotent) adds it, records 7 and keeps the job; an enqueue inside
    a span then stores its traceparent. A broken step shows as an insert naming a missing
    column, or a version left at 6."""
    with engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE jobs DROP COLUMN trace_parent")
    recorded_version(engine, 6)
    old = jobq.enqueue(engine, "t", {})
    jobq.create_schema(engine)
    jobq.create_schema(engine)
    assert "trace_parent" in {c["name"] for c in sa.inspect(engine).get_columns("jobs")}
    assert schema_version(engine) == str(jobq.SCHEMA_VERSION) == "7"
    jobq.propagate_trace_context()
    try:
        with TracerProvider().get_tracer("app").start_as_current_span("request") as span:
            new = jobq.enqueue(engine, "t", {})
    finally:
        jobq.propagate_trace_context(False)
    with engine.connect() as conn:
        stored = conn.execute(jobq._q_trace_parent(new)).scalar()
        assert conn.execute(jobq._q_trace_parent(old)).scalar() is None
    ctx = span.get_span_context()
    assert stored is not None and stored.startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-"), stored

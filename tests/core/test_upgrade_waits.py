"""Schema 5 -> 6: a database made before signals and waits gains jobq_signals and jobq_waits in
place (create_schema), keeps its jobs, and its jobs can then wait for signals."""

from __future__ import annotations

import sqlalchemy as sa

import jobq
from helpers import FAST, recorded_version, schema_version, state


def test_a_schema_5_database_gains_signals_and_waits(engine: sa.Engine) -> None:
    """The two tables dropped and the version set back to 5 (what a schema-5 jobq.py made):
    create_schema (twice: idempotent) makes them, records 6, keeps the ready job, and that job
    then suspends on wait_for and finishes after its signal. A broken step shows as a missing
    table (the suspension's write fails), or a version left at 5."""
    for name in ("jobq_waits", "jobq_signals"):
        jobq.Base.metadata.tables[name].drop(engine)
    recorded_version(engine, 5)
    job = jobq.enqueue(engine, "t", {})
    jobq.create_schema(engine)
    jobq.create_schema(engine)
    assert {"jobq_signals", "jobq_waits"} <= set(sa.inspect(engine).get_table_names())
    assert schema_version(engine) == str(jobq.SCHEMA_VERSION)
    w = jobq.Worker(engine, {"t": lambda ctx: {"got": ctx.wait_for("upgraded")}}, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=30) and state(engine, job) == "ready"
    jobq.signal(engine, "upgraded", 6)
    assert w.run_until_idle(timeout=30)
    info = jobq.get(engine, job)
    assert info is not None and info.result == {"got": 6}, info

"""Schema 6 -> 7: jobs gains max_attempts_set in place (create_schema); the jobs already there
read as enqueued without a max_attempts of their own (a RetryPolicy applies to them, as it
did before), and jobs enqueued afterwards with max_attempts=3 keep their 3."""

from __future__ import annotations

import sqlalchemy as sa

import jobq
from helpers import FAST, recorded_version, schema_version


@jobq.RetryPolicy(attempts=4)
def _fails(ctx: jobq.JobContext) -> None:
    raise RuntimeError("fails")


def test_a_schema_6_database_gains_max_attempts_set(engine: sa.Engine) -> None:
    """The column dropped and the version set back to 6 (what a schema-6 jobq.py made), with a
    job in it: create_schema (twice: idempotent) adds the column, records 7, keeps the job; the
    old job takes the policy's 4 attempts, a new one enqueued with max_attempts=3 keeps 3. A
    broken step shows as a missing column (enqueue fails), or a version left at 6."""
    old = jobq.enqueue(engine, "p", max_attempts=3)  # before the upgrade: cannot be told from the default
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE jobs DROP COLUMN max_attempts_set"))
    recorded_version(engine, 6)
    assert "max_attempts_set" not in {c["name"] for c in sa.inspect(engine).get_columns("jobs")}
    jobq.create_schema(engine)
    jobq.create_schema(engine)
    assert "max_attempts_set" in {c["name"] for c in sa.inspect(engine).get_columns("jobs")}
    assert schema_version(engine) == str(jobq.SCHEMA_VERSION) == "7"
    new = jobq.enqueue(engine, "p", max_attempts=3)
    assert jobq.Worker(engine, {"p": _fails}, max_concurrency=2, **FAST).run_until_idle(timeout=60)
    assert [jobq.get(engine, j).attempts for j in (old, new)] == [4, 3]  # type: ignore[union-attr]

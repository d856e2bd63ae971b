"""Jobs scheduled for later cost an idle tick nothing: its claim asks the due index
(ix_jobs_due; ix_jobs_due_my on MySQL/MariaDB) whether anything is due and, when nothing is,
reads no more of the ready set. The ready index orders a group's jobs by priority before
run_after, so a read of it cannot stop at ``run_after <= now``: with 200,000 jobs a day ahead
an idle tick cost 11 to 1,300 times an empty table's (bench/idle_scheduled.py).

The cost is counted by the engine, never timed: SQLite's VM instructions (a progress handler
called at each one), PostgreSQL's buffer requests on jobs and its indexes in the transaction
(pg_stat_get_xact_blocks_fetched), MySQL/MariaDB's Handler_read_* of the session (with index
condition pushdown off)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

import jobq
from helpers import db_now, recorded_version

#: Jobs scheduled a day ahead: enough that a walk of them dwarfs everything else a tick reads.
SCHEDULED = 20_000

_PG_BLOCKS = ("SELECT coalesce(sum(pg_stat_get_xact_blocks_fetched(c.oid)), 0) FROM pg_class c"
              " WHERE c.oid = 'jobs'::regclass OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = 'jobs'::regclass)")


def _reads(conn: sa.Connection) -> Callable[[], int]:
    """A counter of what this connection's statements read from here on (see the docstring)."""
    name = conn.dialect.name
    if name == "sqlite":
        steps = [0]

        def step() -> int:
            steps[0] += 1
            return 0  # go on

        conn.connection.dbapi_connection.set_progress_handler(step, 1)  # type: ignore[union-attr]
        return lambda: steps[0]
    if name == "postgresql":
        start = int(conn.exec_driver_sql(_PG_BLOCKS).scalar_one())
        return lambda: int(conn.exec_driver_sql(_PG_BLOCKS).scalar_one()) - start

    # Index condition pushdown filters entries inside InnoDB, where Handler_read_* does not
    # count them: off for this session, every index entry visited is counted.
    conn.exec_driver_sql("SET SESSION optimizer_switch = 'index_condition_pushdown=off'")

    def handler_reads() -> int:
        return sum(int(v) for _k, v in conn.exec_driver_sql("SHOW SESSION STATUS LIKE 'Handler_read%%'"))

    start = handler_reads()
    return lambda: handler_reads() - start


def _idle_tick_reads(engine: sa.Engine) -> int:
    """What one tick's transaction (reclaim, then the claim of a Worker: 64 slots, cap 64, one
    type) reads, counted by the engine; rolled back."""
    d = jobq._prepare(engine)
    with engine.connect() as conn:
        conn.begin()
        count = _reads(conn)
        now = d.db_now(conn)
        before = count()
        _n, leases = jobq._schedule_rows(conn, d, now, worker_id="w", types=["t"], max_concurrency=64, lease_ttl=60,
                                         limit=64, group_caps=None, rate_limits=None, state="running")
        read = count() - before
        conn.rollback()
        if conn.dialect.name == "sqlite":
            conn.connection.dbapi_connection.set_progress_handler(None, 1)  # type: ignore[union-attr]
    assert leases == []
    return read


def _schedule(engine: sa.Engine, n: int, groups: int, ahead: dt.timedelta = dt.timedelta(days=1)) -> None:
    """``n`` jobs of type t a day ahead over ``groups`` groups, bulk-inserted (as bench/idle_scheduled.py)."""
    now = db_now(engine)
    base = dict(type="t", args={}, state="ready", is_container=False, parent_id=None, weight=1, run_after=now + ahead,
                created_at=now, updated_at=now, attempts=0, max_attempts=3, in_flight=False, cancel_requested=False,
                pending_deps=0, pending_children=0, failed_children=0)
    with engine.begin() as conn:
        for i in range(0, n, 5000):
            conn.execute(sa.insert(jobq.Job.__table__),
                         [dict(base, group_key=f"g{j % groups:03d}", priority=j % 3) for j in range(i, min(n, i + 5000))])
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("ANALYZE jobs")
    elif engine.dialect.name in ("mysql", "mariadb"):
        with engine.connect() as conn:
            conn.exec_driver_sql("ANALYZE TABLE jobs").all()


def _fresh(engine: sa.Engine) -> None:
    """New tables: rows deleted by an earlier test leave dead index entries behind (until
    vacuum or purge), which an empty table's count would read."""
    jobq.Base.metadata.drop_all(engine)
    jobq.create_schema(engine)


def _flat(empty: int, full: int) -> bool:
    """The target of issue 45 (an idle tick within 1.5x of an empty table's), on what the
    engine read rather than on time."""
    return full <= 1.5 * empty


@pytest.fixture
def no_probe(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """BROKEN variant: the claim without its due check (as before ix_jobs_due): a probe that
    always answers "something is due", so the claim reads the ready index to find out."""
    monkeypatch.setattr(jobq, "_q_any_due", lambda d: sa.select(sa.literal_column("1")))
    yield


@pytest.mark.parametrize("groups", [1, 40])
def test_an_idle_tick_reads_no_job_scheduled_for_later(engine: sa.Engine, groups: int) -> None:
    """With 20,000 jobs scheduled a day ahead (over one group: the one-group claim; over 40:
    the windowed claim) and nothing due, a tick reads no more than 1.5x what it reads on an
    empty table. A claim that reads the ready index to learn that nothing is due walks every
    one of them: below, the broken variant."""
    _fresh(engine)
    empty = _idle_tick_reads(engine)
    _schedule(engine, SCHEDULED, groups)
    full = _idle_tick_reads(engine)
    assert _flat(empty, full), (empty, full)


@pytest.mark.parametrize("groups", [1, 40])
def test_a_claim_without_the_due_check_is_caught(engine: sa.Engine, groups: int, no_probe: None) -> None:
    """BROKEN variant of the test above: without the due check the same idle tick reads every
    scheduled job's index entry, and the check fails."""
    _fresh(engine)
    empty = _idle_tick_reads(engine)
    _schedule(engine, SCHEDULED, groups)
    full = _idle_tick_reads(engine)
    assert not _flat(empty, full), (empty, full)


def _drop_due_index(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP INDEX ix_jobs_due_my ON jobs" if engine.dialect.name in ("mysql", "mariadb")
                             else "DROP INDEX ix_jobs_due")


def test_a_due_check_without_its_index_is_caught(engine: sa.Engine) -> None:
    """BROKEN variant: the due check with its index dropped. It must then find a due row
    through the ready index (or the table), past every scheduled one: the counts catch it."""
    _fresh(engine)
    empty = _idle_tick_reads(engine)
    _schedule(engine, SCHEDULED, 1)
    _drop_due_index(engine)
    assert not _flat(empty, _idle_tick_reads(engine))


def test_a_database_of_before_gets_the_due_index_and_keeps_its_scheduled_jobs(engine: sa.Engine) -> None:
    """A queue made by the jobq.py before the due index, holding jobs scheduled for later and
    one due job, gets the index from create_schema (twice: idempotent); its scheduled jobs
    stay as they were (ready, a day ahead), the due one is claimed, and once it is taken an
    idle tick reads no more than it reads on an empty table. An upgrade that did not make the
    index leaves the tick walking them (the broken variant above)."""
    _fresh(engine)
    empty = _idle_tick_reads(engine)
    _drop_due_index(engine)  # the schema of the jobq.py before it: version 4
    recorded_version(engine, 4)
    now = db_now(engine)
    names = {i["name"] for i in sa.inspect(engine).get_indexes("jobs")}
    assert not names & {"ix_jobs_due", "ix_jobs_due_my"}, names
    _schedule(engine, SCHEDULED, 10)
    due = jobq.enqueue(engine, "t", group_key="g000")

    jobq.create_schema(engine)
    jobq.create_schema(engine)

    names = {i["name"] for i in sa.inspect(engine).get_indexes("jobs")}
    assert ("ix_jobs_due_my" if engine.dialect.name in ("mysql", "mariadb") else "ix_jobs_due") in names, names
    leases = jobq.claim_batch(engine, "w", 60, limit=64, max_in_flight=64, types=["t"])
    assert [lease.id for lease in leases] == [due]
    assert _flat(empty, _idle_tick_reads(engine))
    with engine.connect() as conn:
        states = dict(conn.execute(sa.select(jobq.Job.state, sa.func.count()).where(jobq.Job.id != due)
                                   .group_by(jobq.Job.state)).all())
        later = conn.execute(sa.select(sa.func.min(jobq.Job.run_after)).where(jobq.Job.id != due)).scalar_one()
    assert states == {"ready": SCHEDULED}
    assert later > now + dt.timedelta(hours=23)
    assert jobq.get(engine, due).state == "leased"  # type: ignore[union-attr]

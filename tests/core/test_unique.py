"""Unique jobs (issue 16): ``enqueue(..., unique_key=...)`` returns the unfinished holder's id
and writes nothing; the key is free again once that job is done, failed or cancelled. Enforced
by a unique index over unfinished rows (partial on PostgreSQL/SQLite, a generated column on
MySQL/MariaDB), so concurrent enqueuers, in other processes or other transactions, get one job."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import sqlalchemy as sa
from sqlalchemy import orm

import jobq
from dbs import needs
from helpers import FAST, INNODB_TRX_POLL, jobs, snapshot, wait_for


def _live(engine: sa.Engine, key: str) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(jobs.c.id).where(jobs.c.unique_key == key,
                                                            jobs.c.state.in_(jobq._OPEN)).order_by(jobs.c.id)).scalars())


def test_an_unfinished_holder_is_returned_and_nothing_is_written(engine: sa.Engine) -> None:
    """While the holder is waiting, ready, leased or running, the same key returns its id and
    writes nothing (a snapshot of every row is unchanged); another key is a new job."""
    up = jobq.enqueue(engine, "up")
    first = jobq.enqueue(engine, "t", {"a": 1}, unique_key="k", depends_on=[up])  # waiting
    before = snapshot(engine)
    assert jobq.enqueue(engine, "t", {"a": 2}, unique_key="k") == first
    assert snapshot(engine) == before
    assert jobq.enqueue(engine, "t", unique_key="K") != first  # compared exactly (case matters)
    assert jobq.get(engine, first).unique_key == "k"  # type: ignore[union-attr]
    lease = jobq.claim(engine, "w", 30)
    assert lease == up
    jobq.finalize(engine, lease, worker_id="w", result={})
    assert jobq.enqueue(engine, "t", unique_key="k") == first  # ready now
    assert jobq.claim(engine, "w", 30) == first
    assert jobq.enqueue(engine, "t", unique_key="k") == first  # leased


@pytest.mark.parametrize("end", ["done", "failed", "cancelled"])
def test_the_key_is_free_again_once_the_holder_finished(engine: sa.Engine, end: str) -> None:
    """Done, failed or cancelled: the next enqueue with the key is a new job; the old row keeps
    its key (get shows it) but no longer holds it."""
    first = jobq.enqueue(engine, "t", unique_key="k", max_attempts=1)
    if end == "cancelled":
        jobq.cancel(engine, first)
    else:
        lease = jobq.claim(engine, "w", 30)
        (jobq.finalize(engine, lease, worker_id="w", result={}) if end == "done"
         else jobq.fail(engine, lease, worker_id="w", error="boom"))
    assert jobq.get(engine, first).state == end  # type: ignore[union-attr]
    second = jobq.enqueue(engine, "t", unique_key="k")
    assert second != first and _live(engine, "k") == [second]
    if end != "done":  # retrying the old one would make two holders: refused, nothing changes
        before = snapshot(engine)
        with pytest.raises(jobq.InvalidJob, match="unique_key"):
            jobq.retry(engine, first)
        assert snapshot(engine) == before


def test_submit_wires_dependents_to_the_holder_and_refuses_a_key_twice(engine: sa.Engine) -> None:
    """In submit, an item whose key is held is not inserted: the mapping gives the holder's id
    and the items that depend on it wait for the holder. The same key twice in one submit is
    refused, with nothing written."""
    held = jobq.enqueue(engine, "t", unique_key="page:/a")
    ids = jobq.submit(engine, [{"key": "a", "type": "t", "unique_key": "page:/a"},
                               {"key": "b", "type": "t", "unique_key": "page:/b", "depends_on": ["a"]}])
    assert ids["a"] == held and ids["b"] != held
    info = jobq.get(engine, ids["b"])
    assert info is not None and info.depends_on == (held,) and info.state == "waiting"
    before = snapshot(engine)
    with pytest.raises(jobq.InvalidJob, match="same unique_key 'x'"):
        jobq.submit(engine, [{"key": "p", "type": "t", "unique_key": "x"}, {"key": "q", "type": "t", "unique_key": "x"}])
    for bad in ("", " x", "a" * 201, 7):
        with pytest.raises(jobq.InvalidJob, match="unique_key"):
            jobq.enqueue(engine, "t", unique_key=bad)  # type: ignore[arg-type]
    assert snapshot(engine) == before


def test_inside_the_callers_transaction_it_behaves_the_same(engine: sa.Engine) -> None:
    """In a Session: the second enqueue sees the first (uncommitted, same transaction) and
    returns its id; a rollback leaves nothing and frees the key."""
    with orm.Session(engine) as session:
        a = jobq.enqueue(session, "t", unique_key="k")
        assert jobq.enqueue(session, "t", unique_key="k") == a
        session.rollback()
    assert _live(engine, "k") == []
    with orm.Session(engine) as session:
        a = jobq.enqueue(session, "t", unique_key="k")
        b = jobq.submit(session, [{"key": "x", "type": "t", "unique_key": "k"}])["x"]
        session.commit()
    assert a == b and _live(engine, "k") == [a]


def test_the_cli_takes_a_unique_key(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert jobq.main(["--url", db_url, "enqueue", "t", "--unique-key", "nightly", "--priority", "3"]) == 0
    first = int(capsys.readouterr().out)
    assert jobq.main(["--url", db_url, "enqueue", "t", "--unique-key", "nightly"]) == 0
    assert int(capsys.readouterr().out) == first
    eng = sa.create_engine(db_url)
    info = jobq.get(eng, first)
    eng.dispose()
    assert info is not None and info.priority == 3 and info.unique_key == "nightly"


def _enqueuer(url: str, keys: list[str], barrier: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue) -> None:
    engine = sa.create_engine(url, pool_pre_ping=True)
    got: dict[str, int] = {}
    barrier.wait()
    for k in keys:
        got[k] = jobq.enqueue(engine, "t", {"k": k}, unique_key=k)
    out.put(got)
    engine.dispose()


def test_concurrent_enqueuers_in_several_processes_get_one_job_per_key(db_url: str, engine: sa.Engine) -> None:
    """Three processes enqueue the same 30 keys at once (released by a barrier, each in its own
    order). Correct: every process gets the same id for a key, and each key has exactly one
    row. A check outside the index (SELECT, then INSERT) lets two processes both insert: two
    rows for a key, and processes that disagree on its id (the deterministic catch of that
    variant is the next test)."""
    keys = [f"k{i}" for i in range(30)]
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(3)
    out = ctx.Queue()
    procs = [ctx.Process(target=_enqueuer, args=(db_url, keys[i:] + keys[:i], barrier, out)) for i in (0, 10, 20)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for k in keys:
        assert len({r[k] for r in results}) == 1, k
    with engine.connect() as conn:
        counts = dict(conn.execute(sa.select(jobs.c.unique_key, sa.func.count()).group_by(jobs.c.unique_key)).all())
    assert counts == {k: 1 for k in keys}
    w = jobq.Worker(engine, {"t": lambda ctx: None}, max_concurrency=4, **FAST)
    assert w.run_until_idle(timeout=60)


def _waiting_for_a_lock(engine: sa.Engine) -> bool:
    """Some other session of this database waits for a row or index lock."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            n = conn.exec_driver_sql("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                     "AND datname = current_database()").scalar()
        else:
            n = conn.exec_driver_sql(
                "SELECT count(*) FROM information_schema.innodb_trx t JOIN information_schema.processlist p "
                "ON p.id = t.trx_mysql_thread_id WHERE t.trx_state = 'LOCK WAIT' AND p.db = DATABASE()").scalar()
        conn.rollback()
    return bool(n)


def _race_with_an_uncommitted_holder(engine: sa.Engine, b_returns_first: bool = False) -> tuple[int, int]:
    """Transaction A enqueues key k and stays open; B (another connection, a thread) enqueues
    k; once B waits on A's row (or has returned), A commits. Returns (A's id, B's id). With
    ``b_returns_first`` (the broken variant, which has nothing to wait on) A commits only after
    B has returned, so B cannot have seen A's row."""
    got: list[int] = []
    with engine.connect() as a_conn:
        a_conn.begin()
        a = jobq.enqueue(a_conn, "t", unique_key="k")
        b = threading.Thread(target=lambda: got.append(jobq.enqueue(engine, "t", unique_key="k")))
        b.start()
        if b_returns_first:
            wait_for(lambda: got, timeout=30, what="B to return while A is uncommitted")
        else:
            wait_for(lambda: got or _waiting_for_a_lock(engine), timeout=30, interval=INNODB_TRX_POLL,
                     what="B to wait on A's key")
        a_conn.commit()
    b.join(timeout=30)
    assert got, "B never returned"
    return a, got[0]


@needs("row_locks")  # SQLite has one writer, so B waits on BEGIN IMMEDIATE instead
def test_an_enqueue_racing_an_uncommitted_holder_waits_and_returns_its_id(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Correct: B waits on the unique index for A, then returns A's id, and there is one row.
    The broken variant, a check outside the index (jobq's own SELECT-then-INSERT with the
    unique index dropped and a plain INSERT), lets B insert a duplicate while A is uncommitted: caught here."""
    a, b = _race_with_an_uncommitted_holder(engine)
    assert a == b and _live(engine, "k") == [a]

    d = jobq._prepare(engine)
    # the broken variant: a plain SELECT, then a plain INSERT, with no unique index behind them
    monkeypatch.setattr(jobq._Dialect, "live_keys", lambda self, conn, keys: dict(conn.execute(
        sa.select(jobs.c.unique_key, jobs.c.id).where(jobs.c.unique_key.in_(keys), jobs.c.state.in_(jobq._OPEN))).all()))
    monkeypatch.setattr(type(d), "insert_unique",
                        lambda self, conn, row: conn.execute(jobq._Q_INSERT_JOB, dict(row)).inserted_primary_key[0])
    with engine.begin() as conn:
        conn.execute(jobs.delete())
        if d.partial_indexes:
            conn.exec_driver_sql("DROP INDEX ux_jobs_unique_live")
        else:
            conn.exec_driver_sql("DROP INDEX ux_jobs_unique_live_my ON jobs")
    try:
        a, b = _race_with_an_uncommitted_holder(engine, b_returns_first=True)
        assert a != b and len(_live(engine, "k")) == 2  # the duplicate the index prevents
    finally:
        with engine.begin() as conn:
            conn.execute(jobs.delete())
            if d.partial_indexes:
                next(i for i in jobs.indexes if i.name == "ux_jobs_unique_live").create(conn)
            else:
                conn.execute(jobq._DDL_UNIQUE_LIVE[1])

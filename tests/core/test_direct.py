"""The hot path's statements on the DBAPI cursor (jobq._Direct, _hot_rows, _hot_rowcount).

A busy worker's claim and finalize skip ``Connection.execute`` where the statement allows it.
What ``Connection.execute`` did that matters must still happen: values converted both ways as
the column types say, database errors raised as SQLAlchemy's DBAPIError (which _transaction's
retry rules and the worker's error handling read), a lost connection invalidated, and every
statement shown to cursor-execute listeners (then nothing skips). Each property has a BROKEN
variant next to it that the same check catches.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
from dbs import needs, only
from helpers import FAST

jobs = jobq.Job.__table__


@pytest.fixture(autouse=True)
def _the_cursor_path_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the cursor path: on, whatever JOBQ_FASTPATH says (the suite also
    runs with JOBQ_FASTPATH=0, where everything else runs through Connection.execute)."""
    monkeypatch.setattr(jobq, "_FASTPATH", True)


def _noop(ctx: jobq.JobContext) -> None:
    return None


def _drain(engine: sa.Engine, n: int = 30) -> None:
    """Drain n jobs over three groups, then n in one group (the claim's two locking reads);
    each done once."""
    w = jobq.Worker(engine, {"t": _noop}, max_concurrency=8, **FAST)
    for groups in (3, 1):
        for i in range(n):
            jobq.enqueue(engine, "t", group_key=f"g{i % groups}")
        assert w.run_until_idle(timeout=60)
    with engine.connect() as conn:
        got = conn.execute(sa.select(jobs.c.state, jobs.c.attempts, sa.func.count()).group_by(jobs.c.state, jobs.c.attempts)).all()
    assert [tuple(r) for r in got] == [("done", 1, 2 * n)]


def _on_cursor_calls(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """_drain; the statements that ran on the cursor."""
    seen: list[Any] = []
    real = jobq._on_cursor

    def spy(conn: sa.Connection, form: Any, params: Any, rows: bool) -> Any:
        seen.append(form.stmt)
        return real(conn, form, params, rows)

    monkeypatch.setattr(jobq, "_on_cursor", spy)
    _drain(engine)
    return seen


def test_a_drain_runs_its_claim_and_finalize_on_the_cursor(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _on_cursor_calls(engine, monkeypatch)
    d = jobq._prepare(engine)
    # Every engine: the claim's lock (or its read of the stored policy) and its in-flight count.
    assert any(s is jobq._q_lock_claim(d, p) or s is jobq._q_claim_lock_value(p) for s in seen for p in (False, True))
    assert (jobq._Q_SLOTS_AND_SPAN if d.span_first else jobq._Q_SLOTS_IN_USE) in seen
    finish = jobq._q_finish_recorded(d) if d.dml_ctes else jobq._q_finish_batch_same(d)
    assert finish in seen
    for name, lock in (("chosen", lambda: jobq._q_lock_chosen(d)), ("candidates:True", lambda: jobq._q_candidates(d, True))):
        assert (jobq._q_lock_and_lease(d, name, lock) if d.dml_ctes else lock()) in seen, name
    if not d.dml_ctes:
        assert jobq._q_lease(d) in seen
    if d.index_hints:  # the cursor runs the statement as compiled: with its lock-scope hint
        updates = [jobq._direct_form(engine.dialect, s).sql for s in seen if isinstance(s, sa.Update)]
        assert updates and all("UPDATE jobs FORCE INDEX (PRIMARY)" in u for u in updates), updates


def test_a_worker_running_one_job_at_a_time_finishes_each_on_the_cursor(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Long jobs finish one at a time: each finalize is a batch of one, and takes the batch's
    prebuilt statement like any other (it once built and compiled a statement per job: 0.35-0.5
    ms of client CPU a job on every engine)."""
    built: list[int] = []
    real_finish = jobq._q_finish
    monkeypatch.setattr(jobq, "_q_finish", lambda job_id, *a, **k: built.append(job_id) or real_finish(job_id, *a, **k))
    seen: list[Any] = []
    real = jobq._on_cursor
    monkeypatch.setattr(jobq, "_on_cursor", lambda conn, form, params, rows: seen.append(form.stmt) or real(conn, form, params, rows))
    w = jobq.Worker(engine, {"t": _noop}, max_concurrency=1, **FAST)
    ids = [jobq.enqueue(engine, "t") for _ in range(5)]
    assert w.run_until_idle(timeout=60)
    assert [jobq.get(engine, i).state for i in ids] == ["done"] * 5
    d = jobq._prepare(engine)
    finish = jobq._q_finish_recorded(d) if d.dml_ctes else jobq._q_finish_batch_same(d)
    assert sum(s is finish for s in seen) == 5
    assert built == []  # nothing built per job


@needs(no="local_clock")  # the server's clock read on the cursor (and NOTIFY where there is one)
def test_an_enqueue_reads_the_clock_and_wakes_listeners_on_the_cursor(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    real = jobq._on_cursor
    monkeypatch.setattr(jobq, "_on_cursor", lambda conn, form, params, rows: seen.append(form.stmt) or real(conn, form, params, rows))
    job_id = jobq.enqueue(engine, "t")
    d = jobq._prepare(engine)
    assert d.now_sql is not None
    if d.notify_listen:  # one statement reads the clock and queues the wake-up
        assert jobq._q_db_now_notify(d) in seen and jobq._Q_NOTIFY not in seen
    else:
        assert jobq._q_db_now(d) in seen
    with engine.connect() as conn:
        now = d.db_now(conn)
        conn.rollback()
    created = jobq.get(engine, job_id).created_at.replace(tzinfo=None)
    assert isinstance(now, dt.datetime) and now.tzinfo is None and created <= now


def _inserted_both_ways(engine: sa.Engine) -> tuple[dict[str, Any], dict[str, Any]]:
    """One job row written by _insert_rows (on the cursor where the engine returns ids) and
    the same row through Connection.execute; both read back without their ids."""
    plan = jobq._plan([{"type": "t", "args": {"a": [1, "é", None]}, "group_key": "g'1", "priority": 5, "timeout": 2.5,
                        "max_attempts": 7, "weight": 3}], single=True)
    d = jobq._prepare(engine)
    with engine.connect() as conn:
        now = d.db_now(conn)
        spec = next(iter(plan.specs.values()))
        row = jobq._job_row(spec, now, state="ready", pending_deps=0, pending_children=0)
        (direct,) = jobq._insert_rows(conn, d, [row])
        executed = conn.execute(jobq._Q_INSERT_JOB, dict(row)).inserted_primary_key[0]
        got = {r.id: {k: v for k, v in r._mapping.items() if k != "id"} for r in conn.execute(sa.select(jobs).where(jobs.c.id.in_([direct, executed])))}
        conn.rollback()
    return got[direct], got[executed]


def test_an_enqueued_row_is_the_row_connection_execute_writes(engine: sa.Engine) -> None:
    direct, executed = _inserted_both_ways(engine)
    assert direct == executed
    assert direct["priority"] == 5 and direct["args"] == {"a": [1, "é", None]} and direct["result"] is None


@needs("returning")  # without RETURNING Connection.execute inserts
def test_an_insert_that_drops_a_column_is_caught(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """BROKEN: the prebuilt insert leaves out a column the row has (priority falls back to its
    default, 0)."""
    real = jobq._q_insert_job_returning
    monkeypatch.setattr(jobq, "_q_insert_job_returning", lambda d, cols: real(d, tuple(c for c in cols if c != "priority")))
    direct, executed = _inserted_both_ways(engine)
    assert direct["priority"] == 0 and executed["priority"] == 5


def test_a_statement_that_leaves_a_column_to_its_python_default_is_not_run_on_the_cursor(engine: sa.Engine) -> None:
    """Connection.execute computes such a default; the cursor would bind None in its place."""
    assert jobq._direct_form(engine.dialect, sa.insert(jobs).values(type=sa.bindparam("b_type"))) is None
    assert jobq._direct_form(engine.dialect, jobq._q_insert_job_returning(jobq._prepare(engine), ("type",))) is None


def _wake_ups(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """In one transaction: a wake-up queued in a savepoint that rolls back, then two more. How
    many NOTIFY statements ran, and how many notifications a listener got after the commit."""
    d = jobq._prepare(engine)
    sent: list[Any] = []
    real = jobq._on_cursor
    monkeypatch.setattr(jobq, "_on_cursor", lambda conn, form, params, rows: (
        sent.append(form.stmt) if form.stmt is jobq._Q_NOTIFY else None) or real(conn, form, params, rows))
    listener = jobq._listener_connection(engine)
    try:
        with engine.connect() as conn, conn.begin():
            savepoint = conn.begin_nested()
            d.notify(conn)
            savepoint.rollback()  # PostgreSQL drops the notification queued inside it
            d.notify(conn)
            d.notify(conn)
        with engine.connect() as conn, conn.begin():  # committed after it: delivered after it
            conn.execute(sa.text("SELECT pg_notify(:c, 'end')"), {"c": jobq.PG_NOTIFY_CHANNEL})
        got = []
        for n in listener.notifies(timeout=30):  # the timeout only bounds a failure
            if n.payload == "end":
                break
            got.append(n)
        else:
            raise AssertionError("the closing notification never came")
    finally:
        listener.close()
    return len(sent), len(got)


@needs("notify_listen")
def test_a_wake_up_is_sent_once_a_transaction_and_again_after_its_savepoint_rolls_back(
        engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _wake_ups(engine, monkeypatch) == (2, 1)


@needs("notify_listen")
def test_a_wake_up_thought_sent_by_a_rolled_back_savepoint_is_caught(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """BROKEN: the wake-up marked on the outer transaction: the one the savepoint took with it
    is never sent again, and the listener hears nothing."""
    monkeypatch.setattr(jobq._Dialect, "_wakes", lambda self, conn: conn.get_transaction() is None
                        or conn.info.get("jobq_woken") is not conn.get_transaction())
    monkeypatch.setattr(jobq._Dialect, "_woken", lambda self, conn: conn.info.__setitem__("jobq_woken", conn.get_transaction()))
    assert _wake_ups(engine, monkeypatch) == (1, 0)


def test_a_drain_without_the_cursor_path_is_caught(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """BROKEN: every statement through Connection.execute."""
    monkeypatch.setattr(jobq, "_direct", lambda conn: False)
    assert _on_cursor_calls(engine, monkeypatch) == []


def _listened(engine: sa.Engine) -> list[str]:
    seen: list[str] = []

    def capture(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        seen.append(" ".join(statement.split()))

    sa.event.listen(engine, "before_cursor_execute", capture)
    try:
        _drain(engine)
    finally:
        sa.event.remove(engine, "before_cursor_execute", capture)
    return seen


def _claim_lock_sql(engine: sa.Engine) -> list[str]:
    d = jobq._prepare(engine)
    slots = jobq._Q_SLOTS_AND_SPAN if d.span_first else jobq._Q_SLOTS_IN_USE
    return [" ".join(str(s.compile(dialect=engine.dialect)).split())
            for s in (slots, jobq._q_lock_claim(d), jobq._q_lock_claim(d, True))]


def test_statement_listeners_see_every_statement_of_a_drain(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _listened(engine)
    slots, lock, pinned = _claim_lock_sql(engine)
    assert slots in seen
    assert lock in seen or pinned in seen


def test_listeners_that_miss_the_cursor_path_are_caught(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """BROKEN: the cursor path taken although a listener watches."""
    monkeypatch.setattr(jobq, "_direct", lambda conn: True)
    seen = _listened(engine)
    slots, _lock, _pinned = _claim_lock_sql(engine)
    assert slots not in seen


_NO_TABLE = sa.select(sa.table("jobq_no_such_table", sa.column("x")).c.x).where(sa.literal_column("x") == sa.bindparam("b_x", type_=sa.Integer))


def _error_of(engine: sa.Engine) -> BaseException:
    with engine.connect() as conn:
        assert jobq._direct_form(conn.dialect, _NO_TABLE) is not None
        try:
            jobq._hot_rows(conn, _NO_TABLE, {"b_x": 1})
        except BaseException as exc:  # noqa: BLE001 - the test inspects what came out
            return exc
        finally:
            conn.rollback()
    raise AssertionError("a read of a missing table did not fail")


def test_a_database_error_on_the_cursor_is_a_sqlalchemy_error(engine: sa.Engine) -> None:
    exc = _error_of(engine)
    assert isinstance(exc, sa.exc.DBAPIError), repr(exc)
    assert isinstance(exc.orig, engine.dialect.loaded_dbapi.Error)
    assert "jobq_no_such_table" in (exc.statement or "")
    assert not exc.connection_invalidated


def test_a_raw_driver_error_is_caught(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """BROKEN: the driver's error passed on unwrapped."""

    def naive(conn: sa.Connection, form: Any, params: Any, rows: bool) -> Any:
        cur = conn.connection.cursor()
        values = form.compiled.construct_params(params)
        cur.execute(form.sql, values if form.order is None else tuple(values[k] for k in form.order))
        return cur.fetchall() if rows else cur.rowcount

    monkeypatch.setattr(jobq, "_on_cursor", naive)
    assert not isinstance(_error_of(engine), sa.exc.DBAPIError)


_KILL = {"postgresql": ("SELECT pg_backend_pid()", "SELECT pg_terminate_backend({})"),
         "mysql": ("SELECT CONNECTION_ID()", "KILL {}"), "mariadb": ("SELECT CONNECTION_ID()", "KILL {}")}


def _lost(engine: sa.Engine) -> tuple[BaseException, bool]:
    """Kill a connection's server session from another, then run a hot statement on it: what
    it raised, and whether the connection is invalidated."""
    own, kill = _KILL[engine.dialect.name]
    conn = engine.connect()
    try:
        pid = conn.exec_driver_sql(own).scalar()
        conn.commit()
        with engine.connect() as other:
            other.exec_driver_sql(kill.format(int(pid)))
            other.commit()
        try:
            conn.begin()
            jobq._hot_rows(conn, jobq._Q_SLOTS_IN_USE, {"b_now": dt.datetime(2026, 1, 1)})
        except BaseException as exc:  # noqa: BLE001 - the test inspects what came out
            return exc, conn.invalidated
        raise AssertionError("a statement on a killed session did not fail")
    finally:
        with contextlib.suppress(sa.exc.DBAPIError):  # a dead connection left valid fails its rollback
            conn.close()


@needs(no="local_clock")  # a server session to kill
def test_a_connection_lost_on_the_cursor_is_invalidated(engine: sa.Engine) -> None:
    exc, invalidated = _lost(engine)
    assert isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated, repr(exc)
    assert invalidated


@needs(no="local_clock")  # a server session to kill
def test_a_lost_connection_left_valid_is_caught(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """BROKEN: errors wrapped, but a disconnect not recognised (the pool would hand the dead
    connection out again, and _transaction would not know the transaction never committed)."""
    monkeypatch.setattr(engine.dialect, "is_disconnect", lambda *a, **k: False)
    exc, invalidated = _lost(engine)
    assert isinstance(exc, sa.exc.DBAPIError)
    assert not exc.connection_invalidated and not invalidated


_CREATED = sa.select(jobs.c.id, jobs.c.created_at, jobs.c.args).where(jobs.c.id == sa.bindparam("b_id", type_=sa.BigInteger))


def _both_ways(engine: sa.Engine) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    job_id = jobq.enqueue(engine, "t", args={"a": [1, "é"]})
    with engine.connect() as conn:
        direct = [tuple(r) for r in jobq._hot_rows(conn, _CREATED, {"b_id": job_id})]
        executed = [tuple(r) for r in conn.execute(_CREATED, {"b_id": job_id})]
        conn.rollback()
    return direct, executed


def test_values_come_back_as_the_column_types_say(engine: sa.Engine) -> None:
    direct, executed = _both_ways(engine)
    assert direct == executed
    assert isinstance(direct[0][1], dt.datetime) and direct[0][2] == {"a": [1, "é"]}


@only("sqlite")  # the one engine whose driver returns datetimes and JSON as text
def test_values_left_unconverted_are_caught(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """BROKEN: the rows as the driver returns them."""
    monkeypatch.setattr(jobq._Direct, "rows", lambda self, cur: cur.fetchall())
    direct, executed = _both_ways(engine)
    assert direct != executed and isinstance(direct[0][1], str)


# -- id lists written as literals (MySQL/MariaDB: d.literal_int_lists) ----------------------------

def _ids_read(engine: sa.Engine) -> sa.Select[Any]:
    d = jobq._prepare(engine)
    return sa.select(jobs.c.id).where(jobq._id_in(d, jobs.c.id, sa.bindparam("b_ids"))).order_by(jobs.c.id)


def _as_sent(engine: sa.Engine, stmt: Any, params: dict[str, Any]) -> tuple[str, str | None]:
    """The statement as the driver sends it, through SQLAlchemy's expansion and through the
    literal ids (None where the literal path declines the parameters)."""
    with engine.connect() as conn:
        form = jobq._direct_form(conn.dialect, stmt)
        assert form is not None and form.int_lists, "an id list that is not written as literals"
        cur = conn.connection.cursor()
        state = form.compiled.construct_expanded_state(params)
        expanded = cur.mogrify(state.statement, state.positional_parameters if form.order is not None else dict(state.parameters))
        literal = jobq._int_lists_sql(form, params)
        values = {k: v for k, v in form.compiled.construct_params(params).items() if k not in dict(form.int_lists)}
        if form.order is not None:  # positional (mysqlclient): the list's place is gone from the order
            assert form.literal_order is not None
            values = tuple(values[k] for k in form.literal_order)  # type: ignore[assignment]
        conn.rollback()
        return expanded, None if literal is None else cur.mogrify(literal, values)


@needs("literal_int_lists")  # the driver writes parameters into the SQL text
def test_an_id_list_goes_to_the_server_as_the_driver_would_write_it(engine: sa.Engine) -> None:
    d = jobq._prepare(engine)
    expanded, literal = _as_sent(engine, _ids_read(engine), {"b_ids": [30, 2, 11]})
    assert literal == expanded and "IN (30, 2, 11)" in literal
    # A hot statement with other parameters around the list: the same bytes too.
    now = dt.datetime(2026, 12, 4, 1, 2, 3, 456789)
    lease = {"b_ids": [5, 7], "b_owner": "w'1", "b_token": "t" * 32, "b_state": "running", "b_now": now, "b_expires": now}
    expanded, literal = _as_sent(engine, jobq._q_lease(d), lease)
    assert literal == expanded


@needs("literal_int_lists")
def test_a_list_that_is_not_all_ints_is_left_to_sqlalchemy(engine: sa.Engine) -> None:
    ids = [jobq.enqueue(engine, "t") for _ in range(3)]
    stmt = _ids_read(engine)
    for bad in (["0) OR (1=1"], [ids[0], "0) OR (1=1"], [True], [1.0], [], None):
        assert _as_sent(engine, stmt, {"b_ids": bad})[1] is None, bad
    with engine.connect() as conn:
        assert [r[0] for r in jobq._hot_rows(conn, stmt, {"b_ids": ["0) OR (1=1"]})] == []
        assert [r[0] for r in jobq._hot_rows(conn, stmt, {"b_ids": ids[:2]})] == ids[:2]
        conn.rollback()


@needs("literal_int_lists")
def test_a_list_written_without_checking_its_values_is_caught(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """BROKEN: every list written into the SQL text as it comes: a string in it is SQL."""

    def unchecked(form: Any, params: Any) -> str:
        sql = form.sql
        for name, mark in form.int_lists:
            sql = sql.replace(mark, ", ".join(map(str, params[name])))
        return sql

    ids = [jobq.enqueue(engine, "t") for _ in range(3)]
    monkeypatch.setattr(jobq, "_int_lists_sql", unchecked)
    with engine.connect() as conn:
        assert [r[0] for r in jobq._hot_rows(conn, _ids_read(engine), {"b_ids": ["0) OR (1=1"]})] == ids
        conn.rollback()


def _mogrify(sql: str, args: Any) -> str:
    """A format-paramstyle driver's interpolation (mysqlclient's, in small): each argument
    written as a literal in its place; too many or too few arguments raise TypeError."""
    def lit(v: Any) -> str:
        if isinstance(v, (int, float)):
            return str(v)
        return "'" + str(v).replace("\\", "\\\\").replace("'", "\\'") + "'"

    return sql % tuple(lit(v) for v in args)


def _positional_forms() -> tuple[Any, Any]:
    """The lease statement (a list among other parameters) compiled for mysqlclient's dialect,
    whose paramstyle is positional (``format``); no server or driver needed to compile it."""
    from sqlalchemy.dialects.mysql.mysqldb import MySQLDialect_mysqldb

    dialect = MySQLDialect_mysqldb()
    stmt = jobq._q_lease(jobq._capabilities("mysql", (8, 0)))
    form = jobq._direct_form(dialect, stmt)
    assert form is not None and form.order is not None and form.int_lists, "not a positional form with a literal list"
    return form, {"b_ids": [5, 7, 30], "b_owner": "w'1", "b_token": "t" * 32, "b_state": "running",
                  "b_now": 1, "b_expires": 2}


def _check_positional(form: Any, params: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    sql, args = jobq._statement_args(form, params)
    assert "IN (5, 7, 30)" in sql and isinstance(args, tuple)
    with monkeypatch.context() as m:
        m.setattr(form, "int_lists", ())  # SQLAlchemy's expansion: a placeholder per id
        expanded, expanded_args = jobq._statement_args(form, params)
    assert "IN (%s, %s, %s)" in expanded
    assert _mogrify(sql, args) == _mogrify(expanded, expanded_args)


def test_a_positional_driver_gets_the_same_statement_with_the_list_written_out(monkeypatch: pytest.MonkeyPatch) -> None:
    _check_positional(*_positional_forms(), monkeypatch)


def test_a_positional_order_that_keeps_the_lists_place_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """BROKEN: the list written into the SQL, its name left in the positional order."""
    form, params = _positional_forms()
    monkeypatch.setattr(form, "literal_order", form.order)
    with pytest.raises(KeyError):
        _check_positional(form, params, monkeypatch)


# ---- the switch and the check: Connection.execute whenever the cursor path is off --------------

_DRAIN_SCRIPT = """
import json, sys
import sqlalchemy as sa
import jobq
on_cursor, executed = [], []
real_cursor, real_execute = jobq._on_cursor, sa.Connection.execute
jobq._on_cursor = lambda conn, form, params, rows: on_cursor.append(1) or real_cursor(conn, form, params, rows)
sa.Connection.execute = lambda self, *a, **k: executed.append(1) or real_execute(self, *a, **k)
engine = sa.create_engine(sys.argv[1])
ids = [jobq.enqueue(engine, "t", group_key=f"g{i % 3}") for i in range(20)]
w = jobq.Worker(engine, {"t": lambda ctx: None}, max_concurrency=8, poll_interval=0.02)
assert w.run_until_idle(timeout=60)
states = sorted({jobq.get(engine, i).state for i in ids})
print(json.dumps({"switch": jobq._FASTPATH, "on_cursor": len(on_cursor), "executed": len(executed), "states": states}))
"""


def _drain_in_a_process(engine: sa.Engine, fastpath: str | None) -> dict[str, Any]:
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JOBQ_FASTPATH"}
    if fastpath is not None:
        env["JOBQ_FASTPATH"] = fastpath
    url = engine.url.render_as_string(hide_password=False)
    out = subprocess.run([sys.executable, "-c", _DRAIN_SCRIPT, url], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_jobq_fastpath_0_runs_a_drain_entirely_through_connection_execute(engine: sa.Engine) -> None:
    """JOBQ_FASTPATH=0, read at import: nothing runs on the cursor, every statement goes through
    Connection.execute, and the drain completes. The same drain without it (the contrast that
    makes this able to fail: a switch that is not read) does run statements on the cursor."""
    off = _drain_in_a_process(engine, "0")
    assert off["switch"] is False and off["on_cursor"] == 0 and off["executed"] > 20 and off["states"] == ["done"]
    on = _drain_in_a_process(engine, None)
    assert on["switch"] is True and on["on_cursor"] > 20 and on["states"] == ["done"]


def _drain_with_a_renamed_private_name(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> tuple[list[Any], list[str]]:
    """_drain on a fresh dialect whose compiled statements (as the check sees them) lack
    construct_expanded_state, as a SQLAlchemy that renamed it would: the statements that ran
    on the cursor and the warnings logged."""
    names = tuple("construct_expanded_state_renamed" if n == "construct_expanded_state" else n for n in jobq._COMPILED_NAMES)
    monkeypatch.setattr(jobq, "_COMPILED_NAMES", names)
    assert engine.dialect not in jobq._DIRECT  # a fresh engine: its dialect not yet checked
    caplog.set_level(logging.WARNING, logger="jobq")
    seen = _on_cursor_calls(engine, monkeypatch)
    warned = [r.getMessage() for r in caplog.records if r.name == "jobq" and "run through Connection.execute" in r.getMessage()]
    return seen, warned


def test_a_sqlalchemy_without_an_expected_private_name_falls_back_to_connection_execute(
        engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    assert jobq._fastpath_unsound(engine.dialect) is None  # this SQLAlchemy is the one it was written for
    seen, warned = _drain_with_a_renamed_private_name(engine, monkeypatch, caplog)
    assert seen == []  # _drain checked every job done once, through Connection.execute
    assert len(warned) == 1 and "construct_expanded_state_renamed" in warned[0], warned


def test_a_check_that_does_not_fall_back_is_caught(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """BROKEN: the check passes whatever it finds: statements still go to the cursor, unwarned."""
    monkeypatch.setattr(jobq, "_fastpath_unsound", lambda dialect: None)
    seen, warned = _drain_with_a_renamed_private_name(engine, monkeypatch, caplog)
    assert seen and warned == []

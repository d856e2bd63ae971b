"""The database goes away or pushes back: workers log, back off, reconnect and carry on; no
job is lost or completed twice; deadlocks and lock timeouts roll back and retry the unit."""

from __future__ import annotations

import os
import pathlib
import sqlite3
import subprocess
import threading
import time

import pytest
import sqlalchemy as sa

import jobq
from dbs import needs, only
from helpers import META, REPORT, wait_for
from procs import events, executions, finalized, start

jobs = jobq.Job.__table__


def _kill_connections(engine: sa.Engine) -> int:
    """Cut every other client connection to the test database, as a failover or restart would."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            n = conn.execute(sa.text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = 'jobq-crash-worker'"
            )).scalar_one()
        else:
            ids = conn.execute(sa.text(
                "SELECT id FROM information_schema.processlist WHERE id <> CONNECTION_ID() AND db = DATABASE()"
            )).scalars().all()
            n = 0
            for i in ids:
                try:
                    conn.exec_driver_sql(f"KILL CONNECTION {int(i)}")
                    n += 1
                except sa.exc.DBAPIError:
                    pass  # it went away by itself
        conn.commit()
    return n


def _hold_sqlite_lock(url: str, seconds: float) -> int:
    """SQLite has no server to restart: hold its write lock longer than jobq's retries last."""
    c = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
    c.execute("BEGIN IMMEDIATE")
    time.sleep(seconds)
    c.rollback()
    c.close()
    return 1


def _assert_each_done_once(engine: sa.Engine, ids: list[int], logdir: pathlib.Path) -> None:
    """Every job in ``ids`` is done, and the worker logged no job's finalize commit twice."""
    with engine.connect() as conn:
        states = dict(conn.execute(sa.select(jobs.c.id, jobs.c.state)).all())
    assert [i for i in ids if states[i] != "done"] == [], "a job was lost"
    assert [i for i, n in finalized(logdir).items() if n > 1] == [], "a job was finalized twice"


def test_workers_survive_connections_being_cut_mid_run(engine: sa.Engine, db_url: str, tmp_path: pathlib.Path) -> None:
    """A worker process drains 200 jobs while its connections are cut at least five times
    (pg_terminate_backend / KILL CONNECTION; on SQLite the write lock is held past every retry).
    Correct: the process reruns each transaction that lost its connection before COMMIT (or
    logs db_error and backs off), finishes with exit 0; every job done, no job finalized twice.
    A bug shows as a worker that died of a cut (non-zero exit), a job not done (lost), or a
    second finalize line for one job (completed twice)."""
    with engine.begin() as conn:
        # 200 x 50 ms over 3 slots is >= 3.3 s of work: long enough for five cuts to land
        # before the queue drains (the cut loop below does not rely on that alone).
        ids = [jobq.enqueue(conn, "work", {"sleep": 0.05}, max_attempts=10) for _ in range(200)]
    admin = sa.create_engine(db_url)
    # Without pool_pre_ping the dead connections surface as errors in the worker's own
    # transactions (with it, the pool would quietly replace most of them).
    p = start(db_url, tmp_path, "--concurrency", "3", "--ttl", "2.0", "--until-idle", "90", "--no-pre-ping")
    cuts = killed = 0
    try:
        # Keep cutting until five cuts hit at least one of the worker's connections (a cut
        # that lands while the worker is between connections kills nothing and is not counted).
        ran = 0
        for _ in range(40):
            if cuts >= 5 or p.poll() is not None:
                break
            # Cut a worker that is working: wait until it has started a job since the last cut.
            wait_for(lambda ran=ran: p.poll() is not None or sum(executions(tmp_path).values()) > ran, timeout=60,
                     what="the worker to start a job since the last cut")
            ran = sum(executions(tmp_path).values())
            n = _hold_sqlite_lock(db_url, 1.8) if db_url.startswith("sqlite") else _kill_connections(admin)
            cuts += n > 0
            killed += n
        assert p.wait(120) == 0, (tmp_path / "stderr.log").read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
        admin.dispose()
    _assert_each_done_once(engine, ids, tmp_path)
    assert cuts >= 3, "the worker's connections were not cut: the test proved nothing"
    # Whether a cut surfaces as an error depends on timing (a cut before COMMIT is rerun on a
    # fresh connection; one during COMMIT, or on SQLite, is an error); report it, not require it.
    errors = sum(1 for a, _ in events(tmp_path) if a == "db_error")
    REPORT.append(f"connection cuts {db_url.split(':')[0]}: {cuts} cuts ({killed} worker connections), {errors} db_error events, "
                  f"{len(ids)} jobs done once")


ROOT = pathlib.Path(__file__).resolve().parents[2]


@needs(no="local_clock")  # a server to cut
def test_a_cut_while_jobq_first_connects_to_a_server_is_retried(engine: sa.Engine, db_url: str) -> None:
    """The first thing jobq does with a new engine (Worker(), or any queue call) is connect once
    to learn the server's version. A cut that lands on that connection is retried on a fresh
    one, like any transaction's first connect; before, it raised out of Worker() and the
    worker process died (CI caught it on MariaDB: 'Lost connection ... SELECT
    @@lower_case_table_names'). Each round: a fresh engine whose first connection a killer
    cuts as soon as it appears. Correct: every round prepares the engine. A bug shows as the
    driver's error raised out of the first connect in a round where the cut landed."""
    connect_args = {"application_name": "jobq-crash-worker"} if engine.dialect.name == "postgresql" else {}
    admin = sa.create_engine(db_url)
    landed = rounds = 0
    failures: list[str] = []
    while landed < 3 and rounds < 30:
        rounds += 1
        fresh = sa.create_engine(db_url, connect_args=connect_args)
        done = threading.Event()
        cut: list[int] = []

        def killer(done: threading.Event = done, cut: list[int] = cut) -> None:
            while not done.is_set() and not cut:
                if _kill_connections(admin):
                    cut.append(1)

        t = threading.Thread(target=killer)
        t.start()
        try:
            jobq._prepare(fresh)
        except sa.exc.DBAPIError as exc:
            failures.append(str(exc.orig))
        finally:
            done.set()
            t.join()
            fresh.dispose()
        landed += bool(cut)
    admin.dispose()
    assert landed >= 1, f"no cut landed in {rounds} rounds: the test proved nothing"
    assert failures == [], failures


@needs(no="local_clock")  # a server to cut
@pytest.mark.parametrize("cut_after", ["commit", "rollback"])
def test_a_cut_after_commit_loses_neither_the_result_nor_a_pool_slot(engine: sa.Engine, db_url: str,
                                                                     cut_after: str) -> None:
    """A connection cut after a jobq transaction committed, before the connection is back in
    the pool. CI caught a worker dying of this on MariaDB: jobq set READ COMMITTED on the
    session, so the pool rolled back and then undid the setting on checkin, the second round
    trip outside any error handling; a cut between the two raised the driver's raw 'Lost
    connection' out of close(), after the commit, losing the result and leaking the pool slot.
    Now the level is set for the transaction only. Each round commits an enqueue and has the
    server kill the connection right after the COMMIT (or right after a rollback on return to
    the pool, where there is one). Correct: the job id comes back, the job is in the table,
    and a pool of one connection still serves the next round, on a fresh connection when the
    pooled one is dead (a transaction that lost its connection before COMMIT is rerun).
    Fails on the session-level setting on MySQL and MariaDB (cut after rollback) and on
    PostgreSQL (the next round's dead pooled connection, cut after commit)."""
    fresh = sa.create_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=5)
    admin = sa.create_engine(db_url, isolation_level="AUTOCOMMIT")
    pg = engine.dialect.name == "postgresql"
    server_id: list[int] = []
    cuts: list[int] = []

    def alive(conn: sa.Connection, sid: int) -> bool:
        q = ("SELECT count(*) FROM pg_stat_activity WHERE pid = :i" if pg
             else "SELECT count(*) FROM information_schema.processlist WHERE id = :i")
        return bool(conn.execute(sa.text(q), {"i": sid}).scalar_one())

    def then_cut(real):  # type: ignore[no-untyped-def]
        def call(dbapi_conn) -> None:  # type: ignore[no-untyped-def]
            real(dbapi_conn)
            if not server_id or server_id[-1] in cuts:
                return
            with admin.connect() as conn:
                conn.execute(sa.text("SELECT pg_terminate_backend(:i)" if pg else f"KILL CONNECTION {server_id[-1]}"),
                             {"i": server_id[-1]})
                wait_for(lambda: not alive(conn, server_id[-1]), timeout=10, what="the cut connection to go away")
            cuts.append(server_id[-1])
        return call

    def enqueue_and_note_connection(conn: sa.Connection, d: jobq._Dialect) -> int:
        server_id.append(conn.exec_driver_sql("SELECT pg_backend_pid()" if pg else "SELECT CONNECTION_ID()").scalar_one())
        return jobq.enqueue(conn, "cut_after_commit")

    jobq._prepare(fresh)
    name = "do_commit" if cut_after == "commit" else "do_rollback"
    setattr(fresh.dialect, name, then_cut(getattr(fresh.dialect, name)))
    try:
        ids = [jobq._transaction(fresh, enqueue_and_note_connection) for _ in range(3)]
    finally:
        fresh.dispose()
        admin.dispose()
    REPORT.append(f"cut after {cut_after} {engine.dialect.name}: {len(cuts)} of 3 rounds cut, 3 results kept")
    assert [jobq.get(engine, i).type for i in ids] == ["cut_after_commit"] * 3
    if cut_after == "commit":
        assert len(cuts) == 3  # every round's connection was cut, and the pool still served the next


def _answers(ping: list[str]) -> bool:
    return subprocess.run(ping, capture_output=True, timeout=30).returncode == 0


def _server_control(dialect: str, db_url: str) -> tuple[list[str], list[str], list[str]] | None:
    """(stop, start, ping) commands for the local server behind ``db_url``, if this machine
    runs it as CI does (root, PostgreSQL by pg_ctlcluster, MariaDB by start-stop-daemon,
    MySQL by .ci/mysql-server.sh); None otherwise."""
    import shutil

    url = sa.engine.make_url(db_url)
    if os.geteuid() != 0 or url.host not in ("127.0.0.1", "localhost"):
        return None
    if dialect == "postgresql":
        etc = pathlib.Path("/etc/postgresql")
        versions = sorted(v.name for v in etc.iterdir() if (v / "main").is_dir()) if etc.is_dir() else []
        if not shutil.which("pg_ctlcluster") or not versions:
            return None
        ctl = ["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1], "main"]
        return [*ctl, "stop", "-m", "fast"], [*ctl, "start"], ["pg_isready", "-q", "-h", "127.0.0.1", "-p", str(url.port or 5432)]
    client = ["mariadb-admin", "--protocol=tcp", "-h127.0.0.1", f"-P{url.port or 3306}", "-uroot"]
    if not shutil.which("mariadb-admin") or url.username != "root" or url.password:
        return None
    if dialect == "mariadb" and (url.port or 3306) == 3306 and pathlib.Path("/usr/sbin/mariadbd").exists():
        # The system server is the mariadbd of Debian's pid file: without --pidfile any mariadbd
        # (cluster-mariadb's own, beside this suite in CI) passes for it and nothing is started.
        start = ["start-stop-daemon", "--start", "--oknodo", "--background", "--pidfile", "/run/mysqld/mysqld.pid",
                 "--exec", "/usr/sbin/mariadbd"]
        return [*client, "shutdown"], start, [*client, "ping"]
    chroot = pathlib.Path(os.environ.get("JOBQ_MYSQL_CHROOT", "/var/lib/jobq-mysql/chroot"))
    if dialect == "mysql" and url.port == 3307 and (chroot / "usr/sbin/mysqld").exists():
        script = ["bash", str(ROOT / ".ci" / "mysql-server.sh")]
        return [*script, "stop"], [*script, "start"], [*client, "ping"]
    return None


@needs(no="local_clock")  # a server to restart
def test_workers_survive_a_server_restart_with_connections_refused(engine: sa.Engine, db_url: str, dialect: str,
                                                                   tmp_path: pathlib.Path) -> None:
    """The database server is shut down mid-run (every connection dies), stays down for two
    seconds (new connections are refused), and starts again. Correct: the worker logs
    db_error, backs off, reconnects and finishes with exit 0; every job done, none finalized
    twice. A bug shows as a worker that exits non-zero (or never notices: no db_error), a job
    not done, or one finalized twice. Needs the local server run as in CI (root; pg_ctlcluster,
    start-stop-daemon mariadbd, .ci/mysql-server.sh). Connection cuts without a restart are
    the test above, on every engine."""
    control = _server_control(dialect, db_url)
    if control is None:
        pytest.skip(f"needs a local {dialect} server that this test may stop and start, run as root (as in CI)")
    stop, start_server, ping = control
    # The first job runs until the gate opens, after the restart: the worker cannot finish
    # while the server is down, however long the server takes to stop. The others (50 ms each,
    # on the other two slots) keep outcomes and their commits in flight when it goes.
    gate = tmp_path / "gate"
    with engine.begin() as conn:
        ids = [jobq.enqueue(conn, "work", {"gate": str(gate)}, max_attempts=10)]
        ids += [jobq.enqueue(conn, "work", {"sleep": 0.05}, max_attempts=10) for _ in range(199)]
    engine.dispose()
    p = start(db_url, tmp_path, "--concurrency", "3", "--ttl", "3.0", "--until-idle", "180")
    try:
        wait_for(lambda: p.poll() is not None or any(tmp_path.glob("started-*")), timeout=60,
                 what="the worker to start a job")
        assert p.poll() is None, (tmp_path / "stderr.log").read_text()[-3000:]
        subprocess.run(stop, check=True, timeout=120, capture_output=True)
        wait_for(lambda: not _answers(ping), 60, 0.25, f"{dialect} to stop")
        time.sleep(2.0)  # down: connections refused
        assert p.poll() is None, (tmp_path / "stderr.log").read_text()[-3000:]
    finally:
        subprocess.run(start_server, check=True, timeout=300, capture_output=True)
        wait_for(lambda: _answers(ping), 120, 0.25, f"{dialect} to come back")
        gate.touch()
    try:
        assert p.wait(180) == 0, (tmp_path / "stderr.log").read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    engine.dispose()  # the pool's connections died with the server
    _assert_each_done_once(engine, ids, tmp_path)
    errors = sum(1 for a, _ in events(tmp_path) if a == "db_error")
    assert errors >= 1, "the worker never noticed the server was gone"
    REPORT.append(f"server restart {dialect}: down 2 s, {errors} db_error events, {len(ids)} jobs done once")


@only("mysql", "mariadb")  # error 1205: InnoDB rolls back only the statement, jobq the whole unit
def test_lock_wait_timeout_in_the_claim_is_retried_whole(engine: sa.Engine) -> None:
    """Another session holds the claim lock past innodb_lock_wait_timeout=1: the claim gets
    1205, rolls back entirely and retries until the lock is free. No partial claim commits. A
    bug shows as the 1205 error raised to the caller, or as more than one attempt charged to
    the job (a partial claim committed before the retry)."""
    sa.event.listen(engine, "connect", lambda dbapi, rec: dbapi.cursor().execute("SET SESSION innodb_lock_wait_timeout = 1"))
    jid = jobq.enqueue(engine, "t")
    blocker = engine.connect()
    blocker.execute(sa.select(META).where(META.c.key == "claim_lock").with_for_update()).all()
    threading.Timer(2.5, blocker.rollback).start()
    t0 = time.monotonic()
    leases = jobq.claim_batch(engine, "w", 30, max_in_flight=2)
    waited = time.monotonic() - t0
    blocker.close()
    assert [l.id for l in leases] == [jid]
    assert waited >= 2.0  # it hit at least one lock wait timeout and retried
    info = jobq.get(engine, jid)
    assert info is not None and info.attempts == 1  # one claim, not one per try


@needs("row_locks")
def test_real_deadlocks_are_classified_retryable(engine: sa.Engine) -> None:
    """Two sessions lock two rows in opposite order; the server kills one with a deadlock error
    (40P01 / 1213). jobq must classify exactly that error as retryable, and not an integrity
    error. A bug shows as a real deadlock that jobq would raise instead of rerunning."""
    a_id = jobq.enqueue(engine, "t")
    b_id = jobq.enqueue(engine, "t")
    d = jobq._prepare(engine)
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def session(first: int, second: int) -> None:
        with engine.connect() as conn:
            conn.execution_options(isolation_level="READ COMMITTED")
            try:
                with conn.begin():
                    conn.execute(sa.update(jobs).where(jobs.c.id == first).values(weight=2))
                    barrier.wait(10)
                    conn.execute(sa.update(jobs).where(jobs.c.id == second).values(weight=3))
            except sa.exc.DBAPIError as exc:
                errors.append(exc)

    ts = [threading.Thread(target=session, args=ab) for ab in ((a_id, b_id), (b_id, a_id))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert len(errors) == 1
    assert d.retryable(errors[0])
    assert not d.retryable(sa.exc.IntegrityError("x", {}, Exception("duplicate key")))


@only("sqlite")  # servers: see the lock-wait-timeout test
def test_claim_retry_gives_up_cleanly_when_the_database_stays_locked(engine: sa.Engine, db_url: str) -> None:
    """A database that never frees its lock: the error surfaces after bounded retries (no hot
    loop, no endless wait) and the queue is unchanged. A bug shows as more than TX_RETRIES
    retries (the pause before the one too many raises), a retry without a pause before it
    (transactions begun against pauses taken), or a job that is no longer claimable once the
    lock is freed."""
    jobq.enqueue(engine, "t")
    c = sqlite3.connect(db_url.removeprefix("sqlite:///"), isolation_level=None)
    c.execute("BEGIN IMMEDIATE")
    old, pause = jobq.SQLITE_BUSY_TIMEOUT_MS, jobq._pause_for
    pauses: list[float] = []
    begins: list[int] = []

    def counted(engine: sa.Engine, seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) > jobq.TX_RETRIES:
            raise AssertionError(f"a retry past TX_RETRIES={jobq.TX_RETRIES}")
        pause(engine, seconds)

    fresh = sa.create_engine(db_url)
    sa.event.listen(fresh, "begin", lambda conn: begins.append(1))
    try:
        jobq.SQLITE_BUSY_TIMEOUT_MS = 10
        jobq._pause_for = counted  # type: ignore[assignment]
        with pytest.raises(sa.exc.OperationalError):
            jobq.claim(fresh, "w", 30)
        assert pauses and min(pauses) > 0, pauses
        assert len(begins) == len(pauses) + 1, (len(begins), pauses)  # a pause before every retry
    finally:
        jobq._pause_for = pause  # type: ignore[assignment]
        jobq.SQLITE_BUSY_TIMEOUT_MS = old
        c.rollback()
        c.close()
    assert jobq.claim(engine, "w", 30) is not None

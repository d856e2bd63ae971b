"""Engine-specific claim properties: READ COMMITTED on MySQL/MariaDB, BEGIN IMMEDIATE and
SQLITE_BUSY on SQLite, and workers with different handler sets sharing one database."""

from __future__ import annotations

import contextlib
import os
import pathlib
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import pytest
import sqlalchemy as sa

import jobq
from dbs import only


def _claim_after_snapshot(engine: sa.Engine, isolation: str | None) -> list[int]:
    """Open a claim transaction, read once (a REPEATABLE READ snapshot would start here), let
    another connection commit a new ready job, then run the claim in the same transaction.
    ``isolation`` overrides jobq's level (the broken variant); None runs jobq's own transaction."""
    other = sa.create_engine(engine.url)

    def run(conn: sa.Connection, d: jobq._Dialect) -> list[int]:
        conn.execute(sa.select(sa.func.count()).select_from(jobq.Job.__table__)).scalar_one()
        jobq.enqueue(other, "late")  # commits on its own connection
        leases = jobq._lease_rows(conn, d, worker_id="w", ttl=30, now=d.db_now(conn), limit=5, types=None,
                                  max_in_flight=5, group_caps=None, state="leased")
        return [l.id for l in leases]

    try:
        if isolation is None:
            return jobq._transaction(engine, run)
        d = jobq._prepare(engine)
        with engine.connect() as conn:
            conn.execution_options(isolation_level=isolation)
            with conn.begin():
                return run(conn, d)
    finally:
        other.dispose()


@only("mysql", "mariadb")  # REPEATABLE READ is their default; PostgreSQL's is READ COMMITTED
def test_claim_sees_jobs_committed_after_its_transaction_began(engine: sa.Engine) -> None:
    """jobq's claim runs at READ COMMITTED, so a job committed after the claim transaction's
    first read is still claimed. The same steps at REPEATABLE READ (MySQL's default) miss it:
    that broken variant is run too, to show the test can tell them apart."""
    assert len(_claim_after_snapshot(engine, None)) == 1
    jobq.enqueue(engine, "filler")  # leave one ready job so the broken run has something to see
    with engine.begin() as conn:
        conn.execute(sa.update(jobq.Job.__table__).values(state="done", in_flight=False))
    assert _claim_after_snapshot(engine, "REPEATABLE READ") == []


@only("mysql", "mariadb")  # MySQL/MariaDB's session variables and default level
def test_jobq_sets_its_isolation_level_per_transaction_only(engine: sa.Engine) -> None:
    """READ COMMITTED is set for each jobq transaction alone (SET TRANSACTION, whose effect the
    test above shows); the session keeps the server's default, inside jobq's transaction and
    after it. So nothing has to be undone when the connection goes back to the pool, where a
    cut would raise out of close() (see tests/crash, test_a_cut_after_commit_...)."""
    var = "@@transaction_isolation" if jobq._prepare(engine).family == "mysql" else "@@tx_isolation"
    level = jobq._transaction(engine, lambda conn, d: conn.exec_driver_sql(f"SELECT {var}").scalar_one())
    assert level == "REPEATABLE-READ"  # the session's level; this transaction's is READ COMMITTED
    with engine.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT {var}").scalar_one() == "REPEATABLE-READ"


def _hold_claim_open(url: str, immediate: bool, inside: threading.Event, release: threading.Event) -> threading.Thread:
    eng = sa.create_engine(url)

    def run(conn: sa.Connection, d: jobq._Dialect) -> None:
        conn.execute(sa.select(sa.func.count()).select_from(jobq.Job.__table__)).scalar_one()
        inside.set()
        release.wait(60)  # past every window a test gives a claim that gets through meanwhile

    t = threading.Thread(target=lambda: (jobq._transaction(eng, run, immediate=immediate), eng.dispose()))
    t.start()
    return t


@only("sqlite")  # SQLite's BEGIN IMMEDIATE and its lock file
@pytest.mark.parametrize("immediate", [True, False], ids=["begin-immediate", "BROKEN-deferred-begin"])
def test_two_connections_are_never_inside_the_claim_at_once(db_url: str, dialect: str, immediate: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """With BEGIN IMMEDIATE the first claim transaction holds SQLite's write lock from its first
    statement, so a second connection's claim waits until it commits. The broken variant (a
    deferred BEGIN, as pysqlite would issue) lets the second claim through: the test sees that.
    jobq's lock file (a speed-up that also serialises its own transactions) is switched off
    here, so SQLite's lock alone is tested."""
    monkeypatch.setattr(jobq, "_sqlite_lockfile", lambda engine: None)
    jobq.create_schema(sa.create_engine(db_url))
    jobq.enqueue(sa.create_engine(db_url), "t")
    inside, release = threading.Event(), threading.Event()
    holder = _hold_claim_open(db_url, immediate, inside, release)
    assert inside.wait(10)
    other = sa.create_engine(db_url)  # its own engine: only SQLite's lock stands between them
    done = threading.Event()
    claimer = threading.Thread(target=lambda: (jobq.claim(other, "w2", 30), done.set()))
    claimer.start()
    # Correct: the claim must not get through while the holder is inside; half a second of not
    # getting through shows it waits (a slow machine can only make that look longer). Broken:
    # it gets through with the holder still inside, however slow the machine; give it time.
    entered_together = done.wait(0.5 if immediate else 30)
    release.set()
    holder.join(10)
    claimer.join(30)
    other.dispose()
    assert done.is_set()
    assert entered_together is (not immediate)


@only("sqlite")  # SQLITE_BUSY and busy_timeout are SQLite's
def test_sqlite_busy_is_retried_and_the_connection_stays_usable(db_url: str, dialect: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write lock held longer than busy_timeout makes SQLite answer SQLITE_BUSY; the claim
    retries the whole transaction instead of crashing or losing the job (and the pooled
    connection is usable afterwards, sqlalchemy#5034)."""
    monkeypatch.setattr(jobq, "SQLITE_BUSY_TIMEOUT_MS", 20)
    eng = sa.create_engine(db_url)
    jid = jobq.enqueue(eng, "t")
    path = db_url.removeprefix("sqlite:///")
    blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    blocker.execute("BEGIN IMMEDIATE")
    pause, pauses = jobq._pause_for, []

    def released_at_the_first_retry(engine: sa.Engine, seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 1:
            blocker.rollback()  # the lock goes while the claim backs off (a timer could be late)
        pause(engine, seconds)

    monkeypatch.setattr(jobq, "_pause_for", released_at_the_first_retry)
    assert jobq.claim(eng, "w", 30) == jid
    assert len(pauses) == 1  # it met the lock, backed off, and the retry went through
    blocker.execute("BEGIN IMMEDIATE")  # now longer than every retry: the error surfaces...
    with pytest.raises(sa.exc.OperationalError, match="locked"):
        jobq.claim(eng, "w", 30)
    blocker.rollback()
    blocker.close()
    jid2 = jobq.enqueue(eng, "t")  # ...and the pool still works, nothing was lost
    assert jobq.claim(eng, "w", 30) == jid2
    eng.dispose()


def test_workers_with_different_handler_sets_claim_only_their_types(engine: sa.Engine) -> None:
    ran: list[tuple[str, str]] = []
    lock = threading.Lock()

    def handler(name: str):
        def run(ctx: jobq.JobContext) -> dict:
            with lock:
                ran.append((name, ctx.type))
            time.sleep(0.005)
            return {}

        return run

    for i in range(60):
        jobq.enqueue(engine, ["a", "b", "c"][i % 3])
    w1 = jobq.Worker(engine, {"a": handler("w1"), "c": handler("w1")}, max_concurrency=4, poll_interval=0.02)
    w2 = jobq.Worker(engine, {"b": handler("w2")}, max_concurrency=4, poll_interval=0.02)
    results: list[bool] = []
    ts = [threading.Thread(target=lambda w=w: results.append(w.run_until_idle(timeout=60))) for w in (w1, w2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert results == [True, True]
    assert {t for n, t in ran if n == "w1"} == {"a", "c"}
    assert {t for n, t in ran if n == "w2"} == {"b"}
    assert len(ran) == 60


@only("sqlite")  # the lock file is the SQLite driver's own
def test_a_stuck_holder_of_the_lock_file_cannot_hang_other_processes(db_url: str, dialect: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """jobq's transactions on SQLite first take `<db>-jobq.lock` (processes then hand the write
    lock over at once instead of polling in SQLite's busy handler). A holder that stops while
    holding it (SIGSTOP, a debugger) must not hang everyone: after the busy timeout the claim
    goes on under SQLite's own lock, as without the file. The wait is bounded by the busy
    timeout in force, not a default (each wait on the wake-up pipe asks for no more than it),
    and lasts at least that long."""
    import fcntl

    monkeypatch.setattr(jobq, "SQLITE_BUSY_TIMEOUT_MS", 300)
    monkeypatch.setattr(jobq, "_WAKE_POLL_S", 60.0)  # so only the deadline can bound a wait
    asked: list[float] = []
    _on_each_wait(monkeypatch, asked.append)
    eng = sa.create_engine(db_url)
    jid = jobq.enqueue(eng, "t")
    path = db_url.removeprefix("sqlite:///") + "-jobq.lock"
    held = open(path, "a+b")  # another open file description: conflicts like another process
    fcntl.flock(held, fcntl.LOCK_EX)
    t0 = time.monotonic()
    assert jobq.claim(eng, "w", 30) == jid
    waited = time.monotonic() - t0
    held.close()
    eng.dispose()
    # It waited for the file, each wait within the 0.3 s deadline, and went on while the file
    # was still held. No timed upper bound: a claim that hung on the file never returns, which
    # the suite's per-test timeout (pyproject.toml) reports.
    assert asked and max(asked) <= 300, asked
    assert waited >= 0.25


def _on_each_wait(monkeypatch: pytest.MonkeyPatch, seen: Callable[[float], None]) -> None:
    """Call ``seen(timeout in ms)`` each time a jobq transaction waits on the lock file's
    wake-up pipe (select.poll's poll, wrapped), before the wait."""
    import select

    real = select.poll

    class Watched:
        def __init__(self) -> None:
            self.poller = real()

        def register(self, *args: int) -> None:
            self.poller.register(*args)

        def poll(self, timeout: float) -> list[tuple[int, int]]:
            seen(timeout)
            return self.poller.poll(timeout)

    monkeypatch.setattr(select, "poll", Watched)


def _watch_the_wait(monkeypatch: pytest.MonkeyPatch, nth: int = 1) -> threading.Event:
    """An event set when a jobq transaction waits on the lock file's wake-up pipe for the
    ``nth`` time: the first wait, or (2) the first after the waiter's first look at the pipe,
    and its read, are over."""
    waiting, calls = threading.Event(), [0]

    def seen(timeout: float) -> None:
        calls[0] += 1
        if calls[0] >= nth:
            waiting.set()

    _on_each_wait(monkeypatch, seen)
    return waiting


@only("sqlite")  # the lock file is the SQLite driver's own
@pytest.mark.parametrize("wake", [True, False], ids=["wake-up", "BROKEN-no-wake-up"])
def test_a_process_waiting_for_the_lock_file_is_woken_as_it_is_let_go(db_url: str, dialect: str, wake: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A jobq transaction that finds `<db>-jobq.lock` taken waits on the pipe `<db>-jobq.wake`,
    which the holder writes to as it lets go: the waiter goes on then, not at its next look.
    The longest wait on the pipe is set to a minute here, so a waiter nobody wakes is still
    waiting when the test looks. The broken variant (the holder lets go without writing) shows
    that the test sees it."""

    monkeypatch.setattr(jobq, "_WAKE_POLL_S", 60.0)
    monkeypatch.setattr(jobq, "SQLITE_BUSY_TIMEOUT_MS", 120_000)  # no giving up on the file meanwhile
    if not wake:
        monkeypatch.setattr(jobq, "_wake", lambda fd: None)
    jid = jobq.enqueue(sa.create_engine(db_url), "t")
    inside, release = threading.Event(), threading.Event()
    holder = _hold_claim_open(db_url, True, inside, release)  # its own engine: its own open file, as another process
    assert inside.wait(10)
    eng = sa.create_engine(db_url)
    files = jobq._sqlite_lockfile(eng)
    assert files is not None and files[1] is not None
    pipe = files[1]
    with contextlib.suppress(BlockingIOError):
        os.read(pipe, 65536)  # the bytes of the commits above: none is left to wake the waiter early
    waiting = _watch_the_wait(monkeypatch)
    done, got = threading.Event(), []
    claimer = threading.Thread(target=lambda: (got.append(jobq.claim(eng, "w2", 30)), done.set()))
    claimer.start()
    try:
        assert waiting.wait(10), "the second claim never waited for the lock file"
        release.set()
        holder.join(10)
        if wake:
            assert done.wait(30), "the waiter was not woken when the holder let the lock file go"
        else:
            assert not done.wait(1.0), "the waiter went on with nothing to wake it: the test cannot see a lost wake-up"
            os.write(pipe, b"\0")  # the wake-up the broken holder left out
            assert done.wait(30)
        assert got == [jid]
    finally:
        release.set()
        claimer.join(10)
        eng.dispose()


@only("sqlite")  # the wake pipe beside the database file is the SQLite driver's own
def test_something_other_than_a_pipe_where_the_wake_pipe_goes_is_left_alone(dialect: str, tmp_path: pathlib.Path) -> None:
    """A regular file at `<db>-jobq.wake` (it would read as always ready: a busy loop) is not
    used or touched: jobq polls the lock file instead, and claims as before."""
    path = tmp_path / "jobq.db"
    (tmp_path / "jobq.db-jobq.wake").write_text("mine")
    eng = sa.create_engine(f"sqlite:///{path}")
    jobq.create_schema(eng)
    jid = jobq.enqueue(eng, "t")
    files = jobq._sqlite_lockfile(eng)
    assert files is not None and files[1] is None
    assert jobq.claim(eng, "w", 30) == jid
    assert (tmp_path / "jobq.db-jobq.wake").read_text() == "mine"
    eng.dispose()


@only("sqlite")  # the lock file is the SQLite driver's own
def test_the_wait_for_the_lock_file_works_with_a_pipe_past_descriptor_1023(db_url: str, dialect: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A process with many files open (a server's sockets) gets a pipe descriptor past 1023,
    out of select()'s range (ValueError): the waiter polls instead, and the hand-over works."""
    import fcntl
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"the test needs 1100 open files; this machine's hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    eng = sa.create_engine(db_url)
    try:
        files = jobq._sqlite_lockfile(eng)
        assert files is not None and files[1] is not None
        fd, pipe = files
        high = fcntl.fcntl(pipe, fcntl.F_DUPFD_CLOEXEC, 1050)
        assert high >= 1024
        other = os.open(db_url.removeprefix("sqlite:///") + "-jobq.lock", os.O_RDWR)  # as another process
        fcntl.flock(other, fcntl.LOCK_EX)
        waiting, got = _watch_the_wait(monkeypatch), []

        def wait() -> None:
            try:
                got.append(jobq._flock(fd, high))
            except BaseException as exc:  # noqa: BLE001 - what the test reports
                got.append(exc)
                waiting.set()

        waiter = threading.Thread(target=wait)
        waiter.start()
        assert waiting.wait(30)  # it found the file taken, and waits (or failed to)
        fcntl.flock(other, fcntl.LOCK_UN)
        jobq._wake(high)
        waiter.join(30)
        assert got == [True]
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(other)
        os.close(high)
    finally:
        eng.dispose()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@only("sqlite")  # the lock file's wake pipe is the SQLite driver's own
def test_a_waiter_empties_the_pipe_of_bytes_nobody_waited_for(db_url: str, dialect: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Every release writes a byte, and while nobody waits they pile up in the pipe. A waiter
    reads them all at its first look: left there, they would make every later wait return at
    once, a busy loop for as long as the file is held."""
    import fcntl

    eng = sa.create_engine(db_url)
    files = jobq._sqlite_lockfile(eng)
    assert files is not None and files[1] is not None
    fd, pipe = files
    path = db_url.removeprefix("sqlite:///")
    probe = os.open(path + "-jobq.wake", os.O_RDWR | os.O_NONBLOCK)  # the same pipe, as another process
    os.write(probe, b"\0" * 5000)  # releases nobody waited for
    other = os.open(path + "-jobq.lock", os.O_RDWR)
    fcntl.flock(other, fcntl.LOCK_EX)
    second = _watch_the_wait(monkeypatch, nth=2)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(jobq._flock(fd, pipe)))
    waiter.start()
    try:
        assert second.wait(30)
        with pytest.raises(BlockingIOError):
            os.read(probe, 65536)  # empty: the waiter read what had piled up
    finally:
        fcntl.flock(other, fcntl.LOCK_UN)
        jobq._wake(probe)
        waiter.join(30)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(other)
        os.close(probe)
        eng.dispose()
    assert got == [True]


_LIFECYCLE = r"""
import atexit, os, sys
fds = []

def check():  # registered first, so it runs after every other exit handler
    for fd in fds:
        try:
            os.fstat(fd)
        except OSError:
            print(f"descriptor {fd} closed at exit", flush=True)
            os._exit(3)

atexit.register(check)
import gc
import sqlalchemy as sa
import jobq

eng = sa.create_engine(sys.argv[1])
jobq.enqueue(eng, "t")
fds[:] = jobq._sqlite_lockfile(eng)
if sys.argv[2] == "fork":
    fds.clear()
    pid = os.fork()
    if pid == 0:
        os.closerange(3, 256)  # as a daemonising child does
        log = open(sys.argv[3], "w")  # takes the lowest number: the parent's lock file had it
        child = sa.create_engine(sys.argv[1])
        jobq.enqueue(child, "t")  # the child's own lock file and pipe
        del eng, child
        gc.collect()  # both engines' finalizers run: the parent's copy must leave `log` alone
        try:
            log.write("still open")
            log.close()
        except OSError as exc:
            print(f"the child's file was closed under it: {exc}", flush=True)
            os._exit(4)
        os._exit(0)
    _pid, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
"""


@only("sqlite")  # the lock file is the SQLite driver's own
@pytest.mark.parametrize("how", ["exit", "fork"])
def test_the_lock_files_descriptors_are_closed_only_by_their_own_engine(db_url: str, dialect: str, how: str,
                                                                        tmp_path: pathlib.Path) -> None:
    """The lock file's and the pipe's descriptors are closed when their engine is collected,
    and only then: not at interpreter exit, while jobq's daemon threads may still be inside a
    transaction (an exit handler's file could take the number, and get the unlock or a wake-up
    byte), and not by a forked child's copy of the parent's finalizer, after the child reused
    the numbers for its own files."""

    script = tmp_path / "lifecycle.py"
    script.write_text(textwrap.dedent(_LIFECYCLE))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, str(script), db_url, how, str(tmp_path / "child.log")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    if how == "fork":
        assert (tmp_path / "child.log").read_text() == "still open"

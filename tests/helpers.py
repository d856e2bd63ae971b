"""Small helpers shared by the suites: worker options for quick tests, database snapshots,
polling with a deadline, and the overlap and window counts that timed checks rest on.
(tests/races/harness.py keeps its own copy of the overlap sweep, ``max_overlap``: the race
harness runs in claimer processes and is owned with the race suite.)"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import pathlib
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

import jobq

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: The command line as a user runs it, in a process of its own: ``python -m jobq`` on this
#: checkout's package, or ``python jobq.py`` on the generated single file when the suite runs
#: against it (JOBQ_TEST_SINGLE_FILE).
JOBQ_CLI: list[str] = ([sys.executable, str(ROOT / "single" / "jobq.py")] if os.environ.get("JOBQ_TEST_SINGLE_FILE") else
                       [sys.executable, "-c", f"import runpy, sys; sys.path.insert(0, {str(ROOT)!r}); "
                        "runpy.run_module('jobq', run_name='__main__', alter_sys=True)"])

jobs = jobq.Job.__table__

deps = jobq.JobDep.__table__

#: Figures a test wants in the run's output (printed at the end by tests/conftest.py).
REPORT: list[str] = []

#: Worker options for tests that want a quick queue: tight polling, a lease no test outlives,
#: retries without back-off.
FAST: dict[str, Any] = dict(poll_interval=0.02, lease_ttl=5.0, retry_backoff=lambda attempt: 0.0)


def meeting(n: int, timeout: float = 30.0) -> Callable[[], None]:
    """A call for handlers to make on entry: the first ``n`` calls wait (up to ``timeout``) until
    all ``n`` have been made, later calls return at once. Runs that can overlap then do,
    however slowly a loaded machine starts threads; a worker that cannot run ``n`` at once
    keeps the first waiting, and no overlap shows (the barrier breaks after ``timeout``)."""
    barrier, lock, arrived = threading.Barrier(n, timeout=timeout), threading.Lock(), [0]

    def arrive() -> None:
        with lock:
            arrived[0] += 1
            first = arrived[0] <= n
        if first:
            barrier.wait()

    return arrive


def no_deadline_for_the_retry(engine: sa.Engine, job_id: int) -> None:
    """For a worker's "timed_out" event (sent in the loop's thread after the timeout is written
    and before the same tick's claim): the retry is claimed with no timeout, so a loaded machine
    cannot time it out too. The attempt that timed out had its deadline from its own lease."""
    with engine.begin() as conn:
        conn.execute(sa.update(jobs).where(jobs.c.id == job_id).values(timeout=None))


def snapshot(engine: sa.Engine) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Every row of jobs and job_deps, ordered: compare two to prove nothing was written."""
    with engine.connect() as conn:
        j = [tuple(r) for r in conn.execute(sa.select(jobs).order_by(jobs.c.id))]
        d = [tuple(r) for r in conn.execute(sa.select(deps).order_by(deps.c.job_id, deps.c.depends_on_id))]
    return j, d


def state(engine: sa.Engine, job_id: int) -> str:
    info = jobq.get(engine, job_id)
    assert info is not None, f"job {job_id} vanished"
    return info.state


def db_now(engine: sa.Engine) -> dt.datetime:
    d = jobq._prepare(engine)
    with engine.connect() as conn:
        return d.db_now(conn)


# InnoDB refreshes information_schema.innodb_trx only once nobody has read it for 0.1 s: a poll
# every 20 ms kept showing its first answer and never saw a lock wait that began later. Poll
# that table at this interval.
INNODB_TRX_POLL = 0.25


def wait_for(cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02, what: str = "condition") -> Any:
    """Poll ``cond`` until it is truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def backend_id(conn: sa.Connection) -> int:
    """The server's id of this connection (PostgreSQL backend pid, MySQL/MariaDB thread id)."""
    sql = "SELECT pg_backend_pid()" if conn.dialect.name == "postgresql" else "SELECT CONNECTION_ID()"
    return int(conn.exec_driver_sql(sql).scalar_one())


def waits_for_a_row_lock(engine: sa.Engine, backend: int) -> bool:
    """Whether the connection ``backend`` (backend_id) waits for a row lock now, as the server
    says; poll it at INNODB_TRX_POLL on MySQL/MariaDB."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            got = conn.execute(sa.text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :p"), {"p": backend})
            return got.scalar() == "Lock"
        got = conn.execute(sa.text("SELECT trx_state FROM information_schema.innodb_trx WHERE trx_mysql_thread_id = :p"),
                           {"p": backend})
        return got.scalar() == "LOCK WAIT"


def peak_overlap(spans: Iterable[tuple[float, float]]) -> int:
    """The most (start, end) spans open at one instant. A span that ends exactly when another
    starts does not overlap it (ends sort before starts at equal times)."""
    spans = list(spans)
    points = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    level = peak = 0
    for _, delta in points:
        level += delta
        peak = max(peak, level)
    return peak


def most_surely_in_window(spans: list[tuple[float, float]], window: float) -> int:
    """The most events that certainly happened inside one window of ``window`` seconds.

    Each event is known only to lie inside its span (before, after): a claim's instant falls
    between the moment its caller asked and the moment the answer came back. An event counts
    for the window [w, w + window) only when its whole span lies inside, so a count above a
    limit is proof, with no slack for scheduling delays: late answers can only hide a
    violation, never invent one."""
    most = 0
    for w, _ in spans:
        most = max(most, sum(1 for b, a in spans if b >= w and a < w + window))
    return most


def expire_leases(engine: sa.Engine, *ids: int) -> None:
    """Move lease expiry into the past, as if the holder had stalled for longer than its TTL."""
    past = db_now(engine) - dt.timedelta(seconds=3600)
    with engine.begin() as conn:
        stmt = sa.update(jobs).where(jobs.c.in_flight == sa.true())
        if ids:
            stmt = stmt.where(jobs.c.id.in_(ids))
        conn.execute(stmt.values(lease_expires=past))


def cli(url: str, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``jobq --url url args...`` in this process: (exit code, stdout, stderr)."""
    code = jobq.main(["--url", url, *args])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> bool:
    """The CLI's refusal: one ``jobq: ...`` line, no traceback."""
    return err.startswith("jobq: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@contextlib.contextmanager
def counted(engine: sa.Engine) -> Iterator[list[str]]:
    """The SQL statements the engine sends while the block runs."""
    seen: list[str] = []

    def note(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    sa.event.listen(engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        sa.event.remove(engine, "before_cursor_execute", note)


def recorded_version(engine: sa.Engine, version: int) -> None:
    """Record ``version`` as the database's schema_version, as the jobq.py of that version left it."""
    with engine.begin() as conn:
        conn.execute(sa.update(META).where(META.c.key == "schema_version").values(value=str(version)))


# ---- the test seam: jobq's tables, by the public declarative Base ----------------------------
# Tests that read or write a table directly take it from here, not from jobq's private names.
TABLES = jobq.Base.metadata.tables
JOBS, META, SLOTS = TABLES["jobs"], TABLES["jobq_meta"], TABLES["jobq_slots"]
ATTEMPTS, STARTS, GROUPS = TABLES["jobq_attempts"], TABLES["jobq_starts"], TABLES["jobq_groups"]


def schema_version(engine: sa.Engine) -> str | None:
    """The schema version the database records (jobq_meta's schema_version)."""
    with engine.connect() as conn:
        return conn.execute(sa.select(META.c.value).where(META.c.key == "schema_version")).scalar()

"""prune against a retry that re-opens what prune is about to delete.

F failed and closed its dependent D (failed, closed_by F); both are old enough to prune.
``prune(states=("failed",))`` reads its batch without locks, then deletes. ``retry(F)`` re-opens
F and D. Correct, however the two interleave: whatever retry returned exists afterwards and
is unfinished, or retry was refused because the jobs are gone; never both "re-opened" and
deleted. A prune that deletes by id what it read earlier shows as a retry that returned
``[F, D]`` and two jobs that no longer exist (and will never run).

The interleavings are held open at prune's checkpoints (``jobq._checkpoint``: "prune_read",
after the unlocked read; "prune_locked", after the batch is locked and checked again), where
the retry runs on its own connection until it has committed or the server says it waits for
a row lock: no sleeps, no timing. On SQLite there is no such window: prune's transaction
begins with BEGIN IMMEDIATE, which holds the database's write lock from its first statement,
so a retry (a writer) runs wholly before or after it; the SQLite test checks that the lock is
held at both checkpoints, then runs the retry after prune, sequentially.
"""

from __future__ import annotations

import datetime as dt
import sqlite3
import threading
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
from dbs import needs, only
from harness import SUMMARY
from helpers import INNODB_TRX_POLL, backend_id, db_now, wait_for, waits_for_a_row_lock

jobs = jobq.Job.__table__
c = jobs.c
HOUR = dt.timedelta(hours=1)


def _failed_pair(engine: sa.Engine) -> tuple[int, int]:
    """F failed for good, D (depends on F) closed by it: both failed, both finished now."""
    f = jobq.enqueue(engine, "t", max_attempts=1)
    d = jobq.enqueue(engine, "t", depends_on=[f])
    [lease] = jobq.claim_batch(engine, "w", 600, limit=1)
    assert lease.id == f
    assert jobq.fail(engine, f, "boom", worker_id="w", token=lease.token) == "failed"
    assert (jobq.get(engine, f).state, jobq.get(engine, d).state) == ("failed", "failed")  # type: ignore[union-attr]
    return f, d


def _race(engine: sa.Engine, point: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """prune, with retry(F) run at ``point`` on its own connection until it commits or waits
    for a lock. Returns what each returned (or raised) and what is left of F and D."""
    f, d = _failed_pair(engine)
    reng = sa.create_engine(engine.url, pool_size=1, max_overflow=0)  # the retry's one connection
    jobq._prepare(reng)
    with reng.connect() as conn:
        backend = backend_id(conn)
    out: dict[str, Any] = {"f": f, "d": d}

    def call_retry() -> None:
        try:
            out["retry"] = jobq.retry(reng, f)
        except jobq.InvalidJob as exc:
            out["retry"] = exc

    retrier = threading.Thread(target=call_retry)

    def checkpoint(name: str, job_ids: Any = ()) -> None:
        if name != point or retrier.ident is not None:
            return
        out["batch"] = sorted(job_ids)
        retrier.start()
        out["retry_waited"] = wait_for(
            lambda: "waits" if waits_for_a_row_lock(engine, backend) else "committed" if not retrier.is_alive() else None,
            timeout=30, interval=INNODB_TRX_POLL, what="the retry to commit or to wait for prune's lock",
        ) == "waits"

    monkeypatch.setattr(jobq, "_checkpoint", checkpoint)
    try:
        out["pruned"] = jobq.prune(engine, dt.timedelta(0), states=("failed",), now=db_now(engine) + HOUR)
    finally:
        if retrier.ident is not None:
            retrier.join(60)
        reng.dispose()
    assert not retrier.is_alive(), "retry never finished"
    with engine.connect() as conn:
        out["left"] = dict(conn.execute(sa.select(c.id, c.state).where(c.id.in_([f, d]))).all())
    return out


def _broken_promises(r: dict[str, Any]) -> list[str]:
    """What a user would see go wrong: a retry that re-opened jobs prune deleted, or a prune
    that left a half (one of F, D gone, the other kept)."""
    bad = []
    if isinstance(r["retry"], list):
        gone = [i for i in r["retry"] if i not in r["left"]]
        if gone:
            bad.append(f"retry returned {r['retry']} but prune deleted {gone}")
        finished = [i for i in r["retry"] if r["left"].get(i) in jobq.TERMINAL]
        if finished:
            bad.append(f"retry returned {r['retry']} but {finished} are finished")
    elif "no job" not in str(r["retry"]):
        bad.append(f"retry refused for another reason: {r['retry']}")
    if len(r["left"]) == 1:
        bad.append(f"prune left half of the pair: {r['left']}")
    return bad


def _unlocked_batch(d: jobq._Dialect, ids: Any, states: Any, cutoff: dt.datetime, extra: Any = ()) -> sa.Select[Any]:
    """BROKEN: the batch as read, by id only (prune's delete with no second look)."""
    return sa.select(c.id).where(c.id.in_(ids)).order_by(c.id)


def _recheck_without_lock(d: jobq._Dialect, ids: Any, states: Any, cutoff: dt.datetime, extra: Any = ()) -> sa.Select[Any]:
    """BROKEN: the batch checked again but not locked: a retry can still commit in between."""
    return sa.select(c.id).where(c.id.in_(ids), *jobq._prunable(states, cutoff, extra)).order_by(c.id)


BROKEN: dict[str, tuple[Callable[..., sa.Select[Any]], str]] = {
    # variant: (the batch's second look, the checkpoint whose window it leaves open)
    "delete_by_id_only": (_unlocked_batch, "prune_read"),
    "recheck_without_lock": (_recheck_without_lock, "prune_locked"),
}


@needs("row_locks")  # SQLite: see the test below
@pytest.mark.parametrize("point", ["prune_read", "prune_locked"])
def test_prune_never_deletes_what_a_concurrent_retry_reopened(engine: sa.Engine, dialect: str, point: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """At "prune_read" (batch read, nothing locked) the retry commits: prune's locked second
    look must see F and D re-opened and delete neither; retry's [F, D] stay ready/waiting.
    At "prune_locked" the retry must wait for prune's row locks, then find no job: prune
    deleted both. Either way no broken promise (see _broken_promises)."""
    r = _race(engine, point, monkeypatch)
    SUMMARY.append({"engine": dialect, "check": f"prune vs retry at {point}"})
    assert _broken_promises(r) == []
    f, d = r["f"], r["d"]
    assert r["batch"] == [f, d]
    if point == "prune_read":
        assert (r["retry_waited"], r["retry"], r["pruned"]) == (False, [f, d], 0)
        assert r["left"] == {f: "ready", d: "waiting"}
    else:
        assert (r["retry_waited"], r["pruned"], r["left"]) == (True, 2, {})


@needs("row_locks")
@pytest.mark.parametrize("variant", sorted(BROKEN))
def test_harness_catches_a_prune_that_deletes_what_retry_reopened(engine: sa.Engine, dialect: str, variant: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: with the batch's second look replaced by a broken one, the
    retry commits inside the window that variant leaves open and prune deletes what it
    re-opened."""
    second_look, point = BROKEN[variant]
    monkeypatch.setattr(jobq, "_q_lock_prunable", second_look)
    r = _race(engine, point, monkeypatch)
    caught = _broken_promises(r)
    SUMMARY.append({"engine": dialect, "check": f"BROKEN prune {variant}", "caught": "1/1" if caught else "0/1"})
    assert caught, f"the harness did not catch {variant}: {r}"


@only("sqlite")  # SQLite's write lock; the row-lock engines: the two tests above
def test_sqlite_prune_holds_the_write_lock_from_read_to_delete(engine: sa.Engine, db_url: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite has no row locks and needs none here: at both of prune's checkpoints the
    database's write lock is held (another connection cannot BEGIN IMMEDIATE), so no retry can
    commit between prune's read and its delete. Sequentially, a retry after the prune finds no
    job, and a prune after a retry deletes nothing it re-opened. A deferred BEGIN would let a
    writer in and fail the first check."""
    f, d = _failed_pair(engine)
    path = engine.url.database
    assert path
    seen: list[str] = []

    def checkpoint(name: str, job_ids: Any = ()) -> None:
        if name not in ("prune_read", "prune_locked") or not job_ids:
            return
        other = sqlite3.connect(path, timeout=0, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            other.execute("ROLLBACK")
            seen.append(f"{name}: another writer got in")
        except sqlite3.OperationalError as exc:
            assert "locked" in str(exc) or "busy" in str(exc), exc
            seen.append(f"{name}: write lock held")
        finally:
            other.close()

    monkeypatch.setattr(jobq, "_checkpoint", checkpoint)
    assert jobq.prune(engine, dt.timedelta(0), states=("failed",), now=db_now(engine) + HOUR) == 2
    monkeypatch.undo()
    assert seen == ["prune_read: write lock held", "prune_locked: write lock held"]
    with pytest.raises(jobq.InvalidJob, match="no job"):
        jobq.retry(engine, f)
    f, d = _failed_pair(engine)
    assert jobq.retry(engine, f) == [f, d]
    assert jobq.prune(engine, dt.timedelta(0), states=("failed",), now=db_now(engine) + HOUR) == 0
    assert (jobq.get(engine, f).state, jobq.get(engine, d).state) == ("ready", "waiting")  # type: ignore[union-attr]

"""Jobs that wait without holding a slot: signals (signal), what a handler's ctx.wait_for,
ctx.sleep and ctx.sleep_until read, and the fenced write that suspends or snoozes a dispatch.

A suspended job is ``ready`` and not yet due (its run_after is the wake-up; a wait without a
timeout is due at the end of time until its signal comes), with the attempt the claim counted
given back: the claim, the caps, the rate limits and fair share see it as they see a job
scheduled for later, which is to say not at all until it is due. What it waits for is in
jobq_waits, the signals in jobq_signals (schema.py).

A waiter's suspension and signal() of the same key both lock that key's jobq_signals row first
(a waiter inserts an awaited-only row when there is none): whichever commits second sees the
other's rows, so a signal is never lost between the handler's read and its suspension.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from sqlalchemy import orm
from sqlalchemy.engine import Connection, Engine

from .base import JobqError, LeaseLost, _checkpoint, _Suspension
from .drivers import _Dialect, _engine_of, _prepare, _target_connection, _transaction
from .schema import _NEVER
from .sql import (
    _Outcome,
    _q_fail,
    _q_held,
    _q_insert_wait,
    _q_lock_signal,
    _q_send_signal,
    _q_signal,
    _q_stop_waiting,
    _q_suspend,
    _q_update_wait,
    _q_wait_row,
    _q_waiters,
    _q_wake,
)
from .validate import _check_name, _encode_checked


def signal(target: Engine | Connection | orm.Session, key: str, payload: Any = None) -> bool:
    """Send the signal ``key``: every job waiting for it in ``ctx.wait_for(key)`` becomes due
    now, and every ``ctx.wait_for(key)`` from now on returns ``payload`` at once.

    A signal is a fact, not a message: it is kept, read by every job that waits for its key,
    before or after it was sent, and only the first signal of a key counts (a second one
    changes nothing and returns False: a webhook delivered twice wakes nobody twice).

    ``prune(engine, older_than)`` deletes the signals nobody can still receive: a signal sent
    more than ``older_than`` ago (a key only awaited, never sent: made that long ago) whose key
    no unfinished job has waited for, that is, no job that suspended on the key or timed out
    waiting for it is still unfinished (a woken job's re-run reads the signal again, so it is
    kept until that job finishes). A job that has not waited yet cannot be known: a signal
    sent before its job waits is kept for ``older_than`` whatever happens, and a job that first
    waits for a key after its signal was pruned waits for it anew (until its timeout). So keep
    ``older_than`` longer than the longest time between a signal and the first wait for it, as
    for pruned upstreams; the same holds for a job that read a signal at once (without
    suspending) and later runs again after a failure.

    Args:
        target: an Engine (jobq commits its own transaction) or a Connection/Session (the
            signal is written in the caller's transaction and exists only if the caller
            commits; waiting jobs wake at that commit).
        key: the signal's name, 1-200 characters (as job types are).
        payload: any JSON value (None, a number, a string, a list or an object), what
            ``ctx.wait_for`` returns.

    Returns:
        True if this call recorded the signal; False if the key had been signalled already.

    Raises:
        InvalidJob: a bad key or payload; nothing is written.
    """
    key = _check_name(key, "signal key")
    payload = _encode_checked(payload, "signal payload")

    def run(conn: Connection, d: _Dialect) -> bool:
        now = d.db_now(conn)
        _lock_key(conn, d, key, now)
        if not conn.execute(_q_send_signal(key, payload, now)).rowcount:
            return False
        waiting = list(conn.execute(_q_waiters(key)).scalars())
        if waiting:
            conn.execute(_q_wake(waiting, now))
            conn.execute(_q_stop_waiting(key))
            d.notify(conn)
        return True

    if isinstance(target, Engine):
        return _transaction(target, run)
    d = _prepare(_engine_of(target))
    return run(_target_connection(target), d)  # type: ignore[arg-type]


# ---- what a handler's wait reads ------------------------------------------------------------


def _wait_answer(conn: Connection, d: _Dialect, job_id: int, token: str, op: tuple[Any, ...]) -> tuple[str, Any]:
    """The answer to a handler's ctx.wait_for / ctx.sleep / ctx.sleep_until (``op``), read in
    one transaction by the worker that holds the lease: ("value", payload), ("timeout",
    None), ("return", None), or ("suspend", _Suspension) for the worker to write."""
    now = d.db_now(conn)
    kind = op[0]
    if kind == "until":
        until = op[1]
        return ("return", None) if until <= now else ("suspend", _Suspension("until", until=until, since=now))
    if kind == "sleep":
        _, name, seconds = op
        row = conn.execute(_q_wait_row(job_id, "sleep", name)).first()
        if row is None:
            if seconds <= 0:
                return "return", None
            return "suspend", _Suspension("sleep", name, until=now + _dt.timedelta(seconds=seconds), since=now)
        if row.until is None or row.until <= now:
            return "return", None
        return "suspend", _Suspension("sleep", name, until=row.until, since=row.since)
    _, key, timeout = op
    row = conn.execute(_q_wait_row(job_id, "signal", key)).first()
    if row is not None and row.resolved == "timeout":
        return "timeout", None
    sent = conn.execute(_q_signal(key)).first()
    if sent is not None and sent.sent_at is not None:
        return "value", sent.payload
    since = row.since if row is not None else now
    until = row.until if row is not None else (None if timeout is None else now + _dt.timedelta(seconds=timeout))
    if until is None or until > now:
        return "suspend", _Suspension("signal", key, until=until, since=since)
    # Timed out: decided under the key's lock, so a signal either committed first (and wins)
    # or comes after the timeout is recorded (and this job never reads it).
    locked = _lock_key(conn, d, key, now)
    _checkpoint("wait_timeout_checked", [job_id])
    if locked.sent_at is not None:
        return "value", locked.payload
    if conn.execute(_q_held([job_id], token)).first() is None:
        raise LeaseLost(f"job {job_id}: this dispatch no longer holds the lease; the wait's timeout was not recorded")
    _put_wait(conn, job_id, "signal", key, row is not None, since=since, until=until, waiting=False, resolved="timeout")
    return "timeout", None


def _lock_key(conn: Connection, d: _Dialect, key: str, now: _dt.datetime) -> Any:
    """The key's jobq_signals row (payload, sent_at), made if missing and locked. A prune that
    deleted the row while this waited for its lock leaves nothing to lock: make it again."""
    for _ in range(5):  # a row made now is younger than any prune's cutoff: once is enough
        d.insert_signal_key(conn, key, now)
        row = conn.execute(_q_lock_signal(d, key)).first()
        if row is not None:
            return row
    raise JobqError(f"signal {key!r}: its row was deleted under every lock taken on it")


def _put_wait(conn: Connection, job_id: int, kind: str, name: str, exists: bool, **values: Any) -> None:
    # Only the lease holder's transactions (and signal(), under the key's lock) write a job's
    # rows, so a read-then-write cannot collide with another insert of the same row.
    if exists:
        conn.execute(_q_update_wait(job_id, kind, name, values))
    else:
        conn.execute(_q_insert_wait(), {"job_id": job_id, "kind": kind, "name": name, "n": 0, "waiting": False,
                                        "until": None, "resolved": None, **values})


# ---- the suspension's write -----------------------------------------------------------------


def _write_suspension(conn: Connection, d: _Dialect, o: _Outcome, now: _dt.datetime) -> tuple[int, str, str]:
    """Suspend (or snooze) one dispatch, fenced by its lease: the job back to ``ready``, due at
    its wake-up, the attempt given back, what it waits for recorded. Returns (rows written,
    state, history outcome); a snooze past its limit fails the job instead."""
    w: _Suspension = o.wait
    if w.kind == "snooze":
        row = conn.execute(_q_wait_row(o.job_id, "snooze", "")).first()
        count = 0 if row is None else row.n
        if count >= w.limit:
            error = (f"snoozed {count} times, its limit (Snooze limit={w.limit}): failed instead of snoozing again")
            n = conn.execute(_q_fail(o.job_id, o.owner, o.token, state="failed", error=error, now=now,
                                     run_after=None)).rowcount
            return n, "failed", "failed"
        n = conn.execute(_q_suspend(o.job_id, o.owner, o.token, now + _dt.timedelta(seconds=w.delay), now)).rowcount
        if n:
            _put_wait(conn, o.job_id, "snooze", "", row is not None, since=row.since if row else now, n=count + 1)
        return n, "ready", "snoozed"
    due = w.until
    waiting = False
    if w.kind == "signal":
        sent = _lock_key(conn, d, w.name, now).sent_at is not None
        _checkpoint("suspend_checked", [o.job_id])
        waiting = not sent
        due = now if sent else (w.until or _NEVER)
    assert due is not None
    n = conn.execute(_q_suspend(o.job_id, o.owner, o.token, max(due, now) if w.kind == "signal" else due, now)).rowcount
    if n and w.kind in ("signal", "sleep"):
        exists = conn.execute(_q_wait_row(o.job_id, w.kind, w.name)).first() is not None
        _put_wait(conn, o.job_id, w.kind, w.name, exists, since=w.since or now, until=w.until, waiting=waiting)
    return n, "ready", "suspended"

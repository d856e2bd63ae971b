"""Recurring jobs: schedules stored in the database (schedule, schedules, pause_schedule,
resume_schedule, unschedule), and the firing the workers run on a cadence (_fire_due)."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
from collections.abc import Mapping
from typing import Any

from sqlalchemy import orm
from sqlalchemy.engine import Connection, Engine

from .base import InvalidJob, JobqError, _checkpoint, logger
from .drivers import _Dialect, _engine_of, _prepare, _target_connection, _transaction
from .jobs import _ONE, _insert_graph, _KeyTaken, _link, _make_spec
from .limits import _read
from .sql import (
    _Q_ADVANCE_SCHEDULE,
    _Q_ALL_SCHEDULES,
    _Q_DELETE_SCHEDULE,
    _Q_INSERT_SCHEDULE,
    _Q_SCHEDULE_LAST_JOB,
    _Q_SCHEDULE_ROW,
    _Q_UPDATE_SCHEDULE,
    _q_due_schedules,
    _q_schedule,
)
from .validate import _check_name, _to_db_time

#: How often a worker asks whether a schedule is due (seconds): a slot is enqueued at most
#: about this long (plus one poll interval of an idle worker) after its time.
_SCHEDULE_POLL = 1.0
#: Most schedules one due check fires; more wait for the next check.
_FIRE_LIMIT = 100
_MICRO = _dt.timedelta(microseconds=1)
#: The longest interval accepted for ``every`` (and the shortest: a second).
_MAX_EVERY = _dt.timedelta(days=366)
_MIN_EVERY = _dt.timedelta(seconds=1)


@dataclasses.dataclass(frozen=True)
class ScheduleInfo:
    """A stored schedule (:func:`schedule`, :func:`schedules`). Times are aware UTC datetimes.

    Attributes:
        name: the schedule's name (its key).
        type, args, group_key, weight, priority, max_attempts, timeout, unique_key: the job each
            slot enqueues, as :func:`enqueue` takes them (``max_attempts`` None: not given, so
            3 or the handler's RetryPolicy attempts).
        every: the interval, or None for a cron schedule.
        cron: the cron expression (evaluated in UTC), or None for an interval schedule.
        start: an interval schedule's anchor: its slots are ``start + k * every``.
        paused: paused schedules enqueue nothing.
        next_run_at: the next slot.
        last_run_at: the slot last enqueued (None: never fired).
        last_job_id: the job that slot enqueued (or the unfinished job that held its
            ``unique_key``).
        runs: how many slots were enqueued (a catch-up after downtime counts once).
        created_at, updated_at: when it was made and last changed or fired.
    """

    name: str
    type: str
    args: dict[str, Any]
    every: _dt.timedelta | None
    cron: str | None
    start: _dt.datetime
    group_key: str
    weight: int
    priority: int
    max_attempts: int | None
    timeout: float | None
    unique_key: str | None
    paused: bool
    next_run_at: _dt.datetime
    last_run_at: _dt.datetime | None
    last_job_id: int | None
    runs: int
    created_at: _dt.datetime
    updated_at: _dt.datetime


def _aware(value: _dt.datetime | None) -> _dt.datetime | None:
    return None if value is None else value.replace(tzinfo=_dt.UTC)


def _info(row: Any) -> ScheduleInfo:
    return ScheduleInfo(
        name=row.name, type=row.type, args=row.args,
        every=None if row.every_us is None else _dt.timedelta(microseconds=row.every_us), cron=row.cron,
        start=row.anchor.replace(tzinfo=_dt.UTC), group_key=row.group_key, weight=row.weight, priority=row.priority,
        max_attempts=row.max_attempts, timeout=row.timeout, unique_key=row.unique_key, paused=bool(row.paused),
        next_run_at=row.next_run_at.replace(tzinfo=_dt.UTC), last_run_at=_aware(row.last_slot),
        last_job_id=row.last_job_id, runs=row.runs, created_at=row.created_at.replace(tzinfo=_dt.UTC),
        updated_at=row.updated_at.replace(tzinfo=_dt.UTC),
    )


def _croniter(expr: str, base: _dt.datetime) -> Any:
    """croniter over ``expr`` from ``base`` (naive UTC). Imported here, on a cron schedule's
    first use: the core needs only SQLAlchemy (the ``jobq[cron]`` extra installs croniter)."""
    try:
        from croniter import croniter  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        raise InvalidJob("cron schedules need croniter: pip install 'jobq[cron]'") from None
    try:
        return croniter(expr, base.replace(tzinfo=_dt.UTC))
    except (ValueError, KeyError) as exc:  # CroniterError is a ValueError
        raise InvalidJob(f"cron: {expr!r} is not a cron expression ({exc})") from None


def _cron_next(expr: str, after: _dt.datetime) -> _dt.datetime:
    """The first slot of ``expr`` strictly after ``after`` (naive UTC in, naive UTC out)."""
    nxt = _croniter(expr, after).get_next(_dt.datetime)
    return nxt.astimezone(_dt.UTC).replace(tzinfo=None)  # type: ignore[no-any-return]


def _cron_prev(expr: str, before: _dt.datetime) -> _dt.datetime:
    """The last slot of ``expr`` strictly before ``before``."""
    prev = _croniter(expr, before).get_prev(_dt.datetime)
    return prev.astimezone(_dt.UTC).replace(tzinfo=None)  # type: ignore[no-any-return]


def _catch_up(row: Any, now: _dt.datetime) -> tuple[_dt.datetime, _dt.datetime]:
    """(the latest slot at or before ``now``, the first slot after it) of a stored schedule: the
    catch-up rule. Every slot missed since ``next_run_at`` is covered by the one latest slot."""
    if row.every_us is not None:
        every = _dt.timedelta(microseconds=row.every_us)
        k = (now - row.anchor) // every
        last = row.anchor + k * every
        return last, last + every
    nxt = _cron_next(row.cron, now)
    return _cron_prev(row.cron, nxt), nxt


def _first_slot(every_us: int | None, cron: str | None, anchor: _dt.datetime, now: _dt.datetime) -> _dt.datetime:
    """The first slot strictly after ``now``."""
    if every_us is None:
        assert cron is not None
        return _cron_next(cron, now)
    every = _dt.timedelta(microseconds=every_us)
    if anchor > now:
        return anchor
    return anchor + ((now - anchor) // every + 1) * every


def _check_timing(every: Any, cron: Any, start: Any) -> tuple[int | None, str | None, _dt.datetime | None]:
    if (every is None) == (cron is None):
        raise InvalidJob("schedule: give exactly one of every (a timedelta) and cron (a cron expression)")
    if cron is not None:
        if not isinstance(cron, str) or not cron.strip() or len(cron) > 200:
            raise InvalidJob(f"cron must be a cron expression (a non-empty string of at most 200 characters), got {cron!r}")
        if start is not None:
            raise InvalidJob("start is for every= schedules; a cron expression fixes its own slots")
        _croniter(cron, _dt.datetime(2000, 1, 1))  # refuses a bad expression now, not at its first slot
        return None, cron.strip(), None
    if isinstance(every, bool) or not isinstance(every, _dt.timedelta):
        raise InvalidJob(f"every must be a datetime.timedelta, got {type(every).__name__} {every!r}")
    if not _MIN_EVERY <= every <= _MAX_EVERY:
        raise InvalidJob(f"every must be between {_MIN_EVERY} and {_MAX_EVERY.days} days, got {every}")
    return every // _MICRO, None, None if start is None else _to_db_time(start, "start")


def schedule(
    target: Engine | Connection | orm.Session,
    name: str,
    type: str,
    *,
    every: _dt.timedelta | None = None,
    cron: str | None = None,
    start: _dt.datetime | None = None,
    args: Mapping[str, Any] | None = None,
    group_key: str = "default",
    weight: int = 1,
    max_attempts: int | None = None,
    timeout: float | None = None,
    priority: int = 0,
    unique_key: str | None = None,
) -> ScheduleInfo:
    """Store a recurring job: the workers enqueue one job of ``type`` per slot, each slot once
    across every worker, host and process sharing the database.

    Calling it again with the same ``name`` changes the schedule (a paused one stays paused).
    When ``every``, ``cron`` or ``start`` changed, the next slot is computed afresh from now;
    otherwise the next slot is kept and the new job fields apply from it on.

    Catch-up: a slot is fired by the first worker that sees it due (within about a second). If
    no worker ran across several slots, the first check after they are back enqueues ONE job,
    for the latest missed slot (the job's ``run_after`` is that slot), and the schedule moves
    to the first slot after now: missed slots are never enqueued one by one.

    Args:
        target: an Engine (jobq commits its own transaction) or a Connection/Session (written
            in the caller's transaction, in effect once the caller commits).
        name: the schedule's name, its key (1-200 characters).
        type: the job type each slot enqueues.
        every: a timedelta between 1 second and 366 days: slots are ``start + k * every``.
        cron: a cron expression (5 fields, or 6 with seconds), evaluated in UTC, so no slot is
            skipped or doubled by daylight saving time. Needs the ``jobq[cron]`` extra
            (croniter). Exactly one of ``every`` and ``cron`` must be given.
        start: ``every`` only: an aware datetime anchoring the slots (default: now). The first
            run is the first slot after now (by default one interval from now).
        args: the arguments of the job each slot enqueues. This and the job fields below are
            checked as :func:`enqueue` checks them.
        group_key: the job's group.
        weight: the job's weight in its group's fair share.
        max_attempts: the job's attempts (None: the handler's RetryPolicy, else 3).
        timeout: the job's timeout in seconds.
        priority: the job's priority.
        unique_key: with it, a slot whose key an unfinished job of an earlier slot still holds
            enqueues nothing (the slot counts as fired): runs never overlap.

    Returns:
        The schedule as stored.

    Raises:
        InvalidJob: bad input, such as both or neither of ``every`` and ``cron``, an interval
            out of range, a bad cron expression, croniter missing, or a bad job field.
            Nothing is written.
    """
    key = _check_name(name, "name")
    every_us, cron_expr, anchor = _check_timing(every, cron, start)
    spec = _make_spec({"type": type, "args": args, "group_key": group_key, "weight": weight,
                       "max_attempts": max_attempts, "timeout": timeout, "priority": priority,
                       "unique_key": unique_key})
    job = {"type": spec.type, "args": spec.args, "group_key": spec.group_key, "weight": spec.weight,
           "priority": spec.priority, "max_attempts": spec.max_attempts, "timeout": spec.timeout,
           "unique_key": spec.unique_key}

    def run(conn: Connection, d: _Dialect) -> ScheduleInfo:
        now = d.db_now(conn)
        old = conn.execute(_q_schedule(d), {"b_name": key}).first()
        kept = old is not None and (old.every_us, old.cron) == (every_us, cron_expr)
        base = anchor if anchor is not None else old.anchor if old is not None and kept else now
        same = kept and old is not None and old.anchor == base
        nxt = old.next_run_at if old is not None and same else _first_slot(every_us, cron_expr, base, now)
        values = {**job, "every_us": every_us, "cron": cron_expr, "anchor": base, "updated_at": now, "next_run_at": nxt}
        if old is None:
            conn.execute(_Q_INSERT_SCHEDULE, {**values, "name": key, "paused": False, "runs": 0, "revision": 0,
                                              "created_at": now})
        else:
            conn.execute(_Q_UPDATE_SCHEDULE, {**values, "b_name": key, "paused": old.paused})
        return _info(conn.execute(_Q_SCHEDULE_ROW, {"b_name": key}).one())

    return _write(target, run)


def _write(target: Engine | Connection | orm.Session, run: Any) -> Any:
    if isinstance(target, Engine):
        return _transaction(target, run)
    return run(_target_connection(target), _prepare(_engine_of(target)))  # type: ignore[arg-type]


def schedules(target: Engine | Connection | orm.Session) -> list[ScheduleInfo]:
    """Every stored schedule, by name.

    Args:
        target: an Engine, or a Connection/Session to read in the caller's transaction.
    """
    return [_info(r) for r in _read(target, lambda conn: conn.execute(_Q_ALL_SCHEDULES).all())]


def _set_paused(target: Engine | Connection | orm.Session, name: str, paused: bool) -> ScheduleInfo:
    key = _check_name(name, "name")

    def run(conn: Connection, d: _Dialect) -> ScheduleInfo:
        old = conn.execute(_q_schedule(d), {"b_name": key}).first()
        if old is None:
            raise InvalidJob(f"no schedule named {key!r}")
        now = d.db_now(conn)
        values = {c: getattr(old, c) for c in ("type", "args", "every_us", "cron", "anchor", "group_key", "weight",
                                                "priority", "max_attempts", "timeout", "unique_key", "next_run_at")}
        if old.paused and not paused:  # slots that fell while paused are skipped, not caught up
            values["next_run_at"] = _first_slot(old.every_us, old.cron, old.anchor, now)
        conn.execute(_Q_UPDATE_SCHEDULE, {**values, "b_name": key, "paused": paused, "updated_at": now})
        return _info(conn.execute(_Q_SCHEDULE_ROW, {"b_name": key}).one())

    return _write(target, run)  # type: ignore[no-any-return]


def pause_schedule(target: Engine | Connection | orm.Session, name: str) -> ScheduleInfo:
    """Pause a schedule: it enqueues nothing until :func:`resume_schedule`. Jobs it enqueued
    already are not touched.

    Args:
        target: an Engine, or a Connection/Session (written in the caller's transaction).
        name: the schedule.

    Raises:
        InvalidJob: no schedule has this name.
    """
    return _set_paused(target, name, True)


def resume_schedule(target: Engine | Connection | orm.Session, name: str) -> ScheduleInfo:
    """Resume a paused schedule from the first slot after now: the slots that fell while it was
    paused are skipped, not caught up. Resuming an active schedule changes nothing but its
    revision.

    Args:
        target: an Engine, or a Connection/Session (written in the caller's transaction).
        name: the schedule.

    Raises:
        InvalidJob: no schedule has this name.
    """
    return _set_paused(target, name, False)


def unschedule(target: Engine | Connection | orm.Session, name: str) -> bool:
    """Remove a schedule: no slot is enqueued by it after this commits (a firing that read it
    before finds it gone and enqueues nothing). Jobs it enqueued already are not touched.

    Args:
        target: an Engine, or a Connection/Session (written in the caller's transaction).
        name: the schedule.

    Returns:
        True if it existed.
    """
    key = _check_name(name, "name")
    return _write(target, lambda conn, d: conn.execute(_Q_DELETE_SCHEDULE, {"b_name": key}).rowcount > 0)  # type: ignore[no-any-return]


def _fire_due(engine: Engine, now: _dt.datetime | None = None) -> list[int]:
    """Enqueue the due slots of every active schedule (the workers call this every
    _SCHEDULE_POLL seconds): one indexed read, then per due schedule one transaction that moves
    it to its next slot, fenced on the revision it read, and enqueues the slot's job. A worker
    that lost the race (another fired it, or it was changed meanwhile) updates nothing and
    enqueues nothing. ``now`` (naive UTC) replaces the database's clock (tests). Returns the
    ids of the jobs enqueued."""
    d = _prepare(engine)
    with engine.connect() as conn:
        names = list(conn.execute(_q_due_schedules(now or d.db_now(conn), _FIRE_LIMIT)).scalars())
        conn.rollback()
    fired: list[int] = []
    for name in names:
        try:
            job = _transaction(engine, functools.partial(_fire_one, name=name, now=now))
        except (_KeyTaken, JobqError) as exc:  # a unique key taken meanwhile, or held: the next check retries
            logger.info("jobq: schedule %r not fired this time: %s", name, exc, extra={"action": "schedule_skipped"})
            continue
        if job is not None:
            fired.append(job)
    return fired


def _fire_one(conn: Connection, d: _Dialect, *, name: str, now: _dt.datetime | None) -> int | None:
    row = conn.execute(_Q_SCHEDULE_ROW, {"b_name": name}).first()
    at = now or d.db_now(conn)
    _checkpoint("schedule_read", [])
    if row is None or row.paused or row.next_run_at > at:
        return None  # removed, paused or fired since the due check
    slot, nxt = _catch_up(row, at)
    won = conn.execute(_Q_ADVANCE_SCHEDULE, {"b_name": name, "b_revision": row.revision, "b_next": nxt,
                                             "b_slot": slot, "b_now": at}).rowcount
    if won != 1:
        return None  # another worker fired this slot, or the schedule changed since the read
    fields = {"type": row.type, "args": row.args, "group_key": row.group_key, "weight": row.weight,
              "priority": row.priority, "max_attempts": row.max_attempts, "timeout": row.timeout,
              "unique_key": row.unique_key, "run_after": slot.replace(tzinfo=_dt.UTC)}
    plan = _link({_ONE: _make_spec(fields)}, True)
    job = _insert_graph(conn, d, plan, at)[_ONE]  # a _KeyTaken or UniqueKeyHeld undoes the advance too
    conn.execute(_Q_SCHEDULE_LAST_JOB, {"b_name": name, "b_job": job})
    logger.info("jobq: schedule %r enqueued job %d for its slot %s", name, job, slot.isoformat(),
                extra={"action": "scheduled", "job_id": job, "type": row.type, "group": row.group_key})
    return job

"""Operating a queue: per-job log lines (written by ``ctx.log``, read by :func:`logs`), retention by
stored policy (applied by the workers), bulk actions by filter with their audit log."""

from __future__ import annotations

import dataclasses
import datetime as _dt
from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Connection, Engine

from .base import ConfigError, InvalidJob, _checkpoint, _chunks, logger
from .control import _prune_batches, cancel, retry
from .drivers import _Dialect, _prepare, _transaction
from .limits import UNLIMITED
from .schema import _RETENTION_DUE_KEY, LOG_LINES_PER_JOB, TERMINAL
from .sql import (
    _filter_terms,
    _group_terms,
    _q_audit,
    _q_filter_count,
    _q_filter_ids,
    _q_insert_audit,
    _q_insert_retention,
    _q_logs,
    _q_retention_row,
    _q_retention_rows,
    _q_take_meta_turn,
    _q_update_retention,
)
from .validate import _as_id, _check_age, _check_int, _check_name, _to_db_time

# ---- job logs ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LogLine:
    """One line a handler stored with ``ctx.log``, as :func:`logs` returns it.

    Attributes:
        job_id: the job.
        seq: the line's number within the job, from 1, in the order the lines were written.
        attempt: the attempt that wrote it.
        at: when (aware UTC, the worker's reading of the database clock).
        message: the text (at most ``LOG_MESSAGE_CHARS`` characters).
        fields: the keyword arguments given to ``ctx.log`` (a dict; None without any).
    """

    job_id: int
    seq: int
    attempt: int
    at: _dt.datetime
    message: str
    fields: dict[str, Any] | None


def logs(engine: Engine, job_id: int, *, after: int = 0, limit: int | None = None) -> list[LogLine]:
    """A job's log lines, oldest first (empty for an unknown job, or one that never logged).

    Args:
        engine: an Engine.
        job_id: the job's id.
        after: only lines numbered above this (to page, or to follow a running job).
        limit: most lines returned (1 .. 100,000; default: LOG_LINES_PER_JOB, all a job keeps).

    Raises:
        InvalidJob: ``job_id`` is not a job id.
        ConfigError: ``after`` or ``limit`` out of range.
    """
    job_id = _as_id(job_id, "job_id")
    after = _check_int(after, "after", 0, 2**31 - 1, ConfigError)
    limit = _check_int(LOG_LINES_PER_JOB if limit is None else limit, "limit", 1, 100_000, ConfigError)
    _prepare(engine)
    with engine.connect() as conn:
        rows = conn.execute(_q_logs(job_id, after, limit)).all()
        conn.rollback()
    return [LogLine(job_id, r.seq, r.attempt, r.at.replace(tzinfo=_dt.UTC), r.message, r.fields) for r in rows]


# ---- retention by policy ----------------------------------------------------------------------
# The policy is rows of jobq_retention: "" holds the global ages, a group's row overrides them
# for the states it sets. Workers apply it (_retention_turn) on a cadence: the one whose update
# of the jobq_meta row retention_due moves it forward has the round, and deletes through
# prune's batches (control._prune_batches), a few short transactions, then stops until the next.

#: Seconds between two rounds of retention, across all workers.
RETENTION_INTERVAL = 60.0
#: Jobs deleted per transaction, and transactions per round, when workers apply retention.
RETENTION_BATCH = 500
RETENTION_BATCHES = 4
#: The shortest age a retention policy may keep a finished job.
_MIN_RETENTION = _dt.timedelta(minutes=1)
_STATE_COLUMNS = {"done": "done_s", "failed": "failed_s", "cancelled": "cancelled_s"}


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    """How long finished jobs are kept, as stored by :func:`set_retention`.

    Attributes:
        group_key: the group this row is for; None for the global policy (every group without
            its own value for a state).
        done, failed, cancelled: how long after it finished a job in that state is kept
            (a timedelta), or None: kept until pruned by hand.
        updated_at: when it was last set (aware UTC); None for a policy never stored.
    """

    group_key: str | None
    done: _dt.timedelta | None
    failed: _dt.timedelta | None
    cancelled: _dt.timedelta | None
    updated_at: _dt.datetime | None


def _retention_of(row: Any, group_key: str | None) -> RetentionPolicy:
    if row is None:
        return RetentionPolicy(group_key, None, None, None, None)
    ages = [None if v is None else _dt.timedelta(seconds=v) for v in (row.done_s, row.failed_s, row.cancelled_s)]
    return RetentionPolicy(group_key, ages[0], ages[1], ages[2], row.updated_at.replace(tzinfo=_dt.UTC))


def set_retention(engine: Engine, group_key: str | None = None, *, done: Any = None, failed: Any = None,
                  cancelled: Any = None) -> RetentionPolicy:
    """Store how long finished jobs are kept; the workers apply it (see :func:`apply_retention`).

    Arguments left None keep their stored value; :data:`UNLIMITED` removes one. Without an
    age, the global policy keeps jobs in that state until pruned by hand; a group without its
    own age for a state follows the global one. A group's age for a state overrides the
    global one for that group's jobs, longer or shorter (to keep a group's jobs for good
    while the global policy deletes, give it a long age, such as ten years). ``jobq.prune``
    still deletes by hand, whatever the policy.

    Args:
        engine: an Engine.
        group_key: a group, or None for the global policy.
        done: how long done jobs are kept: a timedelta of at least one minute (and at most
            MAX_TIMEDELTA), or :data:`UNLIMITED`.
        failed: the same for failed jobs.
        cancelled: the same for cancelled jobs.

    Returns:
        The policy as stored.

    Raises:
        ConfigError: a bad age or group; nothing is written.
    """
    scope = "" if group_key is None else _check_name(group_key, "group_key")
    new: dict[str, Any] = {}
    for state, value in (("done", done), ("failed", failed), ("cancelled", cancelled)):
        if value is UNLIMITED:
            new[_STATE_COLUMNS[state]] = None
        elif value is not None:
            age = _check_age(value, f"retention {state}")
            if age < _MIN_RETENTION:
                raise ConfigError(f"retention {state}: {age} is shorter than {_MIN_RETENTION} (the least kept)")
            new[_STATE_COLUMNS[state]] = age.total_seconds()

    def write(conn: Connection, d: _Dialect) -> Any:
        now = d.db_now(conn)
        if conn.execute(_q_update_retention(scope, {**new, "updated_at": now})).rowcount == 0:
            conn.execute(_q_insert_retention(scope, {**new, "updated_at": now}))
        return conn.execute(_q_retention_row(scope)).first()

    return _retention_of(_transaction(engine, write), group_key)


def get_retention(engine: Engine, group_key: str | None = None) -> RetentionPolicy:
    """The stored retention policy of a group (None: the global one); all None if never set.

    Raises:
        ConfigError: a bad group name.
    """
    scope = "" if group_key is None else _check_name(group_key, "group_key")
    _prepare(engine)
    with engine.connect() as conn:
        row = conn.execute(_q_retention_row(scope)).first()
        conn.rollback()
    return _retention_of(row, group_key)


def retention_policies(engine: Engine) -> list[RetentionPolicy]:
    """Every stored retention policy: the global one first (if stored), then groups by name."""
    _prepare(engine)
    with engine.connect() as conn:
        rows = conn.execute(_q_retention_rows()).all()
        conn.rollback()
    return [_retention_of(r, r.scope or None) for r in rows]


def apply_retention(engine: Engine, *, batch: int = RETENTION_BATCH, most: int | None = None,
                    now: _dt.datetime | None = None) -> int:
    """Delete the finished jobs the stored policy no longer keeps, now, through prune's batches
    (each one short transaction; a job something still needs is kept, as :func:`prune` keeps it).

    Workers call this on their own, one worker per ``RETENTION_INTERVAL`` across all of them,
    with ``most=RETENTION_BATCHES``; call it yourself to catch up at once. Two calls at once
    delete each job once.

    Args:
        batch: jobs per transaction (1 .. 100,000).
        most: transactions per (state, scope) at most; None: until nothing is left.

    Returns:
        How many jobs were deleted.
    """
    batch = _check_int(batch, "batch", 1, 100_000, ConfigError)
    if most is not None:
        most = _check_int(most, "most", 1, 1_000_000, ConfigError)
    policies = retention_policies(engine)
    base = next((p for p in policies if p.group_key is None), None)
    groups = [p for p in policies if p.group_key is not None]
    total = 0
    for state in TERMINAL:
        own: dict[_dt.timedelta, list[str]] = {}
        for p in groups:
            age = getattr(p, state)
            if age is not None:
                own.setdefault(age, []).append(p.group_key)  # type: ignore[arg-type]
        for age, keys in sorted(own.items()):
            for chunk in _chunks(sorted(keys)):
                total += _prune_batches(engine, (state,), age, batch, now=now, most=most,
                                        extra=_group_terms(list(chunk), ()))
        gage = getattr(base, state) if base is not None else None
        if gage is not None:
            besides = sorted(k for keys in own.values() for k in keys)
            total += _prune_batches(engine, (state,), gage, batch, now=now, most=most, extra=_group_terms(None, besides))
    return total


def _retention_turn(engine: Engine, interval: float = RETENTION_INTERVAL) -> int | None:
    """A worker's share of retention: take the round if it is due (one UPDATE of one jobq_meta
    row; the worker whose update counts has it, no other), then apply the policy for at most
    RETENTION_BATCHES transactions per state and scope. Returns what was deleted, or None when
    another worker has the round."""

    def take(conn: Connection, d: _Dialect) -> bool:
        now = d.db_now(conn)
        until = now + _dt.timedelta(seconds=interval)
        return bool(conn.execute(_q_take_meta_turn(_RETENTION_DUE_KEY, _turn_text(now), _turn_text(until))).rowcount)

    if not _transaction(engine, take):
        return None
    _checkpoint("retention_turn")
    return apply_retention(engine, most=RETENTION_BATCHES)


def _turn_text(t: _dt.datetime) -> str:
    """A time as jobq_meta's retention row holds it: fixed-width ISO text, which sorts as time."""
    return t.replace(tzinfo=None).isoformat(timespec="microseconds")


# ---- bulk actions by filter, and their audit log ----------------------------------------------
# A bulk action reads the matching ids in batches (id order, no locks) and applies the one-job
# operation to each (control.retry, control.cancel: each its own short transaction, with every
# fence and DAG rule of the single call), or prune's batches for prune. A job that changed
# between the read and its turn is skipped (retry refuses a job no longer failed; cancel leaves
# a finished job as it is). Each action that ran is one row of jobq_audit.

#: The actions :func:`bulk` takes, with the states each may touch and the default.
BULK_ACTIONS = {"retry": (("failed", "cancelled"), ("failed",)),
                "cancel": (("waiting", "ready", "leased", "running", "held"), ("waiting", "ready")),
                "prune": (TERMINAL, ("done",))}


@dataclasses.dataclass(frozen=True)
class BulkResult:
    """What :func:`bulk` did.

    Attributes:
        action: "retry", "cancel" or "prune".
        matched: jobs that matched the filter when the action began (the ``--dry-run`` count).
        applied: jobs retried, cancelled (or asked to stop, if running) or deleted; 0 for a
            dry run.
        skipped: matched jobs left alone: changed meanwhile, refused by the one-job rules (a
            retry whose upstream is still failed), or kept by prune because something needs them.
        reopened: for retry, every job re-opened, dependents and containers included.
        dry_run: True when nothing was changed.
    """

    action: str
    matched: int
    applied: int
    skipped: int
    reopened: int
    dry_run: bool


@dataclasses.dataclass(frozen=True)
class AuditEntry:
    """One audited action, as :func:`audit_log` returns it: ``at`` (aware UTC), ``actor`` (who),
    ``action``, ``filter`` and ``count``. For a bulk action ("retry", "cancel", "prune"),
    ``filter`` is its filter as JSON (states, type, group, since, until, error) and ``count``
    the jobs it applied to; for the dashboard's changes ("group_policy", "group_pause",
    "group_resume", "schedule_pause", "schedule_resume"), ``filter`` names the group or the
    schedule and the values set, and ``count`` is 1."""

    id: int
    at: _dt.datetime
    actor: str
    action: str
    filter: dict[str, Any]
    count: int


@dataclasses.dataclass(frozen=True)
class _Filter:
    states: tuple[str, ...]
    type: str | None
    group: str | None
    since: _dt.datetime | None
    until: _dt.datetime | None
    error: str | None

    def as_json(self) -> dict[str, Any]:
        return {"states": list(self.states), "type": self.type, "group": self.group, "error": self.error,
                "since": None if self.since is None else _turn_text(self.since) + "Z",
                "until": None if self.until is None else _turn_text(self.until) + "Z"}


def _bulk_filter(action: str, states: Any, type: Any, group: Any, since: Any, until: Any, error: Any) -> _Filter:
    if action not in BULK_ACTIONS:
        raise ConfigError(f"bulk: action must be one of {sorted(BULK_ACTIONS)}, got {action!r}")
    allowed, default = BULK_ACTIONS[action]
    if states is None:
        states = default
    if isinstance(states, str) or not isinstance(states, (list, tuple)) or not states:
        raise ConfigError(f"bulk {action}: states must be a non-empty list of states, got {states!r}")
    bad = [s for s in states if s not in allowed]
    if bad:
        done = {"retry": "retried", "cancel": "cancelled", "prune": "pruned"}[action]
        raise ConfigError(f"bulk {action}: only jobs in {', '.join(allowed)} can be {done}, not {bad}")
    times = []
    for value, what in ((since, "since"), (until, "until")):
        try:
            times.append(None if value is None else _to_db_time(value, f"bulk {what}"))
        except InvalidJob as exc:
            raise ConfigError(str(exc)) from None
    if times[0] is not None and times[1] is not None and times[0] >= times[1]:
        raise ConfigError(f"bulk {action}: since ({since}) must be before until ({until})")
    if error is not None and (not isinstance(error, str) or not 1 <= len(error) <= 200 or "\x00" in error):
        raise ConfigError(f"bulk {action}: error must be text of 1 to 200 characters (no NUL), got {error!r}")
    names = [None if v is None else _config_name(v, f"bulk {what}") for v, what in ((type, "type"), (group, "group"))]
    return _Filter(tuple(dict.fromkeys(states)), names[0], names[1], times[0], times[1], error)


def _config_name(value: Any, what: str) -> str:
    try:
        return _check_name(value, what)
    except InvalidJob as exc:
        raise ConfigError(str(exc)) from None


def bulk(engine: Engine, action: str, *, states: Sequence[str] | None = None, type: str | None = None,
         group: str | None = None, since: _dt.datetime | None = None, until: _dt.datetime | None = None,
         error: str | None = None, dry_run: bool = False, actor: str = "api", batch: int = 500) -> BulkResult:
    """Retry, cancel or prune every job that matches a filter, in bounded batches.

    The filter's terms all apply: ``states``, the job ``type``, the ``group``, created in
    [``since``, ``until``) and ``error`` (text the job's current error contains, ignoring the
    case of ASCII letters). ``retry`` and ``cancel`` apply :func:`jobq.retry` /
    :func:`jobq.cancel` to each matching job in turn, each its own short transaction, so every
    rule of the single call holds: a retried job re-opens the dependents it closed, a cancelled
    job closes its dependents, a running job is asked to stop and ends cancelled. ``prune``
    deletes as :func:`jobq.prune` does (whatever the age), keeping jobs something still needs.
    A job that changed since the filter read it is skipped. Each action that ran (not a dry
    run) is recorded in the audit log (:func:`audit_log`).

    Args:
        action: "retry", "cancel" or "prune".
        states: the states to match; each action takes only its own (retry: failed,
            cancelled; cancel: waiting, ready, leased, running, held; prune: done, failed,
            cancelled). Default: failed; waiting and ready; done.
        type: a job type, matched exactly.
        group: a group key, matched exactly.
        since: an aware datetime: jobs created at or after it.
        until: an aware datetime: jobs created before it.
        error: 1-200 characters.
        dry_run: count the matching jobs, change nothing, record nothing.
        actor: who asks (recorded in the audit log), 1-200 characters.
        batch: ids read per batch (1 .. 10,000).

    Returns:
        A :class:`BulkResult`.

    Raises:
        ConfigError: a bad action or filter (one line, saying which); nothing is changed.
    """
    f = _bulk_filter(action, states, type, group, since, until, error)
    actor = _config_name(actor, "actor")
    batch = _check_int(batch, "batch", 1, 10_000, ConfigError)
    if not isinstance(dry_run, bool):
        raise ConfigError(f"bulk {action}: dry_run must be True or False, got {dry_run!r}")
    _prepare(engine)
    with engine.connect() as conn:
        matched = int(conn.execute(_q_filter_count(f)).scalar() or 0)
        conn.rollback()
    if dry_run:
        return BulkResult(action, matched, 0, 0, 0, True)
    applied = reopened = 0
    if action == "prune":
        applied = _prune_batches(engine, f.states, _dt.timedelta(0), batch, extra=_filter_terms(f))
    else:
        after = 0
        while True:
            with engine.connect() as conn:
                ids = list(conn.execute(_q_filter_ids(f, after, batch)).scalars())
                conn.rollback()
            if not ids:
                break
            after = ids[-1]
            for jid in ids:
                _checkpoint("bulk_one", jid)
                try:
                    if action == "retry":
                        reopened += len(retry(engine, jid))
                        applied += 1
                    elif cancel(engine, jid) not in ("done", "failed"):  # finished meanwhile: skipped
                        applied += 1
                except InvalidJob:
                    pass  # changed meanwhile, deleted, or refused by the one-job rules: skipped
    skipped = max(0, matched - applied)

    _transaction(engine, lambda conn, d: _record_audit(conn, d, actor, action, f.as_json(), applied))
    logger.info("bulk %s by %s: %d of %d matching job(s)", action, actor, applied, matched,
                extra={"action": f"bulk_{action}"})
    return BulkResult(action, matched, applied, skipped, reopened, False)


def _record_audit(conn: Connection, d: _Dialect, actor: str, action: str, details: dict[str, Any], count: int) -> None:
    """One row of the audit log, in the caller's transaction (so it commits with the change it
    records): ``details`` is what the action applied to (a bulk filter, a group's new policy)."""
    conn.execute(_q_insert_audit(d.db_now(conn), actor, action, details, count))


def audit_log(engine: Engine, *, limit: int = 100) -> list[AuditEntry]:
    """The newest audit entries first (at most ``limit``, 1 .. 10,000): bulk actions, and the
    dashboard's changes to a group's policy and to schedules.

    Raises:
        ConfigError: a bad limit.
    """
    limit = _check_int(limit, "limit", 1, 10_000, ConfigError)
    _prepare(engine)
    with engine.connect() as conn:
        rows = conn.execute(_q_audit(limit)).all()
        conn.rollback()
    return [AuditEntry(m["id"], m["at"].replace(tzinfo=_dt.UTC), m["actor"], m["action"], m["filter"], m["count"])
            for m in (r._mapping for r in rows)]

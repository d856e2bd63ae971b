"""Errors, events and the few helpers every module uses: the exceptions, the Event record and
the "jobq" logger, the crash-test checkpoint, the package version."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .policy import _K


__version__ = "0.1.0"


# jobq logs one record per job transition on the "jobq" logger, with flat `extra` keys
# (action, job_id, type, group, attempt, worker_id, duration_s). Args, results and database
# URLs are never logged. A Worker's `on_event` hook receives the same information as an Event.

#: The library logger. jobq adds only a NullHandler; configure it in your application.
logger = logging.getLogger("jobq")
logger.addHandler(logging.NullHandler())

#: The current span's W3C traceparent, read by every new job row while trace propagation is on
#: (jobq.propagate_trace_context sets it; empty: nothing read, nothing stored, no import).
_TRACE_CONTEXT: list[Callable[[], str | None]] = []

#: Every action an Event can carry, in rough lifecycle order.
EVENT_ACTIONS = (
    "claimed",
    "started",
    "finished",
    "failed",
    "retried",
    "reclaimed",
    "lease_lost",
    "timed_out",
    "released",
    "cancelled",
    "suspended",
    "snoozed",
    "db_error",
)


@dataclasses.dataclass(frozen=True)
class Event:
    """One job transition, as passed to ``Worker(on_event=...)`` and logged on ``jobq``.

    Attributes:
        action: one of ``EVENT_ACTIONS``.
        job_id: the job concerned (0 for worker-level events such as ``db_error``).
        type: the job's type, or "" when unknown.
        group: the job's group key, or "".
        attempt: the attempt number this dispatch runs as (1-based), or 0.
        worker_id: the worker that saw the transition.
        duration_s: handler run time for finished/failed/timed_out, else None.
        error: a one-line error summary for failures, else None.
    """

    action: str
    job_id: int
    type: str = ""
    group: str = ""
    attempt: int = 0
    worker_id: str = ""
    duration_s: float | None = None
    error: str | None = None


_WARN_ACTIONS = frozenset(("failed", "lease_lost", "timed_out", "db_error"))


def _emit(hook: Callable[[Event], None] | None, ev: Event) -> None:
    # "claimed" is DEBUG: the same worker logs "started" for the job a moment later.
    level = logging.WARNING if ev.action in _WARN_ACTIONS else logging.DEBUG if ev.action == "claimed" else logging.INFO
    if logger.isEnabledFor(level):
        _log(level, ev)
    if hook is not None:
        try:
            hook(ev)
        except Exception:  # a metrics hook must never take the worker down
            logger.exception("on_event hook raised for %s", ev.action)


def _log(level: int, ev: Event) -> None:
    logger.log(
        level,
        "%s job=%s type=%s attempt=%s%s",
        ev.action,
        ev.job_id,
        ev.type,
        ev.attempt,
        f" error={ev.error}" if ev.error else "",
        extra={
            "action": ev.action,
            "job_id": ev.job_id,
            "type": ev.type,
            "group": ev.group,
            "attempt": ev.attempt,
            "worker_id": ev.worker_id,
            "duration_s": ev.duration_s,
        },
    )


# The docstring of each class doubles as its default message.


class JobqError(Exception):
    """jobq failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class UnsupportedDatabase(JobqError):
    """This database or server version is not supported by jobq."""


class LeaseLost(JobqError):
    """This dispatch no longer holds the job's lease; nothing was written."""


class InvalidJob(JobqError, ValueError):
    """The job definition was rejected; nothing was written."""


class ConfigError(JobqError, ValueError):
    """A worker or queue option is invalid."""


class UniqueKeyHeld(InvalidJob):
    """A unique key belongs to a job another running handler is spawning; nothing was written.

    That job is ``held``: it exists only if its spawner's result commits, and it is deleted if
    the spawner fails. The key is neither handed out nor free until then, so the enqueue,
    submit, ``ctx.enqueue`` or ``ctx.submit`` that named it is refused at once (it never
    waits for the other handler). Retry later: the key then names the released job (and the
    call returns its id, as for any unfinished holder), or is free again.

    Attributes:
        key: the unique key.
        job_id: the held job that holds it.
        spawned_by: the job whose running handler spawned it.
    """

    def __init__(self, key: str, job_id: int, spawned_by: int) -> None:
        self.key, self.job_id, self.spawned_by = key, job_id, spawned_by
        super().__init__(f"unique_key {key!r} belongs to job {job_id}, which the running handler of job {spawned_by} "
                         "is spawning: it exists only if that handler's result commits. Retry later")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.job_id, self.spawned_by))


class NoRetry(JobqError):
    """Raised by a handler: fail the job now, whatever attempts it has left.

    The attempt ends ``failed`` with this error (its class and ``reason``) as the job's error,
    and the job's dependents close as after any final failure. Nothing else ends a job this
    way: a lost lease or a timeout is never taken for it, and a handler whose lease is gone
    has its ``NoRetry`` discarded with its other outcomes.

    Attributes:
        reason: why the job cannot succeed (the error's message).
    """

    def __init__(self, reason: str = "the handler gave up: not retried") -> None:
        self.reason = reason
        super().__init__(reason)


def _utcnow() -> _dt.datetime:
    return _dt.datetime.now(_dt.UTC).replace(tzinfo=None)


# ---- settle: the event-driven DAG bookkeeping --------------------------------------------------


def _chunks(items: Sequence[_K], size: int = 500) -> Iterable[Sequence[_K]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


# One loop, written once: the loops (run, run_until_idle, the gather after a finish, the drain
# at a stop) are generators of steps, and a runner executes the steps. A step is a callable
# (database work: called in the loop's thread by Worker, through the greenlet bridge by
# AsyncWorker), a float (wait up to that many seconds for a wake-up), or, for AsyncWorker
# only, an awaitable. Worker and AsyncWorker differ only in how they run steps, start a
# dispatch and stop a stuck one.


def _checkpoint(point: str, job_ids: Sequence[int] = ()) -> None:
    """A no-op the worker calls at its crash-relevant points; crash tests replace it.

    Points: "claimed" (leases committed, before dispatch), "handler_returned" (in the handler's
    thread, before the outcome is queued), "finalize_before_commit" (inside the finalize
    transaction), "finalized" (after it committed); prune's "prune_read" (a batch read without
    locks) and "prune_locked" (the batch locked and checked again, before its delete), both
    inside its transaction (the race tests replace it); "retention_turn" (a worker took the
    round of retention, before its batches); "unique_keys_read" (enqueue, submit and
    spawns with unique keys: the keys looked up, their holders locked, before the insert,
    inside its transaction; job_ids are the holders found); "suspend_checked" (a suspension
    waiting for a signal: the key's row locked and read, before the job is written) and
    "wait_timeout_checked" (ctx.wait_for past its timeout: the key's row locked and read, before
    the timeout is recorded), both inside their transaction.
    """


class WaitTimeout(JobqError):
    """``ctx.wait_for(key, timeout)``: no signal of the key came before the timeout.

    Raised by the re-run of the handler that waited, at that same ``wait_for`` call, and by
    every later re-run's: once a wait has timed out, a signal that comes later does not change
    what it answers.

    Attributes:
        key: the signal key waited for.
    """

    def __init__(self, key: str) -> None:
        super().__init__(f"no signal {key!r} came before the wait's timeout")
        self.key = key


@dataclasses.dataclass(frozen=True)
class _Suspension:
    """What a suspending handler asks for (carried by _Unwind, through a handler process's pipe
    too): kind "signal" (``name`` the key), "sleep" (a relative ctx.sleep: ``name``), "until"
    (ctx.sleep_until) or "snooze"; ``until`` the wake-up (naive UTC, database clock; None: only
    a signal wakes it), ``since`` when the wait began, ``delay`` and ``limit`` a snooze's."""

    kind: str
    name: str = ""
    until: _dt.datetime | None = None
    since: _dt.datetime | None = None
    delay: float = 0.0
    limit: int = 0


class _Unwind(BaseException):  # noqa: N818 - not an error: the way out of a suspending handler
    """Ends a dispatch so that the job runs again later, without charging an attempt. A
    BaseException, so that a handler's ``except Exception`` cannot swallow it; the worker that
    catches it writes the suspension (fenced by the lease, like a finalize)."""

    def __init__(self, intent: _Suspension) -> None:
        super().__init__(intent.kind)
        self.intent = intent


class Snooze(_Unwind):
    """Raise ``jobq.Snooze(seconds)`` in a handler to run the job again after ``seconds``,
    without charging an attempt (its checkpoint is kept; its spawned jobs are discarded, as
    with any end other than a result).

    A job may snooze at most ``limit`` times over its life (default ``Snooze.DEFAULT_LIMIT``,
    100): the snooze after that fails the job (as a final failure: its dependents fail too)
    with an error saying so, so that a job that snoozes forever ends. Like every suspension
    it is a ``BaseException``: a handler's ``except Exception`` does not catch it.

    Args:
        seconds: the delay, a finite number of seconds >= 0.
        limit: the most snoozes this job may make (an int >= 1); the count is the job's.

    Raises:
        ValueError: a bad ``seconds`` or ``limit`` (raised where Snooze is made).
    """

    #: The snoozes a job may make when ``limit`` is not given.
    DEFAULT_LIMIT = 100

    def __init__(self, seconds: float, *, limit: int | None = None) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 1000 * 366 * 86400:
            raise ValueError(f"Snooze seconds must be a number of seconds in 0 .. 366000 days, got {seconds!r}")
        limit = self.DEFAULT_LIMIT if limit is None else limit
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 2**31 - 1:
            raise ValueError(f"Snooze limit must be an int >= 1, got {limit!r}")
        super().__init__(_Suspension("snooze", delay=float(seconds), limit=limit))
        self.seconds = float(seconds)
        self.limit = limit

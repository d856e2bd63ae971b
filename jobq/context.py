"""What a running handler sees (JobContext) and the worker's options (WorkerOptions), with the
process executor's plumbing."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import json
import os
import signal as _os_signal
import socket
import sys
import threading
import time
import traceback
import types
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from .base import ConfigError, Event, InvalidJob, JobqError, LeaseLost, NoRetry, WaitTimeout, _Unwind, _utcnow
from .claiming import Lease, _check_rate_limits
from .drivers import _local_clock, _prepare
from .jobs import _JOB_FIELD_NAMES, _ONE, _Plan, _plan
from .outcomes import _ERROR_LIMIT
from .policy import backoff
from .schema import LOG_FIELDS_BYTES, LOG_MESSAGE_CHARS
from .sql import _Outcome
from .validate import (
    _MAX_DELAY,
    _MAX_SLOTS,
    _check_int,
    _check_json,
    _check_name,
    _check_number,
    _check_seconds,
    _encode_checked,
    _to_db_time,
    _type_name,
)

_CTX_LOCK = threading.Lock()


class JobContext:
    """What a handler receives: the job, ways to learn that it should stop, and ways to add
    work atomically with its result (:meth:`enqueue`, :meth:`submit`).

    Attributes:
        id, type, args, attempt, max_attempts, group_key, parent_id: the job as claimed.
        worker_id: the worker running it.
        state: the job's last stored checkpoint (a dict; None on a fresh job): what a rerun
            after a crash, a reclaim, a timeout or a retry resumes from. ``checkpoint`` updates it.
    """

    def __init__(self, lease: Lease, worker: Any = None) -> None:
        self.id = lease.id
        self.type = lease.type
        self.args = lease.args
        self.attempt = lease.attempt
        self.max_attempts = lease.max_attempts
        self.group_key = lease.group_key
        self.parent_id = lease.parent_id
        self.worker_id = lease.worker_id
        self._stop: Any = None  # a threading.Event, made when first needed (most handlers never wait)
        self._reason: str | None = None
        self.state: dict[str, Any] | None = lease.checkpoint
        self._token = lease.token
        # How checkpoint() stores (set by the runner: a transaction, a pipe to the parent, or a
        # coroutine for AsyncWorker) and the progress the next heartbeat carries.
        self._save: Callable[[JobContext, dict[str, Any]], Any] | None = None
        self._progress: dict[str, Any] | None = None
        self._progress_sent: dict[str, Any] | None = None  # the report the last heartbeat wrote
        self._report: Callable[[dict[str, Any]], None] | None = None  # a process handler's pipe
        #: Inserts a checked _Plan held under this dispatch's lease; set by the worker (or, in a
        #: handler process, a call through the pipe to it).
        self._spawner: Callable[[_Plan], dict[str, int]] | None = None
        #: Reads the upstreams' results (ctx.upstream): set by the runner, called on first access only.
        self._read_upstream: Callable[[JobContext], dict[int, Any]] | None = None
        self._upstream: Mapping[int, Any] | None = None

        #: Answers a wait (waits._wait_answer) for this dispatch: the worker's transaction, or a
        #: call through the pipe to it from a handler process.
        self._waits: Callable[[tuple[Any, ...]], tuple[str, Any]] | None = None
        #: Writes one ctx.log line (the worker's _store_log, or a call through the pipe to it).
        self._logger: Callable[[JobContext, str, Any], bool] | None = None
        self._log_seq: int | None = None  # the job's last log line number, once read
        self._sleeps = 0  # ctx.sleep calls without a name in this dispatch: the next one's number

    @property
    def upstream(self) -> Mapping[int, Any]:
        """The results of this job's direct upstreams (the jobs it depends on), by upstream job id.

        Read from the database when a handler first asks, in one short read of its own, and kept
        for the rest of the dispatch: a handler that never asks costs no query. Every upstream
        is done when its dependent runs, so each value is that job's final result (a dict, or
        None when its handler returned None). For jobs made with :func:`jobq.submit`, the ids
        are those ``submit`` returned for the items' keys. A read-only mapping; empty for a job
        without upstreams. In an :class:`AsyncWorker` the read runs through the greenlet
        bridge, as ``ctx.enqueue`` does: no ``await``.

        Raises:
            JobqError: not the context a worker passed to a handler.
        """
        if self._upstream is None:
            if self._read_upstream is None:
                raise JobqError("ctx.upstream needs the context a Worker passes to its handler")
            self._upstream = types.MappingProxyType(self._read_upstream(self))
        return self._upstream

    def _event(self) -> Any:
        if self._stop is None:
            with _CTX_LOCK:
                if self._stop is None:
                    self._stop = threading.Event()
        return self._stop

    def _signal(self, reason: str) -> None:
        if self._reason is None:
            self._reason = reason
        self._event().set()

    @property
    def stop_requested(self) -> bool:
        """True once the handler should stop: lease lost, timed out, cancelled or worker stopping."""
        return self._stop is not None and self._stop.is_set()

    @property
    def stop_reason(self) -> str | None:
        """Why ``stop_requested`` is set: "lease_lost", "timed_out", "cancelled" or "shutdown"."""
        return self._reason

    @property
    def lease_lost(self) -> bool:
        """True when this dispatch no longer holds the lease: its result will be discarded."""
        return self._reason == "lease_lost"

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; return True early if the handler should stop."""
        return bool(self._event().wait(seconds))

    def checkpoint(self, state: dict[str, Any]) -> Any:
        """Durably store ``state`` for this job now; later dispatches start with it as ``ctx.state``.

        One short transaction per call (see docs/guides/long-running.md, "Checkpoints", for how often), fenced by
        this dispatch's lease: nothing is written once the lease is lost.

        Args:
            state: a JSON object (the same rules as ``args``); replaces the previous checkpoint.

        Returns:
            None. In an :class:`AsyncWorker` an awaitable: ``await ctx.checkpoint(state)``.

        Raises:
            InvalidJob: ``state`` is not a JSON object within the limits; nothing is written.
            LeaseLost: this dispatch no longer holds the job's lease; nothing is written.
        """
        if not isinstance(state, dict):
            raise InvalidJob(f"checkpoint must be a JSON object (a dict), got {_type_name(state)}")
        state = _encode_checked(state, "checkpoint")
        if self._save is None:
            raise JobqError("this JobContext belongs to no running dispatch: nothing to checkpoint")
        return self._save(self, state)

    def progress(self, done: float, total: float | None = None, message: str | None = None) -> None:
        """Report how far the handler is; ``get``, ``jobq show``, ``jobq status`` and ``why`` show it
        within one heartbeat interval. No transaction: the next heartbeat (or ``checkpoint``)
        carries the latest report; earlier ones are dropped. The last one written is kept on
        the job when it finishes (a report made after the last heartbeat or checkpoint is not).

        Args:
            done: work done so far (a finite number >= 0).
            total: the whole amount, if known (a finite number >= 0).
            message: a short note (at most 200 characters).

        Raises:
            InvalidJob: a bad value.
        """
        for value, what in ((done, "done"), (total, "total")):
            if value is None and what == "total":
                continue
            _check_number(value, f"progress {what}", 0, sys.float_info.max)
        if message is not None and (not isinstance(message, str) or len(message) > 200):
            raise InvalidJob(f"progress message must be a string of at most 200 characters, got {message!r}")
        self._progress = _check_json({"done": done, "total": total, "message": message}, "progress")
        if self._report is not None:
            self._report(self._progress)

    def log(self, message: str, **fields: Any) -> bool:
        """Store a log line for this job, with this attempt's number and the time; read them
        with :func:`jobq.logs`, ``jobq logs ID`` or the dashboard's job page.

        One short transaction per line, of its own: it locks no job row (a claim never waits
        for it) and is not fenced (a line written by a dispatch that lost its lease is kept,
        with its attempt number). A job keeps at most ``LOG_LINES_PER_JOB`` (1000) lines over
        all its attempts; later lines are refused: nothing is written and this returns False.
        The lines are deleted with the job (:func:`jobq.prune`, retention). A handler that
        never logs costs nothing. In an :class:`AsyncWorker`, call it without ``await``.

        Args:
            message: the line; longer than ``LOG_MESSAGE_CHARS`` (2000) characters, it is cut
                to that length.
            **fields: JSON values stored with the line (at most ``LOG_FIELDS_BYTES``, 4096
                bytes as JSON).

        Returns:
            True when the line was stored, False when the job already has its limit of lines.

        Raises:
            InvalidJob: ``message`` is not a string, or a field is not JSON within the limits
                (NUL characters, lone surrogates, NaN...); nothing is written.
            JobqError: not the context a worker passed to a handler.
        """
        if not isinstance(message, str):
            raise InvalidJob(f"ctx.log message must be a string, got {_type_name(message)}")
        message = _check_json(message[:LOG_MESSAGE_CHARS], "log message")
        stored: Any = None
        if fields:
            stored = _check_json(fields, "log fields")
            size = len(json.dumps(stored, allow_nan=False, separators=(",", ":")).encode("utf-8"))
            if size > LOG_FIELDS_BYTES:
                raise InvalidJob(f"log fields: {size} bytes as JSON, more than LOG_FIELDS_BYTES={LOG_FIELDS_BYTES}")
        if self._logger is None:
            raise JobqError("ctx.log needs the context a Worker passes to its handler")
        return self._logger(self, message, stored)

    def enqueue(self, type: str, args: Mapping[str, Any] | None = None, **kw: Any) -> int:
        """Spawn a job that exists only if this dispatch's result commits.

        Takes :func:`jobq.enqueue`'s arguments (after the target), with the same checks. The job
        is written at once, ``held`` under this dispatch's lease: nothing claims it, and the
        finalize that writes this handler's result releases it (to ``ready``/``waiting``) in the
        same transaction. If the handler raises, times out, is cancelled or loses its lease, or
        the worker dies (its lease is reclaimed), the job is deleted and never runs. Its id is
        real: put it in the result, or name it in later spawns' ``depends_on``/``parent``.
        ``depends_on=[ctx.id]`` runs it after this job; ``parent=ctx.parent_id`` adds it to this
        job's container, which then cannot roll up before it finishes.

        Each call is one short transaction (it locks this job's row); spawn many at once with
        :meth:`submit`.

        Returns:
            The new job's id.

        Raises:
            InvalidJob: bad input, as :func:`jobq.enqueue` (also: naming a held job of another
                dispatch). Nothing is written.
            UniqueKeyHeld: the ``unique_key`` belongs to a held job of another dispatch.
            LeaseLost: this dispatch no longer holds its lease, or the job was cancelled.
            JobqError: not a worker's context.
        """
        unknown = set(kw) - set(_JOB_FIELD_NAMES)
        if unknown or "type" in kw or "args" in kw:
            raise InvalidJob(f"ctx.enqueue: unknown or repeated arguments {sorted(unknown | ({'type', 'args'} & set(kw)))}")
        return self._spawn(_plan([{"type": type, "args": args, **kw}], single=True))[_ONE]

    def submit(self, jobs: Sequence[Mapping[str, Any]]) -> dict[str, int]:
        """Spawn a whole DAG (the items of :func:`jobq.submit`) held as :meth:`enqueue` holds one
        job: one transaction, released with this dispatch's result or deleted with it.

        Returns:
            key -> new job id.

        Raises:
            InvalidJob: a bad item, as :func:`jobq.submit`. Nothing is written.
            UniqueKeyHeld: an item's ``unique_key`` belongs to a held job of another dispatch.
            LeaseLost: this dispatch no longer holds its lease, or the job was cancelled.
            JobqError: not a worker's context.
        """
        return self._spawn(_plan(jobs, single=False))

    def wait_for(self, key: str, timeout: float | None = None) -> Any:
        """Wait for the signal ``key`` (sent with :func:`jobq.signal`) without holding a slot.

        If the signal was sent (before this job waited, or while it was suspended), return its
        payload at once. Otherwise the dispatch suspends: the handler is unwound (by a
        ``BaseException``, which ``except Exception`` does not catch; let it pass), the lease
        and the slot are released, the checkpoint is kept and no attempt is charged. The job
        runs again from the top when the signal comes, and this call then returns the payload.
        Code before it runs again on every re-run: keep it idempotent, or behind a checkpoint.

        Args:
            key: the signal's name, 1-200 characters.
            timeout: seconds from the first wait for this key by this job (a re-run keeps that
                deadline); None waits for ever.

        Returns:
            The signal's payload (any JSON value).

        Raises:
            WaitTimeout: in the re-run after the timeout passed with no signal (and in every
                later re-run: a signal sent after the timeout is not seen by this job).
            InvalidJob: a bad key or timeout.
            LeaseLost: this dispatch no longer holds the job's lease.
        """
        key = _check_name(key, "signal key")
        if timeout is not None:
            timeout = _check_number(timeout, "wait_for timeout", 0, _MAX_DELAY)
        kind, value = self._wait(("signal", key, timeout))
        if kind == "value":
            return value
        if kind == "timeout":
            raise WaitTimeout(key)
        raise _Unwind(value)

    def sleep_until(self, when: _dt.datetime) -> None:
        """Suspend until ``when`` (an aware datetime, by the database's clock) without holding a
        slot; return at once when it has passed. The dispatch suspends as in :meth:`wait_for`
        (lease and slot released, checkpoint kept, no attempt charged); the job runs again from
        the top at ``when``, where this call returns at once.

        Raises:
            InvalidJob: ``when`` is not an aware datetime within 1970 .. 9999.
        """
        until = _to_db_time(when, "sleep_until")
        kind, value = self._wait(("until", until))
        if kind == "suspend":
            raise _Unwind(value)

    def sleep(self, seconds: float, name: str | None = None) -> None:
        """Suspend for ``seconds`` counted from this job's first call of this sleep, without
        holding a slot (as :meth:`sleep_until`). The end is stored with the job, so a re-run
        from the top (after the sleep, a retry or a crash) does not start it over: once passed,
        this call returns at once, in that re-run and every later one.

        Args:
            seconds: how long, a finite number >= 0 (0 returns at once).
            name: names the sleep within the job. Without it, the sleeps are told apart by
                their order: the n-th nameless ``sleep`` of a dispatch is the n-th of every
                re-run (a handler that sleeps in a different order on a re-run should name them).

        Raises:
            InvalidJob: a bad ``seconds`` or ``name``.
        """
        seconds = _check_number(seconds, "sleep seconds", 0, _MAX_DELAY)
        if name is None:
            name = f"#{self._sleeps}"
            self._sleeps += 1
        else:
            name = _check_name(name, "sleep name")
        kind, value = self._wait(("sleep", name, seconds))
        if kind == "suspend":
            raise _Unwind(value)

    def _wait(self, op: tuple[Any, ...]) -> tuple[str, Any]:
        # A worker's dispatch answers through its _Running (the spawner too): no callable made per job.
        waits = self._waits or getattr(self._spawner, "wait", None)
        if waits is None:
            raise JobqError("waiting needs the context a Worker passes to its handler")
        return waits(op)  # type: ignore[no-any-return]

    def _spawn(self, plan: _Plan) -> dict[str, int]:
        if self._spawner is None:
            raise JobqError("spawning needs the context a Worker passes to its handler")
        return self._spawner(plan)

    def __repr__(self) -> str:
        return f"JobContext(id={self.id}, type={self.type!r}, attempt={self.attempt})"


_NO_IDS: frozenset[int] = frozenset()


class _Running:
    """One dispatch in this worker: a claimed job's lease, its context and its handler's state.

    A plain class with slots, its key computed once: a claim makes one per job, and each
    object a job allocates is one more for the garbage collector's young generations to walk
    while the job runs (a no-op drain spent 14% of its time there, with nine per job).
    """

    __slots__ = ("lease", "ctx", "key", "started", "deadline", "last_beat", "thread", "process", "abandoned",
                 "returned", "size", "spawned", "own", "write_failures", "_worker")

    def __init__(self, lease: Lease, ctx: JobContext, started: float, deadline: float | None, last_beat: float,
                 worker: Any) -> None:
        self.lease = lease
        self.ctx = ctx
        # A dispatch, not a job: the same worker may hold attempt 1 (lease lost, handler still
        # going) and attempt 2 of one job at once. Leases of one claim share a token.
        self.key: tuple[str, int] = (lease.token, lease.id)
        self.started = started  # monotonic
        self.deadline = deadline  # monotonic
        self.last_beat = last_beat  # monotonic time of the last successful heartbeat (or the claim)
        self.thread: threading.Thread | None = None
        self.process: Any = None  # the handler's process, with the process executor
        self.abandoned = False  # released (timed out / shutdown / lease lost) while its handler still ran
        self.returned = False  # the handler thread has finished
        self.size = 0  # bytes of its encoded result, once returned
        self.spawned = False  # the handler called ctx.enqueue/submit: its held jobs go with its outcome
        self.own: frozenset[int] = _NO_IDS  # ids it spawned
        self.write_failures = 0  # writes of its outcome that failed while the database was up
        self._worker = worker

    def __call__(self, plan: _Plan) -> dict[str, int]:
        """The context's spawner (ctx.enqueue/submit): the worker inserts ``plan`` held under this
        dispatch's lease."""
        return self._worker._spawn(self, plan)  # type: ignore[no-any-return]

    def wait(self, op: tuple[Any, ...]) -> tuple[str, Any]:
        """The context's ctx.wait_for/sleep/sleep_until: the worker reads the wait under this
        dispatch's lease."""
        return self._worker._wait_op(self, op)  # type: ignore[no-any-return]


@dataclasses.dataclass
class _Batch:
    """Finished handlers taken from the queue, turned into what one transaction writes."""

    raw: list[tuple[_Running, str, Any]]
    outcomes: list[_Outcome] = dataclasses.field(default_factory=list)
    keep: list[tuple[_Running, str, Any]] = dataclasses.field(default_factory=list)  # event per run, in order
    freed: list[_Running] = dataclasses.field(default_factory=list)  # abandoned runs whose slot is freed


class _Clock:
    """The database's clock, read once in a while and carried forward on the monotonic clock,
    so a jump of this machine's wall clock cannot expire or stretch a lease.

    On SQLite the database's clock *is* this machine's wall clock, read afresh every time: a
    jump of it is a jump of the database's time, seen by every process at once. Carried
    forward, it would leave each worker on its own clock until its next refresh, and a worker
    that had not yet seen a backward jump would reclaim the fresh leases of one that had, and
    postpone their jobs by the size of the jump (tests/crash/test_clock.py)."""

    def __init__(self, engine: Engine, refresh: float = 60.0) -> None:
        self._engine = engine
        self._refresh = refresh
        self._anchor: tuple[_dt.datetime, float] | None = None
        self._wall = _local_clock(engine)

    def now(self) -> _dt.datetime:
        if self._wall:
            return _utcnow()
        m = time.monotonic()
        if self._anchor is None or m - self._anchor[1] > self._refresh:
            d = _prepare(self._engine)
            with self._engine.connect() as conn:
                before = time.monotonic()
                db = d.db_now(conn)
                after = time.monotonic()
                conn.rollback()
            self._anchor = (db, (before + after) / 2)  # off by at most half the round trip
            return self._anchor[0] + _dt.timedelta(seconds=time.monotonic() - self._anchor[1])
        return self._anchor[0] + _dt.timedelta(seconds=m - self._anchor[1])


#: Seconds after a notified tick before the loop looks again (see Worker._run_steps).
_NOTIFY_RECHECK = 0.2


def _worker_id() -> str:
    return f"{socket.gethostname()[:80]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _pipe_wait(conn: Any, op: tuple[Any, ...]) -> tuple[str, Any]:
    # In a handler process: the parent's handler thread reads the wait (one engine, one fence).
    conn.send(("wait", op))
    kind, value = conn.recv()
    if kind == "raise":
        raise value
    return kind, value


def _pipe_spawn(conn: Any, plan: _Plan) -> dict[str, int]:
    # In a handler process: the parent's handler thread spawns (one engine, one fence) and answers.
    conn.send(("spawn", plan))
    kind, value = conn.recv()
    if kind == "raise":
        raise value
    return value  # type: ignore[no-any-return]


#: The write ends (Connections) of the lifelines of this process's handler processes (see
#: _die_with_worker), changed only under _LIFELINE_LOCK, which also covers starting a handler
#: process: a child forked meanwhile inherits exactly these descriptors, and closes them all.
_LIFELINES: set[Any] = set()
_LIFELINE_LOCK = threading.Lock()
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_worker(lifeline: Any) -> None:
    """In a handler process, first thing: end this process when its worker dies, even by SIGKILL.

    Two watches, because neither covers every case alone. On Linux, the kernel sends SIGKILL
    when the parent *thread* ends (PR_SET_PDEATHSIG): with fork and spawn that is the worker's
    handler thread, which waits for this process, so it ends only with the worker; with
    forkserver the parent is the fork server, which may outlive the worker for a while. And
    everywhere, the ``lifeline``: the read end of a pipe whose write end only the worker holds
    (a child forked from the worker closes the worker's copies, this one's included), so end
    of file means the worker is gone, whatever the start method or the platform.
    """
    for held in list(_LIFELINES):  # fork: the worker's write ends, inherited; empty after spawn
        held.close()
    _LIFELINES.clear()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, _os_signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl: the lifeline alone
    threading.Thread(target=_end_at_eof, args=(lifeline,), name="jobq-lifeline", daemon=True).start()


def _end_at_eof(lifeline: Any) -> None:
    try:
        lifeline.recv_bytes()  # nothing is ever sent: this returns only at end of file
    except BaseException:  # noqa: BLE001,S110 - EOF, or a closed pipe: the worker is gone either way
        pass
    kill = getattr(_os_signal, "SIGKILL", None)
    if kill is not None:
        os.kill(os.getpid(), kill)
    os._exit(70)


def _process_main(watch: Callable[[Any], None], handler: Callable[[JobContext], Any], lease: Lease, stop: Any,
                  conn: Any, lifeline: Any) -> None:
    # Runs in the handler's own process: report the outcome (and ask for spawns) through the
    # pipe, touch nothing else (the database connections inherited by fork belong to the parent).
    watch(lifeline)  # _die_with_worker, passed by the worker (a crash test passes a broken one)
    ctx = JobContext(lease)
    ctx._stop = stop
    ctx._save = functools.partial(_checkpoint_through_pipe, conn)
    ctx._report = lambda p: conn.send(("progress", p))
    ctx._spawner = functools.partial(_pipe_spawn, conn)
    ctx._read_upstream = functools.partial(_upstream_through_pipe, conn)
    ctx._waits = functools.partial(_pipe_wait, conn)
    ctx._logger = functools.partial(_log_through_pipe, conn)
    try:
        value = handler(ctx)
        conn.send(("ok", value))
    except _Unwind as unwind:  # a suspension: the parent writes it
        conn.send(("suspend", unwind.intent))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        conn.send(_error_outcome(exc, _retry_policy_of(handler)))


def _upstream_through_pipe(conn: Any, ctx: JobContext) -> dict[int, Any]:
    # In a handler process: the parent reads the upstreams' results (it holds the connections).
    conn.send(("upstream", None))
    kind, value = conn.recv()
    if kind != "ok":
        raise JobqError(value)
    return value  # type: ignore[no-any-return]


def _log_through_pipe(conn: Any, ctx: JobContext, message: str, fields: Any) -> bool:
    # In a handler process: the parent writes the line (it holds the connections).
    conn.send(("log", (message, fields)))
    kind, value = conn.recv()
    if kind != "ok":
        raise JobqError(value)
    return bool(value)


def _checkpoint_through_pipe(conn: Any, ctx: JobContext, state: dict[str, Any]) -> None:
    # The handler's process asks its parent, which holds the lease and the connections, to
    # store the checkpoint, and waits for the answer. Progress rides along with it.
    conn.send(("checkpoint", (state, ctx._progress)))
    kind, text = conn.recv()
    if kind == "lost":
        ctx._signal("lease_lost")
        raise LeaseLost(text)
    if kind != "ok":
        raise JobqError(text)
    ctx.state = state


_EXECUTORS = ("thread", "process")
_IDLE_THREAD_SECONDS = 30.0  # an idle handler thread exits after this long
#: Faults the worker survives by logging ``db_error`` and backing off: the database's own
#: errors, and a connection pool that stays exhausted past its timeout (handlers sharing it).
_DB_FAULTS: tuple[type[BaseException], ...] = (sa.exc.DBAPIError, sa.exc.TimeoutError)
#: Most bytes of results one finalize transaction carries: well below MariaDB's default
#: max_allowed_packet (16 MiB), whatever the batch; a single result is at most MAX_JSON_BYTES.
_BATCH_BYTES = 4 * 1024 * 1024
#: Failed writes of one outcome, while the database answered other transactions, before a
#: result is given up for a failure (and, after twice as many, the outcome is dropped and the
#: lease left to expire): a batch that cannot be written must never wedge the worker.
_WRITE_TRIES = 3


@dataclasses.dataclass(frozen=True, eq=False)
class WorkerOptions:
    """A worker's options, validated once: ``Worker(engine, handlers, **options)`` builds one,
    and ``worker.options`` is it. Each field means what :class:`Worker`'s argument of the same
    name means; after validation ``heartbeat_interval``, ``worker_id`` and ``retry_backoff``
    hold their resolved values (``local_concurrency`` defaults to ``max_concurrency``),
    ``group_caps``/``rate_limits`` are plain dicts.

    Raises:
        ConfigError: an option is invalid (e.g. a heartbeat too close to the lease TTL, or a
            ``start_method`` this platform lacks with ``executor="process"``).
        InvalidJob: ``worker_id`` is not a valid name.
    """

    max_concurrency: int
    lease_ttl: float = 30.0
    heartbeat_interval: float | None = None
    poll_interval: float = 1.0
    worker_id: str | None = None
    timeout: float | None = None
    group_caps: Mapping[str, int] | None = None
    rate_limits: Mapping[str, tuple[int, float]] | None = None
    retry_backoff: Callable[[int], float] | None = None
    shutdown_timeout: float = 30.0
    executor: str = "thread"
    start_method: str = "fork"
    listen: bool = False
    on_event: Callable[[Event], None] | None = None
    finalize_delay: float = 0.005
    local_concurrency: int | None = None

    def __post_init__(self) -> None:
        fix = functools.partial(object.__setattr__, self)
        fix("max_concurrency", _check_int(self.max_concurrency, "max_concurrency", 1, _MAX_SLOTS, ConfigError))
        local = self.max_concurrency if self.local_concurrency is None else _check_int(
            self.local_concurrency, "local_concurrency", 1, _MAX_SLOTS, ConfigError)
        if local > self.max_concurrency:
            raise ConfigError(
                f"local_concurrency={local} is above max_concurrency={self.max_concurrency}: the global cap "
                "would never let this worker fill its slots; raise max_concurrency or lower local_concurrency"
            )
        fix("local_concurrency", local)
        ttl = _check_seconds(self.lease_ttl, "lease_ttl", ConfigError, optional=False)
        assert ttl is not None
        hb = ttl / 3 if self.heartbeat_interval is None else _check_seconds(
            self.heartbeat_interval, "heartbeat_interval", ConfigError, optional=False)
        assert hb is not None
        if hb > ttl / 2:
            raise ConfigError(
                f"heartbeat_interval={hb:g}s must be at most half of lease_ttl={ttl:g}s, or one slow "
                "heartbeat loses the lease; the default is lease_ttl / 3"
            )
        fix("lease_ttl", ttl)
        fix("heartbeat_interval", hb)
        fix("poll_interval", _check_seconds(self.poll_interval, "poll_interval", ConfigError, optional=False))
        if self.executor not in _EXECUTORS:
            raise ConfigError(f"executor must be one of {_EXECUTORS}, got {self.executor!r}")
        if self.executor == "process":  # threads and tasks need no start method (issue 12: no fork here)
            import multiprocessing

            if self.start_method not in multiprocessing.get_all_start_methods():
                raise ConfigError(f"start_method {self.start_method!r} is not available here")
        fix("worker_id", _check_name(self.worker_id, "worker_id") if self.worker_id is not None else _worker_id())
        fix("timeout", _check_seconds(self.timeout, "timeout", ConfigError))
        fix("group_caps", {str(g): _check_int(n, f"group_caps[{g!r}]", 1, _MAX_SLOTS, ConfigError)
                           for g, n in (self.group_caps or {}).items()})
        fix("rate_limits", _check_rate_limits(self.rate_limits))
        fix("retry_backoff", self.retry_backoff or backoff)
        fix("shutdown_timeout", _check_seconds(self.shutdown_timeout, "shutdown_timeout", ConfigError,
                                               optional=False) or 30.0)
        fix("listen", bool(self.listen))
        delay = 0.0 if self.finalize_delay == 0 and not isinstance(self.finalize_delay, bool) else _check_seconds(
            self.finalize_delay, "finalize_delay", ConfigError, optional=False)
        assert delay is not None
        if delay > 1.0:
            raise ConfigError(f"finalize_delay={delay:g}s: keep it to a few milliseconds (at most 1 s)")
        fix("finalize_delay", delay)


_H = TypeVar("_H", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How failures of one job type are retried, set on its handler: decorate the handler with
    the policy (``@jobq.RetryPolicy(attempts=5, retry_on=(TimeoutError,))``) and give it to a
    worker in ``handlers`` as usual. Every field left None falls back to what the worker does
    without a policy.

    Precedence: a job's own ``max_attempts`` (given at enqueue, 3 included) wins over
    ``attempts``, which wins over enqueue's default (3); the job row records whether
    ``max_attempts`` was given (jobs enqueued before schema 7 read as not given). The worker
    writes the policy's attempts into a job enqueued without one when it claims it, so every
    later reader (a reclaim sweep, ``get``, ``why``) sees the same limit.
    Back-off: the policy's (when it sets ``base``, ``cap`` or ``jitter``), else the worker's
    ``retry_backoff``, else :func:`jobq.backoff`.

    Args:
        attempts: dispatches a job of this type may have (1-1000), unless it was enqueued
            with a ``max_attempts`` of its own.
        base: seconds before the first retry; the delay doubles with each attempt
            (:func:`jobq.backoff`; default 1.0 once any of base, cap, jitter is set).
        cap: the longest delay in seconds (default 300.0).
        jitter: spread of each delay, a fraction in 0 .. 1 (default 0.1: +/- 10%).
        retry_on: the exception classes that are retried (a class or a tuple of them). An
            exception of any other class fails the job at once, as :class:`jobq.NoRetry`
            does, and its error says so. None (the default): every exception is retried.
            A timeout is always retried while attempts remain.

    Raises:
        ConfigError: a field is out of range, or ``retry_on`` holds something that is not an
            exception class.
    """

    attempts: int | None = None
    base: float | None = None
    cap: float | None = None
    jitter: float | None = None
    retry_on: type[BaseException] | tuple[type[BaseException], ...] | None = None

    def __post_init__(self) -> None:
        fix = functools.partial(object.__setattr__, self)
        if self.attempts is not None:
            fix("attempts", _check_int(self.attempts, "RetryPolicy attempts", 1, 1000, ConfigError))
        for name, hi in (("base", _MAX_DELAY), ("cap", _MAX_DELAY), ("jitter", 1.0)):
            value = getattr(self, name)
            if value is not None:
                fix(name, _check_number(value, f"RetryPolicy {name}", 0.0, hi, ConfigError))
        on = self.retry_on
        if on is not None:
            classes = on if isinstance(on, tuple) else (on,)
            for c in classes:
                if not (isinstance(c, type) and issubclass(c, BaseException)):
                    raise ConfigError(f"RetryPolicy retry_on must be exception classes, got {c!r}")
            fix("retry_on", classes)

    def delay(self, attempt: int) -> float | None:
        """Seconds before retrying a failed ``attempt`` (1-based), or None when this policy
        sets no back-off (the worker's applies)."""
        if self.base is None and self.cap is None and self.jitter is None:
            return None
        return backoff(attempt, base=1.0 if self.base is None else self.base,
                       cap=300.0 if self.cap is None else self.cap, jitter=0.1 if self.jitter is None else self.jitter)

    def __call__(self, handler: _H) -> _H:
        """Attach this policy to ``handler`` (a function, sync or ``async def``) and return it."""
        if not callable(handler):
            raise ConfigError(f"RetryPolicy decorates a handler function, got {_type_name(handler)}")
        try:
            handler.jobq_retry = self  # type: ignore[attr-defined]
        except AttributeError:
            raise ConfigError(f"cannot attach a RetryPolicy to {_type_name(handler)}: decorate the function "
                              "itself (in a class body, the method's def)") from None
        return handler


def _retry_policy_of(handler: Any) -> RetryPolicy | None:
    """The RetryPolicy a handler carries (RetryPolicy.__call__), or None."""
    p = getattr(handler, "jobq_retry", None)
    return p if isinstance(p, RetryPolicy) else None


def _check_worker_target(engine: Engine, handlers: Any) -> None:
    if not isinstance(engine, Engine):
        raise ConfigError(f"engine must be a SQLAlchemy Engine, got {_type_name(engine)}")
    if not isinstance(handlers, Mapping) or not handlers:
        raise ConfigError("handlers must be a non-empty mapping of job type -> callable")
    for name, fn in handlers.items():
        _check_name(name, "handler type")
        if not callable(fn):
            raise ConfigError(f"handler for {name!r} is not callable")


def _format_error(exc: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    head = f"{type(exc).__name__}: {exc}"
    return (head + "\n" + tb[-(_ERROR_LIMIT - len(head) - 1) :])[:_ERROR_LIMIT]


def _error_outcome(exc: BaseException, policy: RetryPolicy | None = None) -> tuple[str, str]:
    """A handler's exception as its dispatch's outcome: ("fatal", error) for one that must not
    be retried (NoRetry, or a class outside the policy's retry_on), else ("error", error),
    retried while attempts remain."""
    if isinstance(exc, NoRetry):
        return "fatal", _format_error(exc)
    on = policy.retry_on if policy is not None else None
    if on is not None and not isinstance(exc, on):
        note = f"not retried ({type(exc).__name__} is not in the handler's RetryPolicy retry_on): "
        return "fatal", (note + _format_error(exc))[:_ERROR_LIMIT]
    return "error", _format_error(exc)

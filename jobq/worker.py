"""The worker: one loop (scan, rank, lease, dispatch, persist, reclaim) written once as steps,
run by Worker on threads or processes."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import functools
import json
import logging
import math
import os
import signal as _os_signal
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from .base import ConfigError, Event, InvalidJob, JobqError, LeaseLost, _checkpoint, _chunks, _emit, _Unwind, logger
from .claiming import Lease, _lease_rows
from .context import (
    _BATCH_BYTES,
    _DB_FAULTS,
    _IDLE_THREAD_SECONDS,
    _LIFELINE_LOCK,
    _LIFELINES,
    _NOTIFY_RECHECK,
    _WRITE_TRIES,
    JobContext,
    RetryPolicy,
    WorkerOptions,
    _Batch,
    _check_worker_target,
    _Clock,
    _die_with_worker,
    _error_outcome,
    _format_error,
    _process_main,
    _retry_policy_of,
    _Running,
)
from .drivers import _T, _Dialect, _listen_supported, _listener_connection, _prepare, _transaction
from .jobs import _DEFAULT_ATTEMPTS, _Hold, _Plan, _spawn
from .ops import RETENTION_INTERVAL, _retention_turn
from .outcomes import _ERROR_LIMIT, _SWEEP_LIMIT, _SWEEP_SECONDS, _apply_outcomes, _heartbeat_rows, _reclaim_rows
from .policy import backoff
from .recurring import _SCHEDULE_POLL, _fire_due
from .schema import LOG_LINES_PER_JOB
from .sql import (
    _Q_FREE_SLOT,
    _Outcome,
    _q_attempts_unset,
    _q_busy_or_due,
    _q_checkpoint,
    _q_hold_slots,
    _q_insert_log,
    _q_last_log_seq,
    _q_progress,
    _q_reclaimed,
    _q_renew_held_slots,
    _q_set_max_attempts,
    _q_upstream_results,
)
from .validate import _MAX_DELAY, _encode_checked, _one_line, _type_name
from .waits import _wait_answer

_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(WorkerOptions))


class _WorkerCore:
    """What Worker and AsyncWorker share: the tick, the writes, heartbeats, timeouts, and the
    loops as generators of steps (see the section's opening comment). Not public."""

    def __init__(self, engine: Engine, handlers: Mapping[str, Callable[[JobContext], Any]], options: WorkerOptions) -> None:
        o = self.options = options
        # The options that WorkerOptions types as optional (None: the default) but resolves,
        # typed as resolved; the others are read from self.options (and as attributes).
        self.local_concurrency: int = o.local_concurrency  # type: ignore[assignment]
        self.heartbeat_interval: float = o.heartbeat_interval  # type: ignore[assignment]
        self.worker_id: str = o.worker_id  # type: ignore[assignment]
        self.retry_backoff: Callable[[int], float] = o.retry_backoff  # type: ignore[assignment]
        self.engine = engine
        self.handlers = dict(handlers)
        self._types = sorted(self.handlers)
        #: The handlers' RetryPolicy values by job type, and the attempts those set (see _own_attempts).
        self._policies: dict[str, RetryPolicy] = {t: p for t, fn in self.handlers.items() if (p := _retry_policy_of(fn))}
        self._attempts_of: dict[str, int] = {t: p.attempts for t, p in self._policies.items() if p.attempts is not None}
        self._told_cap: int | None = None  # the stored global cap this worker last warned about
        if self.options.listen and not _listen_supported(engine):
            raise ConfigError("listen=True needs PostgreSQL with the psycopg (3) driver")
        self._clock = _Clock(engine)
        self._lock = threading.Lock()
        self._running: dict[tuple[str, int], _Running] = {}  # by dispatch (_Running.key)
        self._abandoned: list[_Running] = []  # released runs whose handler has not returned
        self._finished: deque[tuple[_Running, str, Any]] = deque()
        self._busy = 0  # handlers running, including abandoned ones
        self._wake = threading.Event()
        self._notified = False  # the listener woke the loop since its last tick
        self._stopping = threading.Event()
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._db_failures = 0
        self._last_sweep = -math.inf  # the first tick sweeps
        self._next_retention = time.monotonic()  # the first tick tries for the round of retention
        # Reclaim runs on a cadence, not on every tick: an expired lease waits at most this long
        # (plus a tick) for a live worker's sweep, and a busy worker saves a statement per tick.
        self._sweep_every: float = min(self.options.lease_ttl / 4, _SWEEP_SECONDS)
        self._last_schedules = -math.inf  # the first tick checks for due schedules

    # The other options, read-only as attributes too: worker.lease_ttl is worker.options.lease_ttl.
    max_concurrency: int
    lease_ttl: float
    poll_interval: float
    timeout: float | None
    group_caps: dict[str, int]
    rate_limits: dict[str, tuple[int, float]]
    shutdown_timeout: float
    executor: str
    start_method: str
    listen: bool
    on_event: Callable[[Event], None] | None
    finalize_delay: float

    if not TYPE_CHECKING:  # (hidden from mypy, which would take every unknown attribute as Any)
        def __getattr__(self, name: str) -> Any:
            if name in _OPTION_NAMES:
                return getattr(self.options, name)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- public control --------------------------------------------------------------------

    def stop(self) -> None:
        """Ask ``run`` to stop claiming and shut down gracefully. Thread-safe; ``run`` on the main
        thread stops on SIGTERM and SIGINT by itself (call this from another thread, not from a
        signal handler of your own on the thread that runs the worker)."""
        self._stopping.set()
        self._wake.set()

    @property
    def in_flight(self) -> int:
        """Jobs this worker holds right now (not counting abandoned handlers)."""
        with self._lock:
            return len(self._running)

    # -- the loops, as steps ---------------------------------------------------------------

    def _run_steps(self) -> Generator[Any, Any, None]:
        while not self._stopping.is_set():
            began = time.monotonic()
            notified, self._notified = self._notified, False
            yield self._safe_tick
            # Poll on a fixed period measured from the start of the tick, so a job enqueued
            # just after a poll waits at most one interval plus one tick. After a notification,
            # look once more soon: the claim skips rows another transaction has locked (an
            # enqueue share-locks the upstreams it depends on), so the notified job may have
            # been passed over, and its notification is already spent.
            pause = min(self._pause(), _NOTIFY_RECHECK) if notified else self._pause()
            yield max(0.0, pause - (time.monotonic() - began))
            yield from self._gather_steps()
        yield from self._drain_steps(self.options.shutdown_timeout)

    def _until_idle_steps(self, timeout: float | None) -> Generator[Any, Any, bool]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            started = yield self._safe_tick
            if not started and self.in_flight == 0 and not self._abandoned and (yield self._idle_in_db):
                return True
            if deadline is not None and time.monotonic() > deadline:
                yield from self._drain_steps(0)
                return False
            if not started:
                yield 0.05 if self.in_flight and not self._db_failures else self._pause()
            yield from self._gather_steps()

    def _gather_steps(self) -> Generator[Any, Any, None]:
        """Results that complete close together are written together: once one is waiting,
        give the other busy handlers up to ``finalize_delay`` to finish too (no wait at all
        when none is busy, so a long job's result is written at once)."""
        deadline = time.monotonic() + self.options.finalize_delay
        while True:
            with self._lock:
                if not self._finished or self._busy == 0 or self._stopping.is_set():
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            yield left

    def _drain_steps(self, grace: float, unwind: float = 5.0) -> Generator[Any, Any, None]:
        deadline = time.monotonic() + grace
        while True:
            yield self._persist
            pending = self._pending()
            if not pending or time.monotonic() >= deadline:
                break
            yield 0.05
        yield functools.partial(self._release_unstarted, pending)
        yield from self._unwind_steps(unwind)

    def _unwind_steps(self, wait: float = 5.0) -> Generator[Any, Any, None]:
        yield from ()  # AsyncWorker: let cancelled tasks end (up to ``wait`` s), then free their slots

    # -- the tick --------------------------------------------------------------------------

    def _tick(self) -> int:
        self._revive_takers()
        self._fire_schedules()
        self._write_suspects()
        batch = self._take_finished()
        with self._lock:
            # Outcomes past the batch's size: written after the claim. Those that arrive during
            # it go with the next tick's claim (their handler's return wakes the loop for it).
            leftover = bool(self._finished)
        self._enforce_timeouts()
        with self._lock:
            local_free = self.local_concurrency - self._busy
        claiming = local_free > 0 and not self._stopping.is_set()
        # Full or stopping: claim nothing, but keep sweeping expired leases of crashed workers.
        began = time.monotonic()
        sweeping = began - self._last_sweep >= self._sweep_every
        if not sweeping and not claiming:
            self._write(batch, None)
            self._persist()  # what did not fit in one batch
            return 0
        ok, got = self._write(batch, functools.partial(self._claim, limit=local_free if claiming else 0,
                                                       sweep=sweeping))
        if not ok or got is None:
            return 0
        reclaimed, leases, stalled = got
        if sweeping and len(reclaimed) < _SWEEP_LIMIT:
            self._last_sweep = began  # a full sweep left more: the next tick sweeps again
        if leftover or not claiming:
            self._persist()
        self._lost(stalled)
        for row in reclaimed:
            _emit(self.options.on_event, Event("reclaimed", row.id, row.type, row.group_key, row.attempts, self.worker_id,
                                       error=f"lease expired; now {row.state}"))
        if leases:
            _checkpoint("claimed", [lease.id for lease in leases])
            self._dispatch(leases)
        return len(leases)

    def _fire_schedules(self) -> None:
        """Enqueue the slots of due schedules, at most every _SCHEDULE_POLL seconds: one indexed
        read when nothing is due, in its own transaction, never inside the claim's."""
        began = time.monotonic()
        if began - self._last_schedules < _SCHEDULE_POLL or self._stopping.is_set():
            return
        self._last_schedules = began
        try:
            _fire_due(self.engine)
        except _DB_FAULTS as exc:
            self._db_error(exc, note="schedules: ")

    def _claim(self, conn: Connection, d: _Dialect, now: _dt.datetime, *,
               limit: int, sweep: bool = True) -> tuple[list[Any], list[Lease], list[_Running]]:
        """The claim half of a tick's transaction: with ``sweep``, reclaim expired leases (and,
        for those this worker's own stalled handlers still run, hold a slot each until they
        return, so the caps keep counting them), then lease what fits. Returns the reclaimed
        rows, the new leases, and the stalled runs (told after the commit: this may run again
        on a retry)."""
        back = _reclaim_rows(conn, d, now, _SWEEP_LIMIT) if sweep else []
        reclaimed: list[Any] = []
        mine: list[_Running] = []
        if back:
            ids = {job_id for job_id, _state in back}
            reclaimed = list(conn.execute(_q_reclaimed(sorted(ids))).all())
            with self._lock:
                mine = [r for r in self._running.values() if r.lease.id in ids and not r.returned]
            _hold_slots(conn, mine, self.worker_id, now + _dt.timedelta(seconds=self.options.lease_ttl))
        if limit <= 0:
            return reclaimed, [], mine
        leases = _lease_rows(
            conn, d, worker_id=self.worker_id, ttl=self.options.lease_ttl, now=now, limit=limit, types=self._types,
            max_in_flight=self.options.max_concurrency, group_caps=self.options.group_caps or None, state="running",
            rate_limits=self.options.rate_limits or None, fresh_now=True, seen_cap=self._stored_cap,
        )
        return reclaimed, (self._own_attempts(conn, leases) if self._attempts_of else leases), mine

    def _own_attempts(self, conn: Connection, leases: list[Lease]) -> list[Lease]:
        """In the claim's transaction: jobs whose handler's RetryPolicy sets ``attempts`` and
        that were enqueued without a ``max_attempts`` of their own (the row holds the default and
        says it was not given) get the policy's number, in their row (so a reclaim sweep, ``get``
        and ``why`` see it) and in their lease. Only such leases cost a read."""
        maybe = [x.id for x in leases if (n := self._attempts_of.get(x.type)) is not None
                 and x.max_attempts == _DEFAULT_ATTEMPTS != n]
        if not maybe:
            return leases
        unset = {i for chunk in _chunks(maybe) for i in conn.execute(_q_attempts_unset(list(chunk))).scalars()}
        fix: dict[tuple[int, str], list[int]] = {}
        out: list[Lease] = []
        for lease in leases:
            n = self._attempts_of.get(lease.type)
            if n is not None and lease.id in unset:
                fix.setdefault((n, lease.token), []).append(lease.id)
                lease = dataclasses.replace(lease, max_attempts=n)
            out.append(lease)
        for (n, token), ids in sorted(fix.items()):
            for chunk in _chunks(ids):
                conn.execute(_q_set_max_attempts(list(chunk), token, n))
        return out

    def _stored_cap(self, cap: int) -> None:
        """The claim read the database's stored global cap: say once (per value) that this
        worker's own max_concurrency differs from it, and which applies."""
        if cap != self.options.max_concurrency and cap != self._told_cap:
            self._told_cap = cap
            logger.warning(
                "worker %s: max_concurrency=%d differs from the global cap stored in the database (%d, "
                "jobq.set_limit / `jobq limit`): the smaller, %d, applies", self.worker_id, self.options.max_concurrency,
                cap, min(cap, self.options.max_concurrency),
                extra={"action": "global_cap", "worker_id": self.worker_id})

    def _lost(self, runs: Sequence[_Running]) -> None:
        """Runs whose lease is gone while their handler still runs, with a slot now held for
        each: told to stop, and kept until they return (their results are refused)."""
        for run in runs:
            run.ctx._signal("lease_lost")
        with self._lock:
            for run in runs:
                if self._running.pop(run.key, None) is run:
                    run.abandoned = True
                    if not run.returned:
                        self._abandoned.append(run)
        for run in runs:
            _emit(self.options.on_event, Event("lease_lost", run.lease.id, run.lease.type, run.lease.group_key,
                                       run.lease.attempt, self.worker_id))
        self._stop_handlers(runs)

    def _events_wanted(self, level: int) -> bool:
        # The per-job events cost more than the rest of a no-op dispatch: skip building them
        # when there is no hook and the jobq logger would drop them anyway.
        return self.options.on_event is not None or logger.isEnabledFor(level)

    def _pause(self) -> float:
        # Back off while the database is failing: 0.1 s doubling to 5 s, never a hot loop.
        if self._db_failures:
            return min(5.0, 0.1 * 2 ** min(self._db_failures - 1, 6))
        return self.options.poll_interval

    def _db_error(self, exc: BaseException, job_id: int = 0, note: str = "") -> None:
        self._db_failures += 1
        _emit(self.options.on_event, Event("db_error", job_id, worker_id=self.worker_id, error=note + _one_line(exc)))

    def _safe_tick(self) -> int:
        try:
            failures = self._db_failures
            if time.monotonic() >= self._next_retention:
                # Before the claim, not after it: after, it ran while the handler threads forked
                # this tick's processes, and a child forked while this thread was inside the
                # database driver could inherit its lock held and hang.
                self._retention()
            started = self._tick()
            if self._db_failures == failures:
                self._db_failures = 0  # a clean tick: the database is back
            return started
        except _DB_FAULTS as exc:
            self._db_error(exc)
            return 0

    def _retention(self) -> None:
        """After a tick, once per RETENTION_INTERVAL: this worker's try for the round of
        retention (ops._retention_turn), which one worker across all of them takes."""
        self._next_retention = time.monotonic() + RETENTION_INTERVAL
        if self._stopping.is_set():
            return
        deleted = _retention_turn(self.engine, RETENTION_INTERVAL)
        if deleted:
            logger.info("worker %s: retention deleted %d finished job(s)", self.worker_id, deleted,
                        extra={"action": "retention", "worker_id": self.worker_id})

    def _idle_in_db(self) -> bool:
        """Idle: nothing of this worker's types is due (``ready`` with ``run_after`` passed),
        leased or running. Jobs scheduled for later, or waiting on upstreams, do not count."""
        try:
            now = self._clock.now()
            with self.engine.connect() as conn:
                row = conn.execute(_q_busy_or_due(self._types, now)).first()
                conn.rollback()
        except _DB_FAULTS as exc:
            self._db_error(exc)
            return False
        return row is None

    def _dispatch(self, leases: Sequence[Lease]) -> None:
        # One claim's leases together: registered under one acquisition of the lock, then started.
        runs: list[_Running] = []
        now = time.monotonic()
        save = self._save_checkpoint  # one bound method for the claim, not one per job
        upstream = self._read_upstream
        log = self._store_log
        for lease in leases:
            ctx = JobContext(lease, self)
            ctx._save = save
            ctx._read_upstream = upstream
            ctx._logger = log
            timeout = lease.timeout if lease.timeout is not None else self.options.timeout
            run = _Running(lease, ctx, now, None if timeout is None else now + timeout, now, self)
            ctx._spawner = run
            runs.append(run)
        with self._lock:
            for run in runs:
                self._running[run.key] = run
            self._busy += len(runs)
        claimed, started = self._events_wanted(logging.DEBUG), self._events_wanted(logging.INFO)
        if claimed or started:
            for run in runs:
                lease = run.lease
                if claimed:
                    _emit(self.options.on_event, Event("claimed", lease.id, lease.type, lease.group_key, lease.attempt, self.worker_id))
                if started:
                    _emit(self.options.on_event, Event("started", lease.id, lease.type, lease.group_key, lease.attempt, self.worker_id))
        self._start_all(runs)

    def _save_checkpoint(self, ctx: JobContext, state: dict[str, Any]) -> Any:
        self._store_checkpoint(ctx, state)

    def _read_upstream(self, ctx: JobContext) -> dict[int, Any]:
        """ctx.upstream, on first access: one short read in the handler's thread (or, for a
        handler process, in its parent's handler thread). Unfenced: done results never change."""
        return _transaction(self.engine, lambda conn, d: {i: r for i, r in conn.execute(_q_upstream_results(ctx.id))})

    def _store_log(self, ctx: JobContext, message: str, fields: Any) -> bool:
        """ctx.log: one short transaction that inserts the job's next line (no job row locked,
        not fenced). The line number is read once per dispatch, then counted here; a clash
        with another writer of the same job (a zombie dispatch) reads it again."""
        if ctx._log_seq is not None and ctx._log_seq >= LOG_LINES_PER_JOB:
            return False
        at = self._clock.now()
        for clash in (False, True):
            def write(conn: Connection, d: _Dialect) -> tuple[int, bool]:
                seq = ctx._log_seq
                if seq is None:
                    seq = conn.execute(_q_last_log_seq(ctx.id)).scalar() or 0
                if seq >= LOG_LINES_PER_JOB:
                    return seq, False
                conn.execute(_q_insert_log(ctx.id, seq + 1, ctx.attempt, at, message, fields))
                return seq + 1, True

            try:
                ctx._log_seq, stored = _transaction(self.engine, write)
            except sa.exc.IntegrityError:
                if clash:
                    raise
                ctx._log_seq = None  # read the number again
                continue
            return stored
        return False  # pragma: no cover - the loop returns or raises

    def _store_checkpoint(self, ctx: JobContext, state: dict[str, Any]) -> None:
        """ctx.checkpoint: one short transaction, fenced by the dispatch's lease."""
        now = self._clock.now()
        progress = ctx._progress  # rides along: the heartbeat need not write it again
        n = _transaction(self.engine, lambda conn, d: conn.execute(
            _q_checkpoint(ctx.id, ctx.worker_id, ctx._token, state, progress, now)).rowcount)
        if not n:
            ctx._signal("lease_lost")
            raise LeaseLost(f"job {ctx.id}: this dispatch no longer holds the lease; the checkpoint was not stored")
        ctx.state = state
        ctx._progress_sent = progress

    # -- the runner's part (Worker: threads or processes; AsyncWorker: tasks) -------------

    def _start_all(self, runs: Sequence[_Running]) -> None:
        """Start a claim's dispatches (Worker: on handler threads; AsyncWorker: as tasks)."""
        raise NotImplementedError

    def _stop_handlers(self, runs: Sequence[_Running]) -> None:
        """After ``runs`` were released and fenced: stop what can be stopped."""

    def _poke(self) -> None:
        self._wake.set()

    def _spawn(self, run: _Running, plan: _Plan) -> dict[str, int]:
        """A handler's ctx.enqueue/submit (in its thread, or for a handler process here)."""
        run.spawned = True  # before the insert: whatever may have landed goes with the outcome
        ids = _spawn(self.engine, plan, _Hold(run.lease.id, run.lease.token, run.own))  # immutable: no copy
        run.own = run.own.union(ids.values())
        return ids

    def _wait_op(self, run: _Running, op: tuple[Any, ...]) -> tuple[str, Any]:
        """A handler's ctx.wait_for/sleep/sleep_until (in its thread, or for a handler process here)."""
        lease = run.lease
        return _transaction(self.engine, lambda conn, d: _wait_answer(conn, d, lease.id, lease.token, op))

    @staticmethod
    def _check_result(value: Any) -> tuple[str, Any]:
        try:
            if value is not None and not isinstance(value, Mapping):
                raise InvalidJob(f"handler returned {_type_name(value)}; return a dict or None")
            return "ok", None if value is None else _encode_checked(dict(value), "result")
        except InvalidJob as exc:  # an unstorable result will not improve on retry
            return "fatal", _format_error(exc)

    def _finish(self, run: _Running, kind: str, payload: Any) -> None:
        _checkpoint("handler_returned", [run.lease.id])
        if kind == "ok" and payload is not None:
            run.size = len(json.dumps(payload, separators=(",", ":")))  # here, off the tick's path
        with self._lock:
            self._busy -= 1
            run.returned = True
            self._finished.append((run, kind, payload))
            self._handler_idle()
            # The loop acts on the first outcome queued (it writes it, or starts gathering
            # others for up to finalize_delay) and on the last busy handler returning (the
            # gather ends); one wake-up per outcome would only hand the GIL to a loop that
            # goes back to waiting.
            wake = len(self._finished) == 1 or self._busy == 0
        if wake:
            self._poke()

    def _handler_idle(self) -> None:
        """Under the lock, as a handler returns (Worker: its thread is idle in the same step)."""

    def _revive_takers(self) -> None:
        """At each tick: get dispatches moving that wait with nobody on the way to them (Worker:
        after a handler thread could not be started)."""

    # -- writing outcomes ------------------------------------------------------------------

    def _persist(self) -> None:
        """Write finished handlers' outcomes in transactions of their own (no claim), in
        batches of at most _BATCH_BYTES, until none is left or a write fails."""
        self._write_suspects()
        while True:
            batch = self._take_finished()
            if batch is None or not self._write(batch, None)[0]:
                return

    def _write_suspects(self) -> None:
        # Outcomes that were in a failed write while the database answered: one per transaction.
        while True:
            with self._lock:
                if not self._finished or not self._finished[0][0].write_failures:
                    return
                item = self._finished.popleft()
            if not self._write(self._make_batch([item]), None)[0]:
                return

    def _take_finished(self) -> _Batch | None:
        """Take queued handler outcomes (up to _BATCH_BYTES of results; not past one whose
        write failed before) and turn them into fenced outcomes to write."""
        with self._lock:
            items: list[tuple[_Running, str, Any]] = []
            size = 0
            while self._finished:
                run = self._finished[0][0]
                if run.write_failures or (items and size + run.size > _BATCH_BYTES):
                    break
                items.append(self._finished.popleft())
                size += run.size
        return self._make_batch(items) if items else None

    def _make_batch(self, items: list[tuple[_Running, str, Any]]) -> _Batch:
        out = _Batch(items)
        for run, kind, payload in items:
            lease = run.lease
            if run.abandoned:
                out.freed.append(run)  # released earlier: drop the late result, free its held slot
                continue
            if run.ctx.lease_lost:
                out.keep.append((run, "lost", None))
                continue
            if kind == "ok":
                out.outcomes.append(_Outcome(lease.id, self.worker_id, lease.token, "done", result=payload,
                                             parent_id=lease.parent_id, spawned=run.spawned))
            elif kind == "suspend":
                out.outcomes.append(_Outcome(lease.id, self.worker_id, lease.token, "suspend", wait=payload,
                                             parent_id=lease.parent_id, spawned=run.spawned))
            else:
                retry = kind == "error" and lease.attempt < lease.max_attempts
                delay = self._backoff(lease.attempt, lease.type) if retry else 0.0
                out.outcomes.append(_Outcome(lease.id, self.worker_id, lease.token, "retry" if retry else "failed",
                                             error=str(payload)[:_ERROR_LIMIT], delay=delay, parent_id=lease.parent_id,
                                             spawned=run.spawned))
            out.keep.append((run, kind, payload))
        return out

    def _write(self, batch: _Batch | None, claim: Callable[[Connection, _Dialect, _dt.datetime], _T] | None,
               ) -> tuple[bool, _T | None]:
        """One transaction: write ``batch`` (fenced; rollups and released dependents included),
        then run ``claim`` (reclaim + lease) in the same transaction, so a busy worker pays one
        commit per tick. Returns (committed, what claim returned). On any error the batch is
        queued again (its writes are idempotent: same tokens) and the error is reported; the
        worker never dies of it."""
        if batch is None and claim is None:
            return True, None

        def write(conn: Connection, d: _Dialect) -> tuple[list[str | None], _T | None]:
            applied: list[str | None] = []
            if batch is not None:
                for run in batch.freed:
                    conn.execute(_Q_FREE_SLOT, {"b_token": run.lease.token, "b_id": run.lease.id})
                applied = _apply_outcomes(conn, d, batch.outcomes, now) if batch.outcomes else []
                _checkpoint("finalize_before_commit", [o.job_id for o in batch.outcomes])
            return applied, (claim(conn, d, now) if claim is not None else None)

        try:
            # Inside the try: the clock's occasional refresh talks to the database too, and a
            # batch taken from _finished must go back if anything here fails.
            now = self._clock.now()
            applied, claimed = _transaction(self.engine, write, immediate=True)
        except BaseException as exc:
            if batch is None or not isinstance(exc, Exception):
                if batch is not None:
                    with self._lock:
                        self._finished.extendleft(reversed(batch.raw))
                if not isinstance(exc, Exception):
                    raise
                self._db_error(exc)
                return False, None
            self._db_error(exc, batch.raw[0][0].lease.id if len(batch.raw) == 1 else 0)
            # The batch, the claim, or the database? Only a batch whose own write fails while
            # the database answers is to blame: its outcomes are then written one by one (a
            # batch too large for the server's packet limit, a result the server refuses, a
            # fault in one job's rollup), and one that keeps failing is given up (_blame).
            answers = self._database_answers()
            if answers and claim is not None:
                self._write(batch, None)  # the batch alone (queued again, and blamed, if it fails)
                return self._write(None, claim)  # then the claim alone: the worker keeps working
            with self._lock:  # put them back; the next tick retries with the same tokens
                self._finished.extendleft(reversed(batch.raw))
            if answers:
                self._blame(batch, exc)
            return False, None
        if batch is not None:
            self._written(batch, applied)
        return True, claimed

    def _database_answers(self) -> bool:
        try:
            _transaction(self.engine, lambda conn, d: d.db_now(conn))
            return True
        except Exception:  # noqa: BLE001 - the database is away: nothing to blame on the batch
            return False

    def _blame(self, batch: _Batch, exc: BaseException) -> None:
        gave_up: list[_Running] = []
        with self._lock:
            for i, (run, kind, _payload) in enumerate(self._finished):
                if not any(run is r for r, _k, _p in batch.raw):
                    continue
                run.write_failures += 1
                if len(batch.raw) > 1:
                    continue  # split first: each is tried alone
                if run.write_failures >= 2 * _WRITE_TRIES and kind != "ok":
                    gave_up.append(run)  # an error outcome gets twice the tries; a result half, then this
                elif run.write_failures >= _WRITE_TRIES:
                    self._finished[i] = (run, "fatal", f"the result could not be written ({_one_line(exc)}); "
                                         f"failed after {run.write_failures} tries instead of retrying forever")
            for run in gave_up:
                self._finished = deque(item for item in self._finished if item[0] is not run)
                self._running.pop(run.key, None)
        for run in gave_up:
            # The lease is left to expire: the job is reclaimed and runs again (or ends failed
            # as a poison job), at least once as always.
            _emit(self.options.on_event, Event("db_error", run.lease.id, run.lease.type, run.lease.group_key, run.lease.attempt,
                                       self.worker_id, error=f"gave up writing its outcome: {_one_line(exc)}"))

    def _written(self, batch: _Batch, applied: list[str | None]) -> None:
        _checkpoint("finalized", [o.job_id for o, st in zip(batch.outcomes, applied, strict=True) if st == "done"])
        with self._lock:
            for run in batch.freed:
                if run in self._abandoned:
                    self._abandoned.remove(run)
        it = iter(applied)
        quiet = not self._events_wanted(logging.INFO)  # warnings below are still logged
        with self._lock:
            for run, _kind, _payload in batch.keep:
                if self._running.get(run.key) is run:
                    del self._running[run.key]
        for run, kind, payload in batch.keep:
            lease = run.lease
            written = None if kind == "lost" else next(it)
            if quiet and written == "done" and kind == "ok":
                continue  # "finished": INFO, and nobody is listening
            dur = time.monotonic() - run.started
            ev = functools.partial(Event, job_id=lease.id, type=lease.type, group=lease.group_key, attempt=lease.attempt,
                                   worker_id=self.worker_id, duration_s=dur)
            if written is None:
                _emit(self.options.on_event, ev("lease_lost", error="result discarded: the lease was lost"))
            elif written == "cancelled":
                _emit(self.options.on_event, ev("cancelled"))
            elif kind == "ok":
                _emit(self.options.on_event, ev("finished"))
            elif kind == "suspend":
                action = "failed" if written == "failed" else "snoozed" if payload.kind == "snooze" else "suspended"
                _emit(self.options.on_event, ev(action, error="snoozed past its limit" if written == "failed" else None))
            else:
                action = "retried" if kind == "error" and lease.attempt < lease.max_attempts else "failed"
                _emit(self.options.on_event, ev(action, error=_one_line(payload)))

    # -- releasing runs whose handler is still going --------------------------------------

    def _abandon(self, runs: Sequence[_Running], reason: str, outcomes: Callable[[_Running], _Outcome]) -> list[_Running]:
        """Release runs whose handler is still going: in one transaction write each outcome
        (fenced) and hold a slot per run until its handler returns, so the cap keeps counting
        it. Returns the runs written."""
        for run in runs:
            run.ctx._signal(reason)
        now = self._clock.now()
        expires = now + _dt.timedelta(seconds=self.options.lease_ttl)

        def write(conn: Connection, d: _Dialect) -> None:
            # spawned=True: a handler still going may be inside a spawn right now (it commits
            # first, holding this job's row, or is refused): look for held jobs whatever the flag.
            _apply_outcomes(conn, d, [dataclasses.replace(outcomes(r), spawned=True) for r in runs], now)
            _hold_slots(conn, runs, self.worker_id, expires)

        _transaction(self.engine, write)
        with self._lock:
            for run in runs:
                run.abandoned = True
                self._running.pop(run.key, None)
                if not run.returned:
                    self._abandoned.append(run)
                # else: returned in the meantime: its queued outcome will free the slot
        self._stop_handlers(runs)
        return list(runs)

    def _backoff(self, attempt: int, type_: str = "") -> float:
        """Seconds before the retry of a failed ``attempt`` of a job of ``type_``: its handler's
        RetryPolicy's back-off if it sets one, else ``retry_backoff``'s answer, held to
        0 .. _MAX_DELAY (infinity waits the longest), so a bad answer cannot stop the worker's
        write with an OverflowError. One that is no number (or raises) is logged, and the
        default :func:`backoff` is used instead."""
        policy = self._policies.get(type_)
        own = policy.delay(attempt) if policy is not None else None
        if own is not None:
            return min(own, _MAX_DELAY)
        try:
            delay = self.retry_backoff(attempt)
            if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay != delay:  # NaN
                raise TypeError(f"returned {delay!r}, not a number of seconds")
        except Exception as exc:  # the user's function: its failure must not lose the outcome
            logger.warning("retry_backoff(%d) failed (%s): using jobq.backoff", attempt, _one_line(exc),
                           extra={"action": "backoff", "attempt": attempt, "worker_id": self.worker_id})
            return backoff(attempt)
        return _MAX_DELAY if delay >= _MAX_DELAY else max(0.0, float(delay))  # an int is compared exactly

    def _enforce_timeouts(self) -> None:
        now_m = time.monotonic()
        with self._lock:
            late = [r for r in self._running.values()
                    if r.deadline is not None and now_m > r.deadline and not r.abandoned and not r.returned]
        if not late:
            return

        def outcome(run: _Running) -> _Outcome:
            lease = run.lease
            retry = lease.attempt < lease.max_attempts
            return _Outcome(lease.id, self.worker_id, lease.token, "retry" if retry else "failed", ended="timeout",
                            error=f"timed out after {now_m - run.started:.1f}s (limit {run.deadline - run.started:.1f}s)",  # type: ignore[operator]
                            delay=self._backoff(lease.attempt, lease.type) if retry else 0.0)

        try:
            self._abandon(late, "timed_out", outcome)
        except _DB_FAULTS as exc:
            self._db_error(exc)  # try again next tick
            return
        for run in late:
            lease = run.lease
            _emit(self.options.on_event, Event("timed_out", lease.id, lease.type, lease.group_key, lease.attempt, self.worker_id,
                                       now_m - run.started, outcome(run).error))

    def _pending(self) -> list[_Running]:
        with self._lock:
            return [r for r in self._running.values() if not r.abandoned]

    def _release_unstarted(self, pending: list[_Running]) -> None:
        """After the grace period: release what is still running back to ``ready`` at once."""
        if pending:
            try:
                self._abandon(pending, "shutdown", lambda r: _Outcome(r.lease.id, self.worker_id, r.lease.token, "release"))
                for run in pending:
                    lease = run.lease
                    _emit(self.options.on_event, Event("released", lease.id, lease.type, lease.group_key, lease.attempt, self.worker_id))
            except _DB_FAULTS as exc:
                self._db_error(exc)  # the leases will expire and be reclaimed
        self._persist()  # outcomes that arrived meanwhile; frees slots of returned handlers

    # -- heartbeats ------------------------------------------------------------------------

    def _beat(self) -> None:
        with self._lock:
            runs = [r for r in self._running.values() if not r.abandoned and not r.ctx.lease_lost]
            unheld = [r for r in self._running.values() if not r.abandoned and r.ctx.lease_lost and not r.returned]
            holding = bool(self._abandoned)
        if not runs and not holding and not unheld:
            return
        started = time.monotonic()
        margin = min(self.heartbeat_interval, self.options.lease_ttl * 0.2)

        def fence_stale() -> None:
            # Self-fence: past lease_ttl minus a margin without a successful beat, another worker
            # may already have reclaimed the job. Stop and never write its result.
            for r in runs:
                if time.monotonic() - r.last_beat > self.options.lease_ttl - margin:
                    r.ctx._signal("lease_lost")

        # A request the network swallows (a partition) blocks this beat until the kernel gives
        # up on the socket, minutes later: a watchdog fences on time meanwhile.
        beating = threading.Event()
        if runs:
            threading.Thread(target=_watch_beat, args=(beating, fence_stale, margin), daemon=True,
                             name="jobq-beat-watchdog").start()
        try:
            now = self._clock.now()
            expires = now + _dt.timedelta(seconds=self.options.lease_ttl)

            def write(conn: Connection, d: _Dialect) -> set[tuple[str, int, bool]]:
                if holding:
                    conn.execute(_q_renew_held_slots(self.worker_id, expires))
                _hold_slots(conn, unheld, self.worker_id, expires)  # self-fenced while the database was away
                out: set[tuple[str, int, bool]] = set()
                by_token: dict[str, list[Lease]] = {}
                for r in runs:
                    by_token.setdefault(r.lease.token, []).append(r.lease)
                for token, leases in by_token.items():
                    held, cancel = _heartbeat_rows(conn, leases, self.options.lease_ttl, now)
                    out.update((token, i, i in cancel) for i in held)
                for r, p in reports:  # the latest progress of each handler, fenced like the beat
                    conn.execute(_q_progress(r.lease.id, r.lease.token, p))
                return out

            reports = [(r, r.ctx._progress) for r in runs if r.ctx._progress is not r.ctx._progress_sent]

            beat = _transaction(self.engine, write)
        except Exception as exc:  # noqa: BLE001 - the heartbeat outlives every fault
            _emit(self.options.on_event, Event("db_error", 0, worker_id=self.worker_id, error=_one_line(exc)))
            fence_stale()
            return
        finally:
            beating.set()
        for r, p in reports:
            r.ctx._progress_sent = p
        if unheld:
            self._lost(unheld)
        lost: list[_Running] = []
        for r in runs:
            if (r.lease.token, r.lease.id, False) in beat or (r.lease.token, r.lease.id, True) in beat:
                r.last_beat = started
                if (r.lease.token, r.lease.id, True) in beat:
                    r.ctx._signal("cancelled")
            else:
                with self._lock:
                    if r.returned or self._running.get(r.key) is not r:
                        continue  # finished and written meanwhile: not a lost lease
                lost.append(r)
        if lost:
            # Reclaimed by another worker while the handler still runs: hold its slot until it
            # returns (the caps keep counting it), as for a timeout.
            try:
                _transaction(self.engine, lambda conn, d: _hold_slots(conn, lost, self.worker_id, expires))
            except Exception as exc:  # noqa: BLE001 - held on a later beat (unheld above)
                _emit(self.options.on_event, Event("db_error", 0, worker_id=self.worker_id, error=_one_line(exc)))
                for r in lost:
                    r.ctx._signal("lease_lost")
                return
            self._lost(lost)


def _watch_beat(beating: threading.Event, fence_stale: Callable[[], None], margin: float) -> None:
    while not beating.wait(max(margin / 2, 0.05)):
        fence_stale()


def _hold_slots(conn: Connection, runs: Sequence[_Running], worker_id: str, expires: _dt.datetime) -> None:
    rows = [{"token": r.lease.token, "job_id": r.lease.id, "worker_id": worker_id, "group_key": r.lease.group_key,
             "expires": expires} for r in runs if not r.returned]
    if rows:
        conn.execute(_q_hold_slots(), rows)


class Worker(_WorkerCore):
    """Runs handlers for runnable jobs, within a global concurrency cap, until stopped.

    Each tick persists finished jobs, enforces timeouts, then in one transaction reclaims
    expired leases (at the first tick, then every ``min(lease_ttl / 4, 1 s)``), ranks the
    ready set by fair share and leases what fits under the caps, and dispatches the leases. A
    heartbeat thread renews the leases while handlers run.

    Args:
        engine: the queue's Engine (``pool_pre_ping=True`` is advisable for servers).
        handlers: job type -> callable ``handler(ctx) -> dict | None``. Only these types are
            claimed; workers with different handler maps may share one database. A handler
            decorated with a :class:`RetryPolicy` sets its type's attempts, back-off and retried
            exceptions; one that raises :class:`NoRetry` fails its job at once.
        max_concurrency: the global cap: most jobs in flight across every worker on this
            database (enforced in the claim transaction). Also this worker's own limit, unless
            ``local_concurrency`` sets a lower one.
        lease_ttl: seconds a lease lasts without a heartbeat.
        heartbeat_interval: seconds between heartbeats (default ``lease_ttl / 3``); must be at
            most half of ``lease_ttl``.
        poll_interval: seconds between ticks when idle.
        worker_id: a name for this worker (default host:pid:random, fresh per Worker).
        timeout: default seconds one dispatch may run (a job's own ``timeout`` wins).
        group_caps: group -> most jobs in flight for that group, across all workers.
        rate_limits: group -> (starts, per_seconds): at most that many job starts in any window
            of that length, across all workers; the group "*" limits every group together.
            A start is the claim, timed by the database clock under the claim lock (one extra
            round trip per claim while rate limits are set).
        retry_backoff: ``f(attempt) -> seconds`` before a failed job is retried (default
            :func:`backoff`); a handler's :class:`RetryPolicy` that sets a back-off wins for its type.
        shutdown_timeout: seconds ``run()`` lets running handlers finish after a stop request
            before it releases their jobs back to ``ready``.
        executor: "thread" (default) runs handlers in threads; "process" runs each dispatch in
            its own process, which is killed when it times out.
        start_method: multiprocessing start method for the process executor (default "fork";
            "spawn" and "forkserver" need handlers importable by name). Checked only with
            ``executor="process"``.
        listen: PostgreSQL with psycopg 3 only: also wake on NOTIFY (enqueue, released
            dependents, reclaims) through a dedicated LISTEN connection, re-LISTENing and
            polling at once after any reconnect. Polling stays on as the fallback.
        on_event: called with an :class:`Event` for every transition (metrics hook).
        finalize_delay: once a handler has finished, seconds to wait for other busy handlers
            to finish too, so their results are written in one transaction (group commit).
            Only short jobs that finish together are delayed, by at most this much.
        local_concurrency: most handlers this worker runs at once (default ``max_concurrency``).
            Set it when several workers share one global cap: with only ``max_concurrency``,
            one worker may take the whole cap and leave the others idle. At most
            ``max_concurrency``.

    The options are validated once into :class:`WorkerOptions` (``worker.options``).

    Raises:
        ConfigError: an option is invalid (e.g. a heartbeat too close to the lease TTL).
    """

    def __init__(
        self,
        engine: Engine,
        handlers: Mapping[str, Callable[[JobContext], Mapping[str, Any] | None]],
        *,
        max_concurrency: int,
        lease_ttl: float = 30.0,
        heartbeat_interval: float | None = None,
        poll_interval: float = 1.0,
        worker_id: str | None = None,
        timeout: float | None = None,
        group_caps: Mapping[str, int] | None = None,
        rate_limits: Mapping[str, tuple[int, float]] | None = None,
        retry_backoff: Callable[[int], float] | None = None,
        shutdown_timeout: float = 30.0,
        executor: str = "thread",
        start_method: str = "fork",
        listen: bool = False,
        on_event: Callable[[Event], None] | None = None,
        finalize_delay: float = 0.005,
        local_concurrency: int | None = None,
    ) -> None:
        _check_worker_target(engine, handlers)
        options = WorkerOptions(
            max_concurrency=max_concurrency, lease_ttl=lease_ttl, heartbeat_interval=heartbeat_interval,
            poll_interval=poll_interval, worker_id=worker_id, timeout=timeout, group_caps=group_caps,
            rate_limits=rate_limits, retry_backoff=retry_backoff, shutdown_timeout=shutdown_timeout, executor=executor,
            start_method=start_method, listen=listen, on_event=on_event, finalize_delay=finalize_delay,
            local_concurrency=local_concurrency,
        )
        super().__init__(engine, handlers, options)
        import multiprocessing

        self._mp = multiprocessing.get_context(start_method) if executor == "process" else None
        _prepare(engine)  # fail fast on an unsupported database
        self._queue: deque[_Running] = deque()  # dispatches for the handler threads (under _lock)
        self._parked: list[Any] = []  # parked handler threads' locks: releasing one wakes its thread
        self._takers = 0  # handler threads on their way to look at _queue (see _start_all)
        self._refused = False  # a handler thread could not be started (see _revive_takers)

    def run(self) -> None:
        """Tick until :meth:`stop` or SIGTERM/SIGINT, then stop gracefully: stop claiming, let
        running handlers finish for up to ``shutdown_timeout``, release the rest to ``ready``."""
        restore = self._install_signals()
        self._start_heartbeats()
        try:
            self._drive(self._run_steps())
        finally:
            self._hb_stop.set()
            restore()

    def run_until_idle(self, timeout: float | None = None) -> bool:
        """Tick until idle: nothing of this worker's types is due (``ready`` with its
        ``run_after`` passed), retrying (``ready`` again after an attempt, backing off), leased
        or running, and none of its handlers is busy. Idle means no work a claim could start:
        jobs first scheduled for later, waiting on upstreams, or in a paused group (see
        :func:`set_group`) do not keep it ticking; due jobs held back by a cap or a spent rate
        limit do, since a later tick starts them. Returns True when idle, False if ``timeout``
        seconds passed (unfinished jobs are then released, as by a graceful stop)."""
        self._start_heartbeats()
        try:
            return self._drive(self._until_idle_steps(timeout))
        finally:
            self._hb_stop.set()
            self._hb_thread = None

    def tick(self) -> int:
        """One round, in one transaction: write the outcomes of finished handlers, reclaim
        expired leases, rank the ready set by fair share and lease what fits under the caps;
        then dispatch. Returns how many jobs it started."""
        return self._tick()

    # -- the thread runner -----------------------------------------------------------------

    def _drive(self, steps: Generator[Any, Any, _T]) -> _T:
        sent: Any = None
        while True:
            try:
                step = steps.send(sent)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            if callable(step):
                sent = step()
            else:
                self._wake.wait(step)
                self._wake.clear()
                sent = None

    def _install_signals(self) -> Callable[[], None]:
        # A signal handler runs on the main thread between two bytecodes, possibly while that
        # thread holds the lock inside the tick loop's threading.Event.wait() or .clear(): a
        # handler that called stop() there would wait for that lock forever. So the handler
        # only writes a byte to a pipe (no lock) and a watcher thread calls stop().
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        r, w = os.pipe()
        os.set_blocking(w, False)
        owner = os.getpid()

        def on_signal(signum: int, frame: Any) -> None:
            # A forked handler process inherits this handler and ignores the signal: its fate
            # is its parent's graceful stop (shutdown_timeout), as for a thread.
            if os.getpid() == owner:
                with contextlib.suppress(OSError):  # full: a byte already waits for the watcher
                    os.write(w, b"s")

        def watch() -> None:
            while os.read(r, 1) == b"s":
                self.stop()
            os.close(r)

        watcher = threading.Thread(target=watch, name="jobq-signals", daemon=True)
        watcher.start()
        previous = {s: _os_signal.getsignal(s) for s in (_os_signal.SIGTERM, _os_signal.SIGINT)}
        for s in previous:
            _os_signal.signal(s, on_signal)

        def restore() -> None:
            for s, h in previous.items():
                _os_signal.signal(s, h)
            os.set_blocking(w, True)
            os.write(w, b"x")  # the watcher's last byte
            watcher.join()
            os.close(w)

        return restore

    def _start_all(self, runs: Sequence[_Running]) -> None:
        # A claim's dispatches go on one queue with one wake-up, not one per dispatch. Handler
        # threads take them in turn, and a thread that takes one while more wait first makes
        # sure another thread is on its way (a parked one woken, or a new one started), so no
        # dispatch waits behind a running handler. Short handlers are then run back to back by
        # the threads already awake: a claim of 64 no-ops wakes a few threads, not 64 (each
        # wake-up a futex call and a hand-over of the GIL that the tick's loop waits for).
        with self._lock:
            self._queue.extend(runs)
            spawn = not self._takers and self._add_taker()
        if spawn:
            self._new_thread()

    def _add_taker(self) -> bool:
        """Under the lock: get one more thread on its way to the queue by waking a parked one;
        True if none is parked, and the caller must start one (after releasing the lock)."""
        self._takers += 1
        if self._parked:
            self._parked.pop().release()
            return False
        return True

    def _new_thread(self) -> None:
        try:
            threading.Thread(target=self._handler_thread, name="jobq-handler", daemon=True).start()
        except BaseException:
            # The OS refused a thread ("can't start new thread": a pids limit, memory): nobody
            # is on the way to the queue after all. Uncounted, the next claim or the loop's next
            # tick (_revive_takers) tries again; counted, every later dispatch waited forever
            # behind a thread that never existed, heartbeated and never run.
            with self._lock:
                self._takers -= 1
                self._refused = True
            raise

    def _try_new_thread(self) -> bool:
        """From a handler thread that took a dispatch while more wait: start another thread, or
        (refused) return False and let this one take the rest after its handler. Raising here
        would end this thread with its dispatch taken and never run, heartbeated forever."""
        try:
            self._new_thread()
            return True
        except Exception:  # noqa: BLE001 - refused, and uncounted by _new_thread
            return False

    def _revive_takers(self) -> None:
        if not self._refused:
            return  # only a refusal leaves dispatches with nobody on the way (tests/core/test_handoff.py)
        with self._lock:
            self._refused = False
            spawn = bool(self._queue) and not self._takers and self._add_taker()
        if spawn:
            self._new_thread()  # refused again: raises out of the tick, as the claim's own start did

    def _handler_idle(self) -> None:
        # As its handler returns (under the lock): this thread looks at the queue next, so a
        # claim that lands meanwhile need not wake or start another one.
        self._takers += 1

    def _handler_thread(self) -> None:
        # Runs dispatches from the queue; parks when it is empty, and exits after
        # _IDLE_THREAD_SECONDS parked. It counts in _takers whenever it is on its way to the
        # queue: started, woken, or back from a handler.
        target = self._execute_in_process if self.options.executor == "process" else self._execute
        park = threading.Lock()
        park.acquire()
        while True:
            spawn = False
            with self._lock:
                self._takers -= 1
                run: _Running | None = None
                if self._queue:
                    run = self._queue.popleft()
                    spawn = bool(self._queue) and not self._takers and self._add_taker()
                else:
                    self._parked.append(park)
            if spawn:
                self._try_new_thread()
            if run is None:
                if park.acquire(timeout=_IDLE_THREAD_SECONDS):
                    continue  # woken: the waker counted this thread a taker
                with self._lock:
                    if park in self._parked:
                        self._parked.remove(park)
                        return
                park.acquire()  # a waker took it off the list just now: its release is due
                continue
            run.thread = threading.current_thread()
            kind, payload = target(run)
            self._finish(run, kind, payload)  # counts this thread a taker again, in the same step

    def _execute(self, run: _Running) -> tuple[str, Any]:
        try:
            value = self.handlers[run.lease.type](run.ctx)
            return self._check_result(value)
        except _Unwind as unwind:  # ctx.wait_for/sleep/sleep_until or Snooze: written as a suspension
            return "suspend", unwind.intent
        except BaseException as exc:  # noqa: BLE001 - SystemExit in a handler thread is a failure, never success
            return _error_outcome(exc, self._policies.get(run.lease.type))

    def _execute_in_process(self, run: _Running) -> tuple[str, Any]:
        from multiprocessing.connection import wait

        assert self._mp is not None
        recv, send = self._mp.Pipe()  # duplex: the handler process's checkpoints and spawns are answered
        stop = self._mp.Event()
        with _LIFELINE_LOCK:
            lifeline, held = self._mp.Pipe(duplex=False)  # the child's death watch: see _die_with_worker
            _LIFELINES.add(held)
        proc = self._mp.Process(  # type: ignore[attr-defined]
            target=_process_main, args=(_die_with_worker, self.handlers[run.lease.type], run.lease, stop, send, lifeline),
                                name=f"jobq-job-{run.lease.id}", daemon=True)
        run.process = proc
        msg = None
        try:
            with _LIFELINE_LOCK:  # a fork inherits the lifelines in _LIFELINES, and no other
                proc.start()
            send.close()
            lifeline.close()
            while msg is None:
                ready = wait([recv, proc.sentinel], timeout=0.1)
                if run.ctx.stop_requested:
                    stop.set()
                if recv in ready:
                    try:
                        msg = recv.recv()
                    except EOFError:
                        break
                    if msg[0] == "progress":
                        run.ctx._progress, msg = msg[1], None
                    elif msg[0] == "checkpoint":
                        state, run.ctx._progress = msg[1]
                        recv.send(self._checkpoint_for_child(run, state))
                        msg = None
                    elif msg[0] == "spawn":
                        recv.send(self._spawn_answer(run, msg[1]))
                        msg = None
                    elif msg[0] == "upstream":
                        recv.send(self._upstream_answer(run))
                        msg = None
                    elif msg[0] == "log":
                        recv.send(self._log_answer(run, *msg[1]))
                        msg = None
                    elif msg[0] == "wait":
                        recv.send(self._wait_answer_for_child(run, msg[1]))
                        msg = None
                elif proc.sentinel in ready:
                    break
            proc.join()
            if msg is None:
                kind, payload = "error", f"handler process died (exit code {proc.exitcode})"
            elif msg[0] == "ok":
                kind, payload = self._check_result(msg[1])
            elif msg[0] == "suspend":
                kind, payload = "suspend", msg[1]
            else:  # "error", or "fatal" (not to be retried: _error_outcome in the handler's process)
                kind, payload = ("fatal" if msg[0] == "fatal" else "error"), msg[1]
        except BaseException as exc:  # noqa: BLE001
            kind, payload = "error", _format_error(exc)
        finally:
            recv.close()
            lifeline.close()
            with _LIFELINE_LOCK:
                _LIFELINES.discard(held)
                held.close()
        return kind, payload

    def _checkpoint_for_child(self, run: _Running, state: dict[str, Any]) -> tuple[str, str]:
        try:
            self._store_checkpoint(run.ctx, state)
            return "ok", ""
        except LeaseLost as exc:
            return "lost", str(exc)
        except Exception as exc:  # noqa: BLE001 - the handler's checkpoint() raises it
            return "error", f"checkpoint not stored: {_one_line(exc)}"
    def _log_answer(self, run: _Running, message: str, fields: Any) -> tuple[str, Any]:
        try:
            return "ok", self._store_log(run.ctx, message, fields)
        except Exception as exc:  # noqa: BLE001 - raised in the handler process as a JobqError
            return "error", f"ctx.log line not stored: {_one_line(exc)}"

    def _upstream_answer(self, run: _Running) -> tuple[str, Any]:
        try:
            return "ok", self._read_upstream(run.ctx)
        except Exception as exc:  # noqa: BLE001 - raised in the handler process as a JobqError
            return "error", f"ctx.upstream could not be read: {_one_line(exc)}"

    def _wait_answer_for_child(self, run: _Running, op: tuple[Any, ...]) -> tuple[str, Any]:
        try:
            return self._wait_op(run, op)
        except JobqError as exc:
            return "raise", exc
        except Exception as exc:  # noqa: BLE001 - a driver's error may not pickle: its text does
            return "raise", JobqError(f"wait failed: {_one_line(exc)}")

    def _spawn_answer(self, run: _Running, plan: _Plan) -> tuple[str, Any]:
        try:
            return "ids", self._spawn(run, plan)
        except JobqError as exc:
            return "raise", exc
        except Exception as exc:  # noqa: BLE001 - a driver's error may not pickle: its text does
            return "raise", JobqError(f"spawn failed: {_one_line(exc)}")

    def _stop_handlers(self, runs: Sequence[_Running]) -> None:
        for run in runs:
            if run.process is not None and run.process.is_alive():
                run.process.kill()  # the process executor can really stop a stuck handler

    def _start_heartbeats(self) -> None:
        if self._hb_thread is not None and self._hb_thread.is_alive():
            return
        self._hb_stop = threading.Event()
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, args=(self._hb_stop,), name="jobq-heartbeat", daemon=True)
        self._hb_thread.start()
        if self.options.listen:
            threading.Thread(target=self._listen_loop, args=(self._hb_stop,), name="jobq-listen", daemon=True).start()

    def _listen_loop(self, stop: threading.Event) -> None:
        delay = 0.1
        while not stop.is_set():
            conn = None
            try:
                conn = _listener_connection(self.engine)
                self._wake.set()  # anything enqueued while we were not listening: poll now
                delay = 0.1
                while not stop.is_set():
                    for _ in conn.notifies(timeout=0.5, stop_after=1):
                        self._notified = True
                        self._wake.set()
            except Exception as exc:  # noqa: BLE001 - the listener must outlive every database fault
                _emit(self.options.on_event, Event("db_error", 0, worker_id=self.worker_id, error="listener: " + _one_line(exc)))
                stop.wait(delay)
                delay = min(delay * 2, 5.0)
            finally:
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:  # noqa: BLE001
                        pass

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.heartbeat_interval):
            self._beat()

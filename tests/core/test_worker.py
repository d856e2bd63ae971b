"""Worker: dispatch, DAG order, failures and retries, containers, timeouts, stop, options."""

from __future__ import annotations

import datetime as dt
import pathlib
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import sqlalchemy as sa

import jobq
from helpers import FAST, db_now, meeting, no_deadline_for_the_retry, peak_overlap, state, wait_for


class Recorder:
    """Handlers that record (job id, start, end) so tests can check order and overlap."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: dict[int, tuple[float, float]] = {}
        self.runs: list[int] = []

    def handler(self, sleep: float = 0.0, meet: int = 0):
        """Each run sleeps ``sleep``; the first ``meet`` runs also wait until all of them are
        running (helpers.meeting)."""
        arrive = meeting(meet) if meet else None

        def run(ctx: jobq.JobContext):
            t0 = time.monotonic()
            if arrive is not None:
                arrive()
            if sleep:
                time.sleep(sleep)
            with self.lock:
                self.runs.append(ctx.id)
                self.spans[ctx.id] = (t0, time.monotonic())
            return {"id": ctx.id, "attempt": ctx.attempt}

        return run


def test_worker_runs_a_dag_in_dependency_order(engine: sa.Engine) -> None:
    """A worker runs a diamond DAG: each job once, every downstream starting only after its
    upstreams finished, all done with their results stored."""
    rec = Recorder()
    a = jobq.enqueue(engine, "step", {"n": 1})
    b = jobq.enqueue(engine, "step", {"n": 2}, depends_on=[a])
    c = jobq.enqueue(engine, "step", {"n": 3}, depends_on=[a])
    d = jobq.enqueue(engine, "step", {"n": 4}, depends_on=[b, c])
    w = jobq.Worker(engine, {"step": rec.handler(0.05)}, max_concurrency=3, **FAST)
    assert w.run_until_idle(timeout=30)
    assert sorted(rec.runs) == [a, b, c, d]
    for up, down in ((a, b), (a, c), (b, d), (c, d)):
        assert rec.spans[up][1] <= rec.spans[down][0], f"{down} started before {up} finished"
    assert {jobq.get(engine, j).state for j in (a, b, c, d)} == {"done"}  # type: ignore[union-attr]
    assert jobq.get(engine, d).result == {"id": d, "attempt": 1}  # type: ignore[union-attr]


def test_cap_bounds_overlap_inside_one_worker(engine: sa.Engine) -> None:
    """12 jobs under max_concurrency=3 in one worker: never more than 3 handlers overlap, and at
    least 2 do (the cap does not serialise everything)."""
    rec = Recorder()
    for _ in range(12):
        jobq.enqueue(engine, "slow")
    w = jobq.Worker(engine, {"slow": rec.handler(0.05, meet=2)}, max_concurrency=3, **FAST)
    assert w.run_until_idle(timeout=60)
    assert len(rec.runs) == 12 and 2 <= peak_overlap(rec.spans.values()) <= 3


def test_a_raising_handler_is_retried_then_failed_with_its_error(engine: sa.Engine) -> None:
    """A handler that always raises is retried up to max_attempts, then failed with its exception
    and traceback; its dependent fails too instead of waiting forever; the events are claimed,
    started, retried per attempt and end in failed."""
    calls: list[int] = []

    def boom(ctx: jobq.JobContext) -> None:
        calls.append(ctx.attempt)
        raise RuntimeError(f"broken on attempt {ctx.attempt}")

    jid = jobq.enqueue(engine, "boom", max_attempts=3)
    after = jobq.enqueue(engine, "boom", depends_on=[jid])
    events: list[jobq.Event] = []
    w = jobq.Worker(engine, {"boom": boom}, max_concurrency=1, on_event=events.append, **FAST)
    assert w.run_until_idle(timeout=30)
    info = jobq.get(engine, jid)
    assert info is not None
    assert calls == [1, 2, 3]
    assert (info.state, info.attempts, info.in_flight, info.result) == ("failed", 3, False, None)
    assert info.error is not None and info.error.startswith("RuntimeError: broken on attempt 3")
    assert "Traceback" in info.error
    assert state(engine, after) == "failed"  # not left waiting forever
    assert [e.action for e in events if e.job_id == jid] == ["claimed", "started", "retried"] * 2 + ["claimed", "started", "failed"]
    assert {e.action for e in events} <= set(jobq.EVENT_ACTIONS)


def test_a_result_that_cannot_be_stored_fails_without_retry(engine: sa.Engine) -> None:
    """A handler result that cannot be stored (not JSON-serialisable) writes no `done`: the
    attempt fails with that error and is not retried (a retry would not improve it)."""
    jid = jobq.enqueue(engine, "bad", max_attempts=5)
    w = jobq.Worker(engine, {"bad": lambda ctx: {"when": object()}}, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=30)
    info = jobq.get(engine, jid)
    assert info is not None
    assert (info.state, info.attempts, info.result) == ("failed", 1, None)
    assert "not JSON-serialisable" in (info.error or "")


def test_system_exit_in_a_handler_is_never_success(engine: sa.Engine) -> None:
    """A handler raising SystemExit is a failed attempt (the error starts with SystemExit), never a
    success, and the worker does not exit with it."""
    def leave(ctx: jobq.JobContext) -> None:
        raise SystemExit(3)

    jid = jobq.enqueue(engine, "exit", max_attempts=1)
    assert jobq.Worker(engine, {"exit": leave}, max_concurrency=1, **FAST).run_until_idle(timeout=30)
    info = jobq.get(engine, jid)
    assert info is not None and info.state == "failed" and (info.error or "").startswith("SystemExit")


def test_a_worker_never_runs_a_type_it_has_no_handler_for(engine: sa.Engine) -> None:
    """A worker claims only the types it has handlers for: a job of another type stays ready for
    another worker."""
    rec = Recorder()
    mine = jobq.enqueue(engine, "mine")
    theirs = jobq.enqueue(engine, "theirs")
    assert jobq.Worker(engine, {"mine": rec.handler()}, max_concurrency=2, **FAST).run_until_idle(timeout=30)
    assert rec.runs == [mine]
    assert state(engine, theirs) == "ready"


def test_containers_roll_up_done_or_failed(engine: sa.Engine) -> None:
    """Containers roll up: all children done makes the container done and releases its dependent;
    one failed child fails the container (with the count in its error and no attempt charged) and
    its dependent. No container is dispatched to a handler."""
    def work(ctx: jobq.JobContext):
        if ctx.args.get("fail"):
            raise ValueError("no")
        return {}

    good = jobq.enqueue(engine, "box", container=True)
    bad = jobq.enqueue(engine, "box", container=True)
    g1 = jobq.enqueue(engine, "work", parent=good)
    g2 = jobq.enqueue(engine, "work", parent=good, depends_on=[g1])
    b1 = jobq.enqueue(engine, "work", {"fail": True}, parent=bad, max_attempts=1)
    b2 = jobq.enqueue(engine, "work", parent=bad)
    after_good = jobq.enqueue(engine, "work", depends_on=[good])
    after_bad = jobq.enqueue(engine, "work", depends_on=[bad])
    w = jobq.Worker(engine, {"work": work, "box": lambda ctx: pytest.fail("a container was dispatched")},
                    max_concurrency=2, **FAST)
    assert w.run_until_idle(timeout=30)
    assert [state(engine, j) for j in (g1, g2, good, after_good)] == ["done"] * 4
    assert [state(engine, j) for j in (b1, b2, bad, after_bad)] == ["failed", "done", "failed", "failed"]
    assert "1 child job(s) failed" in (jobq.get(engine, bad).error or "")  # type: ignore[union-attr]
    assert jobq.get(engine, bad).attempts == 0  # type: ignore[union-attr]


def test_a_timed_out_dispatch_is_retried_and_its_late_result_dropped(engine: sa.Engine) -> None:
    """A handler that ignores its stop signal runs past its timeout: the job is retried, the retry's
    result is stored, and the first attempt's result, returned only after the retry finished, is
    dropped. A bug shows the late result ({'late': True}) or a third attempt."""
    release = threading.Event()
    attempts: list[int] = []

    def slow(ctx: jobq.JobContext):
        attempts.append(ctx.attempt)
        if ctx.attempt == 1:
            release.wait(30)  # ignores its stop signal, like a stuck network call
            return {"late": True}
        return {"late": False}

    jid = jobq.enqueue(engine, "slow", timeout=0.3, max_attempts=2)
    events: list[jobq.Event] = []

    def on_event(ev: jobq.Event) -> None:
        events.append(ev)
        if ev.action == "timed_out":
            no_deadline_for_the_retry(engine, ev.job_id)
        if ev.action == "finished" and ev.attempt == 2:
            release.set()  # the retry's result is written: now the stuck first attempt returns, late

    w = jobq.Worker(engine, {"slow": slow}, max_concurrency=2, on_event=on_event, **FAST)
    try:
        # idle only once no abandoned handler is left: the late first attempt has returned
        # and been handled by the time this returns, so the result below is final
        assert w.run_until_idle(timeout=30)
    finally:
        release.set()
    info = jobq.get(engine, jid)
    assert info is not None and (info.state, info.result, info.attempts) == ("done", {"late": False}, 2)
    assert "timed_out" in [e.action for e in events]


def test_stop_releases_unfinished_jobs_without_charging_an_attempt(engine: sa.Engine) -> None:
    """stop() while a handler runs past shutdown_timeout: run() returns and the job goes back to
    ready at once, attempts 0, no owner, instead of staying leased until its TTL."""
    started = threading.Event()

    def long(ctx: jobq.JobContext):
        started.set()
        ctx.wait(30)
        return {"stopped": ctx.stop_reason}

    jid = jobq.enqueue(engine, "long")
    w = jobq.Worker(engine, {"long": long}, max_concurrency=1, shutdown_timeout=0.2, **FAST)
    t = threading.Thread(target=w.run)
    t.start()
    assert started.wait(10)
    w.stop()
    t.join(10)
    assert not t.is_alive()
    info = jobq.get(engine, jid)
    assert info is not None and (info.state, info.attempts, info.lease_owner) == ("ready", 0, None)


# A signal handler runs on the main thread between two bytecodes, so it may run while that
# thread holds the lock inside the tick loop's threading.Event. The child below holds it, as
# Event.wait() and .clear() do, and signals itself: a handler that takes that lock (the broken
# variant: stop() from the handler, as run() once installed) never returns.
_SIGTERM_UNDER_THE_WAKE_LOCK = """
    import os, signal, sys
    import sqlalchemy as sa
    import jobq
    worker = jobq.Worker(sa.create_engine(sys.argv[1]), {"x": lambda ctx: None}, max_concurrency=1)
    if sys.argv[2] == "broken":
        def install():
            for s in (signal.SIGTERM, signal.SIGINT):
                signal.signal(s, lambda signum, frame: worker.stop())
            return lambda: None
        worker._install_signals = install
    restore = worker._install_signals()
    with worker._wake._cond:  # the main thread holds the wake Event's lock
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs on this thread, now
        sum(range(1000))
    worker._stopping.wait()
    restore()
    print("stopped")
"""


@pytest.mark.parametrize("broken", [False, True])
def test_sigterm_stops_a_worker_whose_main_thread_holds_the_wake_lock(tmp_path: pathlib.Path, broken: bool) -> None:
    """No engine code: the signal path is the same on every engine."""
    args = [sys.executable, "-c", textwrap.dedent(_SIGTERM_UNDER_THE_WAKE_LOCK), f"sqlite:///{tmp_path / 'q.db'}",
            "broken" if broken else "fixed"]
    here = pathlib.Path(jobq.__file__).resolve().parent  # the package, or the single file's folder
    env = {"PYTHONPATH": str(here.parent if (here / "__init__.py").exists() else here)}
    if broken:  # deadlocked: no time is long enough, so a few seconds show it
        with pytest.raises(subprocess.TimeoutExpired):
            subprocess.run(args, env=env, capture_output=True, text=True, timeout=5)
        return
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "stopped"), out.stderr


def test_handlers_see_lease_loss_through_their_context(engine: sa.Engine) -> None:
    """Another party takes a running job's lease, as a reclaim would. Correct: the handler sees
    ctx.lease_lost, the worker lets the job go without writing its result, and the new holder
    keeps the lease. A bug shows the result written over the new holder, or the job never leaving
    the worker."""
    seen = threading.Event()

    def watch(ctx: jobq.JobContext):
        while not ctx.wait(0.02):
            pass
        if ctx.lease_lost:
            seen.set()
        return {"should": "be dropped"}

    jid = jobq.enqueue(engine, "watch", max_attempts=1)
    # Heartbeats every 0.2 s tell the handler; a long lease, so that a slow machine's stall
    # never lets the worker's own sweep take the job back first.
    w = jobq.Worker(engine, {"watch": watch}, max_concurrency=1, poll_interval=0.02, lease_ttl=30,
                    heartbeat_interval=0.2)
    assert w.tick() == 1
    with engine.begin() as conn:  # another party takes the job away (as a reclaim would)
        conn.execute(sa.update(jobq.Job.__table__).where(jobq.Job.__table__.c.id == jid)
                     .values(lease_token="stolen", lease_owner="other"))
    w._start_heartbeats()
    assert seen.wait(10)
    wait_for(lambda: (w.tick(), w.in_flight == 0)[1], what="the lost job to leave the worker")
    w._hb_stop.set()
    info = jobq.get(engine, jid)
    assert info is not None and info.result is None and info.lease_owner == "other"


class _ClockThatFailsOnce(jobq._Clock):
    """The worker's clock refreshes from the database now and then; this one's refresh fails
    once, the moment ``armed`` is set, with the error a dead connection gives."""

    def __init__(self, engine: sa.Engine) -> None:
        super().__init__(engine)
        self.armed = threading.Event()
        self.failed = 0

    def now(self):  # type: ignore[no-untyped-def]
        if self.armed.is_set() and not self.failed:
            self.failed += 1
            raise sa.exc.OperationalError("SELECT clock_timestamp()", None, Exception("server closed the connection"))
        return super().now()


def test_a_clock_refresh_that_fails_loses_no_finished_result(engine: sa.Engine) -> None:
    """A handler finishes; the tick that would write its result first reads the worker's
    clock, and that read fails. The result goes back in the queue and the next tick writes it:
    the job ends done, once, and the worker goes idle. (When the clock was read outside the
    write's error handling, the result was dropped: the job stayed running under a lease the
    heartbeat kept renewing, and the worker never went idle.)"""
    job = jobq.enqueue(engine, "step")
    events: list[str] = []
    w = jobq.Worker(engine, {"step": lambda ctx: w._clock.armed.set() or {"ok": True}}, max_concurrency=1,
                    on_event=lambda ev: events.append(ev.action), **FAST)
    w._clock = _ClockThatFailsOnce(engine)
    assert w.run_until_idle(timeout=20) is True
    assert w._clock.failed == 1 and "db_error" in events
    info = jobq.get(engine, job)
    assert (info.state, info.result, info.attempts) == ("done", {"ok": True}, 1)


def test_worker_options_are_checked(engine: sa.Engine) -> None:
    """Every bad Worker option raises ConfigError naming it; two workers get distinct worker_ids,
    and heartbeat_interval defaults to a third of lease_ttl."""
    h = {"t": lambda ctx: None}
    cases = [
        (dict(handlers={}, max_concurrency=1), "non-empty mapping"),
        (dict(handlers={"t": 5}, max_concurrency=1), "not callable"),
        (dict(handlers=h, max_concurrency=0), "max_concurrency"),
        (dict(handlers=h, max_concurrency=True), "max_concurrency must be an int"),
        (dict(handlers=h, max_concurrency=1, lease_ttl=10, heartbeat_interval=6), "at most half of lease_ttl"),
        (dict(handlers=h, max_concurrency=1, lease_ttl=-1), "lease_ttl"),
        (dict(handlers=h, max_concurrency=1, poll_interval=float("nan")), "poll_interval"),
        (dict(handlers=h, max_concurrency=1, group_caps={"g": 0}), "group_caps"),
    ]
    for kwargs, message in cases:
        with pytest.raises(jobq.ConfigError, match=message):
            jobq.Worker(engine, kwargs.pop("handlers"), **kwargs)
    a = jobq.Worker(engine, h, max_concurrency=1)
    b = jobq.Worker(engine, h, max_concurrency=1)
    assert a.worker_id != b.worker_id  # a restarted worker never inherits an old lease
    assert a.heartbeat_interval == pytest.approx(10.0)


class _SweepsOnlyAtStart(jobq.Worker):
    """Broken variant of the reclaim cadence: the first tick sweeps, later ones never do."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._sweep_every = float("inf")


@pytest.mark.parametrize("broken", [False, True], ids=["cadence", "broken-sweeps-only-at-start"])
def test_a_running_worker_reclaims_a_lease_that_expires_after_its_first_sweep(engine: sa.Engine, broken: bool) -> None:
    """A worker sweeps expired leases at its first tick and then every min(lease_ttl / 4, 1 s),
    not on every tick. Correct: a job claimed after the worker started by a holder that then
    stalls is reclaimed by one of that worker's later sweeps and finishes on attempt 2. The bug
    this catches (the broken variant, which sweeps only at start): the job stays leased to its
    dead holder while the worker keeps ticking beside it."""
    w = (_SweepsOnlyAtStart if broken else jobq.Worker)(engine, {"t": lambda ctx: None}, max_concurrency=2,
                                                          worker_id="w", **FAST)
    assert w.tick() == 0  # the first sweep: nothing to reclaim yet
    jid = jobq.enqueue(engine, "t")
    assert jobq.claim(engine, "stalled", 0.2) == jid  # its holder never reports back
    wait_for(lambda: jobq.get(engine, jid).lease_expires < db_now(engine).replace(tzinfo=dt.UTC),
             what="the stalled lease to expire")
    # The broken worker never sweeps again: it ticks for twice the sweep interval, then gives up.
    assert w.run_until_idle(timeout=2.0 if broken else 30) is not broken
    info = jobq.get(engine, jid)
    assert info is not None
    if broken:
        assert (info.state, info.lease_owner) == ("leased", "stalled")
    else:
        assert (info.state, info.attempts) == ("done", 2)

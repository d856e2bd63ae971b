"""Worker options and faults a worker must survive: WorkerOptions, the start method, the idle
test, per-job reclaim logs, a re-claimed own job, an exhausted pool, unwritable batches, and
large results finishing together (issues 12, 13 and 20)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import multiprocessing
import threading

import pytest
import sqlalchemy as sa

import jobq
from helpers import expire_leases, state, wait_for

FAST = dict(poll_interval=0.02, lease_ttl=5.0, retry_backoff=lambda attempt: 0.0)


def test_worker_options_are_one_frozen_validated_value(engine: sa.Engine) -> None:
    """Worker(...) builds a WorkerOptions once, with the defaults resolved; it cannot change
    under a running worker, and the same checks refuse bad values when built directly."""
    w = jobq.Worker(engine, {"t": lambda ctx: None}, max_concurrency=2, lease_ttl=9)
    o = w.options
    assert isinstance(o, jobq.WorkerOptions)
    assert (o.max_concurrency, o.lease_ttl, o.heartbeat_interval, o.worker_id) == (2, 9.0, 3.0, w.worker_id)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.lease_ttl = 1.0  # type: ignore[misc]
    with pytest.raises(jobq.ConfigError, match="at most half of lease_ttl"):
        jobq.WorkerOptions(max_concurrency=1, lease_ttl=10, heartbeat_interval=6)


def test_a_thread_worker_needs_no_fork(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where fork is unavailable (Windows, some sandboxes), a Worker with the default thread
    executor is created and runs; only executor="process" needs the start method. (The bug:
    every Worker raised "start_method 'fork' is not available here".)"""
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    job = jobq.enqueue(engine, "t")
    w = jobq.Worker(engine, {"t": lambda ctx: {"ok": True}}, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=30)
    assert state(engine, job) == "done"
    with pytest.raises(jobq.ConfigError, match="start_method 'fork' is not available"):
        jobq.Worker(engine, {"t": lambda ctx: None}, max_concurrency=1, executor="process")


def test_run_until_idle_ignores_jobs_scheduled_for_later(engine: sa.Engine) -> None:
    """Idle means nothing due, leased or running: a job due in a year must not keep
    run_until_idle ticking (the bug: it returned False at its timeout, or never without one)."""
    later = jobq.enqueue(engine, "t", run_after=dt.timedelta(days=365))
    now = jobq.enqueue(engine, "t")
    w = jobq.Worker(engine, {"t": lambda ctx: {"ok": True}}, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=10) is True
    assert (state(engine, now), state(engine, later)) == ("done", "ready")


def test_each_reclaimed_job_is_logged_with_its_id_type_and_attempt(engine: sa.Engine,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A reclaim is one log record per job, naming it, with flat ``extra`` keys (the bug: one
    record ``reclaimed job=0 type= attempt=0 error=1 expired lease(s)``)."""
    a = jobq.enqueue(engine, "resize")
    b = jobq.enqueue(engine, "resize")
    assert jobq.claim(engine, "gone-worker", ttl=60) is not None
    assert jobq.claim(engine, "gone-worker", ttl=60) is not None
    expire_leases(engine, a, b)
    w = jobq.Worker(engine, {"resize": lambda ctx: None}, max_concurrency=1, **FAST)
    with caplog.at_level(logging.INFO, logger="jobq"):
        w.tick()
    recs = [r for r in caplog.records if getattr(r, "action", None) == "reclaimed"]
    assert sorted((r.job_id, r.type, r.attempt, r.worker_id) for r in recs) == [  # type: ignore[attr-defined]
        (a, "resize", 1, w.worker_id), (b, "resize", 1, w.worker_id)]
    assert all(f"job={r.job_id}" in r.getMessage() for r in recs)  # type: ignore[attr-defined]


def test_a_worker_keeps_track_of_its_own_job_claimed_again(engine: sa.Engine) -> None:
    """A stalled worker reclaims its own expired lease and claims the job again (attempt 2)
    while attempt 1's handler is still finishing. Attempt 1's refused result must not take
    attempt 2 with it: the worker still holds attempt 2 (heartbeats, timeouts, release), and
    the job ends done by attempt 2. (The bug: dispatches keyed by job id; writing attempt 1's
    refusal popped attempt 2's entry, which was then never heartbeated and expired again and
    again until the job failed as a poison job.)"""
    go = {1: threading.Event(), 2: threading.Event()}
    started = {1: threading.Event(), 2: threading.Event()}

    def hold(ctx: jobq.JobContext) -> dict:
        started[ctx.attempt].set()
        go[ctx.attempt].wait(30)
        return {"attempt": ctx.attempt}

    job = jobq.enqueue(engine, "t", max_attempts=3)
    w = jobq.Worker(engine, {"t": hold}, max_concurrency=2, poll_interval=0.02, lease_ttl=60,
                    retry_backoff=lambda a: 0.0)
    assert w.tick() == 1 and started[1].wait(10)
    expire_leases(engine, job)  # as if the worker had been stopped past its lease
    wait_for(lambda: w.tick() or started[2].is_set(), what="attempt 2 to be claimed by the same worker")
    assert started[2].wait(10)
    go[1].set()  # attempt 1 returns; its result is refused
    wait_for(lambda: (w.tick(), w._busy == 1 and not w._abandoned and not w._finished)[1],
             what="attempt 1's return to be dealt with")
    assert w.in_flight == 1, "the worker lost track of attempt 2"
    go[2].set()
    wait_for(lambda: (w.tick(), state(engine, job) == "done")[1], what="attempt 2 to finish")
    info = jobq.get(engine, job)
    assert info is not None and info.result == {"attempt": 2} and w.in_flight == 0


def test_an_exhausted_connection_pool_does_not_kill_the_worker(db_url: str) -> None:
    """A handler holds the pool's only connection: the tick and the heartbeat time out on the
    pool (sqlalchemy.exc.TimeoutError, not a DBAPIError). The worker logs db_error, backs
    off, and carries on once the connection is back; its heartbeat thread survives too. (The
    bug: run() raised and the heartbeat thread died.)"""
    eng = sa.create_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    try:
        job = jobq.enqueue(eng, "t")
        errors: list[str] = []
        beat_failed = threading.Event()
        holding, release = threading.Event(), threading.Event()

        def on_event(ev: jobq.Event) -> None:
            if ev.action == "db_error":
                errors.append(ev.error or "")
                if threading.current_thread().name == "jobq-heartbeat":
                    beat_failed.set()

        def handler(ctx: jobq.JobContext) -> dict:
            with eng.connect():
                holding.set()
                release.wait(30)
            return {"ok": True}

        w = jobq.Worker(eng, {"t": handler}, max_concurrency=2, poll_interval=0.02, lease_ttl=6, on_event=on_event)
        out: list[object] = []
        t = threading.Thread(target=lambda: out.append(w.run_until_idle(timeout=60)), daemon=True)
        t.start()
        assert holding.wait(20)
        wait_for(beat_failed.is_set, timeout=10, what="a heartbeat to meet the exhausted pool")
        assert t.is_alive() and w._hb_thread is not None and w._hb_thread.is_alive()
        release.set()
        t.join(60)
        assert out == [True]
        assert any("QueuePool limit" in e for e in errors)
        info = jobq.get(eng, job)
        assert info is not None and (info.state, info.result, info.attempts) == ("done", {"ok": True}, 1)
    finally:
        eng.dispose()


def test_a_batch_that_cannot_be_written_neither_kills_nor_wedges_the_worker(
        engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """One job's outcome can never be written (its finalize raises a non-database error, as a
    RecursionError from a deep rollup did), in a batch with others. The worker survives, the
    others are written (the batch is split), and the stuck outcome is given up after a bounded
    number of tries: its lease expires and the job ends failed as a poison job. (The bug: the
    exception escaped Worker.run(), or the same batch was retried forever.)"""
    poison = jobq.enqueue(engine, "t", {"n": 0}, max_attempts=1)
    others = [jobq.enqueue(engine, "t", {"n": i}) for i in range(1, 5)]
    gate = threading.Barrier(5, timeout=20)

    def checkpoint(point: str, job_ids=()) -> None:  # type: ignore[no-untyped-def]
        if point == "finalize_before_commit" and poison in job_ids:
            raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(jobq, "_checkpoint", checkpoint)
    gave_up: list[int] = []
    # Only first attempts meet at the gate: the lease is short (the poison job must expire), so a
    # stall on a loaded machine may let another job's lease expire too, and its rerun must not
    # wait for four others that will never come.
    w = jobq.Worker(engine, {"t": lambda ctx: (ctx.attempt == 1 and gate.wait(), {"n": ctx.args["n"]})[1]},
                    max_concurrency=5, poll_interval=0.02, lease_ttl=2.0, retry_backoff=lambda a: 0.0, finalize_delay=0.5,
                    on_event=lambda ev: gave_up.append(ev.job_id) if ev.action == "db_error" and
                    "gave up" in (ev.error or "") else None)
    assert w.run_until_idle(timeout=90) is True
    assert [state(engine, j) for j in others] == ["done"] * 4
    info = jobq.get(engine, poison)
    assert info is not None and info.state == "failed" and "lease expired" in (info.error or "")
    assert gave_up == [poison]


def test_large_results_finishing_together_are_all_written(engine: sa.Engine) -> None:
    """Twenty results of about 0.9 MB each finish within one finalize_delay. Batches are sized
    by bytes, so no statement approaches the server's packet limit (MariaDB's default
    max_allowed_packet is 16 MiB). (The bug: one UPDATE carried all of them; MariaDB dropped
    the connection and the worker retried the same batch forever, writing nothing.)"""
    n = 20
    ids = [jobq.enqueue(engine, "big", {"i": i}) for i in range(n)]
    gate = threading.Barrier(n, timeout=60)
    blob = "x" * 900_000

    def big(ctx: jobq.JobContext) -> dict:
        gate.wait()
        return {"i": ctx.args["i"], "blob": blob}

    w = jobq.Worker(engine, {"big": big}, max_concurrency=n, poll_interval=0.02, lease_ttl=30, finalize_delay=0.5)
    assert w.run_until_idle(timeout=120) is True
    with engine.connect() as conn:
        rows = conn.execute(sa.select(jobq.Job.__table__.c.state).where(jobq.Job.__table__.c.id.in_(ids))).scalars()
        assert list(rows) == ["done"] * n
    info = jobq.get(engine, ids[-1])
    assert info is not None and info.result == {"i": n - 1, "blob": blob}

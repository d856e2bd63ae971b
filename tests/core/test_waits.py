"""Jobs that wait without holding a slot (issue 42): ``jobq.signal`` with ``ctx.wait_for``,
durable sleep (``ctx.sleep_until``, ``ctx.sleep``) and ``raise jobq.Snooze(seconds)``.

A suspension ends the dispatch without charging an attempt: the job is ``ready`` and not yet
due, holding no lease and no slot, its checkpoint kept; it runs again from the top when its
signal comes or its time is up. The races (a signal against its timeout, two signals, a
signal against a cancel) are tests/races/test_signal_races.py. Waits of a second or less are
waited out by polling the worker with a deadline, never by a sleep standing in for an event."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import jobq
from dbs import async_url
from helpers import FAST, JOBS, TABLES, db_now, state, wait_for

WAITS = TABLES["jobq_waits"]
SIGNALS = TABLES["jobq_signals"]


def outcomes(engine: sa.Engine, job: int) -> list[tuple[int, str]]:
    return [(a.attempt, a.outcome) for a in jobq.attempts(engine, job)]


def row(engine: sa.Engine, job: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.select(JOBS).where(JOBS.c.id == job)).one()


def run_until(engine: sa.Engine, w: jobq.Worker, job: int, want: str, timeout: float = 30.0) -> None:
    """Tick the worker until ``job`` reaches ``want`` (a wake-up at a time: polled, with a deadline)."""
    wait_for(lambda: w.run_until_idle(timeout=timeout) and state(engine, job) == want, timeout=timeout,
             what=f"job {job} {want}")


def approval(ctx: jobq.JobContext) -> dict:
    """Checkpoints, then waits for its approval. Module-level: the process executor pickles it."""
    if ctx.state is None:
        ctx.checkpoint({"prepared": True})
    payload = ctx.wait_for(f"approve-{ctx.args['order']}")
    return {"payload": payload, "state": ctx.state, "attempt": ctx.attempt}


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_wait_for_suspends_and_its_signal_runs_it_again(engine: sa.Engine, executor: str) -> None:
    """The first dispatch suspends: the job is ready, not due, holds no lease or slot, its
    checkpoint kept and its attempt given back. signal() makes it due; the re-run's wait_for
    returns the payload. A bug would show as a failed attempt, a job left running, or a
    second attempt number."""
    job = jobq.enqueue(engine, "approve", {"order": 7}, max_attempts=1)
    w = jobq.Worker(engine, {"approve": approval}, max_concurrency=1, executor=executor, **FAST)
    assert w.run_until_idle(timeout=60)
    r = row(engine, job)
    assert (r.state, r.attempts, r.in_flight, r.lease_token) == ("ready", 0, False, None)
    assert r.checkpoint == {"prepared": True}
    assert r.run_after > db_now(engine) + dt.timedelta(days=365)  # no timeout: only the signal wakes it
    st = jobq.stats(engine)
    assert (st["awaiting_signal"], st["ready_scheduled"], st["next_scheduled"]) == (1, 1, None)
    assert jobq.signal(engine, "approve-7", {"ok": True}) is True
    assert w.run_until_idle(timeout=60)
    info = jobq.get(engine, job)
    assert info is not None and info.state == "done", info
    assert info.result == {"payload": {"ok": True}, "state": {"prepared": True}, "attempt": 1}
    assert outcomes(engine, job) == [(1, "suspended"), (1, "done")]


def test_a_signal_sent_before_the_wait_is_not_lost(engine: sa.Engine) -> None:
    """The signal comes first: the job's wait_for returns its payload without suspending."""
    assert jobq.signal(engine, "approve-1", [1, "two"]) is True
    job = jobq.enqueue(engine, "approve", {"order": 1})
    w = jobq.Worker(engine, {"approve": approval}, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=30)
    info = jobq.get(engine, job)
    assert info is not None and info.result is not None and info.result["payload"] == [1, "two"]
    assert outcomes(engine, job) == [(1, "done")]


def test_only_the_first_signal_of_a_key_counts(engine: sa.Engine) -> None:
    """A second signal of a key changes nothing (returns False); every waiter reads the first
    payload, one that waited before and one that waits after."""
    early = jobq.enqueue(engine, "approve", {"order": 2})
    w = jobq.Worker(engine, {"approve": approval}, max_concurrency=2, **FAST)
    assert w.run_until_idle(timeout=30)
    assert jobq.signal(engine, "approve-2", "first") is True
    assert jobq.signal(engine, "approve-2", "second") is False
    late = jobq.enqueue(engine, "approve", {"order": 2})
    assert w.run_until_idle(timeout=30)
    for job in (early, late):
        info = jobq.get(engine, job)
        assert info is not None and info.result is not None and info.result["payload"] == "first", info


def test_a_suspension_passes_through_except_exception(engine: sa.Engine) -> None:
    """A handler that wraps wait_for, sleep and Snooze in ``except Exception`` still suspends:
    the unwind is a BaseException. A bug would show as the handler's fallback result."""
    def careless(ctx: jobq.JobContext) -> dict:
        try:
            ctx.wait_for("never-sent")
        except Exception:  # noqa: BLE001 - the point of the test
            return {"swallowed": True}
        return {}

    job = jobq.enqueue(engine, "c", {})
    w = jobq.Worker(engine, {"c": careless}, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=30)
    assert state(engine, job) == "ready"
    assert outcomes(engine, job) == [(1, "suspended")]


def test_a_signal_in_a_rolled_back_transaction_wakes_nothing(engine: sa.Engine) -> None:
    """signal(conn, ...) writes in the caller's transaction: rolled back, no signal exists and
    the waiting job stays asleep; committed, it wakes."""
    job = jobq.enqueue(engine, "approve", {"order": 3})
    w = jobq.Worker(engine, {"approve": approval}, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=30)
    before = row(engine, job).run_after
    with engine.connect() as conn:
        with conn.begin() as tx:
            assert jobq.signal(conn, "approve-3", 1) is True
            tx.rollback()
    assert row(engine, job).run_after == before
    assert w.run_until_idle(timeout=30) and state(engine, job) == "ready"
    with engine.begin() as conn:
        jobq.signal(conn, "approve-3", 2)
    assert w.run_until_idle(timeout=30)
    info = jobq.get(engine, job)
    assert info is not None and info.result is not None and info.result["payload"] == 2


def times_out(ctx: jobq.JobContext) -> dict:
    try:
        ctx.wait_for("late", timeout=0.3)
    except jobq.WaitTimeout as exc:
        if ctx.attempt == 1:
            jobq.signal(_ENGINE[0], "late", "too late")
            raise RuntimeError("fail once after the timeout") from exc
        return {"timed_out": exc.key, "attempt": ctx.attempt}
    return {"timed_out": None}


_ENGINE: list[sa.Engine] = []


def test_wait_timeout_is_raised_in_the_rerun_and_stays(engine: sa.Engine) -> None:
    """No signal within the timeout: the re-run's wait_for raises WaitTimeout. A signal sent
    after that (here by the handler itself, before it fails) is not seen by the retry: the
    timeout stays the answer. A bug would show as a payload in the retry."""
    _ENGINE[:] = [engine]
    job = jobq.enqueue(engine, "t", {}, max_attempts=2)
    w = jobq.Worker(engine, {"t": times_out}, max_concurrency=1, **FAST)
    run_until(engine, w, job, "done")
    info = jobq.get(engine, job)
    assert info is not None and info.result == {"timed_out": "late", "attempt": 2}, info
    assert outcomes(engine, job) == [(1, "suspended"), (1, "failed"), (2, "done")]


def test_sleep_until_suspends_until_then(engine: sa.Engine) -> None:
    """sleep_until(t) suspends with run_after = t; the re-run after t returns at once.

    t is a margin ahead of the database clock. On a machine so slow that the first run reaches
    sleep_until after t, returning at once is right and proves nothing: the clock read after it
    returned must be past t (else it returned early, a bug), and the scenario is tried again with
    a margin four times as long. Slowness costs time, never a false failure."""
    returned: list[dt.datetime] = []

    def napper(ctx: jobq.JobContext) -> dict:
        ctx.sleep_until(dt.datetime.fromisoformat(ctx.args["when"]))
        returned.append(db_now(engine).replace(tzinfo=dt.UTC))
        return {"attempt": ctx.attempt}

    w = jobq.Worker(engine, {"n": napper}, max_concurrency=1, **FAST)
    for margin in (0.5, 2.0, 8.0, 32.0):
        returned.clear()
        when = (db_now(engine) + dt.timedelta(seconds=margin)).replace(tzinfo=dt.UTC)
        job = jobq.enqueue(engine, "n", {"when": when.isoformat()}, max_attempts=1)
        assert w.run_until_idle(timeout=60)
        if not returned:  # it suspended
            break
        assert returned[0] >= when, f"sleep_until returned at {returned[0]}, before {when}"
    else:
        pytest.fail("the first run never reached sleep_until before its end, even 32 s ahead")
    r = row(engine, job)
    assert (r.state, r.attempts) == ("ready", 0)
    assert r.run_after.replace(tzinfo=dt.UTC) == when
    run_until(engine, w, job, "done")
    assert len(returned) == 1 and returned[0] >= when
    assert outcomes(engine, job) == [(1, "suspended"), (1, "done")]


def test_a_relative_sleep_survives_a_rerun_from_the_top(engine: sa.Engine) -> None:
    """ctx.sleep(s) stores its end with the job: after it, a retry from the top passes the same
    sleep at once instead of sleeping again. A bug would show as a second suspension."""
    runs: list[int] = []

    def sleeper(ctx: jobq.JobContext) -> dict:
        runs.append(ctx.attempt)
        ctx.sleep(0.3)
        ctx.sleep(0, name="zero")
        if ctx.attempt == 1:
            raise RuntimeError("fail after the sleep")
        return {"runs": len(runs)}

    job = jobq.enqueue(engine, "s", {}, max_attempts=2)
    w = jobq.Worker(engine, {"s": sleeper}, max_concurrency=1, **FAST)
    run_until(engine, w, job, "done")
    assert runs == [1, 1, 2]
    assert outcomes(engine, job) == [(1, "suspended"), (1, "failed"), (2, "done")]


def test_snooze_charges_no_attempt_and_is_bounded(engine: sa.Engine) -> None:
    """Snooze(0) three times with max_attempts=1: no attempt charged, the job finishes. A job
    that snoozes for ever fails at its limit, naming it, and its dependent fails too."""
    def snoozer(ctx: jobq.JobContext) -> dict:
        n = (ctx.state or {}).get("n", 0)
        if n < 3:
            ctx.checkpoint({"n": n + 1})
            raise jobq.Snooze(0)
        return {"n": n}

    def forever(ctx: jobq.JobContext) -> None:
        raise jobq.Snooze(0, limit=2)

    ok = jobq.enqueue(engine, "s", {}, max_attempts=1)
    bad = jobq.enqueue(engine, "f", {}, max_attempts=5)
    after = jobq.enqueue(engine, "s", {}, depends_on=[bad])
    w = jobq.Worker(engine, {"s": snoozer, "f": forever}, max_concurrency=2, **FAST)
    assert w.run_until_idle(timeout=30)
    info = jobq.get(engine, ok)
    assert info is not None and info.state == "done" and info.result == {"n": 3}, info
    assert outcomes(engine, ok) == [(1, "snoozed")] * 3 + [(1, "done")]
    info = jobq.get(engine, bad)
    assert info is not None and info.state == "failed", info
    assert info.error is not None and "snoozed 2 times" in info.error
    assert outcomes(engine, bad) == [(1, "snoozed"), (1, "snoozed"), (1, "failed")]
    assert state(engine, after) == "failed"


def test_bad_wait_input_is_refused_with_one_line(engine: sa.Engine) -> None:
    """Bad keys, timeouts, times and snoozes: InvalidJob/ValueError in the handler, nothing written."""
    errors: list[str] = []

    def bad(ctx: jobq.JobContext) -> None:
        for call in (lambda: ctx.wait_for(""), lambda: ctx.wait_for("k", timeout=-1),
                     lambda: ctx.wait_for("k", timeout=float("nan")), lambda: ctx.sleep_until(dt.datetime(2030, 1, 1)),
                     lambda: ctx.sleep(float("inf")), lambda: ctx.sleep(1, name=" x")):
            try:
                call()
            except jobq.InvalidJob as exc:
                errors.append(str(exc))
        for args in ((-1,), (float("nan"),), (True,)):
            try:
                jobq.Snooze(*args)
            except ValueError as exc:
                errors.append(str(exc))

    job = jobq.enqueue(engine, "b", {})
    w = jobq.Worker(engine, {"b": bad}, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=30)
    assert state(engine, job) == "done"
    assert len(errors) == 9 and all("\n" not in e for e in errors), errors
    with pytest.raises(jobq.InvalidJob):
        jobq.signal(engine, "k", {"x": float("nan")})
    with pytest.raises(jobq.InvalidJob):
        jobq.signal(engine, "", None)


def test_cancel_of_a_suspended_job_cancels_it(engine: sa.Engine) -> None:
    """A suspended job is unstarted work: cancel ends it at once, and its signal later wakes nothing."""
    job = jobq.enqueue(engine, "approve", {"order": 4})
    w = jobq.Worker(engine, {"approve": approval}, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=30)
    assert jobq.cancel(engine, job) == "cancelled"
    jobq.signal(engine, "approve-4", None)
    assert w.run_until_idle(timeout=30)
    assert state(engine, job) == "cancelled"


def test_suspended_jobs_count_against_no_cap(engine: sa.Engine) -> None:
    """With a global cap of 1 and a group cap of 1, a suspended job holds neither: the next job
    of its group runs while it waits. A bug would leave the second job ready."""
    jobq.set_limit(engine, max_in_flight=1)
    jobq.set_group(engine, "g", max_in_flight=1)
    first = jobq.enqueue(engine, "approve", {"order": 5}, group_key="g")
    w = jobq.Worker(engine, {"approve": approval, "x": lambda ctx: {"x": 1}}, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=30)
    second = jobq.enqueue(engine, "x", {}, group_key="g")
    assert w.run_until_idle(timeout=30)
    assert (state(engine, first), state(engine, second)) == ("ready", "done")
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(JOBS).where(JOBS.c.in_flight == sa.true())).scalar() == 0


def test_async_worker_waits_and_wakes(db_url: str, engine: sa.Engine) -> None:
    """The AsyncWorker: wait_for suspends (called without await, as ctx.enqueue is) and the
    signal sent with jobq.aio.signal wakes it."""
    async def handler(ctx: jobq.JobContext) -> dict:
        await asyncio.sleep(0)
        return {"payload": ctx.wait_for("async-key")}

    job = jobq.enqueue(engine, "a", {})

    async def main() -> None:
        aengine = create_async_engine(async_url(db_url))
        try:
            w = jobq.AsyncWorker(aengine, {"a": handler}, max_concurrency=1, **FAST)
            assert await w.run_until_idle(timeout=30)
            assert state(engine, job) == "ready"
            assert await jobq.aio.signal(aengine, "async-key", {"n": 1}) is True
            assert await w.run_until_idle(timeout=30)
        finally:
            await aengine.dispose()

    asyncio.run(main())
    info = jobq.get(engine, job)
    assert info is not None and info.result == {"payload": {"n": 1}}, info
    assert outcomes(engine, job) == [(1, "suspended"), (1, "done")]

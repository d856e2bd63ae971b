"""Final errors and retry policy per job type (issue 42, items 3 and 4), on every engine.

Correct: ``raise jobq.NoRetry(reason)`` ends the job ``failed`` on that attempt, whatever attempts
it has left, its error naming NoRetry and the reason, and its waiting dependents close as after
any final failure; in a thread, a handler process and an AsyncWorker alike. The bugs these catch:
a NoRetry taken for an ordinary error (the job retried until max_attempts), a dependent left
waiting, or the handler process's NoRetry lost on its way through the pipe.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import jobq
from dbs import async_url
from helpers import FAST, expire_leases, no_deadline_for_the_retry, wait_for


def _history(engine: sa.Engine, job_id: int) -> list[tuple[int, str]]:
    return [(a.attempt, a.outcome) for a in jobq.attempts(engine, job_id)]


def _gives_up(ctx: jobq.JobContext) -> dict[str, Any]:
    raise jobq.NoRetry(f"order {ctx.args['order']} was refunded")


def _check_failed_once(engine: sa.Engine, job: int, dependent: int) -> None:
    info = jobq.get(engine, job)
    assert info is not None and (info.state, info.attempts) == ("failed", 1), info
    assert info.error is not None and info.error.startswith("NoRetry: order 7 was refunded"), info.error
    assert _history(engine, job) == [(1, "failed")]
    dep = jobq.get(engine, dependent)
    assert dep is not None and dep.state == "failed" and dep.attempts == 0, dep
    assert dep.error is not None and str(job) in dep.error, dep.error


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_no_retry_fails_the_job_at_once_and_closes_its_dependents(engine: sa.Engine, executor: str) -> None:
    """5 attempts allowed, the handler raises NoRetry on the first: one attempt, failed, its
    dependent failed naming it. The bug: attempts 2..5 run (NoRetry treated as an error)."""
    job = jobq.enqueue(engine, "charge", {"order": 7}, max_attempts=5)
    dependent = jobq.enqueue(engine, "ship", depends_on=[job])
    w = jobq.Worker(engine, {"charge": _gives_up, "ship": lambda ctx: None}, max_concurrency=1, executor=executor,
                    **FAST)
    assert w.run_until_idle(timeout=60)
    _check_failed_once(engine, job, dependent)


def test_no_retry_in_an_async_worker(engine: sa.Engine, db_url: str) -> None:
    """The same in an AsyncWorker: its task's NoRetry fails the job on attempt 1."""

    async def gives_up(ctx: jobq.JobContext) -> dict[str, Any]:
        await asyncio.sleep(0)
        return _gives_up(ctx)

    async def ship(ctx: jobq.JobContext) -> None:
        return None

    job = jobq.enqueue(engine, "charge", {"order": 7}, max_attempts=5)
    dependent = jobq.enqueue(engine, "ship", depends_on=[job])

    async def main() -> bool:
        eng = create_async_engine(async_url(db_url))
        try:
            w = jobq.AsyncWorker(eng, {"charge": gives_up, "ship": ship}, max_concurrency=1, **FAST)
            return await w.run_until_idle(timeout=60)
        finally:
            await eng.dispose()

    assert asyncio.run(main())
    _check_failed_once(engine, job, dependent)


def test_a_late_no_retry_after_a_timeout_does_not_fail_the_job(engine: sa.Engine) -> None:
    """Attempt 1 runs past its timeout (ignoring the stop request), attempt 2 succeeds, and only
    then does attempt 1 raise NoRetry: the timeout was written as a retry, the late NoRetry is
    discarded with the abandoned dispatch, the job ends done. The bug: a NoRetry from a dispatch
    that no longer holds the lease failing the job (or its retry)."""
    release = threading.Event()

    def slow(ctx: jobq.JobContext) -> dict[str, int]:
        if ctx.attempt == 1:
            release.wait(30)  # a stuck call that ignores ctx.stop_requested
            raise jobq.NoRetry("too late to matter")
        return {"attempt": ctx.attempt}

    def on_event(ev: jobq.Event) -> None:
        if ev.action == "timed_out":
            no_deadline_for_the_retry(engine, ev.job_id)
        if ev.action == "finished":
            release.set()  # attempt 2 is written: now attempt 1 raises, late

    job = jobq.enqueue(engine, "slow", timeout=0.3, max_attempts=2)
    w = jobq.Worker(engine, {"slow": slow}, max_concurrency=2, on_event=on_event, **FAST)
    try:
        assert w.run_until_idle(timeout=60)
    finally:
        release.set()
    info = jobq.get(engine, job)
    assert info is not None and (info.state, info.attempts, info.result) == ("done", 2, {"attempt": 2}), info
    assert _history(engine, job) == [(1, "timeout"), (2, "done")]


def test_an_ordinary_error_is_still_retried(engine: sa.Engine) -> None:
    """The control: the same handler raising RuntimeError runs all 3 attempts (so the tests
    above see NoRetry's effect, not a queue that never retries)."""
    job = jobq.enqueue(engine, "flaky", max_attempts=3)

    def flaky(ctx: jobq.JobContext) -> None:
        raise RuntimeError("try again")

    assert jobq.Worker(engine, {"flaky": flaky}, max_concurrency=1, **FAST).run_until_idle(timeout=60)
    assert _history(engine, job) == [(1, "failed"), (2, "failed"), (3, "failed")]


# ---- retry policy per job type ----------------------------------------------------------------
#
# Correct: a handler decorated with jobq.RetryPolicy sets, for its type only, how many attempts a
# job has (unless the job was enqueued with its own max_attempts), the back-off before each retry
# (over the worker's retry_backoff), and which exceptions are retried (any other fails the job at
# once, saying so). The bugs these catch: the policy ignored (3 attempts, the worker's back-off),
# the policy beating enqueue's value, the limit known to the worker but not to the row (a reclaim
# sweep then retries a job the policy says is done for), and retry_on lost in a handler process.


@jobq.RetryPolicy(attempts=5)
def _always_fails(ctx: jobq.JobContext) -> None:
    raise RuntimeError(f"attempt {ctx.attempt} failed")


def _plain_fails(ctx: jobq.JobContext) -> None:
    raise RuntimeError("no policy here")


def test_policy_attempts_apply_unless_the_job_was_enqueued_with_its_own(engine: sa.Engine) -> None:
    """attempts=5 on the handler: a job enqueued without max_attempts runs 5 times and its row
    says 5; one enqueued with max_attempts=2 runs twice; a type without a policy keeps 3."""
    by_policy = jobq.enqueue(engine, "policy")
    own = jobq.enqueue(engine, "policy", max_attempts=2)
    plain = jobq.enqueue(engine, "plain")
    w = jobq.Worker(engine, {"policy": _always_fails, "plain": _plain_fails}, max_concurrency=2, **FAST)
    assert w.run_until_idle(timeout=60)
    runs = {j: (jobq.get(engine, j).state, jobq.get(engine, j).attempts, jobq.get(engine, j).max_attempts)  # type: ignore[union-attr]
            for j in (by_policy, own, plain)}
    assert runs == {by_policy: ("failed", 5, 5), own: ("failed", 2, 2), plain: ("failed", 3, 3)}, runs


def test_an_explicit_max_attempts_of_3_wins_over_the_policy(engine: sa.Engine) -> None:
    """max_attempts=3 given at enqueue (or in a submit item) is the job's own number, though
    it equals the default: the policy's attempts=5 must not replace it. The bug this catches:
    a row that holds 3 read as "not given", so the job runs 5 times."""
    own = jobq.enqueue(engine, "policy", max_attempts=3)
    keys = jobq.submit(engine, [{"key": "a", "type": "policy", "max_attempts": 3}, {"key": "b", "type": "policy"}])
    w = jobq.Worker(engine, {"policy": _always_fails}, max_concurrency=2, **FAST)
    assert w.run_until_idle(timeout=60)
    runs = {j: (jobq.get(engine, j).state, jobq.get(engine, j).attempts)  # type: ignore[union-attr]
            for j in (own, keys["a"], keys["b"])}
    assert runs == {own: ("failed", 3), keys["a"]: ("failed", 3), keys["b"]: ("failed", 5)}, runs


def test_policy_attempts_hold_for_a_reclaimed_lease(engine: sa.Engine) -> None:
    """attempts=1, and the dispatch's lease expires and is swept while its handler runs: the
    sweep must see the policy's limit and fail the job (attempt 1 of 1), not give it back to
    ready. The bug: the limit lives only in the worker's memory (the row still says 3), so the
    sweep retries it and the job runs 3 times."""

    @jobq.RetryPolicy(attempts=1)
    def stalls(ctx: jobq.JobContext) -> None:
        expire_leases(engine, ctx.id)  # as if this worker had stalled past its lease
        jobq.reclaim(engine)

    job = jobq.enqueue(engine, "stalls")
    assert jobq.Worker(engine, {"stalls": stalls}, max_concurrency=1, **FAST).run_until_idle(timeout=60)
    info = jobq.get(engine, job)
    assert info is not None and (info.state, info.attempts, info.max_attempts) == ("failed", 1, 1), info
    assert info.error is not None and "attempt 1 of 1" in info.error, info.error


def test_policy_back_off_wins_over_the_worker_s(engine: sa.Engine) -> None:
    """base=100 s without jitter on one handler, the worker's retry_backoff 50 s: that job's
    retry is due exactly 100 s after its failed attempt ended (both written with one clock
    reading); a job of a type whose policy sets only attempts keeps the worker's 50 s. Ticked
    by hand: run_until_idle would wait out a retry's back-off."""

    @jobq.RetryPolicy(attempts=2, base=100, jitter=0)
    def slow(ctx: jobq.JobContext) -> None:
        raise RuntimeError("later")

    job = jobq.enqueue(engine, "slow")
    other = jobq.enqueue(engine, "policy")
    w = jobq.Worker(engine, {"slow": slow, "policy": _always_fails}, max_concurrency=2,
                    **{**FAST, "retry_backoff": lambda attempt: 50.0})
    wait_for(lambda: w.tick() >= 0 and jobq.attempts(engine, job) and jobq.attempts(engine, other),
             timeout=30, what="one failed attempt each")
    due = {}
    for j in (job, other):
        info, ended = jobq.get(engine, j), jobq.attempts(engine, j)
        assert info is not None and info.state == "ready" and [a.outcome for a in ended] == ["failed"], info
        due[j] = info.run_after - ended[0].finished_at
    assert due == {job: dt.timedelta(seconds=100), other: dt.timedelta(seconds=50)}, due


class _Flaky(ConnectionError):
    pass


@jobq.RetryPolicy(attempts=4, retry_on=(ConnectionError,))
def _bad_input_or_network(ctx: jobq.JobContext) -> None:
    if ctx.args["fault"] == "network":
        raise _Flaky("peer reset")
    raise ValueError("malformed order")


def _check_retry_on(engine: sa.Engine, network: int, bad: int, dependent: int) -> None:
    assert _history(engine, network) == [(i, "failed") for i in (1, 2, 3, 4)]
    info = jobq.get(engine, bad)
    assert info is not None and (info.state, info.attempts) == ("failed", 1), info
    assert info.error is not None and info.error.startswith(
        "not retried (ValueError is not in the handler's RetryPolicy retry_on): ValueError: malformed order"), info.error
    assert jobq.get(engine, dependent).state == "failed"  # type: ignore[union-attr]


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_policy_retry_on_fails_other_exceptions_at_once(engine: sa.Engine, executor: str) -> None:
    """retry_on=(ConnectionError,): a subclass of it is retried to the policy's 4 attempts; a
    ValueError fails the job on attempt 1, its error saying why, and closes its dependent."""
    network = jobq.enqueue(engine, "order", {"fault": "network"})
    bad = jobq.enqueue(engine, "order", {"fault": "input"})
    dependent = jobq.enqueue(engine, "ship", depends_on=[bad])
    w = jobq.Worker(engine, {"order": _bad_input_or_network, "ship": lambda ctx: None}, max_concurrency=2,
                    executor=executor, **FAST)
    assert w.run_until_idle(timeout=60)
    _check_retry_on(engine, network, bad, dependent)


def test_policy_in_an_async_worker(engine: sa.Engine, db_url: str) -> None:
    """An async def handler takes the policy the same way: attempts and retry_on hold."""

    @jobq.RetryPolicy(attempts=4, retry_on=ConnectionError)
    async def order(ctx: jobq.JobContext) -> None:
        await asyncio.sleep(0)
        _bad_input_or_network(ctx)

    async def ship(ctx: jobq.JobContext) -> None:
        return None

    network = jobq.enqueue(engine, "order", {"fault": "network"})
    bad = jobq.enqueue(engine, "order", {"fault": "input"})
    dependent = jobq.enqueue(engine, "ship", depends_on=[bad])

    async def main() -> bool:
        eng = create_async_engine(async_url(db_url))
        try:
            w = jobq.AsyncWorker(eng, {"order": order, "ship": ship}, max_concurrency=2, **FAST)
            return await w.run_until_idle(timeout=60)
        finally:
            await eng.dispose()

    assert asyncio.run(main())
    _check_retry_on(engine, network, bad, dependent)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"attempts": 0}, "RetryPolicy attempts must be"),
    ({"attempts": True}, "RetryPolicy attempts must be an int"),
    ({"base": -1}, "RetryPolicy base must be"),
    ({"jitter": 2}, "RetryPolicy jitter must be"),
    ({"cap": float("nan")}, "RetryPolicy cap must be"),
    ({"retry_on": ("ConnectionError",)}, "RetryPolicy retry_on must be exception classes"),
    ({"retry_on": int}, "RetryPolicy retry_on must be exception classes"),
])
def test_a_bad_policy_is_refused_with_one_line(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(jobq.ConfigError, match=message) as err:
        jobq.RetryPolicy(**kwargs)
    assert "\n" not in str(err.value)


def test_a_policy_cannot_be_attached_to_a_bound_method() -> None:
    class Handlers:
        def run(self, ctx: jobq.JobContext) -> None:
            return None

    with pytest.raises(jobq.ConfigError, match="decorate the function itself"):
        jobq.RetryPolicy(attempts=2)(Handlers().run)


def test_a_scheduled_job_takes_the_policy_unless_its_schedule_gives_max_attempts(engine: sa.Engine) -> None:
    """A schedule made without max_attempts stores none (NULL), so the jobs it enqueues take
    the handler's RetryPolicy attempts (5); one made with max_attempts=3 keeps 3. The bug: the
    schedule's default stored as an explicit 3, so no scheduled job ever took its policy."""
    jobq.schedule(engine, "policy-default", "policy", every=dt.timedelta(minutes=1))
    jobq.schedule(engine, "policy-three", "policy", every=dt.timedelta(minutes=1), max_attempts=3)
    assert [s.max_attempts for s in jobq.schedules(engine)] == [None, 3]
    due = max(s.next_run_at for s in jobq.schedules(engine)).astimezone(dt.UTC).replace(tzinfo=None)
    ids = sorted(jobq._fire_due(engine, due))
    fired = dict(zip(["policy-default", "policy-three"], ids, strict=True))  # made in this order
    assert [jobq.get(engine, j).type for j in ids] == ["policy", "policy"]  # type: ignore[union-attr]
    jobs = jobq.Job.__table__
    with engine.begin() as conn:  # their slot is a minute ahead: make them due now
        conn.execute(sa.update(jobs).where(jobs.c.id.in_(ids)).values(run_after=jobq.stats(engine)["now"]))
    assert jobq.Worker(engine, {"policy": _always_fails}, max_concurrency=2, **FAST).run_until_idle(timeout=60)
    assert {n: jobq.get(engine, j).attempts for n, j in fired.items()} == {  # type: ignore[union-attr]
        "policy-default": 5, "policy-three": 3}

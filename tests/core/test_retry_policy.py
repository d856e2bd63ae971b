"""Final errors and retry policy per job type (issue 42, items 3 and 4), on every engine.

Correct: ``raise jobq.NoRetry(reason)`` ends the job ``failed`` on that attempt, whatever attempts
it has left, its error naming NoRetry and the reason, and its waiting dependents close as after
any final failure; in a thread, a handler process and an AsyncWorker alike. The bugs these catch:
a NoRetry taken for an ordinary error (the job retried until max_attempts), a dependent left
waiting, or the handler process's NoRetry lost on its way through the pipe.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import jobq
from dbs import async_url
from helpers import FAST


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


def test_an_ordinary_error_is_still_retried(engine: sa.Engine) -> None:
    """The control: the same handler raising RuntimeError runs all 3 attempts (so the tests
    above see NoRetry's effect, not a queue that never retries)."""
    job = jobq.enqueue(engine, "flaky", max_attempts=3)

    def flaky(ctx: jobq.JobContext) -> None:
        raise RuntimeError("try again")

    assert jobq.Worker(engine, {"flaky": flaky}, max_concurrency=1, **FAST).run_until_idle(timeout=60)
    assert _history(engine, job) == [(1, "failed"), (2, "failed"), (3, "failed")]

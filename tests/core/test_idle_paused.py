"""run_until_idle: idle means no work a claim could start. A paused group's due jobs are none
(no tick starts them until the group is resumed), so they do not keep it ticking; due jobs
held back by a spent rate limit are (a later tick starts them), so it waits for them. The
checks count ticks, never seconds: a worker that ticks on past a bound raises instead of
hanging the test."""

from __future__ import annotations

import asyncio
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import jobq
from dbs import async_url
from helpers import JOBS, state

FAST = dict(poll_interval=0.01, lease_ttl=5.0, retry_backoff=lambda attempt: 0.0)
#: Ticks an idle check may take with only a paused group's jobs due: one that starts the other
#: group's job, one that finds nothing to start (idle). The bug ticked forever.
MOST_TICKS = 20


class TooManyTicks(AssertionError):
    pass


def count_ticks(w: Any, most: int) -> list[int]:
    """Count ``w``'s ticks; the tick after ``most`` raises, ending run_until_idle(timeout=None)."""
    ticks = [0]
    tick = w._safe_tick

    def counted() -> Any:
        ticks[0] += 1
        if ticks[0] > most:
            raise TooManyTicks(f"run_until_idle still ticking after {most} ticks")
        return tick()

    w._safe_tick = counted
    return ticks


def test_run_until_idle_returns_while_a_paused_group_holds_due_jobs(engine: sa.Engine) -> None:
    """The bug: with a paused group's job due, run_until_idle(timeout=None) never returned (its
    idle check counted the paused job as due work). Now it runs the other group's job, returns
    True, and leaves the paused job ready; once the group is resumed, it runs that one too."""
    held = jobq.enqueue(engine, "t", group_key="paused")
    retrying = jobq.enqueue(engine, "t", group_key="paused")
    with engine.begin() as conn:  # a job backing off after an attempt counts as due work too
        conn.execute(sa.update(JOBS).where(JOBS.c.id == retrying).values(attempts=1))
    other = jobq.enqueue(engine, "t", group_key="other")
    jobq.set_group(engine, "paused", paused=True)
    w = jobq.Worker(engine, {"t": lambda ctx: {"ok": True}}, max_concurrency=2, **FAST)
    ticks = count_ticks(w, MOST_TICKS)
    assert w.run_until_idle(timeout=None) is True
    assert ticks[0] <= MOST_TICKS
    assert (state(engine, other), state(engine, held), state(engine, retrying)) == ("done", "ready", "ready")
    jobq.set_group(engine, "paused", paused=False)
    assert w.run_until_idle(timeout=None) is True
    assert (state(engine, held), state(engine, retrying)) == ("done", "done")


def test_run_until_idle_waits_for_jobs_a_rate_limit_holds_back(engine: sa.Engine) -> None:
    """A spent rate limit is not idleness: those jobs are claimable at a later tick, so
    run_until_idle ticks on until it has run them all (1 start per 0.1 s: three jobs)."""
    jobs = [jobq.enqueue(engine, "t", group_key="rated") for _ in range(3)]
    jobq.set_group(engine, "rated", rate_limit=(1, jobq._MIN_RATE_PERIOD))
    w = jobq.Worker(engine, {"t": lambda ctx: {"ok": True}}, max_concurrency=3, **FAST)
    assert w.run_until_idle(timeout=None) is True
    assert [state(engine, j) for j in jobs] == ["done"] * 3


async def _noop(ctx: jobq.JobContext) -> dict:
    return {"ok": True}


def test_async_run_until_idle_returns_while_a_paused_group_holds_due_jobs(db_url: str, engine: sa.Engine) -> None:
    """AsyncWorker shares the idle check: the same paused job does not keep it ticking."""
    held = jobq.enqueue(engine, "t", group_key="paused")
    other = jobq.enqueue(engine, "t", group_key="other")
    jobq.set_group(engine, "paused", paused=True)

    async def main() -> tuple[bool, int]:
        eng = create_async_engine(async_url(db_url))
        try:
            w = jobq.AsyncWorker(eng, {"t": _noop}, max_concurrency=2, **FAST)
            ticks = count_ticks(w, MOST_TICKS)
            return await w.run_until_idle(timeout=None), ticks[0]
        finally:
            await eng.dispose()

    idle, ticks = asyncio.run(main())
    assert idle is True and ticks <= MOST_TICKS
    assert (state(engine, other), state(engine, held)) == ("done", "ready")

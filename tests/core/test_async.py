"""jobq.aio and AsyncWorker: the sync API's twins on an AsyncEngine, on every engine
(aiosqlite, psycopg async, aiomysql). The race test is tests/races (async claimers)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

import jobq
from dbs import async_url
from helpers import SLOTS, state


def _run(coro_fn, db_url: str):
    """Run ``coro_fn(async_engine)`` on a fresh event loop and dispose the engine after."""

    async def main():
        eng = create_async_engine(async_url(db_url))
        try:
            return await coro_fn(eng)
        finally:
            await eng.dispose()

    return asyncio.run(main())


def test_the_queue_functions_have_async_twins(db_url: str, engine: sa.Engine) -> None:
    """enqueue, claim_batch, heartbeat, finalize (fenced), fail, get, cancel, retry, stats,
    why, reclaim on an AsyncEngine: same results as the sync calls, same errors."""

    async def scenario(eng: AsyncEngine) -> None:
        await jobq.aio.create_schema(eng)  # idempotent, like the sync one
        a = await jobq.aio.enqueue(eng, "t", {"n": 1})
        b = await jobq.aio.enqueue(eng, "t", depends_on=[a])
        (lease,) = await jobq.aio.claim_batch(eng, "w", 30, limit=5, max_in_flight=4)
        assert lease.id == a  # b waits on a
        await jobq.aio.heartbeat(eng, lease, 30)
        with pytest.raises(jobq.LeaseLost):
            await jobq.aio.finalize(eng, a, {}, worker_id="w", token="0" * 32)
        await jobq.aio.finalize(eng, a, {"ok": True}, worker_id="w", token=lease.token)
        info = await jobq.aio.get(eng, a)
        assert info is not None and (info.state, info.result) == ("done", {"ok": True})
        assert (await jobq.aio.get(eng, b)).state == "ready"  # released in the finalize's transaction
        assert await jobq.aio.claim(eng, "w", 30) == b
        assert await jobq.aio.fail(eng, b, "boom", worker_id="w", retry=False) == "failed"
        assert "failed" in await jobq.aio.why(eng, b)
        assert await jobq.aio.retry(eng, b) == [b]
        assert await jobq.aio.cancel(eng, b) == "cancelled"
        assert (await jobq.aio.stats(eng))["states"]["cancelled"] == 1
        assert await jobq.aio.reclaim(eng) == 0
        with pytest.raises(jobq.ConfigError, match="AsyncEngine"):
            await jobq.aio.enqueue(engine, "t")  # a sync engine is refused with a clear error

    _run(scenario, db_url)


def test_async_enqueue_in_the_callers_transaction(db_url: str, engine: sa.Engine) -> None:
    """With an AsyncSession the job is written in the caller's transaction: it exists only if
    the caller commits."""

    async def scenario(eng: AsyncEngine) -> tuple[int, int]:
        async with AsyncSession(eng) as session:
            kept = await jobq.aio.enqueue(session, "t")
            await session.commit()
        async with AsyncSession(eng) as session:
            dropped = await jobq.aio.enqueue(session, "t")
            await session.rollback()
        return kept, dropped

    kept, dropped = _run(scenario, db_url)
    assert state(engine, kept) == "ready"
    assert jobq.get(engine, dropped) is None


def test_async_worker_runs_a_dag_of_coroutines(db_url: str, engine: sa.Engine) -> None:
    """Async handlers run as tasks under the cap, upstreams first, results stored."""
    order: list[str] = []
    live = peak = 0

    async def step(ctx: jobq.JobContext) -> dict:
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        await asyncio.sleep(0.02)
        order.append(ctx.args["name"])
        live -= 1
        return {"name": ctx.args["name"]}

    ids = jobq.submit(engine, [{"key": "a", "type": "step", "args": {"name": "a"}}]
                      + [{"key": f"m{i}", "type": "step", "args": {"name": f"m{i}"}, "depends_on": ["a"]} for i in range(6)]
                      + [{"key": "z", "type": "step", "args": {"name": "z"}, "depends_on": [f"m{i}" for i in range(6)]}])

    async def scenario(eng: AsyncEngine) -> bool:
        w = jobq.AsyncWorker(eng, {"step": step}, max_concurrency=3, poll_interval=0.05)
        return await w.run_until_idle(timeout=60)

    assert _run(scenario, db_url) is True
    assert order[0] == "a" and order[-1] == "z" and len(order) == 8
    assert peak <= 3
    assert jobq.get(engine, ids["z"]).result == {"name": "z"}


def test_async_worker_cancels_a_timed_out_task_and_retries(db_url: str, engine: sa.Engine) -> None:
    """Unlike a thread, a timed-out coroutine is really stopped (its task is cancelled); the
    job is retried, and the second attempt finishes."""
    attempts: list[int] = []
    cancelled: list[int] = []

    async def slow_then_fast(ctx: jobq.JobContext) -> None:
        attempts.append(ctx.attempt)
        if ctx.attempt == 1:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(ctx.attempt)
                raise

    jid = jobq.enqueue(engine, "slow", timeout=0.3, max_attempts=3)

    async def scenario(eng: AsyncEngine) -> bool:
        w = jobq.AsyncWorker(eng, {"slow": slow_then_fast}, max_concurrency=1, poll_interval=0.05,
                             retry_backoff=lambda attempt: 0.01)
        return await w.run_until_idle(timeout=30)

    t0 = time.monotonic()
    assert _run(scenario, db_url) is True
    assert time.monotonic() - t0 < 15  # nobody waited for the 30 s sleep
    assert attempts == [1, 2] and cancelled == [1]
    info = jobq.get(engine, jid)
    assert info is not None and (info.state, info.attempts) == ("done", 2)


def test_async_worker_stops_gracefully_and_releases(db_url: str, engine: sa.Engine) -> None:
    """stop() while a handler runs past the grace period: the job goes back to ready at once,
    without charging the attempt. The handler must have started before stop() (the test
    fails, rather than passing on an untouched job, when nothing was claimed), and the worker
    reports the release."""
    jid = jobq.enqueue(engine, "hang")
    started: list[int] = []
    actions: list[tuple[str, int]] = []

    async def hang(ctx: jobq.JobContext) -> None:
        started.append(ctx.id)
        await asyncio.sleep(30)

    async def scenario(eng: AsyncEngine) -> None:
        w = jobq.AsyncWorker(eng, {"hang": hang}, max_concurrency=1, poll_interval=0.05, shutdown_timeout=0.2,
                             on_event=lambda ev: actions.append((ev.action, ev.job_id)))
        task = asyncio.get_running_loop().create_task(w.run())
        try:
            deadline = time.monotonic() + 20
            while not started:
                assert time.monotonic() < deadline, "the worker never started the job"
                assert not task.done(), "the worker's run() ended before it started the job"
                await asyncio.sleep(0.02)
        finally:
            w.stop()
            await asyncio.wait_for(task, 20)

    _run(scenario, db_url)
    assert started == [jid]
    assert ("released", jid) in actions
    info = jobq.get(engine, jid)
    assert info is not None and (info.state, info.attempts, info.lease_owner) == ("ready", 0, None)


def test_async_worker_refuses_what_it_cannot_do(engine: sa.Engine, db_url: str) -> None:
    """AsyncWorker refuses, when it is built, what it cannot run: a sync Engine, a sync handler and
    the process executor, each with a ConfigError naming the problem."""
    async def ok(ctx: jobq.JobContext) -> None:
        return None

    def sync_handler(ctx: jobq.JobContext) -> None:
        return None

    with pytest.raises(jobq.ConfigError, match="AsyncEngine"):
        jobq.AsyncWorker(engine, {"t": ok}, max_concurrency=1)
    eng = create_async_engine(async_url(db_url))
    with pytest.raises(jobq.ConfigError, match="async def"):
        jobq.AsyncWorker(eng, {"t": sync_handler}, max_concurrency=1)
    with pytest.raises(jobq.ConfigError, match="executor"):
        jobq.AsyncWorker(eng, {"t": ok}, max_concurrency=1, executor="process")


def test_async_worker_runs_at_most_its_local_concurrency(db_url: str, engine: sa.Engine) -> None:
    """``local_concurrency`` bounds an AsyncWorker's tasks under a larger cap: 4 jobs, a cap of
    5, 2 local slots; the first tick leases 2 and no more than 2 tasks ever run at once (with
    the cap as its limit, as before the option, the tick leased all 4)."""
    ids = [jobq.enqueue(engine, "hold") for _ in range(4)]
    live = peak = 0

    async def scenario(eng: AsyncEngine) -> tuple[int, bool]:
        gate = asyncio.Event()

        async def hold(ctx: jobq.JobContext) -> None:
            nonlocal live, peak
            live += 1
            peak = max(peak, live)
            await gate.wait()
            live -= 1

        w = jobq.AsyncWorker(eng, {"hold": hold}, max_concurrency=5, local_concurrency=2, poll_interval=0.05)
        assert (w.max_concurrency, w.local_concurrency) == (5, 2)
        first = await w.tick()
        gate.set()
        return first, await w.run_until_idle(timeout=60)

    assert _run(scenario, db_url) == (2, True)
    assert peak <= 2
    assert [state(engine, i) for i in ids] == ["done"] * 4


class _OldRun:
    """BROKEN: AsyncWorker's run loop without its cancellation handling (the loop and the
    heartbeats stop; the handler tasks keep running and their jobs stay leased)."""

    async def _guarded(self, steps):
        done = await self._setup()
        try:
            return await self._drive(steps)
        finally:
            done()


async def _unshielded(self, step):
    """BROKEN: database steps run in the awaiting task, so a cancel lands inside them."""
    return await self._bridge(step)


def _cancel_the_worker_task(db_url: str, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, *,
                            stubborn: bool = False) -> None:
    """Jobs A and B run together on an AsyncWorker; A returns while B still runs, and the task
    running ``worker.run()`` is cancelled while A's finalize is inside its transaction (the
    checkpoint "finalize_before_commit"). Correct: run() raises CancelledError; A's finish is
    written (done, its result kept); B's handler task is cancelled (or, ``stubborn``, ignores
    it and is abandoned after shutdown_timeout) and its job is back to ``ready`` without a
    charged attempt, before run() returns. Bugs: B's handler still running and its job still
    leased (cancel not handled); A's finish cut short by the cancel (not shielded)."""
    a = jobq.enqueue(engine, "a")
    b = jobq.enqueue(engine, "b")
    cancelled: list[int] = []
    hook: dict[str, Any] = {}

    def checkpoint(point: str, job_ids=()) -> None:
        if point == "finalize_before_commit" and a in job_ids and "task" in hook:
            hook.pop("task").cancel()

    monkeypatch.setattr(jobq, "_checkpoint", checkpoint)

    async def scenario(eng: AsyncEngine) -> None:
        b_started, release_stubborn = asyncio.Event(), asyncio.Event()

        async def job_a(ctx: jobq.JobContext) -> dict:
            await b_started.wait()
            return {"a": 1}

        async def job_b(ctx: jobq.JobContext) -> None:
            b_started.set()
            while True:
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    cancelled.append(ctx.id)
                    if not stubborn:
                        raise
                    await release_stubborn.wait()  # ignores its cancellation until the test is done
                    return

        w = jobq.AsyncWorker(eng, {"a": job_a, "b": job_b}, max_concurrency=2, poll_interval=0.05,
                             shutdown_timeout=0.5)
        task = hook["task"] = asyncio.get_running_loop().create_task(w.run())
        try:
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 30)
            assert "task" not in hook, "run() ended before A's finalize"
            handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            assert cancelled == [b], "B's handler task was not cancelled"
            assert len(handlers) == (1 if stubborn else 0), f"handler tasks left running: {handlers}"
            info_a, info_b = jobq.get(engine, a), jobq.get(engine, b)
            assert info_a is not None and (info_a.state, info_a.result) == ("done", {"a": 1}), \
                f"A's finish was not written: {info_a and info_a.state}"
            assert info_b is not None and (info_b.state, info_b.attempts, info_b.lease_owner) == ("ready", 0, None), \
                f"B was not released: {info_b and (info_b.state, info_b.attempts, info_b.lease_owner)}"
        finally:
            release_stubborn.set()
            hook.pop("task", task).cancel()
            leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if leftover:
                await asyncio.wait(leftover, timeout=10)

    _run(scenario, db_url)
    if stubborn:  # the abandoned handler's late return is refused: B stays released
        assert (state(engine, b), jobq.get(engine, b).attempts) == ("ready", 0)


def _cancel_at_the_claims_commit(db_url: str, engine: sa.Engine) -> None:
    """The task running ``worker.run()`` is cancelled while the tick that leases job C commits
    (a "commit" event on the engine, once C is leased in the transaction). Correct: the step
    runs to its end (C leased and its task started), then the cancel stops it: C is back to
    ``ready``, not charged, no slot held, no task left, and run() raises CancelledError. A bug
    (the step cut at its commit): C leased in the database by a worker that never ran it, until
    its lease expires."""
    c = jobq.enqueue(engine, "c")
    jobs = jobq.Job.__table__

    async def scenario(eng: AsyncEngine) -> None:
        async def job_c(ctx: jobq.JobContext) -> None:
            await asyncio.sleep(30)

        w = jobq.AsyncWorker(eng, {"c": job_c}, max_concurrency=1, poll_interval=0.05, shutdown_timeout=0.5,
                             lease_ttl=60)
        hook: dict[str, Any] = {}

        def on_commit(conn: sa.Connection) -> None:
            if "task" in hook and conn.execute(sa.select(jobs.c.state).where(jobs.c.id == c)).scalar() != "ready":
                hook.pop("task").cancel()

        sa.event.listen(eng.sync_engine, "commit", on_commit)
        task = hook["task"] = asyncio.get_running_loop().create_task(w.run())
        try:
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 30)
            assert "task" not in hook, "run() ended before C was claimed"
            info = jobq.get(engine, c)
            assert info is not None and (info.state, info.attempts, info.lease_owner) == ("ready", 0, None), \
                f"C was not released: {info and (info.state, info.attempts, info.lease_owner)}"
            with engine.connect() as conn:
                assert conn.execute(sa.select(sa.func.count()).select_from(SLOTS)).scalar_one() == 0
            assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
        finally:
            sa.event.remove(eng.sync_engine, "commit", on_commit)
            hook.pop("task", task).cancel()
            leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if leftover:
                await asyncio.wait(leftover, timeout=10)

    _run(scenario, db_url)


@pytest.mark.parametrize("point", ["finalize", "finalize_stubborn_handler", "claim_commit"])
def test_cancelling_the_worker_task_stops_its_handlers_and_releases_their_jobs(
        db_url: str, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    """Cancelling ``await worker.run()`` leaves no handler running (a stubborn one abandoned
    after shutdown_timeout) and no job leased, and loses no result, whether the cancel comes
    during a finalize or at a claim's commit (see the two scenarios)."""
    if point == "claim_commit":
        _cancel_at_the_claims_commit(db_url, engine)
    else:
        _cancel_the_worker_task(db_url, engine, monkeypatch, stubborn=point == "finalize_stubborn_handler")


@pytest.mark.parametrize("broken", ["cancel_not_handled", "steps_not_shielded"])
def test_the_cancel_check_catches_a_broken_async_worker(
        db_url: str, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, broken: str) -> None:
    """The broken variants: the old run loop (a cancel leaves the handlers running and their
    jobs leased), and database steps that a cancel cuts at their commit (a job leased in the
    database that the worker never ran)."""
    if broken == "cancel_not_handled":
        monkeypatch.setattr(jobq.AsyncWorker, "_guarded", _OldRun._guarded)
        with pytest.raises(AssertionError):
            _cancel_the_worker_task(db_url, engine, monkeypatch)
    else:
        # Whether the cut commit reached the server first depends on the driver's timing (a
        # cancel that lands before COMMIT is sent rolls back, harmlessly): a few tries, one catch.
        monkeypatch.setattr(jobq.AsyncWorker, "_shielded", _unshielded)
        caught = []
        for _ in range(5):
            try:
                _cancel_at_the_claims_commit(db_url, engine)
            except AssertionError as exc:
                caught.append(str(exc))
                break
            with engine.begin() as conn:  # a clean queue for the next try
                conn.execute(sa.delete(jobq.Job.__table__))
        assert caught and "C was not released" in caught[0], caught

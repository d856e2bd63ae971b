"""Checkpoints and progress (issue 16). ``ctx.checkpoint(state)`` stores a JSON object now,
fenced by the dispatch's lease; every later dispatch starts with it as ``ctx.state``.
``ctx.progress(done, total, message)`` rides on the heartbeat. The crash side (resume after a
SIGKILL of the worker process) is tests/crash/test_checkpoint_resume.py."""

from __future__ import annotations

import asyncio
import threading

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import jobq
from dbs import async_url
from helpers import FAST, jobs, snapshot, wait_for


def resume_or_fail(ctx: jobq.JobContext) -> dict:
    """Attempt 1 stores a checkpoint, reports progress and fails; attempt 2 returns what it
    resumed from. Module-level: the process executor may pickle it."""
    if ctx.state is None:
        ctx.progress(1, 4, "first part")
        ctx.checkpoint({"part": 1, "seen": [ctx.attempt]})
        raise RuntimeError("crash after the first part")
    ctx.checkpoint({**ctx.state, "part": 2})
    return {"resumed": ctx.state, "attempt": ctx.attempt}


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_retry_resumes_from_the_last_checkpoint(engine: sa.Engine, executor: str) -> None:
    """Attempt 1 checkpoints and fails; attempt 2 starts with ctx.state = that checkpoint. With
    the process executor the handler's process stores it through its parent. get() shows the
    last checkpoint and the progress the heartbeat (or the checkpoint) carried."""
    job = jobq.enqueue(engine, "t", max_attempts=2)
    w = jobq.Worker(engine, {"t": resume_or_fail}, max_concurrency=1, executor=executor, **FAST)
    assert w.run_until_idle(timeout=120)
    info = jobq.get(engine, job)
    assert info is not None and info.state == "done", info
    assert info.result == {"resumed": {"part": 2, "seen": [1]}, "attempt": 2}
    assert info.checkpoint == {"part": 2, "seen": [1]}


def test_checkpoint_input_follows_the_args_rules(engine: sa.Engine) -> None:
    """Not a dict, NaN, a set: InvalidJob in the handler, and nothing is stored."""
    errors: list[str] = []

    def bad(ctx: jobq.JobContext) -> None:
        for state in ([1], {"x": float("nan")}, {"s": {1}}, None):
            try:
                ctx.checkpoint(state)  # type: ignore[arg-type]
            except jobq.InvalidJob as exc:
                errors.append(str(exc))
        for args in ((-1,), (1, float("inf")), (True,), (1, 2, "x" * 201)):
            try:
                ctx.progress(*args)  # type: ignore[arg-type]
            except jobq.InvalidJob as exc:
                errors.append(str(exc))

    job = jobq.enqueue(engine, "t")
    assert jobq.Worker(engine, {"t": bad}, max_concurrency=1, **FAST).run_until_idle(timeout=60)
    assert len(errors) == 8, errors
    info = jobq.get(engine, job)
    assert info is not None and info.state == "done" and info.checkpoint is None and info.progress is None


def _stale_checkpoint_lands(engine: sa.Engine) -> tuple[bool, str]:
    """A handler's lease passes to another worker (its row now names another owner and token,
    as after a reclaim and a new claim); then the old handler checkpoints. Returns whether
    its state landed, and what the handler saw."""
    started, go = threading.Event(), threading.Event()
    seen: list[str] = []

    def handler(ctx: jobq.JobContext) -> None:
        started.set()
        go.wait(30)
        try:
            ctx.checkpoint({"from": "stale"})
            seen.append("stored")
        except jobq.LeaseLost as exc:
            seen.append(f"LeaseLost: {exc}")

    job = jobq.enqueue(engine, "t")
    w = jobq.Worker(engine, {"t": handler}, max_concurrency=1, poll_interval=0.02, lease_ttl=30, shutdown_timeout=1)
    t = threading.Thread(target=w.run)
    t.start()
    assert started.wait(30)
    with engine.begin() as conn:  # the lease now belongs to another dispatch, with its own checkpoint
        conn.execute(jobs.update().where(jobs.c.id == job).values(lease_owner="other", lease_token="t" * 32,
                                                                  checkpoint={"from": "new holder"}))
    go.set()
    wait_for(lambda: seen, timeout=30, what="the stale checkpoint")
    w.stop()
    t.join(60)
    info = jobq.get(engine, job)
    assert info is not None
    return info.checkpoint == {"from": "stale"}, seen[0]


def test_a_checkpoint_after_the_lease_was_lost_raises_and_writes_nothing(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Correct: the old dispatch's checkpoint raises LeaseLost and the new holder's checkpoint
    stays. The broken variant, a checkpoint not fenced by the lease token, overwrites the new
    holder's state with the stale one: caught here."""
    landed, seen = _stale_checkpoint_lands(engine)
    assert not landed and seen.startswith("LeaseLost"), seen

    def unfenced(job_id, owner, token, state, progress, now):  # noqa: ANN001, ANN202 - the broken variant
        return sa.update(jobs).where(jobs.c.id == job_id).values(checkpoint=state, updated_at=now)

    monkeypatch.setattr(jobq, "_q_checkpoint", unfenced)
    with engine.begin() as conn:
        conn.execute(jobs.delete())
    landed, seen = _stale_checkpoint_lands(engine)
    assert landed and seen == "stored"


def test_progress_is_visible_while_running_and_kept_after(engine: sa.Engine, db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A running handler reports progress without a transaction; get(), jobq status, jobq show
    and why show it within a heartbeat; it stays on the job once it is done."""
    reported, go = threading.Event(), threading.Event()

    def handler(ctx: jobq.JobContext) -> None:
        ctx.progress(3, 10, "pages")
        reported.set()
        go.wait(30)

    job = jobq.enqueue(engine, "t")
    w = jobq.Worker(engine, {"t": handler}, max_concurrency=1, poll_interval=0.02, lease_ttl=3, heartbeat_interval=0.2)
    t = threading.Thread(target=w.run_until_idle, kwargs={"timeout": 60})
    t.start()
    try:
        assert reported.wait(30)
        wait_for(lambda: jobq.get(engine, job).progress is not None, timeout=30, what="a heartbeat to carry it")  # type: ignore[union-attr]
        assert jobq.get(engine, job).progress == {"done": 3, "total": 10, "message": "pages"}  # type: ignore[union-attr]
        assert "progress 3/10 (30%): pages" in jobq.why(engine, job)
        assert jobq.main(["--url", db_url, "status"]) == 0
        assert f"job {job} (t, group default): 3/10 (30%): pages" in capsys.readouterr().out
        assert jobq.main(["--url", db_url, "show", str(job)]) == 0
        assert "pages" in capsys.readouterr().out
    finally:
        go.set()
        t.join(60)
    info = jobq.get(engine, job)
    assert info is not None and info.state == "done" and info.progress == {"done": 3, "total": 10, "message": "pages"}


def test_the_async_worker_checkpoints_with_await(db_url: str, engine: sa.Engine) -> None:
    """In an AsyncWorker, ``await ctx.checkpoint(state)``; a retry resumes from it."""
    job = jobq.enqueue(engine, "t", max_attempts=2)

    async def handler(ctx: jobq.JobContext) -> dict:
        if ctx.state is None:
            await ctx.checkpoint({"part": 1})
            raise RuntimeError("crash")
        return {"resumed": ctx.state}

    async def main() -> bool:
        eng = create_async_engine(async_url(db_url))
        try:
            w = jobq.AsyncWorker(eng, {"t": handler}, max_concurrency=1, poll_interval=0.05,
                                 retry_backoff=lambda a: 0.0)
            return await w.run_until_idle(timeout=60)
        finally:
            await eng.dispose()

    assert asyncio.run(main())
    info = jobq.get(engine, job)
    assert info is not None and info.result == {"resumed": {"part": 1}} and info.checkpoint == {"part": 1}


def test_a_fresh_job_has_no_state_and_the_lease_carries_the_checkpoint(engine: sa.Engine) -> None:
    job = jobq.enqueue(engine, "t")
    lease = jobq.claim_batch(engine, "w", 30)[0]
    assert lease.checkpoint is None
    before = snapshot(engine)
    assert before  # nothing below writes
    with engine.begin() as conn:
        conn.execute(jobs.update().where(jobs.c.id == job).values(checkpoint={"k": 1}, state="ready", in_flight=False,
                                                                  lease_owner=None, lease_token=None))
    assert jobq.claim_batch(engine, "w", 30)[0].checkpoint == {"k": 1}

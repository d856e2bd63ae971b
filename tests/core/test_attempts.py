"""Attempt history (``jobq.attempts``), kept apart from the job's current error (issue 12, item 9).

Correct: every attempt that ends leaves exactly one row (done, failed, timeout, reclaimed,
released, cancelled) with its worker, DB-clock times and error, written by the transaction that
ended it; ``jobs.error`` holds the last failed attempt's error only while the job is not done.
The bugs these catch: a job reclaimed (or timed out) and then finished still showing the old
error as its current one; history rows claiming an outcome the job row does not show (written
outside the fenced finalize transaction); rows left behind by prune.
"""

from __future__ import annotations

import datetime as dt
import threading

import pytest
import sqlalchemy as sa

import jobq
from helpers import ATTEMPTS, FAST, db_now, no_deadline_for_the_retry, recorded_version, schema_version

S = dt.timedelta(seconds=1)


def history(engine: sa.Engine, job_id: int) -> list[tuple[int, str]]:
    return [(a.attempt, a.outcome) for a in jobq.attempts(engine, job_id)]


def attempt_rows(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(ATTEMPTS)).scalar_one())


def test_a_timed_out_attempt_then_success_shows_two_attempts_and_no_stale_error(engine: sa.Engine) -> None:
    """A real Worker: attempt 1 runs past its timeout (ignoring its stop signal), attempt 2
    succeeds. History: (1, timeout) with the timeout text, (2, done) without error; the job's
    current error is None. The bug: the done job kept "timed out after ..." as its error, or the
    late first result left a row of its own."""
    release = threading.Event()

    def slow(ctx: jobq.JobContext):
        if ctx.attempt == 1:
            release.wait(30)  # a stuck call that ignores ctx.stop_requested
        return {"attempt": ctx.attempt}

    def on_event(ev: jobq.Event) -> None:
        if ev.action == "timed_out":
            no_deadline_for_the_retry(engine, ev.job_id)  # attempt 1 keeps its 0.3 s
        if ev.action == "finished":
            release.set()  # the retry is written: now the stuck first attempt returns, late

    jid = jobq.enqueue(engine, "slow", timeout=0.3, max_attempts=2)
    w = jobq.Worker(engine, {"slow": slow}, max_concurrency=2, on_event=on_event, worker_id="w-timeout", **FAST)
    try:
        assert w.run_until_idle(timeout=30)
    finally:
        release.set()
    info = jobq.get(engine, jid)
    assert info is not None and (info.state, info.attempts, info.error) == ("done", 2, None)
    rows = jobq.attempts(engine, jid)
    assert [(a.attempt, a.outcome, a.worker_id) for a in rows] == [(1, "timeout", "w-timeout"), (2, "done", "w-timeout")]
    assert "timed out after" in (rows[0].error or "") and rows[1].error is None
    for a in rows:
        assert a.started_at is not None and a.started_at.tzinfo == dt.UTC
        assert a.finished_at.tzinfo == dt.UTC and a.started_at <= a.finished_at
    assert rows[0].finished_at <= rows[1].started_at
    assert rows[1].finished_at == info.finished_at  # the same transaction, the same DB time


def test_a_stalled_claim_reclaimed_then_finished_keeps_the_reclaim_in_history_only(engine: sa.Engine) -> None:
    """A claim() whose holder stalls (never heartbeats nor reports) loses its short lease; a real
    Worker reclaims the job and finishes it. History: (1, reclaimed, by the stalled holder, with
    the reclaim text), (2, done, by the worker). The job's error is None. The bug (issue 12):
    "lease expired on attempt 1 ... reclaimed" stayed as the finished job's error."""
    jid = jobq.enqueue(engine, "t", max_attempts=3)
    assert jobq.claim(engine, "stalled", 0.2) == jid
    w = jobq.Worker(engine, {"t": lambda ctx: {"ok": True}}, max_concurrency=1, worker_id="w-finisher", **FAST)
    assert w.run_until_idle(timeout=30)  # leased counts as busy: it ticks until the lease expires
    info = jobq.get(engine, jid)
    assert info is not None and (info.state, info.attempts, info.error) == ("done", 2, None)
    rows = jobq.attempts(engine, jid)
    assert [(a.attempt, a.outcome, a.worker_id) for a in rows] == [(1, "reclaimed", "stalled"), (2, "done", "w-finisher")]
    assert (rows[0].error or "").startswith("lease expired on attempt 1")


def test_failures_releases_and_cancellation_each_leave_their_row(engine: sa.Engine) -> None:
    """Through the seed API with the tests' clock: a failure keeps its error on the job while it
    waits to be retried; a release is recorded but not charged (the next attempt has the same
    number); a failure on the last attempt and a cancel while running end the job with a row
    each; a dead poison job's last reclaim is recorded too."""
    t = db_now(engine) + S
    a = jobq.enqueue(engine, "t", max_attempts=2)
    c = jobq.claim(engine, "w1", 30, now=t)
    assert jobq.fail(engine, c, "boom 1", worker_id="w1", now=t) == "ready"
    assert jobq.get(engine, a).error == "boom 1"  # type: ignore[union-attr]  # current while not done
    c = jobq.claim(engine, "w2", 30, now=t + S)
    jobq.release(engine, c, worker_id="w2", now=t + S)
    c = jobq.claim(engine, "w2", 30, now=t + 2 * S)
    assert jobq.fail(engine, c, "boom 2", worker_id="w2", now=t + 2 * S) == "failed"
    got = jobq.attempts(engine, a)
    assert [(x.attempt, x.outcome, x.worker_id, x.error) for x in got] == [
        (1, "failed", "w1", "boom 1"), (2, "released", "w2", None), (2, "failed", "w2", "boom 2")]
    assert [x.finished_at.replace(tzinfo=None) for x in got] == [t, t + S, t + 2 * S]

    b = jobq.enqueue(engine, "t")
    c = jobq.claim(engine, "w3", 30, now=t + 3 * S)
    assert jobq.cancel(engine, b) == "leased"  # a live job: cancel is requested, its holder ends it
    assert jobq.fail(engine, c, "ignored", worker_id="w3", now=t + 3 * S) == "cancelled"
    assert history(engine, b) == [(1, "cancelled")]

    p = jobq.enqueue(engine, "t", max_attempts=1)
    assert jobq.claim(engine, "w4", 1, now=t + 4 * S) == p
    assert jobq.reclaim(engine, now=t + 10 * S) == 1
    assert jobq.get(engine, p).state == "failed"  # type: ignore[union-attr]
    assert history(engine, p) == [(1, "reclaimed")]
    assert "poison" in (jobq.attempts(engine, p)[0].error or "")
    assert jobq.attempts(engine, 10**12) == [] and jobq.attempts(engine, -1) == []


def test_a_refused_finalize_leaves_no_attempt_row(engine: sa.Engine) -> None:
    """A stale dispatch (its lease expired and the job was claimed again) reports done, fail or
    release: the fence refuses it and no history row appears; the current dispatch's report
    does. The bug: a history row written per report rather than per fenced write would claim
    a "done" the job never had."""
    jid = jobq.enqueue(engine, "t", max_attempts=5)
    t = db_now(engine) + S
    first = jobq.claim(engine, "w", 30, now=t)
    assert jobq.reclaim(engine, now=t + 31 * S) == 1
    second = jobq.claim(engine, "w", 30, now=t + 32 * S)
    assert history(engine, jid) == [(1, "reclaimed")]
    with pytest.raises(jobq.LeaseLost):
        jobq.finalize(engine, first, {"stale": True}, worker_id="w", now=t + 33 * S)
    with pytest.raises(jobq.LeaseLost):
        jobq.fail(engine, first, "stale", worker_id="w", now=t + 33 * S)
    with pytest.raises(jobq.LeaseLost):
        jobq.release(engine, first, worker_id="w", now=t + 33 * S)
    assert history(engine, jid) == [(1, "reclaimed")]
    jobq.finalize(engine, second, {"current": True}, worker_id="w", now=t + 34 * S)
    assert history(engine, jid) == [(1, "reclaimed"), (2, "done")]


def test_a_finalize_that_did_not_commit_leaves_no_attempt_row(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real Worker's first finalize transaction fails just before COMMIT (the crash tests'
    checkpoint raises there once); the worker writes the batch again and it commits. Correct:
    one "done" row per job. The bug (history written in a transaction of its own, before or
    after the finalize): a second "done" row for the same attempt."""
    ids = [jobq.enqueue(engine, "t", {"i": i}) for i in range(4)]
    failed_once = threading.Event()

    def checkpoint(point: str, job_ids=()) -> None:  # type: ignore[no-untyped-def]
        if point == "finalize_before_commit" and job_ids and not failed_once.is_set():
            failed_once.set()
            raise RuntimeError("injected: the finalize transaction does not commit")

    monkeypatch.setattr(jobq, "_checkpoint", checkpoint)
    w = jobq.Worker(engine, {"t": lambda ctx: {"i": ctx.args["i"]}}, max_concurrency=4, **FAST)
    assert w.run_until_idle(timeout=60)
    assert failed_once.is_set()
    for j in ids:
        info = jobq.get(engine, j)
        assert info is not None and info.state == "done" and info.attempts == 1
        assert history(engine, j) == [(1, "done")]


def test_prune_deletes_attempt_rows_with_their_jobs(engine: sa.Engine) -> None:
    """prune removes a finished job's history with it and leaves the rows of jobs it keeps.
    The bug: orphan history rows growing forever (no foreign key cascades them)."""
    t = db_now(engine) + S
    old = jobq.enqueue(engine, "t")
    c = jobq.claim(engine, "w", 30, now=t)
    jobq.fail(engine, c, "once", worker_id="w", now=t)
    c = jobq.claim(engine, "w", 30, now=t + S)
    jobq.finalize(engine, c, {}, worker_id="w", now=t + S)
    kept = jobq.enqueue(engine, "t")
    c = jobq.claim(engine, "w", 30, now=t + 2 * S)
    jobq.fail(engine, c, "still retrying", worker_id="w", now=t + 2 * S)
    assert len(jobq.attempts(engine, old)) == 2 and attempt_rows(engine) == 3
    assert jobq.prune(engine, dt.timedelta(0), now=t + 10 * S) == 1
    assert jobq.get(engine, old) is None and jobq.attempts(engine, old) == []
    assert attempt_rows(engine) == 1 and history(engine, kept) == [(1, "failed")]


def test_show_prints_the_history_and_json_carries_it(engine: sa.Engine, db_url: str) -> None:
    """`jobq show` lists the ended attempts under "history"; `--json` has them as a list."""
    import json
    import subprocess
    import sys

    t = db_now(engine) + S
    jid = jobq.enqueue(engine, "t")
    c = jobq.claim(engine, "w-show", 30, now=t)
    jobq.fail(engine, c, "first try broke", worker_id="w-show", now=t)
    run = [sys.executable, "-m", "jobq", "--url", db_url, "show", str(jid)]
    out = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    assert "attempt 1 failed:" in out and "by w-show: first try broke" in out
    data = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True, check=True).stdout)
    assert [(h["attempt"], h["outcome"], h["error"]) for h in data["history"]] == [(1, "failed", "first try broke")]
    assert data["history"][0]["finished_at"].endswith("Z")


def test_a_schema_3_database_gets_the_history_table(engine: sa.Engine) -> None:
    """A database at schema 3 (no jobq_attempts) is upgraded by create_schema: the table appears,
    the version reads the current one, and history is written. A broken upgrade: no table, so the first
    finalize fails."""
    recorded_version(engine, 3)
    ATTEMPTS.drop(engine)
    assert "jobq_attempts" not in sa.inspect(engine).get_table_names()
    jobq.create_schema(engine)
    jobq.create_schema(engine)
    assert "jobq_attempts" in sa.inspect(engine).get_table_names()
    assert schema_version(engine) == str(jobq.SCHEMA_VERSION)
    jid = jobq.enqueue(engine, "t")
    c = jobq.claim(engine, "w", 30)
    jobq.finalize(engine, c, {}, worker_id="w")
    assert history(engine, jid) == [(1, "done")]


def test_the_history_reads_the_same_through_the_async_api(engine: sa.Engine, db_url: str) -> None:
    """``await jobq.aio.attempts(async_engine, id)`` returns what the sync call returns."""
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    from dbs import async_url

    jid = jobq.enqueue(engine, "t")
    c = jobq.claim(engine, "w", 30)
    jobq.fail(engine, c, "once", worker_id="w")

    async def read() -> list[jobq.AttemptInfo]:
        eng = create_async_engine(async_url(db_url))
        try:
            return await jobq.aio.attempts(eng, jid)  # type: ignore[no-any-return]
        finally:
            await eng.dispose()

    assert asyncio.run(read()) == jobq.attempts(engine, jid) and history(engine, jid) == [(1, "failed")]

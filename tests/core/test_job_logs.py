"""Per-job logs: ctx.log in every runner (threads, processes, asyncio), the documented limit,
bad input, removal with the job by prune, what a log line costs (and what not logging costs),
the CLI's ``jobq logs`` and the job page; and the schema 6 -> 7 upgrade that adds the table."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
import types
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import jobq
from dbs import async_url
from helpers import FAST, cli, counted, one_line_error, recorded_version, schema_version

EVIL = '<script>alert("x")</script>'


def _run(engine: sa.Engine, handler: Any, **options: Any) -> None:
    w = jobq.Worker(engine, {"t": handler}, max_concurrency=1, **{**FAST, **options})
    assert w.run_until_idle(timeout=60)


def test_ctx_log_stores_lines_with_attempt_and_time(engine: sa.Engine) -> None:
    """Each line keeps its attempt, its time and its fields, numbered across attempts: a bug
    shows as a line lost with the failed attempt, a wrong attempt number, or lines out of order."""
    job = jobq.enqueue(engine, "t", {})

    def handler(ctx: jobq.JobContext) -> dict:
        ctx.log(f"start {ctx.attempt}", step=1, tags=["a", "b"])
        if ctx.attempt == 1:
            raise RuntimeError("first try fails")
        ctx.log("done")
        return {}

    _run(engine, handler)
    lines = jobq.logs(engine, job)
    assert [(x.seq, x.attempt, x.message, x.fields) for x in lines] == [
        (1, 1, "start 1", {"step": 1, "tags": ["a", "b"]}), (2, 2, "start 2", {"step": 1, "tags": ["a", "b"]}),
        (3, 2, "done", None)]
    assert all(x.at.tzinfo is dt.UTC for x in lines) and [x.at for x in lines] == sorted(x.at for x in lines)
    assert [x.seq for x in jobq.logs(engine, job, after=1, limit=1)] == [2]
    assert jobq.logs(engine, job + 1000) == []


def test_lines_past_the_limit_are_refused(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first LOG_LINES_PER_JOB lines are kept, later ones refused (False, nothing written),
    also in a later attempt; a long message is cut to LOG_MESSAGE_CHARS."""
    monkeypatch.setattr(jobq, "LOG_LINES_PER_JOB", 4)
    job = jobq.enqueue(engine, "t", {})
    answers: list[bool] = []

    def handler(ctx: jobq.JobContext) -> dict:
        answers.extend(ctx.log("x" * (jobq.LOG_MESSAGE_CHARS + 50) if i == 0 else f"line {i}") for i in range(3))
        if ctx.attempt == 1:
            raise RuntimeError("again")
        return {}

    _run(engine, handler)
    assert answers == [True, True, True, True, False, False]
    lines = jobq.logs(engine, job)
    assert [x.seq for x in lines] == [1, 2, 3, 4] and [x.attempt for x in lines] == [1, 1, 1, 2]
    assert len(lines[0].message) == jobq.LOG_MESSAGE_CHARS


@pytest.mark.parametrize("call, needle", [
    (lambda ctx: ctx.log(7), "must be a string"),
    (lambda ctx: ctx.log("nul \x00 here"), "log message"),
    (lambda ctx: ctx.log("ok", x=math.nan), "log fields"),
    (lambda ctx: ctx.log("ok", blob="y" * (jobq.LOG_FIELDS_BYTES + 1)), "LOG_FIELDS_BYTES"),
    (lambda ctx: ctx.log("ok", when=dt.datetime(2030, 1, 1)), "not JSON-serialisable"),
])
def test_bad_log_input_is_one_clear_error_and_writes_nothing(engine: sa.Engine, call: Any, needle: str) -> None:
    job = jobq.enqueue(engine, "t", {})
    seen: list[str] = []

    def handler(ctx: jobq.JobContext) -> dict:
        with pytest.raises(jobq.InvalidJob) as caught:
            call(ctx)
        seen.append(str(caught.value))
        return {}

    _run(engine, handler)
    assert len(seen) == 1 and needle in seen[0] and "\n" not in seen[0], seen
    assert jobq.logs(engine, job) == [] and jobq.get(engine, job).state == "done"
    with pytest.raises(jobq.JobqError, match="needs the context a Worker"):
        jobq.JobContext(types.SimpleNamespace(  # type: ignore[arg-type]
            id=job, type="t", args={}, attempt=1, max_attempts=3, group_key="default", parent_id=None,
            worker_id="w", checkpoint=None, token="x")).log("x")


def test_a_log_line_locks_no_job_row_and_not_logging_costs_nothing(engine: sa.Engine) -> None:
    """A line is one read of the last number (first line of a dispatch only) and one insert,
    both on jobq_logs: no statement names the jobs table, so no claim waits for it. A job that
    never logs sends no statement about jobq_logs at all."""
    quiet, loud = jobq.enqueue(engine, "quiet", {}), jobq.enqueue(engine, "t", {})
    sent: list[str] = []

    def handler(ctx: jobq.JobContext) -> dict:
        with counted(engine) as seen:
            ctx.log("one")
            ctx.log("two")
        sent.extend(seen)
        return {}

    with counted(engine) as all_sent:
        w = jobq.Worker(engine, {"t": handler, "quiet": lambda ctx: {}}, max_concurrency=1, **FAST)
        assert w.run_until_idle(timeout=60)
    ours = [s for s in sent if s.strip().upper().startswith(("SELECT", "INSERT", "UPDATE", "DELETE"))]
    assert len(ours) == 3 and all("jobq_logs" in s and " jobs" not in s for s in ours), ours
    assert not any("jobq_logs" in s for s in all_sent if s not in sent)
    assert jobq.get(engine, quiet).state == jobq.get(engine, loud).state == "done"


def test_prune_removes_the_lines_with_their_job(engine: sa.Engine) -> None:
    kept, pruned = jobq.enqueue(engine, "t", {}), jobq.enqueue(engine, "t", {})
    _run(engine, lambda ctx: ctx.log(f"job {ctx.id}") and {})
    with engine.begin() as conn:
        jobs = jobq.Base.metadata.tables["jobs"]
        conn.execute(sa.update(jobs).where(jobs.c.id == pruned).values(finished_at=dt.datetime(2000, 1, 1)))
    assert jobq.prune(engine, dt.timedelta(days=1)) == 1
    logs = jobq.Base.metadata.tables["jobq_logs"]
    with engine.connect() as conn:
        assert [r.job_id for r in conn.execute(sa.select(logs.c.job_id))] == [kept]


def _logging_handler(ctx: jobq.JobContext) -> dict:
    return {"stored": ctx.log("from a process", pid=1)}


def test_a_handler_process_logs_through_its_worker(engine: sa.Engine) -> None:
    job = jobq.enqueue(engine, "t", {})
    _run(engine, _logging_handler, executor="process")
    assert jobq.get(engine, job).result == {"stored": True}
    assert [(x.message, x.fields) for x in jobq.logs(engine, job)] == [("from a process", {"pid": 1})]


def test_an_async_handler_logs_without_await(db_url: str, engine: sa.Engine) -> None:
    job = jobq.enqueue(engine, "t", {})

    async def handler(ctx: jobq.JobContext) -> dict:
        await asyncio.sleep(0)
        return {"stored": ctx.log("async", n=2)}

    async def main() -> bool:
        eng: AsyncEngine = create_async_engine(async_url(db_url))
        try:
            return await jobq.AsyncWorker(eng, {"t": handler}, max_concurrency=1, poll_interval=0.05).run_until_idle(timeout=60)
        finally:
            await eng.dispose()

    assert asyncio.run(main())
    assert jobq.get(engine, job).result == {"stored": True}
    assert [(x.attempt, x.message) for x in jobq.logs(engine, job)] == [(1, "async")]


def test_jobq_logs_prints_the_lines(engine: sa.Engine, db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    job = jobq.enqueue(engine, "t", {})
    _run(engine, lambda ctx: ctx.log("hello", n=1) and ctx.log(EVIL) and {})
    code, out, _ = cli(db_url, "logs", str(job), capsys=capsys)
    assert code == 0 and out.splitlines()[0].endswith('attempt 1 #1: hello {"n": 1}') and EVIL in out
    code, out, _ = cli(db_url, "logs", str(job), "--json", "--after", "1", capsys=capsys)
    assert code == 0 and [x["message"] for x in json.loads(out)] == [EVIL]
    code, _, err = cli(db_url, "logs", str(job + 99), capsys=capsys)
    assert code == 1 and one_line_error(err)
    code, _, err = cli(db_url, "logs", str(job), "--after", "-3", capsys=capsys)
    assert code == 2 and one_line_error(err)


def test_a_schema_6_database_gains_the_tables_of_schema_7(engine: sa.Engine) -> None:
    """jobq_logs, jobq_retention and jobq_audit dropped and the version set back to 6 (what a
    schema-6 jobq.py made): create_schema (twice: idempotent) makes them and records 7, the
    waiting job survives and then logs. A broken step shows as a missing table or version 6."""
    for name in ("jobq_logs", "jobq_retention", "jobq_audit"):
        jobq.Base.metadata.tables[name].drop(engine)
    recorded_version(engine, 6)
    job = jobq.enqueue(engine, "t", {})
    jobq.create_schema(engine)
    jobq.create_schema(engine)
    assert {"jobq_logs", "jobq_retention", "jobq_audit"} <= set(sa.inspect(engine).get_table_names())
    assert schema_version(engine) == str(jobq.SCHEMA_VERSION) == "7"
    _run(engine, lambda ctx: ctx.log("upgraded") and {})
    assert [x.message for x in jobq.logs(engine, job)] == ["upgraded"]

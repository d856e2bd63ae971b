"""Upstream results (issue 42, item 5): ``ctx.upstream`` maps each direct upstream's id to its
result, on every engine, in a thread, a handler process and an AsyncWorker.

Correct: a fan-in's handler sees exactly its direct upstreams (not their upstreams, not its
container's), each with its stored result (None for a handler that returned None); jobs made
with ``submit`` appear under the ids submit returned for their keys; and a handler that never
reads ``ctx.upstream`` sends no query for it (counted on the engine, not timed). The bugs these
catch: the results read eagerly on every claim (the hot path pays for a feature it does not
use), a transitive upstream listed, and the handler process's read lost on its way through the
pipe.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import jobq
from dbs import async_url
from helpers import FAST, counted

#: What each handler saw, by job id (a handler process reports through its result instead).
SEEN: dict[int, dict[int, Any]] = {}


def _fan_in(engine: sa.Engine) -> tuple[list[int], int, int]:
    """root -> a, b, c -> join (a returns {"n": 1}, b {"n": 2}, c None): the upstream ids, the
    join, and the root (a transitive upstream of join)."""
    root = jobq.enqueue(engine, "leaf", {"n": 0})
    a = jobq.enqueue(engine, "leaf", {"n": 1}, depends_on=[root])
    b = jobq.enqueue(engine, "leaf", {"n": 2}, depends_on=[root])
    c = jobq.enqueue(engine, "leaf", {"n": None}, depends_on=[root])
    join = jobq.enqueue(engine, "join", depends_on=[a, b, c])
    return [a, b, c], join, root


def _leaf(ctx: jobq.JobContext) -> dict[str, Any] | None:
    return None if ctx.args["n"] is None else {"n": ctx.args["n"]}


def _join(ctx: jobq.JobContext) -> dict[str, Any]:
    assert ctx.upstream is ctx.upstream  # read once, then kept
    return {"seen": {str(k): v for k, v in ctx.upstream.items()}}


def _check_fan_in(engine: sa.Engine, ups: list[int], join: int) -> None:
    info = jobq.get(engine, join)
    assert info is not None and info.state == "done", info
    a, b, c = ups
    assert info.result == {"seen": {str(a): {"n": 1}, str(b): {"n": 2}, str(c): None}}, info.result


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_fan_in_reads_its_direct_upstreams_results(engine: sa.Engine, executor: str) -> None:
    """join depends on a, b, c (which depend on root): ctx.upstream is {a: .., b: .., c: None},
    root absent; a job without upstreams sees {}."""
    ups, join, root = _fan_in(engine)

    def leaf(ctx: jobq.JobContext) -> dict[str, Any] | None:
        if ctx.id == root:
            assert dict(ctx.upstream) == {}
        return _leaf(ctx)

    w = jobq.Worker(engine, {"leaf": leaf, "join": _join}, max_concurrency=2, executor=executor, **FAST)
    assert w.run_until_idle(timeout=60)
    assert jobq.get(engine, root).state == "done"  # type: ignore[union-attr]
    _check_fan_in(engine, ups, join)


def test_a_fan_in_in_an_async_worker(engine: sa.Engine, db_url: str) -> None:
    """The same read from an async def handler, through the greenlet bridge (no await)."""
    ups, join, _root = _fan_in(engine)

    async def leaf(ctx: jobq.JobContext) -> dict[str, Any] | None:
        return _leaf(ctx)

    async def join_(ctx: jobq.JobContext) -> dict[str, Any]:
        await asyncio.sleep(0)
        return _join(ctx)

    async def main() -> bool:
        eng = create_async_engine(async_url(db_url))
        try:
            w = jobq.AsyncWorker(eng, {"leaf": leaf, "join": join_}, max_concurrency=2, **FAST)
            return await w.run_until_idle(timeout=60)
        finally:
            await eng.dispose()

    assert asyncio.run(main())
    _check_fan_in(engine, ups, join)


def test_submitted_jobs_see_their_upstreams_under_the_ids_submit_returned(engine: sa.Engine) -> None:
    """submit's graph: report depends on the keys "eu" and "us"; its ctx.upstream holds exactly
    ids["eu"] and ids["us"] with their results."""
    ids = jobq.submit(engine, [
        {"key": "eu", "type": "leaf", "args": {"n": 10}},
        {"key": "us", "type": "leaf", "args": {"n": 20}},
        {"key": "report", "type": "join", "depends_on": ["eu", "us"]},
    ])
    w = jobq.Worker(engine, {"leaf": _leaf, "join": _join}, max_concurrency=2, **FAST)
    assert w.run_until_idle(timeout=60)
    info = jobq.get(engine, ids["report"])
    assert info is not None and info.result == {"seen": {str(ids["eu"]): {"n": 10}, str(ids["us"]): {"n": 20}}}, info


def _upstream_reads(engine: sa.Engine, seen: list[str]) -> int:
    text = str(jobq._q_upstream_results(0).compile(dialect=engine.dialect))
    return sum(1 for s in seen if s == text)


def test_a_job_that_does_not_read_upstream_sends_no_query_for_it(engine: sa.Engine) -> None:
    """Two dependents of the same upstream, one reading ctx.upstream (twice) and one not: the
    statements the engine sends hold exactly one upstream read. The bug: the results read at
    claim or dispatch for every job (two reads here), or not kept after the first access."""
    up = jobq.enqueue(engine, "leaf", {"n": 1})
    reads = jobq.enqueue(engine, "join", depends_on=[up])
    skips = jobq.enqueue(engine, "skip", depends_on=[up])
    w = jobq.Worker(engine, {"leaf": _leaf, "join": _join, "skip": lambda ctx: {"ok": True}}, max_concurrency=2,
                    **FAST)
    with counted(engine) as seen:
        assert w.run_until_idle(timeout=60)
    assert jobq.get(engine, reads).result == {"seen": {str(up): {"n": 1}}}  # type: ignore[union-attr]
    assert jobq.get(engine, skips).state == "done"  # type: ignore[union-attr]
    assert _upstream_reads(engine, seen) == 1


def test_upstream_outside_a_worker_is_a_clear_error(engine: sa.Engine) -> None:
    jid = jobq.enqueue(engine, "t")
    (lease,) = jobq.claim_batch(engine, worker_id="w", limit=1, ttl=30)
    assert lease.id == jid
    with pytest.raises(jobq.JobqError, match="ctx.upstream needs the context a Worker passes"):
        _ = jobq.JobContext(lease).upstream

"""Spawning work from a handler (issue 16, section 1): ``ctx.enqueue`` / ``ctx.submit``.

Spawned jobs are written at once, ``held`` under the spawning dispatch's lease, with real ids;
the finalize that commits the handler's result releases them in the same transaction, and
every other end of the dispatch (raise, timeout, cancel, lease lost, reclaim) deletes them.
Correct: a spawned job runs if and only if its spawner's result committed, exactly once per
committed result; a container the spawner is in never rolls up before the spawned children
finish; a spawn that depends on its spawner runs after it. Each test runs through real
Workers on every engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
from helpers import expire_leases, wait_for

jobs = jobq.Job.__table__


def _rows(engine: sa.Engine) -> dict[int, Any]:
    with engine.connect() as conn:
        return {r.id: r for r in conn.execute(sa.select(jobs))}


def _worker(engine: sa.Engine, handlers: dict[str, Callable[[jobq.JobContext], Any]], **kw: Any) -> jobq.Worker:
    kw.setdefault("max_concurrency", 2)
    return jobq.Worker(engine, handlers, poll_interval=0.02, retry_backoff=lambda a: 0.0, **kw)


def test_spawned_jobs_are_held_until_the_result_commits_then_run_with_their_real_ids(engine: sa.Engine) -> None:
    """A handler spawns a leaf, a small DAG (one item depending on another spawn and on the
    spawner itself) and a job depending on an earlier spawn; it returns the ids. While it runs,
    the spawns are ``held`` (not claimable; stats count them as held). Afterwards every id in
    the result is a real job that ran once, spawned_by the spawner, and the job depending on
    the spawner started after the spawner finished. A bug shows a spawn running while its
    spawner still runs, or ids that name no job."""
    seen: dict[str, Any] = {}
    ran: list[tuple[str, int]] = []

    def parent(ctx: jobq.JobContext) -> dict[str, Any]:
        a = ctx.enqueue("leaf", {"n": 1})
        dag = ctx.submit([
            {"key": "x", "type": "leaf", "args": {"n": 2}},
            {"key": "y", "type": "leaf", "args": {"n": 3}, "depends_on": ["x", ctx.id]},
        ])
        b = ctx.enqueue("leaf", {"n": 4}, depends_on=[a, dag["y"]])
        seen["held"] = [jobq.get(engine, i).state for i in (a, dag["x"], dag["y"], b)]  # type: ignore[union-attr]
        seen["stats"] = jobq.stats(engine)["states"]["held"]
        seen["why"] = jobq.why(engine, a)
        return {"spawned": [a, dag["x"], dag["y"], b]}

    def leaf(ctx: jobq.JobContext) -> None:
        ran.append(("leaf", ctx.id))

    pid = jobq.enqueue(engine, "parent")
    assert _worker(engine, {"parent": parent, "leaf": leaf}).run_until_idle(timeout=30)
    assert seen["held"] == ["held"] * 4 and seen["stats"] == 4
    assert f"is held: spawned by job {pid}" in seen["why"]
    rows = _rows(engine)
    spawned = rows[pid].result["spawned"]
    assert rows[pid].state == "done"
    assert sorted(i for _, i in ran) == sorted(spawned)  # each ran exactly once
    for i in spawned:
        assert (rows[i].state, rows[i].spawned_by, rows[i].spawn_token) == ("done", pid, None)
    y = spawned[2]
    assert rows[y].started_at >= rows[pid].finished_at  # depends_on=[ctx.id]: after the spawner
    assert jobq.get(engine, y).depends_on == tuple(sorted([spawned[1], pid]))  # type: ignore[union-attr]
    assert jobq.stats(engine)["states"]["held"] == 0


def _spawner(ctx: jobq.JobContext) -> dict[str, Any]:
    # module level: the process executor pickles handlers
    leaf = ctx.enqueue("child", {"attempt": ctx.attempt})
    box = ctx.submit([{"key": "box", "type": "box", "container": True},
                      {"key": "in", "type": "child", "args": {"attempt": ctx.attempt}, "parent": "box"}])
    if ctx.attempt == 1:
        raise RuntimeError("first attempt fails after spawning")
    return {"ids": [leaf, box["box"], box["in"]]}


def _child(ctx: jobq.JobContext) -> dict[str, Any]:
    return {"ran_for_attempt": ctx.args["attempt"]}


def _raise_then_succeed(engine: sa.Engine, worker_kw: dict[str, Any]) -> tuple[dict[int, Any], int]:
    """A spawner that spawns two children (one a container with a child) and raises on its first
    attempt, returns on its second. Returns the table and the spawner id."""
    sid = jobq.enqueue(engine, "spawner", max_attempts=2)
    assert _worker(engine, {"spawner": _spawner, "child": _child}, **worker_kw).run_until_idle(timeout=60)
    return _rows(engine), sid


def _check_only_the_committed_attempt_spawned(rows: dict[int, Any], sid: int) -> None:
    assert rows[sid].state == "done" and rows[sid].attempts == 2
    ran = sorted(r.result["ran_for_attempt"] for r in rows.values() if r.type == "child" and r.result)
    assert ran == [2, 2], f"children of the failed attempt ran: {ran}"
    assert sorted(i for i in rows if i != sid) == sorted(rows[sid].result["ids"]), "orphans of attempt 1 remain"
    assert {r.state for i, r in rows.items()} == {"done"}


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_handler_that_raises_leaves_none_of_its_spawns(engine: sa.Engine, executor: str) -> None:
    """Attempt 1 spawns, then raises: its spawns are deleted with the failed attempt (they never
    run, no row remains); attempt 2's spawns run once. The bug (a spawn written outside the
    finalize transaction, or not fenced) shows attempt 1's children running, or left behind."""
    rows, sid = _raise_then_succeed(engine, {"executor": executor})
    _check_only_the_committed_attempt_spawned(rows, sid)


def test_the_atomicity_test_catches_a_spawn_written_outside_the_finalize(engine: sa.Engine,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: ctx.enqueue/submit commit the jobs at once (a plain submit in its own
    transaction, not held, not fenced). The check above must fail on it."""
    def broken(self: jobq.JobContext, plan: Any) -> dict[str, int]:
        return jobq._submit(engine, plan)

    monkeypatch.setattr(jobq.JobContext, "_spawn", broken)
    rows, sid = _raise_then_succeed(engine, {})
    with pytest.raises(AssertionError, match="children of the failed attempt ran"):
        _check_only_the_committed_attempt_spawned(rows, sid)


def test_a_spawn_into_its_own_container_keeps_the_container_open(engine: sa.Engine) -> None:
    """Container C holds one job A; A spawns X into C (parent=ctx.parent_id) and X waits on A.
    C must not roll up when A finishes (it gained X in the same transaction): X sees C still
    waiting, and C ends done after X. The bug: C done at A's finalize, before X ran. And when
    the spawner fails instead, its spawn is deleted and C rolls up failed (never stuck)."""
    seen: dict[str, Any] = {}

    def a(ctx: jobq.JobContext) -> dict[str, int]:
        if ctx.args.get("fail"):
            ctx.enqueue("x", parent=ctx.parent_id)
            raise RuntimeError("spawner fails")
        return {"x": ctx.enqueue("x", parent=ctx.parent_id, depends_on=[ctx.id])}

    def x(ctx: jobq.JobContext) -> None:
        seen["container"] = jobq.get(engine, ctx.parent_id).state  # type: ignore[arg-type,union-attr]
        seen["a"] = jobq.get(engine, ctx.args.get("a", 0) or jobq.get(engine, ctx.id).depends_on[0]).state  # type: ignore[union-attr]

    ids = jobq.submit(engine, [{"key": "c", "type": "box", "container": True},
                               {"key": "a", "type": "a", "parent": "c"}])
    assert _worker(engine, {"a": a, "x": x}).run_until_idle(timeout=30)
    rows = _rows(engine)
    xid = rows[ids["a"]].result["x"]
    assert seen == {"container": "waiting", "a": "done"}
    assert rows[ids["c"]].state == "done" and rows[ids["c"]].finished_at >= rows[xid].finished_at
    assert rows[xid].parent_id == ids["c"]

    bad = jobq.submit(engine, [{"key": "c", "type": "box", "container": True},
                               {"key": "a", "type": "a", "parent": "c", "args": {"fail": True}, "max_attempts": 1}])
    assert _worker(engine, {"a": a, "x": x}).run_until_idle(timeout=30)
    rows = _rows(engine)
    assert rows[bad["c"]].state == "failed" and rows[bad["a"]].state == "failed"
    assert [i for i, r in rows.items() if r.parent_id == bad["c"]] == [bad["a"]]  # the spawn is gone


def test_a_lost_lease_discards_the_spawns_and_refuses_new_ones(engine: sa.Engine) -> None:
    """Attempt 1 spawns, then its lease expires and is reclaimed while the handler still runs:
    the reclaim deletes the held spawn, a later spawn by the stale dispatch is refused
    (LeaseLost, nothing written), and its result is discarded. Attempt 2's spawn runs once."""
    spawned, resume = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}
    ran: list[int] = []

    def spawner(ctx: jobq.JobContext) -> dict[str, Any]:
        first = ctx.enqueue("child", {"attempt": ctx.attempt})
        if ctx.attempt == 1:
            spawned.set()
            resume.wait(30)
            try:
                ctx.enqueue("child", {"attempt": 1, "late": True})
            except jobq.LeaseLost:
                seen["late"] = "refused"
        return {"child": first}

    def child(ctx: jobq.JobContext) -> None:
        ran.append(ctx.args["attempt"])

    sid = jobq.enqueue(engine, "spawner", max_attempts=3)
    w = _worker(engine, {"spawner": spawner, "child": child}, lease_ttl=30.0)
    t = threading.Thread(target=w.run_until_idle, kwargs={"timeout": 60})
    t.start()
    try:
        assert spawned.wait(30)
        held = [i for i, r in _rows(engine).items() if r.state == "held"]
        assert len(held) == 1
        token = _rows(engine)[held[0]].spawn_token

        def reclaimed() -> bool:
            # again if a heartbeat renewed the lease in between; the worker's own tick may
            # reclaim it first
            expire_leases(engine, sid)
            jobq.reclaim(engine)
            return bool(_rows(engine)[sid].lease_token != token)

        wait_for(reclaimed, what="the reclaim of attempt 1")
        assert held[0] not in _rows(engine), "the reclaim left the stale dispatch's spawn"
    finally:
        resume.set()
        t.join(60)
    wait_for(lambda: _rows(engine)[sid].state == "done", what="attempt 2")
    assert w.run_until_idle(timeout=30)
    rows = _rows(engine)
    assert seen == {"late": "refused"}
    assert ran == [2]
    assert rows[sid].result["child"] in rows and sorted(rows) == sorted([sid, rows[sid].result["child"]])


def test_spawn_refuses_bad_input_and_held_jobs_of_others(engine: sa.Engine) -> None:
    """Same checks as enqueue/submit, before anything is written; a held job of another
    dispatch cannot be named (it may never exist); spawning outside a worker is an error."""
    errors: list[str] = []
    gate = threading.Event()

    def spawner(ctx: jobq.JobContext) -> None:
        for bad in (lambda: ctx.enqueue("", {}), lambda: ctx.enqueue("t", {"x": float("nan")}),
                    lambda: ctx.enqueue("t", depends_on=[10**9]), lambda: ctx.enqueue("t", bogus=1),
                    lambda: ctx.submit([{"key": "a", "type": "t", "depends_on": ["a"]}])):
            try:
                bad()
            except jobq.InvalidJob as exc:
                errors.append(str(exc))
        gate.set()

    jobq.enqueue(engine, "spawner", max_attempts=1)
    assert _worker(engine, {"spawner": spawner}).run_until_idle(timeout=30)
    assert gate.is_set() and len(errors) == 5, errors
    assert len(_rows(engine)) == 1
    with pytest.raises(jobq.JobqError, match="Worker"):
        jobq.JobContext(jobq.claim(engine, "w", 30) or _lease(engine)).enqueue("t")


def _lease(engine: sa.Engine) -> jobq.Lease:
    jobq.enqueue(engine, "t")
    got = jobq.claim_batch(engine, "w", 30)
    return got[0]


def test_async_worker_handlers_spawn_without_await(db_url: str, engine: sa.Engine) -> None:
    """In AsyncWorker, a coroutine handler calls ctx.enqueue/ctx.submit (no await: the handler
    runs inside the greenlet bridge, so the insert awaits the async driver and the loop keeps
    turning). Attempt 1 spawns and raises: nothing of it remains; attempt 2's spawns run once,
    the one depending on the spawner after it."""
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    from dbs import async_url

    async def spawner(ctx: jobq.JobContext) -> dict[str, Any]:
        a = ctx.enqueue("child", {"attempt": ctx.attempt})
        await asyncio.sleep(0.01)  # the handler really awaits between spawns
        dag = ctx.submit([{"key": "b", "type": "child", "args": {"attempt": ctx.attempt}, "depends_on": [a, ctx.id]}])
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails after spawning")
        return {"ids": [a, dag["b"]]}

    async def child(ctx: jobq.JobContext) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {"ran_for_attempt": ctx.args["attempt"]}

    async def main() -> None:
        eng = create_async_engine(async_url(db_url))
        try:
            w = jobq.AsyncWorker(eng, {"spawner": spawner, "child": child}, max_concurrency=2, poll_interval=0.02,
                                 retry_backoff=lambda a: 0.0)
            assert await w.run_until_idle(timeout=30)
        finally:
            await eng.dispose()

    sid = jobq.enqueue(engine, "spawner", max_attempts=2)
    asyncio.run(main())
    rows = _rows(engine)
    assert rows[sid].state == "done" and rows[sid].attempts == 2
    ids = rows[sid].result["ids"]
    assert sorted(rows) == sorted([sid, *ids])
    assert [rows[i].result for i in ids] == [{"ran_for_attempt": 2}] * 2
    assert rows[ids[1]].started_at >= rows[sid].finished_at


@pytest.mark.parametrize("end", ["timed_out", "cancelled"])
def test_a_timed_out_or_cancelled_spawner_leaves_none_of_its_spawns(engine: sa.Engine, end: str) -> None:
    """The handler spawns (into its container too), then runs until it is told to stop: by its
    timeout, or by cancel(). Its spawns are deleted in the transaction that ends the attempt;
    the container rolls up without them. The bug shows spawned rows left (held forever, or
    released by the late result) or a container waiting forever on them."""
    spawned = threading.Event()
    seen: dict[str, Any] = {}

    def spawner(ctx: jobq.JobContext) -> dict[str, Any]:
        kids = [ctx.enqueue("child"), ctx.enqueue("child", parent=ctx.parent_id)]
        spawned.set()
        while not ctx.wait(0.02):
            pass
        seen["reason"] = ctx.stop_reason
        return {"kids": kids}  # a late result: must not release them

    ids = jobq.submit(engine, [{"key": "c", "type": "box", "container": True},
                               {"key": "s", "type": "spawner", "parent": "c", "max_attempts": 1,
                                "timeout": 0.5 if end == "timed_out" else None}])
    w = _worker(engine, {"spawner": spawner, "child": lambda ctx: None}, lease_ttl=3.0)
    t = threading.Thread(target=w.run_until_idle, kwargs={"timeout": 60})
    t.start()
    try:
        assert spawned.wait(30)
        if end == "cancelled":
            assert jobq.cancel(engine, ids["s"]) == "running"
    finally:
        t.join(60)
    assert w.run_until_idle(timeout=30)
    rows = _rows(engine)
    assert seen["reason"] == end
    assert sorted(rows) == sorted(ids.values()), "spawns of the ended attempt remain"
    assert rows[ids["s"]].state == ("failed" if end == "timed_out" else "cancelled")
    assert rows[ids["c"]].state == "failed"  # rolled up without the deleted spawn


def test_a_spawn_whose_upstream_ended_badly_while_held_is_closed_at_release(engine: sa.Engine) -> None:
    """A spawn depends on an existing job U that is cancelled while the spawn is held (nothing
    propagates into a held job then). When the spawner's result commits, the spawn is released
    closed, naming U (closed_by), as a job enqueued after U's cancel would be born; never left
    waiting forever."""
    u = jobq.enqueue(engine, "other")  # no worker runs this type

    def spawner(ctx: jobq.JobContext) -> dict[str, int]:
        x = ctx.enqueue("child", depends_on=[u])
        assert jobq.cancel(engine, u) == "cancelled"
        return {"x": x}

    sid = jobq.enqueue(engine, "spawner")
    assert _worker(engine, {"spawner": spawner, "child": lambda ctx: None}).run_until_idle(timeout=30)
    rows = _rows(engine)
    x = rows[rows[sid].result["x"]]
    assert (x.state, x.closed_by, x.error) == ("cancelled", u, f"upstream job {u} was cancelled")


def test_one_batch_with_a_stale_and_the_current_dispatch_of_a_job_releases_only_the_current_spawns(
        engine: sa.Engine) -> None:
    """A worker may write, in one finalize batch, the late result of a dispatch that lost its
    lease (token 1) next to the result of the job's current dispatch (token 2). Correct: the
    stale one is refused, the current one lands, and the current dispatch's spawn is released.
    The bug (outcomes matched by job id alone): both counted as landed, and the spawn released
    under the stale token, i.e. never, left held forever."""
    sid = jobq.enqueue(engine, "s", max_attempts=5)
    first = jobq.claim_batch(engine, "w", 30)[0]
    jobq._spawn(engine, jobq._plan([{"type": "child"}], single=True), jobq._Hold(sid, first.token, frozenset()))
    expire_leases(engine, sid)
    assert jobq.reclaim(engine) == 1
    second = jobq.claim_batch(engine, "w", 30)[0]
    kid = jobq._spawn(engine, jobq._plan([{"type": "child"}], single=True),
                      jobq._Hold(sid, second.token, frozenset()))[jobq._ONE]
    outcomes = [jobq._Outcome(sid, "w", lease.token, "done", result={"from": n}, spawned=True)
                for n, lease in ((1, first), (2, second))]

    def write(conn: sa.Connection, d: Any) -> list[str | None]:
        return jobq._apply_outcomes(conn, d, outcomes, d.db_now(conn))

    assert jobq._transaction(engine, write) == [None, "done"]
    rows = _rows(engine)
    assert rows[sid].result == {"from": 2}
    assert sorted(rows) == [sid, kid] and rows[kid].state == "ready"


def test_a_held_spawn_holds_its_unique_key_so_its_release_never_collides(engine: sa.Engine) -> None:
    """A handler spawns a job with a unique key; while it is held, an outside enqueue of the same
    key is refused (UniqueKeyHeld, tests/core/test_spawn_held.py) and writes nothing, and after
    the spawner's result commits the job runs once under its id. A second handler failing
    after spawning the key frees it again. A bug shows two jobs with the key (a duplicate
    released next to the outside one), or a finalize failing on the unique index when the held
    job is released."""
    seen: dict[str, int] = {}
    ran: list[int] = []

    def parent(ctx: jobq.JobContext) -> None:
        seen["spawned"] = ctx.enqueue("leaf", unique_key="page:/a")
        try:
            jobq.enqueue(engine, "leaf", unique_key="page:/a")
        except jobq.UniqueKeyHeld as exc:
            seen["outside"] = exc.job_id

    def failing(ctx: jobq.JobContext) -> None:
        seen["doomed"] = ctx.enqueue("leaf", unique_key="page:/b")
        raise RuntimeError("after spawning")

    jobq.enqueue(engine, "parent")
    jobq.enqueue(engine, "failing", max_attempts=1)
    assert _worker(engine, {"parent": parent, "failing": failing, "leaf": lambda ctx: ran.append(ctx.id)}
                   ).run_until_idle(timeout=30)
    assert seen["outside"] == seen["spawned"] and ran == [seen["spawned"]]
    keyed = [r for r in _rows(engine).values() if r.unique_key is not None]
    assert [(r.id, r.unique_key, r.state) for r in keyed] == [(seen["spawned"], "page:/a", "done")]
    fresh = jobq.enqueue(engine, "leaf", unique_key="page:/b")  # the discarded spawn freed its key
    assert fresh != seen["doomed"] and jobq.get(engine, fresh).state == "ready"  # type: ignore[union-attr]

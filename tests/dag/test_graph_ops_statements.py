"""Graph operations are set-based (issue 45 item 5): failing, cancelling and retrying the head of
a chain or a fan-out costs the same number of SQL statements for 30 jobs as for 120. Each
closed or re-opened job cost several statements of its own before (a 5,000-job chain held
SQLite's write lock for 5.8 s), so these counts grew with the graph. Statements are counted,
never timed: one walk down the graph finds the jobs, batches of up to 500 rewrite them.

Beside them, what the set-based walk must keep: the state and cause each closed job gets, a
diamond closed once and re-opened once, a job with two failed upstreams, containers that roll
up, and a retry that re-opens exactly what the failure closed."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
from dbs import needs
from helpers import counted

jobs = jobq.Job.__table__
_heads = itertools.count()
SMALL, LARGE = 30, 120


def chain(n: int, head: str) -> list[dict]:
    return [{"key": "0", "type": head, "max_attempts": 1}] + [
        {"key": str(i), "type": "t", "depends_on": [str(i - 1)]} for i in range(1, n)]


def fanout(n: int, head: str) -> list[dict]:
    return [{"key": "0", "type": head, "max_attempts": 1}] + [
        {"key": str(i), "type": "t", "depends_on": ["0"]} for i in range(1, n)]


def fail_head(engine: sa.Engine, head_type: str) -> int:
    (lease,) = jobq.claim_batch(engine, "w", 30, types=[head_type])
    assert jobq.fail(engine, lease.id, "boom", worker_id="w", token=lease.token, retry=False) == "failed"
    return lease.id


def states(engine: sa.Engine, ids: Any) -> dict[int, str]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.select(jobs.c.id, jobs.c.state).where(jobs.c.id.in_(list(ids)))).all())


def run_op(engine: sa.Engine, shape: Callable[[int, str], list[dict]], n: int, op: str) -> int:
    """Statements one ``op`` of the head of a new graph of ``n`` jobs costs: "fail" or "cancel"
    (checks that it closed the whole graph), or "retry" after a failure (checks that it
    re-opened the whole graph)."""
    head_type = f"head{next(_heads)}"
    ids = jobq.submit(engine, shape(n, head_type))
    head = ids["0"]
    if op == "fail":
        (lease,) = jobq.claim_batch(engine, "w", 30, types=[head_type])
        with counted(engine) as seen:
            assert jobq.fail(engine, lease.id, "boom", worker_id="w", token=lease.token, retry=False) == "failed"
        expect = "failed"
    elif op == "retry":
        fail_head(engine, head_type)
        with counted(engine) as seen:
            assert sorted(jobq.retry(engine, head)) == sorted(ids.values())
        expect = {head: "ready", **{i: "waiting" for i in ids.values() if i != head}}
        assert states(engine, ids.values()) == expect
        return len(seen)
    else:
        with counted(engine) as seen:
            assert jobq.cancel(engine, head) == "cancelled"
        expect = "cancelled"
    assert set(states(engine, ids.values()).values()) == {expect}
    return len(seen)


@pytest.mark.parametrize("op", ["fail", "cancel", "retry"])
@pytest.mark.parametrize("shape", [chain, fanout], ids=["chain", "fanout"])
def test_graph_ops_cost_statements_independent_of_the_graphs_size(engine: sa.Engine, shape: Any, op: str) -> None:
    """fail, cancel and retry of the head of a 30-job and of a 120-job graph send the same
    number of statements (both fit one batch). A bug (statements per closed or re-opened job,
    as before) shows as about 90 to 360 more for the larger graph."""
    small = run_op(engine, shape, SMALL, op)
    large = run_op(engine, shape, LARGE, op)
    assert large == small, f"{op} of a {shape.__name__}: {small} statements for {SMALL} jobs, {large} for {LARGE}"


# ---- what the set-based walk keeps -------------------------------------------------------------


def error_and_cause(engine: sa.Engine, job_id: int) -> tuple[str, int | None]:
    with engine.connect() as conn:
        row = conn.execute(sa.select(jobs.c.error, jobs.c.closed_by).where(jobs.c.id == job_id)).one()
    return row.error, row.closed_by


def test_a_diamond_closes_each_job_once_naming_the_upstream_that_reached_it_first(engine: sa.Engine) -> None:
    """a -> (b, c) -> d -> e: failing a closes b, c, d and e, each failed and naming its lowest
    failed upstream at the level that reached it (d names b, not c; e names d). A walk that
    named the root, or visited d twice, shows here."""
    ids = jobq.submit(engine, [
        {"key": "a", "type": "dia", "max_attempts": 1}, {"key": "b", "type": "t", "depends_on": ["a"]},
        {"key": "c", "type": "t", "depends_on": ["a"]}, {"key": "d", "type": "t", "depends_on": ["c", "b"]},
        {"key": "e", "type": "t", "depends_on": ["d"]}])
    fail_head(engine, "dia")
    assert states(engine, ids.values()) == {i: "failed" for i in ids.values()}
    assert error_and_cause(engine, ids["b"]) == (f"upstream job {ids['a']} failed", ids["a"])
    assert error_and_cause(engine, ids["d"]) == (f"upstream job {ids['b']} failed", ids["b"])
    assert error_and_cause(engine, ids["e"]) == (f"upstream job {ids['d']} failed", ids["d"])


def test_a_job_with_a_failed_and_a_cancelled_upstream_stays_closed_until_both_are_retried(engine: sa.Engine) -> None:
    """x fails, then y is cancelled; z depends on both (and w on z). z and w close failed when
    x fails, naming x, and stay so when y is cancelled. Retrying x alone re-opens nothing
    downstream (z still has y cancelled); retrying y then re-opens z and w, exactly those,
    waiting on x and y again. A retry that did not check every upstream re-opens z with x."""
    ids = jobq.submit(engine, [
        {"key": "x", "type": "two", "max_attempts": 1}, {"key": "y", "type": "t"},
        {"key": "z", "type": "t", "depends_on": ["y", "x"]}, {"key": "w", "type": "t", "depends_on": ["z"]}])
    x, y, z, w = (ids[k] for k in "xyzw")
    fail_head(engine, "two")
    assert jobq.cancel(engine, y) == "cancelled"
    assert states(engine, [x, y, z, w]) == {x: "failed", y: "cancelled", z: "failed", w: "failed"}
    assert error_and_cause(engine, z) == (f"upstream job {x} failed", x)
    assert jobq.retry(engine, x) == [x]
    assert states(engine, [x, y, z, w]) == {x: "ready", y: "cancelled", z: "failed", w: "failed"}
    assert sorted(jobq.retry(engine, y)) == sorted([y, z, w])
    assert states(engine, [x, y, z, w]) == {x: "ready", y: "ready", z: "waiting", w: "waiting"}
    with engine.connect() as conn:
        pending = dict(conn.execute(sa.select(jobs.c.id, jobs.c.pending_deps).where(jobs.c.id.in_([z, w]))).all())
    assert pending == {z: 2, w: 1}


def test_containers_closed_by_an_upstream_roll_up_and_close_their_dependents(engine: sa.Engine) -> None:
    """h -> k1, k2 inside box (with a sibling s that does not depend on h), box -> after. h
    fails: k1 and k2 close, s runs; box rolls up failed once s finishes, and after closes naming
    box. Retrying h re-opens exactly h, k1, k2, box and after (s stays done)."""
    ids = jobq.submit(engine, [
        {"key": "h", "type": "roll", "max_attempts": 1}, {"key": "box", "type": "box", "container": True},
        {"key": "k1", "type": "t", "parent": "box", "depends_on": ["h"]},
        {"key": "k2", "type": "t", "parent": "box", "depends_on": ["k1"]},
        {"key": "s", "type": "sib", "parent": "box"}, {"key": "after", "type": "t", "depends_on": ["box"]}])
    fail_head(engine, "roll")
    assert states(engine, [ids["k1"], ids["k2"], ids["box"]]) == {ids["k1"]: "failed", ids["k2"]: "failed",
                                                                  ids["box"]: "waiting"}
    (lease,) = jobq.claim_batch(engine, "w", 30, types=["sib"])
    jobq.finalize(engine, lease.id, {}, worker_id="w", token=lease.token)
    assert states(engine, ids.values()) == {**{i: "failed" for i in ids.values()}, ids["s"]: "done"}
    assert error_and_cause(engine, ids["after"]) == (f"upstream job {ids['box']} failed", ids["box"])
    reopened = jobq.retry(engine, ids["h"])
    assert reopened[0] == ids["h"] and sorted(reopened) == sorted(ids[k] for k in ("h", "k1", "k2", "box", "after"))
    assert states(engine, ids.values()) == {ids["h"]: "ready", ids["box"]: "waiting", ids["k1"]: "waiting",
                                            ids["k2"]: "waiting", ids["s"]: "done", ids["after"]: "waiting"}
    with engine.connect() as conn:
        box = conn.execute(sa.select(jobs.c.pending_children, jobs.c.failed_children).where(jobs.c.id == ids["box"])).one()
    assert tuple(box) == (2, 0)



# ---- PostgreSQL before its first ANALYZE of job_deps ------------------------------------------

def _edges_read(engine: sa.Engine, d: jobq._Dialect, head: int) -> int:
    """Rows of job_deps the close walk down from ``head`` reads (EXPLAIN ANALYZE: rows times
    loops of every node that reads job_deps), under the pinned plans the walk runs with."""
    walk = sa.text("EXPLAIN (ANALYZE, FORMAT JSON) " + jobq._q_downstream(d, "close").element.text)

    def read(node: dict) -> int:
        own = node["Actual Rows"] * node["Actual Loops"] if node.get("Relation Name") == "job_deps" else 0
        return own + sum(read(n) for n in node.get("Plans", ()))

    with engine.begin() as conn:
        conn.execute(jobq._Q_PIN_PLANS)
        (plan,) = conn.execute(walk.bindparams(sa.bindparam("b_ids", expanding=True)), {"b_ids": [head]}).scalar_one()
    return read(plan["Plan"])


@needs("lateral_edges")
def test_the_walk_reads_each_jobs_edges_even_before_job_deps_is_analysed(engine: sa.Engine,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before autovacuum first analyses job_deps, PostgreSQL guessed thousands of edges per job
    and read all of job_deps at every step of the walk (32 s to fail the head of a 2,000-job
    chain beside 20,000 other jobs). Each step must look up its own rows' edges: the walk of
    a 300-job chain reads about 600 edges (down, then into each job), not 300 x 20,000. Tables
    made afresh with autovacuum off, so no statistics exist; the broken variant (the plain
    join) must read past the bound."""
    n = 300
    jobq.Base.metadata.drop_all(engine)
    jobq.create_schema(engine)
    try:
        with engine.begin() as conn:
            for table in ("jobs", "job_deps"):
                conn.exec_driver_sql(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
        for _ in range(10):
            jobq.submit(engine, fanout(2000, "other"))
        head = jobq.submit(engine, chain(n, "head"))["0"]
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT reltuples FROM pg_class WHERE relname = 'job_deps'").scalar_one() < 0
        d = jobq._prepare(engine)
        assert _edges_read(engine, d, head) <= 3 * n
        monkeypatch.setattr(jobq, "_STATEMENTS", {})  # the plain join's statement, built afresh
        assert _edges_read(engine, dataclasses.replace(d, lateral_edges=False), head) > 10 * n
    finally:
        jobq.Base.metadata.drop_all(engine)
        jobq.create_schema(engine)

"""Priorities (issue 16): ``enqueue(..., priority=int)`` orders claims within a group (higher
first, then the oldest due, then the lowest id) and never overrides fair share between groups.
The ready index carries the priority, so the claim's read stays an ordered index walk."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa

import jobq
from helpers import FAST, snapshot


def test_claims_take_the_highest_priority_first_within_a_group(engine: sa.Engine) -> None:
    """Within one group the claim order is priority desc, then run_after, then id. A claim that
    ignored priority would hand out the oldest job (``low``) first."""
    past = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    low = jobq.enqueue(engine, "t", run_after=past)  # oldest, priority 0
    high_new = jobq.enqueue(engine, "t", priority=10)
    high_old = jobq.enqueue(engine, "t", priority=10, run_after=past + dt.timedelta(seconds=1))
    neg = jobq.enqueue(engine, "t", priority=-3, run_after=past - dt.timedelta(minutes=1))
    mid = jobq.enqueue(engine, "t", priority=5)
    order = [int(jobq.claim(engine, "w", 30)) for _ in range(5)]  # type: ignore[arg-type]
    assert order == [high_old, high_new, mid, low, neg]
    assert jobq.get(engine, mid).priority == 5  # type: ignore[union-attr]


def test_a_worker_runs_a_group_in_priority_order(engine: sa.Engine) -> None:
    """Through a real Worker with one slot: the jobs run in priority order, not in id order."""
    ran: list[int] = []
    ids = {p: jobq.enqueue(engine, "t", args={"p": p}, priority=p) for p in (1, 3, 2, 0, 5)}
    w = jobq.Worker(engine, {"t": lambda ctx: ran.append(ctx.args["p"])}, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=60)
    assert ran == [5, 3, 2, 1, 0]
    assert sorted(ids) == sorted(ran)


def test_priority_does_not_override_fair_share_between_groups(engine: sa.Engine) -> None:
    """A group of high-priority jobs does not starve another group: with two equal groups and
    two free slots, one claim takes one job of each group, each group's highest first."""
    a_hi = jobq.enqueue(engine, "t", group_key="a", priority=100)
    jobq.enqueue(engine, "t", group_key="a", priority=100)
    b_low = jobq.enqueue(engine, "t", group_key="b", priority=-100)
    jobq.enqueue(engine, "t", group_key="b", priority=-200)
    leases = jobq.claim_batch(engine, "w", 30, limit=2)
    assert sorted(lease.id for lease in leases) == sorted([a_hi, b_low])


@pytest.mark.parametrize("bad", [True, 1.5, "3", 1 << 31, -(1 << 31) - 1, 1 << 63])
def test_bad_priorities_are_refused_and_write_nothing(engine: sa.Engine, bad: object) -> None:
    """bool (an int subclass), floats, strings and ints outside a 32-bit INTEGER are refused
    before anything is written (MySQL in non-strict mode would clamp them silently)."""
    before = snapshot(engine)
    with pytest.raises(jobq.InvalidJob, match="priority"):
        jobq.enqueue(engine, "t", priority=bad)  # type: ignore[arg-type]
    with pytest.raises(jobq.InvalidJob, match="priority"):
        jobq.submit(engine, [{"key": "a", "type": "t", "priority": bad}])
    assert snapshot(engine) == before
    assert jobq.get(engine, jobq.enqueue(engine, "t", priority=(1 << 31) - 1)).priority == (1 << 31) - 1  # type: ignore[union-attr]
    assert jobq.get(engine, jobq.enqueue(engine, "t", priority=-(1 << 31))).priority == -(1 << 31)  # type: ignore[union-attr]


def _explain(engine: sa.Engine, stmt: sa.Executable) -> str:
    sql = str(stmt.compile(engine, compile_kwargs={"literal_binds": True, "render_postcompile": True}))
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            return " | ".join(str(r[-1]) for r in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}"))
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql("SET enable_seqscan = off")  # tiny tables: make the planner show its options
            out = " | ".join(r[0] for r in conn.exec_driver_sql(f"EXPLAIN {sql}"))
        else:
            out = " | ".join(" ".join(str(v) for v in r) for r in conn.exec_driver_sql(f"EXPLAIN {sql}"))
        conn.rollback()
        return out


def test_the_claims_read_walks_the_ready_index_in_priority_order_without_sorting(engine: sa.Engine) -> None:
    """On every engine the claim's locking read of one group (and the window read) is an
    index walk of the ready index in claim order: no sort step, so it reads at most ``limit``
    entries. A ready index without the priority column (the schema 3 one) would need a sort of
    the group's whole ready set: the broken variant below shows the check catches that."""
    jobq.submit(engine, [{"key": str(i), "type": "t", "group_key": "g", "priority": i % 3} for i in range(300)])
    d = jobq._prepare(engine)
    now = dt.datetime(2030, 1, 1)
    stmts = {"candidates": jobq._q_candidates(d, False).params(b_group="g", b_now=now, b_limit=10),
             "window candidates": jobq._q_window_candidates(d, 2, False).params(b_g0="g", b_g1="", b_now=now, b_limit=10)}
    sort_words = ("Sort", "TEMP B-TREE", "filesort")
    for name, stmt in stmts.items():
        plan = _explain(engine, stmt)
        assert "ix_jobs_ready" in plan, f"{name}: {plan}"
        assert not any(w in plan for w in sort_words), f"{name}: {plan}"
    # the broken variant: the schema 3 ready index (no priority) needs a sort
    name = "ix_jobs_ready" if d.partial_indexes else "ix_jobs_ready_my"
    index = next(i for i in jobq.Job.__table__.indexes if i.name == name)
    cols = "group_key, run_after, id" if d.partial_indexes else "state, group_key, run_after, id"
    where = " WHERE state = 'ready'" if d.partial_indexes else ""
    with engine.begin() as conn:
        index.drop(conn)
        conn.exec_driver_sql(f"CREATE INDEX {name} ON jobs ({cols}){where}")
    try:
        plan = _explain(engine, stmts["candidates"])
        assert any(w in plan for w in sort_words) or "ix_jobs_ready" not in plan, plan
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP INDEX {name}" + (" ON jobs" if not d.partial_indexes else ""))
            index.create(conn)

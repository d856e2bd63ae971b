"""stats(): what `jobq status` shows. Its plans are checked in test_plans.py."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa

import jobq
from helpers import db_now

jobs = jobq.Job.__table__


def test_stats_counts_live_states_exactly_and_finished_ones_in_the_window(engine: sa.Engine) -> None:
    up = jobq.enqueue(engine, "t", group_key="a")
    jobq.enqueue(engine, "t", depends_on=[up], group_key="a")  # waiting
    for _ in range(3):
        jobq.enqueue(engine, "t", group_key="b")
    old = jobq.enqueue(engine, "hist", group_key="c")
    lease = jobq.claim_batch(engine, "w", 30, limit=1, types=["t"])[0]  # the oldest: `up`
    assert lease.id == up
    jobq.finalize(engine, up, {}, worker_id="w", token=lease.token)
    (boom,) = jobq.claim_batch(engine, "w", 30, limit=1, types=["t"])
    jobq.fail(engine, boom.id, "boom: disk full", worker_id="w", token=boom.token, retry=False)
    jobq.claim_batch(engine, "w", 30, limit=1, types=["t"])  # one leased
    with engine.begin() as conn:  # a job finished long ago is history, outside the window
        conn.execute(sa.update(jobs).where(jobs.c.id == old).values(
            state="done", finished_at=db_now(engine) - dt.timedelta(days=3)))
    st = jobq.stats(engine)
    assert {k: st["states"][k] for k in ("waiting", "ready", "leased", "running", "done", "failed", "cancelled")} == {
        "waiting": 0, "ready": 2, "leased": 1, "running": 0, "done": 1, "failed": 1, "cancelled": 0}
    assert sum(st["ready_by_group"].values()) == 2
    assert sum(st["in_flight"].values()) == 1
    assert [f["id"] for f in st["recent_failures"]] == [boom.id] and "disk full" in st["recent_failures"][0]["error"]
    assert st["expired_leases"] == 0 and st["oldest_ready"] is not None
    assert "totals" not in st
    full = jobq.stats(engine, totals=True)["totals"]
    assert full["done"] == 2 and sum(full.values()) == 6
    assert jobq.stats(engine, window=dt.timedelta(days=7))["states"]["done"] == 2


def test_stats_report_due_and_scheduled_ready_jobs_apart(engine: sa.Engine) -> None:
    """A ready job whose run_after is still ahead (scheduled, or backing off) is not waiting:
    today it counts as the oldest ready job, and `jobq status` prints a negative age."""
    later = jobq.get(engine, jobq.enqueue(engine, "t", group_key="a", run_after=dt.timedelta(hours=1)))
    assert later is not None
    st = jobq.stats(engine)
    assert (st["states"]["ready"], st["ready_due"], st["ready_scheduled"]) == (1, 0, 1)
    assert st["ready_by_group"] == {"a": 1} and st["due_by_group"] == {"a": 0}
    assert st["oldest_ready"] is None and st["next_scheduled"] == later.run_after.replace(tzinfo=None)
    due = jobq.get(engine, jobq.enqueue(engine, "t", group_key="b"))
    assert due is not None
    st = jobq.stats(engine)
    assert (st["states"]["ready"], st["ready_due"], st["ready_scheduled"]) == (2, 1, 1)
    assert st["ready_by_group"] == {"a": 1, "b": 1} and st["due_by_group"] == {"a": 0, "b": 1}
    assert st["oldest_ready"] == due.run_after.replace(tzinfo=None) <= st["now"] < st["next_scheduled"]

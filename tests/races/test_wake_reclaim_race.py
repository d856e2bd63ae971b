"""A suspension (the wake-up's other half) against a reclaim of the same dispatch (issue 42).

Worker A's handler waits for "k" and unwinds to suspend the job J; before A's suspension is
written (at "handler_returned", every engine) or inside its transaction once it has locked the
key's row (at "suspend_checked", the engines with row locks), A's lease expires, a reclaim
sweep returns J to ``ready`` (attempt 1 ended ``reclaimed``) and worker C claims J again. Then
A's suspension is written, the signal "k" is sent and worker D drains the queue.

Correct: A's suspension is fenced by its lease, so it writes nothing: J stays leased to C, the signal wakes nobody (J is not suspended), D never runs J, and C finishes it once
(history: reclaimed, done). A suspension that is not fenced by the lease would put J back to
``ready`` under C's feet, waiting for "k"; the signal would wake it and D would run J while C
still runs it: two dispatches of one job at once, and C's finish refused. The deliberately
broken variant (an unfenced suspension) is run beside the test and must be caught."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
from dbs import needs
from harness import SUMMARY
from helpers import FAST, expire_leases, wait_for


def _race(engine: sa.Engine, point: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    job = jobq.enqueue(engine, "t", {})
    other = sa.create_engine(engine.url, pool_size=2, max_overflow=0)  # the sweeper's and C's connection
    jobq._prepare(other)
    seen: dict[str, Any] = {}
    d_runs: list[int] = []
    a_runs: list[int] = []

    def interleave() -> None:  # on its own thread: A's thread holds its transaction open meanwhile
        expire_leases(other, job)
        seen["reclaimed"] = jobq.reclaim(other)
        seen["c"] = jobq.claim_batch(other, "C", 600, limit=1)

    def checkpoint(name: str, ids: Any = ()) -> None:
        if name == point and job in list(ids) and "c" not in seen:
            t = threading.Thread(target=interleave)
            t.start()
            t.join(60)
            assert not t.is_alive(), "the reclaim or C's claim waited for A's open transaction"

    def a_handler(ctx: jobq.JobContext) -> dict:
        a_runs.append(ctx.id)
        return {"got": ctx.wait_for("k")}

    monkeypatch.setattr(jobq, "_checkpoint", checkpoint)
    a = jobq.Worker(engine, {"t": a_handler}, max_concurrency=1, worker_id="A", **FAST)
    runner = threading.Thread(target=a.run)  # run_until_idle would wait for C's running job
    try:
        runner.start()
        wait_for(lambda: "c" in seen, timeout=60, what="A's dispatch to reach the race")
        a.stop()  # A's handler has returned: a graceful stop writes its suspension
        runner.join(60)
        assert not runner.is_alive()
    finally:
        monkeypatch.undo()
    after_a = jobq.get(engine, job)
    sent = jobq.signal(engine, "k", "paid")

    def d_handler(ctx: jobq.JobContext) -> dict:
        d_runs.append(ctx.id)
        return {"got": ctx.wait_for("k")}

    d = jobq.Worker(engine, {"t": d_handler}, max_concurrency=1, worker_id="D", **FAST)
    if d.tick():  # D claims what is due now: J only if A's stale suspension let the signal wake it
        d.run_until_idle(timeout=60)
    [lease] = seen["c"]
    try:
        c_finished: Any = jobq.finalize(other, job, {"by": "C"}, worker_id="C", token=lease.token)
    except jobq.LeaseLost as exc:  # what C would see if its lease had been taken from under it
        c_finished = exc
    other.dispose()
    info = jobq.get(engine, job)
    assert info is not None and after_a is not None
    return {"reclaimed": seen["reclaimed"], "c_claimed": [x.id for x in seen["c"]], "a_runs": a_runs,
            "after_a": (after_a.state, after_a.lease_owner), "sent": sent, "d_runs": d_runs,
            "c_finished": c_finished, "state": info.state, "result": info.result,
            "history": [(a.attempt, a.outcome) for a in jobq.attempts(engine, job)]}


def _broken(r: dict[str, Any]) -> list[str]:
    bad = []
    if r["after_a"] != ("leased", "C"):  # C's lease, as claim_batch left it
        bad.append(f"A's stale suspension changed the job C holds: {r['after_a']}")
    if r["d_runs"]:
        bad.append(f"D ran the job while C held it (two dispatches at once): {r['d_runs']}")
    if r["state"] != "done" or r["result"] != {"by": "C"}:
        bad.append(f"C's finish did not land: {r['state']} {r['result']} ({r['c_finished']!r})")
    if r["history"] != [(1, "reclaimed"), (2, "done")]:
        bad.append(f"history {r['history']}")
    return bad


def _check(engine: sa.Engine, dialect: str, point: str, monkeypatch: pytest.MonkeyPatch) -> None:
    r = _race(engine, point, monkeypatch)
    SUMMARY.append({"engine": dialect, "check": f"suspension vs reclaim at {point}"})
    assert r["reclaimed"] == 1 and r["a_runs"] and r["sent"] is True, r
    assert _broken(r) == []


def test_a_reclaim_before_the_suspension_is_written_wins(engine: sa.Engine, dialect: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _check(engine, dialect, "handler_returned", monkeypatch)


@needs("row_locks")  # SQLite: the suspension's transaction holds the write lock; nothing runs inside it
def test_a_reclaim_inside_the_suspensions_transaction_wins(engine: sa.Engine, dialect: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _check(engine, dialect, "suspend_checked", monkeypatch)


def _unfenced_suspend(job_id: int, owner: str | None, token: str | None, run_after: Any, now: Any) -> sa.Update:
    """BROKEN: the suspension's write names the job but not the lease it was dispatched under."""
    c = jobq.Job.__table__.c
    return (sa.update(jobq.Job.__table__).where(c.id == job_id)
            .values(state="ready", attempts=c.attempts - 1, lease_token=None, lease_owner=None, lease_expires=None,
                    in_flight=False, run_after=run_after, updated_at=now))


def test_harness_catches_an_unfenced_suspension(engine: sa.Engine, dialect: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobq, "_q_suspend", _unfenced_suspend)
    r = _race(engine, "handler_returned", monkeypatch)
    SUMMARY.append({"engine": dialect, "check": "broken unfenced suspension vs reclaim", "caught": True})
    assert _broken(r) != [], r

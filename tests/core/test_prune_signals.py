"""prune removes the signals nobody can still receive (issue 42), and nothing else.

The rule (signal()'s docstring): a signal sent more than ``older_than`` ago (a key only
awaited: made that long ago) is deleted unless an unfinished job has waited for its key. A
signal sent before its job waits is kept for ``older_than`` whatever happens; past that, the
rule cannot know a job that has not waited yet, and that job waits anew: both sides are
pinned here. ``now=`` moves prune's clock forward instead of waiting for time to pass."""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa

import jobq
from helpers import FAST, TABLES, db_now, state

SIGNALS = TABLES["jobq_signals"]
HOUR = dt.timedelta(hours=1)


def keys(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(sa.select(SIGNALS.c.key)).scalars())


def later(engine: sa.Engine, hours: float) -> dt.datetime:
    return db_now(engine) + dt.timedelta(hours=hours)


def test_prune_keeps_signals_a_live_job_waited_for_and_removes_the_rest(engine: sa.Engine) -> None:
    """Correct: an old signal nobody waited for goes, a young one stays; a signal whose job is
    suspended on it, or woken by it and not yet run again, stays however old; once that job
    finished, it goes. A prune that deleted every old signal would leave the woken job's
    re-run waiting for a signal it was already sent (it would suspend again, not finish)."""
    jobq.signal(engine, "nobody", 1)
    jobq.signal(engine, "young", 2)
    waiter = jobq.enqueue(engine, "w", {})
    handlers = {"w": lambda ctx: {"got": ctx.wait_for("approve")}}
    w = jobq.Worker(engine, handlers, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=30) and state(engine, waiter) == "ready"
    assert keys(engine) == {"nobody", "young", "approve"}  # "approve": awaited only

    jobq.prune(engine, HOUR)  # now: nothing is an hour old
    assert keys(engine) == {"nobody", "young", "approve"}
    assert jobq.prune(engine, HOUR, now=later(engine, 2)) == 0  # two hours on: no job is finished, so 0 jobs
    assert keys(engine) == {"approve"}  # the job suspended on it keeps it

    assert jobq.signal(engine, "approve", {"by": "ops"})  # wakes the waiter; it has not run again yet
    jobq.prune(engine, HOUR, now=later(engine, 2))
    assert "approve" in keys(engine), "the woken job's re-run still reads this signal"
    assert w.run_until_idle(timeout=30)
    info = jobq.get(engine, waiter)
    assert info is not None and info.result == {"got": {"by": "ops"}}, info
    jobq.prune(engine, HOUR, now=later(engine, 2), states=("failed",))  # the done waiter itself stays
    assert "approve" not in keys(engine) and jobq.get(engine, waiter) is not None


def test_a_signal_sent_before_its_job_waits_is_kept_for_older_than(engine: sa.Engine) -> None:
    """A webhook that beats its job: within ``older_than`` prune keeps it and the job, when it
    waits, reads it at once. Past ``older_than`` (the job still behind an upstream) the rule
    deletes it, as documented, and the job then waits anew: this pins that limit, so a change
    of rule shows here."""
    jobq.signal(engine, "paid-1", {"amount": 5})
    jobq.signal(engine, "paid-2", {"amount": 7})
    gate = jobq.enqueue(engine, "gate", {})
    early = jobq.enqueue(engine, "charge", {"n": 1}, depends_on=[gate])
    late = jobq.enqueue(engine, "charge", {"n": 2}, depends_on=[gate])
    jobq.prune(engine, HOUR, now=later(engine, 0.5))
    assert {"paid-1", "paid-2"} <= keys(engine)
    jobq.prune(engine, HOUR, now=later(engine, 2))  # past older_than: the rule cannot see the charges
    assert not {"paid-1", "paid-2"} & keys(engine)
    jobq.signal(engine, "paid-1", {"amount": 5})  # sent again (a webhook retried)
    handlers = {"gate": lambda ctx: None, "charge": lambda ctx: ctx.wait_for(f"paid-{ctx.args['n']}", timeout=3600)}
    assert jobq.Worker(engine, handlers, max_concurrency=1, **FAST).run_until_idle(timeout=30)
    assert jobq.get(engine, early).result == {"amount": 5}  # type: ignore[union-attr]
    assert state(engine, late) == "ready" and "waiting for signal 'paid-2'" in jobq.why(engine, late)


def test_a_timed_out_wait_keeps_its_key_until_its_job_finishes(engine: sa.Engine) -> None:
    """A job that timed out waiting keeps raising WaitTimeout on its re-runs (its wait row says
    so); the key's awaited-only row goes once the job is finished and the row is old."""
    job = jobq.enqueue(engine, "t", {}, max_attempts=2)

    def handler(ctx: jobq.JobContext) -> dict:
        try:
            ctx.wait_for("never", timeout=0.01)
        except jobq.WaitTimeout:
            if ctx.attempt == 1:
                raise RuntimeError("fails once after the timeout") from None
            return {"timed_out": True}
        return {"timed_out": False}

    w = jobq.Worker(engine, {"t": handler}, max_concurrency=1, **FAST)
    for _ in range(50):  # the 10 ms timeout: ticked until the job has finished
        w.run_until_idle(timeout=30)
        if state(engine, job) == "done":
            break
    assert jobq.get(engine, job).result == {"timed_out": True}  # type: ignore[union-attr]
    assert "never" in keys(engine)
    jobq.prune(engine, HOUR)
    assert "never" in keys(engine)  # young
    jobq.prune(engine, HOUR, now=later(engine, 2))
    assert "never" not in keys(engine)

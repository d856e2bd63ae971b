"""Recurring jobs (jobq.schedule): validation, each slot enqueued once, the catch-up rule after
downtime, pause/resume/change/remove, cron, and a worker that fires a due schedule.

Slots are fired with ``jobq._fire_due(engine, now)``, the function workers call every
``_SCHEDULE_POLL`` seconds, with ``now`` set past a slot instead of waiting for it."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
from dbs import needs
from helpers import FAST, ROOT, wait_for

jobs = jobq.Job.__table__
MIN = dt.timedelta(minutes=1)


def naive(t: dt.datetime) -> dt.datetime:
    return t.astimezone(dt.UTC).replace(tzinfo=None)


def fire(engine: sa.Engine, at: dt.datetime) -> list[int]:
    return jobq._fire_due(engine, naive(at))


def job_rows(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(jobs.c.id, jobs.c.type, jobs.c.args, jobs.c.run_after).order_by(jobs.c.id)))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "exactly one of every"),
    ({"every": MIN, "cron": "* * * * *"}, "exactly one of every"),
    ({"every": dt.timedelta(0)}, "every must be between"),
    ({"every": -MIN}, "every must be between"),
    ({"every": dt.timedelta(milliseconds=500)}, "every must be between"),
    ({"every": 60}, "every must be a datetime.timedelta"),
    ({"cron": "61 * * * *"}, "is not a cron expression"),
    ({"cron": "every day"}, "is not a cron expression"),
    ({"cron": ""}, "cron must be a cron expression"),
    ({"cron": "* * * * *", "start": dt.datetime(2030, 1, 1, tzinfo=dt.UTC)}, "start is for every="),
    ({"every": MIN, "start": dt.datetime(2030, 1, 1)}, "naive datetime"),
    ({"every": MIN, "max_attempts": 0}, "max_attempts"),
    ({"every": MIN, "args": {"x": float("nan")}}, "args"),
])
def test_schedule_refuses_bad_input_with_one_error(engine: sa.Engine, kwargs: dict[str, Any], message: str) -> None:
    """Both or neither of every/cron, an interval <= 0 or under a second, a bad cron expression,
    a naive start, a bad job field: one InvalidJob of one line naming the problem, nothing stored."""
    with pytest.raises(jobq.InvalidJob, match=message) as info:
        jobq.schedule(engine, "s", "t", **kwargs)
    assert "\n" not in str(info.value)
    assert jobq.schedules(engine) == []
    with pytest.raises(jobq.InvalidJob, match="name"):
        jobq.schedule(engine, "", "t", every=MIN)


def test_each_slot_is_enqueued_once_with_its_time_as_run_after(engine: sa.Engine) -> None:
    """An every-minute schedule: nothing before its first slot (one minute after it was made);
    one job at the slot, whose run_after is the slot; a second check at the same time enqueues
    nothing; the next minute one more. A firing without its fence would enqueue the slot again."""
    info = jobq.schedule(engine, "tick", "t", every=MIN, args={"n": 1}, group_key="g", priority=5, max_attempts=2)
    assert info.next_run_at == info.start + MIN and info.runs == 0 and info.last_run_at is None
    slot = info.next_run_at
    assert fire(engine, slot - dt.timedelta(seconds=1)) == []
    [first] = fire(engine, slot)
    assert fire(engine, slot) == [] and fire(engine, slot + dt.timedelta(seconds=30)) == []
    got = jobq.get(engine, first)
    assert got is not None and (got.type, got.args, got.group_key, got.priority, got.max_attempts, got.state) == (
        "t", {"n": 1}, "g", 5, 2, "ready")
    assert got.run_after == slot
    [second] = fire(engine, slot + MIN)
    [info] = jobq.schedules(engine)
    assert (info.runs, info.last_run_at, info.last_job_id, info.next_run_at) == (2, slot + MIN, second, slot + 2 * MIN)
    assert len(job_rows(engine)) == 2


def test_catch_up_after_downtime_enqueues_one_job_for_the_missed_slots(engine: sa.Engine) -> None:
    """No worker for ten and a half slots: the first check after enqueues ONE job, for the
    latest missed slot, and the schedule moves to the first slot after now (not to the next
    missed one, which would enqueue the backlog one by one)."""
    info = jobq.schedule(engine, "sync", "t", every=MIN)
    back = info.next_run_at + 10 * MIN + dt.timedelta(seconds=30)
    fired = fire(engine, back)
    assert len(fired) == 1 and fire(engine, back) == []
    [info2] = jobq.schedules(engine)
    assert info2.last_run_at == info.next_run_at + 10 * MIN
    assert info2.next_run_at == info.next_run_at + 11 * MIN and info2.runs == 1
    assert jobq.get(engine, fired[0]).run_after == info2.last_run_at  # type: ignore[union-attr]


def test_cron_schedule_fires_on_its_slots_in_utc(engine: sa.Engine) -> None:
    """``*/15 * * * *``: the next slot is a quarter hour in UTC; a three-hour gap catches up
    with one job for the latest quarter hour before now."""
    info = jobq.schedule(engine, "q", "t", cron="*/15 * * * *")
    nxt = info.next_run_at
    assert nxt.minute % 15 == 0 and nxt.second == 0 and nxt.tzinfo == dt.UTC and nxt - info.created_at <= 15 * MIN
    [job] = fire(engine, nxt + 3 * dt.timedelta(hours=1) + 7 * MIN)
    [info2] = jobq.schedules(engine)
    assert info2.last_run_at == nxt + 3 * dt.timedelta(hours=1)
    assert info2.next_run_at == nxt + 3 * dt.timedelta(hours=1) + 15 * MIN
    assert jobq.get(engine, job).run_after == info2.last_run_at  # type: ignore[union-attr]


def test_pause_skips_slots_and_resume_starts_after_now(engine: sa.Engine) -> None:
    """A paused schedule enqueues nothing, however late; resumed, it continues from the first
    slot after the resume (slots that fell while paused are skipped, not caught up)."""
    info = jobq.schedule(engine, "p", "t", every=MIN)
    assert jobq.pause_schedule(engine, "p").paused
    assert fire(engine, info.next_run_at + 60 * MIN) == []
    resumed = jobq.resume_schedule(engine, "p")
    assert not resumed.paused and resumed.next_run_at > resumed.updated_at
    assert resumed.next_run_at <= resumed.updated_at + MIN and (resumed.next_run_at - info.start) % MIN == dt.timedelta(0)
    assert fire(engine, resumed.updated_at) == []
    assert len(fire(engine, resumed.next_run_at)) == 1
    with pytest.raises(jobq.InvalidJob, match="no schedule named 'nope'"):
        jobq.pause_schedule(engine, "nope")


def test_change_keeps_the_slot_unless_the_timing_changed(engine: sa.Engine) -> None:
    """schedule() again under the same name: new job fields apply from the kept next slot; a
    new interval recomputes the next slot; a paused schedule stays paused through a change."""
    info = jobq.schedule(engine, "c", "t", every=MIN, args={"v": 1})
    changed = jobq.schedule(engine, "c", "t2", every=MIN, args={"v": 2})
    assert changed.next_run_at == info.next_run_at and changed.created_at == info.created_at
    [job] = fire(engine, info.next_run_at)
    assert (jobq.get(engine, job).type, jobq.get(engine, job).args) == ("t2", {"v": 2})  # type: ignore[union-attr]
    hourly = jobq.schedule(engine, "c", "t2", every=60 * MIN)
    assert hourly.every == 60 * MIN and hourly.next_run_at == hourly.updated_at + 60 * MIN
    jobq.pause_schedule(engine, "c")
    assert jobq.schedule(engine, "c", "t3", every=60 * MIN).paused


@needs("row_locks")  # SQLite serialises writers (BEGIN IMMEDIATE), so no window exists
def test_a_firing_that_read_an_older_revision_enqueues_nothing_stale(engine: sa.Engine,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The fence: a change committed between a firing's read and its update (made at the
    firing's "schedule_read" checkpoint, on another connection) makes the update miss, or the
    engine's isolation refuses it and the transaction reruns on the new row: either way the
    slot is enqueued once, with the new fields. A firing without its fence would enqueue the
    stale args {"v": 1}."""
    info = jobq.schedule(engine, "f", "t", every=MIN, args={"v": 1})
    other = sa.create_engine(engine.url, poolclass=sa.pool.NullPool)
    changed: list[int] = []

    def checkpoint(name: str, ids: Any = ()) -> None:
        if name == "schedule_read" and not changed:
            changed.append(1)
            jobq.schedule(other, "f", "t", every=MIN, args={"v": 2})

    monkeypatch.setattr(jobq, "_checkpoint", checkpoint)
    first = fire(engine, info.next_run_at)
    monkeypatch.undo()
    second = fire(engine, info.next_run_at)
    other.dispose()
    assert changed and len(first + second) == 1, (first, second)
    assert [r.args for r in job_rows(engine)] == [{"v": 2}]


def test_unschedule_stops_it_and_keeps_its_jobs(engine: sa.Engine) -> None:
    info = jobq.schedule(engine, "r", "t", every=MIN)
    [job] = fire(engine, info.next_run_at)
    assert jobq.unschedule(engine, "r") is True
    assert jobq.unschedule(engine, "r") is False
    assert fire(engine, info.next_run_at + 30 * MIN) == []
    assert [r.id for r in job_rows(engine)] == [job]


def test_schedule_in_a_caller_transaction_that_rolls_back_leaves_nothing(engine: sa.Engine) -> None:
    jobq.create_schema(engine)
    with engine.connect() as conn:
        jobq.schedule(conn, "tx", "t", every=MIN)
        assert [s.name for s in jobq.schedules(conn)] == ["tx"]
        conn.rollback()
    assert jobq.schedules(engine) == []


def test_unique_key_keeps_runs_from_overlapping(engine: sa.Engine) -> None:
    """With unique_key, a slot whose key the previous slot's unfinished job still holds
    enqueues nothing new (the slot counts as fired and names that job)."""
    info = jobq.schedule(engine, "u", "t", every=MIN, unique_key="nightly")
    [first] = fire(engine, info.next_run_at)
    assert fire(engine, info.next_run_at + MIN) == [first]
    assert len(job_rows(engine)) == 1 and jobq.schedules(engine)[0].runs == 2


def test_a_worker_enqueues_and_runs_a_due_schedule(engine: sa.Engine) -> None:
    """A Worker checks for due schedules on its own (every _SCHEDULE_POLL seconds): a
    schedule anchored in the past with its slot a second away is enqueued and run."""
    ran: list[Any] = []
    info = jobq.schedule(engine, "w", "t", every=dt.timedelta(seconds=1), args={"k": 1})
    w = jobq.Worker(engine, {"t": lambda ctx: ran.append(ctx.args)}, max_concurrency=1, **FAST)
    wait_for(lambda: w.tick() is not None and ran, timeout=30, what="the scheduled job to run")
    assert ran[0] == {"k": 1} and jobq.schedules(engine)[0].runs >= 1 and info.runs == 0


def test_cron_needs_croniter_and_the_core_never_imports_it(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without croniter a cron schedule is refused with the extra to install; importing jobq
    (and making interval schedules) never imports croniter."""
    monkeypatch.setitem(sys.modules, "croniter", None)
    with pytest.raises(jobq.InvalidJob, match=r"pip install 'jobq\[cron\]'"):
        jobq.schedule(engine, "c", "t", cron="* * * * *")
    monkeypatch.undo()
    code = "import sys, jobq; assert 'croniter' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)

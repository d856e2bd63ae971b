"""Kill real worker processes with real signals; the queue loses nothing and completes nothing twice."""

from __future__ import annotations

import datetime as dt
import os
import pathlib
import random
import signal
import threading

import pytest
import sqlalchemy as sa

import jobq
from helpers import ATTEMPTS, SLOTS, db_now, wait_for
from procs import SUMMARY, events, executions, finalized, start, wait_file

jobs = jobq.Job.__table__
ITERATIONS = int(os.environ.get("JOBQ_CRASH_ITERATIONS", "30"))
POINTS = ["claimed", "mid_handler", "handler_returned", "finalize_before_commit"]


def _drain_cleanly(url: str, logdir: pathlib.Path) -> None:
    p = start(url, logdir, "--until-idle", "60", "--concurrency", "3")
    assert p.wait(90) == 0, (logdir / "stderr.log").read_text()[-2000:]


def _table(engine: sa.Engine) -> dict[int, sa.Row]:
    with engine.connect() as conn:
        return {r.id: r for r in conn.execute(sa.select(jobs))}


def test_sigkill_at_random_points_loses_nothing_and_completes_nothing_twice(engine: sa.Engine, db_url: str, tmp_path: pathlib.Path) -> None:
    """30 worker processes are SIGKILLed one after another at random points: right after a
    claim, mid-handler, between handler return and finalize, inside the finalize transaction.
    Correct: afterwards every job is done exactly once (no job has two finalize commits in the
    log), no job is left leased or running, every result comes from a logged execution, and
    attempts never exceed max_attempts. A lost job shows as not done; a double completion as a
    second finalize line; a leaked lease as a leased row; history written outside the finalize
    transaction as a "done" row for an attempt that was then reclaimed."""
    rnd = random.Random(int(os.environ.get("JOBQ_CRASH_SEED", "7")))
    with engine.begin() as conn:
        ids = [jobq.enqueue(conn, "work", {"sleep": 0.03}, max_attempts=25) for _ in range(70)]
    kills: dict[str, int] = {}
    for _ in range(ITERATIONS):
        point = rnd.choice(POINTS)
        if point == "mid_handler":
            target = sum(executions(tmp_path).values()) + rnd.randint(0, 2)
            p = start(db_url, tmp_path, "--concurrency", "2")
            wait_for(lambda p=p, target=target: sum(executions(tmp_path).values()) > target or p.poll() is not None,
                     timeout=30, what="a handler to start")
            p.send_signal(signal.SIGKILL)
        else:
            p = start(db_url, tmp_path, "--concurrency", "2", "--kill-at", point, "--kill-nth", str(rnd.randint(1, 3)))
        code = p.wait(60)
        if code == -signal.SIGKILL:
            kills[point] = kills.get(point, 0) + 1
    _drain_cleanly(db_url, tmp_path)
    rows = _table(engine)
    execs, finals = executions(tmp_path), finalized(tmp_path)
    assert [i for i in ids if rows[i].state != "done"] == []
    assert [i for i, r in rows.items() if r.state in ("leased", "running") or r.in_flight] == []
    assert [i for i, n in finals.items() if n > 1] == [], "a job was finalized twice"
    for i in ids:
        r = rows[i]
        assert 1 <= execs[i] <= r.attempts <= r.max_attempts
        assert f"{i} {r.result['attempt']}" in {line for line in _exec_lines(tmp_path)}
    # Attempt history: every claim ended exactly once, in the transaction that ended it. A kill
    # inside the finalize transaction left no "done" row (it rolled back): that attempt reads
    # "reclaimed", and only the last attempt "done". The finished job's error is None.
    with engine.connect() as conn:
        history: dict[int, list[tuple[int, str]]] = {}
        for h in conn.execute(sa.select(ATTEMPTS).order_by(ATTEMPTS.c.id)):
            history.setdefault(h.job_id, []).append((h.attempt, h.outcome))
    for i in ids:
        r = rows[i]
        assert history.get(i) == [(n, "reclaimed") for n in range(1, r.attempts)] + [(r.attempts, "done")], (i, history.get(i))
        assert r.error is None, (i, r.error)
    assert sum(kills.values()) >= ITERATIONS * 0.8, kills  # the kills really happened
    assert sum(r.attempts for r in rows.values()) > len(ids), "no job was ever re-run"
    SUMMARY.append(
        f"{engine.dialect.name:<10} {sum(kills.values())} SIGKILLs {dict(sorted(kills.items()))}; {len(ids)} jobs all done once; "
        f"{sum(1 for i in ids if rows[i].attempts > 1)} re-run; {sum(execs.values())} executions; max attempts {max(r.attempts for r in rows.values())}"
    )


def _exec_lines(logdir: pathlib.Path) -> list[str]:
    from procs import lines

    return lines(logdir, "exec")


@pytest.mark.parametrize("b_done_first", [True, False], ids=["B-finished", "B-still-running"])
def test_a_zombie_worker_cannot_heartbeat_or_finalize(engine: sa.Engine, db_url: str, tmp_path: pathlib.Path, b_done_first: bool) -> None:
    """Worker A is SIGSTOPped mid-handler past its lease; B reclaims and runs the job. When A
    resumes (after B finished, or while B still runs) its heartbeat and finalize are refused:
    B's result stands and B's lease is untouched. A bug would show A's result, or A's
    heartbeat extending the lease B holds."""
    jid = jobq.enqueue(engine, "work", {"sleep": 1.5}, max_attempts=5)
    a = start(db_url, tmp_path, "--concurrency", "1", "--ttl", "1.0")
    gate = threading.Event()
    try:
        wait_file(tmp_path / f"started-{jid}-1")
        a.send_signal(signal.SIGSTOP)
        wait_for(lambda: jobq.get(engine, jid).lease_expires < db_now(engine).replace(tzinfo=dt.UTC), timeout=10, what="A's lease to expire")

        def b_handler(ctx: jobq.JobContext) -> dict:
            gate.wait(60)
            return {"by": "B", "attempt": ctx.attempt}

        # B is ticked by hand (no heartbeats): a long lease, so that however long A takes to
        # learn of its loss, B's lease has not expired for A's sweep to take back meanwhile.
        b = jobq.Worker(engine, {"work": b_handler}, max_concurrency=1, lease_ttl=60.0, poll_interval=0.02)
        assert b.tick() == 1  # reclaims A's expired lease and claims the job again
        b_lease = jobq.get(engine, jid)
        assert b_lease is not None and b_lease.attempts == 2 and b_lease.lease_owner == b.worker_id
        if b_done_first:
            gate.set()
            assert b.run_until_idle(timeout=20)
        a.send_signal(signal.SIGCONT)
        wait_for(lambda: ("lease_lost", jid) in events(tmp_path), timeout=20, what="A to learn it lost the lease")
        if not b_done_first:
            mid = jobq.get(engine, jid)
            assert mid is not None and (mid.state, mid.lease_owner, mid.attempts) == ("running", b.worker_id, 2)
            gate.set()
            assert b.run_until_idle(timeout=20)
        info = jobq.get(engine, jid)
        assert info is not None and info.state == "done" and info.result == {"by": "B", "attempt": 2}
        assert finalized(tmp_path)[jid] == 0  # A never committed a finalize
    finally:
        gate.set()
        a.send_signal(signal.SIGCONT)
        a.kill()
        a.wait(10)


def test_a_poison_job_fails_after_max_attempts_and_others_complete(engine: sa.Engine, db_url: str, tmp_path: pathlib.Path) -> None:
    """A handler that kills its own process every time: after max_attempts lease expiries the
    job ends failed with an error saying so, instead of killing workers forever; the other jobs
    complete. A bug shows as more than 3 executions of the poison job, or it never failing."""
    poison = jobq.enqueue(engine, "poison", max_attempts=3)
    others = [jobq.enqueue(engine, "work", {"sleep": 0.01}, max_attempts=10) for _ in range(6)]
    for _ in range(10):
        if jobq.get(engine, poison).state == "failed":  # type: ignore[union-attr]
            break
        p = start(db_url, tmp_path, "--concurrency", "1", "--until-idle", "30")
        p.wait(60)
    info = jobq.get(engine, poison)
    assert info is not None and info.state == "failed" and info.attempts == 3
    assert "lease expired on attempt 3 of 3" in (info.error or "")
    assert executions(tmp_path)[poison] == 3
    _drain_cleanly(db_url, tmp_path)
    assert {jobq.get(engine, j).state for j in others} == {"done"}  # type: ignore[union-attr]


def test_sigterm_releases_unfinished_jobs_at_once(engine: sa.Engine, db_url: str, tmp_path: pathlib.Path) -> None:
    """SIGTERM: stop claiming, give handlers the grace period, then release what is unfinished
    to ready at once (not after the 30 s lease), without charging an attempt. A bug shows as
    the slow job still leased (waiting out its lease), an attempt charged, or a process that
    waits the slow job out instead of exiting 0 after the grace period."""
    quick = jobq.enqueue(engine, "work", {"sleep": 0.2})
    slow = jobq.enqueue(engine, "work", {"sleep": 60})
    waiting = jobq.enqueue(engine, "work", {"sleep": 0.01})
    p = start(db_url, tmp_path, "--concurrency", "2", "--ttl", "30", "--shutdown-timeout", "5.0")
    try:
        wait_file(tmp_path / f"started-{quick}-1")
        wait_file(tmp_path / f"started-{slow}-1")
        p.send_signal(signal.SIGTERM)
        # The slow job sleeps 60 s: a worker that waited it out instead of giving up after the
        # 5 s grace is still running at 50 s. No tighter bound: a slow machine is no fault.
        assert p.wait(50) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    q, s = jobq.get(engine, quick), jobq.get(engine, slow)
    assert q is not None and s is not None
    assert q.state == "done"  # finished within the grace period
    assert (s.state, s.attempts, s.lease_owner, s.in_flight) == ("ready", 0, None, False)
    w = jobq.get(engine, waiting)
    assert w is not None and w.state in ("ready", "done")  # may have run before the signal
    assert ("released", slow) in events(tmp_path)


def test_the_process_executor_kills_a_stuck_handler(engine: sa.Engine, db_url: str, tmp_path: pathlib.Path) -> None:
    """With executor="process", a dispatch past its timeout is SIGKILLed, retried, and its slot
    is free as soon as the process is gone. A bug shows as a run that waits out the 60 s
    handler, or a slot row left behind that keeps counting against the cap."""
    jid = jobq.enqueue(engine, "work", {"sleep": 60}, timeout=0.5, max_attempts=1)
    p = start(db_url, tmp_path, "--concurrency", "1", "--executor", "process", "--until-idle", "30")
    assert p.wait(60) == 0, (tmp_path / "stderr.log").read_text()[-2000:]
    info = jobq.get(engine, jid)
    assert info is not None and info.state == "failed" and "timed out" in (info.error or "")
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(SLOTS).where(SLOTS.c.job_id == jid)).scalar_one() == 0
    assert ("timed_out", jid) in events(tmp_path)

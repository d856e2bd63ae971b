"""The worker machine's wall clock jumps an hour, forward or back, while jobs run.

jobq takes every time it stores or compares from the database (carried forward on the
monotonic clock between readings), so a jump of this machine's wall clock must change
nothing on a server: no lease expires early, none is written an hour long. time-machine moves
time.time and datetime.now in every thread of this process; the monotonic clock keeps going.
"""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
import sqlalchemy as sa
import time_machine

import jobq
from dbs import needs
from helpers import REPORT, db_now, wait_for

# Heartbeats every 0.3 s keep leases of TTL alive: a heartbeat stalled for TTL - 0.3 s on a loaded
# machine looks like the early expiry this file tests for, so TTL is not made shorter than this.
TTL = 4.0


def _run(engine: sa.Engine, hours: int) -> dict:
    """Worker A runs J1; the wall clock jumps ``hours``; then worker B starts (its clock first
    read after the jump), J2 is enqueued, and B ticks for longer than the lease TTL. Returns
    what a checker needs: J1's executions, J2's lease against the database's now, and the end
    states."""
    release = threading.Event()
    runs: list[tuple[str, int, int]] = []
    lock = threading.Lock()

    def handler(name: str):
        def run(ctx: jobq.JobContext) -> dict:
            with lock:
                runs.append((name, ctx.id, ctx.attempt))
            release.wait(60)
            return {"by": name}

        return run

    j1 = jobq.enqueue(engine, "long", max_attempts=3)
    # max_concurrency is a cap across workers: room for J1 and J2. J2's type is B's alone.
    opts = dict(max_concurrency=2, lease_ttl=TTL, heartbeat_interval=0.3, poll_interval=0.02)
    a = jobq.Worker(engine, {"long": handler("A")}, **opts)
    done: list[bool] = []
    ta = threading.Thread(target=lambda: done.append(a.run_until_idle(timeout=60)))
    ta.start()
    out: dict = {}
    try:
        wait_for(lambda: runs, timeout=10, what="worker A to start J1")
        with time_machine.travel(dt.datetime.now(dt.UTC) + dt.timedelta(hours=hours), tick=True):
            b = jobq.Worker(engine, {"long": handler("B"), "probe": handler("B")}, **opts)
            j2 = jobq.enqueue(engine, "probe", max_attempts=3)
            # B's deadline ends the broken variant's run, where J2 is postponed by the jump.
            tb = threading.Thread(target=lambda: done.append(b.run_until_idle(timeout=TTL * 1.5 + 6)))
            tb.start()
            time.sleep(TTL * 1.5)  # past J1's lease, had A's heartbeats not counted
            with engine.connect() as conn:
                expires = conn.execute(sa.select(jobq.Job.lease_expires).where(jobq.Job.id == j2)).scalar_one()
            now = db_now(engine)
            out["j2_lease_left"] = None if expires is None else (expires - now).total_seconds()
            out["j1_runs"] = sum(1 for _, i, _ in runs if i == j1)
            release.set()
            ta.join(30)
            tb.join(30)
    finally:
        release.set()
        ta.join(30)
    out["finished"] = done
    out["states"] = [(jobq.get(engine, j).state, jobq.get(engine, j).attempts) for j in (j1, j2)]
    return out


def _violations(o: dict) -> list[str]:
    bad = []
    if o["j1_runs"] != 1:
        bad.append(f"J1 ran {o['j1_runs']} times: its lease expired early")
    left = o["j2_lease_left"]
    if left is None or not 0 < left <= TTL + 1.0:
        bad.append(f"J2's lease ends {left} s from the database's now, not within (0, {TTL + 1.0}]")
    return bad


@pytest.mark.parametrize("hours", [1, -1], ids=["forward", "back"])
def test_a_wall_clock_jump_neither_expires_nor_stretches_a_lease(engine: sa.Engine, dialect: str, hours: int) -> None:
    """Servers: A's job is not reclaimed by B (one execution), and the lease B writes for J2
    ends within the TTL of the database's now, after a jump either way.
    SQLite: a jump of the machine's clock is a jump of the database's clock, seen by every
    process at once. Back: nothing expires early either. Forward: the database's time passed
    A's lease, so B may re-run J1; what must still hold is one completion (A's late finalize
    is fenced). A worker on the machine's clock shows as J1 run twice (forward) or J2's lease
    outside (0, TTL + 1] of the database's now (back): the test below runs that variant."""
    o = _run(engine, hours)
    bad = _violations(o)
    REPORT.append(f"wall clock {hours:+d} h {dialect}: J1 runs {o['j1_runs']}, "
                  f"J2 lease left {o['j2_lease_left']} s, states {o['states']}")
    assert o["finished"] == [True, True]
    if dialect != "sqlite" or hours < 0:
        assert bad == []
        assert o["states"] == [("done", 1), ("done", 1)]
    else:
        assert o["j1_runs"] <= 2
        assert [s for s, _ in o["states"]] == ["done", "done"]


@needs(no="local_clock")  # where the database's clock is the machine's there is nothing to catch
@pytest.mark.parametrize("hours", [1, -1], ids=["forward", "back"])
def test_harness_catches_a_worker_on_the_machines_clock(engine: sa.Engine, dialect: str, hours: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """BROKEN: jobq reading this machine's clock instead of the database's. Forward, B sees
    A's live lease as expired and re-runs J1; back, B's fresh lease on J2 is expired on
    arrival (A reclaims it and postpones J2 by the jump). The checker must see either."""
    monkeypatch.setattr(jobq._Dialect, "db_now", lambda self, conn, **kw: jobq._utcnow())
    o = _run(engine, hours)
    REPORT.append(f"wall clock {hours:+d} h {dialect} (BROKEN machine clock): J1 runs {o['j1_runs']}, "
                  f"J2 lease left {o['j2_lease_left']} s, states {o['states']}")
    assert _violations(o), "the checker did not catch a worker on the machine's clock"

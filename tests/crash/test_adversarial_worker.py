"""A handler that outlives its lease, in a real worker process stopped and resumed with real
signals: its slot stays counted against the global cap until it returns (issue 20)."""

from __future__ import annotations

import datetime as dt
import pathlib
import signal
import time

import sqlalchemy as sa

import jobq
from helpers import db_now, wait_for
from procs import events, start, wait_file

SLEEP = 4.0  # the handler's non-cooperative run time (time.sleep, which never returns early)


def test_a_handler_that_lost_its_lease_keeps_its_slot_until_it_returns(engine: sa.Engine, db_url: str,
                                                                       tmp_path: pathlib.Path) -> None:
    """Worker process A runs a handler that ignores ``ctx.stop_requested``. A is SIGSTOPped
    past its lease, the job is reclaimed, and A is resumed: A's heartbeat learns the lease is
    lost while its handler keeps running. Worker B (global cap 1) must not start any job (here
    one of its own type) until A's handler has returned. A's handler started no later than its marker file and
    sleeps SLEEP seconds, so B starting before marker + SLEEP proves two handlers ran at once
    (the bug: only timed-out threads held a slot; a lease lost any other way freed it)."""
    jid = jobq.enqueue(engine, "work", {"sleep": SLEEP}, max_attempts=5)
    a = start(db_url, tmp_path, "--concurrency", "1", "--ttl", "1.0")
    try:
        marker = tmp_path / f"started-{jid}-1"
        wait_file(marker)
        a_started = marker.stat().st_mtime
        a.send_signal(signal.SIGSTOP)
        wait_for(lambda: jobq.get(engine, jid).lease_expires < db_now(engine).replace(tzinfo=dt.timezone.utc), timeout=10, what="A's lease to expire")
        assert jobq.reclaim(engine) == 1
        a.send_signal(signal.SIGCONT)
        wait_for(lambda: ("lease_lost", jid) in events(tmp_path), timeout=10, what="A to learn it lost the lease")
        assert time.time() < a_started + SLEEP, "A's handler ended before the test could check: nothing proven"
        b_started: list[float] = []

        def b_handler(ctx: jobq.JobContext) -> dict:
            b_started.append(time.time())
            return {"by": "B"}

        k = jobq.enqueue(engine, "quick")
        b = jobq.Worker(engine, {"quick": b_handler}, max_concurrency=1, lease_ttl=5.0, poll_interval=0.02)
        assert b.run_until_idle(timeout=40)
        assert len(b_started) == 1
        assert b_started[0] >= a_started + SLEEP, (
            f"B started {a_started + SLEEP - b_started[0]:.2f}s before A's lease-lost handler could have returned")
        info = jobq.get(engine, k)
        assert info is not None and info.state == "done" and info.result == {"by": "B"}
    finally:
        a.send_signal(signal.SIGCONT)
        a.kill()
        a.wait(10)

"""A handler that outlives its lease, in a real worker process stopped and resumed with real
signals: its slot stays counted against the global cap until it returns (issue 20)."""

from __future__ import annotations

import datetime as dt
import pathlib
import signal

import sqlalchemy as sa

import jobq
from helpers import db_now, wait_for
from procs import events, start, wait_file


def test_a_handler_that_lost_its_lease_keeps_its_slot_until_it_returns(engine: sa.Engine, db_url: str,
                                                                       tmp_path: pathlib.Path) -> None:
    """Worker process A runs a handler that ignores ``ctx.stop_requested`` and runs until the
    test opens its gate. A is SIGSTOPped past its lease, the job is reclaimed, and A is
    resumed: A's heartbeat learns the lease is lost while its handler keeps running. Worker B
    (global cap 1) must not start any job (here one of its own type) until A's handler has
    returned: B's ticks start nothing while the gate is shut, and B's handler, once it runs,
    finds A's returning marker (the bug: only timed-out threads held a slot; a lease lost any
    other way freed it)."""
    gate = tmp_path / "gate"
    jid = jobq.enqueue(engine, "work", {"gate": str(gate)}, max_attempts=5)
    # A's lease, and the slot A holds for its handler once the lease is lost, are renewed by
    # heartbeats every ttl/3: 3 s, so that a stall of A during B's ticks cannot let the slot lapse.
    a = start(db_url, tmp_path, "--concurrency", "1", "--ttl", "3.0")
    try:
        wait_file(tmp_path / f"started-{jid}-1")
        a.send_signal(signal.SIGSTOP)
        wait_for(lambda: jobq.get(engine, jid).lease_expires < db_now(engine).replace(tzinfo=dt.UTC), timeout=30, what="A's lease to expire")
        assert jobq.reclaim(engine) == 1
        a.send_signal(signal.SIGCONT)
        wait_for(lambda: ("lease_lost", jid) in events(tmp_path), timeout=30, what="A to learn it lost the lease")
        returned = tmp_path / f"returning-{jid}-1"
        b_saw: list[bool] = []

        def b_handler(ctx: jobq.JobContext) -> dict:
            b_saw.append(returned.exists())
            return {"by": "B"}

        k = jobq.enqueue(engine, "quick")
        b = jobq.Worker(engine, {"quick": b_handler}, max_concurrency=1, lease_ttl=30, poll_interval=0.02)
        for _ in range(5):
            assert b.tick() == 0, "B started a job while A's lease-lost handler still ran"
        gate.touch()
        assert b.run_until_idle(timeout=60)
        assert b_saw == [True], "B's job ran before A's lease-lost handler returned"
        info = jobq.get(engine, k)
        assert info is not None and info.state == "done" and info.result == {"by": "B"}
    finally:
        gate.touch()
        a.send_signal(signal.SIGCONT)
        a.kill()
        a.wait(10)

"""Stuck-but-alive handlers: the dispatch timeout fires, the late result is dropped, and the
slot stays counted against the global cap until the abandoned thread really returns."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa

import jobq
from helpers import wait_for


@pytest.mark.parametrize("hold_slots", [True, False], ids=["correct", "BROKEN-no-held-slot"])
def test_an_abandoned_thread_keeps_its_slot_until_it_returns(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, hold_slots: bool) -> None:
    """Cap 1. Worker A's handler hangs past its timeout: the job is released for retry and its
    result will be dropped, but the thread cannot be killed, so the slot must stay counted:
    worker B may not start anything until A's thread returns. The broken variant (no held
    slot) lets B start a second job while A's thread still runs: the test sees the overlap."""
    if not hold_slots:
        monkeypatch.setattr(jobq, "_hold_slots", lambda *a, **k: None)
    unstick = threading.Event()
    running = threading.Event()

    def stuck(ctx: jobq.JobContext) -> dict:
        running.set()
        unstick.wait(60)  # ignores ctx.stop_requested, like a hung network call
        return {"late": True}

    jid = jobq.enqueue(engine, "stuck", timeout=0.3, max_attempts=2)
    # Ticked by hand (no heartbeats): leases long enough that no stall lets one expire, so the
    # job is released by its timeout, not reclaimed.
    a = jobq.Worker(engine, {"stuck": stuck}, max_concurrency=1, poll_interval=0.02, lease_ttl=60.0,
                    retry_backoff=lambda attempt: 3600.0)
    b = jobq.Worker(engine, {"quick": lambda ctx: {"ok": True}}, max_concurrency=1, poll_interval=0.02, lease_ttl=60.0)
    try:
        assert a.tick() == 1 and running.wait(30)
        wait_for(lambda: (a.tick(), jobq.get(engine, jid).state == "ready")[1], timeout=10, what="the timeout")
        info = jobq.get(engine, jid)
        assert info is not None and "timed out" in (info.error or "") and info.attempts == 1
        other = jobq.enqueue(engine, "quick")
        started_while_stuck = b.tick()
        if hold_slots:
            assert started_while_stuck == 0, "B started a job while A's abandoned thread held the only slot"
        else:
            assert started_while_stuck == 1  # the harness catches the overspent cap
            return
        unstick.set()
        wait_for(lambda: (a.tick(), a._busy == 0 and not a._abandoned)[1], timeout=10, what="A's thread to return")
        assert b.run_until_idle(timeout=30)
        assert jobq.get(engine, other).state == "done"  # type: ignore[union-attr]
        late = jobq.get(engine, jid)
        assert late is not None and late.result is None and late.state == "ready"  # the late result was dropped
    finally:
        unstick.set()

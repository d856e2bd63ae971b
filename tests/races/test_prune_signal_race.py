"""prune of a signal's key against a signal() of that key (issue 42).

The key "k" has an old row that nobody can still receive (sent long ago; prune runs with its
clock two hours on). prune reads it, locks it and deletes it; a new ``signal("k", "new")``
arrives while prune holds the lock ("prune_signals_locked"), on its own connection, and
waits for it. Correct: once prune commits, the signal finds no row to lock, makes the key's
row anew and records "new" (returns True); a job that then waits for "k" reads "new". A
signal that trusted its first lock would find nothing and fail (PostgreSQL: the insert saw
the old row, the lock finds none), losing a webhook that came in at the wrong moment.
On MySQL/MariaDB the signal's insert itself waits for the delete and then succeeds; on SQLite
prune's transaction holds the write lock, so the signal runs wholly after it. The broken
variant is shown where the window exists for it (PostgreSQL)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
import sqlalchemy as sa
from test_signal_races import _Signaller

import jobq
from dbs import needs, only
from harness import SUMMARY
from helpers import FAST, TABLES, db_now

SIGNALS = TABLES["jobq_signals"]


def _race(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    assert jobq.signal(engine, "k", "old")
    sig = _Signaller(engine, "k", "new")
    seen: dict[str, Any] = {}

    def checkpoint(name: str, ids: Any = ()) -> None:
        if name == "prune_signals_locked" and "k" in list(ids) and sig.thread.ident is None:
            seen["locked"] = list(ids)
            sig.fire()

    monkeypatch.setattr(jobq, "_checkpoint", checkpoint)
    try:
        jobq.prune(engine, dt.timedelta(hours=1), now=db_now(engine) + dt.timedelta(hours=2))
    finally:
        sig.close()
    monkeypatch.undo()
    with engine.connect() as conn:
        row = conn.execute(sa.select(SIGNALS.c.payload, SIGNALS.c.sent_at).where(SIGNALS.c.key == "k")).first()
    job = jobq.enqueue(engine, "t", {})
    jobq.Worker(engine, {"t": lambda ctx: {"got": ctx.wait_for("k", timeout=3600)}}, max_concurrency=1,
                **FAST).run_until_idle(timeout=60)
    info = jobq.get(engine, job)
    return {"sent": sig.out.get("sent"), "waited": sig.out.get("waited"), "locked": seen.get("locked"),
            "row": None if row is None else (row.payload, row.sent_at is not None),
            "result": info.result if info is not None else None}


def _lost(r: dict[str, Any]) -> list[str]:
    bad = []
    if r["sent"] is not True:
        bad.append(f"the new signal was not recorded: {r['sent']!r}")
    if r["row"] != ("new", True):
        bad.append(f"the key's row is {r['row']!r}")
    if r["result"] != {"got": "new"}:
        bad.append(f"a job waiting for the key read {r['result']!r}")
    return bad


@needs("row_locks")  # SQLite: the signal cannot run inside prune's transaction
def test_a_signal_during_prune_of_its_key_is_recorded(engine: sa.Engine, dialect: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    r = _race(engine, monkeypatch)
    SUMMARY.append({"engine": dialect, "check": "signal vs prune of its key"})
    assert r["locked"] == ["k"] and r["waited"] is True, r
    assert _lost(r) == []


def _lock_once(conn: sa.Connection, d: Any, key: str, now: Any) -> Any:
    """BROKEN: trusts that the key's row it made (or found) is still there to lock."""
    d.insert_signal_key(conn, key, now)
    return conn.execute(jobq._q_lock_signal(d, key)).one()


@only("postgresql")  # the insert sees the old row and only the lock finds it gone (MySQL's insert waits instead)
def test_harness_catches_a_signal_that_trusts_its_first_lock(engine: sa.Engine, dialect: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobq, "_lock_key", _lock_once)
    r = _race(engine, monkeypatch)
    SUMMARY.append({"engine": dialect, "check": "broken signal that locks once, vs prune", "caught": True})
    assert _lost(r) != [], r

"""A unique-key enqueue from outside racing a running dispatch's spawn of the same key.

Dispatch A (a claimed job, its lease live) spawns X with ``unique_key="k"`` as ctx.enqueue
does (a transaction of its own; X is ``held`` under A's lease until A's result commits, and
deleted if A fails), while an outsider calls ``enqueue(unique_key="k")``. Correct, however the
two interleave (docs/guides/long-running.md, "Unique jobs"): the spawn gets a job id, never an error; the outsider
either gets ``UniqueKeyHeld`` naming X and A (the key is another dispatch's held spawn) and,
retrying once A's result has committed, gets the released X (or a new job if A failed and X
was deleted), or it got there first and A's spawn is handed the outsider's job. Afterwards
exactly one job holds the key, the outsider's id names it, and the work each side wired to the
id it got runs: nothing waits on a job that vanished, nothing is left held.

The interleavings are held open at the "unique_keys_read" checkpoint (``jobq._checkpoint``:
the keys looked up, before the insert, inside the transaction): there the other side runs on
its own connection until it has returned or the server says it waits for a lock (on the
unique index, for the first side's uncommitted insert, or on MySQL/MariaDB's lock of the gap
the lookup read): no sleeps, no timing. On SQLite both are writers under BEGIN IMMEDIATE, so
the other side runs wholly after the first commits, and no insert is ever lost there. On the
servers an insert is lost (the key committed by the other side after this side's lookup), and
that side must look again: it then finds the other's job (handed back, or refused if held).
"""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
from dbs import needs, wipe
from helpers import INNODB_TRX_POLL, backend_id, db_now, wait_for, waits_for_a_row_lock

jobs = jobq.Job.__table__
c = jobs.c

ORDERS = ["spawn_first", "outsider_first", "outsider_inside_spawn", "spawn_inside_outsider"]


def _attempt(out: dict[str, Any], side: str, call: Any) -> None:
    try:
        out[side] = call()
    except Exception as exc:  # recorded: the checks say which errors a side may see
        out[side] = exc


def _race(engine: sa.Engine, order: str, spawner_ends: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A spawns "k" and the outsider enqueues "k" in ``order``; each wires a job to the id it
    got (A's spawn of Z depending on it, the outsider's Y depending on it); A's result then
    commits (``spawner_ends``: "done" releases its spawns, "failed" discards them); a refused
    outsider retries; a worker drains the queue. Returns what each side got and the table."""
    a = jobq.enqueue(engine, "a", max_attempts=1)
    [lease] = jobq.claim_batch(engine, "w", 600, limit=1)
    assert lease.id == a
    out: dict[str, Any] = {"a": a}
    keyed = jobq._plan([{"type": "leaf", "unique_key": "k"}], single=True)

    def spawn(eng: sa.Engine) -> None:
        _attempt(out, "spawn", lambda: jobq._spawn(eng, keyed, jobq._Hold(a, lease.token, frozenset()))[jobq._ONE])

    def outsider(eng: sa.Engine) -> None:
        _attempt(out, "outsider", lambda: jobq.enqueue(eng, "leaf", unique_key="k"))

    first, second = (spawn, outsider) if order in ("spawn_first", "outsider_inside_spawn") else (outsider, spawn)
    inner_side = "outsider" if second is outsider else "spawn"
    ieng = sa.create_engine(engine.url, pool_size=1, max_overflow=0)  # the inner side's one connection
    jobq._prepare(ieng)
    with ieng.connect() as conn:
        backend = backend_id(conn) if engine.dialect.name != "sqlite" else 0
        conn.rollback()
    inner = threading.Thread(target=second, args=(ieng,))

    def checkpoint(point: str, job_ids: Any = ()) -> None:
        if point != "unique_keys_read" or inner.ident is not None or threading.current_thread() is inner:
            return
        out["first_saw"] = list(job_ids)
        inner.start()
        if engine.dialect.name != "sqlite":  # SQLite: the inner side waits for this write lock
            out["inner_waited"] = wait_for(
                lambda: "waits" if waits_for_a_row_lock(engine, backend) else "returned" if inner_side in out else None,
                timeout=30, interval=INNODB_TRX_POLL, what=f"the {inner_side} to return or wait for a lock",
            ) == "waits"

    try:
        if order.endswith("_first"):
            first(engine)
            second(engine)
        else:
            real = jobq._checkpoint
            monkeypatch.setattr(jobq, "_checkpoint", checkpoint)
            try:
                first(engine)
            finally:
                monkeypatch.setattr(jobq, "_checkpoint", real)  # the retry and the worker run unhooked
            inner.join(60)
            assert not inner.is_alive(), f"the {inner_side} never returned"
    finally:
        ieng.dispose()
    got = out["spawn"]
    if isinstance(got, int):  # A wires work to what it got, as the worker lets it (its own spawns)
        _attempt(out, "z", lambda: jobq._spawn(engine, jobq._plan([{"type": "leaf", "depends_on": [got]}], single=True),
                                               jobq._Hold(a, lease.token, frozenset([got])))[jobq._ONE])
    if isinstance(out["outsider"], int):
        _attempt(out, "y", lambda: jobq.enqueue(engine, "leaf", depends_on=[out["outsider"]]))

    def finish(conn: sa.Connection, d: Any) -> list[str | None]:
        o = jobq._Outcome(a, "w", lease.token, spawner_ends, error="A fails" if spawner_ends == "failed" else None,
                          spawned=True)
        return jobq._apply_outcomes(conn, d, [o], d.db_now(conn))

    assert jobq._transaction(engine, finish) == [spawner_ends]
    if isinstance(out["outsider"], jobq.UniqueKeyHeld):  # "retry later": A's result has committed
        _attempt(out, "retried", lambda: jobq.enqueue(engine, "leaf", unique_key="k"))
        if isinstance(out["retried"], int):
            _attempt(out, "y", lambda: jobq.enqueue(engine, "leaf", depends_on=[out["retried"]]))
    w = jobq.Worker(engine, {"leaf": lambda ctx: None}, max_concurrency=2, poll_interval=0.02, lease_ttl=30.0,
                    retry_backoff=lambda n: 0.0)
    out["drained"] = w.run_until_idle(timeout=60)
    with engine.connect() as conn:
        out["rows"] = {r.id: r for r in conn.execute(sa.select(jobs))}
    out["reclaimed"] = jobq.reclaim(engine)
    return out


def _broken_promises(r: dict[str, Any], spawner_ends: str) -> list[str]:
    """What a user would see go wrong (empty: every promise kept)."""
    bad: list[str] = []
    rows, a, spawn, outsider = r["rows"], r["a"], r["spawn"], r["outsider"]
    if not isinstance(spawn, int):
        bad.append(f"A's spawn raised {spawn!r} instead of returning a job id")
    if isinstance(outsider, jobq.UniqueKeyHeld):
        if (outsider.key, outsider.spawned_by) != ("k", a) or outsider.job_id != spawn:
            bad.append(f"UniqueKeyHeld names {(outsider.key, outsider.job_id, outsider.spawned_by)}, not ('k', {spawn}, {a})")
        final = r.get("retried")
        if spawner_ends == "done" and final != spawn:
            bad.append(f"the retry after A's result got {final!r}, not the released job {spawn}")
    elif isinstance(outsider, int):
        final = outsider
        if isinstance(spawn, int) and spawn != outsider:
            bad.append(f"the outsider got job {outsider} and A's spawn got another, {spawn}")
    else:
        final = None
        bad.append(f"the outsider's enqueue raised {outsider!r}")
    keyed = [i for i, row in rows.items() if row.unique_key == "k"]
    if len(keyed) != 1:
        bad.append(f"{len(keyed)} jobs with the key: {keyed}")
    elif final != keyed[0]:
        bad.append(f"the outsider holds id {final!r}, but the key's job is {keyed[0]}")
    for side in ("y", "z"):
        if side in r and not isinstance(r[side], int):
            bad.append(f"wiring {side} to the id it got raised {r[side]!r}")
    if isinstance(r.get("y"), int) and (r["y"] not in rows or rows[r["y"]].state != "done"):
        bad.append(f"the outsider's dependent {r['y']} is {rows[r['y']].state if r['y'] in rows else 'gone'}")
    left = {i: row.state for i, row in rows.items() if i != a and row.state != "done"}
    if left or not r["drained"] or r["reclaimed"]:
        bad.append(f"jobs not done: {left} (drained: {r['drained']}, reclaimed {r['reclaimed']})")
    return bad


@pytest.mark.parametrize("spawner_ends", ["done", "failed"])
@pytest.mark.parametrize("order", ORDERS)
def test_a_unique_key_enqueue_racing_a_spawn_of_the_key_gets_one_job_or_a_clear_refusal(
        engine: sa.Engine, order: str, spawner_ends: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every interleaving of the outsider's enqueue and A's spawn (sequential either way, and
    each side's insert run inside the other's window), with A's result done or failed: every
    promise in the module docstring holds."""
    r = _race(engine, order, spawner_ends, monkeypatch)
    bad = _broken_promises(r, spawner_ends)
    assert bad == [], (bad, {k: v for k, v in r.items() if k != "rows"})


def _no_refusal(conn: Any, plan: Any, holders: Any, own: Any) -> None:
    return None


def test_the_check_catches_an_outsider_handed_a_held_job(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """BROKEN variant: no refusal of another dispatch's held spawn (the hole of issue 39's items
    1-3). The outsider is handed X while A runs; its dependent is refused (X is held) and, A
    failing, X is deleted: the outsider holds the id of a job that no longer exists, and no job
    holds the key."""
    monkeypatch.setattr(jobq, "_refuse_unborn_holders", _no_refusal)
    r = _race(engine, "spawn_first", "failed", monkeypatch)
    assert r["outsider"] == r["spawn"]
    bad = _broken_promises(r, "failed")
    assert any("0 jobs with the key" in b for b in bad) and any("wiring y" in b for b in bad), bad


@needs("row_locks")  # on SQLite, BEGIN IMMEDIATE: the second lookup sees the first insert
def test_the_check_catches_an_insert_that_does_not_look_again_when_its_key_was_taken(
        engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """BROKEN variant: a spawn or enqueue that gives up when the key it looked up as free was
    committed by the other side before its insert (no second lookup), as ctx.enqueue did. The
    side whose insert loses raises instead of returning the holder (or refusing it)."""
    monkeypatch.setattr(jobq, "_KEY_RERUNS", 1)
    caught = []
    for order in ("outsider_inside_spawn", "spawn_inside_outsider"):
        wipe(engine)
        r = _race(engine, order, "done", monkeypatch)
        bad = _broken_promises(r, "done")
        if any("raised" in b for b in bad):
            caught.append((order, bad))
    assert caught, "the lost insert was never caught"


def _spawner(ctx: jobq.JobContext) -> dict[str, Any]:
    """ctx.enqueue of the key; then a job depending on whatever id it got. The keyed job is due
    only later: run to done before the outsider's enqueue (on SQLite the outsider is not waited
    for), it would free the key and the outsider would rightly make a second job."""
    try:
        got = ctx.enqueue("leaf", unique_key="k", run_after=dt.timedelta(hours=1))
    except Exception as exc:
        return {"raised": repr(exc)}
    return {"got": got, "z": ctx.enqueue("leaf", depends_on=[got])}


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_handlers_spawn_that_loses_its_key_to_an_outsider_gets_the_outsiders_job(
        engine: sa.Engine, executor: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a Worker: the handler's ctx.enqueue(unique_key="k") has looked the key up (free)
    when an outsider's enqueue of "k" commits (on SQLite: runs right after the spawn's
    transaction). Correct: the handler gets a job id, the outsider's on the servers (its own
    spawn, released, on SQLite, where the outsider is refused, or handed that job if A's result
    released it first), and its dependent runs after
    it; one job holds the key. The bug: the handler's ctx.enqueue raises (jobq's internal
    _KeyTaken). The outsider's job is due only later, so it still holds the key when the
    spawn looks again."""
    a = jobq.enqueue(engine, "a", max_attempts=1)
    oeng = sa.create_engine(engine.url, pool_size=1, max_overflow=0)  # the outsider's one connection
    jobq._prepare(oeng)
    with oeng.connect() as conn:
        backend = backend_id(conn) if engine.dialect.name != "sqlite" else 0
        conn.rollback()
    out: dict[str, Any] = {}
    # Due in an hour: the worker cannot run it to done (freeing the key) before the spawn looks again.
    later = dt.timedelta(hours=1)
    outsider = threading.Thread(target=_attempt, args=(out, "outsider", lambda: jobq.enqueue(
        oeng, "leaf", unique_key="k", run_after=later)))

    def checkpoint(point: str, job_ids: Any = ()) -> None:
        if point != "unique_keys_read" or outsider.ident is not None or threading.current_thread() is outsider:
            return
        outsider.start()
        if engine.dialect.name != "sqlite":
            wait_for(lambda: "outsider" in out or waits_for_a_row_lock(engine, backend), timeout=30,
                     interval=INNODB_TRX_POLL, what="the outsider to return or wait for a lock")

    monkeypatch.setattr(jobq, "_checkpoint", checkpoint)
    w = jobq.Worker(engine, {"a": _spawner, "leaf": lambda ctx: None}, max_concurrency=2, executor=executor,
                    poll_interval=0.02, lease_ttl=30.0, retry_backoff=lambda n: 0.0)
    try:
        assert w.run_until_idle(timeout=60)
    finally:
        if outsider.ident is not None:
            outsider.join(60)
        oeng.dispose()
    monkeypatch.setattr(jobq, "_checkpoint", lambda point, job_ids=(): None)
    with engine.begin() as conn:  # the outsider's job is due now
        conn.execute(sa.update(jobs).where(c.run_after > db_now(engine)).values(run_after=db_now(engine)))
    assert w.run_until_idle(timeout=60)
    with engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(sa.select(jobs))}
    result = rows[a].result
    assert rows[a].state == "done" and "got" in result, result
    keyed = [i for i, r in rows.items() if r.unique_key == "k"]
    assert keyed == [result["got"]]
    if engine.dialect.name == "sqlite":
        # The outsider waited for the spawn's write lock, so it ran after the spawn committed:
        # refused while the spawn was still held, or, if A's result had released it by the time
        # the outsider's thread got the lock, handed that job. Never a second job (keyed above).
        o = out["outsider"]
        assert (isinstance(o, jobq.UniqueKeyHeld) and o.job_id == result["got"]) or o == result["got"], o
    else:
        assert out["outsider"] == result["got"]
    assert {r.state for r in rows.values()} == {"done"}
    assert rows[result["z"]].started_at >= rows[result["got"]].finished_at

"""Held spawns that other work names (issue 39, items 1-4): unique keys and cancel.

A job spawned by a running handler is ``held``: it exists only if its spawner's result commits,
and is deleted if the spawner fails. So nothing outside that dispatch may name it. A unique-key
hit on another dispatch's held job is refused at once with ``UniqueKeyHeld`` (key, holder,
spawner), the same way by ``ctx.enqueue``/``ctx.submit``, ``enqueue`` and ``submit``; once the
spawner's result commits, the key names the released job as for any unfinished holder.
Correct: no job ever waits on, or sits in, a job that was deleted, and every reclaim keeps
working. A bug shows a job waiting forever on a vanished upstream (SQLite, MySQL: also a
dangling ``parent_id``), or, on PostgreSQL and MariaDB, a foreign-key error in the failed
spawner's write and then in every reclaim, which wedges the whole queue.

``cancel`` of a held job records the request; the release applies it: the job ends
cancelled and never runs. A bug shows it running to ``done`` after ``cancel`` answered.
Each test runs on every engine.
"""

from __future__ import annotations

import asyncio
import threading
import time
import types
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
from dbs import needs
from helpers import INNODB_TRX_POLL, backend_id, expire_leases, snapshot, wait_for, waits_for_a_row_lock

jobs = jobq.Job.__table__


def _rows(engine: sa.Engine) -> dict[int, Any]:
    with engine.connect() as conn:
        return {r.id: r for r in conn.execute(sa.select(jobs))}


def _unfinished(engine: sa.Engine) -> dict[int, str]:
    return {i: r.state for i, r in _rows(engine).items() if r.state not in jobq.TERMINAL}


def _worker(engine: sa.Engine, handlers: dict[str, Any], **kw: Any) -> jobq.Worker:
    kw.setdefault("max_concurrency", 2)
    return jobq.Worker(engine, handlers, poll_interval=0.02, lease_ttl=30.0, retry_backoff=lambda a: 0.0, **kw)


# -- two dispatches through a Worker: A spawns the key, B names it ---------------------------------
# Module level and coordinated through the database, not through threading events: the process
# executor runs them in other processes (and pickles the error B sees back through its pipe).


def _poll(url: str, sql: str, what: str, timeout: float = 30.0) -> Any:
    eng = sa.create_engine(url)
    try:
        deadline = time.monotonic() + timeout
        while True:
            with eng.connect() as conn:
                value = conn.execute(sa.text(sql)).scalar()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.02)
    finally:
        eng.dispose()


def _spawner_a(ctx: jobq.JobContext) -> None:
    """Spawns the keyed job (a container with a child when B is to put work into it), waits
    until B has finished, then fails: its spawns go with it."""
    if ctx.args["into"] == "parent":
        ctx.submit([{"key": "x", "type": "box", "container": True, "unique_key": "k"},
                    {"key": "in", "type": "leaf", "parent": "x"}])
    else:
        ctx.enqueue("leaf", unique_key="k")
    _poll(ctx.args["url"], f"SELECT id FROM jobs WHERE id = {ctx.args['b']} AND state = 'done'", "B's result")
    raise RuntimeError("A fails after B finished")


def _namer_b(ctx: jobq.JobContext) -> dict[str, Any]:
    """Once A's keyed spawn is held, asks for the key itself. Refused: reports the error. Handed
    the held job (the bug): puts work on it, as the issue's B does."""
    _poll(ctx.args["url"], "SELECT id FROM jobs WHERE unique_key = 'k' AND state = 'held'", "A's held spawn")
    box = ctx.args["into"] == "parent"
    try:
        x = ctx.enqueue("box" if box else "leaf", unique_key="k", **({"container": True} if box else {}))
    except jobq.UniqueKeyHeld as exc:
        return {"refused": [type(exc).__name__, exc.key, exc.job_id, exc.spawned_by, str(exc)]}
    y = ctx.enqueue("leaf", **({"parent": x} if box else {"depends_on": [x]}))
    return {"got": x, "spawned": y}


def _leaf(ctx: jobq.JobContext) -> None:
    return None


def _run_a_and_b(engine: sa.Engine, url: str, into: str, **worker_kw: Any) -> tuple[int, int, dict[int, Any]]:
    b = jobq.enqueue(engine, "b", {"url": url, "into": into}, max_attempts=1)
    a = jobq.enqueue(engine, "a", {"url": url, "into": into, "b": b}, max_attempts=1)
    w = _worker(engine, {"a": _spawner_a, "b": _namer_b, "leaf": _leaf, "box": _leaf}, **worker_kw)
    assert w.run_until_idle(timeout=60), "the worker did not drain the queue"
    return a, b, _rows(engine)


@pytest.mark.parametrize("into", ["depends_on", "parent"])
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_spawn_naming_another_dispatchs_held_key_is_refused_and_nothing_is_left_hanging(
        db_url: str, engine: sa.Engine, into: str, executor: str) -> None:
    """Items 1 and 2. A spawns X with unique_key "k" (a container with a child for "parent");
    B's ctx.enqueue(unique_key="k") is refused with UniqueKeyHeld naming the key, X and A (the
    error crosses the process executor's pipe intact); then A fails and X is deleted. Correct:
    B ends done having spawned nothing, every job ends, no row names a vanished job. The bug:
    B is handed X, spawns Y on it (depends_on, or parent); A's failure then leaves Y waiting on
    nothing forever, or (PostgreSQL, MariaDB) cannot delete X under Y: the worker's write
    fails and the queue never drains."""
    a, b, rows = _run_a_and_b(engine, db_url, into, executor=executor)
    assert "refused" in rows[b].result, f"B was handed A's held job: {rows[b].result}"
    name, key, held_id, spawner, text = rows[b].result["refused"]
    assert (name, key, spawner) == ("UniqueKeyHeld", "k", a)
    assert held_id not in rows, "A's discarded spawn remains"
    assert "Retry later" in text and f"job {a}" in text
    assert (rows[a].state, rows[b].state) == ("failed", "done")
    assert sorted(rows) == sorted([a, b]), "a spawn outlived its failed spawner, or B spawned"
    assert jobq.reclaim(engine) == 0


def test_an_async_worker_spawn_naming_another_dispatchs_held_key_is_refused(db_url: str, engine: sa.Engine) -> None:
    """Item 1 in AsyncWorker: coroutine handlers spawn through the greenlet bridge. B's
    ctx.enqueue of A's held key raises UniqueKeyHeld inside the coroutine; A fails afterwards
    and nothing remains of it. The bug: B is handed X and its Y waits forever."""
    from sqlalchemy.ext.asyncio import create_async_engine

    from dbs import async_url

    seen: dict[str, Any] = {}
    spawned, b_done = asyncio.Event(), asyncio.Event()

    async def spawner_a(ctx: jobq.JobContext) -> None:
        seen["x"] = ctx.enqueue("leaf", unique_key="k")
        spawned.set()
        await asyncio.wait_for(b_done.wait(), 30)
        raise RuntimeError("A fails after B finished")

    async def namer_b(ctx: jobq.JobContext) -> None:
        try:
            await asyncio.wait_for(spawned.wait(), 30)
            try:
                x = ctx.enqueue("leaf", unique_key="k")
            except jobq.UniqueKeyHeld as exc:
                seen["refused"] = (exc.key, exc.job_id, exc.spawned_by)
                return
            seen["got"] = x
            ctx.enqueue("leaf", depends_on=[x])
        finally:
            b_done.set()

    async def leaf(ctx: jobq.JobContext) -> None:
        return None

    async def main() -> None:
        eng = create_async_engine(async_url(db_url))
        try:
            w = jobq.AsyncWorker(eng, {"a": spawner_a, "b": namer_b, "leaf": leaf}, max_concurrency=2,
                                 poll_interval=0.02, retry_backoff=lambda a: 0.0)
            assert await w.run_until_idle(timeout=60)
        finally:
            await eng.dispose()

    a = jobq.enqueue(engine, "a", max_attempts=1)
    b = jobq.enqueue(engine, "b", max_attempts=1)
    asyncio.run(main())
    assert seen.get("refused") == ("k", seen["x"], a), seen
    rows = _rows(engine)
    assert sorted(rows) == [a, b] and (rows[a].state, rows[b].state) == ("failed", "done")


# -- enqueue and submit from outside while a handler holds the key --------------------------------


def test_enqueue_and_submit_naming_a_held_key_are_refused_alike_and_wired_once_it_is_released(
        engine: sa.Engine) -> None:
    """Item 3. While a handler holds spawn X with key "page", enqueue(unique_key="page") and
    submit([page (key), index depending on page]) are refused with UniqueKeyHeld naming X and
    its spawner, wait-free, writing nothing; a submit whose items merely depend on X by id is
    refused as before (InvalidJob). Once the spawner's result commits, the same submit is
    accepted and wired to X: index runs after X. The bug: enqueue hands out X's id (which
    may never exist), and submit fails with a generic error about a job it never named."""
    spawned, go, page_go = threading.Event(), threading.Event(), threading.Event()
    ran: list[tuple[str, int]] = []
    seen: dict[str, int] = {}

    def spawner(ctx: jobq.JobContext) -> None:
        seen["x"] = ctx.enqueue("page", unique_key="page")
        spawned.set()
        assert go.wait(30)

    def page(ctx: jobq.JobContext) -> None:
        assert page_go.wait(30)  # unfinished until the second submit has named it
        ran.append(("page", ctx.id))

    items = [{"key": "p", "type": "page", "unique_key": "page"}, {"key": "i", "type": "index", "depends_on": ["p"]}]
    sid = jobq.enqueue(engine, "spawner")
    w = _worker(engine, {"spawner": spawner, "page": page, "index": lambda ctx: ran.append(("index", ctx.id))})
    t = threading.Thread(target=w.run_until_idle, kwargs={"timeout": 60})
    t.start()
    try:
        assert spawned.wait(30)
        before = snapshot(engine)
        for call in (lambda: jobq.enqueue(engine, "page", unique_key="page"), lambda: jobq.submit(engine, items),
                     lambda: jobq.submit(engine, [items[0]])):
            with pytest.raises(jobq.UniqueKeyHeld) as err:
                call()
            assert (err.value.key, err.value.job_id, err.value.spawned_by) == ("page", seen["x"], sid)
            assert isinstance(err.value, jobq.InvalidJob)
        with pytest.raises(jobq.InvalidJob, match=f"job {seen['x']} is held"):
            jobq.submit(engine, [{"key": "i", "type": "index", "depends_on": [seen["x"]]}])
        assert snapshot(engine) == before, "a refused call wrote something"
        go.set()
        wait_for(lambda: _rows(engine)[seen["x"]].state != "held", what="the release of the spawn")
        ids = jobq.submit(engine, items)
        assert ids["p"] == seen["x"]
    finally:
        go.set()
        page_go.set()
        t.join(60)
    assert w.run_until_idle(timeout=30)
    rows = _rows(engine)
    assert [n for n, _ in ran] == ["page", "index"] and ran[1][1] == ids["i"]
    assert rows[ids["i"]].started_at >= rows[seen["x"]].finished_at


def test_a_dispatch_may_name_its_own_held_key(engine: sa.Engine) -> None:
    """A handler that spawns the same key twice gets its own held job back the second time (it
    is its to name), and wires work to it; one job per key runs after the result commits."""
    def spawner(ctx: jobq.JobContext) -> dict[str, int]:
        x = ctx.enqueue("leaf", unique_key="k")
        again = ctx.submit([{"key": "p", "type": "leaf", "unique_key": "k"},
                            {"key": "i", "type": "leaf", "depends_on": ["p"]}])
        assert again["p"] == x
        return {"x": x, "i": again["i"]}

    sid = jobq.enqueue(engine, "spawner")
    assert _worker(engine, {"spawner": spawner, "leaf": _leaf}).run_until_idle(timeout=30)
    rows = _rows(engine)
    assert sorted(rows) == sorted([sid, *rows[sid].result.values()])
    assert {r.state for r in rows.values()} == {"done"}


# -- defence in depth: a held job that something outside names is closed, never deleted ----------


def _foreign_work_on_a_held_job(engine: sa.Engine) -> dict[str, Any]:
    """Dispatch A spawns container X (key "k", with a child); B, through a hole in the refusal,
    gets X by its key and spawns Y depending on X and Z inside X; B's result commits. Then A's
    lease expires and a reclaim discards A's spawns. Returns what happened: the reclaim's
    error, if any, the states and the jobs still unfinished."""
    a = jobq.enqueue(engine, "a", max_attempts=1)
    b = jobq.enqueue(engine, "b", max_attempts=1)
    la, lb = jobq.claim_batch(engine, "w", 30, limit=2)
    assert (la.id, lb.id) == (a, b)
    x = jobq._spawn(engine, jobq._plan([{"key": "x", "type": "box", "container": True, "unique_key": "k"},
                                        {"key": "in", "type": "leaf", "parent": "x"}], single=False),
                    jobq._Hold(a, la.token, frozenset()))
    hold_b = jobq._Hold(b, lb.token, frozenset())
    got = jobq._spawn(engine, jobq._plan([{"type": "box", "container": True, "unique_key": "k"}], single=True), hold_b)
    assert got[jobq._ONE] == x["x"]
    hold_b = jobq._Hold(b, lb.token, frozenset([x["x"]]))  # as the worker counted it: B's own
    yz = jobq._spawn(engine, jobq._plan([{"key": "y", "type": "leaf", "depends_on": [x["x"]]},
                                         {"key": "z", "type": "leaf", "parent": x["x"]}], single=False), hold_b)

    def finish_b(conn: sa.Connection, d: Any) -> list[str | None]:
        return jobq._apply_outcomes(conn, d, [jobq._Outcome(b, "w", lb.token, "done", spawned=True)], d.db_now(conn))

    assert jobq._transaction(engine, finish_b) == ["done"]
    expire_leases(engine, a)
    out: dict[str, Any] = {"x": x["x"], "y": yz["y"], "z": yz["z"], "error": None}
    try:
        jobq.reclaim(engine)
        jobq.reclaim(engine)  # the next claim's reclaim too
    except sa.exc.DBAPIError as exc:
        out["error"] = type(exc.orig).__name__
    out["unfinished"] = _unfinished(engine)
    out["rows"] = _rows(engine)
    return out


def _no_hole(conn: Any, plan: Any, holders: Any, own: Any) -> None:
    return None


def test_a_held_job_named_from_outside_is_cancelled_with_its_spawner_never_deleted(
        engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the refusal disabled (the hole items 1 and 2 came through), the spawner's discard
    still never strands anything: X, which B's Y depends on and B's Z sits in, is closed
    cancelled naming A instead of deleted; Y and Z are cancelled with it; X's own held child
    is deleted; the reclaim succeeds on every engine and nothing is left unfinished."""
    monkeypatch.setattr(jobq, "_refuse_unborn_holders", _no_hole)
    out = _foreign_work_on_a_held_job(engine)
    assert out["error"] is None and out["unfinished"] == {}
    rows = out["rows"]
    x, y, z = rows[out["x"]], rows[out["y"]], rows[out["z"]]
    assert x.state == "cancelled" and "whose result never committed" in x.error and x.spawn_token is None
    assert (y.state, y.closed_by) == ("cancelled", out["x"])
    assert (z.state, z.parent_id) == ("cancelled", out["x"])
    assert len([r for r in rows.values() if r.type == "leaf"]) == 2, "X's own held child remains"


def test_the_hanging_check_catches_a_discard_that_deletes_what_others_name(
        engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: the hole, and a discard that deletes every held job (nothing kept).
    The reclaim then fails on the parent key (PostgreSQL, MariaDB), or leaves Y waiting on a
    job that is gone and Z with a dangling parent_id (SQLite, MySQL): the check above fails."""
    monkeypatch.setattr(jobq, "_refuse_unborn_holders", _no_hole)
    monkeypatch.setattr(jobq, "_referenced_held", lambda conn, rows: set())
    out = _foreign_work_on_a_held_job(engine)
    if out["error"] is None:
        assert out["unfinished"].get(out["y"]) == "waiting" and out["x"] not in out["rows"]
    else:
        assert out["error"] in ("ForeignKeyViolation", "IntegrityError"), out["error"]
    with pytest.raises(AssertionError):
        assert out["error"] is None and out["unfinished"] == {}


# -- item 4: cancel of a held job -------------------------------------------------------------------


@pytest.mark.parametrize("spawner_ends", ["done", "failed"])
def test_cancel_of_a_held_job_is_recorded_and_applied_by_its_release(engine: sa.Engine, spawner_ends: str) -> None:
    """While the spawner runs, cancel(X) of its held spawn answers "held" and records the
    request (get, why say so); when the spawner's result commits, X is released cancelled,
    never runs, and so are its container child and the job depending on it. If the spawner
    fails instead, X is deleted with its other spawns. The bug: nothing recorded, and X runs
    to done after cancel answered."""
    spawned, go = threading.Event(), threading.Event()
    ran: list[int] = []
    seen: dict[str, int] = {}

    def spawner(ctx: jobq.JobContext) -> dict[str, int]:
        ids = ctx.submit([{"key": "x", "type": "box", "container": True},
                          {"key": "in", "type": "leaf", "parent": "x"},
                          {"key": "after", "type": "leaf", "depends_on": ["x"]},
                          {"key": "other", "type": "leaf"}])
        seen.update(ids)
        spawned.set()
        assert go.wait(30)
        if spawner_ends == "failed":
            raise RuntimeError("the spawner fails")
        return ids

    sid = jobq.enqueue(engine, "spawner", max_attempts=1)
    w = _worker(engine, {"spawner": spawner, "leaf": lambda ctx: ran.append(ctx.id), "box": _leaf})
    t = threading.Thread(target=w.run_until_idle, kwargs={"timeout": 60})
    t.start()
    try:
        assert spawned.wait(30)
        assert jobq.cancel(engine, seen["x"]) == "held"
        info = jobq.get(engine, seen["x"])
        assert info is not None and (info.state, info.cancel_requested) == ("held", True)
        assert "cancel requested" in jobq.why(engine, seen["x"])
    finally:
        go.set()
        t.join(60)
    assert w.run_until_idle(timeout=30)
    rows = _rows(engine)
    if spawner_ends == "failed":
        assert sorted(rows) == [sid] and ran == []
        return
    assert ran == [seen["other"]], f"a cancelled spawn ran: {ran}"
    x, inner, after = rows[seen["x"]], rows[seen["in"]], rows[seen["after"]]
    assert (x.state, x.error, x.closed_by) == ("cancelled", "cancelled", None)
    assert (inner.state, inner.closed_by) == ("cancelled", seen["x"])
    assert (after.state, after.closed_by) == ("cancelled", seen["x"])


def _release_after_cancel(engine: sa.Engine) -> tuple[int, dict[int, Any]]:
    """Dispatch S spawns X; cancel(X) and S's finalize race, the cancel committing first while
    the finalize's transaction is open (on engines with row locks, its read of the held rows
    waits for the cancel). Returns X and the table after the finalize."""
    sid = jobq.enqueue(engine, "s", max_attempts=1)
    lease = jobq.claim_batch(engine, "w", 30)[0]
    x = jobq._spawn(engine, jobq._plan([{"type": "leaf"}], single=True), jobq._Hold(sid, lease.token, frozenset()))
    assert jobq.cancel(engine, x[jobq._ONE]) == "held"

    def finish(conn: sa.Connection, d: Any) -> list[str | None]:
        return jobq._apply_outcomes(conn, d, [jobq._Outcome(sid, "w", lease.token, "done", spawned=True)], d.db_now(conn))

    assert jobq._transaction(engine, finish) == ["done"]
    return x[jobq._ONE], _rows(engine)


def test_a_requested_cancel_ends_the_released_job_cancelled_and_unclaimable(engine: sa.Engine) -> None:
    """Seed level: cancel of a held job, then its spawner's finalize. Correct: the job is
    cancelled in the finalize's transaction, nothing can claim it. The bug: it is released
    ready and the next claim hands it out."""
    x, rows = _release_after_cancel(engine)
    assert (rows[x].state, rows[x].cancel_requested) == ("cancelled", True)
    assert jobq.claim_batch(engine, "w", 30) == []


def test_the_release_check_catches_a_release_that_ignores_the_request(
        engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: the release reads the held rows without their cancel request. The
    job is then released ready and claimable, and the check above fails."""
    real = jobq._held_of

    def unaware(conn: sa.Connection, d: Any, dispatches: Any) -> list[Any]:
        return [types.SimpleNamespace(**{**r._asdict(), "cancel_requested": False}) for r in real(conn, d, dispatches)]

    monkeypatch.setattr(jobq, "_held_of", unaware)
    x, rows = _release_after_cancel(engine)
    with pytest.raises(AssertionError):
        assert rows[x].state == "cancelled"
    assert [lease.id for lease in jobq.claim_batch(engine, "w", 30)] == [x]


def _cancel_inside_the_release(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, dict[int, Any]]:
    """The spawner's finalize reads its held rows; right then, before it writes them, a cancel
    of the held job X runs in another session, and the finalize goes on once that cancel has
    returned or waits for a lock. Returns X, what cancel answered and the table afterwards."""
    sid = jobq.enqueue(engine, "s", max_attempts=1)
    lease = jobq.claim_batch(engine, "w", 30)[0]
    x = jobq._spawn(engine, jobq._plan([{"type": "leaf"}], single=True),
                    jobq._Hold(sid, lease.token, frozenset()))[jobq._ONE]
    real = jobq._held_of
    got: list[str] = []
    one = sa.create_engine(engine.url, poolclass=sa.pool.StaticPool)  # the cancel's one connection
    with one.connect() as conn:
        backend = backend_id(conn)
        conn.rollback()
    canceller = threading.Thread(target=lambda: got.append(jobq.cancel(one, x)))

    def read_then_cancel(conn: sa.Connection, d: Any, dispatches: Any) -> list[Any]:
        rows = real(conn, d, dispatches)
        if dispatches and not canceller.is_alive() and not got:  # the release's read, not the discard's
            canceller.start()
            wait_for(lambda: got or waits_for_a_row_lock(engine, backend), timeout=30, interval=INNODB_TRX_POLL,
                     what="the cancel to return or wait for the release's lock")
        return rows

    monkeypatch.setattr(jobq, "_held_of", read_then_cancel)

    def finish(conn: sa.Connection, d: Any) -> list[str | None]:
        return jobq._apply_outcomes(conn, d, [jobq._Outcome(sid, "w", lease.token, "done", spawned=True)], d.db_now(conn))

    assert jobq._transaction(engine, finish) == ["done"]
    canceller.join(30)
    one.dispose()
    assert got, "the cancel never returned"
    return x, got[0], _rows(engine)


@needs("row_locks")  # on SQLite the cancel waits for the whole finalize
def test_a_cancel_racing_the_release_waits_for_it_and_the_job_ends_cancelled(
        engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The release locks the held rows it reads: a cancel of one of them arriving between that
    read and the release's writes waits, then finds the job released and cancels it. Correct:
    the job ends cancelled, unclaimable. The bug (an unlocked read): the cancel records its
    request on the held row and returns "held", the release writes the row ready from what
    it read before, and the job runs although cancel answered."""
    x, answer, rows = _cancel_inside_the_release(engine, monkeypatch)
    assert (answer, rows[x].state) == ("cancelled", "cancelled")
    assert jobq.claim_batch(engine, "w", 30) == []


@needs("row_locks")
def test_the_release_race_check_catches_an_unlocked_read(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: the release's read of the held rows takes no lock."""
    monkeypatch.setattr(jobq, "_q_held_spawns", lambda d, spawners: sa.select(
        jobs.c.id, jobs.c.parent_id, jobs.c.is_container, jobs.c.spawned_by, jobs.c.spawn_token, jobs.c.cancel_requested,
    ).where(jobs.c.state == "held", jobs.c.spawned_by.in_(spawners)).order_by(jobs.c.id))
    x, answer, rows = _cancel_inside_the_release(engine, monkeypatch)
    assert answer == "held" and (rows[x].state, rows[x].cancel_requested) == ("ready", True)
    with pytest.raises(AssertionError):
        assert (answer, rows[x].state) == ("cancelled", "cancelled")


def _held_pair(engine: sa.Engine) -> tuple[int, int]:
    """A spawner holding its lease and two held spawns of it: (spawner, spawn)."""
    sid = jobq.enqueue(engine, "s", max_attempts=1)
    lease = jobq.claim_batch(engine, "w", 30)[0]
    x = jobq._spawn(engine, jobq._plan([{"type": "leaf"}], single=True), jobq._Hold(sid, lease.token, frozenset()))
    return sid, x[jobq._ONE]


def test_the_cli_says_a_held_cancel_is_requested(engine: sa.Engine, db_url: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`jobq cancel` of a held job exits 0 saying the cancel is requested and when it takes
    effect (not a bare "job N: held"); `jobq show` lists cancel_requested True and `jobq why`
    mentions it."""
    _, x = _held_pair(engine)
    assert jobq.main(["--url", db_url, "cancel", str(x)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"job {x}: cancel requested") and "spawner" in out, out
    assert jobq.main(["--url", db_url, "show", str(x)]) == 0
    assert "cancel_requested: True" in capsys.readouterr().out
    assert jobq.main(["--url", db_url, "why", str(x)]) == 0
    assert "cancel requested" in capsys.readouterr().out

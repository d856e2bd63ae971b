"""Hostile DAG cases (issue 20 items 4, 5, 7, 8, 12, 18; issue 13's retry of what submit
closed): each test fails on the code before the fix, and says how."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
from dbs import needs
from helpers import INNODB_TRX_POLL, backend_id, snapshot, state, wait_for, waits_for_a_row_lock

jobs = jobq.Job.__table__
FAST = dict(poll_interval=0.02, lease_ttl=5.0, retry_backoff=lambda attempt: 0.0)


def ok(ctx: jobq.JobContext) -> dict:
    return {"id": ctx.id}


def run(engine: sa.Engine) -> None:
    w = jobq.Worker(engine, {"t": ok}, max_concurrency=3, **FAST)
    assert w.run_until_idle(timeout=60)


def fail_now(engine: sa.Engine, job_type: str) -> int:
    """Claim the one ready job of ``job_type`` and fail it for good."""
    (lease,) = jobq.claim_batch(engine, "w", 30, types=[job_type])
    assert jobq.fail(engine, lease.id, "boom", worker_id="w", token=lease.token, retry=False) == "failed"
    return lease.id


def finish_now(engine: sa.Engine, job_type: str, result: dict | None = None) -> int:
    (lease,) = jobq.claim_batch(engine, "w", 30, types=[job_type])
    jobq.finalize(engine, lease.id, result or {}, worker_id="w", token=lease.token)
    return lease.id


def closed_by(engine: sa.Engine, job_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.select(jobs.c.closed_by).where(jobs.c.id == job_id)).scalar_one()


# ---- issue 13: retry follows closed_by, also for jobs submit closed at birth -------------------


def test_retry_reopens_dependents_that_submit_closed_because_the_upstream_had_failed(engine: sa.Engine) -> None:
    """submit wrote its own error text for a dependent of an already failed job, and retry,
    matching "upstream job N ..." in the error, never re-opened it. Now both paths write
    closed_by, and retry follows it: the whole chain comes back and runs."""
    up = jobq.enqueue(engine, "bad", max_attempts=1)
    fail_now(engine, "bad")
    ids = jobq.submit(engine, [{"key": "a", "type": "t", "depends_on": [up]},
                               {"key": "b", "type": "t", "depends_on": ["a"]}])
    assert [state(engine, ids[k]) for k in "ab"] == ["failed", "failed"]
    with engine.begin() as conn:  # the cause is fixed: the job will succeed now
        conn.execute(sa.update(jobs).where(jobs.c.id == up).values(type="t"))
    assert set(jobq.retry(engine, up)) == {up, ids["a"], ids["b"]}
    run(engine)
    assert {state(engine, i) for i in (up, *ids.values())} == {"done"}


def test_closed_by_names_the_job_that_closed_each_one(engine: sa.Engine) -> None:
    """closed_by for every way a job is closed by another: a failed upstream (at finalize, and at
    birth, through an existing or a new upstream), a container closed by its upstream, a
    cancelled container's subtree; none for a job cancelled or failed in its own right."""
    up = jobq.enqueue(engine, "bad", max_attempts=1)
    dn = jobq.enqueue(engine, "t", depends_on=[up])
    box = jobq.enqueue(engine, "box", container=True, depends_on=[up])
    kid = jobq.enqueue(engine, "t", parent=box)
    fail_now(engine, "bad")
    born = jobq.submit(engine, [{"key": "a", "type": "t", "depends_on": [up]}, {"key": "b", "type": "t", "depends_on": ["a"]}])
    top = jobq.enqueue(engine, "box", container=True)
    inner = jobq.enqueue(engine, "box", container=True, parent=top)
    deep = jobq.enqueue(engine, "t", parent=inner)
    jobq.cancel(engine, top)
    got = {j: closed_by(engine, j) for j in (up, dn, box, kid, born["a"], born["b"], top, inner, deep)}
    assert got == {up: None, dn: up, box: up, kid: box, born["a"]: up, born["b"]: born["a"], top: None,
                   inner: top, deep: inner}
    assert jobq.get(engine, kid).error == f"container {box} failed"  # type: ignore[union-attr]
    assert jobq.get(engine, born["b"]).error == f"upstream job {born['a']} failed"  # type: ignore[union-attr]


# ---- item 7 and 8: graph walks of any depth --------------------------------------------------


def test_retry_of_a_long_chain_reopens_every_link(engine: sa.Engine) -> None:
    """Item 7: re-opening recursed once per link, so retry of a 1,100-job chain raised
    RecursionError and re-opened nothing."""
    n = 1100
    ids = jobq.submit(engine, [{"key": "0", "type": "head", "max_attempts": 1}]
                      + [{"key": str(i), "type": "t", "depends_on": [str(i - 1)]} for i in range(1, n)])
    fail_now(engine, "head")
    assert state(engine, ids[str(n - 1)]) == "failed"
    reopened = jobq.retry(engine, ids["0"])
    assert reopened == [ids[str(i)] for i in range(n)]
    with engine.connect() as conn:
        rows = conn.execute(sa.select(jobs.c.state, jobs.c.pending_deps, sa.func.count())
                            .group_by(jobs.c.state, jobs.c.pending_deps)).all()
    assert sorted(tuple(r) for r in rows) == [("ready", 0, 1), ("waiting", 1, n - 1)]


def test_a_thousand_deep_nest_of_containers_opens_and_rolls_up(engine: sa.Engine) -> None:
    """Item 8: when the outermost container's upstream finished, releasing the nest recursed
    once per level: the finalize raised RecursionError and the result was never written."""
    depth = 1000
    items: list[dict] = [{"key": "up", "type": "up"}, {"key": "c0", "type": "box", "container": True, "depends_on": ["up"]}]
    items += [{"key": f"c{i}", "type": "box", "container": True, "parent": f"c{i - 1}"} for i in range(1, depth)]
    items += [{"key": "leaf", "type": "leaf", "parent": f"c{depth - 1}"}]
    ids = jobq.submit(engine, items)
    assert state(engine, ids["leaf"]) == "waiting"
    finish_now(engine, "up")
    assert state(engine, ids["leaf"]) == "ready"
    finish_now(engine, "leaf")
    nest = [ids[f"c{i}"] for i in range(depth)]
    with engine.connect() as conn:  # one read of the nest's states, not a thousand jobq.get calls
        states = conn.execute(sa.select(jobs.c.state).where(jobs.c.id.in_(nest))).scalars().all()
    assert len(states) == depth and set(states) == {"done"}


# ---- item 18: cancel leaves a finished job exactly as it is ----------------------------------


def test_cancel_of_a_finished_job_changes_nothing_and_retry_still_finds_it(engine: sa.Engine) -> None:
    """Item 18: cancelling a job already cancelled because of its upstream rewrote its error to
    "cancelled" (and, with the error text as the relation, retry(U) lost it)."""
    u = jobq.enqueue(engine, "t")
    dn = jobq.enqueue(engine, "t", depends_on=[u])
    done = jobq.enqueue(engine, "other")
    finish_now(engine, "other")
    assert jobq.cancel(engine, u) == "cancelled"
    before = snapshot(engine)
    assert jobq.cancel(engine, dn) == "cancelled"
    assert jobq.cancel(engine, done) == "done"
    assert jobq.cancel(engine, u) == "cancelled"
    assert snapshot(engine) == before
    assert jobq.retry(engine, u) == [u, dn]


# ---- item 5: retry semantics -------------------------------------------------------------------


def test_a_dependent_reopens_once_its_last_closed_upstream_is_retried(engine: sa.Engine) -> None:
    """Item 5a: D depends on A and B, both cancelled; D names B. Retrying B (D still blocked by
    A), then A, left D cancelled for ever: only a retry of the upstream D named could find it."""
    a = jobq.enqueue(engine, "t")
    b = jobq.enqueue(engine, "t")
    dd = jobq.enqueue(engine, "t", depends_on=[a, b])
    jobq.cancel(engine, b)  # D is closed by B, and names it
    jobq.cancel(engine, a)
    assert jobq.retry(engine, b) == [b]  # A is still cancelled: D stays closed
    assert state(engine, dd) == "cancelled"
    assert jobq.retry(engine, a) == [a, dd]
    run(engine)
    assert [state(engine, j) for j in (a, b, dd)] == ["done"] * 3


def test_retry_of_a_child_closed_with_its_container_says_which_upstream_to_retry(engine: sa.Engine) -> None:
    """Item 5b: a child closed because its container's upstream failed: retry(child) returned []
    and re-opened nothing, silently. Now it is refused naming the upstream, and retrying that
    upstream brings the container and the child back."""
    up = jobq.enqueue(engine, "bad", max_attempts=1)
    box = jobq.enqueue(engine, "box", container=True, depends_on=[up])
    kid = jobq.enqueue(engine, "t", parent=box)
    fail_now(engine, "bad")
    assert [state(engine, j) for j in (box, kid)] == ["failed", "failed"]
    before = snapshot(engine)
    with pytest.raises(jobq.InvalidJob, match=f"inside container {box}, which depends on job {up}, which is failed"):
        jobq.retry(engine, kid)
    assert snapshot(engine) == before
    with engine.begin() as conn:
        conn.execute(sa.update(jobs).where(jobs.c.id == up).values(type="t"))
    assert set(jobq.retry(engine, up)) == {up, box, kid}
    assert state(engine, kid) == "waiting"  # gated by the container's upstream again
    run(engine)
    assert [state(engine, j) for j in (up, box, kid)] == ["done"] * 3


def test_retry_of_a_cancelled_container_lets_its_running_child_finish(engine: sa.Engine) -> None:
    """Item 5c: cancel(container) while a child runs, then retry(container) before the child
    returns: the child's cancel request was never withdrawn, so it still ended cancelled and the
    just-retried container rolled up failed."""
    box = jobq.enqueue(engine, "box", container=True)
    kid = jobq.enqueue(engine, "t", parent=box)
    (lease,) = jobq.claim_batch(engine, "w", 30)
    assert jobq.cancel(engine, box) == "cancelled"
    assert jobq.get(engine, kid).cancel_requested  # type: ignore[union-attr]
    assert jobq.retry(engine, box) == [box]
    assert not jobq.get(engine, kid).cancel_requested  # type: ignore[union-attr]
    jobq.finalize(engine, kid, {"v": 1}, worker_id="w", token=lease.token)
    info = jobq.get(engine, kid)
    assert info is not None and (info.state, info.result) == ("done", {"v": 1})
    assert state(engine, box) == "done"


# ---- item 12: submit refuses the deadlocks enqueue refuses ------------------------------------


def test_submit_refuses_a_child_that_waits_through_existing_work_for_its_container(engine: sa.Engine) -> None:
    """Item 12: a child of container X depending on an existing job that waits for X: enqueue
    refused it, submit accepted it, and the three waited for each other forever."""
    box = jobq.enqueue(engine, "box", container=True)
    after = jobq.enqueue(engine, "t", depends_on=[box])
    before = snapshot(engine)
    with pytest.raises(jobq.InvalidJob, match=f"wait for each other forever.*'c' -> job {after} -> container {box} -> 'c'"):
        jobq.submit(engine, [{"key": "c", "type": "t", "parent": box, "depends_on": [after]}])
    with pytest.raises(jobq.InvalidJob, match="wait for each other forever"):
        jobq.enqueue(engine, "t", parent=box, depends_on=[after])
    # the same wait through two new jobs: k waits for w, w for container e2, e2 for its new child m, m for k
    e2 = jobq.enqueue(engine, "box", container=True)
    w = jobq.enqueue(engine, "t", depends_on=[e2])
    before = snapshot(engine)
    with pytest.raises(jobq.InvalidJob, match="wait for each other forever"):
        jobq.submit(engine, [{"key": "k", "type": "t", "depends_on": [w]},
                             {"key": "m", "type": "t", "parent": e2, "depends_on": ["k"]}])
    assert snapshot(engine) == before
    # without the edge back there is no deadlock: accepted, and it runs
    ids = jobq.submit(engine, [{"key": "k", "type": "t", "depends_on": [w]}, {"key": "m", "type": "t", "parent": e2}])
    run(engine)
    assert [state(engine, j) for j in (e2, w, ids["m"], ids["k"])] == ["done"] * 4


# ---- item 4: cancel(container) against concurrent finishes and children ------------------------


def test_a_cancelled_or_finished_container_takes_no_children(engine: sa.Engine) -> None:
    """The rule cancel relies on: enqueue or submit into a cancelled (or finished) container is
    refused, and nothing is written."""
    box = jobq.enqueue(engine, "box", container=True)
    jobq.enqueue(engine, "t", parent=box)
    jobq.cancel(engine, box)
    before = snapshot(engine)
    with pytest.raises(jobq.InvalidJob, match=r"already rolled up \(cancelled\)"):
        jobq.enqueue(engine, "t", parent=box)
    with pytest.raises(jobq.InvalidJob, match=r"already rolled up \(cancelled\)"):
        jobq.submit(engine, [{"key": "a", "type": "t", "parent": box}])
    assert snapshot(engine) == before


def _cancel_held_at(engine: sa.Engine, held: int, root: int, meanwhile: Any) -> None:
    """cancel(root) on its own connection while a second connection holds row ``held`` (a
    member of root's subtree) locked: once cancel is seen waiting for that lock (the database
    says so), run ``meanwhile`` in a thread, then release the row and let cancel finish. The
    window is the one a slow network or preemption opens; held open here, never guessed with
    sleeps."""
    ceng = sa.create_engine(engine.url, pool_size=1, max_overflow=0)  # cancel's one connection
    jobq._prepare(ceng)
    with ceng.connect() as conn:
        backend = backend_id(conn)
    out: dict[str, Any] = {}

    def call(name: str, fn: Any) -> None:
        try:
            out[name] = fn()
        except BaseException as exc:  # reported by the assertions below
            out[name] = exc

    holder = engine.connect()
    tx = holder.begin()
    holder.execute(sa.select(jobs.c.id).where(jobs.c.id == held).with_for_update())
    canceller = threading.Thread(target=call, args=("cancel", lambda: jobq.cancel(ceng, root)))
    canceller.start()
    side = threading.Thread(target=call, args=("meanwhile", meanwhile))
    try:
        wait_for(lambda: waits_for_a_row_lock(engine, backend), timeout=30, interval=INNODB_TRX_POLL,
                 what="cancel to wait for the held row")
        side.start()
        side.join(30)
        finished_while_held = not side.is_alive()
    finally:
        tx.rollback()
        holder.close()
        canceller.join(60)
        if side.ident is not None:
            side.join(60)
        ceng.dispose()
    assert finished_while_held, "the concurrent work waited for cancel: cancel had locked more than the rows it read"
    assert not isinstance(out.get("meanwhile"), BaseException), out.get("meanwhile")
    assert out.get("cancel") == "cancelled", out.get("cancel")


@needs("row_locks")  # SQLite serialises writers, so no window exists
def test_cancel_of_a_container_leaves_a_job_that_finished_meanwhile_done(engine: sa.Engine) -> None:
    """Item 4a: cancel read the subtree's waiting/ready members with plain SELECTs and settled
    every one it had read as cancelled. A job in a nested container that finished in between
    kept state done, yet cancel closed its dependent outside the container ("upstream job J was
    cancelled") and counted it off its container a second time."""
    root = jobq.enqueue(engine, "box", container=True)
    held = jobq.enqueue(engine, "t", parent=root)  # id order: root < held < inner < j < k
    inner = jobq.enqueue(engine, "box", container=True, parent=root)
    j = jobq.enqueue(engine, "run", parent=inner)
    k = jobq.enqueue(engine, "t", parent=inner)
    dep = jobq.enqueue(engine, "t", depends_on=[j])
    _cancel_held_at(engine, held, root,
                    lambda: finish_now(engine, "run", {"v": 1}))
    info = jobq.get(engine, j)
    assert info is not None and (info.state, info.result) == ("done", {"v": 1})
    assert state(engine, dep) == "ready"
    assert [state(engine, x) for x in (root, held, inner, k)] == ["cancelled"] * 4
    assert [jobq.claim(engine, "w", 30)] == [dep]


@needs("row_locks")  # SQLite serialises writers, so no window exists
def test_cancel_of_a_container_cancels_a_child_enqueued_meanwhile(engine: sa.Engine) -> None:
    """Item 4b: a child enqueued into a nested container after cancel had listed the subtree
    must not stay ready inside the cancelled container. cancel locks each container before it
    reads its children: a child that committed first is seen and cancelled, a later one waits
    and is refused. (This particular interleaving was also caught by the old code, whose
    settle closed the unstarted children of each container it closed; the test guards the
    rule, test_..._finished_meanwhile_done is the one the old code fails.)"""
    root = jobq.enqueue(engine, "box", container=True)
    held = jobq.enqueue(engine, "t", parent=root)
    inner = jobq.enqueue(engine, "box", container=True, parent=root)
    jobq.enqueue(engine, "t", parent=inner)
    late: list[int] = []
    _cancel_held_at(engine, held, root,
                    lambda: late.append(jobq.enqueue(engine, "t", parent=inner)))
    assert state(engine, late[0]) == "cancelled"
    assert jobq.claim_batch(engine, "w", 30, limit=10) == []

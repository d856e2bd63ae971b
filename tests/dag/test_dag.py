"""DAG semantics: propagation, nested containers, container gates, cancel, retry, bulk submit."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa

import jobq
from dbs import needs
from helpers import FAST, snapshot, state, wait_for


def ok(ctx: jobq.JobContext) -> dict:
    if ctx.args.get("fail"):
        raise RuntimeError("told to fail")
    return {"id": ctx.id}


def run(engine: sa.Engine, **handlers) -> None:
    w = jobq.Worker(engine, {"t": ok, **handlers}, max_concurrency=3, **FAST)
    assert w.run_until_idle(timeout=60)


def test_failure_propagates_transitively_and_names_the_cause(engine: sa.Engine) -> None:
    """A failure propagates down a chain (a fails, so b and then c fail), each dependent naming its
    direct upstream as the cause; an unrelated job still runs."""
    a = jobq.enqueue(engine, "t", {"fail": True}, max_attempts=1)
    b = jobq.enqueue(engine, "t", depends_on=[a])
    c = jobq.enqueue(engine, "t", depends_on=[b])
    free = jobq.enqueue(engine, "t")
    run(engine)
    assert [state(engine, j) for j in (a, b, c, free)] == ["failed", "failed", "failed", "done"]
    assert jobq.get(engine, b).error == f"upstream job {a} failed"  # type: ignore[union-attr]
    assert jobq.get(engine, c).error == f"upstream job {b} failed"  # type: ignore[union-attr]


def test_nested_containers_roll_up_recursively(engine: sa.Engine) -> None:
    """A container inside a container: once the leaves finish, the inner and then the outer
    container roll up done, and a job depending on the outer one runs."""
    outer = jobq.enqueue(engine, "box", container=True)
    inner = jobq.enqueue(engine, "box", container=True, parent=outer)
    leaf1 = jobq.enqueue(engine, "t", parent=inner)
    leaf2 = jobq.enqueue(engine, "t", parent=outer)
    after = jobq.enqueue(engine, "t", depends_on=[outer])
    run(engine)
    assert [state(engine, j) for j in (leaf1, leaf2, inner, outer, after)] == ["done"] * 5


def test_a_containers_upstreams_gate_all_its_descendants(engine: sa.Engine) -> None:
    """No child (nor grandchild) starts before the container's own upstreams are done."""
    started: dict[int, float] = {}
    finished: dict[int, float] = {}
    import time

    def rec(ctx: jobq.JobContext) -> dict:
        started[ctx.id] = time.monotonic()
        time.sleep(0.05)
        finished[ctx.id] = time.monotonic()
        return {}

    up = jobq.enqueue(engine, "t")
    box = jobq.enqueue(engine, "box", container=True, depends_on=[up])
    inner = jobq.enqueue(engine, "box", container=True, parent=box)
    kid = jobq.enqueue(engine, "t", parent=box)
    grandkid = jobq.enqueue(engine, "t", parent=inner)
    assert state(engine, kid) == "waiting" and state(engine, grandkid) == "waiting"
    w = jobq.Worker(engine, {"t": rec}, max_concurrency=3, **FAST)
    assert w.run_until_idle(timeout=60)
    assert started[kid] >= finished[up] and started[grandkid] >= finished[up]
    assert [state(engine, j) for j in (box, inner, kid, grandkid)] == ["done"] * 4


def test_a_failed_container_upstream_fails_the_whole_subtree(engine: sa.Engine) -> None:
    """A container's upstream fails: the container, its nested container, the child inside and the
    container's dependent all end failed; none of them is left waiting."""
    up = jobq.enqueue(engine, "t", {"fail": True}, max_attempts=1)
    box = jobq.enqueue(engine, "box", container=True, depends_on=[up])
    inner = jobq.enqueue(engine, "box", container=True, parent=box)
    kid = jobq.enqueue(engine, "t", parent=inner)
    after = jobq.enqueue(engine, "t", depends_on=[box])
    run(engine)
    assert [state(engine, j) for j in (up, box, inner, kid, after)] == ["failed"] * 5


def test_cancel_a_ready_job_cancels_its_dependents(engine: sa.Engine) -> None:
    """cancel() of a ready job cancels it and its dependent (naming the cause), leaving nothing to
    claim; cancel() of an unknown id is InvalidJob."""
    a = jobq.enqueue(engine, "t")
    b = jobq.enqueue(engine, "t", depends_on=[a])
    assert jobq.cancel(engine, a) == "cancelled"
    assert state(engine, b) == "cancelled"
    assert jobq.get(engine, b).error == f"upstream job {a} was cancelled"  # type: ignore[union-attr]
    assert jobq.claim(engine, "w", 30) is None
    with pytest.raises(jobq.InvalidJob, match="no job"):
        jobq.cancel(engine, 987654)


def test_cancel_a_running_job_asks_its_handler_to_stop(engine: sa.Engine) -> None:
    """cancel() of a running job asks its handler to stop (ctx.wait returns, stop_reason
    'cancelled'); the job ends cancelled with no result although the handler returned one, and
    its dependent is cancelled."""
    seen = threading.Event()

    def long(ctx: jobq.JobContext) -> dict:
        while not ctx.wait(0.02):
            pass
        if ctx.stop_reason == "cancelled":
            seen.set()
        return {"finished": True}

    jid = jobq.enqueue(engine, "long")
    after = jobq.enqueue(engine, "t", depends_on=[jid])
    # Heartbeats every 0.2 s tell the handler; a long lease, so that a slow machine's stall
    # never lets the worker's own sweep take the job back first.
    w = jobq.Worker(engine, {"long": long, "t": ok}, max_concurrency=2, poll_interval=0.02, lease_ttl=30,
                    heartbeat_interval=0.2)
    assert w.tick() == 1
    assert jobq.cancel(engine, jid) == "running"
    assert w.run_until_idle(timeout=30)
    assert seen.is_set()
    info = jobq.get(engine, jid)
    assert info is not None and (info.state, info.result) == ("cancelled", None)
    assert state(engine, after) == "cancelled"


def test_cancel_a_container_cancels_its_subtree(engine: sa.Engine) -> None:
    """cancel() of a container cancels everything inside it, nested containers included, and its
    dependent."""
    box = jobq.enqueue(engine, "box", container=True)
    inner = jobq.enqueue(engine, "box", container=True, parent=box)
    kids = [jobq.enqueue(engine, "t", parent=box), jobq.enqueue(engine, "t", parent=inner)]
    after = jobq.enqueue(engine, "t", depends_on=[box])
    jobq.cancel(engine, box)
    assert [state(engine, j) for j in (box, inner, *kids, after)] == ["cancelled"] * 5


def test_retry_reopens_the_job_and_what_closed_because_of_it(engine: sa.Engine) -> None:
    """retry() of a failed job reopens it and what failed because of it: its container, its
    dependents and theirs, and the container's dependent; the sibling that succeeded is left
    alone. Once the cause is fixed all end done, the retried job's attempts start afresh, and
    retrying a done job is refused."""
    box = jobq.enqueue(engine, "box", container=True)
    flaky = jobq.enqueue(engine, "t", {"fail": True}, parent=box, max_attempts=1)
    sibling = jobq.enqueue(engine, "t", parent=box)
    down = jobq.enqueue(engine, "t", depends_on=[flaky])
    downer = jobq.enqueue(engine, "t", depends_on=[down])
    after_box = jobq.enqueue(engine, "t", depends_on=[box])
    run(engine)
    assert [state(engine, j) for j in (flaky, sibling, box, down, downer, after_box)] == \
        ["failed", "done", "failed", "failed", "failed", "failed"]
    with engine.begin() as conn:  # the cause is fixed: the job will succeed now
        conn.execute(sa.update(jobq.Job.__table__).where(jobq.Job.__table__.c.id == flaky).values(args={}))
    reopened = jobq.retry(engine, flaky)
    assert set(reopened) == {flaky, box, down, downer, after_box}
    run(engine)
    assert [state(engine, j) for j in (flaky, sibling, box, down, downer, after_box)] == ["done"] * 6
    assert jobq.get(engine, flaky).attempts == 1  # type: ignore[union-attr]
    with pytest.raises(jobq.InvalidJob, match="only failed or cancelled"):
        jobq.retry(engine, flaky)


def test_retry_refuses_while_an_upstream_is_still_failed(engine: sa.Engine) -> None:
    """retry() of a dependent whose upstream is still failed is refused, naming the upstream, and
    writes nothing."""
    a = jobq.enqueue(engine, "t", {"fail": True}, max_attempts=1)
    b = jobq.enqueue(engine, "t", depends_on=[a])
    run(engine)
    before = snapshot(engine)
    with pytest.raises(jobq.InvalidJob, match=f"depends on job {a}"):
        jobq.retry(engine, b)
    assert snapshot(engine) == before


def test_submit_inserts_a_dag_with_local_references(engine: sa.Engine) -> None:
    """submit() inserts a graph whose items refer to each other by key and to existing jobs by id:
    ids come back per key, a repeated edge counts once, parent and depends_on resolve, children
    wait for their container's upstream, and a worker runs it all to done."""
    pre = jobq.enqueue(engine, "t")
    ids = jobq.submit(engine, [
        {"key": "extract", "type": "t", "depends_on": [pre]},
        {"key": "box", "type": "box", "container": True, "depends_on": ["extract"]},
        {"key": "p1", "type": "t", "parent": "box"},
        {"key": "p2", "type": "t", "parent": "box", "depends_on": ["p1", "p1"]},
        {"key": "load", "type": "t", "depends_on": ["box"], "group_key": "g", "weight": 2},
    ])
    assert set(ids) == {"extract", "box", "p1", "p2", "load"}
    assert jobq.get(engine, ids["p2"]).depends_on == (ids["p1"],)  # type: ignore[union-attr]
    assert jobq.get(engine, ids["p1"]).parent_id == ids["box"]  # type: ignore[union-attr]
    assert state(engine, ids["p1"]) == "waiting"  # gated by the container's upstream
    run(engine)
    assert {state(engine, i) for i in ids.values()} == {"done"}


@pytest.mark.parametrize("items,message", [
    ([{"key": "a", "type": "t", "depends_on": ["b"]}, {"key": "b", "type": "t", "depends_on": ["c"]},
      {"key": "c", "type": "t", "depends_on": ["a"]}], "cycle among the submitted jobs: "),
    ([{"key": "a", "type": "t", "depends_on": ["a"]}], "cycle among the submitted jobs: a -> a"),
    ([{"key": "a", "type": "t", "depends_on": ["zzz"]}], "unknown key 'zzz'"),
    ([{"key": "a", "type": "t", "depends_on": [999_999]}], "no job with id 999999"),
    ([{"key": "a", "type": "t"}, {"key": "b", "type": "t", "parent": "a"}], "'a', which is not a container"),
    ([{"key": "a", "type": "t"}, {"key": "a", "type": "t"}], "duplicate key 'a'"),
    ([{"key": "box", "type": "t", "container": True}], "container 'box' has no children"),
    ([{"key": "a", "type": "t", "args": {"x": float("nan")}}], "job 'a': args.x"),
    ([{"key": "a", "type": "t", "colour": "red"}], "unknown fields"),
])
def test_submit_rejects_bad_graphs_and_writes_nothing(engine: sa.Engine, items: list, message: str) -> None:
    """Each bad graph (cycle, self-loop, unknown key or id, child of a non-container, duplicate key,
    empty container, bad args, unknown field) raises InvalidJob naming the problem, and nothing
    is written."""
    jobq.enqueue(engine, "t")
    before = snapshot(engine)
    with pytest.raises(jobq.InvalidJob, match=message):
        jobq.submit(engine, items)
    assert snapshot(engine) == before


def test_submit_names_the_cycle(engine: sa.Engine) -> None:
    """The cycle error names the cycle itself (a, b and c, closing on the first), not the job that
    is free."""
    with pytest.raises(jobq.InvalidJob) as err:
        jobq.submit(engine, [{"key": "a", "type": "t", "depends_on": ["c"]}, {"key": "b", "type": "t", "depends_on": ["a"]},
                             {"key": "c", "type": "t", "depends_on": ["b"]}, {"key": "free", "type": "t"}])
    cycle = str(err.value).split(": ")[-1].split(" -> ")
    assert set(cycle) == {"a", "b", "c"} and cycle[0] == cycle[-1]


def test_submit_a_large_fan_out_and_fan_in(engine: sa.Engine) -> None:
    """A very large fan-out and fan-in: 2,000 children in one container and a job depending on
    all of them, inserted in one call. Correct: the counters start at 2,000 (not
    double-counted), every job runs once, the container rolls up once and both counters end
    at zero. A bug shows as a counter off by the duplicates, below zero, or a sink that never
    runs."""
    items = [{"key": "box", "type": "box", "container": True}]
    items += [{"key": f"k{i}", "type": "t", "parent": "box"} for i in range(2000)]
    items += [{"key": "sink", "type": "t", "depends_on": [f"k{i}" for i in range(2000)]}]
    ids = jobq.submit(engine, items)
    info = jobq.get(engine, ids["sink"])
    assert info is not None and info.pending_deps == 2000 and len(info.depends_on) == 2000
    assert jobq.get(engine, ids["box"]).pending_children == 2000  # type: ignore[union-attr]
    runs: list[int] = []
    w = jobq.Worker(engine, {"t": lambda ctx: runs.append(ctx.id)}, max_concurrency=8, **FAST)
    assert w.run_until_idle(timeout=120)
    assert state(engine, ids["box"]) == "done" and state(engine, ids["sink"]) == "done"
    # run_until_idle returned True: nothing is left to wait for. What must hold now: every
    # child and the sink ran exactly once, and both counters came down to zero, not below.
    assert sorted(runs) == sorted(v for k, v in ids.items() if k != "box")
    box, sink = jobq.get(engine, ids["box"]), jobq.get(engine, ids["sink"])
    assert box is not None and sink is not None
    assert (box.pending_children, sink.pending_deps, sink.attempts) == (0, 0, 1)


def _waiting_on_a_lock(engine: sa.Engine) -> int:
    """Transactions of this database blocked on a row lock now."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            q = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
        else:  # InnoDB, MySQL and MariaDB alike; the server's other databases (xdist workers, other sessions) left out
            q = ("SELECT count(*) FROM information_schema.innodb_trx t JOIN information_schema.processlist p "
                 "ON p.id = t.trx_mysql_thread_id WHERE t.trx_state = 'LOCK WAIT' AND p.db = DATABASE()")
        return int(conn.execute(sa.text(q)).scalar() or 0)


@needs("row_locks")  # SQLite runs the two transactions one after the other
@pytest.mark.parametrize("how", ["finalize", "worker"])
def test_a_dependent_enqueued_while_its_upstream_finishes_is_released(engine: sa.Engine, how: str) -> None:
    """The interleaving that lost a dependent on PostgreSQL: an enqueue of ``down`` (depends on
    ``up``, which is running) is inside its transaction, holding its share lock on ``up``, when
    ``up``'s finalize starts; the finalize waits for that lock, the enqueue commits, the
    finalize goes on. The finalize must then count ``down`` off: it is ready, not waiting
    forever on a job that is done. (Reading the dependents in the finish's own statement, whose
    snapshot predates the wait, left ``down`` waiting with pending_deps = 1.)"""
    up = jobq.enqueue(engine, "t")
    [lease] = jobq.claim_batch(engine, "w1", 600, limit=1)
    assert lease.id == up
    with engine.connect() as conn:
        tx = conn.begin()
        down = jobq.enqueue(conn, "t", depends_on=[up])  # share-locks `up` until the commit
        errors: list[BaseException] = []

        def finish() -> None:
            try:
                if how == "finalize":
                    jobq.finalize(engine, up, {}, worker_id="w1", token=lease.token)
                else:  # a Worker's batch of outcomes: the path a tick writes
                    d = jobq._prepare(engine)
                    out = jobq._Outcome(up, "w1", lease.token, "done", result=None)
                    jobq._transaction(engine, lambda c, _d: jobq._apply_outcomes(c, d, [out], d.db_now(c)))
            except BaseException as exc:  # noqa: BLE001 - reported by the test below
                errors.append(exc)

        t = threading.Thread(target=finish)
        t.start()
        # Polled every 0.25 s: InnoDB refreshes its transaction table (a cache) only when the last
        # read of it is over 0.1 s old, so a faster poll reads the same stale copy forever.
        wait_for(lambda: errors or _waiting_on_a_lock(engine) >= 1, timeout=60, interval=0.25,
                 what="the finalize to wait for the enqueue's lock")
        assert errors == []
        tx.commit()
    t.join(timeout=60)
    assert not t.is_alive() and errors == []
    assert state(engine, up) == "done"
    with engine.connect() as conn:
        pending = conn.execute(sa.text("SELECT pending_deps FROM jobs WHERE id = :i"), {"i": down}).scalar()
    assert (state(engine, down), pending) == ("ready", 0)

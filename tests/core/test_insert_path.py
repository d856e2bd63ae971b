"""One insert path (issue 13): enqueue is a one-item submit, the job fields are spelled once,
and every check runs before the first write, also inside the caller's transaction."""

from __future__ import annotations

import datetime as dt
import inspect
import threading

import pytest
import sqlalchemy as sa
from sqlalchemy import orm

import jobq
from dbs import needs
from helpers import snapshot, state

jobs = jobq.Job.__table__


def test_the_job_fields_are_spelled_once() -> None:
    """enqueue's keywords, their defaults, and the keys submit accepts are _JobSpec's fields: a
    new field is one line there (and enqueue's signature, which this test holds to it)."""
    spec_fields = {f.name: f.default for f in jobq._JOB_FIELDS}
    params = [p for p in inspect.signature(jobq.enqueue).parameters.values() if p.name != "target"]
    assert [p.name for p in params] == list(jobq._JOB_FIELD_NAMES) == list(spec_fields)
    for p in params:
        if p.default is not inspect.Parameter.empty:
            assert p.default == spec_fields[p.name], p.name
    with pytest.raises(jobq.InvalidJob, match=r"unknown fields \['colour'\]"):
        jobq._make_spec({"type": "t", "colour": "red"})


FIELDS = [
    {},
    {"args": {"a": [1, (2, 3)]}, "group_key": "g", "weight": 7, "max_attempts": 2, "timeout": 3.5},
    {"run_after": dt.timedelta(hours=2)},
    {"run_after": dt.datetime(2031, 5, 6, 7, 8, 9, tzinfo=dt.timezone(dt.timedelta(hours=2)))},
]  # (containers differ on purpose: submit refuses an empty one, enqueue lets it wait for children)


@pytest.mark.parametrize("fields", FIELDS)
def test_enqueue_and_a_one_item_submit_write_the_same_row(engine: sa.Engine, fields: dict) -> None:
    up = jobq.enqueue(engine, "up")
    box = jobq.enqueue(engine, "box", container=True, depends_on=[up])
    a = jobq.enqueue(engine, "t", parent=box, depends_on=[up], **fields)
    b = jobq.submit(engine, [{"key": "b", "type": "t", "parent": box, "depends_on": [up], **fields}])["b"]
    skip = {"id", "created_at", "updated_at", "run_after"}
    with engine.connect() as conn:
        ra, rb = (conn.execute(sa.select(jobs).where(jobs.c.id == i)).mappings().one() for i in (a, b))
    assert {k: v for k, v in ra.items() if k not in skip} == {k: v for k, v in rb.items() if k not in skip}
    if isinstance(fields.get("run_after"), dt.datetime):
        assert ra["run_after"] == rb["run_after"] == dt.datetime(2031, 5, 6, 5, 8, 9)


def test_a_refused_enqueue_in_the_callers_session_leaves_the_container_alone(engine: sa.Engine) -> None:
    """Issue 13, bug 1: enqueue counted the child into its container before it checked
    depends_on. A caller that caught the InvalidJob and committed left the container waiting for
    a child that did not exist, forever."""
    box = jobq.enqueue(engine, "box", container=True)
    with orm.Session(engine) as session:
        kid = jobq.enqueue(session, "t", parent=box)
        with pytest.raises(jobq.InvalidJob, match="no job with id 777777"):
            jobq.enqueue(session, "t", parent=box, depends_on=[777_777])
        with pytest.raises(jobq.InvalidJob, match="wait for each other forever"):
            jobq.enqueue(session, "t", parent=box, depends_on=[box])
        session.commit()
    info = jobq.get(engine, box)
    assert info is not None and info.pending_children == 1
    (lease,) = jobq.claim_batch(engine, "w", 30)
    assert lease.id == kid
    jobq.finalize(engine, kid, {}, worker_id="w", token=lease.token)
    assert state(engine, box) == "done"  # it rolled up after its one real child


def test_a_refused_submit_in_the_callers_transaction_writes_nothing(engine: sa.Engine) -> None:
    box = jobq.enqueue(engine, "box", container=True)
    other = jobq.enqueue(engine, "box", container=True)
    jobq.enqueue(engine, "t", parent=other)
    before = snapshot(engine)
    with engine.connect() as conn:
        with pytest.raises(jobq.InvalidJob, match="no job with id 888888"):
            jobq.submit(conn, [{"key": "a", "type": "t", "parent": box}, {"key": "b", "type": "t", "parent": other},
                               {"key": "c", "type": "t", "parent": box, "depends_on": [888_888]}])
        conn.commit()
    assert snapshot(engine) == before


# ---- the ids submit returns -------------------------------------------------------------------


def _mislabelled(engine: sa.Engine, ids: dict[str, int]) -> list[str]:
    """Keys whose returned id names a row that is not theirs (each row's args carry its key)."""
    with engine.connect() as conn:
        args = dict(conn.execute(sa.select(jobs.c.id, jobs.c.args)).all())
    return [k for k, i in ids.items() if (args.get(i) or {}).get("k") != k]


def test_concurrent_submits_each_get_their_own_rows_ids(engine: sa.Engine) -> None:
    """Four submits of 600 jobs at once (MySQL: multi-row inserts of 256, 256, 64, 16 and 8 rows,
    their ids read as one block from LAST_INSERT_ID(); the others: RETURNING). Every returned id
    names the row of its own key: ids handed out interleaved between the concurrent inserts
    (what innodb_autoinc_lock_mode = 2 does to bulk inserts) would label rows of another submit."""
    barrier = threading.Barrier(4)
    got: dict[str, int] = {}

    def one(t: int) -> None:
        items = [{"key": f"{t}-{i}", "type": "t", "args": {"k": f"{t}-{i}"}} for i in range(600)]
        barrier.wait()
        got.update(jobq.submit(engine, items))

    threads = [threading.Thread(target=one, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(got) == 2400 and len(set(got.values())) == 2400
    assert _mislabelled(engine, got) == []


@needs(no="returning")  # the driver's insert_block
@pytest.mark.parametrize("broken", [False, True], ids=["correct", "broken-step-1"])
def test_submit_ids_follow_auto_increment_increment(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch,
                                                    broken: bool) -> None:
    """With auto_increment_increment = 3 (as a multi-primary setup spaces ids) a multi-row
    insert's ids are 3 apart. BROKEN variant: ids assumed consecutive label the wrong rows."""
    if broken:
        monkeypatch.setattr(type(jobq._prepare(engine)), "autoinc_step", lambda self, conn: 1)
    items = [{"key": f"k{i}", "type": "t", "args": {"k": f"k{i}"}} for i in range(300)]
    with engine.begin() as conn:
        conn.execute(sa.text("SET SESSION auto_increment_increment = 3"))
        try:
            ids = jobq.submit(conn, items)
        finally:
            conn.execute(sa.text("SET SESSION auto_increment_increment = 1"))
    wrong = _mislabelled(engine, ids)
    assert (len(wrong) > 0) if broken else (wrong == []), wrong[:5]

"""enqueue: what it stores, and bad input that is refused with nothing written."""

from __future__ import annotations

import datetime as dt
import decimal
import math

import pytest
import sqlalchemy as sa
from sqlalchemy import orm

import jobq
from dbs import needs
from helpers import snapshot, state

UTC = dt.UTC


def test_enqueue_stores_a_ready_job_with_its_args(engine: sa.Engine) -> None:
    """A job with no upstreams is stored ready, its args (non-ASCII text, emoji, 62-bit ints,
    nesting) and options read back exactly as given, with no attempt, result or error yet."""
    args = {"name": "café ☕ 🚀", "n": 2**62, "x": 1.5, "ok": True, "none": None, "nested": {"l": [1, "a", None]}}
    jid = jobq.enqueue(engine, "resize", args, group_key="tenant-😀", weight=3, max_attempts=5, timeout=12.5)
    info = jobq.get(engine, jid)
    assert info is not None
    assert (info.type, info.state, info.args, info.group_key, info.weight) == ("resize", "ready", args, "tenant-😀", 3)
    assert (info.attempts, info.max_attempts, info.timeout, info.result, info.error) == (0, 5, 12.5, None, None)


def test_tuples_are_stored_as_lists(engine: sa.Engine) -> None:
    """Tuples in args, however deep, are accepted and come back as lists (their JSON form)."""
    jid = jobq.enqueue(engine, "t", {"pair": (1, 2), "deep": [(3, (4,))]})
    assert jobq.get(engine, jid).args == {"pair": [1, 2], "deep": [[3, [4]]]}  # type: ignore[union-attr]


def test_get_returns_none_for_a_missing_job(engine: sa.Engine) -> None:
    """get() of an id that does not exist returns None instead of raising."""
    assert jobq.get(engine, 424242) is None


def test_type_names_are_case_sensitive_on_every_dialect(engine: sa.Engine) -> None:
    """utf8mb4_bin on MySQL/MariaDB: a worker for "foo" must not claim "Foo"."""
    upper = jobq.enqueue(engine, "Foo")
    lower = jobq.enqueue(engine, "foo")
    assert jobq.claim(engine, "w", 30, types=["foo"]) == lower
    assert jobq.claim(engine, "w", 30, types=["foo"]) is None
    assert state(engine, upper) == "ready"


def _deep(n: int) -> dict:
    v: dict = {}
    for _ in range(n):
        v = {"a": v}
    return v


BAD_INPUTS = [
    pytest.param(dict(type="t", args=[1, 2]), "JSON object", id="args-not-dict"),
    pytest.param(dict(type="t", args={"x": math.nan}), "NaN", id="nan"),
    pytest.param(dict(type="t", args={"x": math.inf}), "NaN and Infinity", id="infinity"),
    pytest.param(dict(type="t", args={"x": "a\x00b"}), "NUL", id="nul-char"),
    pytest.param(dict(type="t", args={"x": "\ud800"}), "surrogate", id="lone-surrogate"),
    pytest.param(dict(type="t", args={1: "a"}), "keys must be strings", id="int-key"),
    pytest.param(dict(type="t", args={"x": dt.datetime(2020, 1, 1)}), "datetime is not JSON", id="datetime"),
    pytest.param(dict(type="t", args={"x": decimal.Decimal("1.5")}), "Decimal", id="decimal"),
    pytest.param(dict(type="t", args={"x": {1, 2}}), "set", id="set"),
    pytest.param(dict(type="t", args={"x": b"raw"}), "bytes", id="bytes"),
    pytest.param(dict(type="t", args={"x": object()}), "object", id="object"),
    pytest.param(dict(type="t", args={"x": 2**63}), "64 bits", id="int-too-big"),
    pytest.param(dict(type="t", args=_deep(40)), "MAX_JSON_DEPTH", id="too-deep"),
    pytest.param(dict(type="t", args={"x": "y" * (jobq.MAX_JSON_BYTES + 1)}), "MAX_JSON_BYTES", id="too-big"),
    pytest.param(dict(type=""), "non-empty", id="empty-type"),
    pytest.param(dict(type=None), "non-empty", id="type-none"),
    pytest.param(dict(type="t" * 201), "limit is 200", id="type-too-long"),
    pytest.param(dict(type="t", group_key=""), "group_key", id="empty-group"),
    pytest.param(dict(type="t", weight=0), "weight", id="weight-zero"),
    pytest.param(dict(type="t", weight=-2), "weight", id="weight-negative"),
    pytest.param(dict(type="t", weight=True), "weight must be an int", id="weight-bool"),
    pytest.param(dict(type="t", weight=1.5), "weight must be an int", id="weight-float"),
    pytest.param(dict(type="t", weight=2**63), "weight", id="weight-huge"),
    pytest.param(dict(type="t", max_attempts=0), "max_attempts", id="max-attempts-zero"),
    pytest.param(dict(type="t", timeout=0), "timeout", id="timeout-zero"),
    pytest.param(dict(type="t", timeout=math.nan), "timeout", id="timeout-nan"),
    pytest.param(dict(type="t", timeout=math.inf), "timeout", id="timeout-inf"),
    pytest.param(dict(type="t", run_after=dt.datetime(2030, 1, 1)), "naive", id="naive-run-after"),
    pytest.param(dict(type="t", run_after=dt.datetime(1900, 1, 1, tzinfo=UTC)), "outside", id="run-after-1900"),
    pytest.param(dict(type="t", run_after="tomorrow"), "aware datetime", id="run-after-str"),
    pytest.param(dict(type="t", depends_on=[999_999]), "no job with id 999999", id="unknown-dep"),
    pytest.param(dict(type="t", depends_on=5), "iterable", id="dep-not-iterable"),
    pytest.param(dict(type="t", depends_on=[True]), "positive int", id="dep-bool"),
    pytest.param(dict(type="t", parent=999_999), "no job with id 999999", id="unknown-parent"),
]


@pytest.mark.parametrize("kwargs,message", BAD_INPUTS)
def test_bad_input_is_refused_and_nothing_is_written(engine: sa.Engine, kwargs: dict, message: str) -> None:
    """Each bad argument raises InvalidJob naming the problem, and the jobs and job_deps tables are
    row for row as before the call: a partial write would show in the snapshot."""
    jobq.enqueue(engine, "existing", {"keep": 1})  # the database is not empty before
    before = snapshot(engine)
    kwargs = dict(kwargs)
    job_type = kwargs.pop("type")
    with pytest.raises(jobq.InvalidJob, match=message):
        jobq.enqueue(engine, job_type, kwargs.pop("args", None), **kwargs)
    assert snapshot(engine) == before


def test_a_job_cannot_be_a_child_of_a_non_container(engine: sa.Engine) -> None:
    """parent= must name a container: a plain job as parent is refused with InvalidJob, and nothing
    is written."""
    plain = jobq.enqueue(engine, "t")
    before = snapshot(engine)
    with pytest.raises(jobq.InvalidJob, match=f"parent {plain} is not a container"):
        jobq.enqueue(engine, "t", parent=plain)
    assert snapshot(engine) == before


def test_a_rolled_up_container_takes_no_more_children(engine: sa.Engine) -> None:
    """A container that has rolled up (done) refuses new children with InvalidJob and nothing
    written: a late child could no longer change its outcome."""
    box = jobq.enqueue(engine, "box", container=True)
    kid = jobq.enqueue(engine, "t", parent=box)
    lease = jobq.claim_batch(engine, "w", 30)[0]
    jobq.finalize(engine, kid, {}, worker_id="w", token=lease.token)
    assert state(engine, box) == "done"
    before = snapshot(engine)
    with pytest.raises(jobq.InvalidJob, match="already rolled up"):
        jobq.enqueue(engine, "t", parent=box)
    assert snapshot(engine) == before


def test_one_bad_dependency_among_good_ones_writes_nothing(engine: sa.Engine) -> None:
    """One unknown id among good depends_on: InvalidJob, and nothing is written (no row, no edge,
    and the parent container's child count not bumped)."""
    good = jobq.enqueue(engine, "t")
    box = jobq.enqueue(engine, "box", container=True)
    before = snapshot(engine)
    with pytest.raises(jobq.InvalidJob, match="no job with id 777777"):
        jobq.enqueue(engine, "t", depends_on=[good, 777_777], parent=box)
    assert snapshot(engine) == before  # the container's child count was not bumped either


def test_enqueue_in_a_session_rolls_back_with_the_caller(engine: sa.Engine) -> None:
    """Enqueue inside the caller's transaction: the job exists only if that transaction
    commits. It is visible inside the transaction; after a rollback no row is left; after a
    commit the job is ready."""
    with orm.Session(engine) as session:
        jid = jobq.enqueue(session, "t")
        assert jobq.get(session, jid) is not None  # visible inside the transaction
        session.rollback()
    assert jobq.get(engine, jid) is None
    with orm.Session(engine) as session:
        jid = jobq.enqueue(session, "t")
        session.commit()
    assert state(engine, jid) == "ready"


@needs("row_locks")  # on SQLite the claim would wait for the writer's lock
def test_enqueue_on_a_connection_is_claimable_only_after_commit(engine: sa.Engine) -> None:
    """A job enqueued on the caller's Connection is invisible to claims on other connections until
    the caller commits, and claimable right after."""
    with engine.connect() as conn:
        jid = jobq.enqueue(conn, "t")
        assert jobq.claim(engine, "w", 30) is None  # another connection cannot see it yet
        conn.commit()
    assert jobq.claim(engine, "w", 30) == jid


def test_dependencies_on_done_failed_and_duplicate_ids(engine: sa.Engine) -> None:
    """Upstreams that already finished, and repeated ids: a done upstream counts as satisfied,
    a repeated edge counts once, and an upstream that already failed fails the new job at once
    (naming it) instead of leaving it waiting forever."""
    up = jobq.enqueue(engine, "t", max_attempts=1)
    other = jobq.enqueue(engine, "t", max_attempts=1)
    lease = jobq.claim_batch(engine, "w", 30)[0]
    jobq.finalize(engine, lease.id, {"v": 1}, worker_id="w", token=lease.token)
    after_done = jobq.enqueue(engine, "t", depends_on=[lease.id, lease.id])
    assert state(engine, after_done) == "ready"
    assert jobq.get(engine, after_done).depends_on == (lease.id,)  # type: ignore[union-attr]
    second = jobq.claim_batch(engine, "w", 30)[0]
    assert jobq.fail(engine, second.id, "boom", worker_id="w", token=second.token) == "failed"
    doomed = jobq.enqueue(engine, "t", depends_on=[up, other])
    info = jobq.get(engine, doomed)
    assert info is not None and info.state == "failed"
    assert info.error == f"upstream job {second.id} failed"


def test_run_after_accepts_a_timedelta_from_database_now(engine: sa.Engine) -> None:
    """run_after=timedelta counts from the database's now: the job is not claimable yet, and its
    run_after is an hour after its created_at."""
    jid = jobq.enqueue(engine, "t", run_after=dt.timedelta(hours=1))
    assert jobq.claim(engine, "w", 30) is None
    info = jobq.get(engine, jid)
    assert info is not None
    assert dt.timedelta(minutes=59) < info.run_after - info.created_at <= dt.timedelta(hours=1)

"""Claim promises under hostile load: a rate limit holds when SKIP LOCKED leaves another group
short, and a claim succeeds with thousands of groups holding ready work (issue 20, items 3
and 19)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

import jobq
from dbs import needs
from helpers import db_now


def _ready_rows(engine: sa.Engine, groups: dict[str, int]) -> None:
    now = db_now(engine)
    base = dict(type="t", args={}, state="ready", is_container=False, weight=1, run_after=now, created_at=now,
                updated_at=now, attempts=0, max_attempts=3, in_flight=False, cancel_requested=False,
                pending_deps=0, pending_children=0, failed_children=0)
    rows = [dict(base, group_key=g) for g, n in groups.items() for _ in range(n)]
    with engine.begin() as conn:
        for i in range(0, len(rows), 1000):
            conn.execute(sa.insert(jobq.Job.__table__), rows[i:i + 1000])


@needs("row_locks")  # SKIP LOCKED; SQLite has one writer
def test_rate_limit_holds_when_skip_locked_leaves_another_group_short(engine: sa.Engine) -> None:
    """Group A may start 2 jobs per minute; group B's ready rows are row-locked by another
    transaction (an application's SELECT ... FOR UPDATE), so the claim's first round comes up
    short on B and re-ranks. Correct: A still gets at most 2 starts. The bug: the re-rank
    offers A its full (rate-clamped) count again, and A gets 4."""
    _ready_rows(engine, {"A": 10, "B": 10})
    jobs = jobq.Job.__table__
    # READ COMMITTED, as jobq's own transactions: at REPEATABLE READ InnoDB keeps a lock on
    # every row its scan read, A's included, and the test would prove nothing.
    holder = engine.connect().execution_options(isolation_level="READ COMMITTED")
    try:
        b_ids = list(holder.execute(sa.select(jobs.c.id).where(jobs.c.group_key == "B")).scalars())
        # One primary-key lookup per row: on a table this small MariaDB answers an IN list by
        # scanning an index, locking every row it passes (A's too).
        held = [holder.execute(sa.select(jobs.c.id).where(jobs.c.id == i).with_for_update()).scalar() for i in b_ids]
        assert len(held) == 10
        leases = jobq.claim_batch(engine, "w", 30, limit=10, rate_limits={"A": (2, 60.0)})
    finally:
        holder.rollback()
        holder.close()
    by_group = [lease.group_key for lease in leases]
    assert by_group.count("B") == 0
    assert by_group.count("A") == 2
    # and the window is spent: nothing more for A within the minute
    assert [lease.group_key for lease in jobq.claim_batch(engine, "w", 30, limit=10, rate_limits={"A": (2, 60.0)})
            ].count("A") == 0


@pytest.mark.timeout(300)
def test_a_claim_succeeds_with_thousands_of_groups_ready(engine: sa.Engine) -> None:
    """5,000 groups each hold one ready job. Correct: a claim leases a job (and a larger batch
    leases as many as asked, one per group). The bug (Oracle MySQL): the recursive skip scan
    over groups stops at cte_max_recursion_depth (1,000) with error 3636, so every claim
    fails and a Worker only logs db_error, forever."""
    _ready_rows(engine, {f"g{i:05d}": 1 for i in range(5000)})
    assert len(jobq.claim_batch(engine, "w", 30, limit=1)) == 1
    leases = jobq.claim_batch(engine, "w", 30, limit=20)
    assert len(leases) == 20 and len({lease.group_key for lease in leases}) == 20


@pytest.mark.timeout(300)
def test_consecutive_claims_cycle_through_every_group_whatever_their_number(engine: sa.Engine) -> None:
    """1,500 groups each hold one ready job; claims of 500 rank a window of 500 groups after
    the previous window. Correct: three claims lease every job, each group once. The bugs: a
    window that never moves (the same 500 groups forever; here they run dry, so the claim
    would come back short), or MariaDB's old unbounded skip scan, cut after 1,001 groups by
    max_recursive_iterations (the last 499 groups were never ranked)."""
    _ready_rows(engine, {f"g{i:05d}": 1 for i in range(1500)})
    seen: list[str] = []
    for _ in range(3):
        leases = jobq.claim_batch(engine, "w", 30, limit=500)
        assert len(leases) == 500
        seen += [lease.group_key for lease in leases]
    assert sorted(seen) == [f"g{i:05d}" for i in range(1500)]


def test_a_claim_looks_past_groups_with_nothing_runnable(engine: sa.Engine) -> None:
    """The first groups in key order hold only jobs scheduled for later or paused; one group
    further on has a due job. Correct: a claim of one slot leases that job at once (the window
    extends past groups with nothing runnable). The bug: a window of one group, "a", and an
    empty claim while work is due."""
    import datetime as dt

    with engine.begin() as conn:
        for g in ("a", "b", "c"):
            jobq.enqueue(conn, "t", group_key=g, run_after=dt.timedelta(hours=1))
        jobq.enqueue(conn, "t", group_key="d")
        due = jobq.enqueue(conn, "t", group_key="z")
    jobq.set_group(engine, "d", paused=True)
    (lease,) = jobq.claim_batch(engine, "w", 30, limit=1)
    assert lease.id == due


def _broken_concat_ids(runnable: int, ids: str | None, limit: int) -> list[int] | None:
    """The broken variant: trusts whatever GROUP_CONCAT sent back, even a list it cut short."""
    return [int(i) for i in (ids or "").split(";") if i][:limit] if runnable else []


@needs("ranged_group_scan")  # the range read that is the window read too
@pytest.mark.parametrize("broken", [False, True], ids=["jobq", "broken-variant"])
def test_a_window_read_cut_by_group_concat_max_len_is_read_again(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch,
                                                               broken: bool) -> None:
    """The MySQL/MariaDB group scan sends each group's runnable ids back as one GROUP_CONCAT
    string, which the server cuts at group_concat_max_len (1,024 bytes by default on MySQL).
    With the limit at 4 bytes every list of 5 ids is cut. Correct: the claim notices (no
    final ";", fewer ids than runnable) and reads those groups again, so it still leases all
    10 jobs of the two groups, highest priority first. The broken variant takes the cut list
    for the whole one and leases fewer."""
    _ready_rows(engine, {"g0": 5, "g1": 5})
    if broken:
        monkeypatch.setattr(jobq, "_concat_ids", _broken_concat_ids)
    short = sa.create_engine(engine.url)

    @sa.event.listens_for(short, "connect")
    def _short_concat(dbapi_conn, _record) -> None:  # noqa: ANN001
        with dbapi_conn.cursor() as cur:
            cur.execute("SET SESSION group_concat_max_len = 4")

    try:
        leases = jobq.claim_batch(short, "w", 30, limit=10, types=["t"])
    finally:
        short.dispose()
    with engine.connect() as conn:
        every = set(conn.execute(sa.select(jobq.Job.__table__.c.id)).scalars())
    if broken:
        assert len(leases) < 10
    else:
        assert {lease.id for lease in leases} == every and len(leases) == 10


def _scans(d: jobq._Dialect) -> list[object]:
    """Every statement a group scan may run on this engine."""
    return [jobq._q_ready_groups(d), *(f(d, t) for t in (False, True)
            for f in (jobq._q_ready_groups_read, jobq._q_ready_groups_ranged_read))]


def _claimed_with_statements(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, limit: int) -> tuple[list[str], list[object]]:
    seen: list[object] = []
    real = jobq._hot_rows

    def spy(conn: sa.Connection, stmt: object, params: object) -> list[object]:
        seen.append(stmt)
        return real(conn, stmt, params)  # type: ignore[arg-type]

    monkeypatch.setattr(jobq, "_hot_rows", spy)
    leases = jobq.claim_batch(engine, "w", 30, limit=limit, max_in_flight=100)
    monkeypatch.undo()
    return [lease.group_key for lease in leases], seen


def _without_span(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: every claim scans groups, as before the span was read."""
    real = jobq._GroupScan.__init__

    def init(self: jobq._GroupScan, *args: object, **kw: object) -> None:
        real(self, *args, **kw)  # type: ignore[arg-type]
        self.span_first = False

    monkeypatch.setattr(jobq._GroupScan, "__init__", init)


@pytest.mark.parametrize("broken", [False, True], ids=["jobq", "broken-variant"])
def test_a_claim_with_one_group_ready_scans_no_groups(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch,
                                                      broken: bool) -> None:
    """One group holds all the ready work (the common case: every job in "default"). Correct:
    the claim reads the first and last group with ready work together with its in-flight
    counts, finds them the same, and leases without a group scan. With two groups it scans,
    and both get their share. The broken variant scans groups on every claim."""
    d = jobq._prepare(engine)
    assert d.span_first  # every engine: a scan costs a round trip on servers, 40 µs on SQLite
    _ready_rows(engine, {"only": 6})
    if broken:
        _without_span(monkeypatch)
    groups, seen = _claimed_with_statements(engine, monkeypatch, 4)
    assert groups == ["only"] * 4
    assert jobq._Q_SLOTS_AND_SPAN in seen
    scanned = [s for s in seen if any(s is scan for scan in _scans(d))]
    if broken:
        assert scanned
        return
    assert not scanned
    _ready_rows(engine, {"another": 2})
    groups, seen = _claimed_with_statements(engine, monkeypatch, 4)
    assert sorted(groups) == ["another", "another", "only", "only"]
    assert any(s is scan for s in seen for scan in _scans(d))


def test_the_span_of_groups_is_read_with_the_in_flight_counts(engine: sa.Engine) -> None:
    """_slots_and_span: the same counts as _in_flight_counts, and the first and last group
    whose jobs are ready (a leased job's group is not ready work; no ready work, no span)."""
    now = db_now(engine)
    _ready_rows(engine, {"k": 2, "c": 1, "x": 1})
    (leased,) = jobq.claim_batch(engine, "w", 30, limit=1, group_caps={"c": 0, "k": 0})
    assert leased.group_key == "x"
    with engine.connect() as conn:
        assert jobq._slots_and_span(conn, now) == (jobq._in_flight_counts(conn, now), ("c", "k"))
        assert jobq._in_flight_counts(conn, now) == {"x": 1}
        conn.execute(sa.update(jobq.Job.__table__).values(state="waiting").where(jobq.Job.__table__.c.state == "ready"))
        assert jobq._slots_and_span(conn, now) == ({"x": 1}, (None, None))
        conn.rollback()

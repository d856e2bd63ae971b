"""Retention by stored policy: set and read it, bad input, what a round deletes (by state, by
group, never what something still needs), one round per interval across workers, two workers
applying it at once (each row deleted once, with a broken variant the check catches), and a
claim that is not blocked by a retention batch holding its locks."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
from dbs import needs
from helpers import FAST, JOBS, META, cli, db_now, meeting, one_line_error

DAY = dt.timedelta(days=1)
HOUR = dt.timedelta(hours=1)


def _finished(engine: sa.Engine, n: int, *, group: str = "g", state: str = "done", age: dt.timedelta = 2 * HOUR) -> list[int]:
    """n jobs of ``group`` finished in ``state``, ``age`` ago (finished_at set back)."""
    ids = [jobq.enqueue(engine, "t", {}, group_key=group) for _ in range(n)]
    if state == "done":
        w = jobq.Worker(engine, {"t": lambda ctx: {}}, max_concurrency=4, **FAST)
        w._next_retention = float("inf")  # this helper's worker applies no retention
        assert w.run_until_idle(timeout=60)
    else:
        for i in ids:
            jobq.cancel(engine, i)
    with engine.begin() as conn:
        conn.execute(sa.update(JOBS).where(JOBS.c.id.in_(ids)).values(state=state, finished_at=db_now(engine) - age))
    return ids


def _left(engine: sa.Engine, ids: list[int]) -> set[int]:
    with engine.connect() as conn:
        return set(conn.execute(sa.select(JOBS.c.id).where(JOBS.c.id.in_(ids))).scalars())


def test_the_policy_is_stored_and_read_back(engine: sa.Engine) -> None:
    assert jobq.get_retention(engine) == jobq.RetentionPolicy(None, None, None, None, None)
    g = jobq.set_retention(engine, done=7 * DAY, failed=30 * DAY)
    assert (g.group_key, g.done, g.failed, g.cancelled) == (None, 7 * DAY, 30 * DAY, None) and g.updated_at is not None
    b = jobq.set_retention(engine, "b", cancelled=HOUR)
    assert jobq.set_retention(engine, failed=jobq.UNLIMITED).failed is None
    assert jobq.get_retention(engine).done == 7 * DAY  # left alone by the later call
    assert [(p.group_key, p.done, p.failed, p.cancelled) for p in jobq.retention_policies(engine)] == [
        (None, 7 * DAY, None, None), ("b", None, None, b.cancelled)]


@pytest.mark.parametrize("kw, needle", [
    ({"done": dt.timedelta(seconds=59)}, "shorter than 0:01:00"),
    ({"done": -DAY}, "retention done"),
    ({"failed": 3600}, "retention failed"),
    ({"group_key": ""}, "group_key"),
    ({"group_key": "a\nb", "done": DAY}, "group_key"),
])
def test_bad_retention_input_is_one_clear_error(engine: sa.Engine, kw: dict[str, Any], needle: str) -> None:
    with pytest.raises((jobq.ConfigError, jobq.InvalidJob)) as caught:
        jobq.set_retention(engine, **kw)
    assert needle in str(caught.value) and "\n" not in str(caught.value)
    assert jobq.retention_policies(engine) == []


def test_a_round_deletes_by_state_and_group_and_keeps_what_is_needed(engine: sa.Engine) -> None:
    """Global: done 1h, cancelled 1 day. Group b: done 1 day. A done job of group a 2h old goes;
    b's stays; a cancelled job 2h old stays (its age is a day); a done job an unfinished job
    depends on stays, as prune keeps it."""
    old_a = _finished(engine, 3, group="a")
    old_b = _finished(engine, 2, group="b")
    cancelled = _finished(engine, 2, group="a", state="cancelled")
    needed = _finished(engine, 1, group="a")
    waiting = jobq.enqueue(engine, "never", {}, depends_on=needed, run_after=dt.datetime(2100, 1, 1, tzinfo=dt.UTC))
    jobq.set_retention(engine, done=HOUR, cancelled=DAY)
    jobq.set_retention(engine, "b", done=DAY)
    assert jobq.apply_retention(engine, batch=2) == 3
    assert _left(engine, old_a + old_b + cancelled + needed + [waiting]) == {*old_b, *cancelled, *needed, waiting}
    jobq.set_retention(engine, "b", done=HOUR)
    jobq.set_retention(engine, cancelled=HOUR)
    assert jobq.apply_retention(engine) == 4 and _left(engine, old_b + cancelled) == set()


def test_one_worker_takes_each_round(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The round is taken by one update of jobq_meta's retention row: a second try within the
    interval gets None and deletes nothing. A worker applies it on its own first tick."""
    ids = _finished(engine, 3)
    jobq.set_retention(engine, done=HOUR)
    assert jobq._retention_turn(engine, 3600) == 3
    more = _finished(engine, 2)
    assert jobq._retention_turn(engine, 3600) is None and _left(engine, more) == set(more)
    with engine.begin() as conn:  # the round is due again
        conn.execute(sa.update(META).where(META.c.key == "retention_due").values(value=""))
    w = jobq.Worker(engine, {"t": lambda ctx: {}}, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=60) and _left(engine, ids + more) == set()


def _race(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, hold: str | None) -> tuple[int, list[int], int]:
    """Two threads apply retention at once (batch 5) to 12 eligible jobs. With ``hold`` (a
    checkpoint) both reach it with their first batch before either goes on ("prune_read": both
    read before either locks; engines with row locks only: SQLite's BEGIN IMMEDIATE lets one in
    at a time). Returns (eligible, what each reported deleted, rows left of them)."""
    ids = _finished(engine, 12)
    jobq.set_retention(engine, done=HOUR)
    arrive = meeting(2)
    held: set[int] = set()

    def checkpoint(name: str, job_ids: Any = ()) -> None:
        me = threading.get_ident()
        if name == hold and job_ids and me not in held:
            held.add(me)
            arrive()

    monkeypatch.setattr(jobq, "_checkpoint", checkpoint)
    out: list[int] = []
    errors: list[BaseException] = []

    def apply() -> None:
        try:
            out.append(jobq.apply_retention(engine, batch=5))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=apply) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return len(ids), out, len(_left(engine, ids))


def test_two_workers_applying_retention_at_once_delete_each_row_once(engine: sa.Engine, dialect: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Correct: the two counts add up to the eligible jobs and none is left; each batch is
    locked and checked again before its delete, so the slower one finds the rows gone. A
    retention that deleted by the ids it read would count rows twice (see the broken variant)."""
    eligible, counts, left = _race(engine, monkeypatch, None if dialect == "sqlite" else "prune_read")
    assert sum(counts) == eligible and left == 0, counts


def _by_id_only(d: Any, ids: Any, states: Any, cutoff: dt.datetime, extra: Any = ()) -> sa.Select[Any]:
    """BROKEN: the batch as read, by id only: no lock, no second look."""
    return sa.select(JOBS.c.id).where(JOBS.c.id.in_(ids)).order_by(JOBS.c.id)


@needs("row_locks")
def test_the_race_check_catches_a_retention_that_deletes_by_the_ids_it_read(engine: sa.Engine,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Both threads hold their batch after its (broken) second look, so both delete it and
    count it: the sum exceeds the eligible jobs. (With the real second look the slower thread
    waits for the first one's row locks and never reaches that point with the same batch.)"""
    monkeypatch.setattr(jobq, "_q_lock_prunable", _by_id_only)
    eligible, counts, left = _race(engine, monkeypatch, "prune_locked")
    assert sum(counts) > eligible, f"not caught: {counts} for {eligible}"


@needs("row_locks")
def test_a_claim_is_not_blocked_by_a_retention_batch(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a retention batch holds its locks (at "prune_locked", before its delete), a claim
    on another connection leases a ready job and commits. A retention that locked what the
    claim reads (the claim lock row, ready rows) would leave the claim waiting: it would not
    finish before the batch does, and the batch waits for it here."""
    _finished(engine, 4)
    ready = jobq.enqueue(engine, "t", {})
    jobq.set_retention(engine, done=HOUR)
    other = sa.create_engine(engine.url)
    claimed: list[Any] = []

    def claim() -> None:
        claimed.extend(jobq.claim_batch(other, "w", 60, limit=1))

    def checkpoint(name: str, job_ids: Any = ()) -> None:
        if name == "prune_locked" and job_ids and not claimed:
            t = threading.Thread(target=claim)
            t.start()
            t.join(60)
            assert not t.is_alive(), "the claim waited for the retention batch"

    monkeypatch.setattr(jobq, "_checkpoint", checkpoint)
    try:
        assert jobq.apply_retention(engine) == 4
    finally:
        other.dispose()
    assert [lease.id for lease in claimed] == [ready]


def test_jobq_retention_sets_shows_and_applies(engine: sa.Engine, db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    ids = _finished(engine, 2, group="a")
    code, out, _ = cli(db_url, "retention", capsys=capsys)
    assert code == 0 and out == "retention global: done kept, failed kept, cancelled kept\n"
    code, out, _ = cli(db_url, "retention", "--done", "1h", "--apply", capsys=capsys)
    assert code == 0 and out == "retention global: done 3600s, failed kept, cancelled kept\ndeleted 2 job(s)\n".replace(
        "3600s", "1h00m") and _left(engine, ids) == set()
    code, out, _ = cli(db_url, "retention", "--group", "a", "--failed", "7d", "--json", capsys=capsys)
    assert code == 0 and '"failed": 604800.0' in out and '"group_key": "a"' in out
    code, _, err = cli(db_url, "retention", "--done", "10s", capsys=capsys)
    assert code == 2 and one_line_error(err) and "shorter" in err

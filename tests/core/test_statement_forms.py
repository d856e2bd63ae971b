"""One statement per operation, and where a second form stays for speed, the same rows.

Each test runs an operation's forms on the same input, each in a transaction it rolls back, and
compares the rows they leave:
- the finish of leased jobs: the general builder (_q_finish: any results, any fence) and the
  forms kept for speed next to it, _q_finish_batch_same (prebuilt, one result for every row,
  run on the cursor) and, with data-modifying CTEs, _q_finish_recorded (finish and history in
  one round trip); attempt history: _q_record_ended and its prebuilt form _q_record_done;
- the lease: _q_lock_and_lease (lock, lease and start log in one statement) against the
  locking read, _q_lease and the start-log insert;
- the window read: the portable UNION, the engine's own form, and the group scan's read;
- the insert of job rows: as a batch, one at a time, and holding a unique key.
A form that drifted (a column it forgets to clear, a history row with another attempt number or
error, a candidate out of claim order, an id returned for another row) fails here;
test_a_form_that_forgets_a_column_is_caught is the broken variant.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
from dbs import needs
from helpers import ATTEMPTS, JOBS, STARTS

WORKER = "w1"
Form = Callable[[sa.Connection, Any, list[Any], dt.datetime], None]


def _leased(engine: sa.Engine, n: int) -> list[Any]:
    """n jobs, the first one failed once before (its error on the row), all leased by WORKER."""
    ids = [jobq.enqueue(engine, "t", max_attempts=3) for _ in range(n)]
    first = jobq.claim(engine, WORKER, 60)
    assert first == ids[0]
    jobq.fail(engine, first, "boom", worker_id=WORKER)
    leases = jobq.claim_batch(engine, WORKER, 60, limit=n)
    assert sorted(x.id for x in leases) == ids
    return sorted(leases, key=lambda x: x.id)


def _rows_after(engine: sa.Engine, form: Form, leases: list[Any], results: list[Any]) -> tuple[list[Any], list[Any]]:
    """Every jobs row and history row (without its own id) after ``form``, which is rolled back."""
    d = jobq._prepare(engine)
    a = ATTEMPTS.c
    now = leases[0].expires  # one time for every form: the rows compare equal only then
    with engine.connect() as conn:
        with conn.begin() as tx:
            outcomes = [jobq._Outcome(x.id, WORKER, x.token, "done", result=r) for x, r in zip(leases, results, strict=True)]
            form(conn, d, outcomes, now)
            jobs = [tuple(r) for r in conn.execute(sa.select(JOBS).order_by(JOBS.c.id))]
            hist = [tuple(r) for r in conn.execute(
                sa.select(a.job_id, a.attempt, a.worker_id, a.started_at, a.finished_at, a.outcome, a.error)
                .order_by(a.job_id, a.attempt, a.outcome))]
            tx.rollback()
    return jobs, hist


def _ended(outcomes: list[Any]) -> list[tuple[int, str, str | None]]:
    return [(o.job_id, "done", o.owner) for o in outcomes]


def general(conn: sa.Connection, d: Any, outcomes: list[Any], now: dt.datetime) -> None:
    """The general forms: _q_finish per job, then _q_record_ended."""
    for o in outcomes:
        assert conn.execute(jobq._q_finish(d, [o], o.owner, o.token, now)).rowcount == 1
    conn.execute(jobq._q_record_ended(d, _ended(outcomes), now))


def general_batch(conn: sa.Connection, d: Any, outcomes: list[Any], now: dt.datetime) -> None:
    """_q_finish for the whole batch (a CASE on the id for the results), then _q_record_ended."""
    assert conn.execute(jobq._q_finish(d, outcomes, WORKER, outcomes[0].token, now)).rowcount == len(outcomes)
    conn.execute(jobq._q_record_ended(d, _ended(outcomes), now))


def prebuilt(conn: sa.Connection, d: Any, outcomes: list[Any], now: dt.datetime) -> None:
    """What a worker's tick runs without CTEs: _q_finish_batch (prebuilt when the results agree)
    and _q_record_attempts (prebuilt _q_record_done), on the cursor."""
    stmt, params = jobq._q_finish_batch(d, outcomes, WORKER, outcomes[0].token, now)
    assert jobq._hot_rowcount(conn, stmt, params) == len(outcomes)
    jobq._hot_rowcount(conn, *jobq._q_record_attempts(d, _ended(outcomes), now))


def recorded(conn: sa.Connection, d: Any, outcomes: list[Any], now: dt.datetime) -> None:
    """_q_finish_recorded: finish and history in one statement (engines with data-modifying CTEs)."""
    stmt, params = jobq._q_finish_batch(d, outcomes, WORKER, outcomes[0].token, now)
    assert params is not None
    assert jobq._hot_rows(conn, jobq._q_finish_recorded(d), {**params, "b_worker": WORKER})[0][0] == len(outcomes)


def _forms(engine: sa.Engine) -> dict[str, Form]:
    forms: dict[str, Form] = {"general": general, "general_batch": general_batch, "prebuilt": prebuilt}
    if jobq._prepare(engine).dml_ctes:
        forms["recorded"] = recorded
    return forms


@pytest.mark.parametrize("result", [None, {"ok": [1, 2]}], ids=["none", "json"])
def test_every_finish_form_writes_the_same_jobs_and_history_rows(engine: sa.Engine, result: Any) -> None:
    """Three leased jobs (one on its second attempt, its first attempt's error on the row), one
    result for all: each form leaves the same rows. A wrong row: a form that kept the error,
    the lease, another attempt number or time, or no history row."""
    leases = _leased(engine, 3)
    forms = _forms(engine)
    rows = {name: _rows_after(engine, form, leases, [result] * 3) for name, form in forms.items()}
    jobs, hist = rows["general"]
    assert [r[1:3] for r in hist][-3:] == [(leases[0].attempt, WORKER), (1, WORKER), (1, WORKER)]
    assert len(hist) == 4 and [r[5] for r in hist] == ["failed", "done", "done", "done"]
    assert [(r["state"], r["result"], r["error"], r["lease_owner"]) for r in _job_rows(rows["general"])] == [
        ("done", result, None, None)] * 3
    for name, got in rows.items():
        assert got == (jobs, hist), name


def test_the_batch_with_several_results_writes_what_one_finish_a_job_writes(engine: sa.Engine) -> None:
    """Different results per row: _q_finish_batch takes the CASE form; it writes what _q_finish
    per job does, each row its own result."""
    leases = _leased(engine, 3)
    results = [{"n": 1}, None, "x"]
    one = _rows_after(engine, general, leases, results)
    assert jobq._q_finish_batch(jobq._prepare(engine), [jobq._Outcome(x.id, WORKER, x.token, "done", result=r)
                                                        for x, r in zip(leases, results, strict=True)],
                                WORKER, leases[0].token, dt.datetime(2030, 1, 1))[1] is None  # the CASE form
    assert _rows_after(engine, prebuilt, leases, results) == one
    assert [r["result"] for r in _job_rows(one)] == results


def _job_rows(rows: tuple[list[Any], list[Any]]) -> list[Any]:
    cols = [c.name for c in JOBS.c]
    return [dict(zip(cols, r, strict=True)) for r in rows[0]]


def test_a_form_that_forgets_a_column_is_caught(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: a prebuilt finish that leaves the lease's expiry on the row is told
    apart from the general form by the comparison above."""
    leases = _leased(engine, 2)
    good = _rows_after(engine, general, leases, [None, None])
    d = jobq._prepare(engine)
    broken = jobq._q_finish_batch_same(d).values(lease_expires=JOBS.c.lease_expires)
    monkeypatch.setattr(jobq, "_q_finish_batch_same", lambda d: broken)
    assert _rows_after(engine, prebuilt, leases, [None, None]) != good


def _claimed(engine: sa.Engine, d: Any, groups: list[str]) -> tuple[list[Any], list[Any], list[Any]]:
    """What one claim of everything ready leaves, through ``d``'s forms, rolled back: the
    leases, the jobs rows and the start log, without the claim's random token."""
    now = dt.datetime(2030, 1, 1)
    token = [c.name for c in JOBS.c].index("lease_token")
    with engine.connect() as conn:
        with conn.begin() as tx:
            leases = jobq._lease_rows(conn, d, worker_id=WORKER, ttl=60, now=now, limit=len(groups), types=None,
                                      max_in_flight=None, group_caps={"g1": 2}, state="leased")
            jobs = [tuple(v for i, v in enumerate(r) if i != token)
                    for r in conn.execute(sa.select(JOBS).order_by(JOBS.c.id))]
            starts = sorted(tuple(r[1:]) for r in conn.execute(sa.select(STARTS)))
            tx.rollback()
    return [dataclasses.replace(x, token="") for x in leases], jobs, starts


@needs("dml_ctes")  # data-modifying WITH: the claim's lock and lease as one statement
@pytest.mark.parametrize("one_group", [False, True], ids=["window", "one-group"])
def test_the_lease_in_the_claims_statement_writes_what_the_separate_lease_writes(engine: sa.Engine, one_group: bool) -> None:
    """_q_lock_and_lease (lock, lease and start log in one statement) against the locking read
    followed by _q_lease and the start log: the same leases, jobs rows and start-log rows,
    for the window over several groups and for a claim of one group."""
    groups = ["g1"] * 3 if one_group else ["g1", "g1", "g1", "g2", "g3"]
    for i, g in enumerate(groups):
        jobq.enqueue(engine, "t", group_key=g, priority=i % 2)
    d = jobq._prepare(engine)
    assert d.dml_ctes
    together = _claimed(engine, d, groups)
    apart = _claimed(engine, dataclasses.replace(d, dml_ctes=False), groups)
    assert together[0] and together == apart
    assert {r.group_key for r in together[0]} == set(groups)


def _window_data(engine: sa.Engine) -> dt.datetime:
    """Twelve groups: some with more runnable jobs than the read's limit, priorities and weights
    mixed, two types, jobs not yet due, and one group whose ready jobs are all for later."""
    for g in range(12):
        for k in range(g % 5 + 1):
            jobq.enqueue(engine, "t" if k % 2 == 0 else "u", group_key=f"g{g:02}", priority=(g + k) % 3,
                         weight=1 + (g * k) % 4)
        jobq.enqueue(engine, "t", group_key=f"g{g:02}", run_after=dt.timedelta(hours=1))
    jobq.enqueue(engine, "t", group_key="later", run_after=dt.timedelta(hours=1))
    with engine.connect() as conn:
        return jobq._prepare(engine).db_now(conn) + dt.timedelta(minutes=1)


@pytest.mark.parametrize("types", [None, ["t"]], ids=["any-type", "typed"])
def test_every_window_read_gives_the_same_candidates(engine: sa.Engine, types: list[str] | None) -> None:
    """The window's candidates per group (first ``limit`` runnable ids in claim order, largest
    weight among them), read by the portable UNION of LIMITed selects and by this engine's own
    form (PostgreSQL's LATERAL over an array, SQLite's JSON array), and as the group scan reads
    them with the groups (d.scan_reads_window; MySQL/MariaDB's ranged read): the same, group
    for group. The scans find the same groups as the plain skip scan."""
    now = _window_data(engine)
    d = jobq._prepare(engine)
    union = dataclasses.replace(d, lateral_arrays=False, json_id_lists=False)
    plain = dataclasses.replace(d, scan_reads_window=False, ranged_group_scan=False, span_first=False)
    limit = 3
    with engine.connect() as conn:
        groups = jobq._GroupScan(conn, plain, types, now, limit).take(100)
        assert groups == [f"g{g:02}" for g in range(12)] + ["later"]
        want = jobq._window_candidates(conn, union, groups, now, types, limit, {})
        assert len(want) == 12 and all(0 < len(ids) <= limit for ids, _w in want.values())
        assert jobq._window_candidates(conn, d, groups, now, types, limit, {}) == want
        scan = jobq._GroupScan(conn, d, types, now, limit)
        assert scan.take(100) == groups
        for g, (ids, w) in scan.read.items():
            assert (ids, w) == want[g] if ids else g not in want, g
        assert scan.read or not (d.scan_reads_window or d.ranged_group_scan)
        conn.rollback()


def _job_rows_for(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The rows a submit of three different jobs hands to _insert_rows (then rolled back)."""
    seen: list[list[dict[str, Any]]] = []
    real = jobq._insert_rows
    monkeypatch.setattr(jobq, "_insert_rows", lambda conn, d, rows: seen.append([dict(r) for r in rows]) or real(conn, d, rows))
    jobq.submit(engine, [{"key": "a", "type": "t", "args": {"n": 1}, "group_key": "g", "priority": 2},
                         {"key": "b", "type": "u", "max_attempts": 5, "timeout": 2.5, "weight": 3},
                         {"key": "c", "type": "t", "run_after": dt.timedelta(hours=1)}])
    monkeypatch.undo()
    assert [len(r) for r in seen] == [3]
    return seen[0]


def _inserted(engine: sa.Engine, insert: Callable[[sa.Connection, Any], list[int]]) -> list[dict[str, Any]]:
    """The rows ``insert`` wrote, in the order of the ids it returned, without the ids (rolled back)."""
    d = jobq._prepare(engine)
    with engine.connect() as conn:
        with conn.begin() as tx:
            ids = insert(conn, d)
            by_id = {r["id"]: dict(r) for r in conn.execute(sa.select(jobq._jobs).where(jobq._jobs.c.id.in_(ids))).mappings()}
            tx.rollback()
    assert len(by_id) == len(ids) == len(set(ids))
    return [{k: v for k, v in by_id[i].items() if k != "id"} for i in ids]


def test_every_insert_form_writes_the_same_rows_under_the_ids_it_returns(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Job rows inserted as one batch (executemany RETURNING, or the multi-row INSERT whose ids
    come from LAST_INSERT_ID() where the engine has no RETURNING), one at a time (the prebuilt
    RETURNING on the cursor, or a one-row INSERT) and one at a time holding a unique key
    (ON CONFLICT DO NOTHING, or a plain INSERT that catches the duplicate): the same rows, each
    under the id its form returned for it. A wrong id shows as rows in another order."""
    rows = _job_rows_for(engine, monkeypatch)
    batch = _inserted(engine, lambda conn, d: jobq._insert_rows(conn, d, rows))
    assert [r["type"] for r in batch] == ["t", "u", "t"] and batch[1]["max_attempts"] == 5
    assert _inserted(engine, lambda conn, d: [i for r in rows for i in jobq._insert_rows(conn, d, [r])]) == batch
    keyed = _inserted(engine, lambda conn, d: [d.insert_unique(conn, {**r, "unique_key": f"k{n}"}) for n, r in enumerate(rows)])
    assert [r.pop("unique_key") for r in keyed] == ["k0", "k1", "k2"]
    assert keyed == [{k: v for k, v in r.items() if k != "unique_key"} for r in batch]

"""Bulk actions by filter (jobq.bulk): dry runs count and change nothing; retry, cancel and
prune follow the one-job rules (dependents re-opened or closed, a running job asked to stop,
what something needs kept); the filter's terms (state, type, group, time, error text); bad
input is one clear error; every action is in the audit log; a bulk retry while a worker runs
loses nothing and runs nothing twice; the CLI's ``jobq bulk`` and ``jobq audit``."""

from __future__ import annotations

import collections
import datetime as dt
import json
import threading
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
from helpers import FAST, JOBS, cli, db_now, one_line_error


def _failed(engine: sa.Engine, n: int, *, type: str = "t", group: str = "g", error: str = "boom") -> list[int]:
    ids = [jobq.enqueue(engine, type, {}, group_key=group, max_attempts=1) for _ in range(n)]
    for _ in ids:
        lease = jobq.claim(engine, "w", 60, types=[type])
        assert lease is not None
        jobq.fail(engine, int(lease), error, worker_id="w", token=lease.token)
    return ids


def _states(engine: sa.Engine, ids: list[int]) -> dict[int, str]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.select(JOBS.c.id, JOBS.c.state).where(JOBS.c.id.in_(ids))).all())


def test_a_dry_run_counts_and_changes_nothing(engine: sa.Engine) -> None:
    a, b = _failed(engine, 3, type="a"), _failed(engine, 2, type="b")
    r = jobq.bulk(engine, "retry", type="a", dry_run=True)
    assert (r.matched, r.applied, r.dry_run) == (3, 0, True)
    assert set(_states(engine, a + b).values()) == {"failed"} and jobq.audit_log(engine) == []


def test_bulk_retry_reopens_the_dependents_each_job_closed(engine: sa.Engine) -> None:
    """Retrying U (failed) by filter re-opens D, which U's failure closed, as retry(U) does;
    D itself matches too (failed) and is skipped: the retry of U re-opened it already."""
    [u] = _failed(engine, 1, type="u")
    d = jobq.enqueue(engine, "d", {}, depends_on=[u], group_key="g")
    assert _states(engine, [d]) == {d: "failed"}
    other = _failed(engine, 1, type="other", group="h")
    r = jobq.bulk(engine, "retry", group="g", actor="ops-test")
    assert (r.matched, r.applied, r.skipped, r.reopened) == (2, 1, 1, 2)
    assert _states(engine, [u, d, *other]) == {u: "ready", d: "waiting", other[0]: "failed"}
    [entry] = jobq.audit_log(engine)
    assert (entry.actor, entry.action, entry.count) == ("ops-test", "retry", 1)
    assert entry.filter["states"] == ["failed"] and entry.filter["group"] == "g" and entry.at.tzinfo is dt.UTC


def test_bulk_cancel_closes_dependents_and_asks_running_jobs_to_stop(engine: sa.Engine) -> None:
    ready = jobq.enqueue(engine, "t", {})
    dep = jobq.enqueue(engine, "later", {}, depends_on=[ready])
    running = jobq.enqueue(engine, "r", {})
    lease = jobq.claim(engine, "w", 60, types=["r"])
    assert lease is not None and int(lease) == running
    r = jobq.bulk(engine, "cancel", states=["ready", "waiting", "leased", "running"], type="t")
    assert (r.matched, r.applied) == (1, 1) and _states(engine, [ready, dep]) == {ready: "cancelled", dep: "cancelled"}
    r = jobq.bulk(engine, "cancel", states=["leased"])
    assert r.applied == 1 and jobq.get(engine, running).cancel_requested is True


def test_bulk_prune_matches_error_text_literally_and_keeps_what_is_needed(engine: sa.Engine) -> None:
    timeouts = _failed(engine, 2, error="TimeoutError: 100% of the_budget")
    others = _failed(engine, 2, error="KeyError: 'x'")
    needed = _failed(engine, 1, error="timeouterror again")
    waiting = jobq.enqueue(engine, "t", {}, depends_on=needed, run_after=dt.datetime(2100, 1, 1, tzinfo=dt.UTC))
    with engine.begin() as conn:  # the waiting job must stay waiting: its upstream failed, so re-open it by hand
        conn.execute(sa.update(JOBS).where(JOBS.c.id == waiting).values(state="waiting", finished_at=None))
    assert jobq.bulk(engine, "prune", states=["failed"], error="100% OF THE_", dry_run=True).matched == 2
    assert jobq.bulk(engine, "prune", states=["failed"], error="100_") .matched == 0  # "_" is no wildcard
    r = jobq.bulk(engine, "prune", states=["failed"], error="timeouterror")
    assert (r.matched, r.applied, r.skipped) == (3, 2, 1)
    assert set(_states(engine, timeouts + others + needed)) == {*others, *needed}


def test_the_time_range_bounds_creation(engine: sa.Engine) -> None:
    old, new = _failed(engine, 1), _failed(engine, 1)
    now = db_now(engine)
    with engine.begin() as conn:
        conn.execute(sa.update(JOBS).where(JOBS.c.id.in_(old)).values(created_at=now - dt.timedelta(days=2)))
    utc = now.replace(tzinfo=dt.UTC)
    assert jobq.bulk(engine, "retry", since=utc - dt.timedelta(days=1), dry_run=True).matched == 1
    r = jobq.bulk(engine, "retry", until=utc - dt.timedelta(days=1))
    assert r.applied == 1 and _states(engine, old + new) == {old[0]: "ready", new[0]: "failed"}


@pytest.mark.parametrize("action, kw, needle", [
    ("restart", {}, "action must be one of"),
    ("retry", {"states": "failed"}, "non-empty list"),
    ("retry", {"states": ["done"]}, "only jobs in failed, cancelled can be retried"),
    ("cancel", {"states": ["done"]}, "can be cancelled"),
    ("prune", {"states": ["ready"]}, "can be pruned"),
    ("retry", {"since": dt.datetime(2030, 1, 1)}, "naive"),
    ("retry", {"since": dt.datetime(2030, 1, 2, tzinfo=dt.UTC), "until": dt.datetime(2030, 1, 1, tzinfo=dt.UTC)}, "before until"),
    ("retry", {"error": ""}, "1 to 200 characters"),
    ("retry", {"error": "a\x00b"}, "no NUL"),
    ("retry", {"type": ""}, "bulk type"),
    ("retry", {"actor": "x" * 500}, "actor"),
    ("retry", {"batch": 0}, "batch"),
])
def test_bad_input_is_one_clear_error_and_changes_nothing(engine: sa.Engine, action: str, kw: dict[str, Any],
                                                          needle: str) -> None:
    ids = _failed(engine, 2)
    with pytest.raises(jobq.ConfigError) as caught:
        jobq.bulk(engine, action, **kw)
    assert needle in str(caught.value) and "\n" not in str(caught.value), caught.value
    assert set(_states(engine, ids).values()) == {"failed"} and jobq.audit_log(engine) == []


def test_bulk_retry_while_a_worker_runs_loses_nothing_and_runs_nothing_twice(engine: sa.Engine) -> None:
    """60 jobs fail their one attempt; then a worker runs while a bulk retry re-opens them, and
    once more after. Correct: every job ends done, its handler ran exactly twice (the failed
    attempt and one retry), and the bulk applied to each once. A retry applied twice, or one
    that reopened a job the worker was running, would show as 3 runs or a job not done."""
    runs: collections.Counter[int] = collections.Counter()
    lock = threading.Lock()

    def handler(ctx: jobq.JobContext) -> dict:
        with lock:
            runs[ctx.id] += 1
        if ctx.attempt == 1 and runs[ctx.id] == 1:
            raise RuntimeError("first run fails")
        return {}

    ids = [jobq.enqueue(engine, "t", {}, max_attempts=1) for _ in range(60)]
    w = jobq.Worker(engine, {"t": handler}, max_concurrency=4, **FAST)
    assert w.run_until_idle(timeout=120) and set(_states(engine, ids).values()) == {"failed"}
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            w.run_until_idle(timeout=120)

    t = threading.Thread(target=work)
    t.start()
    try:
        r = jobq.bulk(engine, "retry", batch=7)
    finally:
        stop.set()
        t.join(120)
    assert w.run_until_idle(timeout=120)
    assert (r.matched, r.applied) == (60, 60)
    assert set(_states(engine, ids).values()) == {"done"} and set(runs.values()) == {2} and len(runs) == 60


def test_jobq_bulk_and_audit(engine: sa.Engine, db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    ids = _failed(engine, 3, type="a") + _failed(engine, 1, type="b")
    code, out, _ = cli(db_url, "bulk", "retry", "--type", "a", "--dry-run", capsys=capsys)
    assert code == 0 and out.startswith("3 job(s) match") and set(_states(engine, ids).values()) == {"failed"}
    code, out, _ = cli(db_url, "bulk", "retry", "--type", "a", "--since", "1h", "--json", capsys=capsys)
    assert code == 0 and json.loads(out)["applied"] == 3
    code, out, _ = cli(db_url, "audit", capsys=capsys)
    assert code == 0 and "retry" in out and '"type": "a"' in out and "cli:" in out
    code, _, err = cli(db_url, "bulk", "retry", "--state", "done", capsys=capsys)
    assert code == 2 and one_line_error(err) and "retried" in err
    code, _, err = cli(db_url, "bulk", "explode", capsys=capsys)
    assert code == 2 and one_line_error(err)

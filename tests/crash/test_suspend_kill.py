"""SIGKILL around a suspension (issue 42): a job that waits for a signal, its worker process
killed before the suspension commits, after it, and while the re-run runs.

Correct at every point: the job runs again and finishes once, with the checkpoint it made
before it waited, and its signal's payload; no lease is left behind. A suspension charges no
attempt: killed after it committed, the job comes back through its signal alone, never
through a reclaim. The broken variant (a suspension that leaves the job leased) shows as a
reclaim in the job's history."""

from __future__ import annotations

import pathlib
import signal

import pytest
import sqlalchemy as sa

import jobq
from helpers import wait_for
from procs import SUMMARY, finalized, lines, start


def _history(engine: sa.Engine, job: int) -> list[tuple[int, str]]:
    return [(a.attempt, a.outcome) for a in jobq.attempts(engine, job)]


def _finished_once(engine: sa.Engine, job: int, logs: pathlib.Path, payload: object) -> None:
    info = jobq.get(engine, job)
    assert info is not None and info.state == "done", info
    assert info.result is not None and info.result["got"] == payload and info.result["state"] == {"prepared": 1}
    assert info.lease_owner is None and info.checkpoint == {"prepared": 1}
    assert finalized(logs)[job] == 1


def test_killed_before_the_suspension_commits(engine: sa.Engine, db_url: str, tmp_path: pathlib.Path) -> None:
    """Killed inside the suspension's transaction (the key's row locked, the job not written):
    it rolls back, the job is still leased, and the next worker reclaims it (the attempt was
    charged: the dispatch never ended). The signal sent meanwhile is read at once by attempt 2."""
    job = jobq.enqueue(engine, "waiter", {"key": "k1"})
    first = start(db_url, tmp_path, "--kill-at", "suspend_checked", "--concurrency", "1")
    assert first.wait(60) == -signal.SIGKILL
    assert jobq.get(engine, job).state == "running"  # type: ignore[union-attr]
    jobq.signal(engine, "k1", {"n": 1})
    second = start(db_url, tmp_path, "--concurrency", "1", "--until-idle", "60", "--ttl", "30")
    assert second.wait(90) == 0
    _finished_once(engine, job, tmp_path, {"n": 1})
    assert _history(engine, job) == [(1, "reclaimed"), (2, "done")]
    SUMMARY.append(f"{engine.dialect.name:<10} suspension: killed before it committed, reclaimed and finished once")


def _killed_after_suspension(engine: sa.Engine, db_url: str, tmp_path: pathlib.Path, *broken: str) -> int:
    job = jobq.enqueue(engine, "waiter", {"key": "k2"})
    first = start(db_url, tmp_path, "--concurrency", "1", *broken)
    try:
        wait_for(lambda: f"suspended {job}" in lines(tmp_path, "events"), timeout=60, what="the suspension")
    finally:
        first.kill()
        first.wait(30)
    jobq.signal(engine, "k2", [2])
    second = start(db_url, tmp_path, "--concurrency", "1", "--until-idle", "60", "--ttl", "30")
    assert second.wait(90) == 0
    return job


def test_killed_after_the_suspension_committed(engine: sa.Engine, db_url: str, tmp_path: pathlib.Path) -> None:
    """Killed once the suspension committed: the job holds no lease, so nothing is reclaimed;
    the signal alone runs it again, as attempt 1 still (not charged), and it finishes once."""
    job = _killed_after_suspension(engine, db_url, tmp_path)
    _finished_once(engine, job, tmp_path, [2])
    assert _history(engine, job) == [(1, "suspended"), (1, "done")]
    SUMMARY.append(f"{engine.dialect.name:<10} suspension: killed after it committed, woken by its signal")


def test_harness_catches_a_suspension_that_keeps_its_lease(engine: sa.Engine, db_url: str,
                                                           tmp_path: pathlib.Path) -> None:
    job = _killed_after_suspension(engine, db_url, tmp_path, "--suspend-keeps-lease")
    assert _history(engine, job) != [(1, "suspended"), (1, "done")]
    assert (1, "reclaimed") in _history(engine, job)


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_killed_while_the_rerun_runs(engine: sa.Engine, db_url: str, tmp_path: pathlib.Path, executor: str) -> None:
    """Suspended, signalled, then the re-run's worker is killed after its handler returned and
    before the finalize: the next worker reclaims it, and attempt 2 finishes it once."""
    job = jobq.enqueue(engine, "waiter", {"key": "k3"})
    first = start(db_url, tmp_path, "--concurrency", "1", "--until-idle", "60", "--executor", executor)
    assert first.wait(90) == 0
    jobq.signal(engine, "k3", "go")
    second = start(db_url, tmp_path, "--kill-at", "handler_returned", "--concurrency", "1", "--executor", executor)
    assert second.wait(60) == -signal.SIGKILL
    third = start(db_url, tmp_path, "--concurrency", "1", "--until-idle", "60", "--ttl", "30", "--executor", executor)
    assert third.wait(90) == 0
    _finished_once(engine, job, tmp_path, "go")
    assert _history(engine, job) == [(1, "suspended"), (1, "reclaimed"), (2, "done")]
    SUMMARY.append(f"{engine.dialect.name:<10} suspension: killed during the re-run ({executor}), finished once")

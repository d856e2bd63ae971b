"""Checkpoint resume after SIGKILL (issue 16): a long job checkpoints after every step; its
worker process is SIGKILLed mid-job; the next worker reclaims the job and resumes from the last
checkpoint instead of starting over."""

from __future__ import annotations

import pathlib
import signal

import pytest
import sqlalchemy as sa

import jobq
from procs import SUMMARY, lines, start


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_a_job_resumes_from_its_checkpoint_after_its_worker_is_killed(engine: sa.Engine, db_url: str, tmp_path: pathlib.Path,
                                                                      executor: str) -> None:
    """Attempt 1 runs steps 0-2, checkpointing after each, and its worker process is SIGKILLed
    right after checkpoint 3 was stored (with the process executor the handler's process
    stores it through its parent). A second worker reclaims the job once the lease expires.
    Correct: attempt 2 starts with ctx.state == {"next": 3} and runs steps 3-5 only; the job is
    done once with checkpoint {"next": 6}. A checkpoint that was not durable (or not handed to
    the next dispatch) shows as attempt 2 starting again at step 0."""
    job = jobq.enqueue(engine, "steps", {"n": 6, "kill_after": 2}, max_attempts=3)
    first = start(db_url, tmp_path, "--executor", executor, "--concurrency", "1")
    assert first.wait(60) == -signal.SIGKILL
    assert jobq.get(engine, job).checkpoint == {"next": 3}  # type: ignore[union-attr]
    # A long lease for the resuming worker: a stall must not let it reclaim its own attempt.
    second = start(db_url, tmp_path, "--executor", executor, "--concurrency", "1", "--until-idle", "60",
                   "--ttl", "30")
    assert second.wait(90) == 0
    steps = sorted(tuple(int(x) for x in line.split()) for line in lines(tmp_path, "steps"))
    assert steps == [(job, 1, 0), (job, 1, 1), (job, 1, 2), (job, 2, 3), (job, 2, 4), (job, 2, 5)]
    info = jobq.get(engine, job)
    assert info is not None and info.state == "done" and info.attempts == 2
    assert info.result == {"resumed_from": 3} and info.checkpoint == {"next": 6}
    SUMMARY.append(f"{engine.dialect.name:<10} checkpoint resume ({executor}): killed after step 2, resumed at step 3")

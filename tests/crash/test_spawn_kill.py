"""SIGKILL a real worker process after its handler spawned work (issue 16): no orphans.

The handler spawns a small DAG with ctx.submit; the worker is SIGKILLed mid-handler (after
the spawn committed), after the handler returned, or inside the finalize transaction. Correct:
the held spawns of the killed attempt never run and are deleted by the reclaim that takes the
job back; the job runs again (attempt 2) and that attempt's spawns run exactly once. A bug shows
an execution of an attempt-1 spawn, a held row left behind, or a spawn run twice.
"""

from __future__ import annotations

import pathlib
import signal

import pytest
import sqlalchemy as sa

import jobq
from procs import SUMMARY, executions, start, wait_file

jobs = jobq.Job.__table__


def _table(engine: sa.Engine) -> dict[int, sa.Row]:
    with engine.connect() as conn:
        return {r.id: r for r in conn.execute(sa.select(jobs))}


@pytest.mark.parametrize("point", ["mid_handler", "handler_returned", "finalize_before_commit"])
def test_sigkill_after_spawning_leaves_no_orphan_and_runs_the_rerun_spawns_once(
        engine: sa.Engine, db_url: str, tmp_path: pathlib.Path, point: str) -> None:
    sid = jobq.enqueue(engine, "spawner", {"n": 3, "hold": 60 if point == "mid_handler" else 0}, max_attempts=5)
    if point == "mid_handler":
        p = start(db_url, tmp_path, "--concurrency", "1")
        wait_file(tmp_path / f"spawned-{sid}-1", timeout=60)
        p.send_signal(signal.SIGKILL)
    else:
        p = start(db_url, tmp_path, "--concurrency", "1", "--kill-at", point)
    assert p.wait(60) == -signal.SIGKILL, (tmp_path / "stderr.log").read_text()[-2000:]
    first = [i for i, r in _table(engine).items() if r.state == "held"]
    assert len(first) == 3, "the killed attempt's spawns should be held (committed, not released)"

    # The recovering worker holds long leases: only the killed one's (1 s) has to expire, and a
    # stall here must not let the drain reclaim its own jobs (an extra attempt, an extra run).
    d = start(db_url, tmp_path, "--until-idle", "60", "--concurrency", "2", "--ttl", "30")
    assert d.wait(90) == 0, (tmp_path / "stderr.log").read_text()[-2000:]
    rows, execs = _table(engine), executions(tmp_path)
    spawner = rows[sid]
    assert (spawner.state, spawner.attempts) == ("done", 2)
    assert [i for i in first if i in rows or execs[i]] == [], "an attempt-1 spawn remained or ran"
    second = spawner.result["spawned"]
    assert sorted(i for i in rows if i != sid) == second  # nothing else in the table
    assert all(rows[i].state == "done" and rows[i].args["attempt"] == 2 and execs[i] == 1 for i in second)
    last = max(second)
    assert rows[last].started_at >= spawner.finished_at
    SUMMARY.append(f"{engine.dialect.name:<10} spawn + SIGKILL at {point}: {len(first)} held spawns discarded, "
                   f"{len(second)} of the rerun ran once")

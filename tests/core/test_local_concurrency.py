"""A worker's own limit under the shared global cap: ``local_concurrency``.

``max_concurrency`` is the cap across every worker on the database, and by default each
worker's own limit too: then the first worker to claim may take the whole cap, and the others
poll against a full cap while it works. ``local_concurrency`` bounds one worker's handlers
while the cap stays shared. The BROKEN variant (a worker that claims up to the cap again) is
caught by the same check.
"""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa

import jobq
from helpers import FAST


class _LocalIgnored(jobq.Worker):
    """BROKEN: claims up to the global cap, as every worker did before local_concurrency."""

    def __init__(self, *args, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kw)
        self.local_concurrency = self.max_concurrency


def _running_by_owner(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT lease_owner, COUNT(*) FROM jobs WHERE state = 'running' GROUP BY lease_owner")).all()
    return {owner: n for owner, n in rows}


def _two_workers_share_a_cap(engine: sa.Engine, worker: type[jobq.Worker]) -> tuple[int, int, int]:
    """Eight blocked jobs; A (local 2) and B (local 4) share a cap of 5. Returns what A's first
    tick, B's tick and A's second tick leased; then lets every handler finish and checks that
    each job ran once."""
    ids = [jobq.enqueue(engine, "hold") for _ in range(8)]
    gate = threading.Event()
    handlers = {"hold": lambda ctx: (gate.wait(60), None)[1]}
    a = worker(engine, handlers, max_concurrency=5, local_concurrency=2, worker_id="worker-a", **FAST)
    b = worker(engine, handlers, max_concurrency=5, local_concurrency=4, worker_id="worker-b", **FAST)
    try:
        got = (a.tick(), b.tick(), a.tick())
        running = _running_by_owner(engine)
        assert sum(running.values()) <= 5, running  # the shared cap, whatever the local limits
        assert (a.in_flight, b.in_flight) == (running.get("worker-a", 0), running.get("worker-b", 0))
    finally:
        gate.set()
        # Both at once: either one, run alone, would wait for the other's leases to expire.
        idle: list[bool] = []
        other = threading.Thread(target=lambda: idle.append(b.run_until_idle(timeout=120)))
        other.start()
        idle.append(a.run_until_idle(timeout=120))
        other.join()
        assert idle == [True, True]
    for job_id in ids:
        job = jobq.get(engine, job_id)
        assert job is not None and (job.state, job.attempts) == ("done", 1)
    return got


def test_each_worker_stays_within_its_local_limit_under_the_shared_cap(engine: sa.Engine) -> None:
    # A leases its 2 (not the cap's 5); B the 3 the cap has left (not its 4); A, full, none.
    assert _two_workers_share_a_cap(engine, jobq.Worker) == (2, 3, 0)


def test_broken_a_worker_taking_the_whole_cap_is_caught(engine: sa.Engine) -> None:
    assert _two_workers_share_a_cap(engine, _LocalIgnored) == (5, 0, 0)


def test_local_concurrency_defaults_to_the_cap_and_is_checked(engine: sa.Engine) -> None:
    handlers = {"t": lambda ctx: None}
    w = jobq.Worker(engine, handlers, max_concurrency=7)
    assert (w.local_concurrency, w.options.local_concurrency) == (7, 7)
    w = jobq.Worker(engine, handlers, max_concurrency=7, local_concurrency=3)
    assert (w.max_concurrency, w.local_concurrency, w.options.local_concurrency) == (7, 3, 3)
    with pytest.raises(jobq.ConfigError, match="local_concurrency=8 is above max_concurrency=7"):
        jobq.Worker(engine, handlers, max_concurrency=7, local_concurrency=8)
    for bad in (0, -1, True, 2.5, "3"):
        with pytest.raises(jobq.ConfigError, match="local_concurrency"):
            jobq.Worker(engine, handlers, max_concurrency=7, local_concurrency=bad)  # type: ignore[arg-type]
    with pytest.raises(jobq.ConfigError, match="local_concurrency=2 is above"):
        jobq.WorkerOptions(max_concurrency=1, local_concurrency=2)

"""Group policy as data (issue 14): set_group stores a group's weight, cap, rate limit and pause
in the database; every claim obeys it, whatever options its worker was given."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa
from sqlalchemy import orm

import jobq


def _fill(engine: sa.Engine, **per_group: int) -> dict[str, list[int]]:
    with engine.begin() as conn:
        return {g: [jobq.enqueue(conn, "t", group_key=g) for _ in range(n)] for g, n in per_group.items()}


def _groups_of(leases: list[jobq.Lease]) -> dict[str, int]:
    out: dict[str, int] = {}
    for lease in leases:
        out[lease.group_key] = out.get(lease.group_key, 0) + 1
    return out


def test_set_group_stores_and_changes_only_what_it_is_given(engine: sa.Engine) -> None:
    """Options left as None keep their stored value; UNLIMITED removes a limit; groups() lists
    every stored policy; a group never set has none (get_group is None)."""
    assert jobq.get_group(engine, "a") is None and jobq.groups(engine) == []
    p = jobq.set_group(engine, "a", weight=3, max_in_flight=2, rate_limit="10/1m")
    assert (p.weight, p.max_in_flight, p.rate_limit, p.paused) == (3, 2, (10, 60.0), False)
    p = jobq.set_group(engine, "a", paused=True)
    assert (p.weight, p.max_in_flight, p.rate_limit, p.paused) == (3, 2, (10, 60.0), True)
    assert jobq.get_group(engine, "a") == p
    p = jobq.set_group(engine, "a", max_in_flight=jobq.UNLIMITED, rate_limit=jobq.UNLIMITED, paused=False)
    assert (p.weight, p.max_in_flight, p.rate_limit, p.paused) == (3, None, None, False)
    jobq.set_group(engine, "b", rate_limit=(5, 30))
    assert [g.group_key for g in jobq.groups(engine)] == ["a", "b"]
    assert jobq.get_group(engine, "b").rate_limit == (5, 30.0)  # type: ignore[union-attr]


@pytest.mark.parametrize("kw, match", [
    ({"weight": 0}, "weight"), ({"weight": True}, "weight"), ({"weight": 1.5}, "weight"),
    ({"max_in_flight": 0}, "max_in_flight"), ({"max_in_flight": "2"}, "max_in_flight"),
    ({"rate_limit": "10"}, "N/PERIOD"), ({"rate_limit": "x/1m"}, "N/PERIOD"), ({"rate_limit": (0, 60)}, "starts"),
    ({"rate_limit": (1, 2 * 86400)}, "START_LOG_RETENTION"), ({"rate_limit": [1, 2]}, "rate_limit"),
    ({"paused": 1}, "paused"),
])
def test_bad_policy_is_refused_and_nothing_is_written(engine: sa.Engine, kw: dict, match: str) -> None:
    with pytest.raises(jobq.ConfigError, match=match):
        jobq.set_group(engine, "a", **kw)
    assert jobq.groups(engine) == []


def test_set_group_in_the_callers_transaction_exists_only_if_it_commits(engine: sa.Engine) -> None:
    with orm.Session(engine) as s:
        jobq.set_group(s, "a", paused=True)
        assert jobq.get_group(s, "a").paused  # type: ignore[union-attr]
        s.rollback()
    assert jobq.get_group(engine, "a") is None
    _fill(engine, a=2)
    assert len(jobq.claim_batch(engine, "w", 30, limit=5)) == 2  # the rolled-back pause holds nothing
    with orm.Session(engine) as s, s.begin():
        jobq.set_group(s, "a", max_in_flight=1)
    assert jobq.get_group(engine, "a").max_in_flight == 1  # type: ignore[union-attr]


def test_a_paused_groups_ready_jobs_are_not_claimed_and_its_running_jobs_finish(engine: sa.Engine) -> None:
    """Pause: no claim (with or without worker options) leases the group's ready jobs; the
    job it already runs is finalized as usual; resume makes the rest claimable again."""
    ids = _fill(engine, a=3, b=2)
    first = jobq.claim_batch(engine, "w", 30, limit=1, types=["t"])
    running = first[0]
    jobq.set_group(engine, running.group_key, paused=True)
    paused = running.group_key
    other = "b" if paused == "a" else "a"
    got = jobq.claim_batch(engine, "w", 30, limit=10)
    assert {lease.group_key for lease in got} == {other}
    assert jobq.claim_batch(engine, "w", 30, limit=10, max_in_flight=50, group_caps={paused: 5}) == []
    jobq.finalize(engine, running.id, {"ok": 1}, worker_id="w", token=running.token)
    assert jobq.get(engine, running.id).state == "done"  # type: ignore[union-attr]
    jobq.set_group(engine, paused, paused=False)
    rest = jobq.claim_batch(engine, "w", 30, limit=10)
    assert _groups_of(rest) == {paused: len(ids[paused]) - 1}


def test_a_stored_cap_binds_claims_without_options_and_a_change_applies_at_the_next_claim(engine: sa.Engine) -> None:
    """Cap 4 stored: a bare claim_batch gets 4. Lowered to 2 while 4 run: nothing more until
    in-flight drops below 2 (never overspent); raised to 3: the next claim fills to 3."""
    _fill(engine, a=20)
    jobq.set_group(engine, "a", max_in_flight=4)
    held = jobq.claim_batch(engine, "w", 30, limit=10)
    assert len(held) == 4
    jobq.set_group(engine, "a", max_in_flight=2)
    for lease in held[:2]:
        assert jobq.claim_batch(engine, "w", 30, limit=10) == []
        jobq.finalize(engine, lease.id, None, worker_id="w", token=lease.token)
    assert jobq.claim_batch(engine, "w", 30, limit=10) == []  # 2 in flight, cap 2
    jobq.finalize(engine, held[2].id, None, worker_id="w", token=held[2].token)
    assert len(jobq.claim_batch(engine, "w", 30, limit=10)) == 1
    jobq.set_group(engine, "a", max_in_flight=3)
    assert len(jobq.claim_batch(engine, "w", 30, limit=10)) == 1
    jobq.set_group(engine, "a", max_in_flight=jobq.UNLIMITED)
    assert len(jobq.claim_batch(engine, "w", 30, limit=10)) == 10


@pytest.mark.parametrize("worker_cap, stored_cap", [(3, 2), (1, 5)])
def test_the_stricter_of_a_workers_cap_and_the_stored_cap_wins(engine: sa.Engine, worker_cap: int, stored_cap: int) -> None:
    _fill(engine, a=10)
    jobq.set_group(engine, "a", max_in_flight=stored_cap)
    got = jobq.claim_batch(engine, "w", 30, limit=10, max_in_flight=10, group_caps={"a": worker_cap})
    assert len(got) == min(worker_cap, stored_cap)


def test_a_stored_rate_limit_binds_and_so_does_a_workers(engine: sa.Engine) -> None:
    """Stored 3 per minute: 3 starts, then none within the minute. A worker's stricter rate
    for the same group (2 per minute) applies as well; both are counted on the same log."""
    _fill(engine, a=10, b=10)
    jobq.set_group(engine, "a", rate_limit="3/1m")
    got = _groups_of(jobq.claim_batch(engine, "w", 30, limit=8))
    assert got["a"] == 3 and got["b"] == 5
    assert "a" not in _groups_of(jobq.claim_batch(engine, "w", 30, limit=8))
    jobq.set_group(engine, "b", rate_limit="100/1m")
    assert _groups_of(jobq.claim_batch(engine, "w", 30, limit=8, rate_limits={"b": (5, 60.0)})) == {}  # b spent 5


def test_a_stored_weight_replaces_the_jobs_weights(engine: sa.Engine) -> None:
    """Jobs of a weigh 5, of b 1: 8 slots split 7:1. Stored weights a=1, b=3: 2:6."""
    with engine.begin() as conn:
        for _ in range(10):
            jobq.enqueue(conn, "t", group_key="a", weight=5)
            jobq.enqueue(conn, "t", group_key="b", weight=1)
    assert _groups_of(jobq.claim_batch(engine, "w", 30, limit=8)) == {"a": 7, "b": 1}  # the jobs' weights
    wipe_leases(engine)
    jobq.set_group(engine, "a", weight=1)
    jobq.set_group(engine, "b", weight=3)
    assert _groups_of(jobq.claim_batch(engine, "w", 30, limit=8)) == {"a": 2, "b": 6}


def wipe_leases(engine: sa.Engine) -> None:
    jobs = jobq.Job.__table__
    with engine.begin() as conn:
        conn.execute(sa.update(jobs).where(jobs.c.state == "leased").values(
            state="ready", in_flight=False, lease_token=None, lease_owner=None, lease_expires=None))


def test_a_worker_without_group_options_obeys_the_stored_cap(engine: sa.Engine) -> None:
    """Worker(max_concurrency=6) with no group_caps: a's stored cap of 2 holds across its
    handlers (counted at handler entry and exit); b's jobs fill the other slots."""
    _fill(engine, a=12, b=6)
    jobq.set_group(engine, "a", max_in_flight=2)
    lock = threading.Lock()
    now = {"a": 0, "b": 0}
    most = {"a": 0, "b": 0}
    release = threading.Event()

    def h(ctx: jobq.JobContext) -> None:
        g = ctx.group_key
        with lock:
            now[g] += 1
            most[g] = max(most[g], now[g])
        release.wait(0.01)
        with lock:
            now[g] -= 1

    w = jobq.Worker(engine, {"t": h}, max_concurrency=6, poll_interval=0.02)
    assert w.run_until_idle(timeout=120)
    assert most["a"] <= 2
    jobs = jobq.Job.__table__
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).where(jobs.c.state != "done")).scalar() == 0

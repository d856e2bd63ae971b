"""The global limits stored in the database (set_limit, get_limit, `jobq limit`): every claim on
the database counts against the stored cap in its own transaction, whatever each worker was
given; a worker's max_concurrency is its share of it (the smaller wins). The race-shaped
check, with a BROKEN variant the harness catches, is in tests/races (stored global cap, with and
without a cap of the claimer's own); a cap lowered while a claim waits for the claim lock is
checked here, beside its BROKEN variant (the cap read before the lock)."""

from __future__ import annotations

import json
import logging
import math
import threading

import pytest
import sqlalchemy as sa

import jobq
from dbs import needs
from helpers import FAST, INNODB_TRX_POLL, META, backend_id, wait_for, waits_for_a_row_lock

ONE_LINE = "jobq: "


def _running_by_owner(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT lease_owner, COUNT(*) FROM jobs WHERE state = 'running' GROUP BY lease_owner")).all()
    return {owner: n for owner, n in rows}


def test_two_workers_with_different_max_concurrency_run_at_most_the_stored_cap(engine: sa.Engine) -> None:
    """set_limit(max_in_flight=3); workers given max_concurrency=2 and 5 share it: A's tick
    leases 2, B's tick 1 (not 3: the cap is the database's, not each worker's own), and a
    second round leases nothing while all three run. Every job still runs once."""
    ids = [jobq.enqueue(engine, "hold") for _ in range(8)]
    jobq.set_limit(engine, max_in_flight=3)
    gate = threading.Event()
    handlers = {"hold": lambda ctx: (gate.wait(60), None)[1]}
    a = jobq.Worker(engine, handlers, max_concurrency=2, worker_id="worker-a", **FAST)
    b = jobq.Worker(engine, handlers, max_concurrency=5, worker_id="worker-b", **FAST)
    try:
        assert (a.tick(), b.tick(), a.tick(), b.tick()) == (2, 1, 0, 0)
        assert _running_by_owner(engine) == {"worker-a": 2, "worker-b": 1}
    finally:
        gate.set()
        idle: list[bool] = []
        other = threading.Thread(target=lambda: idle.append(b.run_until_idle(timeout=120)))
        other.start()
        idle.append(a.run_until_idle(timeout=120))
        other.join()
        assert idle == [True, True]
    assert [jobq.get(engine, i).state for i in ids] == ["done"] * 8  # type: ignore[union-attr]


def test_every_claim_counts_against_the_stored_cap_whatever_its_own(engine: sa.Engine) -> None:
    """The seed-level claims obey it too: tick with max_concurrency 2 then 5 leases 2 then 1;
    claim_batch with no cap of its own leases nothing more; a lower own cap still wins; and once
    the cap is removed, the next claim takes what its own options allow."""
    for _ in range(10):
        jobq.enqueue(engine, "t")
    jobq.set_limit(engine, max_in_flight=3)
    assert len(jobq.tick(engine, "a", None, max_concurrency=2, lease_ttl=60)[1]) == 2
    assert len(jobq.tick(engine, "b", None, max_concurrency=5, lease_ttl=60)[1]) == 1
    assert jobq.claim_batch(engine, "c", 60, limit=5) == []
    jobq.set_limit(engine, max_in_flight=5)
    assert len(jobq.claim_batch(engine, "c", 60, limit=5, max_in_flight=4)) == 1  # its own 4 is the smaller
    assert len(jobq.claim_batch(engine, "c", 60, limit=5)) == 1  # the stored 5
    jobq.set_limit(engine, max_in_flight=jobq.UNLIMITED)
    assert len(jobq.claim_batch(engine, "c", 60, limit=5)) == 5


def _claim_while_the_cap_is_lowered(engine: sa.Engine, own_cap: int | None) -> tuple[int, int]:
    """A stored cap of 5 and 8 ready jobs; set_limit(max_in_flight=1) runs in a transaction left
    open, holding the claim lock, while a claim (with ``own_cap`` of its own, or none) starts
    in another session; once the claim waits for that lock (or has returned), the lowered cap
    commits. Returns (the jobs the claim leased, the jobs in flight afterwards)."""
    for _ in range(8):
        jobq.enqueue(engine, "t")
    jobq.set_limit(engine, max_in_flight=5)
    one = sa.create_engine(engine.url, poolclass=sa.pool.StaticPool)  # the claim's one connection
    got: list[int] = []
    try:
        with one.connect() as conn:
            backend = backend_id(conn)
            conn.rollback()
        claimer = threading.Thread(target=lambda: got.append(len(jobq.claim_batch(one, "w", 60, limit=8,
                                                                                   max_in_flight=own_cap))))
        with engine.begin() as conn:
            jobq.set_limit(conn, max_in_flight=1)
            claimer.start()
            wait_for(lambda: got or waits_for_a_row_lock(engine, backend), timeout=30, interval=INNODB_TRX_POLL,
                     what="the claim to wait for the claim lock, or return")
        claimer.join(30)
    finally:
        one.dispose()
    assert got, "the claim never returned"
    with engine.connect() as conn:
        in_flight = conn.execute(sa.text("SELECT COUNT(*) FROM jobs WHERE in_flight")).scalar_one()
    return got[0], in_flight


@needs("row_locks")  # on SQLite the claim's BEGIN IMMEDIATE waits before it reads
@pytest.mark.parametrize("own_cap", [None, 8])
def test_a_cap_lowered_while_a_claim_waits_for_the_lock_binds_that_claim(engine: sa.Engine, own_cap: int | None) -> None:
    """set_limit lowers the stored cap from 5 to 1 under the claim lock while a claim waits for
    that lock. Correct: the claim reads the cap in the statement that takes the lock, so it
    sees 1 and leases 1 job. The bug (the cap read by a statement before the lock, or a claim
    with no cap of its own that obeys the stored cap without locking) leases 5 under a cap of 1."""
    assert _claim_while_the_cap_is_lowered(engine, own_cap) == (1, 1)


@needs("row_locks")
@pytest.mark.parametrize("own_cap", [None, 8])
def test_the_lowered_cap_check_catches_a_cap_read_before_the_claim_lock(
        engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, own_cap: int | None) -> None:
    """The broken variant: the claim takes its lock, but obeys the global limits an unlocked
    read of the same rows found just before. It leases 5 under the lowered cap of 1, and the
    check above fails."""
    real = jobq._lock_claim

    def stale(conn: sa.Connection, d: jobq._Dialect, pin: bool = False) -> tuple[tuple[int, int], jobq.GlobalLimit]:
        _, glob = jobq._claim_meta(jobq._hot_rows(conn, jobq._q_claim_lock_value(False), {}))
        return real(conn, d, pin)[0], glob

    monkeypatch.setattr(jobq, "_lock_claim", stale)
    got = _claim_while_the_cap_is_lowered(engine, own_cap)
    assert got == (5, 5)
    with pytest.raises(AssertionError):
        assert got == (1, 1)


def test_a_stored_global_rate_limit_counts_every_group_together(engine: sa.Engine) -> None:
    """set_limit(rate_limit=(4, 60)): at most 4 starts a minute over all groups, for claims
    with no options of their own and for a worker's own "*" rate alike (both apply)."""
    with engine.begin() as conn:
        for g in ("a", "b", "c"):
            for _ in range(4):
                jobq.enqueue(conn, "t", group_key=g)
    jobq.set_limit(engine, rate_limit="4/1m")
    assert len(jobq.claim_batch(engine, "w", 60, limit=3)) == 3
    assert len(jobq.claim_batch(engine, "w", 60, limit=10, rate_limits={"*": (100, 60)})) == 1
    assert jobq.claim_batch(engine, "w", 60, limit=10) == []
    jobq.set_limit(engine, rate_limit=jobq.UNLIMITED)
    assert len(jobq.claim_batch(engine, "w", 60, limit=10, rate_limits={"*": (6, 60)})) == 2  # its own "*" still applies


def test_set_limit_stores_changes_and_clears(engine: sa.Engine) -> None:
    """None keeps a stored value, UNLIMITED removes it; get_limit reads what set_limit stored
    (all None on a new database); updated_at is the database's clock, aware UTC; written in a
    caller's transaction it is stored only when that commits."""
    assert jobq.get_limit(engine) == jobq.GlobalLimit(max_in_flight=None, rate_limit=None, updated_at=None)
    g = jobq.set_limit(engine, max_in_flight=3)
    assert (g.max_in_flight, g.rate_limit) == (3, None) and g.updated_at is not None
    assert g.updated_at.tzinfo is not None and jobq.get_limit(engine) == g
    g = jobq.set_limit(engine, rate_limit=(10, 60))
    assert (g.max_in_flight, g.rate_limit) == (3, (10, 60.0))
    g = jobq.set_limit(engine, rate_limit="5/30s")
    assert (g.max_in_flight, g.rate_limit) == (3, (5, 30.0))
    g = jobq.set_limit(engine)  # nothing given: nothing changes but the time
    assert (g.max_in_flight, g.rate_limit) == (3, (5, 30.0))
    g = jobq.set_limit(engine, max_in_flight=jobq.UNLIMITED)
    assert (g.max_in_flight, g.rate_limit) == (None, (5, 30.0))
    g = jobq.set_limit(engine, rate_limit=jobq.UNLIMITED)
    assert (g.max_in_flight, g.rate_limit) == (None, None) and not g.limits
    with engine.connect() as conn:
        jobq.set_limit(conn, max_in_flight=7)
        assert jobq.get_limit(conn).max_in_flight == 7  # the caller's own transaction sees it
        conn.rollback()
    assert jobq.get_limit(engine).max_in_flight is None
    with engine.begin() as conn:
        jobq.set_limit(conn, max_in_flight=7)
    assert jobq.get_limit(engine).max_in_flight == 7


@pytest.mark.parametrize("kw", [
    {"max_in_flight": 0}, {"max_in_flight": -1}, {"max_in_flight": 100_001}, {"max_in_flight": True},
    {"max_in_flight": 2.5}, {"max_in_flight": "3"}, {"max_in_flight": math.nan}, {"max_in_flight": math.inf},
    {"rate_limit": "10"}, {"rate_limit": "x/1m"}, {"rate_limit": (0, 60)}, {"rate_limit": (10, 0)},
    {"rate_limit": (10, math.nan)}, {"rate_limit": (10, math.inf)}, {"rate_limit": 10}, {"rate_limit": (10, 1e300)},
])
def test_bad_values_are_a_config_error_and_store_nothing(engine: sa.Engine, kw: dict) -> None:
    jobq.set_limit(engine, max_in_flight=4, rate_limit=(9, 60))
    before = jobq.get_limit(engine)
    with pytest.raises(jobq.ConfigError):
        jobq.set_limit(engine, **kw)
    assert jobq.get_limit(engine) == before


def test_a_worker_whose_own_cap_differs_from_the_stored_one_says_so_once(engine: sa.Engine,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """max_concurrency=5 under a stored cap of 3: one warning naming both and which applies,
    however many claims it makes; another when the stored cap changes; none when they agree."""
    jobq.set_limit(engine, max_in_flight=3)
    w = jobq.Worker(engine, {"t": lambda ctx: None}, max_concurrency=5, worker_id="w5", **FAST)
    agree = jobq.Worker(engine, {"t": lambda ctx: None}, max_concurrency=4, worker_id="w4", **FAST)
    with caplog.at_level(logging.WARNING, logger="jobq"):
        for _ in range(3):
            w.tick()
        said = [r.getMessage() for r in caplog.records if getattr(r, "action", None) == "global_cap"]
        assert len(said) == 1 and "max_concurrency=5" in said[0] and "(3," in said[0] and "the smaller, 3" in said[0]
        jobq.set_limit(engine, max_in_flight=4)
        w.tick()
        w.tick()
        agree.tick()
        said = [r.getMessage() for r in caplog.records if getattr(r, "action", None) == "global_cap"]
        assert len(said) == 2 and "the smaller, 4" in said[1] and all("w4" not in s for s in said)


def test_a_database_without_the_row_claims_uncapped_until_set_limit_adds_it(engine: sa.Engine) -> None:
    """A database whose create_schema predates the global_limits row: claims work (no stored
    cap), get_limit says none, set_limit adds the row, and create_schema seeds it again."""
    meta = META
    with engine.begin() as conn:
        conn.execute(sa.delete(meta).where(meta.c.key == "global_limits"))
    for _ in range(4):
        jobq.enqueue(engine, "t")
    assert len(jobq.claim_batch(engine, "w", 60, limit=1)) == 1
    assert jobq.get_limit(engine).max_in_flight is None
    assert jobq.set_limit(engine, max_in_flight=2).max_in_flight == 2
    assert len(jobq.claim_batch(engine, "w", 60, limit=5)) == 1
    with engine.begin() as conn:
        conn.execute(sa.delete(meta).where(meta.c.key == "global_limits"))
    jobq.create_schema(engine)
    with engine.connect() as conn:
        assert conn.execute(sa.select(meta.c.value).where(meta.c.key == "global_limits")).scalar() == ""


def test_the_limit_command_shows_sets_and_clears(db_url: str, engine: sa.Engine,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`jobq limit` shows the stored limits; --max-in-flight/--rate set (none removes one);
    --clear removes both; --json prints the GlobalLimit; bad values are one line, exit 2."""

    def cli(*args: str) -> tuple[int, str, str]:
        code = jobq.main(["--url", db_url, "limit", *args])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = cli()
    assert code == 0 and out.startswith("global limit: cap none, rate none")
    code, out, _ = cli("--max-in-flight", "3", "--rate", "10/1m")
    assert code == 0 and out.strip() == "global limit: cap 3, rate 10/60s"
    assert jobq.get_limit(engine).max_in_flight == 3
    code, out, _ = cli("--json")
    got = json.loads(out)
    assert (got["max_in_flight"], got["rate_limit"]) == (3, [10, 60.0]) and got["updated_at"].endswith("Z")
    code, out, _ = cli("--rate", "none")
    assert out.strip() == "global limit: cap 3, rate none"
    for bad in (["--max-in-flight", "0"], ["--max-in-flight", "x"], ["--rate", "10"], ["--clear", "--rate", "1/1s"]):
        code, _, err = cli(*bad)
        assert code == 2 and err.startswith(ONE_LINE) and len(err.strip().splitlines()) == 1, (bad, err)
    assert cli()[1].strip() == "global limit: cap 3, rate none"
    code, out, _ = cli("--clear")
    assert code == 0 and out.startswith("global limit: cap none, rate none")


def test_why_and_status_name_the_stored_global_limits(db_url: str, engine: sa.Engine,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A due job held back by the full stored cap, or the spent stored rate, is told so by why;
    status prints the stored limits (and --json carries them)."""
    first, second = jobq.enqueue(engine, "t"), jobq.enqueue(engine, "t")
    jobq.set_limit(engine, max_in_flight=1)
    assert len(jobq.claim_batch(engine, "w", 60, limit=5)) == 1
    assert "not claimed: the global cap is full: 1 of 1 job(s) in flight (jobq limit)" in jobq.why(engine, second)
    jobq.set_limit(engine, max_in_flight=jobq.UNLIMITED, rate_limit=(1, 60))
    assert "not claimed: the global rate limit is spent: 1 start(s) in the last" in jobq.why(engine, second)
    assert jobq.main(["--url", db_url, "status"]) == 0
    assert "global limit: cap none, rate 1/60s" in capsys.readouterr().out
    assert jobq.main(["--url", db_url, "status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["global_limit"]["rate_limit"] == [1, 60.0]
    assert first != second

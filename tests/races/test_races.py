"""No double dispatch and a hard global cap under real contention, on every engine; and proof
that the same harness catches deliberately broken claims.

Each broken variant runs TRIALS times; the summary reports how often it was caught, and the
test requires at least one catch (on the engines where the bug is real).
"""

from __future__ import annotations

import pathlib

import pytest

from dbs import needs
from harness import CLOCK_MARGIN, ROUNDS, SUMMARY, DrainResult, run_drain, run_last_slot
from helpers import most_surely_in_window

TRIALS = 2  # each broken variant runs twice; if neither caught it, up to MAX_TRIALS
MAX_TRIALS = 8


def _row(dialect: str, check: str, r, caught: str = "") -> None:
    SUMMARY.append({
        "engine": dialect, "check": check, "claimers": r.claimers, "claims": r.claims, "dups": r.duplicates,
        "lost": r.lost, "overlap": f"{r.max_overlap}/{r.cap if r.cap is not None else '-'}", "secs": f"{r.seconds:.1f}",
        "caught": caught,
    })


def test_no_double_dispatch_under_contention(db_url: str, dialect: str, tmp_path: pathlib.Path) -> None:
    """12 claimers (3 processes x 4 threads, barrier start) drain 1,500 jobs in random batches.
    Correct: every job claimed exactly once, finalized exactly once, none lost. A claim that is
    not atomic shows as a job in two claimers' logs (dups > 0) or a double finalize."""
    r = run_drain(db_url, "correct", tmp_path, n_jobs=1500 * ROUNDS, batch_max=5)
    _row(dialect, "no double dispatch", r)
    assert (r.duplicates, r.lost, r.double_done) == (0, 0, 0)
    assert r.claims == r.jobs


def test_no_double_dispatch_under_contention_across_many_groups(db_url: str, dialect: str,
                                                                tmp_path: pathlib.Path) -> None:
    """As above with the jobs spread over 200 groups and no cap, so claimers run concurrently
    (nothing serialises them): each claim reads its window's candidates without locks and
    locks the chosen ids with SKIP LOCKED, so claimers pick the same candidates and come up
    short. Correct: still every job claimed and finalized exactly once, none lost; a lock
    read that took a row another claim had leased meanwhile shows as dups > 0."""
    r = run_drain(db_url, "correct", tmp_path, n_jobs=1500 * ROUNDS, batch_max=5, groups=200)
    _row(dialect, "no double dispatch, 200 groups", r)
    assert (r.duplicates, r.lost, r.double_done) == (0, 0, 0)
    assert r.claims == r.jobs


@needs("row_locks")  # on SQLite, BEGIN IMMEDIATE serialises the two reads
def test_harness_catches_a_lock_by_id_that_does_not_recheck_the_state(db_url: str, dialect: str,
                                                                     tmp_path: pathlib.Path) -> None:
    """The check above can fail: locking the chosen candidates by id alone leases some twice."""
    _trials(db_url, dialect, tmp_path, "lock_chosen_without_recheck", lambda r: r.duplicates > 0,
            n_jobs=600, batch_max=5, groups=200)


def _trials(db_url: str, dialect: str, tmp_path: pathlib.Path, variant: str, caught_if, shown=None, **kw) -> None:
    caught = trials = 0
    last = None
    while trials < TRIALS or (not caught and trials < MAX_TRIALS):
        trials += 1
        seed = trials
        import sqlalchemy as sa

        from dbs import wipe  # each trial starts from an empty queue

        eng = sa.create_engine(db_url)
        wipe(eng)
        eng.dispose()
        last = run_drain(db_url, variant, tmp_path, seed=seed, **kw)
        caught += bool(caught_if(last))
    _row(dialect, f"BROKEN {variant}", last, f"{caught}/{trials}")
    if shown is not None:
        SUMMARY[-1]["overlap"] = shown(last)
    assert caught >= 1, f"the harness never caught {variant} in {trials} trials"


def test_harness_catches_read_then_update(db_url: str, dialect: str, tmp_path: pathlib.Path) -> None:
    """Reading the ready set in one transaction and leasing in another double-dispatches."""
    _trials(db_url, dialect, tmp_path, "read_then_update", lambda r: r.duplicates > 0, n_jobs=200, batch_max=3)


@needs(no="row_locks")  # the trap of an engine without row locks: with_for_update is silently ignored
def test_harness_catches_for_update_without_begin_immediate(db_url: str, dialect: str, tmp_path: pathlib.Path) -> None:
    """with_for_update on SQLite, under pysqlite's own transaction handling, locks nothing."""
    _trials(db_url, dialect, tmp_path, "sqlite_for_update_only", lambda r: r.duplicates > 0, n_jobs=200, batch_max=3)


def test_global_cap_holds_at_the_instant_of_contention(db_url: str, dialect: str, tmp_path: pathlib.Path) -> None:
    """12 claimers share max_concurrency=3; each holds its jobs ~5 ms. The largest overlap of
    claim-to-release intervals never exceeds 3 (and reaches at least 2, so contention is real)."""
    r = run_drain(db_url, "correct", tmp_path, n_jobs=500 * ROUNDS, cap=3, hold=0.005, batch_max=3)
    _row(dialect, "global cap", r)
    assert (r.duplicates, r.lost) == (0, 0)
    assert 2 <= r.max_overlap <= 3


def test_harness_catches_cap_checked_outside_the_claim(db_url: str, dialect: str, tmp_path: pathlib.Path) -> None:
    """Counting free slots in one transaction and claiming in the next overspends the cap."""
    _trials(db_url, dialect, tmp_path, "cap_outside_claim", lambda r: r.max_overlap > 3,
            n_jobs=200, cap=3, hold=0.005, batch_max=3)


@needs("row_locks")  # on SQLite, BEGIN IMMEDIATE already serialises the count
def test_harness_catches_skip_locked_without_a_cap_lock(db_url: str, dialect: str, tmp_path: pathlib.Path) -> None:
    """SKIP LOCKED alone: two claimers skip each other's rows and both take the last slot."""
    _trials(db_url, dialect, tmp_path, "skip_locked_without_cap_lock", lambda r: r.max_overlap > 3,
            n_jobs=200, cap=3, hold=0.005, batch_max=3)


def test_last_slot_goes_to_exactly_one_claimer(db_url: str, dialect: str, tmp_path: pathlib.Path) -> None:
    """Cap 4 with 3 slots held; each round 12 claimers race on a barrier for the last slot.
    Correct: exactly one winner every round. A cap outside the claim's serialisation shows
    rounds with several winners; a claim that misses rows shows rounds with none."""
    rounds = 30 * ROUNDS
    winners = run_last_slot(db_url, "correct", tmp_path, cap=4, rounds=rounds)
    SUMMARY.append({"engine": dialect, "check": "last slot (winners/round)", "claimers": 12, "claims": sum(winners),
                    "overlap": f"{max(winners)}/1"})
    assert winners == [1] * rounds


@pytest.mark.parametrize("variant", ["cap_outside_claim"])
def test_harness_catches_several_winners_of_the_last_slot(db_url: str, dialect: str, tmp_path: pathlib.Path, variant: str) -> None:
    caught = trials = 0
    while trials < TRIALS or (not caught and trials < MAX_TRIALS):
        trials += 1
        import sqlalchemy as sa

        from dbs import wipe

        eng = sa.create_engine(db_url)
        wipe(eng)
        eng.dispose()
        winners = run_last_slot(db_url, variant, tmp_path, cap=4, rounds=15)
        caught += max(winners) > 1
    SUMMARY.append({"engine": dialect, "check": f"BROKEN last slot {variant}", "claimers": 12, "caught": f"{caught}/{trials}"})
    assert caught >= 1


def test_async_claims_never_double_dispatch_and_hold_the_cap(db_url: str, dialect: str, tmp_path: pathlib.Path) -> None:
    """jobq.aio on an AsyncEngine (aiosqlite, psycopg async, aiomysql): 3 processes x 4
    coroutines, released together, drain 600 jobs under a global cap of 3, holding each
    lease a few ms. Correct: no job in two claimers' logs, none lost or finalized twice,
    never more than 3 leases live at once."""
    r = run_drain(db_url, "async", tmp_path, n_jobs=600 * ROUNDS, cap=3, hold=0.003, batch_max=3)
    _row(dialect, "async: no double dispatch, cap", r)
    assert (r.duplicates, r.lost, r.double_done) == (0, 0, 0)
    assert r.claims == r.jobs
    assert r.max_overlap <= 3


def test_harness_catches_an_async_cap_checked_outside_the_claim(db_url: str, dialect: str, tmp_path: pathlib.Path) -> None:
    """The async path can fail too: coroutines that count free slots in one transaction and
    claim in the next overspend the cap."""
    _trials(db_url, dialect, tmp_path, "async_cap_outside_claim", lambda r: r.max_overlap > 3,
            n_jobs=200, cap=3, hold=0.005, batch_max=3)


def test_rate_limit_holds_under_contention(db_url: str, dialect: str, tmp_path: pathlib.Path) -> None:
    """rate_limits={"*": (10, 0.5)}: 12 claimers (3 processes x 4 threads) drain 60 jobs.

    Each claim is known to have happened between the moment its claimer asked and the moment
    the answer came back (one monotonic clock for all processes). No 0.5 s window may hold
    more than 10 claims whose whole span lies inside it, and the 60 claims span at least the
    2.5 s the limit implies. The claim-time window and the starts log are read under the claim
    lock, so claimers racing for the same room cannot all spend it."""
    _assert_rate_held(dialect, "rate", run_drain(db_url, "rate_limited", tmp_path, n_jobs=60, batch_max=4))


def _assert_rate_held(dialect: str, label: str, r: DrainResult) -> None:
    """No 0.5 s window holds more than RATE's 10 claims, and the 60 claims span at least the
    2.5 s the limit implies; a summary row either way."""
    from variants import RATE

    n, period = RATE
    most = most_surely_in_window(r.claim_spans, period - CLOCK_MARGIN)
    span = max(a for _, a in r.claim_spans) - min(b for b, _ in r.claim_spans)
    SUMMARY.append({"engine": dialect, "check": f"{label}: most claims in {period}s", "claimers": r.claimers,
                    "claims": r.claims, "dups": r.duplicates, "lost": r.lost, "overlap": f"{most}/{n}",
                    "secs": f"{r.seconds:.1f}"})
    assert (r.duplicates, r.lost, r.double_done) == (0, 0, 0)
    t0 = r.claim_spans[0][0]
    assert most <= n, [(round(b - t0, 3), round(a - t0, 3)) for b, a in r.claim_spans]
    assert span >= (60 / n - 1) * period - CLOCK_MARGIN


def test_harness_catches_a_rate_counted_outside_the_claim(db_url: str, dialect: str, tmp_path: pathlib.Path) -> None:
    """Counting the window's starts in one transaction and claiming in the next: claimers that
    count together spend the same room, and a window holds more than 10 claims."""
    from variants import RATE

    n, period = RATE
    _trials(db_url, dialect, tmp_path, "rate_outside_claim",
            lambda r: most_surely_in_window(r.claim_spans, period - CLOCK_MARGIN) > n,
            shown=lambda r: f"{most_surely_in_window(r.claim_spans, period - CLOCK_MARGIN)}/{n}", n_jobs=60, batch_max=4)


def test_a_stored_group_cap_holds_at_the_instant_of_contention(db_url: str, dialect: str, tmp_path: pathlib.Path) -> None:
    """set_group(default, max_in_flight=3) and claimers with no options of their own: 12
    claimers each hold their jobs ~5 ms; the largest overlap never exceeds 3 (and reaches 2).
    The stored cap is read inside the claim, under the claim lock that set_group also takes."""
    r = run_drain(db_url, "stored_cap", tmp_path, n_jobs=300 * ROUNDS, cap=3, hold=0.005, batch_max=3)
    _row(dialect, "stored group cap", r)
    assert (r.duplicates, r.lost) == (0, 0)
    assert 2 <= r.max_overlap <= 3


def test_harness_catches_a_stored_cap_read_outside_the_claim(db_url: str, dialect: str, tmp_path: pathlib.Path) -> None:
    """Reading the stored cap and the in-flight count in one transaction and claiming in the
    next overspends the cap."""
    _trials(db_url, dialect, tmp_path, "stored_cap_outside_claim", lambda r: r.max_overlap > 3,
            n_jobs=200, cap=3, hold=0.005, batch_max=3)


def test_a_stored_rate_limit_holds_under_contention(db_url: str, dialect: str, tmp_path: pathlib.Path) -> None:
    """set_group(default, rate_limit=(10, 0.5)) and claimers with no options: as the worker's
    rate test, no 0.5 s window holds more than 10 claims and 60 claims span at least 2.5 s."""
    _assert_rate_held(dialect, "stored rate", run_drain(db_url, "stored_rate", tmp_path, n_jobs=60, batch_max=4))


def test_harness_catches_a_stored_rate_read_outside_the_claim(db_url: str, dialect: str, tmp_path: pathlib.Path) -> None:
    from variants import RATE

    n, period = RATE
    _trials(db_url, dialect, tmp_path, "stored_rate_outside_claim",
            lambda r: most_surely_in_window(r.claim_spans, period - CLOCK_MARGIN) > n,
            shown=lambda r: f"{most_surely_in_window(r.claim_spans, period - CLOCK_MARGIN)}/{n}", n_jobs=60, batch_max=4)


def test_a_stored_global_cap_holds_at_the_instant_of_contention(db_url: str, dialect: str, tmp_path: pathlib.Path) -> None:
    """set_limit(max_in_flight=3) and 12 claimers each given a cap of 12 of their own, holding
    their jobs ~5 ms: the largest overlap never exceeds 3 (and reaches 2). The stored cap is
    read in the statement that takes the claim lock, under it; a cap counted per claimer shows
    as an overlap above 3."""
    r = run_drain(db_url, "stored_global_cap", tmp_path, n_jobs=300 * ROUNDS, cap=3, hold=0.005, batch_max=3)
    _row(dialect, "stored global cap", r)
    assert (r.duplicates, r.lost) == (0, 0)
    assert 2 <= r.max_overlap <= 3


def test_harness_catches_a_stored_global_cap_read_outside_the_claim(db_url: str, dialect: str,
                                                                   tmp_path: pathlib.Path) -> None:
    """Reading the stored global cap and the in-flight count in one transaction and claiming in
    the next overspends the cap."""
    _trials(db_url, dialect, tmp_path, "stored_global_cap_outside_claim", lambda r: r.max_overlap > 3,
            n_jobs=200, cap=3, hold=0.005, batch_max=3)


def test_a_stored_global_cap_binds_claimers_without_a_cap_of_their_own(db_url: str, dialect: str,
                                                                       tmp_path: pathlib.Path) -> None:
    """set_limit(max_in_flight=3) and 12 claimers with no cap of their own (claim_batch called
    without one): the largest overlap never exceeds 3 (and reaches 2). Such a claim reads the
    stored limits unlocked first, and the stored cap makes it take the claim lock and count
    under it; a claim that counted against the stored cap without the lock overspends it."""
    r = run_drain(db_url, "stored_global_cap_alone", tmp_path, n_jobs=300 * ROUNDS, cap=3, hold=0.005, batch_max=3)
    _row(dialect, "stored global cap, no own cap", r)
    assert (r.duplicates, r.lost) == (0, 0)
    assert 2 <= r.max_overlap <= 3


@needs("row_locks")  # on SQLite, BEGIN IMMEDIATE already serialises the count
def test_harness_catches_a_stored_global_cap_read_without_the_claim_lock(db_url: str, dialect: str,
                                                                        tmp_path: pathlib.Path) -> None:
    """A claim with no cap of its own that obeys the stored cap but does not take the claim
    lock for it (it locks only for stored group policy) overspends the cap."""
    _trials(db_url, dialect, tmp_path, "stored_global_cap_alone_unlocked", lambda r: r.max_overlap > 3,
            n_jobs=200, cap=3, hold=0.005, batch_max=3)

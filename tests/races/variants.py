"""Claim strategies for the race harness: jobq's own, and deliberately broken ones.

The broken variants live here, in the tests only, so the harness can show it catches the bugs
they carry. Each takes (engine, worker_id, limit, cap) and returns the leases it took as
(job_id, token) pairs; the harness finalizes them with jobq's fenced finalize.
"""

from __future__ import annotations

import datetime as dt
import uuid

import sqlalchemy as sa

import jobq

jobs = jobq.Job.__table__
c = jobs.c
TTL = 600.0  # no lease may expire during a race run: every second claim is a double dispatch
RATE = (10, 0.5)  # the rate-limit races: at most 10 claims in any 0.5 s, across every claimer


def correct(engine: sa.Engine, wid: str, limit: int, cap: int | None) -> list[tuple[int, str]]:
    """jobq's claim: one transaction, SKIP LOCKED, the cap counted under the claim lock."""
    return [(l.id, l.token) for l in jobq.claim_batch(engine, wid, TTL, limit=limit, max_in_flight=cap)]


def _blind_lease(conn: sa.Connection, ids: list[int], wid: str, now: dt.datetime) -> str:
    token = uuid.uuid4().hex
    # No "AND state = 'ready'": the naive UPDATE trusts the earlier read.
    conn.execute(
        sa.update(jobs).where(c.id.in_(ids)).values(
            state="leased", lease_owner=wid, lease_token=token, lease_expires=now + dt.timedelta(seconds=TTL),
            attempts=c.attempts + 1, in_flight=True,
        )
    )
    return token


def read_then_update(engine: sa.Engine, wid: str, limit: int, cap: int | None) -> list[tuple[int, str]]:
    """BROKEN: reads the ready set in one transaction and leases in another."""
    d = jobq._prepare(engine)
    with engine.begin() as conn:
        now = d.db_now(conn)
        ids = [r.id for r in conn.execute(sa.select(c.id).where(c.state == "ready", c.run_after <= now).order_by(c.id).limit(limit))]
    if not ids:
        return []
    with engine.begin() as conn:
        token = _blind_lease(conn, ids, wid, now)
    return [(i, token) for i in ids]


_raw_engines: dict[str, sa.Engine] = {}


def sqlite_for_update_only(engine: sa.Engine, wid: str, limit: int, cap: int | None) -> list[tuple[int, str]]:
    """BROKEN (SQLite): trusts with_for_update, which SQLite ignores, on an engine left with the
    driver's own transaction handling: pysqlite runs the SELECT before its implicit BEGIN."""
    url = str(engine.url)
    raw = _raw_engines.get(url)
    if raw is None:
        raw = _raw_engines[url] = sa.create_engine(url)  # no jobq hooks on this engine
    with raw.begin() as conn:
        now = jobq._utcnow()
        ids = [r.id for r in conn.execute(
            sa.select(c.id).where(c.state == "ready", c.run_after <= now).order_by(c.id).limit(limit).with_for_update()
        )]
        if not ids:
            return []
        token = _blind_lease(conn, ids, wid, now)
    return [(i, token) for i in ids]


def _in_flight(conn: sa.Connection) -> int:
    return conn.execute(sa.select(sa.func.count()).where(c.in_flight == sa.true())).scalar_one()


def cap_outside_claim(engine: sa.Engine, wid: str, limit: int, cap: int | None) -> list[tuple[int, str]]:
    """BROKEN: counts the free slots in one transaction and claims in the next."""
    assert cap is not None
    with engine.begin() as conn:
        free = cap - _in_flight(conn)
    if free <= 0:
        return []
    return [(l.id, l.token) for l in jobq.claim_batch(engine, wid, TTL, limit=min(limit, free))]


def skip_locked_without_cap_lock(engine: sa.Engine, wid: str, limit: int, cap: int | None) -> list[tuple[int, str]]:
    """BROKEN (servers): counts and claims in one transaction with SKIP LOCKED but without the
    cap's serialisation point: two claimers skip each other's rows and spend the same slot."""
    assert cap is not None

    def run(conn: sa.Connection, d: jobq._Dialect) -> list[tuple[int, str]]:
        free = cap - _in_flight(conn)
        if free <= 0:
            return []
        leases = jobq._lease_rows(conn, d, worker_id=wid, ttl=TTL, now=d.db_now(conn), limit=min(limit, free),
                                  types=None, max_in_flight=None, group_caps=None, state="leased")
        return [(l.id, l.token) for l in leases]

    return jobq._transaction(engine, run)


def rate_limited(engine: sa.Engine, wid: str, limit: int, cap: int | None) -> list[tuple[int, str]]:
    """jobq's claim with a global rate limit: the window counted under the claim lock."""
    leases = jobq.claim_batch(engine, wid, TTL, limit=limit, max_in_flight=cap, rate_limits={"*": RATE})
    return [(l.id, l.token) for l in leases]


def _rate_room_apart(engine: sa.Engine) -> int:
    """The broken rate variants' mistake: RATE's room counted from the start log in a
    transaction of its own, apart from the claim that spends it."""
    n, period = RATE
    with engine.begin() as conn:
        now = jobq._prepare(engine).db_now(conn)
        starts = jobq.Base.metadata.tables["jobq_starts"]
        used = conn.execute(sa.select(sa.func.coalesce(sa.func.sum(starts.c.n), 0))
                            .where(starts.c.started_at > now - dt.timedelta(seconds=period))).scalar_one()
    return n - int(used)


def rate_outside_claim(engine: sa.Engine, wid: str, limit: int, cap: int | None) -> list[tuple[int, str]]:
    """BROKEN: counts the window's starts in one transaction and claims in the next, so
    claimers that count at the same moment all spend the same room."""
    room = _rate_room_apart(engine)
    if room <= 0:
        return []
    return [(l.id, l.token) for l in jobq.claim_batch(engine, wid, TTL, limit=min(limit, room), max_in_flight=cap)]


_stored: set[str] = set()


def _store_policy(engine: sa.Engine, **policy) -> None:
    """Each claimer process stores the group's policy before its first claim (the same value
    every time), so every claim of the run starts after a committed set_group."""
    key = f"{engine.url}:{sorted(policy.items())}"
    if key not in _stored:
        jobq.set_group(engine, "default", **policy)
        _stored.add(key)


def stored_cap(engine: sa.Engine, wid: str, limit: int, cap: int | None) -> list[tuple[int, str]]:
    """jobq's claim with no options of its own, bound by the group's stored cap (set_group)."""
    assert cap is not None
    _store_policy(engine, max_in_flight=cap)
    return [(l.id, l.token) for l in jobq.claim_batch(engine, wid, TTL, limit=limit)]


def _policy_outside_claim() -> None:
    # The claim's own read of stored policy, switched off in this (claimer) process: the
    # broken variants below have read the policy themselves, in an earlier transaction.
    jobq._group_policies = lambda conn, keys: {}
    jobq._policy_counts = lambda value: (0, 0)


def stored_cap_outside_claim(engine: sa.Engine, wid: str, limit: int, cap: int | None) -> list[tuple[int, str]]:
    """BROKEN: reads the stored cap and the group's in-flight count in one transaction, and
    claims (without consulting the policy again) in the next."""
    assert cap is not None
    _store_policy(engine, max_in_flight=cap)
    policy = jobq.get_group(engine, "default")
    assert policy is not None and policy.max_in_flight is not None
    with engine.begin() as conn:
        free = policy.max_in_flight - _in_flight(conn)
    if free <= 0:
        return []
    _policy_outside_claim()
    return [(l.id, l.token) for l in jobq.claim_batch(engine, wid, TTL, limit=min(limit, free))]


def stored_rate(engine: sa.Engine, wid: str, limit: int, cap: int | None) -> list[tuple[int, str]]:
    """jobq's claim with no options of its own, bound by the group's stored rate limit."""
    _store_policy(engine, rate_limit=RATE)
    return [(l.id, l.token) for l in jobq.claim_batch(engine, wid, TTL, limit=limit)]


def stored_rate_outside_claim(engine: sa.Engine, wid: str, limit: int, cap: int | None) -> list[tuple[int, str]]:
    """BROKEN: reads the stored rate and counts the window's starts in one transaction, and
    claims (without consulting the policy again) in the next."""
    _store_policy(engine, rate_limit=RATE)
    room = _rate_room_apart(engine)  # RATE as stored (a get_group per claim would only slow the drain)
    if room <= 0:
        return []
    _policy_outside_claim()
    return [(l.id, l.token) for l in jobq.claim_batch(engine, wid, TTL, limit=min(limit, room))]


_limited: set[str] = set()


def _store_global_cap(engine: sa.Engine, cap: int) -> None:
    """Each claimer process stores the global cap before its first claim (the same value every
    time), so every claim of the run starts after a committed set_limit."""
    key = f"{engine.url}:{cap}"
    if key not in _limited:
        jobq.set_limit(engine, max_in_flight=cap)
        _limited.add(key)


def stored_global_cap(engine: sa.Engine, wid: str, limit: int, cap: int | None) -> list[tuple[int, str]]:
    """jobq's claim bound by the stored global cap (set_limit), each claimer given a cap of its
    own four times as large (as workers with a larger max_concurrency would be)."""
    assert cap is not None
    _store_global_cap(engine, cap)
    return [(l.id, l.token) for l in jobq.claim_batch(engine, wid, TTL, limit=limit, max_in_flight=4 * cap)]


def _global_limits_outside_claim() -> None:
    # The claim's own read of the global limits, switched off in this (claimer) process: the
    # broken variant below has read the cap itself, in an earlier transaction.
    real = jobq._claim_meta
    if getattr(real, "broken", False):
        return

    def without_global(rows):  # type: ignore[no-untyped-def]
        return real(rows)[0], jobq._NO_GLOBAL_LIMIT

    without_global.broken = True  # type: ignore[attr-defined]
    jobq._claim_meta = without_global


def stored_global_cap_outside_claim(engine: sa.Engine, wid: str, limit: int, cap: int | None) -> list[tuple[int, str]]:
    """BROKEN: reads the stored global cap and the in-flight count in one transaction, and
    claims (with the claim's own read of the global limits switched off) in the next."""
    assert cap is not None
    _store_global_cap(engine, cap)
    stored = jobq.get_limit(engine).max_in_flight
    assert stored is not None
    with engine.begin() as conn:
        free = stored - _in_flight(conn)
    if free <= 0:
        return []
    _global_limits_outside_claim()
    return [(l.id, l.token) for l in jobq.claim_batch(engine, wid, TTL, limit=min(limit, free), max_in_flight=4 * cap)]


def stored_global_cap_alone(engine: sa.Engine, wid: str, limit: int, cap: int | None) -> list[tuple[int, str]]:
    """jobq's claim bound by the stored global cap alone: no cap or limit of its own (as
    claim_batch and tick are called without one), so only the stored cap makes it lock."""
    assert cap is not None
    _store_global_cap(engine, cap)
    return [(l.id, l.token) for l in jobq.claim_batch(engine, wid, TTL, limit=limit)]


def _claim_lock_skipped() -> None:
    # The claim's lock replaced, in this (claimer) process, by the same read without the lock.
    real = jobq._lock_claim
    if getattr(real, "broken", False):
        return

    def unlocked(conn, d, pin=False):  # type: ignore[no-untyped-def]
        return jobq._claim_meta(jobq._hot_rows(conn, jobq._q_claim_lock_value(pin), {}))

    unlocked.broken = True  # type: ignore[attr-defined]
    jobq._lock_claim = unlocked


def stored_global_cap_alone_unlocked(engine: sa.Engine, wid: str, limit: int, cap: int | None) -> list[tuple[int, str]]:
    """BROKEN (servers): a claim with no cap of its own reads the stored global cap (and counts
    the jobs in flight) without taking the claim lock: it sees the cap, but not the claims
    that run beside it."""
    _claim_lock_skipped()
    return stored_global_cap_alone(engine, wid, limit, cap)


async def async_correct(engine, wid: str, limit: int, cap: int | None) -> list[tuple[int, str]]:
    """jobq.aio's claim on an AsyncEngine: the same claim, bridged to the event loop."""
    leases = await jobq.aio.claim_batch(engine, wid, TTL, limit=limit, max_in_flight=cap)
    return [(l.id, l.token) for l in leases]


async def async_cap_outside_claim(engine, wid: str, limit: int, cap: int | None) -> list[tuple[int, str]]:
    """BROKEN (async): counts the free slots in one transaction and claims in the next, with
    the coroutines of one event loop interleaving between the two."""
    assert cap is not None
    async with engine.begin() as conn:
        free = cap - (await conn.execute(sa.select(sa.func.count()).where(c.in_flight == sa.true()))).scalar_one()
    if free <= 0:
        return []
    return [(l.id, l.token) for l in await jobq.aio.claim_batch(engine, wid, TTL, limit=min(limit, free))]


def _lock_by_id_only(d: jobq._Dialect) -> sa.Select:
    return d.lock_skip(sa.select(*jobq._LEASE_COLS).where(c.id.in_(sa.bindparam("b_ids", expanding=True)),
                                                          sa.bindparam("b_now", type_=jobq._TS).is_not(None)))


def lock_chosen_without_recheck(engine: sa.Engine, wid: str, limit: int, cap: int | None) -> list[tuple[int, str]]:
    """BROKEN (servers): the claim locks its chosen candidates by id without checking they are
    still ready: a candidate another claimer leased (and committed) after this one's unlocked
    window read is no longer locked, so it is locked and leased a second time."""
    jobq._q_lock_chosen = _lock_by_id_only  # this claimer process only
    return correct(engine, wid, limit, cap)


ASYNC_VARIANTS = {"async": async_correct, "async_cap_outside_claim": async_cap_outside_claim}

VARIANTS = {
    "correct": correct,
    "read_then_update": read_then_update,
    "sqlite_for_update_only": sqlite_for_update_only,
    "cap_outside_claim": cap_outside_claim,
    "skip_locked_without_cap_lock": skip_locked_without_cap_lock,
    "rate_limited": rate_limited,
    "rate_outside_claim": rate_outside_claim,
    "stored_cap": stored_cap,
    "stored_cap_outside_claim": stored_cap_outside_claim,
    "stored_rate": stored_rate,
    "stored_rate_outside_claim": stored_rate_outside_claim,
    "stored_global_cap": stored_global_cap,
    "stored_global_cap_outside_claim": stored_global_cap_outside_claim,
    "stored_global_cap_alone": stored_global_cap_alone,
    "stored_global_cap_alone_unlocked": stored_global_cap_alone_unlocked,
    "lock_chosen_without_recheck": lock_chosen_without_recheck,
}

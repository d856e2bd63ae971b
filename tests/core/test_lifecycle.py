"""claim, heartbeat, finalize, fail, release and reclaim: the lease and its fence."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest
import sqlalchemy as sa

import jobq
from helpers import db_now, expire_leases, snapshot, state


def test_claim_takes_the_oldest_due_job_and_nothing_twice(engine: sa.Engine) -> None:
    """Claims hand out due jobs oldest first, each to one claimer only, and skip a job whose
    run_after is still ahead; the claimed row shows its owner, one attempt and in_flight."""
    first = jobq.enqueue(engine, "t")
    second = jobq.enqueue(engine, "t")
    later = jobq.enqueue(engine, "t", run_after=dt.timedelta(hours=1))
    assert jobq.claim(engine, "w1", 30) == first
    assert jobq.claim(engine, "w2", 30) == second
    assert jobq.claim(engine, "w3", 30) is None  # `later` is not due
    info = jobq.get(engine, first)
    assert info is not None
    assert (info.state, info.lease_owner, info.attempts, info.in_flight) == ("leased", "w1", 1, True)
    assert state(engine, later) == "ready"


def test_only_runnable_leaves_are_claimed(engine: sa.Engine) -> None:
    """Containers never run; a job with an unfinished upstream waits; other types are skipped."""
    box = jobq.enqueue(engine, "t", container=True)
    up = jobq.enqueue(engine, "t", parent=box)
    down = jobq.enqueue(engine, "t", depends_on=[up])
    other = jobq.enqueue(engine, "other")
    leases = jobq.claim_batch(engine, "w", 30, limit=10, types=["t"])
    assert [l.id for l in leases] == [up]
    assert state(engine, box) == "waiting" and state(engine, down) == "waiting"
    assert state(engine, other) == "ready"


def test_a_claimed_lease_is_the_same_as_one_built_by_its_constructor(engine: sa.Engine) -> None:
    """The claim sets each Lease's fields directly (faster than the frozen dataclass's
    __init__). Correct: every field is set, to what the constructor would store, and the lease
    is as immutable as any. A field added to Lease but not to the claim fails here."""
    jid = jobq.enqueue(engine, "t", {"n": 1}, timeout=5)
    lease = jobq.claim_batch(engine, "w", 30)[0]
    again = jobq.Lease(**{f.name: getattr(lease, f.name) for f in dataclasses.fields(jobq.Lease)})
    assert lease == again and vars(lease) == vars(again)
    assert (lease.id, lease.args, lease.attempt, lease.timeout, lease.worker_id) == (jid, {"n": 1}, 1, 5.0, "w")
    with pytest.raises(dataclasses.FrozenInstanceError):
        lease.attempt = 2  # type: ignore[misc]


def test_ready_set_is_a_plain_select_of_due_jobs(engine: sa.Engine) -> None:
    """ready_set(now) is a plain SELECT of the jobs due at ``now`` (of some types, if asked), in id
    order; jobs not yet due are left out."""
    a = jobq.enqueue(engine, "t")
    jobq.enqueue(engine, "t", run_after=dt.timedelta(hours=2))
    b = jobq.enqueue(engine, "u")
    with engine.connect() as conn:
        rows = conn.execute(jobq.ready_set(db_now(engine))).all()
        only_t = conn.execute(jobq.ready_set(db_now(engine), types=["t"])).all()
    assert [r.id for r in rows] == [a, b]
    assert [r.id for r in only_t] == [a]


def test_finalize_writes_result_and_clears_the_lease(engine: sa.Engine) -> None:
    """finalize stores the result, marks the job done with finished_at, and clears the lease (owner,
    expiry, in_flight)."""
    jid = jobq.enqueue(engine, "t")
    assert jobq.claim(engine, "w", 30) == jid
    jobq.finalize(engine, jid, {"answer": 42}, worker_id="w")
    info = jobq.get(engine, jid)
    assert info is not None
    assert (info.state, info.result, info.lease_owner, info.lease_expires, info.in_flight) == ("done", {"answer": 42}, None, None, False)
    assert info.finished_at is not None


def test_finalize_by_another_worker_is_refused_and_writes_nothing(engine: sa.Engine) -> None:
    """The fence: a worker that does not hold the lease cannot finalize the job; LeaseLost, and
    nothing is written."""
    jid = jobq.enqueue(engine, "t")
    jobq.claim(engine, "w1", 30)
    before = snapshot(engine)
    with pytest.raises(jobq.LeaseLost):
        jobq.finalize(engine, jid, {"x": 1}, worker_id="w2")
    assert snapshot(engine) == before


def test_a_reclaimed_job_is_never_completed_by_its_first_dispatch(engine: sa.Engine) -> None:
    """The fence is per dispatch: the same worker claiming the job again after its first lease
    expired must not let the first dispatch's late result through."""
    jid = jobq.enqueue(engine, "t")
    first = jobq.claim_batch(engine, "w", 30)[0]
    expire_leases(engine, jid)
    assert jobq.reclaim(engine) == 1
    second = jobq.claim_batch(engine, "w", 30)[0]  # same worker id, new dispatch
    assert (second.id, second.attempt) == (jid, 2)
    with pytest.raises(jobq.LeaseLost):
        jobq.finalize(engine, jid, {"from": "first"}, worker_id="w", token=first.token)
    with pytest.raises(jobq.LeaseLost):
        jobq.heartbeat(engine, first, 30)
    jobq.finalize(engine, jid, {"from": "second"}, worker_id="w", token=second.token)
    assert jobq.get(engine, jid).result == {"from": "second"}  # type: ignore[union-attr]


def test_finalize_retried_after_it_committed_is_recognised(engine: sa.Engine) -> None:
    """A finalize whose COMMIT landed but whose answer was lost (a connection cut during the
    COMMIT) is retried with the same token: the retry must not report LeaseLost for a write
    that landed, and must not write twice."""
    jobq.enqueue(engine, "t")
    lease = jobq.claim_batch(engine, "w", 30)[0]
    jobq.finalize(engine, lease.id, {"v": 1}, worker_id="w", token=lease.token)
    before = snapshot(engine)
    jobq.finalize(engine, lease.id, {"v": 1}, worker_id="w", token=lease.token)
    assert snapshot(engine) == before


def test_done_is_terminal(engine: sa.Engine) -> None:
    """A done job stays done: a reclaim, and a late fail or release with the old token, change
    nothing (the last two raise LeaseLost)."""
    jid = jobq.enqueue(engine, "t")
    lease = jobq.claim_batch(engine, "w", 30)[0]
    jobq.finalize(engine, jid, {}, worker_id="w", token=lease.token)
    expire_leases(engine)
    assert jobq.reclaim(engine, now=db_now(engine) + dt.timedelta(days=1)) == 0
    for call in (
        lambda: jobq.fail(engine, jid, "late", worker_id="w", token=lease.token),
        lambda: jobq.release(engine, jid, worker_id="w", token=lease.token),
    ):
        with pytest.raises(jobq.LeaseLost):
            call()
    assert state(engine, jid) == "done"


def test_fail_retries_with_backoff_then_fails(engine: sa.Engine) -> None:
    """fail() with attempts left puts the job back to ready after its delay (not claimable before
    it), keeping the error; fail() on the last attempt ends it failed and out of flight."""
    jid = jobq.enqueue(engine, "t", max_attempts=2)
    lease = jobq.claim_batch(engine, "w", 30)[0]
    assert jobq.fail(engine, jid, "ValueError: bad", worker_id="w", token=lease.token, delay=3600) == "ready"
    info = jobq.get(engine, jid)
    assert info is not None and info.error == "ValueError: bad" and info.attempts == 1
    assert info.run_after > db_now(engine).replace(tzinfo=dt.UTC) + dt.timedelta(minutes=59)
    assert jobq.claim(engine, "w", 30) is None  # backing off
    lease = jobq.claim_batch(engine, "w", 30, now=info.run_after.replace(tzinfo=None) + dt.timedelta(seconds=1))[0]
    assert lease.attempt == 2
    assert jobq.fail(engine, jid, "ValueError: again", worker_id="w", token=lease.token) == "failed"
    info = jobq.get(engine, jid)
    assert info is not None and (info.state, info.attempts, info.in_flight) == ("failed", 2, False)


def test_release_returns_the_job_without_charging_an_attempt(engine: sa.Engine) -> None:
    """release() gives a claimed job back: ready, attempts back to 0, no owner."""
    jid = jobq.enqueue(engine, "t")
    lease = jobq.claim_batch(engine, "w", 30)[0]
    jobq.release(engine, jid, worker_id="w", token=lease.token)
    info = jobq.get(engine, jid)
    assert info is not None and (info.state, info.attempts, info.lease_owner) == ("ready", 0, None)


def test_heartbeat_extends_the_lease_so_reclaim_leaves_it(engine: sa.Engine) -> None:
    """heartbeat() moves the lease's expiry ``ttl`` seconds past its ``now``; a reclaim after the
    old expiry but before the new one leaves the job leased."""
    jid = jobq.enqueue(engine, "t")
    lease = jobq.claim_batch(engine, "w", 1)[0]
    later = lease.expires + dt.timedelta(seconds=30)
    new_expiry = jobq.heartbeat(engine, lease, 60, now=lease.expires)
    assert new_expiry == lease.expires + dt.timedelta(seconds=60)
    assert jobq.reclaim(engine, now=later) == 0
    assert state(engine, jid) == "leased"


def test_reclaim_returns_expired_jobs_and_fails_poison_ones(engine: sa.Engine) -> None:
    """reclaim() returns jobs whose lease expired to ready while attempts are left (the attempt
    charged, the reason in error), fails those out of attempts and their dependents with them; a
    second reclaim finds nothing."""
    retry = jobq.enqueue(engine, "t", max_attempts=3)
    poison = jobq.enqueue(engine, "t", max_attempts=1)
    dependent = jobq.enqueue(engine, "t", depends_on=[poison])
    jobq.claim_batch(engine, "w", 30, limit=2)
    expire_leases(engine)
    assert jobq.reclaim(engine) == 2
    r = jobq.get(engine, retry)
    p = jobq.get(engine, poison)
    assert r is not None and p is not None
    assert (r.state, r.attempts, r.lease_owner, r.in_flight) == ("ready", 1, None, False)
    assert "lease expired on attempt 1" in (r.error or "")
    assert p.state == "failed" and "lease expired on attempt 1 of 1" in (p.error or "")
    assert state(engine, dependent) == "failed"
    assert jobq.reclaim(engine) == 0


def test_global_cap_limits_a_batch_claim(engine: sa.Engine) -> None:
    """max_in_flight caps the jobs in flight across all claimers, not per call: with 4 out under a
    cap of 4 another claimer gets none; a cap of 5 lets one more out."""
    for _ in range(6):
        jobq.enqueue(engine, "t")
    assert len(jobq.claim_batch(engine, "a", 30, limit=10, max_in_flight=4)) == 4
    assert len(jobq.claim_batch(engine, "b", 30, limit=10, max_in_flight=4)) == 0
    assert len(jobq.claim_batch(engine, "c", 30, limit=10, max_in_flight=5)) == 1


def test_claim_arguments_are_checked(engine: sa.Engine) -> None:
    """Bad arguments are refused before any work: a zero ttl (ConfigError), an empty worker_id and a
    non-dict result (InvalidJob)."""
    with pytest.raises(jobq.ConfigError, match="ttl"):
        jobq.claim(engine, "w", 0)
    with pytest.raises(jobq.InvalidJob, match="worker_id"):
        jobq.claim(engine, "", 30)
    with pytest.raises(jobq.InvalidJob, match="result must be a dict"):
        jobq.finalize(engine, 1, [1], worker_id="w")  # type: ignore[arg-type]


def test_a_batch_finalize_fences_each_row_and_never_settles_twice(engine: sa.Engine) -> None:
    """The worker writes results in batches (one executemany). Each row is still fenced by its
    own token: a stolen lease is refused alone, a row already finalized by an earlier COMMIT is
    recognised without releasing its dependents a second time, the others commit."""
    ups = [jobq.enqueue(engine, "t") for _ in range(4)]
    down = jobq.enqueue(engine, "t", depends_on=ups)
    leases = {l.id: l for l in jobq.claim_batch(engine, "w", 30, limit=4)}
    a, b, c, d = ups
    jobq.finalize(engine, a, {"early": True}, worker_id="w", token=leases[a].token)  # first COMMIT landed
    with engine.begin() as conn:  # b's lease is taken over by someone else
        conn.execute(sa.update(jobq.Job.__table__).where(jobq.Job.__table__.c.id == b).values(lease_token="other"))
    outs = [jobq._Outcome(j, "w", leases[j].token, "done", result={"j": j}) for j in ups]
    written = jobq._transaction(engine, lambda conn, dl: jobq._apply_outcomes(conn, dl, outs, db_now(engine)))
    assert written == ["done", None, "done", "done"]
    info = jobq.get(engine, down)
    assert info is not None and info.pending_deps == 1 and info.state == "waiting"  # only b is missing
    assert jobq.get(engine, a).result == {"early": True}  # type: ignore[union-attr]
    assert jobq.get(engine, b).state == "leased"  # type: ignore[union-attr]


def test_a_batched_finalize_writes_each_result_and_refuses_only_the_lost_lease(engine: sa.Engine) -> None:
    """The worker's group commit: one batch of outcomes from one claim, each with its own
    result; one job's lease was lost (expired and re-leased by another worker) meanwhile.
    Correct: the other rows commit with their own results; the lost one is reported (None)
    and keeps the new holder's lease untouched."""
    ids = [jobq.enqueue(engine, "t") for _ in range(6)]
    leases = jobq.claim_batch(engine, "w1", 30, limit=6)
    assert sorted(l.id for l in leases) == ids and len({l.token for l in leases}) == 1
    stolen = ids[2]
    expire_leases(engine, stolen)
    jobq.reclaim(engine)
    assert [l.id for l in jobq.claim_batch(engine, "w2", 30)] == [stolen]
    outcomes = [jobq._Outcome(l.id, "w1", l.token, "done", result={"n": l.id}) for l in leases]
    with engine.begin() as conn:
        written = jobq._apply_outcomes(conn, jobq._prepare(engine), outcomes, db_now(engine))
    assert written == [None if l.id == stolen else "done" for l in leases]
    for jid in ids:
        info = jobq.get(engine, jid)
        assert info is not None
        if jid == stolen:
            assert (info.state, info.lease_owner, info.result) == ("leased", "w2", None)
        else:
            assert (info.state, info.result) == ("done", {"n": jid})


def test_a_batched_finalize_of_identical_results_is_fenced_too(engine: sa.Engine) -> None:
    """Same batch, no-op handlers (every result None): one statement, same fence."""
    ids = [jobq.enqueue(engine, "t") for _ in range(4)]
    leases = jobq.claim_batch(engine, "w1", 30, limit=4)
    other = jobq.claim_batch(engine, "w1", 30)  # nothing left: a token from no claim
    assert other == []
    outcomes = [jobq._Outcome(l.id, "w1", l.token if l.id != ids[0] else "f" * 32, "done") for l in leases]
    with engine.begin() as conn:
        written = jobq._apply_outcomes(conn, jobq._prepare(engine), outcomes, db_now(engine))
    assert written == [None if l.id == ids[0] else "done" for l in leases]
    assert [state(engine, j) for j in ids] == ["leased", "done", "done", "done"]


@pytest.mark.parametrize("refused", ["none", "cancelled", "stolen"])
def test_a_batched_finalize_records_each_attempt_once_and_releases_only_done_dependents(
    engine: sa.Engine, refused: str
) -> None:
    """One claim's no-op results finalized together (on PostgreSQL the finish, the history rows
    and the dependents count are one statement). Correct: every job that lands is done with
    exactly one history row, and its dependent becomes ready; a job the fence refuses (cancel
    requested meanwhile; or its lease expired and another worker holds it now) gets no row
    from this finalize, and its dependent is not released. A bug would show as a second
    history row for a landed job (written with the finish and again after it), or as the
    dependent of a refused job released by counts read for the whole batch."""
    ups = [jobq.enqueue(engine, "t") for _ in range(4)]
    downs = [jobq.enqueue(engine, "later", depends_on=[u]) for u in ups]
    leases = jobq.claim_batch(engine, "w1", 30, limit=4, types=["t"])
    assert sorted(l.id for l in leases) == ups and len({l.token for l in leases}) == 1
    if refused == "cancelled":
        jobq.cancel(engine, ups[0])
    elif refused == "stolen":
        expire_leases(engine, ups[0])
        jobq.reclaim(engine)
        assert [l.id for l in jobq.claim_batch(engine, "w2", 30, types=["t"])] == [ups[0]]
    outcomes = [jobq._Outcome(l.id, "w1", l.token, "done") for l in sorted(leases, key=lambda l: l.id)]
    with engine.begin() as conn:
        written = jobq._apply_outcomes(conn, jobq._prepare(engine), outcomes, db_now(engine))
    first = {"none": "done", "cancelled": "cancelled", "stolen": None}[refused]
    assert written == [first, "done", "done", "done"]
    assert [state(engine, j) for j in ups] == [first or "leased", "done", "done", "done"]
    assert [state(engine, j) for j in downs] == [{"none": "ready", "cancelled": "cancelled", "stolen": "waiting"}[refused],
                                                 "ready", "ready", "ready"]
    history = {"none": [(1, "done")], "cancelled": [(1, "cancelled")], "stolen": [(1, "reclaimed")]}[refused]
    assert [(a.attempt, a.outcome) for a in jobq.attempts(engine, ups[0])] == history
    for j in ups[1:]:
        assert [(a.attempt, a.outcome) for a in jobq.attempts(engine, j)] == [(1, "done")]

"""The seed-level API is fenced per dispatch, not per worker (issue 20, item 16).

``claim()`` returns a :class:`jobq.ClaimedId`: the job id as an ``int`` that carries its
lease, and ``finalize``/``fail``/``release``/``heartbeat`` given it are fenced by that lease's
token. Correct: a worker whose lease expired and who claimed the same job again has its stale
first report refused (``LeaseLost``, nothing written) and the current one accepted. The bug
this catches (old code): the fence was the worker_id, so the stale result was written and the
current dispatch was refused. The tests own the clock through ``now=``.
"""

from __future__ import annotations

import copy
import datetime as dt
import pickle

import pytest
import sqlalchemy as sa

import jobq
from helpers import db_now, snapshot

S = dt.timedelta(seconds=1)


def claim_twice(engine: sa.Engine) -> tuple[int, jobq.ClaimedId, jobq.ClaimedId, dt.datetime]:
    """Claim, let the lease expire, reclaim, claim again by the same worker."""
    jid = jobq.enqueue(engine, "t", max_attempts=5)
    t0 = db_now(engine) + S
    first = jobq.claim(engine, "w", 30, now=t0)
    assert first == jid and isinstance(first, jobq.ClaimedId)
    assert jobq.reclaim(engine, now=t0 + 31 * S) == 1
    second = jobq.claim(engine, "w", 30, now=t0 + 32 * S)
    assert second == jid and isinstance(second, jobq.ClaimedId)
    assert second.token != first.token
    return jid, first, second, t0 + 33 * S


def test_a_stale_claim_by_the_same_worker_is_refused_and_the_current_one_accepted(engine: sa.Engine) -> None:
    jid, first, second, t = claim_twice(engine)
    before = snapshot(engine)
    with pytest.raises(jobq.LeaseLost):
        jobq.finalize(engine, first, {"from": "first"}, worker_id="w", now=t)
    with pytest.raises(jobq.LeaseLost):
        jobq.heartbeat(engine, first, 30, now=t)
    assert snapshot(engine) == before  # nothing written by the stale dispatch
    assert jobq.heartbeat(engine, second, 30, now=t) == t + 30 * S
    jobq.finalize(engine, second, {"from": "second"}, worker_id="w", now=t + S)
    info = jobq.get(engine, jid)
    assert info is not None
    assert (info.state, info.result, info.attempts) == ("done", {"from": "second"}, 2)


@pytest.mark.parametrize("action", ["fail", "release"])
def test_fail_and_release_are_fenced_per_dispatch_too(engine: sa.Engine, action: str) -> None:
    jid, first, second, t = claim_twice(engine)
    report = {"fail": lambda i: jobq.fail(engine, i, "boom", worker_id="w", now=t),
              "release": lambda i: jobq.release(engine, i, worker_id="w", now=t)}[action]
    before = snapshot(engine)
    with pytest.raises(jobq.LeaseLost):
        report(first)
    assert snapshot(engine) == before
    report(second)
    info = jobq.get(engine, jid)
    assert info is not None and info.state == "ready" and not info.in_flight
    assert (info.error == "boom") is (action == "fail")


def test_an_explicit_token_wins_and_a_plain_int_keeps_the_worker_fence(engine: sa.Engine) -> None:
    """Documented fallbacks: ``token=`` overrides what the id carries; a plain int id without a
    token is fenced by worker_id alone (the old behaviour, for callers that stored the id)."""
    jid, first, second, t = claim_twice(engine)
    with pytest.raises(jobq.LeaseLost):
        jobq.finalize(engine, second, {}, worker_id="w", token=first.token, now=t)
    with pytest.raises(jobq.LeaseLost):
        jobq.finalize(engine, int(second), {}, worker_id="other", now=t)
    jobq.finalize(engine, int(second), {"plain": True}, worker_id="w", now=t)
    assert jobq.get(engine, jid).result == {"plain": True}  # type: ignore[union-attr]


def test_a_claimed_id_is_an_int_everywhere(engine: sa.Engine) -> None:
    """It compares, hashes, pickles and is stored as its number: usable as a dependency id,
    inside args, and as a get() key, on every driver (PyMySQL encodes by exact type)."""
    up = jobq.enqueue(engine, "up")
    cid = jobq.claim(engine, "w", 30)
    assert cid is not None and cid == up and hash(cid) == hash(up) and {cid: 1}[up] == 1
    assert pickle.loads(pickle.dumps(cid)).token == cid.token == copy.deepcopy(cid).token == cid.lease.token
    assert (cid.lease.id, cid.lease.worker_id, cid.lease.type) == (up, "w", "up")
    down = jobq.enqueue(engine, "down", {"upstream": cid}, depends_on=[cid])
    info = jobq.get(engine, down)
    assert info is not None and info.depends_on == (up,) and info.args == {"upstream": up}
    assert type(info.args["upstream"]) is int
    assert jobq.get(engine, cid).state == "leased"  # type: ignore[union-attr]
    jobq.finalize(engine, cid, None, worker_id="w")
    assert jobq.get(engine, down).state == "ready"  # type: ignore[union-attr]

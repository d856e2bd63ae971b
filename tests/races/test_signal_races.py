"""Signals against what they race (issue 42): the suspension of a job that has just found no
signal, the wait's own timeout, a second signal of the same key, and a cancel.

Correct, however they interleave: a signal is never lost (a job that waits for a sent signal
runs again and reads it), each waiting job wakes once and runs once more, only one of two
signals of a key counts and every waiter reads that one, a wait that timed out stays timed
out (its re-runs never read a signal instead), and a cancelled job stays cancelled.

The interleavings that need a window are held open at the checkpoints (``jobq._checkpoint``):
"handler_returned" (the handler read no signal and is unwinding; the suspension is not yet
written), "suspend_checked" (the suspension's transaction has locked and read the key's row)
and "wait_timeout_checked" (a wait past its timeout has locked and read the key's row). There
the signal runs on its own connection until it has committed or the server says it waits for
a row lock: no sleeps, no timing. On SQLite a jobq transaction holds the database's write lock
from its first statement, so the signal runs wholly before or after it; the windows inside a
transaction exist only on the engines with row locks. The two-signal and cancel races start
both sides at a barrier, several rounds, on every engine. Each test has its deliberately
broken variant next to it, which the same check catches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
from dbs import needs
from harness import SUMMARY
from helpers import INNODB_TRX_POLL, backend_id, wait_for, waits_for_a_row_lock

FAST: dict[str, Any] = dict(poll_interval=0.02, lease_ttl=10.0, retry_backoff=lambda attempt: 0.0)
jobs = jobq.Job.__table__


def _outcomes(engine: sa.Engine, job: int) -> list[tuple[int, str]]:
    return [(a.attempt, a.outcome) for a in jobq.attempts(engine, job)]


class _Signaller:
    """Sends one signal on a connection of its own, in a thread, when ``fire`` is called from a
    checkpoint; ``fire`` returns once the signal committed or waits for a row lock."""

    def __init__(self, engine: sa.Engine, key: str, payload: Any) -> None:
        self.main = engine
        self.engine = sa.create_engine(engine.url, pool_size=1, max_overflow=0)
        jobq._prepare(self.engine)
        self.backend = 0
        if self.engine.dialect.name != "sqlite":
            with self.engine.connect() as conn:
                self.backend = backend_id(conn)
        self.out: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._send, args=(key, payload))

    def _send(self, key: str, payload: Any) -> None:
        try:
            self.out["sent"] = jobq.signal(self.engine, key, payload)
        except Exception as exc:  # noqa: BLE001 - recorded for the checks
            self.out["sent"] = exc

    def fire(self) -> None:
        self.thread.start()
        self.out["waited"] = wait_for(
            lambda: "committed" if not self.thread.is_alive() else
            "waits" if self.backend and waits_for_a_row_lock(self.main, self.backend) else None,
            timeout=30, interval=INNODB_TRX_POLL, what="the signal to commit or to wait for a lock") == "waits"

    def close(self) -> None:
        if self.thread.ident is not None:
            self.thread.join(60)
        self.engine.dispose()


# ---- a signal between the handler's read and its suspension ---------------------------------


def _race_suspension(engine: sa.Engine, point: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Job J waits for "k" (another job E waits for it already, so the key's row exists); the
    signal is sent at ``point`` of J's first dispatch. Then the worker drains. Returns J's and
    E's end, the payloads they read, and whether the signal waited for a lock."""
    got: dict[int, Any] = {}

    def handler(ctx: jobq.JobContext) -> dict:
        value = ctx.wait_for("k")
        got[ctx.id] = value
        return {"got": value}

    early = jobq.enqueue(engine, "t", {})
    w = jobq.Worker(engine, {"t": handler}, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=60)
    job = jobq.enqueue(engine, "t", {})
    sig = _Signaller(engine, "k", {"paid": True})

    def checkpoint(name: str, job_ids: Any = ()) -> None:
        if name == point and job in list(job_ids) and sig.thread.ident is None:
            sig.fire()

    monkeypatch.setattr(jobq, "_checkpoint", checkpoint)
    try:
        assert w.run_until_idle(timeout=60)
    finally:
        sig.close()
    monkeypatch.undo()
    assert w.run_until_idle(timeout=60)
    return {"job": job, "early": early, "got": got, "sent": sig.out.get("sent"), "waited": sig.out.get("waited"),
            "states": {i: jobq.get(engine, i).state for i in (job, early)},  # type: ignore[union-attr]
            "outcomes": _outcomes(engine, job)}


def _lost_signals(r: dict[str, Any]) -> list[str]:
    """What a user would see go wrong: a job still asleep after its signal, a wrong payload, a
    job that ran more than once after waking."""
    bad = []
    if r["sent"] is not True:
        bad.append(f"the signal was not recorded: {r['sent']!r}")
    for i in (r["job"], r["early"]):
        if r["states"][i] != "done":
            bad.append(f"job {i} is {r['states'][i]} after its signal was sent (a lost wake-up)")
        elif r["got"].get(i) != {"paid": True}:
            bad.append(f"job {i} read {r['got'].get(i)!r}")
    if r["states"][r["job"]] == "done" and r["outcomes"][-1] != (1, "done"):
        bad.append(f"job {r['job']} history {r['outcomes']}")
    return bad


def _trusting_suspension(conn: sa.Connection, d: Any, o: Any, now: Any) -> tuple[int, str, str]:
    """BROKEN: the suspension trusts the handler's read (no signal) and never looks again."""
    w = o.wait
    n = conn.execute(jobq._q_suspend(o.job_id, o.owner, o.token, w.until or jobq._NEVER, now)).rowcount
    if n:
        conn.execute(jobq._q_insert_wait(), {"job_id": o.job_id, "kind": "signal", "name": w.name, "n": 0,
                                             "waiting": True, "since": now, "until": w.until, "resolved": None})
    return n, "ready", "suspended"


def _unlocked_key(d: Any, key: str) -> sa.Select[Any]:
    """BROKEN: the suspension reads the key's row without locking it."""
    return jobq._q_signal(key)


def _trust_the_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobq, "_write_suspension", _trusting_suspension)


def _check_without_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    # The key's row is read but never locked, nor inserted (on MySQL/MariaDB a duplicate
    # insert share-locks the existing row, which would serialise the signal all the same).
    monkeypatch.setattr(jobq, "_q_lock_signal", _unlocked_key)
    monkeypatch.setattr(jobq._Dialect, "insert_signal_key", lambda self, conn, key, now: None)


BROKEN_SUSPENSIONS: dict[str, tuple[str, Callable[[pytest.MonkeyPatch], None]]] = {
    # variant: (the checkpoint whose window it leaves open, how it breaks jobq)
    "trust_the_handlers_read": ("handler_returned", _trust_the_read),
    "check_without_lock": ("suspend_checked", _check_without_lock),
}


def _check_suspension_race(engine: sa.Engine, dialect: str, point: str, monkeypatch: pytest.MonkeyPatch) -> None:
    r = _race_suspension(engine, point, monkeypatch)
    SUMMARY.append({"engine": dialect, "check": f"signal vs suspension at {point}"})
    assert _lost_signals(r) == []
    assert r["waited"] is (point == "suspend_checked")
    assert r["outcomes"] == [(1, "suspended"), (1, "done")]


def test_a_signal_before_the_suspension_is_written_is_not_lost(engine: sa.Engine, dialect: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """At "handler_returned" the signal commits before the suspension is written: the
    suspension must see it and make the job due at once; both waiters read the payload and J
    runs once more. A lost wake-up would leave J ready and not due for ever."""
    _check_suspension_race(engine, dialect, "handler_returned", monkeypatch)


@needs("row_locks")  # SQLite: the signal cannot run inside the suspension's transaction
def test_a_signal_during_the_suspension_waits_and_wakes_it(engine: sa.Engine, dialect: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """At "suspend_checked" the signal must wait for the suspension's lock on the key, then
    wake the job it now sees waiting: both waiters read the payload, J runs once more."""
    _check_suspension_race(engine, dialect, "suspend_checked", monkeypatch)


@needs("row_locks")  # the unlocked read has its window only inside a transaction on a server
@pytest.mark.parametrize("variant", sorted(BROKEN_SUSPENSIONS))
def test_harness_catches_a_suspension_that_loses_its_signal(engine: sa.Engine, dialect: str, variant: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    point, breaks = BROKEN_SUSPENSIONS[variant]
    breaks(monkeypatch)
    r = _race_suspension(engine, point, monkeypatch)
    SUMMARY.append({"engine": dialect, "check": f"broken suspension {variant}", "caught": True})
    assert _lost_signals(r) != [], f"{variant} lost no signal"


# ---- a signal racing the wait's timeout -----------------------------------------------------


def _race_timeout(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """J waits for "t" with timeout 0 (past at once): its wait decides "timed out" under the
    key's lock, and the signal is sent right then. J's first attempt fails after the answer,
    the retry asks again. Returns each attempt's answer."""
    answers: list[Any] = []

    def handler(ctx: jobq.JobContext) -> dict:
        try:
            answers.append(("value", ctx.wait_for("t", timeout=0)))
        except jobq.WaitTimeout:
            answers.append(("timeout", None))
        if ctx.attempt == 1:
            raise RuntimeError("fail once, so that a re-run asks again")
        return {}

    job = jobq.enqueue(engine, "t", {}, max_attempts=2)
    sig = _Signaller(engine, "t", "late")

    def checkpoint(name: str, job_ids: Any = ()) -> None:
        if name == "wait_timeout_checked" and sig.thread.ident is None:
            sig.fire()

    monkeypatch.setattr(jobq, "_checkpoint", checkpoint)
    w = jobq.Worker(engine, {"t": handler}, max_concurrency=1, **FAST)
    try:
        assert w.run_until_idle(timeout=60)
    finally:
        sig.close()
    return {"answers": answers, "sent": sig.out.get("sent"), "waited": sig.out.get("waited"),
            "state": jobq.get(engine, job).state}  # type: ignore[union-attr]


def _unrecorded_timeout(conn: sa.Connection, job_id: int, kind: str, name: str, exists: bool, **values: Any) -> None:
    """BROKEN: a wait's timeout is decided but not recorded (other wait rows are written)."""
    if values.get("resolved") != "timeout":
        _PUT_WAIT(conn, job_id, kind, name, exists, **values)


_PUT_WAIT = jobq._put_wait


@needs("row_locks")  # SQLite: the signal runs wholly after; tests/core/test_waits.py covers that order
def test_a_wait_that_timed_out_stays_timed_out(engine: sa.Engine, dialect: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The signal comes while the timeout is being decided: it waits for the key's lock, and
    commits after the timeout is recorded. The first answer is a timeout and so is the retry's:
    one outcome per wait, recorded. A bug would show as the retry reading the late payload."""
    r = _race_timeout(engine, monkeypatch)
    SUMMARY.append({"engine": dialect, "check": "signal vs its timeout"})
    assert (r["waited"], r["sent"], r["state"]) == (True, True, "done")
    assert r["answers"] == [("timeout", None), ("timeout", None)]


@needs("row_locks")
def test_harness_catches_a_timeout_that_is_not_recorded(engine: sa.Engine, dialect: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobq, "_put_wait", _unrecorded_timeout)
    r = _race_timeout(engine, monkeypatch)
    SUMMARY.append({"engine": dialect, "check": "broken timeout, not recorded", "caught": True})
    assert r["answers"] != [("timeout", None), ("timeout", None)]


# ---- two signals of one key at once ---------------------------------------------------------

ROUNDS = 4
WAITERS = 3


def _two_signals(engine: sa.Engine) -> list[dict[str, Any]]:
    """Per round: WAITERS jobs wait for a key; two threads signal it with different payloads
    from a barrier; the worker drains. Returns what each side returned and what each job read."""
    got: dict[int, Any] = {}

    def handler(ctx: jobq.JobContext) -> dict:
        got[ctx.id] = ctx.wait_for(ctx.args["key"])
        return {}

    w = jobq.Worker(engine, {"t": handler}, max_concurrency=WAITERS, **FAST)
    rounds = []
    for r in range(ROUNDS):
        key = f"pay-{r}"
        ids = [jobq.enqueue(engine, "t", {"key": key}) for _ in range(WAITERS)]
        assert w.run_until_idle(timeout=60)
        barrier = threading.Barrier(2)
        sent: dict[str, Any] = {}

        def send(payload: str, barrier: threading.Barrier = barrier, sent: dict[str, Any] = sent,
                 key: str = key) -> None:
            barrier.wait(30)
            sent[payload] = jobq.signal(engine, key, payload)

        threads = [threading.Thread(target=send, args=(p,)) for p in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert w.run_until_idle(timeout=60)
        rounds.append({"sent": sent, "read": [got.get(i) for i in ids],
                       "histories": [_outcomes(engine, i) for i in ids]})
    return rounds


def _two_winners(rounds: list[dict[str, Any]]) -> list[str]:
    bad = []
    for i, r in enumerate(rounds):
        winners = sorted(p for p, ok in r["sent"].items() if ok is True)
        if len(winners) != 1:
            bad.append(f"round {i}: {len(winners)} signals counted ({r['sent']})")
        elif r["read"] != [winners[0]] * WAITERS:
            bad.append(f"round {i}: the waiters read {r['read']}, the signal that counted was {winners[0]!r}")
        if any(h != [(1, "suspended"), (1, "done")] for h in r["histories"]):
            bad.append(f"round {i}: histories {r['histories']}")
    return bad


def test_of_two_signals_at_once_one_counts(engine: sa.Engine, dialect: str) -> None:
    """Exactly one signal returns True, every waiter reads its payload, and each waiter woke
    once and ran once more. A second signal that also counted would show as two True."""
    rounds = _two_signals(engine)
    SUMMARY.append({"engine": dialect, "check": "two signals at once"})
    assert _two_winners(rounds) == []


def _overwriting_send(key: str, payload: Any, now: Any) -> sa.Update:
    """BROKEN: a signal overwrites an earlier one of the same key."""
    sg = jobq.Base.metadata.tables["jobq_signals"]
    return sa.update(sg).where(sg.c.key == key).values(payload=payload, sent_at=now)


def test_harness_catches_a_signal_that_overwrites(engine: sa.Engine, dialect: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobq, "_q_send_signal", _overwriting_send)
    rounds = _two_signals(engine)
    SUMMARY.append({"engine": dialect, "check": "broken signal, overwrites", "caught": True})
    assert _two_winners(rounds) != []


# ---- a signal racing a cancel ---------------------------------------------------------------


def _signal_vs_cancel(engine: sa.Engine, order: str, round_: int = 0) -> dict[str, Any]:
    """A suspended job; cancel and signal in ``order`` ("cancel_first", "signal_first", or
    "together" from a barrier); then the worker drains. Returns its end and history."""
    runs: list[int] = []

    def handler(ctx: jobq.JobContext) -> dict:
        runs.append(ctx.id)
        ctx.wait_for(ctx.args["key"])
        return {}

    key = f"approve-{order}-{round_}"
    job = jobq.enqueue(engine, "t", {"key": key})
    w = jobq.Worker(engine, {"t": handler}, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=60)
    out: dict[str, Any] = {}
    calls = {"cancel": lambda: jobq.cancel(engine, job), "signal": lambda: jobq.signal(engine, key, 1)}
    if order == "together":
        barrier = threading.Barrier(2)

        def call(name: str) -> None:
            barrier.wait(30)
            out[name] = calls[name]()

        threads = [threading.Thread(target=call, args=(n,)) for n in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    else:
        for name in (["cancel", "signal"] if order == "cancel_first" else ["signal", "cancel"]):
            out[name] = calls[name]()
    assert w.run_until_idle(timeout=60)
    return {**out, "state": jobq.get(engine, job).state, "runs": len(runs)}  # type: ignore[union-attr]


ORDERS = ["cancel_first", "signal_first", "together"]


def _cancel_broken(r: dict[str, Any]) -> list[str]:
    bad = []
    if r["cancel"] != "cancelled":
        bad.append(f"cancel returned {r['cancel']!r}")
    if r["state"] != "cancelled":
        bad.append(f"the job ended {r['state']}")
    if r["runs"] != 1:
        bad.append(f"the cancelled job ran {r['runs']} times")
    return bad


@pytest.mark.parametrize("order", ORDERS)
def test_a_signal_racing_a_cancel_leaves_it_cancelled(engine: sa.Engine, dialect: str, order: str) -> None:
    """cancel of a suspended job cancels it at once; a signal before or after it (or at the
    same moment) never makes it run again. A wake-up that ignored the state would re-open it."""
    results = [_signal_vs_cancel(engine, order, i) for i in range(ROUNDS if order == "together" else 1)]
    SUMMARY.append({"engine": dialect, "check": f"signal vs cancel, {order}"})
    assert [b for r in results for b in _cancel_broken(r)] == []


def _wake_any_state(ids: Any, now: Any) -> sa.Update:
    """BROKEN: a wake-up that does not check that the job is still ready."""
    return sa.update(jobs).where(jobs.c.id.in_(ids)).values(state="ready", run_after=now, finished_at=None)


def test_harness_catches_a_wake_up_that_reopens_a_cancelled_job(engine: sa.Engine, dialect: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobq, "_q_wake", _wake_any_state)
    r = _signal_vs_cancel(engine, "cancel_first")
    SUMMARY.append({"engine": dialect, "check": "broken wake-up, any state", "caught": True})
    assert _cancel_broken(r) != []

"""How a Worker hands dispatches to its handler threads, and when its loop wakes for outcomes.

A claim's dispatches go on one queue with one wake-up; threads take them in turn, and a thread
that takes one while more wait first gets another thread on its way, so short handlers run back
to back and no dispatch waits behind a running handler. The loop wakes for the first outcome
queued and for the last busy handler returning, not for each outcome. A handler thread the OS
refuses to start strands no dispatch. Each property has a BROKEN variant next to it that the
same check catches. The hand-off never touches the database, so one engine is enough.
"""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa

import jobq
from dbs import only
from helpers import FAST


class _NoSecondTaker(jobq.Worker):
    """BROKEN: a handler thread that takes a dispatch while more wait gets no other thread on
    its way; the rest of the claim waits behind its handler."""

    def _add_taker(self) -> bool:
        if threading.current_thread().name == "jobq-handler":
            return False
        return super()._add_taker()


class _WakeOnlyWhenIdle(jobq.Worker):
    """BROKEN: the loop is woken only when no handler is busy, not for the first outcome."""

    def _finish(self, run, kind, payload):  # type: ignore[no-untyped-def]
        poke = self._poke
        self._poke = lambda: poke() if self._busy == 0 else None  # type: ignore[method-assign]
        try:
            super()._finish(run, kind, payload)
        finally:
            del self._poke


def _all_at_once(engine: sa.Engine, worker: type[jobq.Worker], wait: float) -> list[str]:
    """16 jobs whose handlers meet at a barrier: it opens only if all 16 run at once."""
    n = 16
    ids = [jobq.enqueue(engine, "meet", max_attempts=1) for _ in range(n)]
    gate = threading.Barrier(n, timeout=wait)
    w = worker(engine, {"meet": lambda ctx: (gate.wait(), None)[1]}, max_concurrency=n, **FAST)
    assert w.run_until_idle(timeout=120)
    return [jobq.get(engine, i).state for i in ids]  # type: ignore[union-attr]


@only("sqlite")  # the hand-off never touches the database: one engine is enough
def test_a_claims_dispatches_all_run_at_once(engine: sa.Engine) -> None:
    assert _all_at_once(engine, jobq.Worker, wait=60) == ["done"] * 16


@only("sqlite")  # the hand-off never touches the database: one engine is enough
def test_broken_a_dispatch_waiting_behind_a_running_handler_is_caught(engine: sa.Engine) -> None:
    # The barrier waits 1 s here: with one thread it can never open, and this keeps the run short.
    assert "failed" in _all_at_once(engine, _NoSecondTaker, wait=1)


def _written_while_another_runs(engine: sa.Engine, worker: type[jobq.Worker], wait: float) -> bool:
    """Job 1 returns at once; job 2 runs until it sees job 1 done in the database. The worker
    polls once an hour, so only a wake-up for job 1's outcome gets it written meanwhile."""
    first = jobq.enqueue(engine, "quick")
    second = jobq.enqueue(engine, "watch")
    seen: list[bool] = []

    def watch(ctx: jobq.JobContext) -> None:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if jobq.get(engine, first).state == "done":  # type: ignore[union-attr]
                seen.append(True)
                return
            time.sleep(0.02)  # polling the database: the thing waited for is the worker's write
        seen.append(False)

    w = worker(engine, {"quick": lambda ctx: None, "watch": watch}, max_concurrency=2, poll_interval=3600,
               lease_ttl=30, finalize_delay=0)
    t = threading.Thread(target=w.run)
    t.start()
    try:
        while jobq.get(engine, second).state != "done":  # type: ignore[union-attr]
            assert t.is_alive()
            time.sleep(0.02)
    finally:
        w.stop()
        t.join(60)
    assert not t.is_alive()
    return seen == [True]


@only("sqlite")  # the hand-off never touches the database: one engine is enough
def test_an_outcome_is_written_while_other_handlers_still_run(engine: sa.Engine) -> None:
    assert _written_while_another_runs(engine, jobq.Worker, wait=60)


@only("sqlite")  # the hand-off never touches the database: one engine is enough
def test_broken_a_loop_woken_only_when_idle_is_caught(engine: sa.Engine) -> None:
    assert not _written_while_another_runs(engine, _WakeOnlyWhenIdle, wait=1)


@only("sqlite")  # the hand-off never touches the database: one engine is enough
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_threads_are_reused_and_every_job_runs_once(engine: sa.Engine, executor: str) -> None:
    """Several claims' worth of jobs through eight slots, on handler threads that are reused:
    every job done once, with its own result, and nothing left on the queue."""
    ids = [jobq.enqueue(engine, "t", {"i": i}) for i in range(60 if executor == "thread" else 12)]
    w = jobq.Worker(engine, {"t": _echo}, max_concurrency=8, executor=executor, **FAST)
    assert w.run_until_idle(timeout=120)
    infos = [jobq.get(engine, i) for i in ids]
    assert [(x.state, x.attempts, x.result) for x in infos] == [  # type: ignore[union-attr]
        ("done", 1, {"i": i}) for i in range(len(ids))]
    assert not w._queue


def _echo(ctx: jobq.JobContext) -> dict:
    return {"i": ctx.args["i"]}


class _KeepsRefusedTaker(jobq.Worker):
    """BROKEN: a refused thread start stays counted as a thread on its way to the queue."""

    def _new_thread(self) -> None:
        threading.Thread(target=self._handler_thread, name="jobq-handler", daemon=True).start()


class _RaisesInHandlerThread(jobq.Worker):
    """BROKEN: a handler thread whose request for another thread is refused raises, and ends
    with the dispatch it took never run."""

    def _try_new_thread(self) -> bool:
        self._new_thread()
        return True


def _refuse_handler_threads(monkeypatch: pytest.MonkeyPatch, which: set[int]) -> None:
    """Thread.start raises, as the OS refusing a thread does, for the handler threads numbered
    in ``which`` (1 = the first handler thread asked for)."""
    start = threading.Thread.start
    asked = [0]

    def refusing(self: threading.Thread) -> None:
        if self.name == "jobq-handler":
            asked[0] += 1
            if asked[0] in which:
                raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", refusing)


def _after_a_refused_claim_thread(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, worker: type[jobq.Worker],
                                  wait: float) -> tuple[bool, list[tuple[str, int]]]:
    """The first handler thread is refused: the worker's run raises it (as before). Run again,
    the worker must run every job it holds, each once."""
    ids = [jobq.enqueue(engine, "t") for _ in range(3)]
    _refuse_handler_threads(monkeypatch, {1})
    w = worker(engine, {"t": lambda ctx: None}, max_concurrency=4, **FAST)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        w.run_until_idle(timeout=60)
    idle = w.run_until_idle(timeout=wait)
    jobs = [jobq.get(engine, i) for i in ids]
    return idle, [(j.state, j.attempts) for j in jobs if j is not None]


@only("sqlite")  # the hand-off never touches the database: one engine is enough
def test_a_refused_thread_start_strands_no_dispatch(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _after_a_refused_claim_thread(engine, monkeypatch, jobq.Worker, wait=60) == (True, [("done", 1)] * 3)


@only("sqlite")  # the hand-off never touches the database: one engine is enough
def test_broken_a_refused_thread_counted_as_on_its_way_is_caught(engine: sa.Engine,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Stranded: nothing ever takes the queued dispatches, so the worker is never idle (2 s is
    # what this check gives it; the working worker above finishes in milliseconds).
    idle, jobs = _after_a_refused_claim_thread(engine, monkeypatch, _KeepsRefusedTaker, wait=2)
    assert not idle and ("done", 1) not in jobs


def _after_a_refused_second_thread(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, worker: type[jobq.Worker],
                                   wait: float) -> tuple[bool, list[str]]:
    """A handler thread takes a dispatch while more wait, asks for another thread, and is
    refused: the worker carries on, and that thread runs the rest after its handler."""
    ids = [jobq.enqueue(engine, "t") for _ in range(4)]
    _refuse_handler_threads(monkeypatch, {2})
    w = worker(engine, {"t": lambda ctx: None}, max_concurrency=4, **FAST)
    idle = w.run_until_idle(timeout=wait)
    return idle, [jobq.get(engine, i).state for i in ids]  # type: ignore[union-attr]


@only("sqlite")  # the hand-off never touches the database: one engine is enough
def test_a_handler_thread_refused_another_runs_the_rest(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _after_a_refused_second_thread(engine, monkeypatch, jobq.Worker, wait=60) == (True, ["done"] * 4)


@only("sqlite")  # the hand-off never touches the database: one engine is enough
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the broken thread's end
def test_broken_a_handler_thread_ended_by_a_refusal_is_caught(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    # The thread that took job 1 ends before running it: job 1 is held, heartbeated, never run.
    # The others run in milliseconds; 10 s (the drain can never go idle, so all of it is spent)
    # is for a loaded machine to get at least one of them done.
    idle, states = _after_a_refused_second_thread(engine, monkeypatch, _RaisesInHandlerThread, wait=10)
    assert not idle and "done" in states and states.count("done") < 4

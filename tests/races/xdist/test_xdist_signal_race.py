"""The signal races under pytest-xdist (issue 42): every xdist worker is a worker process on
ONE shared queue, and every one of them sends every signal.

Run it with every worker taking part (``--dist each``; ``nox -s races-<engine>`` does)::

    pytest -p xdist -n 4 --dist each tests/races/xdist

Once every worker has arrived (the claim race before it shares the database), one process
seeds N_JOBS jobs, each waiting in ``ctx.wait_for`` for a key of its own: some
with no timeout, some with a timeout shorter than their signal takes, some cancelled while
they wait, and pairs sharing one key. After a file barrier every process runs a jobq.Worker
(thread executor) and, meanwhile, a sender that signals every key in its own random order
with a payload naming the sender (so each key gets one signal per process at about the same
time: two or more signals at once), a canceller for the cancel subset (a cancel racing the
signal), and a stray claimer that leases a few woken jobs with a short TTL and abandons them
(a reclaim racing the wake-up). Each handler run logs its span (CLOCK_MONOTONIC is one clock
for every process on a machine).

Correct, however they interleave: every job ends done or cancelled (none lost); a job done
once, with one ``done`` in its history; a done job read either its timeout or the one signal
that counts for its key (exactly one sender's signal() returned True per key, and the key's
row holds that sender's payload); a job whose cancel returned "cancelled" stays cancelled; no
two runs of a job overlap.

``JOBQ_SIGNAL_VARIANT`` swaps in a deliberately broken variant of
tests/races/test_signal_races.py in every worker. ``overwrites`` (a second signal of a key
overwrites the first and counts too) is caught in every run, on every engine, by the figure
``keys_won_not_once`` (every key won by every sender; it needs no particular interleaving,
only that every worker signals every key); tests/races/test_xdist_catches.py checks that in a subprocess with 4 workers. ``unlocked`` (the key's row read without a lock,
and never inserted) is not shown caught here: the senders' signal() finds no row to lock and
raises, so the run fails for that, not for a lost signal; the per-test harness
(test_signal_races.py) catches the unlocked check for certain.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa
from test_xdist_race import WORKER, WORKERS, _shared_dir, _url, _wait_files, _write_atomic

import jobq
from harness import ROUNDS, SUMMARY, max_overlap

jobs = jobq.Job.__table__
SIGNALS = jobq._signals
N_JOBS = int(os.environ.get("JOBQ_SIGNAL_RACE_JOBS", str(120 * ROUNDS)))
VARIANT = os.environ.get("JOBQ_SIGNAL_VARIANT", "correct")
TTL = 5.0  # workers' lease: a stray claim's leases expire and are reclaimed by the workers' sweeps
STRAY_TTL = 0.3
START_DEADLINE = 120.0
RUN_DEADLINE = 900.0 * ROUNDS  # a hang guard, not a timed check


def _kind(i: int) -> str:
    return ("plain", "timeout", "cancel", "pair")[i % 4]


def _seed(url: str, dialect: str) -> dict[str, Any]:
    eng = sa.create_engine(url)
    if dialect != "sqlite":
        jobq.Base.metadata.drop_all(eng)
    jobq.create_schema(eng)
    items = []
    for i in range(N_JOBS):
        kind = _kind(i)
        key = f"k{i - 1}" if kind == "pair" else f"k{i}"  # a pair's second job shares the timeout job's key
        args = {"key": key, "timeout": 0.05 if kind == "timeout" else None}
        items.append({"key": str(i), "type": "wait", "args": args, "max_attempts": 50})
    ids = jobq.submit(eng, items)
    eng.dispose()
    return {"jobs": {k: v for k, v in ids.items()}, "keys": sorted({it["args"]["key"] for it in items})}


def _break(variant: str) -> None:
    """Swap in a deliberately broken variant of tests/races/test_signal_races.py (this process only)."""
    if variant == "unlocked":
        from test_signal_races import _unlocked_key
        jobq._q_lock_signal = _unlocked_key
        jobq._Dialect.insert_signal_key = lambda self, conn, key, now: None  # type: ignore[method-assign]
    elif variant == "overwrites":
        from test_signal_races import _overwriting_send
        jobq._q_send_signal = _overwriting_send
    elif variant != "correct":
        raise AssertionError(f"unknown JOBQ_SIGNAL_VARIANT {variant!r}")


class _Process:
    """This xdist worker's part: a Worker, a sender, a canceller and a stray claimer."""

    def __init__(self, url: str, seeded: dict[str, Any]) -> None:
        self.engine = sa.create_engine(url, pool_size=8, max_overflow=4)
        jobq.create_schema(self.engine)
        self.seeded = seeded
        self.runs: list[dict[str, Any]] = []
        self.sent: dict[str, bool] = {}
        self.cancels: dict[str, str] = {}
        self.strays = 0
        self.lock = threading.Lock()
        self.errors: list[BaseException] = []
        self.worker = jobq.Worker(self.engine, {"wait": self._handler}, max_concurrency=4, lease_ttl=TTL,
                                  heartbeat_interval=1.0, poll_interval=0.02, retry_backoff=lambda a: 0.0,
                                  worker_id=f"{WORKER}-w")

    def _handler(self, ctx: jobq.JobContext) -> dict:
        run: dict[str, Any] = {"job": ctx.id, "t0": time.monotonic()}
        try:
            try:
                run["got"] = {"payload": ctx.wait_for(ctx.args["key"], timeout=ctx.args["timeout"])}
            except jobq.WaitTimeout:
                run["got"] = {"timeout": True}
            return run["got"]
        finally:
            run["t1"] = time.monotonic()
            with self.lock:
                self.runs.append(run)

    def _guard(self, fn: Any) -> Any:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # re-raised by the test
                self.errors.append(e)
        return run

    def _send(self) -> None:
        keys = list(self.seeded["keys"])
        random.Random(WORKER).shuffle(keys)
        for key in keys:
            self.sent[key] = jobq.signal(self.engine, key, {"from": WORKER})
            time.sleep(random.uniform(0, 0.01))  # spread the sends over the workers' dispatches

    def _cancel(self) -> None:
        targets = [int(j) for k, j in self.seeded["jobs"].items() if _kind(int(k)) == "cancel"]
        random.Random(f"c{WORKER}").shuffle(targets)
        for job in targets[: max(1, len(targets) // WORKERS)]:
            self.cancels[str(job)] = jobq.cancel(self.engine, job)
            time.sleep(random.uniform(0, 0.01))

    def _stray(self) -> None:
        # Leases a few due jobs (woken ones, mostly) under a short TTL and abandons them: the
        # workers' reclaim sweeps return them while signals still wake others.
        for _ in range(3):
            self.strays += len(jobq.claim_batch(self.engine, f"{WORKER}-stray", STRAY_TTL, limit=2))
            time.sleep(0.05)

    def run(self) -> None:
        runner = threading.Thread(target=self._guard(self.worker.run))
        helpers = [threading.Thread(target=self._guard(f)) for f in (self._send, self._cancel, self._stray)]
        runner.start()
        for t in helpers:
            t.start()
        for t in helpers:
            t.join()
        end = time.monotonic() + RUN_DEADLINE
        while time.monotonic() < end and not self.errors:
            with self.engine.connect() as conn:
                left = conn.execute(sa.select(sa.func.count()).where(jobs.c.state.not_in(jobq.TERMINAL))).scalar_one()
            if left == 0:
                break
            time.sleep(0.05)
        self.worker.stop()
        runner.join(120)
        self.engine.dispose()
        if self.errors:
            raise self.errors[0]


@pytest.mark.timeout(RUN_DEADLINE + 2 * START_DEADLINE + 300)
def test_signals_from_every_xdist_worker_wake_each_job_once(dialect: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    shared = _shared_dir(tmp_path_factory) / f"signals-{dialect}"
    shared.mkdir(exist_ok=True)
    url = _url(dialect, shared)
    me = {"worker": WORKER}
    try:
        # Every worker is done with the tests before this one (the claim race still reads the
        # shared database in its check) before anyone drops and seeds it.
        _write_atomic(shared / f"{WORKER}.ready", me)
        _wait_files(shared, "*.ready", WORKERS, RUN_DEADLINE, "the barrier before seeding")
        try:
            os.close(os.open(shared / "seed.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            seeder = True
        except FileExistsError:
            seeder = False
        if seeder:
            try:
                _write_atomic(shared / "seeded.json", _seed(url, dialect))
            except BaseException as e:
                _write_atomic(shared / "seeded.json", {"error": repr(e)})
                raise
        [seeded_file] = _wait_files(shared, "seeded.json", 1, START_DEADLINE, "seeding")
        seeded = json.loads(seeded_file.read_text())
        _break(VARIANT)
        proc = _Process(url, seeded)
        _write_atomic(shared / f"{WORKER}.arrived", me)
        _wait_files(shared, "*.arrived", WORKERS, START_DEADLINE, "start barrier")
        proc.run()
        _write_atomic(shared / f"{WORKER}.log.json", {"runs": proc.runs, "sent": proc.sent, "cancels": proc.cancels,
                                                    "strays": proc.strays})
        _write_atomic(shared / f"{WORKER}.done", me)
    except BaseException as e:
        _write_atomic(shared / f"{WORKER}.done", {**me, "error": repr(e)})
        raise
    _wait_files(shared, "*.done", WORKERS, RUN_DEADLINE, "finish barrier")
    _check(url, shared, dialect, seeded)


def _check(url: str, shared: Any, dialect: str, seeded: dict[str, Any]) -> None:
    logs = [json.loads(p.read_text()) for p in sorted(shared.glob("*.log.json"))]
    assert len(logs) == WORKERS
    eng = sa.create_engine(url)
    with eng.connect() as conn:
        rows = {r.id: r for r in conn.execute(sa.select(jobs.c.id, jobs.c.state, jobs.c.args, jobs.c.result))}
        stored = {k: p for k, p in conn.execute(sa.select(SIGNALS.c.key, SIGNALS.c.payload)
                                                .where(SIGNALS.c.sent_at.is_not(None)))}
    dones = {j: sum(1 for a in jobq.attempts(eng, j) if a.outcome == "done") for j in rows}
    eng.dispose()
    wins = Counter(k for lg in logs for k, ok in lg["sent"].items() if ok)
    cancelled = {int(j) for lg in logs for j, out in lg["cancels"].items() if out == "cancelled"}
    spans: dict[int, list[tuple[float, float]]] = {}
    for lg in logs:
        for r in lg["runs"]:
            spans.setdefault(r["job"], []).append((r["t0"], r["t1"]))
    bad: dict[str, Any] = {}
    bad["lost"] = [j for j, r in rows.items() if r.state not in ("done", "cancelled")]
    bad["done_twice"] = [j for j, n in dones.items() if n > 1]
    bad["keys_won_not_once"] = {k: wins[k] for k in seeded["keys"] if wins[k] != 1}
    bad["wrong_payload"] = [j for j, r in rows.items() if r.state == "done" and r.result != {"timeout": True}
                            and r.result != {"payload": stored.get(r.args["key"])}]
    bad["cancel_undone"] = [j for j in cancelled if rows[j].state != "cancelled"]
    bad["overlapping_runs"] = [j for j, s in spans.items() if max_overlap(s) > 1]
    bad = {k: v for k, v in bad.items() if v}
    if WORKER == "gw0":
        res = {"variant": VARIANT, "jobs": len(rows), "runs": sum(len(s) for s in spans.values()),
               "strays": sum(lg["strays"] for lg in logs), "cancelled": len(cancelled), "bad": bad}
        _write_atomic(shared / "result.json", res)
        SUMMARY.append({"engine": dialect, "check": f"xdist signals ({VARIANT})", "claimers": f"{WORKERS} processes",
                        "claims": res["runs"], "lost": len(bad.get("lost", [])),
                        "dups": len(bad.get("done_twice", [])) + len(bad.get("overlapping_runs", []))})
    assert not bad, f"the xdist signal race ({VARIANT}) broke: {bad}"

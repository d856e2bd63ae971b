"""The race harness: many claimer processes x threads, started on one barrier, against one queue.

Every claim is appended to a per-process JSON-lines log that no other claimer can write, and
the logs are checked after the run together with the final table, not instead of it.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import pathlib
import random
import threading
import time
from collections import Counter
from typing import Any

import sqlalchemy as sa

import jobq

#: Rows of the summary table printed at the end of the run (tests/races/conftest.py).
SUMMARY: list[dict[str, object]] = []

ROUNDS = max(1, int(os.environ.get("JOBQ_RACE_ROUNDS", "1")))  # scale runs up to verify an engine longer

# Claims are proven inside a window only by their whole (asked, answered) span, so no slack
# for scheduling delays is needed; 5 ms covers microsecond rounding of logged times and drift
# between the database's clock and this machine's monotonic one over a window.
CLOCK_MARGIN = 0.005

jobs = jobq.Job.__table__
_ctx = mp.get_context("spawn")  # fresh interpreters: no engine or lock inherited across fork


@dataclasses.dataclass
class DrainResult:
    variant: str
    claimers: int
    jobs: int
    claims: int
    duplicates: int  # jobs claimed more than once while their lease was live
    lost: int  # jobs not done at the end
    double_done: int  # jobs whose fenced finalize succeeded more than once
    max_overlap: int
    cap: int | None
    seconds: float
    # Per job: (asked, answered), monotonic, around the claim call that leased it. The claim's
    # own instant lies inside; CLOCK_MONOTONIC is one clock for every process on this machine.
    claim_spans: list[tuple[float, float]] = dataclasses.field(default_factory=list)


def seed_jobs(engine: sa.Engine, n: int, type_: str = "race", groups: int = 1) -> list[int]:
    with engine.begin() as conn:  # one transaction: seeding is not what is measured
        return [jobq.enqueue(conn, type_, {"i": i}, **({"group_key": f"g{i % groups:03d}"} if groups > 1 else {}))
                for i in range(n)]


def _engine(url: str, threads: int) -> sa.Engine:
    return sa.create_engine(url, pool_size=threads + 2, max_overflow=4, pool_pre_ping=False)


def _ready_left(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).where(jobs.c.state == "ready")).scalar_one()


def _run_threads(fn: Any, n: int) -> None:
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _drain_proc(url: str, variant: str, pidx: int, threads: int, barrier: Any, out: str, cap: int | None,
                hold: float, batch_max: int, seed: int) -> None:
    if variant.startswith("async"):
        return _async_drain_proc(url, variant, pidx, threads, barrier, out, cap, hold, batch_max, seed)
    from variants import VARIANTS

    claim = VARIANTS[variant]
    engine = _engine(url, threads)
    jobq.create_schema(engine)  # prepares the engine; the schema exists
    records: list[dict[str, Any]] = []
    lock = threading.Lock()

    def worker(tid: int) -> None:
        wid = f"p{pidx}t{tid}"
        rnd = random.Random(seed * 1000 + pidx * 10 + tid)
        barrier.wait(120)
        while True:
            t_ask = time.monotonic()
            try:
                got = claim(engine, wid, rnd.randint(1, batch_max), cap)
            except sa.exc.OperationalError:
                got = []  # broken variants may surface lock errors; jobq's claim must not
                if variant == "correct":
                    raise
            t_claim = time.monotonic()
            if not got:
                if _ready_left(engine) == 0:
                    return
                time.sleep(0.002)
                continue
            if hold:
                time.sleep(hold * rnd.uniform(0.5, 1.5))
            t_release = time.monotonic()
            for job_id, token in got:
                try:
                    jobq.finalize(engine, job_id, {"by": wid}, worker_id=wid, token=token)
                    ok = True
                except jobq.LeaseLost:
                    ok = False
                with lock:
                    records.append({"job": job_id, "wid": wid, "token": token, "ta": t_ask, "t0": t_claim, "t1": t_release, "ok": ok})

    _run_threads(worker, threads)
    with open(out, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    engine.dispose()


def _async_drain_proc(url: str, variant: str, pidx: int, tasks: int, barrier: Any, out: str, cap: int | None,
                      hold: float, batch_max: int, seed: int) -> None:
    """An async claim variant and jobq.aio's finalize: ``tasks`` coroutines on one event loop
    per process, on an AsyncEngine, logged exactly like the thread claimers."""
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    from dbs import async_url
    from variants import ASYNC_VARIANTS

    claim = ASYNC_VARIANTS[variant]

    async def main() -> list[dict[str, Any]]:
        engine = create_async_engine(async_url(url), pool_size=tasks + 2, max_overflow=4)
        await jobq.aio.create_schema(engine)
        records: list[dict[str, Any]] = []

        async def worker(tid: int) -> None:
            wid = f"p{pidx}a{tid}"
            rnd = random.Random(seed * 1000 + pidx * 10 + tid)
            while True:
                t_ask = time.monotonic()
                try:
                    got = await claim(engine, wid, rnd.randint(1, batch_max), cap)
                except sa.exc.OperationalError:
                    if variant == "async":  # broken variants may surface lock errors; jobq's claim must not
                        raise
                    got = []
                t_claim = time.monotonic()
                if not got:
                    if await _ready(engine) == 0:
                        return
                    await asyncio.sleep(0.002)
                    continue
                if hold:
                    await asyncio.sleep(hold * rnd.uniform(0.5, 1.5))
                t_release = time.monotonic()
                for job_id, token in got:
                    try:
                        await jobq.aio.finalize(engine, job_id, {"by": wid}, worker_id=wid, token=token)
                        ok = True
                    except jobq.LeaseLost:
                        ok = False
                    records.append({"job": job_id, "wid": wid, "token": token, "ta": t_ask, "t0": t_claim, "t1": t_release, "ok": ok})

        barrier.wait(120)
        await asyncio.gather(*(worker(i) for i in range(tasks)))
        await engine.dispose()
        return records

    records = asyncio.run(main())
    with open(out, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


async def _ready(engine: Any) -> int:
    async with engine.connect() as conn:
        return (await conn.execute(sa.select(sa.func.count()).where(jobs.c.state == "ready"))).scalar_one()


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    points = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda p: (p[0], p[1]))
    level = peak = 0
    for _, delta in points:
        level += delta
        peak = max(peak, level)
    return peak


def run_drain(url: str, variant: str, tmp: pathlib.Path, *, n_jobs: int, procs: int = 3, threads: int = 4,
              cap: int | None = None, hold: float = 0.0, batch_max: int = 4, seed: int = 1,
              groups: int = 1) -> DrainResult:
    """Drain ``n_jobs`` (in ``groups`` groups) with procs x threads claimers using ``variant``;
    check the logs and table."""
    engine = sa.create_engine(url)
    ids = seed_jobs(engine, n_jobs, groups=groups)
    barrier = _ctx.Barrier(procs if variant.startswith("async") else procs * threads)  # async: one wait per process
    outs = [str(tmp / f"{variant}-{seed}-p{i}.jsonl") for i in range(procs)]
    t0 = time.monotonic()
    ps = [_ctx.Process(target=_drain_proc, args=(url, variant, i, threads, barrier, outs[i], cap, hold, batch_max, seed))
          for i in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(600)
        assert p.exitcode == 0, f"claimer process exited with {p.exitcode}"
    seconds = time.monotonic() - t0
    records = []
    for out in outs:
        with open(out) as f:
            records += [json.loads(line) for line in f]
    claims = Counter(r["job"] for r in records)
    oks = Counter(r["job"] for r in records if r["ok"])
    with engine.connect() as conn:
        states = dict(conn.execute(sa.select(jobs.c.id, jobs.c.state).where(jobs.c.id.in_(ids))).all())
    engine.dispose()
    return DrainResult(
        variant=variant,
        claimers=procs * threads,
        jobs=n_jobs,
        claims=len(records),
        duplicates=sum(1 for n in claims.values() if n > 1),
        lost=sum(1 for i in ids if states.get(i) != "done"),
        double_done=sum(1 for n in oks.values() if n > 1),
        max_overlap=max_overlap([(r["t0"], r["t1"]) for r in records]),
        cap=cap,
        seconds=seconds,
        claim_spans=sorted((r["ta"], r["t0"]) for r in records),
    )


def _slot_proc(url: str, variant: str, pidx: int, threads: int, barrier: Any, rounds: int, out: str, cap: int) -> None:
    from variants import VARIANTS

    claim = VARIANTS[variant]
    engine = _engine(url, threads)
    jobq.create_schema(engine)
    wins: list[tuple[int, str, int]] = []
    lock = threading.Lock()

    def worker(tid: int) -> None:
        wid = f"p{pidx}t{tid}"
        for rnd in range(rounds):
            barrier.wait(120)  # everyone ready: race for the one free slot
            try:
                got = claim(engine, wid, 1, cap)
            except sa.exc.OperationalError:
                if variant == "correct":
                    raise
                got = []
            barrier.wait(120)  # everyone has tried
            for job_id, token in got:
                with lock:
                    wins.append((rnd, wid, job_id))
                jobq.finalize(engine, job_id, {}, worker_id=wid, token=token)
            barrier.wait(120)  # the slot is free again

    _run_threads(worker, threads)
    with open(out, "w") as f:
        json.dump(wins, f)
    engine.dispose()


def run_last_slot(url: str, variant: str, tmp: pathlib.Path, *, cap: int = 4, procs: int = 3, threads: int = 4,
                  rounds: int = 30) -> list[int]:
    """cap N with N-1 slots held by a sleeper; every round all claimers race for the last slot.
    Returns the number of winners per round."""
    engine = sa.create_engine(url)
    seed_jobs(engine, cap - 1, "held")
    held = jobq.claim_batch(engine, "holder", 600, limit=cap - 1, types=["held"])
    assert len(held) == cap - 1
    seed_jobs(engine, rounds * procs * threads)
    barrier = _ctx.Barrier(procs * threads)
    outs = [str(tmp / f"slot-{variant}-p{i}.json") for i in range(procs)]
    ps = [_ctx.Process(target=_slot_proc, args=(url, variant, i, threads, barrier, rounds, outs[i], cap)) for i in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(600)
        assert p.exitcode == 0, f"claimer process exited with {p.exitcode}"
    per_round: Counter[int] = Counter()
    for out in outs:
        with open(out) as f:
            per_round.update(r for r, _w, _j in json.load(f))
    for lease in held:
        jobq.finalize(engine, lease.id, {}, worker_id="holder", token=lease.token)
    engine.dispose()
    return [per_round.get(r, 0) for r in range(rounds)]

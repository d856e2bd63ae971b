"""Recurring jobs: several worker processes fire one schedule over many slots.

Four processes (real interpreters, spawned) share one every-minute schedule. For each of 40
slots they meet on a barrier and all call ``jobq._fire_due`` (what every Worker calls on its
cadence) with the clock set 30 s past the slot, so every process finds the same slot due at
the same moment. Correct: each slot is enqueued exactly once (40 jobs, 40 distinct
``run_after`` values, the schedule's ``runs`` = 40), whichever process wins each round. A bug
shows as two jobs with one ``run_after`` (a slot enqueued twice) or a slot with no job.

The deliberately broken variant beside it, ``unfenced``, does what a naive scheduler does: it
trusts its due read and, in a second transaction, moves the schedule on and enqueues without a
fence on what it read. The test requires it to be caught (duplicates > 0).
"""

from __future__ import annotations

import datetime as dt
import json
import multiprocessing as mp
import pathlib
import time
from collections import Counter
from typing import Any

import sqlalchemy as sa

import jobq
from harness import SUMMARY

PROCS = 4
SLOTS = 40
MIN = dt.timedelta(minutes=1)
jobs = jobq.Job.__table__
sch = jobq.Base.metadata.tables["jobq_schedules"]
_ctx = mp.get_context("spawn")


def unfenced_fire(engine: sa.Engine, now: dt.datetime) -> list[int]:
    """BROKEN: the due read in one transaction, then the advance and the enqueue in another,
    with no condition on what was read (no revision fence)."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(sch).where(sch.c.paused == sa.false(), sch.c.next_run_at <= now)).all()
        conn.rollback()
    out = []
    for row in rows:
        slot, nxt = jobq._catch_up(row, now)

        def run(conn: sa.Connection, d: Any, row: Any = row, slot: dt.datetime = slot, nxt: dt.datetime = nxt) -> int:
            conn.execute(sa.update(sch).where(sch.c.name == row.name)
                         .values(next_run_at=nxt, last_slot=slot, runs=sch.c.runs + 1))
            return jobq.enqueue(conn, row.type, row.args, run_after=slot.replace(tzinfo=dt.UTC))

        out.append(jobq._transaction(engine, run))
    return out


def _fire_proc(url: str, variant: str, pidx: int, first: dt.datetime, barrier: Any, out: str) -> None:
    engine = sa.create_engine(url, pool_size=2, max_overflow=2)
    jobq.create_schema(engine)  # prepares the engine; the schema exists
    fire = jobq._fire_due if variant == "correct" else unfenced_fire
    got: list[dict[str, Any]] = []
    for k in range(SLOTS):
        barrier.wait(120)
        ids = fire(engine, first + k * MIN + dt.timedelta(seconds=30))
        got.append({"slot": k, "jobs": ids})
    pathlib.Path(out).write_text(json.dumps(got))
    engine.dispose()


def _run(engine: sa.Engine, variant: str, tmp: pathlib.Path) -> dict[str, Any]:
    with engine.connect() as conn:
        now = jobq._prepare(engine).db_now(conn)
    first = now.replace(microsecond=0) + dt.timedelta(days=1)
    info = jobq.schedule(engine, "race", "t", every=MIN, start=first.replace(tzinfo=dt.UTC))
    assert info.next_run_at == first.replace(tzinfo=dt.UTC)
    url = engine.url.render_as_string(hide_password=False)
    barrier = _ctx.Barrier(PROCS)
    outs = [str(tmp / f"{variant}-{i}.json") for i in range(PROCS)]
    t0 = time.monotonic()
    ps = [_ctx.Process(target=_fire_proc, args=(url, variant, i, first, barrier, outs[i])) for i in range(PROCS)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(600)
    assert all(p.exitcode == 0 for p in ps), [p.exitcode for p in ps]
    reported = sum(len(r["jobs"]) for o in outs for r in json.loads(pathlib.Path(o).read_text()))
    with engine.connect() as conn:
        run_afters = [r.replace(tzinfo=None) if r.tzinfo else r for r in conn.execute(sa.select(jobs.c.run_after)).scalars()]
    per_slot = Counter(run_afters)
    [final] = jobq.schedules(engine)
    res = {"enqueues": len(run_afters), "reported": reported, "slots_enqueued": len(per_slot),
           "duplicates": len(run_afters) - len(per_slot), "missing": SLOTS - len(per_slot),
           "runs": final.runs, "secs": round(time.monotonic() - t0, 1),
           "right_slots": set(per_slot) <= {first + k * MIN for k in range(SLOTS)}}
    SUMMARY.append({"engine": engine.dialect.name, "check": f"schedule slots ({variant})", "claimers": PROCS,
                    "claims": res["enqueues"], "dups": res["duplicates"], "lost": res["missing"],
                    "secs": res["secs"], "caught": "yes" if variant != "correct" and res["duplicates"] else ""})
    return res


def test_each_slot_is_enqueued_once_across_processes(engine: sa.Engine, tmp_path: pathlib.Path) -> None:
    """4 processes x 40 slots, all firing each slot at once: 40 jobs, one per slot."""
    res = _run(engine, "correct", tmp_path)
    assert res["right_slots"], res
    assert (res["enqueues"], res["duplicates"], res["missing"], res["runs"], res["reported"]) == (
        SLOTS, 0, 0, SLOTS, SLOTS), res


def test_race_catches_an_unfenced_firing(engine: sa.Engine, tmp_path: pathlib.Path) -> None:
    """The same run with the broken ``unfenced`` firing: some slot is enqueued twice."""
    res = _run(engine, "unfenced", tmp_path)
    assert res["duplicates"] > 0, f"the harness did not catch the unfenced firing: {res}"

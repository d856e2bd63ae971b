"""jobq benchmark, "lock" mode: how long each claim holds the cap's lock, with N worker processes.

A capped claim serialises on one row (``jobq_meta``'s claim_lock, or SQLite's write lock): from
the statement that locks it to the end of the commit, no other claim can count and lease. This
drains ``--jobs`` no-op jobs with 1, 4 and 8 worker processes (as bench.py's drain: 64 slots
per process, ``local_concurrency=64``, under a cap of 64 per process) and reports, per claim, how
long the lock was held (median and 95th percentile) and the lock's utilisation: the summed hold
time of all processes over the drain's wall time. Near 100% the claim lock, not the workers, sets the throughput.

The hold is measured in each worker process with SQLAlchemy events: from the return of the
statement that locks the cap row (``after_cursor_execute``) to the connection's return to the
pool after the commit (``checkin``). On SQLite, from ``BEGIN IMMEDIATE`` to the same point.

Run:
    python bench/lock_hold.py --url postgresql+psycopg://postgres@127.0.0.1/test --procs 1,4,8
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pathlib
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import sqlalchemy as sa
import throughput as T
from sqlalchemy import event

import bench as B


def _holds(eng: sa.Engine) -> list[float]:
    """Install the listeners on ``eng``; returns the list the hold times (s) are appended to."""
    holds: list[float] = []
    held: dict[int, float] = {}

    @event.listens_for(eng, "after_cursor_execute")
    def locked(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        if "jobq_meta" in statement and " FOR " in statement and id(conn.connection.dbapi_connection) not in held:
            held[id(conn.connection.dbapi_connection)] = time.perf_counter()

    @event.listens_for(eng, "begin")
    def begun(conn: Any) -> None:
        if eng.dialect.name == "sqlite" and conn.get_execution_options().get("jobq_immediate"):
            held[id(conn.connection.dbapi_connection)] = time.perf_counter()

    @event.listens_for(eng.pool, "checkin")
    def returned(dbapi_conn: Any, record: Any) -> None:
        t = held.pop(id(dbapi_conn), None)
        if t is not None:
            holds.append(time.perf_counter() - t)

    return holds


def _worker(url: str, conc: int, cap: int, ready: Any, go: Any, out: Any) -> None:
    eng = sa.create_engine(url)
    holds = _holds(eng)
    w = B.jobq.Worker(eng, {"noop": B._noop}, max_concurrency=cap, local_concurrency=conc, poll_interval=0.05,
                      lease_ttl=60)
    ready.set()
    go.wait()
    w.run_until_idle()
    out.put(holds)


def drain(url: str, n_jobs: int, n_procs: int, conc: int = 64) -> tuple[float, list[float]]:
    """Seed ``n_jobs`` no-op jobs, drain them with ``n_procs`` workers; (seconds, hold times)."""
    T._jobq_seed(url, n_jobs)  # as the drain benchmark seeds jobq's contender
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    readies = [ctx.Event() for _ in range(n_procs)]
    procs = [ctx.Process(target=_worker, args=(url, conc, conc * n_procs, readies[i], go, out))
             for i in range(n_procs)]
    for p in procs:
        p.start()
    for r in readies:
        if not r.wait(120):
            raise RuntimeError("a worker process did not get ready")
    t0 = time.perf_counter()
    go.set()
    holds = [h for _ in procs for h in out.get(timeout=600)]
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join()
    return elapsed, holds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--procs", default="1,4,8")
    args = ap.parse_args()
    print("| processes | jobs/s | claims | hold per claim, median | p95 | lock utilisation |")
    print("| --- | --- | --- | --- | --- | --- |")
    for p in (int(x) for x in args.procs.split(",")):
        secs, holds = drain(args.url, args.jobs, p)
        holds.sort()
        p95 = holds[int(0.95 * (len(holds) - 1))] if holds else 0.0
        print(f"| {p} | {args.jobs / secs:,.0f} | {len(holds):,} | {statistics.median(holds) * 1e3:.2f} ms | "
              f"{p95 * 1e3:.2f} ms | {sum(holds) / secs:.0%} |", flush=True)


if __name__ == "__main__":
    main()

"""jobq benchmark, "guarantees" mode: what each guarantee and the handler threads cost a drain.

One process drains the same no-op jobs with the DBAPI ceiling (bench/throughput.py) and with
variants of jobq, the order rotating each round, and prints the medians and each one's ratio
to the ceiling. The variants patch jobq in this process only, and are not safe to run jobs
with: ``nohist`` writes no attempt-history rows, ``nodag`` skips the DAG bookkeeping
(``_settle``), ``nocap`` claims without the global cap (no in-flight count, no claim lock),
``none`` all three, and ``+inline`` runs each handler on the loop's thread instead of a
handler thread (no timeouts, no ``stop()`` while a handler runs).

Run:
    python bench/guarantees.py --url sqlite:////dev/shm/jobq_g.db
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import sqlalchemy as sa
import throughput as T

import bench as B

jobq = B.jobq
_REAL = {"_settle": jobq._settle, "_q_record_attempts": jobq._q_record_attempts,
         "_start_all": jobq.Worker._start_all}
_NO_HISTORY = (sa.text("SELECT 1"), {})


def _inline(self: Any, runs: Sequence[Any]) -> None:
    for run in runs:
        kind, payload = self._execute(run)
        self._finish(run, kind, payload)  # counts this "thread" a taker again: undo that
        with self._lock:
            self._takers -= 1


class _NoCap(jobq.Worker):  # type: ignore[misc, name-defined]
    def _claim(self, conn: Any, d: Any, now: Any, *, limit: int, sweep: bool = True) -> Any:
        return [], jobq._lease_rows(conn, d, worker_id=self.worker_id, ttl=self.lease_ttl, now=now, limit=limit,
                                    types=self._types, max_in_flight=None, group_caps=None, state="running"), []


def _variant(name: str) -> type:
    """Patch jobq for ``name``; returns the Worker class to run."""
    jobq._settle, jobq._q_record_attempts = _REAL["_settle"], _REAL["_q_record_attempts"]
    jobq.Worker._start_all = _REAL["_start_all"]
    parts = set(name.split("+"))
    if parts & {"nohist", "none"}:
        jobq._q_record_attempts = lambda d, rec, now: _NO_HISTORY
    if parts & {"nodag", "none"}:
        jobq._settle = lambda *a, **k: None
    if "inline" in parts:
        jobq.Worker._start_all = _inline
    return _NoCap if parts & {"nocap", "none"} else jobq.Worker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="sqlite:////dev/shm/jobq_g.db")
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="ceiling,shipped,inline,none,none+inline")
    args = ap.parse_args()
    names = args.variants.split(",")
    got: dict[str, list[float]] = {k: [] for k in names}
    for i in range(args.rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            T._jobq_seed(args.url, args.jobs)
            gc.collect()
            t0 = time.perf_counter()
            if name == "ceiling":
                T._ceiling_loop(args.url)
            else:
                eng = sa.create_engine(args.url)
                worker = _variant(name)(eng, {"noop": B._noop}, max_concurrency=64, poll_interval=0.05, lease_ttl=60)
                worker.run_until_idle()
                eng.dispose()
            got[name].append(args.jobs / (time.perf_counter() - t0))
            print(f"  round {i + 1} {name}: {got[name][-1]:,.0f} jobs/s", flush=True)
    _variant("shipped")
    ceiling = statistics.median(got["ceiling"]) if "ceiling" in got else None
    print(f"{args.jobs:,} jobs, 64 slots, medians of {args.rounds}:")
    for name, rates in got.items():
        m = statistics.median(rates)
        print(f"  {name:14s} {m:9,.0f} jobs/s" + (f"  {m / ceiling:.2f}x the ceiling" if ceiling else ""))


if __name__ == "__main__":
    main()

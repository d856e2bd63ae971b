"""jobq benchmark, "guarantees" mode: what each guarantee and the handler threads cost a drain.

One process drains the same no-op jobs with the DBAPI ceiling (bench/throughput.py) and with
variants of jobq, the order rotating each round, and prints the medians and each one's ratio
to the ceiling. The variants patch jobq in this process only, and are not safe to run jobs
with: ``nohist`` writes no attempt-history rows, ``nodag`` skips the DAG bookkeeping
(``_settle``; on PostgreSQL ``nohist`` also leaves the history out of the finish's one statement),
``nocap`` claims without the global cap (no in-flight count, no claim lock),
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
         "_q_finish_recorded": jobq._q_finish_recorded, "_start_all": jobq.Worker._start_all}
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


def _finish_without_history(d: Any) -> Any:
    """PostgreSQL writes a batch's finish and its history rows in one statement
    (jobq._q_finish_recorded): the same finish, counted the same way, without the history, so
    that ``nohist`` leaves it out there too."""
    def build() -> Any:
        c = jobq._c
        fin = jobq._q_finish_batch_same(d).returning(c.id, c.attempts, c.started_at).cte("fin")
        return sa.select(sa.select(sa.func.count()).select_from(fin).scalar_subquery().label("n"))
    return jobq._prebuilt(d, "guarantees:finish:nohist", build)


def _variant(name: str) -> type:
    """Patch jobq for ``name``; returns the Worker class to run."""
    for key in ("_settle", "_q_record_attempts", "_q_finish_recorded"):
        setattr(jobq, key, _REAL[key])
    jobq.Worker._start_all = _REAL["_start_all"]
    parts = set(name.split("+"))
    history, dag = not parts & {"nohist", "none"}, not parts & {"nodag", "none"}
    if not history:
        jobq._q_record_attempts = lambda d, rec, now: _NO_HISTORY
        jobq._q_finish_recorded = _finish_without_history
    if not dag:
        jobq._settle = lambda *a, **k: None
    if "inline" in parts:
        jobq.Worker._start_all = _inline
    return _NoCap if parts & {"nocap", "none"} else jobq.Worker


def _check(url: str, jobs: int, history: bool) -> None:
    """Every job done, and history rows for each exactly where the variant writes them (the
    ceiling writes none): a variant that left out nothing, or too much, is no figure."""
    eng = sa.create_engine(url)
    with eng.connect() as conn:
        done = conn.execute(sa.text("SELECT count(*) FROM jobs WHERE state = 'done'")).scalar()
        rows = conn.execute(sa.text("SELECT count(*) FROM jobq_attempts")).scalar()
    eng.dispose()
    if done != jobs:
        raise RuntimeError(f"{done} of {jobs} jobs done")
    if rows != (jobs if history else 0):
        raise RuntimeError(f"{rows} history rows after {jobs} jobs")


#: What each variant leaves out (bench.py prints it under the table).
MEANING = {
    "shipped": "jobq as it ships",
    "inline": "handlers on the loop's thread, no handler threads (no timeouts, no stop() mid-handler)",
    "nohist": "no attempt-history rows",
    "nodag": "no DAG bookkeeping (dependents, parents)",
    "nocap": "no global cap (no claim lock, no in-flight count)",
    "none": "none of history, DAG bookkeeping and cap",
    "none+inline": "none of them, handlers inline",
}
VARIANTS = ("ceiling", "shipped", "inline", "nohist", "nodag", "nocap", "none", "none+inline")


def measure(url: str, jobs: int, rounds: int, variants: Sequence[str] = VARIANTS, conc: int = 64,
            log: Any = print) -> dict[str, list[tuple[float, float]]]:
    """Drain ``jobs`` no-op jobs with each variant, ``rounds`` times, the order reversing every
    other round; returns variant -> [(jobs/s, client CPU µs a job), ...]. jobq is patched only
    while a variant drains, and restored even when one fails."""
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    try:
        for i in range(rounds):
            for name in variants if i % 2 == 0 else variants[::-1]:
                T._jobq_seed(url, jobs)
                gc.collect()
                c0, t0 = B._cpu(), time.perf_counter()
                if name == "ceiling":
                    T._ceiling_loop(url)
                else:
                    eng = sa.create_engine(url)
                    worker = _variant(name)(eng, {"noop": B._noop}, max_concurrency=conc, poll_interval=0.05,
                                            lease_ttl=60)
                    worker.run_until_idle()
                    _variant("shipped")
                    eng.dispose()
                secs, cpu = time.perf_counter() - t0, B._cpu() - c0
                _check(url, jobs, history=name != "ceiling" and not set(name.split("+")) & {"nohist", "none"})
                got[name].append((jobs / secs, cpu / jobs * 1e6))
                log(f"  round {i + 1} {name}: {jobs / secs:,.0f} jobs/s, {cpu / jobs * 1e6:,.0f} us CPU/job")
    finally:
        _variant("shipped")
    return got


def table(got: dict[str, list[tuple[float, float]]]) -> list[str]:
    """Markdown rows: each variant's median jobs/s and client CPU a job, and its ratio to the
    ceiling and to jobq as shipped; then what each variant leaves out."""
    med = {k: (statistics.median(r for r, _ in v), statistics.median(c for _, c in v)) for k, v in got.items() if v}
    ceiling, shipped = med.get("ceiling"), med.get("shipped")
    lines = ["| variant (1 process) | jobs/s | client CPU a job | × ceiling | × shipped |", "| --- | --- | --- | --- | --- |"]
    for name, (rate, cpu) in med.items():
        lines.append(f"| {name} | {rate:,.0f} | {cpu:,.0f} µs | " + (f"{rate / ceiling[0]:.2f}×" if ceiling else "–")
                     + " | " + (f"{rate / shipped[0]:.2f}×" if shipped and name != "ceiling" else "–") + " |")
    lines.append("")
    lines += [f"* {name}: {MEANING[name]}" for name in med if name in MEANING]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="sqlite:////dev/shm/jobq_g.db")
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    got = measure(args.url, args.jobs, args.rounds, args.variants.split(","))
    print(f"{args.jobs:,} jobs, 64 slots, medians of {args.rounds}:")
    print("\n".join(table(got)))


if __name__ == "__main__":
    main()

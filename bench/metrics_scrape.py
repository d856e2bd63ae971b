"""jobq benchmark: what a Prometheus scrape (MetricsCollector.text()) costs on an empty queue and
on a table of 1,000,000 finished jobs, PostgreSQL only (the rows are made with generate_series).

The queue's tables in ``--url``'s database are dropped and created again. Five ready jobs are
enqueued, then ``--scrapes`` scrapes timed; then ``--rows`` done jobs, one attempt row and one
start row each, are inserted, the tables vacuumed and analysed, and the scrapes timed again.
It prints the median and the slowest of each, and the EXPLAIN ANALYZE of every statement one
scrape runs on the large table (index scans only; sequential scans only of the small policy,
slot and meta tables).

Run:
    python bench/metrics_scrape.py --url postgresql+psycopg://postgres@127.0.0.1/jobq_bench
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

import jobq

TABLES = "job_deps, jobs, jobq_meta, jobq_slots, jobq_starts, jobq_attempts, jobq_groups, jobq_signals, jobq_waits"
FILL = [
    """INSERT INTO jobs (type, args, state, is_container, group_key, weight, run_after, created_at, updated_at,
         started_at, finished_at, attempts, max_attempts, in_flight, cancel_requested, pending_deps,
         pending_children, failed_children, priority)
       SELECT 't', '{}', 'done', false, 'g' || (i %% 100), 1, now() - interval '2 day', now() - interval '2 day',
         now() - interval '1 day', now() - interval '1 day', now() - interval '1 day' + (i || ' ms')::interval,
         1, 3, false, false, 0, 0, 0, 0 FROM generate_series(1, %(rows)s) i""",
    "INSERT INTO jobq_attempts (job_id, attempt, worker_id, started_at, finished_at, outcome)"
    " SELECT id, 1, 'w', started_at, finished_at, 'done' FROM jobs WHERE state = 'done'",
    "INSERT INTO jobq_starts (group_key, started_at, n) SELECT group_key, started_at, 1 FROM jobs WHERE state = 'done'",
]


def timed(engine: sa.Engine, label: str, scrapes: int) -> float:
    m = jobq.MetricsCollector(engine)
    m.text()
    ids = [jobq.enqueue(engine, "t", {}, group_key=f"g{i}") for i in range(5)]
    took = []
    for _ in range(scrapes):
        t = time.perf_counter()
        m.text()
        took.append(time.perf_counter() - t)
    for job_id in ids:
        jobq.cancel(engine, job_id)
    med = statistics.median(took)
    print(f"{label}: median {med * 1000:.1f} ms, slowest {max(took) * 1000:.1f} ms over {scrapes} scrapes")
    return med


def explain(engine: sa.Engine) -> None:
    m = jobq.MetricsCollector(engine)
    m.read()
    seen: list[tuple[str, Any]] = []

    def capture(conn, cursor, statement, parameters, context, executemany):  # noqa: ANN001
        if not statement.lstrip().upper().startswith("EXPLAIN"):
            seen.append((statement, parameters))

    sa.event.listen(engine, "before_cursor_execute", capture)
    m.read()
    sa.event.remove(engine, "before_cursor_execute", capture)
    with engine.connect() as conn:
        for statement, params in seen:
            print("--", " ".join(statement.split())[:110])
            for (line,) in conn.exec_driver_sql("EXPLAIN (ANALYZE, COSTS OFF) " + statement, params):
                if "Scan" in line or "Execution Time" in line:
                    print("  ", line.strip())
        conn.rollback()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="a PostgreSQL URL (its jobq tables are dropped)")
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--scrapes", type=int, default=30)
    a = p.parse_args()
    engine = sa.create_engine(a.url)
    if engine.dialect.name != "postgresql":
        sys.exit("bench/metrics_scrape.py: PostgreSQL only (the rows are made with generate_series)")
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE IF EXISTS {TABLES} CASCADE")
    jobq.create_schema(engine)
    empty = timed(engine, "empty", a.scrapes)
    with engine.begin() as conn:
        for stmt in FILL:
            conn.exec_driver_sql(stmt, {"rows": a.rows})
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("VACUUM ANALYZE")
    full = timed(engine, f"{a.rows:,} finished", a.scrapes)
    print(f"ratio {full / empty:.2f}")
    explain(engine)
    engine.dispose()


if __name__ == "__main__":
    main()

"""jobq benchmark: what a Prometheus scrape (MetricsCollector.text()) costs on an empty queue and
on a table of 1,000,000 finished jobs, on any engine (the rows are made by one INSERT ... SELECT
from a recursive CTE).

Two queues, their tables dropped and created again: ``--url``'s gets ``--rows`` done jobs, one
attempt row and one start row each (then vacuumed and analysed), ``--empty-url``'s nothing. Each
gets five ready jobs and a collector; then the two are scraped in turn, ``--scrapes`` times, so
the load other processes put on the machine falls on both alike. It prints the median and the
slowest scrape of each and their ratio, and on PostgreSQL the EXPLAIN
ANALYZE of every statement one scrape runs on the large table (index scans only; sequential
scans only of the small policy, slot and meta tables).

Run:
    python bench/metrics_scrape.py --url postgresql+psycopg://postgres@127.0.0.1/jobq_bench \\
        --empty-url postgresql+psycopg://postgres@127.0.0.1/jobq_bench_empty
    python bench/metrics_scrape.py --url sqlite:////tmp/full.db --empty-url sqlite:////tmp/empty.db
"""

from __future__ import annotations

import argparse
import datetime as dt
import pathlib
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

import jobq


def fill(engine: sa.Engine, rows: int) -> None:
    """``rows`` done jobs, one attempt row and one start row each, finished a day ago."""
    t = jobq.Base.metadata.tables
    jobs, attempts, starts = t["jobs"], t["jobq_attempts"], t["jobq_starts"]
    day = sa.bindparam("b_day", type_=jobs.c.finished_at.type)
    seq = sa.select(sa.literal(1).label("i")).cte("seq", recursive=True)
    seq = seq.union_all(sa.select(seq.c.i + 1).where(seq.c.i < rows))
    values = {"type": sa.literal("t"), "args": sa.literal({}, type_=jobs.c.args.type), "state": sa.literal("done"),
              "is_container": sa.false(), "group_key": sa.literal("g"), "weight": sa.literal(1),
              "run_after": day, "created_at": day, "updated_at": day, "started_at": day, "finished_at": day,
              "attempts": sa.literal(1), "max_attempts": sa.literal(3), "in_flight": sa.false(),
              "cancel_requested": sa.false(), "pending_deps": sa.literal(0), "pending_children": sa.literal(0),
              "failed_children": sa.literal(0), "priority": sa.literal(0)}
    when = dt.datetime.now(dt.UTC).replace(tzinfo=None) - dt.timedelta(days=1)
    with engine.begin() as conn:
        if engine.dialect.name in ("mysql", "mariadb"):  # the recursion limits: 1,000 by default
            variable = "max_recursive_iterations" if getattr(engine.dialect, "is_mariadb", False) else "cte_max_recursion_depth"
            conn.exec_driver_sql(f"SET SESSION {variable} = {rows + 1}")
        conn.execute(jobs.insert().from_select(list(values), sa.select(*values.values()).select_from(seq)), {"b_day": when})
        done = sa.select(jobs.c.id, sa.literal(1), sa.literal("w"), jobs.c.started_at, jobs.c.finished_at,
                         sa.literal("done")).where(jobs.c.state == "done")
        conn.execute(attempts.insert().from_select(
            ["job_id", "attempt", "worker_id", "started_at", "finished_at", "outcome"], done))
        conn.execute(starts.insert().from_select(
            ["group_key", "started_at", "n"],
            sa.select(jobs.c.group_key, jobs.c.started_at, sa.literal(1)).where(jobs.c.state == "done")))
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql("VACUUM ANALYZE")
        elif engine.dialect.name == "sqlite":
            conn.exec_driver_sql("ANALYZE")
        else:
            conn.exec_driver_sql("ANALYZE TABLE jobs, jobq_attempts, jobq_starts")


def alternate(engines: dict[str, sa.Engine], scrapes: int) -> dict[str, float]:
    """Median scrape per queue, the queues scraped in turn (the machine's load falls on both
    alike), each holding five ready jobs."""
    collectors = {}
    for name, engine in engines.items():
        collectors[name] = jobq.MetricsCollector(engine)
        collectors[name].text()
        for i in range(5):
            jobq.enqueue(engine, "t", {}, group_key=f"g{i}")
    took: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(scrapes):
        for name, m in collectors.items():
            t = time.perf_counter()
            m.text()
            took[name].append(time.perf_counter() - t)
    for name, ts in took.items():
        print(f"{name}: median {statistics.median(ts) * 1000:.1f} ms, slowest {max(ts) * 1000:.1f} ms over {scrapes} scrapes")
    return {name: statistics.median(ts) for name, ts in took.items()}


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
    p.add_argument("--url", required=True, help="a database URL for the full queue (its jobq tables are dropped)")
    p.add_argument("--empty-url", required=True, help="another database for the empty queue (its jobq tables are dropped)")
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--scrapes", type=int, default=60)
    a = p.parse_args()
    engines = {"empty": sa.create_engine(a.empty_url), f"{a.rows:,} finished": sa.create_engine(a.url)}
    for engine in engines.values():
        jobq.Base.metadata.drop_all(engine)
        jobq.create_schema(engine)
    full = engines[f"{a.rows:,} finished"]
    fill(full, a.rows)
    medians = alternate(engines, a.scrapes)
    print(f"ratio {medians[f'{a.rows:,} finished'] / medians['empty']:.2f}")
    if full.dialect.name == "postgresql":
        explain(full)
    for engine in engines.values():
        engine.dispose()


if __name__ == "__main__":
    main()

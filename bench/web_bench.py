"""Dashboard page load times on a table with a million finished jobs.

What this shows: the overview, job list, a job page and the groups page read through indexes
only, so they cost about the same on a million finished rows as on a hundred. It fills
``jobs`` with about N finished rows by SQL (1,000 inserted, then doubled with INSERT ... SELECT: no
enqueue), adds a few hundred live jobs in three groups, then times each page through the WSGI
app in-process (median of 5, after one warm-up). The finished rows are 30 days old, or with
``--recent`` all within the last 17 hours (about 60,000 in the last hour): the per-type page's
windows then hold them all, and it reads its capped sample (jobq_web.TYPE_SAMPLE rows).

The database named by --url is WIPED (jobq's tables dropped and recreated).

Run:  python bench/web_bench.py --url postgresql+psycopg://postgres@127.0.0.1/jobq_bench [--rows 1000000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import pathlib
import statistics
import sys
import time

import sqlalchemy as sa

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "web"))

import jobq  # noqa: E402
import jobq_web  # noqa: E402
from webclient import call  # noqa: E402


def fill(engine: sa.Engine, rows: int, recent: bool = False) -> int:
    jobq.Base.metadata.drop_all(engine)
    jobq.create_schema(engine)
    jobs = jobq.Job.__table__
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    seed = []
    for i in range(1000):
        at = now - (dt.timedelta(minutes=1000) if recent else dt.timedelta(days=30)) + dt.timedelta(minutes=i)
        seed.append({"type": ("resize", "index", "mail")[i % 3], "args": {"n": i}, "result": {"ok": True},
                     "state": "failed" if i % 50 == 0 else "done", "is_container": False,
                     "group_key": f"tenant-{i % 20}", "weight": 1, "run_after": at, "created_at": at, "updated_at": at,
                     "started_at": at - dt.timedelta(seconds=i % 97), "finished_at": at, "attempts": 1, "max_attempts": 3,
                     "error": "Traceback (most recent call last):\nOSError: boom" if i % 50 == 0 else None,
                     "in_flight": False, "cancel_requested": False, "pending_deps": 0, "pending_children": 0,
                     "failed_children": 0})
    cols = [c for c in seed[0]]
    with engine.begin() as conn:
        conn.execute(sa.insert(jobs), seed)
    n = 1000
    copy = sa.insert(jobs).from_select(cols, sa.select(*(jobs.c[c] for c in cols)))
    while n < rows:
        with engine.begin() as conn:
            conn.execute(copy)
        n *= 2
    # live work on top: a DAG, ready jobs in three groups, a few in flight
    ids = jobq.submit(engine, [{"key": "a", "type": "extract"}, {"key": "b", "type": "load", "depends_on": ["a"]}])
    for g, k in (("tenant-a", 200), ("tenant-b", 50), ("tenant-c", 10)):
        for _ in range(k):
            jobq.enqueue(engine, "resize", {}, group_key=g)
    jobq.claim_batch(engine, "bench:1", 60, limit=8)
    # statistics and (PostgreSQL) a visibility map, as a live database's autovacuum keeps them
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql("VACUUM ANALYZE jobs")
        elif engine.dialect.name == "sqlite":
            conn.exec_driver_sql("ANALYZE")
        else:
            conn.exec_driver_sql("ANALYZE TABLE jobs")
    with engine.connect() as conn:
        total = conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar_one()
    print(f"{engine.dialect.name}: {total:,} rows ({n:,} finished)", flush=True)
    return ids["b"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="sqlite:///web_bench.db")
    ap.add_argument("--rows", type=int, default=1_000_000, help="finished rows, rounded up to 1000 * 2^k (1,024,000 for the default)")
    ap.add_argument("--no-fill", action="store_true", help="time the pages on the table a previous run filled")
    ap.add_argument("--recent", action="store_true", help="the finished rows within the last 17 hours, not 30 days ago")
    ns = ap.parse_args()
    engine = sa.create_engine(ns.url)
    t0 = time.perf_counter()
    if ns.no_fill:
        with engine.connect() as conn:
            job = conn.execute(sa.select(sa.func.max(jobq.Job.__table__.c.id))).scalar_one() - 260
    else:
        job = fill(engine, ns.rows, ns.recent)
        print(f"filled in {time.perf_counter() - t0:.1f}s", flush=True)
    app = jobq_web.app(engine)
    for path in ("/", "/jobs", "/jobs?state=failed", f"/jobs/{job}", "/groups", "/types", "/api/overview"):
        call(app, path)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            r = call(app, path)
            times.append(time.perf_counter() - t)
            assert r.status == 200, (path, r.body[:300])
        print(f"  {path:<22} median {statistics.median(times) * 1000:7.1f} ms  (max {max(times) * 1000:.1f})",
              flush=True)
    engine.dispose()


if __name__ == "__main__":
    main()

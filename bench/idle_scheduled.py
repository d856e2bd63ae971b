"""jobq benchmark, "idle scheduled" mode: what an idle tick costs with many jobs scheduled for later.

Two queues: one holds ``--jobs`` no-op jobs (200,000 by default) scheduled a day ahead over
``--groups`` groups, nothing due; the other is empty. A ``Worker`` (64 slots under a cap of 64)
ticks on each in turn, ``--rounds`` times, alternating, so the load other processes put on the
machine falls on both alike. It prints the median tick of each and their ratio (target: 1.5 at
most; a tick that walked the scheduled jobs cost 11 to 1,300 times the empty table's).

The empty queue lives beside the full one: a second SQLite file, or on a server the database
named as ``--url``'s with ``_empty`` appended (created when missing, dropped at the end).
Both queues' tables are dropped and created again first.

Run:
    python bench/idle_scheduled.py --url postgresql+psycopg://postgres@127.0.0.1/test --jobs 200000
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

import jobq


def _noop(ctx: jobq.JobContext) -> None:
    return None


def _sibling(url: str) -> tuple[str, str | None]:
    """The empty queue's URL, and the database to create for it (None: a SQLite file)."""
    u = sa.make_url(url)
    if u.get_backend_name() == "sqlite":
        return f"sqlite:///{tempfile.mkdtemp(prefix='jobq-bench-')}/empty.db", None
    name = f"{u.database}_empty"
    return u.set(database=name).render_as_string(hide_password=False), name


def _create_database(url: str, name: str) -> None:
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        if admin.dialect.name == "postgresql":
            if not conn.exec_driver_sql("SELECT 1 FROM pg_database WHERE datname = %(n)s", {"n": name}).first():
                conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        else:
            conn.exec_driver_sql(f"CREATE DATABASE IF NOT EXISTS `{name}`")
    admin.dispose()


def _drop_database(url: str, name: str) -> None:
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        quoted = f'"{name}"' if admin.dialect.name == "postgresql" else f"`{name}`"
        conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {quoted}")
    admin.dispose()


def _fresh(url: str) -> sa.Engine:
    eng = sa.create_engine(url)
    jobq.Base.metadata.drop_all(eng)
    jobq.create_schema(eng)
    return eng


def seed_scheduled(eng: sa.Engine, n: int, groups: int) -> None:
    """``n`` ready no-op jobs with run_after a day ahead, round-robin over ``groups`` groups."""
    now = jobq._utcnow()
    later = now + jobq._dt.timedelta(days=1)
    base = dict(type="noop", args={}, state="ready", is_container=False, parent_id=None, weight=1, run_after=later,
                created_at=now, updated_at=now, attempts=0, max_attempts=3, in_flight=False, cancel_requested=False,
                pending_deps=0, pending_children=0, failed_children=0)
    with eng.begin() as conn:
        for i in range(0, n, 5000):
            conn.execute(sa.insert(jobq.Job.__table__),
                         [dict(base, group_key=f"tenant-{j % groups:04d}") for j in range(i, min(n, i + 5000))])
    if eng.dialect.name == "postgresql":
        with eng.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("ANALYZE jobs")
    elif eng.dialect.name in ("mysql", "mariadb"):
        with eng.connect() as conn:
            conn.exec_driver_sql("ANALYZE TABLE jobs").all()


def idle_ticks(full: sa.Engine, empty: sa.Engine, rounds: int) -> tuple[float, float]:
    """Median seconds of one idle Worker.tick() on each queue, ticking on them in turn."""
    workers = [jobq.Worker(eng, {"noop": _noop}, max_concurrency=64, local_concurrency=64, poll_interval=1,
                           lease_ttl=60) for eng in (full, empty)]
    times: list[list[float]] = [[], []]
    for w in workers:  # warm-up: prepared statements, caches, the pool
        for _ in range(5):
            w.tick()
    for r in range(rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for i in order:
            t0 = time.perf_counter()
            started = workers[i].tick()
            times[i].append(time.perf_counter() - t0)
            assert started == 0, "an idle tick started a job"
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="the queue holding the scheduled jobs (default: a SQLite file)")
    ap.add_argument("--jobs", type=int, default=200_000, help="jobs scheduled a day ahead")
    ap.add_argument("--groups", type=int, default=100, help="groups they are spread over")
    ap.add_argument("--rounds", type=int, default=200, help="ticks timed on each queue (medians)")
    ns = ap.parse_args()
    url = ns.url or f"sqlite:///{tempfile.mkdtemp(prefix='jobq-bench-')}/full.db"
    empty_url, created = _sibling(url)
    if created:
        _create_database(url, created)
    try:
        full, empty = _fresh(url), _fresh(empty_url)
        t0 = time.perf_counter()
        seed_scheduled(full, ns.jobs, ns.groups)
        print(f"{full.dialect.name} {full.dialect.server_version_info or ''}: seeded {ns.jobs:,} jobs a day ahead "
              f"over {ns.groups:,} groups in {time.perf_counter() - t0:.1f} s; jobq {jobq.__file__}", flush=True)
        t_full, t_empty = idle_ticks(full, empty, ns.rounds)
        print(f"idle tick, {ns.jobs:,} scheduled: {t_full * 1000:.3f} ms; empty table: {t_empty * 1000:.3f} ms; "
              f"ratio {t_full / t_empty:.2f} (target <= 1.5; medians of {ns.rounds}, alternating)")
        full.dispose()
        empty.dispose()
    finally:
        if created:
            _drop_database(url, created)


if __name__ == "__main__":
    main()

"""jobq benchmark: jobq against a DBAPI ceiling and its peers, and jobq's own latencies.

Run:
    python bench/bench.py                                   # SQLite file in a temp directory
    python bench/bench.py --url postgresql+psycopg://postgres@127.0.0.1/test --jobs 20000

Prints the drain table of bench/throughput.py (jobq, the DBAPI ceiling and the peers, 1, 2 and
4 worker processes, alternating, medians) and, under it, each throughput target met or not in
this run; then what each guarantee costs a drain (bench/guarantees.py: jobq with each left
out, beside the ceiling); then enqueue throughput (single and bulk),
a DAG submit, enqueue->start latency with polling, tick time on a near-empty table versus one
holding many done and blocked rows, and worker peak RSS after N and 10N jobs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pathlib
import random
import resource
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

import jobq

jobs = jobq.Job.__table__
c = jobs.c


def fresh(url: str) -> sa.Engine:
    eng = sa.create_engine(url)
    jobq.Base.metadata.drop_all(eng)
    jobq.create_schema(eng)
    return eng


def seed(eng: sa.Engine, n: int, type_: str = "noop", table: sa.Table | None = None) -> None:
    """``n`` ready no-op jobs, inserted in bulk into ``table`` (default: this jobq's jobs table;
    bench/ab.py passes the other revision's, whose columns may differ)."""
    rows = []
    now = jobq._utcnow()
    for _ in range(n):
        rows.append(dict(type=type_, args={}, state="ready", is_container=False, parent_id=None, group_key="default",
                         weight=1, run_after=now - jobq._dt.timedelta(seconds=5), created_at=now, updated_at=now,
                         attempts=0, max_attempts=3, in_flight=False, cancel_requested=False, pending_deps=0,
                         pending_children=0, failed_children=0))
    with eng.begin() as conn:
        for i in range(0, len(rows), 5000):
            conn.execute(sa.insert(jobs if table is None else table), rows[i:i + 5000])


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def wake_cost_us(sleeps: int = 100, runs: int = 5) -> float:
    """CPU the OS charges this thread for one 1 ms sleep, in µs (median of ``runs``): what a
    wake-up from idle costs on this machine. Every contender pays it each time it waits for
    its server (a round trip) or for another thread, so the client CPU figures include it.
    Where waking is cheap this is a few µs (the sleep's own system calls); the virtual machine
    of bench/README.md's figures charges 41-47 µs (the host's time to resume a halted vCPU,
    counted as run time of the thread that wakes: see "The machine" there)."""
    got = []
    for _ in range(runs):
        c0 = time.thread_time()
        for _ in range(sleeps):
            time.sleep(0.001)
        got.append((time.thread_time() - c0) / sleeps * 1e6)
    return statistics.median(got)


# -- jobq ---------------------------------------------------------------------------------------

def _noop(ctx: jobq.JobContext) -> None:
    return None


def peak_rss_kib() -> int:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so
    a spawned worker would report its parent's peak (the parent that just seeded 100k rows)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _worker_proc(url: str, conc: int, cap: int, ready: mp.Event, go: mp.Event, out: mp.Queue) -> None:
    eng = sa.create_engine(url)
    w = jobq.Worker(eng, {"noop": _noop}, max_concurrency=cap, local_concurrency=conc, poll_interval=0.05,
                    lease_ttl=60)
    ready.set()
    go.wait()
    w.run_until_idle()
    out.put((peak_rss_kib(), _cpu()))


def jobq_drain(url: str, n_procs: int, conc: int) -> tuple[float, int, float]:
    """Seconds to drain, the largest worker peak RSS (KiB), CPU seconds the workers used."""
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    readies = [ctx.Event() for _ in range(n_procs)]
    # `conc` slots per worker process (local_concurrency) under a global cap that grows with the
    # processes, as a deployment that adds a worker process to add capacity would set it. (A cap
    # of conc * n_procs as each worker's own limit too let the first worker take the whole cap
    # and the others poll against it: the 2-process figures before 2026-12-03 were in effect
    # one process with twice the slots.)
    procs = [ctx.Process(target=_worker_proc, args=(url, conc, conc * n_procs, readies[i], go, out))
             for i in range(n_procs)]
    for p in procs:
        p.start()
    for r in readies:
        r.wait()
    t0 = time.perf_counter()
    go.set()
    got = [out.get() for _ in procs]
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join()
    return elapsed, max(r for r, _ in got), sum(c for _, c in got)


def latency(url: str, samples: int, poll: float, listen: bool = False) -> tuple[list[float], list[float]]:
    """Enqueue one job at a time (each in its own transaction) into an idle worker. Returns the
    times from just before enqueue() to the handler's first line, and from enqueue()'s return
    (its commit: the moment a worker can first see the job) to the handler's first line."""
    eng = fresh(url)
    started: dict[int, float] = {}
    sent: dict[int, float] = {}
    committed: dict[int, float] = {}

    def h(ctx: jobq.JobContext) -> None:
        started[ctx.id] = time.perf_counter()

    w = jobq.Worker(eng, {"lat": h}, max_concurrency=4, poll_interval=poll, lease_ttl=60, listen=listen)
    t = threading.Thread(target=w.run)
    t.start()
    time.sleep(0.5)  # the listener connects
    rng = random.Random(7)
    for _ in range(samples):
        t0 = time.perf_counter()
        jid = jobq.enqueue(eng, "lat")
        committed[jid] = time.perf_counter()
        sent[jid] = t0
        time.sleep(rng.uniform(0.2, 1.0) * poll if not listen else rng.uniform(0.01, 0.03))
    deadline = time.time() + 30
    while len(started) < samples and time.time() < deadline:
        time.sleep(0.01)
    w.stop()
    t.join()
    return (sorted(started[j] - sent[j] for j in sent if j in started),
            sorted(started[j] - committed[j] for j in sent if j in started))


def _pct(values: list[float]) -> str:
    q = lambda p: values[min(len(values) - 1, int(p * len(values)))] * 1000  # noqa: E731
    return f"{q(0.5):.1f} / {q(0.95):.1f} / {q(0.99):.1f} ms"


def tick_time(eng: sa.Engine, rounds: int = 30) -> float:
    w = jobq.Worker(eng, {"noop": _noop}, max_concurrency=1, poll_interval=1, lease_ttl=60)
    times = []
    for _ in range(rounds):
        jobq.enqueue(eng, "noop")
        t0 = time.perf_counter()
        w.tick()
        times.append(time.perf_counter() - t0)
        w._drain(5)
    return statistics.median(times)


def bulk_history(eng: sa.Engine, done: int, blocked: int) -> None:
    now = jobq._utcnow()
    base = dict(type="noop", args={}, is_container=False, parent_id=None, group_key="default", weight=1,
                run_after=now, created_at=now, updated_at=now, attempts=1, max_attempts=3, in_flight=False,
                cancel_requested=False, pending_children=0, failed_children=0)
    with eng.begin() as conn:
        for i in range(0, done, 10000):
            conn.execute(sa.insert(jobs), [dict(base, state="done", result={}, pending_deps=0, finished_at=now)
                                           for _ in range(min(10000, done - i))])
        for i in range(0, blocked, 10000):
            conn.execute(sa.insert(jobs), [dict(base, state="waiting", pending_deps=1) for _ in range(min(10000, blocked - i))])
    if eng.dialect.name == "postgresql":
        with eng.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("ANALYZE jobs")


SECTIONS = ("drain", "guarantees", "enqueue", "latency", "tick", "rss")


def main() -> None:
    ap = argparse.ArgumentParser(description="jobq vs a DBAPI ceiling and its peers")
    ap.add_argument("--url")
    ap.add_argument("--jobs", type=int, default=10000)
    ap.add_argument("--procs", default="1,2,4", help="worker process counts for the drains")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs per drain figure (the median is shown)")
    ap.add_argument("--contenders", help="comma-separated subset of the drain contenders (ceiling,jobq,pgqueuer-tuned,...)")
    ap.add_argument("--peer-url", help="database for Procrastinate's schema (default: the --url database + _peer)")
    ap.add_argument("--concurrency", type=int, default=64,
                    help="slots per worker process in the drains (global cap = this x processes)")
    ap.add_argument("--done-rows", type=int, default=1_000_000)
    ap.add_argument("--blocked-rows", type=int, default=100_000)
    ap.add_argument("--rss-jobs", default="10000,100000", help="two job counts for the worker RSS comparison")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}, or groups")
    ns = ap.parse_args()
    only = set(ns.only.split(","))
    url = ns.url or f"sqlite:///{tempfile.mkdtemp(prefix='jobq-bench-')}/bench.db"
    n = ns.jobs
    rows: list[tuple[str, str]] = []
    eng0 = sa.create_engine(url)
    with eng0.connect() as conn:
        version = conn.dialect.server_version_info
    print(f"jobq {jobq.__version__} on {eng0.dialect.name} {'.'.join(map(str, version or ()))}, "
          f"SQLAlchemy {sa.__version__}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}; "
          f"a wake-up costs {wake_cost_us():.0f} µs of CPU here (bench.wake_cost_us)", flush=True)
    eng0.dispose()

    if "drain" in only:
        # jobq, the DBAPI ceiling and the peers side by side: bench/throughput.py
        import throughput

        procs = tuple(int(x) for x in ns.procs.split(","))
        res = throughput.measure(url, ns.jobs, procs, ns.rounds, peer_url=ns.peer_url,
                                 only=set(ns.contenders.split(",")) if ns.contenders else None,
                                 conc=ns.concurrency)
        side_by_side = throughput.table(res, procs)
        side_by_side += ["", "Targets, this run:", "", *throughput.targets(res, procs)]
        print("\n".join(side_by_side), flush=True)

    if "guarantees" in only:
        # What each guarantee, and the handler threads, cost one process's drain: jobq patched
        # to leave each out (bench/guarantees.py), beside the ceiling, alternating.
        import guarantees

        got = guarantees.measure(url, ns.jobs, ns.rounds, conc=ns.concurrency)
        costs = [f"What the guarantees cost ({ns.concurrency} slots, one process, medians of {ns.rounds}):", "",
                 *guarantees.table(got)]
        print("\n".join(costs), flush=True)

    if "enqueue" in only:
        eng = fresh(url)
        t0 = time.perf_counter()
        for _ in range(1000):
            jobq.enqueue(eng, "noop")
        single = 1000 / (time.perf_counter() - t0)
        items = [{"key": f"k{i}", "type": "noop"} for i in range(n)]
        t0 = time.perf_counter()
        jobq.submit(eng, items)
        bulk = n / (time.perf_counter() - t0)
        rows.append(("enqueue: one per transaction / submit()", f"{single:,.0f} / {bulk:,.0f} jobs/s"))
        dag = [{"key": "root", "type": "noop"}, {"key": "box", "type": "box", "container": True, "depends_on": ["root"]}]
        dag += [{"key": f"c{i}", "type": "noop", "parent": "box", "depends_on": [f"c{i - 1}"] if i % 10 else []}
                for i in range(9997)]
        dag += [{"key": "sink", "type": "noop", "depends_on": ["box"]}]
        t0 = time.perf_counter()
        jobq.submit(eng, dag)
        rows.append(("submit a 10,000-job DAG (container, chains, fan-in)", f"{time.perf_counter() - t0:.2f} s"))
        print(rows[-2:], flush=True)
        eng.dispose()

    if "latency" in only:
        call, commit = latency(url, 200, 0.1)
        rows.append(("enqueue->start, polling every 100 ms: p50 / p95 / p99", _pct(call)))
        rows.append(("  the same, from enqueue's commit", _pct(commit)))
        print(rows[-2:], flush=True)
        eng = sa.create_engine(url)
        if eng.dialect.name == "postgresql" and eng.dialect.driver == "psycopg":
            call, commit = latency(url, 300, 5.0, listen=True)
            rows.append(("enqueue->start, LISTEN/NOTIFY (poll 5 s): p50 / p95 / p99", _pct(call)))
            rows.append(("  the same, from enqueue's commit", _pct(commit)))
            print(rows[-2:], flush=True)
        eng.dispose()

    if "tick" in only:
        eng = fresh(url)
        empty = tick_time(eng)
        bulk_history(eng, ns.done_rows, ns.blocked_rows)
        full = tick_time(eng)
        rows.append((f"tick: near-empty / {ns.done_rows:,} done + {ns.blocked_rows:,} blocked",
                     f"{empty * 1000:.2f} / {full * 1000:.2f} ms ({full / empty:.2f}x)"))
        print(rows[-1], flush=True)
        eng.dispose()

    if "rss" in only:
        small, big = (int(x) for x in ns.rss_jobs.split(","))
        fresh(url).dispose()
        seed(sa.create_engine(url), small)
        _, rss_small, _ = jobq_drain(url, 1, ns.concurrency)
        fresh(url).dispose()
        seed(sa.create_engine(url), big)
        _, rss_big, _ = jobq_drain(url, 1, ns.concurrency)
        rows.append((f"worker peak RSS after {small:,} / {big:,} jobs",
                     f"{rss_small / 1024:.0f} / {rss_big / 1024:.0f} MiB ({rss_big / rss_small - 1:+.0%})"))

    if "groups" in only:  # not in the default sections: bench/groups.py
        from groups import groups_rows
        rows.extend(groups_rows(url))

    print()
    if "drain" in only:
        print("\n".join(side_by_side) + "\n")
    if "guarantees" in only:
        print("\n".join(costs) + "\n")
    width = max((len(a) for a, _ in rows), default=0)
    for a, b in rows:
        print(f"{a:<{width}}  {b}")


if __name__ == "__main__":
    main()

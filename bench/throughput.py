"""Side-by-side drain throughput: jobq, a DBAPI ceiling and the peers, in one run, alternating.

Every contender drains the same number of no-op jobs, seeded before its clock starts, with 1, 2
and 4 worker processes; the contenders take turns (the order rotates each round) and each figure
is the median of `--rounds` runs, so the load other processes put on the machine falls on all of
them alike. Read the ratios: absolute figures move with that load.

Contenders, per engine:

* `ceiling`: the work every queue must do, written against the DBAPI directly (psycopg, sqlite3,
  PyMySQL or mysqlclient as the URL names; no SQLAlchemy): claim 50 ready rows of jobq's own table with the engine's locking read
  (`FOR UPDATE SKIP LOCKED`, SQLite's `BEGIN IMMEDIATE`), mark them leased under one token and
  commit; run the no-op; finalize all 50 in one fenced `UPDATE` and commit. No cap, no groups, no
  DAG bookkeeping, no heartbeats, no dispatch to threads.
* `jobq`: `Worker(local_concurrency=64, max_concurrency=64 x processes).run_until_idle()`: 64
  slots per process under a global cap of 64 per process, defaults otherwise.
* `jobq-250`: the same with 250 slots per process, the most jobs PGQueuer tuned holds in flight
  per process (5 queue managers x batch 50): on PostgreSQL the two at the same capacity, on
  every engine what a tick's fixed cost comes to when more jobs share it.
* PostgreSQL, pipelined ceilings: the ceiling's work in jobq's tick shape (one transaction
  finalizes the previous batch and claims the next), run by threads on their own connections in
  each process. `ceiling-5conn`: 5 connections, as PGQueuer tuned runs 5 queue managers, and no
  cap. `ceiling-5conn-capped` and `ceiling-1conn-capped`: every claim also decides a global cap
  as jobq must (the claim_lock row locked until the commit, the jobs in flight counted under it;
  the cap, 250 per process, is never reached, so what they show is the serialisation alone).
  Together they say what 1.5x PGQueuer asks of any client on this machine, and what the global
  cap costs a queue that pipelines.
* PostgreSQL: PGQueuer tuned (asyncpg + uvloop, batch 50, 5 queue managers per process, each on
  its own connection) and PGQueuer with its defaults (one queue manager, batch 10, asyncio's
  loop); Procrastinate (psycopg, `run_worker(wait=False)`, concurrency 10) for reference, its
  schema in the database named by `--peer-db` (default `<db>_peer`, created if missing).
* SQLite: huey (`SqliteHuey`, its defaults: WAL, the engine's default synchronous=FULL), each
  process looping over huey's own `dequeue()` / `execute()` (a consumer thread without its
  polling sleep).

The peers are the `bench` extra (`pip install -e .[bench]`); a peer that is not installed is
skipped with a line saying so. jobq never imports them.

Client CPU is the worker processes' own CPU time (user + system) divided by the jobs drained: the
figure that says how much of a core the queue library costs per job, apart from the server.
"""

from __future__ import annotations

import functools
import importlib
import json
import multiprocessing as mp
import os
import queue
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

import bench as B

PEER_MISSING: dict[str, str] = {}
FAILED: dict[tuple[str, int], int] = {}  # (contender, processes) -> runs that raised
Results = dict[tuple[str, int], list[tuple[float, float]]]  # (contender, processes) -> [(jobs/s, CPU µs a job)]


# -- the DBAPI ceiling --------------------------------------------------------------------------

def _dbapi_connect(url: str) -> tuple[Any, str]:
    """A raw DBAPI connection for `url` and its engine family (sqlite, postgresql, mysql)."""
    u = sa.make_url(url)
    backend = u.get_backend_name()
    if backend == "sqlite":
        import sqlite3

        conn = sqlite3.connect(u.database, timeout=30, isolation_level=None)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")
        return conn, "sqlite"
    if backend == "postgresql":
        import psycopg

        return psycopg.connect(host=u.host, port=u.port or 5432, user=u.username, password=u.password or None,
                               dbname=u.database), "postgresql"
    # The URL's driver: mysqlclient (the C driver) or PyMySQL, so jobq and the ceiling share it.
    driver: Any = importlib.import_module("MySQLdb" if u.get_driver_name() == "mysqldb" else "pymysql")
    conn = driver.connect(host=u.host, port=u.port or 3306, user=u.username, password=u.password or "",
                          database=u.database, autocommit=False)
    with conn.cursor() as cur:
        cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
    return conn, "mysql"


# jobq's claim order, which its ready index yields as is. Ordered by (run_after, id) alone, as
# before, every engine sorted the whole ready set for each batch (9.9 ms of 20,000 rows on
# PostgreSQL, against 0.2 ms from the index) and the ceiling was not one.
_CLAIM_SELECT = ("SELECT {cols} FROM jobs WHERE state = 'ready' AND group_key = 'default' "
                 "ORDER BY priority DESC, run_after, id LIMIT {limit}")
_LEASE_SET = "state = 'running', lease_token = {p}, in_flight = {t}, attempts = attempts + 1, started_at = {p}"
_DONE_SET = "state = 'done', result = {p}, in_flight = {f}, lease_token = NULL, finished_at = {p}"


def _now(fam: str) -> Any:
    return B.jobq._utcnow().replace(tzinfo=None)  # jobq's timestamps are naive UTC


def _my_claim(cur: Any, token: str, now: Any) -> list[Any]:
    cur.execute(f"{_CLAIM_SELECT.format(cols='id, type, args', limit=50)} FOR UPDATE SKIP LOCKED")
    rows = list(cur.fetchall())
    if rows:
        ids = ",".join(str(r[0]) for r in rows)
        cur.execute(f"UPDATE jobs SET {_LEASE_SET.format(p='%s', t='true')} WHERE id IN ({ids})", (token, now))
    return rows


def _my_finish(cur: Any, ids: list[int], token: str, now: Any) -> None:
    cur.execute(f"UPDATE jobs SET {_DONE_SET.format(p='%s', f='false')} WHERE id IN "
                f"({','.join(map(str, ids))}) AND lease_token = %s", ("{}", now, token))


def _retry_deadlock(conn: Any, work: Callable[[Any], Any]) -> Any:
    """MySQL/MariaDB: run ``work`` in a transaction, again after a deadlock (1213), as any
    client of InnoDB must; the ceiling's two processes deadlock now and then."""
    while True:
        try:
            with conn.cursor() as cur:
                out = work(cur)
            conn.commit()
            return out
        except Exception as exc:  # noqa: BLE001 - only a deadlock is retried
            if getattr(exc, "args", (None,))[0] != 1213:
                raise
            conn.rollback()


def _run_noops(rows: list[Any]) -> None:
    """The handler's part of a ceiling: decode each claimed row's args and call a no-op."""
    handler: Callable[[dict[str, Any]], None] = lambda args: None  # noqa: E731
    for _id, _type, args in rows:
        handler(json.loads(args) if isinstance(args, (str, bytes)) else args)


def _ceiling_loop(url: str) -> int:
    """Drain jobq's table with the least work a fenced batch queue can do; returns jobs done."""
    conn, fam = _dbapi_connect(url)
    done = 0
    while True:
        token = uuid.uuid4().hex
        now = _now(fam)
        if fam == "postgresql":
            with conn.cursor() as cur:
                cur.execute(f"UPDATE jobs SET {_LEASE_SET.format(p='%s', t='true')} WHERE id IN "
                            f"({_CLAIM_SELECT.format(cols='id', limit=50)} FOR UPDATE SKIP LOCKED) RETURNING id, type, args", (token, now))
                rows = cur.fetchall()
            conn.commit()
        elif fam == "sqlite":
            conn.execute("BEGIN IMMEDIATE")
            rows = conn.execute(f"UPDATE jobs SET {_LEASE_SET.format(p='?', t='1')} WHERE id IN "
                                f"({_CLAIM_SELECT.format(cols='id', limit=50)}) RETURNING id, type, args", (token, now)).fetchall()
            conn.execute("COMMIT")
        else:
            rows = _retry_deadlock(conn, functools.partial(_my_claim, token=token, now=now))
        if not rows:
            break
        _run_noops(rows)
        ids = [r[0] for r in rows]
        now = _now(fam)
        if fam == "postgresql":
            with conn.cursor() as cur:
                cur.execute(f"UPDATE jobs SET {_DONE_SET.format(p='%s', f='false')} "
                            "WHERE id = ANY(%s) AND lease_token = %s", ("{}", now, ids, token))
            conn.commit()
        elif fam == "sqlite":
            conn.execute("BEGIN")
            conn.execute(f"UPDATE jobs SET {_DONE_SET.format(p='?', f='0')} WHERE id IN "
                         f"({','.join('?' * len(ids))}) AND lease_token = ?", ("{}", now, *ids, token))
            conn.execute("COMMIT")
        else:
            _retry_deadlock(conn, functools.partial(_my_finish, ids=ids, token=token, now=now))
        done += len(ids)
    conn.close()
    return done


def _pg_pipelined_loop(conn: Any, cap: int | None, stop: list[BaseException]) -> int:
    """One connection's share of a pipelined ceiling (PostgreSQL), in jobq's tick shape: one
    transaction finalizes the previous batch (fenced by its token) and claims the next, one
    commit per batch. With ``cap`` the global cap is decided as jobq decides it: inside the claim
    transaction, behind the claim_lock row (held until the commit), counting the jobs in flight."""
    done = 0
    prev: list[int] = []
    prev_token = ""
    try:
        while True:
            token = uuid.uuid4().hex
            now = _now("postgresql")
            with conn.cursor() as cur:
                if prev:
                    cur.execute(f"UPDATE jobs SET {_DONE_SET.format(p='%s', f='false')} "
                                "WHERE id = ANY(%s) AND lease_token = %s", ("{}", now, prev, prev_token))
                    done += len(prev)
                want = 50
                if cap is not None:
                    cur.execute("SELECT value FROM jobq_meta WHERE key = 'claim_lock' FOR UPDATE")
                    cur.execute("SELECT count(*) FROM jobs WHERE in_flight")
                    want = min(want, cap - cur.fetchone()[0])
                rows: list[Any] = []
                if want > 0:
                    cur.execute(f"UPDATE jobs SET {_LEASE_SET.format(p='%s', t='true')} WHERE id IN "
                                f"({_CLAIM_SELECT.format(cols='id', limit='%s')} "
                                "FOR UPDATE SKIP LOCKED) RETURNING id, type, args", (token, now, want))
                    rows = cur.fetchall()
            conn.commit()
            if not rows and not prev and want > 0:
                return done
            _run_noops(rows)
            prev, prev_token = [r[0] for r in rows], token
    except BaseException as exc:  # noqa: BLE001 - reported by the drain
        stop.append(exc)
        return done


def _setup_pipelined(url: str, n_procs: int, conns: int, capped: bool) -> Callable[[], None]:
    """A pipelined ceiling: ``conns`` connections per process, each on its own thread, as
    PGQueuer tuned runs 5 queue managers per process. With ``capped``, every claim takes the
    global cap's lock (cap: 250 jobs in flight per process, which the drain never reaches, so
    what it costs is the serialisation alone)."""
    import threading

    cap = 250 * n_procs if capped else None
    made = [_dbapi_connect(url)[0] for _ in range(conns)]

    def drain() -> None:
        errors: list[BaseException] = []
        threads = [threading.Thread(target=_pg_pipelined_loop, args=(c, cap, errors)) for c in made]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c in made:
            c.close()
        if errors:
            raise errors[0]

    return drain


# -- process harness ------------------------------------------------------------------------------

def _proc_main(target: Callable[..., Any], args: tuple[Any, ...], ready: Any, go: Any, out: Any) -> None:
    setup = target(*args)  # returns the drain function, with its connections made
    ready.set()
    go.wait()
    cpu0 = B._cpu()  # the drain's own CPU, not the imports and set-up before it
    setup()
    out.put(B._cpu() - cpu0)


def _run_procs(target: Callable[..., Any], args: tuple[Any, ...], n_procs: int) -> tuple[float, float]:
    """Start n processes that each set up, wait for the start signal, drain; returns (seconds,
    CPU seconds of all of them)."""
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    readies = [ctx.Event() for _ in range(n_procs)]
    procs = [ctx.Process(target=_proc_main, args=(target, args, readies[i], go, out)) for i in range(n_procs)]
    for p in procs:
        p.start()
    for r in readies:
        if not r.wait(120):
            raise RuntimeError(f"{target.__name__}: a process did not get ready")
    t0 = time.perf_counter()
    go.set()
    cpus: list[float] = []
    while len(cpus) < n_procs:
        try:
            cpus.append(out.get(timeout=0.05))
        except queue.Empty:
            if any(p.exitcode for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{target.__name__}: a process failed") from None
    elapsed = time.perf_counter() - t0
    cpu = sum(cpus)
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{target.__name__}: a process exited with {p.exitcode}")
    return elapsed, cpu


def _setup_ceiling(url: str, n_procs: int) -> Callable[[], None]:
    return functools.partial(_ceiling_loop, url)


def _setup_jobq(url: str, n_procs: int, conc: int = 64) -> Callable[[], None]:
    # `conc` slots per process under a global cap that grows with the processes (bench.jobq_drain).
    eng = sa.create_engine(url)
    w = B.jobq.Worker(eng, {"noop": B._noop}, max_concurrency=conc * n_procs, local_concurrency=conc,
                      poll_interval=0.05, lease_ttl=60)
    return w.run_until_idle


# -- PGQueuer -------------------------------------------------------------------------------------

def _asyncpg_dsn(url: str) -> str:
    u = sa.make_url(url)
    return f"postgresql://{u.username}{':' + u.password if u.password else ''}@{u.host}:{u.port or 5432}/{u.database}"


def _pgq_seed(url: str, n: int) -> None:
    import asyncio

    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries

    async def go() -> None:
        conn = await asyncpg.connect(_asyncpg_dsn(url))
        q = Queries(AsyncpgDriver(conn))
        if not await q.schema_is_installed():
            await q.install()
        await q.clear_queue()
        await q.clear_queue_log()
        for i in range(0, n, 5000):
            k = min(5000, n - i)
            await q.enqueue(["noop"] * k, [None] * k, [0] * k)
        await conn.close()

    asyncio.run(go())


def _setup_pgq(url: str, n_procs: int, managers: int, batch: int, use_uvloop: bool) -> Callable[[], None]:
    import asyncio
    from datetime import timedelta

    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries, QueueManager
    from pgqueuer.domain.types import QueueExecutionMode

    if use_uvloop:
        import uvloop

        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    async def connect() -> list[QueueManager]:
        qms = []
        for _ in range(managers):
            qm = QueueManager(Queries(AsyncpgDriver(await asyncpg.connect(_asyncpg_dsn(url)))))

            @qm.entrypoint("noop")
            async def noop(job: Any) -> None:
                return None

            qms.append(qm)
        return qms

    qms = loop.run_until_complete(connect())

    def drain() -> None:
        loop.run_until_complete(asyncio.gather(*(
            qm.run(batch_size=batch, mode=QueueExecutionMode.drain, dequeue_timeout=timedelta(seconds=1))
            for qm in qms)))

    return drain


# -- Procrastinate --------------------------------------------------------------------------------

def _proc_app(url: str, sync: bool = True) -> Any:
    """Procrastinate's app with its one no-op task: the sync connector seeds, the async one runs
    the worker."""
    import procrastinate

    u = sa.make_url(url)
    connector = procrastinate.SyncPsycopgConnector if sync else procrastinate.PsycopgConnector
    app = procrastinate.App(connector=connector(
        conninfo=f"host={u.host} port={u.port or 5432} user={u.username} dbname={u.database}"))

    @app.task(name="noop")
    def noop() -> None:
        return None

    return app


def _proc_seed(url: str, n: int) -> None:
    import psycopg

    u = sa.make_url(url)
    with psycopg.connect(host=u.host, port=u.port or 5432, user=u.username, dbname="postgres",
                         autocommit=True) as c:
        if not c.execute("SELECT 1 FROM pg_database WHERE datname = %s", (u.database,)).fetchone():
            c.execute(f'CREATE DATABASE "{u.database}"')
    app = _proc_app(url)
    with app.open():
        with psycopg.connect(host=u.host, port=u.port or 5432, user=u.username, dbname=u.database,
                             autocommit=True) as c:
            installed = c.execute("SELECT to_regclass('procrastinate_jobs')").fetchone()[0]
        if not installed:
            app.schema_manager.apply_schema()
        with psycopg.connect(host=u.host, port=u.port or 5432, user=u.username, dbname=u.database,
                             autocommit=True) as c:
            c.execute("TRUNCATE procrastinate_jobs RESTART IDENTITY CASCADE")
        task = app.tasks["noop"]
        for i in range(0, n, 5000):
            task.batch_defer(*([{}] * min(5000, n - i)))


def _setup_procrastinate(url: str, n_procs: int) -> Callable[[], None]:
    app = _proc_app(url, sync=False)

    def drain() -> None:
        with app.open():
            app.run_worker(wait=False, concurrency=10, listen_notify=False, install_signal_handlers=False)

    return drain


# -- huey -----------------------------------------------------------------------------------------

def _huey_file(url: str) -> str:
    return os.path.join(os.path.dirname(sa.make_url(url).database or "."), "huey.db")


def _huey(path: str) -> tuple[Any, Any]:
    from huey import SqliteHuey

    h = SqliteHuey(filename=path)

    @h.task()
    def noop() -> None:
        return None

    return h, noop


def _huey_seed(url: str, n: int) -> None:
    import sqlite3

    path = _huey_file(url)
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)
    h, noop = _huey(path)
    data = [(h.storage.name, h.serialize_task(noop.s())) for _ in range(n)]
    h.storage.close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN")
    conn.executemany("INSERT INTO task (queue, data, priority) VALUES (?, ?, 0)", data)
    conn.execute("COMMIT")
    conn.close()


def _setup_huey(url: str, n_procs: int) -> Callable[[], None]:
    h, _ = _huey(_huey_file(url))

    def drain() -> None:
        while (task := h.dequeue()) is not None:
            h.execute(task)

    return drain


# -- the run --------------------------------------------------------------------------------------

class Contender:
    """A way to drain: how to seed `n` jobs, how to set a worker process up (returns its drain)."""

    def __init__(self, name: str, seed: Callable[[str, int], None], setup: Callable[..., Callable[[], None]],
                 extra: tuple[Any, ...] = (), url: str | None = None, share: int = 1) -> None:
        self.name, self.seed, self.setup, self.extra, self.url = name, seed, setup, extra, url
        self.share = share  # drains n // share jobs: a peer two orders of magnitude slower


def _jobq_seed(url: str, n: int) -> None:
    B.fresh(url).dispose()
    eng = sa.create_engine(url)
    B.seed(eng, n)
    if eng.dialect.name == "postgresql":
        with eng.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("ANALYZE jobs")
    eng.dispose()


def _installed(module: str, extra: str = "bench") -> bool:
    try:
        __import__(module)
        return True
    except ImportError as e:
        PEER_MISSING[module] = f"{module} not installed ({e}); `pip install -e .[{extra}]`"
        return False


_PGQ_TUNED_IN_FLIGHT = 5 * 50  # PGQueuer tuned's queue managers x batch size, per process


def contenders(url: str, peer_url: str | None, want: set[str] | None, conc: int = 64) -> list[Contender]:
    fam = sa.make_url(url).get_backend_name()
    out = [Contender("ceiling", _jobq_seed, _setup_ceiling), Contender("jobq", _jobq_seed, _setup_jobq, (conc,))]
    if fam == "postgresql" and _installed("pgqueuer") and _installed("asyncpg") and _installed("uvloop"):
        out.append(Contender("pgqueuer-tuned", _pgq_seed, _setup_pgq, (5, 50, True)))
        out.append(Contender("pgqueuer-defaults", _pgq_seed, _setup_pgq, (1, 10, False)))
    # jobq with PGQueuer tuned's capacity: 5 queue managers x batch 50 = up to 250 jobs in flight
    # per process, where `jobq` has 64 slots. On every engine: what a tick's fixed cost (its
    # statements, its commit) comes to when it is shared by more jobs.
    out.append(Contender("jobq-250", _jobq_seed, _setup_jobq, (_PGQ_TUNED_IN_FLIGHT,)))
    if fam == "postgresql":
        # What the global cap costs a queue that pipelines like PGQueuer tuned: the ceiling on 5
        # connections per process, without and with the cap's serialised claim.
        out.append(Contender("ceiling-5conn", _jobq_seed, _setup_pipelined, (5, False)))
        out.append(Contender("ceiling-5conn-capped", _jobq_seed, _setup_pipelined, (5, True)))
        out.append(Contender("ceiling-1conn-capped", _jobq_seed, _setup_pipelined, (1, True)))
    if fam == "postgresql" and _installed("procrastinate"):
        u = sa.make_url(url)
        out.append(Contender("procrastinate", _proc_seed, _setup_procrastinate,
                             url=peer_url or u.set(database=f"{u.database}_peer").render_as_string(False), share=10))
    if fam == "sqlite" and _installed("huey"):
        out.append(Contender("huey", _huey_seed, _setup_huey))
    return [c for c in out if want is None or c.name in want]


def measure(url: str, n: int, procs: tuple[int, ...], rounds: int, peer_url: str | None = None,
            only: set[str] | None = None, log: Callable[[str], None] = print,
            conc: int = 64) -> Results:
    """Drain `n` jobs with each contender and process count, `rounds` times, alternating
    (jobq with `conc` slots per process). Returns {(contender, processes): [(jobs/s, CPU µs
    per job), ...]}."""
    cs = contenders(url, peer_url, only, conc)
    results: Results = {}
    for r in range(rounds):
        for p in procs:
            order = cs[r % len(cs):] + cs[:r % len(cs)]
            for c in order:
                u, k = c.url or url, max(500, n // c.share)
                try:
                    c.seed(u, k)
                    secs, cpu = _run_procs(c.setup, (u, p, *c.extra), p)
                except Exception as e:  # a peer that breaks is reported, not fatal to the run
                    log(f"  {c.name} x{p}: failed: {type(e).__name__}: {e}")
                    FAILED[(c.name, p)] = FAILED.get((c.name, p), 0) + 1
                    continue
                results.setdefault((c.name, p), []).append((k / secs, cpu / k * 1e6))
                log(f"  round {r + 1} {c.name} x{p}, {k:,} jobs: {k / secs:,.0f} jobs/s, {cpu / k * 1e6:,.0f} us CPU/job")
    return results


def _medians(results: Results) -> dict[tuple[str, int], tuple[float, float, int]]:
    """(contender, processes) -> (median jobs/s, median client CPU µs a job, runs)."""
    return {k: (statistics.median(x for x, _ in v), statistics.median(y for _, y in v), len(v))
            for k, v in results.items()}


def table(results: Results, procs: tuple[int, ...]) -> list[str]:
    """Markdown rows: jobs/s (median), ratio to the ceiling and to each peer, CPU per job."""
    med = _medians(results)
    names = list(dict.fromkeys(k[0] for k in results))
    head = "| contender | " + " | ".join(f"{p} process{'es' if p > 1 else ''}" for p in procs) + " |"
    lines = [head, "| --- |" + " --- |" * len(procs)]
    for name in names:
        cells = []
        for p in procs:
            bad = f" ({FAILED[(name, p)]} run(s) failed)" if (name, p) in FAILED else ""
            if (name, p) not in med:
                cells.append("failed" + bad if bad else "–")
                continue
            rate, cpu, k = med[(name, p)]
            cell = f"{rate:,.0f} jobs/s, {cpu:,.0f} µs CPU/job{bad}"
            ceil = med.get(("ceiling", p))
            if name != "ceiling" and ceil:
                cell += f" ({rate / ceil[0]:.2f}× ceiling)"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    def ratio(a_name: str, b_name: str, label: str) -> None:
        cells = []
        for p in procs:
            a, b = med.get((a_name, p)), med.get((b_name, p))
            cells.append(f"**{a[0] / b[0]:.2f}×**" if a and b else "–")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    for peer in (x for x in names if not x.startswith(("jobq", "ceiling"))):
        ratio("jobq", peer, f"jobq / {peer}")
    if "jobq-250" in names and "pgqueuer-tuned" in names:
        ratio("jobq-250", "pgqueuer-tuned", "jobq-250 / pgqueuer-tuned (same jobs in flight)")
    if "ceiling-5conn" in names:
        # What 1.5x PGQueuer asks of any client, and what the global cap costs a pipelined one.
        if "pgqueuer-tuned" in names:
            for name in ("ceiling-5conn", "ceiling-1conn-capped"):
                if name in names:
                    ratio(name, "pgqueuer-tuned", f"{name} / pgqueuer-tuned")
        if "ceiling-5conn-capped" in names:
            ratio("ceiling-5conn-capped", "ceiling-5conn", "global cap: ceiling-5conn-capped / ceiling-5conn")
    runs = sorted({v[2] for v in med.values()})
    lines.append(f"\n(medians of {'/'.join(map(str, runs))} alternating runs)")
    lines += [f"\n{m}" for m in PEER_MISSING.values()]
    return lines


# -- the targets --------------------------------------------------------------------------------

#: The throughput targets (bench/README.md): jobq at least this many times PGQueuer tuned with 1
#: and 2 worker processes (PostgreSQL), at least this share of the DBAPI ceiling, and at most this
#: much client CPU a no-op job, at every process count.
PEER_TARGET = 1.5
PEER_TARGET_PROCS = (1, 2)
CEILING_TARGET = 0.5
CPU_TARGET_US = 30.0


def targets(results: Results, procs: tuple[int, ...]) -> list[str]:
    """Markdown rows: each target, per process count, with this run's figure and "met" or
    "**not met**" (a cell the target does not ask for, or that this run has no figure for,
    says so). jobq's contenders are `jobq` and, where it ran, `jobq-250`."""
    med = _medians(results)
    head = "| target | " + " | ".join(f"{p} process{'es' if p > 1 else ''}" for p in procs) + " |"
    lines = [head, "| --- |" + " --- |" * len(procs)]

    def verdict(ok: bool) -> str:
        return "met" if ok else "**not met**"

    peer = any(("pgqueuer-tuned", p) in med for p in procs)
    if peer and any(("ceiling", p) in med for p in procs):
        # For reference: the DBAPI loop itself (one connection, batches of 50, no cap) against
        # PGQueuer tuned. Where this is under 1.5x, the target asks jobq to beat the ceiling.
        cells = [f"{a[0] / b[0]:.2f}×" if (a := med.get(("ceiling", p))) and (b := med.get(("pgqueuer-tuned", p)))
                 else "–" for p in procs]
        lines.append("| (reference) ceiling / pgqueuer-tuned | " + " | ".join(cells) + " |")
    for name in (n for n in ("jobq", "jobq-250") if any((n, p) in med for p in procs)):
        if peer:
            cells = []
            for p in procs:
                a, b = med.get((name, p)), med.get(("pgqueuer-tuned", p))
                if a is None or b is None:
                    cells.append("–")
                    continue
                r = a[0] / b[0]
                cells.append(f"{r:.2f}× " + (verdict(r >= PEER_TARGET) if p in PEER_TARGET_PROCS else "(not asked)"))
            lines.append(f"| {name} ≥ {PEER_TARGET}× pgqueuer-tuned ({', '.join(map(str, PEER_TARGET_PROCS))} "
                         f"processes) | " + " | ".join(cells) + " |")
        cells = []
        for p in procs:
            a, ceil = med.get((name, p)), med.get(("ceiling", p))
            cells.append("–" if a is None or ceil is None else
                         f"{a[0] / ceil[0]:.2f}× {verdict(a[0] / ceil[0] >= CEILING_TARGET)}")
        lines.append(f"| {name} ≥ {CEILING_TARGET}× ceiling | " + " | ".join(cells) + " |")
        cells = []
        for p in procs:
            a = med.get((name, p))
            cells.append("–" if a is None else f"{a[1]:,.0f} µs {verdict(a[1] <= CPU_TARGET_US)}")
        lines.append(f"| {name} ≤ {CPU_TARGET_US:.0f} µs client CPU a job | " + " | ".join(cells) + " |")
    return lines

"""jobq across several machines: worker hosts on their own network, a partitioned host, a
database failover. Every run is judged by the history checker (checker.py) on the workers'
own logs, the final table and in-flight counts sampled from the database.

Hosts are network namespaces on this machine (infra.py), the database is the suite's own
PostgreSQL instance on the bridge they share; nothing leaves this machine.
"""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from checker import TALLY, Report, check, read_history, read_table
from infra import (
    DBNAME,
    PRIMARY_PORT,
    SERVER_ADDR,
    STANDBY_PORT,
    Hosts,
    Sampler,
    instances,
    start_worker,
    stop_workers,
    wait,
)

import jobq

pytestmark = pytest.mark.timeout(240)

#: How a worker host reaches the database: a dead or cut-off peer must surface as an error
#: within a few seconds (connect_timeout for new connections, tcp_user_timeout for a request
#: the network swallows, keepalives for an idle one), well inside the lease, or a heartbeat
#: waits on a partitioned socket for the kernel's default of many minutes.
NET_PARAMS = "connect_timeout=2&tcp_user_timeout=1500&keepalives_idle=1&keepalives_interval=1&keepalives_count=2"

jobs = jobq.Job.__table__


def host_url(port: int = PRIMARY_PORT) -> str:
    return f"postgresql+psycopg://postgres@{SERVER_ADDR}:{port}/{DBNAME}?{NET_PARAMS}"


def multi_host_url() -> str:
    """Both servers in one URL: libpq tries them in order and keeps the one that takes writes."""
    return (f"postgresql+psycopg://postgres@/{DBNAME}?host={SERVER_ADDR}:{PRIMARY_PORT}"
            f"&host={SERVER_ADDR}:{STANDBY_PORT}&target_session_attrs=read-write&{NET_PARAMS}")


#: Every engine a test makes, disposed by its teardown (``engines``) even when the test fails:
#: a connection left open would be reported as unclosed in whichever test runs next.
_ENGINES: list[sa.Engine] = []


def local_engine(url: str) -> sa.Engine:
    eng = sa.create_engine(url, pool_pre_ping=True)
    _ENGINES.append(eng)
    return eng


@pytest.fixture(autouse=True)
def engines() -> Iterator[None]:
    yield
    while _ENGINES:
        _ENGINES.pop().dispose()


def count_done(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).where(jobs.c.state == "done")).scalar_one()


def total(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(jobs)).scalar_one()


def dag(groups: dict[str, int], boxes: int, children: int, sleep: float, spread: int = 0) -> list[dict]:
    """Per group: ``boxes`` containers of ``children`` jobs, a fan-in job after all of them; one
    final job after every group's fan-in. Leaf args carry ``i`` (the result is 7 * i). With
    ``spread`` the leaves' types are work0 .. work<spread-1> in turn (a host runs its own type)."""
    items: list[dict] = []
    i = 0
    fan_ins = []
    for g in groups:
        box_keys = []
        for b in range(boxes):
            bk = f"{g}-box{b}"
            items.append({"key": bk, "type": "work", "container": True, "group_key": g})
            box_keys.append(bk)
            for _c in range(children):
                i += 1
                items.append({"key": f"{bk}-{i}", "type": f"work{i % spread}" if spread else "work", "parent": bk,
                              "group_key": g,
                              "args": {"i": i, "sleep": sleep}})
        i += 1
        items.append({"key": f"{g}-fanin", "type": "work", "group_key": g, "depends_on": box_keys,
                      "args": {"i": i, "sleep": sleep}})
        fan_ins.append(f"{g}-fanin")
    i += 1
    items.append({"key": "final", "type": "work", "group_key": next(iter(groups)), "depends_on": fan_ins,
                  "args": {"i": i, "sleep": sleep}})
    return items


def tally(rep: Report, lossy_failover: bool = False) -> None:
    TALLY.jobs += rep.jobs
    TALLY.lost += len(rep.lost)
    if lossy_failover:  # a completion the old primary acknowledged and took with it, then re-run
        TALLY.async_reruns += len(rep.acked_lost)
        TALLY.done_twice += len(set(rep.done_twice) - set(rep.acked_lost))
    else:
        TALLY.done_twice += len(rep.done_twice)
    TALLY.over_cap += rep.over_cap


def hosts_that_worked(logdir: pathlib.Path) -> set[str]:
    return {h["host"] for h in read_history(logdir) if h["ev"] == "start"}


# ---- 1. several hosts, a DAG, caps --------------------------------------------------------------

CAP, GROUP_CAPS = 6, {"a": 2, "b": 3, "c": 3}


def test_cap_and_dag_hold_across_hosts(hosts: Hosts, procs: list, logdir: pathlib.Path) -> None:
    """Three hosts, two worker processes each, drain a DAG (containers, fan-in per group, a final
    fan-in) under a global cap of 6 and group caps a=2, b=3, c=3.

    Correct: every job done exactly once with the result its one acknowledged attempt returned;
    no database sample and no instant of the handlers' intervals above a cap; no job started
    before its upstreams (through containers) were done. A cap counted per host, or a claim that
    is not one transaction across hosts, shows as over_cap; a lost rollup as lost."""
    with instances(standby=False, sync=False) as (pg, _):
        eng = local_engine(pg.url)
        jobq.create_schema(eng)
        for i in range(len(hosts.names)):
            for _ in range(2):
                procs.append(start_worker(hosts, i, host_url(), logdir, "--cap", str(CAP), "--ttl", "30",
                                          "--group-caps", json.dumps(GROUP_CAPS), "--types", f"work,work{i}"))
        # Every worker process up before there is work: started one after another, the first
        # host's could otherwise drain the DAG before the last host's had imported jobq.
        wait(lambda: sum(h["ev"] == "ready" for h in read_history(logdir)) == len(procs), 120,
             "every worker process to start")
        with Sampler(pg.url) as sampler:
            # The global cap counts every worker on the database, so one fast process may hold every
            # slot: each host gets leaves of its own type, so that all three must run jobs and the
            # caps are contended across hosts (the fan-ins and the final job: any host).
            jobq.submit(eng, dag({"a": 1, "b": 1, "c": 1}, boxes=3, children=25, sleep=0.02, spread=len(hosts.names)))
            n = total(eng)
            wait(lambda: count_done(eng) == n, 180, "the DAG to drain", interval=0.2)
        rep = check(read_history(logdir), read_table(eng), cap=CAP, group_caps=GROUP_CAPS, samples=sampler.samples)
        eng.dispose()
    TALLY.notes.append(f"hosts+caps: {rep.line()}")
    tally(rep)
    assert (rep.lost, rep.done_twice, rep.unexpected, rep.early) == ([], [], [], []), rep
    assert rep.over_cap == 0, rep
    assert rep.samples > 0 and not rep.reruns, rep
    assert hosts_that_worked(logdir) == set(hosts.names), "every host should have run jobs"


def test_checker_catches_a_cap_counted_outside_the_claim(hosts: Hosts, procs: list, logdir: pathlib.Path) -> None:
    """BROKEN variant: workers on three hosts count the global cap in a transaction of their
    own before claiming. Hosts that count at the same moment spend the same free slots, and
    the checker must see the cap exceeded (in the sampled counts or the handler intervals)."""
    with instances(standby=False, sync=False) as (pg, _):
        eng = local_engine(pg.url)
        jobq.create_schema(eng)
        jobq.submit(eng, [{"key": str(i), "type": "work", "args": {"i": i, "sleep": 0.1}} for i in range(150)])
        with Sampler(pg.url) as sampler:
            for i in range(len(hosts.names)):
                for _ in range(2):
                    procs.append(start_worker(hosts, i, host_url(), logdir, "--cap", "3",
                                              "--broken", "cap_outside_claim"))
            wait(lambda: count_done(eng) == 150, 180, "the queue to drain", interval=0.2)
        rep = check(read_history(logdir), read_table(eng), cap=3, samples=sampler.samples)
        eng.dispose()
    TALLY.notes.append(f"broken cap_outside_claim (caught): {rep.line()}")
    assert rep.over_cap > 0, rep


# ---- 2. a partitioned host ----------------------------------------------------------------------


def events_of(logdir: pathlib.Path, host: str, ev: str) -> list[dict]:
    return [h for h in read_history(logdir) if h["host"] == host and h["ev"] == ev]


def gated(gate: pathlib.Path, n: int, start: int = 0) -> list[dict]:
    return [{"key": f"g{i}", "type": "work", "args": {"i": i, "gate": str(gate)}} for i in range(start, start + n)]


def all_done(eng: sa.Engine, ids: list[int]) -> bool:
    with eng.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).where(jobs.c.id.in_(ids), jobs.c.state == "done")
                            ).scalar_one() == len(ids)


def test_partitioned_host_loses_its_leases_and_rejoins(hosts: Hosts, procs: list, logdir: pathlib.Path,
                                                       tmp_path: pathlib.Path) -> None:
    """Host 0 runs 4 jobs, then is cut off (every packet dropped in its namespace) for longer than
    the 2 s lease: hosts 1 and 2 reclaim the jobs and finish them. Host 0's handlers finish only
    after the partition heals.

    Correct: every late heartbeat or result of host 0 is refused (a lease_lost event per job),
    no stored result comes from host 0, and once the other hosts stop, host 0 runs new work (it
    rejoined). A worker without the fence would overwrite the results (see the broken variant
    below); one without self-fencing would still be refused here."""
    gate, h0 = tmp_path / "gate", hosts.names[0]
    for h in hosts.names[1:]:
        pathlib.Path(f"{gate}-{h}").touch()
    with instances(standby=False, sync=False) as (pg, _):
        eng = local_engine(pg.url)
        jobq.create_schema(eng)
        first = list(jobq.submit(eng, gated(gate, 4)).values())
        procs.append(start_worker(hosts, 0, host_url(), logdir, "--cap", "8", "--ttl", "2"))
        wait(lambda: len(events_of(logdir, h0, "start")) == 4, 60, "host 0 to start its 4 jobs")
        with Sampler(pg.url) as sampler:
            hosts.partition(0)
            TALLY.partitions += 1
            t_cut = time.monotonic()
            try:
                for i in (1, 2):
                    procs.append(start_worker(hosts, i, host_url(), logdir, "--cap", "8", "--ttl", "2"))
                wait(lambda: all_done(eng, first), 60, "hosts 1 and 2 to finish host 0's jobs")
                cut = time.monotonic() - t_cut
            finally:
                hosts.heal(0)
            pathlib.Path(f"{gate}-{h0}").touch()
            wait(lambda: len({e["job"] for e in events_of(logdir, h0, "lease_lost")}) == 4
                 and len(events_of(logdir, h0, "finish")) == 4, 60, "host 0's late results to be refused")
            # rejoin: the other hosts leave; new work must be done by host 0
            stop_workers(procs[1:], signal.SIGTERM)
            later = list(jobq.submit(eng, [{"key": f"n{i}", "type": "work", "args": {"i": 100 + i}}
                                           for i in range(6)]).values())
            wait(lambda: all_done(eng, later), 60, "host 0 to run new work after the partition")
        table = read_table(eng)
        rep = check(read_history(logdir), table, cap=8, samples=sampler.samples)
        eng.dispose()
    TALLY.notes.append(f"partition {cut:.1f} s > lease 2 s: host 0's 4 jobs re-run elsewhere, "
                       f"{len({e['job'] for e in events_of(logdir, h0, 'lease_lost')})} lease_lost on host 0, "
                       f"0 of its late results stored; {rep.line()}")
    tally(rep)
    assert all(table.rows[j].result["host"] != h0 for j in first), "a result from the cut-off host was stored"
    assert all(table.rows[j].result["host"] == h0 for j in later), "host 0 did not rejoin"
    assert {e["job"] for e in events_of(logdir, h0, "done")} == set(later)
    assert (rep.lost, rep.done_twice, rep.unexpected, rep.early, rep.over_cap) == ([], [], [], [], 0), rep
    assert set(first) <= set(rep.reruns), rep


def test_checker_catches_an_unfenced_zombie(hosts: Hosts, procs: list, logdir: pathlib.Path,
                                            tmp_path: pathlib.Path) -> None:
    """BROKEN variant: host 0 runs a worker that never heartbeats and writes `done` by id alone.
    Cut off past its lease, its job is finished by host 1; after the partition heals it writes
    its late result over the stored one. The checker must report the job done twice and host
    1's acknowledged result lost (overwritten)."""
    gate, h0 = tmp_path / "gate", hosts.names[0]
    pathlib.Path(f"{gate}-{hosts.names[1]}").touch()
    with instances(standby=False, sync=False) as (pg, _):
        eng = local_engine(pg.url)
        jobq.create_schema(eng)
        ids = list(jobq.submit(eng, gated(gate, 1)).values())
        procs.append(start_worker(hosts, 0, host_url(), logdir, "--ttl", "2", "--broken", "unfenced"))
        wait(lambda: events_of(logdir, h0, "start"), 60, "host 0 to start the job")
        hosts.partition(0)
        TALLY.partitions += 1
        try:
            procs.append(start_worker(hosts, 1, host_url(), logdir, "--ttl", "2"))
            wait(lambda: all_done(eng, ids), 60, "host 1 to finish the job")
        finally:
            hosts.heal(0)
        pathlib.Path(f"{gate}-{h0}").touch()
        wait(lambda: events_of(logdir, h0, "done"), 60, "the zombie's unfenced write")
        rep = check(read_history(logdir), read_table(eng))
        eng.dispose()
    TALLY.notes.append(f"broken unfenced zombie (caught): {rep.line()}")
    assert rep.done_twice == ids and rep.acked_lost == ids, rep


def test_partitioned_worker_fences_itself_without_network_timeouts(hosts: Hosts, procs: list, logdir: pathlib.Path,
                                                                   tmp_path: pathlib.Path) -> None:
    """Host 0 runs a cooperative handler under a 3 s lease, on a URL without any network timeout
    (libpq's defaults), and is cut off. Its heartbeat's request is swallowed: the socket waits
    for the kernel to give up, many minutes.

    Correct: the worker still fences itself on time, lease_ttl minus a margin after its last good
    heartbeat: the handler is told "lease_lost" while the host is still cut off, its result is
    not stored, and the job is finished once (by either host) after the heal. A self-fence that waits for the heartbeat to fail
    never comes during the partition (the wait below times out)."""
    gate, h0 = tmp_path / "gate", hosts.names[0]
    pathlib.Path(f"{gate}-{hosts.names[1]}").touch()
    with instances(standby=False, sync=False) as (pg, _):
        eng = local_engine(pg.url)
        jobq.create_schema(eng)
        ids = list(jobq.submit(eng, [{"key": "c", "type": "work", "args": {"i": 1, "gate": str(gate), "coop": True}}]
                               ).values())
        procs.append(start_worker(hosts, 0, host_url(), logdir, "--ttl", "3", "--plain-url"))
        wait(lambda: events_of(logdir, h0, "start"), 60, "host 0 to start the job")
        hosts.partition(0)
        TALLY.partitions += 1
        try:
            stopped = wait(lambda: events_of(logdir, h0, "stopped"), 60, "host 0's handler to be told to stop")
        finally:
            hosts.heal(0)
        pathlib.Path(f"{gate}-{h0}").touch()
        procs.append(start_worker(hosts, 1, host_url(), logdir, "--ttl", "3"))
        wait(lambda: all_done(eng, ids), 60, "the job to be finished after the heal")
        table = read_table(eng)
        rep = check(read_history(logdir), table)
        eng.dispose()
    TALLY.notes.append(f"partition without network timeouts: host 0 self-fenced ({stopped[0]['reason']}); {rep.line()}")
    tally(rep)
    assert stopped[0]["reason"] == "lease_lost"
    assert table.rows[ids[0]].result["run"] != stopped[0]["run"], "the fenced run's result was stored"
    assert (rep.lost, rep.done_twice, rep.unexpected) == ([], [], []), rep


def test_short_partition_runs_nothing_twice(hosts: Hosts, procs: list, logdir: pathlib.Path,
                                            tmp_path: pathlib.Path) -> None:
    """Host 0 is cut off for 1 s while it runs 4 jobs under a 15 s lease; the other hosts keep
    draining the queue meanwhile.

    Correct: no job starts twice, no lease is lost, every job done once. A worker that gave up
    its leases on the first failed heartbeat, or a reclaim that ignored the lease, would re-run
    host 0's jobs."""
    gate, h0 = tmp_path / "gate", hosts.names[0]
    ttl = 15.0  # far beyond the cut: a heartbeat late under load must not pass for a re-run
    with instances(standby=False, sync=False) as (pg, _):
        eng = local_engine(pg.url)
        jobq.create_schema(eng)
        jobq.submit(eng, gated(gate, 4))
        procs.append(start_worker(hosts, 0, host_url(), logdir, "--cap", "8", "--ttl", str(ttl)))
        wait(lambda: len(events_of(logdir, h0, "start")) == 4, 60, "host 0 to start its 4 jobs")
        jobq.submit(eng, [{"key": f"n{i}", "type": "work", "args": {"i": 100 + i, "sleep": 0.05}} for i in range(40)])
        with Sampler(pg.url) as sampler:
            for i in (1, 2):
                procs.append(start_worker(hosts, i, host_url(), logdir, "--cap", "8", "--ttl", str(ttl)))
            hosts.partition(0)
            TALLY.partitions += 1
            t_cut = time.monotonic()
            try:
                time.sleep(1.0)  # the fault's length, not a synchronisation
            finally:
                hosts.heal(0)
            cut = time.monotonic() - t_cut
            assert cut < ttl / 2, f"the partition lasted {cut:.1f}s: too long for this test's premise"
            pathlib.Path(f"{gate}-{h0}").touch()
            n = total(eng)
            wait(lambda: count_done(eng) == n, 120, "the queue to drain")
        rep = check(read_history(logdir), read_table(eng), cap=8, samples=sampler.samples)
        eng.dispose()
    TALLY.notes.append(f"partition {cut:.1f} s < lease {ttl:g} s: {rep.line()}")
    tally(rep)
    assert (rep.lost, rep.done_twice, rep.unexpected, rep.reruns, rep.over_cap) == ([], [], [], [], 0), rep
    assert not events_of(logdir, h0, "lease_lost")


#: A client cut off inside a transaction, as a claim is while it holds the cap's lock row: it locks
#: that row, prints its backend's pid and waits. With "no-keepalive" its session turns the server's
#: dead-client probes off (0: the kernel's defaults, two hours), as a server configured without them.
HOLDER = """
import sys, time, psycopg
conn = psycopg.connect(sys.argv[1], autocommit=True)
if sys.argv[2] == "no-keepalive":
    conn.execute("SET tcp_keepalives_idle = 0")
    conn.execute("SET tcp_user_timeout = 0")
conn.execute("BEGIN")
conn.execute("SELECT value FROM jobq_meta WHERE key = 'claim_lock' FOR UPDATE")
print(conn.info.backend_pid, flush=True)
time.sleep(3600)
"""


def hold_claim_lock(hosts: Hosts, i: int, mode: str) -> tuple[subprocess.Popen, int]:
    """A process on host ``i`` holding the cap's lock row in an open transaction; its backend pid."""
    conninfo = f"host={SERVER_ADDR} port={PRIMARY_PORT} dbname={DBNAME} user=postgres connect_timeout=5"
    p = subprocess.Popen(["ip", "netns", "exec", hosts.names[i], sys.executable, "-c", HOLDER, conninfo, mode],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    with p.stdout:  # it prints nothing more
        return p, int(p.stdout.readline())


def lock_is_held(eng: sa.Engine) -> bool:
    """Whether some other session holds the claim_lock row (a NOWAIT lock attempt fails)."""
    with eng.connect() as conn:
        try:
            conn.execute(sa.text("SELECT value FROM jobq_meta WHERE key = 'claim_lock' FOR UPDATE NOWAIT"))
        except sa.exc.OperationalError:
            return True
        finally:
            conn.rollback()
    return False


def backend_alive(eng: sa.Engine, pid: int) -> bool:
    with eng.connect() as conn:
        return bool(conn.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"), {"p": pid}).scalar())


def test_host_cut_off_inside_a_transaction_does_not_stall_the_others(hosts: Hosts, procs: list,
                                                                      logdir: pathlib.Path) -> None:
    """Host 0 is cut off while it holds the cap's lock row in an open transaction (a claim caught
    mid-way; a heartbeat between its UPDATE and COMMIT holds job rows the same way). Every capped
    claim of every other host waits for that row.

    Correct (the server probes its clients, SERVER_DROPS_DEAD_CLIENTS): the server drops the dead
    session within seconds, its transaction rolls back, and hosts 1 and 2 drain the queue while
    host 0 is still cut off. Without the probes the row stays locked for the kernel's two hours
    (the broken variant below)."""
    with instances(standby=False, sync=False) as (pg, _):
        eng = local_engine(pg.url)
        jobq.create_schema(eng)
        ids = list(jobq.submit(eng, [{"key": f"t{i}", "type": "work", "args": {"i": i}} for i in range(12)]).values())
        holder, pid = hold_claim_lock(hosts, 0, "keepalive")
        procs.append(holder)
        assert lock_is_held(eng)
        hosts.partition(0)
        TALLY.partitions += 1
        try:
            for i in (1, 2):
                procs.append(start_worker(hosts, i, host_url(), logdir, "--cap", "4", "--ttl", "3"))
            wait(lambda: all_done(eng, ids), 90, "hosts 1 and 2 to drain the queue past the dead lock holder")
            assert not backend_alive(eng, pid), "the work finished but the cut-off session is still there"
        finally:
            hosts.heal(0)
        rep = check(read_history(logdir), read_table(eng), cap=4)
    TALLY.notes.append(f"host cut off holding the cap's lock: its session dropped by the server; {rep.line()}")
    tally(rep)
    assert (rep.lost, rep.done_twice, rep.unexpected, rep.over_cap) == ([], [], [], 0), rep


def test_without_server_probes_a_cut_off_transaction_keeps_its_locks(hosts: Hosts, procs: list) -> None:
    """BROKEN variant: the cut-off session has the server's probes turned off. Well past the
    bound the test above relies on (keepalives 1 s + 3 x 1 s, tcp_user_timeout 3 s), its backend
    is still there and the lock row is still held: every capped claim would wait on it."""
    with instances(standby=False, sync=False) as (pg, _):
        eng = local_engine(pg.url)
        jobq.create_schema(eng)
        holder, pid = hold_claim_lock(hosts, 0, "no-keepalive")
        procs.append(holder)
        hosts.partition(0)
        TALLY.partitions += 1
        try:
            time.sleep(12.0)  # three times the probes' bound: the fault's length, not a synchronisation
            assert backend_alive(eng, pid) and lock_is_held(eng), "the server dropped the session without its probes"
        finally:
            hosts.heal(0)


# ---- 3. a database failover ---------------------------------------------------------------------


def listeners(pg_url: str) -> int:
    e = sa.create_engine(pg_url)
    try:
        with e.connect() as conn:
            return conn.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'jobq-listener' "
                                        "AND query LIKE 'LISTEN%'")).scalar_one()
    finally:
        e.dispose()


@pytest.mark.parametrize("replication", ["sync", "async"])
def test_failover_to_a_promoted_standby(hosts: Hosts, procs: list, logdir: pathlib.Path, replication: str) -> None:
    """A primary and a streaming hot standby; workers on three hosts reach them through one
    multi-host URL (target_session_attrs=read-write) with LISTEN on. Mid-run the primary's
    processes are all SIGKILLed (the machine dies) and the standby is promoted.

    Correct, synchronous replication: no acknowledged completion lost, no job completed twice,
    every job done once, caps held. Asynchronous, with the standby made to lag (it stops
    receiving WAL while the primary acknowledges 20 more completions): those completions are
    lost and the jobs run again (counted), yet every job ends done, each job at most once
    acknowledged on the new timeline, and no stored result is one nobody acknowledged.
    Both: work resumes on the new primary (time measured), and every worker's listener LISTENs
    there again. A worker that did not survive its database moving would leave work undone."""
    ttl, cap, sync = 10.0, 6, replication == "sync"
    with instances(standby=True, sync=sync) as (pg, sb):
        assert sb is not None
        eng = local_engine(pg.url)
        jobq.create_schema(eng)
        jobq.submit(eng, dag({"a": 1, "b": 1, "c": 1}, boxes=2, children=50, sleep=0.01))
        n = total(eng)
        eng.dispose()
        with Sampler(multi_host_url()) as sampler:
            for i in range(len(hosts.names)):
                procs.append(start_worker(hosts, i, multi_host_url(), logdir, "--cap", str(cap), "--ttl", str(ttl),
                                          "--listen"))
            acks = lambda: len([h for h in read_history(logdir) if h["ev"] == "done"])  # noqa: E731
            wait(lambda: acks() >= n // 3, 120, "a third of the work to be done")
            if not sync:
                # An asynchronous standby that lags: it stops receiving WAL (no primary_conninfo;
                # reloadable since PostgreSQL 13), while the primary acknowledges 20 more completions.
                sb.psql("ALTER SYSTEM SET primary_conninfo = ''")
                sb.psql("SELECT pg_reload_conf()")
                wait(lambda: sb.psql("SELECT count(*) FROM pg_stat_wal_receiver").strip() == "0", 30,
                     "the standby to stop receiving")
                k = acks()
                wait(lambda: acks() >= k + 20, 60, "20 completions the standby does not have")
            pg.kill9()
            # Taken once every process is dead, not before the signals: pids() forks ps first, and
            # a commit the old primary acknowledges meanwhile belongs to its timeline, not the new one.
            t_kill = time.monotonic()
            sb.promote()
            TALLY.failovers += 1
            new = local_engine(sb.url)
            wait(lambda: count_done(new) == n, 180, "the work to finish on the promoted standby", interval=0.2)
            wait(lambda: listeners(sb.url) == len(hosts.names), 60, "every worker to LISTEN on the new primary")
        history = read_history(logdir)
        table = read_table(new)
        rep = check(history, table, cap=cap, samples=sampler.samples)
        new.dispose()
    before = {h["run"] for h in history if h["ev"] == "start" and h["t"] < t_kill}
    resumed = min(h["t"] for h in history if h["ev"] == "done" and h["t"] > t_kill and h["run"] not in before)
    resume = resumed - t_kill
    TALLY.resume.append(f"{resume:.1f} s ({replication})")
    TALLY.notes.append(f"failover ({replication} replication): resume {resume:.1f} s, "
                       f"{len(rep.acked_lost)} acknowledged completions lost and re-run; {rep.line()}")
    tally(rep, lossy_failover=not sync)
    assert (rep.lost, rep.unexpected) == ([], []), rep
    # Single on the new timeline: an acknowledged completion that is not the stored one must
    # have committed on the old primary, so its run started before the kill (a run logs its
    # start before its handler, and so before its completion commits). One that started after
    # was claimed and completed on the new primary: a second completion there.
    started = {h["run"]: h["t"] for h in history if h["ev"] == "start"}
    stray = [h for h in history if h["ev"] == "done" and h["run"] != (table.rows[h["job"]].result or {}).get("run")
             and started[h["run"]] >= t_kill]
    assert not stray, f"a job was completed twice on the new timeline: {stray[:3]}"
    assert set(rep.done_twice) <= set(rep.acked_lost), rep
    if sync:
        assert (rep.done_twice, rep.acked_lost, rep.early, rep.over_cap) == ([], [], [], 0), rep
    else:  # what a lagging asynchronous standby costs: re-runs, never a lost or doubled job
        assert rep.acked_lost and set(rep.acked_lost) <= set(rep.reruns), rep

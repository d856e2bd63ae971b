"""jobq across several machines on MariaDB: worker hosts on their own network reaching a primary
and a replica through HAProxy, a partitioned host, a host cut off inside a transaction, a
failover to the replica. The same scenarios as test_cluster.py (PostgreSQL), judged by the same
history checker (checker.py); the servers are the backend in maria_infra.py.

Workers reach the database only through HAProxy (PROXY_ADDR:PROXY_PORT), whose health check
follows the writable node; the test reads the servers directly (127.0.0.1).
"""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import sqlalchemy as sa
from checker import TALLY, check, read_history, read_table
from infra import Hosts, Sampler, start_worker, stop_workers, wait
from maria_infra import DBNAME, PROXY_ADDR, PROXY_PORT, USER, cluster, promote
from test_cluster import (  # the scenarios' shared pieces: the DAG, the tally, the history's questions
    CAP,
    GROUP_CAPS,
    all_done,
    count_done,
    dag,
    engines,  # noqa: F401 - the autouse fixture that disposes local_engine's engines
    events_of,
    gated,
    hosts_that_worked,
    local_engine,
    tally,
    total,
)

import jobq

pytestmark = pytest.mark.timeout(240)

#: How a worker host reaches the database: a dead or cut-off peer must surface as an error
#: within a few seconds, well inside the lease (PyMySQL: connect_timeout for new connections,
#: read/write_timeout for a request the network swallows). read_timeout stays above the
#: servers' innodb_lock_wait_timeout (3 s), so a claim waiting for a lock is not cut off first.
NET_PARAMS = "connect_timeout=2&read_timeout=6&write_timeout=6"


def host_url() -> str:
    """Through HAProxy, as the workers' user (read_only binds it)."""
    return f"mariadb+pymysql://{USER}@{PROXY_ADDR}:{PROXY_PORT}/{DBNAME}?{NET_PARAMS}"


def proxy_url() -> str:
    """The test's own view through HAProxy (it follows a failover)."""
    return f"mariadb+pymysql://{USER}@127.0.0.1:{PROXY_PORT}/{DBNAME}?{NET_PARAMS}"


def start_workers(hosts: Hosts, procs: list, logdir: pathlib.Path, per_host: int, *args: str,
                  only: tuple[int, ...] | None = None) -> None:
    for i in (range(len(hosts.names)) if only is None else only):
        for _ in range(per_host):
            procs.append(start_worker(hosts, i, host_url(), logdir, *args))


# ---- 1. several hosts, a DAG, caps --------------------------------------------------------------


def test_cap_and_dag_hold_across_hosts(maria_hosts: Hosts, procs: list, logdir: pathlib.Path) -> None:
    """Three hosts, two worker processes each, all through HAProxy, drain a DAG (containers,
    fan-in per group, a final fan-in) under a global cap of 6 and group caps a=2, b=3, c=3.

    Correct: every job done exactly once with the result its one acknowledged attempt returned;
    no database sample and no instant of the handlers' intervals above a cap; no job started
    before its upstreams were done. A cap counted per host or outside the claim's transaction
    shows as over_cap (the broken variant below); a lost rollup as lost."""
    hosts = maria_hosts
    with cluster(replica=False, sync=False) as (db, _, _proxy):
        eng = local_engine(proxy_url())
        jobq.create_schema(eng)
        for i in range(len(hosts.names)):
            for _ in range(2):
                procs.append(start_worker(hosts, i, host_url(), logdir, "--cap", str(CAP), "--ttl", "30",
                                          "--group-caps", json.dumps(GROUP_CAPS), "--types", f"work,work{i}"))
        wait(lambda: sum(h["ev"] == "ready" for h in read_history(logdir)) == len(procs), 120,
             "every worker process to start")
        with Sampler(db.url) as sampler:
            jobq.submit(eng, dag({"a": 1, "b": 1, "c": 1}, boxes=3, children=25, sleep=0.02, spread=len(hosts.names)))
            n = total(eng)
            wait(lambda: count_done(eng) == n, 180, "the DAG to drain", interval=0.2)
        rep = check(read_history(logdir), read_table(eng), cap=CAP, group_caps=GROUP_CAPS, samples=sampler.samples)
    TALLY.notes.append(f"hosts+caps: {rep.line()}")
    tally(rep)
    assert (rep.lost, rep.done_twice, rep.unexpected, rep.early) == ([], [], [], []), rep
    assert rep.over_cap == 0, rep
    assert rep.samples > 0 and not rep.reruns, rep
    assert hosts_that_worked(logdir) == set(hosts.names), "every host should have run jobs"


def test_checker_catches_a_cap_counted_outside_the_claim(maria_hosts: Hosts, procs: list,
                                                         logdir: pathlib.Path) -> None:
    """BROKEN variant: workers on three hosts count the global cap in a transaction of their own
    before claiming. Hosts that count at the same moment spend the same free slots, and the
    checker must see the cap exceeded (in the sampled counts or the handler intervals)."""
    with cluster(replica=False, sync=False) as (db, _, _proxy):
        eng = local_engine(proxy_url())
        jobq.create_schema(eng)
        jobq.submit(eng, [{"key": str(i), "type": "work", "args": {"i": i, "sleep": 0.1}} for i in range(150)])
        with Sampler(db.url) as sampler:
            start_workers(maria_hosts, procs, logdir, 2, "--cap", "3", "--broken", "cap_outside_claim")
            wait(lambda: count_done(eng) == 150, 180, "the queue to drain", interval=0.2)
        rep = check(read_history(logdir), read_table(eng), cap=3, samples=sampler.samples)
    TALLY.notes.append(f"broken cap_outside_claim (caught): {rep.line()}")
    assert rep.over_cap > 0, rep


# ---- 2. a partitioned host ----------------------------------------------------------------------


def test_partitioned_host_loses_its_leases_and_rejoins(maria_hosts: Hosts, procs: list, logdir: pathlib.Path,
                                                       tmp_path: pathlib.Path) -> None:
    """Host 0 runs 4 jobs, then is cut off for longer than the 2 s lease: hosts 1 and 2 reclaim
    the jobs and finish them. Host 0's handlers finish only after the partition heals.

    Correct: every late heartbeat or result of host 0 is refused (a lease_lost event per job),
    no stored result comes from host 0, and once the other hosts stop, host 0 runs new work (it
    rejoined through HAProxy). Without the fence the late results land (the broken variant)."""
    hosts = maria_hosts
    gate, h0 = tmp_path / "gate", hosts.names[0]
    for h in hosts.names[1:]:
        pathlib.Path(f"{gate}-{h}").touch()
    with cluster(replica=False, sync=False) as (db, _, _proxy):
        eng = local_engine(proxy_url())
        jobq.create_schema(eng)
        first = list(jobq.submit(eng, gated(gate, 4)).values())
        procs.append(start_worker(hosts, 0, host_url(), logdir, "--cap", "8", "--ttl", "2"))
        wait(lambda: len(events_of(logdir, h0, "start")) == 4, 60, "host 0 to start its 4 jobs")
        with Sampler(db.url) as sampler:
            hosts.partition(0)
            TALLY.partitions += 1
            t_cut = time.monotonic()
            try:
                start_workers(hosts, procs, logdir, 1, "--cap", "8", "--ttl", "2", only=(1, 2))
                wait(lambda: all_done(eng, first), 60, "hosts 1 and 2 to finish host 0's jobs")
                cut = time.monotonic() - t_cut
            finally:
                hosts.heal(0)
            pathlib.Path(f"{gate}-{h0}").touch()
            wait(lambda: len({e["job"] for e in events_of(logdir, h0, "lease_lost")}) == 4
                 and len(events_of(logdir, h0, "finish")) == 4, 60, "host 0's late results to be refused")
            stop_workers(procs[1:], signal.SIGTERM)
            later = list(jobq.submit(eng, [{"key": f"n{i}", "type": "work", "args": {"i": 100 + i}}
                                           for i in range(6)]).values())
            wait(lambda: all_done(eng, later), 60, "host 0 to run new work after the partition")
        table = read_table(eng)
        rep = check(read_history(logdir), table, cap=8, samples=sampler.samples)
    TALLY.notes.append(f"partition {cut:.1f} s > lease 2 s: host 0's 4 jobs re-run elsewhere, "
                       f"{len({e['job'] for e in events_of(logdir, h0, 'lease_lost')})} lease_lost on host 0, "
                       f"0 of its late results stored; {rep.line()}")
    tally(rep)
    assert all(table.rows[j].result["host"] != h0 for j in first), "a result from the cut-off host was stored"
    assert all(table.rows[j].result["host"] == h0 for j in later), "host 0 did not rejoin"
    assert {e["job"] for e in events_of(logdir, h0, "done")} == set(later)
    assert (rep.lost, rep.done_twice, rep.unexpected, rep.early, rep.over_cap) == ([], [], [], [], 0), rep
    assert set(first) <= set(rep.reruns), rep


def test_checker_catches_an_unfenced_zombie(maria_hosts: Hosts, procs: list, logdir: pathlib.Path,
                                            tmp_path: pathlib.Path) -> None:
    """BROKEN variant: host 0 runs a worker that never heartbeats and writes `done` by id alone.
    Cut off past its lease, its job is finished by host 1; after the partition heals it writes
    its late result over the stored one. The checker must report the job done twice and host
    1's acknowledged result lost (overwritten)."""
    hosts = maria_hosts
    gate, h0 = tmp_path / "gate", hosts.names[0]
    pathlib.Path(f"{gate}-{hosts.names[1]}").touch()
    with cluster(replica=False, sync=False):
        eng = local_engine(proxy_url())
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
    TALLY.notes.append(f"broken unfenced zombie (caught): {rep.line()}")
    assert rep.done_twice == ids and rep.acked_lost == ids, rep


# ---- 3. a host cut off inside a transaction -----------------------------------------------------

#: A client cut off inside a transaction, as a claim is while it holds the cap's lock row: it locks
#: that row through HAProxy, prints its session's id and waits. With "no-idle-timeout" its session
#: turns the server's idle_transaction_timeout off, as a server configured without it.
HOLDER = """
import sys, time, pymysql
conn = pymysql.connect(host=sys.argv[1], port=int(sys.argv[2]), user=sys.argv[3], database=sys.argv[4],
                       connect_timeout=5, autocommit=True)
cur = conn.cursor()
if sys.argv[5] == "no-idle-timeout":
    cur.execute("SET SESSION idle_transaction_timeout = 0")
cur.execute("SELECT CONNECTION_ID()")
cid = cur.fetchone()[0]
cur.execute("BEGIN")
cur.execute("SELECT value FROM jobq_meta WHERE `key` = 'claim_lock' FOR UPDATE")
print(cid, flush=True)
time.sleep(3600)
"""


def hold_claim_lock(hosts: Hosts, i: int, mode: str) -> tuple[subprocess.Popen, int]:
    """A process on host ``i`` holding the cap's lock row in an open transaction; its session id."""
    p = subprocess.Popen(["ip", "netns", "exec", hosts.names[i], sys.executable, "-c", HOLDER, PROXY_ADDR,
                          str(PROXY_PORT), USER, DBNAME, mode], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    with p.stdout:
        return p, int(p.stdout.readline())


def lock_is_held(eng: sa.Engine) -> bool:
    """Whether some other session holds the claim_lock row (a NOWAIT lock attempt fails)."""
    with eng.connect() as conn:
        try:
            conn.execute(sa.text("SELECT value FROM jobq_meta WHERE `key` = 'claim_lock' FOR UPDATE NOWAIT"))
        except sa.exc.OperationalError:
            return True
        finally:
            conn.rollback()
    return False


def session_alive(eng: sa.Engine, cid: int) -> bool:
    with eng.connect() as conn:
        return bool(conn.execute(sa.text("SELECT count(*) FROM information_schema.processlist WHERE id = :c"),
                                 {"c": cid}).scalar())


def test_host_cut_off_inside_a_transaction_does_not_stall_the_others(maria_hosts: Hosts, procs: list,
                                                                      logdir: pathlib.Path) -> None:
    """Host 0 is cut off while it holds the cap's lock row in an open transaction (a claim caught
    mid-way). Every capped claim of every other host waits for that row. The server's TCP peer
    is HAProxy, which stays up: keepalives cannot tell the server its client is gone.

    Correct (idle_transaction_timeout = 5 s, maria_infra.SERVER_SETTINGS): the server ends the
    idle session, its transaction rolls back, and hosts 1 and 2 drain the queue while host 0 is
    still cut off; their claims that waited meanwhile gave up (innodb_lock_wait_timeout, 1205)
    and were retried. Without the timeout the row stays locked (the broken variant below)."""
    hosts = maria_hosts
    with cluster(replica=False, sync=False) as (db, _, _proxy):
        eng = local_engine(proxy_url())
        root = local_engine(db.url)
        jobq.create_schema(eng)
        ids = list(jobq.submit(eng, [{"key": f"t{i}", "type": "work", "args": {"i": i}} for i in range(12)]).values())
        holder, cid = hold_claim_lock(hosts, 0, "idle-timeout")
        procs.append(holder)
        assert lock_is_held(eng)
        hosts.partition(0)
        TALLY.partitions += 1
        t_cut = time.monotonic()
        try:
            start_workers(hosts, procs, logdir, 1, "--cap", "4", "--ttl", "3", only=(1, 2))
            wait(lambda: all_done(eng, ids), 90, "hosts 1 and 2 to drain the queue past the dead lock holder")
            drained = time.monotonic() - t_cut
            assert not session_alive(root, cid), "the work finished but the cut-off session is still there"
        finally:
            hosts.heal(0)
        rep = check(read_history(logdir), read_table(eng), cap=4)
    TALLY.notes.append(f"host cut off holding the cap's lock: its session ended by the server "
                       f"(idle_transaction_timeout), queue drained {drained:.1f} s after the cut; {rep.line()}")
    tally(rep)
    assert (rep.lost, rep.done_twice, rep.unexpected, rep.over_cap) == ([], [], [], 0), rep


def test_without_an_idle_transaction_timeout_a_cut_off_transaction_keeps_its_locks(maria_hosts: Hosts,
                                                                                    procs: list) -> None:
    """BROKEN variant: the cut-off session has idle_transaction_timeout turned off. Well past the
    5 s the test above relies on, its session is still there and the lock row is still held:
    every capped claim would wait on it (HAProxy's client timeout is an hour)."""
    with cluster(replica=False, sync=False) as (db, _, proxy):
        eng = local_engine(proxy_url())
        root = local_engine(db.url)
        jobq.create_schema(eng)
        holder, cid = hold_claim_lock(maria_hosts, 0, "no-idle-timeout")
        procs.append(holder)
        maria_hosts.partition(0)
        TALLY.partitions += 1
        try:
            time.sleep(12.0)  # more than twice the timeout's bound: the fault's length, not a synchronisation
            # A check that marked the live primary down would have cut the session (shutdown-sessions):
            # not the server's doing, and not what this variant is about.
            assert proxy.marked_down("primary") == 0, "HAProxy's check marked the live primary down"
            assert session_alive(root, cid) and lock_is_held(eng), "the server ended the session without the timeout"
        finally:
            maria_hosts.heal(0)


# ---- 4. a failover behind HAProxy ---------------------------------------------------------------


@pytest.mark.parametrize("replication", ["semisync", "async"])
def test_failover_to_a_promoted_replica(maria_hosts: Hosts, procs: list, logdir: pathlib.Path,
                                        replication: str) -> None:
    """A primary and a replica behind HAProxy; workers on three hosts reach them through it.
    Mid-run the primary is SIGKILLed (the machine dies) and the replica promoted as an
    operator's failover script would (apply the relay log, STOP SLAVE, RESET SLAVE ALL,
    read_only = OFF); HAProxy's check sees the writable node and sends the workers there.

    Correct, semi-synchronous replication (AFTER_SYNC): no acknowledged completion lost, no job
    completed twice, every job done once, caps held. Asynchronous, with the replica made to lag
    (its IO thread stopped while the primary acknowledges 20 more completions): those completions
    are lost and the jobs run again (counted), yet every job ends done, at most once acknowledged
    on the new timeline, and no stored result is one nobody acknowledged. Both: work resumes
    (time measured) through the same address. A worker that did not survive its database moving
    would leave work undone; a semi-sync that fell back to asynchronous would lose completions."""
    hosts = maria_hosts
    ttl, cap, sync = 10.0, 6, replication == "semisync"
    with cluster(replica=True, sync=sync) as (db, replica, proxy):
        assert replica is not None
        eng = local_engine(proxy_url())
        jobq.create_schema(eng)
        jobq.submit(eng, dag({"a": 1, "b": 1, "c": 1}, boxes=2, children=50, sleep=0.01))
        n = total(eng)
        eng.dispose()
        with Sampler(proxy_url()) as sampler:
            start_workers(hosts, procs, logdir, 1, "--cap", str(cap), "--ttl", str(ttl))
            acks = lambda: len([h for h in read_history(logdir) if h["ev"] == "done"])  # noqa: E731
            wait(lambda: acks() >= n // 3, 120, "a third of the work to be done")
            if sync:
                assert db.status("Rpl_semi_sync_master_status") == "ON", "semi-sync fell back to asynchronous"
                assert db.status("Rpl_semi_sync_master_no_tx") == "0", "a commit was acknowledged without the replica"
            else:
                replica.sql("STOP SLAVE IO_THREAD")
                k = acks()
                wait(lambda: acks() >= k + 20, 60, "20 completions the replica does not have")
            db.kill9()
            t_kill = time.monotonic()  # the server is dead (waited for): what commits later, commits on the replica
            promote(replica)
            TALLY.failovers += 1
            wait(lambda: proxy.states() == {"primary": "DOWN", "replica": "UP"}, 30, "HAProxy to follow the replica")
            followed = time.monotonic() - t_kill
            new = local_engine(replica.url)
            wait(lambda: count_done(new) == n, 180, "the work to finish on the promoted replica", interval=0.2)
        history = read_history(logdir)
        table = read_table(new)
        rep = check(history, table, cap=cap, samples=sampler.samples)
    before = {h["run"] for h in history if h["ev"] == "start" and h["t"] < t_kill}
    resumed = min(h["t"] for h in history if h["ev"] == "done" and h["t"] > t_kill and h["run"] not in before)
    resume = resumed - t_kill
    TALLY.resume.append(f"{resume:.1f} s ({replication})")
    TALLY.notes.append(f"failover ({replication} replication): HAProxy followed in {followed:.1f} s, resume "
                       f"{resume:.1f} s, {len(rep.acked_lost)} acknowledged completions lost and re-run; {rep.line()}")
    tally(rep, lossy_failover=not sync)
    assert (rep.lost, rep.unexpected) == ([], []), rep
    started = {h["run"]: h["t"] for h in history if h["ev"] == "start"}
    stray = [h for h in history if h["ev"] == "done" and h["run"] != (table.rows[h["job"]].result or {}).get("run")
             and started[h["run"]] >= t_kill]
    assert not stray, f"a job was completed twice on the new timeline: {stray[:3]}"
    assert set(rep.done_twice) <= set(rep.acked_lost), rep
    if sync:
        assert (rep.done_twice, rep.acked_lost, rep.early, rep.over_cap) == ([], [], [], 0), rep
    else:  # what a lagging asynchronous replica costs: re-runs, never a lost or doubled job
        assert rep.acked_lost and set(rep.acked_lost) <= set(rep.reruns), rep

"""The cluster suite's machinery: worker hosts as network namespaces, PostgreSQL instances of
its own (a primary, and a streaming standby for failover), and worker processes on the hosts.

Everything here is made by the suite and removed by it, also after a failure:
    hosts     network namespaces jqc-h0, jqc-h1, ... each with one end of a veth pair; the
              other ends hang on the bridge jqc-br0 in this (root) namespace, 10.231.7.1/24,
              and each host has 10.231.7.(10 + i). Nothing else is routed: the addresses exist
              only between these namespaces and this machine.
    postgres  initdb'd instances under a temporary directory, run as the `postgres` OS user on
              ports 55432 (primary) and 55433 (standby), listening on 127.0.0.1 and the bridge.
A partition drops every packet of a host inside its own namespace (an nftables table there).
Needs root (CI runs as root); a step that cannot run raises, it never skips.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import sqlalchemy as sa

import jobq

HERE = pathlib.Path(__file__).resolve().parent
PG_BIN = pathlib.Path(os.environ.get("JOBQ_CLUSTER_PG_BIN", "/usr/lib/postgresql/15/bin"))
NET = "10.231.7"
SERVER_ADDR = f"{NET}.1"
PRIMARY_PORT, STANDBY_PORT = 55432, 55433
DBNAME = "jobq_cluster"
#: The server's side of a partition: a host cut off inside a transaction (a claim holding the cap's
#: lock row, a heartbeat between its UPDATE and COMMIT) keeps its locks until the server notices
#: the client is gone, which by the kernel's defaults takes two hours. Probe idle connections
#: (keepalives: 1 s idle, then 3 probes 1 s apart), give up on unacknowledged sends after 3 s, and
#: check a running query's client every second. docs/guides/several-hosts.md asks users for the same.
SERVER_DROPS_DEAD_CLIENTS = ("tcp_keepalives_idle = 1\ntcp_keepalives_interval = 1\ntcp_keepalives_count = 3\n"
                             "tcp_user_timeout = 3000\nclient_connection_check_interval = 1000\n")
#: Where the suite keeps its instances, so a run killed half-way is cleaned by the next one.
STATE_DIR = pathlib.Path(tempfile.gettempdir()) / "jobq-cluster"


def sh(*cmd: str, check: bool = True, input: str | None = None, user: str | None = None) -> str:
    """Run a command; a failure raises with its output (never a silent skip)."""
    full = (["runuser", "-u", user, "--"] if user else []) + list(cmd)
    p = subprocess.run(full, capture_output=True, text=True, input=input)
    if check and p.returncode:
        raise RuntimeError(f"{' '.join(full)} -> {p.returncode}\n{p.stdout}{p.stderr}")
    return p.stdout


def preflight() -> None:
    """Fail loudly if this machine cannot run the suite (root, iproute2, nftables, PostgreSQL)."""
    missing = [t for t in ("ip", "nft", "runuser") if shutil.which(t) is None]
    if not (PG_BIN / "initdb").exists():
        missing.append(str(PG_BIN / "initdb"))
    if missing:
        raise RuntimeError(f"the cluster suite needs {', '.join(missing)} (.ci/run installs them)")
    if os.geteuid() != 0:
        raise RuntimeError("the cluster suite makes network namespaces: run it as root")


# ---- hosts --------------------------------------------------------------------------------------


class Hosts:
    """``n`` worker hosts: network namespaces on one bridge, each partitionable on its own.

    ``tag`` and ``net`` name a set of its own (namespaces <tag>-h0.., bridge <tag>-br0, veths
    <tag>-v0.., addresses <net>.x): the PostgreSQL and MariaDB suites run side by side."""

    def __init__(self, n: int, tag: str = "jqc", net: str = NET) -> None:
        self.tag, self.net = tag, net
        self.bridge = f"{tag}-br0"
        self.names = [f"{tag}-h{i}" for i in range(n)]

    def addr(self, i: int) -> str:
        return f"{self.net}.{10 + i}"

    def up(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.net}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for i, ns in enumerate(self.names):
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", f"{self.tag}-v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "link", "set", f"{self.tag}-v{i}", "master", self.bridge, "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def partition(self, i: int) -> None:
        """Drop every packet host ``i`` sends or receives (but loopback), inside its namespace."""
        rules = ("table inet jqc_partition {\n"
                 "  chain in { type filter hook input priority -10; policy drop; iif lo accept; }\n"
                 "  chain out { type filter hook output priority -10; policy drop; oif lo accept; }\n}\n")
        sh("ip", "netns", "exec", self.names[i], "nft", "-f", "-", input=rules)

    def heal(self, i: int) -> None:
        sh("ip", "netns", "exec", self.names[i], "nft", "delete", "table", "inet", "jqc_partition")

    def down(self) -> None:
        remove_hosts(self.tag)


def remove_hosts(tag: str = "jqc") -> None:
    """Remove every namespace and the bridge this suite makes (also those of an earlier run)."""
    for ns in sh("ip", "netns", "list").split():
        if ns.startswith(f"{tag}-h"):
            sh("ip", "netns", "del", ns, check=False)  # takes its end of the veth, and so the pair
    sh("ip", "link", "del", f"{tag}-br0", check=False)


# ---- PostgreSQL instances -----------------------------------------------------------------------


class Pg:
    """One PostgreSQL instance of the suite's own, run as the ``postgres`` OS user."""

    def __init__(self, datadir: pathlib.Path, port: int) -> None:
        self.datadir, self.port = datadir, port

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{DBNAME}"

    def _conf(self, extra: str = "") -> None:
        with open(self.datadir / "postgresql.auto.conf", "a") as f:
            f.write(f"port = {self.port}\nlisten_addresses = '127.0.0.1,{SERVER_ADDR}'\n"
                    f"unix_socket_directories = '{self.datadir}'\n" + extra)

    def initdb(self) -> None:
        sh(str(PG_BIN / "initdb"), "-D", str(self.datadir), "-U", "postgres", "-A", "trust", "--no-sync",
           user="postgres")
        self._conf("wal_level = replica\nmax_wal_senders = 5\nhot_standby = on\nmax_connections = 200\n"
                   "fsync = off\nfull_page_writes = on\nshared_buffers = 32MB\nwal_keep_size = 256MB\n"
                   + SERVER_DROPS_DEAD_CLIENTS)
        with open(self.datadir / "pg_hba.conf", "a") as f:
            f.write(f"host all all {NET}.0/24 trust\nhost replication all 127.0.0.1/32 trust\n")

    def start(self) -> None:
        sh(str(PG_BIN / "pg_ctl"), "-D", str(self.datadir), "-l", str(self.datadir / "server.log"), "-w",
           "-t", "60", "start", user="postgres")

    def psql(self, sql: str, db: str = "postgres") -> str:
        return sh(str(PG_BIN / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", db,
                  "-Atqc", sql)

    def basebackup_standby(self, standby: Pg) -> None:
        """Clone this instance into ``standby`` as a streaming hot standby (pg_basebackup -R)."""
        sh(str(PG_BIN / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
           "-D", str(standby.datadir), "-R", "-X", "stream", "-c", "fast", "-d",
           f"application_name=jqc_standby host=127.0.0.1 port={self.port} user=postgres", user="postgres")
        standby._conf()

    def pids(self) -> list[int]:
        """The postmaster and every process it started."""
        pm = int((self.datadir / "postmaster.pid").read_text().split()[0])
        kids = [int(p) for p in sh("ps", "-o", "pid=", "--ppid", str(pm), check=False).split()]
        return [pm, *kids]

    def kill9(self) -> None:
        """The machine dies: SIGKILL the postmaster and all its processes at once."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def promote(self) -> None:
        sh(str(PG_BIN / "pg_ctl"), "-D", str(self.datadir), "-w", "-t", "60", "promote", user="postgres")

    def stop(self) -> None:
        if (self.datadir / "postmaster.pid").exists():
            sh(str(PG_BIN / "pg_ctl"), "-D", str(self.datadir), "-m", "immediate", "-w", "stop",
               user="postgres", check=False)
            if (self.datadir / "postmaster.pid").exists():
                self.kill9()


def remove_instances() -> None:
    """Stop and delete every instance the suite made (also those left by a killed run)."""
    if STATE_DIR.exists():
        for d in sorted(STATE_DIR.glob("*/pg*")):
            if (d / "postmaster.pid").exists():
                Pg(d, 0).stop()
        shutil.rmtree(STATE_DIR, ignore_errors=True)


@contextlib.contextmanager
def instances(standby: bool, sync: bool) -> Iterator[tuple[Pg, Pg | None]]:
    """A fresh primary (and, with ``standby``, a streaming standby), removed afterwards."""
    STATE_DIR.mkdir(exist_ok=True)
    base = pathlib.Path(tempfile.mkdtemp(dir=STATE_DIR))
    shutil.chown(base, "postgres")
    primary = Pg(base / "pg-primary", PRIMARY_PORT)
    second = Pg(base / "pg-standby", STANDBY_PORT) if standby else None
    try:
        primary.initdb()
        primary.start()
        primary.psql(f"CREATE DATABASE {DBNAME}")
        if second is not None:
            primary.basebackup_standby(second)
            second.start()
            wait(lambda: primary.psql("SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
                                      ).strip() == "1", 30, "the standby to stream")
            if sync:  # only now: with no standby yet, every commit would wait for one
                primary.psql("ALTER SYSTEM SET synchronous_standby_names = '*'")
                primary.psql("SELECT pg_reload_conf()")
                wait(lambda: primary.psql("SELECT sync_state FROM pg_stat_replication").strip() == "sync", 30,
                     "the standby to be synchronous")
        yield primary, second
    finally:
        failed = sys.exc_info()[0] is not None
        for pg in (second, primary):
            if pg is not None:
                if failed and (pg.datadir / "server.log").exists():  # the servers' side of a failure
                    tail = (pg.datadir / "server.log").read_text(errors="replace").splitlines()[-15:]
                    print(f"--- {pg.datadir.name} server.log (last lines)", *tail, sep="\n", file=sys.stderr)
                pg.stop()
        shutil.rmtree(base, ignore_errors=True)


def wait(cond, timeout: float, what: str, interval: float = 0.05):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


# ---- worker processes on the hosts ---------------------------------------------------------------


def start_worker(hosts: Hosts, i: int, url: str, logdir: pathlib.Path, *args: str) -> subprocess.Popen:
    """A real worker process inside host ``i``'s namespace (tests/cluster/worker_main.py)."""
    with open(logdir / f"stderr-{hosts.names[i]}.log", "a") as err:
        return subprocess.Popen(
            ["ip", "netns", "exec", hosts.names[i], sys.executable, str(HERE / "worker_main.py"), url, str(logdir),
             "--host", hosts.names[i], *args],
            stdout=subprocess.DEVNULL, stderr=err)


def stop_workers(procs: list[subprocess.Popen], sig: int = signal.SIGKILL) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Sampler:
    """Reads the in-flight count per group from the database, again and again, in one statement
    each (one snapshot), until stopped; errors (a database away) are skipped."""

    def __init__(self, url: str) -> None:
        self.engine = sa.create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": 2})
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        jobs = jobq.Job.__table__
        self._q = sa.select(jobs.c.group_key, sa.func.count()).where(jobs.c.in_flight == sa.true()).group_by(
            jobs.c.group_key)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self.engine.connect() as conn:
                    while not self._stop.is_set():
                        got = {g: n for g, n in conn.execute(self._q)}
                        conn.rollback()
                        self.samples.append((time.monotonic(), got))
                        self._stop.wait(0.005)
            except Exception:  # noqa: BLE001 - the database may be away (failover)
                self._stop.wait(0.1)

    def __enter__(self) -> Sampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(timeout=10)
        self.engine.dispose()

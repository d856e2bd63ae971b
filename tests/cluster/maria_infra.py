"""The cluster suite's MariaDB backend: a primary and a replica of its own, and HAProxy in front.

Everything here is made by the suite and removed by it, also after a failure:
    hosts     network namespaces jqm-h0, jqm-h1, ... on the bridge jqm-br0, 10.231.8.1/24 (a set
              of their own: the PostgreSQL suite's jqc-* may run at the same time)
    mariadb   Debian's mariadbd, datadirs under $TMPDIR/jobq-cluster-mariadb, run as root on
              127.0.0.1 ports 53306 (primary) and 53307 (replica); never the system server on 3306
    haproxy   Debian's haproxy on 10.231.8.1:53300 and 127.0.0.1:53300: the workers' one address.
              Its health check (check_writable.sh) passes only a server that answers
              @@global.read_only = 0, so it follows whichever node was made writable.
Workers in the namespaces reach the database only through HAProxy (the servers listen on 127.0.0.1).
A step that cannot run raises, it never skips.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from infra import sh, wait

MARIADBD = "/usr/sbin/mariadbd"
INSTALL_DB = "/usr/bin/mariadb-install-db"
CLIENT = "/usr/bin/mariadb"
HAPROXY = "/usr/sbin/haproxy"
TAG, NET = "jqm", "10.231.8"
PROXY_ADDR = f"{NET}.1"
PRIMARY_PORT, REPLICA_PORT, PROXY_PORT = 53306, 53307, 53300
DBNAME, USER = "jobq_cluster", "jobq"
STATE_DIR = pathlib.Path(tempfile.gettempdir()) / "jobq-cluster-mariadb"
HERE = pathlib.Path(__file__).resolve().parent

#: Every server's settings (docs/guides/several-hosts.md shows the same).
#: - A host cut off inside a transaction (a claim holding the cap's lock row, a heartbeat between
#:   its UPDATE and COMMIT) keeps its locks until the server ends its session. Through a proxy the
#:   server's TCP peer is the proxy, which stays alive, so TCP keepalives cannot tell:
#:   idle_transaction_timeout ends any session idle inside a transaction for 5 s and rolls it back.
#:   No jobq transaction waits on its client that long (a claim, a heartbeat, a finalize take
#:   milliseconds). Sessions that wait for that lock meanwhile give up after
#:   innodb_lock_wait_timeout (error 1205, which jobq retries), and net_read/write_timeout bound a
#:   statement whose client stops mid-packet.
#: - Replication: binary log in row format with GTIDs, every node able to become the primary.
#:   Semi-synchronous replication (switched on at run time) waits AFTER_SYNC (lossless: a commit
#:   is visible to no one before the replica has it) and never falls back to asynchronous on its
#:   own (rpl_semi_sync_master_timeout of an hour).
#: - innodb_flush_log_at_trx_commit=2: the suite kills the server process, not the machine (the
#:   operating system keeps what was written); production keeps 1.
SERVER_SETTINGS = (
    "--idle-transaction-timeout=5", "--innodb-lock-wait-timeout=3", "--net-read-timeout=5",
    "--net-write-timeout=5",
    "--log-bin=binlog", "--binlog-format=ROW", "--log-slave-updates=ON", "--gtid-strict-mode=ON",
    "--rpl-semi-sync-master-wait-point=AFTER_SYNC", "--rpl-semi-sync-master-timeout=3600000",
    "--skip-name-resolve", "--max-connections=300", "--innodb-buffer-pool-size=32M",
    "--innodb-log-file-size=8M", "--innodb-flush-log-at-trx-commit=2", "--sync-binlog=0",
    "--character-set-server=utf8mb4", "--collation-server=utf8mb4_bin",
)


def preflight() -> None:
    """Fail loudly if this machine cannot run the suite (root, iproute2, nftables, MariaDB, HAProxy)."""
    missing = [t for t in ("ip", "nft") if shutil.which(t) is None]
    missing += [t for t in (MARIADBD, INSTALL_DB, CLIENT, HAPROXY) if not os.path.exists(t)]
    if missing:
        raise RuntimeError(f"the MariaDB cluster suite needs {', '.join(missing)} (.ci/run installs them)")
    if os.geteuid() != 0:
        raise RuntimeError("the cluster suite makes network namespaces: run it as root")


def template() -> pathlib.Path:
    """An empty datadir made once per run (mariadb-install-db); each server starts from a copy."""
    tpl = STATE_DIR / "template"
    if not tpl.exists():
        STATE_DIR.mkdir(exist_ok=True)
        tmp = STATE_DIR / "template.new"
        shutil.rmtree(tmp, ignore_errors=True)
        sh(INSTALL_DB, "--no-defaults", f"--datadir={tmp}", "--user=root", "--auth-root-authentication-method=normal",
           "--skip-test-db", "--innodb-log-file-size=8M")
        tmp.rename(tpl)
    return tpl


class Maria:
    """One mariadbd of the suite's own (run as root, on 127.0.0.1 only)."""

    def __init__(self, base: pathlib.Path, name: str, port: int, server_id: int, read_only: bool) -> None:
        self.dir = base / name
        self.datadir = self.dir / "data"
        self.port, self.server_id, self.read_only = port, server_id, read_only
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Directly to this server, as its administrator (the test's own view)."""
        return f"mariadb+pymysql://root@127.0.0.1:{self.port}/{DBNAME}"

    def start(self) -> None:
        self.dir.mkdir(parents=True)
        shutil.copytree(template(), self.datadir)
        log = open(self.dir / "server.log", "w")  # noqa: SIM115 - the server's for its life
        self.proc = subprocess.Popen(
            [MARIADBD, "--no-defaults", "--user=root", f"--datadir={self.datadir}", f"--port={self.port}",
             "--bind-address=127.0.0.1", f"--socket={self.dir / 'sock'}", f"--pid-file={self.dir / 'mariadb.pid'}",
             f"--server-id={self.server_id}", f"--read-only={'ON' if self.read_only else 'OFF'}", *SERVER_SETTINGS],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        wait(lambda: self.proc is not None and (self.proc.poll() is not None or self._pings()), 60,
             f"mariadbd on port {self.port} to start")
        if self.proc.poll() is not None:
            raise RuntimeError(f"mariadbd on port {self.port} exited\n{self.log_tail()}")

    def _pings(self) -> bool:
        return subprocess.run([CLIENT, "-uroot", f"--socket={self.dir / 'sock'}", "-e", "SELECT 1"],
                              capture_output=True).returncode == 0

    def sql(self, stmt: str) -> str:
        return sh(CLIENT, "-uroot", f"--socket={self.dir / 'sock'}", "-N", "-B", "-e", stmt)

    def status(self, var: str) -> str:
        out = self.sql(f"SHOW GLOBAL STATUS LIKE '{var}'").split()
        return out[1] if len(out) > 1 else ""

    def slave_status(self) -> dict[str, str]:
        out = sh(CLIENT, "-uroot", f"--socket={self.dir / 'sock'}", "-e", "SHOW SLAVE STATUS\\G")
        return {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in out.splitlines()) if _}

    def kill9(self) -> None:
        """The machine dies: SIGKILL the server (one process)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, n: int = 15) -> str:
        p = self.dir / "server.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-n:]) if p.exists() else ""


def replicate(primary: Maria, replica: Maria) -> None:
    """Make ``replica`` follow ``primary`` by GTID from the start (both began from the template)."""
    replica.sql(f"CHANGE MASTER TO MASTER_HOST='127.0.0.1', MASTER_PORT={primary.port}, MASTER_USER='root', "
                "MASTER_CONNECT_RETRY=1, MASTER_USE_GTID=slave_pos")
    replica.sql("START SLAVE")
    wait(lambda: replica.slave_status().get("Slave_IO_Running") == "Yes", 30, "the replica to connect")


def promote(replica: Maria) -> None:
    """What an operator's failover script does once the primary is gone: apply every event the
    replica received (semi-sync acknowledged receipt, not execution), stop replicating, and
    take writes. HAProxy's check then sees read_only = 0 and sends the workers here."""
    def applied() -> bool:
        s = replica.slave_status()
        return (s.get("Slave_SQL_Running_State", "").startswith("Slave has read all relay log")
                or (s.get("Relay_Master_Log_File") == s.get("Master_Log_File")
                    and s.get("Exec_Master_Log_Pos") == s.get("Read_Master_Log_Pos")))
    wait(applied, 60, "the replica to apply its relay log")
    replica.sql("STOP SLAVE")
    replica.sql("RESET SLAVE ALL")
    replica.sql("SET GLOBAL rpl_semi_sync_slave_enabled = OFF")
    replica.sql("SET GLOBAL read_only = OFF")


# ---- HAProxy ------------------------------------------------------------------------------------

#: The health check: a server is up only if it answers and is writable. HAProxy runs it as
#: `check_writable.sh <proxy addr> <proxy port> <server addr> <server port>` every `inter`.
CHECK_SCRIPT = """#!/bin/sh
# Up only if the server answers and takes writes (read_only = 0): HAProxy follows the writable node.
[ "$(mariadb -h "$3" -P "$4" -uroot -N -B --connect-timeout=3 -e 'SELECT @@global.read_only' 2>/dev/null)" = 0 ]
"""

HAPROXY_CFG = """global
    insecure-fork-wanted
    external-check
    pidfile {dir}/haproxy.pid
    stats socket {dir}/haproxy.sock mode 600 level admin

defaults
    mode tcp
    timeout connect 2s
    # Longer than any idle pooled connection: the server's idle_transaction_timeout, not the
    # proxy, ends a session whose host was cut off inside a transaction.
    timeout client 1h
    timeout server 1h
    # A check forks a client: on a loaded machine it can take a second or more. One that times
    # out marks a live primary down and (shutdown-sessions) cuts every session through it.
    timeout check 5s

listen jobq_mariadb
    bind {addr}:{port}
    bind 127.0.0.1:{port}
    option external-check
    external-check path "/usr/bin:/bin"
    external-check command {dir}/check_writable.sh
    # Down after 3 failed checks 300 ms apart (a dead server refuses at once: about a second),
    # up after 2 good ones; a server marked down has its sessions cut, so no worker keeps
    # writing to a node that stopped being the writable one.
    default-server inter 300ms fall 3 rise 2 on-marked-down shutdown-sessions
    server primary 127.0.0.1:{primary} check
    server replica 127.0.0.1:{replica} check
"""


class HAProxy:
    def __init__(self, base: pathlib.Path) -> None:
        self.dir = base / "haproxy"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.dir.mkdir(parents=True)
        check = self.dir / "check_writable.sh"
        check.write_text(CHECK_SCRIPT)
        check.chmod(0o755)
        cfg = self.dir / "haproxy.cfg"
        cfg.write_text(HAPROXY_CFG.format(dir=self.dir, addr=PROXY_ADDR, port=PROXY_PORT, primary=PRIMARY_PORT,
                                          replica=REPLICA_PORT))
        sh(HAPROXY, "-c", "-q", "-f", str(cfg))
        log = open(self.dir / "haproxy.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()

    def states(self) -> dict[str, str]:
        """Each server's state as HAProxy sees it (UP, DOWN, ...), from its stats socket."""
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(self.dir / "haproxy.sock"))
                s.sendall(b"show stat\n")
                out = b""
                while chunk := s.recv(65536):
                    out += chunk
        except OSError:
            return {}
        got = {}
        for line in out.decode().splitlines():
            f = line.split(",")
            if len(f) > 17 and f[0] == "jobq_mariadb" and f[1] in ("primary", "replica"):
                got[f[1]] = f[17]
        return got

    def marked_down(self, server: str) -> int:
        """How many times HAProxy's check has marked ``server`` down (its chkdown counter)."""
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(self.dir / "haproxy.sock"))
                s.sendall(b"show stat\n")
                out = b""
                while chunk := s.recv(65536):
                    out += chunk
        except OSError:
            return -1
        for line in out.decode().splitlines():
            f = line.split(",")
            if len(f) > 22 and f[0] == "jobq_mariadb" and f[1] == server:
                return int(f[22] or 0)
        return -1

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def remove_instances() -> None:
    """Stop every server and proxy the suite started (also those left by a killed run), delete them."""
    if STATE_DIR.exists():
        for pidfile in [*STATE_DIR.glob("*/*/mariadb.pid"), *STATE_DIR.glob("*/*/haproxy.pid")]:
            with contextlib.suppress(ValueError, OSError):
                os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
        shutil.rmtree(STATE_DIR, ignore_errors=True)


@contextlib.contextmanager
def cluster(replica: bool, sync: bool) -> Iterator[tuple[Maria, Maria | None, HAProxy]]:
    """A fresh primary (and with ``replica`` a replica, semi-synchronous with ``sync``) behind
    HAProxy, with the database and the workers' user; removed afterwards."""
    STATE_DIR.mkdir(exist_ok=True)
    base = pathlib.Path(tempfile.mkdtemp(dir=STATE_DIR, prefix="run-"))
    primary = Maria(base, "primary", PRIMARY_PORT, 1, read_only=False)
    second = Maria(base, "replica", REPLICA_PORT, 2, read_only=True) if replica else None
    proxy = HAProxy(base)
    try:
        primary.start()
        if second is not None:
            second.start()
            if sync:
                primary.sql("SET GLOBAL rpl_semi_sync_master_enabled = ON")
                second.sql("SET GLOBAL rpl_semi_sync_slave_enabled = ON")
            replicate(primary, second)
            if sync:
                wait(lambda: primary.status("Rpl_semi_sync_master_clients") == "1"
                     and primary.status("Rpl_semi_sync_master_status") == "ON", 30, "the replica to be semi-synchronous")
        # The workers' user: all rights on jobq's database, none beyond (so read_only binds it).
        primary.sql(f"CREATE DATABASE {DBNAME}; CREATE USER '{USER}'@'%'; "
                    f"GRANT ALL ON {DBNAME}.* TO '{USER}'@'%'")
        if second is not None:
            wait(lambda: second.sql(f"SHOW DATABASES LIKE '{DBNAME}'").strip() == DBNAME, 30,
                 "the database to reach the replica")
        proxy.start()
        want = {"primary": "UP", **({"replica": "DOWN"} if second is not None else {})}
        wait(lambda: proxy.exited() or {k: v for k, v in proxy.states().items() if k in want} == want, 30,
             "HAProxy to mark the primary up (and the read-only replica down)")
        if proxy.exited():
            raise RuntimeError(f"haproxy exited\n{(proxy.dir / 'haproxy.log').read_text()}")
        yield primary, second, proxy
    finally:
        failed = sys.exc_info()[0] is not None
        proxy.stop()
        for m in (second, primary):
            if m is not None:
                if failed:
                    print(f"--- {m.dir.name} server.log (last lines)", m.log_tail(), sep="\n", file=sys.stderr)
                m.kill9()
        shutil.rmtree(base, ignore_errors=True)

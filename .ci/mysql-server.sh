#!/usr/bin/env bash
# Bring up a real Oracle MySQL server on 127.0.0.1:3307 (root, empty password, database `test`).
#
# Why a chroot: this machine has no Docker engine and Debian 12 packages only MariaDB, but
# Debian unstable ships Oracle's server (mysql-server-core). MariaDB accepts SQL that MySQL
# rejects (e.g. LOCK IN SHARE MODE SKIP LOCKED), so only a real MySQL catches those bugs.
#
# Idempotent: reuses a running server, an existing chroot, and an initialised data dir.
# Usage: .ci/mysql-server.sh [start|stop|url]
set -euo pipefail

ROOT=${JOBQ_MYSQL_CHROOT:-/var/lib/jobq-mysql/chroot}
PORT=${JOBQ_MYSQL_PORT:-3307}
DATADIR=/var/lib/mysql-jobq
SOCK=/run/mysqld-jobq/mysqld.sock
URL="mysql+pymysql://root@127.0.0.1:${PORT}/test"

log() { printf '[mysql-server] %s\n' "$*" >&2; }

ping_server() {
  python3 - "$PORT" <<'PY' 2>/dev/null
import socket, sys
s = socket.socket()
s.settimeout(1)
try:
    s.connect(("127.0.0.1", int(sys.argv[1])))
    data = s.recv(64)
    sys.exit(0 if data else 1)
except OSError:
    sys.exit(1)
PY
}

in_root() { chroot "$ROOT" "$@"; }

sql() { mariadb -h127.0.0.1 -P"$PORT" -uroot -N -e "$1"; }

mount_binds() {
  for d in proc dev; do
    mountpoint -q "$ROOT/$d" || mount --bind "/$d" "$ROOT/$d"
  done
}

build_chroot() {
  if [ -x "$ROOT/usr/sbin/mysqld" ]; then return; fi
  log "building a Debian sid chroot with mysql-server-core in $ROOT (about a minute)"
  command -v debootstrap >/dev/null || { apt-get update -qq; apt-get install -y -qq debootstrap >/dev/null; }
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  mkdir -p "$ROOT"
  [ -x "$ROOT/usr/bin/apt-get" ] || debootstrap --variant=minbase sid "$ROOT" "$mirror" >/dev/null
  mount_binds
  # The package mirror here may serve a frozen snapshot whose Release file has expired.
  echo 'Acquire::Check-Valid-Until "false";' > "$ROOT/etc/apt/apt.conf.d/99jobq-no-expiry"
  in_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mysql-server-core >/dev/null
}

start() {
  if ping_server && sql "CREATE DATABASE IF NOT EXISTS test" >/dev/null 2>&1; then
    log "MySQL already answering on port $PORT"; echo "$URL"; return
  fi
  build_chroot
  mount_binds
  in_root sh -c "getent passwd mysql >/dev/null || useradd -r -s /bin/false mysql"
  in_root sh -c "mkdir -p $DATADIR /run/mysqld-jobq && chown mysql:mysql $DATADIR /run/mysqld-jobq"
  if [ ! -d "$ROOT$DATADIR/mysql" ]; then
    log "initialising data directory"
    in_root mysqld --initialize-insecure --user=mysql --datadir="$DATADIR" >/dev/null 2>&1
  fi
  log "starting mysqld on 127.0.0.1:$PORT"
  # setsid + nohup: the server must outlive this script and the shell that ran it.
  setsid nohup chroot "$ROOT" mysqld --user=mysql --datadir="$DATADIR" --port="$PORT" \
    --bind-address=127.0.0.1 --socket="$SOCK" --mysqlx=OFF --secure-file-priv="" \
    --log-error="$DATADIR/error.log" --innodb-flush-log-at-trx-commit=1 \
    >/dev/null 2>&1 < /dev/null &
  for _ in $(seq 1 120); do
    # mysql-server-core ships no client; the host's MariaDB client speaks the protocol.
    if ping_server && sql "CREATE DATABASE IF NOT EXISTS test" >/dev/null 2>&1; then
      log "ready: MySQL $(sql 'SELECT VERSION()')"
      echo "$URL"
      return
    fi
    sleep 0.5
  done
  log "mysqld did not come up; last lines of its log:"
  tail -n 30 "$ROOT$DATADIR/error.log" >&2 || true
  exit 1
}

stop() {
  sql "SHUTDOWN" 2>/dev/null || true
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  url) echo "$URL" ;;
  *) echo "usage: $0 [start|stop|url]" >&2; exit 2 ;;
esac

"""The drivers: one class per engine family (_DRIVERS), on its facts (jobq/engines.py), with the
behaviour that differs: how rows are locked, how a keyed or multi-row insert gets its ids, how a
transaction opens and which errors rerun it, SQLite's lock file and wake-up, PostgreSQL's
wake-ups and planner settings. Then connections and transactions (_prepare, _transaction)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event, orm
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.compiler import compiles

from .base import ConfigError, JobqError, UnsupportedDatabase, _utcnow, logger
from .engines import _BY_FAMILY, _ENGINE_LABELS, _Engine, _facts, _family, _MariaDB, _MySQL, _PostgreSQL, _SQLite
from .fastpath import _await_only, _hot_rowcount, _hot_rows
from .schema import _NAME, _UNIQUE_LIVE_WHERE, _c, _jobs, _signals
from .sql import (
    _Q_INSERT_JOB,
    _Q_NOTIFY,
    _Q_PIN_PLANS,
    _JobsUpdate,
    _pins_ids,
    _prebuilt,
    _q_db_now,
    _q_db_now_notify,
    _q_insert_signal,
    _q_insert_values,
    _q_live_keys,
)

# Each engine is inspected once (_prepare) and described by its family's driver: how to lock
# rows for a claim, which isolation level jobq's transactions use, how to read the database
# clock, and which errors are worth a retry.


@dataclasses.dataclass(frozen=True)
class _Dialect(_Engine):
    """One engine as jobq drives it: the base of the drivers, with the behaviour the families
    share. A family's driver (_SQLiteDriver, ...) is its facts class (jobq/engines.py) with this,
    overriding what it does differently; an instance is one engine at its server version,
    decided once by _prepare (_capabilities)."""

    @property
    def statement_key(self) -> str:
        """What a prebuilt statement may depend on: _prebuilt keeps one per engine family,
        since capabilities are decided per family (and a server version adds none yet)."""
        return self.family

    def lock_skip(self, stmt: sa.Select[Any]) -> sa.Select[Any]:
        """Exclusive row locks that skip rows another transaction holds (the claim read)."""
        # PostgreSQL: FOR NO KEY UPDATE: plain FOR UPDATE would block inserts of job_deps rows
        # whose foreign key references the claimed job. MySQL/MariaDB: exclusive only, since
        # SQLAlchemy renders read=True+skip_locked as "LOCK IN SHARE MODE SKIP LOCKED", which
        # Oracle MySQL rejects (sqlalchemy#10134).
        return stmt.with_for_update(skip_locked=True, key_share=self.key_share_locks)

    def lock_wait(self, stmt: sa.Select[Any], *, via: str | None = None) -> sa.Select[Any]:
        """Exclusive row locks that wait (the cap's serialisation point). Rows named by id are
        read by the primary key, others through the index ``via`` (see index_hints)."""
        if via is None and _pins_ids(stmt.whereclause):
            via = "PRIMARY"
        if via is not None and self.index_hints:
            stmt = stmt.with_hint(_jobs, f"FORCE INDEX ({via})")
        return stmt.with_for_update(key_share=self.key_share_locks)

    def lock_share(self, stmt: sa.Select[Any]) -> sa.Select[Any]:
        """Shared row locks: upstream rows read by enqueue, so a concurrent finalize waits."""
        return stmt.with_for_update(read=True)

    def db_now(self, conn: Connection, *, wake: bool = False) -> _dt.datetime:
        """The database's current time, naive UTC, microsecond precision. With ``wake``, the
        same statement also queues :meth:`notify`'s wake-up (one round trip fewer for an
        enqueue whose jobs are all born ready)."""
        if wake and self._wakes(conn):
            got = _hot_rows(conn, _q_db_now_notify(self), {"b_channel": PG_NOTIFY_CHANNEL})
            self._woken(conn)
        else:
            got = _hot_rows(conn, _q_db_now(self), {})
        if len(got) != 1:
            raise JobqError(f"the database clock's read returned {len(got)} rows")
        value = got[0][0]
        return value if isinstance(value, _dt.datetime) else _dt.datetime.fromisoformat(str(value))

    def pin_index_plans(self, conn: Connection) -> None:
        """PostgreSQL: for the rest of this transaction, plan with indexes only where an index
        exists. Every claim-side query is written for a small partial index, but statistics
        taken at the wrong moment of a high-churn table (e.g. while many jobs were in flight)
        made the planner read the whole table instead, on every tick. Bitmap scans go off too:
        only an index(-only) scan marks the dead entries it meets (every finished job leaves one
        in ix_jobs_in_flight until vacuum), so the next tick's count skips them; a bitmap scan
        visited them all again, every tick (1 ms a tick mid-drain). JIT goes off with it:
        a disabled seq scan is costed so high that JIT compilation (about 100 ms) would start
        on every tick. Once per transaction."""
        if self.pin_wanted(conn):
            conn.execute(_Q_PIN_PLANS)
            self.pinned(conn)

    def pin_wanted(self, conn: Connection) -> bool:
        """This transaction's plans are still to be pinned (pin_index_plans): a claim then
        pins them with its first statement (_q_lock_claim) and calls ``pinned``."""
        if not self.tunable:
            return False
        current = conn.get_transaction()  # None before the first statement begins one
        return current is None or conn.info.get("jobq_pinned") is not current

    def pinned(self, conn: Connection) -> None:
        conn.info["jobq_pinned"] = conn.get_transaction()

    def tune_tables(self, conn: Connection) -> None:
        """Storage settings for a high-churn queue table, set by create_schema (none by default)."""

    def notify(self, conn: Connection) -> None:
        """Wake listening workers when this transaction commits (PostgreSQL only; a rollback
        sends nothing). Polling stays on everywhere, so a lost notification only costs latency."""
        if self._wakes(conn):
            _hot_rows(conn, _Q_NOTIFY, {"b_channel": PG_NOTIFY_CHANNEL})
            self._woken(conn)

    def _wakes(self, conn: Connection) -> bool:
        """A wake-up is still to be queued in this transaction: LISTEN/NOTIFY is on, and this
        (sub)transaction has not queued one yet. PostgreSQL delivers one notification per channel
        and payload per transaction however often it is sent, so a second would only cost a
        round trip; a savepoint rolled back drops its own, and the next one is sent again."""
        if not (self.notify_listen and PG_NOTIFY_CHANNEL):
            return False
        mark = conn.get_nested_transaction() or conn.get_transaction()
        return mark is None or conn.info.get("jobq_woken") is not mark

    def _woken(self, conn: Connection) -> None:
        conn.info["jobq_woken"] = conn.get_nested_transaction() or conn.get_transaction()

    def begin(self, conn: Connection) -> None:
        """Statements that open each jobq transaction (none by default: the isolation level
        goes with BEGIN, as an execution option, unless isolation_stmt)."""

    def live_keys(self, conn: Connection, keys: Sequence[str]) -> dict[str, int]:
        """The unfinished jobs holding these unique keys: key -> id. A locking read: it waits
        for a transaction that inserted one of the keys and reads the latest committed rows,
        whatever the caller's isolation level; the rows stay share-locked (they cannot
        finish) until this transaction ends."""
        stmt = self.lock_share(_q_live_keys(sa.literal_column(self.live_key_column, _NAME), keys))
        return {k: int(i) for k, i in conn.execute(stmt)}

    def insert_unique(self, conn: Connection, row: Mapping[str, Any]) -> int | None:
        """Insert one job row that has a unique_key; None when an unfinished job already holds
        the key (a concurrent transaction committed it after this one looked). Never writes a
        duplicate, and leaves the transaction usable. Here: INSERT ... ON CONFLICT DO NOTHING
        against the partial unique index (on_conflict)."""
        stmt = _prebuilt(self, "insert_unique", lambda: self.on_conflict(_jobs).on_conflict_do_nothing(
            index_elements=[_c.unique_key], index_where=sa.text(_UNIQUE_LIVE_WHERE)).returning(_c.id))
        return conn.execute(stmt, dict(row)).scalar()  # type: ignore[no-any-return]

    def insert_signal_key(self, conn: Connection, key: str, now: _dt.datetime) -> None:
        """Make sure jobq_signals has a row for ``key`` (an awaited-only one, sent_at NULL, if
        none): a concurrent insert of the key is waited for, never duplicated, and the
        transaction stays usable."""
        row = {"key": key, "payload": None, "sent_at": None, "created_at": now}
        if self.on_conflict is not None:
            conn.execute(self.on_conflict(_signals).on_conflict_do_nothing(index_elements=["key"]), row)
            return
        try:
            conn.execute(_q_insert_signal(), row)  # MySQL/MariaDB: a duplicate fails only its statement
        except sa.exc.IntegrityError as exc:
            if getattr(exc.orig, "args", (None,))[0] != 1062:  # ER_DUP_ENTRY
                raise

    def insert_block(self, conn: Connection, rows: Sequence[Mapping[str, Any]]) -> list[int]:
        """Insert job rows and return their ids in order, on an engine without RETURNING (its
        driver gives this; _insert_rows calls it only there)."""
        raise NotImplementedError(f"{type(self).__name__}: an engine without RETURNING needs insert_block")

    def retryable(self, exc: BaseException) -> bool:
        """Errors after which the whole transaction was (or must be) rolled back and may rerun:
        those whose code is one of retry_codes."""
        orig = getattr(exc, "orig", None)
        # psycopg names a SQLSTATE; PyMySQL an errno first in args (and, in recent versions,
        # a SQLSTATE too: 1213 carries '40001', 1205 'HY000'), so look at every code given.
        args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
        codes = {getattr(orig, "sqlstate", None), getattr(orig, "pgcode", None), args[0] if args else None}
        return bool(codes & self.retry_codes)

    # ---- the engine, before and around connections (class-level: decided before a driver exists)

    @classmethod
    def server_version(cls, engine: Engine) -> tuple[int, ...]:
        """The version of the engine behind ``engine``. A server's is known once a connection
        has been made (_server_version)."""
        return _server_version(engine)

    @classmethod
    def install(cls, engine: Engine) -> None:
        """Hooks on a new engine, once, before its first jobq transaction (none by default)."""

    @classmethod
    def listens(cls, engine: Engine) -> bool:
        """Whether Worker(listen=True) can LISTEN through this engine (no by default)."""
        return False

    @classmethod
    def missing_file(cls, engine: Engine) -> str | None:
        """The path of an embedded database file that does not exist yet (a connection there
        would create an empty file: the CLI refuses that for a mistyped path); None by default."""
        return None

    def writer(self, engine: Engine) -> contextlib.AbstractContextManager[None]:
        """What a writing transaction holds around its connection (nothing by default: the
        server's row locks serialise writers)."""
        return _NOTHING_HELD


_NOTHING_HELD = contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class _SQLiteDriver(_SQLite, _Dialect):
    """SQLite: one writer at a time. jobq's writing transactions start with BEGIN IMMEDIATE
    (_install_sqlite_hooks), so no statement locks rows; threads and processes queue for the
    write lock at a Python lock and a lock file (_sqlite_writer) rather than in SQLite's busy
    handler; the clock is this machine's."""

    def lock_skip(self, stmt: sa.Select[Any]) -> sa.Select[Any]:
        return stmt  # BEGIN IMMEDIATE already holds the database's write lock (FOR UPDATE is ignored)

    def lock_wait(self, stmt: sa.Select[Any], *, via: str | None = None) -> sa.Select[Any]:
        return stmt

    def lock_share(self, stmt: sa.Select[Any]) -> sa.Select[Any]:
        return stmt

    def db_now(self, conn: Connection, *, wake: bool = False) -> _dt.datetime:
        return _utcnow()  # embedded: the database's clock is this machine's clock

    def retryable(self, exc: BaseException) -> bool:
        text = str(getattr(exc, "orig", None) or exc).lower()
        return "database is locked" in text or "database is busy" in text or "database table is locked" in text

    @classmethod
    def server_version(cls, engine: Engine) -> tuple[int, ...]:
        """The SQLite library this Python links (pysqlite and aiosqlite use it)."""
        if engine.dialect.driver not in ("pysqlite", "aiosqlite"):
            raise UnsupportedDatabase(f"jobq's SQLite support needs the pysqlite (or aiosqlite) driver, not {engine.dialect.driver!r}")
        import sqlite3

        return tuple(sqlite3.sqlite_version_info)

    @classmethod
    def install(cls, engine: Engine) -> None:
        _install_sqlite_hooks(engine)

    @classmethod
    def missing_file(cls, engine: Engine) -> str | None:
        url = engine.url
        path = url.database
        if path and path != ":memory:" and not path.startswith("file:") and "uri" not in url.query and not os.path.exists(path):
            return path
        return None

    def writer(self, engine: Engine) -> contextlib.AbstractContextManager[None]:
        return _sqlite_writer(engine, self)


@dataclasses.dataclass(frozen=True)
class _PostgreSQLDriver(_PostgreSQL, _Dialect):
    """PostgreSQL: row locks of the key-share strengths, wake-ups by NOTIFY (_Dialect.notify,
    on notify_listen), per-transaction planner settings (pin_index_plans, on tunable)."""

    def tune_tables(self, conn: Connection) -> None:
        """Room on each page for HOT updates (heartbeats and finalizes rewrite rows in place
        when no indexed column changes and the page has space), and autovacuum that starts
        early instead of after 20% of a large table has turned into dead rows."""
        conn.exec_driver_sql(
            "ALTER TABLE jobs SET (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02, "
            "autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_limit = 2000)"
        )

    @classmethod
    def listens(cls, engine: Engine) -> bool:
        """LISTEN needs psycopg (3), whose connections jobq opens itself."""
        return engine.dialect.driver == "psycopg"


@dataclasses.dataclass(frozen=True)
class _MySQLDriver(_MySQL, _Dialect):
    """Oracle MySQL: the isolation level set inside each transaction, a keyed insert that lets
    the unique index refuse a duplicate, a multi-row insert whose ids InnoDB hands out as one
    block."""

    def begin(self, conn: Connection) -> None:
        # For this transaction only, as a statement inside it. The session-level setting
        # (execution_options) is undone by the pool when the connection is checked in, with a
        # round trip outside any error handling: a cut landing between commit and close raised
        # the driver's raw error out of close(), after the commit, and leaked the pool slot.
        conn.exec_driver_sql(f"SET TRANSACTION ISOLATION LEVEL {self.isolation}")

    def insert_unique(self, conn: Connection, row: Mapping[str, Any]) -> int | None:
        """A plain INSERT: a duplicate key fails only this statement (ER_DUP_ENTRY, 1062), and
        the transaction goes on."""
        try:
            return int(conn.execute(_Q_INSERT_JOB, dict(row)).inserted_primary_key[0])  # type: ignore[index]
        except sa.exc.IntegrityError as exc:
            if getattr(exc.orig, "args", (None,))[0] == 1062:
                return None
            raise

    def autoinc_step(self, conn: Connection) -> int:
        """How far apart the ids of one multi-row insert are (auto_increment_increment: 1 unless
        a multi-primary setup such as Galera spaces them)."""
        return int(conn.execute(sa.text("SELECT @@session.auto_increment_increment")).scalar_one())

    def insert_block(self, conn: Connection, rows: Sequence[Mapping[str, Any]]) -> list[int]:
        """Insert job rows and return their ids in order without RETURNING (MySQL): one
        multi-row INSERT per 256 rows instead of a round trip per row. Such an INSERT is a
        "simple insert" (its row count known before it runs), and InnoDB gives a simple insert
        its ids as one block under every innodb_autoinc_lock_mode (2, interleaved, the default
        since 8.0, leaves gaps only inside bulk inserts: INSERT ... SELECT, LOAD DATA): the
        first is LAST_INSERT_ID(), the next ones auto_increment_increment apart."""
        step = self.autoinc_step(conn)
        cols = tuple(rows[0])
        out: list[int] = []
        i = 0
        while i < len(rows):
            # 256 rows a statement, the rest in powers of two: at most 9 statement sizes to compile
            n = 256 if len(rows) - i >= 256 else 1 << ((len(rows) - i).bit_length() - 1)
            params = {f"{c}_{k}": r[c] for k, r in enumerate(rows[i : i + n]) for c in cols}
            res = conn.execute(_q_insert_values(self, cols, n), params)
            if res.rowcount != n or not res.lastrowid:
                raise JobqError(f"a multi-row insert of {n} jobs reported {res.rowcount} rows")
            out += range(res.lastrowid, res.lastrowid + step * n, step)
            i += n
        return out



@dataclasses.dataclass(frozen=True)
class _MariaDBDriver(_MariaDB, _MySQLDriver):
    """MariaDB: driven as MySQL (with RETURNING, so insert_block goes unused)."""


#: Every engine family's driver; _ENGINES (jobq/engines.py) lists their facts in the same order.
_DRIVERS: tuple[type[_Dialect], ...] = (_SQLiteDriver, _PostgreSQLDriver, _MySQLDriver, _MariaDBDriver)
_DRIVER_OF: dict[str, type[_Dialect]] = {d.family: d for d in _DRIVERS}


def _capabilities(family: str, version: tuple[int, ...]) -> _Dialect:
    """The driver of one engine: its family's driver at this server version."""
    return _DRIVER_OF[family]._at(version)  # type: ignore[no-any-return]


def _driver_class(engine: Engine) -> type[_Dialect] | None:
    """The driver of an engine's family, decided without a connection (a mysql+pymysql:// URL
    that will reach MariaDB is driven as MariaDB only once _prepare has connected)."""
    return _DRIVER_OF.get(engine.dialect.name)


@compiles(_JobsUpdate)
def _render_jobs_update(stmt: _JobsUpdate, compiler: Any, **kw: Any) -> str:
    """UPDATE jobs, by the primary key where it names its rows by id and the engine needs the
    hint (_Dialect.index_hints)."""
    sql: str = compiler.visit_update(stmt, **kw)
    if _facts(compiler.dialect).index_hints and _pins_ids(stmt.whereclause):
        head = f"UPDATE {compiler.preparer.format_table(_jobs)} "
        if not sql.startswith(head):
            raise AssertionError(f"jobq: unexpected UPDATE text: {sql[:60]!r}")
        sql = f"{head}FORCE INDEX (PRIMARY) {sql[len(head):]}"
    return sql


#: The lock concurrent create_schema calls queue on: a PostgreSQL advisory lock id ("jobq" in
#: ASCII) and a MySQL/MariaDB GET_LOCK name.


def _listen_supported(engine: Engine) -> bool:
    """Whether Worker(listen=True) can LISTEN through this engine (_Dialect.listens)."""
    cls = _driver_class(engine)
    return cls is not None and cls.notify_listen and cls.listens(engine)


def _missing_database_file(engine: Engine) -> str | None:
    """The path of an embedded database file that does not exist yet, else None: a connection
    there would create an empty file (the CLI refuses that for a mistyped path)."""
    cls = _driver_class(engine)
    return cls.missing_file(engine) if cls is not None else None


def _local_clock(engine: Engine) -> bool:
    """Whether this engine's clock is this machine's (decided without a connection)."""
    cls = _driver_class(engine)
    return cls is not None and cls.local_clock


#: PostgreSQL channel that enqueue, released dependents and reclaims notify; None: no NOTIFY.
PG_NOTIFY_CHANNEL: str | None = "jobq"


def _listener_connection(engine: Engine) -> Any:
    """A dedicated psycopg (3) connection in autocommit, LISTENing on PG_NOTIFY_CHANNEL."""
    if not _listen_supported(engine):
        raise ConfigError("listen=True needs PostgreSQL with the psycopg (3) driver")
    cargs, cparams = engine.dialect.create_connect_args(engine.url)
    cparams = {**cparams, "autocommit": True, "application_name": "jobq-listener"}
    conn = engine.dialect.loaded_dbapi.connect(*cargs, **cparams)
    conn.execute(f'LISTEN "{PG_NOTIFY_CHANNEL}"')
    return conn


_DIALECTS: weakref.WeakKeyDictionary[Engine, _Dialect] = weakref.WeakKeyDictionary()
_DIALECTS_LOCK = threading.Lock()

#: SQLite busy timeout, milliseconds: how long a connection waits for the write lock.
SQLITE_BUSY_TIMEOUT_MS = 30_000


def _install_sqlite_hooks(engine: Engine) -> None:
    # pysqlite's own transaction handling defers BEGIN until the first DML and would never emit
    # BEGIN IMMEDIATE. Per SQLAlchemy's documented recipe, switch the driver to autocommit and
    # emit BEGIN ourselves; jobq's claim transactions ask for BEGIN IMMEDIATE through an
    # execution option, every other transaction gets a plain (deferred) BEGIN.
    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_conn: Any, record: Any, proxy: Any) -> None:
        if dbapi_conn.isolation_level is not None:
            dbapi_conn.isolation_level = None
        if not record.info.get("jobq_pragmas"):
            cur = dbapi_conn.cursor()
            cur.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_MS)}")
            cur.execute("PRAGMA journal_mode = WAL")
            cur.close()
            record.info["jobq_pragmas"] = True

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        opts = conn.get_execution_options()
        if opts.get("isolation_level") == "AUTOCOMMIT":
            return
        # On the cursor, as the hot path's statements (_hot_rowcount: errors wrapped as
        # Connection.execute wraps them, and through it whenever anything watches statements).
        _hot_rowcount(conn, _SQLITE_BEGIN[bool(opts.get("jobq_immediate"))], {})


#: SQLite's transaction starts (_install_sqlite_hooks): deferred, and IMMEDIATE for a write
#: that must hold the write lock from its first read (the claim).
_SQLITE_BEGIN = {False: sa.text("BEGIN"), True: sa.text("BEGIN IMMEDIATE")}


def _check_version(family: str, version: tuple[int, ...]) -> None:
    """Refuse a version of ``family`` older than its driver's min_version."""
    cls = _BY_FAMILY[family]
    if version < cls.min_version:
        found = ".".join(map(str, version)) or "unknown"
        raise UnsupportedDatabase(
            f"{cls.label} {found} found; jobq needs {cls.label} {'.'.join(map(str, cls.min_version))} or newer"
            f"{cls.floor_reason}"
        )


def _server_version(engine: Engine) -> tuple[int, ...]:
    """The server's version, known once a connection has been made. A connection lost while it
    is being made (a cut, a restart) is tried again on a fresh one, as _transaction does before
    anything ran; a server that stays unreachable raises its error."""
    for attempt in range(3):
        try:
            with engine.connect() as conn:
                conn.rollback()
            break
        except sa.exc.DBAPIError:
            if attempt == 2:
                raise
            _pause_for(engine, 0.01 * (attempt + 1))
    return tuple(int(x) for x in (engine.dialect.server_version_info or ()) if isinstance(x, int))


def _prepare(engine: Engine) -> _Dialect:
    """Inspect an engine once: check the server version, install SQLite's transaction hooks."""
    d = _DIALECTS.get(engine)
    if d is not None:
        return d
    named = _driver_class(engine)
    if named is None:
        *most, last = _ENGINE_LABELS.values()
        raise UnsupportedDatabase(f"jobq supports {', '.join(most)} and {last}, not {engine.dialect.name!r}")
    # Connect outside the lock: with an async engine this awaits, and another task of the same
    # event loop may be preparing the same engine. The family is known once connected.
    version = named.server_version(engine)
    cls = _DRIVER_OF[_family(engine.dialect)]
    _check_version(cls.family, version)
    with _DIALECTS_LOCK:
        d = _DIALECTS.get(engine)
        if d is None:
            cls.install(engine)
            d = _DIALECTS[engine] = cls._at(version)
        return d


def _engine_of(target: Engine | Connection | orm.Session) -> Engine:
    if isinstance(target, Engine):
        return target
    if isinstance(target, Connection):
        return target.engine
    if isinstance(target, orm.Session):
        bind = target.get_bind()
        return bind if isinstance(bind, Engine) else bind.engine
    raise TypeError(f"expected an Engine, Connection or Session, got {type(target).__name__}")


_SQLITE_WRITERS: weakref.WeakKeyDictionary[Engine, threading.Lock] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def _sqlite_writer(engine: Engine, d: _Dialect) -> Iterator[None]:
    # Threads of one process queue on a Python lock for SQLite's single write lock: a hand-off
    # there is immediate, while SQLite's busy handler polls with sleeps of up to 100 ms.
    # Processes meet at the lock file (_sqlite_lockfile), then at SQLite's lock (busy_timeout).
    if engine.dialect.is_async:
        # (An event loop must never block on a thread lock: async SQLite engines meet at
        # SQLite's own lock, whose busy handler waits in aiosqlite's thread, not the loop.)
        yield
        return
    lock = _SQLITE_WRITERS.get(engine)
    if lock is None:
        with _DIALECTS_LOCK:
            lock = _SQLITE_WRITERS.setdefault(engine, threading.Lock())
    with lock:
        files = _sqlite_lockfile(engine)
        if files is None:
            yield
            return
        fd, wake = files
        held = _flock(fd, wake)
        try:
            yield
        finally:
            if held:
                import fcntl

                fcntl.flock(fd, fcntl.LOCK_UN)
                if wake is not None:
                    _wake(wake)


def _wake(wake: int) -> None:
    """Tell a process waiting for the lock file (_flock) that it is free: one byte on the pipe."""
    with contextlib.suppress(OSError):  # full (nobody waited for a while): enough said
        os.write(wake, b"\0")


#: Longest a process waits on the wake-up pipe before it tries the lock file again: the bound on
#: a wake-up lost to another waiter (or to a process that shares the file but not the pipe).
_WAKE_POLL_S = 0.002


def _flock(fd: int, wake: int | None) -> bool:
    """Take the lock file. While another process holds it, wait on the wake-up pipe, which
    its holder writes a byte to as it lets go: the kernel wakes the waiter at once, as a
    blocking flock would, and unlike a flock the wait can end at a deadline. (No pipe: poll
    the file every millisecond or two.) After SQLITE_BUSY_TIMEOUT_MS (a holder stopped
    mid-transaction) go on without it: SQLite's own lock and busy timeout still decide, exactly
    as without the file, so a stuck process cannot hang the others here.

    Why a pipe: a worker's tick holds the file a millisecond or two. Polling it from 0.2 ms
    doubling to 2 ms woke a waiting worker up to 1.5 ms after the other let go, mostly to find
    it taken again by that worker's next tick: two processes drained a 64-slot queue no
    faster than one. Polling every 0.1 ms caught the hand-over (1.33x with two processes) but
    cost the holder its CPU with four on two cores (0.94x); a blocking flock did well with
    both (1.24x, 1.11x) but cannot time out; a helper thread blocking in it for the caller
    cost more than it saved (two wake-ups, each waiting for the GIL)."""
    import fcntl
    import select

    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    delay = 0.0002
    poller = None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
        if wake is None:
            time.sleep(delay)
            delay = min(delay * 2, 0.002)
            continue
        if poller is None:  # poll, not select: a descriptor past 1023 is out of select's range
            poller = select.poll()
            poller.register(wake, select.POLLIN)
        # A byte written while nobody waited (or read by another waiter) costs one more turn;
        # a wake-up lost to another waiter costs at most _WAKE_POLL_S.
        if poller.poll(min(left, _WAKE_POLL_S) * 1000):
            with contextlib.suppress(BlockingIOError, InterruptedError):
                os.read(wake, 65536)  # all of it: bytes left from releases nobody waited for


_SQLITE_LOCKFILES: weakref.WeakKeyDictionary[Engine, tuple[int, tuple[int, int | None]]] = weakref.WeakKeyDictionary()


def _sqlite_lockfile(engine: Engine) -> tuple[int, int | None] | None:
    """Processes meet at a file lock next to the database (``<db>-jobq.lock``) before SQLite's
    own, and wait for it on a named pipe beside it (``<db>-jobq.wake``, _wake_pipe): the next
    waiter is woken the moment the holder lets go, where SQLite's busy handler sleeps up to
    100 ms between polls. Only jobq's own transactions take them; POSIX only; an in-memory
    database or an unwritable directory simply goes without (without the pipe: polled).
    Returns the lock file's descriptor and the pipe's (or None); both are closed with the
    engine."""
    path = engine.url.database
    if not path or path == ":memory:" or path.startswith("file:") or os.name != "posix":
        return None
    got = _SQLITE_LOCKFILES.get(engine)
    if got is not None and got[0] == os.getpid():
        return got[1]
    cloexec = getattr(os, "O_CLOEXEC", 0)
    try:  # (re)opened after a fork: a flock is shared by the processes that inherit its file
        fd = os.open(path + "-jobq.lock", os.O_RDWR | os.O_CREAT | cloexec, 0o644)
    except OSError:
        return None
    files = (fd, _wake_pipe(path + "-jobq.wake", cloexec))
    _SQLITE_LOCKFILES[engine] = (os.getpid(), files)
    # Closed when the engine is collected, in this process only, and not at exit, where jobq's
    # daemon threads may still be inside a transaction (a number closed under them could be
    # reused by an exit handler's file: an unlock or a wake-up byte would land there). After a
    # fork the child's copy of this finalizer must not close what the child has reused.
    closer = weakref.finalize(engine, _close_all, os.getpid(), [f for f in files if f is not None])
    closer.atexit = False
    return files


def _wake_pipe(path: str, cloexec: int) -> int | None:
    """The named pipe _flock waits on, made if missing, and opened for reading and writing
    without blocking (as Linux and the BSDs allow a FIFO to be opened). None where it cannot
    be made (a file system without FIFOs), where select.poll is missing, or where what is
    there is not a pipe: a regular file would read as always ready, a busy loop. (Copying the
    database's directory file by file then meets a pipe: tar, rsync -a and cp -r copy it as
    one; shutil.copytree reports it.)"""
    import select
    import stat

    if not hasattr(select, "poll"):
        return None
    with contextlib.suppress(OSError):  # there already (FileExistsError), or cannot be made
        os.mkfifo(path, 0o644)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | cloexec)
    except OSError:
        return None
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _close_all(pid: int, fds: list[int]) -> None:
    if os.getpid() != pid:
        return  # a forked child's copy: these numbers may be the child's own files by now
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


@contextlib.contextmanager
def _schema_guard(engine: Engine, d: _Dialect) -> Iterator[Connection]:
    """One transaction for create_schema's checks, DDL and seeding, serialised against every
    other create_schema on the same database (d.schema_lock; SQLite: BEGIN IMMEDIATE, which
    takes the write lock before the first check)."""
    with d.writer(engine), engine.connect() as conn:
        if not d.row_locks:
            conn.execution_options(jobq_immediate=True)
        lock, unlock = d.schema_lock or (None, None)
        try:
            with conn.begin():
                if lock is not None and conn.exec_driver_sql(lock).scalar() != 1 and unlock is not None:
                    raise JobqError("create_schema: timed out waiting for another process's create_schema")
                yield conn
        finally:
            if unlock is not None and not conn.invalidated:
                conn.exec_driver_sql(unlock)
                conn.commit()


#: How many times a transaction is rerun after a deadlock, lock timeout or SQLITE_BUSY.
TX_RETRIES = 8

_T = TypeVar("_T")


def _pause_for(engine: Engine, seconds: float) -> None:
    """Sleep before a retry; with an async engine (we run inside SQLAlchemy's greenlet bridge)
    yield to the event loop instead of blocking it."""
    if engine.dialect.is_async:
        import asyncio

        _await_only(asyncio.sleep(seconds))
    else:
        time.sleep(seconds)


def _transaction(
    engine: Engine, fn: Callable[[Connection, _Dialect], _T], *, immediate: bool = True, retry: bool = True
) -> _T:
    """Run ``fn(conn, dialect)`` in one jobq transaction, rerunning it whole on transient errors.

    On SQLite the transaction starts with BEGIN IMMEDIATE (``immediate``): jobq's transactions
    read and then write, and a deferred one that read first fails with SQLITE_BUSY_SNAPSHOT
    when another writer commits in between.
    """
    d = _prepare(engine)
    delay = 0.005
    dbapi_error = getattr(engine.dialect.loaded_dbapi, "Error", sa.exc.DBAPIError)
    for attempt in range(TX_RETRIES + 1):
        started = committing = False
        try:
            with d.writer(engine), engine.connect() as conn:
                try:
                    if d.isolation and not d.isolation_stmt:
                        # psycopg and asyncpg keep this on the client and send it with BEGIN,
                        # as does SQLAlchemy's reset when the connection goes back to the pool.
                        conn.execution_options(isolation_level=d.isolation)
                    elif immediate and not d.row_locks:
                        conn.execution_options(jobq_immediate=True)
                except dbapi_error as raw:
                    # A driver that does talk to the server here does so outside SQLAlchemy's
                    # error wrapping; a connection that died in the pool fails here. Drop it
                    # and report it like any other database error.
                    conn.invalidate()
                    raise sa.exc.OperationalError("SET TRANSACTION ISOLATION LEVEL", None, raw) from raw
                started = True
                with conn.begin():
                    d.begin(conn)
                    result = fn(conn, d)
                    committing = True
                return result
        except sa.exc.DBAPIError as exc:
            # Before anything ran, a fresh connection is always safe to try (a few times: a
            # database that is down is the worker's to back off from, not ours). So is a
            # connection lost before COMMIT was sent (a server restart or failover left it dead
            # in the pool): the server rolled the transaction back. A connection lost during
            # COMMIT is not retried: the commit may have landed, and rerunning would do it twice.
            lost = exc.connection_invalidated and not committing
            again = (attempt < 2 if not started
                     else retry and attempt < TX_RETRIES and (lost or d.retryable(exc)))
            if not again:
                raise
            logger.debug("retrying transaction after %s", type(exc.orig).__name__)
            _pause_for(engine, delay * (1 + random.random()))
            delay = min(delay * 2, 0.5)
    raise AssertionError("unreachable")


def _target_connection(target: Connection | orm.Session) -> Connection:
    return target.connection() if isinstance(target, orm.Session) else target

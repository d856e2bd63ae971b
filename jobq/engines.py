"""The engine families jobq runs on and their facts: which one a SQLAlchemy dialect is, what
each can do (_Engine), and the column types that differ between them. The only module, with the
drivers built on it, that names an engine."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql as _mysql
from sqlalchemy.dialects import postgresql as _pg
from sqlalchemy.dialects import sqlite as _sqlite

_MIN_VERSIONS = {"postgresql": (12,), "mysql": (8, 0, 1), "mariadb": (10, 6)}
#: Every engine family jobq runs on, as its messages name it.
_ENGINE_LABELS = {"sqlite": "SQLite", "postgresql": "PostgreSQL", "mysql": "MySQL", "mariadb": "MariaDB"}

_SCHEMA_LOCK_ID = 0x6A6F6271
_SCHEMA_LOCK_NAME = "jobq_schema"


@dataclasses.dataclass(frozen=True)
class _Engine:
    """What jobq needs to know about one engine family, as facts: runtime code asks a question
    (``d.returning``) instead of testing a name. The drivers' _Dialect adds the behaviour on top;
    the schema and the statements' compile hooks ask these facts directly (_facts)."""

    family: str  # "postgresql" | "mysql" | "mariadb" | "sqlite": for messages and cache keys only
    version: tuple[int, ...]
    #: INSERT ... RETURNING (Oracle MySQL has none: see insert_block).
    returning: bool = True
    #: CREATE INDEX ... WHERE (PostgreSQL, SQLite); the others index every row.
    partial_indexes: bool = False
    #: One bound array for ``IN`` (``= ANY(:ids)``): the same SQL text for any number of ids.
    array_params: bool = False
    #: One bound JSON array for ``IN`` (``IN (SELECT value FROM json_each(:ids))``, SQLite's
    #: built-in JSON functions): the same SQL text for any number of ids, compiled and
    #: prepared once, where an expanding IN list is rendered anew on every call.
    json_id_lists: bool = False
    #: The driver interpolates parameters into the SQL text itself (PyMySQL, mysqlclient,
    #: aiomysql: no server-side binding), so a hot statement's expanding IN list of ints is rendered as the
    #: literals the driver would send (_Direct.int_lists), byte for byte the same statement,
    #: without SQLAlchemy's per-element expansion and the driver's per-element escaping.
    literal_int_lists: bool = False
    #: Data-modifying statements inside WITH (PostgreSQL): a batch's finish, its history rows
    #: and its dependents count go to the server as one statement, one round trip.
    dml_ctes: bool = False
    #: LISTEN/NOTIFY (PostgreSQL).
    notify_listen: bool = False
    #: The database's clock is this machine's clock (embedded SQLite).
    local_clock: bool = False
    #: Row locks exist: FOR UPDATE [SKIP LOCKED] (servers). SQLite serialises writers instead,
    #: with BEGIN IMMEDIATE, and silently ignores FOR UPDATE.
    row_locks: bool = True
    #: PostgreSQL's FOR NO KEY UPDATE / FOR KEY SHARE lock strengths.
    key_share_locks: bool = False
    #: Isolation level of jobq's transactions (None: the engine's own, serialisable SQLite).
    isolation: str | None = "READ COMMITTED"
    #: Set the isolation level with a statement inside each transaction (MySQL/MariaDB) rather
    #: than as a client-side execution option sent with BEGIN (psycopg, asyncpg).
    isolation_stmt: bool = False
    #: SQL that reads the database clock as naive UTC (None: read this machine's clock).
    now_sql: str | None = None
    #: Driver error codes after which the whole transaction is rolled back and may rerun.
    retry_codes: frozenset[Any] = frozenset()
    #: Per-transaction planner settings and table storage settings (PostgreSQL).
    tunable: bool = False
    #: Deepest JSON nesting the engine stores (MariaDB's JSON_VALID stops at 32 levels).
    json_max_depth: int | None = None
    #: How long a name column may be compared exactly (MySQL/MariaDB compare with PAD SPACE).
    pad_space: bool = False
    #: Without AUTOINCREMENT the primary key hands out the largest id + 1 again (SQLite), so
    #: an old jobs table is rebuilt by _upgrade.
    rowid_reuse: bool = False
    #: (lock, unlock) statements that serialise create_schema across processes: a transaction
    #: advisory lock (PostgreSQL, no unlock), a named session lock (MySQL/MariaDB: their DDL
    #: commits implicitly, so the lock must outlive transactions). None: BEGIN IMMEDIATE (SQLite).
    schema_lock: tuple[str, str | None] | None = None
    #: An optimizer hint for the recursive skip scan over groups (Oracle MySQL stops recursion
    #: at cte_max_recursion_depth, 1,000 by default: one level per group with ready work).
    recursion_hint: str = ""
    #: A statement prefix that lifts the recursion limit for one statement, where the engine
    #: has no hint for it (MariaDB: max_recursive_iterations, 1,000 by default): the walks
    #: down a graph (_q_downstream) recurse once per link of a chain.
    recursion_prefix: str = ""
    #: The join that keeps the written order of its tables (MySQL/MariaDB: STRAIGHT_JOIN). In
    #: a recursive CTE's step MySQL joined every unstarted job to the step's new rows by hash,
    #: not the new rows to their edges by index: 0.8 s against 15 ms for a 1,000-job fan-out.
    ordered_join: str = "JOIN"
    #: Join a recursive walk's rows to their edges with LATERAL (PostgreSQL). Before autovacuum
    #: first analyses job_deps the planner guesses thousands of edges per job, and scanned all
    #: of job_deps at every step of the walk instead of looking up each row's few: 32 s to fail
    #: the head of a 2,000-job chain beside 20,000 other jobs, against 15 ms this way.
    lateral_edges: bool = False
    #: Each level of a recursive CTE costs about 0.25 ms (MySQL/MariaDB, 16 ms for a window of
    #: 64 groups): the claim's group scan first reads the next few hundred ready-index entries
    #: (_q_ready_groups_ranged_read) and recurses only past groups too big for that read.
    ranged_group_scan: bool = False
    #: A claim from the first group reads the first and the last group with ready work before
    #: scanning groups (_Q_READY_GROUP_SPAN, or with its in-flight counts: _Q_SLOTS_AND_SPAN).
    #: A scan is 0.4 ms on PostgreSQL and 1.3 ms on MariaDB, against nothing when one group has
    #: all the ready work, the common case. On SQLite, where a statement is no round trip, the
    #: span costs 7 µs inside the counts' statement and the scan 40 µs a claim.
    span_first: bool = False
    #: A compound SELECT may LIMIT its parenthesised terms (not SQLite).
    compound_limits: bool = True
    #: The ready index, named for the window read's compound terms and one group's candidates
    #: (MySQL/MariaDB): in a UNION term MariaDB dropped the ORDER BY ... LIMIT index choice and
    #: sorted a big group's whole ready set (tests/core/test_priority.py catches it); and the
    #: due index (state, run_after) looks cheaper to them whenever few jobs are due.
    ready_index_hint: str = ""
    #: FORCE INDEX for statements that lock or rewrite rows they name (MySQL/MariaDB). InnoDB
    #: waits for the lock on every row such a statement examines, matching or not (its
    #: semi-consistent read, which skips a locked row that does not match, works only on a
    #: primary key scan). An ``UPDATE ... WHERE id IN (5 ids) AND state = 'waiting'`` planned
    #: through the ready index, as both engines plan it once few rows are waiting, read every
    #: waiting job and waited for any that another transaction held: a cancel or a finalize
    #: elsewhere in the graph. Such statements go by the primary key (or by the index that
    #: names their rows, cancel's walk by parent) and wait only for the rows they name.
    index_hints: bool = False
    #: LATERAL joins over unnest() of a bound array (PostgreSQL): the claim's window read is
    #: one statement of fixed text (_q_window_lateral) instead of a UNION per window size.
    lateral_arrays: bool = False
    #: The claim's group scan reads its groups' candidates in the same statement
    #: (_q_ready_groups_read; PostgreSQL, SQLite with json_id_lists): one statement fewer per
    #: claim over many groups. Not MySQL/MariaDB: their scan is a range read (ranged_group_scan).
    scan_reads_window: bool = False
    #: The column that holds a job's unique_key while it is unfinished, NULL after: the key
    #: itself under a partial unique index, or MySQL/MariaDB's generated unique_live.
    live_key_column: str = "unique_key"
    #: jobs.parent_id references jobs.id with a foreign key. Not on Oracle MySQL: it checks
    #: the key on every UPDATE of a jobs row, parent_id changed or not (measured on 9.7: a
    #: claim's lease of 64 rows 9.0 ms with it, 3.4 ms without; MariaDB 1.7 ms either way),
    #: and every claim, heartbeat and finish updates jobs rows. _upgrade drops an existing one.
    parent_fk: bool = True
    #: The dialect's INSERT construct with ON CONFLICT DO NOTHING (PostgreSQL, SQLite), for
    #: keyed inserts against the partial unique index. None (MySQL/MariaDB): a duplicate key
    #: fails only its INSERT statement (1062), and the transaction goes on.
    on_conflict: Any = None

    @property
    def generated_live_key(self) -> bool:
        """Whether unique keys are held by a generated column (unique_live) under a plain unique
        index, for engines without partial indexes."""
        return self.live_key_column == "unique_live"


def _family(dialect: sa.Dialect) -> str:
    """The engine family of a SQLAlchemy dialect (one that has connected): mysql+pymysql://
    URLs that reach a MariaDB server report "mysql" with is_mariadb."""
    return "mariadb" if dialect.name == "mariadb" or getattr(dialect, "is_mariadb", False) else dialect.name


def _engine_facts(family: str, version: tuple[int, ...]) -> dict[str, Any]:
    """One row per engine family: every fact jobq branches on is decided here (the fields
    of _Engine that differ from their defaults). Adding an engine is one more row."""
    if family == "postgresql":
        return dict(partial_indexes=True, array_params=True, dml_ctes=True, notify_listen=True,
                        on_conflict=_pg.insert, key_share_locks=True, lateral_arrays=True, scan_reads_window=True,
                        now_sql="SELECT clock_timestamp() AT TIME ZONE 'UTC'",
                        # serialization failure, deadlock, lock_not_available
                        retry_codes=frozenset({"40001", "40P01", "55P03"}), tunable=True, span_first=True, lateral_edges=True,
                        schema_lock=(f"SELECT pg_advisory_xact_lock({_SCHEMA_LOCK_ID})", None))
    if family in ("mysql", "mariadb"):
        # 1213 deadlock (InnoDB rolled back the transaction), 1205 lock wait timeout (only the
        # statement was rolled back: _transaction rolls back the rest before retrying).
        # MariaDB's own limit (max_recursive_iterations) is 1,000 by default and it has no
        # SET_VAR: the claim's scans ask for at most 501 groups each (_GroupScan).
        return dict(returning=family == "mariadb", isolation_stmt=True,
                        now_sql="SELECT UTC_TIMESTAMP(6)", retry_codes=frozenset({1213, 1205}),
                        json_max_depth=32 if family == "mariadb" else None, pad_space=True,
                        schema_lock=(f"SELECT GET_LOCK('{_SCHEMA_LOCK_NAME}', 600)",
                                     f"SELECT RELEASE_LOCK('{_SCHEMA_LOCK_NAME}')"),
                        recursion_hint="" if family == "mariadb" else
                        "/*+ SET_VAR(cte_max_recursion_depth = 4294967295) */ ",
                        recursion_prefix="SET STATEMENT max_recursive_iterations = 4294967295 FOR "
                        if family == "mariadb" else "", ordered_join="STRAIGHT_JOIN",
                        live_key_column="unique_live", ranged_group_scan=True,
                        ready_index_hint="FORCE INDEX (ix_jobs_ready_my)", parent_fk=family == "mariadb",
                        index_hints=True, literal_int_lists=True, span_first=True)
    # SQLite: one writer at a time (BEGIN IMMEDIATE), serialisable, this machine's clock.
    return dict(partial_indexes=True, local_clock=True, row_locks=False, isolation=None,
                    rowid_reuse=True, on_conflict=_sqlite.insert, compound_limits=False,
                    json_id_lists=version >= (3, 38), scan_reads_window=version >= (3, 38), span_first=True)


@functools.cache
def _family_facts(family: str) -> _Engine:
    """The facts of a family that no server version changes (for DDL and compile hooks)."""
    return _Engine(family, (), **_engine_facts(family, ()))


def _facts(dialect: sa.Dialect) -> _Engine:
    """The facts of the engine family a SQLAlchemy dialect speaks to."""
    return _family_facts(_family(dialect))


def _when(fact: str) -> Any:
    """A ``ddl_if``/``execute_if`` callable: create the object on engines where ``fact`` holds."""
    return lambda *a, dialect, **kw: bool(getattr(_facts(dialect), fact))


#: Column types: the same column as each engine stores it best.
_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_TS = sa.DateTime().with_variant(_mysql.DATETIME(fsp=6), "mysql", "mariadb")
# utf8mb4_bin: names compare case- and accent-sensitively on MySQL/MariaDB, as elsewhere.
_NAME = sa.String(200).with_variant(
    _mysql.VARCHAR(200, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
)
_JSONCOL = sa.JSON().with_variant(_pg.JSONB(), "postgresql")
_TEXT = sa.Text().with_variant(_mysql.MEDIUMTEXT(), "mysql", "mariadb")

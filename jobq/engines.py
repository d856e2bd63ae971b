"""The engine families jobq runs on, one class each: what the engine is (its label, the oldest
version jobq supports, its facts, the column types and table options it stores best). The
drivers (jobq/drivers.py) subclass these with how jobq drives each one; the schema and the
statements' compile hooks ask these classes (_ENGINES), never an engine's name. With the
drivers, the only module that names an engine."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.dialects import mysql as _mysql
from sqlalchemy.dialects import postgresql as _pg
from sqlalchemy.dialects import sqlite as _sqlite

_SCHEMA_LOCK_ID = 0x6A6F6271
_SCHEMA_LOCK_NAME = "jobq_schema"


@dataclasses.dataclass(frozen=True)
class _Engine:
    """What jobq needs to know about one engine family, as facts: runtime code asks a question
    (``d.returning``) instead of testing a name. Each family is a subclass (_SQLite, ...) that
    overrides the facts that differ from these defaults, as annotated fields; its driver
    (jobq/drivers.py) adds the behaviour; the schema and the statements' compile hooks ask the
    facts directly (_facts). An instance is one engine at one server version (_at)."""

    #: The SQLAlchemy dialect's name, which names the family in cache keys and dialect options.
    family: str = ""
    version: tuple[int, ...] = ()
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

    #: How jobq's messages name the family.
    label: ClassVar[str] = ""
    #: The oldest version jobq runs on, and why (said when an older one is found).
    min_version: ClassVar[tuple[int, ...]] = ()
    floor_reason: ClassVar[str] = " (for FOR UPDATE SKIP LOCKED)"
    #: Column types stored differently from the portable ones, by role ("id", "ts", "name",
    #: "json", "text": the columns _column_type builds).
    column_types: ClassVar[Mapping[str, Any]] = {}
    #: Table options every jobq table carries (the dialect's own keywords, without its prefix).
    table_options: ClassVar[Mapping[str, Any]] = {}
    #: How a partial index predicate spells a true boolean (``{true}`` in _where_options): as the
    #: engine renders ``col == true()``, which its planner must match term for term.
    true_sql: ClassVar[str] = "true"
    #: URL schemes a user may write for this family, and the URL (with the driver jobq's extra
    #: installs) and the extra that the CLI suggests when SQLAlchemy cannot load the scheme.
    url_schemes: ClassVar[tuple[str, ...]] = ()
    url_hint: ClassVar[tuple[str, str] | None] = None

    def __init_subclass__(cls, **kw: Any) -> None:
        # A fact set without its annotation would stay the base's default (the dataclass field
        # of _Engine, not this class attribute, sets the instance's value): refuse it.
        super().__init_subclass__(**kw)
        declared = vars(cls).get("__annotations__", {})
        inherited = {n for base in cls.__mro__[1:] for n in vars(base).get("__dataclass_fields__", {})}
        unannotated = sorted(n for n in vars(cls) if n in inherited and n not in declared)
        if unannotated:
            raise TypeError(f"{cls.__name__}: annotate the facts {unannotated} (as _Engine declares them)")

    @classmethod
    def _at(cls, version: tuple[int, ...]) -> Any:
        """This family at a server version (the facts a version decides: _version_facts)."""
        return cls(version=version, **cls._version_facts(version))

    @classmethod
    def _version_facts(cls, version: tuple[int, ...]) -> dict[str, Any]:
        """The facts that depend on the server's version (none unless a family says so)."""
        return {}

    @property
    def generated_live_key(self) -> bool:
        """Whether unique keys are held by a generated column (unique_live) under a plain unique
        index, for engines without partial indexes."""
        return self.live_key_column == "unique_live"



@dataclasses.dataclass(frozen=True)
class _SQLite(_Engine):
    """Embedded: one writer at a time (BEGIN IMMEDIATE), serialisable, this machine's clock."""

    family: str = "sqlite"
    partial_indexes: bool = True
    local_clock: bool = True
    row_locks: bool = False
    isolation: str | None = None
    rowid_reuse: bool = True
    on_conflict: Any = _sqlite.insert
    compound_limits: bool = False
    span_first: bool = True
    label: ClassVar[str] = "SQLite"
    min_version: ClassVar[tuple[int, ...]] = (3, 25)
    floor_reason: ClassVar[str] = ""
    column_types: ClassVar[Mapping[str, Any]] = {"id": sa.Integer()}
    true_sql: ClassVar[str] = "1"

    @classmethod
    def _version_facts(cls, version: tuple[int, ...]) -> dict[str, Any]:
        # json_each() and the -> operators: SQLite 3.38
        return dict(json_id_lists=version >= (3, 38), scan_reads_window=version >= (3, 38))


@dataclasses.dataclass(frozen=True)
class _PostgreSQL(_Engine):
    family: str = "postgresql"
    partial_indexes: bool = True
    array_params: bool = True
    dml_ctes: bool = True
    notify_listen: bool = True
    on_conflict: Any = _pg.insert
    key_share_locks: bool = True
    lateral_arrays: bool = True
    scan_reads_window: bool = True
    now_sql: str | None = "SELECT clock_timestamp() AT TIME ZONE 'UTC'"
    # serialization failure, deadlock, lock_not_available
    retry_codes: frozenset[Any] = frozenset({"40001", "40P01", "55P03"})
    tunable: bool = True
    span_first: bool = True
    lateral_edges: bool = True
    schema_lock: tuple[str, str | None] | None = (f"SELECT pg_advisory_xact_lock({_SCHEMA_LOCK_ID})", None)
    label: ClassVar[str] = "PostgreSQL"
    min_version: ClassVar[tuple[int, ...]] = (12,)
    column_types: ClassVar[Mapping[str, Any]] = {"json": _pg.JSONB()}
    url_schemes: ClassVar[tuple[str, ...]] = ("postgres", "postgresql")
    url_hint: ClassVar[tuple[str, str] | None] = ("postgresql+psycopg", "postgres")


@dataclasses.dataclass(frozen=True)
class _MySQL(_Engine):
    """Oracle MySQL 8+: no RETURNING, no partial indexes (plain composite stand-ins, named by
    hints), DDL that commits implicitly."""

    family: str = "mysql"
    returning: bool = False
    isolation_stmt: bool = True
    now_sql: str | None = "SELECT UTC_TIMESTAMP(6)"
    # 1213 deadlock (InnoDB rolled back the transaction), 1205 lock wait timeout (only the
    # statement was rolled back: _transaction rolls back the rest before retrying).
    retry_codes: frozenset[Any] = frozenset({1213, 1205})
    pad_space: bool = True
    schema_lock: tuple[str, str | None] | None = (f"SELECT GET_LOCK('{_SCHEMA_LOCK_NAME}', 600)",
                                                  f"SELECT RELEASE_LOCK('{_SCHEMA_LOCK_NAME}')")
    recursion_hint: str = "/*+ SET_VAR(cte_max_recursion_depth = 4294967295) */ "
    ordered_join: str = "STRAIGHT_JOIN"
    live_key_column: str = "unique_live"
    ranged_group_scan: bool = True
    ready_index_hint: str = "FORCE INDEX (ix_jobs_ready_my)"
    parent_fk: bool = False
    index_hints: bool = True
    literal_int_lists: bool = True
    span_first: bool = True
    label: ClassVar[str] = "MySQL"
    min_version: ClassVar[tuple[int, ...]] = (8, 0, 1)
    # utf8mb4_bin: names compare case- and accent-sensitively, as elsewhere.
    column_types: ClassVar[Mapping[str, Any]] = {
        "ts": _mysql.DATETIME(fsp=6),
        "name": _mysql.VARCHAR(200, charset="utf8mb4", collation="utf8mb4_bin"),
        "text": _mysql.MEDIUMTEXT(),
    }
    table_options: ClassVar[Mapping[str, Any]] = {"engine": "InnoDB"}
    url_schemes: ClassVar[tuple[str, ...]] = ("mysql",)
    url_hint: ClassVar[tuple[str, str] | None] = ("mysql+pymysql", "mysql")


@dataclasses.dataclass(frozen=True)
class _MariaDB(_MySQL):
    """MariaDB 10.6+: MySQL's facts, with RETURNING, the parent foreign key, and its own
    recursion limit (max_recursive_iterations, 1,000 by default, and no SET_VAR: the claim's
    scans ask for at most 501 groups each, _GroupScan)."""

    family: str = "mariadb"
    returning: bool = True
    json_max_depth: int | None = 32
    recursion_hint: str = ""
    recursion_prefix: str = "SET STATEMENT max_recursive_iterations = 4294967295 FOR "
    parent_fk: bool = True
    label: ClassVar[str] = "MariaDB"
    min_version: ClassVar[tuple[int, ...]] = (10, 6)
    url_schemes: ClassVar[tuple[str, ...]] = ("mariadb",)
    url_hint: ClassVar[tuple[str, str] | None] = ("mariadb+pymysql", "mysql")


#: Every engine family jobq runs on, in the order messages list them. Adding an engine is a
#: class above and its driver (jobq/drivers.py, _DRIVERS).
_ENGINES: tuple[type[_Engine], ...] = (_SQLite, _PostgreSQL, _MySQL, _MariaDB)
_BY_FAMILY: dict[str, type[_Engine]] = {e.family: e for e in _ENGINES}
#: The oldest version of each family, and its label (derived: kept for the docs and tests).
_MIN_VERSIONS = {e.family: e.min_version for e in _ENGINES}
_ENGINE_LABELS = {e.family: e.label for e in _ENGINES}


def _family(dialect: sa.Dialect) -> str:
    """The engine family of a SQLAlchemy dialect (one that has connected): mysql+pymysql://
    URLs that reach a MariaDB server report "mysql" with is_mariadb."""
    return "mariadb" if dialect.name == "mariadb" or getattr(dialect, "is_mariadb", False) else dialect.name


@functools.cache
def _family_facts(family: str) -> _Engine:
    """The facts of a family that no server version changes (for DDL and compile hooks); an
    engine jobq does not know (SQLAlchemy's default dialect, for str(stmt)) has the defaults."""
    cls = _BY_FAMILY.get(family)
    return cls._at(()) if cls is not None else _Engine(family)


def _facts(dialect: sa.Dialect) -> _Engine:
    """The facts of the engine family a SQLAlchemy dialect speaks to."""
    return _family_facts(_family(dialect))


def _when(fact: str) -> Any:
    """A ``ddl_if``/``execute_if`` callable: create the object on engines where ``fact`` holds."""
    return lambda *a, dialect, **kw: bool(getattr(_facts(dialect), fact))


def _column_type(role: str, portable: Any) -> Any:
    """``portable``, with each family's own type for ``role`` (column_types) as its variant."""
    names: dict[int, tuple[Any, list[str]]] = {}
    for e in _ENGINES:
        if role in e.column_types:
            names.setdefault(id(e.column_types[role]), (e.column_types[role], []))[1].append(e.family)
    for own, families in names.values():
        portable = portable.with_variant(own, *families)
    return portable


def _table_options(*, never_reuse_ids: bool = False) -> dict[str, Any]:
    """The dialect options of a jobq table; ``never_reuse_ids``: ids are never handed out twice,
    on the families whose primary key would (rowid_reuse: SQLite's AUTOINCREMENT)."""
    out = {f"{e.family}_{k}": v for e in _ENGINES for k, v in e.table_options.items()}
    if never_reuse_ids:
        out |= {f"{e.family}_autoincrement": True for e in _ENGINES if e.rowid_reuse}
    return out


def _where_options(where: str) -> dict[str, str]:
    """The dialect options of a partial index of the rows matching ``where`` (``{true}``: the
    family's true_sql), for each family with partial indexes: option -> predicate."""
    return {f"{e.family}_where": where.replace("{true}", e.true_sql) for e in _ENGINES if e.partial_indexes}


def _scheme_hint(scheme: str) -> tuple[str, str] | None:
    """The URL and extra the CLI suggests for a URL scheme SQLAlchemy cannot load."""
    return next((e.url_hint for e in _ENGINES if scheme in e.url_schemes), None)


#: Column types: the same column as each engine stores it best.
_ID = _column_type("id", sa.BigInteger())
_TS = _column_type("ts", sa.DateTime())
_NAME = _column_type("name", sa.String(200))
_JSONCOL = _column_type("json", sa.JSON())
_TEXT = _column_type("text", sa.Text())

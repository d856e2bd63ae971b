"""The schema version and the upgrade steps from earlier versions, run by create_schema."""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .base import JobqError, logger
from .drivers import _Dialect
from .schema import _DDL_UNIQUE_LIVE, _JSONCOL, _NAME, SCHEMA_VERSION, _jobs, _meta

# ---- schema version and upgrades --------------------------------------------------------------
# create_schema (queue API) creates what is missing, seeds jobq_meta with these statements and
# calls _upgrade, all in one transaction serialised by the dialect's _schema_guard.

_Q_META_ROWS = sa.select(_meta.c.key, _meta.c.value)
_Q_SEED_META = sa.insert(_meta)
_Q_SET_SCHEMA_VERSION = (
    sa.update(_meta).where(_meta.c.key == "schema_version").values(value=sa.bindparam("b_value", type_=sa.String(200)))
)
_DDL_STARTS_N = sa.DDL("ALTER TABLE jobq_starts ADD COLUMN n INTEGER DEFAULT 1 NOT NULL")
_DDL_DROP_STATE_FINISHED = sa.DDL("DROP INDEX ix_jobs_state_finished")
_DDL_DROP_PARENT_INDEX = sa.DDL("DROP INDEX ix_jobs_parent")  # PostgreSQL/SQLite (_rekey_parent_index)
_DDL_CLOSED_BY = sa.DDL("ALTER TABLE jobs ADD COLUMN closed_by BIGINT")
_DDL_PRIORITY = sa.DDL("ALTER TABLE jobs ADD COLUMN priority INTEGER DEFAULT 0 NOT NULL")
_DDL_SPAWNED_BY = sa.DDL("ALTER TABLE jobs ADD COLUMN spawned_by BIGINT")
_DDL_SPAWN_TOKEN = sa.DDL("ALTER TABLE jobs ADD COLUMN spawn_token VARCHAR(32)")
_DDL_TRACE_PARENT = sa.DDL("ALTER TABLE jobs ADD COLUMN trace_parent VARCHAR(64)")
_Q_SQLITE_JOBS_SQL = sa.text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'jobs'")
_Q_SQLITE_OLD_INDEXES = sa.text(
    "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'jobq_jobs_old' AND sql IS NOT NULL"
)


def _upgrade(conn: Connection, d: _Dialect, found: int) -> None:
    """Bring a database created by an earlier jobq up to SCHEMA_VERSION: run each step of
    _MIGRATIONS numbered above ``found`` once, in order, recording its number in jobq_meta
    after it. A database at SCHEMA_VERSION runs none of them (nothing is inspected). Each step
    adds only what is missing, so a crash between a step and its record (MySQL/MariaDB commit
    each DDL statement) reruns it safely."""
    if found > SCHEMA_VERSION:
        raise JobqError(
            f"the database has jobq schema version {found}, newer than this jobq.py ({SCHEMA_VERSION}): "
            "upgrade the vendored jobq.py"
        )
    for version, step, _what in _MIGRATIONS:
        if version > found:
            step(conn, d)
            conn.execute(_Q_SET_SCHEMA_VERSION, {"b_value": str(version)})
            logger.info("jobq schema upgraded to version %d: %s", version, _what)


def _step_2(conn: Connection, d: _Dialect) -> None:
    """1 -> 2: jobq_starts counts the jobs of one claim per row (one row per group per claim
    instead of one per job); finished rows get a partial index of their own instead of a
    (state, finished_at) index that every claim wrote to; waiting rows get one for stats().
    (MySQL/MariaDB keep theirs until _rekey_mysql_indexes, step 5.)"""
    inspector = sa.inspect(conn)
    if "n" not in {c["name"] for c in inspector.get_columns("jobq_starts")}:
        conn.execute(_DDL_STARTS_N)
    if d.partial_indexes:
        names = {i["name"] for i in inspector.get_indexes("jobs")}
        if "ix_jobs_state_finished" in names:
            conn.execute(_DDL_DROP_STATE_FINISHED)
        for name in ("ix_jobs_finished", "ix_jobs_waiting"):
            if name not in names:
                next(i for i in _jobs.indexes if i.name == name).create(conn)


def _step_3(conn: Connection, d: _Dialect) -> None:
    """2 -> 3: jobs.closed_by records which job closed a dependent (retry follows it)."""
    if "closed_by" not in {c["name"] for c in sa.inspect(conn).get_columns("jobs")}:
        conn.execute(_DDL_CLOSED_BY)


def _step_4(conn: Connection, d: _Dialect) -> None:
    """3 -> 4: job state (priority, unique keys, checkpoints, progress) and spawning. The new
    tables jobq_attempts and jobq_groups are made by create_all, before any step."""
    _upgrade_4_state(conn, d)
    _upgrade_4_spawn(conn, d)


def _step_5(conn: Connection, d: _Dialect) -> None:
    """4 -> 5: the due index; the indexes re-keyed (MySQL/MariaDB: finished and held spawns
    without state; PostgreSQL/SQLite: the partial ix_jobs_children for ix_jobs_parent); Oracle
    MySQL's parent key dropped; SQLite's jobs table rebuilt with AUTOINCREMENT."""
    _add_due_index(conn, d)
    if not d.partial_indexes:
        _rekey_mysql_indexes(conn)
    else:
        _rekey_parent_index(conn)
    if not d.parent_fk:
        _drop_parent_fk(conn)
    if d.rowid_reuse:
        _autoincrement_jobs(conn)


def _step_6(conn: Connection, d: _Dialect) -> None:
    """5 -> 6: signals and waits (jobq_signals, jobq_waits), new tables made by create_all
    before any step; nothing on the jobs table changes."""


def _step_7(conn: Connection, d: _Dialect) -> None:
    """6 -> 7: jobs.trace_parent, the enqueuing span's trace context (nullable, no default: an
    instant change of the table's definition on every engine, no rewrite); recurring jobs
    (jobq_schedules), per-job logs (jobq_logs), retention policy (jobq_retention) and the audit
    log of bulk actions (jobq_audit), new tables made by create_all before any step; jobs.max_attempts_set,
    whether enqueue was given max_attempts (a RetryPolicy's attempts apply only where it was
    not; existing rows read false, as before this step)."""
    columns = {c["name"] for c in sa.inspect(conn).get_columns("jobs")}
    if "trace_parent" not in columns:
        conn.execute(_DDL_TRACE_PARENT)
    if "max_attempts_set" not in columns:
        kind, false = sa.Boolean().compile(dialect=conn.dialect), sa.false().compile(dialect=conn.dialect)
        conn.execute(sa.DDL(f"ALTER TABLE jobs ADD COLUMN max_attempts_set {kind} DEFAULT {false} NOT NULL"))


def _upgrade_4_state(conn: Connection, d: _Dialect) -> None:
    """3 -> 4 (issue 16): jobs.priority, and the ready index rebuilt with it (the claim's order
    within a group); jobs.unique_key with its unique index over unfinished rows (on MySQL/MariaDB
    through the generated column unique_live); jobs.checkpoint and jobs.progress. Adds only what
    is missing."""
    inspector = sa.inspect(conn)
    columns = {c["name"] for c in inspector.get_columns("jobs")}
    if "priority" not in columns:
        conn.execute(_DDL_PRIORITY)
    for name in ("checkpoint", "progress"):
        if name not in columns:
            conn.execute(sa.DDL(f"ALTER TABLE jobs ADD COLUMN {name} {_JSONCOL.compile(dialect=conn.dialect)}"))
    if "unique_key" not in columns:
        conn.execute(sa.DDL(f"ALTER TABLE jobs ADD COLUMN unique_key {_NAME.compile(dialect=conn.dialect)}"))
    if d.live_key_column == "unique_live" and "unique_live" not in columns:
        for ddl in _DDL_UNIQUE_LIVE:
            conn.execute(ddl)
    for ix in inspector.get_indexes("jobs"):
        if ix["name"] in ("ix_jobs_ready", "ix_jobs_ready_my") and "priority" not in ix["column_names"]:
            next(i for i in _jobs.indexes if i.name == ix["name"]).drop(conn)
    names = {i["name"] for i in sa.inspect(conn).get_indexes("jobs")}
    for name in ("ix_jobs_ready", "ix_jobs_ready_my", "ux_jobs_unique_live"):
        index = next(i for i in _jobs.indexes if i.name == name)
        if name not in names and (d.partial_indexes == (name != "ix_jobs_ready_my")):
            index.create(conn)


def _upgrade_4_spawn(conn: Connection, d: _Dialect) -> None:
    """3 -> 4 (spawning from handlers): jobs.spawned_by, jobs.spawn_token and the index of held
    spawns. Adds only what is missing."""
    inspector = sa.inspect(conn)
    have = {c["name"] for c in inspector.get_columns("jobs")}
    for column, ddl in (("spawned_by", _DDL_SPAWNED_BY), ("spawn_token", _DDL_SPAWN_TOKEN)):
        if column not in have:
            conn.execute(ddl)
    name = "ix_jobs_held" if d.partial_indexes else "ix_jobs_held_my"
    if name not in {i["name"] for i in inspector.get_indexes("jobs")}:
        next(i for i in _jobs.indexes if i.name == name).create(conn)


def _rekey_mysql_indexes(conn: Connection) -> None:
    """MySQL/MariaDB: replace the finished and held-spawn indexes that led with ``state``
    ((state, finished_at) as ix_jobs_state_finished, (state, spawned_by) as ix_jobs_held_my)
    by their state-free keys. A state-led entry moved on every claim and every finish: on a
    64-row lease, 3.4 against 2.8 ms on MySQL 9.7, 1.8 against 1.5 ms on MariaDB 10.11."""
    found = {i["name"]: i["column_names"] for i in sa.inspect(conn).get_indexes("jobs")}
    for name, old in (("ix_jobs_state_finished", None), ("ix_jobs_held_my", ["state", "spawned_by"])):
        if name in found and (old is None or found[name] == old):
            conn.execute(sa.DDL(f"DROP INDEX {name} ON jobs"))
            del found[name]
            logger.info("jobq: dropped the index %s (re-keyed without state, see _rekey_mysql_indexes)", name)
    for name in ("ix_jobs_finished_my", "ix_jobs_held_my"):
        if name not in found:
            next(i for i in _jobs.indexes if i.name == name).create(conn)


def _add_due_index(conn: Connection, d: _Dialect) -> None:
    """The due index (ix_jobs_due, or ix_jobs_due_my), made where it is missing."""
    name = "ix_jobs_due" if d.partial_indexes else "ix_jobs_due_my"
    if name not in {i["name"] for i in sa.inspect(conn).get_indexes("jobs")}:
        next(i for i in _jobs.indexes if i.name == name).create(conn)
        logger.info("jobq: made the index %s (a tick with nothing due reads no scheduled job)", name)


def _rekey_parent_index(conn: Connection) -> None:
    """PostgreSQL/SQLite: replace the index of every row's parent_id (``ix_jobs_parent``, made
    by every jobq.py before this one) by its partial successor ``ix_jobs_children``, made
    first. The full index took an entry for each parentless job at every claim and every
    finish on PostgreSQL."""
    names = {i["name"] for i in sa.inspect(conn).get_indexes("jobs")}
    if "ix_jobs_children" not in names:
        next(i for i in _jobs.indexes if i.name == "ix_jobs_children").create(conn)
    if "ix_jobs_parent" in names:
        conn.execute(_DDL_DROP_PARENT_INDEX)
        logger.info("jobq: dropped the index ix_jobs_parent (replaced by the partial ix_jobs_children)")


def _drop_parent_fk(conn: Connection) -> None:
    """Drop jobs.parent_id's foreign key where _Dialect.parent_fk says jobq does without it."""
    for fk in sa.inspect(conn).get_foreign_keys("jobs"):
        if fk["constrained_columns"] == ["parent_id"] and fk["name"]:
            conn.execute(sa.DDL(f"ALTER TABLE jobs DROP FOREIGN KEY {conn.dialect.identifier_preparer.quote(fk['name'])}"))
            logger.info("jobq: dropped the foreign key %s of jobs.parent_id (see _Dialect.parent_fk)", fk["name"])


def _autoincrement_jobs(conn: Connection) -> None:
    """SQLite: rebuild a ``jobs`` table declared without AUTOINCREMENT in place (SQLite cannot
    add it to an existing table). The largest id ever used then stays in sqlite_sequence.

    Renamed with legacy_alter_table on, so that job_deps' foreign keys (and the table's own
    parent_id) keep naming ``jobs``. Needs foreign-key enforcement off, as jobq's connections
    have it: with it on, dropping the old table would cascade into job_deps."""
    ddl = conn.execute(_Q_SQLITE_JOBS_SQL).scalar()
    if ddl is None or "AUTOINCREMENT" in ddl.upper():
        return
    if conn.exec_driver_sql("PRAGMA foreign_keys").scalar():
        raise JobqError("upgrading a SQLite jobs table needs PRAGMA foreign_keys = OFF for create_schema")
    cols = ", ".join(f'"{c.name}"' for c in _jobs.columns)
    conn.exec_driver_sql("PRAGMA legacy_alter_table = ON")
    try:
        conn.exec_driver_sql("ALTER TABLE jobs RENAME TO jobq_jobs_old")
        for name in list(conn.execute(_Q_SQLITE_OLD_INDEXES).scalars()):
            conn.exec_driver_sql(f'DROP INDEX "{name}"')
        _jobs.create(conn)
        conn.exec_driver_sql(f"INSERT INTO jobs ({cols}) SELECT {cols} FROM jobq_jobs_old")
        conn.exec_driver_sql("DROP TABLE jobq_jobs_old")
    finally:
        conn.exec_driver_sql("PRAGMA legacy_alter_table = OFF")
    logger.info("jobq: rebuilt the SQLite jobs table with AUTOINCREMENT (ids are never reused)")


#: The numbered upgrade steps, in order: (version, step, what it does). A step turns a database
#: at version - 1 into one at version; create_schema runs those above the recorded version.
#: A database made by create_all is at the last one already. SCHEMA_VERSION is the last number.
_MIGRATIONS: tuple[tuple[int, Callable[[Connection, _Dialect], None], str], ...] = (
    (2, _step_2, "jobq_starts.n; the finished and waiting indexes"),
    (3, _step_3, "jobs.closed_by"),
    (4, _step_4, "priority, unique keys, checkpoints, progress; spawning"),
    (5, _step_5, "the due index; re-keyed indexes; no parent key on MySQL; AUTOINCREMENT on SQLite"),
    (6, _step_6, "jobq_signals and jobq_waits (signals, durable sleep, snooze)"),
    (7, _step_7, "jobs.trace_parent (OpenTelemetry trace context); jobq_schedules (recurring jobs); "
                 "jobs.max_attempts_set (an enqueue's max_attempts wins over a RetryPolicy); "
                 "jobq_logs, jobq_retention and jobq_audit (job logs, retention policy, bulk actions)"),
)

"""jobq: an embeddable, database-backed ready-set job scheduler on SQLAlchemy 2.x.

Jobs live in one relational database (SQLite, PostgreSQL, MySQL 8+ or MariaDB 10.6+) and form a
DAG: a job becomes runnable once every job it depends on is done, and container jobs never run
but roll up from their children. Workers lease runnable jobs with one atomic claim per dialect,
keep the lease alive with heartbeats, and write each result with a fenced, atomic finalize.

Vendoring: copy this one file into your project. It imports only the standard library and
SQLAlchemy >= 2.0; the database driver (psycopg, PyMySQL, ...) is your choice.

Guarantees, in three lines:
  * at-least-once: a job whose worker dies is reclaimed when its lease expires and runs again;
  * never completed twice: a result is written only by the dispatch that still holds the lease;
  * the global concurrency cap holds across every worker sharing the database.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import functools
import importlib
import json
import logging
import math
import os
import random
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Collection, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event, orm
from sqlalchemy.dialects import mysql as _mysql
from sqlalchemy.dialects import postgresql as _pg
from sqlalchemy.dialects import sqlite as _sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.engine.interfaces import BindTyping
from sqlalchemy.ext.compiler import compiles

__version__ = "0.1.0"

__all__ = [
    "ATTEMPT_OUTCOMES",
    "AsyncWorker",
    "AttemptInfo",
    "Base",
    "CLAIM_WINDOW",
    "ClaimedId",
    "ConfigError",
    "EVENT_ACTIONS",
    "Event",
    "GlobalLimit",
    "GroupPolicy",
    "InvalidJob",
    "Job",
    "JobContext",
    "JobDep",
    "JobInfo",
    "JobqError",
    "Lease",
    "LeaseLost",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_NAME_LENGTH",
    "PG_NOTIFY_CHANNEL",
    "SCHEMA_VERSION",
    "SQLITE_BUSY_TIMEOUT_MS",
    "START_LOG_RETENTION",
    "STATES",
    "TERMINAL",
    "TX_RETRIES",
    "UNLIMITED",
    "UniqueKeyHeld",
    "UnsupportedDatabase",
    "Worker",
    "WorkerOptions",
    "aio",
    "allocate",
    "attempts",
    "backoff",
    "cancel",
    "claim",
    "claim_batch",
    "create_schema",
    "enqueue",
    "fail",
    "fair_share",
    "finalize",
    "get",
    "get_group",
    "get_limit",
    "groups",
    "heartbeat",
    "main",
    "prune",
    "ready_set",
    "reclaim",
    "release",
    "retry",
    "set_group",
    "set_limit",
    "stats",
    "submit",
    "tick",
    "why",
]


# =============================================================================================
# Logging and events
# =============================================================================================
# jobq logs one record per job transition on the "jobq" logger, with flat `extra` keys
# (action, job_id, type, group, attempt, worker_id, duration_s). Args, results and database
# URLs are never logged. A Worker's `on_event` hook receives the same information as an Event.

#: The library logger. jobq adds only a NullHandler; configure it in your application.
logger = logging.getLogger("jobq")
logger.addHandler(logging.NullHandler())

#: Every action an Event can carry, in rough lifecycle order.
EVENT_ACTIONS = (
    "claimed",
    "started",
    "finished",
    "failed",
    "retried",
    "reclaimed",
    "lease_lost",
    "timed_out",
    "released",
    "cancelled",
    "db_error",
)


@dataclasses.dataclass(frozen=True)
class Event:
    """One job transition, as passed to ``Worker(on_event=...)`` and logged on ``jobq``.

    Attributes:
        action: one of ``EVENT_ACTIONS``.
        job_id: the job concerned (0 for worker-level events such as ``db_error``).
        type: the job's type, or "" when unknown.
        group: the job's group key, or "".
        attempt: the attempt number this dispatch runs as (1-based), or 0.
        worker_id: the worker that saw the transition.
        duration_s: handler run time for finished/failed/timed_out, else None.
        error: a one-line error summary for failures, else None.
    """

    action: str
    job_id: int
    type: str = ""
    group: str = ""
    attempt: int = 0
    worker_id: str = ""
    duration_s: float | None = None
    error: str | None = None


_WARN_ACTIONS = frozenset(("failed", "lease_lost", "timed_out", "db_error"))


def _emit(hook: Callable[[Event], None] | None, ev: Event) -> None:
    # "claimed" is DEBUG: the same worker logs "started" for the job a moment later.
    level = logging.WARNING if ev.action in _WARN_ACTIONS else logging.DEBUG if ev.action == "claimed" else logging.INFO
    if logger.isEnabledFor(level):
        _log(level, ev)
    if hook is not None:
        try:
            hook(ev)
        except Exception:  # a metrics hook must never take the worker down
            logger.exception("on_event hook raised for %s", ev.action)


def _log(level: int, ev: Event) -> None:
    logger.log(
        level,
        "%s job=%s type=%s attempt=%s%s",
        ev.action,
        ev.job_id,
        ev.type,
        ev.attempt,
        f" error={ev.error}" if ev.error else "",
        extra={
            "action": ev.action,
            "job_id": ev.job_id,
            "type": ev.type,
            "group": ev.group,
            "attempt": ev.attempt,
            "worker_id": ev.worker_id,
            "duration_s": ev.duration_s,
        },
    )


# =============================================================================================
# Errors
# =============================================================================================
# The docstring of each class doubles as its default message.


class JobqError(Exception):
    """jobq failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class UnsupportedDatabase(JobqError):
    """This database or server version is not supported by jobq."""


class LeaseLost(JobqError):
    """This dispatch no longer holds the job's lease; nothing was written."""


class InvalidJob(JobqError, ValueError):
    """The job definition was rejected; nothing was written."""


class ConfigError(JobqError, ValueError):
    """A worker or queue option is invalid."""


class UniqueKeyHeld(InvalidJob):
    """A unique key belongs to a job another running handler is spawning; nothing was written.

    That job is ``held``: it exists only if its spawner's result commits, and it is deleted if
    the spawner fails. The key is neither handed out nor free until then, so the enqueue,
    submit, ``ctx.enqueue`` or ``ctx.submit`` that named it is refused at once (it never
    waits for the other handler). Retry later: the key then names the released job (and the
    call returns its id, as for any unfinished holder), or is free again.

    Attributes:
        key: the unique key.
        job_id: the held job that holds it.
        spawned_by: the job whose running handler spawned it.
    """

    def __init__(self, key: str, job_id: int, spawned_by: int) -> None:
        self.key, self.job_id, self.spawned_by = key, job_id, spawned_by
        super().__init__(f"unique_key {key!r} belongs to job {job_id}, which the running handler of job {spawned_by} "
                         "is spawning: it exists only if that handler's result commits. Retry later")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.job_id, self.spawned_by))


# =============================================================================================
# Schema
# =============================================================================================
# Two tables carry the queue (`jobs`, `job_deps`) and one small table (`jobq_meta`) holds the
# schema version and the row the capped claim locks. Times are naive UTC with microseconds on
# every dialect (MySQL/MariaDB need DATETIME(6); SQLite stores ISO text).
#
# Job states:
#   waiting   upstream jobs (or the container's own upstreams) are unfinished; or a container
#             whose children are unfinished
#   ready     runnable once run_after has passed
#   leased    claimed with claim()/claim_batch(); the holder has not reported it started
#   running   a Worker is executing it under a lease
#   done / failed / cancelled   terminal
#   held      spawned by a running handler (ctx.enqueue/ctx.submit, schema 4): not work yet. The
#             finalize that commits the spawner's result releases it to waiting/ready; every
#             other end of that dispatch deletes it. Nothing claims, runs or rolls it up.

SCHEMA_VERSION = 4
STATES = ("waiting", "ready", "leased", "running", "done", "failed", "cancelled", "held")
TERMINAL = ("done", "failed", "cancelled")
_LIVE = ("leased", "running")

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_TS = sa.DateTime().with_variant(_mysql.DATETIME(fsp=6), "mysql", "mariadb")
# utf8mb4_bin: names compare case- and accent-sensitively on MySQL/MariaDB, as elsewhere.
_NAME = sa.String(200).with_variant(
    _mysql.VARCHAR(200, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
)
_JSONCOL = sa.JSON().with_variant(_pg.JSONB(), "postgresql")
_TEXT = sa.Text().with_variant(_mysql.MEDIUMTEXT(), "mysql", "mariadb")


class Base(orm.DeclarativeBase):
    """Declarative base holding jobq's tables (``Base.metadata`` for Alembic autogenerate)."""


def _partial_index(name: str, *cols: Any, where: str, sqlite_where: str | None = None) -> sa.Index:
    """An index of only the rows matching ``where``, on the engines with partial indexes
    (PostgreSQL, SQLite). Queries must spell the predicate as the index does: SQLite matches
    partial indexes by exact terms."""
    return sa.Index(  # type: ignore[no-any-return]
        name, *cols, postgresql_where=sa.text(where), sqlite_where=sa.text(sqlite_where or where),
    ).ddl_if(dialect=("postgresql", "sqlite"))  # type: ignore[arg-type]


def _mysql_index(name: str, *cols: Any) -> sa.Index:
    """The MySQL/MariaDB stand-in for a partial index (they have none): a plain composite."""
    return sa.Index(name, *cols).ddl_if(dialect=("mysql", "mariadb"))  # type: ignore[arg-type,no-any-return]


#: The ready index's priority column, descending (the claim reads it forwards).
_PRIORITY_DESC = sa.text("priority DESC")
#: The rows that hold their unique_key: unfinished ones. Keep in sync with _DDL_UNIQUE_LIVE.
# A job spawned by a running handler (``held``) holds its key too: its release into the ready
# set must never collide with a key taken meanwhile. Keep in sync with _KEY_HOLDERS.
_UNIQUE_LIVE_WHERE = "unique_key IS NOT NULL AND state IN ('waiting', 'ready', 'leased', 'running', 'held')"


#: The due index's predicate: the ready rows. Keep in sync with _q_any_due.
_DUE_WHERE = "state = 'ready' AND attempts >= 0"


class Job(Base):
    """One job: a runnable leaf or a container, with its lease and DAG bookkeeping.

    The counters ``pending_deps`` (unfinished upstreams, plus one while an enclosing container is
    itself waiting on its upstreams), ``pending_children`` and ``failed_children`` are kept by the
    transitions, so readiness and rollup never scan the graph.
    """

    __tablename__ = "jobs"

    id: orm.Mapped[int] = orm.mapped_column(_ID, primary_key=True, autoincrement=True)
    type: orm.Mapped[str] = orm.mapped_column(_NAME)
    args: orm.Mapped[Any] = orm.mapped_column(_JSONCOL)
    result: orm.Mapped[Any] = orm.mapped_column(_JSONCOL, nullable=True)
    state: orm.Mapped[str] = orm.mapped_column(sa.String(16))
    is_container: orm.Mapped[bool] = orm.mapped_column(sa.Boolean, default=False)
    #: The enclosing container. Its foreign key is declared in __table_args__ (not created on
    #: Oracle MySQL: _Dialect.parent_fk).
    parent_id: orm.Mapped[int | None] = orm.mapped_column(_ID, nullable=True)
    group_key: orm.Mapped[str] = orm.mapped_column(_NAME)
    weight: orm.Mapped[int] = orm.mapped_column(sa.Integer, default=1)
    run_after: orm.Mapped[_dt.datetime] = orm.mapped_column(_TS)
    created_at: orm.Mapped[_dt.datetime] = orm.mapped_column(_TS)
    updated_at: orm.Mapped[_dt.datetime] = orm.mapped_column(_TS)
    started_at: orm.Mapped[_dt.datetime | None] = orm.mapped_column(_TS, nullable=True)
    finished_at: orm.Mapped[_dt.datetime | None] = orm.mapped_column(_TS, nullable=True)
    attempts: orm.Mapped[int] = orm.mapped_column(sa.Integer, default=0)
    max_attempts: orm.Mapped[int] = orm.mapped_column(sa.Integer, default=3)
    timeout: orm.Mapped[float | None] = orm.mapped_column(sa.Float, nullable=True)
    error: orm.Mapped[str | None] = orm.mapped_column(_TEXT, nullable=True)
    lease_owner: orm.Mapped[str | None] = orm.mapped_column(sa.String(200), nullable=True)
    lease_token: orm.Mapped[str | None] = orm.mapped_column(sa.String(32), nullable=True)
    lease_expires: orm.Mapped[_dt.datetime | None] = orm.mapped_column(_TS, nullable=True)
    heartbeat_at: orm.Mapped[_dt.datetime | None] = orm.mapped_column(_TS, nullable=True)
    in_flight: orm.Mapped[bool] = orm.mapped_column(sa.Boolean, default=False)
    cancel_requested: orm.Mapped[bool] = orm.mapped_column(sa.Boolean, default=False)
    pending_deps: orm.Mapped[int] = orm.mapped_column(sa.Integer, default=0)
    pending_children: orm.Mapped[int] = orm.mapped_column(sa.Integer, default=0)
    failed_children: orm.Mapped[int] = orm.mapped_column(sa.Integer, default=0)
    #: The upstream (or enclosing container) whose failure or cancellation closed this job
    #: (schema 3): retry re-opens by this relation, never by parsing ``error``.
    closed_by: orm.Mapped[int | None] = orm.mapped_column(_ID, nullable=True)
    #: Claim order within the group, higher first (schema 4).
    priority: orm.Mapped[int] = orm.mapped_column(sa.Integer, default=0, server_default="0")
    #: At most one unfinished job holds a key (schema 4): ux_jobs_unique_live, or on
    #: MySQL/MariaDB the generated column unique_live (see _DDL_UNIQUE_LIVE).
    unique_key: orm.Mapped[str | None] = orm.mapped_column(_NAME, nullable=True)
    #: The handler's last ctx.checkpoint(), handed to every later dispatch (schema 4).
    checkpoint: orm.Mapped[Any] = orm.mapped_column(_JSONCOL, nullable=True)
    #: The handler's last ctx.progress(), written by the heartbeat; kept on finish (schema 4).
    progress: orm.Mapped[Any] = orm.mapped_column(_JSONCOL, nullable=True)
    #: The job whose handler spawned this one (schema 4; kept), and while the job is ``held``
    #: the lease token of that dispatch: only its fenced finalize releases the job.
    spawned_by: orm.Mapped[int | None] = orm.mapped_column(_ID, nullable=True)
    spawn_token: orm.Mapped[str | None] = orm.mapped_column(sa.String(32), nullable=True)

    __table_args__ = (
        # A container's children name it. jobq itself checks a parent under lock (enqueue and
        # submit lock it and refuse one that is missing or finished; prune keeps a container
        # while it has children), so the key is a guard against other writers only: created
        # where it costs nothing, skipped on Oracle MySQL (_parent_fk_ddl).
        sa.ForeignKeyConstraint(["parent_id"], ["jobs.id"]).ddl_if(callable_=lambda *a, **kw: _parent_fk_ddl(**kw)),
        # The claim's scan: ready rows per group, highest priority first, then oldest due.
        # Partial where the engine has partial indexes, so done and waiting rows never enter
        # it; MySQL/MariaDB lead with state instead. Keep in sync with _q_candidates,
        # _q_group_counts, _Q_READY_GROUPS and _upgrade_4_state (priority: schema 4).
        _partial_index("ix_jobs_ready", "group_key", _PRIORITY_DESC, "run_after", "id", where="state = 'ready'"),
        _mysql_index("ix_jobs_ready_my", "state", "group_key", _PRIORITY_DESC, "run_after", "id"),
        # The claim's first question: is anything due at all? The ready index, ordered by
        # priority before run_after, cannot answer it without walking every job scheduled for
        # later; this one answers it from its first entry, so a tick with nothing due reads
        # none of them. Its predicate has a term (always true) that only the due check names,
        # so the planners cannot take it for the claim's reads (in a backlog, a read of one
        # group through it would visit every due job); MySQL/MariaDB's claim reads name their
        # index (d.ready_index_hint). Keep in sync with _q_any_due and _add_due_index.
        _partial_index("ix_jobs_due", "run_after", where=_DUE_WHERE),
        _mysql_index("ix_jobs_due_my", "state", "run_after"),
        # Cap accounting and reclaim read only in-flight rows. lease_expires is deliberately not
        # indexed: heartbeats rewrite it, and an indexed column would defeat PostgreSQL HOT.
        # The predicate is spelled exactly as the queries render `in_flight == true()`, so the
        # planners can prove the index applies (SQLite cannot match "in_flight" to "in_flight = 1").
        _partial_index("ix_jobs_in_flight", "group_key", where="in_flight = true", sqlite_where="in_flight = 1"),
        _mysql_index("ix_jobs_in_flight_my", "in_flight", "group_key"),
        # Children by their container. Partial where possible (replacing a full index on every start:
        # _rekey_parent_index): most jobs have no parent, and on PostgreSQL every claim and every
        # finish of such a job wrote an index entry for its NULL (a state change is no HOT update).
        # Every query names a parent (``parent_id = x`` or ``IN``), which the planners prove
        # implies the predicate. MySQL/MariaDB's index moves only when parent_id does.
        _partial_index("ix_jobs_children", "parent_id", where="parent_id IS NOT NULL"),
        _mysql_index("ix_jobs_parent", "parent_id"),
        # Retention's scan (prune): finished rows by age. Partial where possible, so the hot
        # transitions between ready, leased and running never touch it (schema 2; a full
        # (state, finished_at) index took a new entry on every claim and lured PostgreSQL's
        # planner into walking its dead entries). Keep in sync with prune. MySQL/MariaDB index
        # finished_at alone (NULL until a job finishes), so a claim's state change moves no
        # entry of it; _rekey_mysql_indexes replaces the (state, finished_at) index of before.
        _partial_index("ix_jobs_finished", "finished_at", where="state IN ('done', 'failed', 'cancelled')"),
        _mysql_index("ix_jobs_finished_my", "finished_at"),
        # stats() counts blocked jobs through this (schema 2); on MySQL/MariaDB the state index.
        _partial_index("ix_jobs_waiting", "group_key", where="state = 'waiting'"),
        # Unique jobs (schema 4): one unfinished job per unique_key, enforced by the database so
        # that concurrent enqueuers cannot both insert. Keep the predicate in sync with
        # _UNIQUE_LIVE_WHERE (the insert's ON CONFLICT names it). MySQL/MariaDB: _DDL_UNIQUE_LIVE.
        sa.Index("ux_jobs_unique_live", "unique_key", unique=True, postgresql_where=sa.text(_UNIQUE_LIVE_WHERE),
                 sqlite_where=sa.text(_UNIQUE_LIVE_WHERE)).ddl_if(dialect=("postgresql", "sqlite")),  # type: ignore[arg-type]
        # Held spawns by their spawner (schema 4): release, discard and reclaim find them here;
        # released rows leave the partial index. Keep in sync with _q_held_spawns. MySQL/MariaDB:
        # spawned_by alone (it never changes), so state changes move no entry of it.
        _partial_index("ix_jobs_held", "spawned_by", where="state = 'held'"),
        _mysql_index("ix_jobs_held_my", "spawned_by"),
        # Ids are never handed out twice (schema 3): without AUTOINCREMENT SQLite gives a new
        # row the largest id + 1, so pruning the newest jobs reused their ids, and a later
        # depends_on=[old_id] waited on a stranger. _upgrade rebuilds older SQLite tables.
        {"mysql_engine": "InnoDB", "mariadb_engine": "InnoDB", "sqlite_autoincrement": True},
    )


class JobDep(Base):
    """A DAG edge: ``job_id`` runs only after ``depends_on_id`` is done."""

    __tablename__ = "job_deps"

    job_id: orm.Mapped[int] = orm.mapped_column(_ID, sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    depends_on_id: orm.Mapped[int] = orm.mapped_column(
        _ID, sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )

    __table_args__ = (
        sa.Index("ix_job_deps_upstream", "depends_on_id"),
        {"mysql_engine": "InnoDB", "mariadb_engine": "InnoDB"},
    )


_meta = sa.Table(
    "jobq_meta",
    Base.metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.String(200), nullable=False),
    mysql_engine="InnoDB",
    mariadb_engine="InnoDB",
)

# Slots still occupied by handlers a worker had to abandon (a timed-out thread cannot be
# killed): the job row was released, but the cap keeps counting the slot until the thread
# returns. Rows are renewed by the owner's heartbeat and simply expire if the worker dies.
_slots = sa.Table(
    "jobq_slots",
    Base.metadata,
    sa.Column("token", sa.String(32), primary_key=True),
    sa.Column("job_id", _ID, primary_key=True),
    sa.Column("worker_id", sa.String(200), nullable=False),
    sa.Column("group_key", _NAME, nullable=False),
    sa.Column("expires", _TS, nullable=False),
    mysql_engine="InnoDB",
    mariadb_engine="InnoDB",
)

# One row per group per claim, counting the jobs it started: the memory behind fair-share turns
# (which group started last) and rate limits (how many starts in a window). Swept after
# START_LOG_RETENTION.
_starts = sa.Table(
    "jobq_starts",
    Base.metadata,
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("group_key", _NAME, nullable=False),
    sa.Column("started_at", _TS, nullable=False),
    sa.Column("n", sa.Integer, nullable=False, server_default="1"),  # jobs this claim started (schema 2)
    sa.Index("ix_jobq_starts_group", "group_key", "started_at"),
    sa.Index("ix_jobq_starts_time", "started_at"),
    mysql_engine="InnoDB",
    mariadb_engine="InnoDB",
)

# One row per attempt that ended (schema 4): kept apart from ``jobs.error``, which holds only
# the last failed attempt's error while the job is not done. Written by the transaction that
# ends the attempt (finalize, fail, release, reclaim), one INSERT ... SELECT per batch; deleted
# with its job by prune. No foreign key: the rows are written on the hot path, and a key
# check per row (PostgreSQL's trigger, InnoDB's parent lock) would cost more than prune's
# explicit delete.
_attempts = sa.Table(
    "jobq_attempts",
    Base.metadata,
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("job_id", _ID, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("worker_id", sa.String(200), nullable=True),
    sa.Column("started_at", _TS, nullable=True),
    sa.Column("finished_at", _TS, nullable=False),
    sa.Column("outcome", sa.String(16), nullable=False),
    sa.Column("error", _TEXT, nullable=True),
    sa.Index("ix_jobq_attempts_job", "job_id", "id"),
    mysql_engine="InnoDB",
    mariadb_engine="InnoDB",
)

# Group policy stored with set_group (issue 14): one row per group someone configured. NULL
# means "not set" (weight: the jobs' own; cap, rate: none). The claim reads the rows of the
# groups it ranks, under the claim lock when any row limits (cap, rate, pause); the claim_lock
# row's value counts the rows and the limiting ones (_policy_counts), so a queue that stores
# no policy reads none.
_groups = sa.Table(
    "jobq_groups",
    Base.metadata,
    sa.Column("group_key", _NAME, primary_key=True),
    sa.Column("weight", sa.Integer, nullable=True),
    sa.Column("max_in_flight", sa.Integer, nullable=True),
    sa.Column("rate_n", sa.Integer, nullable=True),
    sa.Column("rate_period", sa.Float, nullable=True),
    sa.Column("paused", sa.Boolean, nullable=False),
    sa.Column("updated_at", _TS, nullable=False),
    mysql_engine="InnoDB",
    mariadb_engine="InnoDB",
)

#: How an attempt ended, as :func:`attempts` reports it: ``done``; ``failed`` (the handler
#: raised or its result was refused); ``timeout`` (the dispatch timeout fired); ``reclaimed``
#: (its lease expired: the worker died, stalled or lost the database); ``released`` (given
#: back unfinished at shutdown, not charged); ``cancelled`` (cancelled while it ran).
ATTEMPT_OUTCOMES = ("done", "failed", "timeout", "reclaimed", "released", "cancelled")

#: How long job starts are remembered: rate-limit periods may be at most this long.
START_LOG_RETENTION = _dt.timedelta(hours=24)

_jobs: sa.Table = Job.__table__  # type: ignore[assignment]
_deps: sa.Table = JobDep.__table__  # type: ignore[assignment]
_c = _jobs.c

# MySQL/MariaDB have no partial indexes: a stored generated column that is the key while the
# job is unfinished and NULL after (NULLs never collide in a unique index), unique-indexed.
# Not part of the Table (nothing writes it); created with the table and by _upgrade_4_state.
_DDL_UNIQUE_LIVE = (
    sa.DDL("ALTER TABLE jobs ADD COLUMN unique_live VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin "
           "GENERATED ALWAYS AS (CASE WHEN state IN ('waiting', 'ready', 'leased', 'running', 'held') "
           "THEN unique_key END) STORED"),
    sa.DDL("CREATE UNIQUE INDEX ux_jobs_unique_live_my ON jobs (unique_live)"),
)
for _ddl in _DDL_UNIQUE_LIVE:
    sa.event.listen(_jobs, "after_create", _ddl.execute_if(dialect=("mysql", "mariadb")))  # type: ignore[arg-type]

#: The jobq_meta row every capped claim locks: the cap's serialisation point.
_CLAIM_LOCK_KEY = "claim_lock"
#: The jobq_meta row holding the global limits (set_limit), as JSON; "" until first set. It
#: sorts after claim_lock: every statement that locks both locks them in key order.
_GLOBAL_LIMITS_KEY = "global_limits"


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
_Q_SQLITE_JOBS_SQL = sa.text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'jobs'")
_Q_SQLITE_OLD_INDEXES = sa.text(
    "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'jobq_jobs_old' AND sql IS NOT NULL"
)


def _upgrade(conn: Connection, d: _Dialect, found: int) -> None:
    """Bring a database created by an earlier jobq up to SCHEMA_VERSION, step by step. Each
    step is idempotent (a crash between a step and the version update reruns it safely)."""
    if found > SCHEMA_VERSION:
        raise JobqError(
            f"the database has jobq schema version {found}, newer than this jobq.py ({SCHEMA_VERSION}): "
            "upgrade the vendored jobq.py"
        )
    if found < 2:
        # 1 -> 2: jobq_starts counts the jobs of one claim per row (one row per group per
        # claim instead of one per job); finished rows get a partial index of their own
        # instead of a (state, finished_at) index that every claim wrote to; waiting rows
        # get one for stats(). (MySQL/MariaDB keep theirs until _rekey_mysql_indexes, below.)
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
    if found < 3:
        # 2 -> 3: jobs.closed_by records which job closed a dependent (retry follows it).
        if "closed_by" not in {c["name"] for c in sa.inspect(conn).get_columns("jobs")}:
            conn.execute(_DDL_CLOSED_BY)
    # 3 -> 4: jobq_attempts is a new table (create_all, before this, made it); nothing to alter.
    if found < 4:
        _upgrade_4_state(conn, d)
        _upgrade_4_spawn(conn, d)
    _add_due_index(conn, d)
    if not d.partial_indexes:
        # Checked on every start (one catalogue read), with no version of its own, like the
        # parent key below: a jobq.py of before reads the re-keyed indexes as well.
        _rekey_mysql_indexes(conn)
    else:
        _rekey_parent_index(conn)  # the same: on every start, no version of its own
    if not d.parent_fk:
        # Checked on every start (one catalogue read), with no version of its own: a jobq.py
        # that predates it works as well without the key, and never creates it again.
        _drop_parent_fk(conn)
    if d.rowid_reuse:
        # Also part of 2 -> 3, checked on every start (one catalogue read): a jobs table made
        # before it (by any version) still hands out pruned ids again.
        _autoincrement_jobs(conn)
    if found < SCHEMA_VERSION:
        conn.execute(_Q_SET_SCHEMA_VERSION, {"b_value": str(SCHEMA_VERSION)})
        logger.info("jobq schema upgraded from version %d to %d", found, SCHEMA_VERSION)


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
    """The due index (ix_jobs_due, or ix_jobs_due_my), made where it is missing. Checked on every
    start (one catalogue read), with no version of its own: a jobq.py of before works with
    it too (it only keeps the index up to date), and one after it finds it made."""
    name = "ix_jobs_due" if d.partial_indexes else "ix_jobs_due_my"
    if name not in {i["name"] for i in sa.inspect(conn).get_indexes("jobs")}:
        next(i for i in _jobs.indexes if i.name == name).create(conn)
        logger.info("jobq: made the index %s (a tick with nothing due reads no scheduled job)", name)


def _rekey_parent_index(conn: Connection) -> None:
    """PostgreSQL/SQLite: replace the index of every row's parent_id (``ix_jobs_parent``, made
    by every jobq.py before this one) by its partial successor ``ix_jobs_children``, made
    first. The full index took an entry for each parentless job at every claim and every
    finish on PostgreSQL. A jobq.py of before never makes it again on an existing table
    (create_all skips the indexes of a table that exists), and reads the new one as well."""
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


# =============================================================================================
# SQL statements
# =============================================================================================
# The only place jobq writes SQL. Each builder returns a statement; callers bind `now` so that
# tests own the clock. State predicates are rendered as literals so PostgreSQL can match the
# partial indexes even under generic plans.
#
# Builders take the `_Dialect` of the next section: a forward reach in annotations only (they
# are postponed, `from __future__ import annotations`), and at run time only its capability
# methods (lock_skip, array_params), which exist by the time any builder is called. Statements
# that differ by engine in more than a lock clause live in the dialect section instead.


# ---- ready set and claim ----------------------------------------------------------------------


def _state_is(*states: str) -> sa.ColumnElement[bool]:
    if len(states) == 1:
        return _c.state == sa.literal_column(f"'{states[0]}'")
    return _c.state.in_([sa.literal_column(f"'{s}'") for s in states])


class _JobsUpdate(sa.Update):
    """``UPDATE jobs``. One whose WHERE names its rows by id reaches them by the primary key,
    whatever else it tests, where the engine needs telling (_Dialect.index_hints; rendered by
    _render_jobs_update in the dialect section)."""

    inherit_cache = True


def _update_jobs() -> _JobsUpdate:
    return _JobsUpdate(_jobs)


def _pins_ids(where: sa.ColumnElement[Any] | None) -> bool:
    """Whether a WHERE clause names the jobs it touches by id (``id = x``, ``id IN (...)``)."""
    if where is None:
        return False
    terms = where.clauses if isinstance(where, sa.BooleanClauseList) else [where]
    return any(isinstance(t, sa.BinaryExpression) and t.left is _c.id for t in terms)


_TRUE = sa.true()
#: The claim's order within a group, as the ready index reads it: priority, then due, then id.
_CLAIM_ORDER = (_c.priority.desc(), _c.run_after, _c.id)


def ready_set(now: _dt.datetime, types: Iterable[str] | None = None) -> sa.Select[Any]:
    """The runnable leaves at ``now``: a plain SELECT of job rows, in claim order.

    Args:
        now: naive UTC time (the database's clock) against which ``run_after`` is compared.
        types: restrict to these job types (None: every type).

    Returns:
        A SQLAlchemy ``Select`` over ``jobs``, highest ``priority`` first, then oldest due; it
        takes no locks. Claims use the same predicate and order per group, with row locks,
        inside their transaction.
    """
    stmt = sa.select(_jobs).where(_state_is("ready"), _c.run_after <= now)
    if types is not None:
        stmt = stmt.where(_c.type.in_(list(types)))
    return stmt.order_by(*_CLAIM_ORDER)


# The next groups with ready jobs after a group key (b_after; "" from the start), at most
# b_window of them, by a skip scan of the ready index: one index probe per group, however many
# jobs each group has ready (a GROUP BY would read the whole ready set), and never more probes
# than the window, however many groups have ready work (the claim's window: _GroupScan).
# Neither run_after nor the types are checked here; the window read does, per group, bounded.
# One recursion level per group: `hint` lifts a recursion limit where the engine has one.
_READY_GROUPS_CTE = (
    "WITH RECURSIVE g(k, n) AS ("
    " SELECT (SELECT group_key FROM jobs WHERE state = 'ready' AND group_key > :b_after"
    " ORDER BY group_key LIMIT 1), 1"
    " UNION ALL"
    " SELECT (SELECT j.group_key FROM jobs j WHERE j.state = 'ready' AND j.group_key > g.k"
    " ORDER BY j.group_key LIMIT 1), g.n + 1 FROM g WHERE g.k IS NOT NULL AND g.n < :b_window)"
)


def _ready_groups(hint: str = "") -> sa.TextualSelect:
    return sa.text(f"{_READY_GROUPS_CTE} SELECT {hint}k FROM g WHERE k IS NOT NULL").bindparams(
        sa.bindparam("b_after", type_=_NAME), sa.bindparam("b_window", type_=sa.Integer)).columns(k=_NAME)


_Q_READY_GROUPS = _ready_groups()


def _q_ready_groups(d: _Dialect) -> sa.TextualSelect:
    return _prebuilt(d, "ready_groups", lambda: _ready_groups(d.recursion_hint))


def _q_ready_groups_ranged_read(d: _Dialect, typed: bool) -> sa.TextualSelect:
    """The groups among the next b_entries ready-index entries after b_after, the first
    b_groups of them, with how many entries each had there (the last group may have more
    beyond): a read bounded by entries, not groups, for the engines whose recursion is slow
    per level (_GroupScan). It is also the window read of every group it sees whole: per group,
    how many of its entries are runnable now, the largest weight among those and their ids in
    claim order, each followed by ";". One statement where a count and an IN-list read of those
    groups took two (MySQL/MariaDB, 1.2-1.4 ms less at 64 groups). GROUP_CONCAT stops at
    group_concat_max_len (1,024 bytes by default on MySQL): the caller takes a list only if it
    ends with ";" and holds every runnable id."""
    def build() -> sa.TextualSelect:
        typed_sql = " AND j.type IN :b_types" if typed else ""
        stmt = sa.text(
            "SELECT x.group_key, COUNT(*), COUNT(j.id), MAX(j.weight),"
            " GROUP_CONCAT(CONCAT(j.id, ';') ORDER BY x.priority DESC, x.run_after, x.id SEPARATOR '')"
            f" FROM (SELECT group_key, id, priority, run_after FROM jobs {d.ready_index_hint}"
            " WHERE state = 'ready' AND group_key > :b_after ORDER BY group_key, priority DESC, run_after, id"
            f" LIMIT :b_entries) x LEFT JOIN jobs j ON j.id = x.id AND j.run_after <= :b_now{typed_sql}"
            " GROUP BY x.group_key ORDER BY x.group_key LIMIT :b_groups"
        ).bindparams(sa.bindparam("b_after", type_=_NAME), sa.bindparam("b_entries", type_=sa.Integer),
                     sa.bindparam("b_now", type_=_TS), sa.bindparam("b_groups", type_=sa.Integer))
        if typed:
            stmt = stmt.bindparams(sa.bindparam("b_types", expanding=True))
        return stmt.columns()

    return _prebuilt(d, f"ready_groups_ranged_read:{typed}", build)


def _q_group_counts(groups: Sequence[str], now: _dt.datetime, types: Sequence[str] | None, limit: int) -> sa.CompoundSelect:
    """Per group: runnable jobs (counted up to ``limit``) and the largest weight among them.
    Reads at most ``limit`` index entries per group, never the whole ready set."""
    parts = []
    for g in groups:
        inner = sa.select(_c.weight).where(_state_is("ready"), _c.group_key == g, _c.run_after <= now)
        if types is not None:
            inner = inner.where(_c.type.in_(types))
        sub = inner.order_by(*_CLAIM_ORDER).limit(limit).subquery()
        parts.append(sa.select(sa.literal(g, _NAME), sa.func.count(), sa.func.max(sub.c.weight)).select_from(sub))
    return sa.union_all(*parts)


#: What a claim reads of each row it leases, in this order (_lease_rows unpacks it; _LEASE_ID
#: and _LEASE_GROUP index it: by position a Row answers in 0.08 us, by name in 0.7 us). The
#: JSON columns come as text, decoded by _lease_rows: psycopg's JSONB loader cost 4 us a row,
#: for `{}`, and most handlers' args are small.
_LEASE_COLS = (
    _c.id,
    _c.type,
    sa.cast(_c.args, sa.Text).label("args"),
    _c.group_key,
    _c.attempts,
    _c.max_attempts,
    _c.timeout,
    _c.parent_id,
    sa.cast(_c.checkpoint, sa.Text).label("checkpoint"),
)
_LEASE_ID, _LEASE_GROUP = 0, 3


def _q_due_weights(now: _dt.datetime) -> sa.Select[Any]:
    """Per group with due ready jobs, the largest weight among them: one read of the ready
    index, whatever the number of groups (the dashboard's weight column; _q_group_counts' UNION
    of one term per group broke past SQLite's 500 terms and took seconds at thousands)."""
    return (sa.select(_c.group_key, sa.func.max(_c.weight))
            .where(_state_is("ready"), _c.run_after <= now).group_by(_c.group_key))


def _q_any_due(d: _Dialect) -> sa.Select[Any]:
    """Whether any ready job is due: the first entry of the due index (ix_jobs_due, spelled as
    its predicate _DUE_WHERE; on MySQL/MariaDB ix_jobs_due_my, a range their optimizers size
    by index dives), however many jobs are scheduled for later. A claim that finds none reads
    nothing else of the ready set. Not named by a hint: a database whose create_schema has not
    yet made the index must still claim."""
    return _prebuilt(d, "any_due", lambda: sa.select(sa.literal_column("1")).where(
        _state_is("ready"), _c.attempts >= sa.literal_column("0"), _c.run_after <= sa.bindparam("b_now", type_=_TS)).limit(1))


def _q_candidates(d: _Dialect, typed: bool) -> sa.Select[Any]:
    """The claim's locking read of one group's oldest runnable jobs (prebuilt per dialect)."""
    def build() -> sa.Select[Any]:
        stmt = sa.select(*_LEASE_COLS).where(_state_is("ready"), _c.group_key == sa.bindparam("b_group"),
                                            _c.run_after <= sa.bindparam("b_now", type_=_TS))
        if typed:
            stmt = stmt.where(_types_in(d))
        if d.ready_index_hint:
            stmt = stmt.with_hint(_jobs, d.ready_index_hint)
        return d.lock_skip(stmt.order_by(*_CLAIM_ORDER).limit(sa.bindparam("b_limit", type_=sa.Integer)))

    return _prebuilt(d, f"candidates:{typed}", build)


def _types_in(d: _Dialect) -> sa.ColumnElement[bool]:
    """``type IN b_types`` for the claim's reads: one bound value where the engine takes one
    (an array on PostgreSQL, a JSON array on SQLite), so the SQL text is the same for any
    types and needs no rendering per call; an expanding list elsewhere."""
    if d.array_params:
        return _c.type == sa.any_(sa.bindparam("b_types", type_=_pg.ARRAY(sa.String(200))))
    if d.json_id_lists:
        return _id_in(d, _c.type, sa.bindparam("b_types"))
    return _c.type.in_(sa.bindparam("b_types", expanding=True))


#: Group terms of one window read (_q_window_candidates), padded up to a power of two so that a
#: few prebuilt statements serve every window size; SQLite allows 500 terms per compound SELECT.
_WINDOW_TERMS = 256


def _q_window_candidates(d: _Dialect, n: int, typed: bool) -> sa.Select[Any] | sa.CompoundSelect:
    """The claim's one read of a window of ``n`` groups (b_g0 .. b_g{n-1}): per group its first
    b_limit runnable jobs in claim order, as (group_key, id, weight), without locks (the chosen
    ones are locked by id: _q_lock_chosen). A UNION ALL of per-group LIMITed selects,
    parenthesised (MySQL/MariaDB refuse LIMIT in an IN subquery, and materialise a derived
    table per term: 10 ms for 64 groups), or as derived tables where the engine takes no
    parenthesised compound terms (SQLite: d.compound_limits). Each term walks the ready index like _q_candidates. Unused terms get
    the group key "", which no group has (_check_name), and read one index probe."""
    def build() -> sa.Select[Any] | sa.CompoundSelect:
        parts = []
        for i in range(n):
            inner = sa.select(_c.group_key, _c.id, _c.weight).where(
                _state_is("ready"), _c.group_key == sa.bindparam(f"b_g{i}", type_=_NAME),
                _c.run_after <= sa.bindparam("b_now", type_=_TS))
            if typed:
                inner = inner.where(_types_in(d))
            inner = inner.order_by(*_CLAIM_ORDER).limit(sa.bindparam("b_limit", type_=sa.Integer))
            if d.compound_limits:
                parts.append(inner.with_hint(_jobs, d.ready_index_hint) if d.ready_index_hint else inner)
            else:
                sub = inner.subquery(f"w{i}")
                parts.append(sa.select(sub.c.group_key, sub.c.id, sub.c.weight))
        return sa.union_all(*parts) if n > 1 else parts[0]

    return _prebuilt(d, f"window:{n}:{typed}", build)


def _q_window_lateral(d: _Dialect, typed: bool) -> sa.Select[Any]:
    """_q_window_candidates as one LATERAL join over the bound array b_groups (d.lateral_arrays):
    the same SQL text and a small plan for any window (the UNION of 64 terms took PostgreSQL
    5 ms to plan, every claim)."""
    def build() -> sa.Select[Any]:
        g = sa.func.unnest(sa.bindparam("b_groups", type_=_pg.ARRAY(sa.String(200)))).table_valued("k").render_derived("g")
        inner = sa.select(_c.group_key, _c.id, _c.weight).where(
            _state_is("ready"), _c.group_key == g.c.k, _c.run_after <= sa.bindparam("b_now", type_=_TS))
        if typed:
            inner = inner.where(_types_in(d))
        w = inner.order_by(*_CLAIM_ORDER).limit(sa.bindparam("b_limit", type_=sa.Integer)).lateral("w")
        return sa.select(w.c.group_key, w.c.id, w.c.weight).select_from(g).join(w, sa.true())

    return _prebuilt(d, f"window_lateral:{typed}", build)


def _q_ready_groups_read(d: _Dialect, typed: bool) -> sa.TextualSelect:
    """The group scan (_ready_groups) and the window read in one statement (d.scan_reads_window):
    each group found, with its first b_limit runnable jobs in claim order (none: one row of
    NULLs), so a claim over many groups spends one statement on both. PostgreSQL joins the
    window read LATERAL (as _q_window_lateral), SQLite as a correlated ``id IN (... LIMIT)``
    (as _q_window_json). A scan from the first group that finds one group alone reads no jobs
    (LIMIT 0): that claim locks that group's jobs directly (_q_candidates), and its caller
    reads them itself if not."""
    def build() -> sa.TextualSelect:
        limit = ("CASE WHEN :b_after = '' AND NOT EXISTS (SELECT 1 FROM g g2 WHERE g2.n = 2 AND g2.k IS NOT NULL)"
                 " THEN 0 ELSE :b_limit END")
        types = sa.bindparam("b_types", type_=_pg.ARRAY(sa.String(200)) if d.lateral_arrays else sa.JSON())
        if d.lateral_arrays:
            typed_sql = " AND type = ANY(:b_types)" if typed else ""
            read = (" LEFT JOIN LATERAL (SELECT id, weight, priority, run_after FROM jobs"
                    f" WHERE state = 'ready' AND group_key = g.k AND run_after <= :b_now{typed_sql}"
                    f" ORDER BY priority DESC, run_after, id LIMIT {limit}) w ON true")
        else:
            typed_sql = " AND type IN (SELECT value FROM json_each(:b_types))" if typed else ""
            read = (" LEFT JOIN jobs w ON w.id IN (SELECT id FROM jobs"
                    f" WHERE state = 'ready' AND group_key = g.k AND run_after <= :b_now{typed_sql}"
                    f" ORDER BY priority DESC, run_after, id LIMIT {limit})")
        stmt = sa.text(
            f"{_READY_GROUPS_CTE} SELECT g.k, w.id, w.weight FROM g{read}"
            " WHERE g.k IS NOT NULL ORDER BY g.n, w.priority DESC, w.run_after, w.id"
        ).bindparams(sa.bindparam("b_after", type_=_NAME), sa.bindparam("b_window", type_=sa.Integer),
                     sa.bindparam("b_now", type_=_TS), sa.bindparam("b_limit", type_=sa.Integer))
        if typed:
            stmt = stmt.bindparams(types)
        return stmt.columns(k=_NAME, id=sa.BigInteger, weight=sa.Integer)

    return _prebuilt(d, f"ready_groups_read:{typed}", build)


def _q_window_json(d: _Dialect, typed: bool) -> sa.Select[Any]:
    """_q_window_candidates over one bound JSON array of groups (d.json_id_lists, SQLite): per
    array element a correlated ``id IN (... LIMIT b_limit)`` read of the ready index, ordered
    by the element's position, then claim order. One text and two bound values for any
    window; the padded UNION of derived tables bound b_now once per term and cost SQLite
    about twice as much (0.7 against 0.3 ms for 64 groups)."""
    def build() -> sa.Select[Any]:
        g = sa.func.json_each(sa.bindparam("b_groups", type_=sa.JSON())).table_valued("value", "key").alias("g")
        inner = sa.select(_c.id).where(_state_is("ready"), _c.group_key == g.c.value,
                                       _c.run_after <= sa.bindparam("b_now", type_=_TS))
        if typed:
            inner = inner.where(_types_in(d))
        inner = inner.order_by(*_CLAIM_ORDER).limit(sa.bindparam("b_limit", type_=sa.Integer))
        j = _jobs.alias("j")
        return (sa.select(j.c.group_key, j.c.id, j.c.weight).select_from(g)
                .join(j, j.c.id.in_(inner.scalar_subquery()))
                .order_by(g.c.key, j.c.priority.desc(), j.c.run_after, j.c.id))

    return _prebuilt(d, f"window_json:{typed}", build)


def _q_lock_chosen(d: _Dialect) -> sa.Select[Any]:
    """The claim's one locking read: the chosen candidates by id, those still runnable, locked;
    rows another claim holds are skipped (that group comes up short and is re-ranked). The
    state and due checks see the latest committed row, so a candidate leased since the window
    read is not taken twice. By primary key only: the state is tested as an expression that no
    ready index matches (a plain `state = 'ready'` let PostgreSQL, on stale statistics, walk the
    whole ready set through the partial index: 6 ms at 20,000 ready jobs, for 64 rows)."""
    return _prebuilt(d, "lock_chosen", lambda: d.lock_skip(
        sa.select(*_LEASE_COLS).where(_id_in(d, _c.id, sa.bindparam("b_ids", type_=_pg.ARRAY(sa.BigInteger))),
                                      sa.func.lower(_c.state) == "ready",
                                      _c.run_after <= sa.bindparam("b_now", type_=_TS))))


_STATEMENTS: dict[tuple[str, str], Any] = {}


def _prebuilt(d: _Dialect, name: str, build: Callable[[], _T]) -> _T:
    """A hot-path statement built once per dialect family: executing a prebuilt statement with
    bound parameters skips SQLAlchemy's per-call construction (and reuses its compiled form)."""
    key = (d.statement_key, name)
    stmt = _STATEMENTS.get(key)
    if stmt is None:
        stmt = _STATEMENTS[key] = build()
    return stmt  # type: ignore[no-any-return]


_Q_IN_FLIGHT_BY_GROUP = sa.select(_c.group_key, sa.func.count()).where(_c.in_flight == _TRUE).group_by(_c.group_key)


_Q_HELD_SLOTS_BY_GROUP = (
    sa.select(_slots.c.group_key, sa.func.count())
    .where(_slots.c.expires > sa.bindparam("b_now", type_=_TS))
    .group_by(_slots.c.group_key)
)


def _q_last_starts(groups: Sequence[str]) -> sa.Select[Any]:
    return (
        sa.select(_starts.c.group_key, sa.func.max(_starts.c.started_at))
        .where(_starts.c.group_key.in_(groups))
        .group_by(_starts.c.group_key)
    )


def _q_starts_since(since: _dt.datetime, groups: Sequence[str] | None) -> sa.Select[Any]:
    total = sa.func.coalesce(sa.func.sum(_starts.c.n), 0)
    if groups is None:
        return sa.select(sa.literal("*"), total).where(_starts.c.started_at > since)  # type: ignore[return-value]
    return (
        sa.select(_starts.c.group_key, total)
        .where(_starts.c.started_at > since, _starts.c.group_key.in_(groups))
        .group_by(_starts.c.group_key)
    )


def _q_starts_by_group(since: _dt.datetime) -> sa.Select[Any]:
    """Jobs started per group since ``since``, every group (the dashboard's served share)."""
    return (sa.select(_starts.c.group_key, sa.func.coalesce(sa.func.sum(_starts.c.n), 0))
            .where(_starts.c.started_at > since).group_by(_starts.c.group_key))


# ---- group policy (set_group, get_group, groups; the claim reads it) ---------------------------


def _q_group_policies(keys: Sequence[str]) -> sa.Select[Any]:
    return sa.select(_groups).where(_groups.c.group_key.in_(keys))


_Q_ALL_GROUP_POLICIES = sa.select(_groups).order_by(_groups.c.group_key)
_Q_INSERT_GROUP = sa.insert(_groups)
_Q_UPDATE_GROUP = (
    sa.update(_groups)
    .where(_groups.c.group_key == sa.bindparam("b_key", type_=_NAME))
    .values(weight=sa.bindparam("weight"), max_in_flight=sa.bindparam("max_in_flight"),
            rate_n=sa.bindparam("rate_n"), rate_period=sa.bindparam("rate_period"),
            paused=sa.bindparam("paused"), updated_at=sa.bindparam("updated_at"))
)
_Q_GROUP_IN_FLIGHT = sa.select(sa.func.count()).where(_c.in_flight == _TRUE, _c.group_key == sa.bindparam("b_key", type_=_NAME))


# ---- builders for get, why, stats and the command line


def _q_job(job_id: int) -> sa.Select[Any]:
    """Every column of one job (get, why)."""
    return sa.select(_jobs).where(_c.id == job_id)


def _q_job_state(job_id: int) -> sa.Select[Any]:
    return sa.select(_c.state).where(_c.id == job_id)


def _q_upstream_ids(job_id: int) -> sa.Select[Any]:
    return sa.select(_deps.c.depends_on_id).where(_deps.c.job_id == job_id).order_by(_deps.c.depends_on_id)


def _q_dependent_ids(job_id: int) -> sa.Select[Any]:
    return sa.select(_deps.c.job_id).where(_deps.c.depends_on_id == job_id).order_by(_deps.c.job_id)


def _q_child_ids(job_id: int) -> sa.Select[Any]:
    return sa.select(_c.id).where(_c.parent_id == job_id).order_by(_c.id)


def _q_unfinished_upstreams(job_id: int) -> sa.Select[Any]:
    """The upstreams of ``job_id`` that are not done yet, with their states (why)."""
    ups = sa.select(_deps.c.depends_on_id).where(_deps.c.job_id == job_id).scalar_subquery()
    return sa.select(_c.id, _c.state).where(_c.id.in_(ups), _c.state != "done").order_by(_c.id)


def _q_holders() -> sa.Select[Any]:
    """In-flight jobs per worker and group (why: who holds the slots)."""
    return (sa.select(_c.lease_owner, _c.group_key, sa.func.count())
            .where(_c.in_flight == _TRUE).group_by(_c.lease_owner, _c.group_key))


def _q_ahead_in_group(group: str, priority: int, run_after: _dt.datetime, job_id: int, now: _dt.datetime) -> sa.Select[Any]:
    """How many due jobs of ``group`` a claim takes before this one (in _CLAIM_ORDER)."""
    return sa.select(sa.func.count()).where(
        _state_is("ready"), _c.group_key == group, _c.run_after <= now,
        sa.or_(_c.priority > priority, sa.and_(_c.priority == priority, sa.or_(
            _c.run_after < run_after, sa.and_(_c.run_after == run_after, _c.id < job_id)))))


def _q_ready_by_group(now: _dt.datetime) -> sa.Select[Any]:
    """Per group: ready jobs, and how many of them are due at ``now`` (the rest are scheduled)."""
    due = sa.func.sum(sa.case((_c.run_after <= now, 1), else_=0))
    return sa.select(_c.group_key, sa.func.count(), due).where(_state_is("ready")).group_by(_c.group_key)


def _q_ready_times(now: _dt.datetime) -> sa.Select[Any]:
    """The ``run_after`` of the oldest due ready job and of the next scheduled one."""
    return sa.select(
        sa.func.min(sa.case((_c.run_after <= now, _c.run_after)), type_=_TS),
        sa.func.min(sa.case((_c.run_after > now, _c.run_after)), type_=_TS),
    ).where(_state_is("ready"))


def _q_waiting_count() -> sa.Select[Any]:
    return sa.select(sa.func.count()).where(_state_is("waiting"))


def _q_in_flight_by_state() -> sa.Select[Any]:
    return sa.select(_c.state, sa.func.count()).where(_c.in_flight == _TRUE).group_by(_c.state)


def _q_finished_by_state(since: _dt.datetime) -> sa.Select[Any]:
    return sa.select(_c.state, sa.func.count()).where(_state_is(*TERMINAL), _c.finished_at >= since).group_by(_c.state)


def _q_expired_count(now: _dt.datetime) -> sa.Select[Any]:
    return sa.select(sa.func.count()).where(_c.in_flight == _TRUE, _c.lease_expires < now)


def _q_recent_failures(since: _dt.datetime, limit: int = 5) -> sa.Select[Any]:
    # both state terms: the first is ix_jobs_finished's predicate, spelled as the index spells it
    return (sa.select(_c.id, _c.type, _c.error, _c.finished_at)
            .where(_state_is(*TERMINAL), _state_is("failed"), _c.finished_at >= since)
            .order_by(_c.finished_at.desc()).limit(limit))


def _q_finished_buckets(since: _dt.datetime, step: _dt.timedelta, n: int) -> sa.Select[Any]:
    """Per final state: jobs finished in each of ``n`` consecutive spans of ``step`` from
    ``since`` (the dashboard's throughput chart). One range read of ix_jobs_finished, like
    _q_finished_by_state: its cost follows the window, never the history."""
    spans = [sa.func.sum(sa.case((sa.and_(_c.finished_at >= since + step * i, _c.finished_at < since + step * (i + 1)), 1),
                                 else_=0)) for i in range(n)]
    return sa.select(_c.state, *spans).where(_state_is(*TERMINAL), _c.finished_at >= since).group_by(_c.state)


def _q_count_by_state() -> sa.Select[Any]:
    """Every job per state: a full scan (stats(totals=True) only)."""
    return sa.select(_c.state, sa.func.count()).group_by(_c.state)


def _q_schema_version() -> sa.Select[Any]:
    return sa.select(_meta.c.value).where(_meta.c.key == "schema_version")


def _q_list_jobs(*, state: str | Sequence[str] | None, type: str | None, group: str | None,
                 since: _dt.datetime | None, limit: int, until: _dt.datetime | None = None,
                 before: int | None = None) -> sa.Select[Any]:
    """`jobq ls` and the dashboard's job list: the newest jobs first, filtered (``state``: one
    state, or any of several); ``before`` (an id) pages backwards by key, so a page costs the
    same however deep it is."""
    stmt = sa.select(_c.id, _c.type, _c.state, _c.group_key, _c.attempts, _c.max_attempts, _c.run_after,
                     _c.created_at, _c.finished_at)
    if until is not None:
        stmt = stmt.where(_c.created_at < until)
    if before is not None:
        stmt = stmt.where(_c.id < before)
    if isinstance(state, str):
        stmt = stmt.where(_c.state == state)
    elif state is not None:
        stmt = stmt.where(_c.state.in_(sorted(set(state))))
    if type is not None:
        stmt = stmt.where(_c.type == type)
    if group is not None:
        stmt = stmt.where(_c.group_key == group)
    if since is not None:
        stmt = stmt.where(_c.created_at >= since)
    return stmt.order_by(_c.id.desc()).limit(limit)


def _q_newest_ids(limit: int) -> sa.Select[Any]:
    return sa.select(_c.id).order_by(_c.id.desc()).limit(limit)


def _q_graph_nodes(ids: Sequence[int]) -> sa.Select[Any]:
    return sa.select(_c.id, _c.type, _c.state, _c.parent_id, _c.is_container).where(_c.id.in_(list(ids)))


def _q_upstream_ids_of(ids: Sequence[int]) -> sa.Select[Any]:
    return sa.select(_deps.c.depends_on_id).where(_deps.c.job_id.in_(list(ids)))


def _q_dependents_of(ids: Sequence[int]) -> sa.Select[Any]:
    return sa.select(_deps.c.job_id).where(_deps.c.depends_on_id.in_(list(ids)))


def _q_edges_into(ids: Sequence[int]) -> sa.Select[Any]:
    """The edges (job_id, depends_on_id) whose dependent is one of ``ids``."""
    return sa.select(_deps.c.job_id, _deps.c.depends_on_id).where(_deps.c.job_id.in_(list(ids)))


_Q_SLOTS_IN_USE = sa.union_all(_Q_IN_FLIGHT_BY_GROUP, _Q_HELD_SLOTS_BY_GROUP)  # one round trip

#: The first and the last group with ready work, read at the two ends of the ready index (MIN
#: and MAX over an index prefix are index dives, not scans): where they are the same group, it
#: is the only one, and a claim from the first group needs no group scan (_GroupScan). Each end
#: is a SELECT of its own: SQLite reads a MIN or a MAX off an index only when it is a SELECT's
#: one aggregate, and walks the whole ready index for both in one.
_READY_FIRST = sa.select(sa.func.min(_c.group_key)).where(_state_is("ready"))
_READY_LAST = sa.select(sa.func.max(_c.group_key)).where(_state_is("ready"))
_Q_READY_GROUP_SPAN = sa.select(_READY_FIRST.scalar_subquery(), _READY_LAST.scalar_subquery())
#: _Q_SLOTS_IN_USE with that span as two more rows, counted -1 (the first group) and -2 (the
#: last): a capped claim reads both after its lock in one round trip (_slots_and_span).
_Q_SLOTS_AND_SPAN = sa.union_all(
    _Q_IN_FLIGHT_BY_GROUP, _Q_HELD_SLOTS_BY_GROUP,
    _READY_FIRST.add_columns(sa.literal_column("-1")), _READY_LAST.add_columns(sa.literal_column("-2")),
)



class _IdArrayText(sa.types.TypeDecorator[Any]):
    """A list of ids bound as the text of an array (``{1,2,3}``), cast to BIGINT[] by the
    statement: psycopg's own list dumper spent a quarter of a no-op batch's finalize CPU
    checking each element against a regular expression."""

    impl = sa.String
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> str | None:
        return None if value is None else "{" + ",".join([str(int(i)) for i in value]) + "}"


def _id_in(d: _Dialect, col: sa.ColumnElement[Any], ids: Any) -> sa.ColumnElement[bool]:
    """``col IN ids`` for the hot path. PostgreSQL: ``col = ANY(array)``, one bound array, so
    the SQL text is the same for any number of ids and psycopg can prepare it (an IN list is
    new SQL for every length, parsed and planned each time); SQLite: a bound JSON array, the
    same for the prebuilt statements (ids given as a bind parameter)."""
    if d.array_params and isinstance(ids, sa.BindParameter):
        return col == sa.any_(sa.cast(sa.bindparam(ids.key, type_=_IdArrayText()), _pg.ARRAY(sa.BigInteger)))
    if d.array_params:
        return col == sa.any_(sa.literal(list(ids), _pg.ARRAY(sa.BigInteger)))
    if isinstance(ids, sa.BindParameter) and d.json_id_lists:
        return col.in_(sa.select(sa.func.json_each(sa.bindparam(ids.key, type_=sa.JSON())).table_valued("value").c.value))
    if isinstance(ids, sa.BindParameter):
        return col.in_(sa.bindparam(ids.key, expanding=True))
    return col.in_(list(ids))


# ---- builders for enqueue, submit, settle, cancel and retry -----------------------------------
# The DAG's reads and writes. Rows a transaction is about to rewrite are locked first, in id
# order, so that its decisions rest on states nobody can change under it (cancel, retry, a
# container taking children); upstream states are share-locked so a concurrent finalize waits.

_BAD = ("failed", "cancelled")
_OPEN = ("waiting", "ready", "leased", "running")
_KEY_HOLDERS = (*_OPEN, "held")  # the states whose jobs hold their unique keys: _UNIQUE_LIVE_WHERE
_Q_INSERT_JOB = sa.insert(_jobs)


def _q_insert_job_returning(d: _Dialect, cols: tuple[str, ...]) -> sa.Insert:
    """_Q_INSERT_JOB for one row of these columns, bound as ``b_<column>``, RETURNING its id
    (d.returning): prebuilt per set of columns, so an enqueue runs it on the cursor."""
    return _prebuilt(d, "insert_job:" + ",".join(cols), lambda: sa.insert(_jobs).values(
        {k: sa.bindparam(f"b_{k}", type_=_jobs.c[k].type) for k in cols}).returning(_c.id))


def _q_live_keys(live_key: sa.ColumnElement[str], keys: Sequence[str]) -> sa.Select[Any]:
    """Unfinished jobs holding these unique keys, through the unique index (the dialect names
    the column: _Dialect.live_keys)."""
    stmt = sa.select(_c.unique_key, _c.id).where(live_key.in_(list(keys)))
    if live_key.name == "unique_key":  # the partial index: spell its predicate for the planner
        stmt = stmt.where(_c.unique_key.is_not(None), _state_is(*_KEY_HOLDERS))
    return stmt.order_by(_c.id)
_Q_INSERT_JOBS = sa.insert(_jobs).returning(_c.id, sort_by_parameter_order=True)


def _q_insert_values(d: _Dialect, cols: tuple[str, ...], n: int) -> sa.TextClause:
    """One multi-row INSERT ... VALUES of ``n`` job rows (engines without RETURNING), bound as
    ``<column>_<row>``: prebuilt, so it is compiled once per size, not per call."""
    def build() -> sa.TextClause:
        # Text, not insert().values([...]): SQLAlchemy compiles a multi-row values() on every
        # execution (it does not cache them), 80 ms for 256 rows; a text is compiled once.
        rows = ", ".join("(" + ", ".join(f":{c}_{i}" for c in cols) + ")" for i in range(n))
        return sa.text(f"INSERT INTO jobs ({', '.join(cols)}) VALUES {rows}").bindparams(
            *(sa.bindparam(f"{c}_{i}", type_=_jobs.c[c].type) for i in range(n) for c in cols))

    return _prebuilt(d, f"insert_values:{n}:{','.join(cols)}", build)
_Q_INSERT_DEPS = sa.insert(_deps)
# A job born closed learns its cause's id only once every row of the submit has one.
_Q_NAME_CAUSE = (
    _update_jobs().where(_c.id == sa.bindparam("b_id"))
    .values(closed_by=sa.bindparam("b_by"), error=sa.bindparam("b_error"))
)


# ---- spawned jobs (held until their spawner's result commits) ------------------------------


def _q_spawner_fence(d: _Dialect, job_id: int, token: str) -> sa.Select[Any]:
    """The spawning dispatch still holds its lease: locked, so a reclaim, cancel or finalize of
    the spawner waits for the spawn's commit (and then finds its held rows), or runs first (and
    the spawn is refused)."""
    return d.lock_wait(sa.select(_c.id).where(*_fence(job_id, None, token)))


def _q_held_spawns(d: _Dialect, spawners: Sequence[int]) -> sa.Select[Any]:
    """The held jobs of these spawners, containers before their children (ids grow down a
    submit). Through ix_jobs_held: keep the predicate spelled as the index's."""
    return d.lock_wait(
        sa.select(_c.id, _c.parent_id, _c.is_container, _c.spawned_by, _c.spawn_token, _c.cancel_requested)
        .where(_state_is("held"), _id_in(d, _c.spawned_by, spawners)).order_by(_c.id),
        via="ix_jobs_held" if d.partial_indexes else "ix_jobs_held_my",
    )


def _q_upstream_edges(ids: Sequence[int]) -> sa.Select[Any]:
    """(job, upstream, upstream's state) for every upstream of these jobs."""
    return (
        sa.select(_deps.c.job_id, _deps.c.depends_on_id, _c.state)
        .join(_jobs, _c.id == _deps.c.depends_on_id).where(_deps.c.job_id.in_(ids))
    )


def _q_release_held(ids: Sequence[int], state: str, pending: int, now: _dt.datetime) -> sa.Update:
    return (
        _update_jobs().where(_c.id.in_(ids), _state_is("held"))
        .values(state=state, pending_deps=pending, spawn_token=None, updated_at=now)
    )


def _q_uncount_children(parent_id: int, n: int) -> sa.Update:
    """Discarded spawns leave their (waiting or held) container."""
    return (
        _update_jobs().where(_c.id == parent_id, _state_is("waiting", "held"))
        .values(pending_children=_c.pending_children - n)
    )


def _q_referrers(ids: Sequence[int]) -> sa.CompoundSelect:
    """(job, a job that names it) for every dependent and every child of these jobs."""
    return sa.union_all(
        sa.select(_deps.c.depends_on_id, _deps.c.job_id).where(_deps.c.depends_on_id.in_(ids)),
        sa.select(_c.parent_id, _c.id).where(_c.parent_id.in_(ids)),
    )


def _q_close_held(job_id: int, error: str, now: _dt.datetime) -> sa.Update:
    return (
        _update_jobs().where(_c.id == job_id, _state_is("held"))
        .values(state="cancelled", error=error, spawn_token=None, finished_at=now, updated_at=now)
    )


def _q_held_among(ids: Sequence[int]) -> sa.Select[Any]:
    """Which of these jobs are held spawns, and whose (the lowest id first)."""
    return sa.select(_c.id, _c.spawned_by).where(_c.id.in_(ids), _state_is("held")).order_by(_c.id)


def _q_held_count() -> sa.Select[Any]:
    return sa.select(sa.func.count()).where(_state_is("held"), _c.spawned_by.is_not(None))


def _q_lock_jobs(d: _Dialect, ids: Sequence[int]) -> sa.Select[Any]:
    """Rows about to be rewritten (a container taking children, a subtree being cancelled, a job
    being re-opened), locked in id order."""
    return d.lock_wait(
        sa.select(_c.id, _c.state, _c.parent_id, _c.is_container, _c.pending_deps).where(_c.id.in_(ids)).order_by(_c.id)
    )


def _q_lock_open_children(d: _Dialect, ids: Sequence[int]) -> sa.Select[Any]:
    """The unfinished children of these containers, locked in id order (cancel's walk). Read
    after their containers were locked: a child enqueued later waits for the container's lock."""
    return d.lock_wait(
        sa.select(_c.id, _c.state, _c.parent_id, _c.is_container, _c.pending_deps)
        .where(_c.parent_id.in_(ids), _state_is(*_OPEN)).order_by(_c.id), via="ix_jobs_parent"
    )


def _q_upstream_states(d: _Dialect, ids: Sequence[int]) -> sa.Select[Any]:
    """States of existing jobs that new jobs will depend on, share-locked: a concurrent finalize
    of one waits for our commit and then sees our edge, or we wait for it and see it done."""
    return d.lock_share(sa.select(_c.id, _c.state).where(_c.id.in_(ids)).order_by(_c.id))


def _q_upstreams_of(d: _Dialect, job_id: int) -> sa.Select[Any]:
    """One job's upstreams and their states, share-locked (retry)."""
    ups = sa.select(_deps.c.depends_on_id).where(_deps.c.job_id == job_id).scalar_subquery()
    return d.lock_share(sa.select(_c.id, _c.state).where(_c.id.in_(ups)).order_by(_c.id))


def _q_closed_nodes(ids: Sequence[int]) -> sa.Select[Any]:
    """(id, state, parent_id) of these jobs (why: the states of the roots it names)."""
    return sa.select(_c.id, _c.state, _c.parent_id).where(_c.id.in_(ids))


def _q_parent_of(job_id: int) -> sa.Select[Any]:
    return sa.select(_c.parent_id).where(_c.id == job_id)


def _q_children_of(ids: Sequence[int]) -> sa.Select[Any]:
    return sa.select(_c.id).where(_c.parent_id.in_(ids))


def _q_wait_nodes(ids: Sequence[int]) -> sa.Select[Any]:
    return sa.select(_c.id, _c.state, _c.parent_id, _c.is_container).where(_c.id.in_(ids))


def _q_open_upstreams(ids: Sequence[int]) -> sa.Select[Any]:
    """(job, upstream) for the unfinished upstreams of these jobs: what they still wait for."""
    return (
        sa.select(_deps.c.job_id, _deps.c.depends_on_id)
        .join(_jobs, _c.id == _deps.c.depends_on_id)
        .where(_deps.c.job_id.in_(ids), _state_is(*_OPEN))
    )


def _q_open_children(ids: Sequence[int]) -> sa.Select[Any]:
    """(container, child) for the unfinished children of these containers."""
    return sa.select(_c.parent_id, _c.id).where(_c.parent_id.in_(ids), _state_is(*_OPEN))


def _q_add_children(parent_id: int, n: int) -> sa.Update:
    # held: a container spawned earlier by the same dispatch (checked by _insert_graph)
    return (
        _update_jobs().where(_c.id == parent_id, _state_is("waiting", "held"))
        .values(pending_children=_c.pending_children + n)
    )


def _q_parents(ids: Sequence[int]) -> sa.Select[Any]:
    return sa.select(_c.id, _c.parent_id).where(_c.id.in_(ids), _c.parent_id.is_not(None))


def _q_count_finished_children(parent_id: int, n: int, bad: int) -> sa.Update:
    return (
        _update_jobs().where(_c.id == parent_id, _state_is("waiting"))
        .values(pending_children=_c.pending_children - n, failed_children=_c.failed_children + bad)
    )


def _q_child_counts(parent_id: int) -> sa.Select[Any]:
    return sa.select(_c.state, _c.pending_children, _c.failed_children).where(_c.id == parent_id)


def _q_roll_up(parent_id: int, state: str, error: str | None, now: _dt.datetime) -> sa.Update:
    return (
        _update_jobs().where(_c.id == parent_id, _state_is("waiting"))
        .values(state=state, finished_at=now, updated_at=now, error=error)
    )


def _q_dependent_counts(d: _Dialect) -> sa.Select[Any]:
    """(dependent, how many of ``b_ids`` it depends on). Prebuilt: every finalize runs it."""
    return _prebuilt(d, "dependent_counts", lambda: (
        sa.select(_deps.c.job_id, sa.func.count())
        .where(_id_in(d, _deps.c.depends_on_id, sa.bindparam("b_ids", type_=_pg.ARRAY(sa.BigInteger))))
        .group_by(_deps.c.job_id)
    ))


# Every job downstream of b_ids along dependencies whose row matches `pick` (the jobs a failure
# closes, or those a retry re-opens), as the edges into them: (upstream, dependent). One
# statement for a chain of any depth: UNION (not ALL) visits each job once, however many paths
# reach it. `prefix` and `hint` lift the engine's recursion limit (_Dialect.recursion_prefix,
# recursion_hint): one level per link of the longest chain; `step` and `into` join each row of
# the walk to its edges, by index from the row (_edges_of_down). Each job's row is tested
# by a scalar subquery, which no planner turns into a join: PostgreSQL, with statistics from
# before the graph existed, read every closed job through ix_jobs_finished at each step of a
# chain (20 s for 5,000 links).
_DOWNSTREAM_CTE = (
    "{prefix}WITH RECURSIVE down(id) AS ("
    " SELECT e.job_id FROM job_deps e WHERE e.depends_on_id IN :b_ids"
    " AND (SELECT {pick} FROM jobs j WHERE j.id = e.job_id)"
    " UNION"
    " SELECT e.job_id FROM down {step}"
    " WHERE (SELECT {pick} FROM jobs j WHERE j.id = e.job_id))"
    " SELECT {hint}e.depends_on_id, e.job_id FROM down {into}"
)
#: The rows each walk of _q_downstream follows: unstarted jobs (closing), or jobs closed by
#: propagation (re-opening: closed_by set, whichever upstream or container closed them).
_DOWNSTREAM_PICK = {"close": "j.state IN ('waiting', 'ready')",
                    "reopen": "j.state IN ('failed', 'cancelled') AND j.closed_by IS NOT NULL"}


def _edges_of_down(d: _Dialect, col: str) -> str:
    """The edges (e) whose ``col`` is a row of ``down``, joined to that row: by index from each
    row, a LATERAL read on PostgreSQL (_Dialect.lateral_edges)."""
    if d.lateral_edges:
        return f"CROSS JOIN LATERAL (SELECT x.depends_on_id, x.job_id FROM job_deps x WHERE x.{col} = down.id OFFSET 0) e"
    return f"{d.ordered_join} job_deps e ON e.{col} = down.id"


def _q_downstream(d: _Dialect, walk: str) -> sa.TextualSelect:
    """(upstream, dependent) for every edge into the jobs downstream of b_ids that ``walk``
    follows (_DOWNSTREAM_PICK)."""
    return _prebuilt(d, f"downstream:{walk}", lambda: sa.text(_DOWNSTREAM_CTE.format(
        prefix=d.recursion_prefix, hint=d.recursion_hint, step=_edges_of_down(d, "depends_on_id"),
        into=_edges_of_down(d, "job_id"), pick=_DOWNSTREAM_PICK[walk]))
        .bindparams(sa.bindparam("b_ids", expanding=True)).columns(depends_on_id=_ID, job_id=_ID))


# The failed or cancelled jobs up from one closed job (:job_id), as the links that reach them:
# (job, the job it was reached from, 0 for an upstream and 1 for a container, job's state);
# the closed job itself comes as (job_id, job_id, -1, state). One statement for a chain of any
# depth; _retry_roots then walks the links in memory. A step follows both kinds of link of a
# job, picked by a two-row table (k): the recursive reference may appear only once in a step
# (PostgreSQL). Rows are read and tested by scalar subqueries (as in _DOWNSTREAM_CTE, whose
# prefix, hint and join this shares), never joined: a join read the whole table per walk.
_UPSTREAM_TARGET = "CASE WHEN k.k = 0 THEN e.depends_on_id ELSE (SELECT x.parent_id FROM jobs x WHERE x.id = up.id) END"
_UPSTREAM_CTE = (
    "{prefix}WITH RECURSIVE up(id, src, k) AS ("
    " SELECT j.id, j.id, -1 FROM jobs j WHERE j.id = :job_id"
    " UNION"
    " SELECT {target}, up.id, k.k"
    " FROM up {join} (SELECT 0 AS k UNION ALL SELECT 1 AS k) k ON 1 = 1"
    " LEFT JOIN job_deps e ON k.k = 0 AND e.job_id = up.id"
    " WHERE (SELECT j.state IN ('failed', 'cancelled') FROM jobs j WHERE j.id = {target}))"
    " SELECT {hint}up.id, up.src, up.k, (SELECT n.state FROM jobs n WHERE n.id = up.id) FROM up"
)


def _q_closed_upstream_walk(d: _Dialect) -> sa.TextualSelect:
    """(id, src, k, state): :job_id and every failed or cancelled job up from it along
    upstreams (k 0) and containers (k 1), each link once (_retry_roots)."""
    return _prebuilt(d, "closed_upstream_walk", lambda: sa.text(_UPSTREAM_CTE.format(
        prefix=d.recursion_prefix, hint=d.recursion_hint, join=d.ordered_join, target=_UPSTREAM_TARGET))
        .columns(id=_ID, src=_ID, k=sa.Integer, state=sa.String))


def _q_unstarted_children(d: _Dialect, ids: Sequence[int]) -> sa.Select[Any]:
    """Unstarted children of these containers, locked in id order (they close with them)."""
    return d.lock_wait(sa.select(_c.id, _c.parent_id).where(_c.parent_id.in_(ids), _state_is("waiting", "ready"))
                       .order_by(_c.id), via="ix_jobs_parent")


def _q_count_off(ids: Sequence[int], k: int) -> sa.Update:
    return _update_jobs().where(_c.id.in_(ids), _state_is("waiting")).values(pending_deps=_c.pending_deps - k)


def _q_unblocked(ids: Sequence[int]) -> sa.Select[Any]:
    return sa.select(_c.id, _c.is_container).where(_c.id.in_(ids), _state_is("waiting"), _c.pending_deps == 0)


def _q_make_ready(ids: Sequence[int], now: _dt.datetime) -> sa.Update:
    return _update_jobs().where(_c.id.in_(ids), _state_is("waiting")).values(state="ready", updated_at=now)


def _q_waiting_children(ids: Sequence[int]) -> sa.Select[Any]:
    return sa.select(_c.id).where(_c.parent_id.in_(ids), _state_is("waiting"))


def _q_close(ids: Sequence[int], state: str, cause: Mapping[int, tuple[int, str]], now: _dt.datetime) -> sa.Update:
    """Close jobs that have not started because ``cause[job]`` = (closed_by, error): an upstream
    or their container ended badly; retry follows closed_by back. One statement for the batch
    (the values per job by CASE, unless they share one cause)."""
    values: list[tuple[int, str]] = [cause[i] for i in ids]
    by: Any = values[0][0]
    error: Any = values[0][1]
    if len(set(values)) > 1:
        by = sa.case({i: sa.literal(cause[i][0], _ID) for i in ids}, value=_c.id)
        error = sa.case({i: sa.literal(cause[i][1], _TEXT) for i in ids}, value=_c.id)
    return (
        _update_jobs().where(_c.id.in_(list(ids)), _state_is("waiting", "ready"))
        .values(state=state, error=error, closed_by=by, finished_at=now, updated_at=now)
    )


def _q_cancel_unstarted(ids: Sequence[int], error: str, now: _dt.datetime, *, root: bool) -> sa.Update:
    """Cancel waiting/ready jobs: the root by request (closed by nobody), the rest of a subtree by
    their container."""
    return (
        _update_jobs().where(_c.id.in_(ids), _state_is("waiting", "ready"))
        .values(state="cancelled", error=error, closed_by=None if root else _c.parent_id, finished_at=now, updated_at=now)
    )


def _q_request_cancel(ids: Sequence[int]) -> sa.Update:
    """Live jobs are asked to stop; a held spawn keeps the request for its release."""
    return _update_jobs().where(_c.id.in_(ids), _state_is(*_LIVE, "held")).values(cancel_requested=True)


def _q_reopen(ids: Sequence[int], state: str, pending: int, now: _dt.datetime, **counters: int) -> sa.Update:
    return _update_jobs().where(_c.id.in_(list(ids))).values(
        state=state, attempts=0, error=None, finished_at=None, run_after=now, updated_at=now, pending_deps=pending,
        cancel_requested=False, lease_token=None, closed_by=None, **counters,
    )


def _q_uncount_failed_children(parent_id: int, n: int) -> sa.Update:
    """Re-opened children are pending again in their (waiting) container."""
    return (
        _update_jobs().where(_c.id == parent_id)
        .values(pending_children=_c.pending_children + n, failed_children=_c.failed_children - n)
    )


def _q_withdraw_cancel(parent_id: int) -> sa.Update:
    """Children still running when their container was cancelled: a retried container wants
    their results after all."""
    return (
        _update_jobs().where(_c.parent_id == parent_id, _state_is(*_LIVE), _c.cancel_requested == _TRUE)
        .values(cancel_requested=False)
    )


def _q_child_states(parent_id: int) -> sa.Select[Any]:
    return sa.select(_c.id, _c.state).where(_c.parent_id == parent_id).order_by(_c.id)


def _lease_values() -> dict[str, Any]:
    """What a lease writes into each claimed row (_q_lease and _q_lock_and_lease)."""
    return dict(
        state=sa.bindparam("b_state", type_=sa.String(16)),
        lease_owner=sa.bindparam("b_owner", type_=sa.String(200)),
        lease_token=sa.bindparam("b_token", type_=sa.String(32)),
        lease_expires=sa.bindparam("b_expires", type_=_TS),
        heartbeat_at=sa.bindparam("b_now", type_=_TS),
        started_at=sa.bindparam("b_now", type_=_TS),
        attempts=_c.attempts + 1,
        in_flight=True,
        cancel_requested=False,
        updated_at=sa.bindparam("b_now", type_=_TS),
    )


def _q_lease(d: _Dialect) -> sa.Update:
    # By primary key only: the claim holds these rows locked (or SQLite's write lock) since it
    # read them as ready, and checks the row count. A `state = 'ready'` here let PostgreSQL, on
    # stale statistics, walk the whole ready set through a state index (10 ms per claim at 20k).
    return _prebuilt(d, "lease", lambda: (
        _update_jobs().where(_id_in(d, _c.id, sa.bindparam("b_ids", type_=_pg.ARRAY(sa.BigInteger))))
        .values(**_lease_values())
    ))


def _q_lock_and_lease(d: _Dialect, name: str, lock: Callable[[], sa.Select[Any]]) -> sa.Select[Any]:
    """A claim's locking read, the lease of the rows it locked and their start log, as one
    statement (d.dml_ctes; one round trip instead of three): ``lock()`` builds the locking read
    (_q_candidates or _q_lock_chosen), whose parameters this takes plus _q_lease's. Returns the
    locked rows as they were read (attempts before this lease), in claim order. Keep in sync
    with _q_lease."""
    def build() -> sa.Select[Any]:
        locked = lock().add_columns(_c.priority, _c.run_after).cte("locked")
        leased = (_update_jobs().where(_c.id == locked.c.id).values(**_lease_values())
                  .returning(*locked.c).cte("leased"))
        logged = _log_starts_of(leased.c.group_key).cte("logged")
        cols = [leased.c[col.name] for col in _LEASE_COLS]
        return (sa.select(*cols).add_cte(logged)
                .order_by(leased.c.priority.desc(), leased.c.run_after, leased.c.id))
    return _prebuilt(d, f"lock_and_lease:{name}", build)


def _log_starts_of(group_key: sa.ColumnElement[Any], *where: sa.ColumnElement[bool]) -> sa.Insert:
    """The start log of a claim's leased rows, one row per group counting its starts at
    ``b_now``: the rows ``group_key`` comes from (the lease's RETURNING in _q_lock_and_lease,
    or ``jobs`` filtered by ``where`` in _q_log_leased_starts)."""
    return sa.insert(_starts).from_select(
        ["group_key", "started_at", "n"],
        sa.select(group_key, sa.bindparam("b_now", type_=_TS), sa.func.count()).where(*where).group_by(group_key),
    )


def _q_log_leased_starts(d: _Dialect) -> sa.Insert:
    """The start log of the rows just leased (``b_ids``) where the lease was a statement of its
    own (not d.dml_ctes), as one INSERT ... SELECT: no parameters per group (a claim over 64
    groups bound 64 rows' worth)."""
    return _prebuilt(d, "log_leased_starts", lambda: _log_starts_of(
        _c.group_key, _id_in(d, _c.id, sa.bindparam("b_ids", type_=_pg.ARRAY(sa.BigInteger)))))


_Q_LOG_STARTS = sa.insert(_starts).values(group_key=sa.bindparam("b_group", type_=_NAME), started_at=sa.bindparam("b_now", type_=_TS),
                                           n=sa.bindparam("b_n", type_=sa.Integer))
# The claim's lock: the claim_lock row and the global_limits row, in key order, in one statement,
# so the global limits a claim obeys are read under the same lock as its in-flight count.
_Q_LOCK_CLAIM = (sa.select(_meta.c.key, _meta.c.value)
                 .where(sa.or_(_meta.c.key == _CLAIM_LOCK_KEY, _meta.c.key == _GLOBAL_LIMITS_KEY))
                 .order_by(_meta.c.key))
# set_group's lock: the claim_lock row alone (it does not touch the global limits).
_Q_LOCK_POLICY = sa.select(_meta.c.key, _meta.c.value).where(_meta.c.key == _CLAIM_LOCK_KEY)
# The claim_lock row's value without the lock (why).
_Q_CLAIM_LOCK_VALUE = sa.select(_meta.c.value).where(_meta.c.key == _CLAIM_LOCK_KEY)
# Both rows without the lock: a claim without caps of its own reads them to learn whether stored
# policy limits any group or a global limit is set (then it takes the lock after all).
_Q_CLAIM_META = (sa.select(_meta.c.key, _meta.c.value)
                 .where(sa.or_(_meta.c.key == _CLAIM_LOCK_KEY, _meta.c.key == _GLOBAL_LIMITS_KEY))
                 .order_by(_meta.c.key))
_Q_GLOBAL_LIMITS = sa.select(_meta.c.value).where(_meta.c.key == _GLOBAL_LIMITS_KEY)
_Q_SET_GLOBAL_LIMITS = (
    sa.update(_meta).where(_meta.c.key == _GLOBAL_LIMITS_KEY).values(value=sa.bindparam("b_value", type_=sa.String(200)))
)
_Q_SET_CLAIM_LOCK_VALUE = (
    sa.update(_meta).where(_meta.c.key == _CLAIM_LOCK_KEY).values(value=sa.bindparam("b_value", type_=sa.String(200)))
)


def _q_lock_claim(d: _Dialect, pin: bool = False) -> sa.Select[Any]:
    """The capped claim's serialisation point: the claim_lock row (and the global_limits row
    after it), locked (waiting) for the rest of the transaction. With ``pin``, the same statement pins this transaction's plans
    (_Q_PIN_PLANS' settings), one round trip fewer."""
    return _prebuilt(d, f"lock_claim:{pin}", lambda: d.lock_wait(_Q_LOCK_CLAIM.add_columns(*_PIN_SETTINGS) if pin
                                                                 else _Q_LOCK_CLAIM))


def _q_lock_policy(d: _Dialect) -> sa.Select[Any]:
    """set_group's serialisation point: the claim_lock row, locked (waiting)."""
    return _prebuilt(d, "lock_policy", lambda: d.lock_wait(_Q_LOCK_POLICY))


def _q_claim_lock_value(pin: bool) -> sa.Select[Any]:
    """_Q_CLAIM_META, with ``pin`` also pinning this transaction's plans (_q_lock_claim)."""
    return _Q_CLAIM_META_PIN if pin else _Q_CLAIM_META


#: PostgreSQL's planner settings for the rest of a claim's transaction (_Dialect.pin_index_plans).
_PIN_SETTINGS = (sa.func.set_config("enable_seqscan", "off", sa.true()), sa.func.set_config("enable_bitmapscan", "off", sa.true()),
                 sa.func.set_config("jit", "off", sa.true()))
_Q_PIN_PLANS = sa.select(*_PIN_SETTINGS)
_Q_CLAIM_META_PIN = _Q_CLAIM_META.add_columns(*_PIN_SETTINGS)


# ---- finalize / fail / release ----------------------------------------------------------------


@dataclasses.dataclass(slots=True)  # not frozen: built per finished job, and frozen costs 1.6 us each
class _Outcome:
    """What one dispatch reports for its job, written by _apply_outcomes (queue API) through
    the builders below."""

    job_id: int
    owner: str | None
    token: str | None
    kind: str  # "done" | "retry" | "failed" | "release"
    result: Any = None
    error: str | None = None
    delay: float = 0.0  # seconds before a retry may run
    parent_id: int | None = -1  # the job's container if the caller knows it (-1: look it up)
    ended: str | None = None  # the attempt's outcome in its history when a failure is more specific ("timeout")
    spawned: bool = False  # the dispatch may have held spawns: release them with "done", else discard


def _fence(job_id: int, owner: str | None, token: str | None, *, cancelled: bool = False) -> list[sa.ColumnElement[bool]]:
    cond = [_c.id == job_id, _state_is(*_LIVE), _c.cancel_requested == (sa.true() if cancelled else sa.false())]
    if owner is not None:
        cond.append(_c.lease_owner == owner)
    if token is not None:
        cond.append(_c.lease_token == token)
    return cond


_CLEAR_LEASE = {"lease_owner": None, "lease_expires": None, "in_flight": False}


def _q_finish(job_id: int, owner: str | None, token: str | None, result: Any, now: _dt.datetime) -> sa.Update:
    # lease_token stays on the row: a finalize retried after an ambiguous COMMIT recognises
    # its own earlier success by it (see _finalize_rows).
    return (
        _update_jobs()
        .where(*_fence(job_id, owner, token))
        .values(state="done", result=result, error=None, finished_at=now, updated_at=now, **_CLEAR_LEASE)
    )


def _q_fail(
    job_id: int, owner: str | None, token: str | None, *, state: str, error: str, now: _dt.datetime, run_after: _dt.datetime | None
) -> sa.Update:
    values: dict[str, Any] = {"state": state, "error": error, "updated_at": now, **_CLEAR_LEASE}
    if state == "ready":
        values["lease_token"] = None
        values["run_after"] = run_after or now
    else:
        values["finished_at"] = now
    return _update_jobs().where(*_fence(job_id, owner, token)).values(**values)


def _q_finish_batch(d: _Dialect, outcomes: Sequence[_Outcome], owner: str | None, token: str | None,
                    now: _dt.datetime) -> tuple[sa.Update, dict[str, Any] | None]:
    """Finish many jobs of one lease in one statement, with its parameters: each row gets its
    own result (a CASE on the id when they differ) and the same fence as _q_finish. One round
    trip on every driver (an executemany is one round trip per row on PyMySQL). When every row
    gets the same result (no-op handlers: all None) the statement is prebuilt and only the
    parameters are new, so a tick pays no statement construction for its finalize."""
    ids = [o.job_id for o in outcomes]
    first = outcomes[0].result
    if all(o.result is None for o in outcomes) or len({json.dumps(o.result, sort_keys=True) for o in outcomes}) == 1:
        return _q_finish_batch_same(d), {"b_ids": ids, "b_owner": owner, "b_token": token, "b_result": first,
                                         "b_now": now}
    result = sa.case({o.job_id: sa.literal(o.result, _JSONCOL) for o in outcomes}, value=_c.id)
    return (
        _update_jobs()
        .where(_id_in(d, _c.id, ids), _state_is(*_LIVE), _c.cancel_requested == sa.false(),
               _c.lease_owner == owner, _c.lease_token == token)
        .values(state="done", result=result, error=None, finished_at=now, updated_at=now, **_CLEAR_LEASE)
    ), None


def _q_finish_batch_same(d: _Dialect) -> sa.Update:
    # _q_finish_batch's statement when all rows get one result; keep the two in sync.
    return _prebuilt(d, "finish_batch_same", lambda: (
        _update_jobs()
        .where(_id_in(d, _c.id, sa.bindparam("b_ids", type_=_pg.ARRAY(sa.BigInteger))), _state_is(*_LIVE),
               _c.cancel_requested == sa.false(), _c.lease_owner == sa.bindparam("b_owner", type_=sa.String(200)),
               _c.lease_token == sa.bindparam("b_token", type_=sa.String(32)))
        .values(state="done", result=sa.bindparam("b_result", type_=_JSONCOL), error=None, finished_at=sa.bindparam("b_now", type_=_TS),
                updated_at=sa.bindparam("b_now", type_=_TS), **_CLEAR_LEASE)
    ))


def _q_finish_recorded(d: _Dialect) -> sa.Select[Any]:
    """_q_finish_batch_same and _q_record_done as one statement (d.dml_ctes), same parameters
    plus ``b_worker``: one row, the rows finished. Keep in sync with the two.

    The dependents' count is not in it: a statement reads with one snapshot, taken before its
    UPDATE waits for an enqueue's share lock on a finishing job, so it missed the dependency
    row that enqueue committed, and the dependent waited forever (_settle counts them in a
    statement of its own, after this one)."""
    def build() -> sa.Select[Any]:
        fin = _q_finish_batch_same(d).returning(_c.id, _c.attempts, _c.started_at).cte("fin")
        rec = sa.insert(_attempts).from_select(
            ["job_id", "attempt", "worker_id", "started_at", "finished_at", "outcome", "error"],
            sa.select(fin.c.id, fin.c.attempts, sa.bindparam("b_worker", type_=sa.String(200)), fin.c.started_at,
                      sa.bindparam("b_now", type_=_TS), sa.literal("done", sa.String(16)), sa.null()),
        ).returning(_attempts.c.job_id).cte("rec")
        return sa.select(sa.select(sa.func.count()).select_from(rec).scalar_subquery().label("n"))
    return _prebuilt(d, "finish_recorded", build)


def _q_landed(ids: Sequence[int], now: _dt.datetime, tokens: Iterable[str | None]) -> sa.Select[Any]:
    # After a batch finish refused some rows: the rows it did finish carry exactly this `now`.
    return sa.select(_c.id, _c.lease_token).where(_c.id.in_(ids), _state_is("done"), _c.finished_at == now,
                                                  _c.lease_token.in_(set(tokens)))


def _q_done_under(job_id: int, token: str) -> sa.Select[Any]:
    # A retried finalize whose first COMMIT landed finds the row done under its own token.
    return sa.select(_c.id).where(_c.id == job_id, _state_is("done"), _c.lease_token == token)


def _q_attempts(job_id: int, owner: str) -> sa.Select[Any]:
    return sa.select(_c.attempts, _c.max_attempts).where(_c.id == job_id, _state_is(*_LIVE), _c.lease_owner == owner)


_Q_FREE_SLOT = sa.delete(_slots).where(_slots.c.token == sa.bindparam("b_token"), _slots.c.job_id == sa.bindparam("b_id"))


def _q_cancel_live(job_id: int, owner: str | None, token: str | None, now: _dt.datetime) -> sa.Update:
    return (
        _update_jobs()
        .where(*_fence(job_id, owner, token, cancelled=True))
        .values(state="cancelled", error="cancelled while running", finished_at=now, updated_at=now, **_CLEAR_LEASE)
    )


def _q_release(job_id: int, owner: str | None, token: str | None, now: _dt.datetime) -> sa.Update:
    # A graceful release is not a failed attempt: the attempt the claim counted is given back.
    return (
        _update_jobs()
        .where(*_fence(job_id, owner, token))
        .values(state="ready", attempts=_c.attempts - 1, lease_token=None, run_after=now, updated_at=now, **_CLEAR_LEASE)
    )


def _q_record_attempts(d: _Dialect, ended: Sequence[tuple[int, str, str | None]], now: _dt.datetime
                       ) -> tuple[sa.Insert, dict[str, Any] | None]:
    """One history row per attempt just ended by this transaction's fenced writes, (job id,
    outcome, worker id) each, as one INSERT ... SELECT, with its parameters: the attempt
    number, start and error come from the job rows, which this transaction has just written
    and still holds. Keep in sync with the finalize/fail/release builders: done clears
    ``error`` (so none is copied), release gives the attempt back (so its number is one more
    than the row's), and a release leaves the previous attempt's error on the row (not this
    attempt's). A batch of one worker's finishes (every tick of a busy worker) is prebuilt."""
    ids = [i for i, _o, _w in ended]
    workers = {w for _i, _o, w in ended}
    if len(workers) == 1 and all(o == "done" for _i, o, _w in ended):
        return _q_record_done(d), {"b_ids": ids, "b_worker": next(iter(workers)), "b_now": now}

    def per_row(values: Mapping[int, Any], type_: Any) -> Any:
        if len(set(values.values())) == 1:
            return sa.literal(next(iter(values.values())), type_)
        return sa.case({i: sa.literal(v, type_) for i, v in values.items()}, value=_c.id)

    released = [i for i, o, _w in ended if o == "released"]
    silent = [i for i, o, _w in ended if o in ("done", "released")]
    attempt: Any = _c.attempts if not released else sa.case((_c.id.in_(released), _c.attempts + 1), else_=_c.attempts)
    error: Any = _c.error if not silent else sa.case((_c.id.in_(silent), sa.null()), else_=_c.error)
    rows = sa.select(_c.id, attempt, per_row({i: w for i, _o, w in ended}, sa.String(200)), _c.started_at,
                     sa.literal(now, _TS), per_row({i: o for i, o, _w in ended}, sa.String(16)), error
                     ).where(_id_in(d, _c.id, ids))
    return sa.insert(_attempts).from_select(
        ["job_id", "attempt", "worker_id", "started_at", "finished_at", "outcome", "error"], rows), None


def _q_record_done(d: _Dialect) -> sa.Insert:
    # _q_record_attempts for finishes by one worker: outcome done, no error. Keep in sync.
    return _prebuilt(d, "record_done", lambda: sa.insert(_attempts).from_select(
        ["job_id", "attempt", "worker_id", "started_at", "finished_at", "outcome", "error"],
        sa.select(_c.id, _c.attempts, sa.bindparam("b_worker", type_=sa.String(200)), _c.started_at,
                  sa.bindparam("b_now", type_=_TS), sa.literal("done", sa.String(16)), sa.null())
        .where(_id_in(d, _c.id, sa.bindparam("b_ids", type_=_pg.ARRAY(sa.BigInteger))))))


def _q_attempt_history(job_id: int, *, last: bool = False) -> sa.Select[Any]:
    # Through ix_jobq_attempts_job (job_id, id): oldest first, or only the newest.
    a = _attempts.c
    stmt = sa.select(a.job_id, a.attempt, a.worker_id, a.started_at, a.finished_at, a.outcome, a.error).where(a.job_id == job_id)
    return stmt.order_by(a.id.desc()).limit(1) if last else stmt.order_by(a.id)


# ---- heartbeat, checkpoint and progress -------------------------------------------------------


def _q_checkpoint(job_id: int, owner: str, token: str, state: Any, progress: Any, now: _dt.datetime) -> sa.Update:
    """Store a handler's checkpoint (and its latest progress, if any), fenced by its dispatch's
    lease (0 rows: the lease is lost)."""
    extra = {} if progress is None else {"progress": progress}
    return (_update_jobs().where(_c.id == job_id, _state_is(*_LIVE), _c.lease_owner == owner, _c.lease_token == token)
            .values(checkpoint=state, updated_at=now, **extra))


def _q_progress(job_id: int, token: str, progress: Any) -> sa.Update:
    """A handler's latest progress, carried by the heartbeat and fenced as it is."""
    return _update_jobs().where(_c.id == job_id, _c.lease_token == token, _state_is(*_LIVE)).values(progress=progress)


def _q_running_progress(limit: int) -> sa.Select[Any]:
    """In-flight jobs that reported progress (jobq status), through the in-flight index."""
    return (sa.select(_c.id, _c.type, _c.group_key, _c.progress)
            .where(_c.in_flight == _TRUE, _c.progress.is_not(None)).order_by(_c.id).limit(limit))


def _q_heartbeat(ids: list[int], token: str, now: _dt.datetime, expires: _dt.datetime) -> sa.Update:
    return (
        _update_jobs()
        .where(_c.id.in_(ids), _c.lease_token == token, _state_is(*_LIVE))
        .values(lease_expires=expires, heartbeat_at=now)
    )


def _q_held(ids: list[int], token: str) -> sa.Select[Any]:
    return sa.select(_c.id, _c.cancel_requested).where(_c.id.in_(ids), _c.lease_token == token, _state_is(*_LIVE))


# ---- builders for the worker ------------------------------------------------------------------


def _q_reclaimed(ids: list[int]) -> sa.Select[Any]:
    # What the worker logs per reclaimed job; attempts is the attempt whose lease expired.
    return sa.select(_c.id, _c.type, _c.group_key, _c.attempts, _c.state).where(_c.id.in_(ids)).order_by(_c.id)


def _q_busy_or_due(types: Sequence[str], now: _dt.datetime) -> sa.CompoundSelect:
    # run_until_idle's test: work of these types that is due, leased or running, or ready again
    # after an attempt (a retry backing off is part of running the job). A job first scheduled
    # for later is not due: it must not keep the worker ticking. Two probes, one per partial
    # index (ready rows; in-flight rows, which are exactly the leased and running ones): one
    # WHERE with an OR over both scanned the whole table, finished history included (16 ms at
    # 100k done rows on SQLite, on every idle check).
    # A paused group's ready jobs are no claimable work: no tick can start them until someone
    # resumes the group, so they must not keep the worker ticking (one primary-key probe of
    # jobq_groups per due row).
    typed = _c.type.in_(list(types))
    paused = sa.exists().where(_groups.c.group_key == _c.group_key, _groups.c.paused == _TRUE)
    # Ordered as the ready index is, so that statistics gathered while every row was ready
    # cannot make a table scan look cheaper (SQLite).
    due = (sa.select(_c.id).where(_state_is("ready"), sa.or_(_c.run_after <= now, _c.attempts > 0), typed, ~paused)
           .order_by(_c.group_key).limit(1))
    live = sa.select(_c.id).where(_c.in_flight == _TRUE, _state_is(*_LIVE), typed).limit(1)
    return sa.union_all(due.subquery().select(), live.subquery().select())


def _q_hold_slots() -> sa.Insert:
    # One row per dispatch whose handler outlives its lease (executemany over the rows).
    return sa.insert(_slots)


def _q_renew_held_slots(worker_id: str, expires: _dt.datetime) -> sa.Update:
    return sa.update(_slots).where(_slots.c.worker_id == worker_id).values(expires=expires)


# ---- reclaim and housekeeping -----------------------------------------------------------------


_Q_SWEEP_SLOTS = sa.delete(_slots).where(_slots.c.expires <= sa.bindparam("b_now", type_=_TS))
_Q_SWEEP_STARTS = sa.delete(_starts).where(_starts.c.started_at < sa.bindparam("b_before", type_=_TS))


def _reclaim_error(kind: str) -> Any:
    # The text a reclaimed row's error (and its attempt's history row) gets; kind: "cancelled"
    # (cancel requested), "dead" (that was its last attempt) or "retry".
    if kind == "cancelled":
        return sa.literal("cancelled; its worker stopped heartbeating", _TEXT)
    if kind == "dead":
        return _text_concat("lease expired on attempt ", _c.attempts, " of ", _c.max_attempts,
                            ": the worker died or lost its lease every time (poison job?)")
    return _text_concat("lease expired on attempt ", _c.attempts, " (worker crashed or stalled); reclaimed")


def _q_record_reclaims(ids: list[int], now: _dt.datetime, kind: str) -> sa.Insert:
    # Run just BEFORE the reclaim's UPDATE, with its condition, on rows the sweep holds locked
    # (_q_expired's lock_skip; SQLite's write lock): the same rows, still naming their holder.
    rows = sa.select(_c.id, _c.attempts, _c.lease_owner, _c.started_at, sa.literal(now, _TS),
                     sa.literal("reclaimed", sa.String(16)), _reclaim_error(kind)
                     ).where(_c.id.in_(ids), _state_is(*_LIVE), _c.lease_expires < now)
    return sa.insert(_attempts).from_select(
        ["job_id", "attempt", "worker_id", "started_at", "finished_at", "outcome", "error"], rows)


def _q_reclaim_cancelled(ids: list[int], now: _dt.datetime) -> sa.Update:
    # As _q_reclaim: a row that finished or was re-leased since it was read is left alone.
    return (
        _update_jobs().where(_c.id.in_(ids), _state_is(*_LIVE), _c.lease_expires < now)
        .values(state="cancelled", error=_reclaim_error("cancelled"), finished_at=now,
                updated_at=now, **_CLEAR_LEASE)
    )


def _q_expired(d: _Dialect) -> sa.Select[Any]:
    """Expired leases (``b_now``), at most ``b_limit``, locked, skipping rows others hold.
    Prebuilt: every tick's sweep runs it."""
    # Ordered as ix_jobs_in_flight is (group_key, then rowid on SQLite): ORDER BY id alone let
    # SQLite, after an ANALYZE taken while nothing was in flight, prefer a rowid scan of the
    # whole table (tests/core/test_plans.py).
    return _prebuilt(d, "expired", lambda: d.lock_skip(
        sa.select(_c.id, _c.attempts, _c.max_attempts, _c.lease_token, _c.cancel_requested)
        .where(_c.in_flight == _TRUE, _state_is(*_LIVE), _c.lease_expires < sa.bindparam("b_now", type_=_TS))
        .order_by(_c.group_key, _c.id)
        .limit(sa.bindparam("b_limit", type_=sa.Integer))
    ))


def _q_reclaim(ids: list[int], now: _dt.datetime, *, dead: bool) -> sa.Update:
    # The sweep's condition is repeated in the UPDATE itself: a row that finished or was
    # re-leased since it was read is left alone.
    stmt = _update_jobs().where(_c.id.in_(ids), _state_is(*_LIVE), _c.lease_expires < now)
    if dead:
        return stmt.values(
            state="failed",
            finished_at=now,
            updated_at=now,
            error=_reclaim_error("dead"),
            **_CLEAR_LEASE,
        )
    return stmt.values(
        state="ready",
        lease_token=None,
        run_after=now,
        updated_at=now,
        error=_reclaim_error("retry"),
        **_CLEAR_LEASE,
    )


# ---- prune ------------------------------------------------------------------------------------


def _prunable(states: Sequence[str], cutoff: _dt.datetime) -> list[sa.ColumnElement[bool]]:
    """A finished job older than ``cutoff`` that nothing still needs: no unfinished dependent,
    no unfinished container, no remaining child. prune's read and its locked re-check share it."""
    dependent = sa.alias(_jobs, "dependent")
    parent = sa.alias(_jobs, "parent")
    child = sa.alias(_jobs, "child")
    return [
        # both literal: the first is ix_jobs_finished's predicate, spelled as the index spells
        # it (SQLite matches partial indexes by exact terms)
        _state_is(*TERMINAL), _state_is(*states), _c.finished_at < cutoff,
        ~sa.exists().where(_deps.c.depends_on_id == _c.id, dependent.c.id == _deps.c.job_id,
                           dependent.c.state.not_in(TERMINAL)),
        ~sa.exists().where(parent.c.id == _c.parent_id, parent.c.state.not_in(TERMINAL)),
        ~sa.exists().where(child.c.parent_id == _c.id),
    ]


def _q_prunable(states: Sequence[str], cutoff: _dt.datetime, batch: int) -> sa.Select[Any]:
    """A batch of prunable jobs, oldest first, without locks. Found through ix_jobs_finished
    (keep in sync)."""
    return sa.select(_c.id).where(*_prunable(states, cutoff)).order_by(_c.finished_at).limit(batch)


def _q_lock_prunable(d: _Dialect, ids: Sequence[int], states: Sequence[str], cutoff: _dt.datetime) -> sa.Select[Any]:
    """The jobs of a batch _q_prunable read that are still prunable, locked in id order until
    they are deleted: a retry that re-opened one after the read (and committed) is seen here
    (a locking read sees the latest committed row, at READ COMMITTED on every server), and one
    that comes later waits for the delete and finds no job."""
    return d.lock_wait(sa.select(_c.id).where(_c.id.in_(ids), *_prunable(states, cutoff)).order_by(_c.id))


def _q_delete_edges(ids: Sequence[int]) -> sa.Delete:
    return sa.delete(_deps).where(sa.or_(_deps.c.job_id.in_(ids), _deps.c.depends_on_id.in_(ids)))


def _q_delete_attempts(ids: Sequence[int]) -> sa.Delete:
    return sa.delete(_attempts).where(_attempts.c.job_id.in_(ids))


def _q_delete_jobs(ids: Sequence[int]) -> sa.Delete:
    return sa.delete(_jobs).where(_c.id.in_(ids))


# ---- shared expressions -----------------------------------------------------------------------


def _text_concat(*parts: Any) -> sa.ColumnElement[str]:
    # String + renders || on PostgreSQL/SQLite and concat() on MySQL/MariaDB.
    out: sa.ColumnElement[str] = sa.literal("")
    for p in parts:
        out = out + (sa.literal(p) if isinstance(p, str) else sa.cast(p, sa.String(20)))
    return out


#: Wake LISTENing workers at commit (_Dialect.notify), prebuilt: run on the cursor it costs
#: about half the client CPU of a text() built per call (57 against 105 us on psycopg).
_NOTIFY_CALL = "pg_notify(:b_channel, '')"
_Q_NOTIFY = sa.text(f"SELECT {_NOTIFY_CALL}").bindparams(sa.bindparam("b_channel", type_=sa.String()))


def _q_db_now(d: _Dialect) -> sa.TextClause:
    """The database clock's read (d.now_sql), prebuilt so it runs on the cursor."""
    return _prebuilt(d, "db_now", lambda: sa.text(d.now_sql or "SELECT NULL"))


def _q_db_now_notify(d: _Dialect) -> sa.TextClause:
    """_q_db_now and _Q_NOTIFY in one statement (d.notify_listen): an enqueue's first round trip
    also queues its wake-up."""
    return _prebuilt(d, "db_now_notify", lambda: sa.text(f"{d.now_sql}, {_NOTIFY_CALL}").bindparams(
        sa.bindparam("b_channel", type_=sa.String())))


# =============================================================================================
# Dialect support
# =============================================================================================
# The only place that branches on the database. Each engine is inspected once (_prepare) and
# described by a _Dialect: how to lock rows for a claim, which isolation level jobq's
# transactions use, how to read the database clock, and which errors are worth a retry.


_MIN_VERSIONS = {"postgresql": (12,), "mysql": (8, 0, 1), "mariadb": (10, 6)}


@dataclasses.dataclass(frozen=True)
class _Dialect:
    """What jobq needs to know about one engine, decided once by _prepare (_capabilities) so
    runtime code asks a question (``d.returning``) instead of testing a name. Adding an engine
    means one new row in _capabilities plus its tests."""

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
    def statement_key(self) -> str:
        """What a prebuilt statement may depend on: _prebuilt keeps one per engine family,
        since capabilities are decided per family (and a server version adds none yet)."""
        return self.family

    @property
    def is_sqlite(self) -> bool:
        # kept for callers that predate the capability fields: "no row locks, one writer"
        return not self.row_locks

    @property
    def is_mysql_family(self) -> bool:
        return self.isolation_stmt

    def lock_skip(self, stmt: sa.Select[Any]) -> sa.Select[Any]:
        """Exclusive row locks that skip rows another transaction holds (the claim read)."""
        if not self.row_locks:
            return stmt  # SQLite: BEGIN IMMEDIATE already holds the database's write lock
        # PostgreSQL: FOR NO KEY UPDATE: plain FOR UPDATE would block inserts of job_deps rows
        # whose foreign key references the claimed job. MySQL/MariaDB: exclusive only, since
        # SQLAlchemy renders read=True+skip_locked as "LOCK IN SHARE MODE SKIP LOCKED", which
        # Oracle MySQL rejects (sqlalchemy#10134).
        return stmt.with_for_update(skip_locked=True, key_share=self.key_share_locks)

    def lock_wait(self, stmt: sa.Select[Any], *, via: str | None = None) -> sa.Select[Any]:
        """Exclusive row locks that wait (the cap's serialisation point). Rows named by id are
        read by the primary key, others through the index ``via`` (see index_hints)."""
        if not self.row_locks:
            return stmt
        if via is None and _pins_ids(stmt.whereclause):
            via = "PRIMARY"
        if via is not None and self.index_hints:
            stmt = stmt.with_hint(_jobs, f"FORCE INDEX ({via})")
        return stmt.with_for_update(key_share=self.key_share_locks)

    def lock_share(self, stmt: sa.Select[Any]) -> sa.Select[Any]:
        """Shared row locks: upstream rows read by enqueue, so a concurrent finalize waits."""
        return stmt.with_for_update(read=True) if self.row_locks else stmt

    def db_now(self, conn: Connection, *, wake: bool = False) -> _dt.datetime:
        """The database's current time, naive UTC, microsecond precision. With ``wake``, the
        same statement also queues :meth:`notify`'s wake-up (one round trip fewer for an
        enqueue whose jobs are all born ready)."""
        if self.now_sql is None:  # embedded: the database's clock is this machine's clock
            return _utcnow()
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
        """Storage settings for a high-churn queue table (PostgreSQL): room on each page for
        HOT updates (heartbeats and finalizes rewrite rows in place when no indexed column
        changes and the page has space), and autovacuum that starts early instead of after 20%
        of a large table has turned into dead rows."""
        if self.tunable:
            conn.exec_driver_sql(
                "ALTER TABLE jobs SET (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02, "
                "autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_limit = 2000)"
            )

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
        """Statements that open each jobq transaction (MySQL/MariaDB: its isolation level)."""
        if self.isolation_stmt and self.isolation:
            # For this transaction only, as a statement inside it. The session-level setting
            # (execution_options) is undone by the pool when the connection is checked in,
            # with a round trip outside any error handling: a cut landing between commit and
            # close raised the driver's raw error out of close(), after the commit, and leaked
            # the pool slot.
            conn.exec_driver_sql(f"SET TRANSACTION ISOLATION LEVEL {self.isolation}")

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
        duplicate, and leaves the transaction usable."""
        if self.on_conflict is not None:
            stmt = _prebuilt(self, "insert_unique", lambda: self.on_conflict(_jobs).on_conflict_do_nothing(
                index_elements=[_c.unique_key], index_where=sa.text(_UNIQUE_LIVE_WHERE)).returning(_c.id))
            return conn.execute(stmt, dict(row)).scalar()
        try:
            return int(conn.execute(_Q_INSERT_JOB, dict(row)).inserted_primary_key[0])  # type: ignore[index]
        except sa.exc.IntegrityError as exc:
            if getattr(exc.orig, "args", (None,))[0] == 1062:  # ER_DUP_ENTRY: only this statement failed
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

    def retryable(self, exc: BaseException) -> bool:
        """Errors after which the whole transaction was (or must be) rolled back and may rerun."""
        orig = getattr(exc, "orig", None)
        if self.row_locks:
            # psycopg names a SQLSTATE; PyMySQL an errno first in args (and, in recent versions,
            # a SQLSTATE too: 1213 carries '40001', 1205 'HY000'), so look at every code given.
            args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
            codes = {getattr(orig, "sqlstate", None), getattr(orig, "pgcode", None), args[0] if args else None}
            return bool(codes & self.retry_codes)
        text = str(orig or exc).lower()
        return "database is locked" in text or "database is busy" in text or "database table is locked" in text


def _capabilities(family: str, version: tuple[int, ...]) -> _Dialect:
    """One row per engine: everything jobq branches on is decided here."""
    if family == "postgresql":
        return _Dialect(family, version, partial_indexes=True, array_params=True, dml_ctes=True, notify_listen=True,
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
        return _Dialect(family, version, returning=family == "mariadb", isolation_stmt=True,
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
    return _Dialect(family, version, partial_indexes=True, local_clock=True, row_locks=False, isolation=None,
                    rowid_reuse=True, on_conflict=_sqlite.insert, compound_limits=False,
                    json_id_lists=version >= (3, 38), scan_reads_window=version >= (3, 38), span_first=True)


@compiles(_JobsUpdate)
def _render_jobs_update(stmt: _JobsUpdate, compiler: Any, **kw: Any) -> str:
    """UPDATE jobs, by the primary key where it names its rows by id and the engine needs the
    hint (_Dialect.index_hints)."""
    sql: str = compiler.visit_update(stmt, **kw)
    if _capabilities(_family(compiler.dialect), ()).index_hints and _pins_ids(stmt.whereclause):
        head = f"UPDATE {compiler.preparer.format_table(_jobs)} "
        if not sql.startswith(head):
            raise AssertionError(f"jobq: unexpected UPDATE text: {sql[:60]!r}")
        sql = f"{head}FORCE INDEX (PRIMARY) {sql[len(head):]}"
    return sql


#: The lock concurrent create_schema calls queue on: a PostgreSQL advisory lock id ("jobq" in
#: ASCII) and a MySQL/MariaDB GET_LOCK name.
_SCHEMA_LOCK_ID = 0x6A6F6271
_SCHEMA_LOCK_NAME = "jobq_schema"


def _listen_supported(engine: Engine) -> bool:
    """LISTEN needs PostgreSQL through psycopg (3), whose connections jobq opens itself."""
    return engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg"


def _missing_database_file(engine: Engine) -> str | None:
    """The path of an embedded (SQLite) database file that does not exist yet, else None: a
    connection there would create an empty file (the CLI refuses that for a mistyped path)."""
    url = engine.url
    path = url.database
    if (engine.dialect.name == "sqlite" and path and path != ":memory:" and not path.startswith("file:")
            and "uri" not in url.query and not os.path.exists(path)):
        return path
    return None


def _local_clock(engine: Engine) -> bool:
    """Whether this engine's clock is this machine's (decided without a connection)."""
    return engine.dialect.name == "sqlite"


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
    need = _MIN_VERSIONS[family]
    if version < need:
        label = {"postgresql": "PostgreSQL", "mysql": "MySQL", "mariadb": "MariaDB"}[family]
        found = ".".join(map(str, version)) or "unknown"
        raise UnsupportedDatabase(
            f"{label} {found} found; jobq needs {label} {'.'.join(map(str, need))} or newer "
            "(for FOR UPDATE SKIP LOCKED)"
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
    name = engine.dialect.name
    if name not in ("postgresql", "mysql", "mariadb", "sqlite"):
        raise UnsupportedDatabase(f"jobq supports SQLite, PostgreSQL, MySQL and MariaDB, not {name!r}")
    if name == "sqlite":
        if engine.dialect.driver not in ("pysqlite", "aiosqlite"):
            raise UnsupportedDatabase(f"jobq's SQLite support needs the pysqlite (or aiosqlite) driver, not {engine.dialect.driver!r}")
        import sqlite3

        version: tuple[int, ...] = sqlite3.sqlite_version_info
        if version < (3, 25):
            raise UnsupportedDatabase(f"SQLite {sqlite3.sqlite_version} found; jobq needs 3.25 or newer")
        family = "sqlite"
    else:
        # Connect outside the lock: with an async engine this awaits, and another task of the
        # same event loop may be preparing the same engine.
        version = _server_version(engine)
        family = _family(engine.dialect)
        _check_version(family, version)
    with _DIALECTS_LOCK:
        d = _DIALECTS.get(engine)
        if d is None:
            if family == "sqlite":
                _install_sqlite_hooks(engine)
            d = _DIALECTS[engine] = _capabilities(family, version)
        return d


def _family(dialect: sa.Dialect) -> str:
    """The engine family of a SQLAlchemy dialect (one that has connected): mysql+pymysql://
    URLs that reach a MariaDB server report "mysql" with is_mariadb."""
    return "mariadb" if dialect.name == "mariadb" or getattr(dialect, "is_mariadb", False) else dialect.name


def _parent_fk_ddl(*, dialect: sa.Dialect, **kw: Any) -> bool:
    """Whether create_schema creates jobs.parent_id's foreign key on this dialect (_Dialect.parent_fk)."""
    return _capabilities(_family(dialect), ()).parent_fk


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
    if not d.is_sqlite or engine.dialect.is_async:
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
    with _sqlite_writer(engine, d), engine.connect() as conn:
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

        from sqlalchemy.util import await_only

        await_only(asyncio.sleep(seconds))
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
            with _sqlite_writer(engine, d), engine.connect() as conn:
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


# ---- the hot path's statements on the DBAPI cursor ---------------------------------------------


class _Direct:
    """A prebuilt statement compiled once for one dialect, to run on the DBAPI cursor of the
    caller's connection: ``Connection.execute`` spent 55-75 us of client CPU per statement on a
    cache key, an execution context and a result object around psycopg's 60 (measured on a
    claim's statements), five times a tick. What it did that matters is done here too: bind and
    result processors, the dialect's paramstyle, and errors raised as SQLAlchemy's DBAPIError
    with the connection invalidated on a disconnect (_transaction's retry rules read both)."""

    __slots__ = ("stmt", "sql", "compiled", "binds", "order", "expanding", "int_lists", "literal_order", "columns",
                 "results")

    def __init__(self, stmt: Any, compiled: Any, binds: dict[str, Callable[[Any], Any]], order: tuple[str, ...] | None):
        self.stmt = stmt  # kept alive: the cache is keyed on its id
        self.sql: str = compiled.string
        self.compiled = compiled
        self.binds = binds
        self.order = order  # positional paramstyles: the parameters' order; None: by name
        # Expanding IN lists (MySQL/MariaDB's id lists): rendered per call for the list's
        # length, as Connection.execute renders them (SQLCompiler.construct_expanded_state),
        # or as integer literals (int_lists, below).
        self.expanding = bool(compiled.post_compile_params)
        # The expanding lists that may be rendered as integer literals (d.literal_int_lists):
        # by name, with the placeholder SQLAlchemy leaves in the text for each. Set by
        # _direct_form; empty: every list is expanded by SQLAlchemy.
        self.int_lists: tuple[tuple[str, str], ...] = ()
        # A positional paramstyle's order with the lists written as literals (mysqlclient).
        self.literal_order: tuple[str, ...] | None = None
        # The result columns' types (a text() without .columns() has none: its values come as
        # the driver gives them, as from Connection.execute), and (position, result processor)
        # for each column that converts, resolved on the first execution from the cursor's
        # type codes (as SQLAlchemy does); empty: none converts.
        self.columns = [c.type.dialect_impl(compiled.dialect) for c in getattr(stmt, "selected_columns", ())]
        self.results: list[tuple[int, Callable[[Any], Any]]] | None = None if self.columns else []

    def rows(self, cur: Any) -> list[Any]:
        got = cur.fetchall()
        if self.results is None:
            desc = cur.description or ()
            if len(desc) != len(self.columns):
                raise JobqError(f"{len(desc)} columns where {len(self.columns)} were compiled: {self.sql[:80]}")
            procs = [t.result_processor(self.compiled.dialect, d[1]) for t, d in zip(self.columns, desc, strict=True)]
            self.results = [(i, f) for i, f in enumerate(procs) if f is not None]
        if not self.results:
            return list(got)
        out = []
        for row in got:  # only the columns that convert (MySQL/MariaDB: the lease's timeout, 1 of 9)
            values = list(row)
            for i, f in self.results:
                values[i] = f(values[i])
            out.append(tuple(values))
        return out


_DIRECT: weakref.WeakKeyDictionary[Any, dict[int, _Direct | None]] = weakref.WeakKeyDictionary()
#: Most statements compiled for the cursor per dialect: the hot path's prebuilt ones are a few
#: dozen; anything past this runs through Connection.execute.
_DIRECT_FORMS = 256


def _direct_form(dialect: Any, stmt: Any) -> _Direct | None:
    """``stmt`` compiled for ``dialect``, or None where only Connection.execute runs it right:
    literal binds rendered at execution, bind names that need escaping, a driver that wants
    input sizes, or column defaults computed in Python."""
    forms = _DIRECT.get(dialect)
    if forms is None:
        forms = _DIRECT[dialect] = {}
    # A form holds its statement, so its id is not reused; at worst a reused id finds None and
    # its statement runs through Connection.execute.
    key = id(stmt)
    if key in forms:
        return forms[key]
    if len(forms) >= _DIRECT_FORMS:
        return None  # a statement built per call would grow the cache without bound
    form: _Direct | None = None
    compiled = stmt.compile(dialect=dialect)
    # Python-side column defaults (prefetch) are computed by Connection.execute's execution
    # context: a statement that leaves such a column to its default runs there.
    if (all(b.expanding for b in compiled.post_compile_params) and not compiled.literal_execute_params
            and not compiled.escaped_bind_names and dialect.bind_typing is not BindTyping.SETINPUTSIZES
            and not compiled.insert_prefetch and not compiled.update_prefetch):
        binds = {name: proc for b, name in compiled.bind_names.items()
                 if (proc := b.type.dialect_impl(dialect).bind_processor(dialect)) is not None}
        form = _Direct(stmt, compiled, binds, tuple(compiled.positiontup) if compiled.positional else None)
        lists = compiled.post_compile_params
        if (lists and _capabilities(_family(dialect), ()).literal_int_lists
                and all(b.type.dialect_impl(dialect).bind_processor(dialect) is None for b in lists)):
            marks = tuple((b.key, f"__[POSTCOMPILE_{b.key}]") for b in lists)
            if all(mark in form.sql for _name, mark in marks):  # else not the text this was written for
                form.int_lists = marks
                if form.order is not None:  # positional (mysqlclient): each list holds one place
                    names = {name for name, _mark in marks}
                    form.literal_order = tuple(k for k in form.order if k not in names)
    forms[key] = form
    return form


def _direct(conn: Connection) -> bool:
    """Whether statements may bypass Connection.execute on ``conn``: not when anything watches
    its statements (cursor-execute listeners, SQLAlchemy's statement log, schema translation)."""
    return not (conn.dispatch.before_cursor_execute or conn.dispatch.after_cursor_execute
                or conn.engine.logger.isEnabledFor(logging.INFO)
                or "schema_translate_map" in conn.get_execution_options())


_INT_ONLY = {int}  # exactly int: a bool is an int too, and str(True) is no literal for 1


def _int_lists_sql(form: _Direct, params: Mapping[str, Any]) -> str | None:
    """``form``'s SQL with its expanding lists written out as integer literals, exactly as the
    driver would render them; None unless every list is non-empty and holds only ints (an
    empty list, a bool or anything else goes through SQLAlchemy's expansion)."""
    sql = form.sql
    for name, mark in form.int_lists:
        ids = params.get(name)
        # set(map(type, ...)): a C loop; a generator over the ids cost 1 us per 64 on the hot path
        if not ids or not isinstance(ids, (list, tuple)) or set(map(type, ids)) != _INT_ONLY:
            return None
        sql = sql.replace(mark, ", ".join(map(str, ids)))  # as SQLAlchemy joins the placeholders
    return sql


def _statement_args(form: _Direct, params: Mapping[str, Any]) -> tuple[str, Any]:
    """The SQL text and the driver's arguments (a dict, or a tuple for a positional
    paramstyle) that run ``form`` with ``params``, as Connection.execute would send them."""
    sql, order = form.sql, form.order
    literal = _int_lists_sql(form, params) if form.int_lists else None
    if form.expanding and literal is None:
        state = form.compiled.construct_expanded_state(params)
        sql, values, order = state.statement, dict(state.parameters), state.positiontup
        for name, proc in state.processors.items():  # the lists' elements
            values[name] = proc(values[name])
        for name, proc in form.binds.items():
            if name in values:  # not an expanded list
                values[name] = proc(values[name])
    else:  # no lists, or every list written into the SQL as literals
        if literal is not None:
            sql, order = literal, form.literal_order
        values = form.compiled.construct_params(params)
        for name, _mark in form.int_lists:
            del values[name]
        for name, proc in form.binds.items():
            values[name] = proc(values[name])
    return sql, values if order is None else tuple([values[k] for k in order])


def _on_cursor(conn: Connection, form: _Direct, params: Mapping[str, Any], rows: bool) -> Any:
    """Run ``form`` with ``params`` on a cursor of ``conn``'s DBAPI connection, inside its
    transaction (begun here if none is, as Connection.execute begins one): the rows as tuples
    (``rows``), else the row count."""
    sql, args = _statement_args(form, params)
    if not conn.in_transaction():
        # Autobegin with SQLAlchemy's own method (2.0+), as Connection.execute does, and by its
        # rule: not while the transaction is beginning, when SQLite's BEGIN hook runs here. A
        # statement on the caller's Connection (an enqueue) must be inside the transaction
        # its commit() commits.
        conn._autobegin()
    dbapi_conn = conn.connection
    cur = dbapi_conn.cursor()
    try:
        cur.execute(sql, args)
        return form.rows(cur) if rows else cur.rowcount
    except Exception as exc:
        base = conn.dialect.loaded_dbapi.Error
        if not isinstance(exc, base):
            raise
        lost = conn.dialect.is_disconnect(exc, dbapi_conn.dbapi_connection, cur)
        if lost:
            conn.invalidate(exc)
        raise sa.exc.DBAPIError.instance(sql, args, exc, base, connection_invalidated=lost,
                                          dialect=conn.dialect) from exc
    except BaseException:
        conn.invalidate()  # interrupted mid-statement: the connection's state is unknown
        raise
    finally:
        with contextlib.suppress(Exception):
            cur.close()


def _hot_rows(conn: Connection, stmt: Any, params: Mapping[str, Any]) -> list[Any]:
    """``conn.execute(stmt, params).all()`` for a prebuilt hot-path statement, on the DBAPI
    cursor where it can (_Direct); rows are read by position either way."""
    form = _direct_form(conn.dialect, stmt) if _direct(conn) else None
    if form is None:
        return list(conn.execute(stmt, params).all())
    return _on_cursor(conn, form, params, True)  # type: ignore[no-any-return]


def _hot_rowcount(conn: Connection, stmt: Any, params: Mapping[str, Any] | None) -> int:
    """``conn.execute(stmt, params).rowcount``, on the DBAPI cursor where it can (_hot_rows).
    Without ``params`` the statement was built for this call, its values in it: it runs
    through Connection.execute and is not cached."""
    form = None if params is None or not _direct(conn) else _direct_form(conn.dialect, stmt)
    if form is None or params is None:
        return int(conn.execute(stmt, params).rowcount)
    return int(_on_cursor(conn, form, params, False))


# =============================================================================================
# Scheduling policy (pure functions, no I/O)
# =============================================================================================

_K = TypeVar("_K")


def allocate(
    free: int,
    ready: Mapping[str, int],
    *,
    weights: Mapping[str, float] | None = None,
    in_flight: Mapping[str, int] | None = None,
    caps: Mapping[str, int] | None = None,
    last_start: Mapping[str, Any] | None = None,
) -> dict[str, int]:
    """Split ``free`` slots between groups by weight, counting the work they already run.

    The rule is weighted max-min fairness (water-filling) over *all* slots: each group with
    ready work aims at ``weight / sum(weights)`` of ``free + in flight``; a group that cannot use
    its share (too few ready jobs, its cap, or already over its share) leaves the rest to the
    others. Fractions are settled by largest remainder.

    No starvation: a group with ready work and nothing in flight is *idle*. When ``free`` is at
    least the number of idle groups, each idle group gets at least one slot; when it is
    smaller, the slots go to idle groups only, in turn: the one whose last start is oldest
    first (never-started first). So a backlogged group with nothing running is passed over by
    at most G - 1 slot grants, G being the number of groups with ready work. (A group that
    already runs work is not starving; giving it a slot regardless would undo the weights.)
    That slot is the one place where starvation freedom outranks the weights: when slots barely
    cover the groups and every group is idle at each claim (jobs shorter than a tick), shares
    tend to equal. Remaining ties go by turn, then group name, so the result is deterministic.

    Args:
        free: slots that may be filled now (>= 0).
        ready: group -> number of ready jobs.
        weights: group -> weight > 0 (default 1).
        in_flight: group -> jobs already running (default 0).
        caps: group -> most jobs the group may run at once (absent: no cap).
        last_start: group -> when it last started a job (any comparable; absent: never).

    Returns:
        group -> number of jobs to start (groups getting none are left out); the total is
        ``min(free, what the groups can take)``.
    """
    weights = weights or {}
    in_flight = in_flight or {}
    caps = caps or {}
    # Consulted only to take turns (scarce slots, remainder ties): the claim passes a mapping
    # that reads the start log when first asked (_LastStarts), so it is not tested for truth.
    last_start = {} if last_start is None else last_start
    room: dict[str, int] = {}
    for g, n in ready.items():
        cap = caps.get(g)
        limit = n if cap is None else min(n, cap - in_flight.get(g, 0))
        if limit > 0:
            room[g] = limit
    if free <= 0 or not room:
        return {}
    groups = sorted(room)
    w = {g: float(weights.get(g, 1.0)) for g in groups}
    f = {g: float(max(0, in_flight.get(g, 0))) for g in groups}

    def turn(g: str) -> tuple[Any, ...]:
        t = last_start.get(g)
        return (0, g) if t is None else (1, t, g)

    budget = min(free, sum(room.values()))
    if len(groups) == 1:
        return {groups[0]: budget}  # nothing to share (what the water-filling below gives)
    idle = [g for g in groups if f[g] == 0]
    if budget < len(idle):
        return {g: 1 for g in sorted(idle, key=turn)[:budget]}
    if budget == len(idle):  # exactly one slot per idle group: what the water-filling below gives
        return dict.fromkeys(idle, 1)
    floor1 = {g: 1 if f[g] == 0 else 0 for g in groups}  # one slot for each idle group first

    # Water level L: group g wants clamp(L * w_g - in_flight_g, floor1_g, room_g). Bisect L so
    # the wants add up to the budget; wants are continuous and increasing in L.
    def wants(level: float) -> dict[str, float]:
        return {g: min(float(room[g]), max(float(floor1[g]), level * w[g] - f[g])) for g in groups}

    terms = [(float(room[g]), float(floor1[g]), w[g], f[g]) for g in groups]  # wants(), summed without a dict
    lo, hi = 0.0, (budget + sum(f.values()) + 1.0) / min(w.values()) + 1.0
    for _ in range(64):  # ample for double precision
        mid = (lo + hi) / 2
        if sum([min(r, max(lo1, mid * wg - fg)) for r, lo1, wg, fg in terms]) < budget:
            lo = mid
        else:
            hi = mid
    share = wants(hi)
    out = {g: min(room[g], max(floor1[g], math.floor(share[g] + 1e-9))) for g in groups}
    left = budget - sum(out.values())
    # Largest remainder first; ties to the group whose turn it is.
    order = sorted(groups, key=lambda g: (-round(share[g] - math.floor(share[g] + 1e-9), 9), turn(g))) if left else []
    while left > 0:
        progressed = False
        for g in order:
            if left and out[g] < room[g]:
                out[g] += 1
                left -= 1
                progressed = True
        if not progressed:
            break
    return {g: n for g, n in out.items() if n}


def fair_share(
    candidates: Mapping[str, Sequence[_K]],
    free: int,
    *,
    weights: Mapping[str, float] | None = None,
    in_flight: Mapping[str, int] | None = None,
    caps: Mapping[str, int] | None = None,
    last_start: Mapping[str, Any] | None = None,
) -> list[_K]:
    """Choose which ready jobs to start: ``allocate`` per group, oldest first within a group.

    Args:
        candidates: group -> its ready jobs, oldest first.
        free, weights, in_flight, caps, last_start: as for :func:`allocate`.

    Returns:
        The chosen jobs, group by group in group-name order.
    """
    counts = allocate(free, {g: len(v) for g, v in candidates.items()}, weights=weights, in_flight=in_flight, caps=caps,
                      last_start=last_start)
    return [job for g in sorted(counts) for job in list(candidates[g])[: counts[g]]]


def backoff(attempt: int, *, base: float = 1.0, cap: float = 300.0, jitter: float = 0.1) -> float:
    """Seconds to wait before retry number ``attempt`` (1-based): ``base * 2**(attempt-1)``,
    capped at ``cap``, spread by +/- ``jitter`` (a fraction) so failed jobs do not retry in step."""
    delay = min(cap, base * (2 ** max(0, attempt - 1)))
    return max(0.0, delay * (1 + random.uniform(-jitter, jitter)))


# ---- DAG checks on a graph in memory (enqueue and submit run them before writing) -------------


def _topological(keys: Sequence[_K], after: Mapping[_K, Sequence[_K]]) -> tuple[list[_K], list[_K]]:
    """Order ``keys`` so that each comes after everything in ``after[key]`` (its upstreams and
    its container, among the keys). Returns (order, []) or, if some keys lie on a cycle,
    ([], one such cycle, its first key repeated at the end)."""
    edges: dict[_K, list[_K]] = {k: [] for k in keys}
    indeg = dict.fromkeys(keys, 0)
    for k in keys:
        for u in after.get(k, ()):
            edges[u].append(k)
            indeg[k] += 1
    todo = deque(k for k in keys if indeg[k] == 0)
    order: list[_K] = []
    while todo:
        k = todo.popleft()
        order.append(k)
        for v in edges[k]:
            indeg[v] -= 1
            if indeg[v] == 0:
                todo.append(v)
    if len(order) == len(keys):
        return order, []
    # Name one cycle: from a key left over, follow left-over predecessors until one repeats.
    left = {k for k in keys if indeg[k] > 0}
    node = next(k for k in keys if k in left)
    seen: dict[_K, int] = {}
    path: list[_K] = []
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = next(u for u in after[node] if u in left)
    cycle = path[seen[node]:] + [node]
    return [], cycle[::-1]


def _check_waits_for(waits: Mapping[Any, Sequence[Any]], starts: Iterable[Any]) -> list[Any]:
    """A cycle in a wait-for graph ("X cannot finish before Y"), searched from ``starts`` by an
    iterative depth-first walk; [] if there is none. A node missing from ``waits`` waits for
    nothing. Dependency cycles are not the only deadlocks: a container waits for its children and
    they wait for its upstreams, so a child that (through any chain) depends on work that waits
    for its own container can never run."""
    colour: dict[Any, int] = {}  # 1: on the current path, 2: explored, no cycle through it
    end = object()
    for start in starts:
        if colour.get(start):
            continue
        colour[start] = 1
        path = [start]
        stack = [iter(waits.get(start, ()))]
        while stack:
            nxt = next(stack[-1], end)
            if nxt is end:
                colour[path.pop()] = 2
                stack.pop()
            elif colour.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not colour.get(nxt):
                colour[nxt] = 1
                path.append(nxt)
                stack.append(iter(waits.get(nxt, ())))
    return []


# =============================================================================================
# Input validation and JSON
# =============================================================================================

#: Largest encoded args or result, in bytes (below MySQL's default max_allowed_packet).
MAX_JSON_BYTES = 1 << 20
#: Most arrays/objects nested inside one another in args or results, the same on every engine:
#: what the strictest one stores. MariaDB's ``CHECK (json_valid(...))`` refuses 32 nested
#: containers, empty or not and whatever is inside (measured on 10.11: 31 pass); Oracle MySQL
#: allows 100, PostgreSQL and SQLite more. ``{"a": 1}`` has depth 1, a scalar 0.
MAX_JSON_DEPTH = 31
#: Longest type, group or worker name.
MAX_NAME_LENGTH = 200
#: Longest ``run_after`` timedelta (either way) and ``prune`` age: far beyond any real use,
#: short enough that the database's now plus or minus it cannot overflow a datetime.
MAX_TIMEDELTA = _dt.timedelta(days=1000 * 366)

_INT64 = 1 << 63
_INT32 = 1 << 31
#: Largest cap a claim accepts (``max_in_flight``, ``max_concurrency``, a group's cap) and most
#: jobs one claim leases.
_MAX_SLOTS = 100_000
#: Largest fair-share weight (a job's, a stored group policy's, ``jobq group --weight``).
_MAX_WEIGHT = 1_000_000
#: Most starts a rate limit allows per period (``set_group``, ``set_limit``, ``rate_limits``,
#: ``jobq group/limit/worker --rate``).
_MAX_RATE_STARTS = 1_000_000
#: Shortest rate-limit period, in seconds. A claim counts the starts of the window ending at
#: the database's now, and one claim round trip takes milliseconds: a shorter window than
#: this holds no start of another claim, so "1/1e-7s" would read as a limit and be none.
#: Faster rates are written over a longer period (100/1s, not 1/0.01s).
_MIN_RATE_PERIOD = 0.1
#: Longest wait before a retry, in seconds (``fail(delay=...)``, a ``retry_backoff``'s answer).
_MAX_DELAY = MAX_TIMEDELTA.total_seconds()
_MIN_TIME = _dt.datetime(1970, 1, 2)
_MAX_TIME = _dt.datetime(9999, 12, 30)


def _check_json(value: Any, where: str, depth: int = 0) -> Any:
    """Validate and normalise a JSON value (tuples become lists, int subclasses plain ints);
    raise InvalidJob otherwise. ``depth`` counts the containers around ``value``."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not -_INT64 <= value < _INT64:
            raise InvalidJob(f"{where}: integer {value} does not fit in 64 bits")
        return int(value)  # an IntEnum or a ClaimedId is stored as the number it is
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidJob(f"{where}: {value!r} is not valid JSON (NaN and Infinity are rejected)")
        return value
    if isinstance(value, str):
        if "\x00" in value:
            raise InvalidJob(f"{where}: strings may not contain NUL (\\u0000): PostgreSQL jsonb rejects it")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidJob(f"{where}: string holds a lone surrogate, which is not valid UTF-8") from None
        return value
    if isinstance(value, (dict, list, tuple)) and depth >= MAX_JSON_DEPTH:
        raise InvalidJob(f"{where}: more than MAX_JSON_DEPTH={MAX_JSON_DEPTH} arrays/objects nested in one another")
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidJob(f"{where}: object keys must be strings, got {type(k).__name__} {k!r}")
            out[_check_json(k, where, depth + 1)] = _check_json(v, f"{where}.{k}", depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [_check_json(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    raise InvalidJob(f"{where}: {type(value).__name__} is not JSON-serialisable (use str, int, float, bool, None, list, dict)")


def _encode_checked(value: Any, where: str) -> Any:
    value = _check_json(value, where)
    size = len(json.dumps(value, allow_nan=False, separators=(",", ":")).encode("utf-8"))
    if size > MAX_JSON_BYTES:
        raise InvalidJob(f"{where}: {size} bytes encoded, more than MAX_JSON_BYTES={MAX_JSON_BYTES}")
    return value


def _check_name(value: Any, what: str) -> str:
    """Type, group, queue and worker names. Compared exactly on every engine only because
    what MySQL/MariaDB's PAD SPACE collation would equate ('a' = 'a ') is refused everywhere:
    leading/trailing whitespace, and control characters (invisible in logs and the CLI)."""
    if not isinstance(value, str) or not value:
        raise InvalidJob(f"{what} must be a non-empty string, got {value!r}")
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidJob(f"{what} is {len(value)} characters long; the limit is {MAX_NAME_LENGTH}")
    if value != value.strip():
        raise InvalidJob(f"{what} {value!r} starts or ends with whitespace")
    bad = next((ch for ch in value if ch < "\x20" or "\x7f" <= ch <= "\x9f"), None)  # Unicode's Cc
    if bad is not None:
        raise InvalidJob(f"{what} {value!r} holds the control character {bad!r}")
    _check_json(value, what)
    return value


def _check_int(value: Any, what: str, lo: int, hi: int, exc: type[JobqError] = InvalidJob) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise exc(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise exc(f"{what} must be between {lo} and {hi}, got {value}")
    return int(value)


def _check_number(value: Any, what: str, lo: float, hi: float, exc: type[JobqError] = InvalidJob) -> float:
    """A real number (an int or a float, not a bool) in ``lo`` .. ``hi``: NaN, infinities and
    ints too large for a float are refused with ``exc`` instead of an OverflowError later."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise exc(f"{what} must be a number, got {type(value).__name__} {value!r}")
    # An int is compared exactly (math.isfinite(10**400) would raise OverflowError).
    if (isinstance(value, float) and not math.isfinite(value)) or not lo <= value <= hi:
        shown = f"{value!r}" if isinstance(value, float) or abs(value) < 10**30 else f"an integer of {len(str(value))} digits"
        raise exc(f"{what} must be a finite number from {lo:g} to {hi:g}, got {shown}")
    return float(value)


def _check_caps(caps: Any, what: str) -> dict[str, int]:
    """``group_caps``: group -> most jobs in flight, each an int in 0 .. _MAX_SLOTS (ConfigError)."""
    if caps is None:
        return {}
    if not isinstance(caps, Mapping):
        raise ConfigError(f"{what} must be a mapping of group -> int, got {type(caps).__name__}")
    return {_check_name(g, f"{what} group"): _check_int(n, f"{what}[{g!r}]", 0, _MAX_SLOTS, ConfigError)
            for g, n in caps.items()}


def _check_seconds(value: Any, what: str, exc: type[JobqError] = InvalidJob, *, optional: bool = True) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise exc(f"{what} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0 or value > 366 * 86400:
        raise exc(f"{what} must be finite, > 0 and at most a year, got {value!r}")
    return float(value)


def _check_timedelta(value: Any, what: str, exc: type[JobqError] = InvalidJob, *, negative: bool = True) -> _dt.timedelta:
    """A timedelta within MAX_TIMEDELTA (and >= 0 unless ``negative``), so that adding it to or
    subtracting it from the database's now cannot overflow."""
    if not isinstance(value, _dt.timedelta):
        raise exc(f"{what} must be a datetime.timedelta, got {value!r}")
    if not (-MAX_TIMEDELTA if negative else _dt.timedelta(0)) <= value <= MAX_TIMEDELTA:
        bound = f"-{MAX_TIMEDELTA.days} .. " if negative else "0 .. "
        raise exc(f"{what} must be within {bound}{MAX_TIMEDELTA.days} days, got {value!r}")
    return value


def _check_run_after(value: Any, what: str) -> _dt.datetime | _dt.timedelta | None:
    """``run_after`` as given (None, a bounded timedelta, or an aware datetime in range)."""
    if value is None:
        return None
    if isinstance(value, _dt.timedelta):
        return _check_timedelta(value, what)
    _to_db_time(value, what)
    return value


def _check_age(value: Any, what: str) -> _dt.timedelta:
    """An age such as prune's ``older_than``: a timedelta in 0 .. MAX_TIMEDELTA (ConfigError)."""
    return _check_timedelta(value, what, ConfigError, negative=False)


def _one_line(value: Any) -> str:
    """The first line of ``value``'s text, at most 300 characters (errors in logs and messages)."""
    text = str(value).strip().splitlines()
    return text[0][:300] if text else ""


def _utcnow() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc).replace(tzinfo=None)


def _to_db_time(value: _dt.datetime, what: str) -> _dt.datetime:
    """Aware datetime -> naive UTC (how every dialect stores it). Naive input is rejected."""
    if not isinstance(value, _dt.datetime):
        raise InvalidJob(f"{what} must be a timezone-aware datetime or a timedelta, got {value!r}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidJob(f"{what} is a naive datetime; pass an aware one (e.g. tzinfo=datetime.timezone.utc)")
    try:
        out = value.astimezone(_dt.timezone.utc).replace(tzinfo=None)
    except OverflowError:  # e.g. 0001-01-01 at +05:00 is before year 1 in UTC
        out = None
    if out is None or not _MIN_TIME <= out <= _MAX_TIME:
        raise InvalidJob(f"{what} {value.isoformat()} is outside 1970-01-02 .. 9999-12-30 (UTC)")
    return out


def _as_id(value: Any, what: str) -> int:
    """A job id: an int in 1 .. 2**63 - 1 (what a BIGINT holds), returned as a plain int.
    InvalidJob otherwise; get() turns that into None (no such job can exist)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < _INT64:
        raise InvalidJob(f"{what} must be a positive int job id below 2**63, got {value!r}")
    return int(value)


def _dispatch_of(job_id: Any, token: str | None) -> tuple[int, str | None]:
    """(id, token) of the dispatch a seed-level call reports on: an explicit token wins, else
    the one a :class:`ClaimedId` carries (else None: fenced by worker_id alone)."""
    if token is None:
        token = getattr(job_id, "token", None)
    return _as_id(job_id, "job_id"), token


# =============================================================================================
# The queue API, in job-lifecycle order
# =============================================================================================


@dataclasses.dataclass(frozen=True)
class JobInfo:
    """A read-only snapshot of one job, as returned by :func:`get`.

    Its datetimes (``run_after``, ``created_at``, ``updated_at``, ``started_at``,
    ``finished_at``, ``lease_expires``, ``heartbeat_at``) are aware, in UTC, so they compare with
    ``datetime.now(timezone.utc)`` and can be passed back as ``run_after``. ``error`` is the
    current error only: the last failed attempt's (or why the job was closed) while it is not
    done, None once done; every attempt's outcome and error are in :func:`attempts`.
    """

    id: int
    type: str
    state: str
    args: Any
    result: Any
    error: str | None
    attempts: int
    max_attempts: int
    group_key: str
    weight: int
    is_container: bool
    parent_id: int | None
    depends_on: tuple[int, ...]
    run_after: _dt.datetime
    created_at: _dt.datetime
    updated_at: _dt.datetime
    started_at: _dt.datetime | None
    finished_at: _dt.datetime | None
    timeout: float | None
    lease_owner: str | None
    lease_expires: _dt.datetime | None
    heartbeat_at: _dt.datetime | None
    in_flight: bool
    cancel_requested: bool
    pending_deps: int
    pending_children: int
    #: Claim order within the group, higher first (schema 4).
    priority: int = 0
    #: The job's unique key, held while it is unfinished (schema 4).
    unique_key: str | None = None
    #: The last state a handler stored with ``ctx.checkpoint`` (a dict), or None (schema 4).
    checkpoint: Any = None
    #: The last ``ctx.progress`` a heartbeat carried: ``{"done", "total", "message"}``, or None.
    #: Kept when the job finishes (schema 4).
    progress: Any = None
    spawned_by: int | None = None  # the job whose handler spawned it (ctx.enqueue/ctx.submit)


@dataclasses.dataclass(frozen=True)
class AttemptInfo:
    """One attempt of a job that has ended, as returned by :func:`attempts`.

    Attributes:
        job_id: the job.
        attempt: its attempt number, from 1 (a released attempt was not charged, so the next
            attempt carries the same number).
        worker_id: the worker that held the lease (None if the caller gave none).
        started_at: when the claim leased it (aware UTC; None only for rows of a job claimed
            before its schema had ``started_at``).
        finished_at: when the attempt ended, by the database clock (aware UTC).
        outcome: one of :data:`ATTEMPT_OUTCOMES`.
        error: what went wrong (truncated as ``JobInfo.error``), None for ``done`` and
            ``released``.
    """

    job_id: int
    attempt: int
    worker_id: str | None
    started_at: _dt.datetime | None
    finished_at: _dt.datetime
    outcome: str
    error: str | None


_JOBINFO_COLUMNS = tuple(f.name for f in dataclasses.fields(JobInfo) if f.name != "depends_on")
_JOBINFO_TIMES = ("run_after", "created_at", "updated_at", "started_at", "finished_at", "lease_expires", "heartbeat_at")


@dataclasses.dataclass(frozen=True)
class Lease:
    """One claimed job: what a holder needs to run it and to report back (fenced by ``token``)."""

    id: int
    type: str
    args: Any
    group_key: str
    attempt: int
    max_attempts: int
    timeout: float | None
    parent_id: int | None
    worker_id: str
    token: str
    expires: _dt.datetime
    #: The job's last checkpoint (what ``ctx.state`` starts as), or None.
    checkpoint: Any = None


def create_schema(engine: Engine) -> None:
    """Create jobq's tables and indexes if they are missing; safe to call again.

    On a database created by an earlier jobq (a lower ``schema_version`` in ``jobq_meta``) it
    also upgrades the schema in place; call it at startup after updating the vendored file.

    Args:
        engine: a SQLAlchemy Engine on a supported database.

    Raises:
        UnsupportedDatabase: the dialect or server version is not supported.
    """
    d = _prepare(engine)
    # Many processes call this at once when a deployment starts: the check for missing tables
    # and their creation race unless serialised (one would fail with "already exists").
    with _schema_guard(engine, d) as conn:
        Base.metadata.create_all(conn, checkfirst=True)
        d.tune_tables(conn)
        have: dict[str, str] = {k: v for k, v in conn.execute(_Q_META_ROWS)}
        rows = [
            {"key": k, "value": v}
            # A database made before global_limits existed gets its row here: a seed, not a
            # schema change, so no version of its own (set_limit also adds it when missing).
            for k, v in (("schema_version", str(SCHEMA_VERSION)), (_CLAIM_LOCK_KEY, ""), (_GLOBAL_LIMITS_KEY, ""))
            if k not in have
        ]
        if rows:
            conn.execute(_Q_SEED_META, rows)
        if "schema_version" in have:
            _upgrade(conn, d, int(have["schema_version"]))


# ---- enqueue and submit: one insert path -------------------------------------------------------
# enqueue is a one-item submit. Both validate every field, then, in the transaction, read and
# check everything (upstreams, containers, deadlocks through existing work) before the first
# write, so a refused call writes nothing, even inside the caller's own transaction.


def _check_args(value: Any, keys: bool) -> dict[str, Any]:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise InvalidJob(f"args must be a JSON object (a dict), got {_type_name(value)}")
    return _encode_checked(value, "args")  # type: ignore[no-any-return]


def _check_depends_on(value: Any, keys: bool) -> tuple[int | str, ...]:
    if isinstance(value, (int, str, bytes)) or value is None:
        raise InvalidJob(f"depends_on must be an iterable of job ids, got {value!r}")
    refs = (x if keys and isinstance(x, str) else _as_id(x, "depends_on item") for x in value)
    return tuple(dict.fromkeys(refs))  # duplicates collapse


def _check_parent(value: Any, keys: bool) -> int | str | None:
    if value is None or (keys and isinstance(value, str)):
        return value  # type: ignore[no-any-return]
    return _as_id(value, "parent")


def _spec_run_after(value: Any, keys: bool) -> _dt.datetime | _dt.timedelta | None:
    if value is None:
        return None
    if isinstance(value, _dt.timedelta):
        return _check_timedelta(value, "run_after")
    return _to_db_time(value, "run_after")


def _run_after_row(value: _dt.datetime | _dt.timedelta | None, now: _dt.datetime) -> _dt.datetime:
    if isinstance(value, _dt.timedelta):
        return now + value
    return now if value is None else value


def _field(default: Any, check: Callable[[Any, bool], Any], column: str | None = None,
           to_row: Callable[[Any, _dt.datetime], Any] = lambda v, now: v) -> Any:
    """One job field: enqueue's keyword default, its check (``keys``: a submit item may name
    other items by key), the jobs column it fills and how."""
    return dataclasses.field(default=default, metadata={"check": check, "column": column, "to_row": to_row})


@dataclasses.dataclass(frozen=True)
class _JobSpec:
    """A validated job. Its fields ARE the list of job fields, spelled once: enqueue's keywords
    (its signature must match; tests/core/test_insert_path.py checks), the keys of a submit item,
    their defaults and checks, and the jobs columns they fill (_job_row)."""

    type: str = _field(None, lambda v, keys: _check_name(v, "type"), "type")  # required: None is refused
    args: dict[str, Any] = _field(None, _check_args, "args")
    group_key: str = _field("default", lambda v, keys: _check_name(v, "group_key"), "group_key")
    weight: int = _field(1, lambda v, keys: _check_int(v, "weight", 1, _MAX_WEIGHT), "weight")
    depends_on: tuple[int | str, ...] = _field((), _check_depends_on)  # job_deps rows, not a column
    parent: int | str | None = _field(None, _check_parent, "parent_id",
                                      lambda v, now: v if isinstance(v, int) else None)  # a key: set once inserted
    container: bool = _field(False, lambda v, keys: bool(v), "is_container")
    run_after: _dt.datetime | _dt.timedelta | None = _field(None, _spec_run_after, "run_after", _run_after_row)
    max_attempts: int = _field(3, lambda v, keys: _check_int(v, "max_attempts", 1, 1000), "max_attempts")
    timeout: float | None = _field(None, lambda v, keys: _check_seconds(v, "timeout"), "timeout")
    priority: int = _field(0, lambda v, keys: _check_int(v, "priority", -_INT32, _INT32 - 1), "priority")
    unique_key: str | None = _field(None, lambda v, keys: None if v is None else _check_name(v, "unique_key"), "unique_key")


_JOB_FIELDS: tuple[dataclasses.Field[Any], ...] = dataclasses.fields(_JobSpec)
# The job fields, in enqueue's order: the registry for whatever lists them (submit, the CLI).
_JOB_FIELD_NAMES = tuple(f.name for f in _JOB_FIELDS)


def _make_spec(fields: Mapping[str, Any], *, keys: bool = False) -> _JobSpec:
    """Check and normalise one job's fields (missing ones take enqueue's defaults)."""
    unknown = set(fields) - set(_JOB_FIELD_NAMES)
    if unknown:
        raise InvalidJob(f"unknown fields {sorted(unknown)}")
    return _JobSpec(**{f.name: f.metadata["check"](fields.get(f.name, f.default), keys) for f in _JOB_FIELDS})


def _job_row(spec: _JobSpec, now: _dt.datetime, *, state: str, pending_deps: int, pending_children: int) -> dict[str, Any]:
    """The jobs row of a new job: its fields' columns, and the bookkeeping every new row starts
    with (the one place both enqueue and submit build a row)."""
    row = {f.metadata["column"]: f.metadata["to_row"](getattr(spec, f.name), now) for f in _JOB_FIELDS if f.metadata["column"]}
    closed = state in _BAD
    row.update(
        state=state, created_at=now, updated_at=now, finished_at=now if closed else None, error=None, closed_by=None,
        attempts=0, in_flight=False, cancel_requested=False, pending_deps=pending_deps,
        pending_children=pending_children, failed_children=0, spawned_by=None, spawn_token=None,
    )
    return row


def _type_name(value: Any) -> str:
    return type(value).__name__


def enqueue(
    target: Engine | Connection | orm.Session,
    type: str,
    args: Mapping[str, Any] | None = None,
    *,
    group_key: str = "default",
    weight: int = 1,
    depends_on: Iterable[int] = (),
    parent: int | None = None,
    container: bool = False,
    run_after: _dt.datetime | _dt.timedelta | None = None,
    max_attempts: int = 3,
    timeout: float | None = None,
    priority: int = 0,
    unique_key: str | None = None,
) -> int:
    """Add one job (or container) to the queue and return its id.

    Args:
        target: an Engine (jobq commits its own transaction) or a Connection/Session (the job is
            written in the caller's transaction and exists only if the caller commits).
        type: the handler key a worker dispatches on; 1-200 characters.
        args: a JSON object (dict with str keys); tuples are stored as lists.
        group_key: the fair-share group (e.g. a tenant).
        weight: the group's weight (int >= 1); a group weighs the largest weight among its next runnable jobs (as many as there are free slots).
        depends_on: ids of jobs that must be done first; duplicates are ignored. A dependency that
            already failed or was cancelled makes this job fail (or be cancelled) at once.
        parent: id of a container this job belongs to; the container must still be waiting (a
            finished or cancelled container is refused).
        container: make a container: it never runs, and is done when all its children are done
            (failed when any child failed, once all are finished).
        run_after: an aware datetime, or a timedelta from now (database clock); default now.
        max_attempts: how many times the job may be dispatched (1-1000).
        timeout: seconds one dispatch may run before it is timed out (None: the worker default).
        priority: claim order within the group, higher first (an int in -2**31 .. 2**31-1;
            default 0); ties go to the oldest due, then the lowest id. It never overrides fair
            share between groups.
        unique_key: while an unfinished job (waiting, ready, leased or running) holds this key,
            return that job's id and write nothing; once it is done, failed or cancelled the
            key is free again. 1-200 characters, compared exactly. Enforced by a unique index,
            so concurrent enqueuers get one job; see the README's "Unique jobs" for what
            happens inside your own transaction. A ``held`` job (spawned by a handler still
            running) holding it is not handed out: :class:`UniqueKeyHeld` is raised.

    Returns:
        The new job's id (or, with ``unique_key``, the id of the unfinished job holding it).

    Raises:
        InvalidJob: bad input, an unknown dependency or parent, a parent that is not an open
            container, or a dependency that waits for the container this job would be inside.
            Nothing is written, also not in the caller's transaction.
        UniqueKeyHeld: ``unique_key`` belongs to a held job another running handler spawned
            (an InvalidJob: retry later). Nothing is written.
    """
    fields = dict(locals())  # exactly the parameters: the job fields and the target
    del fields["target"]
    return _submit(target, _plan([fields], single=True))[_ONE]


def submit(target: Engine | Connection | orm.Session, jobs: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Add a whole DAG in one call and one transaction, with batched inserts.

    Each item is a dict with a unique ``"key"`` (a string naming it within this call) and the
    keyword arguments of :func:`enqueue` (``type`` required; ``args``, ``group_key``, ``weight``,
    ``depends_on``, ``parent``, ``container``, ``run_after``, ``max_attempts``, ``timeout``,
    ``priority``, ``unique_key``).
    An item whose ``unique_key`` an unfinished job already holds is not inserted: the mapping
    gives that job's id for its key, and items that depend on it (or are its children, when it
    is a container) are wired to that job. Two items with the same ``unique_key`` are refused.
    In ``depends_on`` and ``parent``, a string refers to another item's key and an int to an
    existing job id.

    Returns:
        key -> new job id.

    Raises:
        InvalidJob: a bad item (named by its key), a duplicate key, a reference to an unknown
            key or job id, a cycle among the submitted edges (the cycle is named), a child of a
            non-container or of a finished container, a new container without children, or a
            deadlock through containers, also through existing jobs (a child that depends on
            work that waits for its own container), a ``unique_key`` given twice, or a new
            container whose children all turned out to exist already (by ``unique_key``).
            Nothing is written.
        UniqueKeyHeld: an item's ``unique_key`` belongs to a held job another running
            handler spawned (an InvalidJob: retry later). Nothing is written.
    """
    return _submit(target, _plan(jobs, single=False))


_ONE = "job"  # the key of enqueue's one item


@dataclasses.dataclass
class _Plan:
    """A checked batch of new jobs: specs by key, their references to each other, keys in an
    order where upstreams and containers come first."""

    specs: dict[str, _JobSpec]
    deps: dict[str, list[str]]  # local upstream keys
    parent: dict[str, str]  # local container key
    order: list[str]
    single: bool  # an enqueue: messages name "the new job" and carry no "submit:" prefix

    def where(self, key: str) -> str:
        return "" if self.single else f"submit: job {key!r}: "

    def name(self, node: Any, containers: set[int]) -> str:
        if isinstance(node, int):
            return f"container {node}" if node in containers else f"job {node}"
        return "the new job" if self.single else repr(node)

    def deadlock(self, cycle: Sequence[Any], containers: set[int]) -> InvalidJob:
        names = [self.name(n, containers) for n in cycle if not isinstance(n, tuple)]  # gates are not jobs
        return InvalidJob(("depends_on" if self.single else "submit") + ": these jobs would wait for each other "
                          "forever (a container waits for its children, they for its upstreams): " + " -> ".join(names))


def _plan(items: Sequence[Mapping[str, Any]], *, single: bool) -> _Plan:
    """Everything that can be checked without the database (see submit's Raises)."""
    specs: dict[str, _JobSpec] = {}
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise InvalidJob(f"submit: item {i} is not a dict")
        fields = dict(item)
        key = _ONE if single else fields.pop("key", None)
        if not isinstance(key, str) or not key:
            raise InvalidJob(f"submit: item {i} needs a non-empty string 'key'")
        if key in specs:
            raise InvalidJob(f"submit: duplicate key {key!r}")
        try:
            specs[key] = _make_spec(fields, keys=not single)
        except InvalidJob as exc:
            if single:
                raise
            raise InvalidJob(f"submit: job {key!r}: {exc}") from None
    holder: dict[str, str] = {}
    for key, sp in specs.items():
        if sp.unique_key is not None and holder.setdefault(sp.unique_key, key) != key:
            raise InvalidJob(f"submit: jobs {holder[sp.unique_key]!r} and {key!r} have the same unique_key {sp.unique_key!r}")
    return _link(specs, single)


def _link(specs: dict[str, _JobSpec], single: bool) -> _Plan:
    """The plan of checked specs: their references to each other, checked, in an order where
    upstreams and containers come first."""
    deps = {k: [u for u in sp.depends_on if isinstance(u, str)] for k, sp in specs.items()}
    parent = {k: sp.parent for k, sp in specs.items() if isinstance(sp.parent, str)}
    plan = _Plan(specs, deps, parent, list(specs), single)
    if single:
        return plan
    for key, ups in deps.items():
        for u in ups:
            if u not in specs:
                raise InvalidJob(f"submit: job {key!r} depends on unknown key {u!r}")
    for key, p in parent.items():
        if p not in specs:
            raise InvalidJob(f"submit: job {key!r} has unknown parent key {p!r}")
        if not specs[p].container:
            raise InvalidJob(f"submit: job {key!r} has parent {p!r}, which is not a container")
    parents = set(parent.values())
    childless = [k for k, sp in specs.items() if sp.container and k not in parents]
    if childless:
        raise InvalidJob(f"submit: container {childless[0]!r} has no children (an empty container would never finish)")
    plan.order, cycle = _topological(plan.order, {k: deps[k] + ([parent[k]] if k in parent else []) for k in specs})
    if cycle:
        raise InvalidJob("submit: cycle among the submitted jobs: " + " -> ".join(cycle))
    cycle = _check_waits_for(_wait_graph(plan, {}), plan.order)
    if cycle:
        raise plan.deadlock(cycle, set())
    return plan


def _wait_graph(plan: _Plan, existing: Mapping[Any, Sequence[Any]]) -> dict[Any, list[Any]]:
    """The wait-for graph over the new jobs (their keys), existing jobs (ids) and container
    gates (("g", key or id): a container's upstreams, and its own container's gate, which
    every job inside it waits for). ``existing`` holds what existing work waits for."""
    waits: dict[Any, list[Any]] = {k: list(v) for k, v in existing.items()}
    for k, sp in plan.specs.items():
        own = waits.setdefault(k, [])
        own.extend(sp.depends_on)
        if sp.parent is not None:
            own.append(("g", sp.parent))
            waits.setdefault(sp.parent, []).append(k)  # a container waits for its new child
        if sp.container:
            waits[("g", k)] = [*sp.depends_on, *([("g", sp.parent)] if sp.parent is not None else [])]
    return waits


class _KeyTaken(Exception):
    """A unique_key was taken by a transaction that committed after this one looked: undo this
    insert (its transaction or savepoint) and run it again, which then finds the holder."""


#: Reruns of an insert whose unique keys were taken meanwhile (each rerun finds more holders).
_KEY_RERUNS = 5


def _submit(target: Engine | Connection | orm.Session, plan: _Plan) -> dict[str, int]:
    keyed = any(sp.unique_key is not None for sp in plan.specs.values())
    # Every job born ready (no upstreams, no container, not one): the clock's read also queues
    # the wake-up _insert_new would send (_Dialect.db_now). Items a unique key turns away still
    # wake the listeners once, for nothing: a claim that finds no work, never a lost job.
    ready = all(not sp.depends_on and sp.parent is None and not sp.container for sp in plan.specs.values())
    for _ in range(_KEY_RERUNS):
        try:
            if isinstance(target, Engine):
                # No retry on a connection lost during COMMIT (_transaction): it may have landed,
                # and a second insert would duplicate the jobs. Deadlocks and SQLITE_BUSY rolled
                # back for sure.
                return _transaction(target, lambda conn, d: _insert_graph(conn, d, plan, d.db_now(conn, wake=ready)))
            d = _prepare(_engine_of(target))
            conn = _target_connection(target)  # type: ignore[arg-type]
            if not keyed:
                return _insert_graph(conn, d, plan, d.db_now(conn, wake=ready))
            # In the caller's transaction, a lost race on a key must undo only our own writes.
            with conn.begin_nested():
                return _insert_graph(conn, d, plan, d.db_now(conn, wake=ready))
        except _KeyTaken:
            continue
    raise JobqError(f"unique_key: the keys were taken by concurrent transactions {_KEY_RERUNS} times in a row")


@dataclasses.dataclass(frozen=True)
class _Hold:
    """New jobs spawned by a running dispatch: inserted ``held`` under its lease token. ``own``:
    the jobs this dispatch spawned before (the only held jobs it may name)."""

    spawner: int
    token: str
    own: frozenset[int]


def _insert_graph(conn: Connection, d: _Dialect, plan: _Plan, now: _dt.datetime, hold: _Hold | None = None
                  ) -> dict[str, int]:
    """Read and check everything, then write: the new rows, their edges, the containers' child
    counts, and the propagation of jobs born closed (an upstream already failed). Items whose
    unique keys unfinished jobs hold are not inserted: their ids name the holders (_without).
    With ``hold`` the rows are born ``held`` instead (their state is decided when they are
    released, see _release_spawns) and the container counts them at once: it cannot roll up
    before the spawner's result decides their fate."""
    keys = {sp.unique_key: k for k, sp in plan.specs.items() if sp.unique_key is not None}
    held: dict[str, int] = {}
    if keys:
        for chunk in _chunks(sorted(keys)):
            held.update((keys[u], i) for u, i in d.live_keys(conn, chunk).items())
        _checkpoint("unique_keys_read", sorted(held.values()))
        if held:
            _refuse_unborn_holders(conn, plan, held, hold.own if hold is not None else frozenset())
            plan = _without(plan, held)
    ids = _insert_new(conn, d, plan, now, hold) if plan.specs else {}
    return {**ids, **held}


def _refuse_unborn_holders(conn: Connection, plan: _Plan, holders: Mapping[str, int], own: frozenset[int]) -> None:
    """A unique key held by another dispatch's ``held`` spawn is refused (UniqueKeyHeld): that
    job exists only if its spawner's result commits, so its id can be neither handed out (the
    caller would wire work to a job that may vanish) nor replaced by a new job (the release
    would then collide). The holders are share-locked by live_keys: the state read stays true
    until this transaction ends. A dispatch's own held spawns (``own``) are its to name."""
    ids = sorted(set(holders.values()) - own)
    for chunk in _chunks(ids):
        for r in conn.execute(_q_held_among(chunk)):
            key = next(k for k, i in holders.items() if i == r.id)
            raise UniqueKeyHeld(str(plan.specs[key].unique_key), int(r.id), int(r.spawned_by))


def _without(plan: _Plan, held: Mapping[str, int]) -> _Plan:
    """The plan without the items whose unique keys unfinished jobs hold; references to them
    name those jobs' ids instead."""
    def ref(x: Any) -> Any:
        return held.get(x, x) if isinstance(x, str) else x

    specs = {k: dataclasses.replace(sp, depends_on=tuple(dict.fromkeys(ref(u) for u in sp.depends_on)), parent=ref(sp.parent))
             for k, sp in plan.specs.items() if k not in held}
    parents = {sp.parent for sp in specs.values()}
    empty = [k for k, sp in specs.items() if sp.container and k not in parents and k in plan.parent.values()]
    if empty:
        raise InvalidJob(f"submit: container {empty[0]!r} would have no children: unfinished jobs hold all their unique keys")
    return _link(specs, plan.single)


def _insert_new(conn: Connection, d: _Dialect, plan: _Plan, now: _dt.datetime, hold: _Hold | None = None
                ) -> dict[str, int]:
    """_insert_graph's writes, for the items no unique key turned away."""
    specs = plan.specs
    prefix = "" if plan.single else "submit: "
    own = hold.own if hold is not None else frozenset()
    ext_deps = sorted({u for sp in specs.values() for u in sp.depends_on if isinstance(u, int)})
    up_state: dict[int, str] = {}
    for chunk in _chunks(ext_deps):
        up_state.update(conn.execute(_q_upstream_states(d, chunk)).all())
    missing = [i for i in ext_deps if i not in up_state]
    if missing:
        raise InvalidJob(f"{prefix}depends_on: no job with id {', '.join(map(str, missing))}")
    unborn = [i for i in ext_deps if up_state[i] == "held" and i not in own]
    if unborn:
        raise InvalidJob(f"{prefix}depends_on: job {unborn[0]} is held: spawned by a handler that has not finished, "
                         "it exists only if that handler's result commits")
    named_by: dict[int, str] = {}  # existing container -> the first key that names it as parent
    for k, sp in specs.items():
        if isinstance(sp.parent, int):
            named_by.setdefault(sp.parent, k)
    boxes: dict[int, Any] = {}
    for chunk in _chunks(sorted(named_by)):  # locked: it cannot roll up or be cancelled before our commit
        boxes.update((r.id, r) for r in conn.execute(_q_lock_jobs(d, chunk)))
    for pid, k in named_by.items():
        r = boxes.get(pid)
        if r is None:
            raise InvalidJob(f"{plan.where(k)}parent: no job with id {pid}")
        if not r.is_container:
            raise InvalidJob(f"{plan.where(k)}parent {pid} is not a container (enqueue it with container=True)")
        if r.state == "held" and pid not in own:
            raise InvalidJob(f"{plan.where(k)}parent {pid} is held: spawned by a handler that has not finished")
        if r.state not in ("waiting", "held"):
            raise InvalidJob(f"{plan.where(k)}parent {pid} has already rolled up ({r.state}); it takes no more children")
    if boxes:
        _check_existing_deadlocks(conn, plan, boxes)
    rows, closed = _born_rows(plan, up_state, {pid: r.pending_deps > 0 for pid, r in boxes.items()}, now)
    if hold is not None:
        for row in rows.values():
            row.update(state="held", finished_at=None, spawned_by=hold.spawner, spawn_token=hold.token)
        closed = []  # decided at release
    # -- every check passed: write
    per_box: dict[int, int] = {}
    for sp in specs.values():
        if isinstance(sp.parent, int):
            per_box[sp.parent] = per_box.get(sp.parent, 0) + 1
    for pid in sorted(per_box):
        conn.execute(_q_add_children(pid, per_box[pid]))
    ids: dict[str, int] = {}
    kids: dict[str, list[str]] = {}
    for k in plan.order:
        if k in plan.parent:
            kids.setdefault(plan.parent[k], []).append(k)
    level = [k for k in plan.order if k not in plan.parent]
    while level:  # containers before their children: a child row needs its container's id
        for keys in _chunks(level, 1000):
            for k in keys:
                if k in plan.parent:
                    rows[k]["parent_id"] = ids[plan.parent[k]]
            ids.update(zip(keys, _insert_rows(conn, d, [rows[k] for k in keys]), strict=True))
        level = [c for k in level for c in kids.get(k, ())]
    edges = [{"job_id": ids[k], "depends_on_id": ids[u] if isinstance(u, str) else u}
             for k in plan.order for u in specs[k].depends_on]
    for edge_rows in _chunks(edges, 1000):
        conn.execute(_Q_INSERT_DEPS, list(edge_rows))
    if closed:
        causes = []
        for k, cause, by_box in closed:
            cid = ids[cause] if isinstance(cause, str) else cause
            causes.append({"b_id": ids[k], "b_by": cid, "b_error": _closed_error(rows[k]["state"], cid, by_box)})
        conn.execute(_Q_NAME_CAUSE, causes)
        _settle(conn, d, now, [(ids[k], rows[k]["state"]) for k, _, _ in closed])
    if any(r["state"] == "ready" for r in rows.values()):
        d.notify(conn)
    return ids


def _spawn(engine: Engine, plan: _Plan, hold: _Hold) -> dict[str, int]:
    """ctx.enqueue/ctx.submit: insert ``plan`` held under the spawner's lease, in a transaction
    of its own fenced by that lease (one row lock on the spawner)."""

    def run(conn: Connection, d: _Dialect) -> dict[str, int]:
        if conn.execute(_q_spawner_fence(d, hold.spawner, hold.token)).first() is None:
            raise LeaseLost(f"job {hold.spawner}: this dispatch no longer holds its lease (or the job was cancelled); "
                            "nothing spawned")
        return _insert_graph(conn, d, plan, d.db_now(conn), hold)

    # Not retried on a connection lost during COMMIT (as _submit): the dispatch's end cleans up
    # whatever landed, and the handler sees the error. A key taken by a transaction that
    # committed after the lookup is looked up again, as _submit does: the holder it then finds
    # is handed back (or refused, if it is another dispatch's held spawn).
    for _ in range(_KEY_RERUNS):
        try:
            return _transaction(engine, run)
        except _KeyTaken:
            continue
    raise JobqError(f"unique_key: the keys were taken by concurrent transactions {_KEY_RERUNS} times in a row")


def _born_rows(plan: _Plan, up_state: Mapping[int, str], gated: Mapping[int, bool], now: _dt.datetime
               ) -> tuple[dict[str, dict[str, Any]], list[tuple[str, int | str, bool]]]:
    """The state rule for new jobs, in topological order: closed (failed/cancelled) when an
    upstream or the container already is, waiting while upstreams are unfinished, the job is a
    container, or a container above it still waits on its own upstreams (the gate), else ready.
    Returns the rows and, for each job born closed, (key, its cause, whether the cause is its
    container)."""
    n_children: dict[str, int] = {}
    for p in plan.parent.values():
        n_children[p] = n_children.get(p, 0) + 1
    rows: dict[str, dict[str, Any]] = {}
    closed: list[tuple[str, int | str, bool]] = []
    for k in plan.order:
        sp = plan.specs[k]
        states = {u: up_state[u] if isinstance(u, int) else rows[u]["state"] for u in sp.depends_on}
        pending = sum(1 for s in states.values() if s != "done")
        bad = [u for u, s in states.items() if s in _BAD]
        cause: int | str | None = min((u for u in bad if isinstance(u, int)), default=bad[0] if bad else None)
        by_box = False
        if isinstance(sp.parent, str):
            gate = rows[sp.parent]["pending_deps"] > 0
            if rows[sp.parent]["state"] in _BAD:
                cause, by_box = sp.parent, True
        else:
            gate = sp.parent is not None and gated[sp.parent]
        if cause is not None:
            state = rows[str(sp.parent)]["state"] if by_box else states[cause]
            closed.append((k, cause, by_box))
        else:
            state = "waiting" if sp.container or pending or gate else "ready"
        rows[k] = _job_row(sp, now, state=state, pending_deps=pending + int(gate), pending_children=n_children.get(k, 0))
    return rows, closed


def _closed_error(state: str, cause: int, by_container: bool) -> str:
    return f"{'container' if by_container else 'upstream job'} {cause} {'failed' if state == 'failed' else 'was cancelled'}"


def _check_existing_deadlocks(conn: Connection, plan: _Plan, boxes: Mapping[int, Any]) -> None:
    """New jobs go into existing containers: refuse any wait-for cycle through existing work."""
    top: dict[str, int | None] = {}  # the existing container each new job is (indirectly) inside
    for k in plan.order:
        sp = plan.specs[k]
        top[k] = top[plan.parent[k]] if k in plan.parent else sp.parent  # type: ignore[assignment]
    above: dict[int, set[int]] = {}
    for k in plan.order:
        ints = [u for u in plan.specs[k].depends_on if isinstance(u, int)]
        box = top[k]
        if not ints or box is None:
            continue
        if box not in above:
            above[box] = set(_ancestors(conn, box))
        clash = sorted(above[box].intersection(ints))
        if clash:
            raise InvalidJob(f"{plan.where(k)}depends_on: container {clash[0]} encloses this job, which would wait "
                             "for it while it waits for its children: they would wait for each other forever")
    starts: list[Any] = [u for sp in plan.specs.values() for u in sp.depends_on if isinstance(u, int)]
    starts += [("g", pid) for pid in sorted(boxes)]
    existing, containers = _existing_waits(conn, starts)
    cycle = _check_waits_for(_wait_graph(plan, existing), plan.order)
    if cycle:
        raise plan.deadlock(cycle, containers | set(boxes))


def _existing_waits(conn: Connection, starts: Iterable[Any]) -> tuple[dict[Any, list[Any]], set[int]]:
    """What existing unfinished work waits for, as far as it reaches from ``starts`` (job ids and
    ("g", id) container gates): a job its unfinished upstreams and its container's gate; a
    container also its unfinished children; a gate the container's unfinished upstreams and
    the gate above. Breadth first, a few statements per level. Returns (waits, containers seen)."""
    waits: dict[Any, list[Any]] = {}
    containers: set[int] = set()
    frontier = list(dict.fromkeys(starts))
    while frontier:
        nodes = sorted({x for x in frontier if isinstance(x, int)})
        gates = sorted({x[1] for x in frontier if isinstance(x, tuple)})
        rows: dict[int, Any] = {}
        for chunk in _chunks(sorted(set(nodes) | set(gates))):
            rows.update((r.id, r) for r in conn.execute(_q_wait_nodes(chunk)))
        containers.update(i for i, r in rows.items() if r.is_container)
        live = {i for i in nodes if i in rows and rows[i].state not in TERMINAL}
        ups: dict[int, list[int]] = {}
        for chunk in _chunks(sorted(live | {g for g in gates if g in rows})):
            for j, u in conn.execute(_q_open_upstreams(chunk)):
                ups.setdefault(j, []).append(u)
        kids: dict[int, list[int]] = {}
        for chunk in _chunks(sorted(i for i in live if rows[i].is_container)):
            for p, c in conn.execute(_q_open_children(chunk)):
                kids.setdefault(p, []).append(c)
        nxt: list[Any] = []
        for i in nodes:
            above = [("g", rows[i].parent_id)] if i in live and rows[i].parent_id is not None else []
            waits[i] = ups.get(i, []) + kids.get(i, []) + above if i in live else []
            nxt += waits[i]
        for g in gates:
            r = rows.get(g)
            waits[("g", g)] = [] if r is None else ups.get(g, []) + ([("g", r.parent_id)] if r.parent_id is not None else [])
            nxt += waits[("g", g)]
        frontier = [x for x in dict.fromkeys(nxt) if x not in waits]
    return waits, containers


def _insert_rows(conn: Connection, d: _Dialect, rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """Insert job rows and return their ids in order (one statement where RETURNING allows)."""
    if any(r["unique_key"] is not None for r in rows):
        out: list[int] = []
        for r in rows:
            got = d.insert_unique(conn, r) if r["unique_key"] is not None else _insert_rows(conn, d, [r])[0]
            if got is None:
                raise _KeyTaken(r["unique_key"])
            out.append(int(got))
        return out
    if len(rows) == 1:
        if d.returning:  # on the cursor: through Connection.execute it cost 65 us more on psycopg, 30 on SQLite
            row = rows[0]
            (new_id,) = _hot_rows(conn, _q_insert_job_returning(d, tuple(row)), {f"b_{k}": v for k, v in row.items()})
            return [int(new_id[0])]
        return [int(conn.execute(_Q_INSERT_JOB, dict(rows[0])).inserted_primary_key[0])]  # type: ignore[index]
    if not d.returning:  # without INSERT ... RETURNING (MySQL)
        return d.insert_block(conn, rows)
    return [int(x) for x in conn.execute(_Q_INSERT_JOBS, list(rows)).scalars()]


def _ancestors(conn: Connection, job_id: int | None) -> list[int]:
    """``job_id`` and the containers above it, innermost first."""
    out: list[int] = []
    seen: set[int] = set()
    while job_id is not None and job_id not in seen:
        out.append(job_id)
        seen.add(job_id)
        job_id = conn.execute(_q_parent_of(job_id)).scalar()
    return out


def get(engine: Engine | Connection | orm.Session, job_id: int) -> JobInfo | None:
    """Read one job as a plain snapshot, or None if there is no such job.

    Args:
        engine: an Engine, Connection or Session.
        job_id: the job's id.

    Returns:
        A :class:`JobInfo` whose datetimes are aware, in UTC; or None.
    """
    try:
        job_id = _as_id(job_id, "job_id")
    except InvalidJob:
        return None  # an id no job can have

    def read(conn: Connection) -> JobInfo | None:
        row = conn.execute(_q_job(job_id)).mappings().first()
        if row is None:
            return None
        deps = tuple(conn.execute(_q_upstream_ids(job_id)).scalars())
        values = {k: row[k] for k in _JOBINFO_COLUMNS}
        for k in _JOBINFO_TIMES:  # stored naive UTC (every engine alike); handed out aware
            if values[k] is not None:
                values[k] = values[k].replace(tzinfo=_dt.timezone.utc)
        return JobInfo(depends_on=deps, **values)

    if isinstance(engine, Engine):
        _prepare(engine)
        with engine.connect() as conn:
            return read(conn)
    return read(_target_connection(engine))


def attempts(engine: Engine | Connection | orm.Session, job_id: int) -> list[AttemptInfo]:
    """A job's ended attempts, oldest first: its history, kept apart from ``JobInfo.error``.

    Every attempt that ends leaves one row, written by the same transaction that ended it
    (finalize, fail, release, the dispatch timeout, or the reclaim of an expired lease), so the
    history never claims an outcome the job row does not show. An attempt still running has no
    row yet. :func:`prune` deletes the rows with their job.

    Args:
        engine: an Engine, Connection or Session.
        job_id: the job's id.

    Returns:
        A list of :class:`AttemptInfo` (empty for an unknown job or one never run).
    """
    try:
        job_id = _as_id(job_id, "job_id")
    except InvalidJob:
        return []

    def read(conn: Connection) -> list[AttemptInfo]:
        out = []
        for r in conn.execute(_q_attempt_history(job_id)):
            out.append(AttemptInfo(
                job_id=r.job_id, attempt=r.attempt, worker_id=r.worker_id,
                started_at=r.started_at.replace(tzinfo=_dt.timezone.utc) if r.started_at is not None else None,
                finished_at=r.finished_at.replace(tzinfo=_dt.timezone.utc), outcome=r.outcome, error=r.error))
        return out

    if isinstance(engine, Engine):
        _prepare(engine)
        with engine.connect() as conn:
            return read(conn)
    return read(_target_connection(engine))


def _target_connection(target: Connection | orm.Session) -> Connection:
    return target.connection() if isinstance(target, orm.Session) else target


# ---- group policy: what claims obey, stored with set_group ------------------------------------


class _Unlimited:
    """The type of :data:`UNLIMITED`."""

    def __repr__(self) -> str:
        return "jobq.UNLIMITED"


#: Pass as ``max_in_flight`` or ``rate_limit`` to :func:`set_group` or :func:`set_limit` to
#: remove that limit.
UNLIMITED: Any = _Unlimited()


@dataclasses.dataclass(frozen=True)
class GroupPolicy:
    """A group's stored policy (:func:`set_group`); None means "not set".

    Attributes:
        group_key: the group.
        weight: its fair-share weight (None: the largest weight among its next runnable jobs).
        max_in_flight: most of its jobs leased or running at once, across every worker.
        rate_limit: (starts, per_seconds): most job starts in any window of that length.
        paused: its ready jobs are not claimed (its running jobs finish).
        updated_at: when it was last set (aware UTC, the database's clock).
    """

    group_key: str
    weight: int | None
    max_in_flight: int | None
    rate_limit: tuple[int, float] | None
    paused: bool
    updated_at: _dt.datetime

    @property
    def limits(self) -> bool:
        """Whether it holds claims back at all (cap, rate or pause): such groups make every
        claim take the claim lock."""
        return self.paused or self.max_in_flight is not None or self.rate_limit is not None


def _policy_of(row: Any) -> GroupPolicy:
    rate = None if row.rate_n is None else (int(row.rate_n), float(row.rate_period))
    return GroupPolicy(group_key=row.group_key, weight=row.weight, max_in_flight=row.max_in_flight, rate_limit=rate,
                       paused=bool(row.paused), updated_at=row.updated_at.replace(tzinfo=_dt.timezone.utc))


def _policy_counts(value: str | None) -> tuple[int, int]:
    """The claim_lock row's value: (stored policy rows, rows that limit); "" before any."""
    if not value:
        return 0, 0
    rows, _, limited = value.partition(" ")
    return int(rows), int(limited or 0)


def _check_rate_spec(value: Any, what: str) -> tuple[int, float]:
    """A rate limit as (starts, per_seconds) or the text "N/PERIOD" (10/1m, 5/30s, 100/1h)."""
    if isinstance(value, str):
        text = value
        count, slash, per = text.partition("/")
        try:  # _seconds: the command line's duration parser (a forward reach at run time only)
            if not slash:
                raise ValueError(text)
            value = (int(count), _seconds(per, what, unit=False, zero=False))
        except (ValueError, argparse.ArgumentTypeError):
            raise ConfigError(f"{what} must look like N/PERIOD (10/1m, 5/30s), got {text!r}") from None
    return _check_rate_pair(value, what, "(starts, per_seconds) or 'N/PERIOD'")


def _check_rate_pair(value: Any, what: str, forms: str) -> tuple[int, float]:
    """A rate limit as (starts, per_seconds): the checks stored policy (_check_rate_spec) and a
    Worker's rate_limits (_check_rate_limits) share; ``forms`` names what ``what`` accepts."""
    if not isinstance(value, tuple) or len(value) != 2:
        raise ConfigError(f"{what} must be {forms}, got {value!r}")
    n = _check_int(value[0], f"{what} starts", 1, _MAX_RATE_STARTS, ConfigError)
    period = _check_seconds(value[1], f"{what} period", ConfigError, optional=False)
    assert period is not None
    if period < _MIN_RATE_PERIOD:
        raise ConfigError(f"{what} period must be at least {_MIN_RATE_PERIOD} seconds (write a faster rate "
                          f"over a longer period: 100/1s, not 1/0.01s), got {value[1]!r}")
    if period > START_LOG_RETENTION.total_seconds():
        raise ConfigError(f"{what} period is longer than START_LOG_RETENTION")
    return n, float(period)


def set_group(
    target: Engine | Connection | orm.Session,
    group_key: str,
    *,
    weight: int | None = None,
    max_in_flight: Any = None,
    rate_limit: Any = None,
    paused: bool | None = None,
) -> GroupPolicy:
    """Store a group's fair-share policy in the database, where every claim reads it.

    Options left as None keep their stored value; a group never set has none. Takes effect at
    the next claim that starts after the change commits, on every worker: the change is made
    under the claim lock, and claims read it under the same lock, so a lowered cap is never
    overspent by a later claim (jobs already running finish).

    Args:
        target: an Engine (jobq commits its own transaction) or a Connection/Session (written
            in the caller's transaction, in effect once the caller commits).
        group_key: the group (a tenant, customer, API key).
        weight: fair-share weight (int >= 1); it replaces the per-job weights of this group.
        max_in_flight: most jobs of this group leased or running at once (int >= 1), or
            :data:`UNLIMITED`. A worker's ``group_caps`` may be stricter: the smaller cap wins.
        rate_limit: (starts, per_seconds) or "N/PERIOD" ("10/1m"): most starts in any window,
            or :data:`UNLIMITED`. A worker's ``rate_limits`` apply as well.
        paused: True: its ready jobs are not claimed; False: resume.

    Returns:
        The group's policy as stored.

    Raises:
        ConfigError: a bad value; nothing is written.
    """
    key = _check_name(group_key, "group_key")
    new: dict[str, Any] = {}
    if weight is not None:
        new["weight"] = _check_int(weight, "weight", 1, _MAX_WEIGHT, ConfigError)
    if max_in_flight is UNLIMITED:
        new["max_in_flight"] = None
    elif max_in_flight is not None:
        new["max_in_flight"] = _check_int(max_in_flight, "max_in_flight", 1, _MAX_SLOTS, ConfigError)
    if rate_limit is UNLIMITED:
        new["rate_n"] = new["rate_period"] = None
    elif rate_limit is not None:
        new["rate_n"], new["rate_period"] = _check_rate_spec(rate_limit, "rate_limit")
    if paused is not None:
        if not isinstance(paused, bool):
            raise ConfigError(f"paused must be True or False, got {paused!r}")
        new["paused"] = paused

    def run(conn: Connection, d: _Dialect) -> GroupPolicy:
        lock = conn.execute(_q_lock_policy(d)).first()  # serialised with every claim that obeys policy
        if lock is None:
            raise JobqError("jobq_meta has no claim_lock row: run jobq.create_schema(engine)")
        rows, limited = _policy_counts(lock.value)
        old = conn.execute(_q_group_policies([key])).first()
        now = d.db_now(conn)
        if old is None:
            values: dict[str, Any] = {"weight": None, "max_in_flight": None, "rate_n": None, "rate_period": None,
                                      "paused": False}
            values.update(new, group_key=key, updated_at=now)
            conn.execute(_Q_INSERT_GROUP, values)
            rows += 1
        else:
            values = {k: getattr(old, k) for k in ("weight", "max_in_flight", "rate_n", "rate_period", "paused")}
            values.update(new, updated_at=now)
            conn.execute(_Q_UPDATE_GROUP, {**values, "b_key": key})
            limited -= _policy_of(old).limits
            values["group_key"] = key
        rate = None if values["rate_n"] is None else (int(values["rate_n"]), float(values["rate_period"]))
        policy = GroupPolicy(group_key=key, weight=values["weight"], max_in_flight=values["max_in_flight"],
                             rate_limit=rate, paused=bool(values["paused"]), updated_at=now.replace(tzinfo=_dt.timezone.utc))
        limited += policy.limits
        conn.execute(_Q_SET_CLAIM_LOCK_VALUE, {"b_value": f"{rows} {limited}"})
        return policy

    if isinstance(target, Engine):
        return _transaction(target, run)
    return run(_target_connection(target), _prepare(_engine_of(target)))  # type: ignore[arg-type]


def get_group(engine: Engine | Connection | orm.Session, group_key: str) -> GroupPolicy | None:
    """A group's stored policy, or None when :func:`set_group` never stored one.

    Args:
        engine: an Engine, or a Connection/Session to read in the caller's transaction.
        group_key: the group.
    """
    key = _check_name(group_key, "group_key")
    rows = _read(engine, lambda conn: conn.execute(_q_group_policies([key])).all())
    return _policy_of(rows[0]) if rows else None


def groups(engine: Engine | Connection | orm.Session) -> list[GroupPolicy]:
    """Every stored group policy, by group key.

    Args:
        engine: an Engine, or a Connection/Session to read in the caller's transaction.
    """
    return [_policy_of(r) for r in _read(engine, lambda conn: conn.execute(_Q_ALL_GROUP_POLICIES).all())]


# ---- the global limits: what every claim on the database obeys together, stored with set_limit


@dataclasses.dataclass(frozen=True)
class GlobalLimit:
    """The database's global limits (:func:`set_limit`); None means "not set".

    Attributes:
        max_in_flight: most jobs leased or running at once, across every worker and group. A
            worker's ``max_concurrency`` applies as well: the smaller cap wins.
        rate_limit: (starts, per_seconds): most job starts, all groups together, in any window
            of that length. A worker's ``rate_limits["*"]`` applies as well.
        updated_at: when it was last set (aware UTC, the database's clock); None if never.
    """

    max_in_flight: int | None
    rate_limit: tuple[int, float] | None
    updated_at: _dt.datetime | None

    @property
    def limits(self) -> bool:
        """Whether it holds claims back at all (a cap or a rate): then every claim takes the
        claim lock."""
        return self.max_in_flight is not None or self.rate_limit is not None


_NO_GLOBAL_LIMIT = GlobalLimit(max_in_flight=None, rate_limit=None, updated_at=None)


@functools.lru_cache(maxsize=16)
def _global_limit_of(value: str) -> GlobalLimit:
    """The global_limits row's value (JSON; "" before the first set_limit), parsed once per
    distinct value: every claim reads it."""
    if not value:
        return _NO_GLOBAL_LIMIT
    try:
        data = json.loads(value)
        cap, rate = data["max_in_flight"], data["rate_limit"]
        return GlobalLimit(max_in_flight=None if cap is None else int(cap),
                           rate_limit=None if rate is None else (int(rate[0]), float(rate[1])),
                           updated_at=_dt.datetime.fromisoformat(data["updated_at"]).replace(tzinfo=_dt.timezone.utc))
    except (ValueError, TypeError, KeyError, IndexError):
        raise JobqError(f"jobq_meta's global_limits row is not jobq's: {value!r} "
                        "(store the limits again with jobq.set_limit or `jobq limit`)") from None


def set_limit(
    target: Engine | Connection | orm.Session,
    *,
    max_in_flight: Any = None,
    rate_limit: Any = None,
) -> GlobalLimit:
    """Store the global limits in the database, where every claim of every worker reads them.

    Options left as None keep their stored value; :data:`UNLIMITED` removes one. Takes effect
    at the next claim that starts after the change commits, on every worker: the change is
    made under the claim lock, and claims read it under the same lock, so a lowered cap is
    never overspent by a later claim (jobs already running finish). A worker's own
    ``max_concurrency`` (and ``rate_limits["*"]``) apply as well: the stricter limit wins.

    Args:
        target: an Engine (jobq commits its own transaction) or a Connection/Session (written
            in the caller's transaction, in effect once the caller commits).
        max_in_flight: most jobs leased or running at once across every worker (int >= 1),
            or :data:`UNLIMITED`.
        rate_limit: (starts, per_seconds) or "N/PERIOD" ("100/1m"): most job starts, all
            groups together, in any window of that length, or :data:`UNLIMITED`.

    Returns:
        The global limits as stored.

    Raises:
        ConfigError: a bad value; nothing is written.
    """
    new: dict[str, Any] = {}
    if max_in_flight is UNLIMITED:
        new["max_in_flight"] = None
    elif max_in_flight is not None:
        new["max_in_flight"] = _check_int(max_in_flight, "max_in_flight", 1, _MAX_SLOTS, ConfigError)
    if rate_limit is UNLIMITED:
        new["rate_limit"] = None
    elif rate_limit is not None:
        new["rate_limit"] = _check_rate_spec(rate_limit, "rate_limit")

    def run(conn: Connection, d: _Dialect) -> GlobalLimit:
        # Both rows, locked in key order as every claim locks them.
        rows = conn.execute(_q_lock_claim(d)).all()
        _claim_meta(rows)  # the claim_lock row is there
        old = _global_limit_of(rows[1].value) if len(rows) > 1 else None
        now = d.db_now(conn)
        values: dict[str, Any] = {"max_in_flight": None, "rate_limit": None}
        if old is not None:
            values.update(max_in_flight=old.max_in_flight, rate_limit=old.rate_limit)
        values.update(new)
        text = json.dumps({**values, "updated_at": now.isoformat()})
        if old is None:  # a database whose create_schema predates the row
            conn.execute(_Q_SEED_META, [{"key": _GLOBAL_LIMITS_KEY, "value": text}])
        else:
            conn.execute(_Q_SET_GLOBAL_LIMITS, {"b_value": text})
        return _global_limit_of(text)

    if isinstance(target, Engine):
        return _transaction(target, run)
    return run(_target_connection(target), _prepare(_engine_of(target)))  # type: ignore[arg-type]


def get_limit(target: Engine | Connection | orm.Session) -> GlobalLimit:
    """The database's global limits as :func:`set_limit` stored them (all None if never set).

    Args:
        target: an Engine, or a Connection/Session to read in the caller's transaction.
    """
    value = _read(target, lambda conn: conn.execute(_Q_GLOBAL_LIMITS).scalar())
    return _global_limit_of(value or "")


def _read(target: Engine | Connection | orm.Session, fn: Callable[[Connection], _T]) -> _T:
    if isinstance(target, Engine):
        _prepare(target)
        with target.connect() as conn:
            try:
                return fn(conn)
            finally:
                conn.rollback()
    return fn(_target_connection(target))  # type: ignore[arg-type]


def _group_policies(conn: Connection, keys: Sequence[str]) -> dict[str, GroupPolicy]:
    """The stored policies of these groups (the claim's read, in its transaction)."""
    out: dict[str, GroupPolicy] = {}
    for chunk in _chunks(list(keys), 500):
        out.update({r.group_key: _policy_of(r) for r in conn.execute(_q_group_policies(chunk))})
    return out


# ---- claim ------------------------------------------------------------------------------------


def _in_flight_counts(conn: Connection, now: _dt.datetime) -> dict[str, int]:
    """Slots in use per group: leased/running jobs plus slots held by abandoned handlers."""
    counts: dict[str, int] = {}
    for g, n in _hot_rows(conn, _Q_SLOTS_IN_USE, {"b_now": now}):
        counts[g] = counts.get(g, 0) + n
    return counts


def _slots_and_span(conn: Connection, now: _dt.datetime) -> tuple[dict[str, int], tuple[str | None, str | None]]:
    """_in_flight_counts, and the first and last group with ready work (_Q_READY_GROUP_SPAN),
    in one statement."""
    counts: dict[str, int] = {}
    span: list[str | None] = [None, None]
    for g, n in _hot_rows(conn, _Q_SLOTS_AND_SPAN, {"b_now": now}):
        if n < 0:
            span[-1 - n] = g
        else:
            counts[g] = counts.get(g, 0) + n
    return counts, (span[0], span[1])


def _rate_room(
    conn: Connection, now: _dt.datetime, limits: Mapping[str, tuple[int, float]], groups: Sequence[str]
) -> dict[str, int]:
    """Starts still allowed now per rate-limited group ("*": all groups together)."""
    room: dict[str, int] = {}
    by_period: dict[float, list[str]] = {}
    for g, (_n, period) in limits.items():
        if g == "*" or g in groups:
            by_period.setdefault(period, []).append(g)
    for period, gs in by_period.items():
        since = now - _dt.timedelta(seconds=period)
        named = [g for g in gs if g != "*"]
        counts: dict[str, int] = {}
        if named:
            counts.update({g: int(n) for g, n in conn.execute(_q_starts_since(since, named))})  # SUM: Decimal on MySQL
        if "*" in gs:
            counts["*"] = int(conn.execute(_q_starts_since(since, None)).one()[1])
        for g in gs:
            room[g] = max(0, limits[g][0] - counts.get(g, 0))
    return room


def _check_rate_limits(limits: Mapping[str, Any] | None) -> dict[str, tuple[int, float]]:
    out: dict[str, tuple[int, float]] = {}
    for g, spec in (limits or {}).items():
        pair = _check_rate_pair(spec, f"rate_limits[{g!r}]", "(starts, per_seconds)")
        out[_check_name(g, "rate_limits group")] = pair
    return out


#: Fewest groups with ready work a claim ranks (when there are that many): the weights hold
#: between up to this many groups even when a claim has a single free slot; beyond it a claim
#: ranks max(free, CLAIM_WINDOW) groups, whatever the number of groups.
CLAIM_WINDOW = 64

#: Where each process's next claim window starts (_GroupScan), per engine and type filter: the
#: last group key of its previous window. In memory: a cursor in the database would be one more hot row
#: written by every claim; each process cycling through the groups on its own is enough for
#: the bound (every group with ready work is in one of a process's windows every G / free
#: claims).
_GROUP_CURSORS: weakref.WeakKeyDictionary[Engine, dict[Any, str]] = weakref.WeakKeyDictionary()


def _concat_ids(runnable: int, ids: str | None, limit: int) -> list[int] | None:
    """A group's runnable ids from _q_ready_groups_ranged_read ("12;15;"), or None where the
    window read must read them instead: more than ``limit`` of them (the weight would not be
    that of the first ``limit``), or a list GROUP_CONCAT cut at group_concat_max_len (a cut
    list does not end with ";" or holds fewer than ``runnable``)."""
    if not runnable:
        return []
    if runnable > limit or ids is None or not ids.endswith(";") or ids.count(";") != runnable:
        return None
    return [int(i) for i in ids[:-1].split(";")]


def _fold_candidates(rows: Iterable[Any], limit: int, into: dict[str, Any]) -> list[str]:
    """Rows of (group, id, weight), each group's together and in claim order, into ``into``:
    group -> (its first ``limit`` ids, the largest weight among them). A row whose id is None
    (a group the scan found with nothing read for it) enters its group with no ids. Returns the
    groups in the order the rows name them (the window read and _GroupScan's read share it)."""
    keys: list[str] = []
    for g, job_id, w in rows:
        got = into.get(g)
        if got is None:
            keys.append(g)
            got = into[g] = ([], w)
        if job_id is not None and len(got[0]) < limit:
            got[0].append(job_id)
            if w > got[1]:
                into[g] = got[0], w
    return keys


class _GroupScan:
    """The groups with ready work in cycle order, from after this process's cursor, wrapping
    around, each at most once: the claim takes them a window at a time (``take``), each window
    one bounded skip scan (two when it wraps; on MySQL/MariaDB a range read first), and leaves
    the cursor at the last group it took ("" when it took them all)."""

    def __init__(self, conn: Connection, d: _Dialect, types: Sequence[str] | None, now: _dt.datetime,
                 limit: int, span: tuple[str | None, str | None] | None = None) -> None:
        self.conn, self.stmt, self.ranged = conn, _q_ready_groups(d), d.ranged_group_scan
        #: With d.span_first: the first and last group with ready work (read here when first
        #: needed, unless the claim read them with its in-flight counts).
        self.span_first, self.span = d.span_first, span
        #: With d.scan_reads_window each scan reads its groups' candidates too (_q_ready_groups_read):
        #: group -> (its first ``limit`` runnable ids in claim order, the largest weight among them).
        self.read: dict[str, tuple[list[int], Any]] = {}
        self.read_params: dict[str, Any] | None = None
        self.limit = limit
        if self.ranged:
            self.ranged_stmt = _q_ready_groups_ranged_read(d, types is not None)
            self.ranged_params: dict[str, Any] = {"b_now": now}
            if types is not None:
                self.ranged_params["b_types"] = list(types)
        if d.scan_reads_window:
            self.stmt = _q_ready_groups_read(d, types is not None)
            self.read_params = {"b_now": now, "b_limit": limit}
            if types is not None:
                self.read_params["b_types"] = list(types)
        self.cursors = _GROUP_CURSORS.setdefault(conn.engine, {})
        self.key = None if types is None else tuple(sorted(types))
        self.start = self.pos = self.cursors.get(self.key, "")
        self.wrapped = not self.start  # from the first group: nothing to wrap to
        self.done = False  # every group with ready work was taken

    def take(self, n: int) -> list[str]:
        out: list[str] = []
        while len(out) < n and not self.done:
            # At most 500 groups per scan: MariaDB cuts a recursion at max_recursive_iterations
            # (1,000 by default), and a cut scan would read as the end of the groups.
            asked = min(n - len(out), 500)
            # One group more than asked: seeing the end here saves a scan that finds nothing.
            got = self._next(asked + 1)
            if self.wrapped and self.start and any(g > self.start for g in got):
                got = [g for g in got if g <= self.start]
            short = len(got) <= asked
            got = got[:asked]
            out += got
            if got:
                self.pos = got[-1]
            if short:
                if self.wrapped:
                    self.done = True
                else:
                    self.wrapped, self.pos = True, ""
        if out:
            # Every group taken (done): the next claim starts from the first again, with one
            # scan instead of a scan after the cursor that finds nothing and a second one.
            self.cursors[self.key] = "" if self.done else out[-1]
        return out

    def _next(self, n: int) -> list[str]:
        """Up to ``n`` groups with ready work after the position (fewer: the end of them)."""
        got: list[str] = []
        if not self.pos and self.span_first:
            # From the first group, look at both ends of the ready index first: one group alone
            # is the one-group claim, which locks its jobs directly (_q_candidates) and needs no
            # scan. (MariaDB: 0.3 ms for this, against 0.7 ms for the ranged read of 8 * n
            # index entries and 0.6 ms for the recursion past the group's end.)
            if self.span is None:
                rows = _hot_rows(self.conn, _Q_READY_GROUP_SPAN, {})
                self.span = (rows[0][0], rows[0][1]) if rows else (None, None)
            first, last = self.span
            if first is None or first == last:
                return [] if first is None else [first]
        if self.ranged:
            entries = 8 * n  # groups of up to 8 ready jobs each come from this one read
            params = {"b_after": self.pos, "b_entries": entries, "b_groups": n + 1}
            rows = _hot_rows(self.conn, self.ranged_stmt, {**params, **self.ranged_params})
            got = [r[0] for r in rows][:n]
            # A group followed by another in this read was read whole; so was the last one if
            # the read ended before its entries did (the end of the ready set).
            cut = len(rows) <= n and sum(r[1] for r in rows) >= entries
            for g, _k, runnable, top, ids in rows[:n] if not cut else rows[:-1]:
                if (whole := _concat_ids(runnable, ids, self.limit)) is not None:
                    self.read[g] = whole, top
            if len(got) == n or not cut:  # enough, or the end of the ready set
                return got
        after = got[-1] if got else self.pos  # the read ended inside a big group: skip past it
        params = {"b_after": after, "b_window": n - len(got)}
        if self.read_params is None:
            return got + [r[0] for r in _hot_rows(self.conn, self.stmt, params)]
        found: dict[str, tuple[list[int], Any]] = {}
        keys = _fold_candidates(_hot_rows(self.conn, self.stmt, {**params, **self.read_params}), self.limit, found)
        if after or len(keys) != 1:  # else the statement read no jobs (LIMIT 0)
            self.read.update(found)
        return got + keys

    def served(self, groups: Iterable[str]) -> None:
        """The next window starts after the last group (in key order) this claim leased to,
        so groups of this window that got nothing (idle groups beyond the free slots) are
        ranked again: that keeps the starvation bound at G - 1 + S slot grants."""
        if not self.done and self.cursors.get(self.key):
            self.cursors[self.key] = max(groups)


def _lock_claim(conn: Connection, d: _Dialect, pin: bool = False) -> tuple[tuple[int, int], GlobalLimit]:
    """Take the cap's serialisation point; returns the stored policy counts it carries and the
    global limits (read, and locked, by the same statement).

    SKIP LOCKED alone lets two claimers skip each other's rows and both spend the last free
    slot; this row lock (or SQLite's write lock) makes counting and leasing one atomic step.
    set_group and set_limit take it too, so a claim reads the policy as of its last change.
    With ``pin``, the same statement pins the transaction's plans (d.pin_wanted)."""
    return _claim_meta(_hot_rows(conn, _q_lock_claim(d, pin), {}))


def _claim_meta(rows: Sequence[Any]) -> tuple[tuple[int, int], GlobalLimit]:
    """The claim_lock and global_limits rows (key, value, pin settings...), in key order: the
    stored policy counts and the global limits (none where the row is missing or empty)."""
    if not rows or rows[0][0] != _CLAIM_LOCK_KEY:
        raise JobqError("jobq_meta has no claim_lock row: run jobq.create_schema(engine)")
    return _policy_counts(rows[0][1]), (_global_limit_of(rows[1][1]) if len(rows) > 1 else _NO_GLOBAL_LIMIT)


def _window_candidates(conn: Connection, d: _Dialect, groups: Sequence[str], now: _dt.datetime,
                       types: Sequence[str] | None, limit: int, into: dict[str, list[int]],
                       known: Mapping[str, tuple[list[int], Any]] | None = None) -> dict[str, tuple[list[int], int]]:
    """The window's runnable jobs, read without locks in one statement (per _WINDOW_TERMS
    groups; none for the groups whose candidates the group scan read, ``known``:
    _GroupScan.read): group -> (its first ``limit`` ids in claim order, the largest weight
    among them). Counting them is the claim's per-group count; the ids are what it locks
    once chosen."""
    out: dict[str, tuple[list[int], int]] = {}
    if known:
        for g in groups:
            if (got := known.get(g)) is not None and got[0]:
                into[g] = got[0]
                out[g] = got
        groups = [g for g in groups if g not in known]
        if not groups:
            return out
    # Each term binds the due time and the types again: SQLite counts every occurrence
    # towards its 32,766 bound parameters.
    size = _WINDOW_TERMS
    while size > 1 and size * (3 + len(types or ())) > 30_000:
        size //= 2
    stmts: list[tuple[Any, dict[str, Any]]] = []
    params: dict[str, Any]
    if d.lateral_arrays:
        params = {"b_groups": list(groups), "b_now": now, "b_limit": limit}
        if types is not None:
            params["b_types"] = list(types)
        stmts.append((_q_window_lateral(d, types is not None), params))
    elif d.json_id_lists:
        params = {"b_groups": list(groups), "b_now": now, "b_limit": limit}
        if types is not None:
            params["b_types"] = list(types)
        stmts.append((_q_window_json(d, types is not None), params))
    else:
        for chunk in _chunks(groups, size):
            n = 1 << (len(chunk) - 1).bit_length()  # padded: one prebuilt statement per power of two
            params = {f"b_g{i}": g for i, g in enumerate(chunk)}
            params.update({f"b_g{i}": "" for i in range(len(chunk), n)}, b_now=now, b_limit=limit)
            if types is not None:
                params["b_types"] = types
            stmts.append((_q_window_candidates(d, n, types is not None), params))
    for stmt, params in stmts:
        _fold_candidates(_hot_rows(conn, stmt, params), limit, out)
    for g, (ids, _w) in out.items():
        into[g] = ids
    return out


class _LastStarts(Mapping[str, Any]):
    """The window's last starts (jobq_starts), read on allocate's first question: allocate asks
    only to take turns (fewer slots than idle groups, or ties of remainders), which a claim
    that gives every group of its window what it wants never does."""

    def __init__(self, conn: Connection, groups: Iterable[str]) -> None:
        self.conn, self.groups = conn, sorted(groups)
        self.read: dict[str, Any] | None = None

    def _data(self) -> dict[str, Any]:
        if self.read is None:
            self.read = {g: t for g, t in self.conn.execute(_q_last_starts(self.groups))}
        return self.read

    def __getitem__(self, key: str) -> Any:
        return self._data()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data())

    def __len__(self) -> int:
        return len(self._data())


def _lock_rows(conn: Connection, d: _Dialect, name: str, lock: Callable[[], sa.Select[Any]], params: dict[str, Any],
               lease: dict[str, Any]) -> list[Any]:
    """Run one of the claim's locking reads (``lock()``, prebuilt under ``name``). Where the
    engine takes data-modifying WITH (d.dml_ctes) the same statement also leases the rows it
    locked, with ``lease``'s parameters, and logs their starts (_q_lock_and_lease); elsewhere
    _lease_rows leases them afterwards."""
    if d.dml_ctes:
        return _hot_rows(conn, _q_lock_and_lease(d, name, lock), {**params, **lease})
    return _hot_rows(conn, lock(), params)


def _take_chosen(conn: Connection, d: _Dialect, now: _dt.datetime, free: int, ready: Mapping[str, tuple[int, float]],
                 candidates: Mapping[str, list[int]], in_flight: dict[str, int], caps: Mapping[str, int],
                 lease: dict[str, Any]) -> list[Any]:
    """Allocate the free slots over the window (fair share) and lock the chosen candidates in
    one statement (_lock_rows: leased by it, too, where the engine allows); up to three rounds
    when SKIP LOCKED (another claim holding some of them) left groups short, each offering
    those groups' next candidates. Returns the locked rows, group by group in key order, each
    group's in claim order."""
    rows: list[Any] = []
    took: dict[str, int] = {}  # rows taken per group by earlier rounds
    tried: dict[str, int] = {}  # candidates per group already asked for
    place: dict[int, tuple[str, int]] = {}  # chosen id -> (its group, its place in the group's claim order)
    last_start = _LastStarts(conn, ready) if len(ready) > 1 else {}
    for _ in range(3):
        counts = allocate(
            free - len(rows),
            # What each group can still give: its runnable rows (already clamped to its rate
            # room) less what earlier rounds took, and no more than its untried candidates.
            # Offering the full count again granted a rate-limited group its room a second
            # time when another group came up short.
            {g: k for g, (n, _w) in ready.items()
             if (k := min(n - took.get(g, 0), len(candidates[g]) - tried.get(g, 0))) > 0},
            weights={g: w for g, (_n, w) in ready.items()},
            in_flight=in_flight,
            caps=caps,
            last_start=last_start,
        )
        if not counts:
            break
        chosen: list[int] = []
        for g in sorted(counts):
            start = tried.get(g, 0)
            for i, job_id in enumerate(candidates[g][start:start + counts[g]], start):
                chosen.append(job_id)
                place[job_id] = (g, i)
            tried[g] = start + counts[g]
        got = _lock_rows(conn, d, "chosen", lambda: _q_lock_chosen(d), {"b_ids": chosen, "b_now": now}, lease)
        rows += got
        for r in got:
            g = r[_LEASE_GROUP]
            took[g] = took.get(g, 0) + 1
            in_flight[g] = in_flight.get(g, 0) + 1
        if len(got) == len(chosen) or len(rows) >= free:
            break
    # Group by group in key order, each in claim order (a later round's candidates come later).
    rows.sort(key=lambda r: place[r[_LEASE_ID]])
    return rows


def _lease_rows(
    conn: Connection,
    d: _Dialect,
    *,
    worker_id: str,
    ttl: float,
    now: _dt.datetime,
    limit: int,
    types: Sequence[str] | None,
    max_in_flight: int | None,
    group_caps: Mapping[str, int] | None,
    state: str,
    rate_limits: Mapping[str, tuple[int, float]] | None = None,
    fresh_now: bool = False,
    seen_cap: Callable[[int], None] | None = None,
) -> list[Lease]:
    """The claim: rank the ready set and lease the chosen rows, inside the caller's transaction.

    The global limits stored with set_limit apply on top of ``max_in_flight`` (the smaller cap
    wins) and of ``rate_limits["*"]`` (both apply); ``seen_cap`` is called with the stored cap
    when one is set (the Worker's warning when its own disagrees).

    With ``rate_limits`` and ``fresh_now``, ``now`` is replaced by the database clock read once
    the claim lock is held. Every rate window is then measured on one clock, at one point of
    the serialised claim: a time taken before waiting for the lock, or carried forward from an
    earlier reading (the Worker's clock), would log these starts as older than they are, and
    the next claimer's window would let more out early."""
    pin = d.pin_wanted(conn)  # pinned by the claim's first statement, not one of its own
    in_flight: dict[str, int] = {}
    span: tuple[str | None, str | None] | None = None  # read with the counts (d.span_first)
    if max_in_flight is not None or group_caps or rate_limits:
        stored, glob = _lock_claim(conn, d, pin)
    else:
        # No limits of its own: the claim locks only if stored policy limits some group or a
        # global limit is stored. (A claim that read "none" just before set_group or set_limit
        # stored the first limit still runs unlocked: the change counts from the claims that
        # start after it.)
        stored, glob = _claim_meta(_hot_rows(conn, _q_claim_lock_value(pin), {}))
        if stored[1] or glob.limits:
            stored, glob = _lock_claim(conn, d)
    if pin:
        d.pinned(conn)
    if glob.max_in_flight is not None:
        if seen_cap is not None:
            seen_cap(glob.max_in_flight)
        # The stored cap and the caller's own: the smaller wins.
        max_in_flight = glob.max_in_flight if max_in_flight is None else min(max_in_flight, glob.max_in_flight)
    # Nothing due: done, without reading the ready index (whose order puts priority before
    # run_after, so its reads walk every job scheduled for later) or counting slots.
    if not _hot_rows(conn, _q_any_due(d), {"b_now": now}):
        return []
    if max_in_flight is not None or group_caps or rate_limits or stored[1] or glob.limits:
        if fresh_now and (rate_limits or stored[1] or glob.rate_limit):
            now = d.db_now(conn)
        if d.span_first:
            in_flight, span = _slots_and_span(conn, now)
        else:
            in_flight = _in_flight_counts(conn, now)
    free = limit
    if max_in_flight is not None:
        free = min(free, max_in_flight - sum(in_flight.values()))
    if free <= 0:
        return []
    type_list = list(types) if types is not None else None
    # The "*" bucket, all groups together: the caller's and the stored one both apply.
    for every in ((rate_limits or {}).get("*"), glob.rate_limit):
        if every is not None:
            free = min(free, _rate_room(conn, now, {"*": every}, [])["*"])
            if free <= 0:
                return []
    named_rates = {g: r for g, r in (rate_limits or {}).items() if g != "*"}
    caps = dict(group_caps or {})
    stored_rates: dict[str, tuple[int, float]] = {}
    ready: dict[str, tuple[int, float]] = {}
    candidates: dict[str, list[int]] = {}  # group -> its runnable ids in claim order (at most `free`)
    scan = _GroupScan(conn, d, type_list, now, free, span)
    want = max(free, CLAIM_WINDOW)
    only: str | None = None
    while True:
        # The claim window: the next groups with ready work, as many as slots are still
        # wanted; extended past groups that turn out to have nothing runnable now (all
        # scheduled later, other types, paused, capped or out of rate) until the slots are
        # covered or every group was looked at.
        groups = scan.take(want)
        if not groups:
            break
        policy = _group_policies(conn, groups) if stored[0] else {}
        if policy:
            # Stored policy and the worker's own options combine: the stricter cap wins, both
            # rate limits apply, a stored weight replaces the jobs' weights. Paused groups drop.
            groups = [g for g in groups if g not in policy or not policy[g].paused]
            for g, p in policy.items():
                if p.max_in_flight is not None:
                    caps[g] = min(caps.get(g, p.max_in_flight), p.max_in_flight)
                if p.rate_limit is not None:
                    stored_rates[g] = p.rate_limit
        if groups and scan.done and not ready and len(groups) == 1 and not named_rates and not stored_rates:
            only = groups[0]  # one group in all: nothing to share; one locking read bounded by `free`
            ready = {only: (free, 1)}
            break
        found = {g: (len(ids), w) for g, (ids, w) in _window_candidates(conn, d, groups, now, type_list, free, candidates, scan.read).items()}
        weights = {g: p.weight for g, p in policy.items() if p.weight is not None}
        found = {g: (n, weights.get(g, w)) for g, (n, w) in found.items()}
        named = {g: r for g, r in named_rates.items() if g in found}
        own_rates = {g: r for g, r in stored_rates.items() if g in found}
        if named or own_rates:
            room = _rate_room(conn, now, named, sorted(named)) if named else {}
            for g, n in (_rate_room(conn, now, own_rates, sorted(own_rates)) if own_rates else {}).items():
                room[g] = min(room.get(g, n), n)
            found = {g: (min(n, room.get(g, n)), w) for g, (n, w) in found.items()}
        ready.update(found)
        usable = sum(max(0, min(n, caps[g] - in_flight.get(g, 0)) if g in caps else n) for g, (n, _w) in ready.items())
        if usable >= free or scan.done:
            break
        want = free - usable
    ready = {g: (n, w) for g, (n, w) in ready.items() if n > 0}
    if not ready:
        return []
    token = uuid.uuid4().hex
    expires = now + _dt.timedelta(seconds=ttl)
    leasing = {"b_owner": worker_id, "b_token": token, "b_state": state, "b_now": now, "b_expires": expires}
    if only is not None:
        counts = allocate(free, {only: free}, in_flight=in_flight, caps=caps)
        typed = type_list is not None
        params: dict[str, Any] = {"b_now": now, "b_group": only, "b_limit": counts.get(only, 0)}
        if typed:
            params["b_types"] = type_list
        rows = _lock_rows(conn, d, f"candidates:{typed}", lambda: _q_candidates(d, typed), params, leasing) if counts else []
    else:
        rows = _take_chosen(conn, d, now, free, ready, candidates, in_flight, caps, leasing)
    if not rows:
        return []
    scan.served(r[_LEASE_GROUP] for r in rows)
    if not d.dml_ctes:  # else leased, and their starts logged, by the statement that locked them
        ids = [r[_LEASE_ID] for r in rows]
        n = _hot_rowcount(conn, _q_lease(d), {"b_ids": ids, **leasing})
        if n != len(ids):  # rows were locked by us: anything else is a bug, not a race
            raise JobqError(f"claim leased {n} of {len(ids)} locked rows")
        if only is not None:  # one group: one row, no read
            _hot_rowcount(conn, _Q_LOG_STARTS, {"b_group": only, "b_now": now, "b_n": len(rows)})
        else:
            _hot_rowcount(conn, _q_log_leased_starts(d), {"b_ids": ids, "b_now": now})
    # One Lease per claimed row, its fields set directly: the frozen dataclass's __init__ (an
    # object.__setattr__ per field) took 3.8 us a row, this 0.8 us; the row unpacked as a
    # tuple (_LEASE_COLS' order), not read by name. Keep in sync with Lease
    # (tests/core/test_lifecycle.py compares the two).
    new: Callable[[type[Lease]], Lease] = object.__new__
    loads = getattr(conn.dialect, "_json_deserializer", None) or json.loads  # as the engine's JSON type
    leases: list[Lease] = []
    for job_id, type_, args, group_key, attempts, max_attempts, timeout, parent_id, checkpoint in rows:
        lease = new(Lease)
        lease.__dict__.update(
            id=job_id, type=type_, args={} if args == "{}" else loads(args), group_key=group_key,
            attempt=attempts + 1, max_attempts=max_attempts, timeout=timeout, parent_id=parent_id,
            worker_id=worker_id, token=token, expires=expires,
            checkpoint=None if checkpoint is None else loads(checkpoint),
        )
        leases.append(lease)
    return leases


def claim_batch(
    engine: Engine,
    worker_id: str,
    ttl: float,
    *,
    limit: int = 1,
    types: Iterable[str] | None = None,
    max_in_flight: int | None = None,
    group_caps: Mapping[str, int] | None = None,
    rate_limits: Mapping[str, tuple[int, float]] | None = None,
    now: _dt.datetime | None = None,
) -> list[Lease]:
    """Lease up to ``limit`` runnable jobs in one atomic transaction, split by fair share.

    Args:
        engine: the queue's Engine.
        worker_id: the holder's name, stored as ``lease_owner``.
        ttl: lease length in seconds; renew it with :func:`heartbeat`.
        limit: most jobs to lease.
        types: only these job types (None: any type).
        max_in_flight: a global cap: lease only while fewer jobs than this are in flight across
            every holder (enforced inside the transaction).
        group_caps: group -> most jobs in flight for that group.
        rate_limits: group -> (starts, per_seconds): at most that many starts in any window of
            that length; the group "*" limits all groups together.
        now: naive UTC time to use instead of the database clock (tests).

    Returns:
        The leases, each with the token that :func:`finalize`, :func:`fail` and
        :func:`heartbeat` are fenced by. Jobs are left in state ``leased``.
    """
    _check_name(worker_id, "worker_id")
    ttl_ = _check_seconds(ttl, "ttl", ConfigError, optional=False)
    assert ttl_ is not None
    _check_int(limit, "limit", 0, _MAX_SLOTS, ConfigError)
    type_list = None if types is None else [_check_name(t, "type") for t in types]
    cap = None if max_in_flight is None else _check_int(max_in_flight, "max_in_flight", 0, _MAX_SLOTS, ConfigError)
    caps = _check_caps(group_caps, "group_caps")
    rates = _check_rate_limits(rate_limits)

    def run(conn: Connection, d: _Dialect) -> list[Lease]:
        return _lease_rows(
            conn, d, worker_id=worker_id, ttl=ttl_, now=now or d.db_now(conn), limit=limit, types=type_list,
            max_in_flight=cap, group_caps=caps, state="leased", rate_limits=rates,
            fresh_now=now is None,
        )

    return _transaction(engine, run, immediate=True)


class ClaimedId(int):
    """What :func:`claim` returns: the job id, an ``int`` usable wherever an id is, that also
    carries this dispatch's :class:`Lease` (``.lease``, ``.token``). :func:`finalize`,
    :func:`fail`, :func:`release` and :func:`heartbeat` given it without a ``token`` are
    fenced by its token: per dispatch, so a result from an earlier claim of the same job by
    the same worker is refused. Arithmetic on it gives plain ints; it is stored as its number."""

    lease: Lease

    def __new__(cls, lease: Lease) -> ClaimedId:
        self = super().__new__(cls, lease.id)
        self.lease = lease
        return self

    def __getnewargs__(self) -> tuple[Lease]:  # type: ignore[override]  # pickle and copy
        return (self.lease,)

    @property
    def token(self) -> str:
        return self.lease.token


def claim(engine: Engine, worker_id: str, ttl: float, *, types: Iterable[str] | None = None, now: _dt.datetime | None = None) -> ClaimedId | None:
    """Lease one runnable job and return its id (None when nothing is runnable).

    The seed-level building block: one atomic transaction per dialect (``FOR NO KEY UPDATE SKIP
    LOCKED`` on PostgreSQL, ``FOR UPDATE SKIP LOCKED`` at READ COMMITTED on MySQL/MariaDB,
    ``BEGIN IMMEDIATE`` on SQLite). The id is a :class:`ClaimedId` carrying the lease: finish
    the job with ``finalize(engine, id, result, worker_id=worker_id)`` and the write is fenced
    by this claim's token. Use :func:`claim_batch` for several jobs and for caps.
    """
    leases = claim_batch(engine, worker_id, ttl, limit=1, types=types, now=now)
    return ClaimedId(leases[0]) if leases else None


# ---- heartbeat --------------------------------------------------------------------------------


def _heartbeat_rows(conn: Connection, leases: Sequence[Lease], ttl: float, now: _dt.datetime) -> tuple[set[int], set[int]]:
    held: set[int] = set()
    cancel: set[int] = set()
    by_token: dict[str, list[int]] = {}
    for lease in leases:
        by_token.setdefault(lease.token, []).append(lease.id)
    expires = now + _dt.timedelta(seconds=ttl)
    for token, ids in by_token.items():
        conn.execute(_q_heartbeat(ids, token, now, expires))
        for row in conn.execute(_q_held(ids, token)):  # which are still ours, and cancel flags
            held.add(row.id)
            if row.cancel_requested:
                cancel.add(row.id)
    return held, cancel


def heartbeat(engine: Engine, lease: Lease | ClaimedId, ttl: float, *, now: _dt.datetime | None = None) -> _dt.datetime:
    """Extend a lease (a :class:`Lease`, or the :class:`ClaimedId` from :func:`claim`) by
    ``ttl`` seconds from now; return the new expiry.

    Raises:
        LeaseLost: the lease expired and was reclaimed (or the job was released or finished);
            the holder must stop working on it, its result would be refused.
    """
    ttl_ = _check_seconds(ttl, "ttl", ConfigError, optional=False)
    assert ttl_ is not None
    lease = lease.lease if isinstance(lease, ClaimedId) else lease

    def run(conn: Connection, d: _Dialect) -> _dt.datetime:
        t = now or d.db_now(conn)
        held, _ = _heartbeat_rows(conn, [lease], ttl_, t)
        if lease.id not in held:
            raise LeaseLost(f"job {lease.id}: lease {lease.token[:8]} is no longer held")
        return t + _dt.timedelta(seconds=ttl_)

    return _transaction(engine, run)


# ---- finalize / fail / release ----------------------------------------------------------------


_ERROR_LIMIT = 8000  # longest error text stored (characters)
# The history outcome of a fenced write, by the state it wrote (or, back to ready, by the kind
# of outcome); a failure ("retry", "failed") takes the outcome's own ``ended`` or "failed".
_ENDED_AS = {"done": "done", "cancelled": "cancelled", "release": "released"}


def _apply_outcomes(conn: Connection, d: _Dialect, outcomes: Sequence[_Outcome], now: _dt.datetime) -> list[str | None]:
    """Write each outcome fenced by its own lease. Returns, per outcome, the state written, or
    None where the dispatch no longer held the lease (nothing written for it)."""
    written: list[str | None] = []
    terminal: list[tuple[int, str]] = []
    ended: list[tuple[int, str, str | None]] = []  # attempts this transaction ended: history rows
    fast = [o for o in outcomes if o.kind == "done" and o.owner is not None and o.token is not None]
    landed: set[tuple[int, str | None]] = set()  # (job, token): one batch may hold two dispatches of a job
    recorded = False  # the landed rows' history rows are written already (with the finish)
    if fast:
        # Fast path: one UPDATE per claim batch (lease token) and up to 500 rows, each row
        # still fenced by that token; only if some rows were refused, find out which. A batch
        # of one takes it too: long jobs finish one at a time, and a statement built for each
        # (_q_finish) cost 0.35-0.5 ms of client CPU a job to construct and compile.
        by_lease: dict[tuple[str | None, str | None], list[_Outcome]] = {}
        for o in fast:
            by_lease.setdefault((o.owner, o.token), []).append(o)
        n = 0
        for (owner, token), group in by_lease.items():
            for part in _chunks(group):
                stmt, params = _q_finish_batch(d, part, owner, token, now)
                if params is not None and d.dml_ctes and len(part) == len(outcomes):
                    # The whole batch is one statement: finish and history in one round trip.
                    n += _hot_rows(conn, _q_finish_recorded(d), {**params, "b_worker": owner})[0][0]
                    recorded = True
                else:
                    n += _hot_rowcount(conn, stmt, params)
        ids = [o.job_id for o in fast]
        if n == len(fast):
            landed = {(o.job_id, o.token) for o in fast}
        else:  # rows these statements finished carry exactly this `now`; the others go one by one
            for chunk in _chunks(ids):
                landed.update((i, t) for i, t in conn.execute(_q_landed(chunk, now, {o.token for o in fast})))
    for o in outcomes:
        if (o.job_id, o.token) in landed and o.kind == "done":
            written.append("done")
            terminal.append((o.job_id, "done"))
            if not recorded:
                ended.append((o.job_id, "done", o.owner))
            continue
        if o.kind == "done":
            n = conn.execute(_q_finish(o.job_id, o.owner, o.token, o.result, now)).rowcount
            state = "done"
        elif o.kind == "release":
            n = conn.execute(_q_release(o.job_id, o.owner, o.token, now)).rowcount
            state = "ready"
        else:
            state = "ready" if o.kind == "retry" else "failed"
            n = conn.execute(
                _q_fail(o.job_id, o.owner, o.token, state=state, error=o.error or "failed", now=now,
                        run_after=now + _dt.timedelta(seconds=max(0.0, o.delay)))
            ).rowcount
        if not n:
            # Cancelled while running: whatever the handler did, the job ends cancelled.
            n = conn.execute(_q_cancel_live(o.job_id, o.owner, o.token, now)).rowcount
            state = "cancelled"
        if not n and o.kind == "done" and o.token is not None:
            # A retried finalize whose first COMMIT landed: the row is done under our token.
            again = conn.execute(_q_done_under(o.job_id, o.token)).first()
            written.append("done" if again is not None else None)
            continue  # its history row came with that first COMMIT
        written.append(state if n else None)
        if n:
            ended.append((o.job_id, _ENDED_AS.get(state if state != "ready" else o.kind) or o.ended or "failed", o.owner))
        if n and state in TERMINAL:
            terminal.append((o.job_id, state))
    for rec in _chunks(ended):
        _hot_rowcount(conn, *_q_record_attempts(d, rec, now))
    spawners = [(o, st) for o, st in zip(outcomes, written, strict=True) if o.spawned]
    if spawners:  # before the rollups: a container no longer counts discarded spawns
        _discard_spawns(conn, d, now, {(o.job_id, o.token) for o, st in spawners if st != "done"})
    if terminal:
        _settle(conn, d, now, terminal, {o.job_id: o.parent_id for o in outcomes if o.parent_id != -1})
    if spawners:  # after: the spawner is done and counted, its held jobs are work now
        _release_spawns(conn, d, now, {(o.job_id, o.token) for o, st in spawners if st == "done"})
    return written


def finalize(
    engine: Engine, job_id: int, result: Mapping[str, Any] | None, *, worker_id: str, token: str | None = None,
    now: _dt.datetime | None = None,
) -> None:
    """Mark a leased job done with ``result``, atomically and only if this dispatch holds the lease.

    The result, ``state='done'``, clearing the lease, container rollup and releasing dependents
    are one transaction, fenced per dispatch by the lease token: ``token`` (from
    :func:`claim_batch`), else the one the :class:`ClaimedId` from :func:`claim` carries;
    only for a plain int id without a token is the fence the ``worker_id`` alone.

    Raises:
        LeaseLost: the lease is no longer held by this dispatch; nothing was written.
        InvalidJob: ``result`` is not a JSON object.
    """
    job_id, token = _dispatch_of(job_id, token)
    if result is not None and not isinstance(result, dict):
        raise InvalidJob(f"result must be a dict or None, got {_type_name(result)}")
    value = _encode_checked(result, "result")
    out = _Outcome(job_id, worker_id, token, "done", result=value)

    def run(conn: Connection, d: _Dialect) -> None:
        if _apply_outcomes(conn, d, [out], now or d.db_now(conn))[0] is None:
            raise LeaseLost(f"job {job_id}: not held by {worker_id}" + (f" under lease {token[:8]}" if token else ""))

    _transaction(engine, run)


def fail(
    engine: Engine, job_id: int, error: str, *, worker_id: str, token: str | None = None, retry: bool = True,
    delay: float = 0.0, now: _dt.datetime | None = None,
) -> str:
    """Record a failed attempt: back to ``ready`` after ``delay`` seconds while attempts remain
    (and ``retry`` is true), else ``failed`` (dependents are then failed too).

    Returns:
        The state written: ``"ready"``, ``"failed"``, or ``"cancelled"`` when the job was
        cancelled while it ran.

    Raises:
        LeaseLost: the lease is no longer held by this dispatch; nothing was written.
        ConfigError: ``delay`` is not a finite number of seconds in 0 .. MAX_TIMEDELTA.
    """
    job_id, token = _dispatch_of(job_id, token)  # fenced as finalize is
    delay_ = _check_number(delay, "delay", 0, _MAX_DELAY, ConfigError)

    def run(conn: Connection, d: _Dialect) -> str:
        t = now or d.db_now(conn)
        row = conn.execute(_q_attempts(job_id, worker_id)).first()
        kind = "retry" if row is not None and retry and row.attempts < row.max_attempts else "failed"
        out = _Outcome(job_id, worker_id, token, kind, error=str(error)[:_ERROR_LIMIT], delay=delay_)
        state = _apply_outcomes(conn, d, [out], t)[0]
        if state is None:
            raise LeaseLost(f"job {job_id}: not held by {worker_id}")
        return state

    return _transaction(engine, run)


def release(engine: Engine, job_id: int, *, worker_id: str, token: str | None = None, now: _dt.datetime | None = None) -> None:
    """Give a leased job back to ``ready`` at once without charging an attempt (graceful stop).

    Raises:
        LeaseLost: the lease is no longer held by this dispatch.
    """
    job_id, token = _dispatch_of(job_id, token)  # fenced as finalize is

    def run(conn: Connection, d: _Dialect) -> None:
        out = _Outcome(job_id, worker_id, token, "release")
        if _apply_outcomes(conn, d, [out], now or d.db_now(conn))[0] is None:
            raise LeaseLost(f"job {job_id}: not held by {worker_id}")

    _transaction(engine, run)



# ---- settle: the event-driven DAG bookkeeping --------------------------------------------------


def _chunks(items: Sequence[_K], size: int = 500) -> Iterable[Sequence[_K]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _settle(conn: Connection, d: _Dialect, now: _dt.datetime, events: Iterable[tuple[int, str]],
            known_parents: Mapping[int, int | None] | None = None) -> None:
    """Propagate jobs that just became terminal, in the transaction that made them so.

    done: each dependent's pending count drops; a waiting job that reaches 0 becomes ready (a
    container opens, releasing its children). failed/cancelled: waiting dependents, and the
    waiting subtree of a failed container, end in the same state naming the cause, which
    ``closed_by`` records. Either way the parent container counts the child, and rolls up when
    it was the last. Rounds of a work list, never Python recursion: a bad round's whole
    downstream closes at once (_close_downstream, one recursive read for a chain of any depth),
    nests of containers take a round per level.

    The dependents are read here, in statements after the one that made the jobs terminal: an
    enqueue share-locks the upstreams it names, so that statement waited for any enqueue of a
    dependent to commit, and only a later statement's snapshot sees what it committed.
    """
    todo: deque[tuple[int, str]] = deque(events)
    known = known_parents or {}
    while todo:
        batch = [todo.popleft() for _ in range(len(todo))]
        state_of = dict(batch)
        ids = list(state_of)
        parents: dict[int, list[int]] = {}
        for i in ids:
            p = known.get(i, -1)
            if p is not None and p != -1:
                parents.setdefault(p, []).append(i)
        for chunk in _chunks([i for i in ids if i not in known]):
            for row in conn.execute(_q_parents(chunk)):
                parents.setdefault(row.parent_id, []).append(row.id)
        # -- containers count their children
        for pid in sorted(parents):
            kids = parents[pid]
            bad = [k for k in kids if state_of[k] != "done"]
            if not conn.execute(_q_count_finished_children(pid, len(kids), len(bad))).rowcount:
                continue  # the container already ended (e.g. failed from upstream)
            row = conn.execute(_q_child_counts(pid)).one()
            if row.pending_children == 0:
                state, err = _rollup(row.failed_children, min(bad, default=None))
                conn.execute(_q_roll_up(pid, state, err, now))
                todo.append((pid, state))
        # -- dependents
        for chunk in _chunks([i for i, s in batch if s == "done"]):
            counts: dict[int, int] = dict(_hot_rows(conn, _q_dependent_counts(d), {"b_ids": list(chunk)}))
            if _release_pending(conn, now, counts):
                d.notify(conn)
        ended_badly = {i: s for i, s in batch if s in _BAD}
        if ended_badly:
            # A closed job comes back in the next round: its own walk finds nothing left to
            # close, unless a dependent was enqueued before this transaction locked it.
            todo.extend(_close_downstream(conn, d, now, ended_badly))
        for bad_state in _BAD:  # children of a container that ended badly while they were still waiting
            for chunk in _chunks([i for i, s in batch if s == bad_state]):
                by_box = {r.id: r.parent_id for r in conn.execute(_q_unstarted_children(d, chunk))}
                _close_jobs(conn, d, now, by_box, bad_state, todo, by_container=True)


def _rollup(failed_children: int, example: int | None) -> tuple[str, str | None]:
    """A container's final state once its last child finished, and its error."""
    if failed_children == 0:
        return "done", None
    return "failed", f"{failed_children} child job(s) failed or were cancelled" + (f" (e.g. job {example})" if example else "")


def _release_pending(conn: Connection, now: _dt.datetime, counts: Mapping[int, int]) -> int:
    """Count finished upstreams off (job -> how many); returns how many jobs became ready. A
    container whose own upstreams are now done opens: each child it holds was gated by one
    pending count (see _born_rows), released in the next round, level by level for nests."""
    readied = 0
    while counts:
        by_count: dict[int, list[int]] = {}
        for jid, k in counts.items():
            by_count.setdefault(k, []).append(jid)
        touched: list[int] = []
        for k, jids in sorted(by_count.items()):
            for chunk in _chunks(sorted(jids)):
                conn.execute(_q_count_off(chunk, k))
                touched.extend(chunk)
        opened: list[int] = []
        for chunk in _chunks(sorted(touched)):
            rows = conn.execute(_q_unblocked(chunk)).all()
            leaves = [r.id for r in rows if not r.is_container]
            if leaves:
                conn.execute(_q_make_ready(leaves, now))
                readied += len(leaves)
            opened.extend(r.id for r in rows if r.is_container)
        counts = {}
        for chunk in _chunks(opened):
            counts.update((cid, 1) for cid in conn.execute(_q_waiting_children(chunk)).scalars())
    return readied


def _close_downstream(conn: Connection, d: _Dialect, now: _dt.datetime, seeds: Mapping[int, str]) -> list[tuple[int, str]]:
    """Close every unstarted job downstream of ``seeds`` (jobs that ended badly: id -> state),
    as a walk level by level would: each in the state of the upstream that reached it first
    (a failed one before a cancelled one, then the lowest id), which it names as its cause.
    One recursive read finds them, whatever the depth; their rows are locked, then rewritten
    in batches. Returns the jobs closed, in walk order."""
    d.pin_index_plans(conn)
    into: dict[int, list[int]] = {}  # upstream -> its dependents in the walk
    for chunk in _chunks(sorted(seeds)):
        for u, j in conn.execute(_q_downstream(d, "close"), {"b_ids": list(chunk)}):
            into.setdefault(u, []).append(j)
    open_: set[int] = set()
    for chunk in _chunks(sorted({j for js in into.values() for j in js})):
        open_.update(r.id for r in conn.execute(_q_lock_jobs(d, chunk)) if r.state in ("waiting", "ready"))
    closed: dict[int, tuple[str, int]] = {}
    level = dict(seeds)
    while level:
        reached: dict[int, tuple[int, int]] = {}
        for u, st in level.items():
            for j in into.get(u, ()):
                if j in open_ and j not in closed:
                    reached[j] = min(reached.get(j, (2, 0)), (_BAD.index(st), u))
        closed.update((j, (_BAD[k], u)) for j, (k, u) in sorted(reached.items()))
        level = {j: _BAD[k] for j, (k, _) in reached.items()}
    for bad_state in _BAD:
        _write_closed(conn, now, {j: u for j, (s, u) in closed.items() if s == bad_state}, bad_state)
    return [(j, s) for j, (s, _) in closed.items()]


def _write_closed(conn: Connection, now: _dt.datetime, cause: Mapping[int, int], state: str, *,
                  by_container: bool = False) -> None:
    """Close these jobs (locked by the caller, unstarted), naming ``cause[job]``, in batches."""
    for chunk in _chunks(sorted(cause)):
        conn.execute(_q_close(chunk, state, {j: (cause[j], _closed_error(state, cause[j], by_container)) for j in chunk}, now))


def _close_jobs(conn: Connection, d: _Dialect, now: _dt.datetime, cause: Mapping[int, int], state: str,
                todo: deque[tuple[int, str]], *, by_container: bool = False) -> None:
    """Close those of these jobs that have not started, each because of ``cause[job]``, which
    closed_by keeps; they join ``todo``."""
    unstarted: list[int] = []
    for chunk in _chunks(sorted(cause)):
        unstarted += [r.id for r in conn.execute(_q_lock_jobs(d, chunk)) if r.state in ("waiting", "ready")]
    _write_closed(conn, now, {j: cause[j] for j in unstarted}, state, by_container=by_container)
    todo.extend((j, state) for j in unstarted)


# ---- spawned jobs: released with their spawner's result, or discarded -------------------------


def _held_of(conn: Connection, d: _Dialect, dispatches: Collection[tuple[int, str | None]]) -> list[Any]:
    """The held jobs of these dispatches, (spawner id, its lease token) each: a batch may hold
    a stale dispatch of a job next to its current one, and only the current one's are its.
    Locked: a cancel of one of them commits before this reads its request, or waits."""
    out: list[Any] = []
    for chunk in _chunks(sorted({j for j, _ in dispatches})):
        out += [r for r in conn.execute(_q_held_spawns(d, chunk)) if (r.spawned_by, r.spawn_token) in dispatches]
    return sorted(out, key=lambda r: r.id)


def _release_spawns(conn: Connection, d: _Dialect, now: _dt.datetime, dispatches: Collection[tuple[int, str | None]]) -> None:
    """The spawners' results committed (this transaction): their held jobs become work, with the
    state rule of _born_rows decided now (upstreams may have finished or failed meanwhile; the
    spawner itself is done). Jobs whose upstream or container ended badly close, and settle."""
    rows = _held_of(conn, d, dispatches)
    if not rows:
        return
    mine = {r.id for r in rows}
    ups: dict[int, list[tuple[int, str]]] = {}
    for chunk in _chunks(sorted(mine)):
        for j, u, st in conn.execute(_q_upstream_edges(chunk)):
            ups.setdefault(j, []).append((u, st))
    boxes: dict[int, Any] = {}
    for chunk in _chunks(sorted({r.parent_id for r in rows if r.parent_id is not None and r.parent_id not in mine})):
        boxes.update((b.id, b) for b in conn.execute(_q_lock_jobs(d, chunk)))
    pending: dict[int, int] = {}
    by_upstream: dict[str, dict[int, int]] = {s: {} for s in _BAD}
    by_box: dict[str, dict[int, int]] = {s: {} for s in _BAD}
    for r in rows:  # containers first: a child's gate is its container's pending count
        edges = ups.get(r.id, [])
        bad = sorted((u, st) for u, st in edges if st in _BAD)
        gate = 0
        if r.parent_id in mine:
            gate = int(pending[r.parent_id] > 0)
        elif r.parent_id is not None:
            box = boxes[r.parent_id]
            gate = int(box.pending_deps > 0)
            if box.state in _BAD and not bad:
                by_box[box.state][r.id] = box.id
        if bad:
            by_upstream[bad[0][1]][r.id] = bad[0][0]
        pending[r.id] = sum(1 for u, st in edges if st != "done") + gate
    groups: dict[tuple[str, int], list[int]] = {}
    for r in rows:
        state = "waiting" if r.is_container or pending[r.id] else "ready"
        groups.setdefault((state, pending[r.id]), []).append(r.id)
    for (state, n), ids in sorted(groups.items()):
        for chunk in _chunks(ids):
            conn.execute(_q_release_held(chunk, state, n, now))
    todo: deque[tuple[int, str]] = deque()
    for bad_state in _BAD:
        _close_jobs(conn, d, now, by_upstream[bad_state], bad_state, todo)
        _close_jobs(conn, d, now, by_box[bad_state], bad_state, todo, by_container=True)
    closed = {i for i, _ in todo}
    for r in rows:  # cancel() asked while they were held: cancelled as cancel() would now
        if r.cancel_requested and r.id not in closed:
            conn.execute(_q_cancel_unstarted([r.id], "cancelled", now, root=True))
            todo.append((r.id, "cancelled"))
            if r.is_container:
                todo.extend(_cancel_subtree(conn, d, now, r.id))
            closed.update(i for i, _ in todo)
    if todo:
        _settle(conn, d, now, list(todo))
    if any(state == "ready" for state, _ in groups):
        d.notify(conn)


def _discard_spawns(conn: Connection, d: _Dialect, now: _dt.datetime, dispatches: Collection[tuple[int, str | None]]) -> None:
    """These dispatches ended without their result (failed, retried, released, cancelled, lease
    lost, reclaimed): delete their held jobs and edges, and uncount them from their containers;
    a container left with only finished children rolls up (settled here)."""
    rows = _held_of(conn, d, dispatches)
    if not rows:
        return
    mine = {r.id for r in rows}
    per_box: dict[int, int] = {}
    for r in rows:
        if r.parent_id is not None and r.parent_id not in mine:
            per_box[r.parent_id] = per_box.get(r.parent_id, 0) + 1
    kept = _referenced_held(conn, rows)
    gone = [r for r in rows if r.id not in kept]
    for chunk in _chunks(sorted(r.id for r in gone)):
        conn.execute(_q_delete_edges(chunk))
    leaves = sorted(r.id for r in gone if not r.is_container)
    for chunk in _chunks(leaves):
        conn.execute(_q_delete_jobs(chunk))
    for jid in sorted((r.id for r in gone if r.is_container), reverse=True):  # innermost first (foreign keys)
        conn.execute(_q_delete_jobs([jid]))
    if kept:
        _cancel_tree(conn, d, now, [r for r in rows if r.id in kept])
    rolled: list[tuple[int, str]] = []
    for pid, n in sorted(per_box.items()):
        if not conn.execute(_q_uncount_children(pid, n)).rowcount:
            continue
        c = conn.execute(_q_child_counts(pid)).one()
        if c.state == "waiting" and c.pending_children == 0 and conn.execute(_q_child_states(pid)).first() is not None:
            state, err = _rollup(c.failed_children, None)
            conn.execute(_q_roll_up(pid, state, err, now))
            rolled.append((pid, state))
    if rolled:
        _settle(conn, d, now, rolled)


def _referenced_held(conn: Connection, rows: Sequence[Any]) -> set[int]:
    """The held jobs (``rows``, one dispatch's) that a job outside them names, as upstream or as
    container, with the held containers around those. Nothing outside may name a held job
    (_insert_new and _refuse_unborn_holders refuse it), so this is empty unless that rule
    has a hole: then deleting them would leave a dependency that never resolves, or a child
    whose container is gone (a foreign-key error in every reclaim, which wedges the queue)."""
    mine = {r.id for r in rows}
    named: set[int] = set()
    for chunk in _chunks(sorted(mine)):
        for held_id, by in conn.execute(_q_referrers(chunk)):
            if by not in mine:
                named.add(held_id)
    parent = {r.id: r.parent_id for r in rows}
    out: set[int] = set()
    for i in named:
        while i in mine and i not in out:  # a kept job keeps its held containers (foreign keys)
            out.add(i)
            i = parent[i]
    return out


def _cancel_tree(conn: Connection, d: _Dialect, now: _dt.datetime, rows: Sequence[Any]) -> None:
    """Held jobs that something outside names, of a dispatch whose result never commits
    (_referenced_held): closed as cancelled instead of deleted, with whatever depends on them
    or sits in them cancelled too (cancel's walk). Their containers are uncounted by the
    caller as for the deleted spawns, so they settle here without counting into them."""
    ids = sorted(r.id for r in rows)
    spawner = {r.id: r.spawned_by for r in rows}
    for i in ids:
        conn.execute(_q_close_held(i, f"cancelled: spawned by job {spawner[i]}, whose result never committed", now))
    closed = [(i, "cancelled") for i in ids]
    for r in rows:
        if r.is_container:
            closed += _cancel_subtree(conn, d, now, r.id)
    _settle(conn, d, now, closed, {i: None for i in ids})


# ---- reclaim ----------------------------------------------------------------------------------


_HOUSEKEEPING: weakref.WeakKeyDictionary[Engine, float] = weakref.WeakKeyDictionary()
_SWEEP_SECONDS = 1.0  # a Worker's reclaim sweep runs at most this often (lease_ttl / 4 if less)
_SWEEP_LIMIT = 1000  # expired leases one sweep returns; a full sweep is followed by another
_HOUSEKEEPING_SECONDS = 5.0  # how often (per process and engine) a sweep also trims the side tables


def _reclaim_rows(conn: Connection, d: _Dialect, now: _dt.datetime, limit: int = 1000) -> list[tuple[int, str]]:
    d.pin_index_plans(conn)
    # Expired held slots and old start rows are ignored by every count, so deleting them is
    # housekeeping: done every few seconds, not on every tick.
    if time.monotonic() - _HOUSEKEEPING.get(conn.engine, -math.inf) > _HOUSEKEEPING_SECONDS:
        _HOUSEKEEPING[conn.engine] = time.monotonic()
        conn.execute(_Q_SWEEP_SLOTS, {"b_now": now})
        conn.execute(_Q_SWEEP_STARTS, {"b_before": now - START_LOG_RETENTION})
    rows = conn.execute(_q_expired(d), {"b_now": now, "b_limit": limit}).all()
    if not rows:
        return []
    _discard_spawns(conn, d, now, {(r.id, r.lease_token) for r in rows})  # their results never commit
    cancel = [r.id for r in rows if r.cancel_requested]
    retry = [r.id for r in rows if r.attempts < r.max_attempts and not r.cancel_requested]
    dead = [r.id for r in rows if r.attempts >= r.max_attempts and not r.cancel_requested]
    out: list[tuple[int, str]] = []
    if cancel:
        conn.execute(_q_record_reclaims(cancel, now, "cancelled"))
        conn.execute(_q_reclaim_cancelled(cancel, now))
        out += [(i, "cancelled") for i in cancel]
        _settle(conn, d, now, [(i, "cancelled") for i in cancel])
    if retry:
        conn.execute(_q_record_reclaims(retry, now, "retry"))
        conn.execute(_q_reclaim(retry, now, dead=False))
        out += [(i, "ready") for i in retry]
        d.notify(conn)
    if dead:
        conn.execute(_q_record_reclaims(dead, now, "dead"))
        conn.execute(_q_reclaim(dead, now, dead=True))
        out += [(i, "failed") for i in dead]
        _settle(conn, d, now, [(i, "failed") for i in dead])
    return out


def reclaim(engine: Engine, now: _dt.datetime | None = None) -> int:
    """Return jobs whose lease expired to ``ready`` (or ``failed`` when that was their last
    attempt); returns how many were reclaimed.

    The sweep repeats its condition inside the UPDATE, so a job that finished or was leased
    again since it was read is never touched. Two sweepers never reclaim a job twice.
    """

    def run(conn: Connection, d: _Dialect) -> int:
        return len(_reclaim_rows(conn, d, now or d.db_now(conn)))

    return _transaction(engine, run, immediate=True)


# ---- cancel and retry -------------------------------------------------------------------------


def _subtree(conn: Connection, root: int) -> list[int]:
    """The root and all its descendants (containers nest), level by level."""
    out, level = [root], [root]
    while level:
        nxt: list[int] = []
        for chunk in _chunks(level):
            nxt += list(conn.execute(_q_children_of(chunk)).scalars())
        out += nxt
        level = nxt
    return out


def _cancel_subtree(conn: Connection, d: _Dialect, now: _dt.datetime, box: int) -> list[tuple[int, str]]:
    """Cancel the unfinished subtree of container ``box`` (locked by the caller), level by level,
    each row locked before its state is read: unstarted jobs close naming their container
    (the error names ``box``), leased/running ones are asked to stop. Held spawns are not
    walked: their release applies their container's state. Returns the jobs closed, to settle."""
    closed: list[tuple[int, str]] = []
    level = conn.execute(_q_lock_open_children(d, [box])).all()
    while level:
        unstarted = [r.id for r in level if r.state in ("waiting", "ready")]
        for chunk in _chunks(unstarted):
            conn.execute(_q_cancel_unstarted(chunk, f"cancelled with container {box}", now, root=False))
        closed += [(i, "cancelled") for i in unstarted]
        for chunk in _chunks([r.id for r in level if r.state in _LIVE]):
            conn.execute(_q_request_cancel(chunk))
        boxes = [r.id for r in level if r.is_container]
        level = []
        for chunk in _chunks(boxes):
            level += conn.execute(_q_lock_open_children(d, chunk)).all()
    return closed


def cancel(engine: Engine, job_id: int, *, now: _dt.datetime | None = None) -> str:
    """Cancel a job, or a container with its whole subtree.

    A waiting or ready job becomes ``cancelled`` at once; a leased or running one is asked to
    stop (its handler sees ``ctx.stop_requested`` with reason "cancelled" at the next heartbeat)
    and ends ``cancelled`` when it returns, whatever it returns. A ``held`` job (spawned by a
    handler still running) records the request too: the transaction that commits its
    spawner's result releases it cancelled (with its subtree), and it never runs; if the
    spawner fails, the job is deleted with its other spawns. Jobs that depend on a
    cancelled job are cancelled too, naming the cause. A finished job (done, failed or
    cancelled, also one cancelled because of its upstream) is left exactly as it is.

    The subtree is locked level by level, each row before its state is read, so a job that
    finishes meanwhile keeps its result, and a child enqueued into the subtree meanwhile is
    either seen and cancelled or refused (its container is cancelled by then).

    Returns:
        The job's state afterwards: "cancelled"; its live state ("leased", "running") or
        "held" when the cancel is requested (``cancel_requested`` is set); or its terminal
        state if it had finished.

    Raises:
        InvalidJob: no such job.
    """
    job_id = _as_id(job_id, "job_id")

    def run(conn: Connection, d: _Dialect) -> str:
        t = now or d.db_now(conn)
        root = conn.execute(_q_lock_jobs(d, [job_id])).first()
        if root is None:
            raise InvalidJob(f"cancel: no job with id {job_id}")
        if root.state in TERMINAL:
            return str(root.state)
        if root.state in (*_LIVE, "held"):  # a held job's request is applied by its release (_release_spawns)
            conn.execute(_q_request_cancel([job_id]))
        closed = _cancel_subtree(conn, d, t, job_id) if root.is_container else []
        if root.state in ("waiting", "ready"):
            # the root says plainly what happened to it; its descendants name the container
            conn.execute(_q_cancel_unstarted([job_id], "cancelled", t, root=True))
            closed.insert(0, (job_id, "cancelled"))
        if closed:
            _settle(conn, d, t, closed)
        return "cancelled" if root.state in ("waiting", "ready") else str(root.state)

    return _transaction(engine, run)


def retry(engine: Engine, job_id: int, *, now: _dt.datetime | None = None, from_root: bool = False) -> list[int]:
    """Give a ``failed`` or ``cancelled`` job fresh attempts, and re-open what closed because of it.

    The job goes back to ``ready`` (``waiting`` while upstreams are unfinished); a container
    retries its failed and cancelled descendants, and withdraws the cancel request of children
    still running since it was cancelled (they may finish after all). A closed container
    around the job comes back first, with its children. Dependents that were closed by
    propagation (``closed_by``: an upstream or their container ended badly) re-open once none
    of their upstreams is failed or cancelled any more, transitively; containers that roll up
    again once their re-opened children are settled do so in the same transaction.

    Args:
        engine: the queue's Engine.
        job_id: the failed or cancelled job.
        now: the time to record (default: the database clock).
        from_root: a job closed because an upstream failed is refused on its own (its upstream
            is still failed); with ``from_root`` the jobs that keep it closed (its roots: the
            failed or cancelled jobs up its chain that have no failed or cancelled upstream
            themselves, as :func:`why` names them) are retried first, in the same transaction,
            which re-opens the chain down to this job.

    Returns:
        Every job id that was re-opened, the given one first.

    Raises:
        InvalidJob: no such job, it is not failed/cancelled, or (without ``from_root``) one of
            its own upstreams (or an upstream of a closed container around it) is failed or
            cancelled (retry that one first, or pass ``from_root``).
    """
    job_id = _as_id(job_id, "job_id")
    if not isinstance(from_root, bool):
        raise ConfigError(f"retry: from_root must be True or False, got {from_root!r}")

    def run(conn: Connection, d: _Dialect) -> list[int]:
        t = now or d.db_now(conn)
        row = conn.execute(_q_lock_jobs(d, [job_id])).first()
        if row is None:
            raise InvalidJob(f"retry: no job with id {job_id}")
        if row.state not in _BAD:
            raise InvalidJob(f"retry: job {job_id} is {row.state}; only failed or cancelled jobs can be retried")
        reopened: list[int] = []
        # the roots first (each re-opens what it closed, this job's chain among it), then the
        # job itself if it is still closed (a job cancelled on its own is closed by nobody)
        for jid in [*(_retry_roots(conn, job_id, d) if from_root else []), job_id]:
            found = conn.execute(_q_lock_jobs(d, [jid])).first()
            if jid in reopened or found is None or found.state not in _BAD:
                continue
            _check_reopenable(conn, d, jid, job_id)
            try:
                reopened += _reopen(conn, d, t, jid)
            except sa.exc.IntegrityError as exc:  # only ux_jobs_unique_live can refuse a re-open
                raise InvalidJob(f"retry: job {job_id} (or a job it re-opens) has a unique_key that an unfinished "
                                 f"job holds now: {_one_line(exc.orig)}") from None
        if job_id in reopened:
            reopened.remove(job_id)
            reopened.insert(0, job_id)
        return reopened

    return _transaction(engine, run)


def _check_reopenable(conn: Connection, d: _Dialect, jid: int, asked: int) -> None:
    """Refuse to re-open ``jid`` (for a retry of ``asked``) while it, or a closed container
    around it, depends on a failed or cancelled job."""
    x = conn.execute(_q_lock_jobs(d, [jid])).one()
    while True:  # the job, then each closed container around it, must be free to re-open
        bad = [(u, s) for u, s in conn.execute(_q_upstreams_of(d, x.id)) if s in _BAD]
        if bad:
            inside = "" if x.id == asked else f" is inside container {x.id}, which"
            raise InvalidJob(f"retry: job {asked}{inside} depends on job {bad[0][0]}, which is {bad[0][1]}; "
                             f"retry that one first, or re-open the chain from its root: jobq retry --root {asked}")
        if x.parent_id is None:
            break
        x = conn.execute(_q_lock_jobs(d, [x.parent_id])).one()
        if x.state not in _BAD:
            break


def _retry_roots(conn: Connection, job_id: int, d: _Dialect | None = None) -> list[int]:
    """The failed or cancelled jobs that keep a closed ``job_id`` closed and that a retry
    accepts now: up the failed/cancelled upstreams (of the job and of each closed container
    around it, as retry checks them), level by level, to those that have none. [job_id] when
    nothing keeps it closed. One recursive read fetches every row the levels can reach; the
    levels are then walked in memory. Plain reads: retry then locks and checks each root again."""
    d = d or _prepare(conn.engine)
    d.pin_index_plans(conn)
    state: dict[int, str] = {}
    parent: dict[int, int] = {}  # a job's container, where that is failed or cancelled
    bad_ups: dict[int, list[int]] = {}
    for i, src, k, st in conn.execute(_q_closed_upstream_walk(d), {"job_id": job_id}):
        state[i] = st
        if k == 0:
            bad_ups.setdefault(src, []).append(i)
        elif k == 1:
            parent[src] = i
    # what a level's read of these rows returned: a container only above a failed/cancelled job
    rows = {i: (st, parent.get(i) if st in _BAD else None) for i, st in state.items()}
    roots: list[int] = []
    info: dict[int, tuple[str, int | None]] = {}
    seen, level = {job_id}, [job_id]
    while level:
        need = [j for j in level if j not in info]
        while need:  # the rows of this level, and of the closed containers around them
            info.update((i, rows[i]) for i in need if i in rows)
            need = sorted({p for j in need if j in info for st, p in [info[j]]
                           if st in _BAD and p is not None and p not in info})
        scope: dict[int, list[int]] = {}
        for j in level:
            x, scope[j] = j, [j]
            while (p := info.get(x, ("", None))[1]) is not None and info.get(p, ("", None))[0] in _BAD:
                x = p
                scope[j].append(x)
        nxt = []
        for j in level:
            ups = sorted({u for x in scope[j] for u in bad_ups.get(x, [])})
            if not ups:
                roots.append(j)
            for u in ups:
                if u not in seen:
                    seen.add(u)
                    nxt.append(u)
        level = nxt
    return sorted(roots)


def _reopen(conn: Connection, d: _Dialect, now: _dt.datetime, root: int) -> list[int]:
    """Re-open ``root`` and what closed because of it (see retry), wave by wave: a wave is its
    frontier (first the root) and every job closed by propagation downstream of it, found by one
    recursive read and locked. A job of the wave re-opens when none of its upstreams stays
    closed (each upstream is open, or re-opens in this wave) and its container is waiting; a
    closed container around it goes to the next frontier first, and a re-opened container's
    closed children are the next frontier. Batches rewrite the rows: statements grow with the
    waves (the nesting of containers) and the batches, not with the jobs. Returns the ids
    re-opened, each wave in walk order."""
    d.pin_index_plans(conn)
    out: list[int] = []
    boxes: list[tuple[int, bool]] = []  # re-opened containers, outermost first, and whether they have children
    pushed: set[int] = set()  # closed containers sent to a frontier for the children inside them
    frontier = [root]
    while frontier:
        start = sorted(set(frontier))
        down: dict[int, list[int]] = {}  # upstream -> its dependents in the wave
        for chunk in _chunks(start):
            for u, j in conn.execute(_q_downstream(d, "reopen"), {"b_ids": list(chunk)}):
                down.setdefault(u, []).append(j)
        wave = sorted(set(start) | {j for js in down.values() for j in js})
        rows: dict[int, Any] = {}
        for chunk in _chunks(wave):
            rows.update((r.id, r) for r in conn.execute(_q_lock_jobs(d, chunk)))
        todo = {j for j, r in rows.items() if r.state in _BAD}
        ups: dict[int, list[int]] = {}
        state: dict[int, str] = {j: r.state for j, r in rows.items()}
        for chunk in _chunks(sorted(todo)):
            for j, u, _ in conn.execute(_q_upstream_edges(chunk)):
                ups.setdefault(j, []).append(u)
        for chunk in _chunks(sorted({u for us in ups.values() for u in us} - set(rows))):
            state.update(conn.execute(_q_upstream_states(d, chunk)).all())  # share-locked, as enqueue does
        for chunk in _chunks(sorted({r.parent_id for j, r in rows.items() if j in todo and r.parent_id is not None} - set(rows))):
            rows.update((r.id, r) for r in conn.execute(_q_lock_jobs(d, chunk)))
        # A job re-opens once none of its upstreams stays closed and its container is waiting
        # (one closed, or re-opening in this wave, takes it back with its children later):
        # drop the others, and what depends on them, until none is left.
        closed = set(todo)
        while True:
            check = deque(sorted(todo))
            while check:
                j = check.popleft()
                if j in todo and any(state[u] in _BAD and u not in todo for u in ups.get(j, ())):
                    todo.discard(j)
                    check.extend(down.get(j, ()))
            boxed = {j for j in todo if rows[j].parent_id is not None and rows[rows[j].parent_id].state != "waiting"}
            if not boxed:
                break
            todo -= boxed
        # a closed container comes back first, with its children, for a job that only it keeps
        frontier = []
        for j in sorted(closed - todo):
            box = rows.get(rows[j].parent_id)
            if (box is not None and box.state in _BAD and box.id not in todo and box.id not in pushed
                    and not any(state[u] in _BAD and u not in todo for u in ups.get(j, ()))):
                pushed.add(box.id)
                frontier.append(box.id)
        order = _walk_order(start, down, todo)
        kids_of: dict[int, int] = {}
        groups: dict[tuple[str, int], list[int]] = {}
        for j in order:
            r = rows[j]
            gate = 0
            if r.parent_id is not None:  # its container counted it as finished badly; it is pending again
                kids_of[r.parent_id] = kids_of.get(r.parent_id, 0) + 1
                gate = 1 if rows[r.parent_id].pending_deps else 0
            pending = sum(1 for u in ups.get(j, ()) if state[u] != "done") + gate
            if r.is_container:
                kids = conn.execute(_q_child_states(j)).all()
                bad_kids = [k for k, s in kids if s in _BAD]
                live = sum(1 for _, s in kids if s not in TERMINAL)
                # unfinished children are pending; failed ones count as finished badly until each
                # re-opened child moves itself back to pending
                conn.execute(_q_reopen([j], "waiting", pending, now, pending_children=live, failed_children=len(bad_kids)))
                conn.execute(_q_withdraw_cancel(j))
                frontier.extend(bad_kids)
                boxes.append((j, bool(kids)))
            else:
                groups.setdefault(("waiting" if pending else "ready", pending), []).append(j)
        for (st, pending), ids in sorted(groups.items()):
            for chunk in _chunks(sorted(ids)):
                conn.execute(_q_reopen(chunk, st, pending, now))
        for pid, n in sorted(kids_of.items()):
            conn.execute(_q_uncount_failed_children(pid, n))
        out += order
    for jid, has_kids in reversed(boxes):  # innermost first: children that stayed closed roll it up again
        c = conn.execute(_q_child_counts(jid)).one()
        if has_kids and c.state == "waiting" and c.pending_children == 0:
            st, err = _rollup(c.failed_children, None)
            conn.execute(_q_roll_up(jid, st, err, now))
            _settle(conn, d, now, [(jid, st)])
    if out:
        d.notify(conn)
    return out


def _walk_order(frontier: Sequence[int], down: Mapping[int, Sequence[int]], keep: Collection[int]) -> list[int]:
    """``keep``'s jobs level by level down from ``frontier`` (by id within a level)."""
    out: list[int] = []
    seen: set[int] = set()
    level = sorted(set(frontier))
    while level:
        out += [j for j in level if j in keep]
        seen.update(level)
        level = sorted({k for j in level if j in keep for k in down.get(j, ()) if k not in seen})
    return out


# ---- prune ------------------------------------------------------------------------------------


def prune(engine: Engine, older_than: _dt.timedelta, *, states: Sequence[str] = ("done",), batch: int = 1000,
          now: _dt.datetime | None = None) -> int:
    """Delete finished jobs that finished more than ``older_than`` ago, in bounded batches.

    A job is kept while an unfinished job depends on it, while its container is unfinished,
    and (for a container) while any of its children remains. Each batch is one short
    transaction found through the finished-rows index, so the cost follows what is
    deleted, not the size of the history. A job re-opened meanwhile (:func:`retry`) is never
    deleted: each batch is locked and checked again before its delete.

    Returns:
        How many jobs were deleted.
    """
    older_than = _check_age(older_than, "older_than")
    bad = [st for st in states if st not in TERMINAL]
    if bad:
        raise ConfigError(f"prune: only finished states can be pruned, not {bad}")
    _check_int(batch, "batch", 1, 100_000, ConfigError)
    total = 0
    while True:

        def one(conn: Connection, d: _Dialect) -> int:
            cutoff = (now or d.db_now(conn)) - older_than
            read = list(conn.execute(_q_prunable(states, cutoff, batch)).scalars())
            _checkpoint("prune_read", read)
            # The read took no locks: what it found may have been re-opened (retry) since.
            ids = list(conn.execute(_q_lock_prunable(d, read, states, cutoff)).scalars()) if read else []
            _checkpoint("prune_locked", ids)
            if ids:
                conn.execute(_q_delete_edges(ids))
                conn.execute(_q_delete_attempts(ids))
                conn.execute(_q_delete_jobs(ids))
            return len(ids)

        n = _transaction(engine, one)
        total += n
        if n == 0:  # a short batch may have freed containers whose children it deleted: go again
            return total


# ---- why --------------------------------------------------------------------------------------


def _iso(value: _dt.datetime | None, *, precise: bool = False) -> str | None:
    """ISO 8601 UTC with a ``Z``, the one way jobq prints a time: to the second for people,
    to the microsecond (``precise``) for JSON. Naive values are UTC (as stored)."""
    if value is None:
        return None
    if value.tzinfo is not None:
        value = value.astimezone(_dt.timezone.utc).replace(tzinfo=None)
    return value.isoformat(timespec="microseconds" if precise else "seconds") + "Z"


def _span(seconds: float) -> str:
    """A non-negative duration for people: 7s, 5m03s, 3h20m, 2d04h."""
    s = int(round(seconds))
    if s < 120:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 172800:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def why(engine: Engine, job_id: int, *, now: _dt.datetime | None = None) -> str:
    """One line a person understands: why this job is not running right now (or what it did).

    Covers: finished (and how), leased/running (by whom, until when), waiting on upstreams
    (which, in what state), waiting on an enclosing container's upstreams, a container's
    unfinished children, scheduled for later (backing off, or a ``run_after`` in the future),
    due jobs held back by their group's stored policy (paused, at its cap, its rate limit
    spent), and due jobs waiting for a worker: a worker's own caps and fair-share turns are not
    stored, so it reports what the queue knows: the due jobs ahead of it in its group, how many
    jobs are in flight, in its group and overall, and by which workers. Times are ISO 8601 UTC.
    """
    job_id = _as_id(job_id, "job_id")
    d = _prepare(engine)
    with engine.connect() as conn:
        t = now or d.db_now(conn)
        r = conn.execute(_q_job(job_id)).first()
        if r is None:
            return f"job {job_id}: no such job"
        head = f"job {job_id} ({r.type}, group {r.group_key})"
        # what a rerun resumes from, and how far the handler said it was
        note = "".join((f"; progress {_progress_text(r.progress)}" if r.progress is not None else "",
                        f"; last checkpoint {_one_line(json.dumps(r.checkpoint, sort_keys=True))[:120]}"
                        if r.checkpoint is not None else ""))
        if r.state == "done":
            return f"{head} is done: finished {_iso(r.finished_at)} after {r.attempts} attempt(s)"
        if r.state in ("failed", "cancelled"):
            roots = [x for x in _retry_roots(conn, job_id, d) if x != job_id]
            if not roots:
                return f"{head} is {r.state}: {_one_line(r.error or '')} (retry it with: jobq retry {job_id}){note}"
            states = {i: st for i, st, _ in conn.execute(_q_closed_nodes(roots[:5]))}
            if len(roots) == 1:
                which = f"retry job {roots[0]}, the {states.get(roots[0], 'failed')} job this one waits on " \
                        f"(jobq retry {roots[0]})"
            else:
                listed = ", ".join(f"{x} ({states.get(x, '?')})" for x in roots[:5]) + (
                    f" and {len(roots) - 5} more" if len(roots) > 5 else "")
                which = f"retry jobs {listed}, the failed or cancelled jobs this one waits on"
            return (f"{head} is {r.state}: {_one_line(r.error or '')} ({which}, or re-open the chain from its "
                    f"root: jobq retry --root {job_id}){note}")
        if r.state == "held":
            if r.cancel_requested:
                return (f"{head} is held: spawned by job {r.spawned_by}, whose handler is still running; cancel "
                        f"requested: it ends cancelled (never runs) if that job's result commits, and is deleted if it "
                        f"does not")
            return (f"{head} is held: spawned by job {r.spawned_by}, whose handler is still running; it becomes work "
                    f"if that job's result commits, and is deleted if it does not")
        if r.state in _LIVE:
            left = (r.lease_expires - t).total_seconds() if r.lease_expires else 0.0
            ask = "; cancel requested" if r.cancel_requested else ""
            if left < 0:
                return (f"{head} is {r.state} by {r.lease_owner} but its lease expired {_span(-left)} ago: "
                        f"the next claim reclaims it{ask}{note}")
            return (f"{head} is {r.state} (attempt {r.attempts}/{r.max_attempts}) by {r.lease_owner}, "
                    f"lease good for {_span(left)}{ask}{note}")
        if r.state == "waiting":
            ups = conn.execute(_q_unfinished_upstreams(job_id)).all()
            if ups:
                listed = ", ".join(f"{u.id} ({u.state})" for u in ups[:5]) + (f" and {len(ups) - 5} more" if len(ups) > 5 else "")
                return f"{head} is waiting on {len(ups)} upstream job(s): {listed}"
            for a in _ancestors(conn, r.parent_id):
                aups = conn.execute(_q_unfinished_upstreams(a)).all()
                if aups:
                    return f"{head} is waiting: its container {a} waits on upstream job(s) " + ", ".join(
                        f"{u.id} ({u.state})" for u in aups[:5])
            if r.is_container:
                return f"{head} is a container with {r.pending_children} unfinished child job(s); it rolls up when they finish"
            return f"{head} is waiting, but nothing it waits for is unfinished (pending count {r.pending_deps}): report this"
        # ready: scheduled for later, or due and waiting for a worker
        last = conn.execute(_q_attempt_history(job_id, last=True)).first() if r.attempts else None
        ended = f" ({last.outcome})" if last is not None and last.outcome != "failed" else ""  # timeout, reclaimed
        if r.run_after > t:
            when = f"{head} is scheduled, runs in {_span((r.run_after - t).total_seconds())} (at {_iso(r.run_after)})"
            if r.attempts:
                return f"{when}: backing off after attempt {r.attempts}{ended}: {_one_line(r.error or '')}{note}"
            return when
        holders = conn.execute(_q_holders()).all()
        total = sum(n for _, _, n in holders)
        mine = sum(n for _, g, n in holders if g == r.group_key)
        ahead = conn.execute(_q_ahead_in_group(r.group_key, r.priority, r.run_after, r.id, t)).scalar_one()
        owners = sorted({o for o, _, _ in holders if o})
        policy = _group_policies(conn, [r.group_key]).get(r.group_key) if _policy_counts(
            conn.execute(_Q_CLAIM_LOCK_VALUE).scalar())[0] else None
        if policy is not None:
            held = _policy_hold(conn, policy, mine, t)
            if held:
                return f"{head} is ready, due {_span((t - r.run_after).total_seconds())} ago, not claimed: {held}"
        held = _global_hold(conn, _global_limit_of(conn.execute(_Q_GLOBAL_LIMITS).scalar() or ""), total, t)
        if held:
            return f"{head} is ready, due {_span((t - r.run_after).total_seconds())} ago, not claimed: {held}"
        return (f"{head} is ready, due {_span((t - r.run_after).total_seconds())} ago, waiting for a worker"
                + (f" (attempt {last.attempt} ended: {last.outcome})" if last is not None else "") + ": "
                f"{ahead} due job(s) ahead of it in its group (by priority, then age); "
                f"{total} job(s) in flight ({mine} in its group) held by {', '.join(owners[:3]) or 'no worker'}"
                + (": the global or group cap may be full" if total else
                   ": no worker is running jobs; is a worker with a handler for this type up?") + note)


def _global_hold(conn: Connection, g: GlobalLimit, in_flight: int, now: _dt.datetime) -> str:
    """What in the stored global limits holds a due job back now ("" if nothing does)."""
    if g.max_in_flight is not None and in_flight >= g.max_in_flight:
        return f"the global cap is full: {in_flight} of {g.max_in_flight} job(s) in flight (jobq limit)"
    if g.rate_limit is not None and _rate_room(conn, now, {"*": g.rate_limit}, [])["*"] <= 0:
        n, period = g.rate_limit
        return f"the global rate limit is spent: {n} start(s) in the last {_span(period)} (jobq limit)"
    return ""


def _policy_hold(conn: Connection, p: GroupPolicy, in_flight: int, now: _dt.datetime) -> str:
    """What in its group's stored policy holds a due job back now ("" if nothing does)."""
    if p.paused:
        return f"its group is paused (resume it with: jobq group {p.group_key} --resume)"
    if p.max_in_flight is not None and in_flight >= p.max_in_flight:
        return f"its group is at its cap: {in_flight} of {p.max_in_flight} job(s) in flight"
    if p.rate_limit is not None:
        n, period = p.rate_limit
        used = _rate_room(conn, now, {p.group_key: p.rate_limit}, [p.group_key])[p.group_key]
        if used <= 0:
            return f"its group's rate limit is spent: {n} start(s) in the last {_span(period)}"
    return ""


# ---- tick and stats ---------------------------------------------------------------------------


def tick(
    engine: Engine,
    worker_id: str,
    types: Iterable[str] | None,
    *,
    max_concurrency: int,
    lease_ttl: float,
    limit: int | None = None,
    group_caps: Mapping[str, int] | None = None,
    rate_limits: Mapping[str, tuple[int, float]] | None = None,
    now: _dt.datetime | None = None,
    state: str = "leased",
) -> tuple[int, list[Lease]]:
    """One scheduling round in one transaction: reclaim expired leases, rank the ready set by
    fair share, and lease what fits under the global cap.

    Returns:
        ``(reclaimed, leases)``. Dispatching the leases is the caller's job (``Worker`` does it).

    Raises:
        ConfigError: a bad cap, limit, lease TTL or rate limit (NaN, infinite, out of range).
        InvalidJob: a bad ``worker_id`` or type name.
    """
    _check_name(worker_id, "worker_id")
    type_list = None if types is None else [_check_name(t, "type") for t in types]
    cap = _check_int(max_concurrency, "max_concurrency", 0, _MAX_SLOTS, ConfigError)
    n = cap if limit is None else _check_int(limit, "limit", 0, _MAX_SLOTS, ConfigError)
    ttl = _check_seconds(lease_ttl, "lease_ttl", ConfigError, optional=False)
    assert ttl is not None
    caps = _check_caps(group_caps, "group_caps")
    rates = _check_rate_limits(rate_limits)

    def run(conn: Connection, d: _Dialect) -> tuple[int, list[Lease]]:
        return _schedule_rows(
            conn, d, now or d.db_now(conn), worker_id=worker_id, types=type_list, max_concurrency=cap,
            lease_ttl=ttl, limit=n, group_caps=caps,
            rate_limits=rates, state=state, fresh_now=now is None,
        )

    return _transaction(engine, run, immediate=True)


def _schedule_rows(
    conn: Connection, d: _Dialect, now: _dt.datetime, *, worker_id: str, types: Sequence[str] | None,
    max_concurrency: int, lease_ttl: float, limit: int, group_caps: Mapping[str, int] | None,
    rate_limits: Mapping[str, tuple[int, float]] | None, state: str,
    fresh_now: bool = False,
) -> tuple[int, list[Lease]]:
    """The body of a scheduling round, in the caller's transaction: reclaim expired leases,
    then (unless ``limit`` is 0: a full worker only sweeps) lease what fits under the caps."""
    back = _reclaim_rows(conn, d, now)
    if limit <= 0:
        return len(back), []
    return len(back), _lease_rows(
        conn, d, worker_id=worker_id, ttl=lease_ttl, now=now, limit=limit, types=types,
        max_in_flight=max_concurrency, group_caps=group_caps, state=state, rate_limits=rate_limits, fresh_now=fresh_now,
    )


def stats(engine: Engine, *, window: _dt.timedelta = _dt.timedelta(hours=1), totals: bool = False) -> dict[str, Any]:
    """What ``jobq status`` shows, read through indexes only, so its cost follows the live
    jobs and the recent past, never the size of the history.

    Args:
        engine: the queue's Engine.
        window: how far back finished jobs are counted (and failures listed).
        totals: also count every job per state over the whole table: a full scan, slow on a
            table with millions of finished rows (for scripts that really need it).

    Returns:
        A dict: ``states`` (waiting/ready/leased/running: exact now; done/failed/cancelled:
        finished within ``window``), ``window_seconds``, ``ready_by_group`` (every ready job),
        ``ready_due`` and ``ready_scheduled`` (the ready jobs whose ``run_after`` has passed,
        and those scheduled for later: backing off, or enqueued with a future ``run_after``),
        ``due_by_group``, ``held`` in ``states`` (jobs spawned by running handlers, not yet work),
        ``in_flight`` (per group, including slots held by abandoned
        handlers), ``oldest_ready`` (the ``run_after`` of the longest-waiting due job, or
        None), ``next_scheduled`` (the earliest ``run_after`` of a scheduled job, or None),
        ``expired_leases`` (awaiting reclaim), ``recent_failures`` (up to 5: id, type, error,
        finished_at), ``now`` (the database clock), and ``totals`` if asked for. Times are
        naive UTC, as stored.
    """
    window = _check_age(window, "window")
    d = _prepare(engine)
    with engine.connect() as conn:
        now = d.db_now(conn)
        since = now - window
        live = {s: 0 for s in STATES}
        ready_by_group: dict[str, int] = {}
        due_by_group: dict[str, int] = {}
        for g, n, due in conn.execute(_q_ready_by_group(now)):
            ready_by_group[g] = int(n)
            due_by_group[g] = int(due or 0)  # MySQL sums to a Decimal
        live["ready"] = sum(ready_by_group.values())
        live["waiting"] = conn.execute(_q_waiting_count()).scalar_one()
        live["held"] = conn.execute(_q_held_count()).scalar_one()
        for st, n in conn.execute(_q_in_flight_by_state()):
            live[st] = n
        for st, n in conn.execute(_q_finished_by_state(since)):
            live[st] = n
        oldest, upcoming = conn.execute(_q_ready_times(now)).one()
        due_total = sum(due_by_group.values())
        out: dict[str, Any] = {
            "states": live, "window_seconds": window.total_seconds(), "ready_by_group": ready_by_group,
            "ready_due": due_total, "ready_scheduled": live["ready"] - due_total, "due_by_group": due_by_group,
            "in_flight": _in_flight_counts(conn, now), "oldest_ready": oldest, "next_scheduled": upcoming,
            "expired_leases": conn.execute(_q_expired_count(now)).scalar_one(),
            "recent_failures": [dict(r._mapping) for r in conn.execute(_q_recent_failures(since))], "now": now,
        }
        if totals:
            out["totals"] = {s: 0 for s in STATES} | {st: n for st, n in conn.execute(_q_count_by_state())}
        conn.rollback()
    return out


# =============================================================================================
# The worker
# =============================================================================================
# One loop, written once: the loops (run, run_until_idle, the gather after a finish, the drain
# at a stop) are generators of steps, and a runner executes the steps. A step is a callable
# (database work: called in the loop's thread by Worker, through the greenlet bridge by
# AsyncWorker), a float (wait up to that many seconds for a wake-up), or, for AsyncWorker
# only, an awaitable. Worker and AsyncWorker differ only in how they run steps, start a
# dispatch and stop a stuck one.


def _checkpoint(point: str, job_ids: Sequence[int] = ()) -> None:
    """A no-op the worker calls at its crash-relevant points; crash tests replace it.

    Points: "claimed" (leases committed, before dispatch), "handler_returned" (in the handler's
    thread, before the outcome is queued), "finalize_before_commit" (inside the finalize
    transaction), "finalized" (after it committed); prune's "prune_read" (a batch read without
    locks) and "prune_locked" (the batch locked and checked again, before its delete), both
    inside its transaction (the race tests replace it); "unique_keys_read" (enqueue, submit and
    spawns with unique keys: the keys looked up, their holders locked, before the insert,
    inside its transaction; job_ids are the holders found).
    """


_CTX_LOCK = threading.Lock()


class JobContext:
    """What a handler receives: the job, ways to learn that it should stop, and ways to add
    work atomically with its result (:meth:`enqueue`, :meth:`submit`).

    Attributes:
        id, type, args, attempt, max_attempts, group_key, parent_id: the job as claimed.
        worker_id: the worker running it.
        state: the job's last stored checkpoint (a dict; None on a fresh job): what a rerun
            after a crash, a reclaim, a timeout or a retry resumes from. ``checkpoint`` updates it.
    """

    def __init__(self, lease: Lease, worker: Any = None) -> None:
        self.id = lease.id
        self.type = lease.type
        self.args = lease.args
        self.attempt = lease.attempt
        self.max_attempts = lease.max_attempts
        self.group_key = lease.group_key
        self.parent_id = lease.parent_id
        self.worker_id = lease.worker_id
        self._stop: Any = None  # a threading.Event, made when first needed (most handlers never wait)
        self._reason: str | None = None
        self.state: dict[str, Any] | None = lease.checkpoint
        self._token = lease.token
        # How checkpoint() stores (set by the runner: a transaction, a pipe to the parent, or a
        # coroutine for AsyncWorker) and the progress the next heartbeat carries.
        self._save: Callable[[JobContext, dict[str, Any]], Any] | None = None
        self._progress: dict[str, Any] | None = None
        self._progress_sent: dict[str, Any] | None = None  # the report the last heartbeat wrote
        self._report: Callable[[dict[str, Any]], None] | None = None  # a process handler's pipe
        #: Inserts a checked _Plan held under this dispatch's lease; set by the worker (or, in a
        #: handler process, a call through the pipe to it).
        self._spawner: Callable[[_Plan], dict[str, int]] | None = None

    def _event(self) -> Any:
        if self._stop is None:
            with _CTX_LOCK:
                if self._stop is None:
                    self._stop = threading.Event()
        return self._stop

    def _signal(self, reason: str) -> None:
        if self._reason is None:
            self._reason = reason
        self._event().set()

    @property
    def stop_requested(self) -> bool:
        """True once the handler should stop: lease lost, timed out, cancelled or worker stopping."""
        return self._stop is not None and self._stop.is_set()

    @property
    def stop_reason(self) -> str | None:
        """Why ``stop_requested`` is set: "lease_lost", "timed_out", "cancelled" or "shutdown"."""
        return self._reason

    @property
    def lease_lost(self) -> bool:
        """True when this dispatch no longer holds the lease: its result will be discarded."""
        return self._reason == "lease_lost"

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; return True early if the handler should stop."""
        return bool(self._event().wait(seconds))

    def checkpoint(self, state: dict[str, Any]) -> Any:
        """Durably store ``state`` for this job now; later dispatches start with it as ``ctx.state``.

        One short transaction per call (see the README's "Checkpoints" for how often), fenced by
        this dispatch's lease: nothing is written once the lease is lost.

        Args:
            state: a JSON object (the same rules as ``args``); replaces the previous checkpoint.

        Returns:
            None. In an :class:`AsyncWorker` an awaitable: ``await ctx.checkpoint(state)``.

        Raises:
            InvalidJob: ``state`` is not a JSON object within the limits; nothing is written.
            LeaseLost: this dispatch no longer holds the job's lease; nothing is written.
        """
        if not isinstance(state, dict):
            raise InvalidJob(f"checkpoint must be a JSON object (a dict), got {_type_name(state)}")
        state = _encode_checked(state, "checkpoint")
        if self._save is None:
            raise JobqError("this JobContext belongs to no running dispatch: nothing to checkpoint")
        return self._save(self, state)

    def progress(self, done: float, total: float | None = None, message: str | None = None) -> None:
        """Report how far the handler is; ``get``, ``jobq show``, ``jobq status`` and ``why`` show it
        within one heartbeat interval. No transaction: the next heartbeat (or ``checkpoint``)
        carries the latest report; earlier ones are dropped. The last one written is kept on
        the job when it finishes (a report made after the last heartbeat or checkpoint is not).

        Args:
            done: work done so far (a finite number >= 0).
            total: the whole amount, if known (a finite number >= 0).
            message: a short note (at most 200 characters).

        Raises:
            InvalidJob: a bad value.
        """
        for value, what in ((done, "done"), (total, "total")):
            if value is None and what == "total":
                continue
            _check_number(value, f"progress {what}", 0, sys.float_info.max)
        if message is not None and (not isinstance(message, str) or len(message) > 200):
            raise InvalidJob(f"progress message must be a string of at most 200 characters, got {message!r}")
        self._progress = _check_json({"done": done, "total": total, "message": message}, "progress")
        if self._report is not None:
            self._report(self._progress)

    def enqueue(self, type: str, args: Mapping[str, Any] | None = None, **kw: Any) -> int:
        """Spawn a job that exists only if this dispatch's result commits.

        Takes :func:`jobq.enqueue`'s arguments (after the target), with the same checks. The job
        is written at once, ``held`` under this dispatch's lease: nothing claims it, and the
        finalize that writes this handler's result releases it (to ``ready``/``waiting``) in the
        same transaction. If the handler raises, times out, is cancelled or loses its lease, or
        the worker dies (its lease is reclaimed), the job is deleted and never runs. Its id is
        real: put it in the result, or name it in later spawns' ``depends_on``/``parent``.
        ``depends_on=[ctx.id]`` runs it after this job; ``parent=ctx.parent_id`` adds it to this
        job's container, which then cannot roll up before it finishes.

        Each call is one short transaction (it locks this job's row); spawn many at once with
        :meth:`submit`.

        Returns:
            The new job's id.

        Raises:
            InvalidJob: bad input, as :func:`jobq.enqueue` (also: naming a held job of another
                dispatch). Nothing is written.
            UniqueKeyHeld: the ``unique_key`` belongs to a held job of another dispatch.
            LeaseLost: this dispatch no longer holds its lease, or the job was cancelled.
            JobqError: not a worker's context.
        """
        unknown = set(kw) - set(_JOB_FIELD_NAMES)
        if unknown or "type" in kw or "args" in kw:
            raise InvalidJob(f"ctx.enqueue: unknown or repeated arguments {sorted(unknown | ({'type', 'args'} & set(kw)))}")
        return self._spawn(_plan([{"type": type, "args": args, **kw}], single=True))[_ONE]

    def submit(self, jobs: Sequence[Mapping[str, Any]]) -> dict[str, int]:
        """Spawn a whole DAG (the items of :func:`jobq.submit`) held as :meth:`enqueue` holds one
        job: one transaction, released with this dispatch's result or deleted with it.

        Returns:
            key -> new job id.

        Raises:
            InvalidJob: a bad item, as :func:`jobq.submit`. Nothing is written.
            UniqueKeyHeld: an item's ``unique_key`` belongs to a held job of another dispatch.
            LeaseLost: this dispatch no longer holds its lease, or the job was cancelled.
            JobqError: not a worker's context.
        """
        return self._spawn(_plan(jobs, single=False))

    def _spawn(self, plan: _Plan) -> dict[str, int]:
        if self._spawner is None:
            raise JobqError("spawning needs the context a Worker passes to its handler")
        return self._spawner(plan)

    def __repr__(self) -> str:
        return f"JobContext(id={self.id}, type={self.type!r}, attempt={self.attempt})"


_NO_IDS: frozenset[int] = frozenset()


class _Running:
    """One dispatch in this worker: a claimed job's lease, its context and its handler's state.

    A plain class with slots, its key computed once: a claim makes one per job, and each
    object a job allocates is one more for the garbage collector's young generations to walk
    while the job runs (a no-op drain spent 14% of its time there, with nine per job).
    """

    __slots__ = ("lease", "ctx", "key", "started", "deadline", "last_beat", "thread", "process", "abandoned",
                 "returned", "size", "spawned", "own", "write_failures", "_worker")

    def __init__(self, lease: Lease, ctx: JobContext, started: float, deadline: float | None, last_beat: float,
                 worker: Any) -> None:
        self.lease = lease
        self.ctx = ctx
        # A dispatch, not a job: the same worker may hold attempt 1 (lease lost, handler still
        # going) and attempt 2 of one job at once. Leases of one claim share a token.
        self.key: tuple[str, int] = (lease.token, lease.id)
        self.started = started  # monotonic
        self.deadline = deadline  # monotonic
        self.last_beat = last_beat  # monotonic time of the last successful heartbeat (or the claim)
        self.thread: threading.Thread | None = None
        self.process: Any = None  # the handler's process, with the process executor
        self.abandoned = False  # released (timed out / shutdown / lease lost) while its handler still ran
        self.returned = False  # the handler thread has finished
        self.size = 0  # bytes of its encoded result, once returned
        self.spawned = False  # the handler called ctx.enqueue/submit: its held jobs go with its outcome
        self.own: frozenset[int] = _NO_IDS  # ids it spawned
        self.write_failures = 0  # writes of its outcome that failed while the database was up
        self._worker = worker

    def __call__(self, plan: _Plan) -> dict[str, int]:
        """The context's spawner (ctx.enqueue/submit): the worker inserts ``plan`` held under this
        dispatch's lease."""
        return self._worker._spawn(self, plan)  # type: ignore[no-any-return]


@dataclasses.dataclass
class _Batch:
    """Finished handlers taken from the queue, turned into what one transaction writes."""

    raw: list[tuple[_Running, str, Any]]
    outcomes: list[_Outcome] = dataclasses.field(default_factory=list)
    keep: list[tuple[_Running, str, Any]] = dataclasses.field(default_factory=list)  # event per run, in order
    freed: list[_Running] = dataclasses.field(default_factory=list)  # abandoned runs whose slot is freed


class _Clock:
    """The database's clock, read once in a while and carried forward on the monotonic clock,
    so a jump of this machine's wall clock cannot expire or stretch a lease.

    On SQLite the database's clock *is* this machine's wall clock, read afresh every time: a
    jump of it is a jump of the database's time, seen by every process at once. Carried
    forward, it would leave each worker on its own clock until its next refresh, and a worker
    that had not yet seen a backward jump would reclaim the fresh leases of one that had, and
    postpone their jobs by the size of the jump (tests/crash/test_clock.py)."""

    def __init__(self, engine: Engine, refresh: float = 60.0) -> None:
        self._engine = engine
        self._refresh = refresh
        self._anchor: tuple[_dt.datetime, float] | None = None
        self._wall = _local_clock(engine)

    def now(self) -> _dt.datetime:
        if self._wall:
            return _utcnow()
        m = time.monotonic()
        if self._anchor is None or m - self._anchor[1] > self._refresh:
            d = _prepare(self._engine)
            with self._engine.connect() as conn:
                before = time.monotonic()
                db = d.db_now(conn)
                after = time.monotonic()
                conn.rollback()
            self._anchor = (db, (before + after) / 2)  # off by at most half the round trip
            return self._anchor[0] + _dt.timedelta(seconds=time.monotonic() - self._anchor[1])
        return self._anchor[0] + _dt.timedelta(seconds=m - self._anchor[1])


#: Seconds after a notified tick before the loop looks again (see Worker._run_steps).
_NOTIFY_RECHECK = 0.2


def _worker_id() -> str:
    return f"{socket.gethostname()[:80]}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _pipe_spawn(conn: Any, plan: _Plan) -> dict[str, int]:
    # In a handler process: the parent's handler thread spawns (one engine, one fence) and answers.
    conn.send(("spawn", plan))
    kind, value = conn.recv()
    if kind == "raise":
        raise value
    return value  # type: ignore[no-any-return]


#: The write ends (Connections) of the lifelines of this process's handler processes (see
#: _die_with_worker), changed only under _LIFELINE_LOCK, which also covers starting a handler
#: process: a child forked meanwhile inherits exactly these descriptors, and closes them all.
_LIFELINES: set[Any] = set()
_LIFELINE_LOCK = threading.Lock()
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_worker(lifeline: Any) -> None:
    """In a handler process, first thing: end this process when its worker dies, even by SIGKILL.

    Two watches, because neither covers every case alone. On Linux, the kernel sends SIGKILL
    when the parent *thread* ends (PR_SET_PDEATHSIG): with fork and spawn that is the worker's
    handler thread, which waits for this process, so it ends only with the worker; with
    forkserver the parent is the fork server, which may outlive the worker for a while. And
    everywhere, the ``lifeline``: the read end of a pipe whose write end only the worker holds
    (a child forked from the worker closes the worker's copies, this one's included), so end
    of file means the worker is gone, whatever the start method or the platform.
    """
    for held in list(_LIFELINES):  # fork: the worker's write ends, inherited; empty after spawn
        held.close()
    _LIFELINES.clear()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl: the lifeline alone
    threading.Thread(target=_end_at_eof, args=(lifeline,), name="jobq-lifeline", daemon=True).start()


def _end_at_eof(lifeline: Any) -> None:
    try:
        lifeline.recv_bytes()  # nothing is ever sent: this returns only at end of file
    except BaseException:  # noqa: BLE001,S110 - EOF, or a closed pipe: the worker is gone either way
        pass
    kill = getattr(signal, "SIGKILL", None)
    if kill is not None:
        os.kill(os.getpid(), kill)
    os._exit(70)


def _process_main(watch: Callable[[Any], None], handler: Callable[[JobContext], Any], lease: Lease, stop: Any,
                  conn: Any, lifeline: Any) -> None:
    # Runs in the handler's own process: report the outcome (and ask for spawns) through the
    # pipe, touch nothing else (the database connections inherited by fork belong to the parent).
    watch(lifeline)  # _die_with_worker, passed by the worker (a crash test passes a broken one)
    ctx = JobContext(lease)
    ctx._stop = stop
    ctx._save = functools.partial(_checkpoint_through_pipe, conn)
    ctx._report = lambda p: conn.send(("progress", p))
    ctx._spawner = functools.partial(_pipe_spawn, conn)
    try:
        value = handler(ctx)
        conn.send(("ok", value))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        conn.send(("error", _format_error(exc)))


def _checkpoint_through_pipe(conn: Any, ctx: JobContext, state: dict[str, Any]) -> None:
    # The handler's process asks its parent, which holds the lease and the connections, to
    # store the checkpoint, and waits for the answer. Progress rides along with it.
    conn.send(("checkpoint", (state, ctx._progress)))
    kind, text = conn.recv()
    if kind == "lost":
        ctx._signal("lease_lost")
        raise LeaseLost(text)
    if kind != "ok":
        raise JobqError(text)
    ctx.state = state


_EXECUTORS = ("thread", "process")
_IDLE_THREAD_SECONDS = 30.0  # an idle handler thread exits after this long
#: Faults the worker survives by logging ``db_error`` and backing off: the database's own
#: errors, and a connection pool that stays exhausted past its timeout (handlers sharing it).
_DB_FAULTS: tuple[type[BaseException], ...] = (sa.exc.DBAPIError, sa.exc.TimeoutError)
#: Most bytes of results one finalize transaction carries: well below MariaDB's default
#: max_allowed_packet (16 MiB), whatever the batch; a single result is at most MAX_JSON_BYTES.
_BATCH_BYTES = 4 * 1024 * 1024
#: Failed writes of one outcome, while the database answered other transactions, before a
#: result is given up for a failure (and, after twice as many, the outcome is dropped and the
#: lease left to expire): a batch that cannot be written must never wedge the worker.
_WRITE_TRIES = 3


@dataclasses.dataclass(frozen=True, eq=False)
class WorkerOptions:
    """A worker's options, validated once: ``Worker(engine, handlers, **options)`` builds one,
    and ``worker.options`` is it. Each field means what :class:`Worker`'s argument of the same
    name means; after validation ``heartbeat_interval``, ``worker_id`` and ``retry_backoff``
    hold their resolved values (``local_concurrency`` defaults to ``max_concurrency``),
    ``group_caps``/``rate_limits`` are plain dicts.

    Raises:
        ConfigError: an option is invalid (e.g. a heartbeat too close to the lease TTL, or a
            ``start_method`` this platform lacks with ``executor="process"``).
        InvalidJob: ``worker_id`` is not a valid name.
    """

    max_concurrency: int
    lease_ttl: float = 30.0
    heartbeat_interval: float | None = None
    poll_interval: float = 1.0
    worker_id: str | None = None
    timeout: float | None = None
    group_caps: Mapping[str, int] | None = None
    rate_limits: Mapping[str, tuple[int, float]] | None = None
    retry_backoff: Callable[[int], float] | None = None
    shutdown_timeout: float = 30.0
    executor: str = "thread"
    start_method: str = "fork"
    listen: bool = False
    on_event: Callable[[Event], None] | None = None
    finalize_delay: float = 0.005
    local_concurrency: int | None = None

    def __post_init__(self) -> None:
        fix = functools.partial(object.__setattr__, self)
        fix("max_concurrency", _check_int(self.max_concurrency, "max_concurrency", 1, _MAX_SLOTS, ConfigError))
        local = self.max_concurrency if self.local_concurrency is None else _check_int(
            self.local_concurrency, "local_concurrency", 1, _MAX_SLOTS, ConfigError)
        if local > self.max_concurrency:
            raise ConfigError(
                f"local_concurrency={local} is above max_concurrency={self.max_concurrency}: the global cap "
                "would never let this worker fill its slots; raise max_concurrency or lower local_concurrency"
            )
        fix("local_concurrency", local)
        ttl = _check_seconds(self.lease_ttl, "lease_ttl", ConfigError, optional=False)
        assert ttl is not None
        hb = ttl / 3 if self.heartbeat_interval is None else _check_seconds(
            self.heartbeat_interval, "heartbeat_interval", ConfigError, optional=False)
        assert hb is not None
        if hb > ttl / 2:
            raise ConfigError(
                f"heartbeat_interval={hb:g}s must be at most half of lease_ttl={ttl:g}s, or one slow "
                "heartbeat loses the lease; the default is lease_ttl / 3"
            )
        fix("lease_ttl", ttl)
        fix("heartbeat_interval", hb)
        fix("poll_interval", _check_seconds(self.poll_interval, "poll_interval", ConfigError, optional=False))
        if self.executor not in _EXECUTORS:
            raise ConfigError(f"executor must be one of {_EXECUTORS}, got {self.executor!r}")
        if self.executor == "process":  # threads and tasks need no start method (issue 12: no fork here)
            import multiprocessing

            if self.start_method not in multiprocessing.get_all_start_methods():
                raise ConfigError(f"start_method {self.start_method!r} is not available here")
        fix("worker_id", _check_name(self.worker_id, "worker_id") if self.worker_id is not None else _worker_id())
        fix("timeout", _check_seconds(self.timeout, "timeout", ConfigError))
        fix("group_caps", {str(g): _check_int(n, f"group_caps[{g!r}]", 1, _MAX_SLOTS, ConfigError)
                           for g, n in (self.group_caps or {}).items()})
        fix("rate_limits", _check_rate_limits(self.rate_limits))
        fix("retry_backoff", self.retry_backoff or backoff)
        fix("shutdown_timeout", _check_seconds(self.shutdown_timeout, "shutdown_timeout", ConfigError,
                                               optional=False) or 30.0)
        fix("listen", bool(self.listen))
        delay = 0.0 if self.finalize_delay == 0 and not isinstance(self.finalize_delay, bool) else _check_seconds(
            self.finalize_delay, "finalize_delay", ConfigError, optional=False)
        assert delay is not None
        if delay > 1.0:
            raise ConfigError(f"finalize_delay={delay:g}s: keep it to a few milliseconds (at most 1 s)")
        fix("finalize_delay", delay)


def _check_worker_target(engine: Engine, handlers: Any) -> None:
    if not isinstance(engine, Engine):
        raise ConfigError(f"engine must be a SQLAlchemy Engine, got {_type_name(engine)}")
    if not isinstance(handlers, Mapping) or not handlers:
        raise ConfigError("handlers must be a non-empty mapping of job type -> callable")
    for name, fn in handlers.items():
        _check_name(name, "handler type")
        if not callable(fn):
            raise ConfigError(f"handler for {name!r} is not callable")


class _WorkerCore:
    """What Worker and AsyncWorker share: the tick, the writes, heartbeats, timeouts, and the
    loops as generators of steps (see the section's opening comment). Not public."""

    def __init__(self, engine: Engine, handlers: Mapping[str, Callable[[JobContext], Any]], options: WorkerOptions) -> None:
        o = self.options = options
        self.engine = engine
        self.handlers = dict(handlers)
        self._types = sorted(self.handlers)
        # The resolved options, as attributes (as before WorkerOptions existed).
        self.max_concurrency: int = o.max_concurrency
        self.local_concurrency: int = o.local_concurrency  # type: ignore[assignment]  # resolved
        self._told_cap: int | None = None  # the stored global cap this worker last warned about
        self.lease_ttl: float = o.lease_ttl
        self.heartbeat_interval: float = o.heartbeat_interval  # type: ignore[assignment]  # resolved
        self.poll_interval: float = o.poll_interval
        self.worker_id: str = o.worker_id  # type: ignore[assignment]  # resolved
        self.timeout = o.timeout
        self.group_caps: dict[str, int] = dict(o.group_caps or {})
        self.rate_limits: dict[str, tuple[int, float]] = dict(o.rate_limits or {})
        self.retry_backoff: Callable[[int], float] = o.retry_backoff or backoff
        self.shutdown_timeout: float = o.shutdown_timeout
        self.executor = o.executor
        self.listen = o.listen
        self.on_event = o.on_event
        self.finalize_delay: float = o.finalize_delay
        if self.listen and not _listen_supported(engine):
            raise ConfigError("listen=True needs PostgreSQL with the psycopg (3) driver")
        self._clock = _Clock(engine)
        self._lock = threading.Lock()
        self._running: dict[tuple[str, int], _Running] = {}  # by dispatch (_Running.key)
        self._abandoned: list[_Running] = []  # released runs whose handler has not returned
        self._finished: deque[tuple[_Running, str, Any]] = deque()
        self._busy = 0  # handlers running, including abandoned ones
        self._wake = threading.Event()
        self._notified = False  # the listener woke the loop since its last tick
        self._stopping = threading.Event()
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._db_failures = 0
        self._last_sweep = -math.inf  # the first tick sweeps
        # Reclaim runs on a cadence, not on every tick: an expired lease waits at most this long
        # (plus a tick) for a live worker's sweep, and a busy worker saves a statement per tick.
        self._sweep_every: float = min(self.lease_ttl / 4, _SWEEP_SECONDS)

    # -- public control --------------------------------------------------------------------

    def stop(self) -> None:
        """Ask ``run`` to stop claiming and shut down gracefully (thread- and signal-safe)."""
        self._stopping.set()
        self._wake.set()

    @property
    def in_flight(self) -> int:
        """Jobs this worker holds right now (not counting abandoned handlers)."""
        with self._lock:
            return len(self._running)

    # -- the loops, as steps ---------------------------------------------------------------

    def _run_steps(self) -> Generator[Any, Any, None]:
        while not self._stopping.is_set():
            began = time.monotonic()
            notified, self._notified = self._notified, False
            yield self._safe_tick
            # Poll on a fixed period measured from the start of the tick, so a job enqueued
            # just after a poll waits at most one interval plus one tick. After a notification,
            # look once more soon: the claim skips rows another transaction has locked (an
            # enqueue share-locks the upstreams it depends on), so the notified job may have
            # been passed over, and its notification is already spent.
            pause = min(self._pause(), _NOTIFY_RECHECK) if notified else self._pause()
            yield max(0.0, pause - (time.monotonic() - began))
            yield from self._gather_steps()
        yield from self._drain_steps(self.shutdown_timeout)

    def _until_idle_steps(self, timeout: float | None) -> Generator[Any, Any, bool]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            started = yield self._safe_tick
            if not started and self.in_flight == 0 and not self._abandoned and (yield self._idle_in_db):
                return True
            if deadline is not None and time.monotonic() > deadline:
                yield from self._drain_steps(0)
                return False
            if not started:
                yield 0.05 if self.in_flight and not self._db_failures else self._pause()
            yield from self._gather_steps()

    def _gather_steps(self) -> Generator[Any, Any, None]:
        """Results that complete close together are written together: once one is waiting,
        give the other busy handlers up to ``finalize_delay`` to finish too (no wait at all
        when none is busy, so a long job's result is written at once)."""
        deadline = time.monotonic() + self.finalize_delay
        while True:
            with self._lock:
                if not self._finished or self._busy == 0 or self._stopping.is_set():
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            yield left

    def _drain_steps(self, grace: float, unwind: float = 5.0) -> Generator[Any, Any, None]:
        deadline = time.monotonic() + grace
        while True:
            yield self._persist
            pending = self._pending()
            if not pending or time.monotonic() >= deadline:
                break
            yield 0.05
        yield functools.partial(self._release_unstarted, pending)
        yield from self._unwind_steps(unwind)

    def _unwind_steps(self, wait: float = 5.0) -> Generator[Any, Any, None]:
        yield from ()  # AsyncWorker: let cancelled tasks end (up to ``wait`` s), then free their slots

    # -- the tick --------------------------------------------------------------------------

    def _tick(self) -> int:
        self._revive_takers()
        self._write_suspects()
        batch = self._take_finished()
        with self._lock:
            # Outcomes past the batch's size: written after the claim. Those that arrive during
            # it go with the next tick's claim (their handler's return wakes the loop for it).
            leftover = bool(self._finished)
        self._enforce_timeouts()
        with self._lock:
            local_free = self.local_concurrency - self._busy
        claiming = local_free > 0 and not self._stopping.is_set()
        # Full or stopping: claim nothing, but keep sweeping expired leases of crashed workers.
        began = time.monotonic()
        sweeping = began - self._last_sweep >= self._sweep_every
        if not sweeping and not claiming:
            self._write(batch, None)
            self._persist()  # what did not fit in one batch
            return 0
        ok, got = self._write(batch, functools.partial(self._claim, limit=local_free if claiming else 0,
                                                       sweep=sweeping))
        if not ok or got is None:
            return 0
        reclaimed, leases, stalled = got
        if sweeping and len(reclaimed) < _SWEEP_LIMIT:
            self._last_sweep = began  # a full sweep left more: the next tick sweeps again
        if leftover or not claiming:
            self._persist()
        self._lost(stalled)
        for row in reclaimed:
            _emit(self.on_event, Event("reclaimed", row.id, row.type, row.group_key, row.attempts, self.worker_id,
                                       error=f"lease expired; now {row.state}"))
        if leases:
            _checkpoint("claimed", [lease.id for lease in leases])
            self._dispatch(leases)
        return len(leases)

    def _claim(self, conn: Connection, d: _Dialect, now: _dt.datetime, *,
               limit: int, sweep: bool = True) -> tuple[list[Any], list[Lease], list[_Running]]:
        """The claim half of a tick's transaction: with ``sweep``, reclaim expired leases (and,
        for those this worker's own stalled handlers still run, hold a slot each until they
        return, so the caps keep counting them), then lease what fits. Returns the reclaimed
        rows, the new leases, and the stalled runs (told after the commit: this may run again
        on a retry)."""
        back = _reclaim_rows(conn, d, now, _SWEEP_LIMIT) if sweep else []
        reclaimed: list[Any] = []
        mine: list[_Running] = []
        if back:
            ids = {job_id for job_id, _state in back}
            reclaimed = list(conn.execute(_q_reclaimed(sorted(ids))).all())
            with self._lock:
                mine = [r for r in self._running.values() if r.lease.id in ids and not r.returned]
            _hold_slots(conn, mine, self.worker_id, now + _dt.timedelta(seconds=self.lease_ttl))
        if limit <= 0:
            return reclaimed, [], mine
        return reclaimed, _lease_rows(
            conn, d, worker_id=self.worker_id, ttl=self.lease_ttl, now=now, limit=limit, types=self._types,
            max_in_flight=self.max_concurrency, group_caps=self.group_caps or None, state="running",
            rate_limits=self.rate_limits or None, fresh_now=True, seen_cap=self._stored_cap,
        ), mine

    def _stored_cap(self, cap: int) -> None:
        """The claim read the database's stored global cap: say once (per value) that this
        worker's own max_concurrency differs from it, and which applies."""
        if cap != self.max_concurrency and cap != self._told_cap:
            self._told_cap = cap
            logger.warning(
                "worker %s: max_concurrency=%d differs from the global cap stored in the database (%d, "
                "jobq.set_limit / `jobq limit`): the smaller, %d, applies", self.worker_id, self.max_concurrency,
                cap, min(cap, self.max_concurrency),
                extra={"action": "global_cap", "worker_id": self.worker_id})

    def _lost(self, runs: Sequence[_Running]) -> None:
        """Runs whose lease is gone while their handler still runs, with a slot now held for
        each: told to stop, and kept until they return (their results are refused)."""
        for run in runs:
            run.ctx._signal("lease_lost")
        with self._lock:
            for run in runs:
                if self._running.pop(run.key, None) is run:
                    run.abandoned = True
                    if not run.returned:
                        self._abandoned.append(run)
        for run in runs:
            _emit(self.on_event, Event("lease_lost", run.lease.id, run.lease.type, run.lease.group_key,
                                       run.lease.attempt, self.worker_id))
        self._stop_handlers(runs)

    def _events_wanted(self, level: int) -> bool:
        # The per-job events cost more than the rest of a no-op dispatch: skip building them
        # when there is no hook and the jobq logger would drop them anyway.
        return self.on_event is not None or logger.isEnabledFor(level)

    def _pause(self) -> float:
        # Back off while the database is failing: 0.1 s doubling to 5 s, never a hot loop.
        if self._db_failures:
            return min(5.0, 0.1 * 2 ** min(self._db_failures - 1, 6))
        return self.poll_interval

    def _db_error(self, exc: BaseException, job_id: int = 0, note: str = "") -> None:
        self._db_failures += 1
        _emit(self.on_event, Event("db_error", job_id, worker_id=self.worker_id, error=note + _one_line(exc)))

    def _safe_tick(self) -> int:
        try:
            failures = self._db_failures
            started = self._tick()
            if self._db_failures == failures:
                self._db_failures = 0  # a clean tick: the database is back
            return started
        except _DB_FAULTS as exc:
            self._db_error(exc)
            return 0

    def _idle_in_db(self) -> bool:
        """Idle: nothing of this worker's types is due (``ready`` with ``run_after`` passed),
        leased or running. Jobs scheduled for later, or waiting on upstreams, do not count."""
        try:
            now = self._clock.now()
            with self.engine.connect() as conn:
                row = conn.execute(_q_busy_or_due(self._types, now)).first()
                conn.rollback()
        except _DB_FAULTS as exc:
            self._db_error(exc)
            return False
        return row is None

    def _dispatch(self, leases: Sequence[Lease]) -> None:
        # One claim's leases together: registered under one acquisition of the lock, then started.
        runs: list[_Running] = []
        now = time.monotonic()
        save = self._save_checkpoint  # one bound method for the claim, not one per job
        for lease in leases:
            ctx = JobContext(lease, self)
            ctx._save = save
            timeout = lease.timeout if lease.timeout is not None else self.timeout
            run = _Running(lease, ctx, now, None if timeout is None else now + timeout, now, self)
            ctx._spawner = run
            runs.append(run)
        with self._lock:
            for run in runs:
                self._running[run.key] = run
            self._busy += len(runs)
        claimed, started = self._events_wanted(logging.DEBUG), self._events_wanted(logging.INFO)
        if claimed or started:
            for run in runs:
                lease = run.lease
                if claimed:
                    _emit(self.on_event, Event("claimed", lease.id, lease.type, lease.group_key, lease.attempt, self.worker_id))
                if started:
                    _emit(self.on_event, Event("started", lease.id, lease.type, lease.group_key, lease.attempt, self.worker_id))
        self._start_all(runs)

    def _save_checkpoint(self, ctx: JobContext, state: dict[str, Any]) -> Any:
        self._store_checkpoint(ctx, state)

    def _store_checkpoint(self, ctx: JobContext, state: dict[str, Any]) -> None:
        """ctx.checkpoint: one short transaction, fenced by the dispatch's lease."""
        now = self._clock.now()
        progress = ctx._progress  # rides along: the heartbeat need not write it again
        n = _transaction(self.engine, lambda conn, d: conn.execute(
            _q_checkpoint(ctx.id, ctx.worker_id, ctx._token, state, progress, now)).rowcount)
        if not n:
            ctx._signal("lease_lost")
            raise LeaseLost(f"job {ctx.id}: this dispatch no longer holds the lease; the checkpoint was not stored")
        ctx.state = state
        ctx._progress_sent = progress

    # -- the runner's part (Worker: threads or processes; AsyncWorker: tasks) -------------

    def _start_all(self, runs: Sequence[_Running]) -> None:
        """Start a claim's dispatches (Worker: on handler threads; AsyncWorker: as tasks)."""
        raise NotImplementedError

    def _stop_handlers(self, runs: Sequence[_Running]) -> None:
        """After ``runs`` were released and fenced: stop what can be stopped."""

    def _poke(self) -> None:
        self._wake.set()

    def _spawn(self, run: _Running, plan: _Plan) -> dict[str, int]:
        """A handler's ctx.enqueue/submit (in its thread, or for a handler process here)."""
        run.spawned = True  # before the insert: whatever may have landed goes with the outcome
        ids = _spawn(self.engine, plan, _Hold(run.lease.id, run.lease.token, run.own))  # immutable: no copy
        run.own = run.own.union(ids.values())
        return ids

    @staticmethod
    def _check_result(value: Any) -> tuple[str, Any]:
        try:
            if value is not None and not isinstance(value, Mapping):
                raise InvalidJob(f"handler returned {_type_name(value)}; return a dict or None")
            return "ok", None if value is None else _encode_checked(dict(value), "result")
        except InvalidJob as exc:  # an unstorable result will not improve on retry
            return "fatal", _format_error(exc)

    def _finish(self, run: _Running, kind: str, payload: Any) -> None:
        _checkpoint("handler_returned", [run.lease.id])
        if kind == "ok" and payload is not None:
            run.size = len(json.dumps(payload, separators=(",", ":")))  # here, off the tick's path
        with self._lock:
            self._busy -= 1
            run.returned = True
            self._finished.append((run, kind, payload))
            self._handler_idle()
            # The loop acts on the first outcome queued (it writes it, or starts gathering
            # others for up to finalize_delay) and on the last busy handler returning (the
            # gather ends); one wake-up per outcome would only hand the GIL to a loop that
            # goes back to waiting.
            wake = len(self._finished) == 1 or self._busy == 0
        if wake:
            self._poke()

    def _handler_idle(self) -> None:
        """Under the lock, as a handler returns (Worker: its thread is idle in the same step)."""

    def _revive_takers(self) -> None:
        """At each tick: get dispatches moving that wait with nobody on the way to them (Worker:
        after a handler thread could not be started)."""

    # -- writing outcomes ------------------------------------------------------------------

    def _persist(self) -> None:
        """Write finished handlers' outcomes in transactions of their own (no claim), in
        batches of at most _BATCH_BYTES, until none is left or a write fails."""
        self._write_suspects()
        while True:
            batch = self._take_finished()
            if batch is None or not self._write(batch, None)[0]:
                return

    def _write_suspects(self) -> None:
        # Outcomes that were in a failed write while the database answered: one per transaction.
        while True:
            with self._lock:
                if not self._finished or not self._finished[0][0].write_failures:
                    return
                item = self._finished.popleft()
            if not self._write(self._make_batch([item]), None)[0]:
                return

    def _take_finished(self) -> _Batch | None:
        """Take queued handler outcomes (up to _BATCH_BYTES of results; not past one whose
        write failed before) and turn them into fenced outcomes to write."""
        with self._lock:
            items: list[tuple[_Running, str, Any]] = []
            size = 0
            while self._finished:
                run = self._finished[0][0]
                if run.write_failures or (items and size + run.size > _BATCH_BYTES):
                    break
                items.append(self._finished.popleft())
                size += run.size
        return self._make_batch(items) if items else None

    def _make_batch(self, items: list[tuple[_Running, str, Any]]) -> _Batch:
        out = _Batch(items)
        for run, kind, payload in items:
            lease = run.lease
            if run.abandoned:
                out.freed.append(run)  # released earlier: drop the late result, free its held slot
                continue
            if run.ctx.lease_lost:
                out.keep.append((run, "lost", None))
                continue
            if kind == "ok":
                out.outcomes.append(_Outcome(lease.id, self.worker_id, lease.token, "done", result=payload,
                                             parent_id=lease.parent_id, spawned=run.spawned))
            else:
                retry = kind == "error" and lease.attempt < lease.max_attempts
                delay = self._backoff(lease.attempt) if retry else 0.0
                out.outcomes.append(_Outcome(lease.id, self.worker_id, lease.token, "retry" if retry else "failed",
                                             error=str(payload)[:_ERROR_LIMIT], delay=delay, parent_id=lease.parent_id,
                                             spawned=run.spawned))
            out.keep.append((run, kind, payload))
        return out

    def _write(self, batch: _Batch | None, claim: Callable[[Connection, _Dialect, _dt.datetime], _T] | None,
               ) -> tuple[bool, _T | None]:
        """One transaction: write ``batch`` (fenced; rollups and released dependents included),
        then run ``claim`` (reclaim + lease) in the same transaction, so a busy worker pays one
        commit per tick. Returns (committed, what claim returned). On any error the batch is
        queued again (its writes are idempotent: same tokens) and the error is reported; the
        worker never dies of it."""
        if batch is None and claim is None:
            return True, None

        def write(conn: Connection, d: _Dialect) -> tuple[list[str | None], _T | None]:
            applied: list[str | None] = []
            if batch is not None:
                for run in batch.freed:
                    conn.execute(_Q_FREE_SLOT, {"b_token": run.lease.token, "b_id": run.lease.id})
                applied = _apply_outcomes(conn, d, batch.outcomes, now) if batch.outcomes else []
                _checkpoint("finalize_before_commit", [o.job_id for o in batch.outcomes])
            return applied, (claim(conn, d, now) if claim is not None else None)

        try:
            # Inside the try: the clock's occasional refresh talks to the database too, and a
            # batch taken from _finished must go back if anything here fails.
            now = self._clock.now()
            applied, claimed = _transaction(self.engine, write, immediate=True)
        except BaseException as exc:
            if batch is None or not isinstance(exc, Exception):
                if batch is not None:
                    with self._lock:
                        self._finished.extendleft(reversed(batch.raw))
                if not isinstance(exc, Exception):
                    raise
                self._db_error(exc)
                return False, None
            self._db_error(exc, batch.raw[0][0].lease.id if len(batch.raw) == 1 else 0)
            # The batch, the claim, or the database? Only a batch whose own write fails while
            # the database answers is to blame: its outcomes are then written one by one (a
            # batch too large for the server's packet limit, a result the server refuses, a
            # fault in one job's rollup), and one that keeps failing is given up (_blame).
            answers = self._database_answers()
            if answers and claim is not None:
                self._write(batch, None)  # the batch alone (queued again, and blamed, if it fails)
                return self._write(None, claim)  # then the claim alone: the worker keeps working
            with self._lock:  # put them back; the next tick retries with the same tokens
                self._finished.extendleft(reversed(batch.raw))
            if answers:
                self._blame(batch, exc)
            return False, None
        if batch is not None:
            self._written(batch, applied)
        return True, claimed

    def _database_answers(self) -> bool:
        try:
            _transaction(self.engine, lambda conn, d: d.db_now(conn))
            return True
        except Exception:  # noqa: BLE001 - the database is away: nothing to blame on the batch
            return False

    def _blame(self, batch: _Batch, exc: BaseException) -> None:
        gave_up: list[_Running] = []
        with self._lock:
            for i, (run, kind, _payload) in enumerate(self._finished):
                if not any(run is r for r, _k, _p in batch.raw):
                    continue
                run.write_failures += 1
                if len(batch.raw) > 1:
                    continue  # split first: each is tried alone
                if run.write_failures >= 2 * _WRITE_TRIES and kind != "ok":
                    gave_up.append(run)  # an error outcome gets twice the tries; a result half, then this
                elif run.write_failures >= _WRITE_TRIES:
                    self._finished[i] = (run, "fatal", f"the result could not be written ({_one_line(exc)}); "
                                         f"failed after {run.write_failures} tries instead of retrying forever")
            for run in gave_up:
                self._finished = deque(item for item in self._finished if item[0] is not run)
                self._running.pop(run.key, None)
        for run in gave_up:
            # The lease is left to expire: the job is reclaimed and runs again (or ends failed
            # as a poison job), at least once as always.
            _emit(self.on_event, Event("db_error", run.lease.id, run.lease.type, run.lease.group_key, run.lease.attempt,
                                       self.worker_id, error=f"gave up writing its outcome: {_one_line(exc)}"))

    def _written(self, batch: _Batch, applied: list[str | None]) -> None:
        _checkpoint("finalized", [o.job_id for o, st in zip(batch.outcomes, applied, strict=True) if st == "done"])
        with self._lock:
            for run in batch.freed:
                if run in self._abandoned:
                    self._abandoned.remove(run)
        it = iter(applied)
        quiet = not self._events_wanted(logging.INFO)  # warnings below are still logged
        with self._lock:
            for run, _kind, _payload in batch.keep:
                if self._running.get(run.key) is run:
                    del self._running[run.key]
        for run, kind, payload in batch.keep:
            lease = run.lease
            written = None if kind == "lost" else next(it)
            if quiet and written == "done" and kind == "ok":
                continue  # "finished": INFO, and nobody is listening
            dur = time.monotonic() - run.started
            ev = functools.partial(Event, job_id=lease.id, type=lease.type, group=lease.group_key, attempt=lease.attempt,
                                   worker_id=self.worker_id, duration_s=dur)
            if written is None:
                _emit(self.on_event, ev("lease_lost", error="result discarded: the lease was lost"))
            elif written == "cancelled":
                _emit(self.on_event, ev("cancelled"))
            elif kind == "ok":
                _emit(self.on_event, ev("finished"))
            else:
                action = "retried" if kind == "error" and lease.attempt < lease.max_attempts else "failed"
                _emit(self.on_event, ev(action, error=_one_line(payload)))

    # -- releasing runs whose handler is still going --------------------------------------

    def _abandon(self, runs: Sequence[_Running], reason: str, outcomes: Callable[[_Running], _Outcome]) -> list[_Running]:
        """Release runs whose handler is still going: in one transaction write each outcome
        (fenced) and hold a slot per run until its handler returns, so the cap keeps counting
        it. Returns the runs written."""
        for run in runs:
            run.ctx._signal(reason)
        now = self._clock.now()
        expires = now + _dt.timedelta(seconds=self.lease_ttl)

        def write(conn: Connection, d: _Dialect) -> None:
            # spawned=True: a handler still going may be inside a spawn right now (it commits
            # first, holding this job's row, or is refused): look for held jobs whatever the flag.
            _apply_outcomes(conn, d, [dataclasses.replace(outcomes(r), spawned=True) for r in runs], now)
            _hold_slots(conn, runs, self.worker_id, expires)

        _transaction(self.engine, write)
        with self._lock:
            for run in runs:
                run.abandoned = True
                self._running.pop(run.key, None)
                if not run.returned:
                    self._abandoned.append(run)
                # else: returned in the meantime: its queued outcome will free the slot
        self._stop_handlers(runs)
        return list(runs)

    def _backoff(self, attempt: int) -> float:
        """Seconds before the retry of a failed ``attempt``: ``retry_backoff``'s answer, held to
        0 .. _MAX_DELAY (infinity waits the longest), so a bad answer cannot stop the worker's
        write with an OverflowError. One that is no number (or raises) is logged, and the
        default :func:`backoff` is used instead."""
        try:
            delay = self.retry_backoff(attempt)
            if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay != delay:  # NaN
                raise TypeError(f"returned {delay!r}, not a number of seconds")
        except Exception as exc:  # the user's function: its failure must not lose the outcome
            logger.warning("retry_backoff(%d) failed (%s): using jobq.backoff", attempt, _one_line(exc),
                           extra={"action": "backoff", "attempt": attempt, "worker_id": self.worker_id})
            return backoff(attempt)
        return _MAX_DELAY if delay >= _MAX_DELAY else max(0.0, float(delay))  # an int is compared exactly

    def _enforce_timeouts(self) -> None:
        now_m = time.monotonic()
        with self._lock:
            late = [r for r in self._running.values()
                    if r.deadline is not None and now_m > r.deadline and not r.abandoned and not r.returned]
        if not late:
            return

        def outcome(run: _Running) -> _Outcome:
            lease = run.lease
            retry = lease.attempt < lease.max_attempts
            return _Outcome(lease.id, self.worker_id, lease.token, "retry" if retry else "failed", ended="timeout",
                            error=f"timed out after {now_m - run.started:.1f}s (limit {run.deadline - run.started:.1f}s)",  # type: ignore[operator]
                            delay=self._backoff(lease.attempt) if retry else 0.0)

        try:
            self._abandon(late, "timed_out", outcome)
        except _DB_FAULTS as exc:
            self._db_error(exc)  # try again next tick
            return
        for run in late:
            lease = run.lease
            _emit(self.on_event, Event("timed_out", lease.id, lease.type, lease.group_key, lease.attempt, self.worker_id,
                                       now_m - run.started, outcome(run).error))

    def _pending(self) -> list[_Running]:
        with self._lock:
            return [r for r in self._running.values() if not r.abandoned]

    def _release_unstarted(self, pending: list[_Running]) -> None:
        """After the grace period: release what is still running back to ``ready`` at once."""
        if pending:
            try:
                self._abandon(pending, "shutdown", lambda r: _Outcome(r.lease.id, self.worker_id, r.lease.token, "release"))
                for run in pending:
                    lease = run.lease
                    _emit(self.on_event, Event("released", lease.id, lease.type, lease.group_key, lease.attempt, self.worker_id))
            except _DB_FAULTS as exc:
                self._db_error(exc)  # the leases will expire and be reclaimed
        self._persist()  # outcomes that arrived meanwhile; frees slots of returned handlers

    # -- heartbeats ------------------------------------------------------------------------

    def _beat(self) -> None:
        with self._lock:
            runs = [r for r in self._running.values() if not r.abandoned and not r.ctx.lease_lost]
            unheld = [r for r in self._running.values() if not r.abandoned and r.ctx.lease_lost and not r.returned]
            holding = bool(self._abandoned)
        if not runs and not holding and not unheld:
            return
        started = time.monotonic()
        margin = min(self.heartbeat_interval, self.lease_ttl * 0.2)

        def fence_stale() -> None:
            # Self-fence: past lease_ttl minus a margin without a successful beat, another worker
            # may already have reclaimed the job. Stop and never write its result.
            for r in runs:
                if time.monotonic() - r.last_beat > self.lease_ttl - margin:
                    r.ctx._signal("lease_lost")

        # A request the network swallows (a partition) blocks this beat until the kernel gives
        # up on the socket, minutes later: a watchdog fences on time meanwhile.
        beating = threading.Event()
        if runs:
            threading.Thread(target=_watch_beat, args=(beating, fence_stale, margin), daemon=True,
                             name="jobq-beat-watchdog").start()
        try:
            now = self._clock.now()
            expires = now + _dt.timedelta(seconds=self.lease_ttl)

            def write(conn: Connection, d: _Dialect) -> set[tuple[str, int, bool]]:
                if holding:
                    conn.execute(_q_renew_held_slots(self.worker_id, expires))
                _hold_slots(conn, unheld, self.worker_id, expires)  # self-fenced while the database was away
                out: set[tuple[str, int, bool]] = set()
                by_token: dict[str, list[Lease]] = {}
                for r in runs:
                    by_token.setdefault(r.lease.token, []).append(r.lease)
                for token, leases in by_token.items():
                    held, cancel = _heartbeat_rows(conn, leases, self.lease_ttl, now)
                    out.update((token, i, i in cancel) for i in held)
                for r, p in reports:  # the latest progress of each handler, fenced like the beat
                    conn.execute(_q_progress(r.lease.id, r.lease.token, p))
                return out

            reports = [(r, r.ctx._progress) for r in runs if r.ctx._progress is not r.ctx._progress_sent]

            beat = _transaction(self.engine, write)
        except Exception as exc:  # noqa: BLE001 - the heartbeat outlives every fault
            _emit(self.on_event, Event("db_error", 0, worker_id=self.worker_id, error=_one_line(exc)))
            fence_stale()
            return
        finally:
            beating.set()
        for r, p in reports:
            r.ctx._progress_sent = p
        if unheld:
            self._lost(unheld)
        lost: list[_Running] = []
        for r in runs:
            if (r.lease.token, r.lease.id, False) in beat or (r.lease.token, r.lease.id, True) in beat:
                r.last_beat = started
                if (r.lease.token, r.lease.id, True) in beat:
                    r.ctx._signal("cancelled")
            else:
                with self._lock:
                    if r.returned or self._running.get(r.key) is not r:
                        continue  # finished and written meanwhile: not a lost lease
                lost.append(r)
        if lost:
            # Reclaimed by another worker while the handler still runs: hold its slot until it
            # returns (the caps keep counting it), as for a timeout.
            try:
                _transaction(self.engine, lambda conn, d: _hold_slots(conn, lost, self.worker_id, expires))
            except Exception as exc:  # noqa: BLE001 - held on a later beat (unheld above)
                _emit(self.on_event, Event("db_error", 0, worker_id=self.worker_id, error=_one_line(exc)))
                for r in lost:
                    r.ctx._signal("lease_lost")
                return
            self._lost(lost)


def _watch_beat(beating: threading.Event, fence_stale: Callable[[], None], margin: float) -> None:
    while not beating.wait(max(margin / 2, 0.05)):
        fence_stale()


def _hold_slots(conn: Connection, runs: Sequence[_Running], worker_id: str, expires: _dt.datetime) -> None:
    rows = [{"token": r.lease.token, "job_id": r.lease.id, "worker_id": worker_id, "group_key": r.lease.group_key,
             "expires": expires} for r in runs if not r.returned]
    if rows:
        conn.execute(_q_hold_slots(), rows)


class Worker(_WorkerCore):
    """Runs handlers for runnable jobs, within a global concurrency cap, until stopped.

    Each tick persists finished jobs, enforces timeouts, then in one transaction reclaims
    expired leases (at the first tick, then every ``min(lease_ttl / 4, 1 s)``), ranks the
    ready set by fair share and leases what fits under the caps, and dispatches the leases. A
    heartbeat thread renews the leases while handlers run.

    Args:
        engine: the queue's Engine (``pool_pre_ping=True`` is advisable for servers).
        handlers: job type -> callable ``handler(ctx) -> dict | None``. Only these types are
            claimed; workers with different handler maps may share one database.
        max_concurrency: the global cap: most jobs in flight across every worker on this
            database (enforced in the claim transaction). Also this worker's own limit, unless
            ``local_concurrency`` sets a lower one.
        lease_ttl: seconds a lease lasts without a heartbeat.
        heartbeat_interval: seconds between heartbeats (default ``lease_ttl / 3``); must be at
            most half of ``lease_ttl``.
        poll_interval: seconds between ticks when idle.
        worker_id: a name for this worker (default host:pid:random, fresh per Worker).
        timeout: default seconds one dispatch may run (a job's own ``timeout`` wins).
        group_caps: group -> most jobs in flight for that group, across all workers.
        rate_limits: group -> (starts, per_seconds): at most that many job starts in any window
            of that length, across all workers; the group "*" limits every group together.
            A start is the claim, timed by the database clock under the claim lock (one extra
            round trip per claim while rate limits are set).
        retry_backoff: ``f(attempt) -> seconds`` before a failed job is retried (default
            :func:`backoff`).
        shutdown_timeout: seconds ``run()`` lets running handlers finish after a stop request
            before it releases their jobs back to ``ready``.
        executor: "thread" (default) runs handlers in threads; "process" runs each dispatch in
            its own process, which is killed when it times out.
        start_method: multiprocessing start method for the process executor (default "fork";
            "spawn" and "forkserver" need handlers importable by name). Checked only with
            ``executor="process"``.
        listen: PostgreSQL with psycopg 3 only: also wake on NOTIFY (enqueue, released
            dependents, reclaims) through a dedicated LISTEN connection, re-LISTENing and
            polling at once after any reconnect. Polling stays on as the fallback.
        on_event: called with an :class:`Event` for every transition (metrics hook).
        finalize_delay: once a handler has finished, seconds to wait for other busy handlers
            to finish too, so their results are written in one transaction (group commit).
            Only short jobs that finish together are delayed, by at most this much.
        local_concurrency: most handlers this worker runs at once (default ``max_concurrency``).
            Set it when several workers share one global cap: with only ``max_concurrency``,
            one worker may take the whole cap and leave the others idle. At most
            ``max_concurrency``.

    The options are validated once into :class:`WorkerOptions` (``worker.options``).

    Raises:
        ConfigError: an option is invalid (e.g. a heartbeat too close to the lease TTL).
    """

    def __init__(
        self,
        engine: Engine,
        handlers: Mapping[str, Callable[[JobContext], Mapping[str, Any] | None]],
        *,
        max_concurrency: int,
        lease_ttl: float = 30.0,
        heartbeat_interval: float | None = None,
        poll_interval: float = 1.0,
        worker_id: str | None = None,
        timeout: float | None = None,
        group_caps: Mapping[str, int] | None = None,
        rate_limits: Mapping[str, tuple[int, float]] | None = None,
        retry_backoff: Callable[[int], float] | None = None,
        shutdown_timeout: float = 30.0,
        executor: str = "thread",
        start_method: str = "fork",
        listen: bool = False,
        on_event: Callable[[Event], None] | None = None,
        finalize_delay: float = 0.005,
        local_concurrency: int | None = None,
    ) -> None:
        _check_worker_target(engine, handlers)
        options = WorkerOptions(
            max_concurrency=max_concurrency, lease_ttl=lease_ttl, heartbeat_interval=heartbeat_interval,
            poll_interval=poll_interval, worker_id=worker_id, timeout=timeout, group_caps=group_caps,
            rate_limits=rate_limits, retry_backoff=retry_backoff, shutdown_timeout=shutdown_timeout, executor=executor,
            start_method=start_method, listen=listen, on_event=on_event, finalize_delay=finalize_delay,
            local_concurrency=local_concurrency,
        )
        super().__init__(engine, handlers, options)
        import multiprocessing

        self._mp = multiprocessing.get_context(start_method) if executor == "process" else None
        _prepare(engine)  # fail fast on an unsupported database
        self._queue: deque[_Running] = deque()  # dispatches for the handler threads (under _lock)
        self._parked: list[Any] = []  # parked handler threads' locks: releasing one wakes its thread
        self._takers = 0  # handler threads on their way to look at _queue (see _start_all)
        self._refused = False  # a handler thread could not be started (see _revive_takers)

    def run(self) -> None:
        """Tick until :meth:`stop` or SIGTERM/SIGINT, then stop gracefully: stop claiming, let
        running handlers finish for up to ``shutdown_timeout``, release the rest to ``ready``."""
        restore = self._install_signals()
        self._start_heartbeats()
        try:
            self._drive(self._run_steps())
        finally:
            self._hb_stop.set()
            restore()

    def run_until_idle(self, timeout: float | None = None) -> bool:
        """Tick until idle: nothing of this worker's types is due (``ready`` with its
        ``run_after`` passed), retrying (``ready`` again after an attempt, backing off), leased
        or running, and none of its handlers is busy. Idle means no work a claim could start:
        jobs first scheduled for later, waiting on upstreams, or in a paused group (see
        :func:`set_group`) do not keep it ticking; due jobs held back by a cap or a spent rate
        limit do, since a later tick starts them. Returns True when idle, False if ``timeout``
        seconds passed (unfinished jobs are then released, as by a graceful stop)."""
        self._start_heartbeats()
        try:
            return self._drive(self._until_idle_steps(timeout))
        finally:
            self._hb_stop.set()
            self._hb_thread = None

    def tick(self) -> int:
        """One round, in one transaction: write the outcomes of finished handlers, reclaim
        expired leases, rank the ready set by fair share and lease what fits under the caps;
        then dispatch. Returns how many jobs it started."""
        return self._tick()

    # -- the thread runner -----------------------------------------------------------------

    def _drive(self, steps: Generator[Any, Any, _T]) -> _T:
        sent: Any = None
        while True:
            try:
                step = steps.send(sent)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            if callable(step):
                sent = step()
            else:
                self._wake.wait(step)
                self._wake.clear()
                sent = None

    def _install_signals(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        for s in previous:
            signal.signal(s, lambda signum, frame: self.stop())

        def restore() -> None:
            for s, h in previous.items():
                signal.signal(s, h)

        return restore

    def _start_all(self, runs: Sequence[_Running]) -> None:
        # A claim's dispatches go on one queue with one wake-up, not one per dispatch. Handler
        # threads take them in turn, and a thread that takes one while more wait first makes
        # sure another thread is on its way (a parked one woken, or a new one started), so no
        # dispatch waits behind a running handler. Short handlers are then run back to back by
        # the threads already awake: a claim of 64 no-ops wakes a few threads, not 64 (each
        # wake-up a futex call and a hand-over of the GIL that the tick's loop waits for).
        with self._lock:
            self._queue.extend(runs)
            spawn = not self._takers and self._add_taker()
        if spawn:
            self._new_thread()

    def _add_taker(self) -> bool:
        """Under the lock: get one more thread on its way to the queue by waking a parked one;
        True if none is parked, and the caller must start one (after releasing the lock)."""
        self._takers += 1
        if self._parked:
            self._parked.pop().release()
            return False
        return True

    def _new_thread(self) -> None:
        try:
            threading.Thread(target=self._handler_thread, name="jobq-handler", daemon=True).start()
        except BaseException:
            # The OS refused a thread ("can't start new thread": a pids limit, memory): nobody
            # is on the way to the queue after all. Uncounted, the next claim or the loop's next
            # tick (_revive_takers) tries again; counted, every later dispatch waited forever
            # behind a thread that never existed, heartbeated and never run.
            with self._lock:
                self._takers -= 1
                self._refused = True
            raise

    def _try_new_thread(self) -> bool:
        """From a handler thread that took a dispatch while more wait: start another thread, or
        (refused) return False and let this one take the rest after its handler. Raising here
        would end this thread with its dispatch taken and never run, heartbeated forever."""
        try:
            self._new_thread()
            return True
        except Exception:  # noqa: BLE001 - refused, and uncounted by _new_thread
            return False

    def _revive_takers(self) -> None:
        if not self._refused:
            return  # only a refusal leaves dispatches with nobody on the way (tests/core/test_handoff.py)
        with self._lock:
            self._refused = False
            spawn = bool(self._queue) and not self._takers and self._add_taker()
        if spawn:
            self._new_thread()  # refused again: raises out of the tick, as the claim's own start did

    def _handler_idle(self) -> None:
        # As its handler returns (under the lock): this thread looks at the queue next, so a
        # claim that lands meanwhile need not wake or start another one.
        self._takers += 1

    def _handler_thread(self) -> None:
        # Runs dispatches from the queue; parks when it is empty, and exits after
        # _IDLE_THREAD_SECONDS parked. It counts in _takers whenever it is on its way to the
        # queue: started, woken, or back from a handler.
        target = self._execute_in_process if self.executor == "process" else self._execute
        park = threading.Lock()
        park.acquire()
        while True:
            spawn = False
            with self._lock:
                self._takers -= 1
                run: _Running | None = None
                if self._queue:
                    run = self._queue.popleft()
                    spawn = bool(self._queue) and not self._takers and self._add_taker()
                else:
                    self._parked.append(park)
            if spawn:
                self._try_new_thread()
            if run is None:
                if park.acquire(timeout=_IDLE_THREAD_SECONDS):
                    continue  # woken: the waker counted this thread a taker
                with self._lock:
                    if park in self._parked:
                        self._parked.remove(park)
                        return
                park.acquire()  # a waker took it off the list just now: its release is due
                continue
            run.thread = threading.current_thread()
            kind, payload = target(run)
            self._finish(run, kind, payload)  # counts this thread a taker again, in the same step

    def _execute(self, run: _Running) -> tuple[str, Any]:
        try:
            value = self.handlers[run.lease.type](run.ctx)
            return self._check_result(value)
        except BaseException as exc:  # noqa: BLE001 - SystemExit in a handler thread is a failure, never success
            return "error", _format_error(exc)

    def _execute_in_process(self, run: _Running) -> tuple[str, Any]:
        from multiprocessing.connection import wait

        assert self._mp is not None
        recv, send = self._mp.Pipe()  # duplex: the handler process's checkpoints and spawns are answered
        stop = self._mp.Event()
        with _LIFELINE_LOCK:
            lifeline, held = self._mp.Pipe(duplex=False)  # the child's death watch: see _die_with_worker
            _LIFELINES.add(held)
        proc = self._mp.Process(  # type: ignore[attr-defined]
            target=_process_main, args=(_die_with_worker, self.handlers[run.lease.type], run.lease, stop, send, lifeline),
                                name=f"jobq-job-{run.lease.id}", daemon=True)
        run.process = proc
        msg = None
        try:
            with _LIFELINE_LOCK:  # a fork inherits the lifelines in _LIFELINES, and no other
                proc.start()
            send.close()
            lifeline.close()
            while msg is None:
                ready = wait([recv, proc.sentinel], timeout=0.1)
                if run.ctx.stop_requested:
                    stop.set()
                if recv in ready:
                    try:
                        msg = recv.recv()
                    except EOFError:
                        break
                    if msg[0] == "progress":
                        run.ctx._progress, msg = msg[1], None
                    elif msg[0] == "checkpoint":
                        state, run.ctx._progress = msg[1]
                        recv.send(self._checkpoint_for_child(run, state))
                        msg = None
                    elif msg[0] == "spawn":
                        recv.send(self._spawn_answer(run, msg[1]))
                        msg = None
                elif proc.sentinel in ready:
                    break
            proc.join()
            if msg is None:
                kind, payload = "error", f"handler process died (exit code {proc.exitcode})"
            elif msg[0] == "ok":
                kind, payload = self._check_result(msg[1])
            else:
                kind, payload = "error", msg[1]
        except BaseException as exc:  # noqa: BLE001
            kind, payload = "error", _format_error(exc)
        finally:
            recv.close()
            lifeline.close()
            with _LIFELINE_LOCK:
                _LIFELINES.discard(held)
                held.close()
        return kind, payload

    def _checkpoint_for_child(self, run: _Running, state: dict[str, Any]) -> tuple[str, str]:
        try:
            self._store_checkpoint(run.ctx, state)
            return "ok", ""
        except LeaseLost as exc:
            return "lost", str(exc)
        except Exception as exc:  # noqa: BLE001 - the handler's checkpoint() raises it
            return "error", f"checkpoint not stored: {_one_line(exc)}"
    def _spawn_answer(self, run: _Running, plan: _Plan) -> tuple[str, Any]:
        try:
            return "ids", self._spawn(run, plan)
        except JobqError as exc:
            return "raise", exc
        except Exception as exc:  # noqa: BLE001 - a driver's error may not pickle: its text does
            return "raise", JobqError(f"spawn failed: {_one_line(exc)}")

    def _stop_handlers(self, runs: Sequence[_Running]) -> None:
        for run in runs:
            if run.process is not None and run.process.is_alive():
                run.process.kill()  # the process executor can really stop a stuck handler

    def _start_heartbeats(self) -> None:
        if self._hb_thread is not None and self._hb_thread.is_alive():
            return
        self._hb_stop = threading.Event()
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, args=(self._hb_stop,), name="jobq-heartbeat", daemon=True)
        self._hb_thread.start()
        if self.listen:
            threading.Thread(target=self._listen_loop, args=(self._hb_stop,), name="jobq-listen", daemon=True).start()

    def _listen_loop(self, stop: threading.Event) -> None:
        delay = 0.1
        while not stop.is_set():
            conn = None
            try:
                conn = _listener_connection(self.engine)
                self._wake.set()  # anything enqueued while we were not listening: poll now
                delay = 0.1
                while not stop.is_set():
                    for _ in conn.notifies(timeout=0.5, stop_after=1):
                        self._notified = True
                        self._wake.set()
            except Exception as exc:  # noqa: BLE001 - the listener must outlive every database fault
                _emit(self.on_event, Event("db_error", 0, worker_id=self.worker_id, error="listener: " + _one_line(exc)))
                stop.wait(delay)
                delay = min(delay * 2, 5.0)
            finally:
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:  # noqa: BLE001
                        pass

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.heartbeat_interval):
            self._beat()


def _format_error(exc: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    head = f"{type(exc).__name__}: {exc}"
    return (head + "\n" + tb[-(_ERROR_LIMIT - len(head) - 1) :])[:_ERROR_LIMIT]


# =============================================================================================
# asyncio: the same functions and worker on AsyncEngine, through SQLAlchemy's greenlet bridge
# =============================================================================================
# Nothing here has SQL or rules of its own. Each async function runs its sync twin, unchanged,
# inside SQLAlchemy's greenlet bridge (greenlet_spawn / run_sync), where every database call the
# twin makes awaits the async driver instead of blocking; transaction retries sleep with
# asyncio.sleep. Needs greenlet (``pip install sqlalchemy[asyncio]``) and an async driver
# (psycopg 3, aiosqlite, aiomysql or asyncmy).

_ASYNC_TWINS = ("attempts", "cancel", "claim", "claim_batch", "create_schema", "enqueue", "fail", "finalize", "get",
                "get_group", "get_limit", "groups", "heartbeat", "prune", "reclaim", "release", "retry", "set_group",
                "set_limit", "stats", "submit", "tick", "why")


def _async_twin(fn: Callable[..., _T]) -> Callable[..., Any]:
    async def twin(target: Any, *args: Any, **kwargs: Any) -> _T:
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
        from sqlalchemy.util import greenlet_spawn

        if isinstance(target, AsyncEngine):
            return await greenlet_spawn(fn, target.sync_engine, *args, **kwargs)  # type: ignore[no-any-return]
        if isinstance(target, (AsyncConnection, AsyncSession)):
            # the caller's transaction, as with a sync Session/Connection
            return await target.run_sync(lambda sync: fn(sync, *args, **kwargs))  # type: ignore[arg-type]
        raise ConfigError(f"jobq.aio.{fn.__name__} needs an AsyncEngine (or AsyncSession/AsyncConnection), "
                          f"got {_type_name(target)}")

    twin.__name__ = twin.__qualname__ = fn.__name__
    twin.__doc__ = (f"``await jobq.aio.{fn.__name__}(...)``: :func:`jobq.{fn.__name__}` on an ``AsyncEngine`` "
                    "(or, where it takes a Session/Connection, an ``AsyncSession``/``AsyncConnection``). Same "
                    f"arguments, result and errors.\n\n{fn.__doc__ or ''}")
    return twin


class AsyncWorker(_WorkerCore):
    """:class:`Worker` for asyncio: handlers are coroutine functions (``async def handler(ctx)``)
    run as tasks on the running event loop, with the same claim, lease, heartbeat, finalize
    and tick semantics, the same loop and the same database code (only the runner differs).

    Takes the Worker's options, except ``executor`` (handlers are tasks) and ``listen``.
    Differences that follow from asyncio: a dispatch that times out, loses its lease, or whose
    job is cancelled has its task cancelled (so unlike a thread it really stops, at its next
    ``await``); handlers must not block the event loop, or heartbeats stall with it. Use
    ``await worker.run()`` / ``await worker.run_until_idle()``; ``stop()`` is thread-safe.

    Raises:
        ConfigError: not an AsyncEngine, a handler that is not ``async def``, or an option
            this worker does not support.
    """

    def __init__(self, engine: Any, handlers: Mapping[str, Callable[[JobContext], Any]], **options: Any) -> None:
        import inspect

        from sqlalchemy.ext.asyncio import AsyncEngine

        if not isinstance(engine, AsyncEngine):
            raise ConfigError(f"AsyncWorker needs an AsyncEngine, got {_type_name(engine)}")
        for key in ("executor", "start_method", "listen"):
            if key in options:
                raise ConfigError(f"AsyncWorker does not take {key}=")
        for name, fn in (handlers.items() if isinstance(handlers, Mapping) else ()):
            if not inspect.iscoroutinefunction(fn):
                raise ConfigError(f"handler for {name!r} must be an async def function")
        _check_worker_target(engine.sync_engine, handlers)
        super().__init__(engine.sync_engine, handlers, WorkerOptions(**options))
        self.async_engine = engine
        self._tasks: dict[tuple[str, int], Any] = {}  # by dispatch (_Running.key)
        self._loop: Any = None  # the event loop this worker runs on
        self._awake: Any = None  # asyncio.Event, made on the running loop

    async def run(self) -> None:
        """Tick until :meth:`stop` (or SIGTERM/SIGINT in the main thread), then stop gracefully.

        Cancelling the task that awaits it stops at once instead: the handler tasks are
        cancelled, their jobs released to ``ready`` (not charged) and results already returned
        written, then :class:`asyncio.CancelledError` is raised again. The release is written
        before the handlers are cancelled; one that ignores its cancellation is waited for at
        most ``shutdown_timeout`` seconds, then abandoned (its job already released, its slot
        counted until it ends or ``lease_ttl`` passes).
        """
        await self._guarded(self._run_steps())

    async def run_until_idle(self, timeout: float | None = None) -> bool:
        """As :meth:`Worker.run_until_idle`; cancelling it stops as cancelling :meth:`run` does."""
        return await self._guarded(self._until_idle_steps(timeout))

    async def tick(self) -> int:
        """As :meth:`Worker.tick`."""
        await self._attach()
        return await self._bridge(self._tick)

    def stop(self) -> None:
        """Ask :meth:`run` to stop claiming and shut down gracefully (thread-safe)."""
        super().stop()
        if self._awake is not None:
            self._loop.call_soon_threadsafe(self._awake.set)

    # -- the task runner -------------------------------------------------------------------

    async def _guarded(self, steps: Generator[Any, Any, _T]) -> _T:
        import asyncio

        done = await self._setup()
        try:
            return await self._drive(steps)
        except asyncio.CancelledError:
            # How an asyncio service stops: no grace, but nothing left running or leased.
            self._stopping.set()
            await self._drive(self._drain_steps(0, unwind=self.shutdown_timeout))
            raise
        finally:
            done()

    async def _drive(self, steps: Generator[Any, Any, _T]) -> _T:
        sent: Any = None
        while True:
            try:
                step = steps.send(sent)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            if callable(step):
                sent = await self._shielded(step)
            elif isinstance(step, (int, float)):
                await self._nap(step)
                sent = None
            else:
                sent = await step

    async def _shielded(self, step: Callable[[], _T]) -> _T:
        """Run a step (database work) to its end even if the awaiting task is cancelled, which
        then sees the cancellation after it: a finalize is never cut between its statements
        and its bookkeeping."""
        import asyncio

        work = self._loop.create_task(self._bridge(step))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            while not work.done():
                try:
                    await asyncio.wait([work])
                except asyncio.CancelledError:
                    pass  # cancelled again: still, the step ends first
            raise

    async def _bridge(self, fn: Callable[..., _T], *args: Any) -> _T:
        from sqlalchemy.util import greenlet_spawn

        return await greenlet_spawn(fn, *args)  # type: ignore[no-any-return]

    async def _nap(self, seconds: float) -> None:
        import asyncio

        try:
            await asyncio.wait_for(self._awake.wait(), seconds)
        except asyncio.TimeoutError:
            pass
        self._awake.clear()

    async def _attach(self) -> None:
        """Bind to the running event loop and inspect the engine (it may connect: awaited)."""
        import asyncio

        loop = asyncio.get_running_loop()
        if self._awake is None or self._loop is not loop:  # an asyncio.Event belongs to one loop
            self._loop, self._awake = loop, asyncio.Event()
        await self._bridge(_prepare, self.engine)

    async def _setup(self) -> Callable[[], None]:
        await self._attach()
        self._hb_stop = threading.Event()
        hb = self._loop.create_task(self._heartbeats(self._hb_stop))
        restore: list[Callable[[], Any]] = [hb.cancel, self._hb_stop.set]
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    self._loop.add_signal_handler(sig, self.stop)
                    restore.append(functools.partial(self._loop.remove_signal_handler, sig))
                except (NotImplementedError, RuntimeError):
                    pass

        def done() -> None:
            for f in restore:
                f()

        return done

    def _unwind_steps(self, wait: float = 5.0) -> Generator[Any, Any, None]:
        import asyncio

        if self._tasks:  # cancelled by the release: let them unwind
            yield asyncio.wait(list(self._tasks.values()), timeout=wait)
            yield asyncio.sleep(0)  # the done callbacks of tasks that ended before the wait (_task_done)
        yield self._persist  # their outcomes free the slots the release held (tasks done already included)

    def _start_all(self, runs: Sequence[_Running]) -> None:
        for run in runs:
            task = self._tasks[run.key] = self._loop.create_task(self._execute_task(run))
            task.add_done_callback(functools.partial(self._task_done, run))

    def _task_done(self, run: _Running, task: Any) -> None:
        # A task cancelled before its first step never ran _execute_task: its outcome, which
        # frees the slot a release holds for it, is queued here instead.
        if task.cancelled() and self._tasks.pop(run.key, None) is not None:
            self._finish(run, "error", "handler task cancelled before it started")

    def _save_checkpoint(self, ctx: JobContext, state: dict[str, Any]) -> Any:
        return self._bridge(self._store_checkpoint, ctx, state)  # awaited by the handler

    async def _execute_task(self, run: _Running) -> None:
        import asyncio

        try:
            handler: Any = self.handlers[run.lease.type]
            value = await _in_bridge(handler(run.ctx))
            kind, payload = self._check_result(value)
        except asyncio.CancelledError:
            kind, payload = "error", f"handler task cancelled ({run.ctx.stop_reason or 'stopped'})"
        except BaseException as exc:  # noqa: BLE001 - reported like a thread handler's error
            kind, payload = "error", _format_error(exc)
        self._tasks.pop(run.key, None)
        self._finish(run, kind, payload)

    def _poke(self) -> None:
        super()._poke()
        if self._awake is not None:
            self._awake.set()

    def _stop_handlers(self, runs: Sequence[_Running]) -> None:
        for run in runs:  # written (and fenced) first; then the task really stops
            task = self._tasks.get(run.key)
            if task is not None:
                task.cancel()

    async def _heartbeats(self, stop: threading.Event) -> None:
        import asyncio

        while not stop.is_set():
            await asyncio.sleep(self.heartbeat_interval)
            await self._bridge(self._beat)
            for key, task in list(self._tasks.items()):
                run = self._running.get(key)
                if run is not None and run.ctx.stop_reason in ("lease_lost", "cancelled"):
                    task.cancel()


async def _in_bridge(coro: Any) -> Any:
    """Await ``coro`` with its steps run inside SQLAlchemy's greenlet bridge, so that the
    synchronous jobq calls a handler makes (ctx.enqueue, ctx.submit) await the async driver
    instead of blocking the event loop. The coroutine is driven as a Task drives it: each
    future it yields is waited for (and cancelled with the task), then it is resumed."""
    import asyncio

    from sqlalchemy.util import await_only, greenlet_spawn

    async def step(fut: Any) -> None:
        if fut is None:  # a bare yield (asyncio.sleep(0)): give the loop one turn
            await asyncio.sleep(0)
            return
        fut._asyncio_future_blocking = False
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            fut.cancel()
            raise

    def drive() -> Any:
        error: BaseException | None = None
        while True:
            try:
                fut = coro.throw(error) if error is not None else coro.send(None)
            except StopIteration as stop:
                return stop.value
            error = None
            try:
                await_only(step(fut))
            except BaseException as exc:  # noqa: BLE001 - delivered into the handler, as a Task would
                error = exc

    return await greenlet_spawn(drive)


class _AioNamespace:
    """``jobq.aio``: every queue function as a coroutine on an ``AsyncEngine`` (``await
    jobq.aio.enqueue(async_engine, "resize", {...})``), plus :class:`AsyncWorker`. Each one
    runs the sync function of the same name through SQLAlchemy's greenlet bridge, so the SQL,
    the locking and the rules are the sync ones, not copies."""

    AsyncWorker = AsyncWorker

    def __init__(self) -> None:
        for name in _ASYNC_TWINS:
            setattr(self, name, _async_twin(globals()[name]))

    def __getattr__(self, name: str) -> Any:  # for type checkers: the twins are set in __init__
        raise AttributeError(f"jobq.aio has no {name!r}")


#: The asyncio API: ``await jobq.aio.claim_batch(async_engine, ...)``; see :class:`AsyncWorker`.
aio = _AioNamespace()


# =============================================================================================
# Command-line interface
# =============================================================================================
# One rule for exit codes (keep in sync with main's docstring and the README): 0 ok, 1 the job
# named by the command's ID does not exist, 2 bad usage or input (options, the URL, --app),
# 3 the database: unreachable, failing, missing, or without jobq's schema, 4 a bug in jobq.
# Every error is one line on stderr, scrubbed of the URL's credentials.

_EXIT_NO_SUCH_JOB, _EXIT_USAGE, _EXIT_DATABASE, _EXIT_INTERNAL = 1, 2, 3, 4


def _cancel_outcome(state: str) -> str:
    """What cancel() returning ``state`` means, in words (the CLI and the dashboard)."""
    if state in _LIVE:
        return "cancel requested; it ends cancelled when its handler returns"
    if state == "held":
        return ("cancel requested; it ends cancelled (never runs) when its spawner's result releases it, "
                "or is deleted with the spawner's other spawns if that handler fails")
    return state


class _CliError(Exception):
    """An error the command reports as one line, with its exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (it prints the whole usage, then the error)."""

    def error(self, message: str) -> Any:
        self.exit(_EXIT_USAGE, f"jobq: {message} (see: {self.prog} --help)\n")


def _load_handlers(spec: str) -> Mapping[str, Callable[[JobContext], Any]]:
    # Handlers come only from the operator's own module: a job row's type is a key into this
    # mapping, never something jobq imports (write access to the table is not code execution).
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--app must look like package.module:handlers, got {spec!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # anything the operator's module raises while it is imported
        raise ConfigError(f"--app {spec}: cannot import {module_name}: {type(exc).__name__}: {_one_line(exc)}") from None
    handlers = getattr(module, attr, None)
    if handlers is None:
        raise ConfigError(f"--app {spec}: module {module_name} has no attribute {attr!r}")
    if not isinstance(handlers, Mapping):
        raise ConfigError(f"--app {spec} is a {_type_name(handlers)}, not a mapping of job type -> handler")
    return handlers


# ---- argument types: each refuses bad input with one line, before anything connects

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_MAX_SECONDS = 100 * 366 * 86400  # a century: longer is a typo, and overflows date arithmetic


def _seconds(text: str, what: str, *, unit: bool, zero: bool) -> float:
    """``text`` as seconds: a number with a unit (30s, 15m, 12h, 7d, 2w), or without one
    (seconds) unless ``unit`` is required."""
    t = text.strip()
    factor = 1
    if t and t[-1] in _UNITS:
        factor, t = _UNITS[t[-1]], t[:-1]
    elif unit:
        t = ""
    try:
        value = float(t) * factor
    except ValueError:
        value = math.nan
    example = "30s, 15m, 12h or 7d" if unit else "seconds, or 30s, 15m, 12h, 7d"
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(f"{what} must be a {'non-negative' if zero else 'positive'} duration "
                                         f"({example}), got {text!r}")
    if value > _MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{what} must be at most 100 years, got {text!r}")
    return value


def _duration(text: str) -> _dt.timedelta:
    return _dt.timedelta(seconds=_seconds(text, "a duration", unit=True, zero=True))


def _delay(text: str) -> _dt.timedelta:
    return _dt.timedelta(seconds=_seconds(text, "--delay", unit=False, zero=True))


def _interval(text: str) -> float:
    return _seconds(text, "an interval", unit=False, zero=False)


def _run_after(text: str) -> _dt.datetime:
    t = text.strip()
    try:  # Python 3.10's fromisoformat does not read "Z"
        when = _dt.datetime.fromisoformat(t[:-1] + "+00:00" if t[-1:] in ("Z", "z") else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--run-after must be an ISO 8601 time like 2030-01-31T09:00:00Z, got {text!r}") from None
    if when.tzinfo is None:
        raise argparse.ArgumentTypeError(f"--run-after {text!r} has no time zone: add Z (UTC) or an offset like +02:00")
    try:
        return when.astimezone(_dt.timezone.utc)
    except OverflowError:
        raise argparse.ArgumentTypeError(f"--run-after {text!r} is out of range") from None


def _job_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"a job id is a positive 64-bit integer, got {text!r}")
    return value


def _whole(text: str, most: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= most:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {most}, got {text!r}")
    return value


def _count(text: str) -> int:
    """A cap, a concurrency or a number of rows: the API's bound on caps (_MAX_SLOTS)."""
    return _whole(text, _MAX_SLOTS)


def _weight(text: str) -> int:
    return _whole(text, _MAX_WEIGHT)


def _states(text: str) -> list[str]:
    """``--state``'s value: one state, or several separated by commas (failed,cancelled)."""
    names = [t.strip() for t in text.split(",")]
    bad = [t for t in names if t not in STATES]
    if bad:
        raise argparse.ArgumentTypeError(f"invalid state {bad[0]!r} (choose from {', '.join(STATES)})")
    return names


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 0 to 65535, got {text!r}")
    return int(text)


def _token(text: str) -> str:
    if len(text) < 8:
        raise argparse.ArgumentTypeError("the dashboard token must have at least 8 characters")
    return text


def _limit_or_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An option's value, or UNLIMITED for "none" (jobq group --cap none)."""
    def parse_limit(text: str) -> Any:
        return UNLIMITED if text.strip().lower() == "none" else parse(text)
    return parse_limit


def _cap(text: str) -> tuple[str, int]:
    group, eq, n = text.rpartition("=")
    if not eq or not group:
        raise argparse.ArgumentTypeError(f"--cap must look like GROUP=N, got {text!r}")
    return group, _count(n)


def _rate(text: str) -> tuple[str, tuple[int, float]]:
    group, eq, spec = text.rpartition("=")
    n, slash, per = spec.partition("/")
    if not eq or not group or not slash:
        raise argparse.ArgumentTypeError(f"--rate must look like GROUP=N/SECONDS (e.g. tenant-a=10/60 or '*=100/1m'), got {text!r}")
    period = _seconds(per, "--rate's period", unit=False, zero=False)
    if period < _MIN_RATE_PERIOD:
        raise argparse.ArgumentTypeError(f"--rate's period must be at least {_MIN_RATE_PERIOD} seconds (write a "
                                         f"faster rate over a longer period: 100/1s, not 1/0.01s), got {text!r}")
    return group, (_whole(n, _MAX_RATE_STARTS), period)


# ---- credentials: never printed, whatever the URL parser made of them


class _LoginName(str):
    """A piece of the URL's user name. A login is no password: it is blanked only where it
    stands as one (see :func:`_scrub`), so the user "root" leaves "jobq retry --root 7" alone."""


def _url_secrets(raw: str) -> list[str]:
    """Every piece of the URL's credentials that an error message could contain: the raw
    userinfo, its user name and password, their fragments around reserved characters (an
    unescaped ``@`` in a password puts the rest into the host name), decoded and not. Pieces of
    the user name alone come as :class:`_LoginName`."""
    import re
    import urllib.parse

    rest = raw.partition("://")[2]
    at = rest.rfind("@")
    if at <= 0 or rest.startswith("/"):
        return [raw] if raw else []
    userinfo = rest[:at]
    user, _, password = userinfo.partition(":")
    secret = {raw, *((userinfo, password, *re.split(r"[@:/?#\[\]]", password)) if password else ())}
    secret |= {urllib.parse.unquote(s) for s in secret}
    login = {user, *re.split(r"[@:/?#\[\]]", user)}
    login = {*login, *(urllib.parse.unquote(s) for s in login)} - secret
    # A user name that is the dialect's or driver's own name ("postgres://postgres@...") is no
    # secret, and blanking it would blank the error that names the dialect; the password stays.
    public = {part for part in re.split(r"[+]", raw.partition("://")[0].lower()) if part} - secret
    found = [*(s for s in secret if s), *(_LoginName(s) for s in login if s and s.lower() not in public)]
    return sorted(found, key=len, reverse=True)


def _url_hint(raw: str) -> str:
    """The URL a new user most likely meant, for a scheme without a driver SQLAlchemy cannot
    load ("postgres://", "mysql://" without MySQLdb): jobq's extras install psycopg and PyMySQL."""
    meant = {"postgres": ("postgresql+psycopg", "postgres"), "postgresql": ("postgresql+psycopg", "postgres"),
             "mysql": ("mysql+pymysql", "mysql"), "mariadb": ("mariadb+pymysql", "mysql")}.get(raw.partition("://")[0].lower())
    if meant is None:
        return ""
    return f" (use {meant[0]}://...: the driver jobq's {meant[1]} extra installs)"


def _scrub(text: str, secrets: Sequence[str]) -> str:
    """``text`` without any of ``secrets``. Pieces shorter than 4 characters only where they
    stand alone (between non-alphanumerics), so a password "ss" does not garble "address". A
    :class:`_LoginName` only where it stands as a login: before an ``@`` (``root@host``,
    ``'root'@'localhost'``), as a URL's ``root:password@``, or quoted whole as drivers name the
    user (``for user "root"``)."""
    import re

    for s in secrets:
        e = re.escape(s)
        if isinstance(s, _LoginName):
            text = re.sub(rf"(?<![\w.%+-]){e}(?=['\"]?@|:[^\s@/'\"]*@)|(?<=[\"']){e}(?=[\"'])", "***", text)
        elif len(s) >= 4:
            text = text.replace(s, "***")
        else:
            text = re.sub(rf"(?<![A-Za-z0-9]){e}(?![A-Za-z0-9])", "***", text)
    return text


class _ScrubbingFormatter(logging.Formatter):
    """The worker's log lines, scrubbed as errors are (a driver error names the host)."""

    def __init__(self, fmt: str, secrets: Sequence[str]) -> None:
        super().__init__(fmt)
        self._secrets = secrets

    def format(self, record: logging.LogRecord) -> str:
        return _scrub(super().format(record), self._secrets)


def _engine_for(raw: str) -> Engine:
    try:
        url = sa.engine.make_url(raw)
    except (sa.exc.ArgumentError, ValueError, TypeError) as exc:
        raise _CliError(f"bad database URL: {_one_line(exc)}", _EXIT_USAGE) from None
    if url.host and "@" in url.host:  # the parser split an unescaped "@" of the credentials
        raise _CliError("bad database URL: write an '@' inside the credentials as %40", _EXIT_USAGE)
    try:
        return sa.create_engine(url, pool_pre_ping=True)
    except ImportError as exc:
        hint = _url_hint(raw) or " (install the database driver this URL names)"
        raise _CliError(f"{_one_line(exc)}{hint}", _EXIT_USAGE) from None
    except (sa.exc.ArgumentError, ValueError, TypeError) as exc:
        raise _CliError(f"bad database URL: {_one_line(exc)}{_url_hint(raw)}", _EXIT_USAGE) from None


# ---- checks before a command touches the database


def _check_database(engine: Engine, command: str) -> None:
    """Every command but ``init`` needs an existing database with jobq's current schema; on
    SQLite, connecting to a mistyped path would create an empty file there."""
    if command == "init":
        return
    path = _missing_database_file(engine)
    if path is not None:
        raise _CliError(f"no SQLite database at {path}: check the path, or create it with `jobq init`", _EXIT_DATABASE)
    _prepare(engine)
    with engine.connect() as conn:
        inspector = sa.inspect(conn)
        if not (inspector.has_table("jobs") and inspector.has_table("jobq_meta")):
            raise _CliError("no jobq schema here: run `jobq init`", _EXIT_DATABASE)
        if command in ("group", "groups") and not inspector.has_table("jobq_groups"):
            raise _CliError("this database has no jobq_groups table yet: run `jobq init`", _EXIT_DATABASE)
        found = conn.execute(_q_schema_version()).scalar()
        conn.rollback()
    version = int(found) if found is not None and str(found).isdigit() else 0
    if version < SCHEMA_VERSION:
        raise _CliError(f"the jobq schema here is version {version}, this jobq needs {SCHEMA_VERSION}: "
                        "run `jobq init` to upgrade it", _EXIT_DATABASE)
    if version > SCHEMA_VERSION:
        raise _CliError(f"the jobq schema here is version {version}, newer than this jobq ({SCHEMA_VERSION}): "
                        "upgrade jobq.py", _EXIT_DATABASE)


def _require_job(engine: Engine, job_id: int) -> str:
    """The job's state, or exit 1: no such job."""
    with engine.connect() as conn:
        state = conn.execute(_q_job_state(job_id)).scalar()
        conn.rollback()
    if state is None:
        raise _CliError(f"no job with id {job_id}", _EXIT_NO_SUCH_JOB)
    return str(state)


# ---- output


def _json_default(value: Any) -> Any:
    if isinstance(value, _dt.datetime):
        return _iso(value, precise=True)
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    return str(value)


def _print_json(value: Any) -> None:
    print(json.dumps(value, default=_json_default, sort_keys=True))


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, _dt.datetime):
        return _iso(value) or ""
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return str(value)


_COLOURS = {"waiting": "#d0d0d0", "ready": "#9ecbff", "leased": "#ffe08a", "running": "#ffd33d",
            "done": "#85e89d", "failed": "#f97583", "cancelled": "#b392f0"}


def _graph_data(conn: Connection, root: int | None, limit: int = 500) -> tuple[list[Any], list[tuple[int, int]]]:
    """The nodes (id, type, state, parent_id, is_container) and edges (upstream, dependent) of
    a job's subtree with its direct upstreams and dependents, or of the newest ``limit`` jobs."""
    if root is None:
        ids = list(conn.execute(_q_newest_ids(limit)).scalars())
    else:
        ids = _subtree(conn, root)
        ups = list(conn.execute(_q_upstream_ids_of(ids[:limit])).scalars())
        downs = list(conn.execute(_q_dependents_of(ids[:limit])).scalars())
        ids = list(dict.fromkeys(ids + ups + downs))[:limit]
    rows = sorted(conn.execute(_q_graph_nodes(ids)).all(), key=lambda r: r.id)
    known = {r.id for r in rows}
    edges = sorted((u, v) for v, u in conn.execute(_q_edges_into(sorted(known))) if u in known)
    return rows, edges


def _graph(rows: Sequence[Any], edges: Sequence[tuple[int, int]], fmt: str) -> str:
    known = {r.id for r in rows}
    kids: dict[int | None, list[Any]] = {}
    for r in rows:
        kids.setdefault(r.parent_id if r.parent_id in known else None, []).append(r)
    lines: list[str] = []
    if fmt == "mermaid":
        lines.append("flowchart TD")

        def emit(parent: int | None, indent: str) -> None:
            for r in sorted(kids.get(parent, []), key=lambda r: r.id):
                label = f'{r.id} {r.type} ({r.state})'.replace('"', "'")
                if r.is_container:
                    lines.append(f'{indent}subgraph c{r.id}["{label}"]')
                    emit(r.id, indent + "  ")
                    lines.append(f"{indent}end")
                    lines.append(f"{indent}class c{r.id} {r.state}")
                else:
                    lines.append(f'{indent}j{r.id}["{label}"]:::{r.state}')

        emit(None, "  ")
        cont = {r.id for r in rows if r.is_container}
        for u, v in edges:
            lines.append(f"  {'c' if u in cont else 'j'}{u} --> {'c' if v in cont else 'j'}{v}")
        lines += [f"  classDef {st} fill:{col}" for st, col in _COLOURS.items()]
    else:
        lines.append("digraph jobq {")
        lines.append('  node [shape=box, style=filled, fontname="sans-serif"];')

        def emit_dot(parent: int | None, indent: str) -> None:
            for r in sorted(kids.get(parent, []), key=lambda r: r.id):
                label = f"{r.id} {r.type}\\n{r.state}".replace('"', "'")
                if r.is_container:
                    lines.append(f'{indent}subgraph cluster_{r.id} {{ label="{label}"; style=filled; fillcolor="{_COLOURS[r.state]}";')
                    lines.append(f'{indent}  j{r.id} [label="{label}", shape=folder, fillcolor="{_COLOURS[r.state]}"];')
                    emit_dot(r.id, indent + "  ")
                    lines.append(f"{indent}}}")
                else:
                    lines.append(f'{indent}j{r.id} [label="{label}", fillcolor="{_COLOURS[r.state]}"];')

        emit_dot(None, "  ")
        lines += [f"  j{u} -> j{v};" for u, v in edges]
        lines.append("}")
    return "\n".join(lines)


def _table(rows: Sequence[Mapping[str, Any]], cols: Sequence[str]) -> str:
    text = [[_text(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(t[i]) for t in text]) for i, c in enumerate(cols)]
    out = ["  ".join(c.upper().ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()]
    out += ["  ".join(v.ljust(w) for v, w in zip(t, widths, strict=True)).rstrip() for t in text]
    return "\n".join(out)


def _progress_text(p: Any) -> str:
    """A progress report as people read it: "3/10 (30%): message"."""
    if not isinstance(p, dict):
        return ""
    done, total, message = p.get("done"), p.get("total"), p.get("message")
    text = f"{done:g}" if isinstance(done, (int, float)) else "?"
    if isinstance(total, (int, float)):
        text += f"/{total:g}" + (f" ({100 * done / total:.0f}%)" if total and isinstance(done, (int, float)) else "")
    return text + (f": {message}" if message else "")


def _policy_text(p: GroupPolicy) -> str:
    rate = "none" if p.rate_limit is None else f"{p.rate_limit[0]}/{p.rate_limit[1]:g}s"
    weight = "from its jobs" if p.weight is None else p.weight
    cap = "none" if p.max_in_flight is None else p.max_in_flight
    return f"group {p.group_key}: weight {weight}, cap {cap}, rate {rate}{', PAUSED' if p.paused else ''}"


def _limit_text(g: GlobalLimit) -> str:
    cap = "none" if g.max_in_flight is None else g.max_in_flight
    rate = "none" if g.rate_limit is None else f"{g.rate_limit[0]}/{g.rate_limit[1]:g}s"
    return (f"global limit: cap {cap}, rate {rate}"
            + ("" if g.max_in_flight is not None else " (each worker's max_concurrency caps what it runs)"))


#: Groups `jobq status` names per line; past that, the busiest ones and how many more.
_STATUS_GROUPS = 10


def _per_group_text(counts: Mapping[str, int]) -> str:
    """``a: 2, b: 1`` by name, or with thousands of tenants the busiest few and a count."""
    busy = {g: n for g, n in counts.items() if n}
    if len(busy) <= _STATUS_GROUPS:
        return ", ".join(f"{g}: {n}" for g, n in sorted(busy.items())) or "none"
    top = sorted(busy.items(), key=lambda gn: (-gn[1], gn[0]))[:_STATUS_GROUPS]
    return (", ".join(f"{g}: {n}" for g, n in top)
            + f", and {len(busy) - _STATUS_GROUPS:,} more groups (the busiest shown; --json lists all)")


def _status_text(st: Mapping[str, Any]) -> str:
    window = f"{st['window_seconds'] / 3600:g}h"
    states = "  ".join(f"{k}={v}" + (f" ({st['ready_due']} due, {st['ready_scheduled']} scheduled)" if k == "ready" else "")
                       for k, v in st["states"].items() if k not in TERMINAL)
    finished = "  ".join(f"{k}={st['states'][k]}" for k in TERMINAL)
    due = _per_group_text(st["due_by_group"])
    flight = _per_group_text(st["in_flight"])
    # oldest_ready is the oldest *due* job: its wait is never negative
    age = _span((st["now"] - st["oldest_ready"]).total_seconds()) if st["oldest_ready"] else "-"
    later = str(st["ready_scheduled"])
    if st["next_scheduled"]:
        later += f", the next in {_span((st['next_scheduled'] - st['now']).total_seconds())} (at {_iso(st['next_scheduled'])})"
    lines = [f"jobs now: {states}", f"finished in the last {window}: {finished}", f"due per group: {due}",
             f"in flight per group: {flight}", f"oldest due job waiting: {age}", f"scheduled for later: {later}",
             f"expired leases awaiting reclaim: {st['expired_leases']}"]
    recent = st["recent_failures"]
    lines += ["recent failures:"] + [f"  {r['id']} {r['type']}: {_one_line(r['error'] or '')}" for r in recent] if recent else []
    return "\n".join(lines)


# ---- the command


def _parser() -> argparse.ArgumentParser:
    # --url is accepted before and after the subcommand: the subcommand's copy defaults to
    # "absent", so it overrides the global one only when given.
    common = _Parser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS, help="database URL (default: $JOBQ_URL)")
    parser = _Parser(prog="jobq", description="Operate a jobq queue (URL from --url or $JOBQ_URL).",
                     epilog="exit codes: 0 ok, 1 no such job, 2 bad usage or input, 3 database unreachable, "
                            "failing or without the jobq schema, 4 a bug in jobq")
    parser.add_argument("--url", default=os.environ.get("JOBQ_URL"), help="database URL (default: $JOBQ_URL)")
    parser.add_argument("--version", action="version", version=f"jobq {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def add(name: str, text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=text, description=text, parents=[common])
        p.add_argument("--json", action="store_true", help="print JSON (times as ISO 8601 UTC)")
        return p

    add("init", "create the schema, or upgrade it (idempotent)")
    p = add("enqueue", "add a job; prints its id")
    p.add_argument("type")
    p.add_argument("--args", default="{}", metavar="JSON", help="the job's arguments: a JSON object")
    p.add_argument("--group", default="default", help="fair-share group (default: default)")
    p.add_argument("--weight", type=_weight, default=1, help=f"fair-share weight (1 to {_MAX_WEIGHT}; default: 1)")
    p.add_argument("--depends-on", type=_job_id, action="append", default=[], metavar="ID",
                   help="run only after job ID is done (repeatable)")
    p.add_argument("--after", type=_job_id, action="append", default=[], help=argparse.SUPPRESS)  # deprecated
    p.add_argument("--parent", type=_job_id, metavar="ID", help="the container this job belongs to")
    p.add_argument("--container", action="store_true", help="a container: never runs, rolls up from its children")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--delay", type=_delay, metavar="DURATION", help="not before this long from now (seconds, or 30s, 15m, 2h)")
    when.add_argument("--run-after", type=_run_after, metavar="TIME", help="not before this time (ISO 8601 with a zone, e.g. 2030-01-31T09:00:00Z)")
    p.add_argument("--timeout", type=_interval, metavar="DURATION", help="most one dispatch may run (default: the worker's)")
    p.add_argument("--max-attempts", type=int, default=3, metavar="N", help="dispatches before it fails (default: 3)")
    p.add_argument("--priority", type=int, default=0, metavar="N", help="claim order within its group, higher first (default: 0)")
    p.add_argument("--unique-key", metavar="KEY", help="while an unfinished job holds KEY, print its id and add nothing")
    p = add("status", "counts per state, due and scheduled ready jobs, in flight per group, expired leases, failures")
    p.add_argument("--watch", type=_interval, metavar="SECONDS", help="refresh in place every SECONDS")
    p = add("ls", "list jobs, newest first (a note on stderr when more match than --limit)")
    p.add_argument("--state", type=_states, action="extend", metavar="STATE[,STATE]",
                   help="only jobs in this state (repeatable, or comma-separated: failed,cancelled)")
    p.add_argument("--type")
    p.add_argument("--group")
    p.add_argument("--since", type=_duration, metavar="DURATION", help="created within, e.g. 1h")
    p.add_argument("--before", type=_job_id, metavar="ID", help="only jobs older than job ID (the next page)")
    p.add_argument("--limit", type=_count, default=50, help=f"most rows (default: 50, at most {_MAX_SLOTS})")
    for name, text in (("show", "every field of a job, its upstreams, dependents and children"),
                       ("why", "why a job is not running right now, in one line"),
                       ("retry", "retry a failed or cancelled job (and re-open what it closed)"),
                       ("cancel", "cancel a job, or a container with its subtree")):
        p = add(name, text)
        p.add_argument("id", type=_job_id)
        if name == "retry":
            p.add_argument("--root", action="store_true",
                           help="first retry the failed or cancelled jobs up its chain that keep it closed")
    p = add("group", "show a group's stored policy, or change it (weight, cap, rate, pause) for every worker")
    p.add_argument("key", metavar="KEY")
    p.add_argument("--weight", type=_weight, help=f"fair-share weight (1 to {_MAX_WEIGHT})")
    p.add_argument("--cap", type=_limit_or_none(_count), metavar="N|none", help="most jobs in flight; none: no cap")
    p.add_argument("--rate", type=_limit_or_none(str), metavar="N/PERIOD|none",
                   help="most N starts per PERIOD (10/1m, 5/30s); none: no rate limit")
    pause = p.add_mutually_exclusive_group()
    pause.add_argument("--pause", dest="paused", action="store_const", const=True, help="claim none of its ready jobs")
    pause.add_argument("--resume", dest="paused", action="store_const", const=False, help="claim them again")
    add("groups", "every group's stored policy")
    p = add("limit", "show the global limits every worker obeys, or change them (cap, rate)")
    p.add_argument("--max-in-flight", type=_limit_or_none(_count), metavar="N|none",
                   help="most jobs in flight across every worker; none: no stored cap")
    p.add_argument("--rate", type=_limit_or_none(str), metavar="N/PERIOD|none",
                   help="most N starts per PERIOD, all groups together (100/1m); none: no rate limit")
    p.add_argument("--clear", action="store_true", help="remove both (each worker's own options still apply)")
    p = add("prune", "delete finished jobs older than a duration")
    p.add_argument("--older-than", type=_duration, required=True, metavar="DURATION", help="e.g. 7d")
    p.add_argument("--state", action="append", choices=TERMINAL, help="default: done (repeatable)")
    p = add("graph", "a job's or container's DAG as Mermaid or Graphviz DOT (--json: nodes and edges)")
    p.add_argument("id", type=_job_id, nargs="?")
    p.add_argument("--all", action="store_true", help="the newest 500 jobs")
    p.add_argument("--format", choices=("mermaid", "dot"), default="mermaid")
    p = sub.add_parser("worker", help="run a worker until SIGTERM", description="run a worker until SIGTERM/SIGINT",
                       parents=[common])
    p.add_argument("--app", required=True, metavar="MODULE:NAME", help="package.module:handlers (your own mapping)")
    p.add_argument("--concurrency", type=_count, default=4, help="the global cap: most jobs in flight across all workers")
    p.add_argument("--local-concurrency", type=_count, metavar="N",
                   help="most jobs this worker runs at once (default: --concurrency)")
    p.add_argument("--lease-ttl", type=_interval, default=30.0, metavar="SECONDS")
    p.add_argument("--heartbeat", type=_interval, metavar="SECONDS", help="default: lease TTL / 3")
    p.add_argument("--poll", type=_interval, default=1.0, metavar="SECONDS", help="seconds between ticks when idle")
    p.add_argument("--listen", action="store_true", help="also wake on NOTIFY (PostgreSQL with psycopg)")
    p.add_argument("--timeout", type=_interval, metavar="SECONDS", help="default most one dispatch may run")
    p.add_argument("--shutdown-timeout", type=_interval, default=30.0, metavar="SECONDS")
    p.add_argument("--cap", type=_cap, action="append", default=[], metavar="GROUP=N",
                   help="most jobs in flight for GROUP (repeatable)")
    p.add_argument("--rate", type=_rate, action="append", default=[], metavar="GROUP=N/SECONDS",
                   help="most N starts per SECONDS for GROUP, '*' for all (repeatable)")
    p.add_argument("--executor", choices=_EXECUTORS, default="thread")
    p.add_argument("--start-method", choices=("fork", "spawn", "forkserver"), help="for --executor process")
    p.add_argument("--worker-id")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    p = sub.add_parser("serve", help="run the web dashboard (jobq_web.py, beside jobq.py)", parents=[common],
                       description="run the web dashboard until SIGINT/SIGTERM: read-only unless given a token")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=_port, default=8080, help="default: 8080 (0: any free port)")
    p.add_argument("--token", type=_token, default=os.environ.get("JOBQ_DASHBOARD_TOKEN") or None,
                   help="allow retry/cancel/pause with this token (default: $JOBQ_DASHBOARD_TOKEN; none: read-only)")
    p.add_argument("--hide-args", action="store_true", help="never show job arguments")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``jobq`` command for operators. ``jobq --help`` lists the subcommands.

    Exit codes: 0 success, 1 no such job (the ID given to show/why/graph/retry/cancel), 2 bad
    usage or input, 3 the database is unreachable, failing, missing or without the jobq schema,
    4 a bug in jobq. Errors are one line on stderr, never with the URL's credentials. A closed
    output pipe (``jobq ls | head -1``) ends the command quietly.
    """
    try:
        code = _main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away: stop quietly, and keep the interpreter's final flush of
        # stdout from reporting the same broken pipe.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 0


def _main(argv: Sequence[str] | None) -> int:
    try:
        ns = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (already printed)
        return exc.code if isinstance(exc.code, int) else _EXIT_USAGE
    secrets = _url_secrets(ns.url or "")

    def report(message: str, code: int) -> int:
        print(f"jobq: {_scrub(message, secrets)}", file=sys.stderr)
        return code

    if not ns.url:
        return report("no database: pass --url or set JOBQ_URL", _EXIT_USAGE)
    engine = None
    try:
        engine = _engine_for(ns.url)
        _check_database(engine, ns.command)
        return _run_command(ns, engine, secrets)
    except BrokenPipeError:
        raise
    except _CliError as exc:
        return report(str(exc), exc.code)
    except (InvalidJob, ConfigError, argparse.ArgumentTypeError, OverflowError) as exc:
        return report(_one_line(exc), _EXIT_USAGE)
    except (JobqError, sa.exc.SQLAlchemyError) as exc:  # UnsupportedDatabase, a newer schema, driver errors
        return report(f"database error: {_one_line(getattr(exc, 'orig', None) or exc)}", _EXIT_DATABASE)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        return report(f"internal error (a bug in jobq, please report it): {type(exc).__name__}: {_one_line(exc)}",
                      _EXIT_INTERNAL)
    finally:
        if engine is not None:
            engine.dispose()


def _dashboard() -> Any:
    """The vendorable dashboard module, jobq_web.py: importable, or beside this file."""
    # Run as a script (python jobq.py), this module is __main__: jobq_web's `import jobq` must
    # find this copy, not load a second one with its own engine hooks.
    sys.modules.setdefault("jobq", sys.modules[__name__])
    try:
        return importlib.import_module("jobq_web")
    except ModuleNotFoundError as exc:
        if exc.name != "jobq_web":
            raise
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobq_web.py")
    if not os.path.exists(here):
        raise _CliError(f"serve needs the dashboard module: copy jobq_web.py (from the jobq repository, next to "
                        f"jobq.py) to {here}", _EXIT_USAGE)
    import importlib.util as import_util

    spec = import_util.spec_from_file_location("jobq_web", here)
    module = import_util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["jobq_web"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _run_command(ns: argparse.Namespace, engine: Engine, secrets: Sequence[str]) -> int:
    cmd = ns.command
    if cmd == "init":
        create_schema(engine)
        _print_json({"schema_version": SCHEMA_VERSION}) if ns.json else print("schema ready")
    elif cmd == "enqueue":
        try:
            args = json.loads(ns.args)
        except ValueError as exc:
            raise _CliError(f"--args is not valid JSON: {_one_line(exc)}", _EXIT_USAGE) from None
        if not isinstance(args, dict):
            raise _CliError(f"--args must be a JSON object, like '{{\"id\": 7}}', got {_type_name(args)}", _EXIT_USAGE)
        if ns.after:
            print("jobq: --after is deprecated, use --depends-on (the same: wait for that job to be done)", file=sys.stderr)
        when = ns.delay if ns.delay is not None else ns.run_after
        job_id = enqueue(engine, ns.type, args, group_key=ns.group, weight=ns.weight, depends_on=ns.depends_on + ns.after,
                         parent=ns.parent, container=ns.container, run_after=when, max_attempts=ns.max_attempts,
                         timeout=ns.timeout, priority=ns.priority, unique_key=ns.unique_key)
        _print_json({"id": job_id}) if ns.json else print(job_id)
    elif cmd == "status":
        while True:
            st = stats(engine)
            with engine.connect() as conn:  # running jobs that report progress (the first 20)
                running = [dict(r._mapping) for r in conn.execute(_q_running_progress(20))]
                conn.rollback()
            policies = groups(engine) if sa.inspect(engine).has_table("jobq_groups") else []
            glob = get_limit(engine)
            if ns.json:
                out = json.dumps({**st, "progress": running, "group_policy": [dataclasses.asdict(p) for p in policies],
                                  "global_limit": dataclasses.asdict(glob)},
                                 default=_json_default, sort_keys=True)
            else:
                out = _status_text(st) + "".join(
                    f"\n  job {r['id']} ({r['type']}, group {r['group_key']}): {_progress_text(r['progress'])}" for r in running)
                out += f"\n{_limit_text(glob)}" if glob.limits else ""
                out += "".join(f"\n{_policy_text(p)}" for p in policies[:50])
                out += f"\n... and {len(policies) - 50} more stored group policies (jobq groups)" if len(policies) > 50 else ""
            if not ns.watch:
                print(out)
                break
            print("\x1b[2J\x1b[H" + out, flush=True)
            time.sleep(ns.watch)
    elif cmd == "ls":
        with engine.connect() as conn:
            since = _prepare(engine).db_now(conn) - ns.since if ns.since is not None else None
            rows = [dict(r._mapping) for r in conn.execute(_q_list_jobs(
                state=ns.state, type=ns.type, group=ns.group, since=since, before=ns.before, limit=ns.limit + 1))]
            conn.rollback()
        if len(rows) > ns.limit:  # on stderr, so a pipe reading stdout gets only the rows
            rows = rows[:ns.limit]
            more = f", or raise --limit (at most {_MAX_SLOTS})" if ns.limit < _MAX_SLOTS else ""
            print(f"jobq: showing the newest {ns.limit} matching jobs, and more match: the next page is "
                  f"--before {rows[-1]['id']}{more}", file=sys.stderr)
        if ns.json:
            _print_json(rows)
        else:
            print(_table(rows, ["id", "type", "state", "group_key", "attempts", "max_attempts", "run_after",
                                "created_at", "finished_at"]))
    elif cmd == "show":
        info = get(engine, ns.id)
        if info is None:
            raise _CliError(f"no job with id {ns.id}", _EXIT_NO_SUCH_JOB)
        with engine.connect() as conn:
            dependents = list(conn.execute(_q_dependent_ids(ns.id)).scalars())
            children = list(conn.execute(_q_child_ids(ns.id)).scalars())
            conn.rollback()
        data = {**dataclasses.asdict(info), "dependents": dependents, "children": children}
        history = [dataclasses.asdict(a) for a in attempts(engine, ns.id)]
        if ns.json:
            _print_json({**data, "history": history})
        else:
            for k, v in data.items():
                print(f"{k:>17}: {_text(list(v) if isinstance(v, tuple) else v)}")
            print(f"{'history':>17}: " + ("no attempt has ended" if not history else ""))
            for a in history:
                print(f"{'':>19}attempt {a['attempt']} {a['outcome']}: {_iso(a['started_at']) or '-'} .. "
                      f"{_iso(a['finished_at'])} by {a['worker_id'] or '-'}"
                      + (f": {_one_line(a['error'])}" if a["error"] else ""))
    elif cmd == "why":
        state = _require_job(engine, ns.id)
        line = why(engine, ns.id)
        _print_json({"id": ns.id, "state": state, "why": line}) if ns.json else print(line)
    elif cmd in ("retry", "cancel"):
        _require_job(engine, ns.id)
        try:
            outcome: Any = retry(engine, ns.id, from_root=ns.root) if cmd == "retry" else cancel(engine, ns.id)
        except InvalidJob:
            _require_job(engine, ns.id)  # deleted meanwhile: still "no such job"
            raise
        if cmd == "retry":
            _print_json({"id": ns.id, "reopened": outcome}) if ns.json else print("re-opened: " + " ".join(map(str, outcome)))
        else:
            asked = outcome in _LIVE or outcome == "held"  # the job is not cancelled yet: its end is
            _print_json({"id": ns.id, "state": outcome, "cancel_requested": asked}) if ns.json else print(
                f"job {ns.id}: {_cancel_outcome(outcome)}")
    elif cmd in ("group", "groups"):
        if cmd == "groups":
            policies = groups(engine)
        elif ns.weight is None and ns.cap is None and ns.rate is None and ns.paused is None:
            found = get_group(engine, ns.key)
            if found is None:
                print(f"group {ns.key}: no stored policy (weight from its jobs, no cap, no rate limit)")
                return 0
            policies = [found]
        else:
            policies = [set_group(engine, ns.key, weight=ns.weight, max_in_flight=ns.cap, rate_limit=ns.rate,
                                  paused=ns.paused)]
        if ns.json:
            _print_json([dataclasses.asdict(p) for p in policies] if cmd == "groups" else dataclasses.asdict(policies[0]))
        else:
            for p in policies:
                print(_policy_text(p))
    elif cmd == "limit":
        if ns.clear and (ns.max_in_flight is not None or ns.rate is not None):
            raise _CliError("--clear removes both limits: give it alone", _EXIT_USAGE)
        if ns.clear:
            limit = set_limit(engine, max_in_flight=UNLIMITED, rate_limit=UNLIMITED)
        elif ns.max_in_flight is None and ns.rate is None:
            limit = get_limit(engine)
        else:
            limit = set_limit(engine, max_in_flight=ns.max_in_flight, rate_limit=ns.rate)
        _print_json(dataclasses.asdict(limit)) if ns.json else print(_limit_text(limit))
    elif cmd == "prune":
        n = prune(engine, ns.older_than, states=tuple(ns.state or ("done",)))
        _print_json({"deleted": n}) if ns.json else print(f"deleted {n} job(s)")
    elif cmd == "graph":
        if (ns.id is None) == (not ns.all):
            raise _CliError("graph needs a job id or --all (not both)", _EXIT_USAGE)
        if ns.id is not None:
            _require_job(engine, ns.id)
        with engine.connect() as conn:
            nodes, edges = _graph_data(conn, ns.id)
            conn.rollback()
        text = _graph(nodes, edges, ns.format)
        if ns.json:
            _print_json({"root": ns.id, "format": ns.format, "text": text, "edges": [list(e) for e in edges],
                         "nodes": [{"id": r.id, "type": r.type, "state": r.state, "parent_id": r.parent_id,
                                    "is_container": bool(r.is_container)} for r in nodes]})
        else:
            print(text)
    elif cmd == "serve":
        web = _dashboard()
        try:
            web.serve(engine, host=ns.host, port=ns.port, token=ns.token, hide_args=ns.hide_args)
        except OSError as exc:  # the address is taken, or not this machine's
            raise _CliError(f"cannot listen on {ns.host}:{ns.port}: {exc.strerror or _one_line(exc)}", _EXIT_USAGE) from None
    elif cmd == "worker":
        handler = logging.StreamHandler()
        handler.setFormatter(_ScrubbingFormatter("%(asctime)s %(levelname)s %(name)s %(message)s", secrets))
        logging.basicConfig(level=getattr(logging, ns.log_level.upper()), handlers=[handler])
        options: dict[str, Any] = {"start_method": ns.start_method} if ns.start_method else {}
        w = Worker(engine, _load_handlers(ns.app), max_concurrency=ns.concurrency,
                   local_concurrency=ns.local_concurrency, lease_ttl=ns.lease_ttl,
                   heartbeat_interval=ns.heartbeat, poll_interval=ns.poll, listen=ns.listen, timeout=ns.timeout,
                   shutdown_timeout=ns.shutdown_timeout, group_caps=dict(ns.cap), rate_limits=dict(ns.rate),
                   executor=ns.executor, worker_id=ns.worker_id, **options)
        logger.info("worker %s started: types %s", w.worker_id, ", ".join(sorted(w.handlers)))
        w.run()
        logger.info("worker %s stopped", w.worker_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())

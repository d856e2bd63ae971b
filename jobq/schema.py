"""The tables (jobs, job_deps, jobq_meta, the start log, the attempt history, job logs, retention
policy, the audit log) and their indexes, as SQLAlchemy metadata: what create_schema creates."""

from __future__ import annotations

import datetime as _dt
from typing import Any

import sqlalchemy as sa
from sqlalchemy import orm

from .engines import _ID, _JSONCOL, _NAME, _TEXT, _TS, _facts, _table_options, _when, _where_options

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

SCHEMA_VERSION = 7
STATES = ("waiting", "ready", "leased", "running", "done", "failed", "cancelled", "held")
TERMINAL = ("done", "failed", "cancelled")
_LIVE = ("leased", "running")



class Base(orm.DeclarativeBase):
    """Declarative base holding jobq's tables (``Base.metadata`` for Alembic autogenerate)."""


def _partial_index(name: str, *cols: Any, where: str, unique: bool = False) -> sa.Index:
    """An index of only the rows matching ``where`` (``{true}``: a true boolean as each engine
    spells it), on the engines with partial indexes. Queries must spell the predicate as the
    index does: SQLite matches partial indexes by exact terms."""
    return sa.Index(  # type: ignore[no-any-return]
        name, *cols, unique=unique, **{option: sa.text(pred) for option, pred in _where_options(where).items()},  # type: ignore[arg-type]
    ).ddl_if(callable_=_when("partial_indexes"))


def _stand_in_index(name: str, *cols: Any) -> sa.Index:
    """The stand-in for a partial index on the engines without them (MySQL/MariaDB), whose
    claim reads name their indexes (index_hints): a plain composite."""
    return sa.Index(name, *cols).ddl_if(callable_=_when("index_hints"))  # type: ignore[no-any-return]


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
    #: ``max_attempts`` was given at enqueue (schema 7): a handler's RetryPolicy then leaves it
    #: alone (Worker._own_attempts). Rows made before schema 7 read false.
    max_attempts_set: orm.Mapped[bool] = orm.mapped_column(sa.Boolean, default=False, server_default=sa.false())
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
    #: The W3C ``traceparent`` of the span that enqueued the job (schema 7), written only while
    #: trace propagation is on (jobq.propagate_trace_context); an attempt's span is its child.
    trace_parent: orm.Mapped[str | None] = orm.mapped_column(sa.String(64), nullable=True)

    __table_args__ = (
        # A container's children name it. jobq itself checks a parent under lock (enqueue and
        # submit lock it and refuse one that is missing or finished; prune keeps a container
        # while it has children), so the key is a guard against other writers only: created
        # where it costs nothing, skipped on Oracle MySQL (_parent_fk_ddl).
        sa.ForeignKeyConstraint(["parent_id"], ["jobs.id"]).ddl_if(callable_=lambda *a, **kw: _parent_fk_ddl(**kw)),
        # The claim's scan: ready rows per group, highest priority first, then oldest due.
        # Partial where the engine has partial indexes, so done and waiting rows never enter
        # it; MySQL/MariaDB lead with state instead. Keep in sync with _q_candidates,
        # _q_ready_groups and _upgrade_4_state (priority: schema 4).
        _partial_index("ix_jobs_ready", "group_key", _PRIORITY_DESC, "run_after", "id", where="state = 'ready'"),
        _stand_in_index("ix_jobs_ready_my", "state", "group_key", _PRIORITY_DESC, "run_after", "id"),
        # The claim's first question: is anything due at all? The ready index, ordered by
        # priority before run_after, cannot answer it without walking every job scheduled for
        # later; this one answers it from its first entry, so a tick with nothing due reads
        # none of them. Its predicate has a term (always true) that only the due check names,
        # so the planners cannot take it for the claim's reads (in a backlog, a read of one
        # group through it would visit every due job); MySQL/MariaDB's claim reads name their
        # index (d.ready_index_hint). Keep in sync with _q_any_due and _add_due_index.
        _partial_index("ix_jobs_due", "run_after", where=_DUE_WHERE),
        _stand_in_index("ix_jobs_due_my", "state", "run_after"),
        # Cap accounting and reclaim read only in-flight rows. lease_expires is deliberately not
        # indexed: heartbeats rewrite it, and an indexed column would defeat PostgreSQL HOT.
        # The predicate is spelled exactly as the queries render `in_flight == true()`, so the
        # planners can prove the index applies (SQLite cannot match "in_flight" to "in_flight = 1").
        _partial_index("ix_jobs_in_flight", "group_key", where="in_flight = {true}"),
        _stand_in_index("ix_jobs_in_flight_my", "in_flight", "group_key"),
        # Children by their container. Partial where possible (it replaces a full index in upgrade
        # step 5: _rekey_parent_index): most jobs have no parent, and on PostgreSQL every claim and every
        # finish of such a job wrote an index entry for its NULL (a state change is no HOT update).
        # Every query names a parent (``parent_id = x`` or ``IN``), which the planners prove
        # implies the predicate. MySQL/MariaDB's index moves only when parent_id does.
        _partial_index("ix_jobs_children", "parent_id", where="parent_id IS NOT NULL"),
        _stand_in_index("ix_jobs_parent", "parent_id"),
        # Retention's scan (prune): finished rows by age. Partial where possible, so the hot
        # transitions between ready, leased and running never touch it (schema 2; a full
        # (state, finished_at) index took a new entry on every claim and lured PostgreSQL's
        # planner into walking its dead entries). Keep in sync with prune. MySQL/MariaDB index
        # finished_at alone (NULL until a job finishes), so a claim's state change moves no
        # entry of it; _rekey_mysql_indexes replaces the (state, finished_at) index of before.
        _partial_index("ix_jobs_finished", "finished_at", where="state IN ('done', 'failed', 'cancelled')"),
        _stand_in_index("ix_jobs_finished_my", "finished_at"),
        # stats() counts blocked jobs through this (schema 2); on MySQL/MariaDB the state index.
        _partial_index("ix_jobs_waiting", "group_key", where="state = 'waiting'"),
        # Unique jobs (schema 4): one unfinished job per unique_key, enforced by the database so
        # that concurrent enqueuers cannot both insert. Keep the predicate in sync with
        # _UNIQUE_LIVE_WHERE (the insert's ON CONFLICT names it). MySQL/MariaDB: _DDL_UNIQUE_LIVE.
        _partial_index("ux_jobs_unique_live", "unique_key", where=_UNIQUE_LIVE_WHERE, unique=True),
        # Held spawns by their spawner (schema 4): release, discard and reclaim find them here;
        # released rows leave the partial index. Keep in sync with _q_held_spawns. MySQL/MariaDB:
        # spawned_by alone (it never changes), so state changes move no entry of it.
        _partial_index("ix_jobs_held", "spawned_by", where="state = 'held'"),
        _stand_in_index("ix_jobs_held_my", "spawned_by"),
        # Ids are never handed out twice (schema 3): without AUTOINCREMENT SQLite gives a new
        # row the largest id + 1, so pruning the newest jobs reused their ids, and a later
        # depends_on=[old_id] waited on a stranger. _upgrade rebuilds older SQLite tables.
        _table_options(never_reuse_ids=True),
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
        _table_options(),
    )


_meta = sa.Table(
    "jobq_meta",
    Base.metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.String(200), nullable=False),
    **_table_options(),
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
    **_table_options(),
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
    **_table_options(),
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
    **_table_options(),
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
    **_table_options(),
)

# Signals (schema 6): one row per key. ``sent_at`` is NULL while the key is only awaited: a
# waiter inserts the row so that it and signal() lock the same row, whichever comes first
# (see waits._lock_key). The first signal of a key is kept: every waiter reads its payload.
_signals = sa.Table(
    "jobq_signals",
    Base.metadata,
    sa.Column("key", _NAME, primary_key=True),
    sa.Column("payload", _JSONCOL, nullable=True),
    sa.Column("sent_at", _TS, nullable=True),
    sa.Column("created_at", _TS, nullable=False),
    **_table_options(),
)

# What a job's handler waited for (schema 6), kept for the job's life so that a re-run from
# the top finds its earlier waits: one row per (job, kind, name). kind "signal": name is the
# key, ``waiting`` true while the job is suspended on it, ``until`` the timeout, ``resolved``
# "timeout" once ctx.wait_for raised WaitTimeout (later re-runs raise it again). kind "sleep":
# a relative ctx.sleep by its name, ``until`` its end. kind "snooze" (name ""): ``n`` counts
# the job's snoozes. Written only by the lease holder's fenced transactions and by signal().
_waits = sa.Table(
    "jobq_waits",
    Base.metadata,
    sa.Column("job_id", _ID, primary_key=True),
    sa.Column("kind", sa.String(16), primary_key=True),
    sa.Column("name", _NAME, primary_key=True),
    sa.Column("waiting", sa.Boolean, nullable=False),
    sa.Column("since", _TS, nullable=False),
    sa.Column("until", _TS, nullable=True),
    sa.Column("resolved", sa.String(16), nullable=True),
    sa.Column("n", sa.Integer, nullable=False, server_default="0"),
    sa.Index("ix_jobq_waits_key", "kind", "name", "waiting"),
    **_table_options(),
)

# Recurring jobs (schema 7): one row per schedule, by name (jobq.schedule). A slot is enqueued
# by the transaction that advances next_run_at fenced on ``revision``, which every change
# (schedule, pause, resume, a firing) increments: two firings of one slot cannot both commit.
# every_us: the interval in microseconds (slots are anchor + k * every); cron: a cron
# expression in UTC (croniter). The job columns are enqueue's keywords, checked as enqueue's.
_schedules = sa.Table(
    "jobq_schedules",
    Base.metadata,
    sa.Column("name", _NAME, primary_key=True),
    sa.Column("type", _NAME, nullable=False),
    sa.Column("args", _JSONCOL, nullable=False),
    sa.Column("every_us", sa.BigInteger, nullable=True),
    sa.Column("cron", sa.String(200), nullable=True),
    sa.Column("anchor", _TS, nullable=False),
    sa.Column("group_key", _NAME, nullable=False),
    sa.Column("weight", sa.Integer, nullable=False),
    sa.Column("priority", sa.Integer, nullable=False),
    sa.Column("max_attempts", sa.Integer, nullable=True),  # NULL: not given (a RetryPolicy may set it)
    sa.Column("timeout", sa.Float, nullable=True),
    sa.Column("unique_key", _NAME, nullable=True),
    sa.Column("paused", sa.Boolean, nullable=False),
    sa.Column("next_run_at", _TS, nullable=False),
    sa.Column("last_slot", _TS, nullable=True),
    sa.Column("last_job_id", _ID, nullable=True),
    sa.Column("runs", sa.BigInteger, nullable=False),
    sa.Column("revision", sa.BigInteger, nullable=False),
    sa.Column("created_at", _TS, nullable=False),
    sa.Column("updated_at", _TS, nullable=False),
    # The workers' due check (_q_due_schedules): an empty range when nothing is due.
    sa.Index("ix_jobq_schedules_due", "paused", "next_run_at"),
    **_table_options(),
)

# A handler's log lines (ctx.log, schema 7): one row per line, numbered per job (``seq`` from 1)
# across its attempts. Written in a short transaction of its own that locks no job row (the
# claim never reads this table); at most LOG_LINES_PER_JOB per job. Deleted with the job by
# prune; no foreign key, as jobq_attempts.
_logs = sa.Table(
    "jobq_logs",
    Base.metadata,
    sa.Column("job_id", _ID, primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("at", _TS, nullable=False),
    sa.Column("message", _TEXT, nullable=False),
    sa.Column("fields", _JSONCOL, nullable=True),
    **_table_options(),
)

# Retention policy (schema 7): how long finished jobs are kept, in seconds per terminal state
# (NULL: kept until pruned by hand). One row per scope: "" for every group, else a group key
# whose row overrides the global one for the states it sets. Applied by the workers
# (ops.apply_retention), one at a time through the jobq_meta row _RETENTION_DUE_KEY.
_retention = sa.Table(
    "jobq_retention",
    Base.metadata,
    sa.Column("scope", _NAME, primary_key=True),
    sa.Column("done_s", sa.Float, nullable=True),
    sa.Column("failed_s", sa.Float, nullable=True),
    sa.Column("cancelled_s", sa.Float, nullable=True),
    sa.Column("updated_at", _TS, nullable=False),
    **_table_options(),
)

# The audit log of bulk actions (schema 7): who did what to which filter, and how many jobs
# it touched. Written once per action, after its last batch.
_audit = sa.Table(
    "jobq_audit",
    Base.metadata,
    sa.Column("id", _ID, primary_key=True, autoincrement=True),
    sa.Column("at", _TS, nullable=False),
    sa.Column("actor", sa.String(200), nullable=False),
    sa.Column("action", sa.String(16), nullable=False),
    sa.Column("filter", _JSONCOL, nullable=False),
    sa.Column("count", sa.Integer, nullable=False),
    sa.Index("ix_jobq_audit_at", "at"),
    **_table_options(),
)

#: Most log lines one job keeps (ctx.log): later lines are refused (ctx.log returns False).
LOG_LINES_PER_JOB = 1000
#: Most characters of one log line's message; a longer one is cut to this length.
LOG_MESSAGE_CHARS = 2000
#: Most bytes of one log line's fields, as JSON.
LOG_FIELDS_BYTES = 4096

#: run_after of a job that waits for a signal with no timeout (waits.py): only the signal makes
#: it due. stats() leaves it out of ``next_scheduled``.
_NEVER = _dt.datetime(9999, 12, 30)

#: How an attempt ended, as :func:`attempts` reports it: ``done``; ``failed`` (the handler
#: raised or its result was refused); ``timeout`` (the dispatch timeout fired); ``reclaimed``
#: (its lease expired: the worker died, stalled or lost the database); ``released`` (given
#: back unfinished at shutdown, not charged); ``cancelled`` (cancelled while it ran);
#: ``suspended`` (the handler waits for a signal or sleeps, not charged); ``snoozed`` (the
#: handler raised :class:`Snooze`, not charged).
ATTEMPT_OUTCOMES = ("done", "failed", "timeout", "reclaimed", "released", "cancelled", "suspended", "snoozed")

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
    sa.event.listen(_jobs, "after_create", _ddl.execute_if(callable_=_when("generated_live_key")))

#: The jobq_meta row every capped claim locks: the cap's serialisation point.
_CLAIM_LOCK_KEY = "claim_lock"
#: The jobq_meta row holding the global limits (set_limit), as JSON; "" until first set. It
#: sorts after claim_lock: every statement that locks both locks them in key order.
_GLOBAL_LIMITS_KEY = "global_limits"
#: The jobq_meta row naming when retention is next due (ISO 8601, naive UTC): the worker whose
#: update moves it forward applies the policy for that round, no other.
_RETENTION_DUE_KEY = "retention_due"


def _parent_fk_ddl(*, dialect: sa.Dialect, **kw: Any) -> bool:
    """Whether create_schema creates jobs.parent_id's foreign key on this dialect (_Dialect.parent_fk)."""
    return _facts(dialect).parent_fk

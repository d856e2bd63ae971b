"""Every statement jobq runs but the claim's, as named builders: the ready set, get/why/stats,
insert, settle, spawn, finalize, heartbeat, reclaim, prune (the claim's own statements sit next
to the claim, in claim_sql.py)."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as _pg

from .schema import (
    _CLAIM_LOCK_KEY,
    _GLOBAL_LIMITS_KEY,
    _ID,
    _JSONCOL,
    _LIVE,
    _NAME,
    _NEVER,
    _TEXT,
    _TS,
    TERMINAL,
    _attempts,
    _audit,
    _c,
    _deps,
    _groups,
    _jobs,
    _logs,
    _meta,
    _retention,
    _schedules,
    _signals,
    _slots,
    _starts,
    _waits,
)

if TYPE_CHECKING:
    from .drivers import _T, _Dialect


# The only place jobq writes SQL (with claim_sql.py). Each builder returns a statement; callers bind `now` so that
# tests own the clock. State predicates are rendered as literals so PostgreSQL can match the
# partial indexes even under generic plans.
#
# Builders take the `_Dialect` of the next section: a forward reach in annotations only (they
# are postponed, `from __future__ import annotations`), and at run time only its capability
# methods (lock_skip, array_params), which exist by the time any builder is called. Statements
# that differ by engine in more than a lock clause live in the dialect section instead.


# ---- the ready set, and the pieces the statement modules share --------------------------------


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


def _q_due_weights(now: _dt.datetime) -> sa.Select[Any]:
    """Per group with due ready jobs, the largest weight among them: one read of the ready
    index, whatever the number of groups (the dashboard's weight column; a UNION of one term
    per group breaks past SQLite's 500 terms and takes seconds at thousands)."""
    return (sa.select(_c.group_key, sa.func.max(_c.weight))
            .where(_state_is("ready"), _c.run_after <= now).group_by(_c.group_key))


_STATEMENTS: dict[tuple[str, str], Any] = {}


def _prebuilt(d: _Dialect, name: str, build: Callable[[], _T]) -> _T:
    """A hot-path statement built once per dialect family: executing a prebuilt statement with
    bound parameters skips SQLAlchemy's per-call construction (and reuses its compiled form)."""
    key = (d.statement_key, name)
    stmt = _STATEMENTS.get(key)
    if stmt is None:
        stmt = _STATEMENTS[key] = build()
    return stmt  # type: ignore[no-any-return]


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


# ---- builders for get, why, stats and the command line


def _q_job(job_id: int) -> sa.Select[Any]:
    """Every column of one job (get, why)."""
    return sa.select(_jobs).where(_c.id == job_id)


def _q_job_state(job_id: int) -> sa.Select[Any]:
    return sa.select(_c.state).where(_c.id == job_id)


def _q_upstream_ids(job_id: int) -> sa.Select[Any]:
    return sa.select(_deps.c.depends_on_id).where(_deps.c.job_id == job_id).order_by(_deps.c.depends_on_id)


def _q_upstream_results(job_id: int) -> sa.Select[Any]:
    """The direct upstreams of ``job_id`` with their results (ctx.upstream, read when a handler
    first asks). A job runs only once every upstream is done, so each holds its final result."""
    return (sa.select(_c.id, _c.result).join(_deps, _deps.c.depends_on_id == _c.id)
            .where(_deps.c.job_id == job_id).order_by(_c.id))


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
    """The ``run_after`` of the oldest due ready job and of the next scheduled one (not a job
    waiting for a signal with no timeout: it has no time)."""
    return sa.select(
        sa.func.min(sa.case((_c.run_after <= now, _c.run_after)), type_=_TS),
        sa.func.min(sa.case((sa.and_(_c.run_after > now, _c.run_after < _NEVER), _c.run_after)), type_=_TS),
    ).where(_state_is("ready"))


def _q_awaiting_signal() -> sa.Select[Any]:
    # stats: ready jobs suspended on a signal (jobq_waits rows still waiting; a job cancelled
    # meanwhile keeps its row, so the job's state is checked).
    return (sa.select(sa.func.count(sa.distinct(_waits.c.job_id))).select_from(_waits.join(_jobs, _c.id == _waits.c.job_id))
            .where(_waits.c.kind == "signal", _waits.c.waiting == _TRUE, _state_is("ready")))


def _q_suspended_count(now: _dt.datetime) -> sa.Select[Any]:
    # stats: ready jobs not yet due whose newest attempt ended suspended or snoozed (waits.py),
    # as why() tells them; through the ready index and ix_jobq_attempts_job (job_id, id).
    a, newest = _attempts.c, _attempts.alias("newest").c
    last = sa.select(sa.func.max(newest.id)).where(newest.job_id == _c.id).correlate(_jobs).scalar_subquery()
    return sa.select(sa.func.count()).where(_state_is("ready"), _c.run_after > now, sa.exists().where(
        a.job_id == _c.id, a.id == last, a.outcome.in_(("suspended", "snoozed"))).correlate(_jobs))


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


def _q_type_finishes(since: _dt.datetime, limit: int) -> sa.Select[Any]:
    """The newest jobs finished since ``since``, at most ``limit``, newest first: type, final
    state, last start and finish (the dashboard's per-type page). One range read of
    ix_jobs_finished, backwards from now and stopped at ``limit``: its cost is capped whatever
    the history or the window's traffic."""
    return (sa.select(_c.type, _c.state, _c.started_at, _c.finished_at)
            .where(_state_is(*TERMINAL), _c.finished_at >= since)
            .order_by(_c.finished_at.desc()).limit(limit))


def _q_live_by_type() -> sa.CompoundSelect[Any]:
    """Per type and state: the ready jobs (through the ready index) and the jobs in flight
    (ix_jobs_in_flight); their cost follows the live rows, never the history."""
    cols = (_c.type, _c.state, sa.func.count())
    return sa.union_all(sa.select(*cols).where(_state_is("ready")).group_by(_c.type, _c.state),
                        sa.select(*cols).where(_c.in_flight == _TRUE).group_by(_c.type, _c.state))


def _q_count_by_state() -> sa.Select[Any]:
    """Every job per state: a full scan (stats(totals=True) only)."""
    return sa.select(_c.state, sa.func.count()).group_by(_c.state)


def _q_schema_version() -> sa.Select[Any]:
    return sa.select(_meta.c.value).where(_meta.c.key == "schema_version")


def _q_list_jobs(*, state: str | Sequence[str] | None, type: str | None, group: str | None,
                 since: _dt.datetime | None, limit: int, until: _dt.datetime | None = None,
                 before: int | None = None, after: int | None = None) -> sa.Select[Any]:
    """`jobq ls` and the dashboard's job list: the newest jobs first, filtered (``state``: one
    state, or any of several); ``before`` (an id) pages backwards by key, so a page costs the
    same however deep it is; ``after`` (an id) pages forwards: the oldest jobs above it first."""
    stmt = sa.select(_c.id, _c.type, _c.state, _c.group_key, _c.attempts, _c.max_attempts, _c.run_after,
                     _c.created_at, _c.finished_at)
    if until is not None:
        stmt = stmt.where(_c.created_at < until)
    if before is not None:
        stmt = stmt.where(_c.id < before)
    if after is not None:
        stmt = stmt.where(_c.id > after)
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
    return stmt.order_by(_c.id.asc() if after is not None else _c.id.desc()).limit(limit)


def _q_list_details(ids: Sequence[int]) -> sa.Select[Any]:
    """The dashboard's job list: the columns it shows beside `_q_list_jobs`'s (priority, the
    last error, when the last attempt started, progress) for one page of ids."""
    return sa.select(_c.id, _c.priority, _c.error, _c.started_at, _c.progress).where(_c.id.in_(list(ids)))


def _q_count_listed(*, state: str | None, type: str | None, group: str | None, since: _dt.datetime | None,
                    until: _dt.datetime | None, cap: int) -> sa.Select[Any]:
    """How many jobs `_q_list_jobs` with these filters lists, counting at most ``cap`` + 1 (a
    page's total costs a bounded read however large the table)."""
    listed = _q_list_jobs(state=state, type=type, group=group, since=since, until=until, limit=cap + 1)
    return sa.select(sa.func.count()).select_from(listed.with_only_columns(_c.id).subquery())


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


# The claim_lock row's value without the lock (why).
_Q_CLAIM_LOCK_VALUE = sa.select(_meta.c.value).where(_meta.c.key == _CLAIM_LOCK_KEY)
_Q_GLOBAL_LIMITS = sa.select(_meta.c.value).where(_meta.c.key == _GLOBAL_LIMITS_KEY)
_Q_SET_GLOBAL_LIMITS = (
    sa.update(_meta).where(_meta.c.key == _GLOBAL_LIMITS_KEY).values(value=sa.bindparam("b_value", type_=sa.String(200)))
)
_Q_SET_CLAIM_LOCK_VALUE = (
    sa.update(_meta).where(_meta.c.key == _CLAIM_LOCK_KEY).values(value=sa.bindparam("b_value", type_=sa.String(200)))
)


#: PostgreSQL's planner settings for the rest of a claim's transaction (_Dialect.pin_index_plans).
_PIN_SETTINGS = (sa.func.set_config("enable_seqscan", "off", sa.true()), sa.func.set_config("enable_bitmapscan", "off", sa.true()),
                 sa.func.set_config("jit", "off", sa.true()))
_Q_PIN_PLANS = sa.select(*_PIN_SETTINGS)


# ---- finalize / fail / release ----------------------------------------------------------------


@dataclasses.dataclass(slots=True)  # not frozen: built per finished job, and frozen costs 1.6 us each
class _Outcome:
    """What one dispatch reports for its job, written by _apply_outcomes (queue API) through
    the builders below."""

    job_id: int
    owner: str | None
    token: str | None
    kind: str  # "done" | "retry" | "failed" | "release" | "suspend"
    result: Any = None
    error: str | None = None
    delay: float = 0.0  # seconds before a retry may run
    parent_id: int | None = -1  # the job's container if the caller knows it (-1: look it up)
    ended: str | None = None  # the attempt's outcome in its history when a failure is more specific ("timeout")
    spawned: bool = False  # the dispatch may have held spawns: release them with "done", else discard
    wait: Any = None  # "suspend": the base._Suspension the handler asked for


def _fence(job_id: int, owner: str | None, token: str | None, *, cancelled: bool = False) -> list[sa.ColumnElement[bool]]:
    cond = [_c.id == job_id, _state_is(*_LIVE), _c.cancel_requested == (sa.true() if cancelled else sa.false())]
    if owner is not None:
        cond.append(_c.lease_owner == owner)
    if token is not None:
        cond.append(_c.lease_token == token)
    return cond


_CLEAR_LEASE = {"lease_owner": None, "lease_expires": None, "in_flight": False}
#: The columns a history row is written with, in the order the builders select them.
_ATTEMPT_COLS = ("job_id", "attempt", "worker_id", "started_at", "finished_at", "outcome", "error")


def _done_rows(src: Any) -> sa.Select[Any]:
    """History rows (_ATTEMPT_COLS) of attempts one worker (``b_worker``) finished at ``b_now``,
    outcome done, no error, from ``src``'s id, attempts and started_at: the jobs rows
    (_q_record_done) or the finishing UPDATE's RETURNING (_q_finish_recorded)."""
    return sa.select(src.c.id, src.c.attempts, sa.bindparam("b_worker", type_=sa.String(200)), src.c.started_at,
                     sa.bindparam("b_now", type_=_TS), sa.literal("done", sa.String(16)), sa.null())


def _q_finish(d: _Dialect, outcomes: Sequence[_Outcome], owner: str | None, token: str | None,
              now: _dt.datetime) -> sa.Update:
    """Finish these jobs of one holder (``owner``, ``token``: None leaves that fence out) in one
    statement, each row with its own result (a CASE on the id when there are several). One round
    trip on every driver (an executemany is one round trip per row on PyMySQL). lease_token
    stays on the rows: a finalize retried after an ambiguous COMMIT recognises its own earlier
    success by it (_q_done_under)."""
    result: Any = outcomes[0].result
    if len(outcomes) > 1:
        result = sa.case({o.job_id: sa.literal(o.result, _JSONCOL) for o in outcomes}, value=_c.id)
    fence = [_state_is(*_LIVE), _c.cancel_requested == sa.false()]
    fence += [] if owner is None else [_c.lease_owner == owner]
    fence += [] if token is None else [_c.lease_token == token]
    return (
        _update_jobs().where(_id_in(d, _c.id, [o.job_id for o in outcomes]), *fence)
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
    """_q_finish for a batch of one lease, with its parameters. When every row gets the same
    result (no-op handlers: all None) the statement is _q_finish_batch_same, prebuilt, so a tick
    pays no statement construction for its finalize; tests/core/test_statement_forms.py checks
    that the two write the same rows."""
    ids = [o.job_id for o in outcomes]
    first = outcomes[0].result
    if all(o.result is None for o in outcomes) or len({json.dumps(o.result, sort_keys=True) for o in outcomes}) == 1:
        return _q_finish_batch_same(d), {"b_ids": ids, "b_owner": owner, "b_token": token, "b_result": first,
                                         "b_now": now}
    return _q_finish(d, outcomes, owner, token, now), None


def _q_finish_batch_same(d: _Dialect) -> sa.Update:
    # _q_finish with one result for every row, its values bound (test_statement_forms).
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
    plus ``b_worker``: one row, the rows finished (test_statement_forms: the same rows as the two).

    The dependents' count is not in it: a statement reads with one snapshot, taken before its
    UPDATE waits for an enqueue's share lock on a finishing job, so it missed the dependency
    row that enqueue committed, and the dependent waited forever (_settle counts them in a
    statement of its own, after this one)."""
    def build() -> sa.Select[Any]:
        fin = _q_finish_batch_same(d).returning(_c.id, _c.attempts, _c.started_at).cte("fin")
        rec = sa.insert(_attempts).from_select(_ATTEMPT_COLS, _done_rows(fin)).returning(_attempts.c.job_id).cte("rec")
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
    """_q_record_ended, with its parameters: a batch of one worker's finishes (every tick of a
    busy worker) takes _q_record_done, prebuilt (test_statement_forms: the same rows)."""
    workers = {w for _i, _o, w in ended}
    if len(workers) == 1 and all(o == "done" for _i, o, _w in ended):
        return _q_record_done(d), {"b_ids": [i for i, _o, _w in ended], "b_worker": next(iter(workers)), "b_now": now}
    return _q_record_ended(d, ended, now), None


#: History outcomes of attempts the claim counted and the write gave back (not charged).
_GIVEN_BACK = ("released", "suspended", "snoozed")


def _q_record_ended(d: _Dialect, ended: Sequence[tuple[int, str, str | None]], now: _dt.datetime) -> sa.Insert:
    """One history row per attempt just ended by this transaction's fenced writes, (job id,
    outcome, worker id) each, as one INSERT ... SELECT: the attempt number, start and error
    come from the job rows, which this transaction has just written and still holds. It reads
    what the finalize/fail/release builders wrote: done clears ``error`` (so none is copied),
    release gives the attempt back (so its number is one more than the row's), and a release
    leaves the previous attempt's error on the row (not this attempt's)."""
    def per_row(values: Mapping[int, Any], type_: Any) -> Any:
        if len(set(values.values())) == 1:
            return sa.literal(next(iter(values.values())), type_)
        return sa.case({i: sa.literal(v, type_) for i, v in values.items()}, value=_c.id)

    released = [i for i, o, _w in ended if o in _GIVEN_BACK]
    silent = [i for i, o, _w in ended if o in ("done", *_GIVEN_BACK)]
    attempt: Any = _c.attempts if not released else sa.case((_c.id.in_(released), _c.attempts + 1), else_=_c.attempts)
    error: Any = _c.error if not silent else sa.case((_c.id.in_(silent), sa.null()), else_=_c.error)
    rows = sa.select(_c.id, attempt, per_row({i: w for i, _o, w in ended}, sa.String(200)), _c.started_at,
                     sa.literal(now, _TS), per_row({i: o for i, o, _w in ended}, sa.String(16)), error
                     ).where(_id_in(d, _c.id, [i for i, _o, _w in ended]))
    return sa.insert(_attempts).from_select(_ATTEMPT_COLS, rows)


def _q_record_done(d: _Dialect) -> sa.Insert:
    # _q_record_ended for finishes by one worker (outcome done, no error), its values bound.
    return _prebuilt(d, "record_done", lambda: sa.insert(_attempts).from_select(_ATTEMPT_COLS, _done_rows(_jobs).where(
        _id_in(d, _c.id, sa.bindparam("b_ids", type_=_pg.ARRAY(sa.BigInteger))))))


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


def _q_attempts_unset(ids: list[int]) -> sa.Select[Any]:
    # Worker._own_attempts: which of these jobs were enqueued without a max_attempts of their own.
    return sa.select(_c.id).where(_c.id.in_(ids), _c.max_attempts_set == sa.false())


def _q_set_max_attempts(ids: list[int], token: str, n: int) -> sa.Update:
    # In the claim's transaction, on rows it just leased under ``token`` (Worker._own_attempts).
    return _update_jobs().where(_c.id.in_(ids), _c.lease_token == token).values(max_attempts=n)


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
    return sa.insert(_attempts).from_select(_ATTEMPT_COLS, rows)


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


def _prunable(states: Sequence[str], cutoff: _dt.datetime,
              extra: Sequence[sa.ColumnElement[bool]] = ()) -> list[sa.ColumnElement[bool]]:
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
        *extra,
    ]


def _q_prunable(states: Sequence[str], cutoff: _dt.datetime, batch: int,
                extra: Sequence[sa.ColumnElement[bool]] = ()) -> sa.Select[Any]:
    """A batch of prunable jobs, oldest first, without locks. Found through ix_jobs_finished
    (keep in sync). ``extra``: more terms (retention's groups, a bulk filter)."""
    return sa.select(_c.id).where(*_prunable(states, cutoff, extra)).order_by(_c.finished_at).limit(batch)


def _group_terms(only: Sequence[str] | None, besides: Sequence[str]) -> list[sa.ColumnElement[bool]]:
    """Retention's groups: those in ``only`` (None: any), less those in ``besides``."""
    terms: list[sa.ColumnElement[bool]] = []
    if only is not None:
        terms.append(_c.group_key.in_(only))
    if besides:
        terms.append(_c.group_key.not_in(besides))
    return terms


def _q_lock_prunable(d: _Dialect, ids: Sequence[int], states: Sequence[str], cutoff: _dt.datetime,
                     extra: Sequence[sa.ColumnElement[bool]] = ()) -> sa.Select[Any]:
    """The jobs of a batch _q_prunable read that are still prunable, locked in id order until
    they are deleted: a retry that re-opened one after the read (and committed) is seen here
    (a locking read sees the latest committed row, at READ COMMITTED on every server), and one
    that comes later waits for the delete and finds no job."""
    return d.lock_wait(sa.select(_c.id).where(_c.id.in_(ids), *_prunable(states, cutoff, extra)).order_by(_c.id))


def _q_delete_edges(ids: Sequence[int]) -> sa.Delete:
    return sa.delete(_deps).where(sa.or_(_deps.c.job_id.in_(ids), _deps.c.depends_on_id.in_(ids)))


def _q_delete_attempts(ids: Sequence[int]) -> sa.Delete:
    return sa.delete(_attempts).where(_attempts.c.job_id.in_(ids))


def _q_delete_jobs(ids: Sequence[int]) -> sa.Delete:
    return sa.delete(_jobs).where(_c.id.in_(ids))


def _q_delete_logs(ids: Sequence[int]) -> sa.Delete:
    return sa.delete(_logs).where(_logs.c.job_id.in_(ids))


# ---- job logs, retention, bulk actions, audit (ops.py) -----------------------------------------


def _q_last_log_seq(job_id: int) -> sa.Select[Any]:
    """The job's last log line number (None before its first): read through the primary key."""
    return sa.select(sa.func.max(_logs.c.seq)).where(_logs.c.job_id == job_id)


def _q_insert_log(job_id: int, seq: int, attempt: int, at: _dt.datetime, message: str, fields: Any) -> sa.Insert:
    return sa.insert(_logs).values(job_id=job_id, seq=seq, attempt=attempt, at=at, message=message, fields=fields)


def _q_logs(job_id: int, after: int, limit: int) -> sa.Select[Any]:
    lc = _logs.c
    return (sa.select(lc.seq, lc.attempt, lc.at, lc.message, lc.fields)
            .where(lc.job_id == job_id, lc.seq > after).order_by(lc.seq).limit(limit))


def _q_retention_rows() -> sa.Select[Any]:
    rc = _retention.c
    return sa.select(rc.scope, rc.done_s, rc.failed_s, rc.cancelled_s, rc.updated_at).order_by(rc.scope)


def _q_retention_row(scope: str) -> sa.Select[Any]:
    rc = _retention.c
    return sa.select(rc.scope, rc.done_s, rc.failed_s, rc.cancelled_s, rc.updated_at).where(rc.scope == scope)


def _q_insert_retention(scope: str, values: Mapping[str, Any]) -> sa.Insert:
    return sa.insert(_retention).values(scope=scope, **values)


def _q_update_retention(scope: str, values: Mapping[str, Any]) -> sa.Update:
    return sa.update(_retention).where(_retention.c.scope == scope).values(**values)


def _q_delete_retention(scope: str) -> sa.Delete:
    return sa.delete(_retention).where(_retention.c.scope == scope)


def _q_take_meta_turn(key: str, now: str, until: str) -> sa.Update:
    """Move a jobq_meta row holding a time (ISO text) to ``until`` if it is not after ``now``:
    the one transaction whose update counts a row has the turn. ISO times of one format sort
    as text."""
    return sa.update(_meta).where(_meta.c.key == key, _meta.c.value <= now).values(value=until)


def _q_meta_value(key: str) -> sa.Select[Any]:
    return sa.select(_meta.c.value).where(_meta.c.key == key)


def _q_insert_meta(key: str, value: str) -> sa.Insert:
    return sa.insert(_meta).values(key=key, value=value)


def _filter_terms(f: Any) -> list[sa.ColumnElement[bool]]:
    """A bulk filter (ops.JobFilter) as WHERE terms on jobs."""
    terms: list[sa.ColumnElement[bool]] = [_state_is(*f.states)]
    if f.type is not None:
        terms.append(_c.type == f.type)
    if f.group is not None:
        terms.append(_c.group_key == f.group)
    if f.since is not None:
        terms.append(_c.created_at >= f.since)
    if f.until is not None:
        terms.append(_c.created_at < f.until)
    if f.error is not None:
        # Case-insensitive (ASCII letters at least) on every engine: SQLite's LIKE folds case
        # and the others' does not. '/' escapes: a backslash means something else in MySQL.
        pattern = "%" + f.error.lower().replace("/", "//").replace("%", "/%").replace("_", "/_") + "%"
        terms.append(sa.func.lower(_c.error).like(pattern, escape="/"))
    return terms


def _q_filter_ids(f: Any, after: int, batch: int) -> sa.Select[Any]:
    """The next ``batch`` ids matching a bulk filter, in id order after ``after``; no locks."""
    return sa.select(_c.id).where(_c.id > after, *_filter_terms(f)).order_by(_c.id).limit(batch)


def _q_filter_count(f: Any) -> sa.Select[Any]:
    return sa.select(sa.func.count()).select_from(_jobs).where(*_filter_terms(f))


def _q_insert_audit(at: _dt.datetime, actor: str, action: str, filter: Any, count: int) -> sa.Insert:
    return sa.insert(_audit).values(at=at, actor=actor, action=action, filter=filter, count=count)


def _q_audit(limit: int) -> sa.Select[Any]:
    ac = _audit.c
    return sa.select(ac.id, ac.at, ac.actor, ac.action, ac.filter, ac.count).order_by(ac.id.desc()).limit(limit)


# ---- signals and waits (waits.py) ------------------------------------------------------------

_sg = _signals.c
_wc = _waits.c


def _q_signal(key: str) -> sa.Select[Any]:
    return sa.select(_sg.payload, _sg.sent_at).where(_sg.key == key)


def _q_insert_signal() -> sa.Insert:
    return sa.insert(_signals)


def _q_lock_signal(d: _Dialect, key: str) -> sa.Select[Any]:
    # The key's row, locked: a waiter's suspension and signal() of one key serialise on it.
    stmt = _q_signal(key)
    return stmt.with_for_update() if d.row_locks else stmt


def _q_send_signal(key: str, payload: Any, now: _dt.datetime) -> sa.Update:
    # Only the first signal of a key is kept (an awaited-only row has sent_at NULL).
    return sa.update(_signals).where(_sg.key == key, _sg.sent_at.is_(None)).values(payload=payload, sent_at=now)


def _q_waiters(key: str) -> sa.Select[Any]:
    return sa.select(_wc.job_id).where(_wc.kind == "signal", _wc.name == key, _wc.waiting == _TRUE).order_by(_wc.job_id)


def _q_wake(ids: Sequence[int], now: _dt.datetime) -> sa.Update:
    # A suspended job is ready and not yet due; a signal makes it due now (never later).
    return (_update_jobs().where(_c.id.in_(ids), _state_is("ready"), _c.run_after > now)
            .values(run_after=now, updated_at=now))


def _q_stop_waiting(key: str) -> sa.Update:
    return sa.update(_waits).where(_wc.kind == "signal", _wc.name == key, _wc.waiting == _TRUE).values(waiting=False)


def _q_wait_row(job_id: int, kind: str, name: str) -> sa.Select[Any]:
    return sa.select(_wc.waiting, _wc.since, _wc.until, _wc.resolved, _wc.n).where(
        _wc.job_id == job_id, _wc.kind == kind, _wc.name == name)


def _q_signal_waits(job_id: int) -> sa.Select[Any]:
    # why: the signal a suspended job waits for.
    return sa.select(_wc.name, _wc.since, _wc.until).where(_wc.job_id == job_id, _wc.kind == "signal",
                                                            _wc.waiting == _TRUE).order_by(_wc.since).limit(1)


def _q_insert_wait() -> sa.Insert:
    return sa.insert(_waits)


def _q_update_wait(job_id: int, kind: str, name: str, values: Mapping[str, Any]) -> sa.Update:
    return sa.update(_waits).where(_wc.job_id == job_id, _wc.kind == kind, _wc.name == name).values(**values)


def _q_suspend(job_id: int, owner: str | None, token: str | None, run_after: _dt.datetime, now: _dt.datetime
               ) -> sa.Update:
    # As _q_release (the attempt the claim counted is given back), due at ``run_after``.
    return (
        _update_jobs()
        .where(*_fence(job_id, owner, token))
        .values(state="ready", attempts=_c.attempts - 1, lease_token=None, run_after=run_after, updated_at=now,
                **_CLEAR_LEASE)
    )


def _q_delete_waits(ids: Sequence[int]) -> sa.Delete:
    return sa.delete(_waits).where(_wc.job_id.in_(ids))


def _signal_prunable(cutoff: _dt.datetime) -> list[sa.ColumnElement[bool]]:
    """A signal nobody can still receive (prune; see signal()'s docstring): sent before
    ``cutoff`` (a key only awaited: made before it), and no unfinished job has waited for its
    key. prune's read and its locked re-check share it."""
    waiter = sa.alias(_jobs, "waiter")
    return [
        sa.or_(_sg.sent_at < cutoff, sa.and_(_sg.sent_at.is_(None), _sg.created_at < cutoff)),
        ~sa.exists().where(_wc.kind == "signal", _wc.name == _sg.key, waiter.c.id == _wc.job_id,
                           waiter.c.state.not_in(TERMINAL)),
    ]


def _q_prunable_signals(cutoff: _dt.datetime, batch: int) -> sa.Select[Any]:
    return sa.select(_sg.key).where(*_signal_prunable(cutoff)).order_by(_sg.key).limit(batch)


def _q_lock_prunable_signals(d: _Dialect, keys: Sequence[str], cutoff: _dt.datetime) -> sa.Select[Any]:
    # Locked in key order, re-checked: a suspension on a key locks its row first (waits.py),
    # so one that committed before this lock is seen here, and a later one waits for the delete.
    stmt = sa.select(_sg.key).where(_sg.key.in_(keys), *_signal_prunable(cutoff)).order_by(_sg.key)
    return stmt.with_for_update() if d.row_locks else stmt


def _q_delete_signals(keys: Sequence[str]) -> sa.Delete:
    return sa.delete(_signals).where(_sg.key.in_(keys))


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


# ---- metrics (MetricsCollector): the live rows through their partial indexes, history by key


def _q_metrics_ready(now: _dt.datetime) -> sa.Select[Any]:
    """Per group: ready jobs, the due ones, and the oldest due ``run_after`` (one read of the
    ready index, whose size follows the ready set, never the history)."""
    due = _c.run_after <= now
    return (sa.select(_c.group_key, sa.func.count(), sa.func.sum(sa.case((due, 1), else_=0)),
                      sa.func.min(sa.case((due, _c.run_after)), type_=_TS))
            .where(_state_is("ready")).group_by(_c.group_key))


def _q_metrics_unready() -> sa.CompoundSelect[Any]:
    """Per group and state: the waiting, leased, running and held jobs (each through its own
    partial index: ix_jobs_waiting, ix_jobs_in_flight, ix_jobs_held)."""
    cols = (_c.group_key, _c.state, sa.func.count())
    return sa.union_all(
        sa.select(*cols).where(_state_is("waiting")).group_by(_c.group_key, _c.state),
        sa.select(*cols).where(_c.in_flight == _TRUE).group_by(_c.group_key, _c.state),
        sa.select(*cols).where(_state_is("held"), _c.spawned_by.is_not(None)).group_by(_c.group_key, _c.state),
    )


_Q_METRICS_MARKS = sa.select(sa.select(sa.func.max(_attempts.c.id)).scalar_subquery(),
                             sa.select(sa.func.max(_starts.c.id)).scalar_subquery())


def _q_metrics_attempts(after: int, limit: int) -> sa.Select[Any]:
    """Attempt rows past ``after`` by primary key, with their job's type and where it stands
    now (a primary-key lookup each; a pruned job leaves NULLs)."""
    a = _attempts.c
    return (sa.select(a.id, a.attempt, a.outcome, a.started_at, a.finished_at, _c.type, _c.state, _c.attempts,
                      _c.run_after)
            .select_from(_attempts.outerjoin(_jobs, _c.id == a.job_id))
            .where(a.id > after).order_by(a.id).limit(limit))


def _q_metrics_starts(after: int, limit: int) -> sa.Select[Any]:
    """Start-log rows past ``after`` by primary key (one per group per claim, ``n`` jobs each)."""
    s = _starts.c
    return sa.select(s.id, s.group_key, s.n, s.started_at).where(s.id > after).order_by(s.id).limit(limit)


def _q_trace_parent(job_id: int) -> sa.Select[Any]:
    """A job's stored trace context (tracing: one primary-key read per started attempt)."""
    return sa.select(_c.trace_parent).where(_c.id == job_id)


# ---- recurring jobs (schedules.py) ------------------------------------------------------------
_sch = _schedules.c
_Q_ALL_SCHEDULES = sa.select(_schedules).order_by(_sch.name)
_Q_INSERT_SCHEDULE = sa.insert(_schedules)
_Q_DELETE_SCHEDULE = sa.delete(_schedules).where(_sch.name == sa.bindparam("b_name", type_=_NAME))


def _q_schedule(d: _Dialect) -> sa.Select[Any]:
    """One schedule by name, locked for the change that follows (schedule, pause, resume)."""
    return d.lock_wait(sa.select(_schedules).where(_sch.name == sa.bindparam("b_name", type_=_NAME)))


_Q_SCHEDULE_ROW = sa.select(_schedules).where(_sch.name == sa.bindparam("b_name", type_=_NAME))

#: A change of a schedule by name: every column but the name, the counters and created_at,
#: and a new revision (fencing out a firing that read the old one).
_Q_UPDATE_SCHEDULE = (
    sa.update(_schedules)
    .where(_sch.name == sa.bindparam("b_name", type_=_NAME))
    .values({c: sa.bindparam(c) for c in ("type", "args", "every_us", "cron", "anchor", "group_key", "weight",
                                          "priority", "max_attempts", "timeout", "unique_key", "paused",
                                          "next_run_at", "updated_at")}
            | {"revision": _sch.revision + 1})
)


def _q_due_schedules(now: _dt.datetime, limit: int) -> sa.Select[Any]:
    """The workers' due check: active schedules whose next slot has come, from the due index
    (an empty range when nothing is due)."""
    return (sa.select(_sch.name).where(_sch.paused == sa.false(), _sch.next_run_at <= now)
            .order_by(_sch.next_run_at).limit(limit))


#: A firing: the schedule moves to its next slot only if nobody changed or fired it since it
#: was read (the revision fence; keep in sync with the race test's unfenced variant). The
#: enqueue of the slot is in the same transaction, so a slot is enqueued iff this updates a row.
_Q_ADVANCE_SCHEDULE = (
    sa.update(_schedules)
    .where(_sch.name == sa.bindparam("b_name", type_=_NAME), _sch.revision == sa.bindparam("b_revision"),
           _sch.paused == sa.false())
    .values(next_run_at=sa.bindparam("b_next", type_=_TS), last_slot=sa.bindparam("b_slot", type_=_TS),
            runs=_sch.runs + 1, revision=_sch.revision + 1, updated_at=sa.bindparam("b_now", type_=_TS))
)
_Q_SCHEDULE_LAST_JOB = (
    sa.update(_schedules).where(_sch.name == sa.bindparam("b_name", type_=_NAME))
    .values(last_job_id=sa.bindparam("b_job"))
)

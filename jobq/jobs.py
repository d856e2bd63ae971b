"""Putting jobs in and reading them back: create_schema, enqueue and submit (one insert path),
get and attempts."""

from __future__ import annotations

import dataclasses
import datetime as _dt
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import orm
from sqlalchemy.engine import Connection, Engine

from .base import _TRACE_CONTEXT, InvalidJob, JobqError, LeaseLost, UniqueKeyHeld, _checkpoint, _chunks
from .drivers import _Dialect, _engine_of, _prepare, _schema_guard, _target_connection, _transaction
from .fastpath import _hot_rows
from .migrations import _Q_META_ROWS, _Q_SEED_META, _upgrade
from .outcomes import _settle
from .policy import _check_waits_for, _topological
from .schema import _CLAIM_LOCK_KEY, _GLOBAL_LIMITS_KEY, _RETENTION_DUE_KEY, SCHEMA_VERSION, TERMINAL, Base
from .sql import (
    _BAD,
    _Q_INSERT_DEPS,
    _Q_INSERT_JOB,
    _Q_INSERT_JOBS,
    _Q_NAME_CAUSE,
    _q_add_children,
    _q_attempt_history,
    _q_held_among,
    _q_insert_job_returning,
    _q_job,
    _q_lock_jobs,
    _q_open_children,
    _q_open_upstreams,
    _q_parent_of,
    _q_spawner_fence,
    _q_upstream_ids,
    _q_upstream_states,
    _q_wait_nodes,
)
from .validate import (
    _INT32,
    _MAX_WEIGHT,
    _as_id,
    _check_int,
    _check_name,
    _check_seconds,
    _check_timedelta,
    _closed_error,
    _encode_checked,
    _to_db_time,
    _type_name,
)


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
            for k, v in (("schema_version", str(SCHEMA_VERSION)), (_CLAIM_LOCK_KEY, ""), (_GLOBAL_LIMITS_KEY, ""),
                         (_RETENTION_DUE_KEY, ""))
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


#: enqueue's max_attempts when none is given; a handler's RetryPolicy may set its own instead
#: (Worker._own_attempts). Keep in sync with enqueue's signature and the column's default.
_DEFAULT_ATTEMPTS = 3


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
    max_attempts: int | None = _field(None, lambda v, keys: None if v is None else _check_int(v, "max_attempts", 1, 1000),
                                      "max_attempts", lambda v, now: _DEFAULT_ATTEMPTS if v is None else v)
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
    row["max_attempts_set"] = spec.max_attempts is not None
    row.update(
        state=state, created_at=now, updated_at=now, finished_at=now if closed else None, error=None, closed_by=None,
        attempts=0, in_flight=False, cancel_requested=False, pending_deps=pending_deps,
        pending_children=pending_children, failed_children=0, spawned_by=None, spawn_token=None,
    )
    if _TRACE_CONTEXT:
        row["trace_parent"] = _TRACE_CONTEXT[0]()
    return row


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
    max_attempts: int | None = None,
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
        max_attempts: how many times the job may be dispatched (1-1000). None (the default):
            the ``attempts`` of its handler's :class:`RetryPolicy` when one sets them, else 3.
            A number given here wins over any policy, 3 included.
        timeout: seconds one dispatch may run before it is timed out (None: the worker default).
        priority: claim order within the group, higher first (an int in -2**31 .. 2**31-1;
            default 0); ties go to the oldest due, then the lowest id. It never overrides fair
            share between groups.
        unique_key: while an unfinished job (waiting, ready, leased or running) holds this key,
            return that job's id and write nothing; once it is done, failed or cancelled the
            key is free again. 1-200 characters, compared exactly. Enforced by a unique index,
            so concurrent enqueuers get one job; see docs/guides/long-running.md, "Unique
            jobs", for what happens inside your own transaction. A ``held`` job (spawned by a handler still
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
        # Not insert_block's one-row text: that cost 11 us more client CPU an insert on PyMySQL
        # (tests/core/test_statement_forms.py: both write the same rows).
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
                values[k] = values[k].replace(tzinfo=_dt.UTC)
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
                started_at=r.started_at.replace(tzinfo=_dt.UTC) if r.started_at is not None else None,
                finished_at=r.finished_at.replace(tzinfo=_dt.UTC), outcome=r.outcome, error=r.error))
        return out

    if isinstance(engine, Engine):
        _prepare(engine)
        with engine.connect() as conn:
            return read(conn)
    return read(_target_connection(engine))

"""The claim's statements, side by side with the claim (claiming.py): the group scan and the
window reads, the locking reads, the lease and its start log, and the claim lock. Built here
(a statement module, see sql.py's note on builders), run only by the claim and the group policy
writes that share its lock."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql as _pg

from .schema import _CLAIM_LOCK_KEY, _GLOBAL_LIMITS_KEY, _NAME, _TS, _c, _jobs, _meta, _slots, _starts
from .sql import _CLAIM_ORDER, _PIN_SETTINGS, _TRUE, _id_in, _prebuilt, _state_is, _update_jobs

if TYPE_CHECKING:
    from .drivers import _Dialect


# ---- the group scan and the window read ---------------------------------------------------------


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


# ---- slots in use and the start log's counts ----------------------------------------------------


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


# ---- the lease and its start log ---------------------------------------------------------------


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
    locked rows as they were read (attempts before this lease), in claim order; the same rows
    as the locking read, _q_lease and the start log apart (tests/core/test_statement_forms.py)."""
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


# ---- the claim lock (the claim's, and set_group's and set_limit's, which serialise on it) --------


# The claim's lock: the claim_lock row and the global_limits row, in key order, in one statement,
# so the global limits a claim obeys are read under the same lock as its in-flight count.
_Q_LOCK_CLAIM = (sa.select(_meta.c.key, _meta.c.value)
                 .where(sa.or_(_meta.c.key == _CLAIM_LOCK_KEY, _meta.c.key == _GLOBAL_LIMITS_KEY))
                 .order_by(_meta.c.key))
# set_group's lock: the claim_lock row alone (it does not touch the global limits).
_Q_LOCK_POLICY = sa.select(_meta.c.key, _meta.c.value).where(_meta.c.key == _CLAIM_LOCK_KEY)
# Both rows without the lock: a claim without caps of its own reads them to learn whether stored
# policy limits any group or a global limit is set (then it takes the lock after all).
_Q_CLAIM_META = (sa.select(_meta.c.key, _meta.c.value)
                 .where(sa.or_(_meta.c.key == _CLAIM_LOCK_KEY, _meta.c.key == _GLOBAL_LIMITS_KEY))
                 .order_by(_meta.c.key))


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


_Q_CLAIM_META_PIN = _Q_CLAIM_META.add_columns(*_PIN_SETTINGS)

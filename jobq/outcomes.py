"""What happens to a leased job: heartbeat, finalize, fail and release (fenced by the lease
token), the DAG bookkeeping that settles its dependents, spawned jobs, and reclaim."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import time
import weakref
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy.engine import Connection, Engine

from .base import ConfigError, InvalidJob, LeaseLost, _chunks
from .claiming import ClaimedId, Lease
from .drivers import _Dialect, _transaction
from .fastpath import _hot_rowcount, _hot_rows
from .schema import _LIVE, START_LOG_RETENTION, TERMINAL
from .sql import (
    _BAD,
    _Q_SWEEP_SLOTS,
    _Q_SWEEP_STARTS,
    _Outcome,
    _q_attempts,
    _q_cancel_live,
    _q_cancel_unstarted,
    _q_child_counts,
    _q_child_states,
    _q_close,
    _q_close_held,
    _q_count_finished_children,
    _q_count_off,
    _q_delete_edges,
    _q_delete_jobs,
    _q_dependent_counts,
    _q_done_under,
    _q_downstream,
    _q_expired,
    _q_fail,
    _q_finish,
    _q_finish_batch,
    _q_finish_recorded,
    _q_heartbeat,
    _q_held,
    _q_held_spawns,
    _q_landed,
    _q_lock_jobs,
    _q_lock_open_children,
    _q_make_ready,
    _q_parents,
    _q_reclaim,
    _q_reclaim_cancelled,
    _q_record_attempts,
    _q_record_reclaims,
    _q_referrers,
    _q_release,
    _q_release_held,
    _q_request_cancel,
    _q_roll_up,
    _q_unblocked,
    _q_uncount_children,
    _q_unstarted_children,
    _q_upstream_edges,
    _q_waiting_children,
)
from .validate import (
    _MAX_DELAY,
    _check_number,
    _check_seconds,
    _closed_error,
    _dispatch_of,
    _encode_checked,
    _type_name,
)
from .waits import _write_suspension

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
        # (_q_finish per job) cost 0.35-0.5 ms of client CPU a job to construct and compile.
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
            n = conn.execute(_q_finish(d, [o], o.owner, o.token, now)).rowcount
            state = "done"
        elif o.kind == "release":
            n = conn.execute(_q_release(o.job_id, o.owner, o.token, now)).rowcount
            state = "ready"
        elif o.kind == "suspend":
            n, state, as_ended = _write_suspension(conn, d, o, now)
            o = dataclasses.replace(o, ended=as_ended)
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

"""Operating on jobs and the queue: cancel and retry (of a job or a whole graph), prune, why,
tick and stats."""

from __future__ import annotations

import datetime as _dt
import json
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from .base import ConfigError, InvalidJob, _checkpoint, _chunks, logger
from .claiming import Lease, _check_rate_limits, _in_flight_counts, _lease_rows, _rate_room
from .drivers import _Dialect, _prepare, _transaction
from .jobs import _ancestors
from .limits import GlobalLimit, GroupPolicy, _global_limit_of, _group_policies, _policy_counts
from .outcomes import _cancel_subtree, _reclaim_rows, _rollup, _settle
from .schema import _LIVE, STATES, TERMINAL
from .sql import (
    _BAD,
    _Q_CLAIM_LOCK_VALUE,
    _Q_GLOBAL_LIMITS,
    _q_ahead_in_group,
    _q_attempt_history,
    _q_awaiting_signal,
    _q_cancel_unstarted,
    _q_child_counts,
    _q_child_states,
    _q_children_of,
    _q_closed_nodes,
    _q_closed_upstream_walk,
    _q_count_by_state,
    _q_delete_attempts,
    _q_delete_edges,
    _q_delete_jobs,
    _q_delete_logs,
    _q_delete_signals,
    _q_delete_waits,
    _q_downstream,
    _q_expired_count,
    _q_finished_by_state,
    _q_held_count,
    _q_holders,
    _q_in_flight_by_state,
    _q_job,
    _q_lock_jobs,
    _q_lock_prunable,
    _q_lock_prunable_signals,
    _q_prunable,
    _q_prunable_signals,
    _q_ready_by_group,
    _q_ready_times,
    _q_recent_failures,
    _q_reopen,
    _q_request_cancel,
    _q_roll_up,
    _q_signal_waits,
    _q_suspended_count,
    _q_uncount_failed_children,
    _q_unfinished_upstreams,
    _q_upstream_edges,
    _q_upstream_states,
    _q_upstreams_of,
    _q_waiting_count,
    _q_withdraw_cancel,
)
from .validate import _MAX_SLOTS, _as_id, _check_age, _check_caps, _check_int, _check_name, _check_seconds, _one_line

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
    """Delete finished jobs that finished more than ``older_than`` ago, in bounded batches, and
    the signals nobody can still receive.

    A job is kept while an unfinished job depends on it, while its container is unfinished,
    and (for a container) while any of its children remains. Each batch is one short
    transaction found through the finished-rows index, so the cost follows what is
    deleted, not the size of the history. A job re-opened meanwhile (:func:`retry`) is never
    deleted: each batch is locked and checked again before its delete. A job goes with its
    edges, its attempt history, its waits and its log lines (``ctx.log``).

    Then the signals (:func:`jobq.signal`): a signal sent more than ``older_than`` ago (a key
    only awaited, never sent: made that long ago) is deleted unless an unfinished job has
    waited for its key (a ``ctx.wait_for`` that suspended or timed out on it); whatever
    ``states`` says. The rule and its limits are in signal()'s docstring.

    Returns:
        How many jobs were deleted.
    """
    older_than = _check_age(older_than, "older_than")
    bad = [st for st in states if st not in TERMINAL]
    if bad:
        raise ConfigError(f"prune: only finished states can be pruned, not {bad}")
    _check_int(batch, "batch", 1, 100_000, ConfigError)
    total = _prune_batches(engine, states, older_than, batch, now=now)
    _prune_signals(engine, older_than, batch, now)
    return total


def _prune_batches(engine: Engine, states: Sequence[str], older_than: _dt.timedelta, batch: int, *,
                   now: _dt.datetime | None = None, extra: Sequence[Any] = (), most: int | None = None) -> int:
    """prune's deletion, shared by retention and bulk prune: batches of at most ``batch`` jobs,
    each one short transaction (read without locks, lock and re-check, delete the job with its
    edges, attempts, waits and logs), until none is left or ``most`` batches ran. ``extra``:
    more WHERE terms on jobs. Two callers at once delete each job once: the second one's
    locked re-check no longer finds it."""
    total = 0
    runs = 0
    while most is None or runs < most:
        runs += 1

        def one(conn: Connection, d: _Dialect) -> int:
            cutoff = (now or d.db_now(conn)) - older_than
            read = list(conn.execute(_q_prunable(states, cutoff, batch, extra)).scalars())
            _checkpoint("prune_read", read)
            # The read took no locks: what it found may have been re-opened (retry) since.
            ids = list(conn.execute(_q_lock_prunable(d, read, states, cutoff, extra)).scalars()) if read else []
            _checkpoint("prune_locked", ids)
            if ids:
                conn.execute(_q_delete_edges(ids))
                conn.execute(_q_delete_attempts(ids))
                conn.execute(_q_delete_waits(ids))
                conn.execute(_q_delete_logs(ids))
                conn.execute(_q_delete_jobs(ids))
            return len(ids)

        n = _transaction(engine, one)
        total += n
        if n == 0:  # a short batch may have freed containers whose children it deleted: go again
            return total
    return total


def _prune_signals(engine: Engine, older_than: _dt.timedelta, batch: int, now: _dt.datetime | None) -> int:
    """prune's second part: the signals nobody can still receive (_signal_prunable), in
    batches, each read, locked, checked again and deleted in one short transaction."""
    total = 0
    while True:

        def one(conn: Connection, d: _Dialect) -> int:
            cutoff = (now or d.db_now(conn)) - older_than
            read = list(conn.execute(_q_prunable_signals(cutoff, batch)).scalars())
            _checkpoint("prune_signals_read", read)
            keys = list(conn.execute(_q_lock_prunable_signals(d, read, cutoff)).scalars()) if read else []
            _checkpoint("prune_signals_locked", keys)
            if keys:
                conn.execute(_q_delete_signals(keys))
            return len(keys)

        n = _transaction(engine, one)
        total += n
        if n < batch:
            if total:
                logger.info("jobq prune: deleted %d signal(s) nobody can still receive", total,
                            extra={"action": "prune_signals"})
            return total
    return total


# ---- why --------------------------------------------------------------------------------------


def _iso(value: _dt.datetime | None, *, precise: bool = False) -> str | None:
    """ISO 8601 UTC with a ``Z``, the one way jobq prints a time: to the second for people,
    to the microsecond (``precise``) for JSON. Naive values are UTC (as stored)."""
    if value is None:
        return None
    if value.tzinfo is not None:
        value = value.astimezone(_dt.UTC).replace(tzinfo=None)
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
        last = conn.execute(_q_attempt_history(job_id, last=True)).first() if r.attempts or r.run_after > t else None
        ended = f" ({last.outcome})" if last is not None and last.outcome != "failed" else ""  # timeout, reclaimed
        if r.run_after > t and last is not None and last.outcome in ("suspended", "snoozed"):
            return _suspended_text(conn, head, r, last.outcome, t) + note
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


def _suspended_text(conn: Connection, head: str, r: Any, outcome: str, t: _dt.datetime) -> str:
    """why's line for a suspended job (waits.py): the signal it waits for, or its sleep's end."""
    return f"{head} is {_suspension_text(_suspension_of_row(conn, r, outcome), t)}, holding no slot"


def _suspension_of_row(conn: Connection, r: Any, outcome: str) -> dict[str, Any]:
    """What a suspended job (``r``, its newest attempt ``outcome``) waits for: kind "signal"
    (key, since, timeout_at), "sleep" or "snooze" (until)."""
    if outcome == "snoozed":
        return {"kind": "snooze", "until": r.run_after}
    w = conn.execute(_q_signal_waits(r.id)).first()
    if w is not None:
        return {"kind": "signal", "key": w.name, "since": w.since, "timeout_at": w.until}
    return {"kind": "sleep", "until": r.run_after}


def _suspension_text(s: Mapping[str, Any], t: _dt.datetime) -> str:
    """"waiting for signal 'k' since T (timeout at T2)", "sleeping until T (in 5m)"."""
    if s["kind"] == "signal":
        timeout = f"timeout at {_iso(s['timeout_at'])}" if s["timeout_at"] is not None else "no timeout"
        return f"waiting for signal {s['key']!r} since {_iso(s['since'])} ({timeout})"
    at = f"{_iso(s['until'])} (in {_span((s['until'] - t).total_seconds())})"
    return f"{'snoozed' if s['kind'] == 'snooze' else 'sleeping'} until {at}"


def _suspension(engine: Engine, job_id: int) -> dict[str, Any] | None:
    """A suspended job's wait (_suspension_of_row) with ``text`` (as why says it), or None when
    the job is not suspended: for `jobq show` and the dashboard's job page."""
    d = _prepare(engine)
    with engine.connect() as conn:
        t = d.db_now(conn)
        r = conn.execute(_q_job(job_id)).first()
        out = None
        if r is not None and r.state == "ready" and r.run_after > t:
            last = conn.execute(_q_attempt_history(job_id, last=True)).first()
            if last is not None and last.outcome in ("suspended", "snoozed"):
                out = _suspension_of_row(conn, r, last.outcome)
                out["text"] = _suspension_text(out, t)
        conn.rollback()
    return out


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
        ``expired_leases`` (awaiting reclaim), ``suspended`` (scheduled ready jobs whose
        handler suspended them, holding no slot: waiting for a signal, sleeping or snoozed),
        ``awaiting_signal`` (those of them suspended until a signal, see ``ctx.wait_for``), ``recent_failures`` (up to 5: id, type, error,
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
            "awaiting_signal": conn.execute(_q_awaiting_signal()).scalar_one(),
            "suspended": conn.execute(_q_suspended_count(now)).scalar_one(),
            "recent_failures": [dict(r._mapping) for r in conn.execute(_q_recent_failures(since))], "now": now,
        }
        if totals:
            out["totals"] = {s: 0 for s in STATES} | {st: n for st, n in conn.execute(_q_count_by_state())}
        conn.rollback()
    return out


def _progress_text(p: Any) -> str:
    """A progress report as people read it: "3/10 (30%): message"."""
    if not isinstance(p, dict):
        return ""
    done, total, message = p.get("done"), p.get("total"), p.get("message")
    text = f"{done:g}" if isinstance(done, (int, float)) else "?"
    if isinstance(total, (int, float)):
        text += f"/{total:g}" + (f" ({100 * done / total:.0f}%)" if total and isinstance(done, (int, float)) else "")
    return text + (f": {message}" if message else "")

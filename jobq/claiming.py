"""The claim: the ready set ranked by fair share, the group window, caps and rate limits, and
the lease (claim, claim_batch)."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from .base import ConfigError, JobqError, _chunks
from .claim_sql import (
    _LEASE_GROUP,
    _LEASE_ID,
    _Q_LOG_STARTS,
    _Q_READY_GROUP_SPAN,
    _Q_SLOTS_AND_SPAN,
    _Q_SLOTS_IN_USE,
    _WINDOW_TERMS,
    _q_any_due,
    _q_candidates,
    _q_claim_lock_value,
    _q_last_starts,
    _q_lease,
    _q_lock_and_lease,
    _q_lock_chosen,
    _q_lock_claim,
    _q_log_leased_starts,
    _q_ready_groups,
    _q_ready_groups_ranged_read,
    _q_ready_groups_read,
    _q_starts_since,
    _q_window_candidates,
    _q_window_json,
    _q_window_lateral,
)
from .drivers import _Dialect, _transaction
from .fastpath import _hot_rowcount, _hot_rows
from .limits import GlobalLimit, _check_rate_pair, _claim_meta, _group_policies
from .policy import allocate
from .validate import _MAX_SLOTS, _check_caps, _check_int, _check_name, _check_seconds


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


def _claim_window(groups: Sequence[str], cursor: str, size: int) -> tuple[list[str], str]:
    """The claim window's choice, on plain values: of ``groups`` (every group with ready work, in
    key order), the first ``size`` in cycle order from after ``cursor`` (those after it, then
    from the first up to it, each once), and the cursor the next claim starts from: "" once
    every group was taken, else the last group taken. _GroupScan.take makes the same choice a
    bounded scan at a time, never holding every group (tests/core/test_claim_window.py checks
    the two agree; tests/fairness/sim.py runs this one)."""
    if size <= 0 or not groups:  # nothing taken: the cursor stays
        return [], cursor
    after = [g for g in groups if g > cursor]
    if cursor and len(after) >= size:  # the scan after the cursor filled the window: no wrap
        return after[:size], after[size - 1]
    cycle = after + [g for g in groups if g <= cursor] if cursor else list(groups)
    window = cycle[:size]
    return window, _window_cursor(window, len(cycle) <= size)


def _window_cursor(taken: Sequence[str], done: bool) -> str:
    """Where the next claim window starts after one that took ``taken``: from the first group
    again once every group was taken (one scan instead of a scan after the cursor that finds
    nothing and a second one), else after the last group taken."""
    return "" if done else taken[-1]


def _served_cursor(cursor: str, served: Iterable[str]) -> str:
    """The cursor once the claim leased to ``served``: after the last of them in key order, so
    groups of the window that got nothing (idle groups beyond the free slots) are ranked again
    (the starvation bound of G - 1 + S slot grants); a window that took every group ("") stays."""
    return max(served) if cursor else cursor


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
            self.cursors[self.key] = _window_cursor(out, self.done)
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
        """The next window starts after the last group this claim leased to (_served_cursor)."""
        if not self.done and self.cursors.get(self.key):
            self.cursors[self.key] = _served_cursor(self.cursors[self.key], groups)


def _lock_claim(conn: Connection, d: _Dialect, pin: bool = False) -> tuple[tuple[int, int], GlobalLimit]:
    """Take the cap's serialisation point; returns the stored policy counts it carries and the
    global limits (read, and locked, by the same statement).

    SKIP LOCKED alone lets two claimers skip each other's rows and both spend the last free
    slot; this row lock (or SQLite's write lock) makes counting and leasing one atomic step.
    set_group and set_limit take it too, so a claim reads the policy as of its last change.
    With ``pin``, the same statement pins the transaction's plans (d.pin_wanted)."""
    return _claim_meta(_hot_rows(conn, _q_lock_claim(d, pin), {}))


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

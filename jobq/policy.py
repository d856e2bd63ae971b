"""Scheduling policy as pure functions (no I/O): fair share, allocation between groups,
back-off, and the DAG checks on a graph in memory."""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

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
        free: slots to fill, as for :func:`allocate`.
        weights: as for :func:`allocate`.
        in_flight: as for :func:`allocate`.
        caps: as for :func:`allocate`.
        last_start: as for :func:`allocate`.

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

"""A tick simulation of the scheduler's allocation: slots, groups kept backlogged, jobs that
finish after per-group durations. Pure Python, no database: it exercises jobq.allocate
exactly as the claim does (ready counts, weights, in flight, last start)."""

from __future__ import annotations

import dataclasses

import jobq


@dataclasses.dataclass
class SimResult:
    slot_time: dict[str, int]  # slot-ticks used per group
    max_idle_wait: dict[str, int]  # most slots granted to others in ticks where the group sat idle, unserved
    grants: int


#: The claim's own window choice (what jobq._GroupScan takes a bounded scan at a time) and its
#: cursor after leasing: run here, not copied.
claim_window = jobq._claim_window
served_cursor = jobq._served_cursor


def simulate(weights: dict[str, int], durations: dict[str, int], slots: int, ticks: int,
             allocate=jobq.allocate, window: bool = False, claim_window=claim_window,
             reweigh: dict[int, dict[str, int]] | None = None, window_min: int = jobq.CLAIM_WINDOW) -> SimResult:
    """``window``: rank only the claim's window of groups (as the database claim does);
    ``reweigh``: tick -> new weights from that tick on (set_group at run time)."""
    running: list[tuple[str, int]] = []  # (group, ticks left)
    last_start: dict[str, int] = {}
    slot_time = dict.fromkeys(weights, 0)
    passed_over = dict.fromkeys(weights, 0)  # slots granted to others since the group went idle
    max_wait = dict.fromkeys(weights, 0)
    grants = 0
    order = sorted(weights)
    cursor = ""
    for t in range(ticks):
        if reweigh and t in reweigh:
            weights = {**weights, **reweigh[t]}
        running = [(g, left - 1) for g, left in running if left > 1]
        in_flight = dict.fromkeys(weights, 0)
        for h, _ in running:
            in_flight[h] += 1
        free = slots - len(running)
        ranked = order
        if window and free > 0:
            ranked, cursor = claim_window(order, cursor, max(free, window_min))
            ranked = sorted(ranked)
        out = allocate(free, dict.fromkeys(ranked, 10**6), weights=weights, in_flight=in_flight, last_start=last_start)
        if window and out:
            # the next window starts after the last group served, so groups of this window
            # that got nothing are ranked again (jobq._GroupScan.served)
            cursor = served_cursor(cursor, out)
        for g in weights:  # every group stays backlogged
            if in_flight[g] == 0 and g not in out:
                passed_over[g] += sum(out.values())
                max_wait[g] = max(max_wait[g], passed_over[g])
            elif g in out:
                passed_over[g] = 0
        for g, n in sorted(out.items()):
            for _ in range(n):
                running.append((g, durations[g]))
                grants += 1
            last_start[g] = t
        for g, _ in running:
            slot_time[g] += 1
    return SimResult(slot_time, max_wait, grants)

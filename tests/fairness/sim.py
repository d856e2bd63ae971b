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


def simulate(weights: dict[str, int], durations: dict[str, int], slots: int, ticks: int,
             allocate=jobq.allocate) -> SimResult:
    running: list[tuple[str, int]] = []  # (group, ticks left)
    last_start: dict[str, int] = {}
    slot_time = dict.fromkeys(weights, 0)
    passed_over = dict.fromkeys(weights, 0)  # slots granted to others since the group went idle
    max_wait = dict.fromkeys(weights, 0)
    grants = 0
    for t in range(ticks):
        running = [(g, left - 1) for g, left in running if left > 1]
        in_flight = {g: sum(1 for h, _ in running if h == g) for g in weights}
        free = slots - len(running)
        out = allocate(free, dict.fromkeys(weights, 10**6), weights=weights, in_flight=in_flight, last_start=last_start)
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

"""A history checker in the style of Jepsen's queue checker, for runs across several hosts.

The workers log every attempt outside the database (worker_main.py: start, finish, done, lease
events, with CLOCK_MONOTONIC times); the checker reads those logs together with the final
table and the in-flight counts sampled from the database during the run, and reports:

    lost          jobs enqueued that are not done at the end
    done_twice    jobs whose completion was committed (in the workers' word) more than once
    unexpected    done jobs whose stored result is not what one acknowledged attempt returned
    acked_lost    completions a worker saw commit whose result is not the stored one (a
                  committed result that a failover lost, so the job ran again)
    over_cap      cap violations: database samples above the global or a group cap, and the
                  largest number of handler intervals (start..finish, of attempts whose lease was
                  not lost) overlapping at one instant above a cap
    early         attempts that started before every upstream (through containers) was done
    reruns        jobs started more than once (at-least-once: counted, not forbidden)

A handler interval lies inside its lease (start logged after the claim committed, finish
before the finalize that frees the slot), so with one clock for every process on the machine
an overlap above the cap is a real violation, with no slack needed.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
from typing import Any

import sqlalchemy as sa

import jobq

jobs = jobq.Job.__table__
deps = jobq.JobDep.__table__


def read_history(logdir: pathlib.Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for f in sorted(logdir.glob("hist-*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                out.append(json.loads(line))
    return out


@dataclasses.dataclass
class Table:
    rows: dict[int, Any]
    edges: list[tuple[int, int]]


def read_table(engine: sa.Engine) -> Table:
    with engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(sa.select(
            jobs.c.id, jobs.c.state, jobs.c.result, jobs.c.is_container, jobs.c.parent_id, jobs.c.group_key,
            jobs.c.args, jobs.c.attempts))}
        edges = [(r.job_id, r.depends_on_id) for r in conn.execute(sa.select(deps.c.job_id, deps.c.depends_on_id))]
    return Table(rows, edges)


@dataclasses.dataclass
class Report:
    jobs: int = 0
    attempts: int = 0
    lost: list[int] = dataclasses.field(default_factory=list)
    done_twice: list[int] = dataclasses.field(default_factory=list)
    unexpected: list[int] = dataclasses.field(default_factory=list)
    acked_lost: list[int] = dataclasses.field(default_factory=list)
    over_cap_samples: int = 0
    over_cap_intervals: int = 0  # how far the worst instant was above its cap
    early: list[int] = dataclasses.field(default_factory=list)
    reruns: list[int] = dataclasses.field(default_factory=list)
    samples: int = 0
    max_sampled: int = 0
    seconds: float = 0.0  # first start to last completion

    @property
    def over_cap(self) -> int:
        return self.over_cap_samples + self.over_cap_intervals

    def line(self) -> str:
        return (f"{self.jobs} jobs, {self.attempts} attempts, {len(self.lost)} lost, {len(self.done_twice)} done twice, "
                f"{len(self.unexpected)} unexpected, {len(self.acked_lost)} acked results lost, "
                f"{self.over_cap} over cap ({self.samples} samples, max {self.max_sampled}), "
                f"{len(self.early)} early, {len(self.reruns)} re-run, {self.seconds:.1f} s")


def _max_over(intervals: list[tuple[float, float]], cap: int) -> int:
    points = sorted([(s, 1) for s, _ in intervals] + [(f, -1) for _, f in intervals], key=lambda p: (p[0], p[1]))
    n = worst = 0
    for _, step in points:
        n += step
        worst = max(worst, n - cap)
    return worst


def check(history: list[dict[str, Any]], table: Table, *, cap: int | None = None,
          group_caps: dict[str, int] | None = None,
          samples: list[tuple[float, dict[str, int]]] = ()) -> Report:  # type: ignore[assignment]
    rows = table.rows
    rep = Report(jobs=len(rows))
    group_caps = group_caps or {}
    starts: dict[tuple[int, str], float] = {}  # (job, run) -> t
    finishes: dict[tuple[int, str], tuple[float, Any]] = {}
    dones: dict[int, list[tuple[str, float]]] = collections.defaultdict(list)
    lost_lease: set[tuple[int, str]] = set()
    started: collections.Counter[int] = collections.Counter()
    for h in history:
        ev = h["ev"]
        if ev == "start":
            starts[(h["job"], h["run"])] = h["t"]
            started[h["job"]] += 1
        elif ev == "finish":
            finishes[(h["job"], h["run"])] = (h["t"], h["result"])
        elif ev == "done":
            dones[h["job"]].append((h["run"], h["t"]))
        elif ev == "lease_lost":
            lost_lease.add((h["job"], h["run"]))
    rep.attempts = len(starts)
    times = [h["t"] for h in history if h["ev"] in ("start", "done")]
    rep.seconds = max(times) - min(times) if times else 0.0
    rep.reruns = sorted(j for j, n in started.items() if n > 1)

    # lost, results, duplicates
    accepted_finish: dict[int, float] = {}  # job -> finish time of the attempt whose result is stored
    for jid, r in rows.items():
        if r.state != "done":
            rep.lost.append(jid)
            continue
        if r.is_container:
            continue
        res = r.result or {}
        fin = finishes.get((jid, res.get("run")))  # type: ignore[arg-type]
        acked = {run for run, _ in dones.get(jid, [])}
        if (fin is None or fin[1] != res or res.get("v") != int((r.args or {}).get("i", 0)) * 7
                or res.get("run") not in acked):
            rep.unexpected.append(jid)
        if fin is not None:
            accepted_finish[jid] = fin[0]
    for jid, ds in dones.items():
        if len(ds) > 1:
            rep.done_twice.append(jid)
        res = (rows[jid].result or {}) if jid in rows else {}
        for run, _ in ds:
            if run != res.get("run"):
                rep.acked_lost.append(jid)
                break
    rep.done_twice.sort()
    rep.acked_lost.sort()

    # caps: database samples, then handler intervals of attempts that kept their lease
    for _t, by_group in samples:
        rep.samples += 1
        total = sum(by_group.values())
        rep.max_sampled = max(rep.max_sampled, total)
        if (cap is not None and total > cap) or any(n > group_caps.get(g, n) for g, n in by_group.items()):
            rep.over_cap_samples += 1
    intervals: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for key, t0 in starts.items():
        if key in lost_lease or key not in finishes:
            continue
        g = rows[key[0]].group_key if key[0] in rows else "?"
        intervals[g].append((t0, finishes[key][0]))
    worst = 0
    if cap is not None:
        worst = _max_over([iv for ivs in intervals.values() for iv in ivs], cap)
    for g, n in group_caps.items():
        worst = max(worst, _max_over(intervals.get(g, []), n))
    rep.over_cap_intervals = worst

    # the DAG: every attempt starts after each upstream leaf's stored attempt finished
    children: dict[int, list[int]] = collections.defaultdict(list)
    for jid, r in rows.items():
        if r.parent_id is not None:
            children[r.parent_id].append(jid)
    ups_of: dict[int, list[int]] = collections.defaultdict(list)
    for j, u in table.edges:
        ups_of[j].append(u)

    def leaves(x: int) -> set[int]:
        if not rows[x].is_container:
            return {x}
        return set().union(*(leaves(c) for c in children[x])) if children[x] else set()

    memo: dict[int, set[int]] = {}

    def upstream(x: int) -> set[int]:
        if x not in memo:
            s: set[int] = set()
            for u in ups_of[x]:
                s |= leaves(u)
            p = rows[x].parent_id
            if p is not None:
                s |= upstream(p)
            memo[x] = s
        return memo[x]

    for (jid, _run), t0 in starts.items():
        if jid in rows and any(u not in accepted_finish or t0 < accepted_finish[u] for u in upstream(jid)):
            rep.early.append(jid)
    rep.early = sorted(set(rep.early))
    return rep


@dataclasses.dataclass
class Tally:
    hosts: int = 3
    jobs: int = 0
    partitions: int = 0
    failovers: int = 0
    lost: int = 0
    done_twice: int = 0
    over_cap: int = 0
    async_reruns: int = 0  # completions acknowledged by a primary that died before its async standby had them
    resume: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        resume = f", resume {' / '.join(self.resume)}" if self.resume else ""
        return (f"cluster: {self.hosts} hosts, {self.jobs:,} jobs, {self.partitions} partitions, "
                f"{self.failovers} failovers, {self.lost} lost, {self.done_twice} done twice, "
                f"{self.over_cap} over cap, {self.async_reruns} re-run after async failover{resume}")


TALLY = Tally()

"""Prometheus metrics read from the database (MetricsCollector): the queue's state by index, and
counters and histograms from the attempt history and the start log past a watermark.

prometheus_client is imported only when metrics are collected (the ``jobq[prometheus]`` extra).
"""

from __future__ import annotations

import bisect
import datetime as _dt
import threading
from collections.abc import Iterator
from typing import Any

from sqlalchemy.engine import Connection, Engine

from .claiming import _in_flight_counts
from .drivers import _prepare
from .limits import get_limit, groups
from .sql import _Q_METRICS_MARKS, _q_metrics_attempts, _q_metrics_ready, _q_metrics_starts, _q_metrics_unready

#: The histograms' bucket bounds, in seconds (wait and run time).
METRICS_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                                      300.0, 900.0, 3600.0, 21600.0, 86400.0)
#: Rows of history read per statement, and at most per scrape (the rest wait for the next one).
_PAGE, _MAX_PAGES = 5_000, 20
#: Outcomes after which a job may be due again: such an attempt is a retry when its job is.
_RETRYABLE = frozenset({"failed", "timeout", "reclaimed"})
_TERMINAL = frozenset({"done", "failed", "cancelled"})


class _Tail:
    """Reads the rows of an append-only table past a watermark, each once. Ids are handed out
    before commit, so a row may appear below ids already read: the rows of the last ``settle``
    seconds (database clock) are read again and those seen skipped, and the watermark moves
    only past rows older than that."""

    def __init__(self, settle: float) -> None:
        self.low: int | None = None
        self.seen: dict[int, _dt.datetime] = {}
        self.settle = _dt.timedelta(seconds=settle)

    def fresh(self, conn: Connection, build: Any, now: _dt.datetime, at: int) -> list[Any]:
        assert self.low is not None
        out: list[Any] = []
        after = self.low
        for _ in range(_MAX_PAGES):
            rows = conn.execute(build(after, _PAGE)).all()
            for r in rows:
                if r[0] not in self.seen:
                    out.append(r)
                    self.seen[r[0]] = r[at]
            if len(rows) < _PAGE:
                break
            after = rows[-1][0]
        cutoff = now - self.settle
        self.low = max([self.low, *(i for i, t in self.seen.items() if t < cutoff)])
        self.seen = {i: t for i, t in self.seen.items() if i > self.low}
        return out


class _Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(METRICS_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(METRICS_BUCKETS, seconds)] += 1
        self.sum += seconds

    def buckets(self) -> list[tuple[str, float]]:
        out, total = [], 0
        for bound, n in zip((*METRICS_BUCKETS, float("inf")), self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(total)))
        return out


class MetricsCollector:
    """The queue's metrics for Prometheus, read from the database at each scrape: a custom
    collector for a ``prometheus_client`` registry (``registry.register(jobq.MetricsCollector(engine))``),
    and what ``jobq serve`` answers at ``/metrics``.

    Gauges (jobs by state and group, due jobs and the oldest one's age, slots in use against
    the caps) are read through the partial indexes of the live rows. Counters and histograms
    (attempts by outcome, retries, starts, wait and run time per type) count the rows
    ``jobq_attempts`` and ``jobq_starts`` gained since the collector was made, read by primary
    key past a watermark: they start at zero in each process that collects (as a process's own
    counters do) and only grow, whatever ``prune`` or the start log's sweep deletes later. A
    scrape therefore costs the live rows plus the rows written since the last scrape, never
    the size of the history. See docs/guides/metrics.md for every metric.

    Args:
        engine: the queue's Engine.
        settle: seconds of history read again at each scrape, so that a row whose id was handed
            out before a row already read, but committed after it, is still counted (default 5).

    Raises:
        ImportError: at collection, if prometheus_client is not installed (``pip install jobq[prometheus]``).
    """

    def __init__(self, engine: Engine, *, settle: float = 5.0) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._attempts, self._starts = _Tail(settle), _Tail(settle)
        self._by_outcome: dict[tuple[str, str], int] = {}
        self._retries: dict[str, int] = {}
        self._started: dict[str, int] = {}
        self._wait: dict[str, _Histogram] = {}
        self._run: dict[str, _Histogram] = {}

    def read(self) -> dict[str, Any]:
        """One scrape's numbers as plain data (what :meth:`collect` exposes): ``now``, ``jobs``
        {(group, state): n}, ``due`` {group: n}, ``oldest_due`` {group: run_after}, ``in_flight``
        {group: n}, ``caps`` {group: cap}, ``global_cap`` (or None), and the counters so far."""
        with self._lock, self.engine.connect() as conn:
            now = _prepare(self.engine).db_now(conn)
            jobs: dict[tuple[str, str], int] = {}
            due: dict[str, int] = {}
            oldest: dict[str, _dt.datetime] = {}
            for g, n, n_due, first in conn.execute(_q_metrics_ready(now)):
                jobs[(g, "ready")] = int(n)
                due[g] = int(n_due or 0)
                if first is not None:
                    oldest[g] = first
            for g, st, n in conn.execute(_q_metrics_unready()):
                jobs[(g, st)] = jobs.get((g, st), 0) + int(n)
            in_flight = _in_flight_counts(conn, now)
            caps = {p.group_key: p.max_in_flight for p in groups(conn) if p.max_in_flight is not None}
            global_cap = get_limit(conn).max_in_flight
            self._tail(conn, now)
            conn.rollback()
            return {"now": now, "jobs": jobs, "due": due, "oldest_due": oldest, "in_flight": in_flight,
                    "caps": caps, "global_cap": global_cap, "attempts": dict(self._by_outcome),
                    "retries": dict(self._retries), "starts": dict(self._started)}

    def _tail(self, conn: Connection, now: _dt.datetime) -> None:
        if self._attempts.low is None:
            a, s = conn.execute(_Q_METRICS_MARKS).one()
            self._attempts.low, self._starts.low = int(a or 0), int(s or 0)
        for _id, attempt, outcome, started, finished, type_, state, attempts, run_after in self._attempts.fresh(
                conn, _q_metrics_attempts, now, 4):
            t = type_ if type_ is not None else ""
            self._by_outcome[(t, outcome)] = self._by_outcome.get((t, outcome), 0) + 1
            if outcome in _RETRYABLE and state is not None and (state == "ready" or attempts > attempt):
                self._retries[t] = self._retries.get(t, 0) + 1
            if started is not None:
                self._run.setdefault(t, _Histogram()).observe(max(0.0, (finished - started).total_seconds()))
                # the dispatch that ended the job: its run_after is still the one it was due at
                if state in _TERMINAL and attempts == attempt and run_after is not None and started >= run_after:
                    self._wait.setdefault(t, _Histogram()).observe((started - run_after).total_seconds())
        for _id, g, n, _at in self._starts.fresh(conn, _q_metrics_starts, now, 3):
            self._started[g] = self._started.get(g, 0) + int(n)

    def collect(self) -> Iterator[Any]:
        """The metric families, for prometheus_client (which calls this at each scrape)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        r = self.read()
        now = r["now"]
        jobs = GaugeMetricFamily("jobq_jobs", "Unfinished jobs by state and group (waiting, ready, leased, running, held).",
                                 labels=["state", "group"])
        for (g, st), n in sorted(r["jobs"].items()):
            jobs.add_metric([st, g], n)
        yield jobs
        due = GaugeMetricFamily("jobq_ready_due", "Ready jobs whose run_after has passed, by group.", labels=["group"])
        age = GaugeMetricFamily("jobq_ready_oldest_due_age_seconds",
                                "Seconds since the longest-waiting due ready job of the group became due.", labels=["group"])
        for g, n in sorted(r["due"].items()):
            due.add_metric([g], n)
        for g, first in sorted(r["oldest_due"].items()):
            age.add_metric([g], max(0.0, (now - first).total_seconds()))
        yield due
        yield age
        flight = GaugeMetricFamily("jobq_in_flight", "Slots in use by group: leased or running jobs, and abandoned handlers.",
                                   labels=["group"])
        for g, n in sorted(r["in_flight"].items()):
            flight.add_metric([g], n)
        yield flight
        yield GaugeMetricFamily("jobq_in_flight_total", "Slots in use, every group together.",
                                value=sum(r["in_flight"].values()))
        cap = GaugeMetricFamily("jobq_group_max_in_flight", "A group's stored cap (set_group), for groups with one.",
                                labels=["group"])
        for g, n in sorted(r["caps"].items()):
            cap.add_metric([g], n)
        yield cap
        if r["global_cap"] is not None:
            yield GaugeMetricFamily("jobq_max_in_flight", "The stored global cap (set_limit).", value=r["global_cap"])
        attempts = CounterMetricFamily("jobq_attempts", "Attempts that ended, by type and outcome, since this collector started.",
                                       labels=["type", "outcome"])
        for (t, o), n in sorted(r["attempts"].items()):
            attempts.add_metric([t, o], n)
        yield attempts
        retries = CounterMetricFamily("jobq_retries", "Failed, timed-out or reclaimed attempts whose job was due again.",
                                      labels=["type"])
        for t, n in sorted(r["retries"].items()):
            retries.add_metric([t], n)
        yield retries
        starts = CounterMetricFamily("jobq_starts", "Jobs started (claimed), by group.", labels=["group"])
        for g, n in sorted(r["starts"].items()):
            starts.add_metric([g], n)
        yield starts
        for name, doc, hists in (
                ("jobq_wait_seconds", "From due (run_after) to start, for the dispatch that ended the job.", self._wait),
                ("jobq_run_seconds", "From start to end of each attempt.", self._run)):
            fam = HistogramMetricFamily(name, doc, labels=["type"])
            with self._lock:
                for t, h in sorted(hists.items()):
                    fam.add_metric([t], h.buckets(), h.sum)
            yield fam

    def text(self) -> bytes:
        """The metrics in Prometheus's text format (what ``jobq serve`` answers at ``/metrics``)."""
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return generate_latest(registry)  # type: ignore[no-any-return]

"""Fair share and per-group limits with real Workers on every engine (run by tests-* sessions)."""

from __future__ import annotations

import datetime
import threading
import time

import sqlalchemy as sa

import jobq
from helpers import REPORT, most_in_window


class Spans:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: list[tuple[str, float, float]] = []

    def handler(self, seconds: float):
        def run(ctx: jobq.JobContext) -> dict:
            t0 = time.monotonic()
            time.sleep(seconds)
            with self.lock:
                self.rows.append((ctx.group_key, t0, time.monotonic()))
            return {}

        return run


def _run_workers(engine: sa.Engine, handlers: dict, n: int = 2, **kw) -> None:
    ws = [jobq.Worker(engine, handlers, poll_interval=0.01, lease_ttl=10.0, **kw) for _ in range(n)]
    ok: list[bool] = []
    ts = [threading.Thread(target=lambda w=w: ok.append(w.run_until_idle(timeout=120))) for w in ws]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert ok == [True] * n


def _peak(rows: list[tuple[str, float, float]], group: str | None = None) -> int:
    pts = sorted([(a, 1) for g, a, _ in rows if group in (None, g)] + [(b, -1) for g, _, b in rows if group in (None, g)])
    level = peak = 0
    for _, d in pts:
        level += d
        peak = max(peak, level)
    return peak


def test_integration_weighted_shares_hold_while_groups_are_backlogged(engine: sa.Engine) -> None:
    """Weights 3:1, cap 4 shared by two workers; the light group's jobs run 3x longer. While
    both groups are backlogged, the heavy group's share of slot-time stays within 0.1 of 75%
    (the seed's free-slots-only split drifts to about 50% here)."""
    with engine.begin() as conn:
        for _ in range(100):
            jobq.enqueue(conn, "heavy", group_key="heavy", weight=3)
        for _ in range(40):
            jobq.enqueue(conn, "light", group_key="light", weight=1)
    spans = Spans()
    _run_workers(engine, {"heavy": spans.handler(0.1), "light": spans.handler(0.3)}, max_concurrency=4)
    rows = spans.rows
    start = min(a for _, a, _ in rows)
    end = min(max(a for g, a, _ in rows if g == grp) for grp in ("heavy", "light"))  # first group to run dry
    used = {"heavy": 0.0, "light": 0.0}
    for g, a, b in rows:
        used[g] += max(0.0, min(b, end) - max(a, start))
    share = used["heavy"] / sum(used.values())
    REPORT.append(f"fair share {engine.dialect.name}: heavy (w=3) {share:.2f} of slot-time (target 0.75) over {end - start:.1f}s")
    assert abs(share - 0.75) <= 0.1, f"heavy share {share:.2f} over {end - start:.1f}s"
    assert _peak(rows) <= 4


def test_integration_per_group_cap_is_never_exceeded(engine: sa.Engine) -> None:
    """group_caps={"tenant": 2} next to a global cap of 5, two workers: the tenant never runs
    more than 2 at once, while the other group uses the remaining slots."""
    with engine.begin() as conn:
        for _ in range(30):
            jobq.enqueue(conn, "job", group_key="tenant")
            jobq.enqueue(conn, "job", group_key="other")
    spans = Spans()
    _run_workers(engine, {"job": spans.handler(0.03)}, max_concurrency=5, group_caps={"tenant": 2})
    assert len(spans.rows) == 60
    assert _peak(spans.rows, "tenant") <= 2
    assert _peak(spans.rows, "other") >= 3  # the cap binds the tenant only
    assert _peak(spans.rows) <= 5


def test_integration_rate_limit_bounds_starts_per_window(engine: sa.Engine) -> None:
    """rate_limits={"api": (5, 1.0)}, two workers: no 1-second window holds more than 5 claims.

    Claims are timed by the "claimed" event, which a worker emits right after the claim's
    commit, on this process's one monotonic clock (both workers are threads here), so a worker
    whose clock disagrees with the other's would show. Allowed slack: 50 ms of commit latency.
    Handler starts come later still, after dispatch; they get 200 ms."""
    with engine.begin() as conn:
        for _ in range(12):
            jobq.enqueue(conn, "call", group_key="api")
    spans = Spans()
    claimed: list[float] = []

    def on_event(ev: jobq.Event) -> None:
        if ev.action == "claimed":
            claimed.append(time.monotonic())

    _run_workers(engine, {"call": spans.handler(0.001)}, max_concurrency=4, rate_limits={"api": (5, 1.0)},
                 on_event=on_event)
    starts = sorted(a for _, a, _ in spans.rows)
    assert len(starts) == 12 and len(claimed) == 12
    assert most_in_window(claimed, 0.95) <= 5, sorted(round(t - min(claimed), 3) for t in claimed)
    assert most_in_window(starts, 0.8) <= 5, [round(t - starts[0], 3) for t in starts]
    assert starts[-1] - starts[0] >= 1.9  # 12 starts at 5 per second need two full windows


class _LaggingClock(jobq._Clock):
    """A worker clock 300 ms behind the database: what a slow first reading or a descheduled
    thread leaves in a clock that is read once and carried forward."""

    def now(self):  # type: ignore[no-untyped-def]
        return super().now() - datetime.timedelta(seconds=0.3)


def test_integration_rate_limit_holds_when_one_workers_clock_lags(engine: sa.Engine) -> None:
    """The rate window is measured on the database clock read under the claim lock, not on a
    worker's own carried-forward clock: with one worker's clock 300 ms behind, its starts would
    otherwise be logged 300 ms early and the other worker would start its next batch early.
    (Caught when the Worker passes its own clock: 10 claims in 0.95 s on every engine.)"""
    with engine.begin() as conn:
        for _ in range(15):
            jobq.enqueue(conn, "call", group_key="api", run_after=datetime.timedelta(seconds=-1))
    claimed: list[float] = []

    def on_event(ev: jobq.Event) -> None:
        if ev.action == "claimed":
            claimed.append(time.monotonic())

    ws = [jobq.Worker(engine, {"call": lambda ctx: None}, poll_interval=0.01, lease_ttl=10.0, max_concurrency=5,
                      rate_limits={"api": (5, 1.0)}, on_event=on_event) for _ in range(2)]
    ws[0]._clock = _LaggingClock(engine)
    ok: list[bool] = []
    ts = [threading.Thread(target=lambda w=w: ok.append(w.run_until_idle(timeout=120))) for w in ws]
    ts[0].start()  # the lagging worker claims first; the other's next batch is the one at risk
    time.sleep(0.2)
    ts[1].start()
    for t in ts:
        t.join()
    assert ok == [True, True] and len(claimed) == 15
    assert most_in_window(claimed, 0.95) <= 5, sorted(round(t - min(claimed), 3) for t in claimed)

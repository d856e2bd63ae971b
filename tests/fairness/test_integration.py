"""Fair share and per-group limits with real Workers on every engine (run by tests-* sessions)."""

from __future__ import annotations

import datetime
import itertools
import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
from helpers import REPORT, meeting, most_surely_in_window, peak_overlap, wait_for

# Microsecond rounding of logged times and drift between the database's clock and this
# machine's monotonic one over a window; not an allowance for delays (see ClaimSpans).
CLOCK_MARGIN = 0.005


class Spans:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: list[tuple[str, float, float]] = []

    def handler(self, seconds: float, meet: dict[str, int] | None = None):
        """Each run sleeps ``seconds``. With ``meet`` ({group: n}), the first n runs of the group
        also wait until all n are running (helpers.meeting)."""
        arrivals = {g: meeting(n) for g, n in (meet or {}).items()}

        def run(ctx: jobq.JobContext) -> dict:
            t0 = time.monotonic()
            arrive = arrivals.get(ctx.group_key)
            if arrive is not None:
                arrive()
            time.sleep(seconds)
            with self.lock:
                self.rows.append((ctx.group_key, t0, time.monotonic()))
            return {}

        return run


class ClaimSpans:
    """Bounds on when each of a worker's claims happened, with no allowance for delays.

    A Worker claims inside the transaction of its tick and emits "claimed" after that commit,
    in the same thread. So a claim's instant lies between the start of the last transaction
    that thread began (SQLAlchemy's "begin" event) and its "claimed" event."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.spans: list[tuple[float, float]] = []
        self._began = threading.local()
        self._lock = threading.Lock()
        sa.event.listen(engine, "begin", self._on_begin)

    def _on_begin(self, conn: sa.Connection) -> None:
        self._began.t = time.monotonic()

    def on_event(self, ev: jobq.Event) -> None:
        if ev.action == "claimed":
            with self._lock:
                self.spans.append((self._began.t, time.monotonic()))

    def close(self) -> None:
        sa.event.remove(self.engine, "begin", self._on_begin)

    def shown(self) -> list[tuple[float, float]]:
        t0 = min(b for b, _ in self.spans)
        return sorted((round(b - t0, 3), round(a - t0, 3)) for b, a in self.spans)


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
    return peak_overlap((a, b) for g, a, b in rows if group in (None, g))


def _share_while_full(rows: list[tuple[str, float, float]], group: str, cap: int) -> tuple[float, float, float]:
    """``group``'s share of the slots over the time all ``cap`` slots ran handlers, while every
    group still had work (until the first group ran dry); also that time and the whole span.

    Only the full stretches count: between a handler's end and its slot's next start the slot
    is empty for as long as the worker takes to claim again, and a group whose jobs are short
    pays that gap more often. On a loaded machine the gaps grow, which is the machine's speed,
    not the split; with every slot busy, the split is exactly the policy's."""
    start = min(a for _, a, _ in rows)
    end = min(max(a for g, a, _ in rows if g == grp) for grp in {g for g, _, _ in rows})  # first group to run dry
    edges = sorted({start, end, *(t for _, a, b in rows for t in (a, b) if start < t < end)})
    full = held = 0.0
    for t0, t1 in itertools.pairwise(edges):
        mid = (t0 + t1) / 2
        running = [g for g, a, b in rows if a <= mid < b]
        if len(running) == cap:
            full += t1 - t0
            held += (t1 - t0) * running.count(group) / cap
    return (held / full if full else 0.0), full, end - start


def _weighted_run(engine: sa.Engine) -> tuple[float, float, float, list[tuple[str, float, float]]]:
    with engine.begin() as conn:
        for _ in range(100):
            jobq.enqueue(conn, "heavy", group_key="heavy", weight=3)
        for _ in range(40):
            jobq.enqueue(conn, "light", group_key="light", weight=1)
    spans = Spans()
    _run_workers(engine, {"heavy": spans.handler(0.1), "light": spans.handler(0.3)}, max_concurrency=4)
    return (*_share_while_full(spans.rows, "heavy", 4), spans.rows)


def test_integration_weighted_shares_hold_while_groups_are_backlogged(engine: sa.Engine) -> None:
    """Weights 3:1, cap 4 shared by two workers; the light group's jobs run 3x longer. While
    both groups are backlogged and every slot is busy, the heavy group holds 75% of the slots,
    within 0.1 (a split of the free slots alone drifts to about half: the test below)."""
    share, full, span, rows = _weighted_run(engine)
    REPORT.append(f"fair share {engine.dialect.name}: heavy (w=3) {share:.2f} of the slots (target 0.75) "
                  f"over {full:.1f}s of {span:.1f}s with every slot busy")
    assert full > 0, "no moment with every slot busy: the cap was never reached"
    assert abs(share - 0.75) <= 0.1, f"heavy share {share:.2f} over {full:.1f}s with every slot busy"
    assert _peak(rows) <= 4


def test_the_weighted_share_check_catches_a_split_of_the_free_slots_alone(
        engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The broken variant: allocate told nothing runs (in_flight ignored), so each free slot is
    split by weight alone; the light group's long jobs pile up in the slots, and the same
    measure as above shows the heavy share far below 0.75."""
    right = jobq.allocate

    def free_slots_only(free: int, ready: Any, **kw: Any) -> dict[str, int]:
        return right(free, ready, **{**kw, "in_flight": {}})

    monkeypatch.setattr(jobq, "allocate", free_slots_only)
    share, full, _span, _rows = _weighted_run(engine)
    REPORT.append(f"fair share {engine.dialect.name}, BROKEN free slots only: heavy {share:.2f} of the slots (caught)")
    assert full > 0 and abs(share - 0.75) > 0.1, f"the broken split gave {share:.2f}: the check cannot tell"


def test_integration_per_group_cap_is_never_exceeded(engine: sa.Engine) -> None:
    """group_caps={"tenant": 2} next to a global cap of 5, two workers: the tenant never runs
    more than 2 at once, while the other group uses the remaining slots. A cap that does not
    hold across the two workers shows as 3 or more tenant handlers running at once."""
    with engine.begin() as conn:
        for _ in range(30):
            jobq.enqueue(conn, "job", group_key="tenant")
            jobq.enqueue(conn, "job", group_key="other")
    spans = Spans()
    _run_workers(engine, {"job": spans.handler(0.03, meet={"other": 3})}, max_concurrency=5, group_caps={"tenant": 2})
    assert len(spans.rows) == 60
    assert _peak(spans.rows, "tenant") <= 2
    assert _peak(spans.rows, "other") >= 3  # the cap binds the tenant only
    assert _peak(spans.rows) <= 5


def test_integration_rate_limit_bounds_starts_per_window(engine: sa.Engine) -> None:
    """rate_limits={"api": (5, 1.0)}, two workers: no 1-second window holds more than 5 claims.

    Each claim is known only to lie between the start of its tick's transaction and its
    "claimed" event (ClaimSpans); a window counts a claim only when that whole span is inside,
    so a count above 5 is proof and no slack for commit or scheduling delays is needed. The
    12 claims must also span the two full windows the limit implies, and the last handler
    start (which comes after its claim) at least as long after the first claim."""
    with engine.begin() as conn:
        for _ in range(12):
            jobq.enqueue(conn, "call", group_key="api")
    spans = Spans()
    claims = ClaimSpans(engine)
    try:
        _run_workers(engine, {"call": spans.handler(0.001)}, max_concurrency=4, rate_limits={"api": (5, 1.0)},
                     on_event=claims.on_event)
    finally:
        claims.close()
    starts = sorted(a for _, a, _ in spans.rows)
    first_ask = min(b for b, _ in claims.spans)
    assert len(starts) == 12 and len(claims.spans) == 12
    assert most_surely_in_window(claims.spans, 1.0 - CLOCK_MARGIN) <= 5, claims.shown()
    assert max(a for _, a in claims.spans) - first_ask >= 2.0 - CLOCK_MARGIN, claims.shown()
    assert starts[-1] - first_ask >= 2.0 - CLOCK_MARGIN  # 12 starts at 5 per second need two full windows


class _LaggingClock(jobq._Clock):
    """A worker clock 300 ms behind the database: what a slow first reading or a descheduled
    thread leaves in a clock that is read once and carried forward."""

    def now(self):  # type: ignore[no-untyped-def]
        return super().now() - datetime.timedelta(seconds=0.3)


def test_integration_rate_limit_holds_when_one_workers_clock_lags(engine: sa.Engine) -> None:
    """The rate window is measured on the database clock read under the claim lock, not on a
    worker's own carried-forward clock: with one worker's clock 300 ms behind, its starts would
    otherwise be logged 300 ms early and the other worker would start its next batch early.
    (Caught when the Worker passes its own clock: 10 claims in one second on every engine.)
    Claims are bounded by their ClaimSpans, as in the test above."""
    with engine.begin() as conn:
        for _ in range(15):
            jobq.enqueue(conn, "call", group_key="api", run_after=datetime.timedelta(seconds=-1))
    claims = ClaimSpans(engine)
    ws = [jobq.Worker(engine, {"call": lambda ctx: None}, poll_interval=0.01, lease_ttl=10.0, max_concurrency=5,
                      rate_limits={"api": (5, 1.0)}, on_event=claims.on_event) for _ in range(2)]
    ws[0]._clock = _LaggingClock(engine)
    ok: list[bool] = []
    ts = [threading.Thread(target=lambda w=w: ok.append(w.run_until_idle(timeout=120))) for w in ws]
    ts[0].start()  # the lagging worker claims first; the other's next batch is the one at risk
    try:
        wait_for(lambda: claims.spans, timeout=30, what="the lagging worker's first claim")
        ts[1].start()
    finally:
        for t in ts:
            if t.ident is not None:
                t.join()
        claims.close()
    assert ok == [True, True] and len(claims.spans) == 15
    assert most_surely_in_window(claims.spans, 1.0 - CLOCK_MARGIN) <= 5, claims.shown()

"""The claim window's choice is one pure function, jobq._claim_window, that the fairness
simulation runs (tests/fairness/sim.py); the claim makes the same choice with bounded scans of
the ready index (jobq._GroupScan). Here the two agree, on every engine, for every cursor and
window size over a few groups."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

import jobq
from helpers import db_now

GROUPS = ["b", "d", "f", "h", "k"]
#: Cursors: none, each group, between groups, before the first and after the last.
CURSORS = ["", *GROUPS, "c", "e", "a", "z"]


def _ready_rows(engine: sa.Engine, groups: list[str]) -> None:
    now = db_now(engine)
    base = dict(type="t", args={}, state="ready", is_container=False, weight=1, run_after=now, created_at=now,
                updated_at=now, attempts=0, max_attempts=3, in_flight=False, cancel_requested=False,
                pending_deps=0, pending_children=0, failed_children=0)
    with engine.begin() as conn:
        conn.execute(sa.insert(jobq.Job.__table__), [dict(base, group_key=g) for g in groups for _ in range(2)])


def _scanned(engine: sa.Engine, cursor: str, size: int) -> tuple[list[str], str]:
    """The window the claim's scan takes from ``cursor``, and the cursor it leaves."""
    cursors = jobq._GROUP_CURSORS.setdefault(engine, {})
    cursors[None] = cursor
    now = db_now(engine)
    window = jobq._transaction(engine, lambda conn, d: jobq._GroupScan(conn, d, None, now, size).take(size))
    return window, cursors[None]


def _copied_window(groups: list[str], cursor: str, size: int) -> tuple[list[str], str]:
    """BROKEN: the simulation's former copy of the window: a window that wrapped round to every
    group left the cursor at its last group, where the claim starts the next from the first."""
    after = [g for g in groups if g > cursor][:size]
    if len(after) < size and cursor:
        after += [g for g in groups if g <= cursor][: size - len(after)]
    return list(after), (after[-1] if len(after) == size else "")


@pytest.mark.parametrize("broken", [False, True], ids=["jobq", "broken-variant"])
def test_the_claims_scan_takes_the_window_the_pure_function_chooses(engine: sa.Engine, broken: bool) -> None:
    """For every cursor and size, _GroupScan.take returns _claim_window's groups, in its cycle
    order, and leaves its cursor. The broken variant (a copy that drifted) disagrees somewhere."""
    _ready_rows(engine, GROUPS)
    choose = _copied_window if broken else jobq._claim_window
    differ = [(cursor, size) for cursor in CURSORS for size in range(1, len(GROUPS) + 2)
              if _scanned(engine, cursor, size) != choose(GROUPS, cursor, size)]
    assert bool(differ) == broken, differ


def _take_and_serve(conn: sa.Connection, d: object, size: int, served: list[str], now: object) -> None:
    scan = jobq._GroupScan(conn, d, None, now, size)  # type: ignore[arg-type]
    scan.take(size)
    scan.served(served)


def test_the_served_cursor_is_the_claims(engine: sa.Engine) -> None:
    """After leasing, the next window starts after the last group served (_GroupScan.served is
    _served_cursor); a window that took every group leaves the cursor at the first."""
    _ready_rows(engine, GROUPS)
    cursors = jobq._GROUP_CURSORS.setdefault(engine, {})
    for cursor, size, served in (("b", 2, ["d"]), ("", 2, ["b"]), ("d", 5, ["f", "b"])):
        cursors[None] = cursor
        jobq._transaction(engine, lambda conn, d, c=(size, served, db_now(engine)): _take_and_serve(conn, d, *c))
        _, left = jobq._claim_window(GROUPS, cursor, size)
        assert cursors[None] == (jobq._served_cursor(left, served) if left else ""), (cursor, size)


def test_the_simulation_runs_the_claims_window_function() -> None:
    """tests/fairness/sim.py holds no copy of the window: it calls jobq's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fairness"))
    try:
        import sim
    finally:
        sys.path.pop(0)
    assert sim.claim_window is jobq._claim_window
    assert sim.served_cursor is jobq._served_cursor

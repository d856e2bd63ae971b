"""fair_share / allocate are pure: every rule is checked by Hypothesis on generated inputs."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

import jobq

GROUPS = st.sampled_from(["a", "b", "c", "d", "e", "tenant-1", "tenant-2", "Z"])


@st.composite
def situations(draw):
    groups = draw(st.lists(GROUPS, min_size=1, max_size=6, unique=True))
    ready = {g: draw(st.integers(0, 30)) for g in groups}
    weights = {g: draw(st.integers(1, 10)) for g in groups}
    in_flight = {g: draw(st.integers(0, 12)) for g in groups}
    caps = {g: draw(st.integers(1, 15)) for g in groups if draw(st.booleans())}
    last = {g: draw(st.integers(0, 100)) for g in groups if draw(st.booleans())}
    free = draw(st.integers(0, 40))
    return free, ready, weights, in_flight, caps, last


def _room(g, ready, in_flight, caps):
    cap = caps.get(g)
    return max(0, ready[g] if cap is None else min(ready[g], cap - in_flight[g]))


def _alloc(s):
    free, ready, weights, in_flight, caps, last = s
    return jobq.allocate(free, ready, weights=weights, in_flight=in_flight, caps=caps, last_start=last)


@given(situations())
def test_bounded_by_free_ready_and_caps(s) -> None:
    """allocate never hands out more than the free slots, and gives each group it chooses at least
    one and at most what it has ready within its cap."""
    free, ready, weights, in_flight, caps, last = s
    out = _alloc(s)
    assert sum(out.values()) <= free
    for g, n in out.items():
        assert 1 <= n <= _room(g, ready, in_flight, caps)


@given(situations())
def test_work_conserving(s) -> None:
    """If there are at least `free` claimable jobs, exactly `free` are chosen."""
    free, ready, weights, in_flight, caps, last = s
    claimable = sum(_room(g, ready, in_flight, caps) for g in ready)
    assert sum(_alloc(s).values()) == min(free, claimable)


def _idle(ready, in_flight, caps):
    return [g for g in ready if _room(g, ready, in_flight, caps) > 0 and in_flight[g] == 0]


@given(situations())
def test_every_idle_group_gets_a_slot_when_there_are_enough(s) -> None:
    """A group with ready work and nothing in flight is never left out when slots suffice."""
    free, ready, weights, in_flight, caps, last = s
    idle = _idle(ready, in_flight, caps)
    out = _alloc(s)
    if free >= len(idle):
        assert set(idle) <= set(out)


@given(situations())
def test_scarce_slots_go_to_idle_groups_in_turn(s) -> None:
    """Fewer slots than idle groups: only idle groups are served, the most overdue first
    (never-started, then oldest last start), so none waits more than G - 1 grants."""
    free, ready, weights, in_flight, caps, last = s
    idle = _idle(ready, in_flight, caps)
    out = _alloc(s)
    if not 0 < free < len(idle):
        return
    turn = lambda g: (0, g) if g not in last else (1, last[g], g)  # noqa: E731
    assert set(out) <= set(idle)
    assert sorted(out, key=turn) == sorted(idle, key=turn)[:free]


@given(situations())
def test_max_min_fair_up_to_one_slot(s) -> None:
    """Counting in-flight work, no slot could move from a group to another that can still use
    it and make the split fairer by more than rounding: for g holding an extra slot and h with
    room left, g's level without that slot is at most h's level with one more."""
    free, ready, weights, in_flight, caps, last = s
    out = _alloc(s)
    active = [g for g in ready if _room(g, ready, in_flight, caps) > 0]
    if free < len(_idle(ready, in_flight, caps)):
        return
    for g, xg in out.items():
        if xg == 1 and in_flight[g] == 0:
            continue  # an idle group's guaranteed slot is not the water-filling's to move
        for h in active:
            xh = out.get(h, 0)
            if h == g or xh >= _room(h, ready, in_flight, caps):
                continue
            assert (in_flight[g] + xg - 1) / weights[g] <= (in_flight[h] + xh + 1) / weights[h] + 1e-9


@given(situations(), st.randoms())
def test_deterministic_whatever_the_input_order(s, rnd) -> None:
    """allocate's answer depends on its inputs only: not on the order of the ready mapping, and the
    same when asked twice."""
    free, ready, weights, in_flight, caps, last = s
    keys = list(ready)
    rnd.shuffle(keys)
    shuffled = {k: ready[k] for k in keys}
    assert _alloc(s) == jobq.allocate(free, shuffled, weights=weights, in_flight=in_flight, caps=caps, last_start=last)
    assert _alloc(s) == _alloc(s)


def test_proportional_split_counts_in_flight_work() -> None:
    """Weights 3:1 over 8 slots with the light group already running 2: the heavy group gets
    all 6 free slots (6:2 is 3:1). Splitting only the free slots (the seed's rule) would give
    light 1 or 2 more and let it drift above its share."""
    assert jobq.allocate(6, {"heavy": 50, "light": 50}, weights={"heavy": 3, "light": 1},
                         in_flight={"light": 2}) == {"heavy": 6}
    assert jobq.allocate(8, {"heavy": 50, "light": 50}, weights={"heavy": 3, "light": 1}) == {"heavy": 6, "light": 2}
    assert jobq.allocate(4, {"a": 10, "b": 1}, weights={"a": 1, "b": 1}) == {"a": 3, "b": 1}  # b cannot use more


def test_fair_share_returns_the_oldest_jobs_of_each_group() -> None:
    """fair_share picks each group's oldest candidates within its share (2:1 over 3 slots: a1, a2,
    b1), nothing for 0 slots, and every candidate when slots are plentiful."""
    cands = {"a": ["a1", "a2", "a3"], "b": ["b1", "b2"]}
    assert jobq.fair_share(cands, 3, weights={"a": 2, "b": 1}) == ["a1", "a2", "b1"]
    assert jobq.fair_share(cands, 0) == []
    assert math.isclose(sum(1 for _ in jobq.fair_share(cands, 99)), 5)

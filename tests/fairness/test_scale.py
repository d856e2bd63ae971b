"""Fair share at thousands of groups (issue 14): the database claim ranks only a window of the
groups with ready work (as many as it may fill slots, after a cursor that cycles through the
group keys: jobq._GroupScan, whose choice is jobq._claim_window), so its cost follows the slots,
not the groups. Pure tick simulations, no database.

Stated guarantees checked here:
  * starvation freedom: with G backlogged groups and S slots, a group with nothing in flight
    is passed over by at most G - 1 + S slot grants (about G / S claims of S slots each);
  * with no more groups than free slots the window is every group: the claim is unchanged;
  * a weight changed at run time (set_group) converges to its new share.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim import claim_window, simulate


def _load(n: int, seed: int, max_duration: int) -> tuple[dict[str, int], dict[str, int]]:
    rnd = random.Random(seed)
    groups = [f"t{i:05d}" for i in range(n)]
    return {g: rnd.randint(1, 5) for g in groups}, {g: rnd.randint(1, max_duration) for g in groups}


def _check_wait_bound(n: int, slots: int, seed: int, longest: int) -> None:
    weights, durations = _load(n, seed, longest)
    ticks = 2 * (n // slots + 2) * longest
    res = simulate(weights, durations, slots, ticks=ticks, window=True)
    assert max(res.max_idle_wait.values()) <= n - 1 + slots, max(res.max_idle_wait.values())
    assert min(res.slot_time.values()) > 0  # every group ran


@settings(max_examples=4, deadline=None)
@given(st.integers(300, 1200), st.integers(16, 96), st.integers(0, 10**6), st.integers(1, 3))
def test_no_group_waits_more_than_g_minus_1_plus_s_grants_at_thousands_of_groups(n, slots, seed, longest) -> None:
    _check_wait_bound(n, slots, seed, longest)


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(st.integers(2000, 10000), st.integers(4, 128), st.integers(0, 10**6), st.integers(1, 4))
def test_no_group_waits_more_than_g_minus_1_plus_s_grants_soak(n, slots, seed, longest) -> None:
    _check_wait_bound(n, slots, seed, longest)


def _never_advances(groups, cursor, size):
    """BROKEN: a window that always starts from the first group (no cursor)."""
    return list(groups[:size]), ""


def test_the_simulation_catches_a_window_that_never_moves() -> None:
    """Without the cursor the claim would rank the first S groups forever: the rest starve."""
    weights, durations = _load(600, 1, 1)
    broken = simulate(weights, durations, 32, ticks=60, window=True, claim_window=_never_advances)
    assert sum(1 for v in broken.slot_time.values() if v == 0) > 500
    fair = simulate(weights, durations, 32, ticks=60, window=True)
    assert min(fair.slot_time.values()) > 0


@settings(max_examples=40)
@given(st.lists(st.text("abc", min_size=1, max_size=3), unique=True, max_size=8), st.text("abc", max_size=3),
       st.integers(1, 12))
def test_with_no_more_groups_than_free_slots_the_window_is_every_group(groups, cursor, free) -> None:
    """The claim's window drops no group when the free slots cover the groups (the claim is then
    the weighted fair share over all of them, as before), and never holds more than ``free``."""
    window, _ = claim_window(sorted(groups), cursor, free)
    window = sorted(window)  # the window in key order (the claim takes it in cycle order)
    assert len(window) == min(free, len(groups))
    if len(groups) <= free:
        assert window == sorted(groups)


def test_a_weight_changed_at_run_time_converges_to_its_new_share() -> None:
    """1:1 for 300 ticks, then set_group makes it 3:1: over the next 300 ticks the heavy group's
    share of slot-time is within 0.1 of 75%, also when the light group's jobs run 3x longer."""
    for durations in ({"heavy": 2, "light": 2}, {"heavy": 1, "light": 3}):
        weights = {"heavy": 1, "light": 1}
        first = simulate(weights, durations, 16, 300, window=True, reweigh={200: {"heavy": 3}})
        both = simulate(weights, durations, 16, 600, window=True, reweigh={200: {"heavy": 3}})
        heavy = both.slot_time["heavy"] - first.slot_time["heavy"]
        light = both.slot_time["light"] - first.slot_time["light"]
        assert abs(heavy / (heavy + light) - 0.75) <= 0.1, (durations, heavy, light)

"""The benchmark's verdicts: each throughput target met or not, from the run's own medians, and
what each guarantee costs (bench/throughput.py, bench/guarantees.py, printed by bench/bench.py)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
from types import ModuleType

import pytest

from dbs import only

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def throughput(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import throughput as module

    return module


def _cells(lines: list[str], label: str) -> list[str]:
    row = next(line for line in lines if line.startswith(f"| {label} |"))
    return [c.strip() for c in row.strip("|").split("|")][1:]


def test_each_target_is_met_exactly_at_its_bound_and_missed_just_past_it(throughput: ModuleType) -> None:
    # Medians of three runs: (jobs/s, client CPU µs a job). PGQueuer tuned does 1,000 jobs/s.
    res = {
        ("ceiling", 1): [(2000.0, 10.0)] * 3, ("ceiling", 2): [(2000.0, 10.0)] * 3, ("ceiling", 4): [(2000.0, 10.0)] * 3,
        ("pgqueuer-tuned", 1): [(1000.0, 50.0)] * 3, ("pgqueuer-tuned", 2): [(1000.0, 50.0)] * 3,
        ("pgqueuer-tuned", 4): [(1000.0, 50.0)] * 3,
        ("jobq", 1): [(1499.0, 30.0), (1490.0, 30.5), (1400.0, 29.0)],  # 1.49x, 30 µs (the median)
        ("jobq", 2): [(1500.0, 30.1)] * 3,  # 1.5x, 30.1 µs
        ("jobq", 4): [(999.0, 10.0)] * 3,  # below 1.5x where it is not asked; 0.4995x the ceiling
    }
    lines = throughput.targets(res, (1, 2, 4))
    assert _cells(lines, "jobq ≥ 1.5× pgqueuer-tuned (1, 2 processes)") == [
        "1.49× **not met**", "1.50× met", "1.00× (not asked)"]
    assert _cells(lines, "(reference) ceiling / pgqueuer-tuned") == ["2.00×", "2.00×", "2.00×"]
    assert _cells(lines, "jobq ≥ 0.5× ceiling") == ["0.74× met", "0.75× met", "0.50× **not met**"]
    assert _cells(lines, "jobq ≤ 30 µs client CPU a job") == ["30 µs met", "30 µs **not met**", "10 µs met"]
    assert not any("jobq-250" in line for line in lines)  # no rows for a contender that did not run


def test_a_run_without_a_peer_or_a_figure_says_so_instead_of_judging(throughput: ModuleType) -> None:
    res = {("ceiling", 1): [(100.0, 5.0)], ("jobq", 1): [(60.0, 20.0)], ("jobq-250", 2): [(80.0, 12.0)]}
    lines = throughput.targets(res, (1, 2))
    assert not any("pgqueuer" in line for line in lines)  # SQLite, MySQL: no PGQueuer target, no reference
    assert _cells(lines, "jobq ≥ 0.5× ceiling") == ["0.60× met", "–"]
    assert _cells(lines, "jobq-250 ≥ 0.5× ceiling") == ["–", "–"]  # no ceiling figure for 2
    assert _cells(lines, "jobq-250 ≤ 30 µs client CPU a job") == ["–", "12 µs met"]


@only("sqlite")  # its own database file: the drains drop and refill jobq's tables
def test_bench_prints_the_targets_and_each_guarantees_cost(db_url: str) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench.py"), "--url", db_url, "--only", "drain,guarantees",
         "--procs", "1", "--rounds", "1", "--jobs", "200", "--contenders", "ceiling,jobq"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    # The header: what a wake-up costs here, to read the CPU column against (bench.wake_cost_us).
    assert re.search(r"a wake-up costs \d+ µs of CPU here", text.splitlines()[0]), text
    assert "Targets, this run:" in text and "| jobq ≥ 0.5× ceiling | " in text, text
    # Every variant drained (each checks its jobs done and its history rows: bench/guarantees.py).
    for variant in ("ceiling", "shipped", "inline", "nohist", "nodag", "nocap", "none", "none+inline"):
        assert f"| {variant} | " in text, text

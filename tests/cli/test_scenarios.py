"""Scenarios are documentation that runs: each one completes and prints what it promises,
on SQLite and on PostgreSQL."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from dbs import only

ROOT = pathlib.Path(__file__).resolve().parents[2]

EXPECT = {
    "quickstart.py": ["all done"],
    "async_crawl.py": ["exists: False", "task cancelled (timed_out)", "attempts=2", "peak concurrency 3 (cap 3); done=6"],
    "tenants.py": ["final slot-time shares", "'done': 260", "suspended tenant's slot-time while paused: 0.00s"],
    "crash_recover.py": ["killing worker A", "is done, attempts=2", "its current error: None",
                          ": reclaimed (lease expired on attempt 1", ": done"],
    "pipeline_listen.py": ["20 hops in"],
    "checkpoint_resume.py": ["kill -9 worker A", "starting from checkpoint", "is done, attempts=2", "rows': 8000"],
    "crawl_spawn.py": ["then failed (attempt 1): they are discarded", "crawl container: done; 12 page jobs in it",
                       "fetched once each: True", "report: done"],
    "pydantic_boundary.py": ["refused at enqueue", "InvoiceResult(invoice_no=", ": failed; first line of the error: ValidationError"],
}


@only("sqlite", "postgresql")  # the scripts hold no engine code: PostgreSQL shows LISTEN, SQLite the poll
@pytest.mark.parametrize("script", sorted(EXPECT))
def test_scenario_runs_to_completion(db_url: str, dialect: str, script: str) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scenarios" / script), "--url", db_url],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    for needle in EXPECT[script]:
        assert needle in out.stdout, out.stdout
    if script == "pipeline_listen.py":
        assert ("LISTEN/NOTIFY" in out.stdout) == (dialect == "postgresql")

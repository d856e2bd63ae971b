"""Scenarios are documentation that runs: each one completes on every engine and ends with a
one-line verdict of what its docstring promises; a scenario that needs an extra says so in one
line and exits 2."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

EXPECT = {  # besides the verdict: lines the reader is told to look for
    "quickstart.py": ["attempt 1 fails", "part 2 (attempt 2)"],
    "async_crawl.py": ["exists: False", "task cancelled (timed_out)", "attempts=2", "peak concurrency 3 (cap 3); done=6"],
    "tenants.py": ["policy: noisy: weight 1, cap 1", "suspended tenant's starts while paused: 0"],
    "crash_recover.py": ["killing worker A", "is done, attempts=2", "its current error: None",
                          ": reclaimed (lease expired on attempt 1", ": done"],
    "pipeline_listen.py": ["6 requests of 3 stages: 18 jobs done"],
    "checkpoint_resume.py": ["kill -9 worker A", "starting from checkpoint", "is done, attempts=2", "rows': 8000"],
    "crawl_spawn.py": ["then failed (attempt 1): they are discarded", "crawl container: done; 12 page jobs in it",
                       "fetched once each: True", "report: done"],
    "order_payment.py": ["is waiting for signal 'paid-1' since", "report: ran while the orders waited",
                         "order 2: no payment within", "order 2: charge failed, ship failed"],
    "pydantic_boundary.py": ["refused at enqueue", "InvoiceResult(invoice_no=", ": failed; first line of the error: ValidationError"],
}
EXTRAS = {"async_crawl.py": ("aiosqlite", "pip install 'jobq[asyncio]'"),
          "pydantic_boundary.py": ("pydantic", "pip install 'pydantic>=2'")}


def run(script: str, *args: str, block: str | None = None) -> subprocess.CompletedProcess[str]:
    path = str(ROOT / "scenarios" / script)
    if block is None:
        cmd = [sys.executable, path, *args]
    else:  # the module cannot be imported, as in a venv without the extra
        code = (f"import runpy, sys; sys.modules[{block!r}] = None; sys.argv = [{path!r}, *{list(args)!r}]; "
                f"runpy.run_path({path!r}, run_name='__main__')")
        cmd = [sys.executable, "-c", code]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_every_scenario_is_checked() -> None:
    assert sorted(EXPECT) == sorted(p.name for p in (ROOT / "scenarios").glob("*.py"))


@pytest.mark.parametrize("script", sorted(EXPECT))
def test_scenario_shows_what_it_promises(db_url: str, dialect: str, script: str) -> None:
    out = run(script, "--url", db_url)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    verdict = out.stdout.rstrip().splitlines()[-1]
    assert verdict.startswith("verdict: OK: "), out.stdout
    for needle in EXPECT[script]:
        assert needle in out.stdout, out.stdout
    if script == "tenants.py":
        # Whole slots: enterprise (weight 3) and free-tier (weight 1) share 8, so 6 and 2; the share
        # of slot-time may be off by half a slot (1/16) as a freed slot waits for the next claim.
        share = float(re.search(r"had (\d+\.\d)% of the slot-time", verdict).group(1)) / 100  # type: ignore[union-attr]
        assert abs(share - 0.75) <= 1 / 16, verdict
        assert "noisy peak 1 (cap 1); suspended started 0 while paused, 10 in all" in verdict
    if script == "pipeline_listen.py":
        assert ("LISTEN/NOTIFY woke the idle worker" in verdict) == (dialect == "postgresql"), verdict
    if script == "checkpoint_resume.py":
        assert "resumed at partition 3 of 8 (the last checkpoint before the kill said 3)" in verdict


@pytest.mark.parametrize("script", sorted(EXTRAS))
def test_scenario_without_its_extra_says_which_and_exits_2(script: str) -> None:
    module, hint = EXTRAS[script]
    out = run(script, block=module)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and hint in out.stderr, out.stderr
    assert "Traceback" not in out.stderr + out.stdout

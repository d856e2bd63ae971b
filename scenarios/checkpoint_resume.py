"""Checkpoint and resume: a long job saves its place after every step; its worker process is
killed with SIGKILL (kill -9) mid-job; the next worker reclaims the job and carries on from the
last checkpoint instead of starting over.

What this shows:
    * ctx.checkpoint(state): durable now (one short transaction), fenced by the lease;
    * ctx.state: what a rerun resumes from (None on a fresh job);
    * ctx.progress(done, total): carried by the heartbeat, shown by get(), jobq status and why;
    * the cost: steps done before the last checkpoint are never redone.

It ends with a verdict line naming the partition the second attempt resumed at (exit status 1
if it did not resume at the last checkpoint).

Run:
    python scenarios/checkpoint_resume.py                      # SQLite file in a temp directory
    python scenarios/checkpoint_resume.py --url postgresql+psycopg://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

import jobq

LEASE_TTL = 2.0
PARTITIONS = 8


def export(ctx: jobq.JobContext) -> dict:
    """Export partitions one by one; remember the next partition and a running total."""
    state = ctx.state or {"next": 0, "rows": 0}
    first = state["next"]
    where = "from the start" if ctx.state is None else f"from checkpoint {state}"
    print(f"  [pid {os.getpid()}] job {ctx.id} attempt {ctx.attempt}: starting {where}", flush=True)
    for part in range(state["next"], PARTITIONS):
        if ctx.attempt == 1 and part == 3:
            ctx.wait(60)  # this demo's kill -9 lands here, mid-job, however slow the machine
        ctx.wait(0.15)  # the work of one partition
        state = {"next": part + 1, "rows": state["rows"] + 1000}
        ctx.progress(part + 1, PARTITIONS, f"partition {part} exported")  # carried by the checkpoint below
        ctx.checkpoint(state)
        print(f"  [pid {os.getpid()}] exported partition {part}, checkpoint {state}", flush=True)
    return {"rows": state["rows"], "first_partition": first, "attempt": ctx.attempt}


def run_worker(url: str) -> None:
    engine = sa.create_engine(url)
    jobq.Worker(engine, {"export": export}, max_concurrency=1, lease_ttl=LEASE_TTL, poll_interval=0.1).run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="database URL (default: a fresh SQLite file)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    url = ns.url or f"sqlite:///{os.path.join(tempfile.mkdtemp(prefix='jobq-'), 'resume.db')}"
    if ns.worker:
        return run_worker(url)
    engine = sa.create_engine(url)
    jobq.create_schema(engine)
    jid = jobq.enqueue(engine, "export", max_attempts=3)
    print(f"enqueued job {jid} ({PARTITIONS} partitions); starting worker A in its own process")
    a = subprocess.Popen([sys.executable, __file__, "--worker", "--url", url])
    while ((jobq.get(engine, jid).checkpoint or {}).get("next", 0)) < 3:  # type: ignore[union-attr]
        time.sleep(0.05)
    print(f"kill -9 worker A (pid {a.pid}) after checkpoint {jobq.get(engine, jid).checkpoint}")  # type: ignore[union-attr]
    a.send_signal(signal.SIGKILL)
    a.wait()
    saved = jobq.get(engine, jid).checkpoint  # type: ignore[union-attr]
    print(f"why: {jobq.why(engine, jid)}")
    print("starting worker B; it reclaims the job once the lease expires and resumes")
    b = jobq.Worker(engine, {"export": export}, max_concurrency=1, lease_ttl=LEASE_TTL, poll_interval=0.1)
    b.run_until_idle(timeout=60)
    info = jobq.get(engine, jid)
    assert info is not None
    print(f"job {jid} is {info.state}, attempts={info.attempts}, result={info.result}")
    print(f"final checkpoint {info.checkpoint}; progress {info.progress}")
    result = info.result or {}
    ok = (info.state == "done" and info.attempts == 2 and result.get("first_partition") == saved["next"]
          and result.get("rows") == PARTITIONS * 1000)
    print(f"verdict: {'OK' if ok else 'NOT SHOWN'}: attempt {result.get('attempt')} resumed at partition "
          f"{result.get('first_partition')} of {PARTITIONS} (the last checkpoint before the kill said "
          f"{saved['next']}), so partitions 0-{saved['next'] - 1} were not redone; {result.get('rows')} rows")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

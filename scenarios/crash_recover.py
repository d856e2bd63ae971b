"""Crash and recover: a worker process is SIGKILLed mid-job; another worker reclaims the job when
its lease expires and finishes it, once.

What this shows:
    * leases and heartbeats: a dead worker's job is not lost, it is reclaimed after lease_ttl;
    * the attempt count (2) and the attempt history: the reclaimed attempt keeps its error,
      while the finished job has none (``jobq.attempts``, ``jobq show``);
    * at-least-once: the handler ran twice, the result was written once.

It ends with a verdict line (exit status 1 if the run did not show it).

Run:
    python scenarios/crash_recover.py                      # SQLite file in a temp directory
    python scenarios/crash_recover.py --url postgresql+psycopg://postgres@127.0.0.1/test
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


def slow_report(ctx: jobq.JobContext) -> dict:
    print(f"  [pid {os.getpid()}] job {ctx.id} attempt {ctx.attempt}: working...", flush=True)
    ctx.wait(60.0 if ctx.attempt == 1 else 0.2)  # the first attempt is killed long before it ends
    return {"report": "ok", "by_pid": os.getpid(), "attempt": ctx.attempt}


def run_worker(url: str) -> None:
    engine = sa.create_engine(url)
    jobq.Worker(engine, {"report": slow_report}, max_concurrency=1, lease_ttl=LEASE_TTL, poll_interval=0.1).run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="database URL (default: a fresh SQLite file)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    url = ns.url or f"sqlite:///{os.path.join(tempfile.mkdtemp(prefix='jobq-'), 'crash.db')}"
    if ns.worker:
        return run_worker(url)
    engine = sa.create_engine(url)
    jobq.create_schema(engine)
    jid = jobq.enqueue(engine, "report", max_attempts=3)
    print(f"enqueued job {jid}; starting worker A in its own process")
    a = subprocess.Popen([sys.executable, __file__, "--worker", "--url", url])
    while jobq.get(engine, jid).state != "running":  # type: ignore[union-attr]
        time.sleep(0.05)
    time.sleep(0.5)
    print(f"killing worker A (pid {a.pid}) with SIGKILL while it holds job {jid}")
    a.send_signal(signal.SIGKILL)
    a.wait()
    info = jobq.get(engine, jid)
    print(f"job {jid} is still '{info.state}', leased by a dead worker until {info.lease_expires} (UTC)")  # type: ignore[union-attr]
    print("starting worker B; it reclaims the job once the lease expires")
    t0 = time.monotonic()
    b = jobq.Worker(engine, {"report": slow_report}, max_concurrency=1, lease_ttl=LEASE_TTL, poll_interval=0.1)
    b.run_until_idle(timeout=30)
    info = jobq.get(engine, jid)
    assert info is not None
    print(f"after {time.monotonic() - t0:.1f}s: job {jid} is {info.state}, attempts={info.attempts}, result={info.result}")
    print(f"its current error: {info.error}")
    outcomes = []
    for att in jobq.attempts(engine, jid):
        outcomes.append(att.outcome)
        print(f"attempt {att.attempt} by {att.worker_id}: {att.outcome}" + (f" ({att.error})" if att.error else ""))
    ok = info.state == "done" and info.attempts == 2 and outcomes == ["reclaimed", "done"] and info.error is None
    print(f"verdict: {'OK' if ok else 'NOT SHOWN'}: the job held by the killed worker was reclaimed after its lease "
          f"expired and finished by worker B: {info.state}, attempts {' then '.join(outcomes)}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
